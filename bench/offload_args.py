"""bench/offload.py's command line: its flags, checked, with their comma-separated lists parsed.

`parse_args` returns argparse's namespace with these lists on it: `streams` (`--stream-misses`: auto
or ints), `loan_batches` (`--loan-upload-batches`; [None]: the engine's), `prefetch_caps`
(`--prefetch`), `split_counts` (`--split-counts`, in place of its text), `cpu_schedules`,
`cpu_prefetches` (strings), `cpu_weight_rows` ((G, D) pairs), `cpu_down_blocks`, `cpu_teams`,
`split_tables` (tuples of counts), `rates_gaps` (microseconds), `split_rules` and `formats`
(`--experts-dtype`). A bad value is the parser's error, naming the flag and what it takes.
"""

from __future__ import annotations

import argparse

from _common import (
    add_kv_env_arguments,
    add_model_arguments,
    down_block_rows,
    rows_at_once,
)
from strata import _cpu_experts
from strata.engine.cache.rates import SPLIT_RULES
from strata.engine.experts.quant import EXPERTS_DTYPES


def parse_args(argv: list[str] | None, description: str) -> argparse.Namespace:
    """bench/offload.py's arguments (see the module)."""
    parser = argparse.ArgumentParser(description=description)
    add_model_arguments(parser, preset="olmoe-1b-7b")
    parser.add_argument("--model", help="a checkpoint directory to use instead of writing one")
    parser.add_argument("--budget-mib", type=float,
                        help="--vram-budget-mib of the small cache (default: an --expert-cache "
                        "of --expert-share of the experts, the budget the device's free memory)")
    parser.add_argument("--expert-share", type=float, default=0.22)
    parser.add_argument("--stream-misses", default="auto",
                        help="comma-separated: auto and/or N, a decode run each (default auto)")
    parser.add_argument("--cpu-threads", type=int, help="the cache's --cpu-threads")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prefill-tokens", type=int, default=4096,
                        help="the long prompt (0: no prefill run)")
    parser.add_argument("--prefill-chunk", type=int,
                        help="the prompt's chunk (default: the one the cache chooses from its "
                        "budget, as strata generate's)")
    parser.add_argument("--loan-upload-batches",
                        help="comma-separated counts: a prefill run with each as the loan's "
                        "upload batches (default: one run, the engine's)")
    parser.add_argument("--profile-prompts", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3, help="timed runs (the median)")
    parser.add_argument("--eager", action="store_true",
                        help="eager decode rounds (default: piecewise CUDA graphs on CUDA)")
    parser.add_argument("--prefetch", default="",
                        help="comma-separated caps N: also run each decode with up to N of "
                        "the next layer's predicted misses prefetched "
                        "(`strata.engine.cache.prefetch`), named -prefetchN")
    parser.add_argument("--cli-sampling", action="store_true",
                        help="also run each decode with `strata generate`'s default sampling "
                        "(greedy otherwise), named -sampled")
    parser.add_argument("--cpu-schedule", default="",
                        help="comma-separated schedules of the CPU kernel's tasks other than "
                        "the default dynamic (static: equal fixed shares, the schedule "
                        "before; guided; steal: fixed shares a thread done with its own "
                        "takes from; steal-alone: steal, the engine's thread only waiting): "
                        "also run each decode with each, named -static, -guided, -steal, "
                        "-steal-alone (`CpuExperts.schedule`, `caller_helps`)")
    parser.add_argument("--cpu-prefetch", default="",
                        help="comma-separated multiples of 64 (0: none): also run each decode "
                        "with the CPU kernel's weights prefetched that many bytes ahead of "
                        "its reads, named -cpupfN (`CpuExperts.prefetch_bytes`; the default is "
                        "`_cpu_experts.PREFETCH_BYTES`)")
    parser.add_argument("--cpu-weight-rows", default="",
                        help="comma-separated GxD (G, D: 1, 2 or 4): also run each decode with "
                        "the CPU kernel reading G of gate's and up's rows and D of down's at "
                        "once, named -rowsGxD (`CpuExperts.gate_up_rows`, `down_rows`; the "
                        "defaults are `_cpu_experts.GATE_UP_ROWS`, `DOWN_ROWS`)")
    parser.add_argument("--cpu-down-block-rows", default="",
                        help="comma-separated multiples of 16 (up to 1024): also run each "
                        "decode with the CPU kernel's pass-2 tasks that many rows of down each, "
                        "named -downblockN (`CpuExperts.down_block_rows`; the default is "
                        "`_cpu_experts.DOWN_BLOCK_ROWS`)")
    parser.add_argument("--cpu-team", default="",
                        help="comma-separated thread counts: also run each decode with the "
                        "CPU's own thread's OpenMP team that many threads strong, named "
                        "-teamN (`CpuExperts.team_threads`; the default team is a quarter "
                        "short of --cpu-threads, torch's threads by default: `default_team`)")
    parser.add_argument("--interleave", action="store_true",
                        help="run --wake-cpu's, --sync-cpu's, --cpu-schedule's, "
                        "--cpu-prefetch's, --cpu-weight-rows', --cpu-down-block-rows', "
                        "--cpu-team's, --cpu-spin's, --cpu-pin's and "
                        "--no-cpu-shrink's "
                        "variants in the base run's engine, one request of each in turn "
                        "(`run_decode_interleaved`), so that the machine's drift falls on all "
                        "alike")
    parser.add_argument("--split-counts", default="",
                        help="with --interleave, comma-separated N: also run each decode "
                        "streaming min(N, M) of a layer's M misses through the run's own "
                        "staging buffer (N up to its blobs), named -splitN: counts compared "
                        "with the same slots, interleaved (with --sync-cpu each count again "
                        "as -splitN-sync, with --no-cpu-shrink as -splitN-noshrink)")
    parser.add_argument("--split-tables", default="",
                        help="with --interleave, /-separated tables of K + 1 comma-separated "
                        "counts (counts[M]: of M misses, how many a layer streams), e.g. "
                        "0,0,1,1,1,1,2,2,2: also run each decode with each table as its split "
                        "(`StreamSplit`), named -table<counts>, where the run's staging buffer "
                        "holds its largest count")
    parser.add_argument("--rates-gaps", default="",
                        help="with --interleave, comma-separated microseconds: also run each "
                        "decode with the split that --stream-misses auto's rates give when "
                        "each timed call waits that long after the last (measured now, not "
                        "kept; the kept rates wait `rate_calls.ROUND_GAP_S`), named -gap<us>, "
                        "where the run's staging buffer holds it")
    parser.add_argument("--split-rules", default="",
                        help="with --interleave, comma-separated rules of "
                        f"{', '.join(SPLIT_RULES)}: also run each decode with the split the "
                        "kept rates give by that rule (`MissRates.split`; the default rule is "
                        "`rates.SPLIT_RULE`), named -rule<name>, where the run's staging buffer "
                        "holds it")
    parser.add_argument("--split-room", action="store_true",
                        help="with --interleave, give the base run's staging buffer room for "
                        "the largest count any --split-counts, --split-tables or --split-rules "
                        "setting streams, so that none is left out: every setting, the base's "
                        "split too, then runs with that buffer (where a budget sizes the "
                        "cache, a few slots fewer, alike for all)")
    for flag, text in VARIANT_FLAGS.items():  # each adds a run of every decode, named -<name>
        parser.add_argument(flag, action="store_true", help=text)
    parser.add_argument("--profile", metavar="DIR",
                        help="after each decode run's timed requests, profile two more: the "
                        "device's copy engine and compute busy a round (torch's profiler, "
                        "`profile` in the run's JSON) and the host's top functions "
                        "(cProfile, DIR/<run>.host.txt); after each prefill run's, one "
                        "more of each: the device's busy time over the whole prompt")
    parser.add_argument("--trace", metavar="DIR",
                        help="after each decode run's timed requests, trace one more of "
                        "--new-tokens / 4 tokens with the host's steps of each layer call "
                        "marked (bench/round_trace.py): DIR/<run>.trace.json.gz, and the "
                        "layer's figures as `trace` in the run's JSON")
    parser.add_argument("--host-steps", action="store_true",
                        help="after each decode run's timed requests, one more of --new-tokens "
                        "tokens with the host's steps of each layer call timed by its clock, "
                        "no profiler (bench/round_trace.py's `clocked`): µs a layer call as "
                        "`host_steps` in the run's JSON")
    parser.add_argument("--host-read-mib", type=int, default=2048)
    parser.add_argument("--copy-mib", type=int, default=1024)
    parser.add_argument("--experts-dtype", default="auto",
                        help="comma-separated --experts-dtype values, the runs of each (auto)")
    parser.add_argument("--share-per-format", action="store_true",
                        help="with --expert-share: each format's cache holds that share of the "
                        "experts at its own blob size (default: every format gets the MiB "
                        "that hold the share at the checkpoint's)")
    parser.add_argument("--full-layers", type=int,
                        help="scale per-layer figures to this depth (default: the preset's)")
    add_kv_env_arguments(parser)  # --loan-keep-slots, --chunk-bytes for tiny models
    parser.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    args = parser.parse_args(argv)
    try:
        args.streams = stream_values(args.stream_misses)
    except ValueError:
        parser.error(f"--stream-misses takes distinct comma-separated auto or N, got "
                     f"{args.stream_misses!r}")
    if args.new_tokens < 2 or args.repeat < 1:
        parser.error("--new-tokens must be >= 2, --repeat >= 1")
    args.loan_batches = [None] if args.loan_upload_batches is None else \
        _counts(parser, "--loan-upload-batches", args.loan_upload_batches)
    args.prefetch_caps = _counts(parser, "--prefetch", args.prefetch) if args.prefetch else []
    args.split_counts = _counts(parser, "--split-counts", args.split_counts) \
        if args.split_counts else []
    if args.split_counts and not args.interleave:
        parser.error("--split-counts runs in the base run's engine: give --interleave too")
    tables, gaps = split_tables(args.split_tables), gaps_us(args.rates_gaps)
    if tables is None:
        parser.error(f"--split-tables takes distinct /-separated tables of comma-separated "
                     f"counts, each 0 first and counts[M] <= M, got {args.split_tables!r}")
    if gaps is None:
        parser.error(f"--rates-gaps takes distinct comma-separated microseconds >= 0, got "
                     f"{args.rates_gaps!r}")
    rules = [rule for rule in args.split_rules.split(",") if rule]
    if len(set(rules)) != len(rules) or not set(rules) <= set(SPLIT_RULES):
        parser.error(f"--split-rules takes distinct comma-separated rules of "
                     f"{', '.join(SPLIT_RULES)}, got {args.split_rules!r}")
    args.split_tables, args.rates_gaps, args.split_rules = tables, gaps, rules
    if args.split_room and not args.interleave:
        parser.error("--split-room gives the base run's engine room for its settings: give "
                     "--interleave too")
    if (tables or gaps or rules) and not args.interleave:
        parser.error("--split-tables, --rates-gaps and --split-rules run in the base run's "
                     "engine: give --interleave too")
    args.cpu_schedules = args.cpu_schedule.split(",") if args.cpu_schedule else []
    if len(set(args.cpu_schedules)) != len(args.cpu_schedules) \
            or not set(args.cpu_schedules) <= {"static", "guided", "steal", "steal-alone"}:
        parser.error(f"--cpu-schedule takes distinct comma-separated static, guided, steal and "
                     f"steal-alone (the default, dynamic, runs anyway), got "
                     f"{args.cpu_schedule!r}")
    args.cpu_prefetches = [n for n in args.cpu_prefetch.split(",") if n]
    if not all(n.isdigit() and not int(n) % 64 for n in args.cpu_prefetches) \
            or len(set(args.cpu_prefetches)) != len(args.cpu_prefetches):
        parser.error(f"--cpu-prefetch takes distinct comma-separated multiples of 64, got "
                     f"{args.cpu_prefetch!r}")
    weight_rows = rows_at_once(args.cpu_weight_rows)
    if weight_rows is None:
        parser.error(f"--cpu-weight-rows takes distinct comma-separated GxD, G and D each 1, 2 "
                     f"or 4 (the defaults, {_cpu_experts.GATE_UP_ROWS}x"
                     f"{_cpu_experts.DOWN_ROWS}, run anyway), got {args.cpu_weight_rows!r}")
    args.cpu_weight_rows = weight_rows
    args.cpu_down_blocks = down_block_rows(args.cpu_down_block_rows)
    if args.cpu_down_blocks is None:
        parser.error(f"--cpu-down-block-rows takes distinct comma-separated multiples of 16 from "
                     f"16 to 1024, got {args.cpu_down_block_rows!r}")
    args.cpu_teams = _counts(parser, "--cpu-team", args.cpu_team) if args.cpu_team else []
    args.formats = args.experts_dtype.split(",")
    if len(set(args.formats)) != len(args.formats) \
            or any(f not in EXPERTS_DTYPES for f in args.formats):
        parser.error(f"--experts-dtype takes distinct comma-separated values of "
                     f"{', '.join(EXPERTS_DTYPES)}, got {args.experts_dtype!r}")
    if args.share_per_format and args.budget_mib:
        parser.error("--share-per-format sizes each format's cache by --expert-share, which "
                     "--budget-mib replaces: give one of them")
    return args


def split_tables(text: str) -> list[tuple[int, ...]] | None:
    """`--split-tables`' tables (none for ""), or None for text that is not distinct tables of
    counts with counts[0] == 0 and 0 <= counts[M] <= M (K + 1 is checked against the model's
    K where a run takes them)."""
    tables = []
    for part in filter(None, text.split("/")):
        try:
            table = tuple(int(n) for n in part.split(","))
        except ValueError:
            return None
        if table[0] != 0 or any(not 0 <= n <= m for m, n in enumerate(table)):
            return None
        tables.append(table)
    return tables if len(set(tables)) == len(tables) else None


def gaps_us(text: str) -> list[int] | None:
    """`--rates-gaps`' microseconds (none for ""), or None for anything but distinct ints >= 0."""
    parts = [part.strip() for part in text.split(",")] if text else []
    if not all(part.isdigit() for part in parts) or len(set(parts)) != len(parts):
        return None
    return [int(part) for part in parts]


def stream_values(text: str) -> list[int | str]:
    """`--stream-misses`' comma-separated values: auto or ints."""
    values: list[int | str] = []
    for part in text.split(","):
        part = part.strip()
        values.append(part if part == "auto" else int(part))
    if not values or len(set(values)) != len(values):
        raise ValueError(text)
    return values


def _counts(parser: argparse.ArgumentParser, flag: str, text: str) -> list[int]:
    """Distinct comma-separated counts >= 1 from `text`, or the parser's error naming `flag`."""
    try:
        counts = [int(n) for n in text.split(",")]
    except ValueError:
        counts = [0]
    if any(n < 1 for n in counts) or len(set(counts)) != len(counts):
        parser.error(f"{flag} takes distinct comma-separated counts >= 1, got {text!r}")
    return counts


# The flags that run each decode again with one setting of the cache changed, and their help.
VARIANT_FLAGS = {
    "--sync-cpu": "also run each decode with the CPU's misses computed on the engine's thread "
                  "after its uploads (`CachedExperts.async_cpu` off: the way before), named "
                  "-sync",
    "--cpu-spin": "also run each decode with the CPU's thread keeping its OpenMP team spinning "
                  "between calls (`CpuExperts.keep_team_up`), named -spin",
    "--cpu-pin": "also run each decode with the CPU's thread's team pinned, one CPU a thread, "
                 "to the last CPUs of the process (`CpuExperts.pin_team`), named -pin",
    "--no-cpu-shrink": "also run each decode with the engine thread's OpenMP pool left as it "
                       "grows, not shrunk before the CPU's thread computes "
                       "(`CpuExperts.shrink_caller_team` off: the way before), named -noshrink",
    "--wake-cpu": "also run each decode with the CPU kernel's threads started before each "
                  "call's routing read (`CachedExperts.wake_cpu`), named -wake",
    "--launch-ahead": "also run each decode with each split call's next graph launched before "
                      "the CPU's rows are done, behind a wait the host sets when they are "
                      "(`graph_call.LAUNCH_AHEAD`), named -ahead",
    "--whole-calls": "also run each decode with the cache's calls whole, not split around the "
                     "piecewise graphs (`graph_call`): the split's baseline, named -whole",
}
