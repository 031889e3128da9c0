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
each layer's sum after attention, the MoE's norm and its routing as `add_rms_norm` then
`router_route` instead of one kernel (`ops.NORM_ROUTER_KERNEL`), with attention's dense products
by cuBLAS instead of the kernel that reads its weights before its wait
(`products.PRODUCT_KERNEL`), with each layer's first norm as `add_rms_norm` before q/k/v's
product instead of inside its kernel (`products.NORM_PRODUCT_KERNEL`), with no weight load
marked evict_first for L2 (`cache_hints`), three changes each
switched on (the logits' product by that kernel, `products.LOGITS_KERNEL`; the router's weights
read before its wait, `routing_ops.ROUTER_WEIGHTS_FIRST`; a short window attended in one program
a kv head, its cells read before its wait, `decode_attention.SHORT_KERNEL`; the same with the
rotation and the K/V write folded in, `decode_attention.SHORT_ROTATES`: these two on by default
since bench/results/decode-shapes-short-h100-2026-12-05.md, their rows then the default's;
down's index and first weight tile read before its wait, `grouped.DOWN_W_FIRST`, at the default
blocks and with each program's rows whole, DOWN_ROWS_FIRST of them), and
`--compile`'s
(compiled with the experts' Triton kernels as a custom operator; `--gathered-compile` adds
the gathered path under inductor, the code before that operator).
Each is timed (median of `--repeat`, wall clock around a device sync) and profiled once
(torch.profiler): the kernels, their total, and the largest kinds by time. The decode rounds
are then timed again side by side, in alternating sweeps ("ms_interleaved"): the figures to
compare rows by, as the machine's speed drifts over a run.

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

from _common import add_model_arguments, byte_tokens, checkpoint_for, sync, wall_times_s
from strata.engine import cache_hints, dependent_launch
from strata.engine.experts import grouped
from strata.engine.model import decode_attention, ops, products, routing_ops
from strata.engine.runtime.decode_steps import decode_step
from strata.engine.runtime.engine import Engine
from strata.engine.runtime.prompt_graphs import PromptGraphs

DOWN_ROWS_FIRST = 8  # rows of down a program of the "+down-rows-first" row reads, each whole

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
    """Time the decode rounds again side by side: `repeat` sweeps over every row's round,
    each sweep in the other order than the one before, one call a row a sweep, so that a
    drift of the machine during the run (seen: 5-10% between rows timed minutes apart) falls
    on every row alike. Each row gets "ms_interleaved", the median, and the table is printed."""
    if len(captured) < 2:
        return
    times: list[list[float]] = [[] for _ in captured]
    order = list(range(len(captured)))
    for sweep in range(repeat):
        for i in order if sweep % 2 == 0 else order[::-1]:
            times[i].append(timed(captured[i][1], device, 1))
    print("\ndecode rounds timed side by side (medians of "
          f"{repeat} sweeps, alternating order):")
    for (row, _), seconds in zip(captured, times, strict=True):
        row["ms_interleaved"] = 1e3 * statistics.median(seconds)
        print(f"  {row['ms_interleaved']:8.3f} ms  {row['label']}")


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
                steps.append(("decode, CUDA graph, the norm and the router as two kernels",
                              step_of(True), "norm-router"))
                steps.append(("decode, CUDA graph, the dense products by cuBLAS",
                              step_of(True), "products"))
                steps.append(("decode, CUDA graph, the norm then q/k/v's product as two "
                              "kernels", step_of(True), "norm-product"))
                steps.append(("decode, CUDA graph, no weight load marked evict_first",
                              step_of(True), "hints"))
                steps.append(("decode, CUDA graph, the logits by the kernel", step_of(True),
                              "+logits"))
                steps.append(("decode, CUDA graph, the router's weights read before its wait",
                              step_of(True), "+router-first"))
                steps.append(("decode, CUDA graph, attention in one program a kv head",
                              step_of(True), "+short"))
                steps.append(("decode, CUDA graph, the rotation and attention in one program "
                              "a kv head", step_of(True), "+rotate"))
                if getattr(model.experts, "_sum_arrivals", None) is not None:
                    steps.append(("decode, CUDA graph, down then the combine", step_of(True),
                                  "sum"))
                    steps.append(("decode, CUDA graph, down's first weight tile read before "
                                  "its wait", step_of(True), "+down-first"))
                    steps.append((f"decode, CUDA graph, down's whole rows read before its "
                                  f"wait ({DOWN_ROWS_FIRST} a program)", step_of(True),
                                  "+down-rows-first"))
                if not args.no_compile:
                    steps.append(("decode, --compile", step_of(True, True), None))
            # What each row's graph is captured with: (object, attribute, value) set while
            # it is captured, then put back. "ops": the layer ops' torch code; "attention":
            # SDPA's folded path; "sum": `down`, then the combine; "pdl": every kernel
            # launched plainly; "products": F.linear; "+short", "+rotate": `attend_short`,
            # `rotate_attend`.
            switches = {
                None: (),
                "ops": ((ops, "use_kernels", lambda x: False),),
                "attention": ((decode_attention, "takes", lambda q, keys, values: False),),
                "sum": ((model.experts, "_sum_arrivals", None),),
                "pdl": ((dependent_launch, "enabled", False),),
                "rope-mask": ((ops, "ROPE_MASK_KERNEL", False),),
                "norm-router": ((ops, "NORM_ROUTER_KERNEL", False),),
                "products": ((products, "PRODUCT_KERNEL", False),),
                "norm-product": ((products, "NORM_PRODUCT_KERNEL", False),),
                "hints": ((cache_hints, "EXPERTS_EVICT_FIRST", False),
                          (cache_hints, "PRODUCTS_EVICT_FIRST", False)),
                "+logits": ((products, "LOGITS_KERNEL", True),),
                "+router-first": ((routing_ops, "ROUTER_WEIGHTS_FIRST", True),),
                "+short": ((decode_attention, "SHORT_KERNEL", True),),
                "+rotate": ((decode_attention, "SHORT_KERNEL", True),
                            (decode_attention, "SHORT_ROTATES", True)),
                "+down-first": ((grouped, "DOWN_W_FIRST", True),),
                # A program's rows of down whole (a step of F's power of two), all read
                # before the wait; its own arrival counter, as the blocks of D are smaller.
                "+down-rows-first": (
                    (grouped, "DOWN_W_FIRST", True),
                    (grouped, "DOWN_BLOCK_D", DOWN_ROWS_FIRST),
                    (grouped, "DOWN_BLOCK_F", 1 << (model.config.expert_width - 1).bit_length()),
                    (model.experts, "_sum_arrivals", torch.zeros(
                        -(-model.config.hidden_size // DOWN_ROWS_FIRST), dtype=torch.int32,
                        device=device))),
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
