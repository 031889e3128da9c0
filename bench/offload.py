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
  reads, named -cpupfN: `CpuExperts.prefetch_bytes`; `--cpu-team N[,N...]` with the CPU's
  own thread's team N threads strong (the default is one short of the cache's CPU threads,
  torch's count), leaving the other cores to the engine's thread and everything else the
  process and the machine run, named -teamN: `CpuExperts.cpu_threads` N + 1, the misses
  split as the base run's, a straggler test (a team as large as the cores left waits for any
  thread the scheduler takes a core from); `--sync-cpu` with the
  CPU's misses computed on the engine's thread after its uploads, not on a thread of their own
  from the routing read on (`CachedExperts.async_cpu` off, the way before), named -sync;
  `--cpu-spin` with the CPU's thread keeping its team spinning between calls, named -spin:
  `CpuExperts.keep_team_up`; `--no-cpu-shrink` with the engine thread's OpenMP pool left as
  it grows, not shrunk before the CPU's thread computes (`CpuExperts.shrink_caller_team` off,
  the way before), named -noshrink;
  `--interleave` runs those (-static, -guided, -cpupfN, -teamN, -sync, -spin, -noshrink),
  -wake and -ahead in the base run's engine, one request of each in turn, so that a
  machine's drift falls on all alike, and with
  `--split-counts N[,N...]` that engine streaming min(N, M) of M misses too, named -splitN
  (the counts compared with the same slots; with `--sync-cpu` each again as -splitN-sync,
  with `--no-cpu-shrink` as -splitN-noshrink); `--launch-ahead` with each split call's next
  graph launched before the CPU's rows are done, queued behind a wait the host sets when they
  are (`graph_call.LAUNCH_AHEAD`), named -ahead (interleaved too);
  `--cli-sampling` with
  `strata generate`'s default sampling instead of greedy, named -sampled: the pick's host time
  in a round the host holds). For
  each: the round's time; its misses split between the CPU and the copy engine (experts and
  shares); the bound, max(CPU's miss bytes / host read
  bandwidth, streamed bytes / copy rate) + the device round (summed over the round, so a lower
  bound); the CPU experts' GB/s and its share of the host read bandwidth (beside which the
  JSON has the machine's transparent huge page mode and, per experts format, the share of the
  store the kernel backs with huge pages: the CPU's rate depends on its pages); the host-side time
  of a round: the round less the CPU experts' time and the cache's time waiting for the device
  (`CacheStats`: `cpu_s`, `wait_s`), i.e. issuing, booking and everything around the kernels
  (a wait outside the cache, such as sampling's read of the token, counts as host-side); under
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

    python bench/offload.py --preset tiny --device cpu --new-tokens 8 --prefill-tokens 128 \\
        --host-read-mib 64 --loan-keep-slots 0                           # here, in seconds
    python bench/offload.py --preset olmoe-1b-7b --budget-mib 4096      # the GPU machine
    python bench/offload.py --preset qwen3-30b-a3b --layers 16 --expert-share 0.22 \\
        --router-skew 0.5 --stream-misses auto,0,4                       # bench/gpu_session.sh
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from _common import (
    add_kv_env_arguments,
    add_model_arguments,
    byte_tokens,
    checkpoint_for,
    cli_sampling,
    engine_around,
    free_memory,
    fresh_request,
    host_read_bytes_per_s,
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
from round_profile import device_busy, host_functions, per_round
from round_trace import trace
from strata import _cpu_experts
from strata.engine.cache import graph_call
from strata.engine.cache.build import build_cached_experts, plan_cache, staging_blobs
from strata.engine.cache.kept_rates import resolve_stream_misses
from strata.engine.experts import ResidentExperts
from strata.engine.experts.quant import EXPERTS_DTYPES, experts_quant_for
from strata.engine.experts.streamed import StreamSplit
from strata.engine.model.checkpoint import Checkpoint, expert_store
from strata.engine.model.config import ModelConfig
from strata.engine.model.presets import get_preset
from strata.engine.runtime.calibrate import collect_counts
from strata.engine.runtime.engine import Engine
from strata.engine.runtime.generate import CACHED_PREFILL_CHUNK, GenerateOptions
from strata.engine.runtime.load import Loaded, load
from strata.formats.profile import rank_from_counts, uniform_rank
from strata.machine import huge_page_bytes, transparent_huge_pages
from strata.settings import LOAN_UPLOAD_BATCHES
from thread_sched import describe

GB = 1e9


def copy_bytes_per_s(device: torch.device, mib: int, repeat: int = 5) -> float | None:
    """Bytes a second of one large copy from pinned host memory to `device` (None off CUDA)."""
    if device.type != "cuda":
        return None
    host = torch.ones(mib << 20, dtype=torch.uint8, pin_memory=True)
    dest = torch.empty_like(host, device=device)
    times = []
    for _ in range(repeat + 1):
        begin, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        begin.record()
        dest.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / 1000)
    del host, dest
    if hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()  # the pinned buffer back to the system, not kept by torch
    return (mib << 20) / min(times[1:])


def joint_bytes_per_s(device: torch.device, mib: int, copies: int = 8) -> dict | None:
    """The host's memory read by both of a round's readers at once: `copies` pinned copies of
    `mib` MiB to `device` queued, and torch sums over a `mib` MiB host buffer run on every
    thread until the copies are done. {"cpu": the sums' bytes a second, "copy": the copies',
    "total": the two added}: what the host's memory gave both together (None off CUDA)."""
    if device.type != "cuda":
        return None
    host = torch.ones(mib << 20, dtype=torch.uint8, pin_memory=True)
    dest = torch.empty_like(host, device=device)
    buffer = torch.ones((mib << 20) // 4, dtype=torch.float32)
    buffer.sum()
    dest.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    begin, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    begin.record()
    for _ in range(copies):
        dest.copy_(host, non_blocking=True)
    end.record()
    sums = 0
    started = time.perf_counter()
    while not end.query() or sums == 0:
        buffer.sum()
        sums += 1
    cpu_s = time.perf_counter() - started
    end.synchronize()
    copy_s = begin.elapsed_time(end) / 1000
    del host, dest
    if hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()
    cpu, copy = sums * buffer.numel() * 4 / cpu_s, copies * (mib << 20) / copy_s
    return {"cpu": cpu, "copy": copy, "total": cpu + copy}


def round_figures(run: dict, blob_bytes: int, machine: dict, device_round_ms: float | None,
                  n_layers: int, full_layers: int) -> dict:
    """The decode round's figures from `run_decode`'s result (see the module)."""
    d = run["cache"]["decode"]
    rounds = max(d["passes"], 1)
    round_ms = run["decode_ms_per_round"]
    cpu_ms, wait_ms = 1000 * d["cpu_s"] / rounds, 1000 * d["wait_s"] / rounds
    cpu_experts, streamed = d["cpu_experts"] / rounds, d["streamed_experts"] / rounds
    misses = cpu_experts + streamed
    cpu_bytes, copy_bytes = cpu_experts * blob_bytes, streamed * blob_bytes
    cpu_bound = 1000 * cpu_bytes / machine["host_read_bytes_per_s"]
    copy_rate = machine["copy_bytes_per_s"]
    copy_bound = 1000 * copy_bytes / copy_rate if copy_rate else 0.0
    # Both sides read the host's memory: all the misses' bytes at what it gave both together
    # bound a round too, however they are split.
    joint = machine.get("joint_bytes_per_s")
    shared_bound = 1000 * (cpu_bytes + copy_bytes) / joint["total"] if joint else 0.0
    bound = max(cpu_bound, copy_bound, shared_bound) + (device_round_ms or 0.0)
    cpu_rate = cpu_bytes / (d["cpu_s"] / rounds) if d["cpu_s"] else None
    return {
        "round_ms": round_ms, "tok_s": run["decode_tok_s"], "decode_path": run["decode_path"],
        "hit_rate": d["hit_rate"], "deterministic": run["deterministic"],
        "misses_per_round": misses, "cpu_experts_per_round": cpu_experts,
        "streamed_experts_per_round": streamed,
        "cpu_share": cpu_experts / misses if misses else None,
        "copy_share": streamed / misses if misses else None,
        "cpu_bound_ms": cpu_bound, "copy_bound_ms": copy_bound,
        "shared_bound_ms": shared_bound,
        "device_round_ms": device_round_ms, "bound_ms": bound,
        "over_bound": round_ms / bound if bound else None,
        "cpu_ms": cpu_ms, "wait_ms": wait_ms, "device_issue_ms": 1000 * d["device_s"] / rounds,
        "in_cache_ms": 1000 * d["forward_s"] / rounds,
        "host_ms": round_ms - cpu_ms - wait_ms,
        "host_share": (round_ms - cpu_ms - wait_ms) / round_ms,
        "cpu_gb_s": cpu_rate / GB if cpu_rate else None,
        "cpu_share_of_host_read": cpu_rate / machine["host_read_bytes_per_s"]
        if cpu_rate else None,
        "cpu_waiter_task_share": d["cpu_waiter_tasks"] / d["cpu_tasks"]
        if d["cpu_tasks"] else None,
        "ms_per_layer": round_ms / n_layers,
        "scaled_tok_s": 1000 / (round_ms / n_layers * full_layers),
    }


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


def profile_decode(engine, prompt, args, max_context: int, host_path: Path) -> dict:
    """The device's busy time a decode round (two requests, `args.new_tokens` and a quarter
    of it, profiled alike: `round_profile.per_round`) and the host's top functions over a
    request of `args.new_tokens`, written to `host_path`."""
    def request(n_new: int):
        options = GenerateOptions(max_new=n_new, max_context=max_context, temperature=0.0,
                                  ignore_stop=True, cuda_graphs=not args.eager,
                                  piecewise_graphs=not args.eager)
        return lambda: fresh_request(engine, prompt, options)

    short = max(args.new_tokens // 4, 1)
    busy = per_round(device_busy(request(short)), device_busy(request(args.new_tokens)),
                     args.new_tokens - short)
    host_path.parent.mkdir(parents=True, exist_ok=True)
    host_path.write_text(host_functions(request(args.new_tokens)))
    return busy


def trace_decode(engine, prompt, args, max_context: int, path: Path) -> dict:
    """A request of `args.new_tokens` / 4 tokens traced (`round_trace.trace`) to `path`: the
    layer's figures."""
    options = GenerateOptions(max_new=max(args.new_tokens // 4, 1), max_context=max_context,
                              temperature=0.0, ignore_stop=True, cuda_graphs=not args.eager,
                              piecewise_graphs=not args.eager)
    return trace(lambda: fresh_request(engine, prompt, options), path)


def profile_prefill(engine, prompt, max_context: int, prefill_chunk: int | None,
                    host_path: Path) -> dict:
    """The device's busy time over one more prefill of `prompt` (`round_profile.device_busy`)
    and the host's top functions over another, written to `host_path`."""
    options = GenerateOptions(max_new=1, max_context=max_context, temperature=0.0,
                              ignore_stop=True, prefill_chunk=prefill_chunk)
    busy = device_busy(lambda: fresh_request(engine, prompt, options))
    host_path.parent.mkdir(parents=True, exist_ok=True)
    host_path.write_text(host_functions(lambda: fresh_request(engine, prompt, options)))
    return busy


def stream_values(text: str) -> list[int | str]:
    """`--stream-misses`' comma-separated values: auto or ints."""
    values: list[int | str] = []
    for part in text.split(","):
        part = part.strip()
        values.append(part if part == "auto" else int(part))
    if not values or len(set(values)) != len(values):
        raise ValueError(text)
    return values


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    parser.add_argument("--cpu-team", default="",
                        help="comma-separated thread counts: also run each decode with the "
                        "CPU's own thread's OpenMP team that many threads strong, named "
                        "-teamN (`CpuExperts.cpu_threads` N + 1; the default team is one "
                        "short of --cpu-threads, torch's threads by default)")
    parser.add_argument("--interleave", action="store_true",
                        help="run --wake-cpu's, --sync-cpu's, --cpu-schedule's, "
                        "--cpu-prefetch's, --cpu-team's, --cpu-spin's and --no-cpu-shrink's "
                        "variants in the base run's engine, one request of each in turn "
                        "(`run_decode_interleaved`), so that the machine's drift falls on all "
                        "alike")
    parser.add_argument("--split-counts", default="",
                        help="with --interleave, comma-separated N: also run each decode "
                        "streaming min(N, M) of a layer's M misses through the run's own "
                        "staging buffer (N up to its blobs), named -splitN: counts compared "
                        "with the same slots, interleaved (with --sync-cpu each count again "
                        "as -splitN-sync, with --no-cpu-shrink as -splitN-noshrink)")
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
        streams = stream_values(args.stream_misses)
    except ValueError:
        parser.error(f"--stream-misses takes distinct comma-separated auto or N, got "
                     f"{args.stream_misses!r}")
    if args.new_tokens < 2 or args.repeat < 1:
        parser.error("--new-tokens must be >= 2, --repeat >= 1")
    loan_batches = [None] if args.loan_upload_batches is None else \
        _counts(parser, "--loan-upload-batches", args.loan_upload_batches)
    prefetch_caps = _counts(parser, "--prefetch", args.prefetch) if args.prefetch else []
    split_counts = _counts(parser, "--split-counts", args.split_counts) \
        if args.split_counts else []
    if split_counts and not args.interleave:
        parser.error("--split-counts runs in the base run's engine: give --interleave too")
    cpu_schedules = args.cpu_schedule.split(",") if args.cpu_schedule else []
    if len(set(cpu_schedules)) != len(cpu_schedules) \
            or not set(cpu_schedules) <= {"static", "guided", "steal", "steal-alone"}:
        parser.error(f"--cpu-schedule takes distinct comma-separated static, guided, steal and "
                     f"steal-alone (the default, dynamic, runs anyway), got "
                     f"{args.cpu_schedule!r}")
    cpu_prefetches = [n for n in args.cpu_prefetch.split(",") if n]
    if not all(n.isdigit() and not int(n) % 64 for n in cpu_prefetches) \
            or len(set(cpu_prefetches)) != len(cpu_prefetches):
        parser.error(f"--cpu-prefetch takes distinct comma-separated multiples of 64, got "
                     f"{args.cpu_prefetch!r}")
    cpu_teams = _counts(parser, "--cpu-team", args.cpu_team) if args.cpu_team else []
    formats = args.experts_dtype.split(",")
    if len(set(formats)) != len(formats) or any(f not in EXPERTS_DTYPES for f in formats):
        parser.error(f"--experts-dtype takes distinct comma-separated values of "
                     f"{', '.join(EXPERTS_DTYPES)}, got {args.experts_dtype!r}")
    if args.share_per_format and args.budget_mib:
        parser.error("--share-per-format sizes each format's cache by --expert-share, which "
                     "--budget-mib replaces: give one of them")
    set_kv_env(args)
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    full_layers = args.full_layers or get_preset(args.preset).n_layers
    prompt, long_prompt = byte_tokens(args.prompt_tokens, 0), byte_tokens(args.prefill_tokens, 1)
    decode_context = args.prompt_tokens + args.new_tokens
    prefill_context = args.prefill_tokens + 1

    def say(text: str) -> None:
        print(f"bench/offload.py: {text}", file=sys.stderr, flush=True)

    machine = {"host_read_bytes_per_s": host_read_bytes_per_s(args.host_read_mib),
               "copy_bytes_per_s": copy_bytes_per_s(device, args.copy_mib),
               "joint_bytes_per_s": joint_bytes_per_s(device, args.copy_mib),
               "threads": torch.get_num_threads(),
               "transparent_huge_pages": transparent_huge_pages()}
    copy_text = f"{machine['copy_bytes_per_s'] / GB:.1f} GB/s" if machine["copy_bytes_per_s"] \
        else "none (no bus)"
    joint = machine["joint_bytes_per_s"]
    say(f"host read {machine['host_read_bytes_per_s'] / GB:.1f} GB/s on {machine['threads']} "
        f"threads, pinned copies {copy_text}" + (
            f"; both at once {joint['total'] / GB:.1f} GB/s (CPU {joint['cpu'] / GB:.1f}, "
            f"copies {joint['copy'] / GB:.1f})" if joint else ""))
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="strata-bench-offload-") as tmp:
        ckpt = checkpoint_for(args, Path(tmp), dtype,
                              progress=sys.stderr.isatty() and not args.json)
        cfg = ModelConfig.from_dir(ckpt)
        router_skew = json.loads((ckpt / "config.json").read_text()).get(
            "strata_router_skew", args.router_skew)  # --model's own
        small = ({"budget_mib": args.budget_mib} if args.budget_mib else
                 {"expert_cache_mib": cache_mib_for_share(ckpt, dtype, args.expert_share)})
        common = {"cpu_threads": args.cpu_threads, **small}
        first = plan_cache(cfg, dtype, device, rank=uniform_rank(cfg.n_layers, cfg.n_experts),
                           max_context=decode_context, prefill_chunk=args.prefill_chunk,
                           prefill_loan=False, **common)
        model = load(ckpt, device=device, dtype=dtype, cache=first).model
        store = model.experts.store
        counts, _ = collect_counts(model, [byte_tokens(256, 100 + i)
                                           for i in range(args.profile_prompts)],
                                   decode_tokens=16,
                                   prefill_chunk=args.prefill_chunk or CACHED_PREFILL_CHUNK)
        rank = rank_from_counts(counts)
        model.experts.close()
        first.backend.close()
        model.experts = None
        free_memory(device)

        base_store = store
        device_rounds, blob_bytes, huge_shares = {}, {}, {}
        for fmt in formats:
            quant = experts_quant_for(fmt, dtype)
            suffix = "" if fmt == formats[0] and len(formats) == 1 else f"-{fmt}"
            if quant is not None:
                say(f"quantizing the experts into {quant}")
                store = store_of_format(ckpt, dtype, device, quant)
            else:
                store = base_store
            blob_bytes[fmt] = store.blob_bytes
            store_bytes = store.n_layers * store.n_experts * store.blob_bytes
            huge_shares[fmt] = huge_page_bytes(store.layer_blobs(0).data_ptr(),
                                               store_bytes) / store_bytes
            say(f"the store in {fmt}: {huge_shares[fmt]:.0%} of it in huge pages "
                f"(transparent huge pages: {machine['transparent_huge_pages']})")
            device_round_ms = device_round(model, store, device, prompt, args, decode_context,
                                           say)
            device_rounds[fmt] = device_round_ms

            sized = {**common, "expert_cache_mib": share_mib(
                cfg, store.blob_bytes, args.expert_share)} if args.share_per_format else common

            def cached_engine(stream, max_context: int, loan: bool, store=store, quant=quant,
                              prefetch=0, sized=sized):
                value, notes = resolve_stream_misses(stream, cfg, dtype, device,
                                                     cpu_threads=args.cpu_threads)
                config = plan_cache(cfg, dtype, device, rank=rank, max_context=max_context,
                                    prefill_chunk=args.prefill_chunk, prefill_loan=loan,
                                    stream_misses=value, experts_quant=quant,
                                    prefetch_misses=prefetch, **sized)
                model.experts = build_cached_experts(config, store, device)
                if prefetch:
                    model.experts.use_routers([layer.moe.router for layer in model.layers],
                                              cfg.top_k)
                return engine_around(model, None, max_context), notes

            # Variants that only set an attribute of the cache run in the base run's engine,
            # their requests interleaved with its own under --interleave.
            settings = [*(["-wake"] if args.wake_cpu else []),
                        *(["-sync"] if args.sync_cpu else []),
                        *(f"-{schedule}" for schedule in cpu_schedules),
                        *(f"-cpupf{n}" for n in cpu_prefetches),
                        *(f"-team{n}" for n in cpu_teams),
                        *(["-spin"] if args.cpu_spin else []),
                        *(["-noshrink"] if args.no_cpu_shrink else []),
                        *(["-ahead"] if args.launch_ahead else [])]
            together = settings if args.interleave else []
            variants = [("", 0), *([("-whole", 0)] if args.whole_calls else []),
                        *((setting, 0) for setting in settings if setting not in together),
                        *([("-sampled", 0)] if args.cli_sampling else []),
                        *((f"-prefetch{cap}", cap) for cap in prefetch_caps)]
            for stream, (variant, cap) in ((stream, variant) for stream in streams
                                           for variant in variants):
                # Resolved here only for a cap: the engine's own resolve then says whether auto's
                # rates were measured now or read.
                if cap and cap > staging_blobs(resolve_stream_misses(
                        stream, cfg, dtype, device, cpu_threads=args.cpu_threads)[0]):
                    continue  # fewer staging blobs (none: 0, or auto off CUDA) than the cap
                name = f"decode-stream-{stream}{variant}{suffix}"
                engine, notes = cached_engine(stream, decode_context, loan=False,
                                              prefetch=cap)
                engine.cache.split_calls = variant != "-whole"

                streamer = engine.cache.streamer
                rule = streamer.split_rule if streamer is not None else None
                # -splitN: this engine's staging buffer, streaming min(N, M) of M misses;
                # with --sync-cpu each count again on the engine's thread, -splitN-sync, and
                # with --no-cpu-shrink again with the caller's team left grown,
                # -splitN-noshrink.
                splits = [f"-split{n}{mode}" for n in split_counts
                          if streamer is not None and n <= streamer.n_blobs
                          for mode in ["", *(["-sync"] if args.sync_cpu else []),
                                       *(["-noshrink"] if args.no_cpu_shrink else [])]]

                def set_up(setting: str, cache=engine.cache, rule=rule) -> None:
                    count = setting.removeprefix("-split").partition("-")[0]
                    cache.wake_cpu = setting == "-wake"
                    graph_call.LAUNCH_AHEAD = setting == "-ahead"
                    cache.cpu.keep_team_up = setting == "-spin"
                    cache.cpu.shrink_caller_team = not setting.endswith("-noshrink")
                    cache.async_cpu = not setting.endswith("-sync")
                    chosen = setting[1:] if setting[1:] in cpu_schedules else "dynamic"
                    cache.cpu.schedule = chosen.removesuffix("-alone")
                    cache.cpu.caller_helps = not chosen.endswith("-alone")
                    cache.cpu.prefetch_bytes = int(setting.removeprefix("-cpupf")) \
                        if setting.startswith("-cpupf") else _cpu_experts.PREFETCH_BYTES
                    cache.cpu.cpu_threads = int(setting.removeprefix("-team")) + 1 \
                        if setting.startswith("-team") else args.cpu_threads
                    if cache.streamer is not None:
                        cache.streamer.split_rule = StreamSplit.fixed(int(count), cfg.top_k) \
                            if setting.startswith("-split") else rule

                with engine:
                    for note in notes:
                        say(note)
                    if variant == "" and together + splits:
                        named = run_decode_interleaved(
                            engine, prompt, args.new_tokens, args.repeat, decode_context,
                            {setting: functools.partial(set_up, setting)
                             for setting in ["", *together, *splits]},
                            cuda_graphs=not args.eager, piecewise=not args.eager)
                        decoded = {f"decode-stream-{stream}{setting}{suffix}": run
                                   for setting, run in named.items()}
                        set_up("")
                    else:
                        set_up(variant)
                        decoded = {name: run_decode(
                            engine, prompt, args.new_tokens, args.repeat, decode_context,
                            cuda_graphs=not args.eager, piecewise=not args.eager,
                            sampling=cli_sampling() if variant == "-sampled" else None)}
                    for run in decoded.values():
                        run["startup"] = engine.cache.budget.startup_line()
                        run["notes"] = notes
                        run["slots"] = engine.cache.arena.n_slots
                        run["experts_dtype"] = fmt
                        run["interleaved"] = len(decoded) > 1
                    run = decoded[name]
                    if args.profile:
                        run["profile"] = profile_decode(engine, prompt, args, decode_context,
                                                        Path(args.profile) / f"{name}.host.txt")
                    if args.trace:
                        run["trace"] = trace_decode(engine, prompt, args, decode_context,
                                                    Path(args.trace) / f"{name}.trace.json.gz")
                    streamer = engine.cache.streamer
                    if streamer is not None and streamer.prefetching:
                        run["prefetch"] = {"prefetched_experts": streamer.prefetched_experts,
                                           "used": streamer.prefetch_used}
                del engine  # and its graphs
                model.experts = None
                free_memory(device)
                for run_name, run in decoded.items():
                    run["round"] = round_figures(run, store.blob_bytes, machine,
                                                 device_round_ms, cfg.n_layers, full_layers)
                    runs[run_name] = run
                    r = run["round"]
                    ahead = run.get("prefetch")
                    cpu_rate = f" ({r['cpu_gb_s']:.1f} GB/s)" if r["cpu_gb_s"] else ""
                    say(f"{run_name}: {r['round_ms']:.2f} ms a round (bound {r['bound_ms']:.2f}), "
                        f"{r['ms_per_layer']:.3f} ms a layer, "
                        f"host-side {r['host_ms']:.2f} ms, CPU experts {r['cpu_ms']:.2f}"
                        f"{cpu_rate}, wait {r['wait_ms']:.2f}" + (
                            f", prefetched {ahead['prefetched_experts']} experts, used "
                            f"{ahead['used']}" if ahead else ""))
                    say(f"{run_name}, {describe(run['threads_per_round'])}")
                    if run.get("trace"):
                        say(f"{run_name}, traced a layer call: " + ", ".join(
                            f"{key.removesuffix('_us')} {value:.1f}" for key, value in
                            run["trace"].items() if key.endswith("_us")) + " µs")
            for batches in loan_batches if args.prefill_tokens else []:
                with _loan_upload_batches(batches):  # read when the cache is built
                    engine, notes = cached_engine(streams[0], prefill_context, loan=True)
                with engine:
                    run = run_prefill(engine, long_prompt, args.repeat, prefill_context,
                                      prefill_chunk=args.prefill_chunk)
                    name = f"prefill-loan{suffix}" + (f"-b{batches}" if batches is not None
                                                      else "")
                    if args.profile:
                        run["profile"] = profile_prefill(
                            engine, long_prompt, prefill_context, args.prefill_chunk,
                            Path(args.profile) / f"{name}.host.txt")
                    run["startup"] = engine.cache.budget.startup_line()
                    run["prefill_chunk"] = args.prefill_chunk or \
                        engine.cache.budget.prefill_chunk
                    run["experts_dtype"] = fmt
                    run["loan_upload_batches"] = model.experts.loan.options.upload_batches
                del engine
                model.experts = None
                free_memory(device)
                uploaded = run["cache"]["prompt"]["uploaded_bytes"]
                copy_rate = machine["copy_bytes_per_s"]
                run["upload_bound_s"] = uploaded / copy_rate if copy_rate else None
                run["over_bound"] = run["prefill_s"] / run["upload_bound_s"] \
                    if run["upload_bound_s"] else None
                run["scaled_tok_s"] = run["prefill_tok_s"] * cfg.n_layers / full_layers
                runs[name] = run
                bound = f" (upload bound {run['upload_bound_s']:.3f} s, " \
                    f"{run['over_bound']:.2f}x)" if run["upload_bound_s"] else ""
                busy = run.get("profile")
                say(f"{name}: {run['prefill_s']:.3f} s{bound}, {uploaded / GB:.3f} GB uploaded, "
                    f"{run['prefill_tok_s']:,.0f} tok/s, {run['scaled_tok_s']:,.0f} scaled to "
                    f"{full_layers} layers" + (
                        f"; profiled: copies {busy['copies_us'] / 1e3:.1f} ms, compute "
                        f"{busy['compute_us'] / 1e3:.1f}, both {busy['both_us'] / 1e3:.1f}, "
                        f"span {busy['span_us'] / 1e3:.1f}" if busy else ""))
            store = None  # a quantized store's pinned memory goes before the next one's
        sync(device)

    result = {
        "command": " ".join(["python", "bench/offload.py", *(argv if argv is not None
                                                              else sys.argv[1:])]),
        "model": str(args.model or args.preset), "layers": cfg.n_layers,
        "full_layers": full_layers, "router_skew": router_skew, "dtype": args.dtype,
        "device": str(device), "device_name": torch.cuda.get_device_name(device)
        if device.type == "cuda" else platform.processor() or platform.machine(),
        "torch": torch.__version__, "date": datetime.date.today().isoformat(),
        "blob_bytes": blob_bytes[formats[0]], "small_cache": small, "machine": machine,
        "device_round_ms": device_rounds[formats[0]], "prefill_chunk": args.prefill_chunk,
        "experts_dtypes": formats, "blob_bytes_by_format": blob_bytes,
        "device_round_ms_by_format": device_rounds, "store_huge_page_share": huge_shares,
        "runs": runs,
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print_report(result, args)
    return 0


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def print_report(result: dict, args) -> None:
    machine = result["machine"]
    copy = machine["copy_bytes_per_s"]
    scaled = result["layers"] != result["full_layers"]
    rounds = ", ".join(f"{fmt} {_ms(ms)}" for fmt, ms in
                       result["device_round_ms_by_format"].items())
    print(f"{result['command']}")
    print(f"{result['model']} ({result['layers']} layers, {result['dtype']}, router skew "
          f"{result['router_skew']:g}) on {result['device_name']} ({result['device']}), "
          f"{result['date']}; host read {machine['host_read_bytes_per_s'] / GB:.1f} GB/s on "
          f"{machine['threads']} threads, pinned copies "
          f"{'-' if copy is None else f'{copy / GB:.1f}'} GB/s; device round (every expert "
          f"resident) {rounds} ms; medians of {args.repeat}")
    for name, run in result["runs"].items():
        if not name.startswith("decode"):
            continue
        r = run["round"]
        print(f"{name}: {run['startup']}")
        for note in run["notes"]:
            print(f"  {note}")
        print(f"  a round {r['round_ms']:.2f} ms ({r['tok_s']:.1f} tok/s, {r['decode_path']}, "
              f"hit rate {100 * r['hit_rate']:.1f}%, deterministic {r['deterministic']}); bound "
              f"{r['bound_ms']:.2f} ms = max(CPU {r['cpu_bound_ms']:.2f}, copies "
              f"{r['copy_bound_ms']:.2f}, both {r['shared_bound_ms']:.2f}) + device "
              f"{_ms(r['device_round_ms'])}: {_ms(r['over_bound'])}x the bound")
        busy = run.get("profile")
        if busy:
            print(f"  the device a round (profiled): copies {busy['copies_us'] / 1000:.2f} ms "
                  f"({busy['n_copies']:.1f} of them), compute {busy['compute_us'] / 1000:.2f} "
                  f"ms, both at once {busy['both_us'] / 1000:.2f} ms, neither "
                  f"{(busy['span_us'] - busy['either_us']) / 1000:.2f} ms")
        shares = "-" if r["cpu_share"] is None else \
            f"{100 * r['cpu_share']:.0f}% / {100 * r['copy_share']:.0f}%"
        cpu_rate = "-" if r["cpu_gb_s"] is None else \
            f"{r['cpu_gb_s']:.1f} GB/s, {100 * r['cpu_share_of_host_read']:.0f}% of host read"
        print(f"  misses a round {r['misses_per_round']:.2f}: CPU {r['cpu_experts_per_round']:.2f}"
              f", copies {r['streamed_experts_per_round']:.2f} (CPU / copy {shares}); CPU "
              f"experts {r['cpu_ms']:.2f} ms ({cpu_rate}); waiting {r['wait_ms']:.2f} ms; "
              f"host-side {r['host_ms']:.2f} ms ({100 * r['host_share']:.0f}% of the round)"
              + ("" if not r["cpu_waiter_task_share"] else
                 f"; the engine's thread ran {100 * r['cpu_waiter_task_share']:.0f}% of the "
                 f"CPU's tasks"))
        if scaled:
            print(f"  {r['ms_per_layer']:.3f} ms a layer: {r['scaled_tok_s']:.1f} tok/s scaled to "
                  f"{result['full_layers']} layers")
    for name, prefill in result["runs"].items():
        if not name.startswith("prefill"):
            continue
        bound = prefill["upload_bound_s"]
        print(f"{name}, {args.prefill_tokens} tokens in chunks of "
              f"{prefill['prefill_chunk']}: {prefill['prefill_s']:.3f} s "
              f"({prefill['prefill_tok_s']:.0f} tok/s); uploaded "
              f"{prefill['cache']['prompt']['uploaded_bytes'] / GB:.3f} GB, upload bound "
              f"{'-' if bound is None else f'{bound:.3f} s'} "
              f"({_ms(prefill['over_bound'])}x)")
        prompt = prefill["cache"]["prompt"]
        upload_s = prompt["upload_s"]
        rate = f"{prompt['uploaded_bytes'] / upload_s / GB:.1f} GB/s" if upload_s else "-"
        print(f"  where it went: the cache's uploads {upload_s:.3f} s ({rate}), the rest of the "
              f"cache {prompt['forward_s'] - upload_s:.3f} s (of it waiting for the routing "
              f"{prompt['wait_s']:.3f} s), outside the cache "
              f"{prefill['prefill_s'] - prompt['forward_s']:.3f} s")
        if scaled:
            print(f"  {prefill['scaled_tok_s']:.0f} tok/s scaled to {result['full_layers']} "
                  "layers")


if __name__ == "__main__":
    sys.exit(main())
