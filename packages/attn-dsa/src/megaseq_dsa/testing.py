"""Helpers for this package's multi-process tests: spawned gloo workers must import them by module name."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

import megaseq_dsa.ops
import megaseq_dsa.ops.native
from megaseq.contracts import TensorParallel
from megaseq.documents import Documents
from megaseq.records import ModelDims
from megaseq_dsa.config import DSAConfig
from megaseq_dsa.layer import DeepSeekSparseAttention
from megaseq_testkit import build_component
from megaseq_testkit.attention import cp_rank_step


def build_layer(config: dict[str, Any], d_model: int, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return build_component("attention", "dsa", config, ModelDims(d_model=d_model, n_layers=2, vocab_size=8))


@contextmanager
def recorded_selections() -> Iterator[list[tuple[int, int]]]:
    """Records (queries, keys) of every ``select_topk`` call the layer makes inside the block, by the torch or
    the native backend (each looks its function up in its module, ``megaseq_dsa.ops`` or
    ``megaseq_dsa.ops.native``, at each call)."""
    calls: list[tuple[int, int]] = []
    modules = [megaseq_dsa.ops, megaseq_dsa.ops.native]
    originals = [module.select_topk for module in modules]

    def recorder(select: Any) -> Any:
        def recording(q_idx: Tensor, k_idx: Tensor, *args: Any, **kwargs: Any) -> Tensor:
            calls.append((q_idx.shape[1], k_idx.shape[1]))
            return select(q_idx, k_idx, *args, **kwargs)

        return recording

    for module, select in zip(modules, originals, strict=True):
        module.select_topk = recorder(select)
    try:
        yield calls
    finally:
        for module, select in zip(modules, originals, strict=True):
            module.select_topk = select


def context_parallel_cases(
    rank: int, world: int, cases: list[tuple[dict[str, Any], Tensor, Tensor, Tensor | None]]
) -> list[dict[str, Any]]:
    """Core's per-rank context-parallel step for each (config, x, grad_out, cu_seqlens), plus the
    (queries, keys) of every selection call the layer made."""
    results = []
    for config, x, grad_out, cu_seqlens in cases:
        with recorded_selections() as selections:
            result = cp_rank_step(build_layer(config, x.shape[-1]), x, grad_out, cu_seqlens, rank, world)
        results.append({**result, "selections": selections})
    return results


class _OwnHeadsTarget(DeepSeekSparseAttention):
    """A wrong tensor-parallel DSA: each rank's indexer loss takes the attention of its own main heads as the
    target, never summed over the ranks (its target's sum runs in a group of this rank alone; the other ranks'
    blocks are walked as usual). tests/test_tensor_parallel.py shows that the conformance check catches it."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        import torch.distributed as dist

        # new_group is collective: every rank makes every one-rank group, in the same order, and keeps its own
        self._alone = [dist.new_group([r]) for r in range(dist.get_world_size())] if dist.is_initialized() else []

    def _indexer_kl(self, q_idx: Tensor, k_idx: Tensor, weights: Tensor, q: Tensor, key: Tensor, query_pos: Tensor,
                    documents: Documents | None, indices: Tensor | None, tp: TensorParallel | None) -> Tensor:
        alone = None if tp is None else dataclasses.replace(tp, group=self._alone[tp.rank])
        return super()._indexer_kl(q_idx, k_idx, weights, q, key, query_pos, documents, indices, alone)


def build_own_heads_target(config: dict[str, Any], dims: ModelDims, layer_idx: int) -> nn.Module:
    return _OwnHeadsTarget(dims.d_model, DSAConfig(**config), dims.n_layers, dims.tp_size)


def tp_saved_bytes(rank: int, world: int, config: dict[str, Any], d_model: int, lengths: list[int]) -> list[int]:
    """Bytes autograd keeps for backward (parameters aside) on tensor-parallel rank ``rank`` of ``world`` for one
    forward over each of ``lengths`` gathered tokens (the rank's chunk of each)."""
    import torch.distributed as dist

    from megaseq.contracts import ForwardContext

    torch.manual_seed(0)
    dims = ModelDims(d_model=d_model, n_layers=2, vocab_size=8, tp_rank=rank, tp_size=world)
    layer = build_component("attention", "dsa", config, dims)
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    tp = TensorParallel(group=dist.group.WORLD, rank=rank, world_size=world)
    out = []
    for length in lengths:
        storages: dict[int, int] = {}

        def pack(t: Tensor, storages: dict[int, int] = storages) -> Tensor:
            if t.untyped_storage().data_ptr() not in params:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        x = torch.randn(1, length // world, d_model, requires_grad=True)
        ctx = ForwardContext(tp=tp)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = layer(x, ctx)
        out.append(sum(storages.values()))
        del y, ctx
    return out


def tp_collective_bytes(rank: int, world: int, config: dict[str, Any], d_model: int, lengths: list[int]) -> list[int]:
    """Bytes tensor-parallel rank ``rank`` of ``world`` hands to collectives in one forward and backward of the
    layer over each of ``lengths`` gathered tokens (the rank's chunk of each)."""
    import torch.distributed as dist

    from megaseq.contracts import ForwardContext
    from megaseq_testkit import count_collective_bytes

    torch.manual_seed(0)
    dims = ModelDims(d_model=d_model, n_layers=2, vocab_size=8, tp_rank=rank, tp_size=world)
    layer = build_component("attention", "dsa", config, dims)
    tp = TensorParallel(group=dist.group.WORLD, rank=rank, world_size=world)
    out = []
    for length in lengths:
        x = torch.randn(1, length // world, d_model, requires_grad=True)
        with count_collective_bytes() as sent:
            ctx = ForwardContext(tp=tp)
            y = layer(x, ctx)
            torch.autograd.backward([y, *ctx.losses.values()], [torch.ones_like(y), *(torch.ones(()) for _ in ctx.losses)])
        out.append(sum(sent.values()))
    return out
