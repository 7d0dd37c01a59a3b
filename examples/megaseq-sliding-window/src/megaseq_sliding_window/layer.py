"""Sliding-window causal attention, computed blockwise so that memory is O(T * window), never O(T^2).

Query ``i`` (global position ``p_i``) attends to the keys at positions ``p_i - window + 1 .. p_i`` that lie in
its own document. Queries are processed in blocks; a block of queries at positions ``[a, b)`` only ever
touches the keys at ``[a - window + 1, b)``, so each block's score matrix is ``block x (block + window - 1)``.

- Packing (``ctx.cu_seqlens``): keys of another document are masked, and RoPE positions restart at every
  document start, so a packed row equals its documents run separately.
- Decoding: the cache keeps at most the last ``window`` keys/values (already rotated) and the number of
  tokens seen.
- Context parallelism (``ctx.cp``, zig-zag): keys/values are all-gathered over ``ctx.cp.group`` with core's
  autograd-aware ``megaseq.parallel.gather_sequence`` (the gradient of every key returns to its owner), and
  the local queries attend at their global positions. Exact, at the cost of holding the full sequence's
  keys/values on every rank.

Document layout comes from ``ctx.documents`` (core's ``megaseq.documents.Documents``, computed once per batch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from megaseq.contracts import ForwardContext
from megaseq.documents import as_documents
from megaseq.dtypes import compute_dtype
from megaseq.parallel import gather_sequence
from megaseq.records import MemoryEstimate, ModelDims
from megaseq_sliding_window.config import SlidingWindowConfig


def default_block_size(window: int) -> int:
    return min(max(window, 64), 512)


# --------------------------------------------------------------------------------------------------- kernel


def sliding_window_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    window: int,
    runs: list[tuple[int, int, int]],
    k_start: int = 0,
    q_doc: Tensor | None = None,
    k_doc: Tensor | None = None,
    block_size: int | None = None,
) -> Tensor:
    """Blockwise banded causal softmax attention.

    ``q [B, H, Tq, D]``; ``k, v [B, H, Tk, D]`` where key ``j`` sits at global position ``k_start + j``.
    ``runs``: the queries as contiguous runs ``(query_index, first_position, length)`` covering ``0 .. Tq``
    in order (one run normally, two under zig-zag context parallelism). ``q_doc [Tq]`` / ``k_doc [Tk]``:
    optional document ids; a query only sees keys of its own document. Every query must find its own
    position among the keys (so no row is empty).
    """
    block = block_size or default_block_size(window)
    scale = 1.0 / math.sqrt(q.shape[-1])
    device = q.device
    outs: list[Tensor] = []
    for q_index, first, length in runs:
        for s in range(0, length, block):
            e = min(length, s + block)
            pa, pb = first + s, first + e  # global positions of this block's queries
            klo = max(pa - window + 1, k_start)
            if pb - k_start > k.shape[2] or klo > pa:
                raise ValueError(f"sliding-window: keys at positions [{klo}, {pb}) are not available")
            qs = slice(q_index + s, q_index + e)
            ks = slice(klo - k_start, pb - k_start)
            scores = torch.matmul(q[:, :, qs], k[:, :, ks].transpose(-1, -2)) * scale  # [B, H, bq, bk]
            diff = torch.arange(pa, pb, device=device)[:, None] - torch.arange(klo, pb, device=device)[None, :]
            allowed = (diff >= 0) & (diff < window)
            if q_doc is not None and k_doc is not None:
                allowed = allowed & (q_doc[qs, None] == k_doc[None, ks])
            scores = scores.masked_fill(~allowed, float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=compute_dtype(scores.dtype)).to(v.dtype)
            outs.append(torch.matmul(probs, v[:, :, ks]))
    if not outs:
        return q.new_zeros(q.shape)
    return torch.cat(outs, dim=2)


def rope(x: Tensor, positions: Tensor, base: float) -> Tensor:
    """Rotary embedding (rotate-half form) of ``x [B, H, T, D]`` at integer ``positions [T]``."""
    half = x.shape[-1] // 2
    dtype = compute_dtype(x.dtype)
    freqs = base ** (-torch.arange(half, device=x.device, dtype=dtype) / half)
    angles = positions.to(dtype)[:, None] * freqs[None, :]  # [T, D/2]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


# ------------------------------------------------------------------------------------------------- module


@dataclass
class SlidingWindowCache:
    """Decoding state: the last (at most ``window``) rotated keys and values, and how many tokens it has seen."""

    k: Tensor  # [B, H, L, D]
    v: Tensor
    seen: int = 0


class SlidingWindowAttention(nn.Module):
    def __init__(self, config: SlidingWindowConfig, d_model: int) -> None:
        super().__init__()
        if d_model % config.n_heads:
            raise ValueError(f"sliding-window: d_model {d_model} is not a multiple of n_heads {config.n_heads}")
        self.n_heads = config.n_heads
        self.head_dim = d_model // config.n_heads
        if config.rope and self.head_dim % 2:
            raise ValueError(f"sliding-window: RoPE needs an even head dim, got {self.head_dim} (set rope = false)")
        self.window = config.window
        self.use_rope = config.rope
        self.rope_base = config.rope_base
        self.block_size = config.block_size
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)

    def extra_repr(self) -> str:
        return f"n_heads={self.n_heads}, window={self.window}, rope={self.use_rope}"

    def init_cache(self, batch_size: int, *, device: torch.device, dtype: torch.dtype) -> SlidingWindowCache:
        empty = torch.zeros(batch_size, self.n_heads, 0, self.head_dim, device=device, dtype=dtype)
        return SlidingWindowCache(k=empty, v=empty.clone(), seen=0)

    def _qkv(self, x: Tensor, rope_positions: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # [B, H, T, D]
        if self.use_rope and rope_positions is not None:
            q, k = rope(q, rope_positions, self.rope_base), rope(k, rope_positions, self.rope_base)
        return q, k, v

    def _merge(self, y: Tensor) -> Tensor:
        b, _, t, _ = y.shape
        return self.out(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))

    def forward(self, x: Tensor, ctx: ForwardContext, cache: SlidingWindowCache | None = None) -> Tensor:
        if cache is not None:
            if ctx.cu_seqlens is not None or ctx.cp is not None:
                raise ValueError(
                    "sliding-window: a decoding cache cannot be combined with packing or context parallelism"
                )
            return self._decode(x, cache)
        t = x.shape[1]
        cp = ctx.cp
        total = cp.seq_len if cp is not None else t
        if cp is not None and t * cp.world_size != total:
            raise ValueError(f"sliding-window: local length {t} x {cp.world_size} ranks != cp.seq_len {total}")
        device = x.device
        q_pos = cp.positions(device) if cp is not None else torch.arange(t, device=device)

        q_doc = k_doc = None
        rope_pos = q_pos
        if ctx.documents is not None:
            documents = as_documents(ctx.documents, batch=x.shape[0], length=total, who="sliding-window: cu_seqlens")
            k_doc = documents.doc_ids(device)
            q_doc = k_doc[q_pos]
            rope_pos = documents.positions_in_doc(device)[q_pos]  # RoPE restarts at every document start

        q, k, v = self._qkv(x, rope_pos)
        if cp is None:
            runs = [(0, 0, t)]
        else:
            k, v = gather_sequence(k, cp, dim=2), gather_sequence(v, cp, dim=2)
            n = cp.segment_len
            runs = [(i * n, a, b - a) for i, (a, b) in enumerate(cp.segments())]
        y = sliding_window_attention(
            q, k, v, window=self.window, runs=runs, q_doc=q_doc, k_doc=k_doc, block_size=self.block_size
        )
        return self._merge(y)

    def _decode(self, x: Tensor, cache: SlidingWindowCache) -> Tensor:
        t = x.shape[1]
        seen, kept = cache.seen, cache.k.shape[2]
        positions = torch.arange(seen, seen + t, device=x.device)
        q, k, v = self._qkv(x, positions)
        k_all = torch.cat([cache.k.to(k.dtype), k], dim=2)
        v_all = torch.cat([cache.v.to(v.dtype), v], dim=2)
        y = sliding_window_attention(
            q, k_all, v_all, window=self.window, runs=[(0, seen, t)], k_start=seen - kept, block_size=self.block_size
        )
        cache.k = k_all[:, :, -self.window :].contiguous()
        cache.v = v_all[:, :, -self.window :].contiguous()
        cache.seen = seen + t
        return self._merge(y)


def build(config: SlidingWindowConfig, dims: ModelDims, layer_idx: int) -> SlidingWindowAttention:
    return SlidingWindowAttention(config, dims.d_model)


def memory_estimate(config: SlidingWindowConfig, dims: ModelDims, seq_len: int) -> MemoryEstimate:
    """Bytes at fp32: 4 d^2 weights; per token autograd keeps x, q, k, v, the attention output and one row of
    probabilities/masks per head (``block + window - 1`` keys). The largest transient working set: in forward,
    one block's scores and the ~4 tensors made from them (their scale, mask, probabilities), in backward, the
    gradients of every block's slice of q, k and v, which autograd makes sequence-long before it sums them
    (~7 x d_model floats per token)."""
    d, h = dims.d_model, config.n_heads
    block = min(config.block_size or default_block_size(config.window), seq_len)
    keys = min(block + config.window - 1, seq_len)
    per_token = 4.0 * (6 * d + 2 * h * keys) + h * keys  # floats (x, qkv, y, out-proj input, probs) + bool mask
    temporary = 4 * max(5 * h * block * keys, 7 * d * seq_len)
    return MemoryEstimate(parameters=4 * 4 * d * d, saved_per_token=per_token, temporary=temporary)
