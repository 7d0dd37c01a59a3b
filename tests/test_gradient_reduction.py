"""The gradient reduction (``megaseq.distributed.gradients``) on gloo ranks against hand-made oracles.

- Sums, not means, over the right group; accumulated micro-batches reduced once, by the last one's backward.
- A parameter without gradient on some ranks gets the others' sum; one that no rank gave a gradient in the
  whole step keeps ``grad = None``, also when it is reachable through a function that returns no gradient for
  it, and also when a rank's whole set of a group's parameters got none (the anchor's case: without it
  that rank never joins the all-reduce). A rank that ran no micro-batch joins in ``finish``.
- Overlap: the first bucket's all-reduce starts before backward reaches the first layer.
- The plan's reduction buckets are the buckets a dp=2 run with gradient accumulation all-reduces.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from megaseq.distributed.gradients import GradientReduction
from megaseq.distributed.groups import Parallel
from megaseq.distributed.layout import Layout
from megaseq_testkit.distributed import run_gloo

ROOT = Path(__file__).resolve().parents[1]


class _NoGradient(torch.autograd.Function):
    """The identity on ``x`` that uses ``w`` yet hands it no gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


def _model() -> nn.ModuleDict:
    torch.manual_seed(0)
    return nn.ModuleDict({name: nn.Linear(3, 3) for name in ("a", "b", "c", "e", "w")})


def _objective(model: nn.ModuleDict, rank: int, micro: int) -> torch.Tensor:
    """Rank ``rank``'s micro-batch ``micro``: a always, b on rank 0's first micro-batch only, e (the "experts")
    on rank 0 only, w through a function that gives it no gradient, c never."""
    x = torch.arange(6.0).view(2, 3) * (rank + 1) + micro
    y = model["a"](x)
    if rank == 0 and micro == 0:
        y = y + model["b"](x).square()
    if rank == 0:
        y = y + model["e"](x).tanh()
    return _NoGradient.apply(y, model["w"].weight).sum()


def _parallel(rank: int, world: int) -> Parallel:
    import torch.distributed as dist

    return Parallel(layout=Layout(dp=world), rank=rank, dp_rank=rank, world_group=dist.group.WORLD,
                    expert_dp_group=dist.new_group(list(range(world))))


def _reduce(rank: int, world: int, micro_batches: list[int]) -> dict[str, Any]:
    model, parallel = _model(), _parallel(rank, world)
    experts = {model["e"].weight, model["e"].bias}
    reduction = GradientReduction(model, parallel, expert_params=experts)
    for _ in range(2):  # twice: the second step runs on the buckets the first one left
        for p in model.parameters():
            p.grad = None
        mine = micro_batches[rank]
        for micro in range(mine):
            objective, _ = reduction.forward(lambda micro=micro: (_objective(model, rank, micro), None), sync=micro == mine - 1)
            objective.backward()
        reduction.finish()
    return {"grads": {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
            "ddps": len(reduction.ddps), "bucket_bytes": reduction.bucket_bytes}


def _expected(micro_batches: list[int]) -> dict[str, torch.Tensor | None]:
    model = _model()
    for rank, count in enumerate(micro_batches):
        for micro in range(count):
            _objective(model, rank, micro).backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("micro_batches", [[2, 2], [2, 0]], ids=["two micro-batches each", "a rank without rows"])
def test_sums_over_ranks_and_leaves_unused_parameters_alone(micro_batches):
    expected = _expected(micro_batches)
    assert expected["c.weight"] is None and expected["w.weight"] is None and expected["b.weight"] is not None
    for rank in run_gloo(2, _reduce, micro_batches):
        assert rank["ddps"] == 2  # replicated over every rank, "experts" over their own group
        assert rank["bucket_bytes"] == 4 * 12 * 5  # every trained parameter of the five layers
        for name, want in expected.items():
            got = rank["grads"][name]
            assert (got is None) == (want is None), f"{name}: grad {got} where one process has {want}"
            if want is not None:
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=name)


def _overlap(rank: int, world: int) -> list[str]:
    from megaseq.parallel import collectives

    events: list[str] = []
    hook = collectives.sum_bucket

    def recording(group, bucket):  # unannotated, as DDP wants a hook (megaseq.parallel.collectives.sum_bucket)
        events.append("all-reduce")
        return hook(group, bucket)

    collectives.sum_bucket = recording
    try:
        torch.manual_seed(0)
        layers = nn.Sequential(*(nn.Linear(512, 512) for _ in range(3)))  # 1 MiB each: DDP's first bucket
        reduction = GradientReduction(layers, _parallel(rank, world))
    finally:
        collectives.sum_bucket = hook
    x = torch.randn(4, 512, requires_grad=True)
    x.register_hook(lambda grad: events.append("input gradient"))
    objective, _ = reduction.forward(lambda: (layers(x).square().sum(), None), sync=True)
    objective.backward()
    return events


@pytest.mark.slow
def test_buckets_are_reduced_while_backward_runs():
    for events in run_gloo(2, _overlap):
        assert "input gradient" in events and events.index("all-reduce") < events.index("input gradient"), events


TINY = {
    "run": {"name": "t", "device": "cpu"},
    "data": {"train": "excerpt-chr20", "heldout": "excerpt-chrX", "seq_len": 64},
    "model": {"d_model": 16, "n_layers": 2},
    "attention": {"sdpa": {"n_heads": 2}},
    "train": {"steps": 2, "batch_size": 2, "grad_accum": 2, "warmup_steps": 1, "loss_chunk": 50},
}


def _bucket_bytes_of_a_step(rank: int, world: int, raw: dict[str, Any], out_dir: str) -> dict[str, int]:
    from megaseq.distributed.groups import destroy_process_groups, init_process_groups
    from megaseq.memory.machine import Machine
    from megaseq.memory.plan import plan
    from megaseq.parallel import collectives
    from megaseq.train.trainer import Trainer
    from megaseq_testkit import installed_plugins
    from megaseq_testkit.layouts import _recipe

    reduced: list[int] = []
    hook = collectives.sum_bucket

    def recording(group, bucket):  # unannotated, as DDP wants a hook (megaseq.parallel.collectives.sum_bucket)
        reduced.append(bucket.buffer().numel() * bucket.buffer().element_size())
        return hook(group, bucket)

    parallel = init_process_groups(Layout(dp=world))
    collectives.sum_bucket = recording
    try:
        recipe = _recipe(raw, Layout(dp=world), out_dir)
        trainer = Trainer(recipe, installed_plugins(), parallel=parallel, progress=False, tensorboard=False)
        trainer.train_step()
        planned = plan(recipe, installed_plugins(), layout=Layout(dp=world), machine=Machine("cpu", 2**40, None),
                       policies="none").candidates[0]
        return {"reduced": sum(reduced), "planned": planned.reduction, "weights": planned.weights}
    finally:
        collectives.sum_bucket = hook
        destroy_process_groups()


@pytest.mark.slow
@pytest.mark.usefixtures("module_cache")
def test_the_plan_counts_the_buckets_a_run_reduces(tmp_path):
    pytest.importorskip("megatron.core", reason="needs the distributed extra: pip install 'megaseq-core[distributed]'")
    for rank in run_gloo(2, _bucket_bytes_of_a_step, TINY, str(tmp_path)):
        # every parameter of the dense model is replicated, so all are in the buckets (and the DDP's two scalars,
        # its anchor and the one never used: 8 bytes)
        assert rank["planned"] == rank["weights"] and 0 <= rank["reduced"] - rank["planned"] <= 8, rank


@pytest.mark.slow
def test_a_step_that_uses_every_parameter_prints_nothing():
    """DDP, told that parameters may go unused, prints once per rank from C++ that the flag could be turned off
    when a step uses them all (every step of a dense model); the scalar no objective uses keeps it quiet."""
    code = ("import sys; sys.path.insert(0, 'tests'); from test_gradient_reduction import _overlap; "
            "from megaseq_testkit.distributed import run_gloo; run_gloo(2, _overlap)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "find_unused_parameters" not in done.stderr, done.stderr[-3000:]
