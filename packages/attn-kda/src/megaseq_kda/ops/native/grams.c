/* KDA's gated Gram matrices of each chunk on CPU, forward and backward, straight from their definition:
 *
 *     A_kk[s, j] = sum_d k_s[d] k_j[d] exp(G_s[d] - G_j[d])   (j < s)
 *     A_qk[s, j] = sum_d q_s[d] k_j[d] exp(G_s[d] - G_j[d])   (j <= s)
 *
 * with G the chunk's float64 cumulative log-decay, each exponent (<= 0) a float64 difference exponentiated in
 * fp32, as ops/chunk.py's _GatedGrams (the oracle) does. The PyTorch path factorises the exponents into
 * rebased blocks to keep its products large, and spends its time in elementwise passes over memory; here each
 * (s, j) pair's K decays are formed once in registers and used for both Grams (and, in backward, for every
 * gradient), one pass over the chunk. Chunks are independent, so threads split them.
 *
 * Layout: n chunks of L rows, rows of K contiguous: k, q [n, L, K] fp32, G [n, L, K] float64, Grams
 * [n, L, L] fp32 (written whole: zeros above the diagonal, and on it for A_kk). Backward adds to dk, dq [n, L, K]
 * (fp32) and dG [n, L, K] (float64). Compiled as ops/native's other kernels (reassociation for the vectorised
 * sums, no finite-math assumptions).
 */
#include <stdint.h>
#include <string.h>

#include "megaseq_math.h"

BODY void forward_body(
    int64_t c0, int64_t c1, int64_t L, int64_t K, const float *restrict k, const float *restrict q,
    const double *restrict G, float *restrict A_kk, float *restrict A_qk) {
    for (int64_t c = c0; c < c1; c++) {
        const float *kc = k + c * L * K, *qc = q + c * L * K;
        const double *Gc = G + c * L * K;
        float *akk = A_kk + c * L * L, *aqk = A_qk + c * L * L;
        memset(akk, 0, L * L * sizeof(float));
        memset(aqk, 0, L * L * sizeof(float));
        for (int64_t s = 0; s < L; s++) {
            const float *ks = kc + s * K, *qs = qc + s * K;
            const double *Gs = Gc + s * K;
            for (int64_t j = 0; j <= s; j++) {
                const float *kj = kc + j * K;
                const double *Gj = Gc + j * K;
                float sum_kk = 0.0f, sum_qk = 0.0f;
                for (int64_t d = 0; d < K; d++) {
                    const float t = kj[d] * exp_nonpositive((float)(Gs[d] - Gj[d]));
                    sum_kk += ks[d] * t;
                    sum_qk += qs[d] * t;
                }
                if (j < s) akk[s * L + j] = sum_kk;
                aqk[s * L + j] = sum_qk;
            }
        }
    }
}

BODY void backward_body(
    int64_t c0, int64_t c1, int64_t L, int64_t K, const float *restrict k, const float *restrict q,
    const double *restrict G, const float *restrict dA_kk, const float *restrict dA_qk, float *restrict dk,
    float *restrict dq, double *restrict dG, float *restrict acc) {
    float *dks = acc, *dqs = acc + K; /* row s's gradients, summed over its pairs */
    double *dGs = (double *)(acc + 2 * K);
    for (int64_t c = c0; c < c1; c++) {
        const float *kc = k + c * L * K, *qc = q + c * L * K;
        const double *Gc = G + c * L * K;
        const float *gkk = dA_kk + c * L * L, *gqk = dA_qk + c * L * L;
        float *dkc = dk + c * L * K, *dqc = dq + c * L * K;
        double *dGc = dG + c * L * K;
        for (int64_t s = 0; s < L; s++) {
            const float *ks = kc + s * K, *qs = qc + s * K;
            const double *Gs = Gc + s * K;
            for (int64_t d = 0; d < K; d++) {
                dks[d] = 0.0f;
                dqs[d] = 0.0f;
                dGs[d] = 0.0;
            }
            for (int64_t j = 0; j <= s; j++) {
                const float *kj = kc + j * K;
                const double *Gj = Gc + j * K;
                float *dkj = dkc + j * K;
                double *dGj = dGc + j * K;
                const float a = j < s ? gkk[s * L + j] : 0.0f, b = gqk[s * L + j];
                for (int64_t d = 0; d < K; d++) {
                    const float e = exp_nonpositive((float)(Gs[d] - Gj[d]));
                    const float kje = kj[d] * e;
                    const float row = a * ks[d] + b * qs[d]; /* d(A_kk, A_qk)[s, j] through row s */
                    dks[d] += a * kje;
                    dqs[d] += b * kje;
                    dkj[d] += row * e;
                    const double exponent = (double)(row * kje); /* d/d(G_s - G_j) */
                    dGs[d] += exponent;
                    dGj[d] -= exponent;
                }
            }
            float *dksc = dkc + s * K, *dqsc = dqc + s * K;
            double *dGsc = dGc + s * K;
            for (int64_t d = 0; d < K; d++) {
                dksc[d] += dks[d];
                dqsc[d] += dqs[d];
                dGsc[d] += dGs[d];
            }
        }
    }
}

/* Chunks [c0, c1): the Grams. */
void kda_grams_forward(int64_t c0, int64_t c1, int64_t L, int64_t K, const float *k, const float *q,
                       const double *G, float *A_kk, float *A_qk) {
    if (L == 64 && K == 64) forward_body(c0, c1, 64, 64, k, q, G, A_kk, A_qk);
    else forward_body(c0, c1, L, K, k, q, G, A_kk, A_qk);
}

/* Chunks [c0, c1): the gradients added into dk, dq, dG. acc: 4 K floats of scratch. */
void kda_grams_backward(int64_t c0, int64_t c1, int64_t L, int64_t K, const float *k, const float *q,
                        const double *G, const float *dA_kk, const float *dA_qk, float *dk, float *dq, double *dG,
                        float *acc) {
    if (L == 64 && K == 64) backward_body(c0, c1, 64, 64, k, q, G, dA_kk, dA_qk, dk, dq, dG, acc);
    else backward_body(c0, c1, L, K, k, q, G, dA_kk, dA_qk, dk, dq, dG, acc);
}
