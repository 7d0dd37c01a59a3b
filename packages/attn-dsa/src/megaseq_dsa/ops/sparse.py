"""Sparse MQA attention over gathered key indices, forward and backward in query chunks (pure PyTorch).

Query t attends to the keys listed in indices[b, t] (-1 = padding); all H query heads share one key and one
value per token (MLA in MQA mode), so a chunk of C queries gathers [C, S, D] keys and [C, S, Dv] values once
for all heads and computes scores with one batched matmul [C, H, D] x [C, D, S]. Only one chunk's gathered
keys and values exist at a time, never [T, S, D].

Forward saves q, k, v, indices, o and the per-row logsumexp. Backward recomputes each chunk's probabilities
P = exp(S - lse) flash-attention style:

    dV_g = P^T dO,  dP = dO V_g^T,  dS = P * (dP - rowsum(dO * O)),  dQ = scale dS K_g,  dK_g = scale dS^T Q

and scatter-adds dK_g / dV_g back to the token positions with index_add_. Softmax statistics and
accumulators are fp32 (float64 inputs stay float64). A row without any index outputs 0 (its lse is -inf).
Indices in a row must be distinct (a repeated index would be counted twice); `select_topk` guarantees that.
"""

from __future__ import annotations

import torch

from megaseq_dsa.ops.indexer import compute_dtype

# Gathered K and V of one chunk take about this many bytes. The products per query are tiny ([H, D] x [D, S])
# and bound by memory traffic, so a chunk small enough to stay in cache (a few queries) beats big chunks
# (measured on CPU at S=2048, D=64: 4 queries per chunk ~2x faster than 64), at the cost of more Python steps.
CHUNK_BYTES = 4 * 2**20


def default_chunk_size(batch: int, slots: int, dim: int, dim_v: int, dtype: torch.dtype) -> int:
    """Queries per chunk (per batch element) so that the gathered K and V take about CHUNK_BYTES."""
    per_query = batch * slots * (dim + dim_v) * torch.empty((), dtype=dtype).element_size()
    return max(1, CHUNK_BYTES // max(per_query, 1))


def _gather_chunk(
    kv_flat: torch.Tensor, indices: torch.Tensor, seq_len: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """indices [B, C, S] -> flat rows [B*C*S], gathered [K | V] rows [B*C, S, D + Dv], valid [B*C, 1, S].

    Keys and values are gathered together from kv_flat [B*T, D + Dv]: one row copy of D + Dv numbers per index
    instead of two of D and Dv (the gather is bound by per-row memory traffic, not by arithmetic).
    """
    batch, chunk, slots = indices.shape
    valid = indices >= 0
    # Padding reads row 0 of its sequence; its probability is exactly 0, so it adds nothing anywhere.
    rows = indices.long().clamp_min(0) + torch.arange(batch, device=indices.device)[:, None, None] * seq_len
    rows = rows.view(-1)
    kv = kv_flat.index_select(0, rows).view(batch * chunk, slots, -1).to(dtype)
    return rows, kv, valid.view(batch * chunk, 1, slots)


class SparseAttention(torch.autograd.Function):
    """(q, k, v, indices, scale, chunk_size) -> (o, lse); lse [B, T, H] is not differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, indices, scale: float, chunk_size: int):  # type: ignore[override]
        batch, seq_len, heads, dim = q.shape
        dtype = compute_dtype(q.dtype)
        kv_flat = torch.cat([k, v], dim=-1).view(batch * seq_len, -1)
        o = q.new_empty(batch, seq_len, heads, v.shape[-1])
        lse = torch.empty(batch, seq_len, heads, dtype=dtype, device=q.device)
        for c0 in range(0, seq_len, chunk_size):
            c1 = min(c0 + chunk_size, seq_len)
            _, kv, valid = _gather_chunk(kv_flat, indices[:, c0:c1], seq_len, dtype)
            keys, values = kv[..., :dim], kv[..., dim:]
            q_chunk = q[:, c0:c1].reshape(-1, heads, dim).to(dtype)
            scores = torch.bmm(q_chunk, keys.transpose(1, 2)).mul_(scale).masked_fill_(~valid, float("-inf"))
            row_max = scores.amax(-1, keepdim=True)
            row_max.masked_fill_(row_max == float("-inf"), 0.0)  # empty rows: keep exp(-inf - 0) = 0
            probs = scores.sub_(row_max).exp_()
            row_sum = probs.sum(-1, keepdim=True)
            # A non-empty row holds exp(0) = 1 at its max, so row_sum >= 1 and the clamp only turns the
            # empty rows' 0 / 0 into 0 / 1.
            out = torch.bmm(probs, values).div_(row_sum.clamp_min(1.0))
            o[:, c0:c1] = out.view(batch, c1 - c0, heads, -1).to(o.dtype)
            lse[:, c0:c1] = (row_max + row_sum.log()).view(batch, c1 - c0, heads)
        ctx.save_for_backward(q, k, v, indices, o, lse)
        ctx.scale, ctx.chunk_size = scale, chunk_size
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, grad_o, _grad_lse):  # type: ignore[override]
        q, k, v, indices, o, lse = ctx.saved_tensors
        scale, chunk_size = ctx.scale, ctx.chunk_size
        batch, seq_len, heads, dim = q.shape
        dim_v = v.shape[-1]
        dtype = compute_dtype(q.dtype)
        kv_flat = torch.cat([k, v], dim=-1).view(batch * seq_len, -1)
        grad_q = torch.empty_like(q)
        grad_kv = torch.zeros(kv_flat.shape, dtype=dtype, device=q.device)
        for c0 in range(0, seq_len, chunk_size):
            c1 = min(c0 + chunk_size, seq_len)
            rows, kv, valid = _gather_chunk(kv_flat, indices[:, c0:c1], seq_len, dtype)
            grad_out = grad_o[:, c0:c1].reshape(-1, heads, dim_v).to(dtype)
            out = o[:, c0:c1].reshape(-1, heads, dim_v).to(dtype)
            # Block matrix [[scale q, 0], [0, dO]] [2H, D + Dv]: against the gathered [K | V] rows it gives
            # the scores and dP in one pass over them, and transposed it gives [dK_g | dV_g] in one product.
            factors = q.new_zeros(len(out), 2 * heads, dim + dim_v, dtype=dtype)
            factors[:, :heads, :dim] = q[:, c0:c1].reshape(-1, heads, dim) * scale
            factors[:, heads:, dim:] = grad_out
            scores, grad_probs = torch.bmm(factors, kv.transpose(1, 2)).split(heads, dim=1)
            # Empty rows have lse = -inf; 0 there makes exp(-inf - 0) = 0 instead of NaN.
            row_lse = lse[:, c0:c1].reshape(-1, heads, 1)
            row_lse = row_lse.masked_fill(row_lse == float("-inf"), 0.0)
            probs = scores.masked_fill_(~valid, float("-inf")).sub_(row_lse).exp_()
            delta = (grad_out * out).sum(-1, keepdim=True)
            grad_scores = grad_probs.sub_(delta).mul_(probs)
            grad_q[:, c0:c1] = (torch.bmm(grad_scores, kv[..., :dim]) * scale).view(
                batch, c1 - c0, heads, dim
            )
            # [dS; P]^T [[scale q, 0], [0, dO]] = [scale dS^T q | P^T dO] = [dK_g | dV_g]
            pairs = torch.cat([grad_scores, probs], dim=1).transpose(1, 2)
            grad_kv.index_add_(0, rows, torch.bmm(pairs, factors).view(len(rows), -1))
        grad_k = grad_kv[:, :dim].reshape(k.shape).to(k.dtype)
        grad_v = grad_kv[:, dim:].reshape(v.shape).to(v.dtype)
        return grad_q, grad_k, grad_v, None, None, None


def _check_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor) -> None:
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, D], got shape {tuple(q.shape)}")
    batch, seq_len, _, dim = q.shape
    if tuple(k.shape) != (batch, seq_len, dim):
        raise ValueError(f"k must be [B, T, D] = {(batch, seq_len, dim)}, got {tuple(k.shape)}")
    if v.dim() != 3 or tuple(v.shape[:2]) != (batch, seq_len):
        raise ValueError(f"v must be [B, T, Dv] with B, T = {(batch, seq_len)}, got {tuple(v.shape)}")
    if indices.dim() != 3 or tuple(indices.shape[:2]) != (batch, seq_len) or indices.is_floating_point():
        raise ValueError(
            f"indices must be integer [B, T, S] with B, T = {(batch, seq_len)}, got "
            f"{indices.dtype} {tuple(indices.shape)}"
        )
    if indices.numel() and (int(indices.min()) < -1 or int(indices.max()) >= seq_len):
        raise ValueError(
            f"indices must lie in [-1, T-1] = [-1, {seq_len - 1}], got "
            f"[{int(indices.min())}, {int(indices.max())}]"
        )


def sparse_attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MQA attention and its per-row logsumexp.

    q [B, T, H, D], k [B, T, D], v [B, T, Dv], indices [B, T, S] (-1 = padding, distinct per row) ->
    o [B, T, H, Dv] in q's dtype, lse [B, T, H] in fp32 (float64 for float64 inputs; -inf for rows without
    an index; not differentiable).
    chunk_size: queries per chunk; default keeps a chunk's gathered K and V near CHUNK_BYTES.
    """
    _check_attention_inputs(q, k, v, indices)
    if chunk_size is None:
        chunk_size = default_chunk_size(
            q.shape[0], indices.shape[-1], q.shape[-1], v.shape[-1], compute_dtype(q.dtype)
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return SparseAttention.apply(q, k, v, indices, scale, chunk_size)


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Sparse MQA attention: softmax over the selected keys only. See `sparse_attention_with_lse`."""
    return sparse_attention_with_lse(q, k, v, indices, scale, chunk_size)[0]
