"""Lightning-indexer scoring fused with a running top-k, in Triton.

The candidates are those of ``megaseq_dsa.ops.indexer.pooled_candidates``: complete blocks of ``pool`` keys
aligned to their document's start, scored by their mean index key (pool=1: every key, scored by itself).
Each query row sees a contiguous range of candidates [first, last] (its document's blocks whose tokens are
all <= its position). One program owns a block of BLOCK_Q query rows of one sequence; it walks the
candidate blocks those rows can see, scores a [BLOCK_Q, BLOCK_K] tile as ``sum_j w[t, j] * relu(q[t, j] .
k[c])`` with a single ``tl.dot`` over all index heads at once ([BLOCK_Q * heads, D] x [D, BLOCK_K]), and
merges the tile into a per-row top-(topk // pool) list kept on chip, so the [Tq, Tk] score matrix never
exists. The chosen candidates are expanded to their tokens, and the query's own incomplete tail block is
added, by the torch path's ``expand_rows``: the output convention and the tie rule are ``select_topk``'s.

Each candidate is packed into one int64 sort key: the score's bits mapped to an order-preserving signed
int32 in the high word, the candidate index in the low word. Sorting keys sorts by score, ties go to the
earlier candidate (the earlier key), and the index travels with its score through the sort. Merging uses
the bitonic top-k step: the running list (sorted descending) and the new tile (sorted ascending, left-padded
with the empty key) are combined by an elementwise max, which keeps the best of both and is bitonic, so one
bitonic merge re-sorts it. A tile whose best key cannot beat any row's current list minimum is skipped.

The running list holds max(next_pow2(topk // pool), BLOCK_K) int64 keys per row (512 at GLM's topk 2048 and
pool 4), BLOCK_Q x that x 8 bytes per program: that is why BLOCK_Q is kept small. Pooled keys are averaged
in fp32 and scored in the index queries' dtype (bf16 inputs: the mean is rounded to bf16 first; the torch
path scores it in fp32). GPU speed is unmeasured.
"""

import torch
import triton
import triton.language as tl

from megaseq.documents import Documents, as_documents
from megaseq.dtypes import compute_dtype
from megaseq_dsa.ops.indexer import (
    check_index_inputs,
    check_topk_and_pool,
    expand_rows,
    pooled_candidates,
    selected_slots,
)
from megaseq_dsa.ops.triton._launch import check_runnable

# Smaller than every packed (score, position) key, so empty slots sort last. Kernels may only read constexpr
# globals.
_EMPTY_KEY = tl.constexpr(-(2**63))
BLOCK_K = 64
# ptxas for sm_90 at Hi=32, D=128, topk=2048 (bf16) still spills ~4 KB per thread with 8 warps (12 KB with 4,
# 2.2 KB with 16, which spill 2.7x more than 8 at topk=512): tests/test_hopper_fit.py holds it to that.
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
    first_ptr,
    last_ptr,
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
    # The candidate range each row sees; padding rows get an empty range that widens no other.
    first = tl.load(first_ptr + tokens, mask=row_ok, other=TK)
    last = tl.load(last_ptr + tokens, mask=row_ok, other=-1)

    best = tl.full([BLOCK_Q, K_LIST], _EMPTY_KEY, tl.int64)
    first_key = (tl.min(first) // BLOCK_K) * BLOCK_K
    end_key = tl.max(last) + 1
    for key_start in range(first_key, end_key, BLOCK_K):
        cols = key_start + tl.arange(0, BLOCK_K)
        k_mask = (dims < D)[:, None] & (cols < TK)[None, :]
        k_t = tl.load(k_ptr + (batch * TK + cols[None, :]) * D + dims[:, None], mask=k_mask, other=0.0)
        per_head = tl.maximum(tl.dot(q, k_t, input_precision="ieee"), 0.0)
        per_head = tl.reshape(per_head, [BLOCK_Q, HEADS_P, BLOCK_K])
        score = tl.sum(per_head * w[:, :, None], axis=1)
        visible = (cols[None, :] <= last[:, None]) & (cols[None, :] >= first[:, None])
        tile = tl.where(visible, _pack_score_and_position(score, cols[None, :]), _EMPTY_KEY)
        # Skip the sorts when no row's list minimum can be beaten (the common case once the lists are full).
        can_improve = tl.max(tile, axis=1) > tl.min(best, axis=1)
        if tl.sum(can_improve.to(tl.int32)) > 0:
            best = _merge_into_topk(best, tile, BLOCK_Q, BLOCK_K, LOG_BLOCK_K, K_LIST, LOG_K_LIST)

    # Rows are written in ascending candidate order, then -1 padding: sort the kept candidates with empty
    # slots and slots past TOPK mapped to TK, which sorts after every candidate.
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
    cu_seqlens: torch.Tensor | Documents | None = None,
    pool: int = 1,
    query_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """``megaseq_dsa.ops.select_topk`` on Triton kernels: same arguments (no block sizes), same output.

    q_idx [B, Tq, Hi, D], k_idx [B, Tk, D] (Tk >= Tq), weights [B, Tq, Hi]; cu_seqlens (int, [docs + 1] on
    the key axis, needs B == 1) restricts each query to its own document; pool: keys scored in blocks of this
    many (plus the query's own tail block); query_positions int [Tq] or [B, Tq]: each query's key position
    (default arange(Tq), needs Tk == Tq). Returns int32 [B, Tq, selected_slots(topk, pool)]: the selected
    positions in ascending order, then -1 padding; a query with <= topk visible keys gets all of them; equal
    scores go to the earlier key.
    """
    cu_seqlens = None if cu_seqlens is None else as_documents(cu_seqlens)  # read to the host once
    positions = check_index_inputs(q_idx, k_idx, weights, cu_seqlens, query_positions)
    check_topk_and_pool(topk, pool)
    if q_idx.dtype != k_idx.dtype:
        raise ValueError(f"q_idx and k_idx must share one dtype, got {q_idx.dtype} and {k_idx.dtype}")
    check_runnable(q_idx)
    batch, n_queries, heads, dim = q_idx.shape
    cand = pooled_candidates(k_idx, positions, cu_seqlens, pool, compute_dtype(q_idx.dtype))
    n_candidates, kept = cand.keys.shape[1], topk // pool
    chosen = torch.full((batch, n_queries, kept), -1, dtype=torch.int32, device=q_idx.device)
    if n_queries and n_candidates:
        heads_p = triton.next_power_of_2(heads)
        # BLOCK_Q * heads_p rows feed tl.dot: 64 (or heads_p when larger), above the dot's minimum of 16.
        block_q = max(1, 64 // heads_p)
        k_list = max(BLOCK_K, triton.next_power_of_2(kept))
        grid = (triton.cdiv(n_queries, block_q), batch)
        _indexer_topk_kernel[grid](
            q_idx.contiguous(),
            cand.keys.to(q_idx.dtype).contiguous(),
            weights.contiguous(),
            cand.first.to(torch.int32),
            cand.last.to(torch.int32),
            chosen,
            n_queries,
            n_candidates,
            heads,
            dim,
            kept,
            kept,
            BLOCK_Q=block_q,
            BLOCK_K=BLOCK_K,
            HEADS_P=heads_p,
            D_P=max(16, triton.next_power_of_2(dim)),
            LOG_BLOCK_K=BLOCK_K.bit_length() - 1,
            K_LIST=k_list,
            LOG_K_LIST=k_list.bit_length() - 1,
            num_warps=NUM_WARPS,
        )
    return expand_rows(chosen, cand.block_first, pool, cand.tail_start, cand.tail_len, selected_slots(topk, pool))
