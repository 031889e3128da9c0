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
- `cache-streamN`: the same with `--stream-misses N`;
- with `--split`, `split` and `split-streamN`: the host's part of the same calls split as a
  decode round on CUDA runs them around its piecewise graphs (`CachedExperts.fill_misses`
  alone: the books, the policy, the CPU's misses on their own thread, the streamed blobs and
  the stage map queued; `resident_rows` and `sum_rows`, which a graph holds there, run untimed
  on either side), up to where a round launches the next graph (the call's books, which it
  hands back for after the launch, untimed), and beside it the time from the call to the
  CPU's start. On the host the copies are `memmove`s, not driver calls, so this times the
  Python, numpy and torch work around them.

`--dtype bf16 --experts-dtype int8` runs the experts as an int8 store computing in bf16 (the
CPU's misses through strata's kernel, as on the GPU machine); the default is fp32 experts
(torch's matmuls).

It reports microseconds a call (the least of `--repeat` passes over the calls, on `--threads`
torch threads) and each against `resident` measured in the same run.

    python bench/cache_host.py
    python bench/cache_host.py --experts 128 --top-k 8 --stream 4 --json
    python bench/cache_host.py --experts 128 --top-k 8 --split --dtype bf16 --experts-dtype int8
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import inspect
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
from strata.engine.experts.quant import expert_blob_bytes
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


def time_split(experts, calls, repeat: int) -> tuple[float, float | None]:
    """`time_calls` for the host's part of a split call (`fill_misses`) up to where a round
    launches the next graph (its books, where the call hands them back as a round asks,
    after, untimed), and the mean microseconds from the call to the CPU's start
    (`CpuExperts.start` entered; None where no call started one). Each call's
    `resident_rows` and `sum_rows` run around it untimed. A tree whose `fill_misses` cannot
    hand its books back (an A/B's baseline, through PYTHONPATH) is timed whole."""
    books_after = "books_after" in inspect.signature(type(experts).fill_misses).parameters
    started: list[float] = []
    cpu = experts.cpu
    real_start = cpu.start

    def start(*args, **kwargs):
        started.append(time.perf_counter())
        return real_start(*args, **kwargs)

    def one_pass() -> tuple[float, float | None]:
        spent = to_start = 0.0
        n_started = 0
        for layer, x, ids, weights in calls:
            rows = experts.resident_rows(layer, x, ids)  # [K + 1, D]
            begin = time.perf_counter()
            end = experts.fill_misses(layer, x, ids, weights, rows, books_after=True) \
                if books_after else experts.fill_misses(layer, x, ids, weights, rows)
            spent += time.perf_counter() - begin
            if started:
                to_start += started.pop() - begin
                n_started += 1
            experts.sum_rows(x, rows, weights)
            if end is not None:
                end()
        return spent / len(calls) * 1e6, to_start / n_started * 1e6 if n_started else None

    cpu.start = start  # an instance attribute: this cache's calls alone
    try:
        one_pass()
        passes = [one_pass() for _ in range(repeat)]
    finally:
        del cpu.start
    return min(p[0] for p in passes), None if passes[0][1] is None else min(
        p[1] for p in passes)


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
    parser.add_argument("--split", action="store_true",
                        help="also time the host's part of the calls split around the graphs")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"],
                        help="the model's dtype")
    parser.add_argument("--experts-dtype", default="auto", choices=["auto", "int8"],
                        help="the experts' store: the model's dtype, or int8")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    args = parser.parse_args(argv)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    quant = None if args.experts_dtype == "auto" else args.experts_dtype
    if quant is not None and dtype != torch.bfloat16:
        parser.error("--experts-dtype int8 computes in bf16: pass --dtype bf16 with it")
    os.environ["STRATA_VMM_CHUNK_BYTES"] = str(CHUNK_BYTES)
    torch.set_num_threads(args.threads)
    shape = dataclasses.replace(
        get_preset("small"), name="host-overhead", hidden_size=64, head_dim=16, n_heads=4,
        n_kv_heads=2, n_experts=args.experts, top_k=args.top_k, expert_width=32,
        n_layers=args.layers)
    cpu = torch.device("cpu")
    results: dict[str, float] = {}
    to_cpu_start: dict[str, float] = {}  # split calls: us from the call to the CPU's start
    with tempfile.TemporaryDirectory(prefix="strata-bench-host-") as tmp:
        ckpt = write_checkpoint(Path(tmp) / "ckpt", "qwen3_moe", shape, dtype=dtype)
        cfg = ModelConfig.from_dir(ckpt)
        gen = torch.Generator().manual_seed(0)
        calls = []
        for i in range(args.calls):
            x = torch.randn(1, cfg.hidden_size, generator=gen).to(dtype)  # [1, D]
            ids, weights = route(torch.randn(1, cfg.n_experts, generator=gen), cfg.top_k, False)
            calls.append((i % cfg.n_layers, x, ids, weights))
        model = load_model(ckpt, device=cpu)
        assert isinstance(model.experts, ResidentExperts)
        results["resident"] = time_calls(model.experts.forward, calls, args.repeat)
        blob_mib = expert_blob_bytes(cfg.expert_width, cfg.hidden_size, dtype, quant) / 2**20
        quarter_mib = cfg.n_layers * cfg.n_experts * blob_mib / 4
        streams = [0, *(int(n) for n in args.stream.split(",") if n)]
        for n in streams:
            cache = plan_cache(cfg, dtype, cpu, max_context=64, prefill_chunk=16,
                               expert_cache_mib=quarter_mib, prefill_loan=False,
                               rank=uniform_rank(cfg.n_layers, cfg.n_experts), stream_misses=n,
                               experts_quant=quant)
            model = load(ckpt, device=cpu, cache=cache, experts_quant=quant).model
            experts = model.experts
            experts.begin_request()
            experts.set_phase("decode")
            suffix = f"-stream{n}" if n else ""
            results["cache" + suffix] = time_calls(experts.forward, calls, args.repeat)
            if args.split:
                results["split" + suffix], to_cpu = time_split(experts, calls, args.repeat)
                if to_cpu is not None:
                    to_cpu_start["split" + suffix] = to_cpu
            experts.close()
    document = {
        "machine": platform.processor() or platform.machine(), "threads":
        torch.get_num_threads(), "torch": torch.__version__,
        "date": datetime.date.today().isoformat(), "experts": args.experts,
        "dtype": args.dtype, "experts_dtype": args.experts_dtype,
        "top_k": args.top_k, "us_per_call": results,
        "over_resident": {name: us / results["resident"] for name, us in results.items()},
        "us_to_cpu_start": to_cpu_start,
    }
    if args.json:
        print(json.dumps(document))
        return 0
    print(f"host share of a decode layer call (E={args.experts}, K={args.top_k}, D=64, F=32, a "
          f"quarter of the experts cached, {args.dtype}, experts {args.experts_dtype}), "
          f"{document['machine']}, {document['threads']} "
          f"threads; the least of {args.repeat} passes of {args.calls} calls")
    print(f"{'path':<16}{'us/call':>10}{'x resident':>12}{'us to CPU start':>17}")
    for name, us in results.items():
        to_cpu = f"{to_cpu_start[name]:>17.1f}" if name in to_cpu_start else ""
        print(f"{name:<16}{us:>10.1f}{document['over_resident'][name]:>12.2f}{to_cpu}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
