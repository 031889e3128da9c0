"""The decode round's kernels' launch shapes timed where they run: inside a whole decode round.

`grouped.expert_sum_triton` (gate_up_act, then down with the weighted sum) has its block
sizes, warps and pipeline depths as module constants, once chosen by bench/grouped_experts.py,
which replays one layer's call on its own. A round reads each weight once, between other
kernels, launched as dependents: this sweep sets each variant's constants and captures the
default decode step's CUDA graph with them, every variant's first, then times all the graphs'
replays side by side (`_common.side_by_side`: `--repeat` sweeps in alternating order, each
timed round after one of its own, each variant against the default's round of the same sweep,
with the quartiles over the sweeps), so that a drift of the machine falls on every variant
alike and the quartiles say which differences are the variant's. One kernel's
shape moves at a time from the default: the gate_up kernel's (block F x step D, warps,
stages), then down's (block D x step F, warps, stages), then the dense products' kernel's
(`products`: weight elements a program, warps; "cuBLAS" is `F.linear` in its place), q/k/v's
product with the layer's norm inside its kernel at some weight elements a program, or after
`add_rms_norm` (`norm_product`), attention's output product with the MoE's norm and routing
inside its kernel at some weight elements a program and parts of the logits, or before
`add_norm_router_route` (`product_route`), then the logits' product by that kernel (the
default since bench/results/profile-control-h100-2026-12-06.md) or by cuBLAS (`logits`), the
router's splits of D (`router`), a short window's attention split and merged or in one
program a kv head (the default since bench/results/decode-shapes-short-h100-2026-12-05.md),
the rotation folded in or not, at some warps (`attention`), and the experts' and the
products' weight loads marked evict_first for L2 or not (`hints`: `strata.engine.cache_hints`,
on since bench/results/l2-ahead-h100-2026-12-06.md). Timed here too and taken out: the next layer's
q/k/v weight asked into L2 from the short attention's or the router's kernel, gate_up and down
as one kernel (bench/results/one-kernel-ahead-h100-2026-12-06.md), the router's first weights
and down's index and first tile read before the kernel's wait
(bench/results/profile-control-h100-2026-12-06.md).

    python bench/decode_shapes.py --model /tmp/strata-olmoe-1b-7b --json out.json   # the GPU
    python bench/decode_shapes.py --preset qwen3-30b-a3b --layers 4 --kernels products
"""

from __future__ import annotations

import argparse
import datetime
import json
import tempfile
from pathlib import Path

import torch

from _common import add_model_arguments, checkpoint_for, side_by_side
from strata.engine import cache_hints
from strata.engine.experts import grouped
from strata.engine.model import decode_attention, products, routing_ops
from strata.engine.runtime.decode_steps import decode_step
from strata.engine.runtime.engine import Engine

DEFAULT = {"gate_up": (grouped.GATE_UP_BLOCK_F, grouped.GATE_UP_BLOCK_D, grouped.NUM_WARPS[0],
                       grouped.NUM_STAGES[0]),
           "down": (grouped.DOWN_BLOCK_D, grouped.DOWN_BLOCK_F, grouped.NUM_WARPS[1],
                    grouped.NUM_STAGES[1]),
           "products": (products.TILE_ELEMENTS, products.NUM_WARPS),
           "norm_product": (products.NORM_PRODUCT_KERNEL, products.NORM_TILE_ELEMENTS),
           "product_route": (products.PRODUCT_ROUTE_KERNEL, products.ROUTE_TILE_ELEMENTS,
                             products.ROUTE_PARTS),
           "logits": (products.LOGITS_KERNEL,),
           "router": (routing_ops.ROUTER_SPLITS,),
           "attention": (decode_attention.SHORT_KERNEL, decode_attention.SHORT_ROTATES,
                         decode_attention.SHORT_WARPS),
           "hints": (cache_hints.EXPERTS_EVICT_FIRST, cache_hints.PRODUCTS_EVICT_FIRST)}
CUBLAS = (0, 0)  # the products' "shape" that is F.linear in the kernel's place
# (block, step, warps, stages) tried for each kernel, the other kept at its default.
TRIED = {
    "gate_up": [(block, step, warps, stages)
                for block, step in ((32, 128), (16, 256), (64, 64), (32, 256))
                for warps in (4, 8) for stages in (1, 3, 4)],
    "down": [(block, step, warps, stages)
             for block, step in ((32, 128), (16, 256), (64, 128), (32, 256), (16, 128))
             for warps in (4, 8) for stages in (1, 3, 4)],
    "products": [CUBLAS] + [(tile, warps) for tile in (2048, 4096, 8192, 16384)
                            for warps in (2, 4, 8)],
    # q/k/v's product with the norm before it in its kernel, at these weight elements a
    # program (its warps the norm's), or (False) `add_rms_norm`, then the products' kernel
    "norm_product": [(False, products.NORM_TILE_ELEMENTS)]
    + [(True, tile) for tile in (2048, 4096, 8192, 16384, 32768)],
    # attention's output product with the MoE's norm and routing in its kernel at these
    # weight elements and parts of the logits at most, or (False) the product, then
    # `add_norm_router_route`
    "product_route": [(False, products.ROUTE_TILE_ELEMENTS, products.ROUTE_PARTS)]
    + [(True, tile, parts) for tile in (4096, 16384, 32768) for parts in (8192, 16384, 32768)],
    "logits": [(False,), (True,)],  # the logits' product by cuBLAS, or by the kernel
    "router": [(splits,) for splits in (16, 32, 64)],
    "attention": [(False, False, decode_attention.SHORT_WARPS)]
    + [(True, rotates, warps) for rotates in (False, True) for warps in (4, 8, 16)],
    # (the experts' weight loads marked evict_first, the products')
    "hints": [(experts, products_too) for experts in (False, True)
              for products_too in (False, True)],
}


def variants(kernels: tuple[str, ...] = tuple(TRIED)) -> list[dict]:
    """Every variant of `kernels`' shapes once, the default first: {"gate_up": (...), "down":
    (...)}."""
    out = [dict(DEFAULT)]
    for kernel in kernels:
        shapes = TRIED[kernel]
        out += [{**DEFAULT, kernel: shape} for shape in shapes if shape != DEFAULT[kernel]]
    return out


def apply(variant: dict, experts, hidden_size: int, device: torch.device) -> None:
    """Set the kernels' constants to `variant` (grouped's, products', the router's, the
    decode attention's, `cache_hints`'), with a `down` arrival counter that fits it."""
    (grouped.GATE_UP_BLOCK_F, grouped.GATE_UP_BLOCK_D, up_warps, up_stages) = variant["gate_up"]
    (grouped.DOWN_BLOCK_D, grouped.DOWN_BLOCK_F, down_warps, down_stages) = variant["down"]
    grouped.NUM_WARPS = (up_warps, down_warps)
    grouped.NUM_STAGES = (up_stages, down_stages)
    products.PRODUCT_KERNEL = variant["products"] != CUBLAS
    if products.PRODUCT_KERNEL:
        products.TILE_ELEMENTS, products.NUM_WARPS = variant["products"]
    products.NORM_PRODUCT_KERNEL, products.NORM_TILE_ELEMENTS = variant["norm_product"]
    (products.PRODUCT_ROUTE_KERNEL, products.ROUTE_TILE_ELEMENTS,
     products.ROUTE_PARTS) = variant["product_route"]
    (products.LOGITS_KERNEL,) = variant["logits"]
    (routing_ops.ROUTER_SPLITS,) = variant["router"]
    (decode_attention.SHORT_KERNEL, decode_attention.SHORT_ROTATES,
     decode_attention.SHORT_WARPS) = variant["attention"]
    cache_hints.EXPERTS_EVICT_FIRST, cache_hints.PRODUCTS_EVICT_FIRST = variant["hints"]
    experts._sum_arrivals = grouped.sum_arrivals(hidden_size, device)


def captured_round(model, kv, position: int):
    """(a decode round replayed from a graph captured now, with the kernels' constants as they
    are, as a function; its logits [V])."""
    step = decode_step(model, kv, None, cuda_graphs=True, piecewise_graphs=False,
                       compile=False)
    step.prepare(1, position, position)
    logits = step(1, position).float().clone()
    return (lambda: step(1, position)), logits


def label(variant: dict) -> str:
    parts = ["{} {}x{} w{} s{}".format(kernel, *variant[kernel])
             for kernel in ("gate_up", "down")]
    shape = variant["products"]
    parts.append("products cuBLAS" if shape == CUBLAS else "products {} w{}".format(*shape))
    fused, tile = variant["norm_product"]
    parts.append(f"norm in q/k/v's product {tile}" if fused else "norm then q/k/v's product")
    fused, tile, route_parts = variant["product_route"]
    parts.append(f"output product routing {tile} p{route_parts}" if fused
                 else "output product then routing")
    if not variant["logits"][0]:
        parts.append("logits by cuBLAS")
    parts.append("router s{}".format(*variant["router"]))
    short, rotates, warps = variant["attention"]
    parts.append((f"attention short{' rotating' if rotates else ''} w{warps}") if short
                 else "attention split")
    experts, products_too = variant["hints"]
    marked = ["experts"] * experts + ["products"] * products_too
    parts.append(f"{' and '.join(marked)} evict_first" if marked else "no evict_first")
    return " / ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(parser, preset="olmoe-1b-7b")
    parser.add_argument("--model", help="a checkpoint directory to use instead of writing one")
    parser.add_argument("--position", type=int, default=64, help="the decode round's cell")
    parser.add_argument("--repeat", type=int, default=30,
                        help="sweeps over every variant's round (default 30)")
    parser.add_argument("--kernels", default=",".join(TRIED),
                        help=f"comma-separated kernels whose shapes to sweep (default "
                        f"{','.join(TRIED)})")
    parser.add_argument("--json", metavar="FILE", help="also write every figure to FILE")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat takes a count >= 1, got {args.repeat}")
    kernels = tuple(k for k in args.kernels.split(",") if k)
    if not set(kernels) <= set(TRIED):
        parser.error(f"--kernels takes {', '.join(TRIED)}, got {args.kernels}")
    device = torch.device(args.device)
    if device.type != "cuda" or grouped.copies_weights(device):
        print("bench/decode_shapes.py: needs CUDA with Triton (the kernels' shapes are timed)")
        return 0
    tried = variants(kernels)
    rounds, rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = checkpoint_for(args, Path(tmp), torch.bfloat16)
        with Engine.open(ckpt, device=device, dtype=torch.bfloat16,
                         max_context=args.position + 1) as engine:
            model, kv = engine.model, engine.kv
            hidden_size = model.config.hidden_size
            # Every variant's graph captured first, then all timed side by side. Each graph
            # holds its own arrival counter (`apply` makes one a variant), kept alive here.
            counters, reference = [], None
            try:
                for variant in tried:
                    apply(variant, model.experts, hidden_size, device)
                    round_of, logits = captured_round(model, kv, args.position)
                    rounds.append(round_of)
                    counters.append(model.experts._sum_arrivals)
                    reference = logits if reference is None else reference
                    rows.append({"variant": label(variant),
                                 "max_logit_diff": (logits - reference).abs().max().item()})
                figures = side_by_side(rounds, device, args.repeat)
            finally:
                apply(DEFAULT, model.experts, hidden_size, device)
    for row, got in zip(rows, figures, strict=True):
        row.update(round_ms=got["ms"], x_default=got["x_default"],
                   x_default_q=got["x_default_q"])
    default_ms = rows[0]["round_ms"]
    rows.sort(key=lambda row: -row["x_default"])
    for row in rows[:25]:
        low, high = row["x_default_q"]
        print(f"{row['variant']:<100} {row['round_ms']:.4f} ms  {row['x_default']:.3f}x "
              f"({low:.3f}-{high:.3f})  logits {row['max_logit_diff']:.2e}")
    meta = {"model": args.model or args.preset, "layers": model.config.n_layers,
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "date": datetime.date.today().isoformat(), "position": args.position,
            "default": label(DEFAULT), "default_ms": default_ms}
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
