"""What a decode round's sampling costs on the device, and which of its parts.

`strata generate`'s default sampling (temperature 0.8, top-p 0.95) cost 0.097 ms a round over
greedy on the H200's olmoe-1b-7b decode (bench/results/decode-fusions-h200-2026-12-02.md):
8% of a 1.09 ms round, the gap between its 46.5% of the bandwidth bound and greedy's 50.9%.
This times `Sampler.pick` over one row of logits [V] (fp32, as the model returns them) for
each setting, and the parts of the default one alone:

- `pick <setting>`: the whole pick, eager, as the decode loop launches it;
- `pick <setting> graph`: the same captured once in a CUDA graph and replayed (CUDA only):
  the kernels' own time, without the host's launches;
- `sort stable` / `sort`: the descending sort of the V logits with their ids, stable (what
  pick runs) and not;
- `sort bf16 stable`: the same over the logits as bf16 (half the key bits: half the radix
  passes);
- `after the sort`: softmax, the cumulative sums, top-p's mask and the search over V sorted
  values, alone;
- `topk 1024`: the 1,024 largest with their ids, the other way to find top-p's candidates.

Each is the median over `--repeat` timed batches of `--calls` back-to-back calls, on CUDA
events (the host's clock off CUDA); the logits are N(0, `--logit-std`) with a seeded
generator. Absolute times only from the GPU machine.

    python bench/sampling.py --vocab 50304             # on the GPU machine
    python bench/sampling.py --device cpu --vocab 4096 --repeat 2 --calls 4   # the host twin
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from strata.engine.runtime.decode_steps import capture_graph
from strata.engine.runtime.sampling import Sampler

SETTINGS = {
    "greedy": {"temperature": 0.0},
    "cli-default": {"temperature": 0.8, "top_p": 0.95},
    "temperature": {"temperature": 0.8},
    "top-k-50": {"temperature": 0.8, "top_k": 50},
}


def time_ms(fn: Callable[[], object], device: torch.device, calls: int, repeat: int) -> float:
    """The median over `repeat` batches of one call's ms, a batch `calls` calls in a row."""
    fn()  # warm: kernels loaded, allocator primed
    samples = []
    for _ in range(repeat):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / calls)
        else:
            begin = time.perf_counter()
            for _ in range(calls):
                fn()
            samples.append((time.perf_counter() - begin) * 1e3 / calls)
    return statistics.median(samples)


def after_the_sort(values: torch.Tensor, top_p: float, u: float) -> torch.Tensor:
    """`Sampler.pick`'s work over values already sorted (descending): its index."""
    probs = torch.softmax(values, dim=0)
    cumulative = torch.cumsum(probs, dim=0)
    keep = (cumulative - probs) < top_p
    probs = probs * keep
    cumulative = torch.cumsum(probs, dim=0)
    return torch.searchsorted(cumulative, cumulative[-1:] * u, right=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--vocab", type=int, default=50304, help="V (olmoe's: 50,304)")
    parser.add_argument("--logit-std", type=float, default=3.0)
    parser.add_argument("--calls", type=int, default=100, help="calls a timed batch")
    parser.add_argument("--repeat", type=int, default=7, help="timed batches (the median)")
    args = parser.parse_args(argv)
    if args.vocab < 2 or args.calls < 1 or args.repeat < 1:
        parser.error("--vocab must be >= 2, --calls and --repeat >= 1")
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(args.vocab, generator=gen) * args.logit_std).to(device)  # [V]
    u = 0.37
    rows: dict[str, float] = {}

    def timed(name: str, fn: Callable[[], object]) -> None:
        rows[name] = time_ms(fn, device, args.calls, args.repeat)

    for name, options in SETTINGS.items():
        sampler = Sampler(**options)
        draw = None if sampler.greedy else u
        timed(f"pick {name}", lambda s=sampler, d=draw: s.pick(logits, d))
        if device.type == "cuda":
            graph, _ = capture_graph(lambda s=sampler, d=draw: s.pick(logits, d), device, None)
            timed(f"pick {name} graph", graph.replay)
    scaled = logits / 0.8
    timed("sort stable", lambda: torch.sort(scaled, descending=True, stable=True))
    timed("sort", lambda: torch.sort(scaled, descending=True))
    as_bf16 = scaled.to(torch.bfloat16)
    timed("sort bf16 stable", lambda: torch.sort(as_bf16, descending=True, stable=True))
    values = torch.sort(scaled, descending=True, stable=True).values
    timed("after the sort", lambda: after_the_sort(values, 0.95, u))
    timed("topk 1024", lambda: torch.topk(scaled, min(1024, args.vocab)))
    greedy = rows["pick greedy"]
    report = {"bench": "bench/sampling.py", "device": str(device),
              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
              else None, "vocab": args.vocab, "calls": args.calls, "repeat": args.repeat,
              "ms": rows}
    print(json.dumps(report))
    width = max(map(len, rows))
    for name, ms in rows.items():
        print(f"{name:<{width}}  {ms * 1e3:9.1f} us  ({ms / greedy:5.1f}x greedy's pick)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
