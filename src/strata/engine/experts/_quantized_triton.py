"""The Triton kernels of `strata.engine.experts.quantized` (imported only when Triton is there).

Legend: R routed rows, D hidden size, F expert width, G an int4 group; BF, BD the block sizes.
Each kernel reads one expert's quantized blob in place, at `blob_ptr + index[r] * slot_stride`
bytes (the layouts of `strata.engine.experts.quant`): `*_act` its gate and up rows, `*_down`
its down rows; the scales from byte `scales_at` of the blob on. An int8 row's sum is scaled
once; an int4 row sums each group's products, then scales the group's sum (one scale load a
group). The roundings to the output dtype are those of the bf16 kernels (`_grouped_triton`).
"""

import triton
import triton.language as tl

from strata.engine._dependent_triton import wait_for_prior
from strata.engine.experts._grouped_triton import store_act, store_rows


@triton.jit
def int8_act(blob_ptr, index_ptr, x_ptr, act_ptr, slot_stride, scales_at, D, F, x_stride,
             act_stride, BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr,
             USE_PDL: tl.constexpr = False):
    # Program (r, b): act[r, b*BLOCK_F : (b+1)*BLOCK_F] of the expert index[r].
    wait_for_prior(USE_PDL)
    r = tl.program_id(0)
    slot = tl.load(index_ptr + r).to(tl.int64)
    f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)  # [BF]
    f_in = f < tl.where(slot >= 0, F, 0)  # a negative slot: nothing read, nothing stored
    blob = blob_ptr + tl.maximum(slot, 0) * slot_stride
    q = blob.to(tl.pointer_type(tl.int8))
    scales = (blob + scales_at).to(tl.pointer_type(tl.float32))
    gate_sum = tl.zeros([BLOCK_F], dtype=tl.float32)
    up_sum = tl.zeros([BLOCK_F], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)  # [BD]
        d_in = d < D
        x = tl.load(x_ptr + r * x_stride + d, mask=d_in, other=0.0).to(tl.float32)
        both = f_in[:, None] & d_in[None, :]
        gate = tl.load(q + f[:, None] * D + d[None, :], mask=both, other=0)
        up = tl.load(q + (f[:, None] + F) * D + d[None, :], mask=both, other=0)
        gate_sum += tl.sum(gate.to(tl.float32) * x[None, :], axis=1)
        up_sum += tl.sum(up.to(tl.float32) * x[None, :], axis=1)
    gate_sum *= tl.load(scales + f, mask=f_in, other=0.0)
    up_sum *= tl.load(scales + F + f, mask=f_in, other=0.0)
    store_act(gate_sum, up_sum, act_ptr, r, act_stride, f, f_in)


@triton.jit
def int8_down(blob_ptr, index_ptr, act_ptr, y_ptr, slot_stride, scales_at, D, F, act_stride,
              y_stride, BLOCK_D: tl.constexpr, BLOCK_F: tl.constexpr,
              USE_PDL: tl.constexpr = False):
    # Program (r, b): y[r, b*BLOCK_D : (b+1)*BLOCK_D] of the expert index[r].
    wait_for_prior(USE_PDL)
    r = tl.program_id(0)
    slot = tl.load(index_ptr + r).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BD]
    d_in = d < tl.where(slot >= 0, D, 0)  # a negative slot: nothing read, zeros stored
    blob = blob_ptr + tl.maximum(slot, 0) * slot_stride
    q = blob.to(tl.pointer_type(tl.int8)) + 2 * F * D
    scales = (blob + scales_at).to(tl.pointer_type(tl.float32))
    total = tl.zeros([BLOCK_D], dtype=tl.float32)
    for f0 in range(0, F, BLOCK_F):
        f = f0 + tl.arange(0, BLOCK_F)  # [BF]
        f_in = f < F
        act = tl.load(act_ptr + r * act_stride + f, mask=f_in, other=0.0).to(tl.float32)
        w = tl.load(q + d[:, None] * F + f[None, :], mask=d_in[:, None] & f_in[None, :],
                    other=0)
        total += tl.sum(w.to(tl.float32) * act[None, :], axis=1)
    total *= tl.load(scales + 2 * F + d, mask=d_in, other=0.0)
    store_rows(y_ptr, r, y_stride, d, D, slot, total)


@triton.jit
def _int4_rows(blob, scales, starts, rows_in, v_ptr, k0, K, GROUP: tl.constexpr,
               BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    # sum over a step of BLOCK_K inputs [k0, k0 + BLOCK_K) of BLOCK_R rows whose first element
    # is starts [BR] (elements from the blob's first): each group's products summed, then
    # times the group's scale (one scale load a group, not a byte): [BR].
    j = tl.arange(0, BLOCK_K // 2)  # byte of the step
    group = j // (GROUP // 2)
    lo_k = k0 + group * GROUP + j % (GROUP // 2)  # [BK/2] the input a low nibble multiplies
    k_in = lo_k < K  # K is a multiple of GROUP: a group is all in or all out
    v_lo = tl.load(v_ptr + lo_k, mask=k_in, other=0.0).to(tl.float32)
    v_hi = tl.load(v_ptr + lo_k + GROUP // 2, mask=k_in, other=0.0).to(tl.float32)
    both = rows_in[:, None] & k_in[None, :]
    byte = tl.load(blob + (starts[:, None] + k0) // 2 + j[None, :], mask=both, other=0)
    byte = byte.to(tl.int32)
    lo = ((byte << 28) >> 28).to(tl.float32)  # two's complement nibbles, sign-extended
    hi = ((byte << 24) >> 28).to(tl.float32)
    products = lo * v_lo[None, :] + hi * v_hi[None, :]  # [BR, BK/2]
    per_group = tl.sum(tl.reshape(products, (BLOCK_R, BLOCK_K // GROUP, GROUP // 2)), axis=2)
    g = tl.arange(0, BLOCK_K // GROUP)  # [BK/G] the step's groups
    g_in = k0 + g * GROUP < K
    scale = tl.load(scales + (starts[:, None] + k0) // GROUP + g[None, :],
                    mask=rows_in[:, None] & g_in[None, :], other=0.0)  # [BR, BK/G]
    return tl.sum(per_group * scale, axis=1)


@triton.jit
def int4_act(blob_ptr, index_ptr, x_ptr, act_ptr, slot_stride, scales_at, D, F, x_stride,
             act_stride, GROUP: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr,
             USE_PDL: tl.constexpr = False):
    wait_for_prior(USE_PDL)
    r = tl.program_id(0)
    slot = tl.load(index_ptr + r).to(tl.int64)
    f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)  # [BF]
    f_in = f < tl.where(slot >= 0, F, 0)  # a negative slot: nothing read, nothing stored
    blob = blob_ptr + tl.maximum(slot, 0) * slot_stride
    scales = (blob + scales_at).to(tl.pointer_type(tl.float32))
    x = x_ptr + r * x_stride
    gate_sum = tl.zeros([BLOCK_F], dtype=tl.float32)
    up_sum = tl.zeros([BLOCK_F], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        gate_sum += _int4_rows(blob, scales, f * D, f_in, x, d0, D, GROUP, BLOCK_D, BLOCK_F)
        up_sum += _int4_rows(blob, scales, (f + F) * D, f_in, x, d0, D, GROUP, BLOCK_D,
                             BLOCK_F)
    store_act(gate_sum, up_sum, act_ptr, r, act_stride, f, f_in)


@triton.jit
def int4_down(blob_ptr, index_ptr, act_ptr, y_ptr, slot_stride, scales_at, D, F, act_stride,
              y_stride, GROUP: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_F: tl.constexpr,
              USE_PDL: tl.constexpr = False):
    wait_for_prior(USE_PDL)
    r = tl.program_id(0)
    slot = tl.load(index_ptr + r).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BD]
    d_in = d < tl.where(slot >= 0, D, 0)  # a negative slot: nothing read, zeros stored
    blob = blob_ptr + tl.maximum(slot, 0) * slot_stride
    scales = (blob + scales_at).to(tl.pointer_type(tl.float32))
    act = act_ptr + r * act_stride
    total = tl.zeros([BLOCK_D], dtype=tl.float32)
    for f0 in range(0, F, BLOCK_F):
        total += _int4_rows(blob, scales, 2 * F * D + d * F, d_in, act, f0, F, GROUP, BLOCK_F,
                            BLOCK_D)
    store_rows(y_ptr, r, y_stride, d, D, slot, total)
