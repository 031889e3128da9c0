"""The Triton side of `strata.engine.experts.activation` (imported only when Triton is there).

Legend: R rows, F expert width; BF the block size.
"""

import triton
import triton.language as tl

from strata.engine._dependent_triton import wait_for_prior


@triton.jit
def silu_mul(gate, up, dtype: tl.constexpr):
    # silu(gate) * up from float32 gate and up values already rounded to `dtype`: silu rounded
    # to `dtype`, then the product (exact in float32 for 16-bit inputs) rounded once, as torch's
    # `F.silu(gate) * up` rounds in a 16-bit dtype. Every kernel that applies the activation
    # calls this one, so the decode and the prompt paths round alike.
    silu = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
    return (silu * up).to(dtype)


@triton.jit
def silu_and_mul(h_ptr, act_ptr, F, h_stride, act_stride, BLOCK_F: tl.constexpr,
                 USE_PDL: tl.constexpr = False):
    # Program (r, b): act[r, b*BF : (b+1)*BF] from h[r]'s gate half [0, F) and up half [F, 2F),
    # each read once: one pass where torch's silu and product are two (and a copy for the
    # strided gate half).
    wait_for_prior(USE_PDL)
    r = tl.program_id(0).to(tl.int64)
    f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)  # [BF]
    f_in = f < F
    row = h_ptr + r * h_stride
    gate = tl.load(row + f, mask=f_in, other=0.0).to(tl.float32)
    up = tl.load(row + F + f, mask=f_in, other=0.0).to(tl.float32)
    act = silu_mul(gate, up, act_ptr.dtype.element_ty)
    tl.store(act_ptr + r * act_stride + f, act, mask=f_in)
