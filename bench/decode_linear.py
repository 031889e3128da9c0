"""A decode step's dense products by `ops.linear`'s kernel against `F.linear`: a sweep of the
kernel's launch shape on each preset's matrices.

For each preset's q/k/v product (H + 2G heads of Dh x D), output product (D x H Dh) and logits
(V x D), bf16, one token: the microseconds of one call replayed from a CUDA graph of
`--calls` calls (launch gaps as in a decode graph), and the share of the device's bandwidth
that is (the weight's bytes over the time, against `--bandwidth-tb-s`):
- `F.linear`: cuBLAS, the path before `ops.linear`;
- `linear bn=N bk=K w=W`: the kernel, N rows a program, K columns a step, W warps; `default`
  is the launch shape `ops.linear` picks.
Each variant's output is checked against a float32 product rounded once. It needs CUDA.

    python bench/decode_linear.py                    # on the GPU machine, about a minute
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import time

import torch
import torch.nn.functional as F

from router_route import graph_us
from strata.engine.model import ops
from strata.engine.model.presets import get_preset


def matrices(name: str) -> dict[str, tuple[int, int]]:
    """A preset's decode products, name -> (N, K) of the weight."""
    p = get_preset(name)
    return {"qkv": ((p.n_heads + 2 * p.n_kv_heads) * p.head_dim, p.hidden_size),
            "o": (p.hidden_size, p.n_heads * p.head_dim),
            "logits": (p.vocab_size, p.hidden_size)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="olmoe-1b-7b,qwen3-30b-a3b,mixtral-8x7b")
    parser.add_argument("--calls", type=int, default=64)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--bandwidth-tb-s", type=float, default=4.3,
                        help="the device's memory bandwidth, for the share (H200: 4.3)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/decode_linear.py: needs CUDA (the kernels' launch shapes are timed)")
        return 1
    device = torch.device("cuda")
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "bandwidth_tb_s": args.bandwidth_tb_s,
              "shapes": []}
    gen = torch.Generator(device).manual_seed(0)
    for preset in args.presets.split(","):
        for part, (n, k) in matrices(preset).items():
            x = torch.randn(1, k, generator=gen, device=device).to(torch.bfloat16)
            weight = (torch.randn(n, k, generator=gen, device=device) * k ** -0.5).to(
                torch.bfloat16)
            reference = F.linear(x.float(), weight.float()).to(torch.bfloat16)
            scale = reference.float().abs().max()
            runs = {"F.linear": functools.partial(F.linear, x, weight),
                    "default": functools.partial(ops.linear_triton, x, weight)}
            for block_n, block_k, warps in itertools.product((8, 16, 32, 64), (64, 128, 256, 512),
                                                             (2, 4, 8)):
                runs[f"linear bn={block_n} bk={block_k} w={warps}"] = functools.partial(
                    ops.linear_triton, x, weight, block_n=block_n, block_k=block_k,
                    num_warps=warps)
            row = {"preset": preset, "part": part, "n": n, "k": k, "us": {}, "error": {}}
            for label, fn in runs.items():
                row["error"][label] = ((fn().float() - reference.float()).abs().max()
                                       / scale).item()
                row["us"][label] = graph_us(fn, args.calls, args.replays)
            weight_bytes = weight.numel() * weight.element_size()
            row["share"] = {label: weight_bytes / (us * 1e-6) / (args.bandwidth_tb_s * 1e12)
                            for label, us in row["us"].items()}
            best = min((us, label) for label, us in row["us"].items())
            print(f"bench/decode_linear.py: {preset} {part} [{n} x {k}]: F.linear "
                  f"{row['us']['F.linear']:.2f} us ({row['share']['F.linear']:.0%}), default "
                  f"{row['us']['default']:.2f} ({row['share']['default']:.0%}), best {best[1]} "
                  f"{best[0]:.2f}; worst error {max(row['error'].values()):.1e}", flush=True)
            report["shapes"].append(row)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
