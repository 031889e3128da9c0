"""Benchmark strata.sim: replay speed in accesses per second, per policy and path.

A synthetic trace of about `--accesses` routed lookups (48 layers x top-8 of 128 experts,
Zipf popularity with Markov correlation between tokens; 4 requests, a fifth of each request's
tokens its prompt in one step, the rest decoded one a step) is replayed at `--slots` slots through:
- the built-ins on the paths `strata simulate` picks for them (`batched` for static and
  coldest-in-loan, the Cython `kernel` for lru, lfu and sieve),
- the bounds (Belady's MIN with bypass, the oracle static set),
- the generic path, the engine's sequence in Python that an outside policy takes, on a
  shorter trace of `--generic-accesses` (it is 100 times slower).
Each figure is the best of `--repeat` runs (the machine may be shared); an access is one
routed (token, layer, expert).

    python bench/replay.py            # a table
    python bench/replay.py --json     # one JSON object
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

from strata.policies import load_registry
from strata.sim import ReplayConfig, SynthSpec, belady, oracle_static, replay, synth_trace
from strata.sim.belady import access_sequence

LAYERS, EXPERTS, TOP_K, REQUESTS = 48, 128, 8, 4
FAST = ("static", "coldest-in-loan", "lru", "lfu", "sieve")
GENERIC = ("static", "lru", "sieve")


def make_trace(accesses: int):
    """A trace of about `accesses` accesses (whole tokens of L * K each)."""
    per_request = max(accesses // (LAYERS * TOP_K * REQUESTS), 2)
    prompt = per_request // 5
    spec = SynthSpec(kind="markov", n_layers=LAYERS, n_experts=EXPERTS, top_k=TOP_K,
                     n_requests=REQUESTS, prompt_tokens=prompt,
                     decode_tokens=per_request - prompt, prompt_chunk=max(prompt, 1))
    return synth_trace(spec)


def best_seconds(fn, repeat: int):
    """(best wall time in s, the last result)."""
    best, result = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f
                         if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{model}, {os.cpu_count()} cores, Python {platform.python_version()}, "
            f"numpy {np.__version__}")


def row(name: str, path: str, trace, seconds: float, hit_rate: float) -> dict:
    return {"policy": name, "path": path, "accesses": trace.n_accesses,
            "seconds": round(seconds, 4),
            "accesses_per_s": round(trace.n_accesses / seconds),
            "hit_rate": round(hit_rate, 4)}


def run(args: argparse.Namespace) -> dict:
    registry = load_registry()
    rows = []
    trace = make_trace(args.accesses)
    profile = trace.routing_counts()
    config = ReplayConfig(slots=args.slots)
    for name in FAST:
        seconds, result = best_seconds(
            lambda name=name: replay(trace, registry.create(name), config, profile), args.repeat)
        rows.append(row(name, result.path, trace, seconds, result.hit_rate))
    # The bounds, with the access sequence they share built inside the timing.
    for name, bound in (("belady", belady), ("oracle-static", oracle_static)):
        seconds, result = best_seconds(
            lambda bound=bound: bound(trace, args.slots, seq=access_sequence(trace)),
            args.repeat)
        rows.append(row(name, "bound", trace, seconds, result.hit_rate))
    short = make_trace(args.generic_accesses)
    generic = ReplayConfig(slots=args.slots, path="generic")
    for name in GENERIC:
        seconds, result = best_seconds(
            lambda name=name: replay(short, registry.create(name), generic,
                                     short.routing_counts()), 1)
        rows.append(row(name, "generic", short, seconds, result.hit_rate))
    return {
        "benchmark": "replay",
        "machine": machine(),
        "trace": {"accesses": trace.n_accesses, "layers": LAYERS, "experts": EXPERTS,
                  "top_k": TOP_K, "requests": REQUESTS, "steps": trace.n_steps,
                  "kind": "markov", "generic_accesses": short.n_accesses},
        "slots": args.slots,
        "repeat": args.repeat,
        "rows": rows,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accesses", type=int, default=1_000_000)
    parser.add_argument("--generic-accesses", type=int, default=100_000)
    parser.add_argument("--slots", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    out = run(args)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    t = out["trace"]
    print(f"replay speed: {t['accesses']} accesses ({t['layers']} layers x top-{t['top_k']} of "
          f"{t['experts']}, {t['steps']} steps), {out['slots']} slots; best of {out['repeat']}")
    print(f"machine: {out['machine']}")
    print(f"{'policy':<16}{'path':<9}{'accesses':>10}{'seconds':>10}{'M acc/s':>10}"
          f"{'hit rate':>10}")
    for r in out["rows"]:
        print(f"{r['policy']:<16}{r['path']:<9}{r['accesses']:>10}{r['seconds']:>10.3f}"
              f"{r['accesses_per_s'] / 1e6:>10.2f}{r['hit_rate']:>10.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
