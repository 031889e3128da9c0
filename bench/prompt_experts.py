"""Where a prompt chunk's experts spend their time: the grouped products' steps, one by one.

A prompt chunk on a Hopper GPU runs its routed experts as two grouped matrix products over the
rows sorted by expert (`strata.engine.experts.sorted_grouped.sorted_grouped_sum`). Around the
two products are the steps that move rows: the sort by expert, the gather of each row's input,
the activation, the positions, the weighted sum. This times each step alone on one layer of
random weights and random top-k routing (CUDA events, median of `--repeat` calls after a
warm-up), the whole call, and, side by side, the activation as one kernel
(`strata.engine.experts.activation.silu_and_mul`) against torch's `F.silu(gate) * up`, the two
kernels it replaced. The products' share is their FLOPs (2 * R * 3 * F * D, R = T * K rows)
against `--matmul-tflops` (default the device's: 790 on an H200, its measured bf16 rate,
else measured in the run: `_common.device_rates`), as bench/decode.py prints it.

With `--experts-dtype int8,int4-g32` the same layer's experts are quantized too and each format's
resident prompt call (`ResidentExperts.forward`) is timed two ways: the grouped products a
batch of dequantized blobs at a time (`BlobStack.grouped_rows`, the default) and the loop over
the experts (`grouped_prefill=False`, the path before), beside bf16's whole call.

    python bench/prompt_experts.py                        # CUDA (sm90+) only
    python bench/prompt_experts.py --tokens 4096,16384 --json-out prompt-experts.json
    python bench/prompt_experts.py --shapes qwen3-30b-a3b --experts-dtype int8,int4-g32
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys

import torch
import torch.nn.functional as F

from _common import device_rates
from strata.engine.experts import ExpertStore, ResidentExperts
from strata.engine.experts.activation import silu_and_mul
from strata.engine.experts.combine import weighted_sum
from strata.engine.experts.quant import WEIGHT_FORMATS, make_blob
from strata.engine.experts.sorted_grouped import available, expert_runs, sorted_grouped_sum
from strata.engine.model.presets import get_preset

SHAPES = ("olmoe-1b-7b", "qwen3-30b-a3b", "mixtral-8x7b")


def timed(fn, repeat: int) -> float:
    """Median ms of `fn()` over `repeat` calls, each between two CUDA events, after one
    warm-up call."""
    fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def quantized_ms(blobs: torch.Tensor, fmt: str, f: int, d: int, x: torch.Tensor,
                 ids: torch.Tensor, weights: torch.Tensor, repeat: int) -> dict:
    """ms of one resident prompt call over the layer `blobs` [E, 3FD] bf16 quantized to `fmt`:
    "grouped" (the default path) and "loop" (`grouped_prefill=False`)."""
    host = blobs.cpu()
    layer = torch.stack([make_blob(fmt, w[: f * d].view(f, d).float(),
                                   w[f * d : 2 * f * d].view(f, d).float(),
                                   w[2 * f * d :].view(d, f).float()) for w in host])  # [E, b]
    store = ExpertStore([layer], d, f, torch.bfloat16, quant=fmt)
    out = {}
    for name, grouped in (("grouped", None), ("loop", False)):
        experts = ResidentExperts(store, x.device, grouped_prefill=grouped)
        out[name] = timed(lambda experts=experts: experts.forward(0, x, ids, weights), repeat)
    return out


def one_shape(preset_name: str, n_tokens: int, repeat: int, matmul_tflops: float,
              experts_dtypes: tuple[str, ...] = ()) -> dict:
    """The steps' ms for one layer of `preset_name` over a chunk of `n_tokens` tokens."""
    p = get_preset(preset_name)
    e, k, d, f = p.n_experts, p.top_k, p.hidden_size, p.expert_width
    cuda = torch.device("cuda")
    gen = torch.Generator(device=cuda).manual_seed(0)
    blobs = (torch.randn(e, 3 * f * d, device=cuda, generator=gen) / 32).to(torch.bfloat16)
    gate_up = blobs[:, : 2 * f * d].view(e, 2 * f, d)  # [E, 2F, D] views, as ResidentExperts'
    down = blobs[:, 2 * f * d :].view(e, d, f)  # [E, D, F]
    x = torch.randn(n_tokens, d, device=cuda, generator=gen).to(torch.bfloat16)  # [T, D]
    logits = torch.randn(n_tokens, e, device=cuda, generator=gen)
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)  # [T, K] each
    r = n_tokens * k

    # The steps in the order sorted_grouped_sum runs them, each from the last one's outputs.
    order, ends = expert_runs(ids.reshape(-1), e)  # [R], [E]
    x_sorted = x.index_select(0, order // k)  # [R, D]
    h = torch._grouped_mm(x_sorted, gate_up.transpose(-2, -1), offs=ends)  # [R, 2F]
    act = silu_and_mul(h)  # [R, F]
    y = torch._grouped_mm(act, down.transpose(-2, -1), offs=ends)  # [R, D]
    positions = torch.empty_like(order)
    positions[order] = torch.arange(r, device=cuda)

    def scatter_positions():
        positions[order] = torch.arange(r, device=cuda)

    steps = {
        "sort": lambda: expert_runs(ids.reshape(-1), e),
        "gather": lambda: x.index_select(0, order // k),
        "gate_up": lambda: torch._grouped_mm(x_sorted, gate_up.transpose(-2, -1), offs=ends),
        "activation": lambda: silu_and_mul(h),
        "down": lambda: torch._grouped_mm(act, down.transpose(-2, -1), offs=ends),
        "positions": scatter_positions,
        "combine": lambda: weighted_sum(y, weights, x.dtype, positions),
    }
    ms = {name: timed(fn, repeat) for name, fn in steps.items()}
    ms["activation_torch"] = timed(lambda: F.silu(h[:, :f]) * h[:, f:], repeat)
    ms["whole"] = timed(lambda: sorted_grouped_sum(gate_up, down, x, ids, weights), repeat)
    flops = 2 * r * 3 * f * d
    products_ms = ms["gate_up"] + ms["down"]
    quantized = {fmt: quantized_ms(blobs, fmt, f, d, x, ids, weights, repeat)
                 for fmt in experts_dtypes}
    return {
        "shape": preset_name, "tokens": n_tokens, "experts": e, "top_k": k, "hidden": d,
        "width": f, "ms": ms, "steps_ms": sum(ms[name] for name in steps),
        "products_share": flops / (products_ms * 1e-3) / (matmul_tflops * 1e12),
        "whole_share": flops / (ms["whole"] * 1e-3) / (matmul_tflops * 1e12),
        "activation_speedup": ms["activation_torch"] / ms["activation"],
        "quantized_ms": quantized,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES),
                        help=f"comma-separated presets (default {','.join(SHAPES)})")
    parser.add_argument("--tokens", default="4096", help="comma-separated chunk lengths")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--matmul-tflops", type=float,
                        help="bf16 matrix TFLOP/s for the shares (default: the device's, 790 "
                        "on an H200, else measured in the run)")
    parser.add_argument("--json-out", help="also write the figures as one JSON object here")
    parser.add_argument("--experts-dtype", default="",
                        help="comma-separated quantized formats also timed (int8, int4-g32, "
                             "int4-g64): grouped a batch at a time against the loop")
    args = parser.parse_args(argv)
    fmts = tuple(fmt for fmt in args.experts_dtype.split(",") if fmt)
    if not set(fmts) <= set(WEIGHT_FORMATS) or len(set(fmts)) != len(fmts):
        parser.error(f"--experts-dtype takes distinct comma-separated formats of "
                     f"{', '.join(WEIGHT_FORMATS)}, got {args.experts_dtype!r}")
    probe = torch.zeros(1, dtype=torch.bfloat16, device="cuda" if torch.cuda.is_available()
                        else "cpu")
    if not available(probe):
        print("prompt_experts.py times the grouped products: bf16 on a CUDA GPU of compute "
              "capability 9.0 or later", file=sys.stderr)
        return 2
    args.matmul_tflops = args.matmul_tflops or device_rates(probe.device).matmul_tflops
    rows = [one_shape(shape, int(tokens), args.repeat, args.matmul_tflops, fmts)
            for shape in args.shapes.split(",") for tokens in args.tokens.split(",")]
    result = {"command": "python bench/prompt_experts.py " + " ".join(argv or sys.argv[1:]),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "date": datetime.date.today().isoformat(), "rows": rows}
    if args.json_out:
        with open(args.json_out, "w") as out:
            json.dump(result, out)
    for row in rows:
        ms = row["ms"]
        print(f"{row['shape']} (E {row['experts']}, K {row['top_k']}, D {row['hidden']}, "
              f"F {row['width']}), {row['tokens']} tokens: whole {ms['whole']:.3f} ms, "
              f"{100 * row['whole_share']:.1f}% of {args.matmul_tflops:.0f} TFLOP/s; the two "
              f"products alone {100 * row['products_share']:.1f}%")
        for name in ("sort", "gather", "gate_up", "activation", "down", "positions", "combine"):
            print(f"  {name:<10} {ms[name]:8.3f} ms  {100 * ms[name] / row['steps_ms']:5.1f}%")
        print(f"  activation: one kernel {ms['activation']:.3f} ms, torch's two "
              f"{ms['activation_torch']:.3f} ms ({row['activation_speedup']:.2f}x)")
        for fmt, q in row["quantized_ms"].items():
            print(f"  {fmt}: grouped a batch at a time {q['grouped']:.3f} ms, the loop "
                  f"{q['loop']:.3f} ms ({q['loop'] / q['grouped']:.2f}x), bf16's whole call "
                  f"{ms['whole']:.3f} ms ({q['grouped'] / ms['whole']:.2f}x of it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
