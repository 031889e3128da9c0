"""Parking and restoring conversations: strata's host pages against torch's pinned tensors.

`strata.engine.kv.conversations.ConversationCache` copies a parked conversation's cells into
one mapping of host pages of their exact size, page-locked on CUDA at each park
(`cuMemHostRegister`) and given back when the conversation leaves. Until 2026-12-05 it took a
torch tensor a layer's K and a layer's V, `pin_memory=True` on CUDA: torch's caching host
allocator rounds each up to a power of two and keeps freed blocks, so a park after the first
reuses pinned memory for nothing, and the memory is never given back. This runs the same
conversation cache three ways, each in a fresh process:

- `pages`: as it is (page-locked on CUDA);
- `pageable`: the same pages never page-locked (on CUDA only: on the CPU it is `pages`);
- `torch`: `_host_tensors` replaced by a torch tensor a layer (pinned on CUDA).

Each run holds at most 2 conversations of `--cells` cells of a preset's whole K/V: round i
parks conversation i (from the third on, the oldest leaves) and restores conversation i-1.
Figures: the first park's seconds, the later parks' and the restores' (medians) with their
GB/s, and the host memory held at the end (the drop of MemAvailable, the growth of the
process's resident memory) beside the two conversations' cells' bytes. Ratios over `torch`.

    python bench/park.py --preset qwen3-30b-a3b --cells 4096
    python bench/park.py --preset olmoe-1b-7b --cells 16384 --device cuda --json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import sys
import time

import torch

from _common import mem_available_bytes, rss_bytes
from strata.engine.kv.conversations import ConversationCache
from strata.engine.kv.kv_cache import KVCache, device_backend
from strata.engine.model.presets import get_preset

KINDS = ("pages", "pageable", "torch")
HELD = 2  # conversations the cache holds: from the third park on, one leaves at each


class TorchPinnedCache(ConversationCache):
    """The conversation cache as it was: a torch tensor a layer's K, V and scales (pinned on
    CUDA), owning its memory."""

    def _host_tensors(self, cells):
        pin = self.pin and cells[0].is_cuda
        return None, [torch.empty(c.shape, dtype=c.dtype, pin_memory=pin) for c in cells]


def run_once(preset: str, n_cells: int, rounds: int, device: str, kind: str) -> dict:
    """`rounds` parks and restores of `kind` in this process (see the module)."""
    cfg = get_preset(preset)
    cuda = device == "cuda"
    backend = device_backend(device)
    kv = KVCache(backend, cfg.n_layers, n_cells, cfg.n_kv_heads, cfg.head_dim, torch.bfloat16)
    for layer in range(kv.n_layers):
        kv.k(layer).normal_()
        kv.v(layer).normal_()
    cell_bytes = n_cells * kv.layout.bytes_per_cell
    cls = TorchPinnedCache if kind == "torch" else ConversationCache
    cache = cls(HELD * 2 * cell_bytes, HELD, pin=cuda and kind != "pageable")
    available, resident = mem_available_bytes(), rss_bytes()
    parks, restores, previous = [], [], None
    for i in range(rounds):
        start = time.perf_counter()
        entry, dropped = cache.park([i] * n_cells, kv)
        parks.append(time.perf_counter() - start)
        del dropped  # its memory goes back (pages) or to torch's cache (pinned)
        assert entry is not None, "the cache must hold the conversation"
        if previous is not None:
            start = time.perf_counter()
            cache.restore(previous, kv, n_cells)
            restores.append(time.perf_counter() - start)
        previous = entry
    del entry, previous
    result = {
        "kind": kind, "cells_bytes": cell_bytes, "first_park_s": parks[0],
        "park_s": statistics.median(parks[1:]), "restore_s": statistics.median(restores),
        "host_taken_bytes": available - mem_available_bytes(),
        "rss_grown_bytes": rss_bytes() - resident, "held_cells_bytes": HELD * cell_bytes,
    }
    result["park_gbps"] = cell_bytes / result["park_s"] / 1e9
    result["restore_gbps"] = cell_bytes / result["restore_s"] / 1e9
    for entry in cache.entries():
        cache.take(entry)
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
    kinds = KINDS if args.device == "cuda" else ("pages", "torch")
    child = [sys.executable, __file__, "--preset", args.preset, "--cells", str(args.cells),
             "--rounds", str(args.rounds), "--device", args.device]

    def run(kind: str) -> dict:
        done = subprocess.run([*child, "--one", kind], capture_output=True, text=True)
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
    print(f"{args.preset}, {args.cells} cells a conversation: {result['cells_bytes'] / 1e9:.3f} "
          f"GB; {HELD} held")
    print("| host memory | first park s | park s (GB/s) | restore s (GB/s) | "
          "host taken, resident grown / held cells |")
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
