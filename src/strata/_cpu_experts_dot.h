/* The inner loops of strata._cpu_experts: bf16 <-> fp32, and dot products of a bf16, an int8 or
 * an int4 weight row with an fp32 vector.
 *
 * A bf16 value is the upper half of an fp32 one, so widening is a 16-bit shift. The dot product
 * keeps 32 partial sums (two vectors of 16 lanes) and adds them up in one fixed order, so its
 * result depends only on its inputs and on the instruction set it was compiled for (fused or
 * separate multiply-add), never on threads or timing.
 *
 * The vector code uses GCC's generic vector extensions, or plain loops over lanes that GCC turns
 * into vector code; on x86-64 with GCC it is compiled three times (x86-64-v4: AVX-512,
 * x86-64-v3: AVX2, and baseline SSE2) and the loader picks the widest the CPU has (an ifunc,
 * resolved once). Elsewhere it is compiled once for the build's target. The int8 and int4
 * products have AVX-512 intrinsics too, taken where the CPU has AVX-512F (checked at each call,
 * a load and a test): GCC's code widens int8 in 256-bit halves and the nibbles lane by lane,
 * 2x slower on the development machine.
 */
#ifndef STRATA_CPU_EXPERTS_DOT_H
#define STRATA_CPU_EXPERTS_DOT_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
/* The x86-64 levels: v4 brings AVX-512's byte and word instructions too, without which GCC
 * leaves the int4 loops scalar. */
#define STRATA_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#elif defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
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

/* `prefetch` > 0, in every single-row dot product below: each cache line of weights it starts
 * reading, it also asks for the line `prefetch` bytes ahead (past the row's end too: a decode
 * task reads its rows back to back, and a prefetch never faults), so that the next lines are on
 * their way while this one is summed, across the 4 KiB page boundaries where the hardware's own
 * prefetchers stop. It changes no result. */
#define STRATA_PREFETCH(p, offset, prefetch)                                                     \
    do {                                                                                        \
        if ((prefetch) > 0 && !((offset) & 63))                                                 \
            __builtin_prefetch((const char *)(p) + (offset) + (prefetch), 0, 3);                \
    } while (0)

/* sum_k w[k] * x[k] over n elements: w bf16 (as uint16), x fp32. */
STRATA_CLONES
static float strata_dot_bf16_f32(const uint16_t *w, const float *x, int64_t n,
                                 int64_t prefetch) {
    strata_v16f acc0 = {0}, acc1 = {0};
    int64_t k = 0;
    for (; k + 32 <= n; k += 32) {
        STRATA_PREFETCH(w, 2 * k, prefetch); /* 64 bytes a step */
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

/* out[j] = strata_dot_bf16_f32(w[j], x, n) for j < ROWS: ROWS weight rows dotted with one x at
 * once, each row's sums in the same steps and order as the single row's (the same bits), the
 * x vectors loaded once for all of them. ROWS independent chains of multiply-adds where one row
 * has two, and ROWS streams of weights where one row has one: a row short enough (down's F
 * elements) spends much of its time in its chain's latency and its sum's tail. */
#define STRATA_DOTS_BF16(ROWS)                                                                  \
    STRATA_CLONES                                                                               \
    static void strata_dots##ROWS##_bf16_f32(const uint16_t *const *w, const float *x,          \
                                             int64_t n, float *out, int64_t prefetch) {         \
        strata_v16f acc0[ROWS], acc1[ROWS];                                                     \
        for (int j = 0; j < ROWS; j++) acc0[j] = acc1[j] = (strata_v16f){0};                   \
        int64_t k = 0;                                                                          \
        for (; k + 32 <= n; k += 32) {                                                          \
            strata_v16f x0, x1;                                                                 \
            memcpy(&x0, x + k, sizeof x0);                                                      \
            memcpy(&x1, x + k + 16, sizeof x1);                                                 \
            for (int j = 0; j < ROWS; j++) {                                                    \
                STRATA_PREFETCH(w[j], 2 * k, prefetch);                                         \
                strata_v16h h0, h1;                                                             \
                memcpy(&h0, w[j] + k, sizeof h0);                                               \
                memcpy(&h1, w[j] + k + 16, sizeof h1);                                          \
                acc0[j] += (strata_v16f)(__builtin_convertvector(h0, strata_v16u) << 16) * x0;  \
                acc1[j] += (strata_v16f)(__builtin_convertvector(h1, strata_v16u) << 16) * x1;  \
            }                                                                                   \
        }                                                                                       \
        for (int j = 0; j < ROWS; j++) {                                                        \
            strata_v16f acc = acc0[j] + acc1[j];                                                \
            float sum = 0.0f;                                                                   \
            for (int lane = 0; lane < 16; lane++) sum += acc[lane];                             \
            for (int64_t t = k; t < n; t++) sum += strata_bf16_to_f32(w[j][t]) * x[t];          \
            out[j] = sum;                                                                       \
        }                                                                                       \
    }
STRATA_DOTS_BF16(2)
STRATA_DOTS_BF16(4)

/* sum_k w[k] * x[k] over n elements: w int8 (a quantized row, its scale applied by the
 * caller), x fp32. Written as lanes of a plain array, the form GCC turns into the vector
 * sign-extension and conversion instructions (its generic vectors widen int8 lane by lane);
 * on AVX-512, `strata_dot_i8_f32` takes the intrinsics below instead (GCC keeps this loop in
 * 256-bit halves). */
STRATA_CLONES
static float strata_dot_i8_f32_lanes(const int8_t *w, const float *x, int64_t n,
                                     int64_t prefetch) {
    float acc[32] = {0};
    int64_t k = 0;
    for (; k + 32 <= n; k += 32) {
        STRATA_PREFETCH(w, k, prefetch);
        for (int lane = 0; lane < 32; lane++) acc[lane] += (float)w[k + lane] * x[k + lane];
    }
    for (int lane = 0; lane < 16; lane++) acc[lane] += acc[lane + 16];
    float sum = 0.0f;
    for (int lane = 0; lane < 16; lane++) sum += acc[lane];
    for (; k < n; k++) sum += (float)w[k] * x[k];
    return sum;
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
/* The lanes of a + b added up in one fixed order, lane 0 first: every AVX-512 int8 dot
 * product's sum, the same order whatever its rows. */
__attribute__((target("avx512f")))
static inline float strata_lanes_sum_avx512(__m512 a, __m512 b) {
    float lanes[16];
    _mm512_storeu_ps(lanes, _mm512_add_ps(a, b));
    float sum = 0.0f;
    for (int lane = 0; lane < 16; lane++) sum += lanes[lane];
    return sum;
}

/* 16 int8 weights widened to 16 fp32 lanes in one instruction each, 32 a step; the same fixed
 * order of partial sums as the other dot products. One weight row with ROWS inputs x[0..ROWS-1]
 * at once (out[j] for x[j]): each weight vector is loaded and widened once for all of them, and
 * each input's sums take the same steps in the same order whatever ROWS, so four at a time (a
 * prompt's expert of many rows) gives bit for bit what one at a time gives. */
#define STRATA_DOT_I8_AVX512(ROWS)                                                              \
    __attribute__((target("avx512f")))                                                          \
    static void strata_dot##ROWS##_i8_f32_avx512(const int8_t *w, const float *const *x,       \
                                                 int64_t n, float *out, int64_t prefetch) {     \
        __m512 acc0[ROWS], acc1[ROWS];                                                          \
        for (int j = 0; j < ROWS; j++) acc0[j] = acc1[j] = _mm512_setzero_ps();                 \
        int64_t k = 0;                                                                          \
        for (; k + 32 <= n; k += 32) {                                                          \
            STRATA_PREFETCH(w, k, prefetch);                                                    \
            __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(                                \
                _mm_loadu_si128((const __m128i *)(w + k))));                                    \
            __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(                                \
                _mm_loadu_si128((const __m128i *)(w + k + 16))));                               \
            for (int j = 0; j < ROWS; j++) {                                                    \
                acc0[j] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x[j] + k), acc0[j]);              \
                acc1[j] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x[j] + k + 16), acc1[j]);         \
            }                                                                                   \
        }                                                                                       \
        for (int j = 0; j < ROWS; j++) {                                                        \
            float sum = strata_lanes_sum_avx512(acc0[j], acc1[j]);                              \
            for (int64_t t = k; t < n; t++) sum += (float)w[t] * x[j][t];                       \
            out[j] = sum;                                                                       \
        }                                                                                       \
    }
STRATA_DOT_I8_AVX512(1)
STRATA_DOT_I8_AVX512(4)

/* The other way round: ROWS weight rows w[0..ROWS-1] with one input x (out[j] for w[j]), each
 * row's sums in the same steps and order as `strata_dot1_i8_f32_avx512`'s (the same bits), x
 * loaded once for all of them; ROWS chains and streams where one row has one (see
 * STRATA_DOTS_BF16). */
#define STRATA_DOTS_I8_AVX512(ROWS)                                                             \
    __attribute__((target("avx512f")))                                                          \
    static void strata_dots##ROWS##_i8_f32_avx512(const int8_t *const *w, const float *x,      \
                                                  int64_t n, float *out, int64_t prefetch) {    \
        __m512 acc0[ROWS], acc1[ROWS];                                                          \
        for (int j = 0; j < ROWS; j++) acc0[j] = acc1[j] = _mm512_setzero_ps();                 \
        int64_t k = 0;                                                                          \
        for (; k + 32 <= n; k += 32) {                                                          \
            __m512 x0 = _mm512_loadu_ps(x + k), x1 = _mm512_loadu_ps(x + k + 16);               \
            for (int j = 0; j < ROWS; j++) {                                                    \
                STRATA_PREFETCH(w[j], k, prefetch);                                             \
                __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(                            \
                    _mm_loadu_si128((const __m128i *)(w[j] + k))));                             \
                __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(                            \
                    _mm_loadu_si128((const __m128i *)(w[j] + k + 16))));                        \
                acc0[j] = _mm512_fmadd_ps(w0, x0, acc0[j]);                                     \
                acc1[j] = _mm512_fmadd_ps(w1, x1, acc1[j]);                                     \
            }                                                                                   \
        }                                                                                       \
        for (int j = 0; j < ROWS; j++) {                                                        \
            float sum = strata_lanes_sum_avx512(acc0[j], acc1[j]);                              \
            for (int64_t t = k; t < n; t++) sum += (float)w[j][t] * x[t];                       \
            out[j] = sum;                                                                       \
        }                                                                                       \
    }
STRATA_DOTS_I8_AVX512(2)
STRATA_DOTS_I8_AVX512(4)
#endif

static inline float strata_dot_i8_f32(const int8_t *w, const float *x, int64_t n,
                                      int64_t prefetch) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (__builtin_cpu_supports("avx512f")) {
        float out;
        strata_dot1_i8_f32_avx512(w, &x, n, &out, prefetch);
        return out;
    }
#endif
    return strata_dot_i8_f32_lanes(w, x, n, prefetch);
}

/* out[j] = strata_dot_i8_f32(w[j], x, n) for j < n_rows (2 or 4; else one at a time): the rows
 * at once where AVX-512 is there. */
static inline void strata_dots_i8_f32(const int8_t *const *w, int n_rows, const float *x,
                                      int64_t n, float *out, int64_t prefetch) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (__builtin_cpu_supports("avx512f") && (n_rows == 2 || n_rows == 4)) {
        if (n_rows == 2)
            strata_dots2_i8_f32_avx512(w, x, n, out, prefetch);
        else
            strata_dots4_i8_f32_avx512(w, x, n, out, prefetch);
        return;
    }
#endif
    for (int j = 0; j < n_rows; j++) out[j] = strata_dot_i8_f32(w[j], x, n, prefetch);
}

/* out[j] = strata_dot_bf16_f32(w[j], x, n) for j < n_rows (2 or 4 at once; else one at a
 * time). */
static inline void strata_dots_bf16_f32(const uint16_t *const *w, int n_rows, const float *x,
                                        int64_t n, float *out, int64_t prefetch) {
    if (n_rows == 2)
        strata_dots2_bf16_f32(w, x, n, out, prefetch);
    else if (n_rows == 4)
        strata_dots4_bf16_f32(w, x, n, out, prefetch);
    else
        for (int j = 0; j < n_rows; j++) out[j] = strata_dot_bf16_f32(w[j], x, n, prefetch);
}

/* out[j] = strata_dot_i8_f32(w, x[j], n) for j = 0..3, the weights read once where AVX-512 is
 * there (a prompt's expert of many rows: the widening, not the memory, set its time). */
static inline void strata_dot4_i8_f32(const int8_t *w, const float *const *x, int64_t n,
                                      float *out) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (__builtin_cpu_supports("avx512f")) {
        strata_dot4_i8_f32_avx512(w, x, n, out, 0);
        return;
    }
#endif
    for (int j = 0; j < 4; j++) out[j] = strata_dot_i8_f32_lanes(w, x[j], n, 0);
}

/* sum over the groups of a row of n int4 weights (n a multiple of GROUP) of scale[g] * sum_k
 * q[k] * x[k]: each group of GROUP weights is GROUP / 2 bytes, the low nibbles its first half and
 * the high nibbles its second (so both halves read x contiguously), values -8..7 in two's
 * complement. */
#define STRATA_DOT_I4(GROUP)                                                                    \
    STRATA_CLONES                                                                               \
    static float strata_dot_i4_g##GROUP##_lanes(const uint8_t *w, const float *scales,        \
                                                const float *x, int64_t n, int64_t prefetch) { \
        /* One partial sum a lane across the groups: independent lanes, vector code. The       \
         * nibbles are sign-extended with 32-bit shifts, which vector units have (byte shifts  \
         * they do not). */                                                                     \
        float acc[GROUP / 2] = {0};                                                             \
        for (int64_t g = 0; g < n / GROUP; g++) {                                               \
            const uint8_t *b = w + g * (GROUP / 2);                                             \
            const float *xg = x + g * GROUP;                                                    \
            STRATA_PREFETCH(w, g * (GROUP / 2), prefetch);                                      \
            const float scale = scales[g];                                                      \
            for (int lane = 0; lane < GROUP / 2; lane++)                                        \
                acc[lane] += scale * ((float)((int32_t)((uint32_t)b[lane] << 28) >> 28)         \
                                      * xg[lane]                                                \
                                      + (float)((int32_t)((uint32_t)b[lane] << 24) >> 28)       \
                                      * xg[GROUP / 2 + lane]);                                  \
        }                                                                                       \
        float sum = 0.0f;                                                                       \
        for (int lane = 0; lane < GROUP / 2; lane++) sum += acc[lane];                          \
        return sum;                                                                             \
    }
STRATA_DOT_I4(32)
STRATA_DOT_I4(64)

#if defined(__x86_64__) && defined(__GNUC__)
/* The int4 dot product on AVX-512: a group's bytes 16 at a time, zero-extended to 32-bit lanes,
 * their nibbles sign-extended by shifts; each group's sum times its scale. As the int8 one, of
 * ROWS inputs at once, each input's sums in the same steps whatever ROWS. */
#define STRATA_DOT_I4_AVX512(ROWS)                                                              \
    __attribute__((target("avx512f")))                                                          \
    static void strata_dot##ROWS##_i4_f32_avx512(const uint8_t *w, const float *scales,         \
                                                 const float *const *x, int64_t n, int group,   \
                                                 float *out, int64_t prefetch) {                \
        const int half = group / 2;                                                             \
        __m512 acc[ROWS];                                                                       \
        for (int j = 0; j < ROWS; j++) acc[j] = _mm512_setzero_ps();                            \
        for (int64_t g = 0; g < n / group; g++) {                                               \
            __m512 part[ROWS];                                                                  \
            for (int j = 0; j < ROWS; j++) part[j] = _mm512_setzero_ps();                       \
            for (int c = 0; c < half; c += 16) {                                                \
                STRATA_PREFETCH(w, g * half + c, prefetch);                                     \
                __m512i v = _mm512_cvtepu8_epi32(                                               \
                    _mm_loadu_si128((const __m128i *)(w + g * half + c)));                      \
                __m512 lo = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 28), 28)); \
                __m512 hi = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 24), 28)); \
                for (int j = 0; j < ROWS; j++) {                                                \
                    part[j] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x[j] + g * group + c),        \
                                              part[j]);                                         \
                    part[j] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x[j] + g * group + half + c), \
                                              part[j]);                                         \
                }                                                                               \
            }                                                                                   \
            for (int j = 0; j < ROWS; j++)                                                      \
                acc[j] = _mm512_fmadd_ps(part[j], _mm512_set1_ps(scales[g]), acc[j]);           \
        }                                                                                       \
        for (int j = 0; j < ROWS; j++) {                                                        \
            float lanes[16];                                                                    \
            _mm512_storeu_ps(lanes, acc[j]);                                                    \
            float sum = 0.0f;                                                                   \
            for (int lane = 0; lane < 16; lane++) sum += lanes[lane];                           \
            out[j] = sum;                                                                       \
        }                                                                                       \
    }
STRATA_DOT_I4_AVX512(1)
STRATA_DOT_I4_AVX512(4)
#define STRATA_I4_AVX512(GROUP)                                                                 \
    if (__builtin_cpu_supports("avx512f")) {                                                    \
        float out;                                                                              \
        strata_dot1_i4_f32_avx512(w, scales, &x, n, GROUP, &out, prefetch);                     \
        return out;                                                                             \
    }
#else
#define STRATA_I4_AVX512(GROUP)
#endif

static inline float strata_dot_i4_g32_f32(const uint8_t *w, const float *scales, const float *x,
                                          int64_t n, int64_t prefetch) {
    STRATA_I4_AVX512(32)
    return strata_dot_i4_g32_lanes(w, scales, x, n, prefetch);
}

static inline float strata_dot_i4_g64_f32(const uint8_t *w, const float *scales, const float *x,
                                          int64_t n, int64_t prefetch) {
    STRATA_I4_AVX512(64)
    return strata_dot_i4_g64_lanes(w, scales, x, n, prefetch);
}

/* out[j] = the int4 dot product of a row (groups of `group`) with x[j], j = 0..3, the weights
 * read once where AVX-512 is there. */
static inline void strata_dot4_i4_f32(const uint8_t *w, const float *scales,
                                      const float *const *x, int64_t n, int group, float *out) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (__builtin_cpu_supports("avx512f")) {
        strata_dot4_i4_f32_avx512(w, scales, x, n, group, out, 0);
        return;
    }
#endif
    for (int j = 0; j < 4; j++)
        out[j] = group == 32 ? strata_dot_i4_g32_lanes(w, scales, x[j], n, 0)
                             : strata_dot_i4_g64_lanes(w, scales, x[j], n, 0);
}

#endif
