"""Slow, obviously-correct oracles for the DSA operations (dense, O(Tq x Tk) memory: tests and small inputs).

Queries sit at key positions (`query_positions`, default arange(Tq) when there are as many keys as queries).

- `indexer_scores_reference`: the full lightning-indexer score matrix with -inf where a key is hidden.
- `select_topk_reference`: per sequence and per document, dense scores of the (pooled) keys, a stable sort by
  descending score (so equal scores go to the earlier key, the rule of `select_topk`), then a per-row Python
  loop that writes tokens, tail and padding exactly as the convention in `indexer.py` states.
- `sparse_attention_reference`: a dense softmax over the Tk keys masked to the selected indices.
"""

from __future__ import annotations

import torch

from megaseq.documents import Documents, as_documents
from megaseq.dtypes import compute_dtype
from megaseq_dsa.ops.indexer import check_index_inputs, document_starts, selected_slots


def indexer_scores_reference(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    weights: torch.Tensor,
    cu_seqlens: torch.Tensor | Documents | None = None,
    query_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """I(t, s) = sum_j weights[t, j] * relu(q_idx[t, j] . k_idx[s]) as [B, Tq, Tk].

    -inf unless s <= t and s is in t's document, t being the query's position.
    """
    positions = check_index_inputs(q_idx, k_idx, weights, cu_seqlens, query_positions)
    dtype = compute_dtype(q_idx.dtype)
    per_head = torch.einsum("bthd,bsd->bths", q_idx.to(dtype), k_idx.to(dtype)).relu()
    scores = torch.einsum("bths,bth->bts", per_head, weights.to(dtype))
    n_keys = k_idx.shape[1]
    keys = torch.arange(n_keys, device=q_idx.device)
    doc_start = document_starts(cu_seqlens, n_keys, q_idx.device)
    visible = (keys <= positions[..., None]) & (doc_start == doc_start[positions][..., None])
    return scores.masked_fill(~visible, float("-inf"))


def select_topk_reference(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    weights: torch.Tensor,
    topk: int,
    cu_seqlens: torch.Tensor | Documents | None = None,
    pool: int = 1,
    query_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense oracle of `select_topk`: same arguments (no block sizes), same output convention, same ties."""
    positions = check_index_inputs(q_idx, k_idx, weights, cu_seqlens, query_positions).cpu()
    batch, n_queries, _, dim = q_idx.shape
    n_keys = k_idx.shape[1]
    dtype = compute_dtype(q_idx.dtype)
    bounds = [(0, n_keys)] if cu_seqlens is None else as_documents(cu_seqlens).bounds
    out = torch.full((batch, n_queries, selected_slots(topk, pool)), -1, dtype=torch.int32)
    for b in range(batch):
        for start, end in bounds:
            rows = ((positions[b] >= start) & (positions[b] < end)).nonzero()[:, 0].tolist()
            if not rows:
                continue
            q, w = q_idx[b, rows].cpu().to(dtype), weights[b, rows].cpu().to(dtype)
            n_blocks = (end - start) // pool
            pooled = k_idx[b, start : start + n_blocks * pool].cpu().to(dtype)
            pooled = pooled.view(n_blocks, pool, dim).mean(1)
            scores = torch.einsum("thn,th->tn", torch.einsum("thd,nd->thn", q, pooled).relu(), w)
            block_last = start + torch.arange(n_blocks) * pool + pool - 1
            # Stable: among equal scores the earlier block stays first.
            order = scores.sort(dim=-1, descending=True, stable=True).indices
            for i, row in enumerate(rows):
                t = int(positions[b, row])
                chosen = order[i][block_last[order[i]] <= t][: topk // pool]
                tokens = (start + chosen[:, None] * pool + torch.arange(pool)).flatten().tolist()
                own_block = start + (t - start) // pool * pool
                if t - own_block + 1 < pool:
                    tokens += list(range(own_block, t + 1))
                out[b, row, : len(tokens)] = torch.tensor(sorted(tokens), dtype=torch.int32)
    return out.to(q_idx.device)


def sparse_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, scale: float
) -> torch.Tensor:
    """Dense masked softmax: query t attends to the keys listed in indices[b, t] (-1 = padding).

    q [B, Tq, H, D], k [B, Tk, D], v [B, Tk, Dv] -> [B, Tq, H, Dv] in q's dtype; a row with no index gives 0.
    """
    dtype = compute_dtype(q.dtype)
    batch, n_queries = q.shape[:2]
    n_keys = k.shape[1]
    # Column Tk collects the -1 padding and is dropped.
    allowed = torch.zeros(batch, n_queries, n_keys + 1, dtype=torch.bool, device=q.device)
    allowed.scatter_(2, indices.long().masked_fill(indices < 0, n_keys), True)
    allowed = allowed[..., :n_keys]
    scores = torch.einsum("bthd,bsd->bhts", q.to(dtype), k.to(dtype)) * scale
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    # Rows with nothing selected: softmax over zeros, then masked to 0, so neither output nor gradient is NaN.
    has_key = allowed.any(-1)[:, None, :, None]
    probs = torch.softmax(torch.where(has_key, scores, 0.0), dim=-1) * allowed[:, None]
    return torch.einsum("bhts,bsv->bthv", probs, v.to(dtype)).to(q.dtype)
