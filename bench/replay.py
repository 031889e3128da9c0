"""Benchmark strata.sim: replay speed in accesses per second, per policy and path.

A synthetic trace of about `--accesses` routed lookups (48 layers x top-8 of 128 experts,
Zipf popularity with Markov correlation between tokens; 4 requests, a fifth of each request's
tokens its prompt in one step, the rest decoded one a step) is replayed at `--slots` slots through:
- the built-ins on the paths `strata simulate` picks for them (`batched` for static and
  coldest-in-loan, the Cython `kernel` for lru, lfu and sieve),
- the bounds (Belady's MIN with bypass, the oracle static set),
- the outside plugins installed (every policy the registry has from another package, e.g.
  `pip install ./examples/fifo-plugin ./examples/clock-plugin ./examples/arc-plugin`), on the
  path `strata simulate` picks for them (`kernel` for a compiled rule);
- the generic path, the engine's sequence around a Python policy's `observe` and `admit`
  (a C step loop), for built-ins forced onto it and for two plain Python plugins defined here
  (`fifo-py`: `admit` only; `clock-py`: `observe` and `admit`);
- the baseline, measured in the same run: the same sequence step by step in Python
  (`strata.sim.reference`, what the generic path was before the C loop), on a shorter trace of
  `--generic-accesses`; each generic row prints its speed-up over it;
- a sweep of each plugin (and `lru`) over 10 cache sizes with the bounds, as `strata
  simulate --slots ...` runs it (`--sweep`).
Each figure is the best of `--repeat` runs (the machine may be shared); an access is one
routed (token, layer, expert).

    python bench/replay.py                  # a table
    python bench/replay.py --sweep --json   # one JSON object, with the sweeps
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

from strata.policies import Policy, load_registry
from strata.sim import ReplayConfig, SynthSpec, belady, oracle_static, replay, synth_trace
from strata.sim.belady import access_sequence
from strata.sim.reference import reference_replay
from strata.sim.sweep import sweep

LAYERS, EXPERTS, TOP_K, REQUESTS = 48, 128, 8, 4
FAST = ("static", "coldest-in-loan", "lru", "lfu", "sieve")
GENERIC = ("static", "lru", "sieve", "fifo-py", "clock-py")
SWEEP_SLOTS = (64, 128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096)


class PyFifo(Policy):
    """A plain plugin, `admit` only: FIFO as a ring over the slots below top."""

    name = "fifo-py"

    def __init__(self, options=None):
        super().__init__(options)
        self.hand = 0

    def admit(self, view, layer, missed_experts):
        top, placements = view.top, []
        for expert in missed_experts.tolist()[:top]:
            placements.append((self.hand, layer, expert))
            self.hand = (self.hand + 1) % top
        return placements


class PyClock(PyFifo):
    """A plain plugin, `observe` and `admit`: CLOCK, a reference bit per expert."""

    name = "clock-py"

    def observe(self, view, layer, expert_ids, hit_mask):
        if not hasattr(self, "ref"):
            self.ref = np.zeros(view.n_layers * view.n_experts, bool)
        self.ref[layer * view.n_experts + expert_ids] = True  # misses too: cleared on entry

    def admit(self, view, layer, missed_experts):
        top, owner, ref, placements = view.top, view.owner, self.ref, []
        for expert in missed_experts.tolist()[:top]:
            for _ in range(2 * top):  # the hand gives each referenced resident a second chance
                flat = owner[self.hand]
                if flat < 0 or not ref[flat]:
                    break
                ref[flat] = False
                self.hand = (self.hand + 1) % top
            placements.append((self.hand, layer, expert))
            ref[layer * view.n_experts + expert] = False
            self.hand = (self.hand + 1) % top
        return placements


def make(registry, name: str) -> Policy:
    return {"fifo-py": PyFifo, "clock-py": PyClock}.get(name, lambda: registry.create(name))()


def plugins(registry) -> list[str]:
    """The policies the registry has from outside packages."""
    return [name for name, entry in registry.entries.items()
            if not entry.source.startswith("strata ")]


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


def row(name: str, path: str, trace, seconds: float, hit_rate: float, kind: str = "built-in",
        **extra) -> dict:
    return {"policy": name, "kind": kind, "path": path, "accesses": trace.n_accesses,
            "seconds": round(seconds, 4),
            "accesses_per_s": round(trace.n_accesses / seconds),
            "hit_rate": round(hit_rate, 4), **extra}


def generic_rows(registry, trace, short, args) -> list[dict]:
    """Each GENERIC policy on the generic path, with its speed-up over the reference (the
    Python sequence) measured on the short trace in this run."""
    rows = []
    config = ReplayConfig(slots=args.slots, path="generic")
    for name in GENERIC:
        kind = "plain plugin" if name.endswith("-py") else "built-in"
        seconds, result = best_seconds(
            lambda name=name: replay(trace, make(registry, name), config, trace.routing_counts()),
            args.repeat)
        base_s, _ = best_seconds(
            lambda name=name: reference_replay(short, make(registry, name), config,
                                               short.routing_counts()), 1)
        rate, base_rate = trace.n_accesses / seconds, short.n_accesses / base_s
        rows.append(row(name, "generic", trace, seconds, result.hit_rate, kind,
                        reference_accesses_per_s=round(base_rate),
                        speedup=round(rate / base_rate, 1)))
    return rows


def sweep_rows(registry, trace, args) -> list[dict]:
    """Seconds for a sweep of SWEEP_SLOTS with the default bounds, per policy."""
    out = []
    for name in ["lru", *plugins(registry)]:
        seconds, results = best_seconds(
            lambda name=name: sweep(trace, [(name, [])], SWEEP_SLOTS, registry=registry,
                                    profile=trace.routing_counts()), args.repeat)
        rates = [r.hit_rate for r in results if r.name == name]
        out.append({"policy": name, "sizes": len(SWEEP_SLOTS), "seconds": round(seconds, 3),
                    "hit_rates": [round(h, 4) for h in rates]})
    return out


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
    for name in plugins(registry):
        seconds, result = best_seconds(
            lambda name=name: replay(trace, registry.create(name), config, profile), args.repeat)
        rows.append(row(name, result.path, trace, seconds, result.hit_rate, "plugin"))
    short = make_trace(args.generic_accesses)
    rows += generic_rows(registry, trace, short, args)
    return {
        "benchmark": "replay",
        "machine": machine(),
        "trace": {"accesses": trace.n_accesses, "layers": LAYERS, "experts": EXPERTS,
                  "top_k": TOP_K, "requests": REQUESTS, "steps": trace.n_steps,
                  "kind": "markov", "generic_accesses": short.n_accesses},
        "slots": args.slots,
        "repeat": args.repeat,
        "rows": rows,
        "sweeps": sweep_rows(registry, trace, args) if args.sweep else [],
        "sweep_slots": list(SWEEP_SLOTS),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accesses", type=int, default=1_000_000)
    parser.add_argument("--generic-accesses", type=int, default=100_000)
    parser.add_argument("--slots", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--sweep", action="store_true",
                        help="also time a sweep of 10 sizes per plugin (and lru)")
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
    print(f"{'policy':<16}{'kind':<13}{'path':<9}{'accesses':>10}{'seconds':>10}"
          f"{'M acc/s':>10}{'hit rate':>10}  vs reference")
    for r in out["rows"]:
        ratio = f"  {r['speedup']:.1f}x ({r['reference_accesses_per_s'] / 1e6:.2f}M/s)" \
            if "speedup" in r else ""
        print(f"{r['policy']:<16}{r['kind']:<13}{r['path']:<9}{r['accesses']:>10}"
              f"{r['seconds']:>10.3f}{r['accesses_per_s'] / 1e6:>10.2f}{r['hit_rate']:>10.4f}"
              f"{ratio}")
    for r in out["sweeps"]:
        print(f"sweep {r['policy']:<10} {r['sizes']} sizes {out['sweep_slots'][0]}.."
              f"{out['sweep_slots'][-1]} with belady and oracle-static: {r['seconds']:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
