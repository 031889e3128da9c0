"""A decode step's dense products (q/k/v, output) as one Triton kernel: staged, off by default.

`linear(x, weight, bias)` is `F.linear` everywhere but where `LINEAR_KERNEL` is set, on CUDA,
for one token in bf16 or fp16: there `linear_triton`, a matrix-vector kernel launched as a
dependent of the kernel before it (`strata.engine.dependent_launch`), so that a layer's
attention half is one chain of dependent launches instead of being broken by cuBLAS's two
plain ones. Tried once without dependent launches, it lost to cuBLAS inside the decode graph
(bench/results/decode-linear-h200-2026-12-02.md); bench/decode_shapes.py times it in the
round again, with them, over launch shapes, against cuBLAS.

Legend: T tokens, K input features, N output features.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from strata.engine import dependent_launch

__all__ = ["linear", "linear_triton"]

# Whether `linear` takes its kernel on CUDA: off until measured inside the decode round.
LINEAR_KERNEL = False
# Its launch shape: rows of the weight a program, columns a step, warps, pipeline depth.
LINEAR_BLOCK_N, LINEAR_BLOCK_K, LINEAR_WARPS, LINEAR_STAGES = 16, 256, 4, 3


@functools.cache
def _kernels():
    """The Triton kernel module, or None without Triton."""
    try:
        from strata.engine.model import _linear_triton
    except ImportError:
        return None
    return _linear_triton


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """`F.linear(x, weight, bias)`: x [T, K] @ weight [N, K]^T (+ bias [N]) -> [T, N].

    With `LINEAR_KERNEL`, on CUDA outside a compilation, for one token in bf16 or fp16 with
    contiguous rows: `linear_triton`. It sums in float32 and rounds once, as cuBLAS does, in
    its own order: the last bit may differ from `F.linear`'s."""
    if (LINEAR_KERNEL and x.is_cuda and not torch.compiler.is_compiling()
            and _kernels() is not None and _takes(x, weight, bias)):
        return linear_triton(x, weight, bias)
    return F.linear(x, weight, bias)


def _takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (x.dim() == 2 and x.shape[0] == 1 and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and weight.dim() == 2 and weight.stride(1) == 1
            and x.stride(1) == 1 and (bias is None or bias.is_contiguous()))


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """`linear` of one token x [1, K] by the Triton kernel at the module's launch shape (under
    Triton's interpreter on the CPU in tests): [1, N] in x's dtype."""
    n, k = weight.shape
    if x.shape != (1, k) or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"linear_triton takes one token [1, {k}] with contiguous rows and a "
                         f"weight [N, {k}] with contiguous rows, got x {list(x.shape)}, weight "
                         f"{list(weight.shape)}")
    kernels = _kernels()
    if kernels is None:
        raise RuntimeError("linear_triton needs Triton (pip install triton)")
    out = x.new_empty((1, n))  # [1, N]
    kernels.linear_one[(-(-n // LINEAR_BLOCK_N),)](
        x, weight, bias if bias is not None else x, out, n, k, weight.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=LINEAR_BLOCK_N, BLOCK_K=LINEAR_BLOCK_K,
        num_warps=LINEAR_WARPS, num_stages=LINEAR_STAGES,
        **dependent_launch.kernel_options(x.device))
    return out
