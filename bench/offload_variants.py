"""The variants of bench/offload.py's decode runs: each the base run with one setting of the cache
changed, named by a suffix of the run's name.

Variants that only set an attribute of a built cache (the CPU's schedule, prefetch distance, weight
rows at once, team, spinning, pinning, the caller's pool, the async CPU, the wake-up, the launch
ahead, a fixed split count, a split table) are *settings*: under `--interleave` they run in the
base run's engine, one request of each in turn, so that the machine's drift falls on all alike
(`cache.run_decode_interleaved`). The others (-whole, -sampled, -prefetchN) need an engine of
their own.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from strata import _cpu_experts
from strata.engine.cache import graph_call
from strata.engine.cache.kept_rates import auto_split
from strata.engine.cache.rates import RatesKey, measure_rates
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


def split_room(args: argparse.Namespace) -> int:
    """The blobs `--split-room` asks the base run's staging buffer to hold: the largest count
    any `--split-counts` N or `table_splits` table streams (0 without the flag)."""
    if not args.split_room:
        return 0
    return max([*args.split_counts, *(rule.n_blobs for rule in args.table_rules.values())],
               default=0)


def split_settings(args: argparse.Namespace, streamer: Any, say: Any) -> list[str]:
    """-splitN for each `--split-counts` N the run's staging buffer holds (streaming min(N, M)
    of a layer's M misses), each again as -splitN-sync with `--sync-cpu` and -splitN-noshrink
    with `--no-cpu-shrink`; then each of `table_splits`' tables the buffer holds; none without
    a staging buffer. Each one asked for that the buffer cannot hold is said, not run
    (`--split-room` gives the buffer room for them: `split_room`)."""
    if streamer is None:
        if args.split_counts or args.table_rules:
            say("the split settings left out: the run streams no misses (no staging buffer)")
        return []
    blobs = streamer.n_blobs
    for n in args.split_counts:
        if n > blobs:
            say(f"-split{n} left out: the run's staging buffer holds {blobs} experts")
    for name, rule in args.table_rules.items():
        if rule.n_blobs > blobs:
            say(f"{name} ({rule.text()}) left out: it streams up to {rule.n_blobs} experts, "
                f"the run's staging buffer holds {blobs}")
    return [*(f"-split{n}{mode}" for n in args.split_counts if n <= blobs
              for mode in ["", *(["-sync"] if args.sync_cpu else []),
                           *(["-noshrink"] if args.no_cpu_shrink else [])]),
            *(name for name, rule in args.table_rules.items() if rule.n_blobs <= blobs)]


def table_splits(args: argparse.Namespace, config: Any, dtype: Any, device: Any,
                 quant: str | None, say: Any) -> None:
    """`args.table_rules`, by setting: -table<counts> for each `--split-tables` table,
    -rule<name> for each `--split-rules` rule the split the kept rates give by it, and -gap<us>
    for each `--rates-gaps` gap the split `measure_rates` gives with each timed call that long
    after the last (measured now, on this format's store, kept nowhere); each rule's and
    gap's split said. The tables are K + 1 long (bench/offload.py's `main` checked them)."""
    rules = {}
    for counts in args.split_tables:
        rules["-table" + "".join(map(str, counts))] = StreamSplit(counts, "--split-tables")
    if args.split_rules and torch.device(device).type == "cuda":
        _, kept = auto_split(config, dtype, device, cpu_threads=args.cpu_threads, quant=quant)
        for name in args.split_rules:
            split = kept.split(name)
            say(f"the kept rates split by {name}: {split.text()}")
            rules[f"-rule{name}"] = StreamSplit(split.counts, f"rule {name}")
    if args.rates_gaps and torch.device(device).type == "cuda":
        key = RatesKey.of(config, dtype, device, args.cpu_threads, quant)
        for gap_us in args.rates_gaps:
            rates = measure_rates(key, dtype, device, cpu_threads=args.cpu_threads,
                                  gap_s=gap_us / 1e6)
            split = rates.split()
            say(f"rates timed {gap_us} us apart: split {split.text()} (upload and compute "
                f"{rates.stream_bytes_per_s / 1e9:.1f} GB/s, CPU experts "
                f"{rates.cpu_bytes_per_s / 1e9:.1f} GB/s)")
            rules[f"-gap{gap_us}"] = StreamSplit(split.counts, f"rates {gap_us} us apart")
    args.table_rules = rules


def apply_setting(cache: Any, setting: str, args: argparse.Namespace,
                  rule: StreamSplit | None, top_k: int) -> None:
    """Set `cache` (a `CachedExperts`) as `setting` says, every other setting back to the
    base run's: `rule` its streamer's split rule, the team `default_team`'s. ""
    puts everything back (and `graph_call.LAUNCH_AHEAD` off)."""
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
        cache.streamer.split_rule = setting_split(setting, args, rule, top_k)


def setting_split(setting: str, args: argparse.Namespace, rule: StreamSplit | None,
                  top_k: int) -> StreamSplit | None:
    """The split `setting` runs with: its table's, min(N, M) for -splitN, else the run's
    `rule`."""
    if setting in args.table_rules:
        return args.table_rules[setting]
    if setting.startswith("-split"):
        return StreamSplit.fixed(int(setting.removeprefix("-split").partition("-")[0]), top_k)
    return rule
