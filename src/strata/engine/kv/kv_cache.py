"""The K/V cache: one `_vmm` range, one segment per layer's K and per layer's V (and, for int8
cells, segments of their scales).

Dimension letters: N K/V cells (positions), G kv heads, Dh head dim, L layers, P scale pairs a
scale cell holds.

Layout (design.md, "the elastic K/V"; `strata.engine.model.kv_cells.KvLayout`): the range holds
`n_segments` segments of equal cells: K of layer 0, V of layer 0, K of layer 1, ... and, for
int8 cells (`--kv-dtype int8`), the scale segments after them ([N, P, G] float32: the scales of
P (layer, K|V) pairs a cell). Each segment is reserved for the whole window (`max_cells` cells
of `cell_bytes`) and rounded up to whole chunks, so growing maps the next chunks of *every*
segment, and each layer's K and V stay plain contiguous [N, G, Dh] tensors whose addresses
never move. Mapping is by whole chunks; `mapped_cells` is how many leading cells every segment
covers.

The elastic K/V (`strata.engine.kv.elastic`) moves physical chunks between this range and the
expert cache's arena: `map_cells(n, chunks=...)` maps given chunks first (their bytes are then
overwritten by zeros), and `unmap_cells(n)` hands back the chunks above what `n` cells need,
bytes intact. Both are all or nothing. Chunks keep their addresses in the range, so a view made
before a growth stays valid (over the cells it covered) after it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from strata import _vmm
from strata.engine.memory import backend_limit, device_backend
from strata.engine.model.kv_cells import KvLayout, LayerCells
from strata.machine import bytes_text

__all__ = ["KVCache", "new_kv"]


class KVCache:
    """Per-layer K and V tensors [N, G, Dh] living in one virtual-memory range.

    `dtype` is the model's (what attention reads the cells into); `cell_dtype` what the cells
    hold (None: `dtype`; bf16, fp32, or int8 with a float32 scale per cell and kv head).
    `mapped_cells=None` maps the whole window at construction; a smaller value maps just enough
    chunks for that many cells, `map_cells` maps more later and `unmap_cells` gives chunks back
    (the elastic K/V). Newly mapped cells are zeroed (scales too), so masked-out cells never
    hold NaN bit patterns.
    """

    def __init__(
        self,
        backend: _vmm.Backend,
        n_layers: int,
        max_cells: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        *,
        mapped_cells: int | None = None,
        cell_dtype: torch.dtype | None = None,
    ) -> None:
        for name, value in (("n_layers", n_layers), ("max_cells", max_cells),
                            ("n_kv_heads", n_kv_heads), ("head_dim", head_dim)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.backend = backend
        self.n_layers = n_layers
        self.max_cells = max_cells
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.layout = KvLayout(n_layers, n_kv_heads, head_dim,
                               dtype if cell_dtype is None else cell_dtype)
        self.cell_dtype = self.layout.cell_dtype
        self.chunk_bytes = backend.chunk_bytes
        self.cell_bytes = self.layout.cell_bytes
        # Each segment spans whole chunks so that it starts on a chunk boundary.
        self.segment_chunks = self.layout.segment_chunks(max_cells, self.chunk_bytes)
        self.segment_bytes = self.segment_chunks * self.chunk_bytes
        window_bytes = self.n_segments * self.segment_bytes
        limit = backend_limit(backend)
        if window_bytes > limit.nbytes:
            # Every cell of the window may be mapped: one that could never be is refused
            # before anything is reserved.
            raise ValueError(
                f"a K/V of {max_cells:,} cells needs {bytes_text(window_bytes)}, more than "
                f"{limit}"
            )
        self._range = backend.reserve(window_bytes)
        self._mapped_chunks = 0  # per segment: chunks [0, _mapped_chunks) are mapped
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []
        self._scales: list[torch.Tensor] = []  # per scale segment [N, P, G] float32
        try:
            self.map_cells(max_cells if mapped_cells is None else mapped_cells)
        except BaseException:
            self._range.close()
            raise

    @property
    def mapped_cells(self) -> int:
        """Leading cells of every segment that are backed by memory."""
        return min(self.max_cells, self._mapped_chunks * self.chunk_bytes // self.cell_bytes)

    @property
    def mapped_chunks(self) -> int:
        """Chunks mapped in each segment: [0, mapped_chunks) of every one."""
        return self._mapped_chunks

    @property
    def n_segments(self) -> int:
        """2 * L (the K and the V of every layer), and int8's scale segments after them."""
        return self.layout.n_segments

    @property
    def bytes_mapped(self) -> int:
        return self._range.bytes_mapped

    def chunks_for(self, n_cells: int) -> int:
        """Chunks of one segment that cells [0, n_cells) need (n_cells in [0, max_cells])."""
        if not 0 <= n_cells <= self.max_cells:
            raise ValueError(f"n_cells {n_cells} is out of range [0, {self.max_cells}]")
        return -(-n_cells * self.cell_bytes // self.chunk_bytes)

    def map_cells(self, n_cells: int, chunks: Sequence[_vmm.Chunk] | None = None) -> int:
        """Map the chunks that cells [0, n_cells) need in every segment; zero the new cells.

        `chunks` (unmapped chunks of this K/V's backend) are used first, segment by segment in
        order (K of layer 0, V of layer 0, ..., then int8's scale segments), then new ones are
        created. Returns how many chunks were mapped over all segments. All or nothing: if a
        mapping fails, the chunks this call mapped are unmapped again, those it created are
        released, and the given ones are unmapped and the caller's again (bytes intact). Cells
        already mapped are left as they are.
        """
        return self._map(n_cells, list(chunks) if chunks is not None else [], zero=True)

    def remap_cells(self, n_cells: int, chunks: Sequence[_vmm.Chunk]) -> None:
        """Undo `unmap_cells`: map `chunks` (exactly those it returned) back where they were,
        bytes kept (nothing is zeroed), so that cells [0, n_cells) are mapped as before.

        All or nothing, as `map_cells`; ValueError unless `chunks` fill the gap exactly.
        """
        chunks = list(chunks)
        need = (self.chunks_for(n_cells) - self._mapped_chunks) * self.n_segments
        if len(chunks) != max(0, need):
            raise ValueError(f"remap_cells: {len(chunks)} chunks given; cells [0, {n_cells}) "
                             f"need {max(0, need)} more")
        self._map(n_cells, chunks, zero=False)

    def _map(self, n_cells: int, given: list[_vmm.Chunk], *, zero: bool) -> int:
        need = self.chunks_for(n_cells)
        grow = max(0, need - self._mapped_chunks)
        if len(given) > grow * self.n_segments:
            raise ValueError(
                f"{len(given)} chunks given, but cells [0, {n_cells}) need only "
                f"{grow * self.n_segments} more ({grow} in each of {self.n_segments} segments)"
            )
        if not grow:
            return 0
        old_chunks, old_cells = self._mapped_chunks, self.mapped_cells
        done: list[int] = []
        try:
            for segment in range(self.n_segments):
                base = segment * self.segment_chunks
                mine = given[segment * grow : (segment + 1) * grow]
                self._range.map(base + old_chunks, base + need, chunks=mine)
                done.append(base)
        except BaseException:
            # Range.map rolled back the failing segment itself; undo the segments done. The
            # chunks they created drop here (released); the given ones are the caller's.
            for base in done:
                self._range.unmap(base + old_chunks, base + need)
            raise
        self._mapped_chunks = need
        self._rebuild_views()
        if zero:
            for cells in (*self._k, *self._v, *self._scales):
                cells[old_cells:].zero_()
        return grow * self.n_segments

    def unmap_cells(self, n_cells: int) -> list[_vmm.Chunk]:
        """Unmap the chunks of every segment above what cells [0, n_cells) need; return them.

        The chunks come in segment order, each segment's in index order, bytes intact; the
        caller owns them (dropping one frees it). Views are re-made over the cells left: views
        taken before this call must not be used for the cells given up. All or nothing: if a
        segment fails to unmap, the segments already unmapped are mapped back with their chunks.
        """
        keep = self.chunks_for(n_cells)
        if keep >= self._mapped_chunks:
            return []
        old_chunks = self._mapped_chunks
        taken: list[list[_vmm.Chunk]] = []
        try:
            for segment in range(self.n_segments):
                base = segment * self.segment_chunks
                taken.append(self._range.unmap(base + keep, base + old_chunks))
        except BaseException:
            for segment, chunks in enumerate(taken):
                base = segment * self.segment_chunks
                self._range.map(base + keep, base + old_chunks, chunks=chunks)
            raise
        self._mapped_chunks = keep
        self._rebuild_views()
        return [chunk for segment in taken for chunk in segment]

    def _rebuild_views(self) -> None:
        n, layout = self.mapped_cells, self.layout
        shape = (n, self.n_kv_heads, self.head_dim)
        self._k, self._v, self._scales = [], [], []
        if not n:
            return
        for layer in range(self.n_layers):
            k_offset = 2 * layer * self.segment_bytes
            self._k.append(self._range.view(k_offset, shape, self.cell_dtype))
            self._v.append(self._range.view(k_offset + self.segment_bytes, shape,
                                            self.cell_dtype))
        for segment in range(layout.value_segments, layout.n_segments):
            self._scales.append(self._range.view(
                segment * self.segment_bytes, (n, layout.scale_pairs, self.n_kv_heads),
                torch.float32))

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.n_layers:
            raise IndexError(f"layer {layer} is out of range [0, {self.n_layers})")
        if not self._k:
            raise ValueError("no K/V cells are mapped (closed, or call map_cells first)")

    def k(self, layer: int) -> torch.Tensor:
        """Keys of `layer` as the cells hold them (`cell_dtype`, int8: without their scales): a
        view [mapped_cells, G, Dh] whose address never moves."""
        self._check_layer(layer)
        return self._k[layer]

    def v(self, layer: int) -> torch.Tensor:
        """Values of `layer`, as `k`."""
        self._check_layer(layer)
        return self._v[layer]

    def scales(self) -> list[torch.Tensor]:
        """The scale segments' views [mapped_cells, P, G] float32 (int8 cells; else none)."""
        if self.layout.quantized:
            self._check_layer(0)
        return list(self._scales)

    def layer(self, layer: int) -> LayerCells:
        """What attention reads and writes of `layer`: its K and V, and int8's scales
        ([mapped_cells, G] float32 views, row `layout.scale_row` of a scale segment)."""
        self._check_layer(layer)
        if not self.layout.quantized:
            return LayerCells(self._k[layer], self._v[layer])
        first = self.layout.value_segments
        (k_segment, k_row), (v_segment, v_row) = (self.layout.scale_row(layer, kv)
                                                  for kv in (0, 1))
        return LayerCells(self._k[layer], self._v[layer],
                          self._scales[k_segment - first][:, k_row],
                          self._scales[v_segment - first][:, v_row])

    @property
    def closed(self) -> bool:
        return self._range.closed

    def close(self) -> None:
        """Unmap and release everything; the views must not be used afterwards (one kept
        reads zeros on the host and faults on CUDA, and its addresses stay reserved until it is
        freed: `Range.view`). Idempotent."""
        self._k, self._v, self._scales = [], [], []
        self._range.close()

    def __enter__(self) -> KVCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def new_kv(model, max_cells: int, cell_dtype: torch.dtype | None = None) -> KVCache:
    """A K/V of `max_cells` cells for `model` (a `MoEModel`), mapped whole, on its device, its
    cells in `cell_dtype` (None: the model's dtype)."""
    cfg = model.config
    return KVCache(device_backend(model.device), cfg.n_layers, max_cells, cfg.n_kv_heads,
                   cfg.head_dim, model.dtype, cell_dtype=cell_dtype)
