"""The Triton kernel of `strata.engine.model.linear` (imported only when Triton is there).

Legend: N output features, K input features; BLOCK_N rows of the weight a program, BLOCK_K
columns a step.
"""

import triton
import triton.language as tl

from strata.engine._dependent_triton import wait_for_prior


@triton.jit
def linear_one(x_ptr, w_ptr, b_ptr, out_ptr, N, K, w_stride, HAS_BIAS: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False):
    # Program p: out[n] = w[n, :] . x (+ b[n]) for the one token x [K] and the BLOCK_N rows n
    # of p, as `F.linear` rounds it: the products summed in float32 (a [BN, BK] tile summed
    # along the loop, reduced across its columns once, in a fixed order: deterministic), the
    # bias added in float32, the result rounded once.
    wait_for_prior(USE_PDL)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_in = n < N
    rows = w_ptr + n[:, None].to(tl.int64) * w_stride
    tile = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)  # [BK]
        k_in = k < K
        x = tl.load(x_ptr + k, mask=k_in, other=0.0).to(tl.float32)
        w = tl.load(rows + k[None, :], mask=n_in[:, None] & k_in[None, :], other=0.0)
        tile += w.to(tl.float32) * x[None, :]
    y = tl.sum(tile, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=n_in, other=0.0).to(tl.float32)
    tl.store(out_ptr + n, y.to(out_ptr.dtype.element_ty), mask=n_in)
