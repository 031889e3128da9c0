"""Measure the transient device memory of one forward against the budget's workspace estimate.

The budget (`strata.engine.cache.budget.workspace_bytes`) reserves room for the tensors a
forward allocates and frees: attention's over the window, the routed rows, the activations,
the logits. This script measures them on CUDA: for each `--cells` N, a model of `--layers` layers
with a K/V of N cells runs, from a clean allocator peak,
- `first`: the first prompt chunk (C tokens from position 0: the causal kernel, no mask);
- `last`: a prompt chunk whose last token is the window's last cell (C tokens against N cells,
  through a mask: the case whose attention grows with the window);
- `decode`: one token at the window's last cell;
and reports `torch.cuda.max_memory_allocated` above what was allocated before the call, beside
the estimate. A warm-up forward of each kind runs first: what a library allocates once and keeps
(cuBLAS's workspace, 32 MiB per stream) is not a forward's transient, and the budget's reserve
(`--vram-reserve-mib`) holds it. Random weights; the K/V's contents do not change the
allocations.

    python bench/workspace.py --preset olmoe-1b-7b --cells 4096,16384,65536
    python bench/workspace.py --preset qwen3-30b-a3b --layers 2 --json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
from pathlib import Path

import torch

from _common import add_model_arguments, free_memory
from strata.engine.cache.budget import MIB, workspace_bytes
from strata.engine.experts.grouped import copies_weights
from strata.engine.kv.kv_cache import new_kv
from strata.engine.model.init_model import write_checkpoint
from strata.engine.model.moe import load_model
from strata.engine.model.presets import get_preset


def peak_bytes(device: torch.device, call) -> int:
    """Bytes allocated above the current level at the peak of `call()` (its result freed)."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    result = call()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del result
    return peak


def measure(model, n_cells: int, chunk: int, device: torch.device) -> dict:
    kv = new_kv(model, n_cells)
    try:
        c = min(chunk, n_cells)
        ids = torch.randint(0, 256, (c,), device=device)  # [C]
        one = ids[:1]  # [1]
        model.forward(ids, 0, kv, last_only=True)  # warm-up: the libraries' one-time workspaces
        model.forward(one, n_cells - 1, kv)
        return {
            "cells": n_cells,
            "first": peak_bytes(device, lambda: model.forward(ids, 0, kv, last_only=True)),
            "last": peak_bytes(device, lambda: model.forward(ids, n_cells - c, kv,
                                                            last_only=True)),
            "decode": peak_bytes(device, lambda: model.forward(one, n_cells - 1, kv)),
            "estimate": workspace_bytes(model.config, chunk, n_cells, model.dtype,
                                        gathers=copies_weights(device)),
        }
    finally:
        kv.close()
        free_memory(device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(parser, preset="olmoe-1b-7b")
    parser.add_argument("--cells", default="4096,16384,65536", help="comma-separated windows")
    parser.add_argument("--prefill-chunk", type=int, default=512)
    parser.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    parser.set_defaults(layers=2)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type != "cuda":
        parser.error("the allocator's peak is measured on CUDA only: --device cuda")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    cells = [int(n) for n in args.cells.split(",")]
    with tempfile.TemporaryDirectory(prefix="strata-bench-workspace-") as tmp:
        preset = get_preset(args.preset)
        ckpt = write_checkpoint(Path(tmp) / "ckpt", args.family or preset.default_family,
                                preset, n_layers=args.layers, dtype=dtype,
                                router_skew=args.router_skew)
        model = load_model(ckpt, device=device, dtype=dtype)
        rows = [measure(model, n, args.prefill_chunk, device) for n in cells]
    result = {"preset": args.preset, "layers": args.layers, "dtype": args.dtype,
              "prefill_chunk": args.prefill_chunk, "device_name": torch.cuda.get_device_name(),
              "torch": torch.__version__, "date": datetime.date.today().isoformat(),
              "rows": rows}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"workspace: {args.preset} ({args.layers} layers, {args.dtype}) on "
          f"{result['device_name']}, prompt chunks of {args.prefill_chunk}; MiB above the "
          "level before the call")
    print(f"{'cells':>8}{'first':>10}{'last':>10}{'decode':>10}{'estimate':>10}")
    for row in rows:
        print(f"{row['cells']:>8}" + "".join(
            f"{row[key] / MIB:>10.1f}" for key in ("first", "last", "decode", "estimate")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
