"""Benchmark how often the CPU's own thread's OpenMP team sleeps in a decode round's calls,
beside the engine thread's team and with it shrunk (issue 17).

libgomp spins an idle thread about 300,000 times before it sleeps, but only 100 times while the
process holds more OpenMP threads than CPUs. In a round the engine's thread holds a team (the
prompt's CPU misses run `CpuExperts.compute` on it) and the CPU's thread another
(`CpuExperts.start`): together more threads than cores, so the worker's threads may sleep at
every barrier and each call wait for them to wake. `CpuExperts.shrink_caller_team` cuts the
caller's pool to one idle thread before the worker computes (`_cpu_experts.shrink_team`).

For each mode, `--calls` calls of `--experts` experts of `--preset`'s shape on the CPU's thread,
each after a `--gap-us` busy wait of the main thread (as the engine waits for the device):

- `beside-caller-team`: after a `compute` on the main thread with every thread (its pool full);
- `caller-team-shrunk`: the same, then `shrink_caller_team` on.

It prints each mode's median call in microseconds and the voluntary context switches a call of
every thread but the main one (/proc/self/task/*/status: a thread that sleeps and is woken
counts one), their sum and largest. Linux only. One process, the modes in that order: on a
machine with fewer cores than two teams both modes show the sleeps.

    python bench/cpu_sleeps.py --preset olmoe-1b-7b --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

import numpy as np
import torch

from strata.engine.cache.rate_calls import synthetic_store
from strata.engine.experts.cpu import CpuExperts
from strata.engine.experts.routed import Routed
from strata.engine.model.presets import PRESETS, get_preset
from thread_sched import thread_scheds

MODES = ("beside-caller-team", "caller-team-shrunk")


def switches() -> dict[int, int]:
    """Voluntary context switches of each of this process's threads, by thread id."""
    return {tid: counts.voluntary for tid, counts in thread_scheds().items()}


def busy_wait(seconds: float) -> None:
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


def run_mode(cpu: CpuExperts, mode: str, n_experts: int, n_calls: int, gap_s: float,
             n_layers: int) -> dict:
    """The mode's calls on the CPU's thread (see the module); its figures."""
    hidden = cpu.store.hidden_size
    routed = Routed.of(np.arange(n_experts)[None, :])
    x = torch.full((n_experts, hidden), 0.01, dtype=cpu.store.dtype)
    out = torch.empty((n_experts, hidden), dtype=cpu.store.dtype)
    cpu.compute(0, x, routed)  # the main thread's team, full
    cpu.shrink_caller_team = mode == "caller-team-shrunk"
    warm = 5
    times, before, main = [], {}, threading.get_native_id()
    for i in range(warm + n_calls):
        if i == warm:
            before = switches()
        busy_wait(gap_s)
        started = time.perf_counter()
        if not cpu.start(i % n_layers, x, routed, out):
            raise SystemExit("the store's kernel is not strata's: nothing runs on the CPU's "
                             "thread (bf16 experts of up to KERNEL_MAX_ROWS rows)")
        cpu.finish()
        if i >= warm:
            times.append(time.perf_counter() - started)
    after = switches()
    per_call = sorted(((after[t] - before.get(t, 0)) / n_calls for t in after if t != main),
                      reverse=True)
    return {"mode": mode, "call_us": 1e6 * statistics.median(times),
            "switches_per_call": {"sum": sum(per_call), "largest": per_call[0] if per_call
                                  else 0.0, "threads": per_call}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="olmoe-1b-7b", choices=sorted(PRESETS))
    parser.add_argument("--experts", type=int, default=3, help="experts a call (3)")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--gap-us", type=float, default=450.0,
                        help="the main thread's busy wait before each call (450)")
    parser.add_argument("--threads", type=int, help="CpuExperts' threads (torch's)")
    parser.add_argument("--store-mib", type=int, default=512)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.experts < 1 or args.calls < 1 or args.gap_us < 0:
        parser.error("--experts and --calls must be >= 1, --gap-us >= 0")
    config = get_preset(args.preset)
    n_experts = min(args.experts, config.top_k)
    store = synthetic_store(config.hidden_size, config.expert_width, config.top_k,
                            torch.bfloat16, False, args.store_mib << 20)
    cpu = CpuExperts(store, args.threads)
    report = {"preset": args.preset, "experts": n_experts, "calls": args.calls,
              "gap_us": args.gap_us, "threads": args.threads or torch.get_num_threads(),
              "cpus": os.cpu_count(),
              "modes": [run_mode(cpu, mode, n_experts, args.calls, args.gap_us / 1e6,
                                 store.n_layers) for mode in MODES]}
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"{args.preset}: {n_experts} experts a call on the CPU's thread, {report['threads']} "
          f"threads, {report['cpus']} CPUs, a {args.gap_us:.0f} us gap before each")
    print(f"{'mode':<20} {'call us':>9} {'sleeps/call (sum)':>18} {'(largest)':>10}")
    for r in report["modes"]:
        s = r["switches_per_call"]
        print(f"{r['mode']:<20} {r['call_us']:9.1f} {s['sum']:18.2f} {s['largest']:10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
