/* Vectorisable maths for the C kernels plugins build with megaseq.native.NativeLibrary (which puts this file's
 * folder on the include path): `#include "megaseq_math.h"`. */
#ifndef MEGASEQ_MATH_H
#define MEGASEQ_MATH_H

#include <math.h>
#include <stdint.h>

/* A kernel's helper, inlined so that its loops vectorise and its sizes specialise. */
#define BODY static inline __attribute__((always_inline))

/* exp(x) for x <= 0, vectorisable: x = n ln2 + r, |r| <= ln2 / 2; exp(r) by its Taylor polynomial to r^7
 * (truncation error under 5e-9 relative), times 2^n written into the exponent bits; 0 below -87. */
BODY float exp_nonpositive(float x) {
    const float ln2_hi = 0.693145751953125f; /* ln2 in two parts: n * ln2_hi is exact for |n| < 2^11 */
    const float ln2_lo = 1.42860682030941723e-6f;
    const float clamped = x < -87.0f ? -87.0f : x;
    const float n = floorf(clamped * 1.44269504088896341f + 0.5f);
    const float r = (clamped - n * ln2_hi) - n * ln2_lo;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { int32_t i; float f; } two_n = {.i = ((int32_t)n + 127) << 23};
    return x < -87.0f ? 0.0f : p * two_n.f;
}

/* log(x) for x > 0 (subnormals included), vectorisable: x = 2^e m with m in [sqrt(1/2), sqrt(2)),
 * log m = 2 atanh(s), s = (m - 1) / (m + 1), |s| < 0.172, by its series to s^11 (error under 1e-9). */
BODY float log_positive(float x) {
    const int tiny = x < 1.17549435e-38f;
    union { float f; int32_t i; } bits = {.f = tiny ? x * 8388608.0f : x};
    int32_t e = ((bits.i >> 23) & 0xff) - 127 - (tiny ? 23 : 0);
    bits.i = (bits.i & 0x007fffff) | 0x3f800000; /* m in [1, 2) */
    float m = bits.f;
    const int high = m > 1.41421356f;
    m = high ? 0.5f * m : m;
    e += high;
    const float s = (m - 1.0f) / (m + 1.0f), s2 = s * s;
    float p = 1.0f / 11.0f;
    p = p * s2 + 1.0f / 9.0f;
    p = p * s2 + 1.0f / 7.0f;
    p = p * s2 + 1.0f / 5.0f;
    p = p * s2 + 1.0f / 3.0f;
    p = p * s2 + 1.0f;
    return 2.0f * s * p + (float)e * 0.693147180559945309f;
}

#endif
