"""The CPU miss path's kernel: bf16 experts read in place from the host store, on all cores.

Dimension letters: M experts of the call, R rows (a row is one token routed to one expert),
D hidden size, F expert width.

A blob is gate [F, D] | up [F, D] | down [D, F] in bf16 (`strata.engine.experts.store`), or
the same matrices in int8 followed by their fp32 scales, one per row: gate [F] | up [F] | down
[D], or in int4, two weights a byte, followed by one fp32 scale per group of 32 or 64 weights
along a row (`strata.engine.experts.quant`). At a few tokens an expert, computing one is
reading it: 3*F*D*2 bytes (bf16), about 3*F*D (int8) or 3*F*D*0.56-0.63 (int4) for 3*F*D
multiply-adds per token. torch's bf16 matmul reads a decode round's experts at 30-50% of the
host's bandwidth (bench/results/cpu-experts-h200-2026-11-29.md); these loops read each weight
row once per call and spread every expert of the call over the cores, so the whole call
streams at the memory's rate:

1. act[r, f] = bf16(silu(bf16(gate[f] . x[r])) * bf16(up[f] . x[r])) for each row r of each
   expert (an int8 row's dot product times its scale), the expert's F split in blocks over
   the threads (the gate and up rows of one f are read by the same thread);
2. out[r, d] = bf16(down[d] . act[r]), the expert's D split in blocks over the threads.

A quantized expert's rows are taken four at a time (on AVX-512: each weight vector loaded and
widened once for the four rows; a prompt's expert of many rows), the four products bit for bit
the single ones.

Each output value is computed by one thread in one fixed order, so the result does not depend
on the thread count or the schedule; the roundings to bf16 are torch's (the matmul's output,
silu's, the product's), so the result is close to the torch path's, not equal to it (the sums
are added in another order).
"""

from cython.parallel cimport prange
from libc.math cimport expf
from libc.stdint cimport int8_t, int64_t, uint8_t, uint16_t, uintptr_t
from libc.string cimport memcpy

import numpy as np

cdef extern from "_cpu_experts_dot.h" nogil:
    float strata_dot_bf16_f32(const uint16_t *w, const float *x, int64_t n, int64_t prefetch)
    float strata_dot_i8_f32(const int8_t *w, const float *x, int64_t n, int64_t prefetch)
    void strata_dot4_i8_f32(const int8_t *w, const float *const *x, int64_t n, float *out)
    void strata_dot4_i4_f32(const uint8_t *w, const float *scales, const float *const *x,
                            int64_t n, int group, float *out)
    float strata_dot_i4_g32_f32(const uint8_t *w, const float *scales, const float *x,
                                int64_t n, int64_t prefetch)
    float strata_dot_i4_g64_f32(const uint8_t *w, const float *scales, const float *x,
                                int64_t n, int64_t prefetch)
    float strata_bf16_to_f32(uint16_t h)
    uint16_t strata_f32_to_bf16(float f)

# What a call's threads note of its run, for a `CpuWorker` (the passes' header; declared here,
# before `Call`, which points at it).
cdef extern from "_cpu_experts_passes.h" nogil:
    ctypedef struct strata_call_times:
        int64_t entered_ns  # the team's last thread entered the call
        int64_t pass1_ns  # pass 1's last task done

# How far ahead of its reads a one-row dot product asks for the weights' next cache lines, by
# default. The hardware's prefetchers stop at each 4 KiB page, and a decode task streams 32-128
# KiB of rows: on the H200 machine's Xeon, 4096 bytes ahead made an olmoe-1b-7b expert 1.5-2.0x
# as fast as none (1-8 experts a call, with and without a gap before it), 256 and 1024 less so
# (bench/results/offload-async-h200-2026-12-03.md, `bench/cpu_experts.py --prefetch-bytes`).
PREFETCH_BYTES = 4096

# The kernel's revision, part of the key of the rates `--stream-misses auto` keeps
# (`strata.engine.experts.cpu.kernel_id`): raised by a change that moves the kernel's times, so
# that rates measured before it are measured again. 2: a call's two passes in one OpenMP region
# with no barrier of the team before the first task (`_cpu_experts_passes.h`).
REVISION = 2

# Rows of a weight matrix one task reads: enough to amortise the task, few enough that a
# decode call's M * F / BLOCK_ROWS tasks keep 16 threads busy (olmoe: 8 * 1024 / 16 = 512).
cdef enum:
    BLOCK_ROWS = 16

# The blobs' formats (`blob_bytes` of each: the layout above).
cdef enum:
    _BF16 = 0
    _INT8 = 1
    _INT4_G32 = 2
    _INT4_G64 = 3
FORMAT_BF16 = _BF16
FORMAT_INT8 = _INT8
FORMAT_INT4_G32 = _INT4_G32
FORMAT_INT4_G64 = _INT4_G64


cdef inline int64_t _group(int fmt) noexcept nogil:
    return 32 if fmt == _INT4_G32 else 64


def blob_bytes(int fmt, int64_t expert_width, int64_t hidden_size):
    """Bytes of one blob of format `fmt` (a FORMAT_*) for F and D; ValueError for an unknown
    format, or an int4 one whose group does not divide F and D."""
    cdef int64_t n = 3 * expert_width * hidden_size
    if fmt == _BF16:
        return 2 * n
    if fmt == _INT8:
        return n + 4 * (2 * expert_width + hidden_size)
    if fmt == _INT4_G32 or fmt == _INT4_G64:
        if expert_width % _group(fmt) or hidden_size % _group(fmt):
            raise ValueError(f"an int4 blob in groups of {_group(fmt)} needs F and D multiples "
                             f"of {_group(fmt)}, got F = {expert_width}, D = {hidden_size}")
        return n // 2 + 4 * (n // _group(fmt))
    raise ValueError(f"fmt must be FORMAT_BF16 ({FORMAT_BF16}), FORMAT_INT8 ({FORMAT_INT8}), "
                     f"FORMAT_INT4_G32 ({FORMAT_INT4_G32}) or FORMAT_INT4_G64 "
                     f"({FORMAT_INT4_G64}), got {fmt}")


cdef inline float _round(float v) noexcept nogil:
    return strata_bf16_to_f32(strata_f32_to_bf16(v))


cdef inline int64_t _scales_at(int fmt, int64_t f_width, int64_t d_hidden) noexcept nogil:
    """The byte where a quantized blob's scales begin (after its 3*F*D weights)."""
    if fmt == _INT8:
        return 3 * f_width * d_hidden
    return 3 * f_width * d_hidden // 2


cdef inline float _dot(const uint8_t *blob, int fmt, int64_t start, int64_t row,
                       int64_t scales_at, int64_t n, const float *x,
                       int64_t prefetch) noexcept nogil:
    """Row `row` of the blob's rows (gate 0..F-1, up F..2F-1, down 2F..2F+D-1), its n elements
    from element `start`, dotted with x: an int8 row times its scale, an int4 row's groups
    each times theirs (the scales from byte scales_at on). `prefetch`: the bytes ahead of its
    reads to ask the cache for (`Call.prefetch`)."""
    cdef float scale
    cdef const float *scales = <const float *>(blob + scales_at)
    if fmt == _BF16:
        return strata_dot_bf16_f32(<const uint16_t *>blob + start, x, n, prefetch)
    if fmt == _INT8:
        memcpy(&scale, blob + scales_at + 4 * row, 4)  # a blob's scales need not be aligned
        return strata_dot_i8_f32(<const int8_t *>blob + start, x, n, prefetch) * scale
    # int4: F and D are multiples of the group, so every row starts on a group and a byte.
    if fmt == _INT4_G32:
        return strata_dot_i4_g32_f32(blob + start // 2, scales + start // 32, x, n, prefetch)
    return strata_dot_i4_g64_f32(blob + start // 2, scales + start // 64, x, n, prefetch)


cdef struct Call:
    # One call's operands as raw pointers into the C-contiguous arrays `compute` checked, so
    # that a thread without the GIL can take the call whole (`CpuWorker`).
    const uint8_t *blobs  # [E, blob_bytes]
    int64_t blob_bytes
    int fmt
    const int64_t *experts  # [M]
    const int64_t *row_starts  # [M+1]
    int64_t n_experts
    const float *x  # [R, D], or [1, D] that every row reads (x_stride 0)
    int64_t x_stride  # elements from one row's input to the next: D, or 0
    float *act  # [R, F]
    uint16_t *out  # [R, D]
    int64_t f_width
    int64_t d_hidden
    int n_threads
    int schedule
    int64_t prefetch  # bytes of weights ahead of a one-row dot's reads to prefetch, 0: none
    void *shares  # steal: the call's shares and count, 64-byte aligned (`_steal_state`); else NULL
    strata_call_times *times  # where its threads note its run (`CpuWorker`'s); else NULL


cdef inline void _dot4(const uint8_t *blob, int fmt, int64_t start, int64_t row,
                       int64_t scales_at, int64_t n, const float *x, int64_t x_stride,
                       float *out) noexcept nogil:
    """out[j] = `_dot` of a quantized row with the row x + j * x_stride, j = 0..3, the row
    read once (the same bytes as four `_dot`s)."""
    cdef float scale
    cdef const float *rows[4]
    cdef int j
    for j in range(4):
        rows[j] = x + j * x_stride
    if fmt == _INT8:
        memcpy(&scale, blob + scales_at + 4 * row, 4)  # a blob's scales need not be aligned
        strata_dot4_i8_f32(<const int8_t *>blob + start, rows, n, out)
        for j in range(4):
            out[j] = out[j] * scale
    else:
        strata_dot4_i4_f32(blob + start // 2, <const float *>(blob + scales_at)
                           + start // _group(fmt), rows, n, _group(fmt), out)


cdef inline void _activations4(const Call *c, const uint8_t *blob, int64_t f,
                                int64_t scales_at, int64_t r) noexcept nogil:
    """act[r..r+3, f] of a quantized expert, its gate and up rows f read once for the four (the
    sums on this call's stack: a thread's own)."""
    cdef int64_t d_hidden = c.d_hidden
    cdef const float *x = c.x + r * c.x_stride
    cdef float gs[4]
    cdef float us[4]
    cdef float g, u
    cdef int j
    _dot4(blob, c.fmt, f * d_hidden, f, scales_at, d_hidden, x, c.x_stride, gs)
    _dot4(blob, c.fmt, (c.f_width + f) * d_hidden, c.f_width + f, scales_at, d_hidden, x,
          c.x_stride, us)
    for j in range(4):
        g = _round(gs[j])
        u = _round(us[j])
        c.act[(r + j) * c.f_width + f] = _round(_round(g / (1.0 + expf(-g))) * u)


cdef inline void _outputs4(const Call *c, const uint8_t *blob, int64_t d, int64_t down_at,
                           int64_t scales_at, int64_t r) noexcept nogil:
    """out[r..r+3, d] of a quantized expert, its down row d read once for the four."""
    cdef int64_t f_width = c.f_width
    cdef float ys[4]
    cdef int j
    _dot4(blob, c.fmt, down_at + d * f_width, 2 * f_width + d, scales_at, f_width,
          c.act + r * f_width, f_width, ys)
    for j in range(4):
        c.out[(r + j) * c.d_hidden + d] = strata_f32_to_bf16(ys[j])


cdef inline void _activation_task(const Call *c, int64_t n_blocks, int64_t scales_at,
                                  int64_t task) noexcept nogil:
    """Pass 1's task `task`: act[r, f] for one block of BLOCK_ROWS f of one expert, every row."""
    cdef int64_t i = task // n_blocks
    cdef const uint8_t *blob = c.blobs + c.experts[i] * c.blob_bytes
    cdef int64_t d_hidden = c.d_hidden, f_width = c.f_width
    cdef int64_t f = (task % n_blocks) * BLOCK_ROWS
    cdef int64_t f_end = min(f + BLOCK_ROWS, f_width)
    cdef int64_t r, r_end
    cdef float g, u
    while f < f_end:
        r = c.row_starts[i]
        r_end = c.row_starts[i + 1]
        while c.fmt != _BF16 and r + 4 <= r_end:  # four rows a weight row read
            _activations4(c, blob, f, scales_at, r)
            r = r + 4
        while r < r_end:
            g = _round(_dot(blob, c.fmt, f * d_hidden, f, scales_at, d_hidden,
                            c.x + r * c.x_stride, c.prefetch))
            u = _round(_dot(blob, c.fmt, (f_width + f) * d_hidden, f_width + f, scales_at,
                            d_hidden, c.x + r * c.x_stride, c.prefetch))
            c.act[r * f_width + f] = _round(_round(g / (1.0 + expf(-g))) * u)
            r = r + 1
        f = f + 1


cdef inline void _output_task(const Call *c, int64_t n_blocks, int64_t scales_at,
                              int64_t task) noexcept nogil:
    """Pass 2's task `task`: out[r, d] for one block of BLOCK_ROWS d of one expert, every row."""
    cdef int64_t d_hidden = c.d_hidden, f_width = c.f_width
    cdef int64_t down_at = 2 * f_width * d_hidden  # elements before down's first row
    cdef int64_t i = task // n_blocks
    cdef const uint8_t *blob = c.blobs + c.experts[i] * c.blob_bytes
    cdef int64_t d = (task % n_blocks) * BLOCK_ROWS
    cdef int64_t d_end = min(d + BLOCK_ROWS, d_hidden)
    cdef int64_t r, r_end
    while d < d_end:
        r = c.row_starts[i]
        r_end = c.row_starts[i + 1]
        while c.fmt != _BF16 and r + 4 <= r_end:  # four rows a weight row read
            _outputs4(c, blob, d, down_at, scales_at, r)
            r = r + 4
        while r < r_end:
            c.out[r * d_hidden + d] = strata_f32_to_bf16(_dot(
                blob, c.fmt, down_at + d * f_width, 2 * f_width + d, scales_at, f_width,
                c.act + r * f_width, c.prefetch))
            r = r + 1
        d = d + 1


include "_cpu_experts_passes.pxi"


cdef void _arrive(int64_t task) noexcept nogil:
    """A task that does nothing: `wake`'s threads each take one and are then up."""
    pass


def wake(int n_threads):
    """Start the n_threads team `compute` runs on (one empty task a thread), so its threads are
    up and spinning when the next call comes.

    Between two calls of a decode round the host waits about a millisecond for the device, long
    enough for OpenMP's idle threads to sleep; a call after such a gap paid 70-220 us for their
    wake-up on the H200 (bench/results/offload-omp-wait-h200-2026-12-03.md). Called while the
    host would wait for the device anyway, it is meant to take that wait off the call; in rounds
    it gained at 4 streamed misses a layer and lost at 3, so the cache leaves it off
    (`CachedExperts.wake_cpu`). It returns when every thread has arrived. ValueError for
    n_threads < 1."""
    cdef int64_t task
    if n_threads < 1:
        raise ValueError(f"n_threads must be >= 1, got {n_threads}")
    with nogil:
        for task in prange(n_threads, num_threads=n_threads, schedule="static"):
            _arrive(task)


def shrink_team():
    """Run an empty two-thread OpenMP region on the calling thread, which leaves one idle
    thread in its pool: libgomp lets the others exit.

    libgomp spins its idle threads for a while before they sleep, but only 100 times (about a
    microsecond) while the process holds more OpenMP threads than CPUs. A thread that ran a
    large team (the engine's, for the prompt's CPU misses or torch's own operations) keeps those
    threads, and with them a `CpuWorker`'s team outnumbers the CPUs: its threads then sleep at
    every barrier, and each pass of each call waits for them to wake (bench/cpu_sleeps.py
    counts those sleeps). Shrunk, the caller's pool and the worker's team fit the CPUs
    again."""
    wake(2)  # a two-thread team: what is left of the pool is its one other thread


include "_cpu_experts_call.pxi"


def compute(const uint8_t[:, ::1] blobs, int fmt, const int64_t[::1] experts,
            const int64_t[::1] row_starts, const float[:, ::1] x, uint16_t[:, ::1] out,
            int64_t expert_width, int n_threads, str schedule="dynamic",
            int64_t prefetch_bytes=PREFETCH_BYTES):
    """Compute `experts` of one layer over their rows, into `out`.

    blobs uint8 [E, blob_bytes(fmt, F, D)]: the layer's blobs (the store's bytes, not a copy);
    fmt: a FORMAT_*;
    experts int64 [M]: the blob row of each expert of the call; row_starts int64 [M+1]: expert
    i owns rows [row_starts[i], row_starts[i+1]) of `out` (and of `x`); x float32 [R, D]:
    each row's input, or [1, D]: the one input every row reads (a decode call's token); out
    uint16 [R, D]: each row's output as bf16 bits (written, not read);
    expert_width: F; n_threads: the threads of both passes (>= 1); schedule: how the passes'
    tasks reach the threads, one of `SCHEDULES`: "dynamic" (one at a time to whichever thread
    asks, the default), "static" (equal fixed shares), "guided" (large shares first) or
    "steal" (fixed shares, a thread done with its own taking the back half of another's;
    fewer than 2**31 tasks a pass); the same bytes whichever; prefetch_bytes: how far ahead of its
    reads a row's dot asks for the weights' next cache lines (a multiple of 64;
    `PREFETCH_BYTES` by default, 0: not at all); the same bytes whatever.

    Raises ValueError for shapes that disagree, an expert out of range or a "steal" call of
    2**31 tasks a pass or more, before any work.
    """
    _check(blobs, fmt, experts, row_starts, x, out, expert_width, n_threads, schedule,
           prefetch_bytes)
    cdef int64_t n_rows = out.shape[0]
    if n_rows == 0:
        return
    act = np.empty((n_rows, expert_width), dtype=np.float32)  # [R, F]
    cdef float[:, ::1] act_view = act
    shares = _shares(n_threads, SCHEDULES[schedule])
    cdef Call call = _call(blobs, fmt, experts, row_starts, x, act_view, out, expert_width,
                           n_threads, SCHEDULES[schedule], prefetch_bytes, shares)
    with nogil:
        _run(&call)


include "_cpu_experts_worker.pxi"
include "_cpu_experts_tally.pxi"
