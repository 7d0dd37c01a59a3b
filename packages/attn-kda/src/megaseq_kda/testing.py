"""Test helpers: a KDA layer built from a config dict with a fixed seed; a gloo worker counting host reads of
``cu_seqlens`` (gloo workers must import their function by module name)."""

from __future__ import annotations

from typing import Any

import torch

from megaseq.contracts import ContextParallel, ForwardContext
from megaseq.parallel import zigzag_shard
from megaseq.records import ModelDims
from megaseq_kda.config import KDAConfig
from megaseq_kda.layer import KimiDeltaAttention, build
from megaseq_testkit import watch_host_syncs


def build_layer(config: dict[str, Any], d_model: int, seed: int = 0) -> KimiDeltaAttention:
    torch.manual_seed(seed)
    return build(KDAConfig(**config), ModelDims(d_model=d_model, n_layers=2, vocab_size=8), 0)


def host_reads_of_layers(
    config: dict[str, Any], x: torch.Tensor, cu_seqlens: torch.Tensor, n_layers: int, cp: ContextParallel | None = None
) -> int:
    """Forward and backward of ``n_layers`` KDA layers sharing one packed context (``x`` is the rank's share
    under ``cp``); returns how often ``cu_seqlens`` was read to the host."""
    watched, host_reads = watch_host_syncs(cu_seqlens)
    ctx = ForwardContext(cu_seqlens=watched, cp=cp)
    h = x.detach().requires_grad_(True)
    for seed in range(n_layers):
        h = build_layer(config, x.shape[-1], seed=seed)(h, ctx)
    h.square().sum().backward()
    return host_reads()


def host_reads_context_parallel(rank: int, world: int, config: dict[str, Any], x: torch.Tensor, cu: torch.Tensor) -> int:
    """``host_reads_of_layers`` of three layers on this gloo rank's zig-zag share."""
    import torch.distributed as dist

    cp = ContextParallel(group=dist.group.WORLD, rank=rank, world_size=world, seq_len=x.shape[1])
    return host_reads_of_layers(config, zigzag_shard(x, rank, world), cu, 3, cp)
