"""The Triton kernels of `strata.engine.model.ops` (imported only when Triton is there).

Legend: T tokens, D hidden size, H query heads, G kv heads, P heads of one part (H for q, G
for k), Dh head dim, E experts, K experts per token; BLOCK_* a power of two at least the size.

Each kernel rounds where the torch reference's ops round: every product or sum of two values
is computed in float32 and rounded once to the tensors' dtype, as torch's elementwise kernels
do for bf16, so the two differ only where a reduction adds in another order (the sum of
squares of a norm, the softmax's sum): in the last bit, now and then.
"""

import triton
import triton.language as tl
from triton.language.extra import libdevice

from strata.engine._dependent_triton import wait_for_prior


@triton.jit
def _residual_sum(x_ptr, delta_ptr, t, x_stride, delta_stride, col, col_in,
                  HAS_DELTA: tl.constexpr):
    # Token t's h = x + delta at columns col, summed in float32 and rounded to x's dtype (as
    # torch's add rounds it); without delta, x as it is. 0 where not col_in.
    x = tl.load(x_ptr + t * x_stride + col, mask=col_in, other=0.0)
    if HAS_DELTA:
        delta = tl.load(delta_ptr + t * delta_stride + col, mask=col_in, other=0.0)
        x = (x.to(tl.float32) + delta.to(tl.float32)).to(x_ptr.dtype.element_ty)
    return x


@triton.jit
def _rstd(h, D, eps):
    # 1 / sqrt(mean(h^2) + eps) in float32 over a whole row h [BD] (0 past D). Shared by the
    # kernels that norm a row: launched with as many warps (`op_kernels.NORM_WARPS`), they lay
    # the row out alike and so add its squares in one order, the same rstd to the bit.
    wide = h.to(tl.float32)
    return tl.math.rsqrt(tl.sum(wide * wide, axis=0) / D + eps)


@triton.jit
def _normed(h, rstd, weight, dtype: tl.constexpr):
    # weight * (h * rstd): the norm rounded to dtype, then the weight's product rounded again
    # (`ops.rms_norm`'s order: the scale after the cast back). The caller loads the weight
    # (any dtype, widened here) where its read costs least: before its wait, or with the
    # row's own loads, not after the reduction that rstd waits on.
    normed = (h.to(tl.float32) * rstd).to(dtype)
    return (weight.to(tl.float32) * normed.to(tl.float32)).to(dtype)


@triton.jit
def add_rms_norm(x_ptr, delta_ptr, weight_ptr, h_ptr, out_ptr, D, eps,
                 x_stride, delta_stride, h_stride, out_stride,
                 HAS_DELTA: tl.constexpr, BLOCK_D: tl.constexpr,
                 USE_PDL: tl.constexpr = False):
    # Program t: h[t] = x[t] + delta[t] (rounded); out[t] = weight * rms_norm(h[t]).
    wait_for_prior(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)  # [BD]
    d_in = d < D
    h = _residual_sum(x_ptr, delta_ptr, t, x_stride, delta_stride, d, d_in, HAS_DELTA)
    weight = tl.load(weight_ptr + d, mask=d_in, other=0.0)  # with the row's loads
    if HAS_DELTA:
        tl.store(h_ptr + t * h_stride + d, h, mask=d_in)
    out = _normed(h, _rstd(h, D, eps), weight, out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * out_stride + d, out, mask=d_in)


@triton.jit
def qk_norm_rope(qkv_ptr, weight_ptr, cos_ptr, sin_ptr, out_ptr, positions_ptr, k_cells_ptr,
                 v_cells_ptr, H, G, eps, qkv_stride, cos_stride, sin_stride, out_stride,
                 cells_stride, NORM: tl.constexpr, WRITE: tl.constexpr,
                 HEAD_DIM: tl.constexpr, BLOCK_P: tl.constexpr,
                 USE_PDL: tl.constexpr = False):
    # Program (t, part): part 0 the H query heads, part 1 the G key heads of token t, read as
    # [P, Dh/2] first and second halves. NORM 0: none; 1 ("full"): over the part's P*Dh
    # values; 2 ("head"): over each head's Dh. Then the weight, then the rotation by
    # cos [T, Dh] and the folded sin [T, Dh] (`ops.apply_rope`): out = x*cos + [x2, x1]*sin.
    # Without WRITE both parts go to out [T, H+G, Dh]; with it q goes to out [T, H, Dh], and
    # k, and v (copied from after k in qkv), to their cells at row positions[t].
    wait_for_prior(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    first_head = part * H
    n_heads = H + part * (G - H)  # H or G
    half: tl.constexpr = HEAD_DIM // 2
    p = tl.arange(0, BLOCK_P)[:, None]  # [BP, 1]
    c = tl.arange(0, half)[None, :]  # [1, Dh/2]
    p_in = p < n_heads
    local = p * HEAD_DIM + c  # [BP, Dh/2]: the first halves' columns within the part
    offsets = first_head * HEAD_DIM + local  # within the row
    dtype = out_ptr.dtype.element_ty
    # The tables and the weights loaded with the heads (none waits on another): one trip to
    # memory before the norm's reduction, not one after it and another after the weights.
    x1, x2 = halves(qkv_ptr + t * qkv_stride, offsets, p_in, half)
    cos, sin1, sin2 = rope_rows(cos_ptr + t * cos_stride, sin_ptr + t * sin_stride, c, half)
    if NORM != 0:
        w1, w2 = halves(weight_ptr, offsets, p_in, half)
        x1, x2 = weigh_halves(x1, x2, rstd_heads(x1, x2, n_heads, eps, NORM, HEAD_DIM), w1, w2,
                              dtype)
    out1, out2 = rotate_halves(x1, x2, cos, sin1, sin2, dtype)
    if WRITE:
        if part == 0:
            tl.store(out_ptr + t * out_stride + local, out1, mask=p_in)
            tl.store(out_ptr + t * out_stride + local + half, out2, mask=p_in)
        else:
            cell = tl.load(positions_ptr + t).to(tl.int64) * cells_stride
            tl.store(k_cells_ptr + cell + local, out1, mask=p_in)
            tl.store(k_cells_ptr + cell + local + half, out2, mask=p_in)
            v = qkv_ptr + t * qkv_stride + offsets + G * HEAD_DIM  # v's heads follow k's
            tl.store(v_cells_ptr + cell + local, tl.load(v, mask=p_in), mask=p_in)
            tl.store(v_cells_ptr + cell + local + half, tl.load(v + half, mask=p_in),
                     mask=p_in)
    else:
        tl.store(out_ptr + t * out_stride + offsets, out1, mask=p_in)
        tl.store(out_ptr + t * out_stride + offsets + half, out2, mask=p_in)


# halves, rope_rows, rstd_heads, weigh_halves and rotate_halves are `qk_norm_rope`'s steps,
# shared with `_attention_triton.rotate_attend_short` so that the two write the same k bytes.
# The loads are steps of their own, so that a kernel issues them together, early.
@triton.jit
def halves(base_ptr, offsets, rows_in, half):
    # The first and second halves of heads at offsets [BP, Dh/2] from base_ptr (0 where not
    # rows_in), as stored.
    return (tl.load(base_ptr + offsets, mask=rows_in, other=0.0),
            tl.load(base_ptr + offsets + half, mask=rows_in, other=0.0))


@triton.jit
def rope_rows(cos_row, sin_row, c, half):
    # A token's rotary rows at columns c [1, Dh/2] in float32: cos (both halves' alike), the
    # folded sin's first half (-sin) and second (sin).
    return (tl.load(cos_row + c).to(tl.float32), tl.load(sin_row + c).to(tl.float32),
            tl.load(sin_row + c + half).to(tl.float32))


@triton.jit
def rstd_heads(x1, x2, n_heads, eps, NORM: tl.constexpr, HEAD_DIM: tl.constexpr):
    # The norm's 1 / sqrt(mean + eps) of heads held as halves x1, x2 [BP, Dh/2] (0 past the
    # heads), in float32: NORM 1 ("full") over all n_heads * Dh values (a scalar), 2 ("head")
    # over each head's Dh ([BP, 1]).
    wide1 = x1.to(tl.float32)
    wide2 = x2.to(tl.float32)
    squares = wide1 * wide1 + wide2 * wide2  # [BP, Dh/2]
    if NORM == 1:
        rstd = tl.math.rsqrt(tl.sum(tl.sum(squares, axis=1), axis=0) / (n_heads * HEAD_DIM)
                             + eps)
    else:  # one return: Triton types a function's returns alike, even in an untaken branch
        rstd = tl.math.rsqrt(tl.sum(squares, axis=1)[:, None] / HEAD_DIM + eps)  # [BP, 1]
    return rstd


@triton.jit
def weigh_halves(x1, x2, rstd, w1, w2, dtype: tl.constexpr):
    # x1, x2 normed by rstd, rounded to dtype, times their weights' halves w1, w2 (`halves`),
    # rounded again: `ops.rms_norm`'s order (the scale after the cast back).
    return ((w1.to(tl.float32) * (x1.to(tl.float32) * rstd).to(dtype).to(tl.float32)).to(dtype),
            (w2.to(tl.float32) * (x2.to(tl.float32) * rstd).to(dtype).to(tl.float32)).to(dtype))


@triton.jit
def rotate_halves(x1, x2, cos, sin1, sin2, dtype: tl.constexpr):
    # Heads' halves x1, x2 [BP, Dh/2] rotated by a token's rotary rows (`rope_rows`; `ops.
    # apply_rope`: x*cos + [x2, x1]*sin), each product and the sum rounded to dtype.
    wide1 = x1.to(tl.float32)
    wide2 = x2.to(tl.float32)
    out1 = ((wide1 * cos).to(dtype).to(tl.float32)
            + (wide2 * sin1).to(dtype).to(tl.float32)).to(dtype)
    out2 = ((wide2 * cos).to(dtype).to(tl.float32)
            + (wide1 * sin2).to(dtype).to(tl.float32)).to(dtype)
    return out1, out2


@triton.jit
def _top_k(probs, e, e_in, ids_ptr, weights_ptr, t, K, NORMALIZE: tl.constexpr,
           BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BY_RANK: tl.constexpr):
    # Token t's K largest of probs [BE] in order (equal values: the lower id first), stored as
    # ids [T, K] and weights [T, K], renormalized to sum to 1 when NORMALIZE. BY_RANK: each
    # expert's place counted at once (the experts before it: larger, or equal and of a lower
    # id), the first K stored at their places, two reductions; else K rounds of taking the
    # largest left, two reductions a round. The same ids and probabilities; the renormalizing
    # sum adds the same K values in another order.
    probs = tl.where(e_in, probs, -1.0)  # below every probability: never chosen
    if BY_RANK:
        before = (probs[None, :] > probs[:, None]) | (
            (probs[None, :] == probs[:, None]) & (e[None, :] < e[:, None]))  # [BE, BE]
        rank = tl.sum(before.to(tl.int32), axis=1)  # [BE]
        chosen = rank < K
        if NORMALIZE:
            probs = probs / tl.sum(tl.where(chosen, probs, 0.0), axis=0)
        tl.store(ids_ptr + t * K + rank, e.to(tl.int64), mask=chosen)
        tl.store(weights_ptr + t * K + rank, probs, mask=chosen)
    else:
        slot = tl.arange(0, BLOCK_K)
        ids = tl.zeros([BLOCK_K], dtype=tl.int64)
        weights = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k in range(0, K):
            best = tl.max(probs, axis=0)
            best_id = tl.min(tl.where(probs == best, e, BLOCK_E), axis=0)
            ids = tl.where(slot == k, best_id.to(tl.int64), ids)
            weights = tl.where(slot == k, best, weights)
            probs = tl.where(e == best_id, -1.0, probs)
        if NORMALIZE:
            weights = weights / tl.sum(weights, axis=0)
        tl.store(ids_ptr + t * K + slot, ids, mask=slot < K)
        tl.store(weights_ptr + t * K + slot, weights, mask=slot < K)


@triton.jit
def _softmax(logits):
    # Softmax of float32 logits [BE] (-inf where masked) in float32.
    shifted = tl.exp(logits - tl.max(logits, axis=0))
    return shifted / tl.sum(shifted, axis=0)


@triton.jit
def route(logits_ptr, ids_ptr, weights_ptr, E, K, logits_stride,
          NORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
          BY_RANK: tl.constexpr = True, USE_PDL: tl.constexpr = False):
    # Program t: softmax over token t's E logits in float32, then its top K (`_top_k`).
    wait_for_prior(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    e_in = e < E
    logits = tl.load(logits_ptr + t * logits_stride + e, mask=e_in,
                     other=float("-inf")).to(tl.float32)
    _top_k(_softmax(logits), e, e_in, ids_ptr, weights_ptr, t, K, NORMALIZE, BLOCK_E, BLOCK_K,
           BY_RANK)


@triton.jit
def _split_columns(split, b, BLOCKS_PER_SPLIT, D, BLOCK_D: tl.constexpr):
    # Block b of split `split`'s columns [BD] of a row of D, and which of them lie in it.
    col = (split * BLOCKS_PER_SPLIT + b) * BLOCK_D + tl.arange(0, BLOCK_D)
    return col, col < D


@triton.jit
def _router_block(w_ptr, w_stride, x, e, e_in, col, col_in):
    # The router's product over one block of columns col [BD] for every expert e [BE]:
    # sum over col of w[e, col] * x[col] in float32 -> [BE]. x [BD] float32, 0 where not
    # col_in.
    w = tl.load(w_ptr + e[:, None].to(tl.int64) * w_stride + col[None, :],
                mask=e_in[:, None] & col_in[None, :], other=0.0)  # [BE, BD]
    return tl.sum(w.to(tl.float32) * x[None, :], axis=1)


@triton.jit
def _route_split(acc, partial_ptr, arrived_ptr, ids_ptr, weights_ptr, t, split, e, e_in, K,
                 dtype: tl.constexpr, NORMALIZE: tl.constexpr, SPLITS: tl.constexpr,
                 BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BY_RANK: tl.constexpr):
    # Program (t, split)'s part acc [BE] of token t's router product, stored to partial
    # [T, SPLITS, BE] in float32. The program then counts itself in arrived[t]; the last to
    # arrive (acquiring the others' partials) sums the SPLITS partials in split order (the
    # same order whichever program is last: the same bytes), rounds the logits to dtype where
    # `F.linear` rounds them, routes them as `route` does, and sets arrived[t] back to 0 for
    # the next launch.
    tl.store(partial_ptr + (t * SPLITS + split) * BLOCK_E + e, acc)
    if tl.atomic_add(arrived_ptr + t, 1, sem="acq_rel") == SPLITS - 1:
        s = tl.arange(0, SPLITS)
        parts = tl.load(partial_ptr + (t * SPLITS + s[:, None]) * BLOCK_E + e[None, :],
                        volatile=True)  # [SPLITS, BE]
        logits = tl.sum(parts, axis=0).to(dtype).to(tl.float32)
        logits = tl.where(e_in, logits, float("-inf"))
        _top_k(_softmax(logits), e, e_in, ids_ptr, weights_ptr, t, K, NORMALIZE, BLOCK_E,
               BLOCK_K, BY_RANK)
        tl.store(arrived_ptr + t, 0)


@triton.jit
def router_route(x_ptr, w_ptr, partial_ptr, arrived_ptr, ids_ptr, weights_ptr, D, E, K,
                 x_stride, w_stride, BLOCKS_PER_SPLIT, NORMALIZE: tl.constexpr,
                 SPLITS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
                 BLOCK_K: tl.constexpr, BY_RANK: tl.constexpr = True,
                 USE_PDL: tl.constexpr = False):
    # Program (t, s): the router's product over split s of D for token t, every expert at
    # once, then the split's part routed with the others' (`_route_split`).
    wait_for_prior(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    e = tl.arange(0, BLOCK_E)
    e_in = e < E
    acc = tl.zeros([BLOCK_E], dtype=tl.float32)
    for b in range(0, BLOCKS_PER_SPLIT):
        col, col_in = _split_columns(split, b, BLOCKS_PER_SPLIT, D, BLOCK_D)  # [BD] each
        x = tl.load(x_ptr + t * x_stride + col, mask=col_in, other=0.0).to(tl.float32)
        acc += _router_block(w_ptr, w_stride, x, e, e_in, col, col_in)
    _route_split(acc, partial_ptr, arrived_ptr, ids_ptr, weights_ptr, t, split, e, e_in, K,
                 x_ptr.dtype.element_ty, NORMALIZE, SPLITS, BLOCK_E, BLOCK_K, BY_RANK)


@triton.jit
def add_norm_router_route(x_ptr, delta_ptr, norm_w_ptr, h_ptr, normed_ptr, router_ptr,
                          partial_ptr, arrived_ptr, ids_ptr, weights_ptr, D, E, K, eps,
                          x_stride, delta_stride, h_stride, normed_stride, router_stride,
                          BLOCKS_PER_SPLIT, HAS_DELTA: tl.constexpr, NORMALIZE: tl.constexpr,
                          SPLITS: tl.constexpr, BLOCK_ROW: tl.constexpr,
                          BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
                          BLOCK_K: tl.constexpr, BY_RANK: tl.constexpr = True,
                          USE_PDL: tl.constexpr = False):
    # `add_rms_norm` then `router_route` in one launch. Program (t, s): first token t's whole
    # row h = x + delta [BLOCK_ROW] for its rstd: every program of t sums the same squares in
    # the same order (`_rstd`), so they share one rstd, `add_rms_norm`'s when launched with
    # its warps. Then split s's columns [s * BLOCKS_PER_SPLIT * BLOCK_D, ...): h there again
    # from x and delta, normed as `add_rms_norm` rounds it, both stored (h only with a delta:
    # without one h is x), and the normed values, rounded to the dtype and widened back (as
    # `router_route` reads its input), times the router; then `_route_split`. The splits own
    # disjoint columns and cover the row (SPLITS * BLOCKS_PER_SPLIT * BLOCK_D >= D), so
    # together they write h[t] and normed[t] whole. Nothing here reads those stores back (the
    # routing takes the values in registers), so they need no ordering; the kernels that read
    # them (the experts', the next layer's) are launched after this one and see its writes
    # once it has ended (as dependents too: `wait_for_prior`). Reading the split's first block
    # of the router's weights before the wait (no kernel writes them) was timed and was no
    # faster: bench/results/profile-control-h100-2026-12-06.md.
    wait_for_prior(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    e = tl.arange(0, BLOCK_E)
    e_in = e < E
    dtype = normed_ptr.dtype.element_ty
    row = tl.arange(0, BLOCK_ROW)
    rstd = _rstd(_residual_sum(x_ptr, delta_ptr, t, x_stride, delta_stride, row, row < D,
                               HAS_DELTA), D, eps)
    acc = tl.zeros([BLOCK_E], dtype=tl.float32)
    for b in range(0, BLOCKS_PER_SPLIT):
        col, col_in = _split_columns(split, b, BLOCKS_PER_SPLIT, D, BLOCK_D)  # [BD] each
        normed = _norm_block(x_ptr, delta_ptr, norm_w_ptr, h_ptr, normed_ptr, t, rstd, col,
                             col_in, x_stride, delta_stride, h_stride, normed_stride, dtype,
                             HAS_DELTA)
        acc += _router_block(router_ptr, router_stride, normed, e, e_in, col, col_in)
    _route_split(acc, partial_ptr, arrived_ptr, ids_ptr, weights_ptr, t, split, e, e_in, K,
                 dtype, NORMALIZE, SPLITS, BLOCK_E, BLOCK_K, BY_RANK)


@triton.jit
def _norm_block(x_ptr, delta_ptr, norm_w_ptr, h_ptr, normed_ptr, t, rstd, col, col_in,
                x_stride, delta_stride, h_stride, normed_stride, dtype: tl.constexpr,
                HAS_DELTA: tl.constexpr):
    # Token t's h = x + delta and its norm at columns col [BD], both stored (h only with a
    # delta: without one h is x); the norm returned widened to float32 [BD], as
    # `router_route` reads its input (rounded to dtype first).
    h = _residual_sum(x_ptr, delta_ptr, t, x_stride, delta_stride, col, col_in, HAS_DELTA)
    if HAS_DELTA:
        tl.store(h_ptr + t * h_stride + col, h, mask=col_in)
    normed = _normed(h, rstd, tl.load(norm_w_ptr + col, mask=col_in, other=0.0), dtype)
    tl.store(normed_ptr + t * normed_stride + col, normed, mask=col_in)
    return normed.to(tl.float32)


@triton.jit
def rope_and_mask(positions_ptr, inv_freq_ptr, cos_ptr, sin_ptr, mask_ptr, N, window,
                  cos_stride, sin_stride, mask_stride, HAS_WINDOW: tl.constexpr,
                  LIBDEVICE: tl.constexpr, HALF: tl.constexpr, BLOCK_N: tl.constexpr,
                  USE_PDL: tl.constexpr = False):
    # Program (t, b): cells [b*BLOCK_N, (b+1)*BLOCK_N) of token t's mask [T, N]: 0 where
    # n <= positions[t] (and n > positions[t] - window with a window), -inf elsewhere.
    # Program (t, 0) also token t's rotary rows: angles [Dh/2] = float(position) * inv_freq
    # in float32, cos [T, Dh] = [cos, cos] and the folded sin [T, Dh] = [-sin, sin], each
    # rounded to the tables' dtype before the sign (`layers.rope_cos_sin`). LIBDEVICE: CUDA's
    # sinf and cosf (range-reduced, as torch's kernels call them); the interpreter's own else.
    wait_for_prior(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    position = tl.load(positions_ptr + t)
    n = b * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    allowed = n <= position
    if HAS_WINDOW:
        allowed = allowed & (n > position - window)
    values = tl.where(allowed, 0.0, float("-inf")).to(mask_ptr.dtype.element_ty)
    tl.store(mask_ptr + t * mask_stride + n, values, mask=n < N)
    if b == 0:
        j = tl.arange(0, HALF)  # [Dh/2]
        angles = position.to(tl.float32) * tl.load(inv_freq_ptr + j)
        if LIBDEVICE:
            cos, sin = libdevice.cos(angles), libdevice.sin(angles)
        else:
            cos, sin = tl.cos(angles), tl.sin(angles)
        cos = cos.to(cos_ptr.dtype.element_ty)
        sin = sin.to(sin_ptr.dtype.element_ty)
        tl.store(cos_ptr + t * cos_stride + j, cos)
        tl.store(cos_ptr + t * cos_stride + HALF + j, cos)
        tl.store(sin_ptr + t * sin_stride + j, -sin)
        tl.store(sin_ptr + t * sin_stride + HALF + j, sin)
