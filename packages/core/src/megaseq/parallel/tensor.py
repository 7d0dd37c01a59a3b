"""Tensor parallelism (``megaseq.contracts.TensorParallel``): the mappings around a split region, and the
cross-entropy of a vocabulary split over ranks.

With sequence parallelism (training) they are megatron-core's sequence-parallel mappings
(``gather_from_sequence_parallel_region``, ``reduce_scatter_to_sequence_parallel_region``,
``scatter_to_sequence_parallel_region``); without it (``TensorParallel.sequence_parallel = False``: decoding)
its plain tensor-parallel ones (``copy_to_tensor_model_parallel_region``, an identity whose backward sums the
gradient over the ranks, and ``reduce_from_tensor_model_parallel_region``, an all-reduce whose backward is the
identity), and splitting or chunking the sequence is the identity. With ``vocab_parallel_cross_entropy`` they
work on ``[batch, tokens, ...]`` tensors along any dimension and on the group's device through
``megaseq.parallel.collectives``: megatron-core's own allocate their buffers on ``torch.cuda.current_device()``
and take the sequence as dimension 0, so they cannot run on a CPU rank.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from megaseq.contracts import TensorParallel
from megaseq.parallel import collectives


def tp_chunk(x: Tensor, tp: TensorParallel, dim: int = 1) -> Tensor:
    """This rank's contiguous ``1/tp`` of ``x`` along ``dim`` (no gradient plumbing: for inputs); all of ``x``
    without sequence parallelism."""
    if not tp.sequence_parallel:
        return x
    if x.shape[dim] % tp.world_size:
        raise ValueError(f"length {x.shape[dim]} along dim {dim} is not a multiple of tp {tp.world_size}")
    return x.chunk(tp.world_size, dim=dim)[tp.rank]


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, tp: TensorParallel) -> Tensor:  # type: ignore[override]
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return collectives.all_reduce(grad.clone(), ctx.tp.group), None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, tp: TensorParallel) -> Tensor:  # type: ignore[override]
        return collectives.all_reduce(x.clone(), tp.group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad, None


def tp_gather(x: Tensor, tp: TensorParallel, dim: int = 1) -> Tensor:
    """The whole sequence from every rank's chunk ``x`` (along ``dim``). Backward: each chunk's gradient summed
    over the ranks (a reduce-scatter): every rank's split region used the whole sequence. Without sequence
    parallelism ``x`` is the whole sequence already: the identity, whose backward sums the gradient over the
    ranks."""
    if not tp.sequence_parallel:
        return _Copy.apply(x, tp)
    stacked = collectives.all_gather(x, tp.group)  # [tp, *x.shape]
    return stacked.movedim(0, dim).flatten(dim, dim + 1)


def tp_reduce_scatter(x: Tensor, tp: TensorParallel, dim: int = 1) -> Tensor:
    """This rank's chunk (along ``dim``) of the sum over ranks of their partial ``x``. Backward: the chunks'
    gradients gathered (an all-gather). Without sequence parallelism: the whole sum (an all-reduce; backward the
    identity)."""
    if not tp.sequence_parallel:
        return _Reduce.apply(x, tp)
    n = tp.world_size
    if x.shape[dim] % n:
        raise ValueError(f"length {x.shape[dim]} along dim {dim} is not a multiple of tp {n}")
    stacked = x.unflatten(dim, (n, x.shape[dim] // n)).movedim(dim, 0)
    return collectives.reduce_scatter(stacked, tp.group)


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, tp: TensorParallel, dim: int) -> Tensor:  # type: ignore[override]
        ctx.tp, ctx.dim = tp, dim
        return tp_chunk(x, tp, dim).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        with torch.no_grad():
            return tp_gather(grad, ctx.tp, ctx.dim), None, None


def tp_split(x: Tensor, tp: TensorParallel, dim: int = 1) -> Tensor:
    """This rank's chunk of ``x``, which every rank holds alike. Backward: every rank's chunk gradient gathered,
    so that the same whole gradient flows on every rank into what computed ``x``. Without sequence parallelism
    the rank holds all of ``x``: the identity."""
    return _Split.apply(x, tp, dim) if tp.sequence_parallel else x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, logits: Tensor, targets: Tensor, tp: TensorParallel, vocab_size: int | None
    ) -> Tensor:
        vocab = logits.shape[-1]
        first = tp.rank * vocab
        if vocab_size is not None and first + vocab > vocab_size:  # padding past the vocabulary: never a token
            logits = logits.clone()
            logits[:, max(vocab_size - first, 0) :] = float("-inf")
        here = (targets >= first) & (targets < first + vocab)
        local = (targets - first).clamp(0, vocab - 1)
        peak = collectives.all_reduce(logits.max(-1).values, tp.group, op="max")
        shifted = logits - peak[:, None]
        picked = torch.where(here, shifted.gather(1, local[:, None])[:, 0], 0.0)  # where: 0 x -inf is NaN
        target_logit = collectives.all_reduce(picked, tp.group)
        exp = shifted.exp()
        total = collectives.all_reduce(exp.sum(-1), tp.group)
        ctx.save_for_backward(exp.div_(total[:, None]), here, local)
        return total.log() - target_logit

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:  # type: ignore[override]
        softmax, here, local = ctx.saved_tensors
        grad_logits = softmax.clone()
        grad_logits[torch.arange(len(local), device=local.device), local] -= here.to(softmax.dtype)
        return grad_logits.mul_(grad[:, None]), None, None, None


def vocab_parallel_cross_entropy(
    logits: Tensor, targets: Tensor, tp: TensorParallel, vocab_size: int | None = None
) -> Tensor:
    """Per-token cross-entropy of ``logits [N, B]`` (this rank's block ``rank`` of ``B = ceil(V / tp)`` ids of
    the vocabulary) against ``targets [N]`` (whole-vocabulary ids), the same on every rank; no rank holds
    whole-vocabulary logits. ``vocab_size``: ``V``, when the last blocks hold padding past it (left out of
    the softmax). The incoming gradient must be the same on every rank (each computes only its block's
    logit gradient)."""
    return _VocabParallelCrossEntropy.apply(logits, targets, tp, vocab_size)


__all__ = ["tp_chunk", "tp_gather", "tp_reduce_scatter", "tp_split", "vocab_parallel_cross_entropy"]
