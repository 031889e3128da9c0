"""One token's attention with its output projection inside the kernel: the rotation, the K/V
write, attention over a short window and wo's product as one launch (a decode step).

Dimension letters: D hidden size, H query heads, G kv heads, R = H / G query heads per kv
head, Dh head dim, N cells attended; BO rows of wo a program, BRP = R rounded up to a power of
two.

`decode_attention.rotate_attend` leaves the heads' outputs [1, H*Dh] to `products.linear`
with wo [D, H*Dh]: one more kernel a layer, which reads wo's rows before its dependent-launch
wait but can take its dot products only once attention has finished and its outputs are
visible. `rotate_attend_project` takes them where the outputs are made. Its programs are
(kv head g, block b of BO rows of wo): each attends its kv head as `rotate_attend`'s program
g does (the programs of one head each read its cells, in the device's L2 cache after the
first; only b = 0 stores the token's k and v), then multiplies its R heads' outputs, rounded
as that kernel stores them, by its tile of wo [BRP, BO, Dh], read before the wait beside
the cells. The tile's partial sums [BO] (float32) of the G kv heads are added in order of g
by the last program of block b to arrive (an atomic count, as `decode_attention`'s merge),
so the bytes do not depend on which program finishes last. They differ from
`products.linear`'s (its sum runs along all H*Dh columns in one program's order) in float32
rounding.

Off (`PROJECT_KERNEL`): a staged change, timed by bench/decode_shapes.py (`--kernels
attention`) against the kernel and the product apart.
"""

from __future__ import annotations

import functools

import torch

from strata.engine import dependent_launch
from strata.engine.model import decode_attention, ops
from strata.engine.model.kv_cells import LayerCells
from strata.engine.model.op_kernels import block

__all__ = ["MAX_PROGRAMS", "MAX_ROW_BLOCKS", "MAX_TILE_ELEMENTS", "PROJECT_KERNEL", "projects",
           "rotate_attend_project", "rotate_attend_project_triton", "row_block",
           "tile_elements"]

PROJECT_KERNEL = False
# The most programs a launch has: G kv heads times the blocks of wo's rows. A program holds
# its tile of wo and its kv head's keys in registers across the wait (compiled for sm_90 at
# 8 warps: 231 to 255 registers a thread, none spilled, at olmoe-1b-7b's shape), so one
# program an SM: 128 is one wave on the H100's and the H200's 132 SMs. A second wave would
# attend again after the first.
MAX_PROGRAMS = 128
# The most elements of wo a program holds (BRP * BO * Dh): 32,768 bf16 at 8 warps are 64
# registers a thread. Where the G kv heads' programs within MAX_PROGRAMS need a larger tile
# (wo's 8 MiB fit one wave at olmoe-1b-7b's shape; qwen3-30b-a3b's 16 and mixtral-8x7b's 32
# do not), the layer keeps the two kernels, whose product reads wo over as many programs as
# it takes.
MAX_TILE_ELEMENTS = 32768
MAX_ROW_BLOCKS = 1024  # the arrival counters kept per device


def row_block(n_rows: int, n_kv_heads: int, max_programs: int) -> int:
    """BO, the rows of wo [n_rows, H*Dh] a program multiplies: the fewest (a power of two)
    that keep G kv heads' programs within `max_programs` (at least one block a head)."""
    return block(-(-n_rows // max(1, max_programs // n_kv_heads)))


def tile_elements(n_rows: int, heads: ops.QKHeads, max_programs: int) -> int:
    """The elements of wo a program holds at that launch shape: BRP * BO * Dh."""
    per_kv = heads.n_heads // heads.n_kv_heads
    return block(per_kv) * row_block(n_rows, heads.n_kv_heads, max_programs) * heads.head_dim


def projects(qkv: torch.Tensor, heads: ops.QKHeads, cells: LayerCells, n_ctx: int,
             positions: torch.Tensor, wo: torch.Tensor, bo: torch.Tensor | None) -> bool:
    """Whether a layer's attention of one token and its output product run
    `rotate_attend_project`: PROJECT_KERNEL, `decode_attention.rotates`, wo [D, H*Dh]
    without a bias in qkv's dtype on its device with contiguous rows, and a program's tile
    within MAX_TILE_ELEMENTS at MAX_PROGRAMS. Shapes decide, never values."""
    return (PROJECT_KERNEL and bo is None and wo.dim() == 2 and wo.stride(1) == 1
            and wo.dtype == qkv.dtype and wo.device == qkv.device
            and wo.shape[1] == heads.n_heads * heads.head_dim
            and tile_elements(wo.shape[0], heads, MAX_PROGRAMS) <= MAX_TILE_ELEMENTS
            and decode_attention.rotates(qkv, heads, cells, n_ctx, positions))


@functools.cache
def _arrived(device: torch.device) -> torch.Tensor:
    """The kernel's count of arrived programs per block of rows, on `device`: zeros between
    launches (each block's last program sets its count back). One per device, kept for the
    process: a CUDA graph holds its address. Made by an eager call (the engine runs every
    step once before capturing it)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("rotate_attend_project's first call on a device must be eager, not "
                           "inside a CUDA graph's capture: run the step once before capturing "
                           "it")
    return torch.zeros(MAX_ROW_BLOCKS, dtype=torch.int32, device=device)


def rotate_attend_project(qkv: torch.Tensor, heads: ops.QKHeads, cos: torch.Tensor,
                          sin: torch.Tensor, positions: torch.Tensor, cells: LayerCells,
                          n_ctx: int, mask: torch.Tensor | None, scale: float,
                          wo: torch.Tensor) -> torch.Tensor:
    """`decode_attention.rotate_attend` of one token's projection qkv [1, (H+2G)*Dh], then
    its outputs times wo [D, H*Dh] -> [1, D] in qkv's dtype, as one kernel. Only where
    `projects` holds (a bias: never)."""
    if not projects(qkv, heads, cells, n_ctx, positions, wo, None):
        raise ValueError(
            "rotate_attend_project takes what decode_attention.rotate_attend takes and wo "
            f"[D, {heads.n_heads * heads.head_dim}] of qkv's dtype on its device with "
            f"contiguous rows, with PROJECT_KERNEL on; got wo {list(wo.shape)} {wo.dtype} on "
            f"{wo.device}, qkv {qkv.dtype} on {qkv.device}")
    return rotate_attend_project_triton(qkv, heads, cos, sin, positions, cells, n_ctx, mask,
                                        scale, wo)


def rotate_attend_project_triton(qkv: torch.Tensor, heads: ops.QKHeads, cos: torch.Tensor,
                                 sin: torch.Tensor, positions: torch.Tensor, cells: LayerCells,
                                 n_ctx: int, mask: torch.Tensor | None, scale: float,
                                 wo: torch.Tensor, *, max_programs: int | None = None,
                                 num_warps: int | None = None) -> torch.Tensor:
    """`rotate_attend_project` by its kernel, however the call came (the tests'
    interpreter): `max_programs` (default MAX_PROGRAMS) and `num_warps` (default
    `decode_attention.SHORT_WARPS`), both read at the call, for bench/decode_shapes.py."""
    h, g, dh = heads.n_heads, heads.n_kv_heads, heads.head_dim
    d = wo.shape[0]
    if wo.dim() != 2 or wo.shape[1] != h * dh or wo.stride(1) != 1 or wo.dtype != qkv.dtype:
        raise ValueError(f"rotate_attend_project needs wo [D, {h * dh}] in {qkv.dtype} with "
                         f"contiguous rows, got {list(wo.shape)} {wo.dtype}")
    launch = decode_attention.rotate_attend_launch(qkv, heads, cos, sin, positions, cells,
                                                   n_ctx, mask, scale,
                                                   "rotate_attend_project")
    rows = row_block(d, g, MAX_PROGRAMS if max_programs is None else max_programs)
    n_blocks = -(-d // rows)
    if n_blocks > MAX_ROW_BLOCKS:
        raise ValueError(f"rotate_attend_project counts at most {MAX_ROW_BLOCKS} blocks of wo's "
                         f"rows: {d} rows at {rows} a block are {n_blocks}")
    out = qkv.new_empty((1, d))  # [1, D]
    partial = torch.empty((g, d), dtype=torch.float32, device=qkv.device)  # [G, D]
    kernel = decode_attention.kernels().rotate_attend_project
    kernel[(g, n_blocks)](
        *launch.pointers, wo, partial, _arrived(qkv.device), out, *launch.sizes, d,
        *launch.scalars, wo.stride(0), **launch.constexprs, BLOCK_O=rows,
        BLOCK_RP=block(h // g),
        num_warps=decode_attention.SHORT_WARPS if num_warps is None else num_warps,
        **dependent_launch.kernel_options(qkv.device))
    return out
