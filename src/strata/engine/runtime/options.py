"""`CacheOptions`: the expert cache's and the elastic K/V's options as a user gives them, and
`plan_cache_options`, what they build.

These are `strata generate`'s flags (the messages name them), as one frozen object that
`Engine.open` and the command line share. The cache is used when any of its options is given,
or when the budget cannot hold every expert; otherwise every expert is resident, as without the
feature (CUDA graphs included). Planning checks every value and sizes the cache before the
model is loaded, so a bad value or a budget too small is one error at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from strata.engine.cache.build import (
    CacheConfig,
    default_stream_misses,
    plan_cache,
    staging_blobs,
)
from strata.engine.cache.defaults import DEFAULT_SHORT_READ
from strata.engine.cache.kept_rates import resolve_stream_misses
from strata.engine.experts.quant import EXPERTS_DTYPES, experts_quant_for
from strata.engine.kv.plan import KvGrowConfig, kv_grow_requested, plan_elastic_cache
from strata.engine.model.config import ModelConfig
from strata.engine.model.kv_cells import KV_DTYPES, cell_dtype_of
from strata.engine.model.moe import runtime_dtype
from strata.formats.profile import ProfileError, fill_rank, load_profile
from strata.machine import available_cpus
from strata.policies import DEFAULT_POLICY, load_registry

__all__ = ["CacheOptions", "CachePlan", "EngineOptions", "kv_cell_dtype", "plan_cache_options",
           "plan_engine_cache"]


def _positive(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class CacheOptions:
    """The options of the expert cache (`--vram-budget-mib`, `--vram-reserve-mib`,
    `--expert-cache` in MiB or "auto" (None: not given, auto too), `--expert-profile`, the
    loan, `--short-read`, `--cpu-threads`, `--stream-misses` "auto" or N (None: not given,
    auto: 0 off CUDA), `--prefetch-misses` N (0: off)), of the
    elastic K/V (`--kv-grow`) and the policy (`--policy`, `--policy-opt`). ValueError naming
    the flag for a bad value. A given option (even "auto") turns the cache on."""

    vram_budget_mib: float | None = None
    vram_reserve_mib: float | None = None
    expert_cache_mib: float | str | None = None
    expert_profile: str | None = None
    prefill_loan: bool = True
    short_read: int | None = None
    cpu_threads: int | None = None
    stream_misses: int | str | None = None
    prefetch_misses: int = 0
    kv_grow: bool = False
    policy: str = DEFAULT_POLICY
    policy_options: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        mib = self.expert_cache_mib
        if mib is not None and mib != "auto" and not (
                isinstance(mib, int | float) and not isinstance(mib, bool)
                and math.isfinite(mib) and mib >= 0):
            raise ValueError(f"--expert-cache must be auto or a number of MiB >= 0, got {mib!r}")
        for flag, value in (("--short-read", self.short_read),
                            ("--cpu-threads", self.cpu_threads)):
            if value is not None and not _positive(value):
                raise ValueError(f"{flag} must be >= 1, got {value}")
        stream = self.stream_misses
        if stream is not None and stream != "auto" and (
                isinstance(stream, bool) or not isinstance(stream, int)):
            raise ValueError(f"--stream-misses must be auto or a number of experts, got "
                             f"{stream!r}")
        if isinstance(self.prefetch_misses, bool) or not isinstance(self.prefetch_misses, int) \
                or self.prefetch_misses < 0:
            raise ValueError(f"--prefetch-misses must be a number of experts >= 0 (0: off), "
                             f"got {self.prefetch_misses!r}")
        cpus = available_cpus()
        if self.cpu_threads is not None and self.cpu_threads > cpus:
            raise ValueError(f"--cpu-threads {self.cpu_threads} is more than the {cpus} CPUs "
                             f"this process may run on; give at most {cpus}")
        object.__setattr__(self, "policy_options", tuple(self.policy_options))

    def asks_for_the_cache(self, kv_grow: bool) -> bool:
        """Whether an option that sizes or feeds the cache was given (a budget, a reserve, a
        size, a profile, the loan turned off, the read length, CPU threads, streamed or
        prefetched misses), or the elastic K/V: then the cache is used even where every
        expert would fit.

        The policy is not one of them: it decides what a cache holds, and naming it (the
        default `coldest-in-loan` or another, with or without options) never switches a
        cache on. So `--policy coldest-in-loan` is exactly the default, and `--policy lru`
        on a model whose experts all fit leaves them all resident, as a cache that holds
        every expert would (nothing is ever evicted there); a cache smaller than the model
        is what gives a policy something to decide."""
        given = any(v is not None for v in (
            self.vram_budget_mib, self.vram_reserve_mib, self.expert_cache_mib,
            self.expert_profile, self.short_read, self.cpu_threads, self.stream_misses))
        return given or kv_grow or not self.prefill_loan or self.prefetch_misses > 0


@dataclass
class CachePlan:
    """What `plan_cache_options` decided: the config (None: every expert resident), the
    elastic K/V to start beside it (None: `--kv-grow` off or not applicable) and the notes to
    print before loading (the profile warning, the elastic K/V's figures)."""

    config: CacheConfig | None
    notes: list[str] = field(default_factory=list)
    kv_grow: KvGrowConfig | None = None


def _profile_rank(path: str | None, config: ModelConfig) -> tuple[object, list[str]]:
    """(rank [L, E], notes): the fill order the profile at `path` gives, or the uniform one with
    the warning to print. ValueError naming the file for one that cannot be used."""
    profile = None
    if path is not None:
        try:
            profile = load_profile(path, expect=(config.n_layers, config.n_experts))
            profile.check(config)
        except (OSError, ProfileError) as err:
            reason = getattr(err, "strerror", None) or err
            raise ValueError(f"--expert-profile {path}: {reason}") from None
    rank, warning = fill_rank(profile, config.n_layers, config.n_experts)
    return rank, [warning] if warning else []


def plan_cache_options(
    options: CacheOptions,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    *,
    max_context: int,
    prefill_chunk: int | None,
    experts_quant: str | None = None,
    kv_dtype: torch.dtype | None = None,
) -> CachePlan:
    """The cache `options` ask for, sized for `config` in `dtype` on `device`, its slots for
    experts in `experts_quant` (`--experts-dtype`'s format, `experts_quant`; None: `dtype`),
    beside K/V cells of `kv_dtype` (`--kv-dtype`'s, `kv_cell_dtype`; None: `dtype`), its
    workspace for prompt chunks of `prefill_chunk` (None: chosen from the budget,
    `strata.engine.cache.prompt_chunk.choose_prefill_chunk`).

    Raises ValueError for a bad value, an unreadable profile or one for another model, and a
    budget too small (saying how much is missing); the registry's UnknownPolicyError /
    OptionError for an unknown policy or option; PolicyError for a wrong `kv_params`;
    SettingError for a bad `STRATA_KV_GROW*` or `STRATA_LOAN_KEEP_SLOTS`; RatesError (a
    ValueError) for a rates file that cannot be read or written (`--stream-misses auto`).

    `--stream-misses auto`, the default, reads the split from the rates kept for this
    machine, measuring them first where there are none (`strata.engine.cache.kept_rates`), and
    says so in the notes. Not given, it is resolved only once the cache is known to be used
    (sized first with a fixed count, `default_stream_misses`): a model whose experts all fit
    measures nothing. Given, it turns the cache on, so its rates are always used.
    """
    stream = options.stream_misses
    if stream is not None and stream != "auto" and not 0 <= stream <= config.top_k:
        raise ValueError(f"--stream-misses must be auto or in [0, {config.top_k}] (a decode "
                         f"layer misses at most the model's {config.top_k} experts a token), "
                         f"got {stream}")
    kv_grow = kv_grow_requested(options.kv_grow)
    rank, notes = _profile_rank(options.expert_profile, config)
    registry = load_registry()
    policy = registry.create(options.policy, list(options.policy_options))
    sizing = dict(
        max_context=max_context, prefill_chunk=prefill_chunk,
        budget_mib=options.vram_budget_mib, reserve_mib=options.vram_reserve_mib,
        expert_cache_mib=None if options.expert_cache_mib == "auto" else options.expert_cache_mib,
        policy=policy, rank=rank,
        cpu_threads=options.cpu_threads,
        prefill_loan=options.prefill_loan,
        short_read=options.short_read or DEFAULT_SHORT_READ, events=registry.pm,
        experts_quant=experts_quant, kv_dtype=kv_dtype,
    )
    device = torch.device(device)
    if stream is None and device.type == "cuda" and not options.asks_for_the_cache(kv_grow) \
            and _all_resident(config, dtype, device, {
                **sizing, "stream_misses": default_stream_misses(config, device)}):
        return CachePlan(None)  # before auto's rates: they are measured only for a cache
    sizing["stream_misses"], stream_notes = resolve_stream_misses(
        stream, config, dtype, device, cpu_threads=options.cpu_threads, quant=experts_quant)
    notes += stream_notes
    n_staging = staging_blobs(sizing["stream_misses"])
    if options.prefetch_misses and not n_staging:
        raise ValueError("--prefetch-misses uploads predicted misses with the streamed ones, "
                         "and none are streamed here: give --stream-misses N > 0 (off CUDA "
                         "there is no bus to stream over)")
    if options.prefetch_misses > n_staging:
        raise ValueError(f"--prefetch-misses {options.prefetch_misses} is more than the "
                         f"{n_staging} streamed misses' staging blobs (--stream-misses): give "
                         f"at most {n_staging}")
    sizing["prefetch_misses"] = options.prefetch_misses
    if kv_grow:
        cache, kv_grow_config, kv_notes = plan_elastic_cache(
            config, dtype, device, profile=options.expert_profile is not None, **sizing)
        notes += kv_notes
    else:
        cache, kv_grow_config = plan_cache(config, dtype, device, **sizing), None
    if not options.asks_for_the_cache(kv_grow) and cache.budget.holds_every_expert:
        cache.backend.close()
        return CachePlan(None)
    return CachePlan(cache, notes, kv_grow_config)


def _all_resident(config: ModelConfig, dtype: torch.dtype, device: torch.device,
                  sizing: dict) -> bool:
    """Whether a cache planned with `sizing` (a fixed count of streamed misses) would hold
    every expert, so that, no cache option given, none is used."""
    cache = plan_cache(config, dtype, device, **sizing)
    cache.backend.close()
    return cache.budget.holds_every_expert


@dataclass(frozen=True)
class EngineOptions:
    """Everything `Engine.from_options` needs besides the model directory: the device
    (`torch.device` or its name), the dtype (None: the checkpoint's own), the experts' storage
    (`experts_dtype`, one of `strata.engine.experts.quant.EXPERTS_DTYPES`: `auto`, the model's
    dtype, or quantized at load), the K/V cells' (`kv_dtype`, one of
    `strata.engine.model.kv_cells.KV_DTYPES`: `auto`, the model's dtype, `bf16` or `int8`), the
    window (`max_context` cells), the prompt's chunk (None: the engine's default, for a cache
    chosen from its budget), the cache's options and the conversation cache's size (either 0:
    none). ValueError for a bad value."""

    device: str | torch.device = "cpu"
    dtype: torch.dtype | None = None
    experts_dtype: str = "auto"
    kv_dtype: str = "auto"
    max_context: int = 4096
    prefill_chunk: int | None = None
    cache: CacheOptions = field(default_factory=CacheOptions)
    conversation_cache_mib: float = 0.0
    conversation_cache_slots: int = 0

    def __post_init__(self) -> None:
        chunk = 1 if self.prefill_chunk is None else self.prefill_chunk  # None: the default
        for name, value in (("max_context", self.max_context), ("prefill_chunk", chunk)):
            if not _positive(value):
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        mib, slots = self.conversation_cache_mib, self.conversation_cache_slots
        if not (isinstance(mib, int | float) and math.isfinite(mib) and mib >= 0) or \
                isinstance(slots, bool) or not isinstance(slots, int) or slots < 0:
            raise ValueError("conversation_cache_mib and conversation_cache_slots must be >= 0, "
                             f"got {mib!r} and {slots!r}")
        if self.experts_dtype not in EXPERTS_DTYPES:
            raise ValueError(f"--experts-dtype must be one of {', '.join(EXPERTS_DTYPES)}, got "
                             f"{self.experts_dtype!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, got "
                             f"{self.kv_dtype!r}")
        if not isinstance(self.cache, CacheOptions):
            raise ValueError(f"cache must be CacheOptions, got {type(self.cache).__name__}")
        object.__setattr__(self, "device", torch.device(self.device))


def plan_engine_cache(options: EngineOptions, config: ModelConfig) -> tuple[CachePlan, str | None]:
    """(the cache plan, the experts' quantized format or None) for a model of `config` opened
    with `options`: the model's dtype and `--experts-dtype` resolved, then
    `plan_cache_options`. Raises as it, and ValueError for an `--experts-dtype` the model
    cannot take."""
    dtype = runtime_dtype(config, options.dtype)
    quant = experts_quant_for(options.experts_dtype, dtype)
    plan = plan_cache_options(options.cache, config, dtype, options.device,
                              max_context=options.max_context,
                              prefill_chunk=options.prefill_chunk, experts_quant=quant,
                              kv_dtype=kv_cell_dtype(options, config))
    return plan, quant


def kv_cell_dtype(options: EngineOptions, config: ModelConfig) -> torch.dtype:
    """The K/V cells' dtype for a model of `config` opened with `options` (`--kv-dtype`
    resolved against the model's dtype)."""
    return cell_dtype_of(options.kv_dtype, runtime_dtype(config, options.dtype))
