"""A decode step's attention: `decode_attention`'s kernel against the fused SDPA it replaces.

For each preset's heads (q [1, H, Dh] over G kv heads) and each attended length N (a decode
graph's window), bf16, the mask a decode graph builds (cells after the position -inf): the
microseconds of one call replayed from a CUDA graph of `--layers` calls, each over its own
layer's cells (laid out as the K/V's, [N, G, Dh] a layer), so that the cells come from memory
and not from the L2 cache, as in a decode round; and the share of the device's bandwidth that
is (the K/V bytes read over the time, against `--bandwidth-tb-s`):
- `sdpa`: `F.scaled_dot_product_attention` over the R query heads folded per kv head, the
  layer's path before the kernel (`Attention._folded`);
- `kernel s=S b=B w=W`: the kernel, S cells a program, B at a time, W warps;
- `capped m=M w=W`: the kernel at 128 cells a program up to 1,024 cells, 256 past that
  (`launch_shape` before its cap), doubled until at most
  M programs read a kv head's cells, W warps;
- `at once m=M w=W`: the same, merging its partials as reductions, 4 splits at a time (the
  second sweep's rows `at once s=S m=M w=W`; S made no difference);
- `default`: `attend_one_triton` at `launch_shape`'s choice (what the layer runs where
  `decode_attention.takes`; the first sweep's `default` was 128 cells, 64, 4 warps at every
  shape).
Each variant's output is checked against a float32 reference. It needs CUDA.

    python bench/decode_attention.py                 # on the GPU machine, about two minutes
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from router_route import graph_us
from strata.engine.model import decode_attention
from strata.engine.model.layers import Attention, attention_mask
from strata.engine.model.presets import get_preset

L2_BYTES = 64 << 20  # more than the H200's L2: the layers' cells together are larger


def heads(name: str) -> tuple[int, int, int]:
    """A preset's (H, G, Dh)."""
    p = get_preset(name)
    return p.n_heads, p.n_kv_heads, p.head_dim


def layers_for(n_cells: int, n_kv_heads: int, head_dim: int, cap: int) -> int:
    """How many layers' cells a graph cycles through: together at least 4x L2_BYTES."""
    layer_bytes = 2 * n_cells * n_kv_heads * head_dim * 2
    return max(2, min(cap, -(-4 * L2_BYTES // layer_bytes)))


def variants(q, keys: list, values: list, mask, scale: float) -> dict:
    """label -> a function of the layer i: its attention over layer i's cells."""
    folded = SimpleNamespace(n_kv_heads=keys[0].shape[0], scale=scale)  # what `_folded` reads
    split_cells, warps = decode_attention.launch_shape(keys[0].shape[1],
                                                       q.shape[1] // keys[0].shape[0])
    out = {"sdpa": lambda i: Attention._folded(folded, q, keys[i], values[i], mask),
           "default": lambda i: decode_attention.attend_one_triton(
               q, keys[i], values[i], mask, scale, split_cells=split_cells, num_warps=warps)}
    for split, block, warps in itertools.product((64, 128, 256), (32, 64), (4, 8)):
        out[f"kernel s={split} b={block} w={warps}"] = functools.partial(
            lambda i, s, b, w: decode_attention.attend_one_triton(
                q, keys[i], values[i], mask, scale, split_cells=s, block_cells=b, num_warps=w),
            s=split, b=block, w=warps)
    base_cells = 128 if keys[0].shape[1] <= 1024 else 256
    for most, warps, merge in itertools.product((8, 16, 32), (4, 8), (0, 4)):
        label = "at once" if merge else "capped"
        out[f"{label} m={most} w={warps}"] = functools.partial(
            lambda i, m, w, ms: decode_attention.attend_one_triton(
                q, keys[i], values[i], mask, scale, split_cells=base_cells, num_warps=w,
                max_splits=m, merge_splits=ms), m=most, w=warps, ms=merge)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="olmoe-1b-7b,qwen3-30b-a3b,mixtral-8x7b")
    parser.add_argument("--cells", default="256,1024,4096,16384")
    parser.add_argument("--layers", type=int, default=256,
                        help="the most layers a graph cycles through")
    parser.add_argument("--replays", type=int, default=10)
    parser.add_argument("--bandwidth-tb-s", type=float, default=4.3,
                        help="the device's memory bandwidth, for the share (H200: 4.3)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/decode_attention.py: needs CUDA (the kernel's launch shapes are timed)")
        return 1
    device = torch.device("cuda")
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "bandwidth_tb_s": args.bandwidth_tb_s,
              "shapes": []}
    gen = torch.Generator(device).manual_seed(0)
    dtype = torch.bfloat16
    for preset, n_cells in itertools.product(args.presets.split(","),
                                             (int(c) for c in args.cells.split(","))):
        n_heads, n_kv_heads, head_dim = heads(preset)
        n_layers = layers_for(n_cells, n_kv_heads, head_dim, args.layers)
        scale = head_dim**-0.5
        # Each layer's cells [N, G, Dh], read as [G, N, Dh] views, as `LayerCells.read` gives.
        k_cells = torch.randn(n_layers, n_cells, n_kv_heads, head_dim, generator=gen,
                              device=device).to(dtype)
        v_cells = torch.randn(n_layers, n_cells, n_kv_heads, head_dim, generator=gen,
                              device=device).to(dtype)
        q = torch.randn(1, n_heads, head_dim, generator=gen, device=device).to(dtype)
        position = torch.tensor([n_cells - 100], device=device)  # a window's later cells empty
        mask = attention_mask(position, n_cells, None, dtype)  # [1, N]
        keys = [k_cells[i].transpose(0, 1) for i in range(n_layers)]  # [G, N, Dh] each
        values = [v_cells[i].transpose(0, 1) for i in range(n_layers)]
        r = n_heads // n_kv_heads
        exact = F.scaled_dot_product_attention(
            q.float().transpose(0, 1), keys[0].float().repeat_interleave(r, 0),
            values[0].float().repeat_interleave(r, 0), attn_mask=mask.float(),
            scale=scale).reshape(1, -1)  # [1, H*Dh]
        calls = variants(q, keys, values, mask, scale)
        row = {"preset": preset, "cells": n_cells, "heads": [n_heads, n_kv_heads, head_dim],
               "layers": n_layers, "us": {}, "error": {}}
        for label, fn in calls.items():
            row["error"][label] = ((fn(0).float() - exact).abs().max()
                                   / exact.abs().max()).item()
            # One layer after another, round and round: the graph's calls cover them all.
            layers = itertools.cycle(range(n_layers))
            row["us"][label] = graph_us(lambda fn=fn, layers=layers: fn(next(layers)),
                                        n_layers, args.replays)
        kv_bytes = 2 * n_cells * n_kv_heads * head_dim * 2
        row["share"] = {label: kv_bytes / (us * 1e-6) / (args.bandwidth_tb_s * 1e12)
                        for label, us in row["us"].items()}
        best = min((us, label) for label, us in row["us"].items())
        print(f"bench/decode_attention.py: {preset} N={n_cells}: sdpa {row['us']['sdpa']:.2f} us "
              f"({row['share']['sdpa']:.0%}), default {row['us']['default']:.2f} "
              f"({row['share']['default']:.0%}), best {best[1]} {best[0]:.2f}; worst error "
              f"{max(row['error'].values()):.1e}", flush=True)
        report["shapes"].append(row)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
