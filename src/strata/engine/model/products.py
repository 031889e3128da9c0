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

`linear` is `F.linear` wherever that cannot happen: more than one token, float32, off CUDA or
without dependent launches (before compute capability 9.0 the kernel would only match cuBLAS),
inside `torch.compile`'s tracing, a weight row wider than MAX_K. The kernel's sum runs in
float32 in one fixed order (deterministic), not cuBLAS's order: a bf16 decode step's bytes
differ from `F.linear`'s in the last bit now and then, as a different library's would.
`PRODUCT_KERNEL` is the switch a benchmark turns off for its A/B (bench/decode_profile.py's
row "the dense products by cuBLAS"). `logits` is the last product of a decode step, the
vocabulary's, the same way where `LOGITS_KERNEL`: off, against cuBLAS, which reads a whole
logits matrix at about 94% of the H200's bandwidth (bench/decode_profile.py's row "the logits
by the kernel"); timed on an H100 it was 1.012-1.018x a round on qwen3-30b-a3b's and
mixtral-8x7b's cuts, but its logits differed from cuBLAS's by up to 1.6e-02
(bench/results/decode-shapes-short-h100-2026-12-05.md).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from strata.engine import dependent_launch

__all__ = ["LOGITS_KERNEL", "MAX_K", "PRODUCT_KERNEL", "linear", "linear_one_triton",
           "logits", "takes"]

PRODUCT_KERNEL = True
LOGITS_KERNEL = False
MAX_K = 8192  # a program holds BLOCK_N whole rows in registers: wider rows take F.linear
# The launch shape: the weight elements a program holds (BLOCK_N rows of BLOCK_K, the power of
# two at least K; one row at least) and its warps. Small tiles won inside the whole
# olmoe-1b-7b's decode round on the H200 (bench/decode_shapes.py --kernels products): 0.998 ms
# at 4,096 elements and 4 warps (2 rows a program there), 1.014 at 16,384, 1.191 at 32,768,
# cuBLAS 1.087. More programs fit on the device beside the kernel before, so more of the
# weights are read before the wait.
TILE_ELEMENTS = 4096
NUM_WARPS = 4


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
    """The vocabulary's product x [T, D] @ weight [V, D]^T -> [T, V]: `linear` where
    LOGITS_KERNEL, else `F.linear`."""
    return linear(x, weight) if LOGITS_KERNEL else F.linear(x, weight)


def _block(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def linear_one_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      *, tile_elements: int | None = None, num_warps: int | None = None
                      ) -> torch.Tensor:
    """`linear` of one token x [1, K] by the kernel (under Triton's interpreter on the CPU in
    tests), launched as a dependent where `dependent_launch.kernel_options` says so.
    `tile_elements` (a power of two) and `num_warps` override the launch shape (TILE_ELEMENTS,
    NUM_WARPS) for bench/decode_shapes.py's sweep."""
    tile_elements = TILE_ELEMENTS if tile_elements is None else tile_elements
    num_warps = NUM_WARPS if num_warps is None else num_warps
    n_out, k_in = weight.shape
    if x.dim() != 2 or x.shape != (1, k_in) or x.dtype != weight.dtype \
            or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"linear_one_triton takes one token x [1, K] and a weight [N, K] of its "
                         f"dtype, both with contiguous rows; got x {list(x.shape)} {x.dtype}, "
                         f"weight {list(weight.shape)} {weight.dtype}")
    if bias is not None and bias.shape != (n_out,):
        raise ValueError(f"bias must be [{n_out}], got {list(bias.shape)}")
    if tile_elements < 1 or tile_elements & (tile_elements - 1):
        raise ValueError(f"tile_elements must be a power of two, got {tile_elements}")
    block_k = _block(k_in)
    block_n = max(1, tile_elements // block_k)
    out = x.new_empty((1, n_out))  # [1, N]
    if n_out:
        _kernels().product_one[(-(-n_out // block_n),)](
            weight, x, bias if bias is not None else weight, out, n_out, k_in,
            weight.stride(0), HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k,
            num_warps=num_warps,
            **dependent_launch.kernel_options(x.device))
    return out
