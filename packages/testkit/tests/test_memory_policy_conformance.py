"""The memory-policy suite passes a correct third-party policy written with ``torch.utils.checkpoint`` and
catches a wrong policy for each of its checks.

``CheckpointBlocks`` is what a plugin author writes from the guide: find the blocks with
``megaseq.memory.model_layers`` and wrap them in a non-reentrant checkpoint. It is correct by construction:
``ForwardContext`` ignores the auxiliary losses and metrics of the re-run in backward. The wrong policies
each break one rule the suite checks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
from typing import Any

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from megaseq.contracts import ForwardContext, recomputing
from megaseq.memory import model_layers
from megaseq.records import MemoryEffect
from megaseq_testkit.memory_policy import MemoryPolicyConformance


class CheckpointBlocks:
    """Correct: every block recomputed by torch's non-reentrant checkpoint."""

    reentrant = False
    preserve_rng = True

    def __init__(self, config: dict) -> None:
        self.config = config

    def forward(self, fwd, x, ctx, cache):
        return fwd(x, ctx, cache)

    def apply(self, model) -> None:
        def wrapper(block, fwd):
            def run(x, ctx, cache=None):
                if cache is not None or not torch.is_grad_enabled():
                    return fwd(x, ctx, cache)
                return checkpoint(
                    self.forward, fwd, x, ctx, cache, use_reentrant=self.reentrant, preserve_rng_state=self.preserve_rng
                )

            return run

        for layer in model_layers(model):
            layer.wrap("block", wrapper)

    def step(self):
        return contextlib.nullcontext()


class ReentrantCheckpoint(CheckpointBlocks):
    """Wrong: torch's reentrant checkpoint runs the forward without gradients, so auxiliary losses lose theirs."""

    reentrant = True


class NoRngReplay(CheckpointBlocks):
    """Wrong: the re-run draws new random numbers."""

    preserve_rng = False


class RecordsRecomputation(CheckpointBlocks):
    """Wrong: makes the re-run record its losses and metrics again (what core did before recomputation was
    recognised), so the auxiliary loss is counted twice."""

    def forward(self, fwd, x, ctx, cache):
        ctx._records_in_backward = True
        return fwd(x, ctx, cache)


class RunsTwice(CheckpointBlocks):
    """Wrong: runs each block twice in forward (say, to warm a cache) and keeps the second result."""

    def apply(self, model) -> None:
        for layer in model_layers(model):
            layer.wrap("block", lambda block, fwd: lambda x, ctx, cache=None: (fwd(x, ctx, cache), fwd(x, ctx, cache))[1])


class DropsContextParallel(CheckpointBlocks):
    """Wrong: re-runs blocks in backward without the context-parallel shard (exact on one rank only)."""

    def forward(self, fwd, x, ctx, cache):
        return fwd(x, dataclasses.replace(ctx, cp=None) if recomputing() else ctx, cache)


class LeaksScratchFile(CheckpointBlocks):
    """Wrong: leaves a file in the scratch directory after every step."""

    @contextlib.contextmanager
    def step(self):
        tempfile.mkstemp(dir=os.environ["MEGASEQ_SCRATCH"])
        yield


class LeaksOnError(CheckpointBlocks):
    """Wrong: installs saved-tensor hooks for the step and removes them only when the step succeeds."""

    @contextlib.contextmanager
    def step(self):
        hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        hooks.__enter__()
        yield
        hooks.__exit__(None, None, None)


class KeepsTensors(CheckpointBlocks):
    """Wrong: keeps every saved tensor of every step (a cache that is never released)."""

    def __init__(self, config: dict) -> None:
        super().__init__(config)
        self.kept: list[Any] = []

    @contextlib.contextmanager
    def step(self):
        def pack(t):
            self.kept.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield


class KeyedPerCall(CheckpointBlocks):
    """Wrong: keeps each block's saved tensors in a store keyed by (layer, n-th tensor of the call): a second
    forward of the layer before the backward overwrites the first forward's entries."""

    def __init__(self, config: dict) -> None:
        super().__init__(config)
        self.store: dict[tuple[int, int], torch.Tensor] = {}
        self.key: list = [None, 0]

    def apply(self, model) -> None:
        def wrapper(index):
            def wrap(block, fwd):
                def run(x, ctx, cache=None):
                    self.key[:] = [index, 0]
                    try:
                        return fwd(x, ctx, cache)
                    finally:
                        self.key[0] = None  # outside the blocks tensors are saved as they are

                return run

            return wrap

        for layer in model_layers(model):
            layer.wrap("block", wrapper(layer.index))

    @contextlib.contextmanager
    def step(self):
        def pack(t):
            if self.key[0] is None:
                return t
            key = tuple(self.key)
            self.key[1] += 1
            self.store[key] = t
            return key

        def unpack(packed):
            return self.store[packed] if isinstance(packed, tuple) else packed

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                yield
        finally:
            self.store.clear()


class NeedsStep(CheckpointBlocks):
    """Wrong: every block forward records into a pool that only exists inside step()."""

    pool = None

    @contextlib.contextmanager
    def step(self):
        self.pool = []
        try:
            yield
        finally:
            self.pool = None

    def forward(self, fwd, x, ctx, cache):
        self.pool.append(x.shape[1])
        return fwd(x, ctx, cache)

    def apply(self, model) -> None:
        for layer in model_layers(model):
            layer.wrap("block", lambda block, fwd: lambda x, ctx, cache=None: self.forward(fwd, x, ctx, cache))


class CachesNoGrad(CheckpointBlocks):
    """Wrong: reuses a block's last no-grad output for the next no-grad forward (an evaluation cache)."""

    def apply(self, model) -> None:
        cache: dict[int, torch.Tensor] = {}

        def wrapper(index):
            def wrap(block, fwd):
                def run(x, ctx, kv=None):
                    if torch.is_grad_enabled() or kv is not None:
                        return fwd(x, ctx, kv)
                    if index not in cache:
                        cache[index] = fwd(x, ctx, kv)
                    return cache[index]

                return run

            return wrap

        for layer in model_layers(model):
            layer.wrap("block", wrapper(layer.index))


class Bf16Saved(CheckpointBlocks):
    """Lossy and honest: keeps every floating-point tensor saved for backward as a bf16 copy (no recompute),
    which rounds gradients by ~1e-3 relative; it declares exact = False and its bound."""

    def apply(self, model) -> None:
        model_layers(model)  # acts on the whole model through its step's hooks

    @contextlib.contextmanager
    def step(self):
        def pack(t):
            return (t.to(torch.bfloat16), t.dtype) if t.is_floating_point() else (t, None)

        def unpack(packed):
            t, dtype = packed
            return t if dtype is None else t.to(dtype)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield


def recompute_blocks(config: dict) -> MemoryEffect:
    """What ``CheckpointBlocks`` does, as the planner models it."""
    return MemoryEffect(recompute="block")


class DeclaresRecomputeOnly(CheckpointBlocks):
    """Wrong: declares whole-block recomputation (``recompute_blocks``) but runs the blocks as they are, so each
    keeps everything it saves."""

    def apply(self, model) -> None:
        model_layers(model)  # finds the layers, wraps none of them


def _suite(policy: str, **settings: Any) -> MemoryPolicyConformance:
    knobs = {"name": policy, "factory": f"{__file__}:{policy}", "capabilities": frozenset({"context_parallel"}), **settings}
    return type(f"Suite{policy}", (MemoryPolicyConformance,), knobs)()


class TestThirdPartyCheckpointPolicy(MemoryPolicyConformance):
    name = "checkpoint-blocks"
    factory = f"{__file__}:CheckpointBlocks"
    memory = f"{__file__}:recompute_blocks"
    capabilities = frozenset({"context_parallel"})


class TestLossyPolicy(MemoryPolicyConformance):
    """A lossy policy passes at the bound it states, on the loss and the whole gradient vector."""

    name = "bf16-saved"
    factory = f"{__file__}:Bf16Saved"
    exact = False
    tolerance = 2e-2
    test_releases_everything_each_step = test_releases_everything_on_error = test_context_parallel = None


@pytest.mark.parametrize(
    ("policy", "check", "message"),
    [
        ("ReentrantCheckpoint", "test_same_loss_gradients_losses_and_metrics", "gradient of"),
        ("NoRngReplay", "test_same_loss_gradients_losses_and_metrics", "loss differs"),
        ("RecordsRecomputation", "test_same_loss_gradients_losses_and_metrics", "auxiliary loss"),
        ("RunsTwice", "test_each_forward_counted_once", "tokens"),
        ("LeaksScratchFile", "test_releases_everything_each_step", "files left in the scratch directory"),
        ("LeaksOnError", "test_releases_everything_on_error", "saved-tensor hooks are still installed"),
        ("KeepsTensors", "test_releases_everything_each_step", "more bytes of tensors"),
        ("KeyedPerCall", "test_two_forwards_before_one_backward", "two forwards before one backward"),
        ("NeedsStep", "test_forwards_outside_step_and_without_grad", "no-grad forward outside step"),
        ("CachesNoGrad", "test_forwards_outside_step_and_without_grad", "second batch"),
        ("Bf16Saved", "test_same_loss_gradients_losses_and_metrics", "relative error .* > tolerance 1.0e-04"),
        ("DeclaresRecomputeOnly", "test_memory_effect",
         r"DeclaresRecomputeOnly MemoryEffect: the planner takes MemoryEffect\(recompute='block'\) to save \d+ bytes .*"
         r"applying the policy saves 0 of \d+"),
    ],
)
def test_wrong_policy_is_caught(policy, check, message):
    settings = {"exact": False, "tolerance": 1e-4} if policy == "Bf16Saved" else {}  # a bound it does not keep
    if policy == "DeclaresRecomputeOnly":
        settings = {"memory": f"{__file__}:recompute_blocks"}  # a saving it does not make
    try:
        with pytest.raises(AssertionError, match=message):
            getattr(_suite(policy, **settings), check)()
    finally:  # LeaksOnError leaves its hooks installed: remove them for the tests that follow
        while torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
            torch._C._autograd._pop_saved_tensors_default_hooks()


def test_wrong_policy_under_context_parallelism_is_caught():
    with pytest.raises((AssertionError, RuntimeError)):
        _suite("DropsContextParallel").test_context_parallel()


def test_undeclared_context_parallel_support_is_checked():
    with pytest.raises(AssertionError, match="did not raise under ctx.cp"):
        _suite("CheckpointBlocks", capabilities=frozenset()).test_context_parallel()


def test_recomputation_does_not_record_again():
    """The mechanism itself: a loss added in a re-run during backward is dropped, not added twice."""
    x = torch.ones(3, requires_grad=True)
    ctx = ForwardContext()

    def part(t):
        out = t.sin()
        ctx.add_loss("aux", out.sum())
        ctx.log("seen", 1.0 + recomputing())
        return out

    y = checkpoint(part, x, use_reentrant=False)
    (y.sum() + ctx.losses["aux"]).backward()
    assert float(ctx.losses["aux"].detach()) == pytest.approx(3 * torch.sin(torch.tensor(1.0)).item())
    assert ctx.metrics == {"seen": 1.0}


def test_the_suite_removes_its_scratch_directories(tmp_path, monkeypatch):
    """Every scratch directory the suite makes is gone afterwards, with what a wrong policy left in it: a
    plugin's test run must not fill the system's temporary directory (it left one per test before)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    _suite("CheckpointBlocks").test_releases_everything_each_step()
    _suite("CheckpointBlocks").test_same_loss_gradients_losses_and_metrics()
    with pytest.raises(AssertionError, match="files left in the scratch directory"):
        _suite("LeaksScratchFile").test_releases_everything_each_step()
    assert sorted(p.name for p in tmp_path.glob("megaseq-suite-*")) == []  # torch may put its own caches here
