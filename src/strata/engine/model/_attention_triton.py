"""The Triton kernel of `strata.engine.model.decode_attention` (imported only with Triton).

Legend: G kv heads, R query heads per kv head (H = G*R), N cells attended, S splits of the
cells, Dh head dim; BLOCK_* a power of two at least the size (BLOCK_R at least 16: `tl.dot`'s
least; BLOCK_C the cells a step, or in `attend_short` every cell).
"""

import triton
import triton.language as tl

from strata.engine._dependent_triton import wait_for_prior
from strata.engine.model._ops_triton import (
    halves,
    rope_rows,
    rotate_halves,
    rstd_heads,
    weigh_halves,
)


@triton.jit
def _online(row_max, row_sum, acc, scores, values):
    # One step of the online softmax: the running row maxima row_max [BR], sums row_sum [BR]
    # and weighted values acc [BR, BD] (float32) taking scores [BR, BC] (float32, -inf where
    # masked) and their values [BC, BD]. A row every score of which is -inf so far keeps
    # row_max = -inf, row_sum = 0, acc = 0 (the safe maximum 0 keeps exp() off -inf - -inf).
    m_new = tl.maximum(row_max, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(row_max - m_safe)
    p = tl.exp(scores - m_safe[:, None])  # [BR, BC]
    row_sum = row_sum * alpha + tl.sum(p, axis=1)
    # P rounded to the values' dtype for the product, as the fused attention kernels do.
    acc = acc * alpha[:, None] + tl.dot(p.to(values.dtype), values)
    return m_new, row_sum, acc


@triton.jit
def decode_attention(q_ptr, k_ptr, v_ptr, mask_ptr, acc_ptr, stats_ptr, arrived_ptr, out_ptr,
                     N, R, Dh, n_splits, scale, k_head_stride, k_cell_stride, v_head_stride,
                     v_cell_stride, HAS_MASK: tl.constexpr, CELLS_PER_SPLIT: tl.constexpr,
                     BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_S: tl.constexpr, MERGE_SPLITS: tl.constexpr,
                     USE_PDL: tl.constexpr = False):
    # Program (g, s): kv head g's R query heads q [R, Dh] (rows g*R .. g*R + R - 1 of
    # q [H, Dh]) over cells [s*CELLS_PER_SPLIT, (s+1)*CELLS_PER_SPLIT) of N, BLOCK_C at a
    # time: scores q.k * scale (+ mask [N]) in float32, an online softmax, its partial row
    # maxima and sums [G, S, 2, BR] and weighted values acc [G, S, BR, BD] stored. Each
    # program then counts itself in arrived[g]; the last to arrive (acquiring the others'
    # partials) merges the S partials (MERGE_SPLITS 0: `_merge_in_order`; else
    # `_merge_at_once`), stores out [H, Dh] = acc / row_sum in out's dtype, and sets
    # arrived[g] back to 0 for the next launch.
    wait_for_prior(USE_PDL)
    g = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    r = tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    r_in, d_in = r < R, d < Dh
    rd_in = r_in[:, None] & d_in[None, :]
    q = tl.load(q_ptr + (g * R + r[:, None]) * Dh + d[None, :], mask=rd_in, other=0.0)
    row_max = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for c0 in range(0, CELLS_PER_SPLIT, BLOCK_C):
        c = split * CELLS_PER_SPLIT + c0 + tl.arange(0, BLOCK_C)  # [BC]
        c_in = c < N
        cd_in = c_in[:, None] & d_in[None, :]
        k = tl.load(k_ptr + g * k_head_stride + c[:, None].to(tl.int64) * k_cell_stride
                    + d[None, :], mask=cd_in, other=0.0)  # [BC, BD]
        v = tl.load(v_ptr + g * v_head_stride + c[:, None].to(tl.int64) * v_cell_stride
                    + d[None, :], mask=cd_in, other=0.0)  # [BC, BD]
        mask_row = _mask_row(mask_ptr, c, N, HAS_MASK)  # [BC]
        scores = _masked(tl.dot(q, tl.trans(k)) * scale, mask_row, c, N, HAS_MASK)  # [BR, BC]
        row_max, row_sum, acc = _online(row_max, row_sum, acc, scores, v)
    part = g * n_splits + split
    tl.store(stats_ptr + (part * 2) * BLOCK_R + r, row_max, mask=r_in)
    tl.store(stats_ptr + (part * 2 + 1) * BLOCK_R + r, row_sum, mask=r_in)
    tl.store(acc_ptr + (part * BLOCK_R + r[:, None]) * BLOCK_D + d[None, :], acc, mask=rd_in)
    if tl.atomic_add(arrived_ptr + g, 1, sem="acq_rel") == n_splits - 1:
        if MERGE_SPLITS == 0:
            acc, row_sum = _merge_in_order(acc_ptr, stats_ptr, g, n_splits, r, r_in, d, rd_in,
                                           BLOCK_R, BLOCK_D)
        else:
            acc, row_sum = _merge_at_once(acc_ptr, stats_ptr, g, n_splits, r, r_in, d, d_in,
                                          BLOCK_R, BLOCK_D, BLOCK_S, MERGE_SPLITS)
        out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]  # a row with no cell: zeros
        tl.store(out_ptr + (g * R + r[:, None]) * Dh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=rd_in)
        tl.store(arrived_ptr + g, 0)


@triton.jit
def _merge_in_order(acc_ptr, stats_ptr, g, n_splits, r, r_in, d, rd_in, BLOCK_R: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    # Kv head g's S partial softmaxes merged one split after another, in split order ->
    # (acc [BR, BD], row sums [BR]), float32: one step a split, each waiting on its loads.
    # Loads are volatile: the other programs' stores, acquired by the atomic, not a stale
    # cached copy.
    row_max = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for s in range(0, n_splits):
        part = g * n_splits + s
        max_s = tl.load(stats_ptr + (part * 2) * BLOCK_R + r, mask=r_in, other=float("-inf"),
                        volatile=True)
        sum_s = tl.load(stats_ptr + (part * 2 + 1) * BLOCK_R + r, mask=r_in, other=0.0,
                        volatile=True)
        acc_s = tl.load(acc_ptr + (part * BLOCK_R + r[:, None]) * BLOCK_D + d[None, :],
                        mask=rd_in, other=0.0, volatile=True)
        m_new = tl.maximum(row_max, max_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha, beta = tl.exp(row_max - m_safe), tl.exp(max_s - m_safe)
        row_sum = row_sum * alpha + sum_s * beta
        acc = acc * alpha[:, None] + acc_s * beta[:, None]
        row_max = m_new
    return acc, row_sum


@triton.jit
def _merge_at_once(acc_ptr, stats_ptr, g, n_splits, r, r_in, d, d_in, BLOCK_R: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, MERGE_SPLITS: tl.constexpr):
    # The same merge as reductions: every split's row maxima and sums at once ([BS, BR]), then
    # the weighted values MERGE_SPLITS splits at a time ([MS, BR, BD]); each sum in a fixed
    # order (the same bytes whichever program merges), S / MERGE_SPLITS steps instead of S.
    s = tl.arange(0, BLOCK_S)
    sr_in = (s < n_splits)[:, None] & r_in[None, :]
    stats = stats_ptr + ((g * n_splits + s[:, None]) * 2) * BLOCK_R + r[None, :]  # [BS, BR]
    maxima = tl.load(stats, mask=sr_in, other=float("-inf"), volatile=True)
    sums = tl.load(stats + BLOCK_R, mask=sr_in, other=0.0, volatile=True)
    row_max = tl.max(maxima, axis=0)  # [BR]
    m_safe = tl.where(row_max == float("-inf"), 0.0, row_max)
    row_sum = tl.sum(tl.exp(maxima - m_safe[None, :]) * sums, axis=0)  # [BR]
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for s0 in range(0, n_splits, MERGE_SPLITS):
        sc = s0 + tl.arange(0, MERGE_SPLITS)  # [MS]
        scr_in = (sc < n_splits)[:, None] & r_in[None, :]  # [MS, BR]
        part = g * n_splits + sc[:, None]  # [MS, 1]
        # Named apart from the maxima above: Triton types a name reassigned in a loop once.
        step_maxima = tl.load(stats_ptr + (part * 2) * BLOCK_R + r[None, :], mask=scr_in,
                              other=float("-inf"), volatile=True)  # [MS, BR]
        weights = tl.exp(step_maxima - m_safe[None, :])  # [MS, BR]
        values = tl.load(acc_ptr + ((part * BLOCK_R + r[None, :]) * BLOCK_D)[:, :, None]
                         + d[None, None, :], mask=scr_in[:, :, None] & d_in[None, None, :],
                         other=0.0, volatile=True)  # [MS, BR, BD]
        acc += tl.sum(weights[:, :, None] * values, axis=0)
    return acc, row_sum


@triton.jit
def attend_short(q_ptr, k_ptr, v_ptr, mask_ptr, positions_ptr, out_ptr, N, R, Dh, scale,
                 k_head_stride, k_cell_stride, v_head_stride, v_cell_stride,
                 HAS_MASK: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_D: tl.constexpr, VALUES_FIRST: tl.constexpr,
                 USE_PDL: tl.constexpr = False):
    # Program g: kv head g's R query heads q [R, Dh] over all N cells at once (N <= BLOCK_C):
    # no split, so no partials and no merge. Before the wait it loads what no kernel of this
    # round writes but at one cell: the token's position (an input of the round) and every
    # cell's keys [BC, BD], and where VALUES_FIRST the values too (held in registers: at 256
    # cells of 128 dims, keys and values together spill). The one cell this round writes (at
    # the position: the kernel just before stores its k and v there) is read again after the
    # wait, past the L1 cache (volatile), into its row; q and the mask (this round's) are read
    # after the wait too. Scores, softmax and the product as `_online`'s one step: float32, P
    # rounded to the values' dtype.
    position = tl.load(positions_ptr).to(tl.int64)
    g = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    d = tl.arange(0, BLOCK_D)
    cd_in = (c < N)[:, None] & (d < Dh)[None, :]
    k_head = k_ptr + g * k_head_stride
    v_head = v_ptr + g * v_head_stride
    k = tl.load(k_head + c[:, None].to(tl.int64) * k_cell_stride + d[None, :], mask=cd_in,
                other=0.0)  # [BC, BD]
    if VALUES_FIRST:
        v = tl.load(v_head + c[:, None].to(tl.int64) * v_cell_stride + d[None, :], mask=cd_in,
                    other=0.0)  # [BC, BD]
    wait_for_prior(USE_PDL)
    r = tl.arange(0, BLOCK_R)
    rd_in = (r < R)[:, None] & (d < Dh)[None, :]
    q = tl.load(q_ptr + (g * R + r[:, None]) * Dh + d[None, :], mask=rd_in, other=0.0)
    mask_row = _mask_row(mask_ptr, c, N, HAS_MASK)  # [BC]
    fresh = (c == position)[:, None]  # [BC, 1]: the cell this round wrote
    k = tl.where(fresh, tl.load(k_head + position * k_cell_stride + d, mask=d < Dh, other=0.0,
                                volatile=True)[None, :], k)
    scores = _masked(tl.dot(q, tl.trans(k)) * scale, mask_row, c, N, HAS_MASK)  # [BR, BC]
    if not VALUES_FIRST:  # loaded once the keys are spent: both at once would spill
        v = tl.load(v_head + c[:, None].to(tl.int64) * v_cell_stride + d[None, :], mask=cd_in,
                    other=0.0)  # [BC, BD]
    v = tl.where(fresh, tl.load(v_head + position * v_cell_stride + d, mask=d < Dh, other=0.0,
                                volatile=True)[None, :], v)
    out = _weighted(scores, v, BLOCK_R, BLOCK_D)  # [BR, BD]
    tl.store(out_ptr + (g * R + r[:, None]) * Dh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=rd_in)


@triton.jit
def _mask_row(mask_ptr, c, N, HAS_MASK: tl.constexpr):
    # The mask [N] at cells c in float32 (0 past N, and everywhere without HAS_MASK): loaded
    # by itself, so that a kernel issues it with its other loads, not after its products.
    row = tl.zeros_like(c).to(tl.float32)
    if HAS_MASK:
        row = tl.load(mask_ptr + c, mask=c < N, other=0.0).to(tl.float32)
    return row


@triton.jit
def _masked(scores, mask_row, c, N, HAS_MASK: tl.constexpr):
    # Scores [BR, BC] over cells c with the mask's row (`_mask_row`) added (HAS_MASK) and
    # -inf past N.
    if HAS_MASK:
        scores += mask_row[None, :]
    return tl.where((c < N)[None, :], scores, float("-inf"))


@triton.jit
def _weighted(scores, values, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # The softmax of scores [BR, BC] over all cells at once (`_online`'s one step) times the
    # values [BC, BD], float32 [BR, BD]; a row with no cell attended: zeros.
    _, row_sum, acc = _online(tl.full([BLOCK_R], float("-inf"), dtype=tl.float32),
                              tl.zeros([BLOCK_R], dtype=tl.float32),
                              tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32), scores, values)
    return acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]


@triton.jit
def rotate_attend_short(qkv_ptr, norm_w_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, mask_ptr,
                        positions_ptr, out_ptr, N, H, G, R, eps, scale, k_head_stride,
                        k_cell_stride, v_head_stride, v_cell_stride, NORM: tl.constexpr,
                        HAS_MASK: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_P: tl.constexpr, HEAD_DIM: tl.constexpr,
                        VALUES_FIRST: tl.constexpr, USE_PDL: tl.constexpr = False):
    # `qk_norm_rope` writing the token's k and v, then `attend_short`, in one launch. Program
    # g: kv head g. Before the wait, as `attend_short`: the position and the cells' keys (as
    # halves [BC, Dh/2]) and maybe values; and the norm's weights of the group's heads (no
    # kernel writes them). After it, from the token's projection qkv [(H + 2G) * Dh] and
    # with the round's rotary rows, all loaded at once: kv head g's R query heads and its key
    # head, normed (NORM as `qk_norm_rope`'s: "full" over every head of the part, so each
    # program reads them all), weighted and rotated by `qk_norm_rope`'s helpers (the same
    # roundings), the key and the value stored to their cells at the position, and put in
    # those rows of the registers (no read back). Then the scores as two products over the
    # halves, and the softmax.
    position = tl.load(positions_ptr).to(tl.int64)
    g = tl.program_id(0).to(tl.int64)
    half: tl.constexpr = HEAD_DIM // 2
    c = tl.arange(0, BLOCK_C)
    j = tl.arange(0, half)
    d = tl.arange(0, HEAD_DIM)
    c_in = (c < N)[:, None]
    k_head = k_ptr + g * k_head_stride
    v_head = v_ptr + g * v_head_stride
    k_rows = k_head + c[:, None].to(tl.int64) * k_cell_stride + j[None, :]  # [BC, Dh/2]
    k1 = tl.load(k_rows, mask=c_in, other=0.0)
    k2 = tl.load(k_rows + half, mask=c_in, other=0.0)
    if VALUES_FIRST:
        v = tl.load(v_head + c[:, None].to(tl.int64) * v_cell_stride + d[None, :], mask=c_in,
                    other=0.0)  # [BC, Dh]
    r = tl.arange(0, BLOCK_R)[:, None]  # [BR, 1]
    r_in = r < R
    q_at = (g * R + r) * HEAD_DIM + j[None, :]  # [BR, Dh/2]: the group's q halves in qkv
    k_at = (H + g) * HEAD_DIM + j[None, :]  # [1, Dh/2]: its key head's
    if NORM != 0:
        q_w1, q_w2 = halves(norm_w_ptr, q_at, r_in, half)
        k_w1, k_w2 = halves(norm_w_ptr, k_at, k_at >= 0, half)
    wait_for_prior(USE_PDL)
    dtype = out_ptr.dtype.element_ty
    q1, q2 = halves(qkv_ptr, q_at, r_in, half)
    x1, x2 = halves(qkv_ptr, k_at, k_at >= 0, half)
    if NORM == 1:  # over every head of the part: all of q's, all of k's
        p = tl.arange(0, BLOCK_P)[:, None]
        every_q1, every_q2 = halves(qkv_ptr, p * HEAD_DIM + j[None, :], p < H, half)
        every_k1, every_k2 = halves(qkv_ptr, (H + p) * HEAD_DIM + j[None, :], p < G, half)
    new_v = tl.load(qkv_ptr + (H + G + g) * HEAD_DIM + d)  # [Dh]: v's heads follow k's
    cos, sin1, sin2 = rope_rows(cos_ptr, sin_ptr, j[None, :], half)
    if NORM != 0:  # without a norm the row would be held across the products: it spills
        mask_row = _mask_row(mask_ptr, c, N, HAS_MASK)  # [BC]
    if NORM == 1:
        q_rstd = rstd_heads(every_q1, every_q2, H, eps, NORM, HEAD_DIM)
        k_rstd = rstd_heads(every_k1, every_k2, G, eps, NORM, HEAD_DIM)
        q1, q2 = weigh_halves(q1, q2, q_rstd, q_w1, q_w2, dtype)
        x1, x2 = weigh_halves(x1, x2, k_rstd, k_w1, k_w2, dtype)
    if NORM == 2:  # each head over its own Dh
        q1, q2 = weigh_halves(q1, q2, rstd_heads(q1, q2, R, eps, NORM, HEAD_DIM), q_w1, q_w2,
                              dtype)
        x1, x2 = weigh_halves(x1, x2, rstd_heads(x1, x2, 1, eps, NORM, HEAD_DIM), k_w1, k_w2,
                              dtype)
    q1, q2 = rotate_halves(q1, q2, cos, sin1, sin2, dtype)
    x1, x2 = rotate_halves(x1, x2, cos, sin1, sin2, dtype)  # [1, Dh/2]
    cell = position * k_cell_stride
    tl.store(k_head + cell + j[None, :], x1)
    tl.store(k_head + cell + half + j[None, :], x2)
    tl.store(v_head + position * v_cell_stride + d, new_v)
    fresh = (c == position)[:, None]  # [BC, 1]
    k1 = tl.where(fresh, x1, k1)
    k2 = tl.where(fresh, x2, k2)
    scores = (tl.dot(q1, tl.trans(k1)) + tl.dot(q2, tl.trans(k2))) * scale  # [BR, BC]
    if NORM == 0:
        mask_row = _mask_row(mask_ptr, c, N, HAS_MASK)
    scores = _masked(scores, mask_row, c, N, HAS_MASK)
    if not VALUES_FIRST:  # loaded once the keys are spent: both at once would spill
        v = tl.load(v_head + c[:, None].to(tl.int64) * v_cell_stride + d[None, :], mask=c_in,
                    other=0.0)  # [BC, Dh]
    out = _weighted(scores, tl.where(fresh, new_v[None, :], v), BLOCK_R, HEAD_DIM)
    tl.store(out_ptr + (g * R + r) * HEAD_DIM + d[None, :], out.to(dtype), mask=r_in)
