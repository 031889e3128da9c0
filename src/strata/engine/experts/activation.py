"""The experts' activation: act = silu(gate) * up from the gate and up products side by side.

Dimension letters: R rows, F expert width.

An expert's first product gives h [R, 2F], the gate's F columns first, then the up's. Every
experts path that computes h itself (a prompt chunk's grouped products, the per-expert loops,
the gathered decode path, the CPU's torch path) turns it into act [R, F] here:
- CUDA with Triton, in bf16 or fp16: one kernel reads h once and writes act
  (`_activation_triton.silu_and_mul`), where torch's `F.silu(gate) * up` is two kernels and
  5/3 the bytes (the silu's output written and read back). It rounds as torch does (silu to
  the dtype, then the product), with the sigmoid of the decode kernels (`silu_mul`, which
  they call too), so the decode and the prompt paths on one device round alike; against
  torch's own silu a few values (under 2% on the H200) differ by one or two steps of the
  dtype, which is why it is one device's choice, never a routed data's. On the H200 it ran
  2.3-4.0x as fast as torch's two (bench/results/prompt-experts-h200-2026-12-03.md);
- elsewhere (the CPU, float32, no Triton, and under `torch.compile`, where inductor fuses the
  two itself): torch's `F.silu(gate) * up`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from strata.engine import dependent_launch

__all__ = ["silu_and_mul", "silu_and_mul_triton"]

BLOCK_F = 1024  # columns of one row a kernel program writes: qwen3's and olmoe's F in one


@functools.cache
def _kernels():
    """The Triton kernel module, or None without Triton."""
    try:
        from strata.engine.experts import _activation_triton
    except ImportError:
        return None
    return _activation_triton


def silu_and_mul(h: torch.Tensor) -> torch.Tensor:
    """act [R, F] = silu(h[:, :F]) * h[:, F:] for h [R, 2F], contiguous, in h's dtype."""
    if (h.is_cuda and h.dtype in (torch.bfloat16, torch.float16)
            and not torch.compiler.is_compiling() and _kernels() is not None):
        return silu_and_mul_triton(h)
    f = h.shape[1] // 2
    return F.silu(h[:, :f]) * h[:, f:]


def silu_and_mul_triton(h: torch.Tensor) -> torch.Tensor:
    """`silu_and_mul` by the Triton kernel (its interpreter on the CPU, with TRITON_INTERPRET=1
    set before import, is how the tests check it without a GPU). ValueError for an odd width
    or a row that is not contiguous."""
    kernels = _kernels()
    if kernels is None:
        raise RuntimeError("silu_and_mul_triton needs Triton (pip install triton)")
    n_rows, two_f = h.shape
    if two_f % 2 or h.stride(1) != 1:
        raise ValueError(f"h must be [R, 2F] with contiguous rows, got {list(h.shape)} "
                         f"with strides {list(h.stride())}")
    f = two_f // 2
    act = h.new_empty((n_rows, f))  # [R, F]
    if n_rows and f:
        kernels.silu_and_mul[(n_rows, -(-f // BLOCK_F))](
            h, act, f, h.stride(0), act.stride(0), BLOCK_F=BLOCK_F,
            **dependent_launch.kernel_options(h.device))
    return act
