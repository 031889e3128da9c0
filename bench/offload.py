"""Benchmark issue 17's figures: decode and prefill with the experts mostly in host RAM, beside
the bounds the machine sets, all measured in one run.

One checkpoint (`--preset`, `--layers`, `--router-skew`; or `--model`) is loaded once; its host
store is shared by every run, each building a fresh cache around it (as bench/prefill_chunk.py
and bench/kv_grow.py do). The profile is the routing of a few seeded prompts. Measured, in order:

- the machine: the host's read bandwidth (a torch sum over `--host-read-mib` on all threads,
  the best of a few) and the copy rate of pinned host memory to the device (one large copy,
  CUDA events; none off CUDA: no bus);
- `device round`: a decode round with every expert resident on the device (CUDA graphs where
  there are): the device's own compute of a round, the part no offloading removes;
- a decode round at the small cache (`--budget-mib`, or an `--expert-cache` of
  `--expert-share` of the experts; `--stream-misses`, default `auto`, and any others given,
  comma-separated, each a run), rounds as `strata generate` runs them (piecewise CUDA graphs;
  `--eager` for eager rounds; the cache's calls split around the graphs, the hits inside them:
  `strata.engine.cache.graph_call`; `--whole-calls` adds each run again with the calls whole,
  the split's baseline, named -whole; `--prefetch N[,N...]` adds each run that streams again
  with up to N of the next layer's predicted misses prefetched, named -prefetchN:
  `strata.engine.cache.prefetch`, its prefetched experts and how many the next layer used;
  an N above a run's staging blobs is skipped; `--wake-cpu` adds each run again with the CPU
  kernel's threads started before each call's routing read, named -wake:
  `CachedExperts.wake_cpu`; `--cpu-schedule static,guided,steal` with the CPU kernel's tasks
  in fixed shares a thread (the schedule before), guided shares or fixed shares that a thread
  done with its own takes from, named -static, -guided, -steal: `CpuExperts.schedule`
  (`steal-alone`: steal with the engine's thread only waiting, `CpuExperts.caller_helps`
  off);
  `--cpu-prefetch N[,N...]` with the CPU kernel's weights prefetched N bytes ahead of its
  reads, named -cpupfN: `CpuExperts.prefetch_bytes`; `--cpu-weight-rows GxD[,GxD]` with
  the CPU kernel reading G of gate's and up's rows and D of down's at once (1, 2 or 4 each),
  named -rowsGxD: `CpuExperts.gate_up_rows`, `down_rows`; `--cpu-down-block-rows N[,N...]`
  with the CPU kernel's pass-2 tasks N rows of down each, named -downblockN:
  `CpuExperts.down_block_rows`;
  `--cpu-team N[,N...]` with the CPU's
  own thread's team N threads strong (the default, `default_team`, is a quarter short of the
  cache's CPU threads, torch's count), leaving the other cores to the engine's thread and
  everything else the process and the machine run, named -teamN: `CpuExperts.team_threads`
  N, the misses
  split as the base run's, a straggler test (a team as large as the cores left waits for any
  thread the scheduler takes a core from); `--sync-cpu` with the
  CPU's misses computed on the engine's thread after its uploads, not on a thread of their own
  from the routing read on (`CachedExperts.async_cpu` off, the way before), named -sync;
  `--cpu-spin` with the CPU's thread keeping its team spinning between calls, named -spin:
  `CpuExperts.keep_team_up`; `--cpu-pin` with that team pinned, one CPU a thread, to the
  process's last CPUs, named -pin: `CpuExperts.pin_team`; `--no-cpu-shrink` with the engine
  thread's OpenMP pool left as it grows, not shrunk before the CPU's thread computes
  (`CpuExperts.shrink_caller_team` off, the way before), named -noshrink;
  `--interleave` runs those (-static, -guided, -cpupfN, -rowsGxD, -downblockN, -teamN, -sync,
  -spin, -pin, -noshrink), -wake and -ahead in the base run's engine, one request of each in
  turn, so that a machine's drift falls on all alike, and with
  `--split-counts N[,N...]` that engine streaming min(N, M) of M misses too, named -splitN
  (the counts compared with the same slots; with `--sync-cpu` each again as -splitN-sync,
  with `--no-cpu-shrink` as -splitN-noshrink); `--split-tables T[/T...]` with each table of
  counts (counts[M] of M misses streamed) as the split, named -table<counts>, and
  `--rates-gaps US[,US...]` with the split auto's rates give when their timed calls are US
  microseconds apart, measured then, named -gap<us>, and `--split-rules R[,R...]` with the
  split the kept rates give by each rule (`rates.SPLIT_RULES`), named -rule<name> (each where
  the staging buffer holds it, else said and left out; `--split-room` gives the buffer room for
  the largest; the JSON's `split` says each run's table); `--launch-ahead`
  with each split call's next graph launched before the CPU's rows are done, queued behind a
  wait the host sets when they are (`graph_call.LAUNCH_AHEAD`), named -ahead (interleaved too);
  `--cli-sampling` with
  `strata generate`'s default sampling instead of greedy, named -sampled: the pick's host time
  in a round the host holds). For
  each: the round's time; its misses split between the CPU and the copy engine (experts and
  shares); the bound, max(CPU's miss bytes / host read
  bandwidth, streamed bytes / copy rate) + the device round (summed over the round, so a lower
  bound); the CPU experts' GB/s and its share of the host read bandwidth (beside which the
  JSON has the machine's transparent huge page mode and, per experts format, the share of the
  store the kernel backs with huge pages: the CPU's rate depends on its pages); the host-side time
  of a round: the round less the CPU experts' time, the cache's time waiting for the device
  (`CacheStats`: `cpu_s`, `wait_s`) and the decode loop's wait for the round's token (the
  device's tail of the round: `decode_token_wait_s`, `token_wait_ms`), i.e. issuing, booking
  and everything around the kernels (`host_ms_with_token_wait` counts the token's wait too,
  as runs before 2026-12-06 did); under
  `--cpu-schedule steal`, the share of the CPU kernel's tasks the engine's thread ran while it
  waited for them (`CacheStats`: `cpu_waiter_tasks` of `cpu_tasks`); what the scheduler did
  to the process's threads a round, the engine's and the others' (the CPU's team, named
  `_cpu_experts.WORKER_NAME`, among them; by name in the JSON): sleeps, preemptions, time
  ready but waiting for a core, migrations (`bench/thread_sched.py`), which tell a CPU team
  that sleeps from one scheduled away when its rate moves from one process to the next;
- prefill of a `--prefill-tokens` prompt at the same cache with the prompt loan: its time, the
  expert bytes it uploaded and the upload bound (bytes / copy rate) beside it, and where the
  time went: the cache's uploads (`upload_s`: the host's time queueing them, which is their
  time only where the host waits for them, at `--loan-upload-batches 1`), the rest of the
  cache (of it, the routing's reads), and outside the cache (attention, the dense layers).
  `--loan-upload-batches` (comma-separated) makes a prefill run for each count of batches a
  layer's loaned misses upload in (`STRATA_LOAN_UPLOAD_BATCHES`), named -bN.

With `--experts-dtype` (comma-separated, e.g. `auto,int8,int4`) all of it is measured for each
format, the experts quantized at load into a store of their own, at the same cache MiB (so a
quantized cache holds more slots; with `--share-per-format` each format's cache holds
`--expert-share` of the experts instead, at its own blob size) and beside the same machine
figures: the device round, the decode runs (their names end in the format) and the prefill,
each bound counted at the format's bytes.

Per-layer figures and tok/s scaled to the preset's full depth (`--full-layers`, default the
preset's) are printed beside the measured ones for a shortened model, saying so.

Its parts: the flags and their checks (`offload_args`), the machine's rates (`offload_rates`),
the decode variants and how each sets the cache (`offload_variants`), a run's figures, lines
and the report (`offload_report`), the profiled and traced requests (`offload_profile`); here,
the runs. bench/rounds.py tabulates the JSON lines it prints.

    python bench/offload.py --preset tiny --device cpu --new-tokens 8 --prefill-tokens 128 \\
        --host-read-mib 64 --loan-keep-slots 0                           # here, in seconds
    python bench/offload.py --preset olmoe-1b-7b --budget-mib 4096      # the GPU machine
    python bench/offload.py --preset qwen3-30b-a3b --layers 16 --expert-share 0.22 \\
        --router-skew 0.5 --stream-misses auto,0,4                       # bench/gpu_session.sh
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import platform
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch

from _common import (
    byte_tokens,
    checkpoint_for,
    cli_sampling,
    engine_around,
    free_memory,
    set_kv_env,
    sync,
)
from cache import (
    cache_mib_for_share,
    run_decode,
    run_decode_interleaved,
    run_prefill,
    share_mib,
)
from offload_args import parse_args
from offload_profile import look_closer, profile_prefill
from offload_rates import machine_line, measure_machine
from offload_report import (
    decode_lines,
    prefill_figures,
    prefill_line,
    print_report,
    round_figures,
)
from offload_variants import (
    apply_setting,
    cache_settings,
    decode_variants,
    setting_split,
    split_room,
    split_settings,
    table_splits,
)
from strata.engine.cache.build import build_cached_experts, plan_cache, staging_blobs
from strata.engine.cache.kept_rates import resolve_stream_misses
from strata.engine.experts import ResidentExperts
from strata.engine.experts.quant import experts_quant_for
from strata.engine.experts.streamed import StreamSplit
from strata.engine.model.checkpoint import Checkpoint, expert_store
from strata.engine.model.config import ModelConfig
from strata.engine.model.presets import get_preset
from strata.engine.runtime.calibrate import collect_counts
from strata.engine.runtime.engine import Engine
from strata.engine.runtime.generate import CACHED_PREFILL_CHUNK
from strata.engine.runtime.load import Loaded, load
from strata.formats.profile import rank_from_counts, uniform_rank
from strata.machine import huge_page_bytes
from strata.settings import LOAN_UPLOAD_BATCHES


def device_round(model, store, device, prompt, args, max_context: int, say) -> float | None:
    """Ms of a decode round with every expert resident on the device (CUDA graphs where there
    are): the device's own compute of a round. None, said, where the device cannot hold them."""
    def resident_run() -> dict:  # its engine (and graphs) gone when it returns
        model.experts = ResidentExperts(store, device)
        with Engine(Loaded(model), None, max_context=max_context) as engine:
            return run_decode(engine, prompt, args.new_tokens, args.repeat, max_context)

    try:
        resident = resident_run()
        say(f"device round (every expert resident, {resident['decode_path']}): "
            f"{resident['decode_ms_per_round']:.2f} ms")
        return resident["decode_ms_per_round"]
    except torch.OutOfMemoryError:
        say("device round: the device cannot hold every expert: the bound leaves out the "
            "device's compute")
        return None
    finally:
        model.experts = None
        free_memory(device)


def store_of_format(ckpt: Path, dtype: torch.dtype, device: torch.device, quant: str):
    """The checkpoint's experts quantized into `quant`, pinned on CUDA."""
    opened = Checkpoint.open(ckpt)
    try:
        return expert_store(opened, dtype, pin_memory=device.type == "cuda", quant=quant)
    finally:
        opened.close()


@contextlib.contextmanager
def _loan_upload_batches(batches: int | None) -> Iterator[None]:
    """`STRATA_LOAN_UPLOAD_BATCHES` set to `batches` inside (None: left as it is), then back."""
    before = os.environ.get(LOAN_UPLOAD_BATCHES)
    if batches is not None:
        os.environ[LOAN_UPLOAD_BATCHES] = str(batches)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(LOAN_UPLOAD_BATCHES, None)
        else:
            os.environ[LOAN_UPLOAD_BATCHES] = before


class Setup(NamedTuple):
    """What every run of one invocation shares: the parsed flags, the checkpoint's config, the
    model (loaded once, its experts replaced by each run's), the profile's rank (every cache's),
    the machine's rates, the depth per-layer figures are scaled to, and where lines are said."""

    args: Any
    cfg: ModelConfig
    dtype: torch.dtype
    device: torch.device
    model: Any
    rank: Any
    machine: dict
    full_layers: int
    say: Any


class Format(NamedTuple):
    """One `--experts-dtype`'s runs: its name, the suffix of its runs' names ("" where it is the
    only one), its store, its quantization (None: the checkpoint's dtype), the cache's sizing
    (`plan_cache`'s budget arguments) and its device round (ms; None where the device cannot
    hold every expert)."""

    name: str
    suffix: str
    store: Any
    quant: str | None
    sized: dict
    device_round_ms: float | None


def cached_engine(setup: Setup, fmt: Format, stream: int | str, max_context: int, loan: bool,
                  prefetch: int = 0, room: int = 0) -> tuple[Any, list[str]]:
    """An engine around the model with a cache of `fmt`'s store streaming `stream` misses a
    call (auto: resolved from the kept rates, which its notes say), and the notes; its
    staging buffer `room` blobs where that is more than the split streams (`--split-room`)."""
    cfg, args = setup.cfg, setup.args
    value, notes = resolve_stream_misses(stream, cfg, setup.dtype, setup.device,
                                         cpu_threads=args.cpu_threads, quant=fmt.quant)
    split = value if isinstance(value, StreamSplit) else StreamSplit.fixed(value, cfg.top_k)
    roomier = room > split.n_blobs > 0  # a buffer of `room` blobs, the split still `value`'s
    config = plan_cache(cfg, setup.dtype, setup.device, rank=setup.rank,
                        max_context=max_context, prefill_chunk=args.prefill_chunk,
                        prefill_loan=loan, experts_quant=fmt.quant, prefetch_misses=prefetch,
                        stream_misses=StreamSplit.fixed(room, cfg.top_k) if roomier else value,
                        **fmt.sized)
    setup.model.experts = build_cached_experts(config, fmt.store, setup.device)
    if roomier:
        setup.model.experts.streamer.split_rule = split
        notes = [*notes, f"--split-room: the staging buffer holds {room} experts, the base "
                         f"run streams {split.text()}"]
    if prefetch:
        setup.model.experts.use_routers([layer.moe.router for layer in setup.model.layers],
                                        cfg.top_k)
    return engine_around(setup.model, None, max_context), notes


def decode_runs(setup: Setup, fmt: Format, prompt: list[int], max_context: int
                ) -> dict[str, dict]:
    """Every decode run of `fmt`: each `--stream-misses` value with each variant
    (`offload_variants`), by name, their round's figures added and said."""
    args, cfg, device = setup.args, setup.cfg, setup.device
    table_splits(args, cfg, setup.dtype, device, fmt.quant, setup.say)
    settings = cache_settings(args)
    together = settings if args.interleave else []
    runs: dict[str, dict] = {}
    for stream in args.streams:
        for variant, cap in decode_variants(args, settings):
            # Resolved here only for a cap: the engine's own resolve then says whether auto's
            # rates were measured now or read.
            if cap and cap > staging_blobs(resolve_stream_misses(
                    stream, cfg, setup.dtype, device, cpu_threads=args.cpu_threads,
                    quant=fmt.quant)[0]):
                continue  # fewer staging blobs (none: 0, or auto off CUDA) than the cap
            name = f"decode-stream-{stream}{variant}{fmt.suffix}"
            engine, notes = cached_engine(setup, fmt, stream, max_context, loan=False,
                                          prefetch=cap,
                                          room=split_room(args) if variant == "" else 0)
            engine.cache.split_calls = variant != "-whole"
            streamer = engine.cache.streamer
            rule = streamer.split_rule if streamer is not None else None
            splits = split_settings(args, streamer, setup.say) if variant == "" else []
            set_up = functools.partial(apply_setting, engine.cache, args=args, rule=rule,
                                       top_k=cfg.top_k)
            with engine:
                for note in notes:
                    setup.say(note)
                if variant == "" and together + splits:
                    named = run_decode_interleaved(
                        engine, prompt, args.new_tokens, args.repeat, max_context,
                        {setting: functools.partial(set_up, setting)
                         for setting in ["", *together, *splits]},
                        cuda_graphs=not args.eager, piecewise=not args.eager)
                    decoded = {f"decode-stream-{stream}{setting}{fmt.suffix}": run
                               for setting, run in named.items()}
                    for setting, run in named.items():  # the table each setting split by
                        chosen = setting_split(setting, args, rule, cfg.top_k)
                        run["split"] = None if chosen is None else chosen.text()
                    set_up("")
                else:
                    set_up(variant)
                    decoded = {name: run_decode(
                        engine, prompt, args.new_tokens, args.repeat, max_context,
                        cuda_graphs=not args.eager, piecewise=not args.eager,
                        sampling=cli_sampling() if variant == "-sampled" else None)}
                for run in decoded.values():
                    run["startup"] = engine.cache.budget.startup_line()
                    run["notes"] = notes
                    run["slots"] = engine.cache.arena.n_slots
                    run["experts_dtype"] = fmt.name
                    run["interleaved"] = len(decoded) > 1
                    # The run its requests took turns with, request by request (rounds.py
                    # --interleaved): the setting-less one of this stream and format.
                    run["interleaved_base"] = f"decode-stream-{stream}{fmt.suffix}" \
                        if len(decoded) > 1 else None
                look_closer(engine, decoded[name], name, prompt, args, max_context)
            del engine  # and its graphs
            setup.model.experts = None
            free_memory(device)
            for run_name, run in decoded.items():
                run["round"] = round_figures(run, fmt.store.blob_bytes, setup.machine,
                                             fmt.device_round_ms, cfg.n_layers,
                                             setup.full_layers)
                runs[run_name] = run
                for line in decode_lines(run_name, run):
                    setup.say(line)
    return runs


def prefill_runs(setup: Setup, fmt: Format, prompt: list[int], max_context: int
                 ) -> dict[str, dict]:
    """`fmt`'s prefill of `prompt` with the prompt loan, a run for each count of
    `--loan-upload-batches` (-bN), by name, their upload bound added and said."""
    args = setup.args
    runs: dict[str, dict] = {}
    for batches in args.loan_batches:
        with _loan_upload_batches(batches):  # read when the cache is built
            engine, _ = cached_engine(setup, fmt, args.streams[0], max_context, loan=True)
        with engine:
            run = run_prefill(engine, prompt, args.repeat, max_context,
                              prefill_chunk=args.prefill_chunk)
            name = f"prefill-loan{fmt.suffix}" + (f"-b{batches}" if batches is not None else "")
            if args.profile:
                run["profile"] = profile_prefill(engine, prompt, max_context,
                                                 args.prefill_chunk,
                                                 Path(args.profile) / f"{name}.host.txt")
            run["startup"] = engine.cache.budget.startup_line()
            run["prefill_chunk"] = args.prefill_chunk or engine.cache.budget.prefill_chunk
            run["experts_dtype"] = fmt.name
            run["loan_upload_batches"] = setup.model.experts.loan.options.upload_batches
        del engine
        setup.model.experts = None
        free_memory(setup.device)
        prefill_figures(run, setup.machine, setup.cfg.n_layers, setup.full_layers)
        runs[name] = run
        setup.say(prefill_line(name, run, setup.full_layers))
    return runs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv, __doc__.split("\n\n")[0])
    set_kv_env(args)
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    full_layers = args.full_layers or get_preset(args.preset).n_layers
    prompt, long_prompt = byte_tokens(args.prompt_tokens, 0), byte_tokens(args.prefill_tokens, 1)
    decode_context = args.prompt_tokens + args.new_tokens
    prefill_context = args.prefill_tokens + 1

    def say(text: str) -> None:
        print(f"bench/offload.py: {text}", file=sys.stderr, flush=True)

    machine = measure_machine(device, args.host_read_mib, args.copy_mib)
    say(machine_line(machine))
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="strata-bench-offload-") as tmp:
        ckpt = checkpoint_for(args, Path(tmp), dtype,
                              progress=sys.stderr.isatty() and not args.json)
        cfg = ModelConfig.from_dir(ckpt)
        for counts in args.split_tables:  # checked before anything is loaded or measured
            if len(counts) != cfg.top_k + 1:
                raise SystemExit(f"bench/offload.py: --split-tables' table "
                                 f"{','.join(map(str, counts))} is not K + 1 = {cfg.top_k + 1} "
                                 f"counts (the model's K is {cfg.top_k})")
        router_skew = json.loads((ckpt / "config.json").read_text()).get(
            "strata_router_skew", args.router_skew)  # --model's own
        small = ({"budget_mib": args.budget_mib} if args.budget_mib else
                 {"expert_cache_mib": cache_mib_for_share(ckpt, dtype, args.expert_share)})
        common = {"cpu_threads": args.cpu_threads, **small}
        model, base_store, rank = _profiled(ckpt, cfg, dtype, device, args, common,
                                            decode_context)
        free_memory(device)
        setup = Setup(args, cfg, dtype, device, model, rank, machine, full_layers, say)

        device_rounds, blob_bytes, huge_shares = {}, {}, {}
        for name in args.formats:
            quant = experts_quant_for(name, dtype)
            if quant is not None:
                say(f"quantizing the experts into {quant}")
            store = base_store if quant is None else store_of_format(ckpt, dtype, device, quant)
            blob_bytes[name] = store.blob_bytes
            store_bytes = store.n_layers * store.n_experts * store.blob_bytes
            huge_shares[name] = huge_page_bytes(store.layer_blobs(0).data_ptr(),
                                                store_bytes) / store_bytes
            say(f"the store in {name}: {huge_shares[name]:.0%} of it in huge pages "
                f"(transparent huge pages: {machine['transparent_huge_pages']})")
            device_rounds[name] = device_round(model, store, device, prompt, args,
                                               decode_context, say)
            sized = {**common, "expert_cache_mib": share_mib(
                cfg, store.blob_bytes, args.expert_share)} if args.share_per_format else common
            fmt = Format(name, "" if len(args.formats) == 1 else f"-{name}", store, quant,
                         sized, device_rounds[name])
            runs.update(decode_runs(setup, fmt, prompt, decode_context))
            if args.prefill_tokens:
                runs.update(prefill_runs(setup, fmt, long_prompt, prefill_context))
            if store is not base_store:  # its pinned memory goes before the next one's
                store.close()
            fmt = store = None
        base_store.close()
        sync(device)

    result = {
        "command": " ".join(["python", "bench/offload.py", *(argv if argv is not None
                                                              else sys.argv[1:])]),
        "model": str(args.model or args.preset), "layers": cfg.n_layers,
        "full_layers": full_layers, "router_skew": router_skew, "dtype": args.dtype,
        "device": str(device), "device_name": torch.cuda.get_device_name(device)
        if device.type == "cuda" else platform.processor() or platform.machine(),
        "torch": torch.__version__, "date": datetime.date.today().isoformat(),
        "blob_bytes": blob_bytes[args.formats[0]], "small_cache": small, "machine": machine,
        "device_round_ms": device_rounds[args.formats[0]],
        "prefill_chunk": args.prefill_chunk, "experts_dtypes": args.formats,
        "blob_bytes_by_format": blob_bytes, "device_round_ms_by_format": device_rounds,
        "store_huge_page_share": huge_shares, "runs": runs,
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print_report(result, args)
    return 0


def _profiled(ckpt: Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
              args: Any, common: dict, max_context: int) -> tuple[Any, Any, Any]:
    """(the model, loaded once, without experts; its host store; the rank of the experts by
    the routing of `--profile-prompts` seeded prompts, the profile every run's cache is built
    with), from a first cache, closed after."""
    first = plan_cache(cfg, dtype, device, rank=uniform_rank(cfg.n_layers, cfg.n_experts),
                       max_context=max_context, prefill_chunk=args.prefill_chunk,
                       prefill_loan=False, **common)
    model = load(ckpt, device=device, dtype=dtype, cache=first).model
    counts, _ = collect_counts(model, [byte_tokens(256, 100 + i)
                                       for i in range(args.profile_prompts)],
                               decode_tokens=16,
                               prefill_chunk=args.prefill_chunk or CACHED_PREFILL_CHUNK)
    store = model.experts.store
    model.experts.close()
    first.backend.close()
    model.experts = None
    return model, store, rank_from_counts(counts)


if __name__ == "__main__":
    sys.exit(main())
