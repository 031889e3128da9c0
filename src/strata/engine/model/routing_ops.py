"""The launches of the routing kernels (`_ops_triton`): `route_triton`, `router_route_triton`
and `add_norm_router_route_triton`, with the router kernels' launch shape and arrival counts.

Dimension letters: T tokens, D hidden size, E experts, K experts per token.

`ops.route`, `ops.router_route` and `ops.add_norm_router_route` choose between these kernels
and the torch ops (by device, never by values); `ops` exports these functions under the same
names. Each `*_triton` function here always runs its kernel: on CUDA, or under Triton's
interpreter on the CPU in tests.
"""

from __future__ import annotations

import functools

import torch

from strata.engine import dependent_launch
from strata.engine.model.op_kernels import NORM_WARPS, block, kernels

__all__ = ["ROUTER_BLOCK_D", "ROUTER_MAX_TOKENS", "ROUTER_SPLITS", "ROUTER_WARPS",
           "TOP_K_BY_RANK", "add_norm_router_route_triton", "arrival_counts", "route_triton",
           "router_route_triton"]

# `router_route`'s kernel takes calls of at most this many tokens (decode's, a prompt's last
# few); larger ones run the router's product as a matrix product, then `route`'s kernel.
ROUTER_MAX_TOKENS = 8
# Its launch shape, from bench/router_route.py's sweep on the H200 (bench/results/
# decode-ops-h200-2026-12-02.md): the product split over D into as many programs as there are
# ROUTER_BLOCK_D-column blocks, up to ROUTER_SPLITS, so that a decode step's 64-512 KB of
# router weight are read by many SMs at once; ROUTER_WARPS warps a program.
ROUTER_SPLITS = 64
ROUTER_BLOCK_D = 32
ROUTER_WARPS = 4
# How the routing kernels take a token's top K (`_ops_triton._top_k`): each expert's place
# counted at once (True), or K rounds of taking the largest left (False: the A/B).
TOP_K_BY_RANK = True


def route_triton(
    logits: torch.Tensor, top_k: int, normalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ops.route` by its Triton kernel (under Triton's interpreter on the CPU in tests); of
    equal probabilities the lower expert id comes first."""
    n_tokens, n_experts = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("route_triton needs contiguous rows")
    ids, weights = _routing(n_tokens, top_k, logits.device)
    if n_tokens:
        kernels().route[(n_tokens,)](
            logits, ids, weights, n_experts, top_k, logits.stride(0), NORMALIZE=normalize,
            BLOCK_E=block(n_experts), BLOCK_K=block(top_k), BY_RANK=TOP_K_BY_RANK,
            num_warps=1, **dependent_launch.kernel_options(logits.device))
    return ids, weights


def _routing(n_tokens: int, top_k: int,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A launch's outputs: ids [T, K] int64 and weights [T, K] float32."""
    return (torch.empty((n_tokens, top_k), dtype=torch.int64, device=device),
            torch.empty((n_tokens, top_k), dtype=torch.float32, device=device))


@functools.cache
def arrival_counts(device: torch.device) -> torch.Tensor:
    """The router kernels' count of arrived programs per token, on `device`: zeros between
    launches (a launch's last program sets them back). One per device, kept for the process: a
    CUDA graph holds its address. `router_route`'s, `add_norm_router_route`'s and
    `products.linear_add_norm_route`'s kernels share it, and the greedy pick's
    (`sampling.argmax_pick`, its first count): launches on a stream run one after the other,
    each leaving it zeroed. Made by an eager call: a graph's capture would record
    its zeroing without running it (the engine's warm-up runs every op before it
    captures)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("a router kernel's first call on a device must be eager, not "
                           "inside a CUDA graph's capture: run the step once before capturing it")
    return torch.zeros(ROUTER_MAX_TOKENS, dtype=torch.int32, device=device)


def _split_d(d: int, splits: int | None, block_d: int | None) -> tuple[int, int, int]:
    """(splits, block_d, blocks a split): the router's product split over D's blocks of
    `block_d` columns (ROUTER_BLOCK_D by default) into at most `splits` programs
    (ROUTER_SPLITS), as many as the blocks rounded up to a power of two. Together the splits
    cover D: splits * blocks a split * block_d >= D."""
    block_d = ROUTER_BLOCK_D if block_d is None else block_d  # a [BE, BD] tile of the weight
    splits = ROUTER_SPLITS if splits is None else splits
    if splits < 1 or splits & (splits - 1) or block_d < 1 or block_d & (block_d - 1):
        raise ValueError(f"splits and block_d must be powers of two, got {splits}, {block_d}")
    n_blocks = -(-d // block_d)
    splits = min(splits, block(n_blocks))
    return splits, block_d, -(-n_blocks // splits)


def _check_router(name: str, x: torch.Tensor, router: torch.Tensor) -> None:
    """A router kernel's input x [T, D] and router [E, D]: contiguous rows, at most
    ROUTER_MAX_TOKENS tokens."""
    if x.stride(1) != 1 or router.stride(1) != 1:
        raise ValueError(f"{name} needs contiguous rows")
    if x.shape[0] > ROUTER_MAX_TOKENS:
        raise ValueError(f"{name} takes at most {ROUTER_MAX_TOKENS} tokens, got {x.shape[0]}")


def router_route_triton(
    x: torch.Tensor, router: torch.Tensor, top_k: int, normalize: bool, *,
    splits: int | None = None, block_d: int | None = None, num_warps: int = ROUTER_WARPS
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ops.router_route` by its Triton kernel (under Triton's interpreter on the CPU in
    tests). `splits` (at most; default ROUTER_SPLITS), `block_d` (the columns a program reads
    at a time; default ROUTER_BLOCK_D) and `num_warps` are the kernel's launch shape, powers of
    two, for bench/router_route.py's sweep."""
    n_tokens, d = x.shape
    n_experts = router.shape[0]
    _check_router("router_route_triton", x, router)
    ids, weights = _routing(n_tokens, top_k, x.device)
    if not n_tokens:
        return ids, weights
    splits, block_d, blocks_per_split = _split_d(d, splits, block_d)
    block_e = block(n_experts)
    partial = torch.empty((n_tokens, splits, block_e), dtype=torch.float32, device=x.device)
    kernels().router_route[(n_tokens, splits)](
        x, router, partial, arrival_counts(x.device), ids, weights, d, n_experts, top_k,
        x.stride(0), router.stride(0), blocks_per_split, NORMALIZE=normalize, SPLITS=splits,
        BLOCK_D=block_d, BLOCK_E=block_e, BLOCK_K=block(top_k), BY_RANK=TOP_K_BY_RANK,
        num_warps=num_warps, **dependent_launch.kernel_options(x.device))
    return ids, weights


def add_norm_router_route_triton(
    x: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
    router: torch.Tensor, top_k: int, normalize: bool, *, splits: int | None = None,
    block_d: int | None = None, num_warps: int = NORM_WARPS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`ops.add_norm_router_route` by its one Triton kernel (under Triton's interpreter on the
    CPU in tests): (h, normed [T, D], ids [T, K] int64, weights [T, K] float32) for x, delta
    [T, D] (delta None: h is x), norm_weight [D] and router [E, D].

    h and normed are `ops.add_rms_norm_triton`'s bytes: the same rounding and, at its warps
    (`num_warps`' default, NORM_WARPS), the row's squares summed in its order. ids and weights
    are those `router_route_triton` gives for that normed at the same launch shape (`splits`,
    `block_d`, `num_warps`: its arguments); at its own default of ROUTER_WARPS the last
    program sums the splits' parts in another order, so a logit can round the other way."""
    n_tokens, d = x.shape
    n_experts = router.shape[0]
    _check_router("add_norm_router_route_triton", x, router)
    if delta is not None and (delta.shape != x.shape or delta.stride(1) != 1):
        raise ValueError(f"add_norm_router_route_triton needs delta of x's shape {list(x.shape)}"
                         f" with contiguous rows, got {list(delta.shape)}")
    if norm_weight.shape != (d,) or norm_weight.stride(0) != 1 or router.shape[1] != d:
        raise ValueError(f"add_norm_router_route_triton needs a contiguous norm weight [D = {d}]"
                         f" and a router [E, {d}], got {list(norm_weight.shape)} and "
                         f"{list(router.shape)}")
    if not 1 <= top_k <= n_experts:
        raise ValueError(f"top_k must be in [1, {n_experts}], got {top_k}")
    h = x if delta is None else torch.empty_like(x)  # [T, D]
    normed = torch.empty_like(x)  # [T, D]
    ids, weights = _routing(n_tokens, top_k, x.device)
    if not n_tokens:
        return h, normed, ids, weights
    splits, block_d, blocks_per_split = _split_d(d, splits, block_d)
    block_e = block(n_experts)
    partial = torch.empty((n_tokens, splits, block_e), dtype=torch.float32, device=x.device)
    has_delta = delta is not None
    delta = delta if has_delta else x  # not read: a placeholder pointer
    kernels().add_norm_router_route[(n_tokens, splits)](
        x, delta, norm_weight, h, normed, router, partial, arrival_counts(x.device), ids,
        weights, d, n_experts, top_k, eps, x.stride(0), delta.stride(0), h.stride(0),
        normed.stride(0), router.stride(0), blocks_per_split, HAS_DELTA=has_delta,
        NORMALIZE=normalize, SPLITS=splits, BLOCK_ROW=block(d), BLOCK_D=block_d,
        BLOCK_E=block_e, BLOCK_K=block(top_k), BY_RANK=TOP_K_BY_RANK, num_warps=num_warps,
        **dependent_launch.kernel_options(x.device))
    return h, normed, ids, weights
