"""Helpers for splitting a sequence over a context-parallel group (see ``ContextParallel``)."""

from __future__ import annotations

import torch
from torch import Tensor


def zigzag_shard(x: Tensor, rank: int, world_size: int, dim: int = 1) -> Tensor:
    """This rank's zig-zag share of ``x`` along ``dim``: segments ``rank`` and ``2 * world_size - 1 - rank``."""
    if x.shape[dim] % (2 * world_size):
        raise ValueError(f"length {x.shape[dim]} along dim {dim} is not a multiple of 2 x {world_size} ranks")
    segments = x.chunk(2 * world_size, dim=dim)
    return torch.cat([segments[rank], segments[2 * world_size - 1 - rank]], dim=dim)


def zigzag_unshard(shards: list[Tensor], dim: int = 1) -> Tensor:
    """Inverse of :func:`zigzag_shard`: the full sequence from every rank's share, in rank order."""
    world_size = len(shards)
    segments: list[Tensor | None] = [None] * (2 * world_size)
    for rank, shard in enumerate(shards):
        first, second = shard.chunk(2, dim=dim)
        segments[rank], segments[2 * world_size - 1 - rank] = first, second
    return torch.cat(segments, dim=dim)  # type: ignore[arg-type]
