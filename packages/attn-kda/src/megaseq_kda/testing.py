"""Multi-rank test helper: runs several context-parallel cases in one gloo group (one spawn for all of them,
since starting processes dominates the cost of a small case). It lives in the package so that spawned
workers can import it whatever directory the tests run from."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from megaseq.contracts import ContextParallel, ForwardContext
from megaseq.parallel import zigzag_shard
from megaseq.records import ModelDims
from megaseq_kda.config import KDAConfig
from megaseq_kda.layer import KimiDeltaAttention, build


def build_layer(config: dict[str, Any], d_model: int, seed: int = 0) -> KimiDeltaAttention:
    torch.manual_seed(seed)
    return build(KDAConfig(**config), ModelDims(d_model=d_model, n_layers=2, vocab_size=8), 0)


def context_parallel_cases(
    rank: int, world: int, cases: list[tuple[dict[str, Any], Tensor, Tensor, Tensor | None]]
) -> list[dict[str, Any]]:
    """For each ``(config, x, grad_out, cu_seqlens)``: this rank's output and input gradient, and the
    parameter gradients summed over the group, with ``x`` zig-zag sharded over the ``world`` ranks."""
    # several ranks share few cores: intra-op threads would only spin against each other
    torch.set_num_threads(1)
    results = []
    for config, x, grad_out, cu_seqlens in cases:
        layer = build_layer(config, x.shape[-1])
        x_local = zigzag_shard(x, rank, world).detach().requires_grad_(True)
        cp = ContextParallel(group=dist.group.WORLD, rank=rank, world_size=world, seq_len=x.shape[1])
        out = layer(x_local, ForwardContext(cu_seqlens=cu_seqlens, cp=cp))
        (out * zigzag_shard(grad_out, rank, world)).sum().backward()
        grads = {}
        for name, p in layer.named_parameters():
            dist.all_reduce(p.grad)
            grads[name] = p.grad
        results.append({"out": out.detach(), "x_grad": x_local.grad, "param_grads": grads})
    return results
