"""What `--stream-misses auto`'s rates are made of: every timed call, not only the kept medians.

`strata.engine.cache.rates.measure_rates` keeps, for each k, the median of its timed rounds, and
makes each side's table non-decreasing in k: one slow median at a small k then sets every larger
k's figure. This script runs the same calls (`rate_calls.TimedCalls`, `rate_calls.samples`) on
a preset's expert shape and prints, per k, each side's samples round by round, the median,
the kept (non-decreasing) figure and the rate it gives, then the split; with `--json-out`, the
samples as JSON too. Where a median is slow, the rounds show whether every round is slow at
that k (a cost of the call's place in the round, e.g. the first call of a kind after the other
kind) or one round is (noise). On the H200 it showed the first: k = 1 on the CPU took 1.2-3.6
ms where k = 2 took 0.5, the engine thread's OpenMP pool made again after the split calls had
shrunk it, until each round grew it untimed first (bench/results/rates-probe-h200-2026-12-04.txt
and rates-probe-grown-h200-2026-12-04.txt).

    python bench/rates_probe.py --preset qwen3-30b-a3b --repeat 7
    python bench/rates_probe.py --preset qwen3-30b-a3b --experts-dtype int8
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from strata.engine.cache.rate_calls import TimedCalls, samples, synthetic_store
from strata.engine.cache.rates import REPEAT, TARGET_BYTES, MissRates, RatesKey, _grid, _table
from strata.engine.experts.quant import experts_quant_for
from strata.engine.model.presets import get_preset


def probe(preset: str, dtype: torch.dtype, device: torch.device, repeat: int,
          threads: int | None, quant: str | None = None) -> dict:
    """Every sample of `measure_rates`' calls on `preset`'s expert shape, the experts in
    `quant`'s format (None: `dtype`'s), and what it keeps."""
    key = RatesKey.of(get_preset(preset), dtype, device, threads, quant)  # its D, F and K
    store = synthetic_store(key.hidden_size, key.expert_width, key.top_k, dtype,
                            device.type == "cuda", TARGET_BYTES, quant)
    calls = TimedCalls(store, key.top_k, device, threads)
    stream_t, cpu_t, joint_t, staged_t = samples(calls, key.top_k, repeat)
    rates = MissRates(_table(stream_t), _table(cpu_t), key.blob_bytes, joint_s=_grid(joint_t),
                      staged_s=_grid(staged_t))
    return {
        "preset": preset, "key": key.text(), "repeat": repeat, "blob_bytes": key.blob_bytes,
        "stream_ms": [[round(t * 1e3, 4) for t in row] for row in stream_t[1:]],
        "cpu_ms": [[round(t * 1e3, 4) for t in row] for row in cpu_t[1:]],
        "kept_stream_ms": [round(t * 1e3, 4) for t in rates.stream_s[1:]],
        "kept_cpu_ms": [round(t * 1e3, 4) for t in rates.cpu_s[1:]],
        "stream_gbps": round(rates.stream_bytes_per_s / 1e9, 1),
        "cpu_gbps": round(rates.cpu_bytes_per_s / 1e9, 1),
        "split": rates.split().text(),
    }


def print_table(result: dict) -> None:
    print(f"bench/rates_probe.py: {result['preset']}, {result['key']}, "
          f"{result['repeat']} timed rounds")
    print("k  side    median   kept  | each round's ms")
    for k, (stream, cpu) in enumerate(zip(result["stream_ms"], result["cpu_ms"],
                                                    strict=True), start=1):
        for side, row, kept in (("stream", stream, result["kept_stream_ms"][k - 1]),
                                ("cpu", cpu, result["kept_cpu_ms"][k - 1])):
            print(f"{k}  {side:6s} {statistics.median(row):7.3f} {kept:7.3f} | "
                  + " ".join(f"{t:.3f}" for t in row))
    print(f"rates at K: stream {result['stream_gbps']} GB/s, cpu {result['cpu_gbps']} GB/s; "
          f"split {result['split']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-30b-a3b,olmoe-1b-7b",
                        help="comma-separated presets")
    parser.add_argument("--dtype", default="bf16", choices=["bf16"])
    parser.add_argument("--experts-dtype", default="auto", choices=["auto", "int8", "int4"],
                        help="the experts' format, as strata generate's flag (auto: bf16)")
    parser.add_argument("--repeat", type=int, default=REPEAT)
    parser.add_argument("--threads", type=int, default=None, help="the CPU experts' threads")
    parser.add_argument("--device", default=None, help="default: cuda where there is one")
    parser.add_argument("--json-out", default=None,
                        help="also write one JSON object a preset, a line each, to this file")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    quant = experts_quant_for(args.experts_dtype, torch.bfloat16)
    results = []
    for preset in args.preset.split(","):
        results.append(probe(preset, torch.bfloat16, device, args.repeat, args.threads, quant))
        print_table(results[-1])
        sys.stdout.flush()
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.writelines(json.dumps(result) + "\n" for result in results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
