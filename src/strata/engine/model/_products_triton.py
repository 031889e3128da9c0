"""The Triton kernel of `strata.engine.model.products` (imported only when Triton is there).

Legend: N output features, K input features; BLOCK_N weight rows a program, BLOCK_K a power of
two at least K.
"""

import triton
import triton.language as tl

from strata.engine._dependent_triton import wait_for_prior


@triton.jit
def product_one(w_ptr, x_ptr, b_ptr, out_ptr, N, K, w_stride, HAS_BIAS: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False):
    # Program p: out[n] = w[n, :] . x (+ b[n]) for one token x [K] and the BLOCK_N rows n of
    # p. The weight rows are loaded before the wait: no kernel writes them, so as a dependent
    # the program reads them while the kernel before it still runs, and only x, that kernel's
    # output, waits (an exception to "wait first": tests/engine/test_dependent_launch.py
    # checks that nothing but w is read before it). Summed in float32 across the row in one
    # fixed order (deterministic), the bias added in float32, rounded once: F.linear's
    # arithmetic up to the order of the sum.
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    k = tl.arange(0, BLOCK_K)  # [BK]
    w = tl.load(w_ptr + n[:, None].to(tl.int64) * w_stride + k[None, :],
                mask=(n < N)[:, None] & (k < K)[None, :], other=0.0)  # [BN, BK]
    wait_for_prior(USE_PDL)
    x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)  # [BK]
    y = tl.sum(w.to(tl.float32) * x[None, :], axis=1)  # [BN]
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + n, y.to(out_ptr.dtype.element_ty), mask=n < N)
