"""The exponential race's pick on the device (`strata.engine.runtime.sampling`), in three
kernels over one row of logits [V]: no sort.

1. `race_blocks` (a program a block of BLOCK tokens): the block's largest scaled logit, its sum
   of exp(s - largest) (the softmax's denominator in parts), and its race winner (largest
   s + g, the lowest id on ties). It stores the race values [V]: the noise's float64 logs
   are computed once, and the later passes read them.
2. `race_before_blocks` (a program a block): every program finds the winner c from step 1's
   parts (the same bytes in each), then sums over its block the tokens *before* c in the
   candidates' order (s larger, or equal with a lower id): their mass exp(s - largest), their
   count, and their own race winner, the next candidate if c is not one.
3. `race_pick` (one program): c is a candidate when fewer than top_k tokens come before it and
   their mass is below top_p of the candidates' whole (the row's, or with top_k the first
   top_k's); then it is the pick. Otherwise the winner among the tokens before c is drawn
   next and checked the same way, over the whole row in this program (ROW_BLOCK tokens a
   step), until one is (the first token in the order always is). With top_p 0.95 a winner is
   a candidate 95% of the time or more, so the loop is the rare path.

The greedy pick has a kernel of its own, `argmax_blocks` (one launch: each block's largest
logit, the last program to arrive takes the row's), for `sampling.argmax_pick`.

With top_k, the caller passes the top_k largest logits (torch's topk: their values, which ties
do not change): tokens below the last never enter the race, and the first top_k's mass is
theirs.

Why the pick is `sampling.race_pick_torch`'s: a winner outside the candidates comes after all
of them in the order, so the largest race among the candidates is the largest among the tokens
before it. Masses are summed in block order, torch's in its own:
the two can disagree only where a token's mass before it equals top_p's share within float
rounding.

Sums and maxima are over fixed blocks in a fixed order: the same logits and keys give the same
pick, run to run. Scaling divides with IEEE rounding (`div_rn`), as torch does on the CPU, and
the noise is `sampling.gumbel_noise`'s integer hash and float64 logs: the CPU's race values.
"""

from __future__ import annotations

import triton
import triton.language as tl

from strata.engine._dependent_triton import wait_for_prior

# Tokens a program of steps 1 and 2 covers, and the fallback's step over the row (in the one
# program of step 3, with ROW_WARPS warps). Fixed, not tuned: the blocks fix the order of the
# sums, and so the bytes of a pick.
BLOCK = 1024
ROW_BLOCK = 4096
ROW_WARPS = 16

_HASH_MULTIPLIER = tl.constexpr(0x45D9F3B)  # sampling.HASH_MULTIPLIER
_TWO_POW_MINUS_23 = tl.constexpr(1.0 / (1 << 23))


@triton.jit
def _hash32(x):
    # sampling.hash32 over uint32: two multiply-xorshift rounds and a final xorshift.
    x = ((x >> 16) ^ x) * _HASH_MULTIPLIER
    x = ((x >> 16) ^ x) * _HASH_MULTIPLIER
    return (x >> 16) ^ x


@triton.jit
def _gumbel(ids, key1, key2):
    # sampling.gumbel_noise for token ids [B] (int32): float32 [B].
    h = _hash32(_hash32(ids.to(tl.uint32) ^ key1.to(tl.uint32, bitcast=True))
                ^ key2.to(tl.uint32, bitcast=True))
    uniform = ((h >> 9).to(tl.float64) + 0.5) * _TWO_POW_MINUS_23  # (0, 1), 23 bits
    return (-tl.log(-tl.log(uniform))).to(tl.float32)


@triton.jit
def _scaled(logits_ptr, ids, inside, temperature):
    # s = logits / temperature in float32, -inf outside the row.
    x = tl.load(logits_ptr + ids, mask=inside, other=float("-inf")).to(tl.float32)
    return tl.where(inside, tl.math.div_rn(x, temperature), float("-inf"))


@triton.jit
def _winner(best_ptr, id_ptr, q, q_in, V):
    # The race's winner over blocks' winners [NB]: the largest, the lowest id on ties.
    best = tl.load(best_ptr + q, mask=q_in, other=float("-inf"))
    ids = tl.load(id_ptr + q, mask=q_in, other=V)
    return tl.min(tl.where(best == tl.max(best, axis=0), ids, V), axis=0)


@triton.jit
def _before(logits_ptr, race_ptr, ids, inside, temperature, top, c, s_c, V):
    # Over a block: the tokens before candidate c in the order (s descending, id ascending):
    # their mass exp(s - top), their count, and their race's winner (value and id; -inf and V
    # when none is), from the race values race_blocks stored.
    s = _scaled(logits_ptr, ids, inside, temperature)
    before = inside & ((s > s_c) | ((s == s_c) & (ids < c)))
    mass = tl.sum(tl.where(before, tl.exp(s - top), 0.0), axis=0)
    count = tl.sum(before.to(tl.int32), axis=0)
    race = tl.where(before, tl.load(race_ptr + ids, mask=before, other=float("-inf")),
                    float("-inf"))
    best = tl.max(race, axis=0)
    best_id = tl.min(tl.where(before & (race == best), ids, V), axis=0)
    return mass, count, best, best_id


@triton.jit(do_not_specialize=["key1", "key2", "top_k"])
def race_blocks(logits_ptr, V, temperature, key1, key2, top_k, top_values_ptr, race_ptr,
                top_ptr, sum_ptr, best_ptr, id_ptr, HAS_TOP_K: tl.constexpr,
                BLOCK: tl.constexpr):
    b = tl.program_id(0)
    ids = b * BLOCK + tl.arange(0, BLOCK)
    inside = ids < V
    s = _scaled(logits_ptr, ids, inside, temperature)  # [BLOCK]
    top = tl.max(s, axis=0)
    # A block of -inf logits only: its sum is 0, and exp(-inf - top) needs a finite top.
    shift = tl.where(top == float("-inf"), 0.0, top)
    tl.store(top_ptr + b, top)
    tl.store(sum_ptr + b, tl.sum(tl.where(inside, tl.exp(s - shift), 0.0), axis=0))
    in_play = inside
    if HAS_TOP_K:  # only tokens at or above the top_k-th largest s: the others never win
        in_play = inside & (s >= _scaled(top_values_ptr, top_k - 1, True, temperature))
    race = tl.where(in_play, s + _gumbel(ids, key1, key2), float("-inf"))
    tl.store(race_ptr + ids, race, mask=inside)  # read again only by the tokens before a winner
    best = tl.max(race, axis=0)
    tl.store(best_ptr + b, best)
    tl.store(id_ptr + b, tl.min(tl.where(race == best, ids, V), axis=0))


@triton.jit
def _row_top(top_ptr, q, q_in):
    # The row's largest s from the blocks' [NB], 0 when every logit is -inf (nothing to shift).
    top = tl.max(tl.load(top_ptr + q, mask=q_in, other=float("-inf")), axis=0)
    return tl.where(top == float("-inf"), 0.0, top)


@triton.jit
def race_before_blocks(logits_ptr, race_ptr, V, temperature, top_ptr, best_ptr, id_ptr,
                       n_blocks, mass_ptr, count_ptr, next_best_ptr, next_id_ptr,
                       BLOCK: tl.constexpr, NB: tl.constexpr):
    q = tl.arange(0, NB)
    q_in = q < n_blocks
    top = _row_top(top_ptr, q, q_in)
    c = _winner(best_ptr, id_ptr, q, q_in, V)
    s_c = _scaled(logits_ptr, c, c < V, temperature)  # c is V only for a row of NaNs
    b = tl.program_id(0)
    ids = b * BLOCK + tl.arange(0, BLOCK)
    mass, count, best, best_id = _before(logits_ptr, race_ptr, ids, ids < V, temperature, top,
                                         c, s_c, V)
    tl.store(mass_ptr + b, mass)
    tl.store(count_ptr + b, count)
    tl.store(next_best_ptr + b, best)
    tl.store(next_id_ptr + b, best_id)


@triton.jit
def _is_candidate(mass, count, limit, top_k, CHECK_MASS: tl.constexpr):
    # Fewer than top_k before it (top_k 0: no limit) and, with top_p < 1, a mass before it
    # below top_p of the whole.
    ok = (top_k == 0) | (count < top_k)
    if CHECK_MASS:
        ok = ok & (mass < limit)
    return ok


@triton.jit(do_not_specialize=["top_k"])
def race_pick(logits_ptr, race_ptr, V, temperature, top_p, top_k, top_values_ptr, top_ptr,
              sum_ptr, best_ptr, id_ptr, n_blocks, mass_ptr, count_ptr, next_best_ptr,
              next_id_ptr, out_ptr, HAS_TOP_K: tl.constexpr, CHECK_MASS: tl.constexpr,
              BLOCK: tl.constexpr, ROW_BLOCK: tl.constexpr, NB: tl.constexpr):
    q = tl.arange(0, NB)
    q_in = q < n_blocks
    top = _row_top(top_ptr, q, q_in)
    tops = tl.load(top_ptr + q, mask=q_in, other=float("-inf"))
    sums = tl.load(sum_ptr + q, mask=q_in, other=0.0)
    shifts = tl.where(tops == float("-inf"), 0.0, tops)  # as race_blocks shifted them
    whole = tl.sum(tl.where(q_in, sums * tl.exp(shifts - top), 0.0), axis=0)
    if HAS_TOP_K and CHECK_MASS:  # the first top_k's mass: their values, as torch's topk has them
        whole = 0.0
        for start in range(0, top_k, BLOCK):
            k = start + tl.arange(0, BLOCK)
            s_k = _scaled(top_values_ptr, k, k < top_k, temperature)
            whole += tl.sum(tl.where(k < top_k, tl.exp(s_k - top), 0.0), axis=0)
    limit = top_p * whole
    c = _winner(best_ptr, id_ptr, q, q_in, V)
    mass = tl.sum(tl.load(mass_ptr + q, mask=q_in, other=0.0), axis=0)
    count = tl.sum(tl.load(count_ptr + q, mask=q_in, other=0), axis=0)
    nxt = _winner(next_best_ptr, next_id_ptr, q, q_in, V)
    # No token before c (nxt is V: only with NaN logits, which order nothing): c stands. Each
    # pass otherwise leaves fewer tokens in play, so the loop ends.
    found = _is_candidate(mass, count, limit, top_k, CHECK_MASS) | (nxt >= V)
    while not found:  # the rare path: c is not a candidate; check the winner before it
        c = nxt
        nxt = tl.zeros_like(nxt) + V  # none yet
        s_c = _scaled(logits_ptr, c, True, temperature)
        mass = 0.0
        count = 0
        best = float("-inf")
        for start in range(0, V, ROW_BLOCK):
            ids = start + tl.arange(0, ROW_BLOCK)
            b_mass, b_count, b_best, b_id = _before(logits_ptr, race_ptr, ids, ids < V,
                                                    temperature, top, c, s_c, V)
            mass += b_mass
            count += b_count
            nxt = tl.where(b_best > best, b_id, nxt)  # strictly: the lower block wins ties
            best = tl.maximum(best, b_best)
        found = _is_candidate(mass, count, limit, top_k, CHECK_MASS) | (nxt >= V)
    tl.store(out_ptr, tl.minimum(c, V - 1).to(tl.int64))  # in the row, whatever the logits


@triton.jit
def argmax_blocks(logits_ptr, V, best_ptr, best_id_ptr, nan_id_ptr, arrived_ptr, out_ptr,
                  n_blocks, BLOCK: tl.constexpr, NB: tl.constexpr,
                  USE_PDL: tl.constexpr = False):
    # The greedy pick, torch.argmax's token, in one launch (`sampling.argmax_pick`). Program p,
    # over tokens [p * BLOCK, (p + 1) * BLOCK): its largest logit, the lowest id holding it and
    # the lowest id holding NaN (V where none), stored to best, best_id and nan_id [n_blocks].
    # The program then counts itself in arrived[0]; the last to arrive (acquiring the others'
    # stores) takes the lowest id holding NaN where there is one (torch counts NaN as the
    # largest), else the lowest id holding the largest logit, stores it to out [1] int64, and
    # sets arrived[0] back to 0. Minima and maxima: the same token whichever program is last.
    # As a dependent (USE_PDL) it is set up while the logits' product finishes.
    wait_for_prior(USE_PDL)
    p = tl.program_id(0)
    ids = p * BLOCK + tl.arange(0, BLOCK)
    inside = ids < V
    x = tl.load(logits_ptr + ids, mask=inside, other=float("-inf")).to(tl.float32)
    is_nan = inside & (x != x)
    x = tl.where(is_nan, float("-inf"), x)
    best = tl.max(x, axis=0)
    tl.store(best_ptr + p, best)
    tl.store(best_id_ptr + p, tl.min(tl.where(inside & (x == best), ids, V), axis=0))
    tl.store(nan_id_ptr + p, tl.min(tl.where(is_nan, ids, V), axis=0))
    if tl.atomic_add(arrived_ptr, 1, sem="acq_rel") == n_blocks - 1:
        b = tl.arange(0, NB)
        b_in = b < n_blocks
        bests = tl.load(best_ptr + b, mask=b_in, other=float("-inf"), volatile=True)
        best_ids = tl.load(best_id_ptr + b, mask=b_in, other=V, volatile=True)
        first_nan = tl.min(tl.load(nan_id_ptr + b, mask=b_in, other=V, volatile=True), axis=0)
        top = tl.max(bests, axis=0)
        token = tl.min(tl.where(b_in & (bests == top), best_ids, V), axis=0)
        tl.store(out_ptr, tl.where(first_nan < V, first_nan, token).to(tl.int64))
        tl.store(arrived_ptr, 0)
