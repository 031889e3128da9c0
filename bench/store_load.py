"""The expert store's load: strata's host pages against a torch tensor a layer.

`strata.engine.model.checkpoint.expert_store` reads a checkpoint's experts into one mapping of
host pages (`strata.engine.experts.store.host_blobs`: exactly the store's bytes, page-locked
for CUDA once loaded). Until 2026-12-04 it allocated a torch tensor a
layer, `pin_memory=True` on CUDA: torch's caching host allocator rounds each such block up to a
power of two. This loads one checkpoint's store three ways, each load in a fresh process as a
user's start is, alternating `--repeat` times after an untimed load that warms the file cache:

- `pages`: `expert_store` as it is (on CUDA, page-locked after loading), in 4 KiB pages;
- `huge`: the same with `STRATA_HOST_HUGE_PAGES=1`, the pages advised to be 2 MiB ones;
- `torch`: the same loader with `host_blobs` replaced by a torch tensor a layer (pinned on
  CUDA, pageable otherwise).

For each load: its seconds; the host memory it took (the drop of MemAvailable across it, and
the growth of the process's resident memory) beside the store's bytes; the share of the store
in huge pages; the CPU kernel's GB/s over the loaded store (`CpuExperts.compute`, `--experts`
experts a call, each call other experts of the next layer, the median of 20); on CUDA, the
upload rate from it (every layer's blobs copied to one device buffer, asynchronous, the best of
3). Ratios are `pages` and `huge` over `torch`, from the medians.

    python bench/store_load.py --model /tmp/strata-qwen3-2l
    python bench/store_load.py --model /tmp/strata-qwen3-2l --experts-dtype int8 --json
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
from unittest import mock

import numpy as np
import torch

from _common import mem_available_bytes, rss_bytes
from strata.engine.experts.cpu import CpuExperts
from strata.engine.experts.routed import Routed
from strata.engine.model import checkpoint
from strata.engine.model.checkpoint import Checkpoint, expert_store
from strata.machine import huge_page_bytes
from strata.settings import HOST_HUGE_PAGES

KINDS = ("pages", "huge", "torch")


class TorchLayers:
    """`host_blobs`' stand-in: a torch tensor a layer, as the loader allocated them before
    (pinned at allocation on CUDA, so `register` has nothing left to do)."""

    def __init__(self, n_layers: int, n_experts: int, blob_bytes: int, pin: bool) -> None:
        self.layers = [torch.empty((n_experts, blob_bytes), dtype=torch.uint8, pin_memory=pin)
                       for _ in range(n_layers)]

    def register(self, device: int) -> None:
        pass


def cpu_gbps(store, n_experts: int) -> float:
    """GB/s of `CpuExperts.compute` over n_experts experts a call of one token, each call
    other experts of the next layer (the median of 20 after one)."""
    cpu = CpuExperts(store)
    rng = np.random.default_rng(0)
    x = torch.randn(n_experts, store.hidden_size).to(store.dtype)
    times = []
    for call in range(21):
        ids = np.sort(rng.choice(store.n_experts, n_experts, replace=False))
        routed = Routed.of(ids[None, :])  # one token routed to n_experts experts: n rows
        start = time.perf_counter()
        cpu.compute(call % store.n_layers, x, routed)
        if call:
            times.append(time.perf_counter() - start)
    return n_experts * store.blob_bytes / statistics.median(times) / 1e9


def upload_gbps(store) -> float:
    """GB/s of every layer's blobs copied to one device buffer, asynchronously (best of 3)."""
    dest = torch.empty(store.layer_blobs(0).shape, dtype=torch.uint8, device="cuda")
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for layer in range(store.n_layers):
            dest.copy_(store.layer_blobs(layer), non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return store.n_layers * dest.numel() / best / 1e9


def load_once(model: str, kind: str, quant: str | None, n_experts: int) -> dict:
    """One load of `kind` in this process, and its figures (see the module); `huge` is `pages`
    under the environment its parent set."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.zeros(1, device="cuda")  # the context's own memory is not the store's
    stand_in = None
    if kind == "torch":
        def torch_layers(n_layers, n, blob_bytes, what):
            layers = TorchLayers(n_layers, n, blob_bytes, pin=cuda)
            return layers, layers.layers
        stand_in = mock.patch.object(checkpoint, "host_blobs", torch_layers)
        stand_in.start()
    try:
        available, resident = mem_available_bytes(), rss_bytes()
        start = time.perf_counter()
        ckpt = Checkpoint.open(model)
        try:
            store = expert_store(ckpt, pin_memory=cuda, quant=quant)
        finally:
            ckpt.close()
        seconds = time.perf_counter() - start
        taken = available - mem_available_bytes()
        grown = rss_bytes() - resident
    finally:
        if stand_in is not None:
            stand_in.stop()
    store_bytes = store.n_layers * store.n_experts * store.blob_bytes
    return {
        "kind": kind, "load_s": seconds, "store_bytes": store_bytes, "host_taken_bytes": taken,
        "rss_grown_bytes": grown,
        "huge_page_share": huge_page_bytes(store.layer_blobs(0).data_ptr(),
                                           store_bytes) / store_bytes,
        "cpu_gbps": cpu_gbps(store, n_experts),
        "upload_gbps": upload_gbps(store) if cuda else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a checkpoint directory")
    parser.add_argument("--experts-dtype", default=None, choices=("int8", "int4-g32"),
                        help="quantize the store as it loads (default: the model's dtype)")
    parser.add_argument("--experts", type=int, default=4,
                        help="experts a CPU call (default 4: a decode call's CPU share)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--one", choices=KINDS, help=argparse.SUPPRESS)  # a child's load
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(load_once(args.model, args.one, args.experts_dtype, args.experts)))
        return 0
    if args.repeat < 1 or args.experts < 1:
        parser.error(f"--repeat and --experts must be >= 1, got {args.repeat}, {args.experts}")
    child = [sys.executable, __file__, "--model", args.model, "--experts", str(args.experts)]
    if args.experts_dtype:
        child += ["--experts-dtype", args.experts_dtype]

    def load(kind: str) -> dict:
        env = {**os.environ, HOST_HUGE_PAGES: "1" if kind == "huge" else "0"}
        out = subprocess.run([*child, "--one", kind], check=True, capture_output=True,
                             text=True, env=env).stdout
        return json.loads(out.splitlines()[-1])

    load("pages")  # untimed: the checkpoint's file into the page cache
    loads = [load(kind) for _ in range(args.repeat) for kind in KINDS]
    summary = {}
    for kind in KINDS:
        mine = [r for r in loads if r["kind"] == kind]
        summary[kind] = {key: statistics.median(r[key] for r in mine)
                         for key in ("load_s", "host_taken_bytes", "rss_grown_bytes",
                                     "huge_page_share",
                                     "cpu_gbps", "upload_gbps")
                         if mine[0][key] is not None}
        summary[kind]["store_bytes"] = mine[0]["store_bytes"]
    result = {
        "command": " ".join(["python", "bench/store_load.py", *(argv or sys.argv[1:])]),
        "date": datetime.date.today().isoformat(),
        "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "loads": loads, "median": summary,
        "over_torch": {kind: {key: summary[kind][key] / summary["torch"][key]
                              for key in summary[kind] if summary["torch"].get(key)}
                       for kind in ("pages", "huge")},
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['command']}  ({result['machine']}, torch {result['torch']}, "
          f"{result['cuda'] or 'no CUDA'})")
    print("| store | load s | host memory taken, resident grown / store bytes | in huge pages | "
          "CPU kernel GB/s | upload GB/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for kind in KINDS:
        s = summary[kind]
        upload = f"{s['upload_gbps']:.1f}" if "upload_gbps" in s else "-"
        print(f"| {kind} | {s['load_s']:.2f} | {s['host_taken_bytes'] / 2**30:.2f}, "
              f"{s['rss_grown_bytes'] / 2**30:.2f} GiB / "
              f"{s['store_bytes'] / 2**30:.2f} GiB | {s['huge_page_share']:.0%} | "
              f"{s['cpu_gbps']:.1f} | {upload} |")
    for kind, over in result["over_torch"].items():
        ratios = ", ".join(f"{k} {v:.2f}x" for k, v in over.items())
        print(f"{kind} over torch (medians of {args.repeat}): {ratios}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
