"""Asking the next decode layer's q/k/v weight into the GPU's L2 cache before its product.

A one-token decode layer reads its dense weights and its routed experts once each, at the
device's bandwidth, with kernels between them that barely use the memory bus: the short
window's attention and the router, a few microseconds each. The L2 cache (50 MiB on the H100
and the H200) could hold the next layer's q/k/v weight (24 MiB at olmoe-1b-7b's shape) if
something asked for its lines in those idle microseconds and the expert reads that follow did
not push them out. On an H100 a weight read before 100 to 200 MiB of other reads marked
`evict_first` was still in L2 after them, and the product kernel read it 1.40x as fast as from
memory (bench/l2_keep.py, bench/results/l2-keep-h100-2026-12-06.md). Three switches, read at
each launch (bench/decode_shapes.py's `l2` variants set them):

- `AHEAD`: which kernel of a one-token decode layer asks the next layer's q/k/v weight into
  L2, each of its programs a share of the lines, right after its dependent-launch wait
  ("attention": `decode_attention.rotate_attend`'s kernel; "router":
  `ops.add_norm_router_route`'s; "": none), marked to be evicted last. `AHEAD_METHOD` says
  how: "bulk", one `cp.async.bulk.prefetch.L2` of each BULK_BYTES (the SM's asynchronous copy
  unit fetches them; compute capability 9.0 and later), or "lines" and "sectors", one
  `prefetch.global.L2` a 128-byte line or 32-byte sector.
- `EXPERTS_EVICT_FIRST`: the decode experts' kernels (`grouped`'s `gate_up_act` and
  `down_sum`) read their weights marked evict_first, so they leave L2 before the lines asked
  for.
- `PRODUCTS_EVICT_FIRST`: the one-token products' kernels (`products`) likewise for their
  weights, which a round reads once.

The bytes never change with them: only where the weights are read from does. A prefetch is
an instruction of the CUDA backend, so nothing is asked for off CUDA (Triton's interpreter on
the CPU runs the kernels without it).
"""

from __future__ import annotations

import torch

__all__ = ["AHEAD", "AHEAD_KERNELS", "AHEAD_METHOD", "CHUNK_BYTES", "EXPERTS_EVICT_FIRST",
           "PRODUCTS_EVICT_FIRST", "ahead_options", "experts_eviction", "products_eviction"]

AHEAD = ""
AHEAD_KERNELS = ("", "attention", "router")  # AHEAD's values
AHEAD_METHOD = "bulk"
# The bytes one prefetch instruction asks for, by AHEAD_METHOD: a bulk prefetch's chunk (a
# multiple of 16), an L2 line, an L2 sector.
CHUNK_BYTES = {"bulk": 16384, "lines": 128, "sectors": 32}
EXPERTS_EVICT_FIRST = False
PRODUCTS_EVICT_FIRST = False
CHUNKS_A_STEP = 256  # chunks a program asks for a step: one for each thread of 8 warps


def experts_eviction() -> str:
    """The expert kernels' weight loads' `eviction_policy`: "evict_first" where
    EXPERTS_EVICT_FIRST, else "" (Triton's default)."""
    return "evict_first" if EXPERTS_EVICT_FIRST else ""


def products_eviction() -> str:
    """The products' kernels' weight loads' `eviction_policy`, as `experts_eviction`."""
    return "evict_first" if PRODUCTS_EVICT_FIRST else ""


def ahead_options(kernel: str, weight: torch.Tensor | None, like: torch.Tensor) -> dict:
    """The arguments a launch of `kernel` ("attention" or "router") on like's device adds:
    `ahead_ptr`, `ahead_n` and the constexprs `AHEAD_CHUNK` (elements a prefetch asks for, 0:
    ask nothing), `AHEAD_STEP` and `AHEAD_BULK` (`_l2_triton.ask_into_l2`'s). They ask for
    `weight` (contiguous) where AHEAD names `kernel`, a weight is given and the launch is on
    CUDA; otherwise for nothing (like's storage is a placeholder pointer, never read).
    ValueError for an AHEAD that names no kernel or an AHEAD_METHOD that names no method."""
    if AHEAD not in AHEAD_KERNELS:
        raise ValueError(f"l2_ahead.AHEAD must be one of {AHEAD_KERNELS}, got {AHEAD!r}")
    if AHEAD_METHOD not in CHUNK_BYTES:
        raise ValueError(f"l2_ahead.AHEAD_METHOD must be one of {tuple(CHUNK_BYTES)}, got "
                         f"{AHEAD_METHOD!r}")
    bulk = AHEAD_METHOD == "bulk"
    if kernel != AHEAD or weight is None or like.device.type != "cuda":
        return {"ahead_ptr": like, "ahead_n": 0, "AHEAD_CHUNK": 0, "AHEAD_STEP": CHUNKS_A_STEP,
                "AHEAD_BULK": bulk}
    if not weight.is_contiguous() or weight.device != like.device:
        raise ValueError(f"the weight asked into L2 must be contiguous on {like.device}, got "
                         f"{list(weight.shape)} strides {list(weight.stride())} on "
                         f"{weight.device}")
    return {"ahead_ptr": weight, "ahead_n": weight.numel(),
            "AHEAD_CHUNK": CHUNK_BYTES[AHEAD_METHOD] // weight.element_size(),
            "AHEAD_STEP": CHUNKS_A_STEP, "AHEAD_BULK": bulk}
