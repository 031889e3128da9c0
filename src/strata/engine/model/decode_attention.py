"""One token's attention over the K/V cells (a decode step) as one kernel.

Dimension letters: H query heads, G kv heads, R = H / G query heads per kv head, N cells
attended, S splits of the cells, Dh head dim.

At a decode step `F.scaled_dot_product_attention` over the R query heads folded per kv head
(the layer's `_folded`) costs 8-11 µs a layer on the H200 at a few hundred cells, and with
grouped kv heads (R > 1) it reads the cells at 1-5% of the device's bandwidth at any length.
Here the cells are split into S parts read by G*S programs at once (flash-decoding), each
with the R query heads of its kv head; the last program of a kv head to finish merges the S
partial softmaxes in a fixed order, so the bytes do not depend on which program finishes
last, and one launch does it all (no merge kernel). The two differ by float32 rounding in the
softmax's sums and by P rounded to the cells' dtype before its product with V, as the fused
kernels round it.

Where it runs (`takes`), from bench/decode_attention.py's sweep on the H200
(bench/results/decode-attention-h200-2026-12-02.md): with grouped kv heads at every length
(1.6x to 5.5x SDPA's speed from 256 to 16,384 cells); without them (R = 1, as olmoe) up to
`UNGROUPED_MAX_CELLS` cells, past which SDPA's kernel reads the cells faster than this one,
whose merge is serial in S.

On by default (`SHORT_KERNEL`; `bench/decode_shapes.py --kernels attention` times it against
the split kernel): a short window attended by `attend_short`, one program a kv head over every
cell, no split and no merge. A round writes the cells at one position only (the kernel before
attention stores the token's k and v there), so the program reads the keys
(and at up to 128 cells the values) before its dependent-launch wait, beside that kernel,
then reads the one written row again after it. At a few hundred cells a decode step's
attention is a chain of dependent reads (q, the cells, the partials, the merge), about 7 µs
a layer on the H200; this leaves q, that row and the mask after the wait. With
`SHORT_ROTATES` too, `rotate_attend` folds the rotation's kernel in (`ops.rotate_and_write`:
q's and k's norms and rotation, k and v stored): each program norms and rotates its own
heads from the projection, stores its key and value, and attends the row it just made, one
launch a layer fewer. Both on, at 8 warps, a decode round was 1.086x as fast on the whole
olmoe-1b-7b, 1.049x on qwen3-30b-a3b cut to 4 layers and 1.018x on mixtral-8x7b cut to 2,
with the same logits, on an H100 (bench/results/decode-shapes-short-h100-2026-12-05.md).
"""

from __future__ import annotations

import functools

import torch

from strata.engine import dependent_launch
from strata.engine.model import ops
from strata.engine.model.kv_cells import LayerCells

__all__ = ["MAX_SPLITS", "SHORT_KERNEL", "SHORT_ROTATES", "UNGROUPED_MAX_CELLS", "attend_one",
           "attend_one_triton", "attend_short_triton", "launch_shape", "rotate_attend",
           "rotate_attend_triton", "rotates", "short_takes", "takes"]

UNGROUPED_MAX_CELLS = 256
# The most programs a kv head's cells are split across: the merge takes one serial step a
# split, so past 16 splits longer ones cost less than more of them (at 16,384 cells, 16
# splits of 1,024 took 34.7 µs against 64 of 256's 58.2 on qwen3's heads on the H200).
MAX_SPLITS = 16
BLOCK_CELLS = 64  # cells a program reads at a time
MAX_KV_HEADS = 256  # the arrival counters kept per device
SHORT_KERNEL = True
# Where SHORT_KERNEL, whether the short kernel also norms and rotates the token's q and k and
# writes its k and v to the cells (`rotate_attend`: `ops.rotate_and_write`'s kernel folded in,
# one launch a layer fewer); on with it (see the module).
SHORT_ROTATES = True
# `attend_short` holds a kv head's keys [N, Dh] in registers (and its values where
# N * Dh <= SHORT_VALUES_FIRST_ELEMENTS): compiled for sm_90 at 8 warps, 256 cells of 128 dims
# take 232 registers a thread with the values read after the keys are spent, 128 cells 143
# with both before the wait, neither spilling (both at 256 cells spill).
SHORT_MAX_ELEMENTS = 256 * 128
SHORT_VALUES_FIRST_ELEMENTS = 128 * 128
SHORT_WARPS = 8


@functools.cache
def _kernels():
    """The Triton kernel module, or None without Triton."""
    try:
        from strata.engine.model import _attention_triton
    except ImportError:
        return None
    return _attention_triton


def takes(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether the layer attends q [T, H, Dh] over keys, values [G, N, Dh] with `attend_one`:
    one token on CUDA with Triton, outside a compilation, in bf16 or fp16, each head's row
    contiguous, and grouped kv heads or at most UNGROUPED_MAX_CELLS cells. Shapes alone
    decide (never values), so a CUDA graph captures what an eager call runs."""
    return q.dim() == 3 and q.shape[0] == 1 and _one_token_takes(q, q.shape[1], keys, values)


def _one_token_takes(x: torch.Tensor, n_heads: int, keys: torch.Tensor,
                     values: torch.Tensor) -> bool:
    """`takes` for one token's n_heads query heads, x its q or its projection: x on CUDA
    with Triton, outside a compilation, in bf16 or fp16 as the keys and values are."""
    return (x.is_cuda and not torch.compiler.is_compiling() and _kernels() is not None
            and x.dtype in (torch.bfloat16, torch.float16)
            and keys.dtype == x.dtype and values.dtype == x.dtype
            and keys.stride(2) == 1 and values.stride(2) == 1
            and keys.shape[0] <= MAX_KV_HEADS
            and (n_heads > keys.shape[0] or keys.shape[1] <= UNGROUPED_MAX_CELLS))


def launch_shape(n_cells: int, per_kv: int) -> tuple[int, int]:
    """(cells a program, warps) for N cells and R query heads per kv head: the sweep's best
    within a few percent at each length measured. 128 cells a program up to 1,024 cells
    (more programs at once); 256 past that, where the merge's serial steps, one per split,
    cost more than the reads they spread, and doubled until at most MAX_SPLITS programs read
    a kv head's cells. 8 warps with grouped heads, 4 without."""
    split_cells = 128 if n_cells <= 1024 else 256
    while -(-n_cells // split_cells) > MAX_SPLITS:
        split_cells *= 2
    return split_cells, (8 if per_kv > 1 else 4)


@functools.cache
def _arrived(device: torch.device) -> torch.Tensor:
    """The kernel's count of arrived programs per kv head, on `device`: zeros between launches
    (each head's last program sets its count back). One per device, kept for the process: a
    CUDA graph holds its address. Made by an eager call (the engine runs every step once
    before capturing it)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("attend_one's first call on a device must be eager, not inside a "
                           "CUDA graph's capture: run the step once before capturing it")
    return torch.zeros(MAX_KV_HEADS, dtype=torch.int32, device=device)


def _block(n: int, least: int = 1) -> int:
    return max(least, 1 << max(n - 1, 0).bit_length())


def short_takes(keys: torch.Tensor, positions: torch.Tensor | None) -> bool:
    """Whether `attend_one` runs `attend_short` over keys [G, N, Dh]: SHORT_KERNEL, the
    token's position given ([1], int64), and a kv head's keys within SHORT_MAX_ELEMENTS (N
    and Dh each rounded up to a power of two)."""
    return (SHORT_KERNEL and positions is not None and positions.shape == (1,)
            and positions.dtype == torch.int64
            and _block(keys.shape[1], 16) * _block(keys.shape[2], 16) <= SHORT_MAX_ELEMENTS)


def attend_one(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               mask: torch.Tensor | None, scale: float,
               positions: torch.Tensor | None = None) -> torch.Tensor:
    """One token's attention: q [1, H, Dh] over keys, values [G, N, Dh] (query head h reads kv
    head h // R), `mask` [1, N] added to the scores (-inf: not attended) or None (every cell)
    -> [1, H*Dh] in q's dtype, by the kernel at `launch_shape`, or by `attend_short` where
    `short_takes` (`positions` [1]: the cell the token's k and v were just written to). Only
    where `takes` holds: the layer's fused path is the reference elsewhere."""
    if not takes(q, keys, values):
        raise ValueError(
            "attend_one takes one token q [1, H, Dh] in bf16 or fp16 on CUDA (with Triton, "
            "outside a compilation), keys and values [G, N, Dh] of its dtype with contiguous "
            f"head rows, and grouped kv heads (G < H) or N <= {UNGROUPED_MAX_CELLS}; got q "
            f"{list(q.shape)} {q.dtype} on {q.device}, keys {list(keys.shape)} {keys.dtype}")
    if short_takes(keys, positions):
        return attend_short_triton(q, keys, values, mask, scale, positions)
    split_cells, warps = launch_shape(keys.shape[1], q.shape[1] // keys.shape[0])
    return attend_one_triton(q, keys, values, mask, scale, split_cells=split_cells,
                             num_warps=warps)


def _check_operands(name: str, q_shape: tuple[int, ...], keys: torch.Tensor,
                    values: torch.Tensor, mask: torch.Tensor | None) -> None:
    """Refuse, naming them, operands a kernel cannot take: q of shape [1, H, Dh] and keys,
    values [G, N, Dh] with G dividing H; mask [1, N] with contiguous cells, or None."""
    _, n_heads, head_dim = q_shape
    n_kv_heads, n_cells, _ = keys.shape
    if n_heads % n_kv_heads or values.shape != keys.shape or keys.shape[2] != head_dim:
        raise ValueError(f"{name} needs q [1, H, Dh] and keys, values [G, N, Dh] with G "
                         f"dividing H, got q {list(q_shape)}, keys {list(keys.shape)}, "
                         f"values {list(values.shape)}")
    if mask is not None and (mask.shape != (1, n_cells) or mask.stride(1) != 1):
        raise ValueError(f"mask must be [1, {n_cells}] with contiguous cells, got "
                         f"{list(mask.shape)}")


def attend_one_triton(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      mask: torch.Tensor | None, scale: float, *, split_cells: int = 128,
                      block_cells: int = BLOCK_CELLS, num_warps: int = 4,
                      max_splits: int | None = None, merge_splits: int = 0) -> torch.Tensor:
    """`attend_one` by its Triton kernel (under Triton's interpreter on the CPU in tests).
    `split_cells` (the cells a program, a multiple of `block_cells`), `block_cells` (a power
    of two, at least 16) and `num_warps` are its launch shape, for bench/decode_attention.py's
    sweep. `max_splits` doubles the cells a program until at most that many programs read a
    kv head's cells (`attend_one` passes cells already capped at MAX_SPLITS); `merge_splits`
    (a power of two) merges the partials as reductions over that many splits at a time
    instead of one split after another (0, the default: one after another; the reductions
    were slower at every shape the sweep measured)."""
    _, n_heads, head_dim = q.shape
    n_kv_heads, n_cells, _ = keys.shape
    _check_operands("attend_one", q.shape, keys, values, mask)
    if block_cells < 16 or block_cells & (block_cells - 1) or split_cells % block_cells:
        raise ValueError(f"block_cells must be a power of two >= 16 dividing split_cells, got "
                         f"{block_cells} and {split_cells}")
    if ((max_splits is not None and max_splits < 1) or merge_splits < 0
            or merge_splits & (merge_splits - 1)):
        raise ValueError(f"max_splits must be at least 1 and merge_splits 0 or a power of two, "
                         f"got {max_splits} and {merge_splits}")
    per_kv = n_heads // n_kv_heads  # R
    block_r, block_d = _block(per_kv, 16), _block(head_dim, 16)
    while max_splits is not None and -(-n_cells // split_cells) > max_splits:
        split_cells *= 2
    n_splits = max(1, -(-n_cells // split_cells))  # S
    q = q.contiguous()
    out = q.new_empty((n_heads, head_dim))  # [H, Dh]
    partial = torch.empty((n_kv_heads, n_splits, block_r, block_d), dtype=torch.float32,
                          device=q.device)  # [G, S, BR, BD]
    stats = torch.empty((n_kv_heads, n_splits, 2, block_r), dtype=torch.float32,
                        device=q.device)  # [G, S, (max, sum), BR]
    _kernels().decode_attention[(n_kv_heads, n_splits)](
        q, keys, values, mask if mask is not None else q, partial, stats, _arrived(q.device),
        out, n_cells, per_kv, head_dim, n_splits, scale, keys.stride(0), keys.stride(1),
        values.stride(0), values.stride(1), HAS_MASK=mask is not None,
        CELLS_PER_SPLIT=split_cells, BLOCK_C=block_cells, BLOCK_R=block_r, BLOCK_D=block_d,
        BLOCK_S=_block(n_splits, 2), MERGE_SPLITS=merge_splits, num_warps=num_warps,
        **dependent_launch.kernel_options(q.device))
    return out.view(1, n_heads * head_dim)


def attend_short_triton(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                        mask: torch.Tensor | None, scale: float, positions: torch.Tensor, *,
                        num_warps: int | None = None) -> torch.Tensor:
    """`attend_one` by `attend_short` (under Triton's interpreter on the CPU in tests): one
    program a kv head over every cell, the keys (and at most SHORT_VALUES_FIRST_ELEMENTS a kv
    head, the values) read before its wait, the row at positions[0] read again after it; at
    `num_warps` (default SHORT_WARPS, read at the call: bench/decode_shapes.py sets it)."""
    _, n_heads, head_dim = q.shape
    n_kv_heads, n_cells, _ = keys.shape
    _check_operands("attend_short", q.shape, keys, values, mask)
    if positions.shape != (1,) or positions.dtype != torch.int64:
        raise ValueError(f"attend_short needs the token's position as int64 [1], got "
                         f"{positions.dtype} {list(positions.shape)}")
    block_c, block_d = _block(n_cells, 16), _block(head_dim, 16)
    if block_c * block_d > SHORT_MAX_ELEMENTS:
        raise ValueError(f"attend_short holds a kv head's keys in registers: {n_cells} cells of "
                         f"{head_dim} (rounded to {block_c} x {block_d}) are past its "
                         f"{SHORT_MAX_ELEMENTS} elements; attend_one_triton splits them")
    q = q.contiguous()
    out = q.new_empty((n_heads, head_dim))  # [H, Dh]
    _kernels().attend_short[(n_kv_heads,)](
        q, keys, values, mask if mask is not None else q, positions, out, n_cells,
        n_heads // n_kv_heads, head_dim, scale, keys.stride(0), keys.stride(1),
        values.stride(0), values.stride(1), HAS_MASK=mask is not None, BLOCK_C=block_c,
        BLOCK_R=_block(n_heads // n_kv_heads, 16), BLOCK_D=block_d,
        VALUES_FIRST=block_c * block_d <= SHORT_VALUES_FIRST_ELEMENTS,
        num_warps=SHORT_WARPS if num_warps is None else num_warps,
        **dependent_launch.kernel_options(q.device))
    return out.view(1, n_heads * head_dim)


def rotates(qkv: torch.Tensor, heads: ops.QKHeads, cells: LayerCells, n_ctx: int,
            positions: torch.Tensor) -> bool:
    """Whether a layer's attention of one token runs `rotate_attend`: SHORT_ROTATES, the
    rotation's kernel would write the cells (`ops.writes_in_kernel`), `takes` and
    `short_takes` hold for the window's q, keys and values, and a head dim of at least 32 (the
    scores are two products over its halves, at least 16 wide each). Shapes decide, never
    values."""
    if not (SHORT_ROTATES and qkv.dim() == 2 and qkv.shape[0] == 1 and heads.head_dim >= 32
            and ops.writes_in_kernel(qkv, heads, cells)):
        return False
    keys, values = cells.k[:n_ctx].transpose(0, 1), cells.v[:n_ctx].transpose(0, 1)
    return (_one_token_takes(qkv, heads.n_heads, keys, values)
            and short_takes(keys, positions))


def rotate_attend(qkv: torch.Tensor, heads: ops.QKHeads, cos: torch.Tensor, sin: torch.Tensor,
                  positions: torch.Tensor, cells: LayerCells, n_ctx: int,
                  mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """`ops.rotate_and_write` of one token's projection qkv [1, (H+2G)*Dh] (its k and v stored
    at positions [1]), then `attend_one` over cells [0, n_ctx) with `mask` [1, n_ctx] or None
    -> [1, H*Dh], as one kernel. Only where `rotates` holds."""
    if not rotates(qkv, heads, cells, n_ctx, positions):
        raise ValueError(
            "rotate_attend takes one token's qkv [1, (H+2G)*Dh] whose rotation writes the cells "
            "in one kernel (ops.writes_in_kernel), a head dim of at least 32, and a window "
            f"attend_short holds, with SHORT_ROTATES on; got qkv {list(qkv.shape)} "
            f"{qkv.dtype} on {qkv.device}, head dim {heads.head_dim}, {n_ctx} cells")
    return rotate_attend_triton(qkv, heads, cos, sin, positions, cells, n_ctx, mask, scale)


def rotate_attend_triton(qkv: torch.Tensor, heads: ops.QKHeads, cos: torch.Tensor,
                         sin: torch.Tensor, positions: torch.Tensor, cells: LayerCells,
                         n_ctx: int, mask: torch.Tensor | None, scale: float, *,
                         num_warps: int | None = None) -> torch.Tensor:
    """`rotate_attend` by its kernel, however the call came (the tests' interpreter)."""
    h, g, dh = heads.n_heads, heads.n_kv_heads, heads.head_dim
    keys, values = cells.k[:n_ctx].transpose(0, 1), cells.v[:n_ctx].transpose(0, 1)
    _check_operands("rotate_attend", (1, h, dh), keys, values, mask)
    if qkv.shape != (1, (h + 2 * g) * dh) or qkv.stride(1) != 1 or positions.shape != (1,) \
            or cos.shape != (1, dh) or sin.shape != (1, dh):
        raise ValueError(f"rotate_attend needs qkv [1, {(h + 2 * g) * dh}] with contiguous "
                         f"columns, positions [1] and cos, sin [1, {dh}], got qkv "
                         f"{list(qkv.shape)}, positions {list(positions.shape)}, cos "
                         f"{list(cos.shape)}")
    block_c = _block(n_ctx, 16)
    if block_c * dh > SHORT_MAX_ELEMENTS or dh < 32 or dh & (dh - 1):
        raise ValueError(f"rotate_attend holds a kv head's keys in registers and a head dim "
                         f"that is a power of two, at least 32: {n_ctx} cells of {dh} cannot")
    out = qkv.new_empty((h, dh))  # [H, Dh]
    weight = heads.weight.contiguous() if heads.weight is not None else qkv  # qkv: not read
    _kernels().rotate_attend_short[(g,)](
        qkv, weight, cos, sin, cells.k, cells.v, mask if mask is not None else qkv, positions,
        out, n_ctx, h, g, h // g, heads.eps, scale, keys.stride(0), keys.stride(1),
        values.stride(0), values.stride(1), NORM=ops.NORMS[heads.norm],
        HAS_MASK=mask is not None, BLOCK_C=block_c, BLOCK_R=_block(h // g, 16),
        BLOCK_P=_block(max(h, g)), HEAD_DIM=dh,
        VALUES_FIRST=block_c * dh <= SHORT_VALUES_FIRST_ELEMENTS,
        num_warps=SHORT_WARPS if num_warps is None else num_warps,
        **dependent_launch.kernel_options(qkv.device))
    return out.view(1, h * dh)
