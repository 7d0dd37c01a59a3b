"""Splitting a sequence over a context-parallel group (see ``ContextParallel``), the autograd-aware
collectives components use across ranks (``megaseq.parallel.collectives``), and the tensor-parallel
mappings (``megaseq.parallel.tensor``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from megaseq.parallel.collectives import all_gather, all_to_all
from megaseq.parallel.tensor import tp_chunk, tp_gather, tp_reduce_scatter, tp_split, vocab_parallel_cross_entropy

if TYPE_CHECKING:
    from megaseq.contracts import ContextParallel


def zigzag_shard(x: Tensor, rank: int, world_size: int, dim: int = 1) -> Tensor:
    """This rank's zig-zag share of ``x`` along ``dim``: segments ``rank`` and ``2 * world_size - 1 - rank``."""
    if x.shape[dim] % (2 * world_size):
        raise ValueError(f"length {x.shape[dim]} along dim {dim} is not a multiple of 2 x {world_size} ranks")
    segments = x.chunk(2 * world_size, dim=dim)
    return torch.cat([segments[rank], segments[2 * world_size - 1 - rank]], dim=dim)


def zigzag_unshard(shards: list[Tensor] | Tensor, dim: int = 1) -> Tensor:
    """Inverse of :func:`zigzag_shard`: the full sequence from every rank's share, in rank order (a list, or
    a tensor stacked along a new leading dimension as :func:`all_gather` returns it)."""
    world_size = len(shards)
    segments: list[Tensor | None] = [None] * (2 * world_size)
    for rank, shard in enumerate(shards):
        first, second = shard.chunk(2, dim=dim)
        segments[rank], segments[2 * world_size - 1 - rank] = first, second
    return torch.cat(segments, dim=dim)  # type: ignore[arg-type]


def gather_sequence(local: Tensor, cp: ContextParallel, dim: int = 1) -> Tensor:
    """The whole sequence in global order from every rank's zig-zag share ``local`` (along ``dim``),
    differentiably: each position's gradient, summed over the ranks that used it, returns to its owner."""
    return zigzag_unshard(all_gather(local, cp.group), dim=dim)


__all__ = [
    "all_gather",
    "all_to_all",
    "gather_sequence",
    "tp_chunk",
    "tp_gather",
    "tp_reduce_scatter",
    "tp_split",
    "vocab_parallel_cross_entropy",
    "zigzag_shard",
    "zigzag_unshard",
]
