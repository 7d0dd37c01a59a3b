"""Every collective megaseq runs: the one place that calls ``torch.distributed``'s communication functions.

Buffers go to the group's device (``group_device``: the current CUDA device under NCCL, the CPU under gloo)
and results come back on the caller's device, so a caller may hand a CPU flag to an NCCL group or a CUDA
tensor to a gloo one. ``tests/test_governance.py`` rejects a direct collective anywhere else.

Plain collectives (``all_reduce``, ``all_gather_tensor``, ``exchange``, the object ones, ``barrier``) carry
no gradient; ``sum_bucket`` is the gradient reduction's hook (``megaseq.distributed.gradients``). The
autograd-aware ones for components (``all_gather``, ``all_to_all``) are each a ``torch.autograd.Function``
whose backward is itself a collective: gradients flow back to the rank that owns each piece. They use only
public ``torch.distributed`` calls that gloo (CPU) and NCCL (CUDA) both implement; the deprecated
``torch.distributed.nn.functional`` is not used.

The rule that comes with them: **every rank of the group must run the same collectives, in the same order,
with matching sizes, in forward and in backward.** A backward collective runs only where autograd reaches
it, so a rank whose output does not depend on a gathered tensor (say, both of its segments start a document
and ignore the incoming state) must still keep that tensor in its graph, e.g. by multiplying it by zero
instead of dropping it. Otherwise the other ranks wait in a collective this rank never enters (a hang, or
gloo's "Received data size doesn't match"). The conformance suite runs layouts that provoke this.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}

# torch 2.13 renamed the single-tensor forms (the old names warn); older torch has only the old names
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_device(group: Any) -> torch.device:
    """Where the group's buffers must live: NCCL (and XCCL) move only accelerator memory, gloo only host."""
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "xccl":
        return torch.device("xpu", torch.xpu.current_device())
    return torch.device("cpu")


def all_reduce(t: Tensor, group: Any, op: str = "sum") -> Tensor:
    """``t`` reduced over the group in place (``op``: sum, max or min), through a copy on the group's device
    when ``t`` lives elsewhere. Returns ``t``."""
    device = group_device(group)
    buffer = t if t.device == device else t.to(device)
    dist.all_reduce(buffer, op=_REDUCE_OPS[op], group=group)
    if buffer is not t:
        t.copy_(buffer)
    return t


# unannotated: DDP checks the hook's signature and, under postponed annotations, rejects any annotation of bucket
def sum_bucket(group, bucket):
    """A ``DistributedDataParallel`` communication hook: the bucket's gradients summed over ``group`` (DDP's own
    hook averages them), asynchronously; returns the future of the summed buffer. DDP keeps its buckets on the
    parameters' device, which is the group's (``megaseq.distributed.gradients``)."""
    buffer = bucket.buffer()
    return dist.all_reduce(buffer, group=group, async_op=True).get_future().then(lambda done: done.value()[0])


def all_gather_tensor(t: Tensor, group: Any) -> list[Tensor]:
    """Every rank's ``t`` (same shape on every rank), in rank order, on ``t``'s device; no gradient."""
    device = group_device(group)
    buffer = t.detach().to(device).contiguous()
    blocks = [torch.empty_like(buffer) for _ in range(dist.get_world_size(group))]
    dist.all_gather(blocks, buffer, group=group)
    return [b.to(t.device) for b in blocks]


def exchange(t: Tensor, group: Any) -> Tensor:
    """``t [ranks, ...]``: row ``r`` goes to rank ``r``; returns the rows every rank sent here, in rank order
    (an all-to-all with equal splits, no gradient), on ``t``'s device."""
    device = group_device(group)
    buffer = t.detach().to(device).contiguous()
    out = torch.empty_like(buffer)
    dist.all_to_all_single(out, buffer, group=group)
    return out.to(t.device)


def barrier(group: Any) -> None:
    dist.barrier(group=group)


# Object collectives pickle through a tensor on the current device of the group's backend (torch chooses it).
def gather_object(obj: Any, group: Any, dst: int = 0) -> list[Any]:
    """Every rank's ``obj`` in rank order on global rank ``dst``; ``[]`` elsewhere."""
    if dist.get_rank() != dst:
        dist.gather_object(obj, None, dst=dst, group=group)
        return []
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.gather_object(obj, gathered, dst=dst, group=group)
    return gathered


def broadcast_object(obj: Any, group: Any, src: int = 0) -> Any:
    """Global rank ``src``'s ``obj`` on every rank of the group."""
    box = [obj if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_gather_object(obj: Any, group: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def _has_reduce_scatter(group: Any) -> bool:
    return dist.get_backend(group) in ("nccl", "xccl")


def _reduce_scatter(stacked: Tensor, group: Any) -> Tensor:
    """``stacked [W, ...]``: return the sum over ranks of their slice ``r`` (this rank being ``r``)."""
    stacked = stacked.contiguous()
    if _has_reduce_scatter(group):
        out = stacked.new_empty(stacked[0].numel())
        _reduce_scatter_single(out, stacked.view(-1), group=group)
        return out.view(stacked.shape[1:])
    # gloo has no reduce-scatter: all-to-all moves slice r of every rank here, then sum (same traffic)
    received = torch.empty_like(stacked)
    dist.all_to_all_single(received, stacked, group=group)
    return received.sum(0)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:  # type: ignore[override]
        x = x.contiguous()
        out = x.new_empty(dist.get_world_size(group) * x.numel())
        _all_gather_single(out, x.view(-1), group=group)
        ctx.group = group
        return out.view(-1, *x.shape)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return _reduce_scatter(grad, ctx.group), None


def all_gather(x: Tensor, group: Any) -> Tensor:
    """Every rank's ``x`` stacked in rank order, ``[world_size, *x.shape]`` (all ranks' ``x`` must have the
    same shape). Backward: the gradient of this rank's ``x`` is the sum over ranks of their gradient for
    slice ``rank`` (a reduce-scatter)."""
    return _AllGather.apply(x, group)


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, stacked: Tensor, group: Any) -> Tensor:  # type: ignore[override]
        ctx.group = group
        return _reduce_scatter(stacked, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        grad = grad.contiguous()
        out = grad.new_empty(dist.get_world_size(ctx.group) * grad.numel())
        _all_gather_single(out, grad.view(-1), group=ctx.group)
        return out.view(-1, *grad.shape), None


def reduce_scatter(stacked: Tensor, group: Any) -> Tensor:
    """``stacked [world_size, ...]``: the sum over ranks of their slice ``rank``. Backward: every rank's
    gradient of its slice, stacked (an all-gather)."""
    return _ReduceScatter.apply(stacked, group)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, send_counts: list[int], recv_counts: list[int], group: Any
    ) -> Tensor:
        out = x.new_empty((sum(recv_counts), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=group)
        ctx.counts, ctx.group = (send_counts, recv_counts), group
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:  # type: ignore[override]
        send_counts, recv_counts = ctx.counts
        out = grad.new_empty((sum(send_counts), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), send_counts, recv_counts, group=ctx.group)
        return out, None, None, None


def all_to_all(x: Tensor, send_counts: list[int], recv_counts: list[int], group: Any) -> Tensor:
    """Send ``send_counts[r]`` consecutive rows (dim 0) of ``x`` to rank ``r``; receive ``recv_counts[r]`` rows
    from rank ``r``, in rank order. Uneven counts are fine (gloo included). Backward: the reverse exchange."""
    return _AllToAll.apply(x, list(send_counts), list(recv_counts), group)


__all__ = [
    "all_gather",
    "all_gather_object",
    "all_gather_tensor",
    "all_reduce",
    "all_to_all",
    "barrier",
    "broadcast_object",
    "exchange",
    "gather_object",
    "group_device",
    "reduce_scatter",
    "sum_bucket",
]
