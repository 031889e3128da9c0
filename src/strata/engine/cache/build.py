"""`CacheConfig` and `build_cached_experts`: from the sized budget to a filled cache.

The order at start: the books (`ResidencyTable`, ranked by the profile when there is one), the
arena (mapped whole), the policy bound to the books, then the slots filled hottest first, as the
simulator starts, with the prompt loan if asked for. The elastic K/V (`--kv-grow`) is started
beside the cache by whatever composes them (`strata.engine.runtime.load`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pluggy
import torch

from strata import _vmm
from strata._residency import ResidencyTable
from strata.books import CheckedPolicy
from strata.engine.cache.arena import Arena, slot_bytes_for
from strata.engine.cache.budget import CacheBudget, plan_budget
from strata.engine.cache.cached_experts import CachedExperts
from strata.engine.cache.defaults import DEFAULT_SHORT_READ
from strata.engine.cache.loan import LoanOptions
from strata.engine.cache.prefetch import check_prefetch_misses
from strata.engine.cache.prompt_chunk import choose_prefill_chunk
from strata.engine.experts import ExpertStore
from strata.engine.experts.quant import WEIGHT_FORMATS, expert_blob_bytes
from strata.engine.experts.streamed import StreamSplit, staging_blobs
from strata.engine.memory import given_or_own_backend
from strata.engine.model.config import ModelConfig
from strata.policies import Policy

__all__ = [
    "DEFAULT_SHORT_READ",
    "CacheConfig",
    "build_cached_experts",
    "default_stream_misses",
    "plan_cache",
    "staging_blobs",
]


@dataclass(frozen=True)
class CacheConfig:
    """How to build the expert cache of a model.

    `budget` sizes it (see `strata.engine.cache.budget.plan_budget`); `backend` is the memory
    backend of the arena (its chunk size must be the budget's). `rank` int [L, E], a
    permutation of the flat ids (0 = hottest), orders the experts for the fill and the refills
    (`strata.formats.profile.fill_rank`; None: flat id order); `policy` decides
    admissions and refills (None: `coldest-in-loan`); `events` is told admissions and
    evictions. `prefill_loan` lends the top slots to prompt parts longer than `short_read`
    tokens. `cpu_threads` sets the intra-op threads of the CPU's experts (None: torch's).
    `stream_misses`: of a decode layer call's misses, how many are uploaded to a staging
    buffer and computed on the device while the CPU computes the others: an int N, the first
    min(N, M) of M misses (0: none), or a `StreamSplit`, M -> streamed
    (`strata.engine.cache.kept_rates.resolve_stream_misses` makes `--stream-misses auto`'s).
    `experts_quant`: the format of the slots' blobs (`--experts-dtype`; None: the model's
    dtype), which the store's must be. `prefetch_misses` N > 0 (with `stream_misses`) uploads
    up to N of each next decode layer's predicted misses ahead, the likeliest first
    (`strata.engine.cache.prefetch`; 0: off; at most the staging buffer's blobs), its staging
    buffer twice the size. The elastic K/V is planned beside it
    (`strata.engine.kv.plan.plan_elastic_cache`).
    """

    budget: CacheBudget
    backend: _vmm.Backend = field(compare=False)
    policy: Policy | None = None
    rank: np.ndarray | None = field(default=None, compare=False)
    cpu_threads: int | None = None
    stream_misses: int | StreamSplit = 0
    prefill_loan: bool = True
    short_read: int = DEFAULT_SHORT_READ
    events: pluggy.PluginManager | None = field(default=None, compare=False)
    experts_quant: str | None = None
    prefetch_misses: int = 0

    def __post_init__(self) -> None:
        if self.backend.chunk_bytes != self.budget.chunk_bytes:
            raise ValueError(
                f"the backend's chunks are {self.backend.chunk_bytes} bytes, the budget was "
                f"sized for {self.budget.chunk_bytes}"
            )
        if isinstance(self.short_read, bool) or not isinstance(self.short_read, int) \
                or self.short_read < 1:
            raise ValueError(f"short_read must be an int >= 1, got {self.short_read!r}")
        if self.cpu_threads is not None and (
                isinstance(self.cpu_threads, bool) or not isinstance(self.cpu_threads, int)
                or self.cpu_threads < 1):
            raise ValueError(f"cpu_threads must be None or an int >= 1, got {self.cpu_threads!r}")
        staging_blobs(self.stream_misses)  # checks it
        check_prefetch_misses(self.prefetch_misses, staging_blobs(self.stream_misses))
        if self.experts_quant is not None and self.experts_quant not in WEIGHT_FORMATS:
            raise ValueError(f"experts_quant must be None or one of {WEIGHT_FORMATS}, got "
                             f"{self.experts_quant!r}")


def default_stream_misses(config: ModelConfig, device: torch.device) -> int:
    """A fixed `--stream-misses`: three eighths of the model's top-k on CUDA, rounded half up
    (3 of 8, 1 of 2), 0 elsewhere (off the GPU there is no bus to use). The default is `auto`
    (`strata.engine.cache.kept_rates.resolve_stream_misses`); this count sizes a cache before
    it is known whether one is used at all, so that auto's rates are measured only where one
    is (`strata.engine.runtime.options.plan_cache_options`).

    It was the default until auto's rates were timed as a round runs its calls. On the H200
    (bench/results/offload-balance-h200-2026-12-03.md), the counts interleaved in one engine:
    on olmoe-1b-7b at a 4 GiB budget auto ran 13.87 ms a round against 14.68 for 2 and 17.19
    for this 3; on a 16-layer qwen3-30b-a3b with 22% of its experts cached 13.78 against 13.52
    and 16.17, and with its experts in int8 10.00 against 10.03 and 11.21. Earlier, with the
    CPU's side slower, 3 had been the fastest fixed count (18.00 ms against 18.44 for 2 and
    20.04 for 4 on olmoe, offload-async-h200-2026-12-03.md): which count is fastest moves with
    the machine, which is what auto measures."""
    return (3 * config.top_k + 4) // 8 if device.type == "cuda" else 0


def plan_cache(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    *,
    max_context: int,
    prefill_chunk: int | None,
    budget_mib: float | None = None,
    reserve_mib: float | None = None,
    expert_cache_mib: float | None = None,
    backend: _vmm.Backend | None = None,
    kv_cells: int | None = None,
    kv_dtype: torch.dtype | None = None,
    **options,
) -> CacheConfig:
    """The CacheConfig for a model of `config` computing in `dtype` on `device`, sized from the
    flags' values (see `plan_budget`; `kv_dtype`: the K/V cells', None: `dtype`;
    `prefill_chunk` None: `choose_prefill_chunk`'s); `options` are CacheConfig's other fields.
    `backend`
    defaults to a new one for `device` (`strata.engine.memory.device_backend`). Raises
    ValueError for a bad value or a budget too small; the backend made here is closed again then."""
    quant = options.get("experts_quant")
    blob_bytes = expert_blob_bytes(config.expert_width, config.hidden_size, dtype, quant)
    with given_or_own_backend(backend, device) as backend:
        def budget_at(chunk: int) -> CacheBudget:
            return plan_budget(
                config, dtype, device,
                slot_bytes=slot_bytes_for(blob_bytes),
                chunk_bytes=backend.chunk_bytes, max_context=max_context,
                prefill_chunk=chunk, budget_mib=budget_mib, reserve_mib=reserve_mib,
                expert_cache_mib=expert_cache_mib, kv_cells=kv_cells, kv_dtype=kv_dtype,
                stream_blobs=staging_blobs(options.get("stream_misses", 0))
                * (2 if options.get("prefetch_misses") else 1),
                experts_quant=quant,
            )

        if prefill_chunk is None:
            prefill_chunk = choose_prefill_chunk(budget_at)
        return CacheConfig(budget=budget_at(prefill_chunk), backend=backend, **options)


def build_cached_experts(
    config: CacheConfig, store: ExpertStore, device: str | torch.device
) -> CachedExperts:
    """The cache for `store` on `device`, filled hottest first, with the loan if asked for.

    Raises ValueError when the store's blobs are not in the format the cache was planned for,
    the budget's slot size does not hold them, or the rank is not a permutation [L, E] of the
    store's experts, before anything is allocated.
    """
    if store.quant != config.experts_quant:
        raise ValueError(f"the cache was planned for experts in "
                         f"{config.experts_quant or 'the model dtype'}, the store holds "
                         f"{store.quant or store.dtype}")
    budget = config.budget
    shape = (store.n_layers, store.n_experts)
    if budget.total_experts != shape[0] * shape[1]:
        raise ValueError(f"the budget was sized for {budget.total_experts} experts, the store "
                         f"holds {shape[0] * shape[1]}")
    table = ResidencyTable(*shape, budget.n_slots, budget.slot_bytes, budget.chunk_bytes)
    if config.rank is not None:
        rank = np.asarray(config.rank)
        if rank.shape != shape:
            raise ValueError(f"the rank is {list(rank.shape)}, the model's experts [L, E] = "
                             f"{list(shape)}")
        table.set_rank(rank)
    arena = Arena(config.backend, budget.n_slots, budget.slot_bytes,
                  hidden_size=store.hidden_size, expert_width=store.expert_width,
                  dtype=store.dtype, quant=store.quant)
    try:
        checked = CheckedPolicy(config.policy, table) if config.policy is not None else None
        loan = LoanOptions(short_read=config.short_read) if config.prefill_loan else None
        cached = CachedExperts(store, arena, table, checked, device, config.cpu_threads,
                               events=config.events, budget=budget,
                               stream_misses=config.stream_misses, loan=loan,
                               prefetch_misses=config.prefetch_misses)
        try:
            cached.fill_hottest()
        except BaseException:
            cached.close()
            raise
    except BaseException:
        arena.close()
        raise
    return cached
