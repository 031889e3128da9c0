"""The L2 cache hints on the one-token decode kernels' weight loads.

A decode round reads every weight once, in the order of the layers: nothing it reads from a
weight is read again before the next round, after the other layers' hundreds of MiB have
passed through the GPU's L2 cache (50 MiB on the H100 and the H200). What *is* read again soon
is small: the token's hidden state and its norms, the routing, the router's and the norms'
weights, the K/V cells. Marking the weight loads `evict_first` (Triton's `eviction_policy`,
PTX's `L2::cache_hint` with an evict-first policy) lets L2 give up the weights' lines before
those. Two switches, read at each launch (bench/decode_shapes.py's `hints` variants set them):

- `EXPERTS_EVICT_FIRST`: the decode experts' kernels (`grouped`'s `gate_up_act`, `down` and
  `down_sum`) mark their weight loads.
- `PRODUCTS_EVICT_FIRST`: the one-token products' kernels (`products`) mark theirs.

Both on: inside the whole olmoe-1b-7b's decode round on an H100 the round was 1.024x as fast,
in two runs (1.018x with the experts' marks alone); qwen3-30b-a3b cut to 4 layers 1.007x,
mixtral-8x7b cut to 2 1.001x (bench/results/l2-ahead-h100-2026-12-06.md). The bytes never
change: only which lines L2 keeps does. Asking the next layer's q/k/v weight into L2 from the
kernels before it (prefetches) was slower every way tried and is not here
(bench/results/one-kernel-ahead-h100-2026-12-06.md; the code is in abb1e9e). Nor did
leaving the first layers' dense weights unmarked, so that L2 would keep them from one round
to the next (a weight read plainly stayed in L2 across 200 MiB of marked reads in
bench/l2_keep.py): with 24 and 40 MiB of them so kept, the whole olmoe-1b-7b's round was
0.995x and 0.994x on an H100 (bench/results/h100-figures-2026-12-07.md; the code is in
4993307).
"""

from __future__ import annotations

__all__ = ["EXPERTS_EVICT_FIRST", "PRODUCTS_EVICT_FIRST", "experts_eviction",
           "products_eviction"]

EXPERTS_EVICT_FIRST = True
PRODUCTS_EVICT_FIRST = True


def experts_eviction() -> str:
    """The expert kernels' weight loads' `eviction_policy`: "evict_first" where
    EXPERTS_EVICT_FIRST, else "" (Triton's default)."""
    return "evict_first" if EXPERTS_EVICT_FIRST else ""


def products_eviction() -> str:
    """The products' kernels' weight loads' `eviction_policy`, as `experts_eviction`."""
    return "evict_first" if PRODUCTS_EVICT_FIRST else ""
