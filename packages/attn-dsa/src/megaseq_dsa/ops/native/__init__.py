"""DSA's top-k selection, sparse attention and indexer KL on CPU in C (``select.c``, ``sparse.c``): the
``native`` backend.

Selection: ``megaseq_dsa.ops.select_topk``'s arguments, candidates (``pooled_candidates``), tie rule and
output (``expand_rows``), the k best blocks of each query found by ``select.c`` (its comment says how) in
blocks of ``SELECT_ROWS`` queries; fp32 scores only (``scores="bf16"`` and other dtypes run the PyTorch path).
Its scores are summed in another order than the PyTorch path's matmul, so a key whose score ties another's to
fp32 rounding may be chosen differently; with exactly representable scores both choose the same keys.

Attention:the same arguments and results as ``megaseq_dsa.ops.sparse`` (the oracle it is tested against; its
docstring has the maths), computed one query at a time by the compiled kernels, each selected row read in
place instead of gathered into a chunk buffer. fp32 inside: bf16 inputs are converted, float64 inputs run the
PyTorch path (the kernels are fp32 only). What is saved for backward is what the PyTorch path saves.

Threads: the queries are split into ``torch.get_num_threads()`` contiguous ranges run at once on core's
pool of kernel threads (``megaseq.native.run_at_once``; ctypes releases the GIL). The gradients of the key
rows (the attention's in backward, the indexer keys' in forward) are sums over queries: each extra thread adds
into its own copy of them, summed at the end, and a pass takes only as many threads as fit
``ROW_GRADIENT_BYTES`` of such copies (at long lengths a pass runs on one thread rather than copy a
sequence's worth of rows per thread).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megaseq.documents import as_documents
from megaseq.native import ranges, run_at_once
from megaseq_dsa.ops import indexer as indexer_path
from megaseq_dsa.ops import sparse as reference_path
from megaseq_dsa.ops.indexer import (
    check_index_inputs,
    check_topk_and_pool,
    expand_rows,
    pooled_candidates,
    selected_slots,
)
from megaseq_dsa.ops.native.build import library, unavailable
from megaseq_dsa.ops.sparse import (
    check_attention_inputs,
    check_indexer_inputs,
    values_are_key_columns,
    with_given_gradient,
)

# Queries selected per call of the kernels (and per ``expand_rows``, whose buffers grow with it).
SELECT_ROWS = 1024
# Queries scored together by select.c (its QUERIES).
_SELECT_QUERIES = 4
# A group of queries' scores, kept together while select.c scores a tile of keys for all of them, take about
# this many bytes per thread (more queries per group read the keys from memory fewer times).
SELECT_GROUP_BYTES = 16 * 2**20


def select_group(candidates: int) -> int:
    """Queries per group of select.c for rows of ``candidates`` blocks: a multiple of 4, from 4 to 64."""
    return max(1, min(16, SELECT_GROUP_BYTES // (4 * _SELECT_QUERIES * max(candidates, 1)))) * _SELECT_QUERIES


# The most bytes of per-thread copies of the key rows' gradients a pass may add (module docstring).
ROW_GRADIENT_BYTES = 64 * 2**20


def _run(calls: list[Callable[[], float]]) -> float:
    """Run the calls at once (core's pool of kernel threads); the sum of their results."""
    return sum(run_at_once(calls))


def _threads(rows: int, width: int) -> int:
    """Threads for a pass whose extra threads each need a copy of ``rows x width`` fp32 row gradients."""
    copy = 4 * rows * width
    return max(1, min(torch.get_num_threads(), 1 + (ROW_GRADIENT_BYTES // copy if copy else 0)))


def _ptr(x: torch.Tensor | None) -> int | None:
    return None if x is None else x.data_ptr()


class _Inputs:
    """The kernels' view of the arguments: contiguous fp32 q [B, Tq, H, D], rows kv [B, Tk, W] (k itself when
    v is its leading columns, else [k | v]) with the values at column ``voff``, and int32 indices."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor) -> None:
        self.shared = values_are_key_columns(k, v)
        self.q = q.float().contiguous()
        self.kv = (k if self.shared else torch.cat([k, v], dim=-1)).float().contiguous()
        self.indices = indices.to(torch.int32).contiguous()
        self.batch, self.n_queries, self.heads, self.dim = q.shape
        self.dim_v, self.n_keys, self.width = v.shape[-1], k.shape[1], self.kv.shape[-1]
        self.voff = 0 if self.shared else self.dim
        self.slots = indices.shape[-1]

    def sizes(self) -> tuple[int, ...]:
        return self.heads, self.dim, self.dim_v, self.slots, self.width, self.voff

    def scratch(self, index_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One thread's work floats and index ints (sparse.c's functions say what they hold)."""
        heads, slots = self.heads, self.slots
        floats = (heads + 2 + index_heads) * slots + heads * max(self.dim, self.dim_v) + 2 * heads
        return torch.empty(floats), torch.empty(slots, dtype=torch.int32)


class _NativeSparseAttention(torch.autograd.Function):
    """``megaseq_dsa.ops.sparse.SparseAttention``'s interface: (q, k, v, indices, scale[, q_idx, k_idx,
    weights]) -> (o, lse, kl, dkl/dq_idx, dkl/dk_idx, dkl/dweights); only o is differentiable."""

    @staticmethod
    def forward(ctx: Any, q, k, v, indices, scale: float, q_idx=None, k_idx=None, weights=None):  # type: ignore[override]
        lib, x = library(), _Inputs(q, k, v, indices)
        o = torch.empty(x.batch, x.n_queries, x.heads, x.dim_v)
        lse = torch.empty(x.batch, x.n_queries, x.heads)
        with_kl = q_idx is not None
        index_heads, index_dim = (q_idx.shape[2], q_idx.shape[3]) if with_kl else (0, 0)
        indexer: tuple[torch.Tensor | None, ...] = (None,) * 5
        if with_kl:
            q_idx, k_idx, weights = (t.float().contiguous() for t in (q_idx, k_idx, weights))
            grad_q_idx, grad_weights = torch.empty(q_idx.shape), torch.empty(weights.shape)
            grad_k_idx = torch.zeros(k_idx.shape)
            indexer = (q_idx, k_idx, weights, grad_q_idx, grad_weights)
        parts = ranges(x.n_queries, _threads(x.n_keys, index_dim) if with_kl else torch.get_num_threads())
        scratch = [x.scratch(index_heads) for _ in parts]
        copies = [torch.empty(x.n_keys, index_dim) for _ in parts[1:]] if with_kl else []
        kl = 0.0
        for b in range(x.batch):
            for copy in copies:
                copy.zero_()
            row_grads = [grad_k_idx[b], *copies] if with_kl else [None] * len(parts)

            def call(i: int, b: int = b, row_grads: list = row_grads) -> Callable[[], float]:
                (first, end), (work, sel) = parts[i], scratch[i]
                return lambda: lib.dsa_sparse_forward(
                    first, end, *x.sizes(), _ptr(x.q[b]), _ptr(x.kv[b]), _ptr(x.indices[b]), scale, _ptr(o[b]),
                    _ptr(lse[b]), _ptr(work), _ptr(sel), index_heads, index_dim,
                    *(None if t is None else _ptr(t[b]) for t in indexer), _ptr(row_grads[i]),
                )

            kl += _run([call(i) for i in range(len(parts))])
            for copy in copies:
                grad_k_idx[b] += copy
        o = o.to(q.dtype)
        ctx.save_for_backward(q, k, *([] if x.shared else [v]), indices, o, lse)
        ctx.scale, ctx.shared_dim_v = scale, x.dim_v if x.shared else None
        kl = torch.tensor(kl, dtype=torch.float32)
        kl_grads = [grad_q_idx, grad_k_idx, grad_weights] if with_kl else [q.new_empty(0)] * 3
        ctx.mark_non_differentiable(lse, kl, *kl_grads)
        return o, lse, kl, *kl_grads

    @staticmethod
    def backward(ctx: Any, grad_o: torch.Tensor, *_non_differentiable: Any):  # type: ignore[override]
        if ctx.shared_dim_v is not None:
            q, k, indices, o, lse = ctx.saved_tensors
            v = k[..., : ctx.shared_dim_v]
        else:
            q, k, v, indices, o, lse = ctx.saved_tensors
        lib, x = library(), _Inputs(q, k, v, indices)
        grad_o = grad_o.float().contiguous()
        delta = (grad_o * o.float()).sum(-1).contiguous()  # rowsum(dO * O): [B, Tq, H]
        grad_q = torch.empty(x.q.shape)
        grad_kv = torch.zeros(x.kv.shape)
        parts = ranges(x.n_queries, _threads(x.n_keys, x.width))
        scratch = [x.scratch(0) for _ in parts]
        copies = [torch.empty(x.n_keys, x.width) for _ in parts[1:]]
        for b in range(x.batch):
            for copy in copies:
                copy.zero_()
            row_grads = [grad_kv[b], *copies]

            def call(i: int, b: int = b, row_grads: list = row_grads) -> Callable[[], float]:
                (first, end), (work, sel) = parts[i], scratch[i]

                def run() -> float:
                    lib.dsa_sparse_backward(
                        first, end, *x.sizes(), _ptr(x.q[b]), _ptr(x.kv[b]), _ptr(x.indices[b]), ctx.scale,
                        _ptr(grad_o[b]), _ptr(lse[b]), _ptr(delta[b]), _ptr(grad_q[b]), _ptr(row_grads[i]),
                        _ptr(work), _ptr(sel),
                    )
                    return 0.0

                return run

            _run([call(i) for i in range(len(parts))])
            for copy in copies:
                grad_kv[b] += copy
        grad_k = grad_kv[..., : x.dim].to(k.dtype)
        grad_v = None if x.shared else grad_kv[..., x.dim :].to(v.dtype)
        return grad_q.to(q.dtype), grad_k, grad_v, None, None, None, None, None


@torch.no_grad()
def select_topk(
    q_idx: torch.Tensor, k_idx: torch.Tensor, weights: torch.Tensor, topk: int, cu_seqlens=None, pool: int = 1,
    query_positions: torch.Tensor | None = None, scores: str = "fp32",
) -> torch.Tensor:
    """``megaseq_dsa.ops.select_topk`` by the kernels (module docstring): int32 [B, Tq, slots]."""
    if scores != "fp32" or any(x.dtype != torch.float32 for x in (q_idx, k_idx, weights)):
        return indexer_path.select_topk(q_idx, k_idx, weights, topk, cu_seqlens, pool, query_positions, scores=scores)
    documents = None if cu_seqlens is None else as_documents(cu_seqlens)
    positions = check_index_inputs(q_idx, k_idx, weights, documents, query_positions)
    check_topk_and_pool(topk, pool)
    lib = library()
    batch, n_queries, heads, dim = q_idx.shape
    cand = pooled_candidates(k_idx, positions, documents, pool, torch.float32)
    kept, slots, n = topk // pool, selected_slots(topk, pool), len(cand.block_first)
    n_pad = -(-n // 16) * 16 + 16  # select.c reads whole tiles of 16 keys from any start
    out = torch.full((batch, n_queries, slots), -1, dtype=torch.int32)
    threads = max(1, min(torch.get_num_threads(), n_queries))
    group = select_group(n)
    scratch = [
        (torch.empty(group * max(n, 1)), torch.empty(2 * max(n, 1)),
         torch.empty(_SELECT_QUERIES * heads * (dim + 1) + group * (n // 16 + 1)))
        for _ in range(threads)
    ]
    for b in range(batch):
        keys_t = torch.zeros(dim, n_pad)
        keys_t[:, :n] = cand.keys[b].t()
        q, w = q_idx[b].contiguous(), weights[b].contiguous()
        first, last = cand.first[b].contiguous(), cand.last[b].contiguous()
        for q0 in range(0, n_queries, SELECT_ROWS):
            q1 = min(q0 + SELECT_ROWS, n_queries)
            blocks = torch.empty(q1 - q0, kept, dtype=torch.long)
            # pointers to the block's first query: the kernels index rows from there
            at = [_ptr(x[q0:]) for x in (q, w, first, last)] + [_ptr(keys_t)]

            def call(a: int, z: int, rows: torch.Tensor, work: torch.Tensor, block: torch.Tensor,
                     at: list = at, blocks: torch.Tensor = blocks) -> Callable[[], float]:
                def run() -> float:
                    lib.dsa_select(a, z, heads, dim, at[0], at[1], at[4], n_pad, at[2], at[3], kept, group, _ptr(blocks),
                                   _ptr(rows), _ptr(work), _ptr(block))
                    return 0.0

                return run

            _run([call(a, z, *room) for (a, z), room in zip(ranges(q1 - q0, threads), scratch, strict=False)])
            tails = cand.tail_start[b : b + 1, q0:q1], cand.tail_len[b : b + 1, q0:q1]
            out[b, q0:q1] = expand_rows(blocks[None], cand.block_first, pool, *tails, slots)[0]
    return out


def _native(q: torch.Tensor) -> bool:
    """Whether the kernels take q's dtype (fp32 and bf16; float64 runs the PyTorch path)."""
    return q.dtype in (torch.float32, torch.bfloat16)


def sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, scale: float,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """``megaseq_dsa.ops.sparse_attention`` by the kernels (``chunk_size`` is the PyTorch path's knob: unused)."""
    if not _native(q):
        return reference_path.sparse_attention(q, k, v, indices, scale, chunk_size)
    check_attention_inputs(q, k, v, indices)
    with torch.autocast(q.device.type, enabled=False):
        return _NativeSparseAttention.apply(q, k, v, indices, scale)[0]


def sparse_attention_with_indexer_kl(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, scale: float, q_idx: torch.Tensor,
    k_idx: torch.Tensor, weights: torch.Tensor, chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``megaseq_dsa.ops.sparse_attention_with_indexer_kl`` by the kernels: ``(o, summed indexer KL)``."""
    if not _native(q):
        return reference_path.sparse_attention_with_indexer_kl(q, k, v, indices, scale, q_idx, k_idx, weights,
                                                               chunk_size)
    check_attention_inputs(q, k, v, indices)
    check_indexer_inputs(q, k, q_idx, k_idx, weights)
    indexer = (q_idx, k_idx, weights)
    with torch.autocast(q.device.type, enabled=False):
        o, _, kl, *kl_grads = _NativeSparseAttention.apply(q, k, v, indices, scale, *(t.detach() for t in indexer))
    return o, with_given_gradient(kl, indexer, kl_grads)


__all__ = [
    "ROW_GRADIENT_BYTES", "SELECT_GROUP_BYTES", "SELECT_ROWS", "library", "select_group", "select_topk",
    "sparse_attention", "sparse_attention_with_indexer_kl", "unavailable",
]
