"""Lightning-indexer scoring fused with a running top-k, in Triton.

One program owns a block of BLOCK_Q query rows of one sequence; each row sits at a key position (its
`query_positions` entry: keys may outnumber queries, as in decoding and context parallelism). It walks the
key blocks those rows can see (from the earliest of their document starts up to the latest position), scores
a [BLOCK_Q, BLOCK_K] tile as ``sum_j w[t, j] * relu(q[t, j] . k[s])`` with a single ``tl.dot`` over all index
heads at once ([BLOCK_Q * heads, D] x [D, BLOCK_K]), and merges the tile into a per-row top-k list kept on
chip, so the [Tq, Tk] score matrix never exists.

Each candidate is packed into one int64 sort key: the score's bits mapped to an order-preserving signed
int32 in the high word, the key position in the low word. Sorting keys sorts by score, ties go to the
earlier position, and the position travels with its score through the sort. Merging uses the bitonic
top-k step: the running list (sorted descending) and the new tile (sorted ascending, left-padded with the
empty key) are combined by an elementwise max, which keeps the best K of both and is bitonic, so one
bitonic merge re-sorts it. A tile whose best key cannot beat any row's current list minimum is skipped.

Only pool=1 is implemented here; pooled key selection (pool > 1) is served by the torch path.
The running list holds max(next_pow2(topk), BLOCK_K) int64 keys per row, so at topk=2048 it is
BLOCK_Q x 2048 x 8 bytes per program: that is why BLOCK_Q is kept small. GPU speed is unmeasured.
"""

import torch
import triton
import triton.language as tl

from megaseq_dsa.ops.indexer import check_index_inputs, document_starts, selected_slots
from megaseq_dsa.ops.triton._launch import check_runnable

# Smaller than every packed (score, position) key, so empty slots sort last. Kernels may only read constexpr
# globals.
_EMPTY_KEY = tl.constexpr(-(2**63))
BLOCK_K = 64
# ptxas for sm_90 at Hi=32, D=128, topk=2048 (bf16) still spills ~4 KB per thread with 8 warps (12 KB with 4).
NUM_WARPS = 8


@triton.jit
def _pack_score_and_position(score, position):
    # -0.0 and +0.0 have different bits but must tie.
    score = tl.where(score == 0.0, 0.0, score)
    bits = score.to(tl.int32, bitcast=True)
    # Negative floats order backwards by their bits; flipping their magnitude bits fixes the int order.
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    # Low word 0x7FFFFFFF - position: among equal scores the earlier position has the larger key.
    return (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - position).to(tl.int64)


@triton.jit
def _compare_exchange(
    x, ROWS: tl.constexpr, N: tl.constexpr, STRIDE: tl.constexpr, RUN: tl.constexpr, DESCENDING: tl.constexpr
):
    # Orders each pair (i, i + STRIDE) inside blocks of 2 * STRIDE; runs of RUN elements alternate direction
    # (RUN == N: one direction). Built from reshape/split/join rather than tl.sort, whose xor-reductions
    # run element by element in the Triton CPU interpreter and made the tests minutes long.
    pairs = tl.permute(tl.reshape(x, [ROWS, N // (2 * STRIDE), 2, STRIDE]), (0, 1, 3, 2))
    first, second = tl.split(pairs)
    low = tl.minimum(first, second)
    high = tl.maximum(first, second)
    position = (
        tl.arange(0, N // (2 * STRIDE))[None, :, None] * (2 * STRIDE) + tl.arange(0, STRIDE)[None, None, :]
    )
    ascending = ((position // RUN) % 2 == 0) != DESCENDING
    pairs = tl.join(tl.where(ascending, low, high), tl.where(ascending, high, low))
    return tl.reshape(tl.permute(pairs, (0, 1, 3, 2)), [ROWS, N])


@triton.jit
def _bitonic_merge_rows(
    x, ROWS: tl.constexpr, N: tl.constexpr, LOG_N: tl.constexpr, DESCENDING: tl.constexpr
):
    # Sorts rows that are already bitonic.
    for level in tl.static_range(LOG_N):
        x = _compare_exchange(x, ROWS, N, N >> (level + 1), N, DESCENDING)
    return x


@triton.jit
def _sort_rows_ascending(x, ROWS: tl.constexpr, N: tl.constexpr, LOG_N: tl.constexpr):
    # Bitonic sort: merge sorted runs of 2, 4, ..., N, alternating direction so each pair of runs is bitonic.
    for stage in tl.static_range(1, LOG_N + 1):
        for level in tl.static_range(stage):
            x = _compare_exchange(x, ROWS, N, 1 << (stage - 1 - level), 1 << stage, False)
    return x


@triton.jit
def _merge_into_topk(
    best,
    tile,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    LOG_BLOCK_K: tl.constexpr,
    K_LIST: tl.constexpr,
    LOG_K_LIST: tl.constexpr,
):
    tile = _sort_rows_ascending(tile, BLOCK_Q, BLOCK_K, LOG_BLOCK_K)
    if K_LIST > BLOCK_K:
        # Place the ascending tile in the last BLOCK_K slots so the padded row is ascending too.
        slot_group = tl.arange(0, K_LIST // BLOCK_K)[None, :, None]
        tile = tl.where(slot_group == K_LIST // BLOCK_K - 1, tile[:, None, :], _EMPTY_KEY)
        tile = tl.reshape(tile, [BLOCK_Q, K_LIST])
    # Elementwise max of a descending and an ascending row keeps the best K_LIST of both and is bitonic.
    return _bitonic_merge_rows(tl.maximum(best, tile), BLOCK_Q, K_LIST, LOG_K_LIST, True)


@triton.jit
def _indexer_topk_kernel(
    q_ptr,
    k_ptr,
    w_ptr,
    pos_ptr,
    doc_start_ptr,
    out_ptr,
    TQ,
    TK,
    HEADS,
    D,
    TOPK,
    OUT_WIDTH,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HEADS_P: tl.constexpr,
    D_P: tl.constexpr,
    LOG_BLOCK_K: tl.constexpr,
    K_LIST: tl.constexpr,
    LOG_K_LIST: tl.constexpr,
):
    q_start = tl.program_id(0) * BLOCK_Q
    batch = tl.program_id(1).to(tl.int64)
    rows = q_start + tl.arange(0, BLOCK_Q)
    row_ok = rows < TQ
    tokens = batch * TQ + rows
    heads = tl.arange(0, HEADS_P)
    dims = tl.arange(0, D_P)

    q_offsets = (tokens[:, None, None] * HEADS + heads[None, :, None]) * D + dims[None, None, :]
    q_mask = row_ok[:, None, None] & (heads < HEADS)[None, :, None] & (dims < D)[None, None, :]
    q = tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0)
    q = tl.reshape(q, [BLOCK_Q * HEADS_P, D_P])
    w_mask = row_ok[:, None] & (heads < HEADS)[None, :]
    w = tl.load(w_ptr + tokens[:, None] * HEADS + heads[None, :], mask=w_mask, other=0.0).to(tl.float32)
    # Position and document start of each row; padding rows get values that widen no key range.
    position = tl.load(pos_ptr + tokens, mask=row_ok, other=-1)
    doc_start = tl.load(doc_start_ptr + tokens, mask=row_ok, other=TK)

    best = tl.full([BLOCK_Q, K_LIST], _EMPTY_KEY, tl.int64)
    first_key = (tl.min(doc_start) // BLOCK_K) * BLOCK_K
    end_key = tl.max(position) + 1
    for key_start in range(first_key, end_key, BLOCK_K):
        cols = key_start + tl.arange(0, BLOCK_K)
        k_mask = (dims < D)[:, None] & (cols < TK)[None, :]
        k_t = tl.load(k_ptr + (batch * TK + cols[None, :]) * D + dims[:, None], mask=k_mask, other=0.0)
        per_head = tl.maximum(tl.dot(q, k_t, input_precision="ieee"), 0.0)
        per_head = tl.reshape(per_head, [BLOCK_Q, HEADS_P, BLOCK_K])
        score = tl.sum(per_head * w[:, :, None], axis=1)
        visible = (cols[None, :] <= position[:, None]) & (cols[None, :] >= doc_start[:, None])
        tile = tl.where(visible, _pack_score_and_position(score, cols[None, :]), _EMPTY_KEY)
        # Skip the sorts when no row's list minimum can be beaten (the common case once the lists are full).
        can_improve = tl.max(tile, axis=1) > tl.min(best, axis=1)
        if tl.sum(can_improve.to(tl.int32)) > 0:
            best = _merge_into_topk(best, tile, BLOCK_Q, BLOCK_K, LOG_BLOCK_K, K_LIST, LOG_K_LIST)

    # Rows are written in ascending position order (the select_topk convention), then -1 padding: sort the
    # kept positions with empty slots and slots past TOPK mapped to TK, which sorts after every position.
    slots = tl.arange(0, K_LIST)
    kept = (best != _EMPTY_KEY) & (slots < TOPK)[None, :]
    positions = tl.where(kept, 0x7FFFFFFF - (best & 0xFFFFFFFF), TK)
    positions = _sort_rows_ascending(positions, BLOCK_Q, K_LIST, LOG_K_LIST)
    positions = tl.where(positions == TK, -1, positions)
    out_mask = row_ok[:, None] & (slots < TOPK)[None, :]
    tl.store(out_ptr + tokens[:, None] * OUT_WIDTH + slots[None, :], positions.to(tl.int32), mask=out_mask)


def select_topk_triton(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    weights: torch.Tensor,
    topk: int,
    cu_seqlens: torch.Tensor | None = None,
    query_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Top-``topk`` key positions per query by the lightning-indexer score (pool=1 only).

    q_idx [B, Tq, Hi, D], k_idx [B, Tk, D] (Tk >= Tq), weights [B, Tq, Hi]; query_positions int [Tq] or
    [B, Tq]: each query's key position (default arange(Tq), needs Tk == Tq); cu_seqlens (int, [docs + 1] on
    the key axis, needs B == 1) restricts each query to its own document. Returns int32
    [B, Tq, selected_slots(topk)]: the selected positions in ascending order, then -1 padding (the
    `select_topk` convention); a query with <= topk visible keys gets all of them. Equal scores at the cut
    are broken towards the earlier position, as in `select_topk`.
    """
    positions = check_index_inputs(q_idx, k_idx, weights, cu_seqlens, query_positions)
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
    if q_idx.dtype != k_idx.dtype:
        raise ValueError(f"q_idx and k_idx must share one dtype, got {q_idx.dtype} and {k_idx.dtype}")
    check_runnable(q_idx)
    batch, n_queries, heads, dim = q_idx.shape
    n_keys = k_idx.shape[1]
    out_width = selected_slots(topk)
    out = torch.full((batch, n_queries, out_width), -1, dtype=torch.int32, device=q_idx.device)
    if n_queries == 0:
        return out
    doc_start = document_starts(cu_seqlens, n_keys, q_idx.device)[positions].to(torch.int32)
    heads_p = triton.next_power_of_2(heads)
    # BLOCK_Q * heads_p rows feed tl.dot: 64 (or heads_p when larger), above the dot's minimum of 16.
    block_q = max(1, 64 // heads_p)
    k_list = max(BLOCK_K, triton.next_power_of_2(topk))
    grid = (triton.cdiv(n_queries, block_q), batch)
    _indexer_topk_kernel[grid](
        q_idx.contiguous(),
        k_idx.contiguous(),
        weights.contiguous(),
        positions.to(torch.int32),
        doc_start,
        out,
        n_queries,
        n_keys,
        heads,
        dim,
        topk,
        out_width,
        BLOCK_Q=block_q,
        BLOCK_K=BLOCK_K,
        HEADS_P=heads_p,
        D_P=max(16, triton.next_power_of_2(dim)),
        LOG_BLOCK_K=BLOCK_K.bit_length() - 1,
        K_LIST=k_list,
        LOG_K_LIST=k_list.bit_length() - 1,
        num_warps=NUM_WARPS,
    )
    return out
