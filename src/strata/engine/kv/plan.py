"""`--kv-grow`: whether the elastic K/V applies, its figures, and starting it beside the cache.

Units: cells are K/V positions; chunks are the memory backend's physical chunks; slots are
expert-cache slots. A K/V segment (one layer's K or V, or int8's scales: `KvLayout`) holds
`cells_per_chunk` cells a chunk, the same in every segment.

Planning (before the model loads, `plan_kv_grow`):
- asked for by `--kv-grow` or `STRATA_KV_GROW=1`; it applies with one device, a profile, and the
  whole K/V in device memory (strata keeps the K/V on the device always), and when K/V cells
  tile the chunks; otherwise it is ignored, with a one-line reason;
- the policy's `kv_params` gives the cells mapped at start, the step and the floor
  (`STRATA_KV_GROW_INIT` / `_STEP` / `_FLOOR` override the default policy's; a value that is not
  a positive integer is an error naming the variable);
- the cache is sized around the mapped cells, so it gets the slots the rest of the window would
  have taken;
- the whole window must stay reachable (`--max-context` cells always fit, as without the
  flag): free budget plus the chunks of the slots between the floor and the loan region must
  hold the K/V past the start cells; if they do not, more cells are mapped at start (whole
  steps: the cache gets fewer slots) until they do. If no start short of the whole window does
  (a cache of 0 slots, `top` at the floor, or too little between them), the cache is sized
  around the whole window, mapped up front, and a budget too small for that stops the run with
  how much memory is missing.

Starting (after the cache is filled, `start_elastic`): the K/V range is reserved on the arena's
backend for the whole window with the start cells mapped, the floor is set in the books, and the
free budget left is counted in chunks.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from strata import _vmm
from strata.books.checked import POLICY_FAULTS
from strata.books.validate import check_kv_params
from strata.engine.cache.budget import CacheBudget, size_text
from strata.engine.cache.build import CacheConfig, plan_cache
from strata.engine.cache.cached_experts import CachedExperts
from strata.engine.cache.loan import DEFAULT_MAX_FRACTION, _keep_slots_from_env, loan_slots
from strata.engine.cache.prompt_chunk import PREFILL_CHUNKS
from strata.engine.kv.elastic import ElasticKV
from strata.engine.kv.kv_cache import KVCache
from strata.engine.memory import given_or_own_backend
from strata.engine.model.config import ModelConfig
from strata.engine.model.kv_cells import KvLayout
from strata.policies import (
    DEFAULT_POLICY,
    KvContext,
    KvParams,
    Policy,
    PolicyError,
    load_registry,
)

__all__ = [
    "ENV_KV_GROW",
    "KvGrowConfig",
    "KvGrowPlan",
    "ask_kv_params",
    "cells_per_chunk",
    "kv_grow_requested",
    "plan_elastic_cache",
    "plan_kv_grow",
    "start_elastic",
]

ENV_KV_GROW = "STRATA_KV_GROW"


def kv_grow_requested(flag: bool, environ: Mapping[str, str] | None = None) -> bool:
    """`--kv-grow`, or `STRATA_KV_GROW=1` in `environ` (os.environ), read and checked by
    `strata.settings`: SettingError (a ValueError) naming the variable for another value."""
    from strata import settings

    return settings.read(environ).kv_grow or bool(flag)


def cells_per_chunk(config: ModelConfig, cell_dtype: torch.dtype, chunk_bytes: int) -> int:
    """Cells of one K/V segment in a chunk, for cells of `cell_dtype`; 0 when cells do not
    tile chunks."""
    return KvLayout.of(config, cell_dtype).cells_per_chunk(chunk_bytes)


def ask_kv_params(policy: Policy, ctx: KvContext) -> KvParams:
    """The policy's checked `kv_params` (PolicyError naming it for a wrong answer or a raise)."""
    name = policy.name or type(policy).__name__
    try:
        answer = policy.kv_params(ctx)
    except PolicyError:
        raise
    except POLICY_FAULTS as exc:
        raise PolicyError(name, "kv_params", exc, f"raised {type(exc).__name__}: {exc}") from exc
    return check_kv_params(ctx, name, answer)


@dataclass(frozen=True)
class KvGrowConfig:
    """The elastic K/V to start beside the cache: the model's K/V shape, its dtype (`dtype`)
    and the cells' (`cell_dtype`, None: `dtype`), the window (`max_cells`) and the policy's
    figures."""

    n_layers: int
    max_cells: int
    n_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    params: KvParams
    cell_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for name in ("n_layers", "max_cells", "n_kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.params, KvParams):
            raise ValueError(f"params must be a KvParams, got {type(self.params).__name__}")
        KvLayout(self.n_layers, self.n_kv_heads, self.head_dim,
                 self.dtype if self.cell_dtype is None else self.cell_dtype)  # ValueError

    @property
    def init_cells(self) -> int:
        """Cells mapped at start: the policy's, at most the window."""
        return min(self.params.init_cells, self.max_cells)


@dataclass
class KvGrowPlan:
    """What `plan_kv_grow` decided: the budget to size the cache with, the elastic K/V to start
    (None: the whole window is mapped up front, as without the flag) and notes to print."""

    budget: CacheBudget
    kv_grow: KvGrowConfig | None
    notes: list[str] = field(default_factory=list)


def plan_kv_grow(
    config: ModelConfig,
    dtype: torch.dtype,
    *,
    policy: Policy | None,
    max_context: int,
    chunk_bytes: int,
    make_budget: Callable[[int], CacheBudget],
    loan_region: Callable[[int], int],
    profile: bool,
    environ: Mapping[str, str] | None = None,
    cell_dtype: torch.dtype | None = None,
) -> KvGrowPlan:
    """Plan the elastic K/V for `--kv-grow` (asked for: check `kv_grow_requested` first), its
    cells in `cell_dtype` (None: `dtype`, the model's).

    `make_budget(kv_cells)` sizes the cache with that many K/V cells mapped (ValueError saying
    how much is missing when too small); `loan_region(n_slots)` is how many top slots the prompt
    loan of a cache of `n_slots` lends (0 without the loan). Raises ValueError for a bad
    `STRATA_KV_GROW_*` value or a budget too small, PolicyError for a wrong `kv_params`.
    """
    policy = policy or load_registry().create(DEFAULT_POLICY)
    layout = KvLayout.of(config, dtype if cell_dtype is None else cell_dtype)
    per_chunk = layout.cells_per_chunk(chunk_bytes)
    ignored = None
    if not profile:
        ignored = "it needs --expert-profile (the refill after a trim comes from the profile)"
    elif per_chunk == 0:
        ignored = f"K/V cells do not tile the memory's {chunk_bytes}-byte chunks"
    if ignored is not None:
        return KvGrowPlan(make_budget(max_context), None, [f"--kv-grow ignored: {ignored}"])

    def context(n_slots: int) -> KvContext:
        top = n_slots - loan_region(n_slots)
        return KvContext.from_env(max_cells=max_context, cells_per_chunk=per_chunk,
                                  n_slots=n_slots, top=top, environ=environ)

    # Asked once to size the cache (with the most slots a cache can have), once sized.
    most_slots = config.n_layers * config.n_experts
    init = min(ask_kv_params(policy, context(most_slots)).init_cells, max_context)
    budget = make_budget(init)
    params = ask_kv_params(policy, context(budget.n_slots))
    if min(params.init_cells, max_context) != init:
        name = policy.name or type(policy).__name__
        raise PolicyError(name, "kv_params", params,
                          f"init_cells {params.init_cells} differs from the {init} it gave "
                          "before the cache was sized: it must not depend on the cache's size")
    window = _Window(layout.n_segments, max_context, layout.cell_bytes, chunk_bytes,
                     params.floor_slots, loan_region)
    start, start_budget = window.start(init, budget, params.step_cells, make_budget)
    if start < max_context or init == max_context:
        if start != init:
            params = KvParams(start, params.step_cells, params.floor_slots)
        shape = KvGrowConfig(config.n_layers, max_context, config.n_kv_heads,
                             config.head_dim, dtype, params, cell_dtype)
        return KvGrowPlan(start_budget, shape, window.notes(start, init, start_budget, params))
    top = window.top_of(budget)
    floor = params.floor_slots
    if budget.n_slots > 0 and top > floor:
        why = (f"free budget and slots [{floor}, {top}) can give "
               f"{size_text(window.reachable_bytes(budget))} of the "
               f"{size_text(window.rest_bytes(init))} the rest of the window needs")
    else:
        why = _why_not(budget.n_slots, top, floor)
    whole = make_budget(max_context)  # ValueError: how much memory is missing
    return KvGrowPlan(whole, None, [
        f"--kv-grow: the cache cannot give memory to the K/V ({why}): elastic K/V off for this "
        f"run, the whole window ({max_context} cells) is mapped up front"])


@dataclass(frozen=True)
class _Window:
    """The window's arithmetic for a plan: `n_segments` K/V segments of `max_cells` cells of
    `cell_bytes`, in chunks of `chunk_bytes`; the cache keeps `floor` slots and the prompt loan
    of a cache of n slots lends `loan_region(n)` of them."""

    n_segments: int
    max_cells: int
    cell_bytes: int
    chunk_bytes: int
    floor: int
    loan_region: Callable[[int], int]

    def rest_bytes(self, cells: int) -> int:
        """The window's K/V beyond `cells` mapped: whole chunks of every segment."""
        chunk = self.chunk_bytes
        segment_chunks = [-(-n * self.cell_bytes // chunk) for n in (cells, self.max_cells)]
        return self.n_segments * (segment_chunks[1] - segment_chunks[0]) * chunk

    def top_of(self, budget: CacheBudget) -> int:
        """The first slot of the loan region of a cache sized by `budget`."""
        return budget.n_slots - self.loan_region(budget.n_slots)

    def reachable_bytes(self, budget: CacheBudget) -> int:
        """What growth can map past the start: free budget, then the chunks that slots
        [floor, top) hold whole (a chunk shared with a kept slot stays)."""
        chunk = self.chunk_bytes
        spare = (budget.available_bytes - budget.arena_bytes) // chunk
        lo = -(-self.floor * budget.slot_bytes // chunk)
        hi = self.top_of(budget) * budget.slot_bytes // chunk
        return (spare + max(0, hi - lo)) * chunk

    def start(self, init: int, budget: CacheBudget, step: int,
              make_budget: Callable[[int], CacheBudget]) -> tuple[int, CacheBudget]:
        """(cells mapped at start, the budget sized for them): `init`, or more by whole steps.

        The window must stay reachable: --max-context cells always fit, as without the flag.
        When free budget and the givable slots cannot hold the rest of it, more cells are
        mapped at start, which leaves the cache fewer slots; `max_cells` when no start short of
        the window does."""
        while init < self.max_cells and self.reachable_bytes(budget) < self.rest_bytes(init):
            init = min(init + step, self.max_cells)
            if init < self.max_cells:
                try:
                    budget = make_budget(init)
                except ValueError:  # too small: the whole window says how much is missing
                    init = self.max_cells
        return init, budget

    def notes(self, start: int, asked: int, budget: CacheBudget, params: KvParams) -> list[str]:
        """The lines to print for a plan mapping `start` cells at start (`asked` asked for)."""
        notes = [f"elastic K/V: {start} of {self.max_cells} cells mapped at start, steps of "
                 f"{params.step_cells}, the cache keeps at least {self.floor} slots"]
        if start != asked:
            notes.append(f"--kv-grow: {start} cells mapped at start, not {asked}: with fewer, "
                         "the free budget and the slots between the floor and the loan region "
                         f"could not hold the rest of the {self.max_cells}-cell window")
        top = self.top_of(budget)
        if start < self.max_cells and not (budget.n_slots > 0 and top > self.floor):
            notes.append("--kv-grow: the cache cannot give memory to the K/V ("
                         + _why_not(budget.n_slots, top, self.floor) + "); the K/V grows into "
                         "free budget only")
        return notes


def _why_not(n_slots: int, top: int, floor: int) -> str:
    """Why a cache of `n_slots` slots, `top` below its loan region, can give nothing."""
    if n_slots == 0:
        return "a cache of 0 slots"
    return f"its {top} slots below the loan are at the floor of {floor}"


def plan_elastic_cache(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    *,
    profile: bool,
    max_context: int,
    prefill_chunk: int | None,
    budget_mib: float | None = None,
    reserve_mib: float | None = None,
    expert_cache_mib: float | None = None,
    backend: _vmm.Backend | None = None,
    environ: Mapping[str, str] | None = None,
    kv_dtype: torch.dtype | None = None,
    **options: Any,
) -> tuple[CacheConfig, KvGrowConfig | None, list[str]]:
    """`strata.engine.cache.build.plan_cache` for `--kv-grow`: the CacheConfig, the elastic
    K/V to start beside it (None when the flag is ignored or the window is mapped up front)
    and the notes to print. `profile` says whether the fill comes from a profile
    (`--expert-profile`); `kv_dtype` is the K/V cells' dtype (None: `dtype`); `options` are
    CacheConfig's other fields. Raises as `plan_kv_grow`; a backend made here is closed again
    then."""
    with given_or_own_backend(backend, device) as backend:
        keep_slots = _keep_slots_from_env()
        lends = options.get("prefill_loan", True)

        def budget_at(kv_cells: int, chunk: int | None) -> CacheBudget:
            return plan_cache(config, dtype, device, max_context=max_context,
                              prefill_chunk=chunk, budget_mib=budget_mib,
                              reserve_mib=reserve_mib, expert_cache_mib=expert_cache_mib,
                              backend=backend, kv_cells=kv_cells, kv_dtype=kv_dtype,
                              stream_misses=options.get("stream_misses", 0),
                              prefetch_misses=options.get("prefetch_misses", 0),
                              experts_quant=options.get("experts_quant")).budget

        if prefill_chunk is None:
            # One chunk for every budget the plan compares (their slots may differ by the
            # cells mapped only): chosen with the whole window mapped, the cache's least room;
            # the smallest where even that does not fit.
            try:
                prefill_chunk = budget_at(max_context, None).prefill_chunk
            except ValueError:
                prefill_chunk = PREFILL_CHUNKS[0]

        def make_budget(kv_cells: int) -> CacheBudget:
            return budget_at(kv_cells, prefill_chunk)

        def loan_region(n_slots: int) -> int:
            if not lends:
                return 0
            return loan_slots(n_slots, config.n_experts, keep_slots, DEFAULT_MAX_FRACTION)

        plan = plan_kv_grow(config, dtype, policy=options.get("policy"),
                            max_context=max_context, chunk_bytes=backend.chunk_bytes,
                            make_budget=make_budget, loan_region=loan_region, profile=profile,
                            environ=environ, cell_dtype=kv_dtype)
        cache = CacheConfig(budget=plan.budget, backend=backend, **options)
    return cache, plan.kv_grow, plan.notes


def start_elastic(
    cached: CachedExperts,
    config: KvGrowConfig,
    *,
    free_chunks: int | None = None,
    on_note: Callable[[str], None] | None = None,
) -> ElasticKV:
    """Reserve the K/V for `config.max_cells` cells on `cached`'s arena backend, map the start
    cells, set the floor in the books; the elastic K/V of `cached` (a filled `CachedExperts`).

    `free_chunks`: the budget's chunks left for growth; None counts them from `cached.budget`
    (budget - dense - workspace - reserve - the K/V mapped - the arena). `on_note` is told why a
    growth or trim failed (default: a `strata:` line on stderr).
    """
    backend = cached.arena.backend
    table = cached.table
    kv = KVCache(backend, config.n_layers, config.max_cells, config.n_kv_heads,
                 config.head_dim, config.dtype, mapped_cells=config.init_cells,
                 cell_dtype=config.cell_dtype)
    try:
        if free_chunks is None:
            budget = cached.budget
            if budget is None:
                raise ValueError("the cache has no budget: give free_chunks")
            others = budget.fixed_bytes - budget.kv_bytes
            spare = budget.budget_bytes - others - kv.bytes_mapped - cached.arena.nbytes
            free_chunks = max(0, spare) // backend.chunk_bytes
        table.set_regions(floor=min(config.params.floor_slots, table.top))
        elastic = ElasticKV(kv, cached, config.params, free_chunks=free_chunks,
                            on_note=on_note or _note)
    except BaseException:
        kv.close()
        raise
    return elastic


def _note(line: str) -> None:
    print(f"strata: {line}", file=sys.stderr)
