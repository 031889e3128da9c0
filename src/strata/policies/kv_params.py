"""The elastic K/V figures a policy decides: cells mapped at start, the growth step, the floor.

Cells are K/V positions. The K/V range is reserved for `max_cells`; the engine maps it in whole
chunks of every layer's K and V segment, so cell counts it maps are multiples of `cells_per_chunk`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from strata import settings

DEFAULT_INIT_CELLS = 16384
DEFAULT_STEP_CELLS = 8192
DEFAULT_FLOOR_SLOTS = 128

ENV_INIT = settings.KV_GROW_INIT
ENV_STEP = settings.KV_GROW_STEP
ENV_FLOOR = settings.KV_GROW_FLOOR


def _require_int(name: str, value: object, lowest: int) -> None:
    # bool is an int subclass; True cells is a bug, not a count.
    if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
        raise ValueError(f"{name} must be an integer >= {lowest}, got {value!r}")


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KvParams:
    """A policy's answer to `kv_params`: cells mapped at start, the growth step, the floor.

    `floor_slots` is the fewest expert-cache slots the cache keeps: slots below it are never
    given up to the K/V.
    """

    init_cells: int
    step_cells: int
    floor_slots: int

    def __post_init__(self) -> None:
        _require_int("init_cells", self.init_cells, 1)
        _require_int("step_cells", self.step_cells, 1)
        _require_int("floor_slots", self.floor_slots, 0)


@dataclass(frozen=True)
class KvContext:
    """What the engine knows when it asks `kv_params`.

    `floor_slots` is the engine's own floor (its default or a command-line value); the
    `env_*` fields are the `STRATA_KV_GROW_INIT` / `_STEP` / `_FLOOR` overrides, None when unset.
    """

    max_cells: int
    cells_per_chunk: int
    n_slots: int
    top: int
    floor_slots: int = DEFAULT_FLOOR_SLOTS
    env_init_cells: int | None = None
    env_step_cells: int | None = None
    env_floor_slots: int | None = None

    def __post_init__(self) -> None:
        _require_int("max_cells", self.max_cells, 1)
        _require_int("cells_per_chunk", self.cells_per_chunk, 1)
        _require_int("n_slots", self.n_slots, 0)
        _require_int("top", self.top, 0)
        _require_int("floor_slots", self.floor_slots, 0)
        if self.top > self.n_slots:
            raise ValueError(f"top {self.top} is past the last slot (n_slots {self.n_slots})")
        for name, lowest in (("env_init_cells", 1), ("env_step_cells", 1),
                             ("env_floor_slots", 0)):
            value = getattr(self, name)
            if value is not None:
                _require_int(name, value, lowest)

    @property
    def max_mapped_cells(self) -> int:
        """The most cells the K/V can map: `max_cells` rounded up to whole chunks."""
        return ceil_div(self.max_cells, self.cells_per_chunk) * self.cells_per_chunk

    @classmethod
    def from_env(
        cls,
        *,
        max_cells: int,
        cells_per_chunk: int,
        n_slots: int,
        top: int,
        floor_slots: int = DEFAULT_FLOOR_SLOTS,
        environ: Mapping[str, str] | None = None,
    ) -> KvContext:
        """A context with the `STRATA_KV_GROW_*` overrides read from `environ` (os.environ)
        through `strata.settings`; SettingError (a ValueError) names a bad variable."""
        read = settings.read(environ)
        return cls(
            max_cells=max_cells,
            cells_per_chunk=cells_per_chunk,
            n_slots=n_slots,
            top=top,
            floor_slots=floor_slots,
            env_init_cells=read.kv_grow_init,
            env_step_cells=read.kv_grow_step,
            env_floor_slots=read.kv_grow_floor,
        )


def default_kv_params(ctx: KvContext) -> KvParams:
    """16384 cells at start, steps of 8192, the engine's floor; the environment overrides each.

    Cells are rounded up to whole chunks (and init capped at the window); the floor is capped
    at `top`, since the loan region is never given up anyway.
    """
    per_chunk = ctx.cells_per_chunk
    init = ctx.env_init_cells or DEFAULT_INIT_CELLS
    step = ctx.env_step_cells or DEFAULT_STEP_CELLS
    floor = ctx.floor_slots if ctx.env_floor_slots is None else ctx.env_floor_slots
    return KvParams(
        init_cells=min(ceil_div(init, per_chunk) * per_chunk, ctx.max_mapped_cells),
        step_cells=ceil_div(step, per_chunk) * per_chunk,
        floor_slots=min(floor, ctx.top),
    )


def default_kv_target(need_cells: int, mapped_cells: int, params: KvParams) -> int:
    """Grow by whole steps to cover the need; trim to the step grid once two steps are spare.

    Trimming waits until `mapped >= need + 2 * step` so that requests alternating around a step
    boundary do not map and unmap the same chunks each time; it trims to the smallest
    `init + k * step` that covers the need.
    """
    step = params.step_cells
    if need_cells > mapped_cells:
        return mapped_cells + ceil_div(need_cells - mapped_cells, step) * step
    if mapped_cells >= need_cells + 2 * step:
        init = params.init_cells
        return init + ceil_div(max(need_cells - init, 0), step) * step
    return mapped_cells
