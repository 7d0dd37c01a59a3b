"""Sparse MQA attention over gathered key indices, forward and backward in query chunks (pure PyTorch).

Query t attends to the keys listed in indices[b, t] (-1 = padding); there may be more keys than queries
(context parallelism, decoding: the indices say which keys a query sees). All H query heads share one key and
one value per token (MLA in MQA mode), so a chunk of C queries gathers [C, S, D] keys and [C, S, Dv] values
once for all heads and computes scores with one batched matmul [C, H, D] x [C, D, S]. Only one chunk's
gathered keys and values exist at a time, never [T, S, D].

Forward saves q, k, v (k alone when v is its leading columns), indices, o and the per-row logsumexp. Backward
recomputes each chunk's probabilities P = exp(S - lse) flash-attention style:

    dV_g = P^T dO,  dP = dO V_g^T,  dS = P * (dP - rowsum(dO * O)),  dQ = scale dS K_g,  dK_g = scale dS^T Q

and scatter-adds [dK_g | dV_g] of a chunk back to the token positions with one index_add_. Every product is
a per-query batched matmul over the chunk, the scale folded into the score product (baddbmm alpha), and the
gathered rows, scores and gradients of a chunk live in buffers reused by every chunk. Softmax statistics and
accumulators are fp32 (float64 inputs stay float64). A row without any index outputs 0 (its lse is -inf).
Indices in a row must be distinct (a repeated index would be counted twice); `select_topk` guarantees that.

Shared values (MLA's latent): when v is the leading columns of k (``v = k[..., :Dv]``, the same storage and
strides), each selected row is gathered once as K, V being its first Dv columns, and both gradients arrive
as one: dK_g + [dV_g | 0] = [dS^T | P^T] [scale Q ; dO 0], a single product over 2H per query, returned
through k (v's gradient is then None: it is inside k's). That halves the bytes gathered and scattered,
which bound this operation on CPU (the products per query have only H rows).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megaseq.dtypes import compute_dtype
from megaseq_dsa.indexer import kl_and_grads

# Gathered K and V of one chunk take about this many bytes. The products per query are tiny ([H, D] x [D, S])
# and bound by memory traffic, so a chunk small enough to stay in cache (a few queries) beats big chunks
# (measured on CPU at S=2048, D=64: 4-8 queries per chunk ~2x faster than 64), at the cost of more Python
# steps.
CHUNK_BYTES = 4 * 2**20


def default_chunk_size(batch: int, slots: int, dim: int, dim_v: int, dtype: torch.dtype) -> int:
    """Queries per chunk (per batch element) so that the gathered K and V take about CHUNK_BYTES."""
    per_query = batch * slots * (dim + dim_v) * torch.empty((), dtype=dtype).element_size()
    return max(1, CHUNK_BYTES // max(per_query, 1))


def values_are_key_columns(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether v is k's leading columns (a view sharing k's storage and row layout): MLA's shared latent."""
    return (
        v.shape[:-1] == k.shape[:-1]
        and v.shape[-1] <= k.shape[-1]
        and v.dtype == k.dtype
        and v.data_ptr() == k.data_ptr()
        and v.stride() == k.stride()
    )


class _Chunks:
    """Gathers and scores query chunks into buffers allocated once per call: a fresh multi-MB tensor per chunk
    would pay for its page faults every time (measured: several times slower gathers at 32 MB chunks).

    Rows are gathered from kv [B*Tk, width]: k itself when the values are its leading columns (``shared``),
    else [k | v], so that one row copy per index serves both (the gather is bound by per-row memory traffic,
    not by arithmetic). Keys are the first ``dim`` columns of a gathered row; values the first ``dim_v``
    (shared) or the last ``dim_v``.
    """

    def __init__(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        indices: torch.Tensor,
        chunk: int,
        heads: int,
        shared: bool,
        k_idx: torch.Tensor | None = None,
    ) -> None:
        batch, self.n_keys, self.dim = k.shape
        dtype = compute_dtype(k.dtype)
        kv = k if shared else torch.cat([k, v], dim=-1)
        self.kv = kv.reshape(batch * self.n_keys, -1).to(dtype)
        self.values = slice(0, v.shape[-1]) if shared else slice(self.dim, None)
        slots = indices.shape[-1]
        rows = batch * min(chunk, indices.shape[1])
        self.gathered = torch.empty(rows * slots, self.kv.shape[1], dtype=dtype, device=k.device)
        self.heads = heads
        self.scores = torch.empty(rows * heads * slots, dtype=dtype, device=k.device)
        # The indexer loss's index keys, gathered at the same rows into their own buffer (the products want
        # contiguous rows: a strided view of wider rows made them 2x slower).
        if k_idx is not None:
            self.index_keys = k_idx.reshape(batch * self.n_keys, -1).to(dtype)
            self.index_gathered = torch.empty(rows * slots, k_idx.shape[-1], dtype=dtype, device=k.device)

    def gather_index_keys(self, rows: torch.Tensor, queries: int) -> torch.Tensor:
        """The index keys of flat rows [n * S] (from :meth:`gather`) as [n, S, Di]."""
        out = torch.index_select(self.index_keys, 0, rows, out=self.index_gathered[: len(rows)])
        return out.view(queries, -1, self.index_keys.shape[1])

    def gather(
        self, indices: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """indices [B, C, S] -> the indices up to the chunk's last valid column [B, C, S'], flat rows [B*C*S'],
        gathered rows [B*C, S', width], and valid [B*C, 1, S'] (None when every index is valid)."""
        valid = indices >= 0
        # Columns after every row's last index hold padding only, whose probability is 0: they are cut, not
        # gathered and multiplied (a row of topk + pool - 1 indices is padded to a multiple of 64, and the first
        # queries see fewer keys than the slots).
        columns = valid.flatten(0, 1).any(0)
        last = (columns * torch.arange(1, len(columns) + 1, device=columns.device)).max()
        used, n_valid = torch.stack([last, valid.sum()]).tolist()  # one read to the host for both
        used = max(1, used)
        indices, valid = indices[..., :used], valid[..., :used]
        batch, chunk, slots = indices.shape
        # Padding reads row 0 of its sequence; its probability is exactly 0, so it adds nothing anywhere.
        offsets = torch.arange(batch, device=indices.device)[:, None, None] * self.n_keys
        rows = (indices.long().clamp_min(0) + offsets).view(-1)
        kv = torch.index_select(self.kv, 0, rows, out=self.gathered[: len(rows)])
        valid = None if n_valid == valid.numel() else valid.view(batch * chunk, 1, slots)
        return indices, rows, kv.view(batch * chunk, slots, -1), valid

    def scores_of(
        self, q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor | None, scale: float
    ) -> torch.Tensor:
        """scale q . k [n, H, S] for queries q [n, H, D] against their gathered rows, -inf where invalid."""
        scores = self.scores[: len(q) * self.heads * kv.shape[1]].view(len(q), self.heads, kv.shape[1])
        torch.baddbmm(scores, q, kv[..., : self.dim].transpose(1, 2), beta=0.0, alpha=scale, out=scores)
        if valid is not None:
            scores.masked_fill_(~valid, float("-inf"))
        return scores


class SparseAttention(torch.autograd.Function):
    """(q, k, v, indices, scale, chunk_size[, q_idx, k_idx, weights]) -> (o, lse, kl, dkl/dq_idx, dkl/dk_idx,
    dkl/dweights); only o is differentiable (in q, k, v). With the indexer's inputs (detached), kl is the summed
    indexer KL over the same selected keys (``megaseq_dsa.indexer``), its target the forward's own head-averaged
    probabilities, and its gradients are formed here too; ``_GivenGradient`` attaches them to the indexer's
    inputs, so the loss's graph never reaches the attention's."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, q, k, v, indices, scale: float, chunk_size: int, q_idx=None, k_idx=None, weights=None
    ):
        batch, n_queries, heads, dim = q.shape
        dim_v = v.shape[-1]
        dtype = compute_dtype(q.dtype)
        with_kl = q_idx is not None
        shared = values_are_key_columns(k, v)
        chunks = _Chunks(k, v, indices, chunk_size, heads, shared, k_idx)
        o = q.new_empty(batch, n_queries, heads, dim_v)
        lse = torch.empty(batch, n_queries, heads, dtype=dtype, device=q.device)
        kl = torch.zeros((), dtype=dtype, device=q.device)
        if with_kl:
            grad_q_idx = torch.empty(q_idx.shape, dtype=dtype, device=q.device)
            grad_weights = torch.empty(weights.shape, dtype=dtype, device=q.device)
            grad_k_idx = torch.zeros(batch * k_idx.shape[1], k_idx.shape[-1], dtype=dtype, device=q.device)
        for c0 in range(0, n_queries, chunk_size):
            c1 = min(c0 + chunk_size, n_queries)
            chunk_indices, rows, kv, valid = chunks.gather(indices[:, c0:c1])
            q_chunk = q[:, c0:c1].reshape(-1, heads, dim).to(dtype)
            probs = chunks.scores_of(q_chunk, kv, valid, scale)
            row_max = probs.amax(-1, keepdim=True)
            row_max.masked_fill_(row_max == float("-inf"), 0.0)  # empty rows: keep exp(-inf - 0) = 0
            probs.sub_(row_max).exp_()
            row_sum = probs.sum(-1, keepdim=True)
            # A non-empty row holds exp(0) = 1 at its max, so row_sum >= 1 and the clamp only turns the
            # empty rows' 0 / 0 into 0 / 1.
            out = torch.bmm(probs, kv[..., chunks.values]).div_(row_sum.clamp_min(1.0))
            o[:, c0:c1] = out.view(batch, c1 - c0, heads, dim_v)
            lse[:, c0:c1] = (row_max + row_sum.log()).view(batch, c1 - c0, heads)
            if not with_kl:
                continue
            n = len(q_chunk)
            visible = chunk_indices.reshape(n, 1, -1) >= 0
            target = probs.div_(row_sum.clamp_min(1.0)).mean(1, keepdim=True)  # [n, 1, S]
            chunk_kl, grads = kl_and_grads(
                target,
                q_idx[:, c0:c1].reshape(n, 1, *q_idx.shape[2:]),
                weights[:, c0:c1].reshape(n, 1, -1),
                chunks.gather_index_keys(rows, n),
                visible,
                True,
            )
            kl += chunk_kl
            if grads is not None:
                d_q_idx, d_weights, d_k_idx = grads
                grad_q_idx[:, c0:c1] = d_q_idx.view(batch, c1 - c0, *q_idx.shape[2:])
                grad_weights[:, c0:c1] = d_weights.view(batch, c1 - c0, -1)
                grad_k_idx.index_add_(0, rows, d_k_idx.reshape(len(rows), -1))
        # Shared values are saved as k alone: a saved-tensor hook (offloading) returns each saved tensor as its
        # own copy, and backward must still know that v is k's leading columns.
        ctx.save_for_backward(q, k, *([] if shared else [v]), indices, o, lse)
        ctx.scale, ctx.chunk_size, ctx.shared_dim_v = scale, chunk_size, dim_v if shared else None
        kl_grads = [q.new_empty(0)] * 3
        if with_kl:
            kl_grads = [grad_q_idx, grad_k_idx.view(k_idx.shape), grad_weights]
        ctx.mark_non_differentiable(lse, kl, *kl_grads)
        return o, lse, kl, *kl_grads

    @staticmethod
    def backward(ctx, grad_o, *_non_differentiable):  # type: ignore[override]
        with torch.autocast(grad_o.device.type, enabled=False):
            return *SparseAttention._backward(ctx, grad_o), None, None, None

    @staticmethod
    def _backward(ctx, grad_o):  # type: ignore[no-untyped-def]
        scale, chunk_size, shared = ctx.scale, ctx.chunk_size, ctx.shared_dim_v is not None
        if shared:
            q, k, indices, o, lse = ctx.saved_tensors
            v = k[..., : ctx.shared_dim_v]
        else:
            q, k, v, indices, o, lse = ctx.saved_tensors
        batch, n_queries, heads, dim = q.shape
        dim_v = v.shape[-1]
        dtype = compute_dtype(q.dtype)
        chunks = _Chunks(k, v, indices, chunk_size, heads, shared)
        delta = (grad_o.to(dtype) * o.to(dtype)).sum(-1, keepdim=True)  # rowsum(dO * O): [B, Tq, H, 1]
        # Empty rows have lse = -inf; 0 there makes exp(-inf - 0) = 0 instead of NaN.
        lse = lse.masked_fill(lse == float("-inf"), 0.0)[..., None]
        grad_q = torch.empty(q.shape, dtype=dtype, device=q.device)
        grad_kv = torch.zeros(chunks.kv.shape, dtype=dtype, device=q.device)
        # The gradient of a chunk's gathered rows, written in place by the products and scattered with one
        # index_add_.
        grad_gathered = torch.empty_like(chunks.gathered)
        for c0 in range(0, n_queries, chunk_size):
            c1 = min(c0 + chunk_size, n_queries)
            _, rows, kv, valid = chunks.gather(indices[:, c0:c1])
            q_chunk = q[:, c0:c1].reshape(-1, heads, dim).to(dtype)
            grad_out = grad_o[:, c0:c1].reshape(-1, heads, dim_v).to(dtype)
            probs = chunks.scores_of(q_chunk, kv, valid, scale)
            probs.sub_(lse[:, c0:c1].reshape(-1, heads, 1)).exp_()  # P = exp(S - lse)
            grad_scores = torch.bmm(grad_out, kv[..., chunks.values].transpose(1, 2))  # dP
            grad_scores.sub_(delta[:, c0:c1].reshape(-1, heads, 1)).mul_(probs)  # dS = P (dP - delta)
            grad_q[:, c0:c1] = torch.bmm(grad_scores, kv[..., :dim]).view(batch, c1 - c0, heads, dim)
            grads = grad_gathered[: len(rows)].view(len(q_chunk), -1, chunks.kv.shape[1])
            if shared:  # dK_g + [dV_g | 0] = [dS^T | P^T] [scale q ; dO | 0]
                right = torch.cat([q_chunk * scale, F.pad(grad_out, (0, dim - dim_v))], dim=1)
                torch.bmm(torch.cat([grad_scores, probs], dim=1).transpose(1, 2), right, out=grads)
            else:
                torch.bmm(grad_scores.transpose(1, 2), q_chunk * scale, out=grads[..., :dim])  # dK_g
                torch.bmm(probs.transpose(1, 2), grad_out, out=grads[..., dim:])  # dV_g = P^T dO
            grad_kv.index_add_(0, rows, grads.view(len(rows), -1))
        grad_q = grad_q.mul_(scale).to(q.dtype)
        grad_k = grad_kv[:, :dim].reshape(k.shape).to(k.dtype)
        grad_v = None if shared else grad_kv[:, dim:].reshape(v.shape).to(v.dtype)
        return grad_q, grad_k, grad_v, None, None, None


def check_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor) -> None:
    if q.dim() != 4:
        raise ValueError(f"q must be [B, Tq, H, D], got shape {tuple(q.shape)}")
    batch, n_queries, _, dim = q.shape
    if k.dim() != 3 or k.shape[0] != batch or k.shape[2] != dim or k.shape[1] < n_queries:
        raise ValueError(
            f"k must be [B, Tk, D] with B = {batch}, D = {dim} and Tk >= Tq = {n_queries}, "
            f"got {tuple(k.shape)}"
        )
    n_keys = k.shape[1]
    if v.dim() != 3 or tuple(v.shape[:2]) != (batch, n_keys):
        raise ValueError(f"v must be [B, Tk, Dv] with B, Tk = {(batch, n_keys)}, got {tuple(v.shape)}")
    if indices.dim() != 3 or tuple(indices.shape[:2]) != (batch, n_queries) or indices.is_floating_point():
        raise ValueError(
            f"indices must be integer [B, Tq, S] with B, Tq = {(batch, n_queries)}, got "
            f"{indices.dtype} {tuple(indices.shape)}"
        )
    if indices.numel() and (int(indices.min()) < -1 or int(indices.max()) >= n_keys):
        raise ValueError(
            f"indices must lie in [-1, Tk-1] = [-1, {n_keys - 1}], got "
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

    q [B, Tq, H, D], k [B, Tk, D], v [B, Tk, Dv] (Tk >= Tq), indices [B, Tq, S] into the keys (-1 = padding,
    distinct per row) -> o [B, Tq, H, Dv] in q's dtype, lse [B, Tq, H] in fp32 (float64 for float64 inputs;
    -inf for rows without an index; not differentiable).
    chunk_size: queries per chunk; default keeps a chunk's gathered K and V near CHUNK_BYTES.
    """
    o, lse, *_ = _apply(q, k, v, indices, scale, chunk_size)
    return o, lse


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Sparse MQA attention: softmax over the selected keys only. See `sparse_attention_with_lse`."""
    return _apply(q, k, v, indices, scale, chunk_size)[0]


def sparse_attention_with_indexer_kl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    weights: torch.Tensor,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sparse_attention` and, in the same pass over the selected keys, the indexer's summed KL over them:
    ``(o, kl)``, kl equal to ``megaseq_dsa.indexer.indexer_kl(q_idx, k_idx, weights, q, k, scale, ...,
    indices)`` and differentiable in q_idx [B, Tq, Hi, Di], k_idx [B, Tk, Di] and weights [B, Tq, Hi] only.
    Sharing the pass saves the loss its own gather of the main keys and its own attention scores."""
    check_indexer_inputs(q, k, q_idx, k_idx, weights)
    o, _, kl, *kl_grads = _apply(q, k, v, indices, scale, chunk_size, (q_idx, k_idx, weights))
    return o, with_given_gradient(kl, (q_idx, k_idx, weights), kl_grads)


def check_indexer_inputs(
    q: torch.Tensor, k: torch.Tensor, q_idx: torch.Tensor, k_idx: torch.Tensor, weights: torch.Tensor
) -> None:
    """The indexer's inputs of `sparse_attention_with_indexer_kl` match the main query and key (ValueError)."""
    if k_idx.shape[:2] != k.shape[:2] or q_idx.shape[:2] != q.shape[:2] or weights.shape != q_idx.shape[:3]:
        raise ValueError(
            f"q_idx [B, Tq, Hi, Di], k_idx [B, Tk, Di] and weights [B, Tq, Hi] must match q {tuple(q.shape[:2])} "
            f"and k {tuple(k.shape[:2])}, got {tuple(q_idx.shape)}, {tuple(k_idx.shape)}, {tuple(weights.shape)}"
        )


def with_given_gradient(
    value: torch.Tensor, inputs: tuple[torch.Tensor, ...], grads: list[torch.Tensor]
) -> torch.Tensor:
    """``value``, differentiable in ``inputs`` with the gradients ``grads`` formed beside it (scaled by the
    incoming gradient in backward)."""
    return _GivenGradient.apply(value, *inputs, *grads)


class _GivenGradient(torch.autograd.Function):
    """(value, *inputs, *gradients) -> value, whose gradient with respect to each input is the given one
    (scaled by the incoming gradient): a loss whose gradient was formed with its value."""

    @staticmethod
    def forward(ctx, value, *inputs_and_grads):  # type: ignore[override]
        inputs, grads = inputs_and_grads[: len(inputs_and_grads) // 2], inputs_and_grads[len(inputs_and_grads) // 2 :]
        ctx.save_for_backward(*grads)
        ctx.dtypes = [x.dtype for x in inputs]
        return value.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        grads = [(grad * g).to(dtype) for g, dtype in zip(ctx.saved_tensors, ctx.dtypes, strict=True)]
        return None, *grads, *([None] * len(grads))


def _apply(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    chunk_size: int | None,
    indexer: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, ...]:
    """SparseAttention's outputs (see there), checked arguments and chunk size filled in."""
    check_attention_inputs(q, k, v, indices)
    if chunk_size is None:
        chunk_size = default_chunk_size(
            q.shape[0], indices.shape[-1], q.shape[-1], v.shape[-1], compute_dtype(q.dtype)
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    detached = [x.detach() for x in indexer or ()]  # the loss reaches the indexer through _GivenGradient only
    with torch.autocast(q.device.type, enabled=False):  # fp32 statistics and products, whatever the caller runs
        return SparseAttention.apply(q, k, v, indices, scale, chunk_size, *detached)
