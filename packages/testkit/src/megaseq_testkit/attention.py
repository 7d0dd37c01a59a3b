"""Conformance suite for attention components (see ``megaseq.contracts.Attention``).

Subclass :class:`AttentionConformance` in a pytest module and set ``name`` and ``config``; every test below
then runs against the component built through the installed plugins. What is checked, and what each check
would catch:

- ``test_shape_and_dtype``: ``[B, T, d_model]`` in and out, the input's dtype (float32 and float64), finite.
- ``test_causal``: changing later tokens leaves earlier outputs alone (a component that peeks ahead).
- ``test_packed_equals_separate``: with ``cu_seqlens`` (an empty document among them) outputs and all
  gradients equal running the documents separately (attention, state or convolution across documents).
- ``test_decode_equals_forward``: a prefill then single-token steps from ``init_cache`` equal the forward,
  and so do steps of several tokens (``decode_steps``: a cache that handles one new token only).
- ``test_gradients``: float64 finite differences for the input and every trainable parameter (wrong or
  missing gradients: a detached projection, a hand-written backward with a mistake), reference-free.
- ``test_deterministic``: the same forward and backward twice, torch's global random generator moved in
  between, are identical, and the generator is left alone (noise drawn from the global generator).
- ``test_zero_input`` and ``test_padding_document``: all-zero rows and an all-zero document in a packed
  row give finite outputs and gradients (a normalisation without epsilon: NaN).
- ``test_two_forwards_one_backward``: two forwards, then one backward of both, give each forward's own
  gradients (state kept on the module between a forward and its backward).
- ``test_memory_estimate``: the record's ``MemoryEstimate.saved_per_token`` times the tokens is within
  ``memory_tolerance`` (25%) of the bytes autograd saves (distinct storages, the input included, the
  parameters not) at each of ``memory_lengths`` (a 3x underestimate; a ``[T, T]`` matrix kept for backward).
- ``test_temporary_estimate``: the record's ``MemoryEstimate.temporary`` against the transient working set of
  one forward and of one backward (``megaseq_testkit.checks.transient_bytes``: the most bytes live at once of
  what the call allocates and frees before it returns), the larger of the two, at each of ``memory_lengths``:
  at least ``1 - memory_tolerance`` and at most ``temporary_ratio`` (4) times it (a scratch buffer the estimate
  leaves out; a working set that grows faster than the estimate; a fixed cap where the buffer is smaller).
- ``test_kept_for_rerun``: what the component keeps with ``ForwardContext.keep`` (as a recompute unit's forward
  does), replayed to a second forward as a recompute unit's re-run gets it, on plain rows and on packed
  documents (``doc_lengths``), gives bitwise the outputs and
  gradients of a plain forward, every kept value taken back (a kept tensor changed in place after the forward
  used it); its bytes are the estimate's ``kept_per_token`` at each of ``memory_lengths``, within
  ``memory_tolerance`` (a kept value the estimate does not declare).
- ``test_one_host_sync_per_batch``: two layers sharing one packed forward read ``cu_seqlens`` to the host
  at most once between them (a per-layer ``.tolist()``: a device stall per layer on CUDA). Components read
  the layout through ``ctx.documents``.
- ``test_context_parallel``: for each world size in ``cp_world_sizes`` (2 and 4), one launch of gloo
  processes runs several layouts (batch 2; documents inside segments; documents starting exactly on segment
  edges with ranks whose segments hold no document start; an empty and a one-token document) and compares
  every rank's outputs, input gradients, summed parameter gradients, auxiliary losses and metrics (the mean
  of the ranks' per-token means, ranks holding equal shares) with one rank. A
  component whose ranks run different collectives in backward fails here (gloo errors or times out). This
  runs when the record declares ``context_parallel`` (``megaseq.records.CAPABILITIES``; with ``factory``,
  the ``capabilities`` knob); a component that does not declare it must instead raise a one-line error on
  ``ctx.cp``, which is checked.
- ``test_tensor_parallel``: with ``tensor_parallel`` declared, ``megaseq_testkit.tensor_parallel.
  check_tensor_parallel`` at tp=2 (outputs, input and every parameter gradient over packed documents).

Error bound everywhere: ``max |actual - expected| <= tolerance * max(1, max |expected|)`` (``tolerance``,
1e-5 for the float32 comparisons; the float64 gradient check uses ``grad_tolerance``, 1e-6).
"""

from __future__ import annotations

import itertools
from typing import Any, ClassVar

import pytest
import torch
from torch import Tensor, nn

from megaseq.contracts import ContextParallel, ForwardContext, KeptValues
from megaseq.parallel import zigzag_shard
from megaseq.records import ModelDims
from megaseq_testkit import (
    ComponentSuite,
    assert_close,
    build_component,
    check_deterministic,
    check_gradients,
    watch_host_syncs,
)
from megaseq_testkit.checks import (
    check_shape_and_dtype,
    check_two_forwards,
    forward_backward,
)
from megaseq_testkit.tensor_parallel import check_tensor_parallel

# A context-parallel case: (config, x [B, T, d_model], grad_out [B, T, d_model], cu_seqlens or None).
CPCase = tuple[dict[str, Any], Tensor, Tensor, Tensor | None]

# Seconds a rank waits in a collective before failing: a rank whose peers skipped the collective (a different
# graph in backward) ends up waiting forever otherwise. Generous, because a loaded machine slows some ranks.
COLLECTIVE_TIMEOUT = 60.0


def _build(name: str, config: dict[str, Any], d_model: int, seed: int, factory: str | None = None) -> nn.Module:
    torch.manual_seed(seed)
    dims = ModelDims(d_model=d_model, n_layers=2, vocab_size=8)
    return build_component("attention", name, config, dims, factory=factory).float()


def _cu(offsets: list[int] | tuple[int, ...]) -> Tensor:
    return torch.tensor(offsets, dtype=torch.int32)


def cp_layouts(seq_len: int, world: int) -> list[tuple[str, int, list[int] | None]]:
    """The suite's context-parallel layouts for ``world`` ranks: (description, batch size, cu_seqlens)."""
    n = seq_len // (2 * world)  # segment length
    return [
        ("batch of 2, one document per row", 2, None),
        ("documents starting inside segments", 1, [0, 3, seq_len // 2 + 1, seq_len]),
        # rank 0's two segments both start a document exactly at their edge; no other rank holds a start
        ("documents starting on segment edges", 1, [0, (2 * world - 1) * n, seq_len]),
        ("an empty and a one-token document", 1, [0, n, n, n + 1, seq_len - 1, seq_len]),
    ]


def cp_rank_step(
    module: nn.Module, x: Tensor, grad_out: Tensor, cu_seqlens: Tensor | None, rank: int, world: int
) -> dict[str, Any]:
    """One rank's forward and backward of ``(out * grad_out).sum() + auxiliary losses`` on its zig-zag share.

    Returns this rank's output, input gradient, parameter gradients and auxiliary loss (its share: the shares
    of all ranks add up to the single-rank loss, as their parameter gradients do). No collective runs after
    the backward: a rank that skipped a collective its peers entered then finishes, and the peers waiting in
    that collective fail at once (their connection closes) instead of hanging until a timeout.
    """
    import torch.distributed as dist

    x_local = zigzag_shard(x, rank, world).detach().requires_grad_(True)
    cp = ContextParallel(group=dist.group.WORLD, rank=rank, world_size=world, seq_len=x.shape[1])
    ctx = ForwardContext(cu_seqlens=cu_seqlens, cp=cp)
    out = module(x_local, ctx)
    aux = sum(ctx.losses.values(), torch.zeros(()))
    ((out * zigzag_shard(grad_out, rank, world)).sum() + aux).backward()
    grads = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in module.named_parameters()}
    return {
        "out": out.detach(),
        "x_grad": x_local.grad,
        "param_grads": grads,
        "aux_loss": aux.detach(),
        "metrics": dict(ctx.metrics),
    }


def _cp_cases_worker(
    rank: int, world: int, name: str, d_model: int, cases: list[CPCase], factory: str | None = None
) -> list[dict[str, Any]]:
    return [
        cp_rank_step(_build(name, config, d_model, seed=0, factory=factory), x, g, cu, rank, world)
        for config, x, g, cu in cases
    ]


def check_context_parallel(
    name: str,
    d_model: int,
    cases: list[CPCase],
    world: int,
    tolerance: float = 1e-5,
    results: list[list[dict[str, Any]]] | None = None,
    factory: str | None = None,
    labels: list[str] | None = None,
) -> list[list[dict[str, Any]]]:
    """Assert that ``world`` gloo ranks equal one rank for every case: outputs, input gradients, parameter
    gradients and auxiliary losses. All cases share one launch of processes (starting them dominates a small
    case's cost). ``results`` (per rank, per case, from :func:`cp_rank_step`) may come from a plugin's own
    worker that records more; returns them for further checks. ``labels`` name the cases in messages."""
    from megaseq_testkit.distributed import run_gloo

    if results is None:
        try:
            results = run_gloo(
                world, _cp_cases_worker, name, d_model, cases, factory, collective_timeout=COLLECTIVE_TIMEOUT
            )
        except RuntimeError as exc:  # a rank raised, or ranks disagreed on their collectives (a timeout)
            raise AssertionError(
                f"{name}: context parallelism over {world} gloo ranks failed (a timeout in a collective means "
                f"the ranks did not run the same collectives, e.g. one skipped a gather in backward): {exc}"
            ) from exc
    for i, (config, x, grad_out, cu) in enumerate(cases):
        module = _build(name, config, d_model, seed=0, factory=factory)
        xr = x.clone().requires_grad_(True)
        ctx = ForwardContext(cu_seqlens=cu)
        ref = module(xr, ctx)
        aux = sum(ctx.losses.values(), torch.zeros(()))
        ((ref * grad_out).sum() + aux).backward()
        what = f"{name}, {labels[i] if labels else f'case {i}'}, cp{world}"
        for rank in range(world):
            res = results[rank][i]
            assert_close(res["out"], zigzag_shard(ref.detach(), rank, world), tolerance, f"{what} rank {rank} output")
            assert_close(
                res["x_grad"], zigzag_shard(xr.grad, rank, world), tolerance, f"{what} rank {rank} input grad"
            )
        ranks = [results[rank][i] for rank in range(world)]
        assert_close(sum(r["aux_loss"] for r in ranks), aux.detach(), tolerance, f"{what} auxiliary loss")
        for rank, r in enumerate(ranks):
            assert set(r["metrics"]) == set(ctx.metrics), f"{what} rank {rank}: metrics {sorted(r['metrics'])} != {sorted(ctx.metrics)}"
        for key, value in ctx.metrics.items():  # per-token means over equal shares: their mean is the whole's
            mean = sum(r["metrics"][key] for r in ranks) / world
            assert_close(torch.tensor(mean), torch.tensor(value), tolerance, f"{what} metric {key!r} (mean over ranks)")
        for pname, p in module.named_parameters():
            if p.grad is not None:
                summed = sum(r["param_grads"][pname] for r in ranks)
                assert_close(summed, p.grad, tolerance, f"{what} gradient of {pname} (summed over ranks)")
    return results


class AttentionConformance(ComponentSuite):
    """Base class of an attention component's conformance tests (the knobs are documented in
    docs/writing-a-plugin.md)."""

    kind: ClassVar[str] = "attention"
    temporary_ratio: ClassVar[float] = 4.0
    grad_tolerance: ClassVar[float] = 1e-6
    seq_len: ClassVar[int] = 48
    grad_seq_len: ClassVar[int] = 10
    doc_lengths: ClassVar[tuple[int, ...]] = (5, 17, 0, 1, 25)
    prefill: ClassVar[int] = 19
    decode_steps: ClassVar[tuple[int, ...]] = (3, 1, 5, 2)
    cp_world_sizes: ClassVar[tuple[int, ...]] = (2, 4)
    cp_seq_len: ClassVar[int] = 32

    def build(self, seed: int = 0) -> nn.Module:
        return _build(self.name, self.config, self.d_model, seed, self.factory)

    def inputs(self, batch: int, length: int, seed: int = 1) -> Tensor:
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(batch, length, self.d_model, generator=gen)

    def packed(self) -> Tensor:
        """``cu_seqlens`` of ``doc_lengths``."""
        return _cu([0, *itertools.accumulate(self.doc_lengths)])

    def test_shape_and_dtype(self) -> None:
        check_shape_and_dtype(self.build(), self.inputs(2, self.seq_len), ForwardContext)

    def test_causal(self) -> None:
        module = self.build()
        x = self.inputs(2, self.seq_len)
        cut = self.seq_len // 2 + 1
        changed = x.clone()
        changed[:, cut:] = self.inputs(2, self.seq_len - cut, seed=7)
        a, b = module(x, ForwardContext()), module(changed, ForwardContext())
        assert_close(b[:, :cut], a[:, :cut], self.tolerance, "outputs before the change")
        assert not torch.allclose(a[:, cut:], b[:, cut:]), "changing later tokens changed nothing at all"

    def test_packed_equals_separate(self) -> None:
        module = self.build()
        cu = self.packed()
        total = int(cu[-1])
        x = self.inputs(1, total).requires_grad_(True)
        grad_out = self.inputs(1, total, seed=3)
        packed = module(x, ForwardContext(cu_seqlens=cu))
        (packed * grad_out).sum().backward()
        packed_grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
        module.zero_grad()
        xs = x.detach().clone().requires_grad_(True)
        parts = [module(xs[:, s:e], ForwardContext()) for s, e in itertools.pairwise(cu.tolist()) if e > s]
        separate = torch.cat(parts, dim=1)
        (separate * grad_out).sum().backward()
        assert_close(packed, separate, self.tolerance, "packed output")
        assert_close(x.grad, xs.grad, self.tolerance, "packed input gradient")
        for n, p in module.named_parameters():
            if p.grad is not None:
                assert_close(packed_grads[n], p.grad, self.tolerance, f"packed gradient of {n}")

    def test_decode_equals_forward(self) -> None:
        module = self.build()
        x = self.inputs(2, self.seq_len)
        with torch.no_grad():
            full = module(x, ForwardContext())
            for steps in ((1,), self.decode_steps):
                cache = module.init_cache(2, device=x.device, dtype=x.dtype)
                outs = [module(x[:, : self.prefill], ForwardContext(), cache)]
                t, sizes = self.prefill, itertools.cycle(steps)
                while t < self.seq_len:
                    n = min(next(sizes), self.seq_len - t)
                    outs.append(module(x[:, t : t + n], ForwardContext(), cache))
                    t += n
                what = "single-token steps" if steps == (1,) else f"steps of {', '.join(map(str, steps))} tokens"
                assert_close(torch.cat(outs, dim=1), full, self.tolerance, f"prefill + decode in {what} vs full forward")

    def test_gradients(self) -> None:
        grad_out = self.inputs(2, self.grad_seq_len, seed=4).double()

        def loss(module: nn.Module, x: Tensor) -> Tensor:
            return (module(x, ForwardContext()) * grad_out).sum()

        x = self.inputs(2, self.grad_seq_len)
        check_gradients(self.build(), loss, x, f"{self.name} (float64)", self.grad_tolerance)

    def test_two_forwards_one_backward(self) -> None:
        module = self.build()
        inputs = (self.inputs(2, self.seq_len, seed=11), self.inputs(2, self.seq_len, seed=12))
        grad_outs = (self.inputs(2, self.seq_len, seed=13), self.inputs(2, self.seq_len, seed=14))
        check_two_forwards(module, inputs, grad_outs, ForwardContext, self.tolerance, self.name)

    def test_memory_estimate(self) -> None:
        self.check_saved_per_token(1, lambda length: self.inputs(1, length))

    def test_temporary_estimate(self) -> None:
        self.check_temporary(1, lambda length, seed: self.inputs(1, length, seed=seed))

    def test_kept_for_rerun(self) -> None:
        module = self.build()
        cu = self.packed()
        for batch, length, ctx in ((2, self.seq_len, ForwardContext()), (1, int(cu[-1]), ForwardContext(cu_seqlens=cu))):
            x, grad_out = self.inputs(batch, length), self.inputs(batch, length, seed=3)
            plain = forward_backward(module, x, grad_out, ctx)
            kept = KeptValues()
            forward_backward(module, x, grad_out, ctx.fork(kept))
            replay = KeptValues(list(kept.items))
            rerun = forward_backward(module, x, grad_out, ctx.for_recomputation(replay))
            case = "packed documents" if ctx.cu_seqlens is not None else "plain rows"
            assert replay.exhausted, f"{self.name} ({case}): a re-run took {replay.used} of the {len(kept.items)} values kept"
            for key, value in plain.items():
                assert torch.equal(rerun[key], value), (
                    f"{self.name} ({case}): a re-run with the kept values, {key}: differs from a forward"
                )
        estimate = self.estimator()
        if estimate is None:
            return
        for length in self.memory_lengths:
            kept = KeptValues()
            module(self.inputs(1, length), ForwardContext().fork(kept))
            measured = sum(value.numel() * value.element_size() for _, value in kept.items)
            declared = length * estimate(length).kept_per_token
            assert abs(declared - measured) <= self.memory_tolerance * measured, (
                f"{self.name}: at {length} tokens the estimate says it keeps {declared:.0f} bytes for a re-run, it "
                f"keeps {measured}: fix kept_per_token"
            )

    def test_deterministic(self) -> None:
        module = self.build(seed=5)
        x = self.inputs(2, self.seq_len)
        grad_out = self.inputs(2, self.seq_len, seed=3)

        check_deterministic(lambda: forward_backward(module, x, grad_out, ForwardContext()), self.name)

    def _assert_finite_forward_backward(self, x: Tensor, ctx: ForwardContext, what: str) -> None:
        module = self.build()
        x = x.clone().requires_grad_(True)
        out = module(x, ctx)
        assert torch.isfinite(out).all(), f"{what}: non-finite output"
        aux = sum(ctx.losses.values(), torch.zeros(()))
        ((out * self.inputs(*x.shape[:2], seed=3)).sum() + aux).backward()
        assert torch.isfinite(x.grad).all(), f"{what}: non-finite input gradient"
        for n, p in module.named_parameters():
            assert p.grad is None or torch.isfinite(p.grad).all(), f"{what}: non-finite gradient of {n}"

    def test_zero_input(self) -> None:
        self._assert_finite_forward_backward(torch.zeros(2, self.seq_len, self.d_model), ForwardContext(), "zeros")

    def test_padding_document(self) -> None:
        cu = self.packed()
        x = self.inputs(1, int(cu[-1]))
        x[:, int(cu[1]) : int(cu[2])] = 0  # the second document is padding
        self._assert_finite_forward_backward(x, ForwardContext(cu_seqlens=cu), "an all-zero packed document")

    def test_one_host_sync_per_batch(self) -> None:
        layers = [self.build(seed=0), self.build(seed=1)]
        cu, host_reads = watch_host_syncs(self.packed())
        ctx = ForwardContext(cu_seqlens=cu)
        x = self.inputs(1, int(self.packed()[-1])).requires_grad_(True)
        h = x
        for layer in layers:
            h = layer(h, ctx)
        aux = sum(ctx.losses.values(), torch.zeros(()))
        ((h * self.inputs(*h.shape[:2], seed=3)).sum() + aux).backward()
        assert host_reads() <= 1, (
            f"{self.name}: two layers of one packed forward read cu_seqlens to the host {host_reads()} times; "
            "read the layout through ctx.documents (built once per forward)"
        )

    @pytest.mark.slow  # gloo processes: outside the fast lane (megaseq_testkit/pytest_plugin.py)
    def test_context_parallel(self) -> None:
        if "context_parallel" not in self.declared():
            self._assert_refuses_context_parallel()
            return
        assert self.cp_world_sizes, f"{self.name} declares context_parallel: cp_world_sizes must name a world size"
        t = self.cp_seq_len
        for world in self.cp_world_sizes:
            layouts = cp_layouts(t, world)
            cases = [
                (self.config, self.inputs(b, t, seed=10 + i), self.inputs(b, t, seed=20 + i), cu and _cu(cu))
                for i, (_, b, cu) in enumerate(layouts)
            ]
            labels = [label for label, _, _ in layouts]
            check_context_parallel(
                self.name, self.d_model, cases, world, self.tolerance, factory=self.factory, labels=labels
            )

    def test_tensor_parallel(self) -> None:
        """With ``tensor_parallel`` declared: ``megaseq_testkit.tensor_parallel.check_tensor_parallel`` at tp=2
        (a component without it is refused by the launch, ``megaseq.capabilities``, and never sees ``ctx.tp``)."""
        if "tensor_parallel" in self.declared():
            check_tensor_parallel("attention", self.name, self.config, self.d_model, tolerance=self.tolerance,
                                  factory=self.factory)

    def _assert_refuses_context_parallel(self) -> None:
        """A component that does not declare context_parallel must raise a one-line error when handed a
        context-parallel shard (no process group exists here, so the error must come before any communication)."""
        module = self.build()
        cp = ContextParallel(group=None, rank=0, world_size=2, seq_len=self.cp_seq_len)
        x = self.inputs(1, self.cp_seq_len // 2)
        with pytest.raises((ValueError, NotImplementedError)) as raised:
            module(x, ForwardContext(cp=cp))
        message = str(raised.value)
        assert message and "\n" not in message, f"the error on ctx.cp must be one line, got {message!r}"
        assert "process group" not in message, (
            f"{self.name} does not declare context_parallel but tried to communicate on ctx.cp: {message}"
        )
