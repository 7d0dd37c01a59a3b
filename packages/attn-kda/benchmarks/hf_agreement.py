"""Logit agreement of an imported fla KDA model with fla's own (docs/results.md, megaseq-attn-kda).

Builds the random fla models of ``tests/test_hf.py`` (its helpers: fla's kernels swapped for its reference ops
on CPU), imports each with ``megaseq import`` and prints max |megaseq - fla| / max |fla| over the logits of
two plain rows of 37 tokens and of one packed row of four documents (13, 1, 70, 7 tokens) against fla on each
document alone. Needs the package's ``hf`` extra.
"""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path

import torch

from megaseq.cli import main
from megaseq.contracts import ForwardContext

HERE = Path(__file__).resolve().parent
spec = importlib.util.spec_from_file_location("test_hf", HERE.parent / "tests" / "test_hf.py")
t = importlib.util.module_from_spec(spec)
spec.loader.exec_module(t)

VARIANTS = {"softplus gate, untied head": {}, "bounded gate, tied head": {"lower_bound": -5.0, "tie": True},
            "softplus, fla softmax layer 1": {"softmax_layers": (1,)}}


def main_() -> None:
    print("| model (3 layers, d 32, 2 KDA heads of 8) | plain rows | packed row |\n|---|---|---|")
    for name, options in VARIANTS.items():
        directory = Path(tempfile.mkdtemp())
        fla = t.fla_model(directory / "fla", layers=3, **options)
        assert main(["import", str(directory / "fla"), "--out", str(directory / "imported")]) == 0
        _, model = t.load_import(directory / "imported")
        torch.manual_seed(1)
        tokens = torch.randint(0, len(t.VOCAB), (2, 37))
        plain = t.relative(t.megaseq_logits(model, tokens), t.fla_logits(fla, tokens))
        lengths = [13, 1, 70, 7]
        row = torch.randint(0, len(t.VOCAB), (1, sum(lengths)))
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        packed = t.relative(t.megaseq_logits(model, row, ForwardContext(cu_seqlens=cu)),
                            torch.cat([t.fla_logits(fla, doc) for doc in row.split(lengths, 1)], 1))
        print(f"| {name} | {plain:.1e} | {packed:.1e} |", flush=True)


if __name__ == "__main__":
    main_()
