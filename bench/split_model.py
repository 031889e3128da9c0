"""Fit a model of the decode round to bench/offload.py's runs of one machine and predict the round
of split tables not run: which table to time next, and what a split rule's table should give.

Dimension letters: K experts per token, M missed experts of a layer call, s streamed.

A layer's misses: M of K, binomial with the runs' mean misses a layer (with uniform routing
bench/results/split-tables-h100-2026-12-07.md's streamed counts agreed with it within 2%, and
with `--router-skew 0.5` too). A layer call with s of its M misses streamed takes
max(cpu_fixed + (M - s) * cpu_each, upload_fixed + s * upload_each) (a side with nothing to do
takes nothing); a round is the layers' expected sum plus a constant of the routing (the device's
work, the host's, the token's wait). The four per-call figures are shared by every run fitted
(one machine), the constant is one a routing; they are fitted to the runs' rounds (relative
errors, least squares) by a grid search, each constant in closed form. The runs are
bench/offload.py's JSON lines (its `split` names each run's table; a run without one is auto's,
given by `--auto`). A model, not a measurement: it prints its fit's error beside its
predictions, and a table it ranks first is one to time.

    python bench/split_model.py bench/results/split-tables-h100-2026-12-07-call*.jsonl \\
        --auto 0,1,2,3,3,4,4,4,5 --tables 0,0,1,1,2,2,3,3,4/0,0,1,1,1,2,2,3,3
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from pathlib import Path

import numpy as np

from offload_args import split_tables

# The grid searched, in µs: (lowest, highest, step) of each per-call figure.
GRID_US = {"cpu_each": (20, 160, 4), "upload_each": (20, 200, 4), "cpu_fixed": (0, 300, 15),
           "upload_fixed": (0, 300, 15)}


def binomial(k: int, p: float) -> np.ndarray:
    """[K + 1]: P(M = m) of M ~ Binomial(K, p)."""
    return np.array([math.comb(k, m) * p ** m * (1 - p) ** (k - m) for m in range(k + 1)])


def layer_ms(counts: np.ndarray, chances: np.ndarray, figures: np.ndarray) -> np.ndarray:
    """[G]: a layer call's expected ms for each of G rows of figures [G, 4] (cpu_each,
    upload_each, cpu_fixed, upload_fixed in ms) under the table counts [K + 1] and the chances
    [K + 1] of M."""
    cpu_each, upload_each, cpu_fixed, upload_fixed = figures.T[:, :, None]  # [G, 1] each
    m = np.arange(counts.size)
    on_cpu, streamed = m - counts, counts  # [K + 1] each
    cpu = np.where(on_cpu > 0, cpu_fixed + on_cpu * cpu_each, 0.0)  # [G, K + 1]
    upload = np.where(streamed > 0, upload_fixed + streamed * upload_each, 0.0)
    return (np.maximum(cpu, upload) * chances).sum(axis=1)


def read_runs(paths: list[Path], auto: tuple[int, ...]) -> list[dict]:
    """Each decode run of the JSON lines: its routing's skew, layers, table, round (ms) and
    misses a layer. ValueError naming the file and run whose table is not len(auto) long."""
    runs = []
    for path in paths:
        for line in path.read_text().splitlines():
            if not line.startswith("{"):
                continue
            document = json.loads(line)
            for name, run in document["runs"].items():
                if not name.startswith("decode"):
                    continue
                r = run["round"]
                counts = [int(c) for c in run["split"].split(",")] if run.get("split") \
                    else list(auto)
                if len(counts) != len(auto):
                    raise ValueError(f"{path}: run {name} splits by {counts}, not K + 1 = "
                                     f"{len(auto)} counts as --auto's table")
                runs.append({"name": name, "skew": document["router_skew"],
                             "layers": document["layers"], "counts": np.array(counts),
                             "round_ms": r["round_ms"],
                             "misses": r["misses_per_round"] / document["layers"]})
    return runs


def chances_of(runs: list[dict], k: int) -> dict[float, np.ndarray]:
    """Each routing's chances [K + 1] of M: binomial at its runs' mean misses a layer."""
    return {skew: binomial(k, np.mean([r["misses"] for r in runs if r["skew"] == skew]) / k)
            for skew in {r["skew"] for r in runs}}


def fit(runs: list[dict], chances: dict[float, np.ndarray]) -> tuple[dict, dict, float]:
    """(the per-call figures in ms, the constant of each routing in ms, the rms relative error)
    that fit `runs` best on the grid, M of each routing by `chances`."""
    grid = np.array(list(itertools.product(*(np.arange(lo, hi + step, step) / 1000
                                              for lo, hi, step in GRID_US.values()))))
    measured = np.array([r["round_ms"] for r in runs])  # [N]
    modelled = np.stack([r["layers"] * layer_ms(r["counts"], chances[r["skew"]], grid)
                         for r in runs], axis=1)  # [G, N]
    constants, predicted = {}, modelled.copy()
    for skew in chances:
        mine = np.array([r["skew"] == skew for r in runs])
        weights = 1 / measured[mine] ** 2  # the constant that minimizes the relative errors
        constant = ((measured[mine] - modelled[:, mine]) * weights).sum(axis=1) / weights.sum()
        constants[skew] = constant
        predicted[:, mine] += constant[:, None]
    errors = np.sqrt((((predicted - measured) / measured) ** 2).mean(axis=1))  # [G]
    best = int(errors.argmin())
    return (dict(zip(GRID_US, grid[best], strict=True)),
            {skew: float(c[best]) for skew, c in constants.items()}, float(errors[best]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", type=Path, help="bench/offload.py JSON lines")
    parser.add_argument("--auto", required=True,
                        help="auto's kept table in those runs (comma-separated counts)")
    parser.add_argument("--tables", default="", help="/-separated tables to predict")
    args = parser.parse_args(argv)
    tables = split_tables(args.auto), split_tables(args.tables)
    if not tables[0] or len(tables[0]) != 1 or tables[1] is None:
        parser.error(f"--auto takes one table and --tables /-separated tables of "
                     f"comma-separated counts, each 0 first and counts[M] <= M, got "
                     f"{args.auto!r} and {args.tables!r}")
    auto, k = tables[0][0], len(tables[0][0]) - 1
    if any(len(table) != k + 1 for table in tables[1]):
        parser.error(f"--tables' tables must be K + 1 = {k + 1} counts as --auto's, got "
                     f"{args.tables!r}")
    try:
        runs = read_runs(args.paths, auto)
    except ValueError as error:
        parser.error(str(error))
    if not runs:
        parser.error(f"no decode run in {', '.join(map(str, args.paths))}")
    chances = chances_of(runs, k)
    figures, constants, error = fit(runs, chances)
    print("per call: " + ", ".join(f"{name} {1000 * ms:.0f} µs" for name, ms in figures.items())
          + "; a round's constant: " + ", ".join(f"skew {skew} {c:.2f} ms"
                                                 for skew, c in sorted(constants.items()))
          + f"; rms relative error {error:.3f} over {len(runs)} runs")
    row = np.array([list(figures.values())])
    for skew in sorted(constants):
        layers = next(r["layers"] for r in runs if r["skew"] == skew)
        for table in [list(auto), *map(list, tables[1])]:
            ms = layers * layer_ms(np.array(table), chances[skew], row)[0] + constants[skew]
            measured = [r["round_ms"] for r in runs
                        if r["skew"] == skew and list(r["counts"]) == table]
            seen = f", measured {', '.join(f'{m:.2f}' for m in measured)}" if measured else ""
            print(f"skew {skew}: {','.join(map(str, table))} {ms:.2f} ms predicted{seen}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
