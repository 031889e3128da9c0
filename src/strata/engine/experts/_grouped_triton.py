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
    _gate_up_block(w_ptr, index_ptr, x_ptr, act_ptr, tl.program_id(0), tl.program_id(1),
                   slot_stride, row_stride, D, F, x_stride, act_stride, BLOCK_F, BLOCK_D, EVICT)


@triton.jit
def _gate_up_block(w_ptr, index_ptr, x_ptr, act_ptr, r, b, slot_stride, row_stride, D, F,
                   x_stride, act_stride, BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr,
                   EVICT: tl.constexpr):
    # act[r, b*BLOCK_F : (b+1)*BLOCK_F] of the expert index[r], its weights' loads marked EVICT.
    slot = tl.load(index_ptr + r).to(tl.int64)
    f = b * BLOCK_F + tl.arange(0, BLOCK_F)  # [BF]
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
                BLOCK_D: tl.constexpr, BLOCK_F: tl.constexpr, EVICT: tl.constexpr,
                ACT_CACHE: tl.constexpr):
    # [BD] float32: rows d of the expert in `slot` times row r of act, summed over F in a
    # fixed order (nothing read where d_in is false); the weights' loads marked EVICT, act's
    # read with the cache modifier ACT_CACHE.
    tile = tl.zeros([BLOCK_D, BLOCK_F], dtype=tl.float32)
    return _down_steps(tile, w_ptr + tl.maximum(slot, 0) * slot_stride, act_ptr, r, d, d_in,
                       row_stride, F, act_stride, 0, BLOCK_F, EVICT, ACT_CACHE)


@triton.jit
def _down_steps(tile, expert, act_ptr, r, d, d_in, row_stride, F, act_stride, f_start,
                BLOCK_F: tl.constexpr, EVICT: tl.constexpr, ACT_CACHE: tl.constexpr):
    # `_down_block`'s steps from column f_start on, added onto `tile` [BD, BF], then the tile
    # summed across its columns: [BD].
    for f0 in range(f_start, F, BLOCK_F):
        f = f0 + tl.arange(0, BLOCK_F)  # [BF]
        f_in = f < F
        act = tl.load(act_ptr + r * act_stride + f, mask=f_in, other=0.0,
                      cache_modifier=ACT_CACHE).to(tl.float32)
        w = tl.load(expert + d[:, None] * row_stride + f[None, :],
                    mask=d_in[:, None] & f_in[None, :], other=0.0, eviction_policy=EVICT)
        tile += w.to(tl.float32) * act[None, :]
    return tl.sum(tile, axis=1)


@triton.jit
def _down_first_tile(w_ptr, slot, d, d_in, slot_stride, row_stride, F, BLOCK_F: tl.constexpr,
                     EVICT: tl.constexpr):
    # [BD, BF] in w's dtype: the first step's tile of `_down_block`, columns 0..BF-1.
    f = tl.arange(0, BLOCK_F)  # [BF]
    return tl.load(w_ptr + tl.maximum(slot, 0) * slot_stride + d[:, None] * row_stride
                   + f[None, :], mask=d_in[:, None] & (f < F)[None, :], other=0.0,
                   eviction_policy=EVICT)


@triton.jit
def _down_block_after(first, w_ptr, slot, act_ptr, r, d, d_in, slot_stride, row_stride, F,
                      act_stride, BLOCK_D: tl.constexpr, BLOCK_F: tl.constexpr,
                      EVICT: tl.constexpr, ACT_CACHE: tl.constexpr):
    # `_down_block` with its first step's weight tile loaded already (`_down_first_tile`):
    # the same steps in the same order onto the same zeros (a zero's sign included), so the
    # sums are the same bytes.
    f = tl.arange(0, BLOCK_F)  # [BF]
    act = tl.load(act_ptr + r * act_stride + f, mask=f < F, other=0.0,
                  cache_modifier=ACT_CACHE).to(tl.float32)
    tile = tl.zeros([BLOCK_D, BLOCK_F], dtype=tl.float32)
    tile += first.to(tl.float32) * act[None, :]  # [BD, BF]
    return _down_steps(tile, w_ptr + tl.maximum(slot, 0) * slot_stride, act_ptr, r, d, d_in,
                       row_stride, F, act_stride, BLOCK_F, BLOCK_F, EVICT, ACT_CACHE)


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
                    BLOCK_D, BLOCK_F, EVICT, "")
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
             BLOCK_F: tl.constexpr, W_FIRST: tl.constexpr = False,
             EVICT: tl.constexpr = "", USE_PDL: tl.constexpr = False):
    # One token's R = K rows. Program (r, b): `down`'s y[r, block b], rounded and stored as
    # `down` stores it; then counted in arrived[b]. The last of block b's R programs to arrive
    # (acquiring the others' rows) sums weights[k] * y[k, block b] over k = 0..R-1 in order in
    # float32, as `combine` does, into out[block b] (the same bytes as `down` then `combine`,
    # whichever program is last), and sets arrived[b] back to 0 for the next launch.
    # W_FIRST: the expert's index and the first step's weight tile are read before the wait.
    # No kernel writes the weights; the index is written before `gate_up_act`, the kernel
    # this one follows, and that kernel lets this one start only after its own wait, so the
    # writer has finished by then (`grouped.DOWN_W_FIRST`). The index is read past the L1
    # cache (".cg"), which may still hold the last launch's.
    r = tl.program_id(0)
    b = tl.program_id(1)
    d = b * BLOCK_D + tl.arange(0, BLOCK_D)  # [BD]
    d_in = d < D
    if W_FIRST:
        slot = tl.load(index_ptr + r, cache_modifier=".cg").to(tl.int64)
        first = _down_first_tile(w_ptr, slot, d, d_in, slot_stride, row_stride, F, BLOCK_F,
                                 EVICT)
    wait_for_prior(USE_PDL)
    if W_FIRST:
        y = _down_block_after(first, w_ptr, slot, act_ptr, r, d, d_in, slot_stride,
                              row_stride, F, act_stride, BLOCK_D, BLOCK_F, EVICT, "")
    else:
        slot = tl.load(index_ptr + r).to(tl.int64)
        y = _down_block(w_ptr, slot, act_ptr, r, d, d_in, slot_stride, row_stride, F,
                        act_stride, BLOCK_D, BLOCK_F, EVICT, "")
    _store_then_sum(y, y_ptr, r, y_stride, d, d_in, weights_ptr, out_ptr, arrived_ptr, b, R,
                    BLOCK_D)


@triton.jit
def _store_then_sum(y, y_ptr, r, y_stride, d, d_in, weights_ptr, out_ptr, arrived_ptr, b, R,
                    BLOCK_D: tl.constexpr):
    # y [BD] float32 stored as row r's block b of y, rounded as `down` stores it, then counted
    # in arrived[b]; the last of block b's R rows to arrive sums weights[k] * y[k, block b]
    # over k = 0..R-1 in order in float32, as `combine` does, into out[block b], and sets
    # arrived[b] back to 0 for the next launch. The barrier first: every thread's part of the
    # row is stored before the one thread that counts it releases it.
    tl.store(y_ptr + r * y_stride + d, y.to(y_ptr.dtype.element_ty), mask=d_in)
    tl.debug_barrier()
    if tl.atomic_add(arrived_ptr + b, 1, sem="acq_rel") == R - 1:
        total = tl.zeros([BLOCK_D], dtype=tl.float32)
        for k in range(0, R):
            values = tl.load(y_ptr + k * y_stride + d, mask=d_in, other=0.0, volatile=True)
            total += values.to(tl.float32) * tl.load(weights_ptr + k)
        tl.store(out_ptr + d, total.to(out_ptr.dtype.element_ty), mask=d_in)
        tl.store(arrived_ptr + b, 0)


# `experts_sum`'s counters, int32 offsets into its counters buffer: the next ticket, the
# programs finished, then one count of finished gate_up blocks a row.
TICKET, FINISHED, ROWS_DONE = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def experts_sum(gate_up_ptr, down_ptr, index_ptr, x_ptr, act_ptr, y_ptr, weights_ptr, out_ptr,
                arrived_ptr, counters_ptr, up_slot_stride, up_row_stride, down_slot_stride,
                down_row_stride, D, F, x_stride, act_stride, y_stride, R,
                UP_BLOCK_F: tl.constexpr, UP_BLOCK_D: tl.constexpr,
                DOWN_BLOCK_D: tl.constexpr, DOWN_BLOCK_F: tl.constexpr,
                W_FIRST: tl.constexpr = False, EVICT: tl.constexpr = "",
                USE_PDL: tl.constexpr = False):
    # `gate_up_act` then `down_sum` as one launch of R * (F / UP_BLOCK_F) gate_up programs and
    # R * (D / DOWN_BLOCK_D) down programs, so that a row's down blocks start once that row's
    # act is whole, not once every row's is (nor once the kernel before has drained).
    # A program's work is its ticket, taken from counters[TICKET] in the order programs start,
    # not its program id: gate_up blocks first, row by row, then down blocks, row by row. A
    # down block waits for its row's gate_up blocks, which hold smaller tickets, so they were
    # handed to programs that are running already and wait for nothing: no order in which the
    # GPU starts programs can leave a waiting program holding the place one it waits for needs.
    # The last program to finish sets the counters back to 0 for the next launch. The same
    # bytes as `gate_up_act` then `down_sum`: the same blocks summed in the same order.
    # W_FIRST: a down block reads its first step's weight tile before it waits for its row
    # (the index is written before the kernel this one follows, as for `down_sum`'s).
    wait_for_prior(USE_PDL)
    n_up_blocks = tl.cdiv(F, UP_BLOCK_F)
    n_down_blocks = tl.cdiv(D, DOWN_BLOCK_D)
    n_up = R * n_up_blocks
    ticket = tl.atomic_add(counters_ptr + TICKET, 1)
    if ticket < n_up:
        r = ticket // n_up_blocks
        _gate_up_block(gate_up_ptr, index_ptr, x_ptr, act_ptr, r, ticket % n_up_blocks,
                       up_slot_stride, up_row_stride, D, F, x_stride, act_stride, UP_BLOCK_F,
                       UP_BLOCK_D, EVICT)
        tl.debug_barrier()  # the whole block stored before it is counted
        tl.atomic_add(counters_ptr + ROWS_DONE + r, 1, sem="release")
    else:
        r = (ticket - n_up) // n_down_blocks
        b = (ticket - n_up) % n_down_blocks
        slot = tl.load(index_ptr + r).to(tl.int64)
        d = b * DOWN_BLOCK_D + tl.arange(0, DOWN_BLOCK_D)  # [BD]
        d_in = d < D
        if W_FIRST:
            first = _down_first_tile(down_ptr, slot, d, d_in, down_slot_stride,
                                     down_row_stride, F, DOWN_BLOCK_F, EVICT)
        done = tl.atomic_add(counters_ptr + ROWS_DONE + r, 0, sem="acquire")
        while done < n_up_blocks:
            done = tl.atomic_add(counters_ptr + ROWS_DONE + r, 0, sem="acquire")
        # act is read past L1 (".cg"): other programs wrote it during this launch.
        if W_FIRST:
            y = _down_block_after(first, down_ptr, slot, act_ptr, r, d, d_in, down_slot_stride,
                                  down_row_stride, F, act_stride, DOWN_BLOCK_D, DOWN_BLOCK_F,
                                  EVICT, ".cg")
        else:
            y = _down_block(down_ptr, slot, act_ptr, r, d, d_in, down_slot_stride,
                            down_row_stride, F, act_stride, DOWN_BLOCK_D, DOWN_BLOCK_F, EVICT,
                            ".cg")
        _store_then_sum(y, y_ptr, r, y_stride, d, d_in, weights_ptr, out_ptr, arrived_ptr, b,
                        R, DOWN_BLOCK_D)
    if tl.atomic_add(counters_ptr + FINISHED, 1, sem="acq_rel") == n_up + R * n_down_blocks - 1:
        for k in range(0, R):
            tl.store(counters_ptr + ROWS_DONE + k, 0)
        tl.store(counters_ptr + FINISHED, 0)
        tl.store(counters_ptr + TICKET, 0)
