/* The inner loops of strata._cpu_experts: bf16 <-> fp32 and a dot product of a bf16 weight row
 * with an fp32 vector.
 *
 * A bf16 value is the upper half of an fp32 one, so widening is a 16-bit shift. The dot product
 * keeps 32 partial sums (two vectors of 16 lanes) and adds them up in one fixed order, so its
 * result depends only on its inputs and on the instruction set it was compiled for (fused or
 * separate multiply-add), never on threads or timing.
 *
 * The vector code uses GCC's generic vector extensions; on x86-64 with GCC it is compiled three
 * times (AVX-512, AVX2, baseline SSE2) and the loader picks the widest the CPU has (an ifunc,
 * resolved once). Elsewhere it is compiled once for the build's target.
 */
#ifndef STRATA_CPU_EXPERTS_DOT_H
#define STRATA_CPU_EXPERTS_DOT_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define STRATA_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define STRATA_CLONES
#endif

typedef float strata_v16f __attribute__((vector_size(64)));
typedef uint32_t strata_v16u __attribute__((vector_size(64)));
typedef uint16_t strata_v16h __attribute__((vector_size(32)));

static inline float strata_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest, ties to even, as torch converts fp32 to bf16; NaN stays a (quiet) NaN. */
static inline uint16_t strata_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* sum_k w[k] * x[k] over n elements: w bf16 (as uint16), x fp32. */
STRATA_CLONES
static float strata_dot_bf16_f32(const uint16_t *w, const float *x, int64_t n) {
    strata_v16f acc0 = {0}, acc1 = {0};
    int64_t k = 0;
    for (; k + 32 <= n; k += 32) {
        strata_v16h h0, h1;
        strata_v16f x0, x1;
        memcpy(&h0, w + k, sizeof h0);
        memcpy(&h1, w + k + 16, sizeof h1);
        memcpy(&x0, x + k, sizeof x0);
        memcpy(&x1, x + k + 16, sizeof x1);
        acc0 += (strata_v16f)(__builtin_convertvector(h0, strata_v16u) << 16) * x0;
        acc1 += (strata_v16f)(__builtin_convertvector(h1, strata_v16u) << 16) * x1;
    }
    acc0 += acc1;
    float sum = 0.0f;
    for (int lane = 0; lane < 16; lane++) sum += acc0[lane];
    for (; k < n; k++) sum += strata_bf16_to_f32(w[k]) * x[k];
    return sum;
}

#endif
