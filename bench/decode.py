"""Benchmark decode speed at batch 1: strata against transformers' `generate`, same weights.

Makes its own checkpoint (`write_checkpoint` into a temporary directory, removed at the end),
then runs strata's `Engine` and transformers' `generate` greedily on the same prompt ids, each
after a warm-up run, and reports decode tok/s, their ratio, and the share of the memory-bandwidth
bound that strata reaches. Writes nothing else.

- strata: decode tok/s is its own figure: rounds / decode time (the clock starts after the
  prefill and, on CUDA, after the decode graphs are captured).
- transformers: decode tok/s = (new - 1) / (time of `generate` for `new` tokens - time for 1
  token), so that its prefill is left out the same way. Medians over `--repeat` runs.
- MoE share (CUDA): the routed experts of every layer over `--prompt-tokens` random rows, timed
  alone (`Experts.forward` as a prompt chunk calls it), their FLOPs (2 * T * K * 3 * F * D a
  layer) against `--matmul-tflops` (default on cuda the device's: `_common.device_rates`,
  790 on an H200, its measured bf16 rate; measured in the run on any other GPU).
- `--prefill-lengths`: more prompt lengths whose prefill alone is measured in the same run
  (strata's, with the MoE share of its chunk, and transformers'; 2 new tokens each), so that
  one run prints issue 16's table of prefill at every length beside the decode figures.
- bound: the bytes one decode token must read (every dense weight, the K routed experts of each
  layer, the lm_head, the K/V at the mean context; from the config), against `--bandwidth-gbs`
  (on cuda by default the device's: 4300 GB/s on an H200, its measured device-to-device copy
  rate and issue 16's bound; measured in the run on any other GPU, so that an H100's share is
  of its own rate; the rates measured in the run are in the JSON on an H200 too).

    python bench/decode.py --preset tiny --device cpu          # here, in a minute
    python bench/decode.py --preset olmoe-1b-7b --device cuda  # the GPU machine (~14 GB on disk)
    python bench/decode.py ... --layers 8 --json               # shorter; one JSON object
    python bench/decode.py ... --experts-dtype int8,int4       # + quantized experts' runs
    python bench/decode.py ... --prefill-lengths 512,4096,16384  # + prefill at those lengths
    python bench/decode.py ... --cli-sampling --plain-loop  # + strata generate's sampling, and
                                                            # each round's token read first
    python bench/decode.py ... --pick-in-graph  # + greedy picks inside the graphs (or outside)
    python bench/decode.py ... --argmax-kernel  # + the greedy pick by one kernel (or torch's)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest.mock import patch

import torch

from _common import (
    add_model_arguments,
    cli_sampling,
    device_rates,
    free_memory,
    fresh_request,
    sync,
)
from decode_report import print_report
from strata.engine.experts.quant import EXPERTS_DTYPES, expert_blob_bytes, experts_quant_for
from strata.engine.model.init_model import write_checkpoint
from strata.engine.model.presets import BYTE_TOKENS, get_preset
from strata.engine.runtime import decode_loop, decode_steps
from strata.engine.runtime import sampling as sampling_module
from strata.engine.runtime.engine import Engine
from strata.engine.runtime.generate import GenerateOptions, default_prefill_chunk


def moe_tflops(engine, n_tokens: int, repeat: int) -> tuple[float, float]:
    """(seconds, TFLOP/s) of the routed experts of every layer over n_tokens random rows with
    random top-k routing, as one prompt chunk calls them; the median of `repeat` passes."""
    model, config = engine.model, engine.model.config
    gen = torch.Generator(device=model.device).manual_seed(0)
    x = torch.randn(n_tokens, config.hidden_size, device=model.device, dtype=model.dtype,
                    generator=gen)  # [T, D]
    logits = torch.randn(n_tokens, config.n_experts, device=model.device, generator=gen)
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), config.top_k, dim=-1)  # [T, K]

    def one_pass() -> float:
        sync(model.device)
        start = time.perf_counter()
        for layer in range(config.n_layers):
            model.experts.forward(layer, x, ids, weights)
        sync(model.device)
        return time.perf_counter() - start

    one_pass()  # warm-up
    seconds = statistics.median(one_pass() for _ in range(repeat))
    flops = 2 * n_tokens * config.top_k * 3 * config.expert_width * config.hidden_size \
        * config.n_layers
    return seconds, flops / seconds / 1e12


def bytes_per_token(config, itemsize: int, mean_context: float,
                    expert_bytes: int | None = None) -> float:
    """The bytes one decode token reads at least: dense weights, K experts a layer (each
    `expert_bytes`, a quantized blob's; None: its three matrices in `itemsize`), lm_head, one
    embedding row, and the K/V of `mean_context` cells."""
    d, qw, kvw = config.hidden_size, config.q_width, config.kv_width
    attention = d * qw * 2 + d * kvw * 2 + 2 * d  # q, o, k, v; the two layer norms
    if config.qkv_bias:
        attention += qw + 2 * kvw
    if config.qk_norm == "full":
        attention += qw + kvw
    elif config.qk_norm == "head":
        attention += 2 * config.head_dim
    router = config.n_experts * d
    if expert_bytes is None:
        expert_bytes = 3 * config.expert_width * d * itemsize
    shared = 3 * config.shared_expert_width * d + d if config.shared_expert_width else 0
    per_layer = attention + router + shared
    weights = config.n_layers * per_layer + config.vocab_size * d + 2 * d  # + lm_head, norm, row
    kv = config.n_layers * 2 * mean_context * kvw  # K and V
    return (weights + kv) * itemsize + config.n_layers * config.top_k * expert_bytes


def run_strata(ckpt, device, dtype, prompt, n_new, repeat, prefill_chunk, compile=False,
               grouped_prefill=None, moe_share=False, experts_quant=None,
               sampling=None) -> dict:
    """`grouped_prefill` False: the prompt's experts by the per-expert loop (the baseline of
    the grouped products, `strata.engine.experts.sorted_grouped`); `prefill_chunk` None: the
    engine's default; `moe_share`: time the experts alone too; `experts_quant`: the experts
    quantized at load (`--experts-dtype`); `sampling`: GenerateOptions' sampling fields
    (default greedy)."""
    options = GenerateOptions(
        max_new=n_new, max_context=len(prompt) + n_new, ignore_stop=True,
        compile=compile, prefill_chunk=prefill_chunk, **(sampling or {"temperature": 0.0}),
    )
    moe = None
    with Engine.open(ckpt, device=device, dtype=dtype, max_context=options.max_context,
                     experts_quant=experts_quant) as engine:
        engine.model.experts.grouped_prefill = grouped_prefill
        start = time.perf_counter()
        fresh_request(engine, prompt, options)  # warm-up (the decode graphs captured)
        first_request_s = time.perf_counter() - start  # with compiling, where it compiles
        runs = [fresh_request(engine, prompt, options) for _ in range(repeat)]
        config = engine.model.config
        chunk_tokens = prefill_chunk or default_prefill_chunk(engine.model)
        if moe_share:
            moe = moe_tflops(engine, min(len(prompt), chunk_tokens), repeat)
    return {
        "prefill_chunk": chunk_tokens,
        "first_request_s": first_request_s,
        "blob_bytes": expert_blob_bytes(config.expert_width, config.hidden_size, dtype,
                                        experts_quant),
        "moe_s": moe[0] if moe else None,
        "moe_tflops": moe[1] if moe else None,
        "config": config,
        "tokens": runs[0].tokens,
        "prefill_tok_s": statistics.median(r.prefill_tok_s for r in runs),
        "decode_tok_s": statistics.median(r.decode_tok_s for r in runs),
        "decode_ms_per_round": statistics.median(r.decode_ms_per_round for r in runs),
        "decode_path": runs[0].decode_path,
        "deterministic": all(r.tokens == runs[0].tokens for r in runs),
    }


def run_transformers(ckpt, device, dtype, prompt, n_new, repeat) -> dict:
    import transformers

    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype).to(device)
    model.eval()
    ids = torch.tensor([prompt], device=device)

    def timed(n: int) -> tuple[float, list[int]]:
        sync(device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )
        sync(device)
        return time.perf_counter() - start, out[0, len(prompt):].tolist()

    timed(n_new)  # warm-up
    one = statistics.median(timed(1)[0] for _ in range(repeat))
    full = [timed(n_new) for _ in range(repeat)]
    full_s = statistics.median(seconds for seconds, _ in full)
    return {
        "tokens": full[0][1],
        "prefill_tok_s": len(prompt) / one,
        "decode_tok_s": (n_new - 1) / (full_s - one) if full_s > one else float("nan"),
        "decode_ms_per_round": 1000 * (full_s - one) / (n_new - 1),
        "generate_s": full_s,
    }


def prefill_at(n_tokens: int, ckpt, device, dtype, args, matmul_tflops) -> dict:
    """Prefill of an `n_tokens` prompt (byte ids seeded by its length), strata's and, unless
    --no-transformers, transformers', each the median of --repeat after a warm-up; with the
    MoE share of strata's chunk where there is a matrix rate."""
    prompt = torch.randint(0, BYTE_TOKENS, (n_tokens,),
                           generator=torch.Generator().manual_seed(n_tokens)).tolist()
    ours = run_strata(ckpt, device, dtype, prompt, 2, args.repeat, args.prefill_chunk,
                      moe_share=matmul_tflops is not None)
    free_memory(device)
    theirs = None
    if not args.no_transformers:
        theirs = run_transformers(ckpt, device, dtype, prompt, 2, args.repeat)["prefill_tok_s"]
        free_memory(device)
    return {
        "prompt_tokens": n_tokens, "prefill_chunk": ours["prefill_chunk"],
        "strata_tok_s": ours["prefill_tok_s"], "transformers_tok_s": theirs,
        "ratio": ours["prefill_tok_s"] / theirs if theirs else None,
        "moe_tokens": min(n_tokens, ours["prefill_chunk"]), "moe_tflops": ours["moe_tflops"],
        "moe_share": ours["moe_tflops"] / matmul_tflops
        if matmul_tflops and ours["moe_tflops"] else None,
        "deterministic": ours["deterministic"],
    }


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[int], list[str]]:
    """The arguments, `--prefill-lengths` as ints and `--experts-dtype` as a list; a bad
    value is the parser's error."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(parser, preset="olmoe-1b-7b")
    parser.add_argument("--model", help="a checkpoint directory to use instead of writing one "
                        "(--preset and --layers then only name it)")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per engine (median)")
    parser.add_argument(
        "--bandwidth-gbs", type=float,
        help="memory bandwidth for the bound (default on cuda: the device's, 4300 on an H200, "
        "else measured in the run; on cpu: no bound unless given)",
    )
    parser.add_argument("--no-transformers", action="store_true", help="strata alone")
    parser.add_argument(
        "--compile", action="store_true",
        help="also run strata with `--compile` (torch.compile of the decode step, CUDA only; "
        "`strata serve`'s default)",
    )
    parser.add_argument(
        "--loop-prefill", action="store_true",
        help="also run strata with the prompt's experts by the per-expert loop (strata-loop), "
        "the baseline of the grouped products",
    )
    parser.add_argument("--prefill-chunk", type=int,
                        help="strata's --prefill-chunk (default: the engine's, "
                        "default_prefill_chunk)")
    parser.add_argument(
        "--matmul-tflops", type=float,
        help="bf16 matrix throughput for the MoE share (default on cuda: the device's, 790 on "
        "an H200, else measured in the run; on cpu: no share unless given)",
    )
    parser.add_argument("--experts-dtype", default="",
                        help="comma-separated quantized --experts-dtype values (int8, int4, ...):"
                        " strata runs with the experts quantized at load, each against the bound "
                        "at its bytes")
    parser.add_argument("--prefill-lengths", default="",
                        help="comma-separated prompt lengths whose prefill alone is measured "
                        "too (strata and transformers, the MoE share of each chunk)")
    parser.add_argument("--plain-loop", action="store_true",
                        help="also run strata greedy with each round's token read before the "
                        "next round is launched (strata-plain: the A/B of "
                        "strata.engine.runtime.decode_loop's round ahead)")
    parser.add_argument("--pick-in-graph", action="store_true",
                        help="also run strata greedy with each round's pick made inside its "
                        "CUDA graph (strata-pick-in-graph: the A/B of strata.engine.runtime."
                        "decode_steps.GREEDY_PICK_IN_GRAPH, the other side of the default's)")
    parser.add_argument("--argmax-kernel", action="store_true",
                        help="also run strata greedy with the greedy pick from the other side "
                        "of strata.engine.runtime.sampling.ARGMAX_KERNEL than the default's "
                        "(one Triton launch, or torch's argmax): strata-argmax")
    parser.add_argument("--cli-sampling", action="store_true",
                        help="also run strata decoding with `strata generate`'s default "
                        "sampling (temperature, top-p) instead of greedy: what a user gets "
                        "without flags")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    args = parser.parse_args(argv)
    try:
        lengths = [int(n) for n in args.prefill_lengths.split(",") if n]
    except ValueError:
        lengths = [0]
    if any(n < 1 for n in lengths):
        parser.error(f"--prefill-lengths takes comma-separated token counts >= 1, got "
                     f"{args.prefill_lengths!r}")
    formats = [f for f in args.experts_dtype.split(",") if f]
    if any(f not in EXPERTS_DTYPES or f in ("auto", "bf16") for f in formats):
        parser.error(f"--experts-dtype takes comma-separated quantized values of "
                     f"{', '.join(EXPERTS_DTYPES[2:])}, got {args.experts_dtype!r}")
    if args.new_tokens < 2 or args.prompt_tokens < 1 or args.repeat < 1 \
            or (args.prefill_chunk is not None and args.prefill_chunk < 1):
        parser.error("--new-tokens must be >= 2, --prompt-tokens, --repeat and "
                     "--prefill-chunk >= 1")

    return args, lengths, formats


def main(argv: list[str] | None = None) -> int:
    args, lengths, formats = _parse(argv)
    preset = get_preset(args.preset)
    family = args.family or preset.default_family
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    device = torch.device(args.device)
    # Byte ids: tokens the checkpoint's tokenizer knows, fixed by a seed.
    prompt = torch.randint(
        0, BYTE_TOKENS, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0)
    ).tolist()

    with tempfile.TemporaryDirectory(prefix="strata-bench-decode-") as tmp:
        start = time.perf_counter()
        ckpt = Path(args.model) if args.model else write_checkpoint(
            Path(tmp) / "ckpt", family, preset, n_layers=args.layers, dtype=dtype,
            progress=sys.stderr.isatty() and not args.json, router_skew=args.router_skew,
        )
        write_s = time.perf_counter() - start
        rates = device_rates(device) if device.type == "cuda" else None
        matmul_tflops = args.matmul_tflops or (rates.matmul_tflops if rates else None)
        run = (ckpt, device, dtype, prompt, args.new_tokens, args.repeat, args.prefill_chunk)
        strata = run_strata(*run, moe_share=matmul_tflops is not None)
        free_memory(device)
        compiled = loop = sampled = plain = in_graph = argmax = None
        sampling = cli_sampling() if args.cli_sampling else None

        def variant(switch=None, **options):
            """run_strata(*run, **options) with `switch` (owner, attribute, value) set while it
            runs, its config left out, the device's memory freed after."""
            with patch.object(*switch) if switch else contextlib.nullcontext():
                figures = run_strata(*run, **options)
            figures.pop("config")
            free_memory(device)
            return figures

        if args.plain_loop:
            plain = variant((decode_loop, "AHEAD_PATHS", frozenset()))
        if args.pick_in_graph:
            in_graph = variant((decode_steps, "GREEDY_PICK_IN_GRAPH",
                                not decode_steps.GREEDY_PICK_IN_GRAPH))
        if args.argmax_kernel:
            argmax = variant((sampling_module, "ARGMAX_KERNEL",
                              not sampling_module.ARGMAX_KERNEL))
        if args.cli_sampling:
            sampled = variant(sampling=sampling)
        if args.compile:
            compiled = variant(compile=True)
        if args.loop_prefill:
            loop = variant(grouped_prefill=False)
        quantized = {fmt: variant(experts_quant=experts_quant_for(fmt, dtype))
                     for fmt in formats}
        peer = None
        if not args.no_transformers:
            peer = run_transformers(ckpt, device, dtype, prompt, args.new_tokens, args.repeat)
            free_memory(device)
        prefills = [prefill_at(n, ckpt, device, dtype, args, matmul_tflops) for n in lengths]

    config = strata.pop("config")
    itemsize = torch.empty((), dtype=dtype).element_size()
    token_bytes = bytes_per_token(config, itemsize, args.prompt_tokens + args.new_tokens / 2)
    bandwidth_gbs = args.bandwidth_gbs or (rates.bandwidth_gbs if rates else None)
    bound_tok_s = bandwidth_gbs * 1e9 / token_bytes if bandwidth_gbs else None
    result = {
        "preset": preset.name,
        "family": family,
        "layers": config.n_layers,
        "dtype": args.dtype,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else
        platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "checkpoint_write_s": write_s,
        "strata": strata,
        "transformers": peer,
        "ratio": strata["decode_tok_s"] / peer["decode_tok_s"] if peer else None,
        "strata_compiled": compiled,
        "strata_cli_sampling": sampled,
        "strata_plain_loop": plain,
        "ahead_speedup": strata["decode_tok_s"] / plain["decode_tok_s"] if plain else None,
        "strata_pick_in_graph": in_graph,
        "pick_in_graph": None if in_graph is None else not decode_steps.GREEDY_PICK_IN_GRAPH,
        "pick_in_graph_speedup": in_graph["decode_tok_s"] / strata["decode_tok_s"]
        if in_graph else None,
        "strata_argmax": argmax,
        "argmax_kernel": None if argmax is None else not sampling_module.ARGMAX_KERNEL,
        "argmax_speedup": argmax["decode_tok_s"] / strata["decode_tok_s"] if argmax else None,
        "cli_sampling": sampling,
        "bound_share_cli_sampling": sampled["decode_tok_s"] / bound_tok_s
        if bound_tok_s and sampled else None,
        "strata_loop_prefill": loop,
        "prefill_chunk": strata["prefill_chunk"],
        "matmul_tflops": matmul_tflops,
        "moe_share": strata["moe_tflops"] / matmul_tflops
        if matmul_tflops and strata["moe_tflops"] else None,
        "prefill_ratio_loop": strata["prefill_tok_s"] / loop["prefill_tok_s"] if loop else None,
        "prefill_ratio": strata["prefill_tok_s"] / peer["prefill_tok_s"] if peer else None,
        "ratio_compiled": compiled["decode_tok_s"] / peer["decode_tok_s"]
        if peer and compiled else None,
        "bound_share_compiled": compiled["decode_tok_s"] / bound_tok_s
        if bound_tok_s and compiled else None,
        "bytes_per_token": token_bytes,
        "bandwidth_gbs": bandwidth_gbs,
        "bandwidth_from": "given" if args.bandwidth_gbs else (rates.source if rates else None),
        "measured_copy_gbs": rates.measured_copy_gbs if rates else None,
        "measured_matmul_tflops": rates.measured_matmul_tflops if rates else None,
        "bound_tok_s": bound_tok_s,
        "bound_share": strata["decode_tok_s"] / bound_tok_s if bound_tok_s else None,
        "tokens_equal_prefix": _common_prefix(strata["tokens"], peer["tokens"]) if peer else None,
        "quantized": quantized,
        "prefill_lengths": prefills,
    }
    for figures in quantized.values():
        figures["bytes_per_token"] = bytes_per_token(
            config, itemsize, args.prompt_tokens + args.new_tokens / 2, figures["blob_bytes"])
        figures["bound_tok_s"] = bandwidth_gbs * 1e9 / figures["bytes_per_token"] \
            if bandwidth_gbs else None
        figures["bound_share"] = figures["decode_tok_s"] / figures["bound_tok_s"] \
            if bandwidth_gbs else None
        figures["speedup"] = figures["decode_tok_s"] / strata["decode_tok_s"]
        figures["tokens_equal_prefix"] = _common_prefix(figures["tokens"], strata["tokens"])
    for figures in (in_graph, argmax):
        if figures:
            figures["same_tokens"] = figures["tokens"] == strata["tokens"]
    if args.json:
        print(json.dumps(result))
        return 0
    print_report(result, args)
    return 0

if __name__ == "__main__":
    sys.exit(main())
