"""Time the host's share of a decode layer call through the expert cache, math made negligible.

On the H200 a 4 GiB decode round of `olmoe-1b-7b` spent about 1.1 ms a layer on the host
issuing and booking the call (bench/results/cache-h200-2026-11-29.md), beside the CPU's
experts: the round is host-bound. This bench isolates that share on any machine: a checkpoint
of a real model's routing shape (E experts, top-K) with tiny widths (D = 64, F = 32), so each
matmul costs little and what is timed is the Python, numpy and per-op torch overhead of
`CachedExperts.forward` for one token. It runs the same seeded calls (random routing, a cache
holding a quarter of the experts, uniform fill) through:

- `resident`: `ResidentExperts.forward`, the runtime's decode path (the reference: a handful of
  torch ops, no books);
- `cache`: `CachedExperts.forward` with every miss on the CPU;
- `cache-streamN`: the same with `--stream-misses N`.

and reports microseconds a call (the least of `--repeat` passes over the calls, on `--threads`
torch threads) and each against `resident` measured in the same run.

    python bench/cache_host.py
    python bench/cache_host.py --experts 128 --top-k 8 --stream 4 --json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from strata.engine.cache.build import plan_cache
from strata.engine.experts import ResidentExperts
from strata.engine.model.config import ModelConfig
from strata.engine.model.init_model import write_checkpoint
from strata.engine.model.layers import route
from strata.engine.model.moe import load_model
from strata.engine.model.presets import get_preset
from strata.engine.runtime.load import load
from strata.formats.profile import uniform_rank

CHUNK_BYTES = 65536  # the host backend's chunks: slots of a few KiB fit whole


def time_calls(forward, calls, repeat: int) -> float:
    """The least microseconds a call over `repeat` passes (after one untimed pass): the pass
    least disturbed by the rest of the machine."""
    for call in calls:
        forward(*call)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        for call in calls:
            forward(*call)
        times.append((time.perf_counter() - start) / len(calls) * 1e6)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=64, help="E, experts a layer")
    parser.add_argument("--top-k", type=int, default=8, help="K, experts a token")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--stream", default="2,4", help="comma-separated --stream-misses N")
    parser.add_argument("--calls", type=int, default=800, help="layer calls a pass")
    parser.add_argument("--repeat", type=int, default=7, help="timed passes (the least)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: the tiny matmuls gain nothing from more)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    args = parser.parse_args(argv)
    os.environ["STRATA_VMM_CHUNK_BYTES"] = str(CHUNK_BYTES)
    torch.set_num_threads(args.threads)
    shape = dataclasses.replace(
        get_preset("small"), name="host-overhead", hidden_size=64, head_dim=16, n_heads=4,
        n_kv_heads=2, n_experts=args.experts, top_k=args.top_k, expert_width=32,
        n_layers=args.layers)
    cpu = torch.device("cpu")
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="strata-bench-host-") as tmp:
        ckpt = write_checkpoint(Path(tmp) / "ckpt", "qwen3_moe", shape, dtype=torch.float32)
        cfg = ModelConfig.from_dir(ckpt)
        gen = torch.Generator().manual_seed(0)
        calls = []
        for i in range(args.calls):
            x = torch.randn(1, cfg.hidden_size, generator=gen)  # [1, D]
            ids, weights = route(torch.randn(1, cfg.n_experts, generator=gen), cfg.top_k, False)
            calls.append((i % cfg.n_layers, x, ids, weights))
        model = load_model(ckpt, device=cpu)
        assert isinstance(model.experts, ResidentExperts)
        results["resident"] = time_calls(model.experts.forward, calls, args.repeat)
        blob_mib = 3 * cfg.expert_width * cfg.hidden_size * 4 / 2**20
        quarter_mib = cfg.n_layers * cfg.n_experts * blob_mib / 4
        streams = [0, *(int(n) for n in args.stream.split(",") if n)]
        for n in streams:
            cache = plan_cache(cfg, torch.float32, cpu, max_context=64, prefill_chunk=16,
                               expert_cache_mib=quarter_mib, prefill_loan=False,
                               rank=uniform_rank(cfg.n_layers, cfg.n_experts), stream_misses=n)
            model = load(ckpt, device=cpu, cache=cache).model
            experts = model.experts
            experts.begin_request()
            experts.set_phase("decode")
            results[f"cache-stream{n}" if n else "cache"] = time_calls(experts.forward, calls,
                                                                        args.repeat)
            experts.close()
    document = {
        "machine": platform.processor() or platform.machine(), "threads":
        torch.get_num_threads(), "torch": torch.__version__,
        "date": datetime.date.today().isoformat(), "experts": args.experts,
        "top_k": args.top_k, "us_per_call": results,
        "over_resident": {name: us / results["resident"] for name, us in results.items()},
    }
    if args.json:
        print(json.dumps(document))
        return 0
    print(f"host share of a decode layer call (E={args.experts}, K={args.top_k}, D=64, F=32, a "
          f"quarter of the experts cached), {document['machine']}, {document['threads']} "
          f"threads; the least of {args.repeat} passes of {args.calls} calls")
    print(f"{'path':<16}{'us/call':>10}{'x resident':>12}")
    for name, us in results.items():
        print(f"{name:<16}{us:>10.1f}{document['over_resident'][name]:>12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
