/* The lightning indexer's top-k on CPU: each query's best k candidate blocks by
 *
 *     I(t, s) = sum_h w[t, h] relu(q[t, h] . key[s])
 *
 * over the blocks s in [lo[t], hi[t]] it sees, equal scores to the earlier block (ops/indexer.py's rule), as
 * ascending block ids padded with -1; a query that sees at most k blocks gets all of them.
 *
 * Why C: the PyTorch path computes a query block's per-head products with a matmul, then relu, the weighted
 * head sum and numpy's selection as separate passes over [queries x heads x keys] in memory. Here a block of
 * QUERIES queries scores a tile of 16 keys at a time in registers, from keys stored transposed (keys_t [Di, n]:
 * a tile's keys are one vector per index dimension, loaded once for all the block's queries and heads), and
 * keeps each tile's largest score beside its scores; a group of such blocks scores KEY_TILE keys at a time, so
 * that the keys come from cache, not memory, once they outgrow it (a million tokens: 32 MiB of keys). A
 * query's k-th largest score is then found among few
 * scores: where k whole tiles lie in its range, the k-th largest of their maxima is a lower bound of it (k tiles
 * each hold a visible score at least that large), and only the tiles whose maximum reaches the bound (and the
 * partial tiles at the range's ends) are searched. Scores are summed in a fixed order (index dimensions, then
 * heads), so every run and every thread count selects the same keys.
 */
#include <stdint.h>
#include <string.h>

#include "megaseq_math.h"
#define LANES 16
#define QUERIES 4
#define KEY_TILE 2048 /* keys scored by a whole group of queries at a time: 256 KiB of keys_t at 32 dimensions */

/* The k-th largest of x[0..n) (1 <= k <= n), reordering x: quickselect, median-of-three pivots. */
static float kth_largest(float *x, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1, want = k - 1; /* x sorted descending: want x[want] */
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        float a = x[lo], b = x[mid], c = x[hi];
        const float pivot = a > b ? (b > c ? b : (a > c ? c : a)) : (a > c ? a : (b > c ? c : b));
        int64_t i = lo, j = hi;
        while (i <= j) { /* descending: > pivot left, < pivot right */
            while (x[i] > pivot) i++;
            while (x[j] < pivot) j--;
            if (i <= j) {
                const float t = x[i];
                x[i] = x[j];
                x[j] = t;
                i++;
                j--;
            }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else return x[want];
    }
    return x[want];
}

/* A tile of 16 keys' scores as one vector (GCC's vector extension: AVX-512 registers here, split into
 * narrower ones by the compiler elsewhere), so that a block's accumulators stay in registers. */
typedef float v16 __attribute__((vector_size(4 * LANES)));
typedef int32_t v16i __attribute__((vector_size(4 * LANES)));
typedef float v16u __attribute__((vector_size(4 * LANES), aligned(4), may_alias)); /* unaligned loads */

/* Scores of QUERIES queries (rows of q [QUERIES, Hi, Di], w [QUERIES, Hi]) over the keys [start, end) into
 * rows of scores (row r at scores + r * stride, column s - start), and the largest of each tile of 16 keys
 * from start into rows of maxima (row r at maxima + r * tiles; a last partial tile's maximum counts the
 * padding's scores and is never used). */
BODY void score_block(
    int64_t Hi, int64_t Di, int64_t nq, const float *restrict q, const float *restrict w,
    const float *restrict keys_t, int64_t n_pad, int64_t start, int64_t end, float *restrict scores,
    int64_t stride, float *restrict maxima, int64_t tiles) {
    const v16 zero = {0};
    for (int64_t s = start; s < end; s += LANES) {
        v16 total[QUERIES];
        for (int64_t r = 0; r < QUERIES; r++) total[r] = zero;
        for (int64_t h = 0; h < Hi; h++) {
            v16 acc[QUERIES];
            for (int64_t r = 0; r < QUERIES; r++) acc[r] = zero;
            for (int64_t d = 0; d < Di; d++) {
                const v16 key = *(const v16u *)(keys_t + d * n_pad + s);
                for (int64_t r = 0; r < QUERIES; r++) acc[r] += q[(r * Hi + h) * Di + d] * key;
            }
            for (int64_t r = 0; r < QUERIES; r++) {
                const v16 relu = (v16)((v16i)acc[r] & (acc[r] > zero));
                total[r] += w[r * Hi + h] * relu;
            }
        }
        const int64_t width = end - s < LANES ? end - s : LANES;
        for (int64_t r = 0; r < nq; r++) {
            memcpy(scores + r * stride + (s - start), &total[r], width * sizeof(float));
            float top = total[r][0];
            for (int64_t l = 1; l < LANES; l++) top = total[r][l] > top ? total[r][l] : top;
            maxima[r * tiles + (s - start) / LANES] = top;
        }
    }
}

/* One query's k best of its scores (key ids first + i for scores[i], i < n): out [k], ascending, -1 padded.
 * The tile maxima (module comment) of its block start `offset` scores before scores[0]. work: n floats and n
 * ints. */
static void select_row(
    const float *scores, int64_t n, int64_t first, int64_t k, const float *maxima, int64_t offset, float *work,
    int64_t *out) {
    if (n <= k) {
        for (int64_t i = 0; i < k; i++) out[i] = i < n ? first + i : -1;
        return;
    }
    int32_t *candidates = (int32_t *)(work + n); /* ascending positions of the scores that may be among the k best */
    int64_t m = 0;
    /* the whole tiles in the range: scores[head + LANES j], j < whole, start tile t0 + j of the block */
    const int64_t t0 = (offset + LANES - 1) / LANES, head = t0 * LANES - offset;
    const int64_t whole = head < n ? (n - head) / LANES : 0;
    if (whole >= k) {
        memcpy(work, maxima + t0, whole * sizeof(float));
        const float bound = kth_largest(work, whole, k);
        for (int64_t i = 0; i < head; i++)
            if (scores[i] >= bound) candidates[m++] = (int32_t)i;
        for (int64_t j = 0; j < whole; j++) {
            if (maxima[t0 + j] < bound) continue;
            for (int64_t i = head + j * LANES; i < head + (j + 1) * LANES; i++)
                if (scores[i] >= bound) candidates[m++] = (int32_t)i;
        }
        for (int64_t i = head + whole * LANES; i < n; i++)
            if (scores[i] >= bound) candidates[m++] = (int32_t)i;
    } else {
        for (int64_t i = 0; i < n; i++) candidates[m++] = (int32_t)i;
    }
    for (int64_t j = 0; j < m; j++) work[j] = scores[candidates[j]];
    const float kth = kth_largest(work, m, k);
    int64_t above = 0;
    for (int64_t j = 0; j < m; j++) above += scores[candidates[j]] > kth;
    int64_t ties = k - above, taken = 0; /* the earliest keys tied with the k-th score fill the rest */
    for (int64_t j = 0; j < m; j++) {
        const float x = scores[candidates[j]];
        if (x > kth || (x == kth && ties-- > 0)) out[taken++] = first + candidates[j];
    }
}

BODY void select_body(
    int64_t q0, int64_t q1, int64_t Hi, int64_t Di, const float *restrict q, const float *restrict w,
    const float *restrict keys_t, int64_t n_pad, const int64_t *restrict lo, const int64_t *restrict hi, int64_t k,
    int64_t group, int64_t *restrict out, float *restrict scores, float *restrict work, float *restrict block) {
    float *qb = block, *wb = block + QUERIES * Hi * Di; /* four queries, zero rows past the last */
    float *maxima = wb + QUERIES * Hi;
    for (int64_t g0 = q0; g0 < q1; g0 += group) {
        const int64_t ng = q1 - g0 < group ? q1 - g0 : group;
        int64_t start = INT64_MAX, end = 0;
        for (int64_t t = g0; t < g0 + ng; t++) {
            if (hi[t] < lo[t]) continue;
            start = lo[t] < start ? lo[t] : start;
            end = hi[t] + 1 > end ? hi[t] + 1 : end;
        }
        const int64_t stride = end > start ? end - start : 0, tiles = (stride + LANES - 1) / LANES;
        /* a tile of keys is scored by every four queries of the group while it is in cache */
        for (int64_t k0 = start; k0 < end; k0 += KEY_TILE) {
            const int64_t k1 = end - k0 < KEY_TILE ? end : k0 + KEY_TILE;
            for (int64_t t0 = g0; t0 < g0 + ng; t0 += QUERIES) {
                const int64_t nq = g0 + ng - t0 < QUERIES ? g0 + ng - t0 : QUERIES;
                memset(block, 0, QUERIES * Hi * (Di + 1) * sizeof(float));
                memcpy(qb, q + t0 * Hi * Di, nq * Hi * Di * sizeof(float));
                memcpy(wb, w + t0 * Hi, nq * Hi * sizeof(float));
                score_block(Hi, Di, nq, qb, wb, keys_t, n_pad, k0, k1, scores + (t0 - g0) * stride + (k0 - start),
                            stride, maxima + (t0 - g0) * tiles + (k0 - start) / LANES, tiles);
            }
        }
        for (int64_t t = g0; t < g0 + ng; t++) {
            const int64_t n = hi[t] - lo[t] + 1;
            if (n <= 0) {
                for (int64_t i = 0; i < k; i++) out[t * k + i] = -1;
                continue;
            }
            select_row(scores + (t - g0) * stride + (lo[t] - start), n, lo[t], k, maxima + (t - g0) * tiles,
                       lo[t] - start, work, out + t * k);
        }
    }
}

/* Queries [q0, q1) of q [Tq, Hi, Di] and w [Tq, Hi] over keys_t [Di, n_pad] (the n candidate blocks' keys
 * transposed, zero columns from n to n_pad >= round_up(n, 16) + 16), each seeing the blocks [lo[t], hi[t]]:
 * out [Tq, k] (written for rows [q0, q1)). Queries go in groups of `group` (a multiple of 4), whose scores
 * are kept together. Scratch: scores group * n, work 2 n and block QUERIES * Hi * (Di + 1) + group * (n / 16 +
 * 1) floats. */
void dsa_select(
    int64_t q0, int64_t q1, int64_t Hi, int64_t Di, const float *q, const float *w, const float *keys_t,
    int64_t n_pad, const int64_t *lo, const int64_t *hi, int64_t k, int64_t group, int64_t *out, float *scores,
    float *work, float *block) {
    if (Hi == 4 && Di == 32)
        select_body(q0, q1, 4, 32, q, w, keys_t, n_pad, lo, hi, k, group, out, scores, work, block);
    else
        select_body(q0, q1, Hi, Di, q, w, keys_t, n_pad, lo, hi, k, group, out, scores, work, block);
}
