"""The decode path's experts from quantized blobs: `expert_rows` for int8 and int4 slots.

Legend: S blobs in the stack (a layer's, or the cache's slots), R routed rows, D hidden size,
F expert width.

As `strata.engine.experts.grouped.expert_rows` does for bf16 blobs, `quantized_rows` computes R
routed experts over one input row each, from blobs picked by an index on the device (no host
read, static shapes), but the blobs hold one of the quantized formats of
`strata.engine.experts.quant`. Two implementations, chosen by where the tensors are:
- CUDA with Triton: kernels that read each routed blob in place, the int8 or int4 weights
  widened and scaled as they are loaded (`strata.engine.experts._quantized_triton`): a routed
  expert costs its quantized bytes, about half (int8) or a third (int4) of bf16's;
- elsewhere: the R blobs dequantized (`dequantize_blobs`, a copy in x's dtype) and two batched
  matmuls, as the bf16 gathered path.
Under `torch.compile` the kernels run as the custom operator `strata::quantized_rows`, as the
bf16 ones do (`strata.engine.experts.grouped`).
Both round the gate and up sums, silu and the product to x's dtype like the bf16 paths; the two
sum in other orders, so the device's choice is part of what the output bytes depend on.

Every holder of quantized blobs on a device calls it through its
`strata.engine.experts.blobs.BlobStack` (`--experts-dtype`).
"""

from __future__ import annotations

import functools

import torch

from strata.engine import dependent_launch
from strata.engine.experts.activation import silu_and_mul
from strata.engine.experts.quant import blob_bytes, dequantize_blobs, format_group

__all__ = ["quantized_rows", "quantized_rows_gathered", "quantized_rows_triton"]

# Measured on the H200 (bench/grouped_experts.py; bench/results/
# quantized-experts-h200-2026-12-01.md): 8 rows a program and steps of 512 took 0.58x (int8)
# and 0.62x (int4) the bf16 kernels' time on olmoe's layer call, against 0.70x and 0.78x at
# the bf16 kernels' 16 x 256; the steps are multiples of every int4 group.
ACT_BLOCK_F, ACT_BLOCK_D = 8, 512
DOWN_BLOCK_D, DOWN_BLOCK_F = 8, 512


@functools.cache
def _kernels():
    """The Triton kernels module, or None without Triton."""
    try:
        from strata.engine.experts import _quantized_triton
    except ImportError:
        return None
    return _quantized_triton


def _check(blobs: torch.Tensor, fmt: str, x_rows: torch.Tensor, expert_width: int) -> None:
    need = blob_bytes(fmt, expert_width, x_rows.shape[1])  # ValueError for a bad format
    if blobs.dtype != torch.uint8 or blobs.dim() != 2 or blobs.shape[1] < need \
            or blobs.stride(1) != 1:
        raise ValueError(f"blobs must be uint8 [S, >= {need}] (one {fmt} blob of F = "
                         f"{expert_width}, D = {x_rows.shape[1]}), bytes contiguous, got "
                         f"{blobs.dtype} {list(blobs.shape)}")


def quantized_rows(blobs: torch.Tensor, fmt: str, index: torch.Tensor, x_rows: torch.Tensor,
                   expert_width: int) -> torch.Tensor:
    """[R, D] in x_rows' dtype: row r is the expert in blob index[r] applied to x_rows[r].

    blobs uint8 [S, >= blob_bytes]: one blob of `fmt` (a quant.WEIGHT_FORMATS) a row, any
    stride from one to the next; index [R] int64 on their device; x_rows [R, D]. The Triton
    kernels on CUDA when Triton is there, the dequantizing path elsewhere (see the module)."""
    if torch.compiler.is_compiling():  # as in `grouped.expert_rows`
        if x_rows.is_cuda and _compiled["quantized_rows"] is not None:
            return _compiled["quantized_rows"](blobs, fmt, index, x_rows, expert_width)
    elif x_rows.is_cuda and _kernels() is not None:
        return quantized_rows_triton(blobs, fmt, index, x_rows, expert_width)
    return quantized_rows_gathered(blobs, fmt, index, x_rows, expert_width)


# As `grouped._compiled`: made by `define_compiled_op`.
_compiled = {"quantized_rows": None}


def define_compiled_op() -> None:
    """Make `quantized_rows_triton` the custom operator `strata::quantized_rows`, as
    `grouped.define_compiled_op` does for bf16. Idempotent; nothing without Triton."""
    if _compiled["quantized_rows"] is not None or _kernels() is None:
        return

    @torch.library.triton_op("strata::quantized_rows", mutates_args=())
    def compiled_quantized_rows(blobs: torch.Tensor, fmt: str, index: torch.Tensor,
                                x_rows: torch.Tensor, expert_width: int) -> torch.Tensor:
        return quantized_rows_triton(blobs, fmt, index, x_rows, expert_width,
                                     launch=torch.library.wrap_triton)

    _compiled["quantized_rows"] = compiled_quantized_rows


def quantized_rows_gathered(blobs: torch.Tensor, fmt: str, index: torch.Tensor,
                            x_rows: torch.Tensor, expert_width: int) -> torch.Tensor:
    """`quantized_rows` by dequantizing the R blobs and two batched matmuls."""
    _check(blobs, fmt, x_rows, expert_width)
    f = expert_width
    gate_up, down = dequantize_blobs(blobs.index_select(0, index), fmt, f, x_rows.shape[1],
                                     x_rows.dtype)  # [R, 2F, D], [R, D, F]
    h = torch.bmm(gate_up, x_rows.unsqueeze(-1)).squeeze(-1)  # [R, 2F]
    act = silu_and_mul(h)  # [R, F]
    return torch.bmm(down, act.unsqueeze(-1)).squeeze(-1)  # [R, D]


def quantized_rows_triton(blobs: torch.Tensor, fmt: str, index: torch.Tensor,
                          x_rows: torch.Tensor, expert_width: int, *,
                          act_blocks: tuple[int, int] = (ACT_BLOCK_F, ACT_BLOCK_D),
                          down_blocks: tuple[int, int] = (DOWN_BLOCK_D, DOWN_BLOCK_F),
                          launch=None) -> torch.Tensor:
    """`quantized_rows` with the Triton kernels, reading the blobs in place. Runs wherever
    Triton does (its interpreter on the CPU, with TRITON_INTERPRET=1 set before import, is how
    the tests check it without a GPU). `act_blocks` (F rows, D step) and `down_blocks` (D
    rows, F step) are the kernels' block sizes, powers of two, the steps at least the int4
    group (the benchmark tries others). `launch` wraps each kernel before its launch
    (`torch.library.wrap_triton` under the custom operator; None: launched as they are, as
    dependents where `dependent_launch` has them). RuntimeError without Triton;
    ValueError for blobs whose scales would not be 4-byte aligned (a slot stride, 3*F*D or
    the storage offset not a multiple of 4)."""
    kernels = _kernels()
    if kernels is None:
        raise RuntimeError("quantized_rows_triton needs Triton (pip install triton)")
    _check(blobs, fmt, x_rows, expert_width)
    n_rows, d = x_rows.shape
    f = expert_width
    group = format_group(fmt)
    scales_at = 3 * f * d // 2 if group else 3 * f * d  # bytes before the scales
    # The storage's own address is aligned by every allocator; its offset is known when
    # traced too (no data pointer then).
    if blobs.stride(0) % 4 or scales_at % 4 or blobs.storage_offset() % 4:
        raise ValueError(f"the kernels read a {fmt} blob's scales as float32: the slot stride "
                         f"({blobs.stride(0)}) and 3*F*D ({3 * f * d}) must keep them 4-byte "
                         f"aligned")
    if x_rows.stride(1) != 1:  # any stride between rows: 0 repeats one token's row
        x_rows = x_rows.contiguous()
    act = x_rows.new_empty((n_rows, f))  # [R, F]
    y = x_rows.new_empty((n_rows, d))  # [R, D]
    if n_rows == 0:
        return y
    (act_f, act_d), (down_d, down_f) = act_blocks, down_blocks
    act_grid = (n_rows, -(-f // act_f))
    down_grid = (n_rows, -(-d // down_d))
    common = (blobs.stride(0), scales_at, d, f)
    launch, options = dependent_launch.launch_with(launch, x_rows.device)
    if group:
        launch(kernels.int4_act)[act_grid](
            blobs, index, x_rows, act, *common, x_rows.stride(0),
            act.stride(0), GROUP=group, BLOCK_F=act_f, BLOCK_D=act_d, **options)
        launch(kernels.int4_down)[down_grid](
            blobs, index, act, y, *common, act.stride(0), y.stride(0),
            GROUP=group, BLOCK_D=down_d, BLOCK_F=down_f, **options)
    else:
        launch(kernels.int8_act)[act_grid](
            blobs, index, x_rows, act, *common, x_rows.stride(0),
            act.stride(0), BLOCK_F=act_f, BLOCK_D=act_d, **options)
        launch(kernels.int8_down)[down_grid](
            blobs, index, act, y, *common, act.stride(0), y.stride(0),
            BLOCK_D=down_d, BLOCK_F=down_f, **options)
    return y
