"""A decode step's dense products (attention's q/k/v and output) as a kernel that reads its
weights before the kernel before it has finished.

Dimension letters: T tokens, N output features, K input features.

One token's product reads its weight once and does two flops a weight: its time is the
weight's bytes at the memory's rate, plus whatever delays the read. cuBLAS's kernels, launched
plainly, start reading only once the kernel before them has finished, and a one-token kernel
of our own launched as a dependent that waits first (`dependent_launch`'s rule) was within
noise of them inside the decode round (bench/results/decode-linear-h200-2026-12-02.md,
decode-fusions-h200-2026-12-02.md). Weights are the one input no kernel of a round writes, so
`product_one` loads its rows *before* its wait: as a dependent it is set up while the kernel
before it runs (attention before the output's product, the norm before q/k/v's), its first
programs read their weights beside it, and only the token, that kernel's output, waits.

A decode layer's first product, q/k/v's, takes the token's norm: `add_norm_linear` sums the
residual and norms it (`ops.add_rms_norm`) inside the product's kernel where `linear` would
run the kernel (`NORM_PRODUCT_KERNEL`), one launch a layer fewer. Every program norms the
whole row itself (a few KiB from the cache, beside the weight rows it reads), as
`add_norm_router_route`'s programs do, so the norm needs no second kernel; the bytes are the
two kernels' when both run at the norm's warps (tests/engine/test_products.py). Its last
product, the output's, takes the residual sum, the MoE's norm and its routing after it:
`linear_add_norm_route` (`PRODUCT_ROUTE_KERNEL`), each program its rows' part of every
expert's logit, the last to arrive the norm and the routing (docs/reference/engine-model.md).

`linear` is `F.linear` wherever that cannot happen: more than one token, float32, off CUDA or
without dependent launches (before compute capability 9.0 the kernel would only match cuBLAS),
inside `torch.compile`'s tracing, a weight row wider than MAX_K. The kernel's sum runs in
float32 in one fixed order (deterministic), not cuBLAS's order: a bf16 decode step's bytes
differ from `F.linear`'s in the last bit now and then, as a different library's would.
`PRODUCT_KERNEL` is the switch a benchmark turns off for its A/B (bench/decode_profile.py's
row "the dense products by cuBLAS"). `logits` is the last product of a decode step, the
vocabulary's, the same way where `LOGITS_KERNEL` (on): cuBLAS reads a whole logits matrix at
about 94% of the bandwidth, and the kernel reads it beside the final norm. On an H100 the
kernel's round was 1.011x (its quartiles 1.001-1.016) cuBLAS's on the whole olmoe-1b-7b and
1.021x in another way of timing it, 1.012-1.018x on qwen3-30b-a3b's and mixtral-8x7b's cuts
(bench/results/profile-control-h100-2026-12-06.md, decode-shapes-short-h100-2026-12-05.md).
Like the other products, its logits differ from cuBLAS's in the last bit of bf16 now and then
(up to 1.6e-02 of a logit there), the same run to run. bench/decode_profile.py's row "the
logits by cuBLAS" is the A/B.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from strata.engine import cache_hints, dependent_launch
from strata.engine.model import routing_ops
from strata.engine.model.op_kernels import NORM_WARPS
from strata.engine.model.op_kernels import block as _block
from strata.engine.model.ops import MAX_KERNEL_WIDTH, add_norm_router_route, add_rms_norm
from strata.engine.model.routing_ops import arrival_counts

__all__ = ["LOGITS_KERNEL", "MAX_K", "NORM_PRODUCT_KERNEL", "PRODUCT_KERNEL",
           "PRODUCT_ROUTE_KERNEL", "add_norm_linear", "add_norm_linear_triton", "linear",
           "linear_add_norm_route", "linear_add_norm_route_triton", "linear_one_triton",
           "logits", "takes"]

PRODUCT_KERNEL = True
LOGITS_KERNEL = True
MAX_K = 8192  # a program holds BLOCK_N whole rows in registers: wider rows take F.linear
# The launch shape: the weight elements a program holds (BLOCK_N rows of BLOCK_K, the power of
# two at least K; one row at least) and its warps. Small tiles won inside the whole
# olmoe-1b-7b's decode round on the H200 (bench/decode_shapes.py --kernels products): 0.998 ms
# at 4,096 elements and 4 warps (2 rows a program there), 1.014 at 16,384, 1.191 at 32,768,
# cuBLAS 1.087. More programs fit on the device beside the kernel before, so more of the
# weights are read before the wait.
TILE_ELEMENTS = 4096
NUM_WARPS = 4
# `add_norm_linear`'s kernel on or off (off: `ops.add_rms_norm`, then `linear`), and its
# weight elements a program. Its warps are the norm's (`op_kernels.NORM_WARPS`), so that its
# norm is `add_rms_norm`'s to the bit. Inside the decode round on the H200 16,384 was the
# fastest tile on olmoe-1b-7b and qwen3-30b-a3b and within 0.2% on mixtral-8x7b; the whole
# olmoe's round 1.026x the two kernels' (bench/results/norm-product-h200-2026-12-05.md).
NORM_PRODUCT_KERNEL = True
NORM_TILE_ELEMENTS = 16384
# `linear_add_norm_route`'s kernel on or off (off: `linear`, then `ops.add_norm_router_route`),
# and its launch shape: at least ROUTE_TILE_ELEMENTS weight elements a program, and rows
# enough that the programs' parts of the logits, which its last program sums, are at most
# ROUTE_PARTS floats; a shape past MAX_ROUTE_TILE elements a program takes the two kernels.
PRODUCT_ROUTE_KERNEL = True
ROUTE_TILE_ELEMENTS = 16384
ROUTE_PARTS = 16384
MAX_ROUTE_TILE = 65536


@functools.cache
def _kernels():
    """The Triton kernel module, or None without Triton."""
    try:
        from strata.engine.model import _products_triton
    except ImportError:
        return None
    return _products_triton


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` runs the kernel for x [T, K] and weight [N, K]: PRODUCT_KERNEL, one
    token on a CUDA device that launches dependents (`dependent_launch.supported`), with
    Triton, outside a compilation, x and weight both bf16 or both fp16, contiguous rows, K up
    to MAX_K. Shapes and devices decide, never values, so a CUDA graph captures what an eager
    call runs."""
    return (PRODUCT_KERNEL and x.is_cuda and x.dim() == 2 and x.shape[0] == 1
            and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and x.stride(1) == 1 and weight.stride(1) == 1 and weight.shape[1] <= MAX_K
            and _kernels() is not None and dependent_launch.supported(x.device))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """x [T, K] @ weight [N, K]^T (+ bias [N]) -> [T, N]: `linear_one_triton` where `takes`,
    else `F.linear`."""
    if takes(x, weight):
        return linear_one_triton(x, weight, bias)
    return F.linear(x, weight, bias)


def logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The vocabulary's product x [T, D] @ weight [V, D]^T -> [T, V] float32, each rounded to
    x's dtype first, as `F.linear(x, weight).float()`. Where LOGITS_KERNEL and `takes` (one
    token), by `linear_one_triton`, which stores the float32 itself: no cast kernel after it."""
    if LOGITS_KERNEL and takes(x, weight):
        return linear_one_triton(x, weight, out_dtype=torch.float32)
    return F.linear(x, weight).float()


def _check_one_token(name: str, x: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None, tile_elements: int) -> None:
    """Raise ValueError, naming `name` and what was wrong, unless x is one token [1, K] of
    weight [N, K]'s dtype, both with contiguous rows, bias None or [N], and tile_elements a
    power of two."""
    n_out, k_in = weight.shape
    if x.dim() != 2 or x.shape != (1, k_in) or x.dtype != weight.dtype \
            or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"{name} takes one token x [1, K] and a weight [N, K] of its dtype, "
                         f"both with contiguous rows; got x {list(x.shape)} {x.dtype}, "
                         f"weight {list(weight.shape)} {weight.dtype}")
    if bias is not None and bias.shape != (n_out,):
        raise ValueError(f"bias must be [{n_out}], got {list(bias.shape)}")
    if tile_elements < 1 or tile_elements & (tile_elements - 1):
        raise ValueError(f"tile_elements must be a power of two, got {tile_elements}")


def linear_one_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      *, tile_elements: int | None = None, num_warps: int | None = None,
                      out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`linear` of one token x [1, K] by the kernel (under Triton's interpreter on the CPU in
    tests), launched as a dependent where `dependent_launch.kernel_options` says so.
    `tile_elements` (a power of two) and `num_warps` override the launch shape (TILE_ELEMENTS,
    NUM_WARPS) for bench/decode_shapes.py's sweep. `out_dtype` (default x's) is the output's:
    each value rounded to x's dtype first, then stored in it (the logits' float32)."""
    tile_elements = TILE_ELEMENTS if tile_elements is None else tile_elements
    num_warps = NUM_WARPS if num_warps is None else num_warps
    n_out, k_in = weight.shape
    _check_one_token("linear_one_triton", x, weight, bias, tile_elements)
    block_k = _block(k_in)
    block_n = max(1, tile_elements // block_k)
    out = x.new_empty((1, n_out), dtype=out_dtype)  # [1, N]
    if n_out:
        _kernels().product_one[(-(-n_out // block_n),)](
            weight, x, bias if bias is not None else weight, out, n_out, k_in,
            weight.stride(0), HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k,
            EVICT=cache_hints.products_eviction(), num_warps=num_warps,
            **dependent_launch.kernel_options(x.device))
    return out


def add_norm_linear(x: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor,
                    eps: float, weight: torch.Tensor, bias: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, linear(weight * norm(h), weight, bias)) for h = x + delta, x and delta [T, K]
    (delta None: h = x), norm_weight [K], weight [N, K]: `ops.add_rms_norm`, then `linear`,
    as one kernel where `linear` would run its kernel and NORM_PRODUCT_KERNEL is on."""
    if NORM_PRODUCT_KERNEL and takes(x, weight) and (delta is None or (
            delta.shape == x.shape and delta.dtype == x.dtype and delta.stride(1) == 1)):
        return add_norm_linear_triton(x, delta, norm_weight, eps, weight, bias)
    h, normed = add_rms_norm(x, delta, norm_weight, eps)  # [T, K] each
    return h, linear(normed, weight, bias)


def add_norm_linear_triton(x: torch.Tensor, delta: torch.Tensor | None,
                           norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                           bias: torch.Tensor | None = None, *,
                           tile_elements: int | None = None, num_warps: int | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_norm_linear` of one token x [1, K] by its kernel (under Triton's interpreter on the
    CPU in tests), launched as a dependent where `dependent_launch.kernel_options` says so.
    `tile_elements` and `num_warps` override NORM_TILE_ELEMENTS and NORM_WARPS (a test's
    comparison at other warps, a benchmark's sweep)."""
    tile_elements = NORM_TILE_ELEMENTS if tile_elements is None else tile_elements
    num_warps = NORM_WARPS if num_warps is None else num_warps
    n_out, k_in = weight.shape
    _check_one_token("add_norm_linear_triton", x, weight, bias, tile_elements)
    if delta is not None and (delta.shape != x.shape or delta.dtype != x.dtype
                              or delta.stride(1) != 1):
        raise ValueError(f"delta must be x's shape [1, {k_in}] and dtype {x.dtype} with a "
                         f"contiguous row; got {list(delta.shape)} {delta.dtype}")
    if norm_weight.shape != (k_in,) or norm_weight.stride(0) != 1:
        raise ValueError(f"norm_weight must be a contiguous [{k_in}], got "
                         f"{list(norm_weight.shape)} with strides {list(norm_weight.stride())}")
    if not n_out:  # no program would store h
        return add_rms_norm(x, delta, norm_weight, eps)[0], x.new_empty((1, 0))
    block_k = _block(k_in)
    block_n = max(1, tile_elements // block_k)
    h = x if delta is None else torch.empty_like(x)  # [1, K]
    out = x.new_empty((1, n_out))  # [1, N]
    _kernels().add_norm_product_one[(-(-n_out // block_n),)](
        x, delta if delta is not None else x, norm_weight, h, weight,
        bias if bias is not None else weight, out, n_out, k_in, eps, weight.stride(0),
        HAS_DELTA=delta is not None, HAS_BIAS=bias is not None, BLOCK_N=block_n,
        BLOCK_K=block_k, EVICT=cache_hints.products_eviction(), num_warps=num_warps,
        **dependent_launch.kernel_options(x.device))
    return h, out


def _route_shape(n_out: int, k_in: int, n_experts: int, tile_elements: int) -> int | None:
    """`linear_add_norm_route_triton`'s rows a program for a weight [N, K] and E experts, or
    None where they would hold more than MAX_ROUTE_TILE weight elements."""
    block_n = max(1, tile_elements // _block(k_in), _block(-(-n_out * _block(n_experts)
                                                              // ROUTE_PARTS)))
    return block_n if block_n * _block(k_in) <= MAX_ROUTE_TILE else None


def linear_add_norm_route(
    a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor,
    norm_weight: torch.Tensor, eps: float, router: torch.Tensor, top_k: int, normalize: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h, normed, ids, weights) for h = x + linear(a, weight, bias), a [T, K], x [T, N],
    weight [N, K]: `linear`, then `ops.add_norm_router_route` of x and that product by
    norm_weight [N] and router [E, N] (ids and weights [T, top_k], int64 and float32; K here
    is the product's input features). A decode layer's attention output product, the residual
    sum, the MoE's norm and its routing: one kernel where `linear` would run its kernel,
    PRODUCT_ROUTE_KERNEL is on and the shapes fit (`linear_add_norm_route_triton`), else the
    two as they run apart."""
    if (PRODUCT_ROUTE_KERNEL and takes(a, weight) and x.shape == (1, weight.shape[0])
            and x.dtype == a.dtype and router.dtype == a.dtype and x.stride(1) == 1
            and router.stride(1) == 1 and norm_weight.stride(0) == 1
            and weight.shape[0] <= MAX_KERNEL_WIDTH and 1 <= top_k <= router.shape[0]
            and _route_shape(*weight.shape, router.shape[0], ROUTE_TILE_ELEMENTS) is not None):
        return linear_add_norm_route_triton(a, weight, bias, x, norm_weight, eps, router,
                                            top_k, normalize)
    return add_norm_router_route(x, linear(a, weight, bias), norm_weight, eps, router, top_k,
                                 normalize)


def linear_add_norm_route_triton(
    a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor,
    norm_weight: torch.Tensor, eps: float, router: torch.Tensor, top_k: int, normalize: bool,
    *, tile_elements: int | None = None, num_warps: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`linear_add_norm_route` of one token a [1, K] by its kernel (under Triton's interpreter
    on the CPU in tests), launched as a dependent where `dependent_launch.kernel_options` says
    so. h is the two kernels' to the bit; normed is `ops.add_rms_norm`'s at its warps
    (`num_warps`' default, NORM_WARPS); the router's product takes the norm before its rounding
    to the dtype, so a logit can round the other way in its last bit, and a near tie route
    another way, the same run to run. `tile_elements` (ROUTE_TILE_ELEMENTS) and `num_warps`
    override the launch shape for a benchmark's sweep."""
    tile_elements = ROUTE_TILE_ELEMENTS if tile_elements is None else tile_elements
    num_warps = NORM_WARPS if num_warps is None else num_warps
    n_out, k_in = weight.shape
    n_experts = router.shape[0]
    _check_one_token("linear_add_norm_route_triton", a, weight, bias, tile_elements)
    if x.shape != (1, n_out) or x.dtype != a.dtype or x.stride(1) != 1:
        raise ValueError(f"x must be one token [1, {n_out}] of dtype {a.dtype} with a "
                         f"contiguous row; got {list(x.shape)} {x.dtype}")
    if norm_weight.shape != (n_out,) or norm_weight.stride(0) != 1 \
            or router.shape[1:] != (n_out,) or router.dtype != a.dtype or router.stride(1) != 1:
        raise ValueError(f"linear_add_norm_route_triton needs a contiguous norm weight "
                         f"[{n_out}] and a router [E, {n_out}] of dtype {a.dtype} with "
                         f"contiguous rows, got {list(norm_weight.shape)} and "
                         f"{list(router.shape)} {router.dtype}")
    if not 1 <= top_k <= n_experts:
        raise ValueError(f"top_k must be in [1, {n_experts}], got {top_k}")
    block_n = _route_shape(n_out, k_in, n_experts, tile_elements)
    if block_n is None or not 1 <= n_out <= MAX_KERNEL_WIDTH:
        raise ValueError(f"linear_add_norm_route_triton cannot hold a weight [{n_out}, "
                         f"{k_in}] with {n_experts} experts at {tile_elements} elements a "
                         f"program (at most {MAX_ROUTE_TILE} a program, {MAX_KERNEL_WIDTH} "
                         f"outputs)")
    programs = -(-n_out // block_n)
    block_e = _block(n_experts)
    h = torch.empty_like(x)  # [1, N]
    normed = torch.empty_like(x)  # [1, N]
    ids = torch.empty((1, top_k), dtype=torch.int64, device=x.device)  # [1, top_k]
    weights = torch.empty((1, top_k), dtype=torch.float32, device=x.device)  # [1, top_k]
    partial = torch.empty((programs, block_e), dtype=torch.float32, device=x.device)
    _kernels().product_add_norm_route[(programs,)](
        weight, a, bias if bias is not None else weight, x, norm_weight, router, h, normed,
        partial, arrival_counts(x.device), ids, weights, n_out, k_in, n_experts, top_k, eps,
        weight.stride(0), router.stride(0), programs, HAS_BIAS=bias is not None,
        NORMALIZE=normalize, BLOCK_N=block_n, BLOCK_K=_block(k_in), BLOCK_ROW=_block(n_out),
        BLOCK_P=_block(programs), BLOCK_E=block_e, BLOCK_TOP_K=_block(top_k),
        BY_RANK=routing_ops.TOP_K_BY_RANK, EVICT=cache_hints.products_eviction(),
        num_warps=num_warps, **dependent_launch.kernel_options(x.device))
    return h, normed, ids, weights
