"""The Triton side of `strata.engine.experts.quant.dequantize_blobs` (imported only when Triton is
there).

Legend: B blobs, R rows of one matrix, C its columns, G an int4 group; BR, BC the block sizes.
A launch turns one matrix of every blob (the gate and up rows [2F, D], or the down rows
[D, F]) into out [B, R, C]: its integers at byte `q_at` of each blob, its float32 scales at
byte `scales_at` (the layouts of `strata.engine.experts.quant`), blob b at `blobs_ptr +
b * blob_stride`. Each weight is its integer times its scale in float32, rounded once to out's
dtype: torch's `q.float() * s` then `.to(dtype)`, so the bytes are the same.
"""

import triton
import triton.language as tl

from strata.engine._dependent_triton import wait_for_prior


@triton.jit
def int8_rows(blobs_ptr, out_ptr, blob_stride, q_at, scales_at, R, C, out_stride,
              BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, USE_PDL: tl.constexpr = False):
    # Program (b, i, j): out[b, i*BR : (i+1)*BR, j*BC : (j+1)*BC], one scale a row.
    wait_for_prior(USE_PDL)
    blob = blobs_ptr + tl.program_id(0).to(tl.int64) * blob_stride
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BC]
    rows_in = rows < R
    both = rows_in[:, None] & (cols < C)[None, :]
    at = rows[:, None].to(tl.int64) * C + cols[None, :]  # [BR, BC] element of the matrix
    q = tl.load((blob + q_at).to(tl.pointer_type(tl.int8)) + at, mask=both, other=0)
    scale = tl.load((blob + scales_at).to(tl.pointer_type(tl.float32)) + rows, mask=rows_in,
                    other=0.0)
    out = out_ptr + tl.program_id(0).to(tl.int64) * out_stride
    tl.store(out + at, (q.to(tl.float32) * scale[:, None]).to(out_ptr.dtype.element_ty),
             mask=both)


@triton.jit
def int4_rows(blobs_ptr, out_ptr, blob_stride, q_at, scales_at, R, C, out_stride,
              GROUP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
              USE_PDL: tl.constexpr = False):
    # Program (b, i, j) as int8_rows', BC a multiple of G (and C one, so a group is all in or
    # all out). Byte k of a block holds, of group k // (G/2), weight k % (G/2) in its low
    # nibble and weight G/2 + k % (G/2) in its high one; one scale a group.
    wait_for_prior(USE_PDL)
    blob = blobs_ptr + tl.program_id(0).to(tl.int64) * blob_stride
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    k = tl.arange(0, BLOCK_C // 2)  # [BC/2] byte of the block's row
    group = tl.program_id(2) * (BLOCK_C // GROUP) + k // (GROUP // 2)  # [BC/2] group of the row
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
    out = out_ptr + tl.program_id(0).to(tl.int64) * out_stride + row_at + lo_col[None, :]
    dtype = out_ptr.dtype.element_ty
    tl.store(out, (lo.to(tl.float32) * scale).to(dtype), mask=both)
    tl.store(out + GROUP // 2, (hi.to(tl.float32) * scale).to(dtype), mask=both)
