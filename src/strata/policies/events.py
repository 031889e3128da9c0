"""What observers are told: `EngineInfo` once at start, then one frozen `Event` per happening.

Each event is sent with `strata_event(event)` after the books and the memory agree again.
Slots, chunks and cells are counts or indices as in `strata._residency`; experts are
(layer, expert) pairs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import pluggy


def _check_counts(event: object) -> None:
    """Int fields are counts or indices (never negative); bool fields are bools."""
    for field in dataclasses.fields(event):  # type: ignore[arg-type]
        value = getattr(event, field.name)
        if field.type == "bool":
            wrong = not isinstance(value, bool)
        elif field.type == "int":
            wrong = isinstance(value, bool) or not isinstance(value, int) or value < 0
        else:
            continue
        if wrong:
            want = "a bool" if field.type == "bool" else "an int >= 0"
            raise ValueError(f"{type(event).__name__}.{field.name} must be {want}, got {value!r}")


@dataclass(frozen=True)
class EngineInfo:
    """The engine's shape when it starts, and the policy deciding for it."""

    model: str
    device: str
    policy: str
    n_layers: int
    n_experts: int
    n_slots: int
    slot_bytes: int
    chunk_bytes: int
    max_cells: int
    mapped_cells: int
    kv_grow: bool

    def __post_init__(self) -> None:
        _check_counts(self)


@dataclass(frozen=True)
class Event:
    """Base of the events; `kind` is the event's name in traces and metrics."""

    kind: ClassVar[str] = "event"

    def __post_init__(self) -> None:
        _check_counts(self)


@dataclass(frozen=True)
class Grown(Event):
    """The K/V mapped more cells: chunks from free budget first, then from the cache."""

    kind: ClassVar[str] = "grown"
    cells_before: int
    cells_after: int
    chunks_from_budget: int
    chunks_from_cache: int


@dataclass(frozen=True)
class GaveUp(Event):
    """Slots handed their chunks to the K/V; `evicted` experts became misses."""

    kind: ClassVar[str] = "gave_up"
    slots: tuple[int, ...]
    chunks: int
    evicted: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Relocated(Event):
    """Hot experts moved out of given-up slots: (src_slot, dst_slot) each."""

    kind: ClassVar[str] = "relocated"
    moves: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Trimmed(Event):
    """The K/V gave chunks back to the arena."""

    kind: ClassVar[str] = "trimmed"
    cells_before: int
    cells_after: int
    chunks_returned: int


@dataclass(frozen=True)
class Refilled(Event):
    """Experts loaded into empty slots: (slot, layer, expert) each."""

    kind: ClassVar[str] = "refilled"
    placements: tuple[tuple[int, int, int], ...]


@dataclass(frozen=True)
class Admitted(Event):
    """Missed experts of `layer` entered the cache: (slot, layer, expert) each."""

    kind: ClassVar[str] = "admitted"
    layer: int
    placements: tuple[tuple[int, int, int], ...]


@dataclass(frozen=True)
class Evicted(Event):
    """Experts left the cache to make room for admissions: (layer, expert) each."""

    kind: ClassVar[str] = "evicted"
    experts: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Parked(Event):
    """A finished conversation's K/V was copied to host RAM."""

    kind: ClassVar[str] = "parked"
    conversation: str
    cells: int
    nbytes: int


@dataclass(frozen=True)
class Restored(Event):
    """A parked conversation's K/V was copied back for a prompt that extends it."""

    kind: ClassVar[str] = "restored"
    conversation: str
    cells: int
    nbytes: int


@dataclass(frozen=True)
class RequestStarted(Event):
    """A request begins: its prompt's tokens, of which `reused_tokens` the K/V holds already
    (the live or a restored conversation's cells), read by no forward."""

    kind: ClassVar[str] = "request_started"
    request: str
    prompt_tokens: int
    reused_tokens: int


@dataclass(frozen=True)
class RequestFinished(Event):
    """A request is done: its tokens, its time, and the cache's hits among its lookups.
    `seconds` is the whole request, `first_token_s` the part up to its first token."""

    kind: ClassVar[str] = "request_finished"
    request: str
    prompt_tokens: int
    new_tokens: int
    seconds: float
    hits: int
    lookups: int
    reused_tokens: int = 0
    first_token_s: float = 0.0


EVENTS: tuple[type[Event], ...] = (
    Grown, GaveUp, Relocated, Trimmed, Refilled, Admitted, Evicted, Parked, Restored,
    RequestStarted, RequestFinished,
)


def emit(pm: pluggy.PluginManager, event: Event) -> None:
    """Tell every `strata_event` observer about `event`."""
    pm.hook.strata_event(event=event)


def announce_start(pm: pluggy.PluginManager, info: EngineInfo) -> None:
    """Call `strata_engine_started` now, and for every plugin registered later."""
    pm.hook.strata_engine_started.call_historic(kwargs={"info": info})
