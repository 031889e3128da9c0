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
(bench/results/one-kernel-ahead-h100-2026-12-06.md; the code is in abb1e9e).

Staged, off: `L2_KEPT`, the weights whose loads the products' kernels leave unmarked, so that
they stay in L2 from one round to the next. With every other weight load marked, a weight
read plainly was still in L2 after 100 and 200 MiB of marked reads, and one-token products
read a 24 MiB weight 1.40x as fast from there, an 8 MiB one 1.16x (bench/results/
l2-keep-h100-2026-12-06.md); a 48 MiB one did not fit. A round reads the same dense weights
every time, so the first layers' q/k/v and output weights, up to a budget of L2, could be read
from L2 every round instead of from memory. `kept_weights` picks them; bench/decode_profile.py's
rows "+l2-keep-24" and "+l2-keep-40" set L2_KEPT for their graphs (the A/B).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["EXPERTS_EVICT_FIRST", "L2_KEPT", "PRODUCTS_EVICT_FIRST", "experts_eviction",
           "kept_weights", "products_eviction"]

EXPERTS_EVICT_FIRST = True
PRODUCTS_EVICT_FIRST = True
L2_KEPT: frozenset[int] = frozenset()  # the kept weights' data_ptr()s (`kept_weights`)


def experts_eviction() -> str:
    """The expert kernels' weight loads' `eviction_policy`: "evict_first" where
    EXPERTS_EVICT_FIRST, else "" (Triton's default)."""
    return "evict_first" if EXPERTS_EVICT_FIRST else ""


def products_eviction(weight: torch.Tensor | None = None) -> str:
    """The products' kernels' weight loads' `eviction_policy`, as `experts_eviction`: "" for
    a weight in L2_KEPT (its loads unmarked, so L2 keeps its lines over the marked ones)."""
    if weight is not None and weight.data_ptr() in L2_KEPT:
        return ""
    return "evict_first" if PRODUCTS_EVICT_FIRST else ""


def kept_weights(layers: Iterable, budget_bytes: int) -> frozenset[int]:
    """The data_ptr()s of the decoder layers' dense weights that fit `budget_bytes` together,
    taken in the order a round reads them (each layer's q/k/v, then its output product),
    passing over one that does not fit: a value for L2_KEPT."""
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
    kept, used = set(), 0
    for layer in layers:
        for weight in (layer.attn.wqkv, layer.attn.wo):
            size = weight.numel() * weight.element_size()
            if used + size <= budget_bytes:
                kept.add(weight.data_ptr())
                used += size
    return frozenset(kept)
