"""Causal softmax attention, the reference token mixer.

Paths, all exact: plain rows use ``scaled_dot_product_attention(is_causal=True)``; packed rows run each
document separately (no ``T x T`` mask); decoding appends to a key/value cache. On CUDA with fp16/bf16
and flash-attn installed, plain and packed rows use flash-attn (varlen for packed).

Context parallelism all-gathers keys and values (autograd-aware), then attends each run of a local segment's
queries that lie in one document to that document's keys up to them (:func:`context_runs`): the queries are
the last of their keys, a lower-right-aligned causal pattern (:func:`attend_lower_right`). On CUDA that is one
flash or memory-efficient kernel call per run; elsewhere blocks of queries whose mask and score tile stay
under ``TILE_SCORE_BYTES``, each recomputed in backward. Memory grows linearly with the sequence: no
``[T / cp, T]`` mask or score tensor exists.

Tensor parallelism: a rank holds ``n_heads / tp`` heads (the ``qkv`` rows of its heads, each head's q, k and v
rows together, and the matching ``out`` columns); it gathers the sequence chunks, attends with its heads over
the whole sequence and reduce-scatters its partial output (``megaseq.contracts.TensorParallel``). Decoding
(tensor parallelism without sequence parallelism) caches the keys and values of the rank's heads only.

Sequence tiles (``megaseq.contracts.SequenceTiling``): a tile's queries attend to the rotated keys and the
values of every earlier tile (its carry) and of itself, in blocks of queries whose ``[block x keys]`` score
tile stays under ``TILE_SCORE_BYTES``; each block is recomputed in backward, so no mask or score tile is kept.
"""

from __future__ import annotations

import importlib.util
import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from megaseq.contracts import ForwardContext, Tile
from megaseq.documents import Documents, as_documents
from megaseq.parallel import gather_sequence, tp_gather, tp_reduce_scatter
from megaseq.records import MemoryEstimate, ModelDims, TileCarry
from megaseq.rotary import rotary

from .config import SDPAConfig

HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None
# The largest [batch x heads x queries x keys] fp32 score tile of one block of a sequence tile's queries.
TILE_SCORE_BYTES = 64 * 2**20


@dataclass
class KVCache:
    k: Tensor  # [B, H, L, D]
    v: Tensor

    @property
    def length(self) -> int:
        return self.k.shape[2]


class SDPAttention(nn.Module):
    def __init__(self, d_model: int, config: SDPAConfig, n_layers: int, tp_size: int = 1) -> None:
        super().__init__()
        if config.n_heads % tp_size:
            raise ValueError(f"attention.sdpa: n_heads {config.n_heads} is not a multiple of tp {tp_size}")
        self.n_heads = config.n_heads // tp_size  # this rank's heads
        self.head_dim = config.head_dim or d_model // config.n_heads
        if self.head_dim % 2 and config.rope:
            raise ValueError(f"attention.sdpa: head_dim must be even with rope = true, got {self.head_dim}")
        self.rope = config.rope
        self.theta = config.rope_theta
        width = self.n_heads * self.head_dim
        self.qkv = nn.Linear(d_model, 3 * width, bias=False)
        self.out = nn.Linear(width, d_model, bias=False)
        nn.init.normal_(self.qkv.weight, std=0.02)
        nn.init.normal_(self.out.weight, std=0.02 / (2 * n_layers) ** 0.5)

    def init_cache(self, batch_size: int, *, device: torch.device, dtype: torch.dtype) -> KVCache:
        empty = torch.zeros(batch_size, self.n_heads, 0, self.head_dim, device=device, dtype=dtype)
        return KVCache(empty, empty.clone())

    def _rope(self, x: Tensor, positions: Tensor) -> Tensor:
        return rotary(x, positions, self.theta) if self.rope else x

    def _qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, self.n_heads, 3, self.head_dim).unbind(3)  # [B, T, H, D] each
        return q, k, v

    def forward(self, x: Tensor, ctx: ForwardContext, cache: KVCache | None = None) -> Tensor:
        if ctx.tp is not None:
            x = tp_gather(x, ctx.tp)
        b, t, _ = x.shape
        q, k, v = self._qkv(x)
        if cache is not None:
            if ctx.cu_seqlens is not None or ctx.cp is not None or (ctx.tp and ctx.tp.sequence_parallel):
                raise ValueError("sdpa: a decoding cache cannot be combined with packing or context or sequence parallelism")
            o = self._decode(q, k, v, cache)
        elif ctx.cp is not None:
            o = self._context_parallel(q, k, v, ctx)
        elif ctx.documents is not None:
            o = self._packed(q, k, v, as_documents(ctx.documents, batch=b, length=t, who="sdpa: cu_seqlens"))
        else:
            pos = torch.arange(t, device=x.device)
            o = self._causal(self._rope(q, pos), self._rope(k, pos), v)
        out = self.out(o.reshape(b, t, -1))
        return out if ctx.tp is None else tp_reduce_scatter(out, ctx.tp)

    def _causal(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if q.is_cuda and HAS_FLASH_ATTN and q.dtype in (torch.float16, torch.bfloat16):
            from flash_attn import flash_attn_func

            return flash_attn_func(q, k, v, causal=True)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return o.transpose(1, 2)

    def _packed(self, q: Tensor, k: Tensor, v: Tensor, documents: Documents) -> Tensor:
        pos = documents.positions_in_doc(q.device)
        q, k = self._rope(q, pos), self._rope(k, pos)
        if q.is_cuda and HAS_FLASH_ATTN and q.dtype in (torch.float16, torch.bfloat16):
            from flash_attn import flash_attn_varlen_func

            cu = documents.on(q.device, torch.int32)
            longest = max(documents.lengths)
            return flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, longest, longest, causal=True)[None]
        parts = [self._causal(q[:, s:e], k[:, s:e], v[:, s:e]) for s, e in documents.bounds if e > s]
        return torch.cat(parts, dim=1)

    def _decode(self, q: Tensor, k: Tensor, v: Tensor, cache: KVCache) -> Tensor:
        start, t = cache.length, q.shape[1]
        pos = torch.arange(start, start + t, device=q.device)
        q, k = self._rope(q, pos), self._rope(k, pos)
        cache.k = torch.cat([cache.k, k.transpose(1, 2)], dim=2)
        cache.v = torch.cat([cache.v, v.transpose(1, 2)], dim=2)
        key_pos = torch.arange(cache.length, device=q.device)
        mask = key_pos[None, :] <= pos[:, None]  # [T, L]: a query sees the cache and the new tokens up to itself
        o = F.scaled_dot_product_attention(q.transpose(1, 2), cache.k, cache.v, attn_mask=mask)
        return o.transpose(1, 2)

    def forward_tile(
        self, x: Tensor, ctx: ForwardContext, tile: Tile, history: list[tuple[Tensor, ...]]
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        """Tokens ``[tile.start, tile.stop)`` given the earlier tiles' rotated keys and values (``SequenceTiling``)."""
        if ctx.cp is not None or ctx.tp is not None:
            raise ValueError("sdpa: sequence tiles run without context parallelism or tensor parallelism")
        b, t, _ = x.shape
        q, k, v = self._qkv(x)
        positions = torch.arange(tile.start, tile.stop, device=x.device)
        doc_start = torch.zeros_like(positions)
        if ctx.documents is not None:
            documents = as_documents(ctx.documents, batch=b, length=tile.seq_len, who="sdpa: cu_seqlens")
            doc_start = documents.starts(x.device)[tile.start : tile.stop]
        q, k = self._rope(q, positions - doc_start), self._rope(k, positions - doc_start)
        keys = torch.cat([*(h[0] for h in history), k], dim=1)
        values = torch.cat([*(h[1] for h in history), v], dim=1)
        o = attend_suffix(q, keys, values, doc_start)
        # copies: k and v are views of the tile's whole q/k/v projection, which the carry would keep alive
        return self.out(o.reshape(b, t, -1)), (k.clone(), v.clone())

    def _context_parallel(self, q: Tensor, k: Tensor, v: Tensor, ctx: ForwardContext) -> Tensor:
        cp = ctx.cp
        assert cp is not None
        q_pos = cp.positions(q.device)
        if ctx.documents is not None:
            documents = as_documents(ctx.documents, batch=q.shape[0], length=cp.seq_len, who="sdpa: cu_seqlens")
            offsets = documents.offsets
            rope_pos = documents.positions_in_doc(q.device)[q_pos]
        else:
            offsets, rope_pos = (0, cp.seq_len), q_pos
        q, k = self._rope(q, rope_pos), self._rope(k, rope_pos)
        # differentiable gathers: key/value gradients flow back to the ranks that own those positions
        k_all, v_all = gather_sequence(k, cp), gather_sequence(v, cp)
        parts = [
            attend_lower_right(q[:, local : local + (stop - start)], k_all[:, first:stop], v_all[:, first:stop])
            for local, start, stop, first in context_runs(cp.segments(), offsets)
        ]
        return torch.cat(parts, dim=1)


def context_runs(segments: list[tuple[int, int]], offsets: tuple[int, ...]) -> list[tuple[int, int, int, int]]:
    """The local queries cut where a segment or a document ends: ``(local index, start, stop, first key)`` per
    run, in local order; queries ``[start, stop)`` (global positions) all see keys ``first .. themselves``, where
    ``first`` is their document's start. ``segments``: the rank's global ``[start, end)`` in local order;
    ``offsets``: the documents' boundaries (``cu_seqlens`` on the host), covering the whole sequence."""
    runs, local = [], 0
    for seg_start, seg_end in segments:
        for doc_start, doc_end in itertools.pairwise(offsets):
            start, stop = max(seg_start, doc_start), min(seg_end, doc_end)
            if start < stop:
                runs.append((local + start - seg_start, start, stop, doc_start))
        local += seg_end - seg_start
    return runs


def attend_lower_right(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Causal attention of the last ``n`` of ``m`` positions: ``q [B, n, H, D]``, ``k, v [B, m, H, D]``; query
    ``i`` sees keys ``0 .. m - n + i``. On CUDA (and whenever ``n == m``, plain ``is_causal``) one kernel call
    without a mask; elsewhere blocks of queries whose ``[block x keys]`` mask and score tile stay under
    ``TILE_SCORE_BYTES``, each recomputed in backward, so that only the inputs are kept for it."""
    b, n, h, _ = q.shape
    m = k.shape[1]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    block = n if q.is_cuda or n == m else max(1, TILE_SCORE_BYTES // (4 * b * h * m))
    recompute = block < n and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    parts = []
    for q0 in range(0, n, block):
        q1 = min(q0 + block, n)
        args = (q[:, :, q0:q1], k[:, :, : m - n + q1], v[:, :, : m - n + q1])  # the keys this block can see
        parts.append(checkpoint(_lower_right_attention, *args, use_reentrant=False) if recompute else _lower_right_attention(*args))
    return torch.cat(parts, dim=2).transpose(1, 2)


def _lower_right_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """``q [B, H, n, D]`` against ``k, v [B, H, m, D]``, query ``i`` seeing keys ``0 .. m - n + i``. The pattern
    is made here, not passed in, so that a recomputed block keeps no mask for backward."""
    n, m = q.shape[2], k.shape[2]
    if n == m:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if q.is_cuda:  # torch's flash or memory-efficient kernel takes the lower-right pattern without a mask
        # imported here: the module pulls in triton, which a component's import (megaseq plugins --check) must not
        from torch.nn.attention.bias import causal_lower_right

        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(n, m))
    mask = torch.ones(n, m, dtype=torch.bool, device=q.device).tril(m - n)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def attend_suffix(q: Tensor, k: Tensor, v: Tensor, first_key: Tensor) -> Tensor:
    """Causal attention of the last ``n`` of ``m`` positions: ``q [B, n, H, D]``, ``k, v [B, m, H, D]``; query
    ``i`` sees keys ``first_key[i] .. m - n + i`` (``first_key``: its document's start). Queries run in blocks
    whose score tile stays under ``TILE_SCORE_BYTES``, each recomputed in backward."""
    b, n, h, _ = q.shape
    m = k.shape[1]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    block = max(1, TILE_SCORE_BYTES // (4 * b * h * m))
    recompute = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    parts = []
    for q0 in range(0, n, block):
        q1 = min(q0 + block, n)
        k0, k1 = int(first_key[q0:q1].min()), m - n + q1  # the keys this block can see
        key_pos = torch.arange(k0, k1, device=q.device)
        query_pos = torch.arange(m - n + q0, m - n + q1, device=q.device)
        mask = (key_pos[None, :] <= query_pos[:, None]) & (key_pos[None, :] >= first_key[q0:q1, None])
        args = (q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], mask)
        parts.append(checkpoint(_masked_attention, *args, use_reentrant=False) if recompute else _masked_attention(*args))
    return torch.cat(parts, dim=2).transpose(1, 2)


def _masked_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def build(config: SDPAConfig, dims: ModelDims, layer_idx: int) -> SDPAttention:
    return SDPAttention(dims.d_model, config, dims.n_layers, dims.tp_size)


def memory_estimate(config: SDPAConfig, dims: ModelDims, seq_len: int) -> MemoryEstimate:
    if config.n_heads % dims.tp_size:
        raise ValueError(f"attention.sdpa: n_heads {config.n_heads} is not a multiple of tp {dims.tp_size}")
    heads = config.n_heads // dims.tp_size  # this rank's, over the gathered sequence under tensor parallelism
    head_dim = config.head_dim or dims.d_model // config.n_heads
    width = heads * head_dim
    # saved per token (fp32, measured with saved-tensor hooks): the input, the q/k/v projection, the attention
    # output and one logsumexp per head; with RoPE also the rotated q and k and the cos/sin tables of both.
    # Temporary: backward's gradients of q, k and v (the kernel's, then rotated back) and their stacked qkv
    # gradient, 6 floats per channel (measured with the test kit's transient_bytes).
    rope = 2 * width + 2 * head_dim if config.rope else 0
    return MemoryEstimate(
        parameters=4 * dims.d_model * width * 4,
        saved_per_token=(dims.d_model + 4 * width + rope + heads) * 4,
        temporary=24 * width * seq_len,
        # a tile hands on its rotated keys and its values; each block of a tile's queries (attend_suffix) builds
        # a boolean mask over the keys it sees, which scaled_dot_product_attention turns into a float one, for at
        # most TILE_SCORE_BYTES / (4 x heads x rows) query-key pairs: ~12 bytes a pair at the peak, in forward
        # and in the recomputing backward (measured, 4k tokens in 1k tiles: tests/test_plan_accuracy.py)
        tiling=TileCarry(per_token=2 * width * 4, temporary=12 * TILE_SCORE_BYTES // (4 * heads)),
    )
