"""`KvStats`: what the elastic K/V did, since the engine started.

Cells are K/V positions; `cells_mapped` is how many leading cells every layer's K and V have
memory for now, `max_cells` the window (`--max-context`). Chunks are the memory backend's
physical chunks (2 MiB on CUDA): `fresh_chunks` were created from free budget (by growths, and
by trims for the arena's holes that the K/V's own chunks did not fill),
`returned_chunks` went back to the arena in trims, `freed_chunks` were released by trims (more
than the arena had room for). Slots are expert-cache slots.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

MIB = 1 << 20


@dataclass
class KvStats:
    """Counters of the elastic K/V; `last_failure` says why the latest growth or trim that
    failed (and was rolled back) failed, or is None."""

    cells_mapped: int
    max_cells: int
    init_cells: int
    step_cells: int
    floor_slots: int
    grows: int = 0
    trims: int = 0
    slots_given_up: int = 0
    relocated: int = 0
    refilled: int = 0
    fresh_chunks: int = 0
    returned_chunks: int = 0
    freed_chunks: int = 0
    failures: int = 0
    last_failure: str | None = None

    def copy(self) -> KvStats:
        return dataclasses.replace(self)

    def as_dict(self) -> dict[str, Any]:
        """JSON values, the issue's names first."""
        return dataclasses.asdict(self)

    def summary_line(self) -> str:
        """One line for the stats block."""
        line = (
            f"kv             {self.cells_mapped} of {self.max_cells} cells mapped (start "
            f"{self.init_cells}, step {self.step_cells}, floor {self.floor_slots} slots); "
            f"{self.grows} grows, {self.trims} trims; slots given up {self.slots_given_up}, "
            f"relocated {self.relocated}, refilled {self.refilled}; fresh chunks "
            f"{self.fresh_chunks}"
        )
        if self.failures:
            line += f"; {self.failures} failed (last: {self.last_failure})"
        return line
