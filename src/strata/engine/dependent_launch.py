"""Programmatic dependent launch of strata's own Triton kernels, where the GPU has it.

A decode round is a few kernels a layer (five on olmoe-1b-7b since attention's output product
took the routing in; fourteen when this came), most a few microseconds long, and between two
of them the device idles: the second is only set up once the first has finished (on the H200,
plain launches left a 4-layer olmoe-1b-7b round's kernels 23% of its wall time apart). From
compute capability 9.0 a kernel launched as a *dependent* of the one before it in its stream
is set up early, its programs placed as the earlier kernel's last ones run; each program then
waits (`griddepcontrol.wait`) until the earlier kernel has finished and its writes are
visible. A CUDA graph's capture keeps the dependency as a programmatic edge, so replays
overlap the same way. Measured on the H200, same runs (bench/results/
dependent-launch-h200-2026-12-02.md): a decode round 1.04x faster on the whole olmoe-1b-7b,
1.27x on qwen3-30b-a3b cut to 4 layers, 1.03x on mixtral-8x7b cut to 2.

The rule that keeps it correct: every kernel launched this way waits first, before it reads or
writes anything (`_dependent_triton.wait_for_prior`), and only then lets its own dependents be
set up. So a kernel never reads what the one it follows writes, and since that one waited on
its own predecessor, nor what any earlier kernel writes. The exception is what no kernel of
a round writes: `products`' kernels load their weight rows before their wait (the output
product's with its rows' columns of the router and of the norm's weight), and
`decode_attention`'s short kernel the cells, reading again after its wait the one row the
round writes, so that the read overlaps the kernel before.
tests/engine/test_dependent_launch.py checks the rule in the source and, compiled for compute
capability 9.0, in the instructions. Kernels that are not
ours (cuBLAS, cuDNN, torch's) are launched plainly and wait for ours whole, as always. The
bytes do not change: only when the next kernel's work starts does.

`kernel_options(device)` is what a launch site adds to its kernel's arguments: on a CUDA
device of capability 9.0 or more with a Triton that has the launch option, the kernel's
`USE_PDL` switch and Triton's `launch_pdl`; elsewhere (older GPUs, Triton's interpreter on the
CPU, inside `torch.compile`'s tracing) nothing, and the kernels run as plain launches.
`enabled` is the process-wide switch a benchmark turns off for its A/B.

Every launch on a CUDA device also says how the kernel is compiled where Triton's default is
about to change (`compile_options`, which `kernel_options` includes): multiplies and adds
contracted into fused multiply-adds, as every figure and token so far was made. Triton 3.9
warns that its default turns to no contraction in 3.10; left to it, the kernels' float32 sums
would round differently after an upgrade (other bytes, maybe other tokens) and each run would
print the warning.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["compile_options", "enabled", "kernel_options", "launch_with", "supported"]

enabled = True  # benchmarks set it False to measure the plain launches in the same run


@functools.cache
def _triton_has_it() -> bool:
    """Whether the installed Triton has the launch option and the wait instruction."""
    try:
        import triton.language.extra.cuda as cuda_extra
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in CUDAOptions.__dataclass_fields__ and hasattr(cuda_extra, "gdc_wait")


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def supported(device: torch.device) -> bool:
    """Whether kernels on `device` can be launched as dependents: NVIDIA CUDA (not ROCm, whose
    devices torch also calls "cuda"), capability 9.0 or more, a Triton with `launch_pdl`, not
    inside `torch.compile`'s tracing (inductor launches the kernels it traces its own way)."""
    device = torch.device(device)
    if device.type != "cuda" or torch.version.hip is not None \
            or torch.compiler.is_compiling() or not _triton_has_it():
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def compile_options(device: torch.device) -> dict[str, bool]:
    """The compile options a launch of one of our kernels on `device` passes (see the module):
    {"enable_fp_fusion": True} on a CUDA device outside `torch.compile`'s tracing (whose
    launches are inductor's), else {} (Triton's interpreter has no such choice)."""
    if torch.device(device).type != "cuda" or torch.compiler.is_compiling():
        return {}
    return {"enable_fp_fusion": True}


def kernel_options(device: torch.device) -> dict[str, bool]:
    """The keyword arguments a launch of one of our kernels on `device` adds: its
    `compile_options`, and {"USE_PDL": True, "launch_pdl": True} where `supported` and
    `enabled` (without them the kernel's USE_PDL defaults to False: a plain launch)."""
    options = compile_options(device)
    if enabled and supported(device):
        options.update(USE_PDL=True, launch_pdl=True)
    return options


def launch_with(launch: Callable[[Any], Any] | None, device: torch.device
                ) -> tuple[Callable[[Any], Any], dict[str, bool]]:
    """(wrap, options) for a launch site whose caller may wrap its kernels: `launch` None, the
    kernels as they are, with `kernel_options(device)`; a wrapper (`torch.library.wrap_triton`
    under a custom operator, which takes every argument, a defaulted one too, and launches
    the kernel its own way), that wrapper with USE_PDL False."""
    if launch is None:
        return (lambda kernel: kernel), kernel_options(device)
    return launch, {"USE_PDL": False}
