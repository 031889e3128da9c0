"""The K/V's cells as attention reads and writes them: their dtype, the segments they take, and
int8's quantization.

Dimension letters: T tokens written, N cells (positions), G kv heads, Dh head dim, L layers,
P scale pairs a scale cell holds.

`--kv-dtype` names the cells' dtype: `auto` (the model's, as before the option), `bf16`, or
`int8`. The model computes in its own dtype whatever the cells hold: a layer's attended cells
are read into it (`LayerCells.read`).

Segments (`KvLayout`): the K/V is `n_segments` segments of equal cells (`cell_bytes` each),
so that every chunk and cell figure is one number a segment, whatever the dtype:
- bf16 or fp32 cells: 2 * L segments, K of layer 0, V of layer 0, K of layer 1, ... each
  [N, G, Dh] in the cells' dtype;
- int8 cells: the same 2 * L segments of int8 values [N, G, Dh] (G * Dh bytes a cell), then
  the scale segments: the float32 scale of every (cell, kv head) of the K and the V of every
  layer, one (layer, K|V) pair a [G] row, P = Dh / 4 pairs a cell (4 * G * P = G * Dh bytes:
  the values' cell size), pair 2 * l + (0 for K, 1 for V) at row (2l + kv) % P of scale
  segment (2l + kv) // P. ceil(2L / P) scale segments; rows past 2L in the last are unused
  but mapped (and counted). A cell of the whole K/V is then 2L * G * Dh * (1 + 4 / Dh)
  bytes at most one scale segment over, about 0.53x bf16's at Dh = 128.

int8 (`quantize`): each written row [Dh] of a (cell, kv head) is stored as round(x / s)
in [-127, 127] with s = absmax / 127 (s = 0 and the row all 0 for a zero row), so each value
is within s / 2 of what it was; reads (`dequantize`) compute q * s in float32 and round once
to the model's dtype, the attended cells [0, n_ctx) of a layer at a time (K and V in the
model's dtype: `read_copy_bytes`, counted in the budget's workspace), then attention runs the
same fused calls as over bf16 cells. Deterministic: no atomics, the same bytes for the same
input.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = [
    "CELL_DTYPES",
    "KV_DTYPES",
    "KvLayout",
    "LayerCells",
    "cell_dtype_of",
    "dequantize",
    "kv_dtype_name",
    "quantize",
    "read_copy_bytes",
]

# `--kv-dtype`'s values; `auto` is the model's own dtype.
KV_DTYPES = ("auto", "bf16", "int8")
# The dtypes cells may hold: the model's (bf16 or fp32), or int8 with scales.
CELL_DTYPES = (torch.bfloat16, torch.float32, torch.int8)
SCALE_DTYPE = torch.float32
QMAX = 127  # int8 values are in [-QMAX, QMAX]: symmetric, so -x quantizes to -q


def cell_dtype_of(kv_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cells' dtype that `--kv-dtype kv_dtype` names for a model computing in
    `model_dtype`; ValueError naming the value and the allowed ones."""
    if kv_dtype == "auto":
        if model_dtype not in CELL_DTYPES[:2]:
            raise ValueError(f"--kv-dtype auto: the model's dtype {model_dtype} cannot be a K/V "
                             "cell's; K/V cells are bf16, fp32 (the model's) or int8")
        return model_dtype
    if kv_dtype == "bf16":
        return torch.bfloat16
    if kv_dtype == "int8":
        return torch.int8
    raise ValueError(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")


def kv_dtype_name(cell_dtype: torch.dtype) -> str:
    """`bfloat16`, `float32` or `int8`: the name reports give cells of `cell_dtype` (torch's,
    as they name the model's dtype)."""
    return str(cell_dtype).removeprefix("torch.")


def _element_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class KvLayout:
    """The segments of a K/V of `n_layers` layers, `n_kv_heads` heads of `head_dim` in cells of
    `cell_dtype` (see the module): what `KVCache` maps, and what the budget, the elastic K/V's
    plan and the simulator count. ValueError for a dtype cells cannot hold or int8 cells whose
    scales would not tile a cell."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    cell_dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("n_layers", "n_kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.cell_dtype not in CELL_DTYPES:
            raise ValueError(f"K/V cells cannot be {self.cell_dtype}; they are bf16, fp32 or "
                             "int8")
        if self.quantized and self.head_dim % 4:
            raise ValueError(f"int8 K/V cells need a head dim divisible by 4 (a cell's float32 "
                             f"scales tile its values' bytes), got {self.head_dim}; use "
                             "--kv-dtype auto or bf16")

    @classmethod
    def of(cls, config, cell_dtype: torch.dtype) -> KvLayout:
        """The layout of a model of `config` (a `ModelConfig`) with cells of `cell_dtype`."""
        return cls(config.n_layers, config.n_kv_heads, config.head_dim, cell_dtype)

    @property
    def quantized(self) -> bool:
        return self.cell_dtype == torch.int8

    @property
    def name(self) -> str:
        return kv_dtype_name(self.cell_dtype)

    @property
    def cell_bytes(self) -> int:
        """Bytes of one cell of every segment (values and scales alike)."""
        return self.n_kv_heads * self.head_dim * _element_bytes(self.cell_dtype)

    @property
    def value_segments(self) -> int:
        """2 * L: the K and the V of every layer."""
        return 2 * self.n_layers

    @property
    def scale_pairs(self) -> int:
        """P: the (layer, K|V) pairs whose [G] float32 scales one scale cell holds (0: none)."""
        return self.head_dim // 4 if self.quantized else 0

    @property
    def scale_segments(self) -> int:
        """Segments of scales after the values': ceil(2L / P) for int8, else 0."""
        pairs = self.scale_pairs
        return -(-self.value_segments // pairs) if pairs else 0

    @property
    def n_segments(self) -> int:
        return self.value_segments + self.scale_segments

    @property
    def bytes_per_cell(self) -> int:
        """Bytes one cell takes over every segment: what parking a cell copies."""
        return self.n_segments * self.cell_bytes

    def scale_row(self, layer: int, kv: int) -> tuple[int, int]:
        """(segment, row) of the scales of `layer`'s K (kv 0) or V (kv 1)."""
        pair = 2 * layer + kv
        return self.value_segments + pair // self.scale_pairs, pair % self.scale_pairs

    def cells_per_chunk(self, chunk_bytes: int) -> int:
        """Cells of one segment in a chunk; 0 when cells do not tile chunks."""
        return chunk_bytes // self.cell_bytes if chunk_bytes % self.cell_bytes == 0 else 0

    def segment_chunks(self, n_cells: int, chunk_bytes: int) -> int:
        """Chunks of one segment that cells [0, n_cells) need."""
        return -(-n_cells * self.cell_bytes // chunk_bytes)

    def mapped_bytes(self, n_cells: int, chunk_bytes: int) -> int:
        """Bytes cells [0, n_cells) map over every segment: whole chunks of each."""
        return self.n_segments * self.segment_chunks(n_cells, chunk_bytes) * chunk_bytes


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., Dh] -> (q int8 [..., Dh], scale float32 [...]): per row, s = absmax / 127 and
    q = round(x / s), so |x - q * s| <= s / 2 (a zero row: s = 0, q = 0)."""
    x = x.float()
    # Times the float32 reciprocal, not divided by QMAX: CUDA divides a tensor by a scalar that
    # way, the CPU does not, and the two would differ in the last bit of some scales.
    scale = x.abs().amax(dim=-1) * (1.0 / QMAX)  # [...]
    # A zero row divides by 1 instead of 0: its q is 0 all the same, and no NaN is made.
    step = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)
    q = torch.round(x / step).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q int8 [..., Dh] and scale float32 [...] -> [..., Dh] in `dtype`: q * s computed in
    float32 and rounded once as it is stored, with no float32 copy of the cells made (the
    product's type is float32; `out` in `dtype` takes it element by element)."""
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    return torch.mul(q, scale.unsqueeze(-1), out=out)


def read_copy_bytes(layout: KvLayout, n_cells: int, dtype: torch.dtype) -> int:
    """Bytes one layer's read of `n_cells` cells makes in `dtype` beyond the cells' views: none
    when they are in `dtype`; else K and V in `dtype` (`dequantize` makes no float32 copy)."""
    if layout.cell_dtype == dtype:
        return 0
    return 2 * n_cells * layout.n_kv_heads * layout.head_dim * _element_bytes(dtype)


class LayerCells(NamedTuple):
    """One layer's cells: k, v [N, G, Dh] (the cells' dtype) and, for int8, k_scale, v_scale
    float32 [N, G] (else None). N is the mapped cells; views whose addresses never move."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    def write(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [T, G, Dh] at cells `positions` [T] (distinct: each cell is written once,
        so index_copy_ is deterministic)."""
        if self.k_scale is None:
            self.k.index_copy_(0, positions, k.to(self.k.dtype))
            self.v.index_copy_(0, positions, v.to(self.v.dtype))
            return
        for values, scales, rows in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            q, scale = quantize(rows)  # [T, G, Dh], [T, G]
            values.index_copy_(0, positions, q)
            scales.index_copy_(0, positions, scale)

    def read(self, n_ctx: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of cells [0, n_ctx) in `dtype`, [N, G, Dh] each: the views
        themselves when the cells are in `dtype` (no copy), else converted copies."""
        k, v = self.k[:n_ctx], self.v[:n_ctx]
        if self.k_scale is not None:
            return (dequantize(k, self.k_scale[:n_ctx], dtype),
                    dequantize(v, self.v_scale[:n_ctx], dtype))
        if k.dtype != dtype:
            return k.to(dtype), v.to(dtype)
        return k, v
