"""The decode router's kernel (`ops.router_route`) against the product then `route`: a sweep of
its launch shape on each preset's router.

For each preset's router (E experts x D hidden, bf16) and one token, the microseconds of one
call replayed from a CUDA graph of `--calls` calls (so launch gaps are as in a decode graph):
- `linear+route`: `F.linear` then `route`'s kernel, the path before `router_route`;
- `router_route s=S bd=B w=W`: the kernel split S ways over D, B columns a tile, W warps;
  `default` is the launch shape `router_route` picks.
Each run's ids are checked against the reference's. It needs CUDA.

    python bench/router_route.py                     # on the GPU machine, about 30 s
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import time

import torch
import torch.nn.functional as F

from strata.engine.model import ops
from strata.engine.model.presets import get_preset


def linear_route(x: torch.Tensor, router: torch.Tensor, top_k: int):
    """The path before `router_route`: the product, then `route`'s kernel."""
    return ops.route(F.linear(x, router), top_k, True)


def graph_us(fn, calls: int, replays: int) -> float:
    """Microseconds a call of fn() takes, replayed from a CUDA graph of `calls` calls."""
    fn()  # eager first: the kernels compiled, the router's arrival count made
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) * 1000 / (calls * replays)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="olmoe-1b-7b,qwen3-30b-a3b,mixtral-8x7b")
    parser.add_argument("--calls", type=int, default=64)
    parser.add_argument("--replays", type=int, default=20)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/router_route.py: needs CUDA (the kernels' launch shapes are timed)")
        return 1
    device = torch.device("cuda")
    report = {"device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "shapes": []}
    gen = torch.Generator().manual_seed(0)
    for name in args.presets.split(","):
        preset = get_preset(name)
        d, e, k = preset.hidden_size, preset.n_experts, preset.top_k
        x = torch.randn(1, d, generator=gen).to(torch.bfloat16).to(device)
        router = (torch.randn(e, d, generator=gen) * d ** -0.5).to(torch.bfloat16).to(device)
        reference = ops.route(F.linear(x, router), k, True)
        runs = {"linear+route": functools.partial(linear_route, x, router, k),
                "default": functools.partial(ops.router_route_triton, x, router, k, True)}
        for splits, block_d, warps in itertools.product((8, 16, 32, 64), (32, 64, 128),
                                                        (1, 2, 4)):
            runs[f"router_route s={splits} bd={block_d} w={warps}"] = functools.partial(
                ops.router_route_triton, x, router, k, True, splits=splits, block_d=block_d,
                num_warps=warps)
        row = {"preset": name, "experts": e, "hidden": d, "top_k": k, "us": {}, "agree": {}}
        for label, fn in runs.items():
            row["agree"][label] = bool(torch.equal(fn()[0], reference[0]))
            row["us"][label] = graph_us(fn, args.calls, args.replays)
        best = min((us, label) for label, us in row["us"].items())
        print(f"bench/router_route.py: {name}: linear+route {row['us']['linear+route']:.2f} us, "
              f"default {row['us']['default']:.2f}, best {best[1]} {best[0]:.2f}; ids agree: "
              f"{sum(row['agree'].values())} of {len(runs)}", flush=True)
        report["shapes"].append(row)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
