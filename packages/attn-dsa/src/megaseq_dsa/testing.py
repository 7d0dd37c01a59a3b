"""Helpers for this package's multi-process tests: spawned gloo workers must import them by module name."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

import megaseq_dsa.layer
from megaseq.contracts import ContextParallel, ForwardContext
from megaseq.parallel import zigzag_shard
from megaseq.records import ModelDims
from megaseq.testing import build_component


def build_layer(config: dict[str, Any], d_model: int, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return build_component("attention", "dsa", config, ModelDims(d_model=d_model, n_layers=2, vocab_size=8))


@contextmanager
def recorded_selections() -> Iterator[list[tuple[int, int]]]:
    """Records (queries, keys) of every torch ``select_topk`` call the layer makes inside the block."""
    calls: list[tuple[int, int]] = []
    select = megaseq_dsa.layer.select_topk

    def recording(q_idx: Tensor, k_idx: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        calls.append((q_idx.shape[1], k_idx.shape[1]))
        return select(q_idx, k_idx, *args, **kwargs)

    megaseq_dsa.layer.select_topk = recording
    try:
        yield calls
    finally:
        megaseq_dsa.layer.select_topk = select


def context_parallel_cases(
    rank: int, world: int, cases: list[tuple[dict[str, Any], Tensor, Tensor, Tensor | None]]
) -> list[dict[str, Any]]:
    """For each (config, x, grad_out, cu_seqlens): this rank's output and input gradient, and the parameter
    gradients and indexer loss summed over the group, after backward of ``(out * grad_out).sum() + loss``;
    and the (queries, keys) of the layer's selection calls."""
    results = []
    for config, x, grad_out, cu_seqlens in cases:
        layer = build_layer(config, x.shape[-1])
        x_local = zigzag_shard(x, rank, world).detach().requires_grad_(True)
        cp = ContextParallel(group=dist.group.WORLD, rank=rank, world_size=world, seq_len=x.shape[1])
        ctx = ForwardContext(cu_seqlens=cu_seqlens, cp=cp)
        with recorded_selections() as selections:
            out = layer(x_local, ctx)
        loss = ctx.losses["dsa_indexer"]
        ((out * zigzag_shard(grad_out, rank, world)).sum() + loss).backward()
        grads = {}
        for name, p in layer.named_parameters():
            grads[name] = p.grad if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(grads[name])
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        results.append(
            {
                "out": out.detach(),
                "x_grad": x_local.grad,
                "param_grads": grads,
                "loss": loss,
                "selections": selections,
            }
        )
    return results
