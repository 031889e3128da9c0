/* Streams of weight rows through strata's CPU dot products, as a decode call's tasks read them,
 * without the kernel's passes, its team's wake-up or the engine around it: how fast can THREADS
 * threads dot WEIGHT_MIB of rows of ROW_BYTES in memory with one vector, ROWS_AT_ONCE at a time
 * (`strata_dots_*`), adjacent or half a block apart, each thread over its own part of the rows
 * (SCHEDULE parts) or taking blocks of BLOCK_ROWS rows one at a time as they come (dynamic, as
 * the kernel's default schedule hands out its tasks of 16 rows)? bench/dot_stream.py builds it
 * against src/strata/_cpu_experts_dot.h and runs the grid.
 *
 *   dot_stream FORMAT ROW_BYTES ROWS_AT_ONCE LAYOUT PREFETCH_BYTES THREADS WEIGHT_MIB REPEAT
 *              SCHEDULE BLOCK_ROWS
 *
 * FORMAT int8 or bf16; LAYOUT adjacent (rows r..r+k-1 together) or apart (in each block of
 * BLOCK_ROWS, a multiple of 4, rows i, i + BLOCK_ROWS / k, ... together, as the kernel's pass 1
 * takes two f half a task apart). Prints one JSON object: the best of REPEAT passes over all
 * the weights (GB/s of weights read), and `checksum`, the XOR of every row's dot product's
 * bits, which is the same whatever ROWS_AT_ONCE, LAYOUT, PREFETCH_BYTES, SCHEDULE and
 * BLOCK_ROWS (each row's sum takes the same steps), a check of the dot products on this CPU.
 */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "_cpu_experts_dot.h"


static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static uint32_t bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* The dot products of block `b`'s rows, k at a time as `apart` says; the XOR of their bits. */
static uint32_t dot_block(const uint8_t *w, int64_t b, int64_t block_rows, int k, int apart,
                          int64_t row_bytes, int bf16, const float *x, int64_t prefetch);

/* Dot the rows `rows[0..k-1]` (row indices into `w`, each `row_bytes` long) with x. */
static uint32_t dot_rows(const uint8_t *w, const int64_t *rows, int k, int64_t row_bytes,
                         int bf16, const float *x, int64_t prefetch) {
    const void *ptrs[4];
    float out[4];
    int64_t n = bf16 ? row_bytes / 2 : row_bytes;
    uint32_t sum = 0;
    for (int j = 0; j < k; j++) ptrs[j] = w + rows[j] * row_bytes;
    if (k == 1)
        out[0] = bf16 ? strata_dot_bf16_f32((const uint16_t *)ptrs[0], x, n, prefetch)
                      : strata_dot_i8_f32((const int8_t *)ptrs[0], x, n, prefetch);
    else if (bf16)
        strata_dots_bf16_f32((const uint16_t *const *)ptrs, k, x, n, out, prefetch);
    else
        strata_dots_i8_f32((const int8_t *const *)ptrs, k, x, n, out, prefetch);
    for (int j = 0; j < k; j++) sum ^= bits(out[j]);
    return sum;
}

static uint32_t dot_block(const uint8_t *w, int64_t b, int64_t block_rows, int k, int apart,
                          int64_t row_bytes, int bf16, const float *x, int64_t prefetch) {
    int64_t rows[4], first = b * block_rows;
    uint32_t sum = 0;
    for (int64_t g = 0; g < block_rows / k; g++) {
        for (int j = 0; j < k; j++)
            rows[j] = apart ? first + g + j * (block_rows / k) : first + g * k + j;
        sum ^= dot_rows(w, rows, k, row_bytes, bf16, x, prefetch);
    }
    return sum;
}

int main(int argc, char **argv) {
    if (argc != 11) {
        fprintf(stderr, "usage: dot_stream FORMAT ROW_BYTES ROWS_AT_ONCE LAYOUT PREFETCH_BYTES "
                        "THREADS WEIGHT_MIB REPEAT SCHEDULE BLOCK_ROWS\n");
        return 2;
    }
    int bf16 = strcmp(argv[1], "bf16") == 0;
    int64_t row_bytes = atoll(argv[2]), prefetch = atoll(argv[5]);
    int k = atoi(argv[3]), apart = strcmp(argv[4], "apart") == 0;
    int n_threads = atoi(argv[6]), repeat = atoi(argv[8]);
    int64_t total = atoll(argv[7]) << 20;
    int dynamic = strcmp(argv[9], "dynamic") == 0;
    int64_t block_rows = atoll(argv[10]);
    if ((!bf16 && strcmp(argv[1], "int8")) || (k != 1 && k != 2 && k != 4) || row_bytes < 64
        || row_bytes % 64 || n_threads < 1 || repeat < 1 || prefetch < 0 || prefetch % 64
        || (!apart && strcmp(argv[4], "adjacent")) || (!dynamic && strcmp(argv[9], "parts"))
        || block_rows < 4 || block_rows % 4) {
        fprintf(stderr, "dot_stream: FORMAT int8 or bf16, ROW_BYTES a multiple of 64, "
                        "ROWS_AT_ONCE 1, 2 or 4, LAYOUT adjacent or apart, PREFETCH_BYTES a "
                        "multiple of 64, THREADS and REPEAT >= 1, SCHEDULE parts or dynamic, "
                        "BLOCK_ROWS a multiple of 4\n");
        return 2;
    }
    /* Each thread's part: whole blocks of BLOCK_ROWS rows, at least one. */
    int64_t block_bytes = block_rows * row_bytes;
    int64_t blocks = total / block_bytes / n_threads;
    if (blocks < 1) blocks = 1;
    int64_t part = blocks * block_bytes;
    uint8_t *w = aligned_alloc(4096, (size_t)(part * n_threads + 4096));
    float *x = aligned_alloc(64, (size_t)row_bytes * 4);
    if (!w || !x) {
        fprintf(stderr, "dot_stream: out of memory for %lld bytes\n", (long long)total);
        return 1;
    }
    for (int64_t i = 0; i < row_bytes; i++) x[i] = (float)((i % 13) - 6) * 0.01f;
    uint32_t checksum = 0;
    double best = 0.0;
#pragma omp parallel num_threads(n_threads) reduction(^ : checksum)
    {
        int t = omp_get_thread_num();
        uint8_t *mine = w + t * part;
        /* First touch by the thread whose part it is; small signed values, any bf16 a number,
         * set by their place alone (the same weights under either schedule). */
        for (int64_t i = 0; i < part; i++) mine[i] = (uint8_t)(((t * part + i) * 7) % 61) & 0x3f;
        for (int pass = 0; pass < repeat; pass++) {
            uint32_t sum = 0;
            int64_t b;
#pragma omp barrier
            double start = seconds();
            if (dynamic) {
#pragma omp for schedule(dynamic) nowait
                for (b = 0; b < blocks * n_threads; b++)
                    sum ^= dot_block(w, b, block_rows, k, apart, row_bytes, bf16, x, prefetch);
            } else {
                for (b = 0; b < blocks; b++)
                    sum ^= dot_block(mine, b, block_rows, k, apart, row_bytes, bf16, x,
                                     prefetch);
            }
#pragma omp barrier
            double took = seconds() - start;
#pragma omp master
            if (part * n_threads / took > best) best = part * n_threads / took;
            if (pass == 0) checksum ^= sum;
        }
    }
    printf("{\"format\": \"%s\", \"row_bytes\": %lld, \"rows_at_once\": %d, \"layout\": \"%s\", "
           "\"prefetch_bytes\": %lld, \"threads\": %d, \"weight_bytes\": %lld, "
           "\"schedule\": \"%s\", \"block_rows\": %lld, \"gb_s\": %.3f, \"checksum\": %u}\n",
           argv[1], (long long)row_bytes, k, argv[4], (long long)prefetch, n_threads,
           (long long)(part * n_threads), argv[9], (long long)block_rows, best / 1e9, checksum);
    free(w);
    free(x);
    return 0;
}
