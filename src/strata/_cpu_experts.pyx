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
the single ones. The other way round, a single row of x (a decode call's token) reads 2 or 4
weight rows at once (`gate_up_rows`: gate's and up's rows together, of one f or two; `down_rows`:
adjacent rows of down), more independent sums and streams of memory in flight a thread, each
row's sums in the steps of its own dot product: the same bytes.

Each output value is computed by one thread in one fixed order, so the result does not depend
on the thread count or the schedule; the roundings to bf16 are torch's (the matmul's output,
silu's, the product's), so the result is close to the torch path's, not equal to it (the sums
are added in another order).
"""

from cython.parallel cimport prange
from libc.math cimport expf
from libc.stdint cimport int8_t, int64_t, uint8_t, uint16_t, uintptr_t
from libc.string cimport memcpy

import os

import numpy as np

cdef extern from "_cpu_experts_dot.h" nogil:
    float strata_dot_bf16_f32(const uint16_t *w, const float *x, int64_t n, int64_t prefetch)
    float strata_dot_i8_f32(const int8_t *w, const float *x, int64_t n, int64_t prefetch)
    void strata_dots_bf16_f32(const uint16_t *const *w, int n_rows, const float *x, int64_t n,
                              float *out, int64_t prefetch)
    void strata_dots_i8_f32(const int8_t *const *w, int n_rows, const float *x, int64_t n,
                            float *out, int64_t prefetch)
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

# Weight rows read at once for one row of x, by default: pass 1's (`compute`'s `gate_up_rows`:
# 1, gate's then up's row of each f; 2, the two together; 4, those of two f) and pass 2's
# (`down_rows`: 1, 2 or 4 adjacent rows of down). The same bytes whichever. On an H100
# machine's Xeon gate and up together read 1.05-1.67x as fast alone, but only where the weights
# sat in its last-level cache: in the decode round, from memory, pass 1 read 0.95-1.04x the
# rate of one at a time, and down two or four at once (then half a task apart; adjacent since,
# untimed) was slower under the default schedule
# (bench/results/cpu-weight-rows-h100-2026-12-05.md). So one at a time stays.
GATE_UP_ROWS = 1
DOWN_ROWS = 1

# The kernel's revision, part of the key of the rates `--stream-misses auto` keeps
# (`strata.engine.experts.cpu.kernel_id`): raised by a change that moves the kernel's times, so
# that rates measured before it are measured again. 2: a call's two passes in one OpenMP region
# with no barrier of the team before the first task (`_cpu_experts_passes.h`). 3: pass 2's
# tasks of DOWN_BLOCK_ROWS = 64 rows of down, not 16.
REVISION = 3

# Rows of a weight matrix one task reads: enough to amortise the task, few enough that a
# decode call's M * F / BLOCK_ROWS tasks keep 16 threads busy (olmoe: 8 * 1024 / 16 = 512).
cdef enum:
    BLOCK_ROWS = 16

# Rows of down one pass-2 task reads, by default (`compute`'s `down_block_rows`; a multiple of
# 16 up to 1024). Down's rows are short (F elements: 768 bytes of int8 on qwen3-30b-a3b), so a
# task of 16 of them, as pass 1 takes of gate and up, is a 12 KiB run of memory against pass
# 1's two runs of 32 KiB, and the tasks handed out one at a time read down at 0.7-0.8x pass
# 1's rate. 64 rows (48 KiB of int8 on qwen3, 128 KiB of bf16 on olmoe) read it 1.25-1.33x
# faster in issue 17's decode round on the H100 machine's Xeon, while a call of one expert
# still has D / 64 = 32 tasks for 16 threads (bench/results/cpu-down-block-h100-2026-12-05.md).
# The same bytes whatever.
DOWN_BLOCK_ROWS = 64

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
    int gate_up_rows  # pass 1's weight rows read at once for a row of x: 1, 2, 4 (`GATE_UP_ROWS`)
    int down_rows  # pass 2's: 1, 2 or 4 adjacent rows of down (`DOWN_ROWS`)
    int64_t down_block  # rows of down a pass-2 task reads (`DOWN_BLOCK_ROWS`)
    void *shares  # steal: the call's shares and count, 64-byte aligned (`_steal_state`); else NULL
    strata_call_times *times  # where its threads note its run (`CpuWorker`'s); else NULL
    const int *pin  # its team's CPUs by thread (`CpuWorker.team_cpus`, `_cpu_experts_pin.h`)


include "_cpu_experts_tasks.pxi"

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
            int64_t prefetch_bytes=PREFETCH_BYTES, int gate_up_rows=GATE_UP_ROWS,
            int down_rows=DOWN_ROWS, int64_t down_block_rows=DOWN_BLOCK_ROWS):
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
    `PREFETCH_BYTES` by default, 0: not at all); gate_up_rows, down_rows: how many weight rows
    pass 1 and pass 2 read at once for one row of x, 1, 2 or 4 (`GATE_UP_ROWS`, `DOWN_ROWS` by
    default; int4 rows one at a time whatever); down_block_rows: the rows of down a pass-2 task
    reads, a multiple of 16 up to 1024 (`DOWN_BLOCK_ROWS` by default); the same bytes
    whatever.

    Raises ValueError for shapes that disagree, an expert out of range or a "steal" call of
    2**31 tasks a pass or more, before any work.
    """
    _check(blobs, fmt, experts, row_starts, x, out, expert_width, n_threads, schedule,
           prefetch_bytes, gate_up_rows, down_rows, down_block_rows)
    cdef int64_t n_rows = out.shape[0]
    if n_rows == 0:
        return
    act = np.empty((n_rows, expert_width), dtype=np.float32)  # [R, F]
    cdef float[:, ::1] act_view = act
    shares = _shares(n_threads, SCHEDULES[schedule])
    cdef Call call = _call(blobs, fmt, experts, row_starts, x, act_view, out, expert_width,
                           n_threads, SCHEDULES[schedule], prefetch_bytes, gate_up_rows,
                           down_rows, down_block_rows, shares)
    with nogil:
        _run(&call)


include "_cpu_experts_worker.pxi"
include "_cpu_experts_tally.pxi"
