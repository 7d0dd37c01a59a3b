"""Tensor parallelism (with sequence parallelism) on gloo ranks equals the single process.

A dense recipe (core's sdpa attention and SwiGLU FFN, the vocabulary split over ranks) trains two optimizer
steps under tp=2 and must log the same loss, tokens, gradient norm and metrics and reach the same weights as
one process (fp32, 1e-5 relative). Its checkpoint, written per tensor-parallel block, resumes in one process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("megatron.core", reason="needs the distributed extra: pip install 'megaseq-core[distributed]'")

from megaseq.distributed.layout import Layout
from megaseq.testing.distributed import run_gloo
from megaseq.testing.layouts import assert_same_run, single_trainer, train_single, train_under_layouts

RTOL = 1e-5

DENSE: dict[str, Any] = {
    "run": {"name": "dense", "device": "cpu"},
    "data": {"train": "excerpt-chr20", "heldout": "excerpt-chrX", "seq_len": 96},
    "model": {"d_model": 32, "n_layers": 2, "layer_pattern": ["sdpa"], "vocab_size": 6, "tie_embeddings": False},
    "attention": {"sdpa": {"n_heads": 4}},
    "ffn": {"swiglu": {"hidden": 64}},
    "train": {"steps": 3, "batch_size": 2, "warmup_steps": 1, "log_every": 1, "loss_chunk": 64},
    "eval": {"windows": 2, "batch_size": 2, "markov_order": 2},
}


@pytest.fixture(autouse=True, scope="module")
def cache_dir(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MEGASEQ_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield


def test_tp2_equals_one_process_and_its_checkpoint_resumes_on_one(tmp_path):
    trainer = single_trainer(DENSE, tmp_path / "single")
    first_two, third = train_single(trainer, 2), train_single(trainer, 1)
    layouts = [Layout(tp=2)]
    ranks = run_gloo(2, train_under_layouts, DENSE, layouts, str(tmp_path), 2, True)
    assert_same_run(ranks[0][0], first_two, RTOL, "tp=2")

    saved = Path(ranks[0][0]["checkpoint"])
    assert sorted(p.name for p in (saved / "tensor").iterdir()) == ["tp0.pt", "tp0.safetensors", "tp1.pt", "tp1.safetensors"]
    resumed = single_trainer(DENSE, saved.parents[1])
    assert resumed.resume() and resumed.step == 2
    assert_same_run(train_single(resumed, 1), third, RTOL, "tp=2 checkpoint resumed with tp=1")
