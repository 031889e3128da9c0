"""The elastic K/V, simulated on the books alone: grow and trim at request boundaries.

At each request the K/V must hold the request's cells (its prompt and decoded tokens). The
policy's `kv_target` says how many cells to have mapped; growing takes chunks from the free
budget first, then from the expert cache (the policy's `give_up` and `relocate`, checked and
applied as the engine does); trimming hands chunks back to the arena's unmapped chunks, lowest
first, and the policy's `refill` fills every empty backed slot. Each request starts with an
empty K/V: version 1 traces carry no parked conversations.

Units: the arena and the K/V share the device's chunk size. The K/V is `kv_segments` segments
(each layer's K and V, and for int8 cells the segments of their scales), each
`kv_segment_cell_bytes` per cell, so one chunk of a segment holds
`chunk_bytes // kv_segment_cell_bytes` cells, and mapping `c` cells takes
`kv_segments * c / cells_per_chunk` chunks. These are the engine's `KvLayout` figures
(`cell_bytes`, `n_segments`), which a trace's meta carries (`kv_dtype` names the cells): int8
cells of a model with head dim Dh are half of bf16's `kv_segment_cell_bytes`, with
ceil(2L / (Dh / 4)) more segments.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from strata.books import CheckedPolicy, apply_give_up, apply_refill
from strata.policies.kv_params import DEFAULT_FLOOR_SLOTS, KvContext
from strata.sim.result import ReplayResult

DEFAULT_CHUNK_BYTES = 2 << 20


def _positive(name: str, value: object, lowest: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
        raise ValueError(f"{name} must be an int >= {lowest}, got {value!r}")


@dataclass(frozen=True)
class KvConfig:
    """The K/V a replay simulates (`strata simulate --kv-grow`).

    `budget_bytes` is the device memory the arena and the K/V may use together; None means
    exactly what they take at start (the arena's chunks and the policy's initial cells), so
    every growth takes slots from the cache.
    """

    max_context: int
    slot_bytes: int
    kv_segment_cell_bytes: int
    kv_segments: int
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    budget_bytes: int | None = None
    floor_slots: int = DEFAULT_FLOOR_SLOTS

    def __post_init__(self) -> None:
        for name in ("max_context", "slot_bytes", "kv_segment_cell_bytes", "kv_segments",
                     "chunk_bytes"):
            _positive(name, getattr(self, name))
        _positive("floor_slots", self.floor_slots, 0)
        if self.budget_bytes is not None:
            _positive("budget_bytes", self.budget_bytes, 0)
        if self.chunk_bytes % self.kv_segment_cell_bytes:
            raise ValueError(
                f"kv_segment_cell_bytes {self.kv_segment_cell_bytes} must divide chunk_bytes "
                f"{self.chunk_bytes}: a chunk of a K/V segment holds whole cells"
            )

    @property
    def cells_per_chunk(self) -> int:
        return self.chunk_bytes // self.kv_segment_cell_bytes

    def chunks_for(self, cells: int) -> int:
        """Chunks that `cells` mapped cells take, over all segments (cells: whole chunks)."""
        return self.kv_segments * (cells // self.cells_per_chunk)


class KvSim:
    """The K/V's mapped cells and the free budget beside the books; `request` grows or trims.

    Raises (at construction):
        ValueError: the budget is below what the arena and the initial K/V take.
    """

    def __init__(self, config: KvConfig, checked: CheckedPolicy) -> None:
        table = checked.table
        self.config = config
        self.checked = checked
        self.ctx = KvContext.from_env(
            max_cells=config.max_context,
            cells_per_chunk=config.cells_per_chunk,
            n_slots=table.n_slots,
            top=table.top,
            floor_slots=min(config.floor_slots, table.top),
        )
        self.params = checked.kv_params(self.ctx)
        table.set_regions(floor=self.params.floor_slots)
        self.max_cells = self.ctx.max_mapped_cells
        self.mapped_cells = self.params.init_cells
        start_chunks = table.n_chunks + config.chunks_for(self.mapped_cells)
        start_bytes = start_chunks * config.chunk_bytes
        budget = start_bytes if config.budget_bytes is None else config.budget_bytes
        if budget < start_bytes:
            raise ValueError(
                f"budget {budget / 2**20:.1f} MiB is below what the start takes: "
                f"{table.n_chunks} arena chunks and {config.chunks_for(self.mapped_cells)} K/V "
                f"chunks ({self.mapped_cells} cells) of {config.chunk_bytes} bytes = "
                f"{start_bytes / 2**20:.1f} MiB"
            )
        self.free_chunks = (budget - start_bytes) // config.chunk_bytes

    def request(self, need_cells: int, first_step: int, result: ReplayResult) -> None:
        """Make the K/V fit a request of `need_cells` cells that starts at `first_step`."""
        if need_cells > self.config.max_context:
            raise ValueError(
                f"a request of {need_cells} cells does not fit max_context "
                f"{self.config.max_context}"
            )
        target = self.checked.kv_target(need_cells, self.mapped_cells, self.params,
                                        self.max_cells)
        if target > self.mapped_cells:
            self._grow(target, result)
        elif target < self.mapped_cells:
            self._trim(target, first_step, result)

    def _grow(self, target: int, result: ReplayResult) -> None:
        need = self.config.chunks_for(target) - self.config.chunks_for(self.mapped_cells)
        from_budget = min(self.free_chunks, need)
        from_cache = need - from_budget
        if from_cache:
            if from_cache > self.checked.view.givable_chunks():
                # The engine rolls such a growth back and carries on with the K/V it has.
                result.events["kv_shortfalls"] += 1
                return
            plan = self.checked.give_up(from_cache)
            evicted = apply_give_up(self.checked.table, plan, self.checked)
            self.free_chunks += plan.chunks.size - from_cache
            result.events["gave_up_slots"] += int(plan.slots.size)
            result.events["relocations"] += int(plan.moves.shape[0])
            n_layers = result.layer_evictions.size
            result.layer_evictions += np.bincount(evicted[:, 0], minlength=n_layers)
        self.free_chunks -= from_budget
        self.mapped_cells = target
        result.events["grows"] += 1

    def _trim(self, target: int, first_step: int, result: ReplayResult) -> None:
        """Hand chunks back and refill, all or nothing, as the engine does: the refill is asked
        with the chunks mapped (the slots they complete are what it fills), so if it raises or
        cannot be applied the chunks are unmapped again before the error propagates, and the
        K/V's figures and the counts change only once both have succeeded."""
        table = self.checked.table
        back = self.config.chunks_for(self.mapped_cells) - self.config.chunks_for(target)
        holes = np.flatnonzero(~table.chunk_mapped).astype(np.int32)[:back]
        if holes.size:
            table.mark_chunks(holes, True)
        try:
            free_slots = self.checked.view.empty_slots(0, table.n_slots)
            placements = (self.checked.refill(free_slots) if free_slots.size
                          else np.empty((0, 3), np.int64))
            apply_refill(table, placements, self.checked, why="trim")
        except BaseException:
            if holes.size:
                table.mark_chunks(holes, False)
            raise
        self.free_chunks += back - holes.size
        self.mapped_cells = target
        result.events["trims"] += 1
        if placements.size:
            result.events["refills"] += int(placements.shape[0])
            result.steps.uploads[first_step] += placements.shape[0]
