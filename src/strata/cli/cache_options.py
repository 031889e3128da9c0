"""The expert cache's options of `strata generate`, and what they build.

The cache is used when any of its options is given, or when the budget cannot hold every
expert; otherwise every expert is resident, as without the feature (CUDA graphs included).
`cache_config_from_args` checks every value and sizes the cache before the model is loaded, so
a bad value or a budget too small is one line (`UsageError`) at once.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import TYPE_CHECKING

from strata.cli.errors import UsageError
from strata.cli.policies import add_policy_arguments
from strata.engine.cache.defaults import DEFAULT_SHORT_READ

if TYPE_CHECKING:
    import torch

    from strata.engine.model.config import ModelConfig
    from strata.engine.runtime.options import CacheOptions, CachePlan

__all__ = ["add_cache_arguments", "cache_config_from_args", "cache_options_from_args"]

# dest -> flag, for the options whose presence turns the cache on.
CACHE_FLAGS = {
    "vram_budget_mib": "--vram-budget-mib",
    "vram_reserve_mib": "--vram-reserve-mib",
    "expert_cache": "--expert-cache",
    "expert_profile": "--expert-profile",
    "short_read": "--short-read",
    "cpu_threads": "--cpu-threads",
    "stream_misses": "--stream-misses",
    "prefetch_misses": "--prefetch-misses",
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
        "--stream-misses", metavar="auto|N",
        help="of a decode layer's missed experts, how many to upload over PCIe and compute on "
        "the device while the CPU computes the rest: auto (the default) splits them as the "
        "calls timed once on this machine and kept in the cache directory ran fastest (0 off "
        "CUDA: all on the CPU); N streams the first N (at most the model's top-k)",
    )
    group.add_argument(
        "--prefetch-misses", type=int, default=0, metavar="N",
        help="predict each next decode layer's experts with its router while this layer runs "
        "and upload up to N of those it will miss ahead, the likeliest first (0, the default: "
        "off; CUDA graphs; N at most --stream-misses'; the staging buffer twice the size)",
    )
    group.add_argument(
        "--kv-grow", action="store_true",
        help="the elastic K/V: map K/V cells as requests reach them and give the cache the rest "
        "(also STRATA_KV_GROW=1; needs --expert-profile; STRATA_KV_GROW_INIT/_STEP/_FLOOR)",
    )
    # Checked by `EngineOptions` (its names are `strata.engine.model.kv_cells.KV_DTYPES`,
    # which imports torch), whether or not the cache is used.
    group.add_argument(
        "--kv-dtype", default="auto", metavar="DTYPE",
        help="the K/V cells' dtype: auto (the model's), bf16, or int8 (a float32 scale per "
        "cell and kv head: about half of bf16's memory, so more cells or slots fit)",
    )
    parser.add_argument(
        "--trace", metavar="FILE",
        help="record the routing (per token, per layer, the top-k ids) to FILE (.npz) for "
        "`strata simulate`",
    )
    add_policy_arguments(parser)


def _expert_cache_mib(text: str | None) -> float | str | None:
    if text is None or text == "auto":
        return text
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise UsageError(f"--expert-cache must be auto or a number of MiB >= 0, got {text!r}")
    return value


def _stream_misses(text: str | None) -> int | str | None:
    if text is None or text == "auto":
        return text
    try:
        return int(text, 10)
    except ValueError:
        raise UsageError(f"--stream-misses must be auto or a number of experts, got "
                         f"{text!r}") from None


def cache_options_from_args(args: argparse.Namespace) -> CacheOptions:
    """The `expert cache` group's flags, `--kv-grow` and `--policy` as one `CacheOptions`;
    UsageError naming the flag for a bad value."""
    from strata.engine.runtime.options import CacheOptions

    try:
        return CacheOptions(
            vram_budget_mib=args.vram_budget_mib, vram_reserve_mib=args.vram_reserve_mib,
            expert_cache_mib=_expert_cache_mib(args.expert_cache),
            expert_profile=args.expert_profile, prefill_loan=not args.no_prefill_loan,
            short_read=args.short_read, cpu_threads=args.cpu_threads,
            stream_misses=_stream_misses(args.stream_misses),
            prefetch_misses=args.prefetch_misses, kv_grow=args.kv_grow,
            policy=args.policy, policy_options=tuple(args.policy_opts or ()))
    except ValueError as err:
        raise UsageError(str(err)) from None


def cache_config_from_args(
    args: argparse.Namespace,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    *,
    max_context: int,
    prefill_chunk: int | None,
) -> CachePlan:
    """The cache the options ask for (`strata.engine.runtime.options.plan_cache_options`),
    sized for `config` in `dtype` on `device`.

    Raises UsageError for a bad value, an unreadable profile or one for another model, an
    unknown policy or option, and a budget too small (saying how much is missing); a bad
    `STRATA_KV_GROW*` or `STRATA_LOAN_KEEP_SLOTS` is a SettingError.
    """
    from strata.engine.runtime.options import plan_cache_options
    from strata.policies import OptionError, PolicyError, UnknownPolicyError

    options = cache_options_from_args(args)
    try:
        return plan_cache_options(options, config, dtype, device, max_context=max_context,
                                  prefill_chunk=prefill_chunk)
    except (ValueError, PolicyError, UnknownPolicyError, OptionError) as err:
        if isinstance(err, PolicyError) and not isinstance(err, ValueError):
            raise  # the front door's error path adds the tracing hint
        raise UsageError(str(err)) from None


def check_trace_path(path: str | None) -> None:
    """UsageError unless `--trace`'s directory exists."""
    if path is not None and not Path(path).absolute().parent.is_dir():
        raise UsageError(f"--trace {path}: its directory does not exist")
