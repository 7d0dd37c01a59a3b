"""The lightning indexer module and its KL training loss.

The indexer scores query t against an earlier key s by I(t, s) = sum_j w[t, j] relu(q[t, j] . k[s]) with H^I
heads of width d^I, one shared index key per token (from the hidden state x), index queries from the
compressed query c_q, and per-head weights from x scaled by (H^I d^I)^-1/2 so that the score's magnitude does
not grow with the indexer's size.

Its loss (DeepSeek-V3.2) is KL(p || softmax(I)) per query, where p is the main attention distribution summed
over heads and L1-normalised (the mean over heads) and is a fixed target (no gradient). The keys it runs over:

- dense warm-up: every key the query can see (its document, positions <= its own);
- sparse training: the query's selected keys (p is then the main attention itself, a softmax over them, and
  softmax(I) is renormalised over them).

The loss is computed in query chunks under activation checkpointing, so neither the L x L scores nor the
per-chunk tiles are kept for backward: memory is O(chunk x keys), and backward recomputes each chunk.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

# One chunk's largest score tile takes about this many bytes.
CHUNK_BYTES = 64 * 2**20


class LightningIndexer(nn.Module):
    """x [B, T, d_model] and c_q [B, T, q_lora_rank] -> index queries, index keys and head weights."""

    def __init__(self, d_model: int, q_lora_rank: int, heads: int, dim: int) -> None:
        super().__init__()
        self.heads, self.dim = heads, dim
        self.query = nn.Linear(q_lora_rank, heads * dim, bias=False)
        self.key = nn.Linear(d_model, dim, bias=False)
        self.head_weights = nn.Linear(d_model, heads, bias=False)
        self.weight_scale = (heads * dim) ** -0.5
        for linear in (self.query, self.key, self.head_weights):
            nn.init.normal_(linear.weight, std=linear.in_features**-0.5)

    def forward(self, x: Tensor, c_q: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q_idx [B, T, Hi, Di], k_idx [B, T, Di], weights [B, T, Hi]."""
        b, t, _ = x.shape
        q_idx = self.query(c_q).view(b, t, self.heads, self.dim)
        return q_idx, self.key(x), self.head_weights(x) * self.weight_scale


def indexer_kl(
    q_idx: Tensor,
    k_idx: Tensor,
    weights: Tensor,
    q: Tensor,
    key: Tensor,
    scale: float,
    query_pos: Tensor,
    doc_start: Tensor,
    indices: Tensor | None = None,
    chunk: int | None = None,
) -> Tensor:
    """Sum over query rows of KL(p_attn || softmax(I)), differentiable in the indexer inputs only.

    Queries (rows): q_idx [B, Tq, Hi, Di], weights [B, Tq, Hi], main queries q [B, Tq, H, D] at global
    positions query_pos [Tq]. Keys: k_idx [B, Tk, Di], main keys key [B, Tk, D], document start of every key
    doc_start [Tk]. indices [B, Tq, S] (-1 = padding): KL over those keys (sparse training); None: over every
    visible key (dense warm-up). The main attention is softmax(scale q . key) over the same keys.
    """
    batch, rows, heads, _ = q.shape
    keys = key.shape[1] if indices is None else indices.shape[-1]
    if chunk is None:
        chunk = max(1, CHUNK_BYTES // (4 * batch * keys * max(heads, q_idx.shape[2], key.shape[-1])))
    q, key = q.detach(), key.detach()
    total = q_idx.new_zeros((), dtype=torch.promote_types(q_idx.dtype, torch.float32))
    for c0 in range(0, rows, chunk):
        c1 = min(c0 + chunk, rows)
        pos = query_pos[c0:c1]
        if indices is None:
            k0, k1 = int(doc_start[pos].min()), int(pos.max()) + 1
            key_ids = torch.arange(k0, k1, device=pos.device)
            visible = (key_ids >= doc_start[pos][:, None]) & (key_ids <= pos[:, None])
            part = checkpoint(
                _chunk_kl, q_idx[:, c0:c1], k_idx[:, k0:k1], weights[:, c0:c1], q[:, c0:c1], key[:, k0:k1], scale,
                visible.expand(batch, -1, -1), use_reentrant=False,
            )
        else:
            # gathering inside the checkpoint keeps the gathered [chunk, S, D] rows out of what backward saves
            part = checkpoint(
                _gathered_chunk_kl, q_idx[:, c0:c1], k_idx, weights[:, c0:c1], q[:, c0:c1], key, scale,
                indices[:, c0:c1], use_reentrant=False,
            )
        total = total + part
    return total


def _gathered_chunk_kl(
    q_idx: Tensor, k_idx: Tensor, weights: Tensor, q: Tensor, key: Tensor, scale: float, ids: Tensor
) -> Tensor:
    """:func:`_chunk_kl` over the keys ``ids [B, C, S]`` of each query (-1 = padding)."""
    batch_ids = torch.arange(ids.shape[0], device=ids.device)[:, None, None]
    safe = ids.long().clamp_min(0)
    return _chunk_kl(q_idx, k_idx[batch_ids, safe], weights, q, key[batch_ids, safe], scale, ids >= 0)


def _chunk_kl(
    q_idx: Tensor, k_idx: Tensor, weights: Tensor, q: Tensor, key: Tensor, scale: float, visible: Tensor
) -> Tensor:
    """Summed KL of one chunk of C queries over K keys: keys shared by the chunk ([B, K, D]) or per query
    ([B, C, K, D]); visible [B, C, K]."""
    pattern = "bchd,bkd->bchk" if key.dim() == 3 else "bchd,bckd->bchk"
    dtype = torch.promote_types(q_idx.dtype, torch.float32)
    with torch.no_grad():
        main = torch.einsum(pattern, q.to(dtype), key.to(dtype)) * scale
        target = main.masked_fill(~visible[:, :, None], float("-inf")).softmax(-1).mean(2)
    per_head = torch.einsum(pattern, q_idx.to(dtype), k_idx.to(dtype)).relu()
    index = torch.einsum("bchk,bch->bck", per_head, weights.to(dtype))
    log_q = index.masked_fill(~visible, float("-inf")).log_softmax(-1).masked_fill(~visible, 0.0)
    return (torch.xlogy(target, target) - target * log_q).sum()
