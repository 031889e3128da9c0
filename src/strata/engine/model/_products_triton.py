"""The Triton kernels of `strata.engine.model.products` (imported only when Triton is there).

Legend: N output features, K input features, E experts; BLOCK_N weight rows a program,
BLOCK_K a power of two at least K.
"""

import triton
import triton.language as tl

from strata.engine._dependent_triton import wait_for_prior
from strata.engine.model._ops_triton import _normed, _residual_sum, _rstd, _softmax, _top_k


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
    # arithmetic up to the order of the sum. Rounded to x's dtype, then stored in out's (the
    # logits' float32: F.linear's bytes widened, with no cast kernel after this one). EVICT:
    # the weight loads' eviction_policy (`cache_hints.PRODUCTS_EVICT_FIRST`).
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
    y = y.to(x_ptr.dtype.element_ty)
    tl.store(out_ptr + n, y.to(out_ptr.dtype.element_ty), mask=n < N)


@triton.jit
def add_norm_product_one(x_ptr, delta_ptr, norm_w_ptr, h_ptr, w_ptr, b_ptr, out_ptr, N, K,
                         eps, w_stride, HAS_DELTA: tl.constexpr, HAS_BIAS: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         EVICT: tl.constexpr = "", USE_PDL: tl.constexpr = False):
    # `add_rms_norm` of one token, then `product_one` of its norm, in one launch. Program p:
    # its BLOCK_N weight rows and the norm's weight loaded before the wait (as `product_one`'s;
    # the norm's after the wait would be a trip to memory after the norm's reduction), then
    # the token's whole row h = x + delta [K] and its norm, which every program computes alike
    # (the same loads, the same order of squares: launched with `op_kernels.NORM_WARPS` warps,
    # the bytes of `add_rms_norm`'s norm), and out[n] = w[n, :] . norm (+ b[n]) for its rows.
    # Program 0 stores h (the residual stream the layer goes on with; without a delta h is x
    # and nothing is stored); nothing here reads it back. The norm is never stored: only this
    # product reads it.
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    k = tl.arange(0, BLOCK_K)  # [BK]
    k_in = k < K
    w = tl.load(w_ptr + n[:, None].to(tl.int64) * w_stride + k[None, :],
                mask=(n < N)[:, None] & k_in[None, :], other=0.0,
                eviction_policy=EVICT)  # [BN, BK]
    norm_w = tl.load(norm_w_ptr + k, mask=k_in, other=0.0)  # [BK]
    wait_for_prior(USE_PDL)
    h = _residual_sum(x_ptr, delta_ptr, 0, 0, 0, k, k_in, HAS_DELTA)  # [BK]
    if HAS_DELTA and tl.program_id(0) == 0:
        tl.store(h_ptr + k, h, mask=k_in)
    normed = _normed(h, _rstd(h, K, eps), norm_w, x_ptr.dtype.element_ty)
    y = tl.sum(w.to(tl.float32) * normed.to(tl.float32)[None, :], axis=1)  # [BN]
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + n, y.to(out_ptr.dtype.element_ty), mask=n < N)


@triton.jit
def product_add_norm_route(w_ptr, a_ptr, b_ptr, x_ptr, norm_w_ptr, router_ptr, h_ptr,
                           normed_ptr, partial_ptr, arrived_ptr, ids_ptr, weights_ptr, N, K, E,
                           TOP_K, eps, w_stride, router_stride, PROGRAMS,
                           HAS_BIAS: tl.constexpr, NORMALIZE: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           BLOCK_ROW: tl.constexpr, BLOCK_P: tl.constexpr,
                           BLOCK_E: tl.constexpr, BLOCK_TOP_K: tl.constexpr,
                           BY_RANK: tl.constexpr = True, EVICT: tl.constexpr = "",
                           USE_PDL: tl.constexpr = False):
    # One token's output product, the residual sum after it, the MoE's norm and its routing
    # in one launch (`product_one`, then `add_norm_router_route`). Program p, of PROGRAMS:
    # its BLOCK_N rows n of the product's weight, their columns of the router [E, BN] and the
    # norm's weight loaded before the wait (no kernel writes them); after it, delta[n] = w[n,
    # :] . a (+ b[n]) rounded to the dtype (the product's output), h[n] = x[n] + delta[n]
    # rounded again (the residual stream, stored), and the program's part of every expert's
    # logit, sum over n of router[e, n] * norm_w[n] * h[n] in float32, stored to partial
    # [PROGRAMS, BE]. The program then counts itself in arrived[0]; the last to arrive
    # (acquiring the others' h and parts) loads the whole row h [N], every part and the
    # norm's weight at once (one trip to memory: the next kernel waits on this program
    # alone), sums the parts in program order (the same bytes whichever program is last)
    # times the row's rstd (`add_rms_norm`'s to the bit at its warps), rounds the logits to
    # the dtype, routes them as `route` does, stores the norm of the row, and sets
    # arrived[0] back to 0. The router's product so takes the norm before its rounding to
    # the dtype (the two kernels' path multiplies the rounded norm): a logit can differ in
    # its last bit, deterministically.
    p = tl.program_id(0)
    n = p * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_in = n < N
    k = tl.arange(0, BLOCK_K)  # [BK]
    e = tl.arange(0, BLOCK_E)  # [BE]
    e_in = e < E
    w = tl.load(w_ptr + n[:, None].to(tl.int64) * w_stride + k[None, :],
                mask=n_in[:, None] & (k < K)[None, :], other=0.0,
                eviction_policy=EVICT)  # [BN, BK]
    router = tl.load(router_ptr + e[:, None].to(tl.int64) * router_stride + n[None, :],
                     mask=e_in[:, None] & n_in[None, :], other=0.0)  # [BE, BN]
    norm_w = tl.load(norm_w_ptr + n, mask=n_in, other=0.0).to(tl.float32)  # [BN]
    wait_for_prior(USE_PDL)
    dtype = h_ptr.dtype.element_ty
    a = tl.load(a_ptr + k, mask=k < K, other=0.0).to(tl.float32)  # [BK]
    y = tl.sum(w.to(tl.float32) * a[None, :], axis=1)  # [BN]
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=n_in, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + n, mask=n_in, other=0.0).to(tl.float32)
    h = (x + y.to(dtype).to(tl.float32)).to(dtype)  # [BN]
    tl.store(h_ptr + n, h, mask=n_in)
    part = tl.sum(router.to(tl.float32) * (h.to(tl.float32) * norm_w)[None, :], axis=1)
    tl.store(partial_ptr + p * BLOCK_E + e, part)  # [BE]
    if tl.atomic_add(arrived_ptr, 1, sem="acq_rel") == PROGRAMS - 1:
        row = tl.arange(0, BLOCK_ROW)
        row_in = row < N
        whole = tl.load(h_ptr + row, mask=row_in, other=0.0, volatile=True)  # [BR]
        s = tl.arange(0, BLOCK_P)
        parts = tl.load(partial_ptr + s[:, None] * BLOCK_E + e[None, :],
                        mask=(s < PROGRAMS)[:, None], other=0.0, volatile=True)  # [BP, BE]
        row_norm_w = tl.load(norm_w_ptr + row, mask=row_in, other=0.0)  # [BR]
        rstd = _rstd(whole, N, eps)
        logits = (tl.sum(parts, axis=0) * rstd).to(dtype).to(tl.float32)
        logits = tl.where(e_in, logits, float("-inf"))
        _top_k(_softmax(logits), e, e_in, ids_ptr, weights_ptr, 0, TOP_K, NORMALIZE, BLOCK_E,
               BLOCK_TOP_K, BY_RANK)
        tl.store(normed_ptr + row, _normed(whole, rstd, row_norm_w, dtype), mask=row_in)
        tl.store(arrived_ptr, 0)
