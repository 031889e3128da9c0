"""The Triton side of `strata.engine.experts.quant.dequantize_blobs` (imported only when Triton is
there).

Legend: B blobs, R rows of one matrix, C its columns, G an int4 group; BR, BC the block sizes.
One launch turns every blob's two matrices (the gate and up rows [2F, D], the down rows
[D, F]) into gate_up [B, 2F, D] and down [B, D, F]: program (p, b) writes tile p of blob b,
the gate and up rows' tiles first, then the down rows' (tiles on the grid's first axis, whose
limit is 2^31 - 1, not 65,535). A matrix's integers sit at byte `q_at` of each blob and its
float32 scales at byte `scales_at` (the layouts of `strata.engine.experts.quant`), blob b at
`blobs_ptr + b * blob_stride`. Each weight is its integer times its scale in float32, rounded
once to the output's dtype: torch's `q.float() * s` then `.to(dtype)`, so the bytes are the
same. One launch, not one a matrix: a prompt's layer dequantizes many batches, and each
launch costs tens of µs of host time.
"""

import triton
import triton.language as tl

from strata.engine._dependent_triton import wait_for_prior


@triton.jit
def _int8_tile(blob, out, q_at, scales_at, R, C, tile_r, tile_c,
               BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # out[tile_r*BR : (tile_r+1)*BR, tile_c*BC : (tile_c+1)*BC] of one [R, C] matrix, one
    # scale a row.
    rows = tile_r * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    cols = tile_c * BLOCK_C + tl.arange(0, BLOCK_C)  # [BC]
    rows_in = rows < R
    both = rows_in[:, None] & (cols < C)[None, :]
    at = rows[:, None].to(tl.int64) * C + cols[None, :]  # [BR, BC] element of the matrix
    q = tl.load((blob + q_at).to(tl.pointer_type(tl.int8)) + at, mask=both, other=0)
    scale = tl.load((blob + scales_at).to(tl.pointer_type(tl.float32)) + rows, mask=rows_in,
                    other=0.0)
    tl.store(out + at, (q.to(tl.float32) * scale[:, None]).to(out.dtype.element_ty), mask=both)


@triton.jit
def _int4_tile(blob, out, q_at, scales_at, R, C, tile_r, tile_c, GROUP: tl.constexpr,
               BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # The tile as _int8_tile's, BC a multiple of G (and C one, so a group is all in or all
    # out). Byte k of a block holds, of group k // (G/2), weight k % (G/2) in its low nibble
    # and weight G/2 + k % (G/2) in its high one; one scale a group.
    rows = tile_r * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    k = tl.arange(0, BLOCK_C // 2)  # [BC/2] byte of the block's row
    group = tile_c * (BLOCK_C // GROUP) + k // (GROUP // 2)  # [BC/2] group of the row
    first = group * GROUP  # [BC/2] the group's first column
    lo_col = first + k % (GROUP // 2)  # [BC/2] the column a low nibble stands for
    both = (rows < R)[:, None] & (first < C)[None, :]
    row_at = rows[:, None].to(tl.int64) * C  # [BR, 1] the row's first element
    byte_at = (row_at + first[None, :]) // 2 + k[None, :] % (GROUP // 2)  # [BR, BC/2]
    byte = tl.load(blob + q_at + byte_at, mask=both, other=0).to(tl.int32)  # [BR, BC/2]
    lo = (byte << 28) >> 28  # the nibbles sign-extended: two's complement in -8..7
    hi = (byte << 24) >> 28
    scale = tl.load((blob + scales_at).to(tl.pointer_type(tl.float32))
                    + row_at // GROUP + group[None, :], mask=both, other=0.0)  # [BR, BC/2]
    dst = out + row_at + lo_col[None, :]  # [BR, BC/2] where the low nibbles' weights go
    dtype = out.dtype.element_ty
    tl.store(dst, (lo.to(tl.float32) * scale).to(dtype), mask=both)
    tl.store(dst + GROUP // 2, (hi.to(tl.float32) * scale).to(dtype), mask=both)


@triton.jit
def _tile(blob, out, q_at, scales_at, R, C, tile_r, tile_c, GROUP: tl.constexpr,
          BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # One tile of int8 (GROUP 0) or int4 weights.
    if GROUP == 0:
        _int8_tile(blob, out, q_at, scales_at, R, C, tile_r, tile_c, BLOCK_R, BLOCK_C)
    else:
        _int4_tile(blob, out, q_at, scales_at, R, C, tile_r, tile_c, GROUP, BLOCK_R, BLOCK_C)


@triton.jit
def dequant_blobs(blobs_ptr, gate_up_ptr, down_ptr, blob_stride, gate_up_stride, down_stride,
                  down_q_at, gate_up_scales_at, down_scales_at, F, D, GROUP: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, USE_PDL: tl.constexpr = False):
    # Program (p, b): the gate and up rows' tiles [2F, D] first, then the down rows' [D, F];
    # GROUP 0 for int8, else int4's group.
    wait_for_prior(USE_PDL)
    p = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    blob = blobs_ptr + b * blob_stride
    gate_up_cols = tl.cdiv(D, BLOCK_C)
    gate_up_tiles = tl.cdiv(2 * F, BLOCK_R) * gate_up_cols
    if p < gate_up_tiles:
        _tile(blob, gate_up_ptr + b * gate_up_stride, 0, gate_up_scales_at, 2 * F, D,
              p // gate_up_cols, p % gate_up_cols, GROUP, BLOCK_R, BLOCK_C)
    else:
        p -= gate_up_tiles
        down_cols = tl.cdiv(F, BLOCK_C)
        _tile(blob, down_ptr + b * down_stride, down_q_at, down_scales_at, D, F,
              p // down_cols, p % down_cols, GROUP, BLOCK_R, BLOCK_C)
