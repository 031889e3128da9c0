"""The Triton kernel of `strata.engine.experts.combine` (imported only when Triton is there).

Legend: T tokens, K experts per token, D hidden size; BD the block size.
"""

import triton
import triton.language as tl

from strata.engine._dependent_triton import wait_for_prior


@triton.jit
def combine(rows_ptr, weights_ptr, positions_ptr, out_ptr, row_stride, out_stride, D, K,
            HAS_POSITIONS: tl.constexpr, BLOCK_D: tl.constexpr,
            USE_PDL: tl.constexpr = False):
    # Program (t, b): out[t, b*BLOCK_D : (b+1)*BLOCK_D] = sum over k = 0..K-1, in order, of
    # weights[t, k] * row(t, k) in float32, each row value widened exactly, rounded once.
    wait_for_prior(USE_PDL)
    t = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BD]
    d_in = d < D
    total = tl.zeros([BLOCK_D], dtype=tl.float32)
    for k in range(0, K):
        if HAS_POSITIONS:
            row = tl.load(positions_ptr + t * K + k).to(tl.int64)
        else:
            row = (t * K + k).to(tl.int64)
        values = tl.load(rows_ptr + row * row_stride + d, mask=d_in, other=0.0)
        total += values.to(tl.float32) * tl.load(weights_ptr + t * K + k)
    tl.store(out_ptr + t * out_stride + d, total.to(out_ptr.dtype.element_ty), mask=d_in)
