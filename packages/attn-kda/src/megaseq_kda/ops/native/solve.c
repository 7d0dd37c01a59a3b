/* The unit lower-triangular solves of KDA's WY representation on CPU, per chunk: X = (I + A)^{-1} B and its
 * adjoint (I + A)^{-T} Y, with A strictly lower (its diagonal and upper part are not read), by forward and back
 * substitution, each row's update one vectorised pass over the right-hand side's columns. LAPACK's solver
 * (torch.linalg.solve_triangular) takes most of its time in per-matrix overhead at these 64 x 64 sizes.
 *
 * Layout: n chunks, A [n, L, L], B, X [n, L, N] fp32 contiguous.
 */
#include <stdint.h>

#include "megaseq_math.h"

BODY void lower_body(int64_t c0, int64_t c1, int64_t L, int64_t N, const float *restrict A, const float *restrict B,
                     float *restrict X) {
    for (int64_t c = c0; c < c1; c++) {
        const float *a = A + c * L * L, *b = B + c * L * N;
        float *x = X + c * L * N;
        for (int64_t s = 0; s < L; s++) {
            float *xs = x + s * N;
            for (int64_t i = 0; i < N; i++) xs[i] = b[s * N + i];
            for (int64_t j = 0; j < s; j++) {
                const float coefficient = a[s * L + j];
                const float *xj = x + j * N;
                for (int64_t i = 0; i < N; i++) xs[i] -= coefficient * xj[i];
            }
        }
    }
}

BODY void adjoint_body(int64_t c0, int64_t c1, int64_t L, int64_t N, const float *restrict A,
                       const float *restrict Y, float *restrict Z) {
    for (int64_t c = c0; c < c1; c++) {
        const float *a = A + c * L * L, *y = Y + c * L * N;
        float *z = Z + c * L * N;
        for (int64_t s = L - 1; s >= 0; s--) {
            float *zs = z + s * N;
            for (int64_t i = 0; i < N; i++) zs[i] = y[s * N + i];
            for (int64_t j = s + 1; j < L; j++) {
                const float coefficient = a[j * L + s];
                const float *zj = z + j * N;
                for (int64_t i = 0; i < N; i++) zs[i] -= coefficient * zj[i];
            }
        }
    }
}

/* Chunks [c0, c1): X = (I + strict_lower(A))^{-1} B. */
void kda_unit_lower_solve(int64_t c0, int64_t c1, int64_t L, int64_t N, const float *A, const float *B, float *X) {
    if (L == 64 && N == 128) lower_body(c0, c1, 64, 128, A, B, X);
    else lower_body(c0, c1, L, N, A, B, X);
}

/* Chunks [c0, c1): Z = (I + strict_lower(A))^{-T} Y. */
void kda_unit_lower_solve_adjoint(int64_t c0, int64_t c1, int64_t L, int64_t N, const float *A, const float *Y,
                                  float *Z) {
    if (L == 64 && N == 128) adjoint_body(c0, c1, 64, 128, A, Y, Z);
    else adjoint_body(c0, c1, L, N, A, Y, Z);
}
