"""Benchmark the built-in policies' decisions on a table of a real model's shape.

`observe` runs once per MoE layer per step on the hot path, so its cost is compared with the
books' own `lookup` of the same ids in the same run. `admit` (checked) runs per layer per step
with misses; a growth (`give_up` + `relocate`, checked) once per K/V step. Medians of `--repeat`
calls, in µs, after `--warm-steps` decode steps of skewed routing through every layer (lookup,
observe, admit, apply, as the engine will run them).

    python bench/policies.py            # a table for people
    python bench/policies.py --json     # one JSON object
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import numpy as np

from strata._residency import ResidencyTable
from strata.books import CheckedPolicy, apply_admit
from strata.policies import load_registry

# Qwen3-30B-A3B's MoE shape: 48 layers of 128 experts, 8 routed per token; bf16 experts of
# hidden 2048 and width 768 are 9 MiB blobs, in 2 MiB chunks.
N_LAYERS, N_EXPERTS, TOP_K = 48, 128, 8
SLOT_BYTES, CHUNK_BYTES = 3 * 2048 * 768 * 2, 2 << 20
N_SLOTS, LOAN, FLOOR = 3072, 256, 128


def make_table(rng: np.random.Generator) -> ResidencyTable:
    table = ResidencyTable(N_LAYERS, N_EXPERTS, N_SLOTS, SLOT_BYTES, CHUNK_BYTES)
    table.set_regions(top=N_SLOTS - LOAN, floor=FLOOR)
    counts = rng.zipf(1.3, size=(N_LAYERS, N_EXPERTS)).astype(np.float64)
    table.set_rank_from_counts(counts)
    hottest = np.argsort(table.rank.ravel())[:N_SLOTS]
    table.assign_many(np.arange(N_SLOTS), hottest // N_EXPERTS, hottest % N_EXPERTS)
    return table


def route(rng: np.random.Generator, tokens: int) -> np.ndarray:
    """int64 [T, K] expert ids, skewed like real routing."""
    weights = 1.0 / np.arange(1, N_EXPERTS + 1) ** 0.8
    return np.stack([rng.choice(N_EXPERTS, TOP_K, replace=False, p=weights / weights.sum())
                     for _ in range(tokens)])


def median_us(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e3


def bench_policy(name: str, registry, repeat: int, warm_steps: int) -> dict[str, float]:
    rng = np.random.default_rng(0)
    table = make_table(rng)
    checked = CheckedPolicy(registry.create(name), table)
    # Warm up as the engine runs: per step and layer, look up, observe, admit, apply.
    for _ in range(warm_steps):
        for layer in range(N_LAYERS):
            ids = route(rng, 1)
            _, hit = table.lookup(layer, ids)
            checked.observe(checked.view, layer, ids, hit)
            apply_admit(table, checked.admit(layer, np.unique(ids[~hit])))
    decode, prefill = route(rng, 1), route(rng, 512)
    hit_decode = table.lookup(3, decode)[1].copy()
    hit_prefill = table.lookup(3, prefill)[1].copy()
    missed = np.flatnonzero(table.res[3] < 0)[:4].astype(np.int32)
    return {
        "lookup_1x8_us": median_us(lambda: table.lookup(3, decode), repeat),
        "observe_1x8_us": median_us(
            lambda: checked.observe(checked.view, 3, decode, hit_decode), repeat),
        "observe_512x8_us": median_us(
            lambda: checked.observe(checked.view, 3, prefill, hit_prefill), repeat),
        "admit_4_misses_us": median_us(lambda: checked.admit(3, missed), repeat),
        "give_up_64_chunks_us": median_us(lambda: checked.give_up(64), max(repeat // 20, 5)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--warm-steps", type=int, default=16,
                        help="decode steps of routing (every layer) before timing")
    args = parser.parse_args()
    registry = load_registry()
    results = {name: bench_policy(name, registry, args.repeat, args.warm_steps)
               for name in registry.names()}
    if args.json:
        print(json.dumps({"machine": platform.processor() or platform.machine(),
                          "shape": [N_LAYERS, N_EXPERTS, N_SLOTS], "results": results}))
        return
    columns = list(next(iter(results.values())))
    print("| policy | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for name, row in results.items():
        print(f"| {name} | " + " | ".join(f"{row[c]:.1f}" for c in columns) + " |")


if __name__ == "__main__":
    main()
