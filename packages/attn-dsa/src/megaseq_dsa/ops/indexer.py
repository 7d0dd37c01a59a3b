"""Lightning-indexer top-k key selection for DeepSeek Sparse Attention, in blocks (PyTorch; numpy on CPU).

Queries sit at known positions of the key sequence (`query_positions`; by default query t is key t): all the
tokens of a sequence (training), this rank's zig-zag share of it over the all-gathered keys (context
parallelism), or the new tokens over the cached ones (decoding). The indexer scores the query at position t
against a key s <= t of its own document by

    I(t, s) = sum_j weights[t, j] * relu(q_idx[t, j] . k_idx[s])

and the query then attends only to its `topk` best keys. Equal scores go to the earlier key: the selection is
the first `topk` keys of a stable sort by descending score. The T x T score matrix is 64 GiB per layer at 128k
tokens, so it never exists here: queries go in blocks, and a block's scores over the keys it can see are
computed in key tiles (one [query_block x Hi x key_block] per-head tile at a time) into a [query_block x keys]
matrix of at most SCORE_BLOCK_BYTES (the query block shrinks for long sequences: 256 queries at 64k keys, 16
at 1M).

Each row of that matrix then keeps the scores >= its k-th largest score, found by one selection per row; on
rows of at least 64k keys (CPU) that selection runs only over the scores that reach a lower bound of the k-th
largest taken from group maxima (`_kth_and_kept`: the same threshold, one pass over the row instead of a
selection over all of it; `docs/results.md`, "DSA selection cost").
Where keys tie with the k-th score beyond k keys (relu makes exact zeros common), the latest tied keys are
dropped; a row that sees at most k keys keeps all of them. The kept positions come out of a flat nonzero()
already ascending per row. On CPU the selection, the comparison and the nonzero run in numpy
(np.partition, ~1 ns per score, and np.flatnonzero: about 10x and 4x faster than torch.kthvalue and
torch.nonzero there), elsewhere in torch; all of it costs about a fifth of computing the scores.
This replaced a running top-k merged key tile by key tile (sampled threshold, kthvalue shrinks): 2.2x faster
at 32k tokens on CPU, for at most SCORE_BLOCK_BYTES of scores.

Key pooling (GLM-5.3-Flash, pool=4): keys are grouped in blocks of `pool` tokens aligned to the start of their
document; a complete block is scored by the mean of its index keys and is a candidate for query t when all its
tokens are <= t. The best topk // pool blocks are expanded to their tokens, and the query's own incomplete
tail block (the tokens of t's block up to t, at most pool - 1) is always added. With pool=1 a "block" is one
token and there is never a tail, so one code path serves both.

Low-precision scores (`scores="bf16"`, the recipe's `attention.dsa.index_scores`): a block's scores over
all its keys come from bf16 operands (bf16 per-head products, their weighted sum in fp32), as a GPU indexer
scores in low precision; then each query's best `topk // pool + RESCORE_MARGIN` candidates by those scores
are scored again exactly (fp32 operands) and the top-k is chosen among them by the exact scores, with the same
tie rule. bf16 keeps 8 bits of mantissa: over thousands of visible keys the scores near the k-th best lie
closer together than bf16 rounds them (`benchmarks/indexer_recall.py` measures how often the plain bf16
choice differs), so the exact second pass decides the boundary; the result equals the fp32 selection unless
a key of the fp32 top-k ranks below the margin by the bf16 scores. It pays only where bf16 products are
faster than fp32 ones (bf16 matrix units: AVX512-BF16/AMX CPUs, GPUs); on a CPU without them torch emulates
them, many times slower than fp32.

Under tensor parallelism every rank holds the whole indexer and selects for its share of the queries
(``megaseq_dsa.layer``): a selection is always over the whole score.

Output convention (shared with `select_topk_reference`): int32 [B, Tq, slots] with
slots = round_up(topk + pool - 1, 64); each row lists its selected key positions in ascending order,
followed by -1 padding. A query with at most `topk` visible keys gets all of them, so T <= topk is exactly
dense causal attention. The work is O(Tq x visible keys): a decoding step costs O(cached length).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from megaseq.documents import Documents, as_documents
from megaseq.dtypes import compute_dtype

# Sparse attention kernels want the index count padded to a multiple of 64 (FlashMLA-style tiles).
SLOT_MULTIPLE = 64
DEFAULT_QUERY_BLOCK = 256
DEFAULT_KEY_BLOCK = 2048
# Low-precision scores: candidates beyond the topk // pool best that are scored again exactly.
RESCORE_MARGIN = 128
SCORE_DTYPES = {"fp32": None, "bf16": torch.bfloat16}


def selected_slots(topk: int, pool: int = 1) -> int:
    """Width of the index rows returned by `select_topk`: topk + pool - 1 rounded up to a multiple of 64."""
    return -(-(topk + pool - 1) // SLOT_MULTIPLE) * SLOT_MULTIPLE


def check_index_inputs(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    weights: torch.Tensor,
    cu_seqlens: torch.Tensor | Documents | None,
    query_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Raise a one-line ValueError for inconsistent indexer inputs; return the query positions as int64
    [B, Tq] (default arange(Tq), only when there are as many keys as queries)."""
    if q_idx.dim() != 4:
        raise ValueError(f"q_idx must be [B, Tq, Hi, D], got shape {tuple(q_idx.shape)}")
    batch, n_queries, heads, dim = q_idx.shape
    if k_idx.dim() != 3 or k_idx.shape[0] != batch or k_idx.shape[2] != dim or k_idx.shape[1] < n_queries:
        raise ValueError(
            f"k_idx must be [B, Tk, D] with B = {batch}, D = {dim} and Tk >= Tq = {n_queries}, "
            f"got {tuple(k_idx.shape)}"
        )
    n_keys = k_idx.shape[1]
    if tuple(weights.shape) != (batch, n_queries, heads):
        raise ValueError(
            f"weights must be [B, Tq, Hi] = {(batch, n_queries, heads)}, got {tuple(weights.shape)}"
        )
    positions = check_query_positions(query_positions, batch, n_queries, n_keys, q_idx.device)
    documents_of(cu_seqlens, batch, n_keys)
    return positions


def check_query_positions(
    query_positions: torch.Tensor | None, batch: int, n_queries: int, n_keys: int, device: torch.device
) -> torch.Tensor:
    """Validated key position of every query as int64 [B, Tq] (default arange(Tq) when Tk == Tq)."""
    if query_positions is None:
        if n_keys != n_queries:
            raise ValueError(
                f"query_positions is required when keys outnumber queries (Tk = {n_keys}, Tq = {n_queries})"
            )
        return torch.arange(n_queries, device=device).repeat(batch, 1)
    if (
        query_positions.is_floating_point()
        or query_positions.dim() not in (1, 2)
        or query_positions.shape[-1] != n_queries
        or (query_positions.dim() == 2 and query_positions.shape[0] != batch)
    ):
        raise ValueError(
            f"query_positions must be integer [Tq] or [B, Tq] with B = {batch}, Tq = {n_queries}, got "
            f"{query_positions.dtype} {tuple(query_positions.shape)}"
        )
    positions = query_positions.to(device=device, dtype=torch.long).expand(batch, -1).contiguous()
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= n_keys):
        raise ValueError(
            f"query_positions must lie in [0, Tk-1] = [0, {n_keys - 1}], got "
            f"[{int(positions.min())}, {int(positions.max())}]"
        )
    return positions


def documents_of(cu_seqlens: torch.Tensor | Documents | None, batch: int, n_keys: int) -> Documents | None:
    """cu_seqlens [N+1] (a tensor or core's Documents) bounding packed documents on the key axis (B == 1),
    validated, as core Documents (a tensor is read to the host here, once)."""
    return None if cu_seqlens is None else as_documents(cu_seqlens, batch=batch, length=n_keys)


def document_starts(
    cu_seqlens: torch.Tensor | Documents | None, seq_len: int, device: torch.device
) -> torch.Tensor:
    """First token of each token's document, int64 [T] (all zeros without cu_seqlens)."""
    if cu_seqlens is None:
        return torch.zeros(seq_len, dtype=torch.long, device=device)
    return as_documents(cu_seqlens, length=seq_len).starts(device)


def _index_scores(
    q_block: torch.Tensor, k_block: torch.Tensor, w_block: torch.Tensor, out: torch.Tensor, work: torch.Tensor
) -> None:
    """I(t, s) for a tile: q [B, Q, Hi, D], k [B, K, D], w [B, Q, Hi] -> out [B, Q, K] (a view into the block's
    scores); work: flat scratch of at least B * Q * Hi * K elements for the per-head scores, in q's dtype (the
    head sum runs in w's)."""
    batch, queries, heads, dim = q_block.shape
    n = k_block.shape[1]
    per_head = work[: batch * queries * heads * n].view(batch, queries * heads, n)
    torch.bmm(q_block.reshape(batch, queries * heads, dim), k_block.transpose(1, 2), out=per_head).relu_()
    # The head sum is a batched vector-matrix product. (Written into the strided `out` directly, bmm would
    # fall back to one small product per query.)
    out.copy_(
        torch.bmm(
            w_block.reshape(batch * queries, 1, heads), per_head.view(batch * queries, heads, n).to(w_block.dtype)
        ).view_as(out)
    )


@torch.no_grad()
def select_topk(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    weights: torch.Tensor,
    topk: int,
    cu_seqlens: torch.Tensor | Documents | None = None,
    pool: int = 1,
    query_positions: torch.Tensor | None = None,
    query_block: int = DEFAULT_QUERY_BLOCK,
    key_block: int = DEFAULT_KEY_BLOCK,
    scores: str = "fp32",
    rescore_margin: int = RESCORE_MARGIN,
) -> torch.Tensor:
    """Indices of each query's top-k keys by the lightning-indexer score.

    q_idx [B, Tq, Hi, D], k_idx [B, Tk, D] (one index key per token, Tk >= Tq), weights [B, Tq, Hi];
    query_positions int [Tq] or [B, Tq]: the key position of each query (default arange(Tq), needs Tk == Tq);
    the query at position t sees the keys s <= t of its document. cu_seqlens [N+1] (B == 1) bounds the
    documents on the key axis. Returns int32 [B, Tq, selected_slots(topk, pool)]: ascending key positions,
    then -1 padding; equal scores go to the earlier key. See the module docstring for pooling and the tail.
    query_block: at most this many queries per block (fewer when a block's scores would pass
    SCORE_BLOCK_BYTES); key_block: keys per scoring tile. scores: "fp32", or "bf16" for bf16 scores with an
    exact second pass over the best ``topk // pool + rescore_margin`` candidates (module docstring; a margin of
    0 keeps the bf16 scores' own choice).
    """
    if scores not in SCORE_DTYPES:
        raise ValueError(f"scores must be one of {', '.join(SCORE_DTYPES)}, got {scores!r}")
    if rescore_margin < 0:
        raise ValueError(f"rescore_margin must be >= 0, got {rescore_margin}")
    with torch.autocast(q_idx.device.type, enabled=False):  # scores in fp32 (or float64) under any autocast
        return _select_topk(
            q_idx, k_idx, weights, topk, cu_seqlens, pool, query_positions, query_block, key_block,
            SCORE_DTYPES[scores], rescore_margin,
        )


def _select_topk(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    weights: torch.Tensor,
    topk: int,
    cu_seqlens: torch.Tensor | Documents | None,
    pool: int,
    query_positions: torch.Tensor | None,
    query_block: int,
    key_block: int,
    low: torch.dtype | None = None,
    margin: int = RESCORE_MARGIN,
) -> torch.Tensor:
    documents = None if cu_seqlens is None else as_documents(cu_seqlens)  # read to the host once, checked below
    positions = check_index_inputs(q_idx, k_idx, weights, documents, query_positions)
    check_topk_and_pool(topk, pool)
    if query_block < 1 or key_block < 1:
        raise ValueError(f"query_block and key_block must be >= 1, got {query_block}, {key_block}")
    batch, n_queries, _, _ = q_idx.shape
    device = q_idx.device
    dtype = compute_dtype(q_idx.dtype)
    cand = pooled_candidates(k_idx, positions, documents, pool, dtype)
    keys, block_first, first_key, last_key = cand.keys, cand.block_first, cand.first, cand.last
    tail_start, tail_len = cand.tail_start, cand.tail_len

    blocks_kept = topk // pool
    slots = selected_slots(topk, pool)
    out = torch.full((batch, n_queries, slots), -1, dtype=torch.int32, device=device)
    element_size = torch.empty((), dtype=dtype).element_size()
    query_block = max(
        1, min(query_block, n_queries, SCORE_BLOCK_BYTES // (element_size * batch * max(len(block_first), 1)))
    )
    # Scratch reused by every block: fresh large allocations would each pay for their page faults.
    scores = torch.empty(batch * query_block * len(block_first), dtype=dtype, device=device)
    work = torch.empty(
        batch * query_block * q_idx.shape[2] * min(key_block, len(block_first)), dtype=low or dtype, device=device
    )
    for q0 in range(0, n_queries, query_block):
        q1 = min(q0 + query_block, n_queries)
        selected = _select_block(
            q_idx[:, q0:q1].to(dtype),
            weights[:, q0:q1].to(dtype),
            keys,
            first_key[:, q0:q1],
            last_key[:, q0:q1],
            blocks_kept,
            key_block,
            scores,
            work,
            low,
            margin,
        )
        tails = tail_start[:, q0:q1], tail_len[:, q0:q1]
        out[:, q0:q1] = expand_rows(selected, block_first, pool, *tails, slots)
    return out


def check_topk_and_pool(topk: int, pool: int) -> None:
    if topk < 1 or pool < 1 or topk < pool:
        raise ValueError(f"need topk >= pool >= 1, got topk={topk}, pool={pool}")


@dataclass(frozen=True)
class Candidates:
    """What a selection chooses among: complete blocks of ``pool`` keys aligned to their document's start
    (pool=1: every key), and what each query sees of them.

    ``keys [B, n_blocks, D]``: each block's mean index key (the index keys themselves for pool=1);
    ``block_first [n_blocks]``: each block's first key position, ascending; the query at position t sees the
    blocks ``first[b, q] ..= last[b, q]`` (none when last < first): those of its document whose tokens are all
    <= t. ``tail_start``/``tail_len [B, Tq]``: its own incomplete block up to t (length 0 when t completes
    its block), always selected.
    """

    keys: torch.Tensor
    block_first: torch.Tensor
    first: torch.Tensor
    last: torch.Tensor
    tail_start: torch.Tensor
    tail_len: torch.Tensor


def pooled_candidates(
    k_idx: torch.Tensor,
    positions: torch.Tensor,
    cu_seqlens: torch.Tensor | Documents | None,
    pool: int,
    dtype: torch.dtype,
) -> Candidates:
    """The candidate blocks of queries at key positions ``positions [B, Tq]`` (means in ``dtype``)."""
    n_keys, device = k_idx.shape[1], k_idx.device
    documents = None if cu_seqlens is None else as_documents(cu_seqlens, length=n_keys)
    key_positions = torch.arange(n_keys, device=device)
    doc_start = document_starts(documents, n_keys, device)
    doc_end = doc_start.new_full((n_keys,), n_keys) if documents is None else documents.ends(device)
    is_block_first = ((key_positions - doc_start) % pool == 0) & (key_positions + pool <= doc_end)
    block_first = key_positions[is_block_first]
    block_last = block_first + pool - 1
    if pool == 1:
        keys = k_idx  # a one-token mean is the key itself: skip a T x D copy
    else:
        members = block_first[:, None] + torch.arange(pool, device=device)
        keys = k_idx[:, members].to(dtype).mean(dim=2)
    query_doc_start = doc_start[positions]
    first = torch.searchsorted(block_first, query_doc_start)
    last = torch.searchsorted(block_last, positions, right=True) - 1
    tail_start = query_doc_start + (positions - query_doc_start) // pool * pool
    tail_len = positions - tail_start + 1
    return Candidates(keys, block_first, first, last, tail_start, tail_len.masked_fill(tail_len == pool, 0))


# One query block's scores over all the keys it can see take at most about this many bytes.
SCORE_BLOCK_BYTES = 64 * 2**20


def _select_block(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    k: int,
    key_block: int,
    scores: torch.Tensor,
    work: torch.Tensor,
    low: torch.dtype | None = None,
    margin: int = RESCORE_MARGIN,
) -> torch.Tensor:
    """Top-k key ids [B, Q, k] (ascending, -1 padded) of a query block: q [B, Q, Hi, D], weights [B, Q, Hi],
    keys [B, n_keys, D], visible key range [lo, hi] per query [B, Q]; scores and work: flat scratch (work in
    ``low`` when given: the scores' operands in that dtype, then the exact second pass over ``margin`` more)."""
    batch, queries = lo.shape
    # The block's keys lie in [min lo, max hi] and every row sees [max lo, min hi]. An empty row has
    # hi = lo - 1 >= min lo - 1, so the range never runs backwards.
    start, end = int(lo.min()), int(hi.max()) + 1
    all_see_from, all_see_to = int(lo.max()), int(hi.min())
    scores = scores[: batch * queries * (end - start)].view(batch, queries, end - start)
    operands = q if low is None else q.to(low)
    for k0 in range(start, end, key_block):
        k1 = min(k0 + key_block, end)
        _index_scores(operands, keys[:, k0:k1].to(operands.dtype), weights, scores[..., k0 - start : k1 - start], work)
    # Hidden keys (-inf) can only lie outside the range every row sees.
    for k0, k1 in ((start, min(all_see_from, end)), (max(all_see_to + 1, start), end)):
        if k1 > k0:
            ids = torch.arange(k0, k1, device=q.device)
            hidden = (ids < lo[..., None]) | (ids > hi[..., None])
            scores[..., k0 - start : k1 - start].masked_fill_(hidden, float("-inf"))
    scores = scores.view(batch * queries, -1)
    visible = (hi - lo + 1).clamp_min(0).view(-1)
    if low is not None:
        return _rescored(scores, q, weights, keys, lo, hi, visible, k, start, margin).view(batch, queries, k)
    need = visible.clamp_max(k)

    # Each row keeps its scores >= its need-th best: for a row with more than k visible keys that is the k-th
    # best score; for the others the lowest finite value, so that every visible key is kept.
    rows, width = scores.shape
    kth, kept = _kth_and_kept(scores, k, visible > k)  # kept row-major: each row's keys ascending
    if len(kept) > int(need.sum()):
        # Some rows tie with their k-th best score beyond k keys: the latest of those tied keys are dropped.
        # Counted over the kept keys only (their tied ones, ascending per row), not over whole rows.
        row = kept // width
        surplus = torch.bincount(row, minlength=rows) - need
        tied = (scores.view(-1)[kept] == kth.view(-1)[row]) & (surplus[row] > 0)
        tied_total = torch.bincount(row, weights=tied, minlength=rows).long()
        rank = tied.cumsum(0) - (tied_total.cumsum(0) - tied_total)[row]  # 1, 2, ... among a row's tied keys
        kept = kept[~(tied & (rank > (tied_total - surplus)[row]))]
    if bool((need == k).all()):
        row_starts = torch.arange(rows, device=q.device)[:, None] * width
        return (kept.view(rows, k) - row_starts + start).view(batch, queries, k)
    row = kept // width
    out = torch.full((rows, k), -1, dtype=torch.long, device=q.device)
    slot = torch.arange(len(kept), device=q.device) - (need.cumsum(0) - need).index_select(0, row)
    out[row, slot] = kept - row * width + start
    return out.view(batch, queries, k)


def _rescored(
    scores: torch.Tensor,
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    visible: torch.Tensor,
    k: int,
    start: int,
    margin: int,
) -> torch.Tensor:
    """Top-k key ids [R, k] (ascending, -1 padded) from low-precision scores [R, width] (keys start..): a row
    that sees at most k keys keeps them all; each other row scores again, from the fp32 operands, every key
    whose low-precision score reaches its (k + margin)-th best (more than k + margin where scores tie there),
    and keeps the k best of those, equal exact scores to the earlier key."""
    rows, width = scores.shape
    queries, heads, dim = q.shape[1:]
    offsets = torch.arange(k, device=q.device)
    out = (lo.reshape(-1, 1) + offsets).masked_fill(offsets >= visible[:, None], -1)  # all visible, in order
    full = (visible > k).nonzero()[:, 0]
    if len(full) == 0:
        return out
    chosen = scores[full].contiguous()
    kept = _flat_positions_at_least(chosen, _kth_largest(chosen, min(k + margin, width)))  # row-major, ascending
    row = kept // width
    counts = torch.bincount(row, minlength=len(full))
    slot = torch.arange(len(kept), device=q.device) - (counts.cumsum(0) - counts).index_select(0, row)
    candidates = torch.full((len(full), int(counts.max())), -1, dtype=torch.long, device=q.device)
    candidates[row, slot] = kept % width  # each row's candidates ascending, then -1
    ids = candidates.clamp_min(0) + start
    exact_keys = keys[(full // queries)[:, None], ids]  # [F, C, D]
    per_head = torch.bmm(q.reshape(rows, heads, dim)[full], exact_keys.transpose(1, 2)).relu_()
    exact = torch.bmm(weights.reshape(rows, 1, heads)[full], per_head)[:, 0]
    hidden = (candidates < 0) | (ids < lo.reshape(-1)[full, None]) | (ids > hi.reshape(-1)[full, None])
    # a stable sort of ascending candidates: equal exact scores keep the earlier key first
    best = exact.masked_fill_(hidden, float("-inf")).sort(dim=-1, descending=True, stable=True).indices[:, :k]
    out[full] = ids.gather(1, best).sort(-1).values
    return out


def selection_recall(selected: torch.Tensor, reference: torch.Tensor) -> float:
    """The share of the reference's selected keys that ``selected`` selects too, over all rows: two outputs of
    ``select_topk`` ([..., slots], ascending, -1 padded) for the same queries; 1.0 when every row agrees."""
    sel, ref = (x.reshape(-1, x.shape[-1]).long() for x in (selected, reference))
    padded = ref.masked_fill(ref < 0, torch.iinfo(torch.long).max)  # ascending including the padding
    where = torch.searchsorted(padded, sel.clamp_min(0)).clamp_max(ref.shape[-1] - 1)
    hits = ((padded.gather(1, where) == sel) & (sel >= 0)).sum()
    return float(hits) / max(int((ref >= 0).sum()), 1)


# numpy's selection (introselect, vectorised on x86), comparison and nonzero are about 10x, 4x and 4x faster
# than torch's kthvalue, ge and nonzero on CPU; these two helpers use them there and torch elsewhere (tested
# against each other in tests/test_ops.py).


def _kth_largest(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The k-th largest value of every row of scores [R, n] (n >= k) as [R, 1]."""
    n = scores.shape[-1]
    if scores.device.type == "cpu":
        return torch.from_numpy(np.partition(scores.numpy(), n - k, axis=-1)[:, n - k : n - k + 1])
    return scores.kthvalue(n - k + 1, dim=-1, keepdim=True).values


# The bound of `_kth_and_kept`: GROUPS_PER_KEPT group maxima per kept key (more make the bound tighter, fewer
# candidates, for a larger selection among the maxima), used where groups hold at least MIN_GROUP scores
# (rows of at least 64k keys at k = 128: at 16k keys it measured no faster than selecting over whole rows).
GROUPS_PER_KEPT = 4
MIN_GROUP = 64


def _kth_and_kept(scores: torch.Tensor, k: int, full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's threshold [R, 1] (its k-th largest score where ``full [R]``, else the dtype's lowest finite
    value, which keeps every visible score) and the ascending flat positions (int64) of the scores >= it.

    A selection over every score of a row costs several times one pass over it, so on CPU the k-th largest is
    found among few candidates: split a row into at least k groups; the k-th largest of the groups' maxima is
    a lower bound of the row's k-th largest (k groups each hold a score >= it), so every score >= the k-th
    largest is among the scores >= that bound, of which there are at least k. One pass finds those candidates
    (with their ascending positions), a selection among them the threshold, and the kept positions are the
    candidates that reach it: exactly what the selection over the whole row keeps."""
    rows, width = scores.shape
    lowest = torch.finfo(scores.dtype).min
    group = width // (GROUPS_PER_KEPT * k)  # scores per group
    if not bool(full.any()):
        kth = scores.new_full((rows, 1), lowest)
        return kth, _flat_positions_at_least(scores, kth)
    if scores.device.type != "cpu" or group < MIN_GROUP:  # select over whole rows
        if bool(full.all()):  # no copy of the rows
            kth = _kth_largest(scores, k)
        else:
            kth = scores.new_full((rows, 1), lowest)
            kth[full] = _kth_largest(scores[full], k)
        return kth, _flat_positions_at_least(scores, kth)
    n_groups = width // group
    # group j holds the positions j, j + n_groups, j + 2 n_groups, ...: a strided maximum, one pass
    maxima = scores[:, : group * n_groups].unflatten(1, (group, n_groups)).amax(1)
    bound = _kth_largest(maxima, k).masked_fill_(~full[:, None], lowest)
    candidates = _flat_positions_at_least(scores, bound)
    values = scores.view(-1)[candidates]
    row = candidates // width
    # Where fewer than k candidates lie above the bound, the bound is the k-th largest (ties at it are common:
    # with all head weights of a query negative its best score is 0, shared by many keys). Otherwise the k-th
    # largest lies above the bound: selected among the candidates above it, padded to the longest row, or over
    # the whole row where those are many.
    above = values > bound[row, 0]
    counts = torch.bincount(row[above], minlength=rows)
    kth = bound.clone()
    crowded = full & (counts > GROUPS_PER_KEPT * k)
    if bool(crowded.any()):
        kth[crowded] = _kth_largest(scores[crowded], k)
    few = full & ~crowded & (counts >= k)
    if bool(few.any()):
        ids = row[above]
        slot = torch.arange(len(ids)) - (counts.cumsum(0) - counts)[ids]
        padded = scores.new_full((rows, int(counts[few].max())), float("-inf"))
        light = few[ids]
        padded[ids[light], slot[light]] = values[above][light]
        kth[few] = _kth_largest(padded[few], k)
    return kth, candidates[values >= kth[row, 0]]


def _flat_positions_at_least(values: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """Ascending flat positions (int64) where values [R, n] (contiguous) >= bound [R, 1]."""
    if values.device.type == "cpu":
        return torch.from_numpy(np.flatnonzero(values.numpy() >= bound.numpy()))
    return (values >= bound).view(-1).nonzero()[:, 0]


def expand_rows(
    block_ids: torch.Tensor,
    block_first: torch.Tensor,
    pool: int,
    tail_start: torch.Tensor,
    tail_len: torch.Tensor,
    slots: int,
) -> torch.Tensor:
    """Ascending selected blocks [B, Q, m] (-1 padded) and tails [B, Q] -> token rows [B, Q, slots]: tokens,
    tail, -1."""
    batch, queries, kept = block_ids.shape
    valid = block_ids >= 0
    offsets = torch.arange(pool, device=block_ids.device)
    # A spare entry for the -1 padding (which index -1 reads), so that no block at all still indexes safely.
    tokens = torch.cat([block_first, block_first.new_zeros(1)])[block_ids][..., None] + offsets
    tokens = tokens.masked_fill(~valid[..., None], -1).view(batch, queries, kept * pool)
    # One spare column receives the scatter writes of absent tail tokens and is dropped.
    rows = torch.full((batch, queries, slots + 1), -1, dtype=torch.long, device=block_ids.device)
    rows[..., : kept * pool] = tokens
    if pool > 1:
        tail_offsets = offsets[: pool - 1]
        where = valid.sum(-1, keepdim=True) * pool + tail_offsets
        where = torch.where(tail_offsets < tail_len[..., None], where, slots)
        rows.scatter_(-1, where, tail_start[..., None] + tail_offsets)
    return rows[..., :slots].to(torch.int32)
