"""Slow, obviously-correct oracles for the DSA operations (dense, O(T^2) memory: tests and small inputs only).

- `indexer_scores_reference`: the full lightning-indexer score matrix with -inf where a key is hidden.
- `select_topk_reference`: per sequence and per document, dense scores of the (pooled) keys, torch.topk, then
  a per-row Python loop that writes tokens, tail and padding exactly as the convention in `indexer.py` states.
- `sparse_attention_reference`: a dense softmax over the T keys masked to the selected indices.
"""

from __future__ import annotations

import itertools

import torch

from megaseq_dsa.ops.indexer import check_index_inputs, compute_dtype, document_starts, selected_slots


def indexer_scores_reference(
    q_idx: torch.Tensor, k_idx: torch.Tensor, weights: torch.Tensor, cu_seqlens: torch.Tensor | None = None
) -> torch.Tensor:
    """I(t, s) = sum_j weights[t, j] * relu(q_idx[t, j] . k_idx[s]) as [B, T, T].

    -inf unless s <= t and s is in t's document.
    """
    check_index_inputs(q_idx, k_idx, weights, cu_seqlens)
    dtype = compute_dtype(q_idx.dtype)
    per_head = torch.einsum("bthd,bsd->bths", q_idx.to(dtype), k_idx.to(dtype)).relu()
    scores = torch.einsum("bths,bth->bts", per_head, weights.to(dtype))
    seq_len = q_idx.shape[1]
    positions = torch.arange(seq_len, device=q_idx.device)
    doc_start = document_starts(cu_seqlens, seq_len, q_idx.device)
    visible = (positions[None, :] <= positions[:, None]) & (doc_start[None, :] == doc_start[:, None])
    return scores.masked_fill(~visible, float("-inf"))


def select_topk_reference(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    weights: torch.Tensor,
    topk: int,
    cu_seqlens: torch.Tensor | None = None,
    pool: int = 1,
) -> torch.Tensor:
    """Dense oracle of `select_topk`: same arguments (no block sizes), same output convention."""
    check_index_inputs(q_idx, k_idx, weights, cu_seqlens)
    batch, seq_len, _, dim = q_idx.shape
    dtype = compute_dtype(q_idx.dtype)
    bounds = [0, seq_len] if cu_seqlens is None else cu_seqlens.tolist()
    out = torch.full((batch, seq_len, selected_slots(topk, pool)), -1, dtype=torch.int32)
    for b in range(batch):
        for start, end in itertools.pairwise(bounds):
            q, w = q_idx[b, start:end].to(dtype), weights[b, start:end].to(dtype)
            n_blocks = (end - start) // pool
            pooled = k_idx[b, start : start + n_blocks * pool].to(dtype).view(n_blocks, pool, dim).mean(1)
            scores = torch.einsum("thn,th->tn", torch.einsum("thd,nd->thn", q, pooled).relu(), w)
            block_last = torch.arange(n_blocks) * pool + pool - 1
            scores = scores.masked_fill(
                block_last[None, :] > torch.arange(end - start)[:, None], float("-inf")
            )
            values, blocks = scores.topk(min(topk // pool, n_blocks), dim=-1)
            for t in range(end - start):
                chosen = blocks[t][values[t] > float("-inf")]
                tokens = (chosen[:, None] * pool + torch.arange(pool)).flatten().tolist()
                own_block = t // pool * pool
                if t - own_block + 1 < pool:
                    tokens += list(range(own_block, t + 1))
                row = sorted(start + token for token in tokens)
                out[b, start + t, : len(row)] = torch.tensor(row, dtype=torch.int32)
    return out.to(q_idx.device)


def sparse_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, scale: float
) -> torch.Tensor:
    """Dense masked softmax: query t attends to the keys listed in indices[b, t] (-1 = padding).

    q [B, T, H, D], k [B, T, D], v [B, T, Dv] -> [B, T, H, Dv] in q's dtype; a row with no index gives 0.
    """
    dtype = compute_dtype(q.dtype)
    batch, seq_len = q.shape[:2]
    # Column T collects the -1 padding and is dropped.
    allowed = torch.zeros(batch, seq_len, seq_len + 1, dtype=torch.bool, device=q.device)
    allowed.scatter_(2, indices.long().masked_fill(indices < 0, seq_len), True)
    allowed = allowed[..., :seq_len]
    scores = torch.einsum("bthd,bsd->bhts", q.to(dtype), k.to(dtype)) * scale
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    # Rows with nothing selected: softmax over zeros, then masked to 0, so neither output nor gradient is NaN.
    has_key = allowed.any(-1)[:, None, :, None]
    probs = torch.softmax(torch.where(has_key, scores, 0.0), dim=-1) * allowed[:, None]
    return torch.einsum("bhts,bsv->bthv", probs, v.to(dtype)).to(q.dtype)
