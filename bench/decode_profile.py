"""Where the device time of a prompt chunk and of a decode round goes, every expert resident.

Issue 16's question: which kernels a prompt and a decode round launch, how long each kind takes,
and how much of the wall time is kernels at all (the rest is launching them). For each
`--prompt-tokens` length it times `MoEModel.forward` over one chunk from position 0, and for
decode one round at `--position` in each of strata's decode steps: eager, replayed from a CUDA
graph (the default), the same graph with the layers' small ops in plain torch (as they were
before `strata.engine.model.ops` had kernels: the baseline of the same run), with the experts'
`down` then the combine instead of the sum inside `down`, with SDPA's attention instead of
`decode_attention`'s kernel (each the A/B of one kernel), with every kernel launched plainly
instead of as a dependent of the one before (`strata.engine.dependent_launch`), with a forward's
rotary tables and mask as the torch ops instead of one kernel (`ops.ROPE_MASK_KERNEL`), with
attention's output product apart from the sum after it, the MoE's norm and its routing
(`products.PRODUCT_ROUTE_KERNEL`), and those three as three kernels (the product,
`add_rms_norm`, `router_route`: `ops.NORM_ROUTER_KERNEL` off too), with the routing's top K
taken in K rounds instead of each expert's place counted at once (`routing_ops.TOP_K_BY_RANK`),
with attention's dense products
by cuBLAS instead of the kernel that reads its weights before its wait
(`products.PRODUCT_KERNEL`), with each layer's first norm as `add_rms_norm` before q/k/v's
product instead of inside its kernel (`products.NORM_PRODUCT_KERNEL`), with no weight load
marked evict_first for L2 (`cache_hints`), with the logits' product by cuBLAS instead of that
kernel (`products.LOGITS_KERNEL`), two bounds rather than A/Bs (no routing after the
output product, the routing fixed; no short attention kernel: what either costs the round,
with wrong logits; a third, the experts' bytes read by one kernel: what running gate_up and
down as two kernels with a sum costs), `--compile`'s (compiled with the experts' Triton kernels as
a custom operator; `--gathered-compile` adds the gathered path under inductor, the code before
that operator), and, last, the default's graph captured again: the control.
Each is timed (median of `--repeat`, wall clock around a device sync) and profiled once
(torch.profiler): the kernels, their total, and the largest kinds by time. The graphs' rounds
are then timed again side by side, in alternating sweeps, each timed round after an untimed
one of its own ("ms_interleaved", and "x_default": each against the default's in the same
sweeps, with its quartiles): the figures to compare rows by, as the machine's speed drifts over
a run; the control's says how far apart two captures of one graph come out.

    python bench/decode_profile.py --preset olmoe-1b-7b --layers 4 --device cuda
    python bench/decode_profile.py --preset tiny --device cpu --no-compile   # the script's check
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import platform
import pstats
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from _common import (
    add_model_arguments,
    byte_tokens,
    checkpoint_for,
    side_by_side,
    sync,
    wall_times_s,
)
from strata.engine import cache_hints, dependent_launch
from strata.engine.experts import grouped
from strata.engine.model import decode_attention, ops, products, routing_ops
from strata.engine.model.routing_ops import ROUTER_MAX_TOKENS
from strata.engine.runtime.decode_steps import decode_step
from strata.engine.runtime.engine import Engine
from strata.engine.runtime.prompt_graphs import PromptGraphs

# strata's own Triton kernels by their exact names (a substring such as "down" would match
# others): the experts' decode kernels and the sum of their rows.
OWN_KERNELS = {"gate_up_act": "experts (triton)", "down": "experts (triton)",
               "down_sum": "experts (triton)", "combine": "experts (triton)"}
# Other kernel names -> the kind they are counted under, first match wins (lower-case
# substrings).
KINDS = (
    # router_route and add_norm_router_route too
    ("layer ops (triton)", ("add_rms_norm", "qk_norm_rope", "route")),
    ("experts (triton)", ("int8_", "int4_")),
    ("grouped mm", ("grouped", "group_gemm")),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("matmul", ("gemm", "gemv", "nvjet", "cutlass", "sm90", "cublas", "xmma", "splitk")),
    ("inductor fused", ("triton_",)),
    ("sort / top-k", ("sort", "topk", "radix", "bitonic")),
    ("copy / index", ("copy", "index", "gather", "scatter", "cat")),
)


def kind_of(name: str) -> str:
    if name in OWN_KERNELS:
        return OWN_KERNELS[name]
    lower = name.lower()
    for kind, needles in KINDS:
        if any(needle in lower for needle in needles):
            return kind
    return "elementwise / other"


def timed(fn, device: torch.device, repeat: int) -> float:
    """Median wall seconds of `fn()` with the device synced around it."""
    return statistics.median(wall_times_s(fn, device, repeat))


def kernels_of(fn, device: torch.device) -> list[tuple[str, float]]:
    """(name, µs) of each device kernel `fn()` ran, from one profiled call."""
    if device.type != "cuda":
        return []
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync(device)
    return [(event.name, event.time_range.elapsed_us()) for event in prof.events()
            if event.device_type == torch.autograd.DeviceType.CUDA]


def host_profile(fn, device: torch.device, lines: int = 14) -> str:
    """The Python functions and torch calls `fn()` spends its host time in (cProfile, by
    own time), as text."""
    profiler = cProfile.Profile()
    sync(device)
    profiler.enable()
    fn()
    sync(device)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(lines)
    return text.getvalue()


def summary(label: str, fn, device: torch.device, repeat: int, tokens: int,
            host: bool = False) -> dict:
    fn()  # warm-up (and, for a compiled step, its compilation)
    if host:
        print(f"\nhost time of {label}:\n" + host_profile(fn, device).split("Ordered by")[-1])
    seconds = timed(fn, device, repeat)
    kernels = kernels_of(fn, device)
    by_kind: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for name, us in kernels:
        for table, key in ((by_kind, kind_of(name)), (by_name, name)):
            table[key][0] += 1
            table[key][1] += us
    kernel_us = sum(us for _, us in kernels)
    return {
        "label": label, "tokens": tokens, "ms": 1e3 * seconds,
        "tok_s": tokens / seconds, "n_kernels": len(kernels), "kernel_ms": kernel_us / 1e3,
        "kernel_share": kernel_us / 1e6 / seconds if kernels else None,
        "kinds": sorted(([k, n, us / 1e3] for k, (n, us) in by_kind.items()),
                        key=lambda row: -row[2]),
        # Every kernel name, largest total first (the text shows the first 6): what a round
        # launches, to the last small copy.
        "top": sorted(([k[:90], n, us / 1e3] for k, (n, us) in by_name.items()),
                      key=lambda row: -row[2]),
    }


def interleaved(captured: list, device: torch.device, repeat: int) -> None:
    """Time the graph rows' decode rounds again side by side, the default's first
    (`_common.side_by_side`: `repeat` sweeps, each timed round after one of its own, each row
    against the default's round of the same sweep): each row gets "ms_interleaved",
    "x_default" and "x_default_q", and the table is printed. The control row (the default's
    graph captured again, last) shows how far two captures of one graph come out apart."""
    if len(captured) < 2:
        return
    figures = side_by_side([round_of for _, round_of in captured], device, repeat)
    print(f"\ndecode rounds timed side by side (medians of {repeat} sweeps, alternating order; "
          "x default: the default's round over the row's, median of the sweeps, quartiles):")
    for (row, _), got in zip(captured, figures, strict=True):
        row["ms_interleaved"], row["x_default"] = got["ms"], got["x_default"]
        row["x_default_q"] = got["x_default_q"]
        low, high = got["x_default_q"]
        print(f"  {got['ms']:8.3f} ms  {got['x_default']:.3f}x ({low:.3f}-{high:.3f})  "
              f"{row['label']}")


def fixed_routing(config, device: torch.device):
    """`products.linear_add_norm_route` as attention's output product alone: x as the stream
    and the norm, every token routed to experts 0..K-1 alike (the same bytes of expert
    weights a round reads, from tensors made here, before any capture). A bound for the
    profile, not a model."""
    ids = torch.arange(config.top_k, device=device).expand(ROUTER_MAX_TOKENS, -1).contiguous()
    weights = torch.full(ids.shape, 1 / config.top_k, dtype=torch.float32, device=device)

    def route(a, weight, bias, x, norm_weight, eps, router, top_k, normalize):
        products.linear(a, weight, bias)
        return x, x, ids[:x.shape[0]], weights[:x.shape[0]]
    return route


def no_attention(config, device: torch.device, dtype: torch.dtype):
    """`decode_attention.rotate_attend` launching nothing: a zero output of its shape, made
    here, before any capture. A bound for the profile, not a model."""
    out = torch.zeros((1, config.n_heads * config.head_dim), dtype=dtype, device=device)
    return lambda *args: out


def experts_as_one_read(config, device: torch.device, dtype: torch.dtype):
    """`grouped.expert_sum_triton` as one `gate_up_act` launch over the same bytes: each of
    the K rows reads a [3F, D] expert (gate, up and down's bytes as one block, from a tensor
    made here, before any capture), so the round keeps the experts' reads but loses the second
    kernel, its wait for the first and its sum. A bound for the profile, not a model: its
    output, a row of D, is the first D of act's K * 1.5F elements (`one_read_fits`)."""
    k, d, f = config.top_k, config.hidden_size, config.expert_width
    weights = torch.randn((k, 3 * f, d), device=device, dtype=dtype)  # f' = 1.5F: [K, 2F', D]
    index = torch.arange(k, device=device)
    # Only its shape and strides are read: one row's memory, expanded.
    wide = torch.empty((1, 1, 3 * f // 2), device=device, dtype=dtype).expand(k, d, -1)

    def experts(gate_up, down, _index, x_rows, _weights, _arrived):
        act, _ = grouped._gate_up_act(
            grouped._kernels(), weights, wide, index, x_rows, grouped.GATE_UP_BLOCK_F,
            grouped.GATE_UP_BLOCK_D, grouped.NUM_WARPS[0], grouped.NUM_STAGES[0],
            *dependent_launch.launch_with(None, x_rows.device))
        return act.view(-1)[:d].view(1, d)  # [1, D]: act's first D elements (K * 1.5F >= D)
    return experts


def one_read_fits(config) -> bool:
    """Whether `experts_as_one_read`'s act holds a row of D."""
    return config.top_k * 3 * config.expert_width // 2 >= config.hidden_size


def print_summary(row: dict) -> None:
    share = f"{100 * row['kernel_share']:.0f}%" if row["kernel_share"] is not None else "-"
    print(f"\n{row['label']}: {row['ms']:.3f} ms ({row['tok_s']:,.0f} tok/s); "
          f"{row['n_kernels']} kernels, {row['kernel_ms']:.3f} ms of them ({share} of the wall)")
    for kind, n, ms in row["kinds"]:
        print(f"  {kind:<22}{n:>6} kernels {ms:>9.3f} ms")
    for name, n, ms in row["top"][:6]:
        print(f"    {ms:>8.3f} ms {n:>5}x  {name}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(parser, preset="olmoe-1b-7b")
    parser.add_argument("--model", help="a checkpoint directory to use instead of writing one")
    parser.add_argument("--prompt-tokens", default="32,4096",
                        help="comma-separated chunk lengths to profile (default 32,4096)")
    parser.add_argument("--position", type=int, default=64, help="the decode round's cell")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--no-compile", action="store_true", help="leave --compile's step out")
    parser.add_argument("--gathered-compile", action="store_true",
                        help="also compile with the experts gathered (inductor's own code)")
    parser.add_argument("--host-profile", action="store_true",
                        help="also print where the host time of the prompt chunks and of an "
                        "eager decode round goes (cProfile)")
    parser.add_argument("--json", metavar="FILE", help="also write every figure to FILE")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat takes a count >= 1, got {args.repeat}")
    lengths = [int(n) for n in args.prompt_tokens.split(",") if n]
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    on_cuda = device.type == "cuda"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = checkpoint_for(args, Path(tmp), dtype)
        max_context = max([*lengths, args.position + 1])
        with Engine.open(ckpt, device=device, dtype=dtype, max_context=max_context) as engine:
            model, kv = engine.model, engine.kv
            config = model.config
            for n in lengths:
                ids = torch.tensor(byte_tokens(n, seed=n), dtype=torch.int64, device=device)
                rows.append(summary(f"prompt chunk of {n}",
                                    lambda ids=ids: model.forward(ids, 0, kv, last_only=True),
                                    device, max(3, args.repeat // 4), n, args.host_profile))
                print_summary(rows[-1])
                graphs = PromptGraphs(model, kv) if on_cuda else None
                if graphs is not None and model.experts.prompt_capturable \
                        and graphs(ids, 0) is not None:
                    graphs(ids, 0)  # the shape's second use: its graph captured
                    # What an engine's requests replay.
                    rows.append(summary(f"prompt chunk of {n}, CUDA graph (default)",
                                        lambda ids=ids, graphs=graphs: graphs(ids, 0),
                                        device, max(3, args.repeat // 4), n))
                    print_summary(rows[-1])

            def step_of(graphs: bool, compile: bool = False):
                return decode_step(model, kv, None, cuda_graphs=graphs, piecewise_graphs=False,
                                   compile=compile)

            # (label, step, the key of `switches` below its graph is captured with: None, the
            # default; a name, one part left out; "+name", a staged change switched on).
            steps = [("decode, eager", step_of(False), None)]
            if on_cuda:
                steps.append(("decode, CUDA graph (default)", step_of(True), None))
                steps.append(("decode, CUDA graph, the layer ops in torch", step_of(True),
                              "ops"))
                steps.append(("decode, CUDA graph, attention by SDPA", step_of(True),
                              "attention"))
                steps.append(("decode, CUDA graph, plain launches", step_of(True), "pdl"))
                steps.append(("decode, CUDA graph, the rotary tables and mask in torch",
                              step_of(True), "rope-mask"))
                steps.append(("decode, CUDA graph, the output product, then the norm and "
                              "the router", step_of(True), "product-route"))
                steps.append(("decode, CUDA graph, the output product, the norm and the "
                              "router as three kernels", step_of(True), "norm-router"))
                steps.append(("decode, CUDA graph, the dense products by cuBLAS",
                              step_of(True), "products"))
                steps.append(("decode, CUDA graph, the norm then q/k/v's product as two "
                              "kernels", step_of(True), "norm-product"))
                steps.append(("decode, CUDA graph, the top K taken in K rounds",
                              step_of(True), "top-k-rounds"))
                steps.append(("decode, CUDA graph, no weight load marked evict_first",
                              step_of(True), "hints"))
                steps.append(("decode, CUDA graph, the logits by cuBLAS", step_of(True),
                              "logits"))
                # Two bounds, not A/Bs (the logits are wrong): what a round would gain if a
                # layer's routing (its norm and router, after the output product) or its short
                # attention cost nothing.
                steps.append(("decode, CUDA graph, no routing after the output product (a "
                              "bound: the routing fixed, wrong logits)", step_of(True),
                              "no-router"))
                steps.append(("decode, CUDA graph, no attention kernel (a bound: wrong "
                              "logits)", step_of(True), "no-attention"))
                if getattr(model.experts, "_sum_arrivals", None) is not None:
                    steps.append(("decode, CUDA graph, down then the combine", step_of(True),
                                  "sum"))
                if getattr(model.experts, "_sum_arrivals", None) is not None \
                        and one_read_fits(config):
                    steps.append(("decode, CUDA graph, the experts' bytes as one kernel's "
                                  "read (a bound: wrong logits)", step_of(True), "one-read"))
                if not args.no_compile:
                    steps.append(("decode, --compile", step_of(True, True), None))
                # The control: the default's graph captured again, last (`interleaved`).
                steps.append(("decode, CUDA graph (default, captured again)", step_of(True),
                              None))
            # What each row's graph is captured with: (object, attribute, value) set while
            # it is captured, then put back. "ops": the layer ops' torch code; "attention":
            # SDPA's folded path; "sum": `down`, then the combine; "pdl": every kernel
            # launched plainly; "products", "logits": F.linear.
            switches = {
                None: (),
                "ops": ((ops, "use_kernels", lambda x: False),),
                "attention": ((decode_attention, "takes", lambda q, keys, values: False),),
                "sum": ((model.experts, "_sum_arrivals", None),),
                "pdl": ((dependent_launch, "enabled", False),),
                "rope-mask": ((ops, "ROPE_MASK_KERNEL", False),),
                "product-route": ((products, "PRODUCT_ROUTE_KERNEL", False),),
                "norm-router": ((products, "PRODUCT_ROUTE_KERNEL", False),
                                (ops, "NORM_ROUTER_KERNEL", False)),
                "products": ((products, "PRODUCT_KERNEL", False),),
                "norm-product": ((products, "NORM_PRODUCT_KERNEL", False),),
                "hints": ((cache_hints, "EXPERTS_EVICT_FIRST", False),
                          (cache_hints, "PRODUCTS_EVICT_FIRST", False)),
                "logits": ((products, "LOGITS_KERNEL", False),),
                "no-router": ((products, "linear_add_norm_route",
                               fixed_routing(config, device)),),
                "top-k-rounds": ((routing_ops, "TOP_K_BY_RANK", False),),
                "no-attention": ((decode_attention, "rotate_attend", no_attention(config, device,
                                                                                   dtype)),),
                "one-read": ((grouped, "expert_sum_triton",
                              experts_as_one_read(config, device, dtype)
                              if on_cuda and one_read_fits(config) else None),),
            }
            captured = []  # (row, its round): timed again side by side below
            for label, step, without in steps:
                # The graph is captured here, with or without the part named.
                saved = [(owner, name, getattr(owner, name))
                         for owner, name, _ in switches[without]]
                for owner, name, value in switches[without]:
                    setattr(owner, name, value)
                try:
                    step.prepare(1, args.position, args.position)
                finally:
                    for owner, name, value in saved:
                        setattr(owner, name, value)
                rows.append(summary(label, lambda step=step: step(1, args.position), device,
                                    args.repeat, 1, args.host_profile and step.path == "eager"))
                print_summary(rows[-1])
                if step.path != "eager":  # the graphs are compared side by side
                    captured.append((rows[-1], lambda step=step: step(1, args.position)))
            interleaved(captured, device, args.repeat)
            if on_cuda and args.gathered_compile:
                # The experts as inductor compiles the gathered path (no custom operator).
                made = grouped._compiled["expert_rows"]
                grouped._compiled["expert_rows"] = None  # traced: the gathered path
                define, grouped.define_compiled_op = grouped.define_compiled_op, lambda: None
                torch._dynamo.reset()
                step = step_of(True, True)
                step.prepare(1, args.position, args.position)
                rows.append(summary("decode, --compile, experts gathered",
                                    lambda: step(1, args.position), device, args.repeat, 1))
                print_summary(rows[-1])
                grouped._compiled["expert_rows"], grouped.define_compiled_op = made, define
    meta = {
        "preset": args.preset, "layers": config.n_layers, "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if on_cuda else platform.processor(),
        "torch": torch.__version__, "date": datetime.date.today().isoformat(),
        "command": "python bench/decode_profile.py " + " ".join(sys.argv[1:] if argv is None
                                                                  else argv),
    }
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
