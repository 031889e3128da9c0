"""The Triton kernels of `strata.engine.experts.grouped` (imported only when Triton is there).

Legend: R routed rows, D hidden size, F expert width; BF, BD the block sizes.
Each kernel reads one expert's weights in place, at `w_ptr + index[r] * slot_stride` elements,
rows `row_stride` apart (a negative index[r]: no weight read, row r of the output zeros):
`gate_up_act` its [2F, D] gate and up rows, `down` its [D, F] rows.
A program keeps a [BF, BD] (or [BD, BF]) tile of fp32 products summed along its loop and reduces
the tile across its columns once, at the end: one cross-thread reduction a program, not one a
step (1.5x the bandwidth on the H200, bench/results/grouped-experts-h200-2026-12-01.md). The
order is fixed, so the sums are deterministic.
EVICT is the weight loads' `eviction_policy` ("evict_first" where
`cache_hints.EXPERTS_EVICT_FIRST`: read once a round, their lines leave L2 first).
"""

import triton
import triton.language as tl

from strata.engine._dependent_triton import wait_for_prior
from strata.engine.experts._activation_triton import silu_mul


@triton.jit
def gate_up_act(w_ptr, index_ptr, x_ptr, act_ptr, slot_stride, row_stride, D, F,
                x_stride, act_stride, BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr,
                EVICT: tl.constexpr = "", USE_PDL: tl.constexpr = False):
    # Program (r, b): act[r, b*BLOCK_F : (b+1)*BLOCK_F] of the expert index[r].
    wait_for_prior(USE_PDL)
    r = tl.program_id(0)
    slot = tl.load(index_ptr + r).to(tl.int64)
    f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)  # [BF]
    f_in = f < tl.where(slot >= 0, F, 0)  # a negative slot: nothing read, nothing stored
    expert = w_ptr + tl.maximum(slot, 0) * slot_stride
    gate_tile = tl.zeros([BLOCK_F, BLOCK_D], dtype=tl.float32)
    up_tile = tl.zeros([BLOCK_F, BLOCK_D], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)  # [BD]
        d_in = d < D
        x = tl.load(x_ptr + r * x_stride + d, mask=d_in, other=0.0).to(tl.float32)
        both = f_in[:, None] & d_in[None, :]
        gate = tl.load(expert + f[:, None] * row_stride + d[None, :], mask=both, other=0.0,
                       eviction_policy=EVICT)
        up = tl.load(expert + (f[:, None] + F) * row_stride + d[None, :], mask=both,
                     other=0.0, eviction_policy=EVICT)
        gate_tile += gate.to(tl.float32) * x[None, :]
        up_tile += up.to(tl.float32) * x[None, :]
    store_act(tl.sum(gate_tile, axis=1), tl.sum(up_tile, axis=1), act_ptr, r, act_stride, f,
              f_in)


@triton.jit
def store_act(gate_sum, up_sum, act_ptr, r, act_stride, f, f_in):
    # act[r, f] from the fp32 gate and up sums [BF], rounded as the batched matmul and silu of
    # the gathered path do, then multiplied.
    dtype = act_ptr.dtype.element_ty
    gate = gate_sum.to(dtype).to(tl.float32)
    up = up_sum.to(dtype).to(tl.float32)
    tl.store(act_ptr + r * act_stride + f, silu_mul(gate, up, dtype), mask=f_in)


@triton.jit
def _down_block(w_ptr, slot, act_ptr, r, d, d_in, slot_stride, row_stride, F, act_stride,
                BLOCK_D: tl.constexpr, BLOCK_F: tl.constexpr, EVICT: tl.constexpr):
    # [BD] float32: rows d of the expert in `slot` times row r of act, summed over F in a
    # fixed order (nothing read where d_in is false); the weights' loads marked EVICT.
    tile = tl.zeros([BLOCK_D, BLOCK_F], dtype=tl.float32)
    return _down_steps(tile, w_ptr + tl.maximum(slot, 0) * slot_stride, act_ptr, r, d, d_in,
                       row_stride, F, act_stride, 0, BLOCK_F, EVICT)


@triton.jit
def _down_steps(tile, expert, act_ptr, r, d, d_in, row_stride, F, act_stride, f_start,
                BLOCK_F: tl.constexpr, EVICT: tl.constexpr):
    # `_down_block`'s steps from column f_start on, added onto `tile` [BD, BF], then the tile
    # summed across its columns: [BD].
    for f0 in range(f_start, F, BLOCK_F):
        f = f0 + tl.arange(0, BLOCK_F)  # [BF]
        f_in = f < F
        act = tl.load(act_ptr + r * act_stride + f, mask=f_in, other=0.0).to(tl.float32)
        w = tl.load(expert + d[:, None] * row_stride + f[None, :],
                    mask=d_in[:, None] & f_in[None, :], other=0.0, eviction_policy=EVICT)
        tile += w.to(tl.float32) * act[None, :]
    return tl.sum(tile, axis=1)


@triton.jit
def down(w_ptr, index_ptr, act_ptr, y_ptr, slot_stride, row_stride, D, F, act_stride,
         y_stride, BLOCK_D: tl.constexpr, BLOCK_F: tl.constexpr, EVICT: tl.constexpr = "",
         USE_PDL: tl.constexpr = False):
    # Program (r, b): y[r, b*BLOCK_D : (b+1)*BLOCK_D] of the expert index[r].
    wait_for_prior(USE_PDL)
    r = tl.program_id(0)
    slot = tl.load(index_ptr + r).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BD]
    d_in = d < tl.where(slot >= 0, D, 0)  # a negative slot: nothing read, zeros stored
    y = _down_block(w_ptr, slot, act_ptr, r, d, d_in, slot_stride, row_stride, F, act_stride,
                    BLOCK_D, BLOCK_F, EVICT)
    store_rows(y_ptr, r, y_stride, d, D, slot, y)


@triton.jit
def store_rows(y_ptr, r, y_stride, d, D, slot, y):
    # y[r, d] for d < D from the fp32 sums y [BD]; zeros for a negative slot. Its act row was
    # never written, so its sums may be 0 * NaN: the zeros keep a row nobody fills (a decode
    # graph's warm-up sums every row) from carrying garbage into the hidden state.
    y = tl.where(slot >= 0, y, 0.0)
    tl.store(y_ptr + r * y_stride + d, y.to(y_ptr.dtype.element_ty), mask=d < D)


@triton.jit
def down_sum(w_ptr, index_ptr, act_ptr, y_ptr, weights_ptr, out_ptr, arrived_ptr, slot_stride,
             row_stride, D, F, act_stride, y_stride, R, BLOCK_D: tl.constexpr,
             BLOCK_F: tl.constexpr, BLOCK_R: tl.constexpr, EVICT: tl.constexpr = "",
             USE_PDL: tl.constexpr = False):
    # One token's R = K rows. Program (r, b): `down`'s y[r, block b], rounded and stored as
    # `down` stores it; then counted in arrived[b]. The last of block b's R programs to arrive
    # (acquiring the others' rows) sums weights[k] * y[k, block b] over k = 0..R-1 in order in
    # float32, as `combine` does, into out[block b] (the same bytes as `down` then `combine`,
    # whichever program is last), and sets arrived[b] back to 0 for the next launch. Its
    # BLOCK_R steps (a power of two at least R) are unrolled, so their loads are issued at
    # once, not a trip to memory a row or four; a step past R adds 0 * 0. (Reading
    # the expert's index and first weight tile before the wait was timed and was slower:
    # bench/results/profile-control-h100-2026-12-06.md.)
    wait_for_prior(USE_PDL)
    r = tl.program_id(0)
    b = tl.program_id(1)
    d = b * BLOCK_D + tl.arange(0, BLOCK_D)  # [BD]
    d_in = d < D
    slot = tl.load(index_ptr + r).to(tl.int64)
    y = _down_block(w_ptr, slot, act_ptr, r, d, d_in, slot_stride, row_stride, F, act_stride,
                    BLOCK_D, BLOCK_F, EVICT)
    tl.store(y_ptr + r * y_stride + d, y.to(y_ptr.dtype.element_ty), mask=d_in)
    if tl.atomic_add(arrived_ptr + b, 1, sem="acq_rel") == R - 1:
        total = tl.zeros([BLOCK_D], dtype=tl.float32)
        for k in tl.static_range(BLOCK_R):
            values = tl.load(y_ptr + k * y_stride + d, mask=tl.where(k < R, d_in, False),
                             other=0.0, volatile=True)
            total += values.to(tl.float32) * tl.load(weights_ptr + k, mask=k < R, other=0.0)
        tl.store(out_ptr + d, total.to(out_ptr.dtype.element_ty), mask=d_in)
        tl.store(arrived_ptr + b, 0)
