"""The CPU miss path's kernel: bf16 experts read in place from the host store, on all cores.

Dimension letters: M experts of the call, R rows (a row is one token routed to one expert),
D hidden size, F expert width.

A blob is gate [F, D] | up [F, D] | down [D, F] in bf16 (`strata.engine.experts.store`). At a
few tokens an expert, computing one is reading it: 3*F*D*2 bytes for 3*F*D multiply-adds per
token. torch's bf16 matmul reads a decode round's experts at 30-50% of the host's bandwidth
(bench/results/cpu-experts-h200-2026-11-29.md); these loops read each weight row once per call
and spread every expert of the call over the cores, so the whole call streams at the memory's
rate:

1. act[r, f] = bf16(silu(bf16(gate[f] . x[r])) * bf16(up[f] . x[r])) for each row r of each
   expert, the expert's F split in blocks over the threads (the gate and up rows of one f are
   read by the same thread);
2. out[r, d] = bf16(down[d] . act[r]), the expert's D split in blocks over the threads.

Each output value is computed by one thread in one fixed order, so the result does not depend
on the thread count or the schedule; the roundings to bf16 are torch's (the matmul's output,
silu's, the product's), so the result is close to the torch path's, not equal to it (the sums
are added in another order).
"""

from cython.parallel cimport prange
from libc.math cimport expf
from libc.stdint cimport int64_t, uint16_t

import numpy as np

cdef extern from "_cpu_experts_dot.h" nogil:
    float strata_dot_bf16_f32(const uint16_t *w, const float *x, int64_t n)
    float strata_bf16_to_f32(uint16_t h)
    uint16_t strata_f32_to_bf16(float f)

# Rows of a weight matrix one task reads: enough to amortise the task, few enough that a
# decode call's M * F / BLOCK_ROWS tasks keep 16 threads busy (olmoe: 8 * 1024 / 16 = 512).
cdef enum:
    BLOCK_ROWS = 16


cdef inline float _round(float v) noexcept nogil:
    return strata_bf16_to_f32(strata_f32_to_bf16(v))


cdef void _activations(const uint16_t[:, ::1] blobs, const int64_t[::1] experts,
                       const int64_t[::1] row_starts, const float[:, ::1] x,
                       float[:, ::1] act, int64_t f_width, int64_t d_hidden,
                       int n_threads) noexcept nogil:
    cdef int64_t n_blocks = (f_width + BLOCK_ROWS - 1) // BLOCK_ROWS
    cdef int64_t task, i, f, f_end, r
    cdef const uint16_t *blob
    cdef float g, u
    for task in prange(experts.shape[0] * n_blocks, num_threads=n_threads, schedule="static"):
        i = task // n_blocks
        blob = &blobs[experts[i], 0]
        f = (task % n_blocks) * BLOCK_ROWS
        f_end = min(f + BLOCK_ROWS, f_width)
        while f < f_end:
            for r in range(row_starts[i], row_starts[i + 1]):
                g = _round(strata_dot_bf16_f32(blob + f * d_hidden, &x[r, 0], d_hidden))
                u = _round(strata_dot_bf16_f32(blob + (f_width + f) * d_hidden, &x[r, 0],
                                               d_hidden))
                act[r, f] = _round(_round(g / (1.0 + expf(-g))) * u)
            f = f + 1


cdef void _outputs(const uint16_t[:, ::1] blobs, const int64_t[::1] experts,
                   const int64_t[::1] row_starts, const float[:, ::1] act,
                   uint16_t[:, ::1] out, int64_t f_width, int64_t d_hidden,
                   int n_threads) noexcept nogil:
    cdef int64_t n_blocks = (d_hidden + BLOCK_ROWS - 1) // BLOCK_ROWS
    cdef int64_t task, i, d, d_end, r
    cdef const uint16_t *down
    for task in prange(experts.shape[0] * n_blocks, num_threads=n_threads, schedule="static"):
        i = task // n_blocks
        down = &blobs[experts[i], 2 * f_width * d_hidden]
        d = (task % n_blocks) * BLOCK_ROWS
        d_end = min(d + BLOCK_ROWS, d_hidden)
        while d < d_end:
            for r in range(row_starts[i], row_starts[i + 1]):
                out[r, d] = strata_f32_to_bf16(
                    strata_dot_bf16_f32(down + d * f_width, &act[r, 0], f_width))
            d = d + 1


def experts_bf16(const uint16_t[:, ::1] blobs, const int64_t[::1] experts,
                 const int64_t[::1] row_starts, const float[:, ::1] x, uint16_t[:, ::1] out,
                 int64_t expert_width, int n_threads):
    """Compute `experts` of one layer over their rows, into `out`.

    blobs uint16 [E, 3*F*D]: the layer's blobs as bf16 bits (the store's bytes, not a copy);
    experts int64 [M]: the blob row of each expert of the call; row_starts int64 [M+1]: expert
    i owns rows [row_starts[i], row_starts[i+1]) of `x` and `out`; x float32 [R, D]: each
    row's input; out uint16 [R, D]: each row's output as bf16 bits (written, not read);
    expert_width: F; n_threads: the threads of both passes (>= 1).

    Raises ValueError for shapes that disagree or an expert out of range, before any work.
    """
    cdef int64_t d_hidden = x.shape[1]
    cdef int64_t n_rows = x.shape[0]
    cdef Py_ssize_t i
    if expert_width < 1 or blobs.shape[1] != 3 * expert_width * d_hidden:
        raise ValueError(f"blobs must be [E, 3*F*D] = [E, {3 * expert_width * d_hidden}] for "
                         f"F = {expert_width}, D = {d_hidden}, got [{blobs.shape[0]}, "
                         f"{blobs.shape[1]}]")
    if out.shape[0] != n_rows or out.shape[1] != d_hidden:
        raise ValueError(f"out must be [R, D] = [{n_rows}, {d_hidden}], got "
                         f"[{out.shape[0]}, {out.shape[1]}]")
    if row_starts.shape[0] != experts.shape[0] + 1 or row_starts[0] != 0 \
            or row_starts[experts.shape[0]] != n_rows:
        raise ValueError(f"row_starts must be [M+1] = [{experts.shape[0] + 1}] from 0 to "
                         f"R = {n_rows}, got {np.asarray(row_starts).tolist()}")
    for i in range(experts.shape[0]):
        if row_starts[i + 1] < row_starts[i]:
            raise ValueError(f"row_starts must not decrease, got "
                             f"{np.asarray(row_starts).tolist()}")
        if not 0 <= experts[i] < blobs.shape[0]:
            raise ValueError(f"expert {experts[i]} is out of range [0, {blobs.shape[0]})")
    if n_threads < 1:
        raise ValueError(f"n_threads must be >= 1, got {n_threads}")
    if n_rows == 0:
        return
    act = np.empty((n_rows, expert_width), dtype=np.float32)  # [R, F]
    cdef float[:, ::1] act_view = act
    with nogil:
        _activations(blobs, experts, row_starts, x, act_view, expert_width, d_hidden, n_threads)
        _outputs(blobs, experts, row_starts, act_view, out, expert_width, d_hidden, n_threads)
