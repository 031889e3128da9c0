"""Int8 expert blobs: weight-only quantization per output channel, scales in the same blob.

Dimension letters: D hidden size, F expert width, R rows of a matrix, C its columns.

An int8 blob holds the same three matrices as a bf16 one (`strata.engine.experts.store`), each
row as int8 with one fp32 scale:

    gate q [F, D] | up q [F, D] | down q [D, F]   int8, 3*F*D bytes
    gate s [F]    | up s [F]    | down s [D]      fp32, 4*(2F + D) bytes

so a slot still holds one contiguous blob of `int8_blob_bytes(F, D)` (a little over half of
bf16's), and a row's weights are q * s. The scale of a row is its largest magnitude / 127, so
every weight is within half a step (s / 2) of its value, and a row of zeros stays zeros.
`strata._cpu_experts` reads these blobs in place (FORMAT_INT8).

An int4 blob quantizes per group of `group` (32 or 64) weights along a row (the input), one
fp32 scale a group, symmetric in -7..7, two weights a byte:

    gate q [F, D/2] | up q [F, D/2] | down q [D, F/2]          3*F*D/2 bytes
    gate s [F, D/G] | up s [F, D/G] | down s [D, F/G]          fp32, 12*F*D/G bytes

where each group's G/2 bytes hold its first G/2 weights in their low nibbles and its last G/2
in their high nibbles (so a kernel reads both halves' inputs contiguously); F and D must be
multiples of G. `fake_quantize` gives the weights any format stands for, to measure what it
costs in accuracy (bench/quant_accuracy.py).
"""

from __future__ import annotations

import functools

import torch

from strata.engine import dependent_launch

__all__ = ["EXPERTS_DTYPES", "INT4_GROUPS", "INT4_MAX", "INT8_MAX", "WEIGHT_FORMATS", "blob_bytes",
           "dequantize_blobs", "dequantize_blobs_torch", "dequantize_blobs_triton",
           "dequantize_int4", "dequantize_int8", "expert_blob_bytes",
           "experts_quant_for", "fake_quantize",
           "format_group", "int4_blob", "int4_blob_bytes", "int8_blob", "int8_blob_bytes",
           "int8_parts", "make_blob", "quantize_int4", "quantize_int8"]

INT8_MAX = 127  # symmetric: -127..127, so that -q is always representable
INT4_MAX = 7  # symmetric: -7..7
INT4_GROUPS = (32, 64)  # weights a scale covers along a row
# The formats `fake_quantize` knows: int8 per row, int4 per group of 32 or 64.
WEIGHT_FORMATS = ("int8", "int4-g32", "int4-g64")
# `--experts-dtype`: auto (the model's dtype, unquantized), bf16 (the same, for a bf16 model),
# or a quantized format; int4 is int4-g32, the more accurate group.
EXPERTS_DTYPES = ("auto", "bf16", "int8", "int4", "int4-g32", "int4-g64")


def experts_quant_for(experts_dtype: str | None, dtype: torch.dtype) -> str | None:
    """The store's `quant` for `--experts-dtype` `experts_dtype` (None: auto) on a model that
    computes in `dtype`: None for unquantized experts, else one of WEIGHT_FORMATS. ValueError
    naming the flag for a name not in EXPERTS_DTYPES, and for bf16 on a model in another dtype
    (the experts compute in the model's dtype; only their storage is chosen here)."""
    if experts_dtype is None or experts_dtype == "auto":
        return None
    if experts_dtype not in EXPERTS_DTYPES:
        raise ValueError(f"--experts-dtype must be one of {', '.join(EXPERTS_DTYPES)}, got "
                         f"{experts_dtype!r}")
    if experts_dtype == "bf16":
        if dtype != torch.bfloat16:
            raise ValueError(f"--experts-dtype bf16 keeps the experts in the model's dtype, and "
                             f"this model computes in {str(dtype).removeprefix('torch.')}; give "
                             f"--dtype bf16, or --experts-dtype auto, int8 or int4")
        return None
    return "int4-g32" if experts_dtype == "int4" else experts_dtype


def int8_blob_bytes(expert_width: int, hidden_size: int) -> int:
    """Bytes of one int8 blob of an expert of width F and hidden size D."""
    return 3 * expert_width * hidden_size + 4 * (2 * expert_width + hidden_size)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [R, C] (any float dtype) -> (q int8 [R, C], scale float32 [R]) with weight ~ q *
    scale[:, None], each row's scale its largest magnitude / 127 (0 for a row of zeros)."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"weight must be a float matrix [R, C], got {weight.dtype} "
                         f"{list(weight.shape)}")
    w = weight.float()
    scale = w.abs().amax(dim=1) / INT8_MAX  # [R]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / safe[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q int8 [R, C], scale [R] -> float32 [R, C]."""
    return q.float() * scale.float()[:, None]


def int8_blob(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The int8 blob (uint8 [int8_blob_bytes(F, D)]) of gate [F, D], up [F, D], down [D, F]."""
    f, d = gate.shape
    if up.shape != (f, d) or down.shape != (d, f):
        raise ValueError(f"gate and up must be [F, D] and down [D, F], got {list(gate.shape)}, "
                         f"{list(up.shape)}, {list(down.shape)}")
    parts = [quantize_int8(w) for w in (gate, up, down)]
    q = torch.cat([p[0].reshape(-1) for p in parts]).view(torch.uint8)  # [3*F*D]
    scales = torch.cat([p[1] for p in parts]).view(torch.uint8)  # [4*(2F + D)]
    return torch.cat((q, scales))


def int8_parts(blob: torch.Tensor, expert_width: int, hidden_size: int
               ) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """Views ((gate q, s), (up q, s), (down q, s)) into an int8 blob uint8 [int8_blob_bytes]."""
    f, d = expert_width, hidden_size
    if blob.dtype != torch.uint8 or blob.shape != (int8_blob_bytes(f, d),):
        raise ValueError(f"an int8 blob of F = {f}, D = {d} is uint8 [{int8_blob_bytes(f, d)}], "
                         f"got {blob.dtype} {list(blob.shape)}")
    q = blob[: 3 * f * d].view(torch.int8)
    scales = blob[3 * f * d :].clone().view(torch.float32)  # a copy: the view may be unaligned
    return ((q[: f * d].view(f, d), scales[:f]),
            (q[f * d : 2 * f * d].view(f, d), scales[f : 2 * f]),
            (q[2 * f * d :].view(d, f), scales[2 * f :]))


def quantize_int4(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [R, C] -> (q int8 [R, C] in -7..7, scale float32 [R, C / group]) with weight ~
    q * scale of its group; C must be a multiple of `group` (32 or 64)."""
    if group not in INT4_GROUPS:
        raise ValueError(f"group must be one of {INT4_GROUPS}, got {group!r}")
    if weight.dim() != 2 or not weight.is_floating_point() or weight.shape[1] % group:
        raise ValueError(f"weight must be a float matrix [R, C] with C a multiple of {group}, "
                         f"got {weight.dtype} {list(weight.shape)}")
    rows, cols = weight.shape
    w = weight.float().view(rows, cols // group, group)  # [R, G, group]
    scale = w.abs().amax(dim=2) / INT4_MAX  # [R, G]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / safe[..., None]).clamp_(-INT4_MAX, INT4_MAX).to(torch.int8)
    return q.view(rows, cols), scale


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q int8 [R, C] (values -7..7), scale [R, G] -> float32 [R, C]."""
    rows, cols = q.shape
    group = cols // scale.shape[1]
    return (q.float().view(rows, -1, group) * scale.float()[..., None]).view(rows, cols)


def fake_quantize(weight: torch.Tensor, fmt: str) -> torch.Tensor:
    """The float32 weights [R, C] a matrix stands for once stored in `fmt` (WEIGHT_FORMATS)."""
    if fmt == "int8":
        return dequantize_int8(*quantize_int8(weight))
    if fmt in ("int4-g32", "int4-g64"):
        return dequantize_int4(*quantize_int4(weight, int(fmt.removeprefix("int4-g"))))
    raise ValueError(f"fmt must be one of {WEIGHT_FORMATS}, got {fmt!r}")


def int4_blob_bytes(expert_width: int, hidden_size: int, group: int) -> int:
    """Bytes of one int4 blob in groups of `group` (F and D multiples of it)."""
    n = 3 * expert_width * hidden_size
    return n // 2 + 4 * (n // group)


def _pack_int4(q: torch.Tensor, group: int) -> torch.Tensor:
    """q int8 [R, C] in -7..7 -> uint8 [R * C / 2]: per group, the first half's nibbles low."""
    rows, cols = q.shape
    halves = q.view(rows, cols // group, 2, group // 2).to(torch.int32) & 0xF  # [R, G, 2, g/2]
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).to(torch.uint8).reshape(-1)


def int4_blob(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, group: int
              ) -> torch.Tensor:
    """The int4 blob (uint8 [int4_blob_bytes(F, D, group)]) of gate [F, D], up [F, D],
    down [D, F]."""
    f, d = gate.shape
    if up.shape != (f, d) or down.shape != (d, f):
        raise ValueError(f"gate and up must be [F, D] and down [D, F], got {list(gate.shape)}, "
                         f"{list(up.shape)}, {list(down.shape)}")
    parts = [quantize_int4(w, group) for w in (gate, up, down)]
    packed = torch.cat([_pack_int4(q, group) for q, _ in parts])
    scales = torch.cat([scale.reshape(-1) for _, scale in parts]).view(torch.uint8)
    return torch.cat((packed, scales))


def format_group(fmt: str) -> int:
    """The int4 group of `fmt` ("int4-g32": 32); 0 for int8. ValueError for another format."""
    if fmt == "int8":
        return 0
    if fmt in ("int4-g32", "int4-g64"):
        return int(fmt.removeprefix("int4-g"))
    raise ValueError(f"fmt must be one of {WEIGHT_FORMATS}, got {fmt!r}")


def blob_bytes(fmt: str, expert_width: int, hidden_size: int) -> int:
    """Bytes of one blob of the quantized format `fmt` (WEIGHT_FORMATS)."""
    group = format_group(fmt)
    if not group:
        return int8_blob_bytes(expert_width, hidden_size)
    if expert_width % group or hidden_size % group:
        raise ValueError(f"{fmt} needs F and D multiples of {group}, got F = {expert_width}, "
                         f"D = {hidden_size}")
    return int4_blob_bytes(expert_width, hidden_size, group)


def expert_blob_bytes(expert_width: int, hidden_size: int, dtype: torch.dtype,
                      quant: str | None = None) -> int:
    """Bytes of one expert's blob: its three matrices in `dtype`, or with `quant` in that
    format (WEIGHT_FORMATS). Every size of the experts' memory (the store, a slot, the budget,
    the simulator's trace) is counted from this."""
    if quant is None:
        return 3 * expert_width * hidden_size * dtype.itemsize
    return blob_bytes(quant, expert_width, hidden_size)


def make_blob(fmt: str, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor
              ) -> torch.Tensor:
    """The blob of `fmt` (WEIGHT_FORMATS) of gate [F, D], up [F, D], down [D, F]."""
    group = format_group(fmt)
    return int4_blob(gate, up, down, group) if group else int8_blob(gate, up, down)


def _unpack_int4(packed: torch.Tensor, n_rows: int, cols: int, group: int) -> torch.Tensor:
    """uint8 [B, n_rows * cols / 2] -> int8 [B, n_rows, cols] in -8..7 (`_pack_int4`'s inverse)."""
    b = packed.shape[0]
    byte = packed.view(b, n_rows, cols // group, group // 2).to(torch.int32)
    lo = ((byte << 28) >> 28).to(torch.int8)  # two's complement nibbles, sign-extended
    hi = ((byte << 24) >> 28).to(torch.int8)
    return torch.stack((lo, hi), dim=3).view(b, n_rows, cols)


def dequantize_blobs(blobs: torch.Tensor, fmt: str, expert_width: int, hidden_size: int,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """blobs uint8 [B, >= blob_bytes] of `fmt` -> (gate_up [B, 2F, D], down [B, D, F]) in
    `dtype`: each weight its integer times its scale in float32, rounded once to `dtype`.

    On CUDA with Triton (outside `torch.compile`'s tracing), with the blobs' scales 4-byte
    aligned: `dequantize_blobs_triton`, one pass over the bytes. Elsewhere
    `dequantize_blobs_torch`, the same bytes."""
    if dequant_kernels_run(blobs, fmt, expert_width, hidden_size):
        return dequantize_blobs_triton(blobs, fmt, expert_width, hidden_size, dtype)
    return dequantize_blobs_torch(blobs, fmt, expert_width, hidden_size, dtype)


def dequant_kernels_run(blobs: torch.Tensor, fmt: str, expert_width: int,
                        hidden_size: int) -> bool:
    """Whether `dequantize_blobs` takes these blobs through the kernels (which write only the
    compute dtype) rather than torch's float32 copies: on CUDA with Triton, outside
    `torch.compile`'s tracing, with the blobs' scales 4-byte aligned."""
    return (blobs.is_cuda and not torch.compiler.is_compiling()
            and _dequant_kernels() is not None
            and _scales_aligned(blobs, fmt, expert_width, hidden_size))


def dequantize_blobs_torch(blobs: torch.Tensor, fmt: str, expert_width: int, hidden_size: int,
                           dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`dequantize_blobs` by torch's arithmetic on any device: the integers widened to float32
    copies, multiplied by their scales, then cast (about five passes over the weights' bytes)."""
    f, d = expert_width, hidden_size
    b, n = blobs.shape[0], 3 * f * d
    blobs = blobs[:, : blob_bytes(fmt, f, d)]
    group = format_group(fmt)
    if not group:
        q = blobs[:, :n].contiguous().view(torch.int8).float()  # [B, 3FD]
        scales = _floats(blobs[:, n:])  # [B, 2F + D]
        gate_up = q[:, : 2 * f * d].view(b, 2 * f, d) * scales[:, : 2 * f, None]
        down = q[:, 2 * f * d :].view(b, d, f) * scales[:, 2 * f :, None]
        return gate_up.to(dtype), down.to(dtype)
    packed = blobs[:, : n // 2].contiguous()
    scales = _floats(blobs[:, n // 2 :])  # [B, 3FD / G]
    gate_up_q = _unpack_int4(packed[:, : f * d], 2 * f, d, group).float()  # [B, 2F, D]
    down_q = _unpack_int4(packed[:, f * d :], d, f, group).float()  # [B, D, F]
    gate_up_s = scales[:, : 2 * f * d // group].view(b, 2 * f, d // group)
    down_s = scales[:, 2 * f * d // group :].view(b, d, f // group)
    gate_up = (gate_up_q.view(b, 2 * f, d // group, group) * gate_up_s[..., None])
    down = (down_q.view(b, d, f // group, group) * down_s[..., None])
    return gate_up.view(b, 2 * f, d).to(dtype), down.view(b, d, f).to(dtype)


def _floats(scale_bytes: torch.Tensor) -> torch.Tensor:
    """uint8 [B, 4S] -> float32 [B, S]: a view where the bytes are contiguous and 4-byte
    aligned, else a copy that is (a view needs the alignment)."""
    scale_bytes = scale_bytes.contiguous()
    if scale_bytes.storage_offset() % 4 or scale_bytes.stride(0) % 4:
        # one blob's row is contiguous whatever its stride, and may sit anywhere
        scale_bytes = scale_bytes.new_empty(scale_bytes.shape).copy_(scale_bytes)
    return scale_bytes.view(torch.float32)


DEQUANT_BLOCK_R = 16  # rows of one matrix a kernel program writes
DEQUANT_BLOCK_C = 256  # and columns: a multiple of every int4 group


@functools.cache
def _dequant_kernels():
    """The Triton kernel module, or None without Triton."""
    try:
        from strata.engine.experts import _dequant_triton
    except ImportError:
        return None
    return _dequant_triton


def _scales_aligned(blobs: torch.Tensor, fmt: str, expert_width: int, hidden_size: int) -> bool:
    """Whether every blob's float32 scales start on a 4-byte boundary (the kernels load them in
    place; torch's path copies them)."""
    n = 3 * expert_width * hidden_size
    scales_at = n // 2 if format_group(fmt) else n
    return (blobs.data_ptr() + scales_at) % 4 == 0 and blobs.stride(0) % 4 == 0


def dequantize_blobs_triton(blobs: torch.Tensor, fmt: str, expert_width: int,
                            hidden_size: int, dtype: torch.dtype
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """`dequantize_blobs` by a Triton kernel (`_dequant_triton`), one launch for both matrices
    of every blob, each weight read once and written once. Under Triton's
    interpreter on the CPU (TRITON_INTERPRET=1 set before import) it is how the tests check the
    kernels without a GPU. ValueError for blobs that are not uint8 [B, >= blob_bytes] with
    contiguous bytes and 4-byte aligned scales."""
    kernels = _dequant_kernels()
    if kernels is None:
        raise RuntimeError("dequantize_blobs_triton needs Triton (pip install triton)")
    f, d = expert_width, hidden_size
    group, n = format_group(fmt), 3 * f * d
    if (blobs.dtype != torch.uint8 or blobs.dim() != 2 or blobs.shape[1] < blob_bytes(fmt, f, d)
            or blobs.stride(1) != 1 or not _scales_aligned(blobs, fmt, f, d)):
        raise ValueError(f"blobs must be uint8 [B, >= {blob_bytes(fmt, f, d)}] with contiguous "
                         f"bytes and 4-byte aligned scales, got {blobs.dtype} "
                         f"{list(blobs.shape)} with strides {list(blobs.stride())}")
    b = blobs.shape[0]
    gate_up = torch.empty((b, 2 * f, d), dtype=dtype, device=blobs.device)
    down = torch.empty((b, d, f), dtype=dtype, device=blobs.device)
    if not (b and f and d):
        return gate_up, down
    # Bytes in a blob (the module docstring's layouts): the down rows' integers, the gate and
    # up rows' scales, the down rows'.
    per_weight = 2 if group else 1  # weights a byte
    gate_up_scales_at = n // per_weight
    down_scales_at = gate_up_scales_at + 4 * (2 * f * d // group if group else 2 * f)
    tiles = (-(-2 * f // DEQUANT_BLOCK_R) * -(-d // DEQUANT_BLOCK_C)
             + -(-d // DEQUANT_BLOCK_R) * -(-f // DEQUANT_BLOCK_C))  # both matrices'
    args = (blobs, gate_up, down, blobs.stride(0), gate_up.stride(0), down.stride(0),
            2 * f * d // per_weight, gate_up_scales_at, down_scales_at, f, d)
    options = dict(BLOCK_R=DEQUANT_BLOCK_R, BLOCK_C=DEQUANT_BLOCK_C,
                   **dependent_launch.kernel_options(blobs.device))
    kernels.dequant_blobs[(tiles, b)](*args, GROUP=group, **options)
    return gate_up, down
