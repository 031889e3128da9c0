"""The variants of bench/offload.py's decode runs: each the base run with one setting of the cache
changed, named by a suffix of the run's name.

Variants that only set an attribute of a built cache (the CPU's schedule, prefetch distance, weight
rows at once, team, spinning, pinning, the caller's pool, the async CPU, the wake-up, the launch
ahead, a fixed split count) are *settings*: under `--interleave` they run in the base run's
engine, one request of each in turn, so that the machine's drift falls on all alike
(`cache.run_decode_interleaved`). The others (-whole, -sampled, -prefetchN) need an engine of their
own.
"""

from __future__ import annotations

import argparse
from typing import Any

from strata import _cpu_experts
from strata.engine.cache import graph_call
from strata.engine.experts.streamed import StreamSplit


def cache_settings(args: argparse.Namespace) -> list[str]:
    """The settings the flags ask for, each a run's suffix (see the module)."""
    return [*(["-wake"] if args.wake_cpu else []),
            *(["-sync"] if args.sync_cpu else []),
            *(f"-{schedule}" for schedule in args.cpu_schedules),
            *(f"-cpupf{n}" for n in args.cpu_prefetches),
            *(f"-rows{gate_up}x{down}" for gate_up, down in args.cpu_weight_rows),
            *(f"-downblock{n}" for n in args.cpu_down_blocks),
            *(f"-team{n}" for n in args.cpu_teams),
            *(["-spin"] if args.cpu_spin else []),
            *(["-pin"] if args.cpu_pin else []),
            *(["-noshrink"] if args.no_cpu_shrink else []),
            *(["-ahead"] if args.launch_ahead else [])]


def decode_variants(args: argparse.Namespace, settings: list[str]) -> list[tuple[str, int]]:
    """(suffix, prefetch cap) of each decode run with an engine of its own: the base (""),
    -whole, the settings not interleaved, -sampled and -prefetchN (cap N; 0 for the others)."""
    together = settings if args.interleave else []
    return [("", 0), *([("-whole", 0)] if args.whole_calls else []),
            *((setting, 0) for setting in settings if setting not in together),
            *([("-sampled", 0)] if args.cli_sampling else []),
            *((f"-prefetch{cap}", cap) for cap in args.prefetch_caps)]


def split_settings(args: argparse.Namespace, streamer: Any) -> list[str]:
    """-splitN for each `--split-counts` N the run's staging buffer holds (streaming min(N, M)
    of a layer's M misses), each again as -splitN-sync with `--sync-cpu` and -splitN-noshrink
    with `--no-cpu-shrink`; none without a staging buffer."""
    return [f"-split{n}{mode}" for n in args.split_counts
            if streamer is not None and n <= streamer.n_blobs
            for mode in ["", *(["-sync"] if args.sync_cpu else []),
                         *(["-noshrink"] if args.no_cpu_shrink else [])]]


def apply_setting(cache: Any, setting: str, args: argparse.Namespace,
                  rule: StreamSplit | None, top_k: int) -> None:
    """Set `cache` (a `CachedExperts`) as `setting` says, every other setting back to the
    base run's: `rule` its streamer's split rule, the team `default_team`'s. ""
    puts everything back (and `graph_call.LAUNCH_AHEAD` off)."""
    count = setting.removeprefix("-split").partition("-")[0]
    cache.wake_cpu = setting == "-wake"
    graph_call.LAUNCH_AHEAD = setting == "-ahead"
    cache.cpu.keep_team_up = setting == "-spin"
    cache.cpu.pin_team = setting == "-pin"
    cache.cpu.shrink_caller_team = not setting.endswith("-noshrink")
    cache.async_cpu = not setting.endswith("-sync")
    chosen = setting[1:] if setting[1:] in args.cpu_schedules else "dynamic"
    cache.cpu.schedule = chosen.removesuffix("-alone")
    cache.cpu.caller_helps = not chosen.endswith("-alone")
    cache.cpu.prefetch_bytes = int(setting.removeprefix("-cpupf")) \
        if setting.startswith("-cpupf") else _cpu_experts.PREFETCH_BYTES
    gate_up, _, down = setting.removeprefix("-rows").partition("x")
    cache.cpu.gate_up_rows, cache.cpu.down_rows = (int(gate_up), int(down)) \
        if setting.startswith("-rows") else (_cpu_experts.GATE_UP_ROWS, _cpu_experts.DOWN_ROWS)
    cache.cpu.down_block_rows = int(setting.removeprefix("-downblock")) \
        if setting.startswith("-downblock") else _cpu_experts.DOWN_BLOCK_ROWS
    cache.cpu.team_threads = int(setting.removeprefix("-team")) \
        if setting.startswith("-team") else None
    if cache.streamer is not None:
        cache.streamer.split_rule = StreamSplit.fixed(int(count), top_k) \
            if setting.startswith("-split") else rule
