"""ZeRO-1 and the host optimizer under data parallelism equal one process with torch.optim.AdamW.

Two gloo ranks (dp=2) train with the optimizer state sharded (``train.optimizer_shard``), in device memory and
in host memory (``train.optimizer_state = "host"``), and must reach the weights of two ranks with the default
optimizer (fp32, 1e-6 relative), and one process sharding its state those of one process without. The sharded
checkpoint (``optimizer/rank{r}.pt``) resumes in one process without sharding, and a one-process sharded
checkpoint resumes on two sharded ranks: both continue where the one-process run is.

Across layouts (dp=2 against one process) the tolerance is the distributed tests' 1e-5: the two ranks' gradient
sum rounds differently from one process's batch, and Adam's first steps divide each gradient element by its own
magnitude, so an element whose gradient is near Adam's eps turns that rounding into a weight difference
(2.1e-6 on ``blocks.1.ffn.w1`` on an AMD EPYC, with and without sharding alike). A sharding fault moves
weights by about the learning rate (3e-3).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs the distributed extra: pip install 'megaseq-core[distributed]'")

from megaseq.distributed.layout import Layout
from megaseq_testkit.distributed import run_gloo
from megaseq_testkit.layouts import (
    assert_same_run,
    resume_under_layout,
    single_trainer,
    train_single,
    train_under_layouts,
)

pytestmark = pytest.mark.usefixtures("module_cache")  # tests/conftest.py

RTOL = 1e-6  # the same layout, with and without sharding
DP_RTOL = 1e-5  # dp=2 against one process (module docstring)
TINY = {
    "run": {"name": "t", "device": "cpu"},
    "data": {"train": "excerpt-chr20", "heldout": "excerpt-chrX", "seq_len": 64},
    "model": {"d_model": 16, "n_layers": 2},
    "attention": {"sdpa": {"n_heads": 2}},
    "train": {"steps": 6, "batch_size": 2, "warmup_steps": 1, "log_every": 1, "loss_chunk": 50},
    "eval": {"windows": 2, "batch_size": 2},
}


def _with(**train):
    return {**TINY, "train": {**TINY["train"], **train}}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The one-process run with the default optimizer: its first two steps, then two more."""
    trainer = single_trainer(TINY, tmp_path_factory.mktemp("single"))
    return train_single(trainer, 2), train_single(trainer, 2)


@pytest.fixture(scope="module")
def unsharded_dp2(tmp_path_factory):
    """Two ranks with the default optimizer: their first two steps."""
    return run_gloo(2, train_under_layouts, TINY, [Layout(dp=2)], str(tmp_path_factory.mktemp("dp2")), 2)[0][0]


@pytest.mark.slow
@pytest.mark.parametrize("state", ["device", "host"])
def test_sharded_on_two_ranks_equals_unsharded_and_resumes_on_one_process(tmp_path, single, unsharded_dp2, state):
    first_two, next_two = single
    raw = _with(optimizer_shard=True, optimizer_state=state)
    [result] = run_gloo(2, train_under_layouts, raw, [Layout(dp=2)], str(tmp_path), 2, True)[0]
    assert_same_run(result, unsharded_dp2, RTOL, f"dp=2, optimizer_shard, {state}, against dp=2 unsharded")
    assert_same_run(result, first_two, DP_RTOL, f"dp=2, optimizer_shard, {state}, against one process")

    saved = Path(result["checkpoint"])
    assert sorted(p.name for p in (saved / "optimizer").iterdir()) == ["rank0.pt", "rank1.pt"]
    shards = [{n for g in torch.load(saved / "optimizer" / f"rank{r}.pt")["optimizer_param_names"] for n in g} for r in (0, 1)]
    assert shards[0] and shards[1] and not shards[0] & shards[1]  # each rank holds its own share of the state
    assert shards[0] | shards[1] == set(result["weights"])
    resumed = single_trainer(TINY, saved.parents[1])  # one process, whole optimizer on the device
    assert resumed.resume() and resumed.step == 2
    assert_same_run(train_single(resumed, 2), next_two, DP_RTOL, f"dp=2 sharded ({state}) resumed on one process")


@pytest.mark.slow
def test_one_process_checkpoint_resumes_sharded_on_two_ranks(tmp_path, single):
    first_two, next_two = single
    raw = _with(optimizer_shard=True)
    trainer = single_trainer(raw, tmp_path)
    assert_same_run(train_single(trainer, 2), first_two, RTOL, "one process, optimizer_shard")
    assert (trainer.save() / "optimizer" / "rank0.pt").is_file()
    ranks = run_gloo(2, resume_under_layout, raw, Layout(dp=2), str(tmp_path), 2)
    assert_same_run(ranks[0], next_two, DP_RTOL, "one-process sharded checkpoint resumed on dp=2")
