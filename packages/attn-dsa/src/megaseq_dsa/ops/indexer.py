"""Lightning-indexer top-k key selection for DeepSeek Sparse Attention, in blocks (pure PyTorch).

The indexer scores query t against an earlier key s of its own document by

    I(t, s) = sum_j weights[t, j] * relu(q_idx[t, j] . k_idx[s])

and query t then attends only to its `topk` best keys. The T x T score matrix is 64 GiB per layer at 128k
tokens, so it never exists here: queries are processed in blocks, each query block walks over the key blocks
it can see, and every key block's scores are merged into the query block's running top-k. Extra memory is one
[query_block x Hi x key_block] score tile plus the running top-k (2 k + key_block candidates per query).

The merge is where the time goes on CPU (torch.topk costs tens of ns per element, a comparison about one), so
a score is compared with a per-row threshold first and only the survivors are kept; an exact k-th value
selection runs when a row holds more than 2 k candidates, and once at the end. The threshold starts from a
sample (the score about 2 k keys should beat, estimated from every 8th key) and rises to the exact k-th best
kept score after each selection. A row the sampled threshold left with too few keys is detected and its query
block recomputed without it, so the result is always the exact top-k.

Key pooling (GLM-5.3-Flash, pool=4): keys are grouped in blocks of `pool` tokens aligned to the start of their
document; a complete block is scored by the mean of its index keys and is a candidate for query t when all its
tokens are <= t. The best topk // pool blocks are expanded to their tokens, and the query's own incomplete
tail block (the tokens of t's block up to t, at most pool - 1) is always added. With pool=1 a "block" is one
token and there is never a tail, so one code path serves both.

Output convention (shared with `select_topk_reference`): int32 [B, T, slots] with
slots = round_up(topk + pool - 1, 64); each row lists its selected token indices in ascending order,
followed by -1 padding. A query with at most `topk` visible keys gets all of them, so T <= topk is exactly
dense causal attention.
"""

from __future__ import annotations

import itertools

import torch

# Sparse attention kernels want the index count padded to a multiple of 64 (FlashMLA-style tiles).
SLOT_MULTIPLE = 64
DEFAULT_QUERY_BLOCK = 256
DEFAULT_KEY_BLOCK = 4096


def selected_slots(topk: int, pool: int = 1) -> int:
    """Width of the index rows returned by `select_topk`: topk + pool - 1 rounded up to a multiple of 64."""
    return -(-(topk + pool - 1) // SLOT_MULTIPLE) * SLOT_MULTIPLE


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Scores and softmax statistics are accumulated in at least fp32 (float64 inputs stay float64)."""
    return torch.promote_types(dtype, torch.float32)


def check_index_inputs(
    q_idx: torch.Tensor, k_idx: torch.Tensor, weights: torch.Tensor, cu_seqlens: torch.Tensor | None
) -> None:
    """Raise a one-line ValueError for inconsistent indexer inputs."""
    if q_idx.dim() != 4:
        raise ValueError(f"q_idx must be [B, T, Hi, D], got shape {tuple(q_idx.shape)}")
    batch, seq_len, heads, dim = q_idx.shape
    if tuple(k_idx.shape) != (batch, seq_len, dim):
        raise ValueError(f"k_idx must be [B, T, D] = {(batch, seq_len, dim)}, got {tuple(k_idx.shape)}")
    if tuple(weights.shape) != (batch, seq_len, heads):
        raise ValueError(
            f"weights must be [B, T, Hi] = {(batch, seq_len, heads)}, got {tuple(weights.shape)}"
        )
    if cu_seqlens is None:
        return
    if batch != 1:
        raise ValueError(f"cu_seqlens needs packed documents in a batch of 1, got batch size {batch}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            f"cu_seqlens must be a 1-D tensor [N+1] with N >= 1, got shape {tuple(cu_seqlens.shape)}"
        )
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != seq_len or any(b < a for a, b in itertools.pairwise(bounds)):
        raise ValueError(f"cu_seqlens must rise from 0 to T={seq_len} without decreasing, got {bounds}")


def document_starts(cu_seqlens: torch.Tensor | None, seq_len: int, device: torch.device) -> torch.Tensor:
    """First token of each token's document, int64 [T] (all zeros without cu_seqlens)."""
    if cu_seqlens is None:
        return torch.zeros(seq_len, dtype=torch.long, device=device)
    bounds = cu_seqlens.to(device=device, dtype=torch.long)
    positions = torch.arange(seq_len, device=device)
    doc = torch.searchsorted(bounds[1:], positions, right=True)
    return bounds[doc]


def _index_scores(q_block: torch.Tensor, k_block: torch.Tensor, w_block: torch.Tensor) -> torch.Tensor:
    """I(t, s) for a tile: q [B, Q, Hi, D], k [B, K, D], w [B, Q, Hi] -> [B, Q, K]."""
    batch, queries, heads, dim = q_block.shape
    per_head = torch.bmm(q_block.reshape(batch, queries * heads, dim), k_block.transpose(1, 2)).relu_()
    # The head sum is a batched vector-matrix product; it keeps the [Q, Hi, K] tile the only big temporary.
    summed = torch.bmm(w_block.reshape(batch * queries, 1, heads), per_head.view(batch * queries, heads, -1))
    return summed.view(batch, queries, -1)


@torch.no_grad()
def select_topk(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    weights: torch.Tensor,
    topk: int,
    cu_seqlens: torch.Tensor | None = None,
    pool: int = 1,
    query_block: int = DEFAULT_QUERY_BLOCK,
    key_block: int = DEFAULT_KEY_BLOCK,
) -> torch.Tensor:
    """Indices of each query's top-k keys by the lightning-indexer score.

    q_idx [B, T, Hi, D], k_idx [B, T, D] (one index key per token), weights [B, T, Hi]; cu_seqlens [N+1]
    (B == 1) keeps the selection inside each document. Returns int32 [B, T, selected_slots(topk, pool)]:
    ascending token indices, then -1 padding. See the module docstring for pooling and the tail block.
    """
    check_index_inputs(q_idx, k_idx, weights, cu_seqlens)
    if topk < 1 or pool < 1 or topk < pool:
        raise ValueError(f"need topk >= pool >= 1, got topk={topk}, pool={pool}")
    if query_block < 1 or key_block < 1:
        raise ValueError(f"query_block and key_block must be >= 1, got {query_block}, {key_block}")
    batch, seq_len, _, _ = q_idx.shape
    device = q_idx.device
    dtype = compute_dtype(q_idx.dtype)
    positions = torch.arange(seq_len, device=device)
    doc_start = document_starts(cu_seqlens, seq_len, device)

    # Candidate keys are complete blocks of `pool` tokens aligned to the document start (pool=1: every token).
    doc_end = doc_start.new_full((seq_len,), seq_len)
    if cu_seqlens is not None:
        bounds = cu_seqlens.to(device=device, dtype=torch.long)
        doc_end = bounds[torch.searchsorted(bounds[1:], positions, right=True) + 1]
    is_block_first = ((positions - doc_start) % pool == 0) & (positions + pool <= doc_end)
    block_first = positions[is_block_first]
    block_last = block_first + pool - 1
    if pool == 1:
        keys = k_idx  # a one-token mean is the key itself: skip a T x D copy
    else:
        members = block_first[:, None] + torch.arange(pool, device=device)
        keys = k_idx[:, members].to(dtype).mean(dim=2)
    # Query t sees the contiguous key range [first_key[t], last_key[t]] (empty when last < first).
    first_key = torch.searchsorted(block_first, doc_start)
    last_key = torch.searchsorted(block_last, positions, right=False) - 1
    # Tail: the tokens of t's own block up to t, unless t completes that block.
    tail_start = doc_start + (positions - doc_start) // pool * pool
    tail_len = positions - tail_start + 1
    tail_len = tail_len.masked_fill(tail_len == pool, 0)

    blocks_kept = topk // pool
    slots = selected_slots(topk, pool)
    out = torch.full((batch, seq_len, slots), -1, dtype=torch.int32, device=device)
    for q0 in range(0, seq_len, query_block):
        q1 = min(q0 + query_block, seq_len)
        block = _QueryBlock(
            q_idx[:, q0:q1].to(dtype), weights[:, q0:q1].to(dtype), first_key[q0:q1], last_key[q0:q1]
        )
        threshold = block.sampled_threshold(keys, blocks_kept)
        selected, count = block.select(keys, blocks_kept, key_block, threshold)
        # The sampled threshold is only an estimate: if it left a row fewer keys than it must select, some of
        # the dropped keys belong to the top-k, so the block is redone exactly (> 5 sigma on smooth scores).
        if bool((count < (block.hi - block.lo + 1).clamp(0, blocks_kept).repeat(batch)).any()):
            selected, _ = block.select(keys, blocks_kept, key_block, None)
        out[:, q0:q1] = _expand_rows(
            selected.view(batch, q1 - q0, -1), block_first, pool, tail_start[q0:q1], tail_len[q0:q1], slots
        )
    return out


# Sampled threshold: score every SAMPLE_STRIDE-th visible key and take the score that about 2 k of all keys
# should beat (the (2 k / stride)-th best sample; failing to leave k is a > 5 sigma event on smooth scores).
# Filtering with it leaves ~2 k candidates per row instead of the k (1 + ln(n / k)) an exact running threshold
# lets through, at 1 / SAMPLE_STRIDE extra scoring.
SAMPLE_STRIDE = 8


class _QueryBlock:
    """One block of queries: q [B, Q, Hi, D], weights [B, Q, Hi], visible key range [lo, hi] per query."""

    def __init__(self, q: torch.Tensor, weights: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> None:
        self.q, self.weights, self.lo, self.hi = q, weights, lo, hi
        # lo / hi never decrease: the block's keys lie in [lo[0], hi[-1]], all see [lo[-1], hi[0]].
        self.key_start, self.key_end = int(lo[0]), int(hi[-1]) + 1
        self.all_see_from, self.all_see_to = int(lo[-1]), int(hi[0])

    def scores(self, keys: torch.Tensor, key_ids: torch.Tensor) -> torch.Tensor:
        """Index scores [B*Q, n] of keys [B, n, D] with ids key_ids [n] (ascending), -inf where hidden."""
        scores = _index_scores(self.q, keys.to(self.q.dtype), self.weights)
        if int(key_ids[0]) < self.all_see_from or int(key_ids[-1]) > self.all_see_to:
            hidden = (key_ids < self.lo[:, None]) | (key_ids > self.hi[:, None])
            scores.masked_fill_(hidden, float("-inf"))
        return scores.view(-1, len(key_ids))

    def sampled_threshold(self, keys: torch.Tensor, k: int) -> torch.Tensor | None:
        rank = 2 * k // SAMPLE_STRIDE + 1
        sample = torch.arange(self.key_start, self.key_end, SAMPLE_STRIDE, device=keys.device)
        if len(sample) <= 2 * rank:  # short ranges: the exact filter alone is cheap
            return None
        scores = self.scores(keys[:, self.key_start : self.key_end : SAMPLE_STRIDE], sample)
        # Rows with fewer than `rank` visible samples get -inf (no filtering) from the -inf padding.
        kth_best = scores.kthvalue(len(sample) - rank + 1, dim=-1, keepdim=True).values
        # Just below it, so that keys tied with it pass the strict filter (relu makes exact ties at 0 common).
        return torch.nextafter(kth_best, torch.full_like(kth_best, float("-inf")))

    def select(
        self, keys: torch.Tensor, k: int, key_block: int, threshold: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k key ids [B*Q, <= k] (ascending, -1 padded) among keys above threshold, and their count."""
        best = _RunningTopK(
            self.q.shape[0] * self.q.shape[1], k, key_block, threshold, self.q.dtype, keys.device
        )
        for k0 in range(self.key_start, self.key_end, key_block):
            k1 = min(k0 + key_block, self.key_end)
            best.add(self.scores(keys[:, k0:k1], torch.arange(k0, k1, device=keys.device)), k0)
        return best.result()


class _RunningTopK:
    """Exact running top-k of each row of a query block, kept in ascending key order.

    torch.topk costs tens of ns per element on CPU, while a comparison costs about one, so each new score is
    first compared with its row's threshold (the k-th best score kept so far: anything not above it can never
    enter the top-k); only the survivors are appended, and an exact k-th value selection runs when a row holds
    more than 2k candidates. Rows stay left-aligned in arrival order (ascending keys), so no sort is needed.
    Slots at or beyond a row's count hold stale values and are masked wherever they are read.
    """

    def __init__(
        self,
        rows: int,
        k: int,
        tile: int,
        threshold: torch.Tensor | None,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.k = k
        self.capacity = 2 * k + tile  # at most 2k kept + one tile appended before the next shrink
        self.scores = torch.empty(rows, self.capacity, dtype=dtype, device=device)
        self.keys = torch.empty(rows, self.capacity, dtype=torch.long, device=device)
        self.count = torch.zeros(rows, dtype=torch.long, device=device)
        if threshold is None:
            threshold = torch.full((rows, 1), float("-inf"), dtype=dtype, device=device)
        self.threshold = threshold

    def add(self, scores: torch.Tensor, first_key: int) -> None:
        """Merge scores [rows, n] of keys first_key .. first_key + n - 1 (-inf = hidden key)."""
        row, col, new, slot = _left_aligned(scores > self.threshold)
        dst = row * self.capacity + self.count.index_select(0, row) + slot
        self.scores.view(-1).index_copy_(
            0, dst, scores.reshape(-1).index_select(0, row * scores.shape[1] + col)
        )
        self.keys.view(-1).index_copy_(0, dst, col + first_key)
        self.count += new
        if int(self.count.max()) > 2 * self.k:
            self._shrink()

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Kept keys [rows, <= k], ascending, -1 after each row's last key; and the count per row."""
        if int(self.count.max()) > self.k:
            self._shrink()
        width = int(self.count.max())
        return self.keys[:, :width].masked_fill(self._stale(width), -1), self.count

    def _stale(self, width: int) -> torch.Tensor:
        return torch.arange(width, device=self.count.device) >= self.count[:, None]

    def _shrink(self) -> None:
        width = int(self.count.max())
        scores = self.scores[:, :width].masked_fill(self._stale(width), float("-inf"))
        kth_best = scores.kthvalue(max(width - self.k + 1, 1), dim=-1, keepdim=True).values
        above = scores > kth_best
        # Ties at the k-th value: keep the first ones, just enough to make k (rows with < k keys have -inf).
        tied = (scores == kth_best) & (kth_best > float("-inf"))
        tied &= tied.cumsum(-1) <= self.k - above.sum(-1, keepdim=True)
        row, col, self.count, slot = _left_aligned(above | tied)
        src, dst = row * width + col, row * self.capacity + slot
        self.keys.view(-1).index_copy_(0, dst, self.keys[:, :width].reshape(-1).index_select(0, src))
        self.scores.view(-1).index_copy_(0, dst, scores.view(-1).index_select(0, src))
        self.threshold = torch.maximum(self.threshold, kth_best)


def _left_aligned(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For a mask [rows, n]: row and column of each kept entry (row-major), the count per row, and each one's
    slot when the kept entries of a row are packed to the left in order."""
    row, col = keep.nonzero(as_tuple=True)
    counts = torch.bincount(row, minlength=keep.shape[0])
    slot = torch.arange(row.numel(), device=row.device) - (counts.cumsum(0) - counts).index_select(0, row)
    return row, col, counts, slot


def _expand_rows(
    block_ids: torch.Tensor,
    block_first: torch.Tensor,
    pool: int,
    tail_start: torch.Tensor,
    tail_len: torch.Tensor,
    slots: int,
) -> torch.Tensor:
    """Ascending selected blocks [B, Q, m] (-1 padded) -> token rows [B, Q, slots]: tokens, tail, -1."""
    batch, queries, kept = block_ids.shape
    valid = block_ids >= 0
    offsets = torch.arange(pool, device=block_ids.device)
    tokens = block_first[block_ids.clamp_min(0)][..., None] + offsets
    tokens = tokens.masked_fill(~valid[..., None], -1).view(batch, queries, kept * pool)
    # One spare column receives the scatter writes of absent tail tokens and is dropped.
    rows = torch.full((batch, queries, slots + 1), -1, dtype=torch.long, device=block_ids.device)
    rows[..., : kept * pool] = tokens
    if pool > 1:
        tail_offsets = offsets[: pool - 1]
        where = valid.sum(-1, keepdim=True) * pool + tail_offsets
        where = torch.where(tail_offsets < tail_len[:, None], where, slots)
        rows.scatter_(-1, where, (tail_start[:, None] + tail_offsets).expand(batch, -1, -1))
    return rows[..., :slots].to(torch.int32)
