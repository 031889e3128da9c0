"""The expert cache's options of `strata generate`, and what they build.

The cache is used when any of its options is given, or when the budget cannot hold every
expert; otherwise every expert is resident, as without the feature (CUDA graphs included).
`cache_config_from_args` checks every value and sizes the cache before the model is loaded, so
a bad value or a budget too small is one line (`UsageError`) at once.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from strata.cli.errors import UsageError
from strata.cli.policies import add_policy_arguments, policy_from_args
from strata.engine.cache.defaults import DEFAULT_SHORT_READ
from strata.machine import available_cpus
from strata.policies.registry import DEFAULT_POLICY

if TYPE_CHECKING:
    import torch

    from strata.engine.cache.build import CacheConfig
    from strata.engine.kv.plan import KvGrowConfig
    from strata.engine.model.config import ModelConfig

__all__ = ["CachePlan", "add_cache_arguments", "cache_config_from_args"]

# dest -> flag, for the options whose presence turns the cache on.
CACHE_FLAGS = {
    "vram_budget_mib": "--vram-budget-mib",
    "vram_reserve_mib": "--vram-reserve-mib",
    "expert_cache": "--expert-cache",
    "expert_profile": "--expert-profile",
    "short_read": "--short-read",
    "cpu_threads": "--cpu-threads",
    "stream_misses": "--stream-misses",
}



def add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """The `expert cache` option group, `--trace`, and `--policy` / `--policy-opt`."""
    group = parser.add_argument_group(
        "expert cache",
        "Experts that fit the device budget sit in the cache's slots; the CPU computes the "
        "rest. Used when any of these is given or the experts do not all fit.",
    )
    group.add_argument(
        "--vram-budget-mib", type=float, metavar="MIB",
        help="device memory strata may use (default: free memory on CUDA; on the CPU: what "
        "holds every expert)",
    )
    group.add_argument(
        "--vram-reserve-mib", type=float, metavar="MIB",
        help="of the budget, what stays free (default: 256 on CUDA, 0 on the CPU)",
    )
    group.add_argument(
        "--expert-cache", metavar="auto|MIB",
        help="the cache's size: auto (what the budget leaves) or MiB, capped by the budget",
    )
    group.add_argument(
        "--expert-profile", metavar="PATH",
        help="fill the cache hottest first by this profile (`strata profile` makes one)",
    )
    group.add_argument(
        "--no-prefill-loan", action="store_true",
        help="long prompt parts send their misses to the CPU instead of borrowing slots",
    )
    group.add_argument(
        "--short-read", type=int, metavar="N",
        help=f"prompt parts longer than N tokens take the loan ({DEFAULT_SHORT_READ})",
    )
    group.add_argument(
        "--cpu-threads", type=int, metavar="N",
        help="threads computing the CPU's experts (default: torch's, the physical cores)",
    )
    group.add_argument(
        "--stream-misses", type=int, metavar="N",
        help="of a decode layer's missed experts, upload the first N (at most the model's "
        "top-k) over PCIe and compute them on the device while the CPU computes the rest "
        "(default: half the top-k on CUDA, 0 elsewhere; 0: all on the CPU)",
    )
    group.add_argument(
        "--kv-grow", action="store_true",
        help="the elastic K/V: map K/V cells as requests reach them and give the cache the rest "
        "(also STRATA_KV_GROW=1; needs --expert-profile; STRATA_KV_GROW_INIT/_STEP/_FLOOR)",
    )
    parser.add_argument(
        "--trace", metavar="FILE",
        help="record the routing (per token, per layer, the top-k ids) to FILE (.npz) for "
        "`strata simulate`",
    )
    add_policy_arguments(parser)


@dataclass
class CachePlan:
    """What `cache_config_from_args` decided: the config (None: every expert resident), the
    elastic K/V to start beside it (None: `--kv-grow` off or not applicable) and the notes to
    print before loading (the profile warning)."""

    config: CacheConfig | None
    notes: list[str] = field(default_factory=list)
    kv_grow: KvGrowConfig | None = None


def _expert_cache_mib(text: str | None) -> float | None:
    if text is None or text == "auto":
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise UsageError(f"--expert-cache must be auto or a number of MiB >= 0, got {text!r}")
    return value


def _wanted(args: argparse.Namespace, kv_grow: bool) -> bool:
    """Whether an option of the cache (or a policy other than the default, or the elastic K/V)
    was given."""
    given = any(getattr(args, dest) is not None for dest in CACHE_FLAGS)
    return given or kv_grow or args.no_prefill_loan or args.policy != DEFAULT_POLICY or bool(
        args.policy_opts)


def cache_config_from_args(
    args: argparse.Namespace,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    *,
    max_context: int,
    prefill_chunk: int,
) -> CachePlan:
    """The cache the options ask for, sized for `config` in `dtype` on `device`.

    Raises UsageError for a bad value, an unreadable profile or one for another model, an
    unknown policy or option, and a budget too small (saying how much is missing); a bad
    `STRATA_KV_GROW*` or `STRATA_LOAN_KEEP_SLOTS` is a SettingError.
    """
    from strata.engine.cache.build import default_stream_misses, plan_cache
    from strata.engine.kv.plan import kv_grow_requested, plan_elastic_cache
    from strata.policies import PolicyError, load_registry

    expert_cache_mib = _expert_cache_mib(args.expert_cache)
    for dest in ("short_read", "cpu_threads"):
        value = getattr(args, dest)
        if value is not None and value < 1:
            raise UsageError(f"{CACHE_FLAGS[dest]} must be >= 1, got {value}")
    cpus = available_cpus()
    if args.cpu_threads is not None and args.cpu_threads > cpus:
        raise UsageError(f"--cpu-threads {args.cpu_threads} is more than the {cpus} CPUs this "
                         f"process may run on; give at most {cpus}")
    if args.stream_misses is not None and not 0 <= args.stream_misses <= config.top_k:
        raise UsageError(f"--stream-misses must be in [0, {config.top_k}] (a decode layer misses "
                         f"at most the model's {config.top_k} experts a token), got "
                         f"{args.stream_misses}")
    kv_grow = kv_grow_requested(args.kv_grow)
    profile_rank, notes = _profile_rank(args, config)
    registry = load_registry()
    policy = policy_from_args(args, registry)
    sizing = dict(
        max_context=max_context, prefill_chunk=prefill_chunk,
        budget_mib=args.vram_budget_mib, reserve_mib=args.vram_reserve_mib,
        expert_cache_mib=expert_cache_mib, policy=policy, rank=profile_rank,
        cpu_threads=args.cpu_threads,
        stream_misses=default_stream_misses(config, device) if args.stream_misses is None
        else args.stream_misses,
        prefill_loan=not args.no_prefill_loan,
        short_read=args.short_read or DEFAULT_SHORT_READ, events=registry.pm,
    )
    try:
        if kv_grow:
            cache, kv_grow_config, kv_notes = plan_elastic_cache(
                config, dtype, device, profile=args.expert_profile is not None, **sizing)
            notes += kv_notes
        else:
            cache, kv_grow_config = plan_cache(config, dtype, device, **sizing), None
    except (ValueError, PolicyError) as err:
        raise UsageError(str(err)) from None
    if not _wanted(args, kv_grow) and cache.budget.holds_every_expert:
        cache.backend.close()
        return CachePlan(None)
    return CachePlan(cache, notes, kv_grow_config)


def _profile_rank(args: argparse.Namespace, config: ModelConfig):
    """(rank [L, E], notes): the fill order `--expert-profile` gives, or the uniform one with
    the warning to print."""
    from strata.formats.profile import ProfileError, fill_rank, load_profile

    profile = None
    if args.expert_profile is not None:
        try:
            profile = load_profile(args.expert_profile,
                                   expect=(config.n_layers, config.n_experts))
            profile.check(config)
        except (OSError, ProfileError) as err:
            reason = getattr(err, "strerror", None) or err
            raise UsageError(f"--expert-profile {args.expert_profile}: {reason}") from None
    rank, warning = fill_rank(profile, config.n_layers, config.n_experts)
    return rank, [warning] if warning else []


def check_trace_path(path: str | None) -> None:
    """UsageError unless `--trace`'s directory exists."""
    if path is not None and not Path(path).absolute().parent.is_dir():
        raise UsageError(f"--trace {path}: its directory does not exist")
