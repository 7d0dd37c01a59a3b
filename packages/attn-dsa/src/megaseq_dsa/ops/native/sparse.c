/* Sparse MQA attention over selected key rows on CPU, one query at a time, and the indexer's KL over the same
 * rows: the maths of ops/sparse.py (see its docstring) in one pass per query instead of gathered chunks.
 *
 * Why C: on CPU a query's products are [H, D] x [D, S] with H = 4 rows, where a batched matmul reaches a third
 * of the CPU's matmul rate, and the gathered copies of the selected rows and their scattered gradients cost as
 * much again. Here each selected row is read where it lies, once per pass, and used while it is in L1.
 *
 * Layout: fp32 throughout (float64 callers take the PyTorch path), rows contiguous. kv [Tk, W]: a key is
 * columns [0, D) of its row, a value columns [voff, voff + Dv) (MLA's shared latent: voff = 0, Dv <= D).
 * idx [Tq, S] int32 key rows, -1 = padding anywhere in a row, the others distinct. Every function takes a
 * query range [q0, q1) so that threads split the queries; the gradients of rows (d_kv, d_k_idx) are sums
 * over queries and go to the caller's buffer, one per thread.
 *
 * The bodies are inlined with constant sizes for the shapes in `specialised` (the compiler then keeps a
 * query's accumulators in registers and unrolls the dot products) and with run-time sizes for the rest.
 * Compiled with reassociation allowed (vectorised dot products) but without -ffast-math's finite-math and
 * flush-to-zero assumptions: -inf marks a query without keys, as in the PyTorch path.
 */
#include <stdint.h>
#include <string.h>

#include "megaseq_math.h"

BODY float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* Selected rows lie anywhere in the sequence (past L2 at long lengths): each loop over them asks for the row
 * AHEAD places on while it works on this one. */
#define AHEAD 8

BODY void prefetch_row(const float *base, const int32_t *restrict sel, int64_t j, int64_t m, int64_t width, int write) {
    if (j + AHEAD >= m) return;
    const char *row = (const char *)(base + (int64_t)sel[j + AHEAD] * width);
    for (int64_t b = 0; b < width * (int64_t)sizeof(float); b += 64) {
        if (write) __builtin_prefetch(row + b, 1);
        else __builtin_prefetch(row + b, 0);
    }
}

/* The valid entries of one index row, in order; their count. */
BODY int64_t compact(const int32_t *restrict row, int64_t slots, int32_t *restrict out) {
    int64_t m = 0;
    for (int64_t s = 0; s < slots; s++)
        if (row[s] >= 0) out[m++] = row[s];
    return m;
}

/* The indexer's KL(target || softmax(I)) of one query over its m rows sel, and its gradients (the maths of
 * megaseq_dsa.indexer.kl_and_grads): target [m] sums to 1; d_q_idx [Hi, Di] and d_w [Hi] written, d_k_idx
 * rows accumulated. per_head: Hi * m floats, index: m floats of scratch. Returns the query's KL. */
BODY float indexer_kl_row(
    int64_t m, const int32_t *restrict sel, const float *restrict target, int64_t Hi, int64_t Di,
    const float *restrict q_idx, const float *restrict k_idx, const float *restrict w, float *restrict per_head,
    float *restrict index, float *restrict d_q_idx, float *restrict d_w, float *restrict d_k_idx) {
    float top = -INFINITY;
    for (int64_t j = 0; j < m; j++) {
        prefetch_row(k_idx, sel, j, m, Di, 0);
        const float *key = k_idx + (int64_t)sel[j] * Di;
        float score = 0.0f;
        for (int64_t h = 0; h < Hi; h++) {
            float r = dot(q_idx + h * Di, key, Di);
            r = r > 0.0f ? r : 0.0f;
            per_head[h * m + j] = r;
            score += w[h] * r;
        }
        index[j] = score;
        top = score > top ? score : top;
    }
    float total = 0.0f, target_sum = 0.0f;
    for (int64_t j = 0; j < m; j++) total += exp_nonpositive(index[j] - top);
    for (int64_t j = 0; j < m; j++) target_sum += target[j];
    const float shift = top + log_positive(total);
    float kl = 0.0f;
    for (int64_t j = 0; j < m; j++) {
        const float log_q = index[j] - shift, t = target[j];
        kl += t > 0.0f ? t * (log_positive(t) - log_q) : 0.0f; /* xlogy(t, t) - t log_q */
        index[j] = exp_nonpositive(log_q) * target_sum - t;    /* dKL/dI */
    }
    for (int64_t h = 0; h < Hi; h++) {
        float dw = 0.0f;
        float *restrict dq = d_q_idx + h * Di;
        for (int64_t d = 0; d < Di; d++) dq[d] = 0.0f;
        for (int64_t j = 0; j < m; j++) {
            const float r = per_head[h * m + j];
            dw += r * index[j];
            const float g = r > 0.0f ? w[h] * index[j] : 0.0f; /* through the relu and the head weight */
            per_head[h * m + j] = g;
            const float *key = k_idx + (int64_t)sel[j] * Di;
            for (int64_t d = 0; d < Di; d++) dq[d] += g * key[d];
        }
        d_w[h] = dw;
    }
    for (int64_t j = 0; j < m; j++) {
        prefetch_row(d_k_idx, sel, j, m, Di, 1);
        float *restrict dk = d_k_idx + (int64_t)sel[j] * Di;
        for (int64_t h = 0; h < Hi; h++) {
            const float g = per_head[h * m + j];
            for (int64_t d = 0; d < Di; d++) dk[d] += g * q_idx[h * Di + d];
        }
    }
    return kl;
}

/* Forward of queries [q0, q1): o [Tq, H, Dv] and lse [Tq, H] written. acc: H * Dv floats; work: (H + 2 + Hi)
 * * S floats; sel: S ints. With q_idx non-NULL also the indexer KL (returned) and its gradients. */
BODY double forward_body(
    int64_t q0, int64_t q1, int64_t H, int64_t D, int64_t Dv, int64_t S, int64_t W, int64_t voff,
    const float *restrict q, const float *restrict kv, const int32_t *restrict idx, float scale, float *restrict o,
    float *restrict lse, float *restrict acc, float *restrict work, int32_t *restrict sel, int64_t Hi, int64_t Di,
    const float *restrict q_idx, const float *restrict k_idx, const float *restrict w, float *restrict d_q_idx,
    float *restrict d_w, float *restrict d_k_idx) {
    double kl = 0.0;
    float *probs = work, *target = work + H * S, *per_head = target + S, *index = per_head + Hi * S;
    for (int64_t t = q0; t < q1; t++) {
        const int64_t m = compact(idx + t * S, S, sel);
        const float *qt = q + t * H * D;
        if (m == 0) {
            memset(o + t * H * Dv, 0, H * Dv * sizeof(float));
            for (int64_t h = 0; h < H; h++) lse[t * H + h] = -INFINITY;
            if (q_idx) {
                memset(d_q_idx + t * Hi * Di, 0, Hi * Di * sizeof(float));
                memset(d_w + t * Hi, 0, Hi * sizeof(float));
            }
            continue;
        }
        for (int64_t j = 0; j < m; j++) {
            prefetch_row(kv, sel, j, m, W, 0);
            const float *row = kv + (int64_t)sel[j] * W;
            for (int64_t h = 0; h < H; h++) probs[h * m + j] = scale * dot(qt + h * D, row, D);
        }
        for (int64_t h = 0; h < H; h++) {
            float *p = probs + h * m, top = p[0], total = 0.0f;
            for (int64_t j = 1; j < m; j++) top = p[j] > top ? p[j] : top;
            for (int64_t j = 0; j < m; j++) {
                p[j] = exp_nonpositive(p[j] - top);
                total += p[j];
            }
            lse[t * H + h] = top + log_positive(total);
            const float inv = 1.0f / total;
            for (int64_t j = 0; j < m; j++) p[j] *= inv;
        }
        for (int64_t i = 0; i < H * Dv; i++) acc[i] = 0.0f;
        for (int64_t j = 0; j < m; j++) {
            prefetch_row(kv, sel, j, m, W, 0);
            const float *value = kv + (int64_t)sel[j] * W + voff;
            for (int64_t h = 0; h < H; h++) {
                const float p = probs[h * m + j];
                for (int64_t d = 0; d < Dv; d++) acc[h * Dv + d] += p * value[d];
            }
        }
        memcpy(o + t * H * Dv, acc, H * Dv * sizeof(float));
        if (!q_idx) continue;
        for (int64_t j = 0; j < m; j++) {
            float mean = 0.0f;
            for (int64_t h = 0; h < H; h++) mean += probs[h * m + j];
            target[j] = mean / (float)H;
        }
        kl += indexer_kl_row(m, sel, target, Hi, Di, q_idx + t * Hi * Di, k_idx, w + t * Hi, per_head, index,
                             d_q_idx + t * Hi * Di, d_w + t * Hi, d_k_idx);
    }
    return kl;
}

/* Backward of queries [q0, q1): d_q [Tq, H, D] written (the scale included), d_kv [Tk, W] accumulated; lse
 * [Tq, H] from the forward, delta [Tq, H] = rowsum(dO * O). acc: H * D + 2 * H floats; sel: S ints. */
BODY void backward_body(
    int64_t q0, int64_t q1, int64_t H, int64_t D, int64_t Dv, int64_t S, int64_t W, int64_t voff,
    const float *restrict q, const float *restrict kv, const int32_t *restrict idx, float scale,
    const float *restrict d_o, const float *restrict lse, const float *restrict delta, float *restrict d_q,
    float *restrict d_kv, float *restrict acc, int32_t *restrict sel) {
    float *dq = acc, *p = acc + H * D, *ds = p + H;
    for (int64_t t = q0; t < q1; t++) {
        const int64_t m = compact(idx + t * S, S, sel);
        const float *qt = q + t * H * D, *dot_t = d_o + t * H * Dv;
        for (int64_t i = 0; i < H * D; i++) dq[i] = 0.0f;
        for (int64_t j = 0; j < m; j++) {
            prefetch_row(kv, sel, j, m, W, 0);
            prefetch_row(d_kv, sel, j, m, W, 1);
            const float *row = kv + (int64_t)sel[j] * W, *value = row + voff;
            for (int64_t h = 0; h < H; h++) {
                p[h] = exp_nonpositive(scale * dot(qt + h * D, row, D) - lse[t * H + h]); /* P = exp(S - lse) */
                ds[h] = p[h] * (dot(dot_t + h * Dv, value, Dv) - delta[t * H + h]);       /* P (dP - delta) */
            }
            for (int64_t h = 0; h < H; h++)
                for (int64_t d = 0; d < D; d++) dq[h * D + d] += ds[h] * row[d];
            float *grad = d_kv + (int64_t)sel[j] * W;
            for (int64_t d = 0; d < D; d++) {
                float g = 0.0f;
                for (int64_t h = 0; h < H; h++) g += ds[h] * qt[h * D + d];
                grad[d] += scale * g;
            }
            for (int64_t d = 0; d < Dv; d++) {
                float g = 0.0f;
                for (int64_t h = 0; h < H; h++) g += p[h] * dot_t[h * Dv + d];
                grad[voff + d] += g;
            }
        }
        for (int64_t i = 0; i < H * D; i++) d_q[t * H * D + i] = scale * dq[i];
    }
}

/* The shapes compiled with constant sizes: (H, D, Dv, Hi, Di). */
#define SPECIALISED(X) X(4, 64, 64, 4, 32)

double dsa_sparse_forward(
    int64_t q0, int64_t q1, int64_t H, int64_t D, int64_t Dv, int64_t S, int64_t W, int64_t voff,
    const float *q, const float *kv, const int32_t *idx, float scale, float *o, float *lse, float *work,
    int32_t *sel, int64_t Hi, int64_t Di, const float *q_idx, const float *k_idx, const float *w,
    float *d_q_idx, float *d_w, float *d_k_idx) {
#define FORWARD(H_, D_, DV_, HI_, DI_)                                                                        \
    if (H == H_ && D == D_ && Dv == DV_ && (!q_idx || (Hi == HI_ && Di == DI_))) {                          \
        float acc[H_ * DV_];                                                                              \
        return forward_body(q0, q1, H_, D_, DV_, S, W, voff, q, kv, idx, scale, o, lse, acc, work, sel, HI_, \
                            DI_, q_idx, k_idx, w, d_q_idx, d_w, d_k_idx);                                   \
    }
    SPECIALISED(FORWARD)
    return forward_body(q0, q1, H, D, Dv, S, W, voff, q, kv, idx, scale, o, lse, work + (H + 2 + Hi) * S,
                        work, sel, Hi, Di, q_idx, k_idx, w, d_q_idx, d_w, d_k_idx);
}

void dsa_sparse_backward(
    int64_t q0, int64_t q1, int64_t H, int64_t D, int64_t Dv, int64_t S, int64_t W, int64_t voff,
    const float *q, const float *kv, const int32_t *idx, float scale, const float *d_o, const float *lse,
    const float *delta, float *d_q, float *d_kv, float *work, int32_t *sel) {
#define BACKWARD(H_, D_, DV_, HI_, DI_)                                                                       \
    if (H == H_ && D == D_ && Dv == DV_) {                                                                  \
        float acc[H_ * D_ + 2 * H_];                                                                      \
        backward_body(q0, q1, H_, D_, DV_, S, W, voff, q, kv, idx, scale, d_o, lse, delta, d_q, d_kv, acc,  \
                      sel);                                                                                 \
        return;                                                                                             \
    }
    SPECIALISED(BACKWARD)
    backward_body(q0, q1, H, D, Dv, S, W, voff, q, kv, idx, scale, d_o, lse, delta, d_q, d_kv, work, sel);
}
