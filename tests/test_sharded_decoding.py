"""Decoding on the sharded model (``megaseq.inference.cached``) equals the one-process engine.

The hybrid recipe (kda, kda, kda, dsa; a dense first layer, then chunked MoE) at tiny width, built inside gloo
workers with the process groups training creates, under tp=2 (heads, widths and vocabulary split, tensor
parallelism without sequence parallelism), dp=2 x ep=2 (the batch's rows split over the replicas, the experts
over the ranks) and tp=2 x ep=2 (the tensor-parallel ranks share the experts). Every rank generates the same
tokens, log-probabilities, masks and MoE routing as one process, greedily and sampled with a seed (3 prompts:
the dp=2 split pads a row), and scores the same (fp32, 1e-5 relative); no rank gathers experts or
tensor-parallel blocks, and each holds at most its share of every split tensor (plus the vocabulary's padding).
A sharded engine takes the whole model's weights (``update_weights``) and reads a checkpoint written by one
process as its blocks. A layout the engine cannot run (context parallelism) is one line before any worker.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs the distributed extra: pip install 'megaseq-core[distributed]'")

from megaseq.builtins.config import CachedEngineConfig
from megaseq.config import validate_recipe
from megaseq.distributed.layout import Layout
from megaseq.errors import UserError
from megaseq.inference import SamplingParams
from megaseq.inference.cached import CachedEngine, check_decoding_layout, sharded_engine
from megaseq_testkit import assert_close, installed_plugins
from megaseq_testkit.distributed import run_gloo

pytestmark = pytest.mark.usefixtures("module_cache")  # tests/conftest.py

RTOL = 1e-5
SEED = 7
CONFIG = CachedEngineConfig(device="cpu", dtype="fp32")
PARAMS = [SamplingParams(max_new_tokens=4, temperature=0.0),
          SamplingParams(max_new_tokens=4, temperature=0.9, top_p=0.95, seed=3)]
LAYOUTS = [Layout(tp=2), Layout(dp=2, ep=2), Layout(tp=2, ep=2)]
SLACK = 1024  # bytes: the vocabulary's padding rows (5 ids in blocks of 3) in the embedding and the head


def _prompts(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (3, 7), generator=torch.Generator().manual_seed(0))


def _decode(engine: CachedEngine, prompts: torch.Tensor) -> dict[str, Any]:
    """What the engine generates (greedy, sampled) and scores, and the bytes of its parameters."""
    out: dict[str, Any] = {"generations": []}
    for params in PARAMS:
        g = engine.generate(prompts, params)
        out["generations"].append({"tokens": g.tokens, "logprobs": g.logprobs, "mask": g.mask, "routing": g.routing})
    scored = torch.cat([prompts, out["generations"][0]["tokens"]], 1)
    out["scores"] = [engine.score(scored), engine.score(scored, temperature=0.7)]
    out["parameter_bytes"] = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    return out


def _one_process(raw: dict[str, Any], checkpoint: Path | None = None) -> CachedEngine:
    torch.manual_seed(SEED)
    return CachedEngine(CONFIG, validate_recipe(raw, installed_plugins()), installed_plugins(), checkpoint=checkpoint)


def _sharded(rank: int, world: int, raw: dict[str, Any], layouts: list[Layout], weights: dict, checkpoint: str) -> list:
    """Under each layout: decoding from the recipe's initial weights, then from ``weights`` (the whole model's,
    handed over), then from ``checkpoint``; gathering a whole model is refused."""
    from megaseq.distributed.groups import Parallel

    def refuse(*args, **kwargs):
        raise AssertionError("decoding gathered experts or tensor-parallel blocks onto one rank")

    Parallel.gather_experts = Parallel.gather_tensor_parallel = refuse
    recipe, plugins = validate_recipe(raw, installed_plugins()), installed_plugins()
    prompts = _prompts(recipe.model.vocab_size)
    results = []
    for layout in layouts:
        torch.manual_seed(SEED)
        with sharded_engine(CONFIG, recipe, plugins, layout) as engine:
            initial = _decode(engine, prompts)
            engine.update_weights(weights)
            updated = _decode(engine, prompts)
            split = {name: [stop - start for start, stop in slices] for name, slices in engine.placement.slices.items()}
        with sharded_engine(CONFIG, recipe, plugins, layout, Path(checkpoint)) as engine:
            loaded = _decode(engine, prompts)
        results.append({"initial": initial, "updated": updated, "loaded": loaded, "split": split})
    return results


def _assert_same(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    for i, (g, w) in enumerate(zip(got["generations"], want["generations"], strict=True)):
        label = f"{what} {'greedy' if PARAMS[i].temperature == 0 else 'sampled'}"
        assert torch.equal(g["tokens"], w["tokens"]), f"{label}: tokens {g['tokens'].tolist()} != {w['tokens'].tolist()}"
        assert torch.equal(g["mask"], w["mask"]), f"{label}: masks differ"
        assert_close(g["logprobs"], w["logprobs"], RTOL, f"{label}: logprobs")
        assert g["routing"].keys() == w["routing"].keys(), f"{label}: routed layers differ"
        for key, indices in w["routing"].items():
            assert torch.equal(g["routing"][key], indices), f"{label}: routing of {key} differs"
    for t, (g, w) in enumerate(zip(got["scores"], want["scores"], strict=True)):
        assert_close(g, w, RTOL, f"{what}: score {t}")


def _share_bound(whole: dict[str, torch.Tensor], split: dict[str, list[int]]) -> int:
    """The most parameter bytes a rank may hold: every split tensor's whole bytes over the number of blocks the
    layout cuts it into, every other tensor whole, plus ``SLACK``."""
    total = 0
    for name, t in whole.items():
        blocks = math.prod(-(-a // b) for a, b in zip(t.shape, split[name], strict=True)) if name in split else 1
        total += t.numel() * t.element_size() // blocks
    return total + SLACK


@pytest.mark.slow
def test_sharded_decoding_equals_one_process_and_holds_only_its_shards(hybrid, tmp_path, capsys):
    from megaseq_testkit.layouts import single_trainer

    trainer = single_trainer(hybrid, tmp_path / "trained")  # trained weights: what update_weights and a checkpoint carry
    trainer.train_step()
    checkpoint = trainer.save()
    weights = {name: t.detach().clone() for name, t in trainer.model.state_dict().items()}

    engine = _one_process(hybrid)
    prompts = _prompts(engine.vocab_size)
    expected = {"initial": _decode(engine, prompts)}
    engine.update_weights(weights)
    expected["updated"] = _decode(engine, prompts)
    expected["loaded"] = _decode(_one_process(hybrid, checkpoint), prompts)
    # the trained weights decode differently from the initial ones: handing them over is seen
    assert not torch.allclose(expected["updated"]["scores"][0], expected["initial"]["scores"][0])
    whole = dict(engine.model.named_parameters())

    ranks = run_gloo(2, _sharded, hybrid, LAYOUTS, weights, str(checkpoint))
    lines = [f"decoding engine parameter bytes: one process {expected['initial']['parameter_bytes']} B"]
    lines += [f"  {layout}: " + ", ".join(f"rank {r} {results[i]['initial']['parameter_bytes']} B"
                                           for r, results in enumerate(ranks)) for i, layout in enumerate(LAYOUTS)]
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    for i, layout in enumerate(LAYOUTS):
        for rank, results in enumerate(ranks):
            got = results[i]
            for which in ("initial", "updated", "loaded"):
                _assert_same(got[which], expected[which], f"{layout} rank {rank} ({which} weights)")
            bound = _share_bound(whole, got["split"])
            assert got["initial"]["parameter_bytes"] <= bound, (layout, rank, got["initial"]["parameter_bytes"], bound)
            # the bound catches an engine that holds the whole model
            assert expected["initial"]["parameter_bytes"] > bound, (layout, expected["initial"]["parameter_bytes"], bound)


def test_context_parallel_decoding_is_refused_in_one_line(hybrid):
    recipe = validate_recipe(hybrid, installed_plugins())
    with pytest.raises(UserError) as raised:
        check_decoding_layout(recipe, installed_plugins(), Layout(cp=2))
    message = str(raised.value)
    assert "the cached engine decodes without context parallelism" in message and "use cp=1" in message
    assert "\n" not in message
