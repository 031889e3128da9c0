"""Parking and restoring conversations: strata's host pages against torch's pinned tensors.

`strata.engine.kv.conversations.ConversationCache` copies a parked conversation's cells into
one mapping of host pages of their exact size, page-locked on CUDA, and keeps the pages of a
conversation that leaves (pushed out or restored) for the next park, within its bound. Until
2026-12-05 it took a torch tensor a layer's K and a layer's V, `pin_memory=True` on CUDA:
torch's caching host allocator rounds each up to a power of two and keeps freed blocks outside
any bound. This runs the serving pattern three ways, each in a fresh process:

- `pages`: the cache as it is (page-locked on CUDA);
- `huge`: the same with `STRATA_HOST_HUGE_PAGES=1`, the pages advised to be 2 MiB ones (fewer
  pages to fault in and to lock);
- `pageable`: the same pages never page-locked (on CUDA only: on the CPU it is `pages`);
- `torch`: the cache's memory as it was (`TorchPinnedParking`).

Two conversations take turns, as two chats on one server do: A of `--cells` cells and B of
3/4 of them. Each round parks the live one and restores the other (the first round parks A
alone, from a K/V holding it). Figures: the first park's seconds, the later parks' and the
restores' (medians) with their GB/s over the parked cells' bytes, and the host memory held at
the end (the drop of MemAvailable, the growth of the process's resident memory) beside the
two conversations' cells' bytes. Ratios over `torch`.

    python bench/park.py --preset qwen3-30b-a3b --cells 4096
    python bench/park.py --preset olmoe-1b-7b --cells 16384 --device cuda --json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

from _common import mem_available_bytes, rss_bytes
from strata import _vmm
from strata.engine.kv.conversations import ConversationCache
from strata.engine.kv.kv_cache import KVCache, device_backend
from strata.engine.model.presets import get_preset
from strata.settings import HOST_HUGE_PAGES

KINDS = ("pages", "huge", "pageable", "torch")


class TorchPinnedParking:
    """The conversation cache's memory as it was until 2026-12-05: a torch tensor a layer's K
    and V (pinned on CUDA), each copied with a blocking `copy_`; a restored one dropped."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.parked: dict[tuple[int, ...], list[torch.Tensor]] = {}

    def park(self, tokens: list[int], kv: KVCache) -> None:
        n = len(tokens)
        copies = []
        for cells in [kv.k(layer)[:n] for layer in range(kv.n_layers)] + \
                [kv.v(layer)[:n] for layer in range(kv.n_layers)]:
            out = torch.empty(cells.shape, dtype=cells.dtype, pin_memory=self.pin)
            out.copy_(cells)
            copies.append(out)
        self.parked[tuple(tokens)] = copies

    def restore(self, tokens: list[int], kv: KVCache) -> None:
        copies, n, L = self.parked.pop(tuple(tokens)), len(tokens), kv.n_layers
        for layer in range(L):
            kv.k(layer)[:n].copy_(copies[layer])
            kv.v(layer)[:n].copy_(copies[L + layer])
        if kv.k(0).is_cuda:
            torch.cuda.synchronize()


class PagesParking:
    """The conversation cache as it is, behind the same two calls."""

    def __init__(self, max_bytes: int, pin: bool) -> None:
        self.cache = ConversationCache(max_bytes, 2, pin=pin)

    def park(self, tokens: list[int], kv: KVCache) -> None:
        entry, _ = self.cache.park(tokens, kv)
        assert entry is not None, "the cache must hold the conversation"

    def restore(self, tokens: list[int], kv: KVCache) -> None:
        entry, _ = self.cache.best(tokens)
        self.cache.restore(self.cache.take(entry), kv, len(tokens))


def run_once(preset: str, n_cells: int, rounds: int, device: str, kind: str) -> dict:
    """`rounds` parks and restores of `kind` in this process (see the module)."""
    cfg = get_preset(preset)
    cuda = device == "cuda"
    backend = device_backend(device)
    kv = KVCache(backend, cfg.n_layers, n_cells, cfg.n_kv_heads, cfg.head_dim, torch.bfloat16)
    for layer in range(kv.n_layers):
        kv.k(layer).normal_()
        kv.v(layer).normal_()
    turns = [[0] * n_cells, [1] * (3 * n_cells // 4)]  # A and B: other tokens, other sizes
    held_bytes = sum(len(t) for t in turns) * kv.layout.bytes_per_cell
    parking = (TorchPinnedParking(cuda) if kind == "torch"
               else PagesParking(2 * held_bytes + 4 * _vmm.HUGE_PAGE_BYTES,  # room to round
                                 pin=cuda and kind != "pageable"))
    available, resident = mem_available_bytes(), rss_bytes()
    parks, restores = [], []
    for i in range(rounds):
        live, other = turns[i % 2], turns[(i + 1) % 2]
        start = time.perf_counter()
        parking.park(live, kv)
        parks.append((time.perf_counter() - start, len(live)))
        if i:
            start = time.perf_counter()
            parking.restore(other, kv)
            restores.append((time.perf_counter() - start, len(other)))
    cell_bytes = kv.layout.bytes_per_cell
    result = {
        "kind": kind, "first_park_s": parks[0][0],
        "park_s": statistics.median(s for s, _ in parks[1:]),
        "restore_s": statistics.median(s for s, _ in restores),
        "park_gbps": statistics.median(n * cell_bytes / s / 1e9 for s, n in parks[1:]),
        "restore_gbps": statistics.median(n * cell_bytes / s / 1e9 for s, n in restores),
        "host_taken_bytes": available - mem_available_bytes(),
        "rss_grown_bytes": rss_bytes() - resident, "held_cells_bytes": held_bytes,
        "cells_bytes": n_cells * cell_bytes,
    }
    if kind != "torch":
        parking.cache.clear()
    kv.close()
    backend.close()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-30b-a3b", help="the K/V's shape, all layers")
    parser.add_argument("--cells", type=int, default=4096, help="a conversation's cells")
    parser.add_argument("--rounds", type=int, default=6, help="parks a run (at least 3)")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each kind, alternated")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        choices=("cpu", "cuda"))
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--one", choices=KINDS, help=argparse.SUPPRESS)  # a child's run
    args = parser.parse_args(argv)
    if args.cells < 1 or args.rounds < 3 or args.repeat < 1:
        parser.error(f"--cells >= 1, --rounds >= 3, --repeat >= 1; got {args.cells}, "
                     f"{args.rounds}, {args.repeat}")
    if args.one:
        print(json.dumps(run_once(args.preset, args.cells, args.rounds, args.device, args.one)))
        return 0
    kinds = KINDS if args.device == "cuda" else ("pages", "huge", "torch")
    child = [sys.executable, __file__, "--preset", args.preset, "--cells", str(args.cells),
             "--rounds", str(args.rounds), "--device", args.device]

    def run(kind: str) -> dict:
        env = {**os.environ, HOST_HUGE_PAGES: "1" if kind == "huge" else "0"}
        done = subprocess.run([*child, "--one", kind], capture_output=True, text=True, env=env)
        if done.returncode:
            raise SystemExit(f"bench/park.py: the {kind} run failed:\n{done.stderr}")
        return json.loads(done.stdout.splitlines()[-1])

    runs = [run(kind) for _ in range(args.repeat) for kind in kinds]
    keys = ("first_park_s", "park_s", "restore_s", "park_gbps", "restore_gbps",
            "host_taken_bytes", "rss_grown_bytes")
    median = {kind: {key: statistics.median(r[key] for r in runs if r["kind"] == kind)
                     for key in keys} for kind in kinds}
    result = {
        "command": " ".join(["python", "bench/park.py", *(argv or sys.argv[1:])]),
        "date": datetime.date.today().isoformat(),
        "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "preset": args.preset, "cells": args.cells, "cells_bytes": runs[0]["cells_bytes"],
        "held_cells_bytes": runs[0]["held_cells_bytes"], "runs": runs, "median": median,
        "over_torch": {kind: {key: median[kind][key] / median["torch"][key] for key in keys
                              if median["torch"][key]}
                       for kind in kinds if kind != "torch"},
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['command']}  ({result['machine']}, torch {result['torch']}, "
          f"{result['cuda'] or 'no CUDA'})")
    print(f"{args.preset}: conversations of {args.cells} and {3 * args.cells // 4} cells, "
          f"{result['held_cells_bytes'] / 1e9:.3f} GB of cells in all")
    print("| host memory | first park s | park s (GB/s) | restore s (GB/s) | "
          "host taken, resident grown / both conversations' cells |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for kind in kinds:
        m = median[kind]
        print(f"| {kind} | {m['first_park_s']:.3f} | {m['park_s']:.3f} ({m['park_gbps']:.1f}) | "
              f"{m['restore_s']:.3f} ({m['restore_gbps']:.1f}) | "
              f"{m['host_taken_bytes'] / 1e9:.2f}, {m['rss_grown_bytes'] / 1e9:.2f} / "
              f"{result['held_cells_bytes'] / 1e9:.2f} GB |")
    for kind, over in result["over_torch"].items():
        print(f"{kind} over torch: " + ", ".join(f"{k} {v:.2f}x" for k, v in over.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
