"""The Triton kernels of `strata.engine.model.products` (imported only when Triton is there).

Legend: N output features, K input features; BLOCK_N weight rows a program, BLOCK_K a power of
two at least K.
"""

import triton
import triton.language as tl

from strata.engine._dependent_triton import wait_for_prior
from strata.engine.model._ops_triton import _normed, _residual_sum, _rstd


@triton.jit
def product_one(w_ptr, x_ptr, b_ptr, out_ptr, N, K, w_stride, HAS_BIAS: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVICT: tl.constexpr = "",
                USE_PDL: tl.constexpr = False):
    # Program p: out[n] = w[n, :] . x (+ b[n]) for one token x [K] and the BLOCK_N rows n of
    # p. The weight rows are loaded before the wait: no kernel writes them, so as a dependent
    # the program reads them while the kernel before it still runs, and only x, that kernel's
    # output, waits (an exception to "wait first": tests/engine/test_dependent_launch.py
    # checks that nothing but w is read before it). Summed in float32 across the row in one
    # fixed order (deterministic), the bias added in float32, rounded once: F.linear's
    # arithmetic up to the order of the sum. EVICT: the weight loads' eviction_policy
    # (`cache_hints.PRODUCTS_EVICT_FIRST`).
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    k = tl.arange(0, BLOCK_K)  # [BK]
    w = tl.load(w_ptr + n[:, None].to(tl.int64) * w_stride + k[None, :],
                mask=(n < N)[:, None] & (k < K)[None, :], other=0.0,
                eviction_policy=EVICT)  # [BN, BK]
    wait_for_prior(USE_PDL)
    x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)  # [BK]
    y = tl.sum(w.to(tl.float32) * x[None, :], axis=1)  # [BN]
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + n, y.to(out_ptr.dtype.element_ty), mask=n < N)


@triton.jit
def add_norm_product_one(x_ptr, delta_ptr, norm_w_ptr, h_ptr, w_ptr, b_ptr, out_ptr, N, K,
                         eps, w_stride, HAS_DELTA: tl.constexpr, HAS_BIAS: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         EVICT: tl.constexpr = "", USE_PDL: tl.constexpr = False):
    # `add_rms_norm` of one token, then `product_one` of its norm, in one launch. Program p:
    # its BLOCK_N weight rows loaded before the wait (as `product_one`'s), then the token's
    # whole row h = x + delta [K] and its norm, which every program computes alike (the same
    # loads, the same order of squares: launched with `op_kernels.NORM_WARPS` warps, the bytes
    # of `add_rms_norm`'s norm), and out[n] = w[n, :] . norm (+ b[n]) for its rows. Program 0
    # stores h (the residual stream the layer goes on with; without a delta h is x and nothing
    # is stored); nothing here reads it back. The norm is never stored: only this product
    # reads it.
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    k = tl.arange(0, BLOCK_K)  # [BK]
    k_in = k < K
    w = tl.load(w_ptr + n[:, None].to(tl.int64) * w_stride + k[None, :],
                mask=(n < N)[:, None] & k_in[None, :], other=0.0,
                eviction_policy=EVICT)  # [BN, BK]
    wait_for_prior(USE_PDL)
    h = _residual_sum(x_ptr, delta_ptr, 0, 0, 0, k, k_in, HAS_DELTA)  # [BK]
    if HAS_DELTA and tl.program_id(0) == 0:
        tl.store(h_ptr + k, h, mask=k_in)
    normed = _normed(h, _rstd(h, K, eps), norm_w_ptr, k, k_in, x_ptr.dtype.element_ty)
    y = tl.sum(w.to(tl.float32) * normed.to(tl.float32)[None, :], axis=1)  # [BN]
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + n, y.to(out_ptr.dtype.element_ty), mask=n < N)
