"""The L2 cache hints of the one-token decode kernels: their weight loads marked, and the next
layer's q/k/v weight asked into L2 ahead.

A decode round reads every weight once, in the order of the layers: nothing it reads from a
weight is read again before the next round, after the other layers' hundreds of MiB have
passed through the GPU's L2 cache (50 MiB on the H100 and the H200). What *is* read again soon
is small: the token's hidden state and its norms, the routing, the router's and the norms'
weights, the K/V cells. Marking the weight loads `evict_first` (Triton's `eviction_policy`,
PTX's `L2::cache_hint` with an evict-first cache policy) lets L2 give up the weights' lines
before those. The switches are read at each launch (bench/decode_shapes.py's `hints` and
`ahead` variants set them):

- `EXPERTS_EVICT_FIRST`: the decode experts' kernels (`grouped`'s `gate_up_act`, `down` and
  `down_sum`) mark their weight loads. On.
- `PRODUCTS_EVICT_FIRST`: the one-token products' kernels (`products`) mark theirs. On.

  Both on, the whole olmoe-1b-7b's decode round on an H100 was 1.024x as fast, in two runs
  (1.018x with the experts' marks alone); qwen3-30b-a3b cut to 4 layers 1.007x, mixtral-8x7b
  cut to 2 1.001x (bench/results/l2-ahead-h100-2026-12-06.md).

- `AHEAD`: which latency-bound kernel of a one-token layer asks the next layer's q/k/v weight
  into L2 (24 MiB at olmoe-1b-7b's shape), one `prefetch.global.L2` a line from each of its
  programs right after its dependent-launch wait: "attention" (`decode_attention`'s
  rotating short kernel), "router" (`ops.add_norm_router_route`'s kernel), "both" (the
  attention the first half of the lines, the router the second), "" none. Off: asked for
  whole by one kernel, marked evict_last (`AHEAD_EVICT_LAST`), the round was 0.92x to 0.96x
  as fast. The prefetching kernel lasts as long as a read of the weight, holding the chain
  behind it, and the product after it read only a part from L2 (1.13x, where a weight read
  into L2 whole gives 1.41x; lines marked evict_last may be held to the persisting part of
  L2, empty by default). Half the weight from each kernel, unmarked, is staged for the
  GPU machine: bench/l2_keep.py times unmarked prefetches first.

The bytes never change with any of them: only where a weight is read from does. A prefetch is
an instruction of the CUDA backend, so nothing is asked for off CUDA (Triton's interpreter on
the CPU runs the kernels without it).
"""

from __future__ import annotations

import torch

__all__ = ["AHEAD", "AHEAD_EVICT_LAST", "AHEAD_KERNELS", "EXPERTS_EVICT_FIRST", "LINES_A_STEP",
           "LINE_BYTES", "PRODUCTS_EVICT_FIRST", "ahead_options", "experts_eviction",
           "products_eviction"]

EXPERTS_EVICT_FIRST = True
PRODUCTS_EVICT_FIRST = True
AHEAD = ""
AHEAD_KERNELS = ("", "attention", "router", "both")  # AHEAD's values
AHEAD_EVICT_LAST = False
LINE_BYTES = 128  # an L2 cache line: one prefetch each
LINES_A_STEP = 256  # lines a program asks for a step: one for each thread of 8 warps


def experts_eviction() -> str:
    """The expert kernels' weight loads' `eviction_policy`: "evict_first" where
    EXPERTS_EVICT_FIRST, else "" (Triton's default)."""
    return "evict_first" if EXPERTS_EVICT_FIRST else ""


def products_eviction() -> str:
    """The products' kernels' weight loads' `eviction_policy`, as `experts_eviction`."""
    return "evict_first" if PRODUCTS_EVICT_FIRST else ""


def ahead_options(kernel: str, weight: torch.Tensor | None, like: torch.Tensor) -> dict:
    """The arguments a launch of `kernel` ("attention" or "router") on like's device adds:
    `ahead_ptr`, `ahead_n` and the constexprs `AHEAD_LINE` (elements a cache line; 0: ask
    for nothing), `AHEAD_STEP` and `AHEAD_LAST` (`_cache_hints_triton.ask_into_l2`'s). They
    ask for `weight` (contiguous), or under "both" the kernel's half of it, where AHEAD
    names the kernel or "both", a weight is given and the launch is on CUDA; otherwise for
    nothing (like is a placeholder pointer, never read). ValueError for an AHEAD that names
    no kernel, or a weight that is not contiguous on like's device."""
    if AHEAD not in AHEAD_KERNELS:
        raise ValueError(f"cache_hints.AHEAD must be one of {AHEAD_KERNELS}, got {AHEAD!r}")
    options = {"ahead_ptr": like, "ahead_n": 0, "AHEAD_LINE": 0, "AHEAD_STEP": LINES_A_STEP,
               "AHEAD_LAST": AHEAD_EVICT_LAST}
    if AHEAD not in (kernel, "both") or weight is None or like.device.type != "cuda":
        return options
    if not weight.is_contiguous() or weight.device != like.device:
        raise ValueError(f"the weight asked into L2 must be contiguous on {like.device}, got "
                         f"{list(weight.shape)} strides {list(weight.stride())} on "
                         f"{weight.device}")
    flat = weight.view(-1)
    if AHEAD == "both":  # the first half's lines from the attention, the rest from the router
        half = flat.numel() // 2
        flat = flat[:half] if kernel == "attention" else flat[half:]
    return {**options, "ahead_ptr": flat, "ahead_n": flat.numel(),
            "AHEAD_LINE": LINE_BYTES // weight.element_size()}
