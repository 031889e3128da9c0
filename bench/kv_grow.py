"""Benchmark the elastic K/V (`--kv-grow`): the reference engine's table on ours.

The reference engine's proportions: the experts several times the device budget, and the whole
window's K/V about a quarter of it. The budget is `--budget-mib` (default: the experts' bytes over
`--expert-multiple`); `--max-context` (default) is the window whose K/V is `--kv-share` of it.
One checkpoint is written (or `--model` reused) and loaded once; its host expert store is shared
by every run, each run building a fresh cache (and K/V) around it, alternating without and with
the flag (the order swaps each round), with fixed seeds:

`--burn-in` rounds of both variants run first, untimed. `--kv-dtype bf16,int8` runs both
variants in each K/V cell dtype (`strata generate --kv-dtype`), in the same alternation, and
sets each dtype's figures beside the first's (int8 against bf16: decode and prefill tok/s,
slots); `--variants kv-grow` runs only the elastic one.

- `slots`: the expert cache's slots at start;
- `chat`: a `--chat-tokens` prompt and `--chat-new` greedy tokens: decode tok/s (after an
  untimed chat of a few tokens: the first run after a load or a new cache is slow);
- `long`: a `--long-tokens` prompt (32K) and `--long-new` tokens after it: prefill seconds
  (growth included) and decode ms per round after it; the K/V's growth.

The profile is the routing of `--profile-prompts` seeded prompts, counted as `strata profile`
counts it. Medians over `--rounds`; the ratios (with / without) are what the reference reported
(+68% slots, +15% short-chat tok/s on a 16 GB card).

    python bench/kv_grow.py --preset small --device cpu --budget-mib 12 --chunk-bytes 65536 \\
        --kv-init 128 --kv-step 128 --kv-floor 4 --long-tokens 768 --chat-new 16 --long-new 8 \\
        --prefill-chunk 64 --no-prefill-loan                     # here, on the CPU
    python bench/kv_grow.py --preset qwen3-30b-a3b --layers 16 --kv-floor 32 --kv-init 4096 \\
        [--router-skew 0.5]                  # the GPU (bench/gpu_session.sh's kv-grow stages)
    python bench/kv_grow.py ... --kv-dtype bf16,int8      # gpu_session.sh's kv-int8 stage
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from _common import (
    add_kv_env_arguments,
    add_model_arguments,
    add_proportion_arguments,
    byte_tokens,
    checkpoint_for,
    engine_around,
    free_memory,
    fresh_request,
    proportions,
    set_kv_env,
)
from strata.engine.cache.build import build_cached_experts, default_stream_misses, plan_cache
from strata.engine.kv.plan import plan_elastic_cache, start_elastic
from strata.engine.model.config import ModelConfig
from strata.engine.model.kv_cells import KV_DTYPES, cell_dtype_of
from strata.engine.runtime.calibrate import collect_counts
from strata.engine.runtime.generate import GenerateOptions
from strata.engine.runtime.load import load
from strata.formats.profile import rank_from_counts, uniform_rank

VARIANTS = ("without", "kv-grow")
WARMUP_TOKENS = 8  # the untimed chat each run starts with


def run_variant(variant, model, store, cfg, dtype, device, rank, sizing, args) -> dict:
    """One run: a fresh cache (and K/V) around the shared store, the chat, then the long one.
    `variant` is (without or kv-grow, the K/V cells' `--kv-dtype`)."""
    name, kv_name = variant
    cells = cell_dtype_of(kv_name, dtype)
    if name == "kv-grow":
        config, kv_grow, notes = plan_elastic_cache(cfg, dtype, device, profile=True,
                                                    rank=rank, kv_dtype=cells, **sizing)
    else:
        config, kv_grow, notes = plan_cache(cfg, dtype, device, rank=rank, kv_dtype=cells,
                                            **sizing), None, []
    model.experts = build_cached_experts(config, store, device)
    kv = start_elastic(model.experts, kv_grow) if kv_grow is not None else None
    common = {"max_context": sizing["max_context"], "temperature": 0.0, "ignore_stop": True,
              "prefill_chunk": sizing["prefill_chunk"]}
    with engine_around(model, kv, sizing["max_context"], cells) as engine:
        # Untimed first: on the GPU machine the first run after a load or a new cache took up
        # to 1.5x as long a round as the later ones.
        fresh_request(engine, byte_tokens(args.chat_tokens, 1),
                      GenerateOptions(max_new=min(args.chat_new, WARMUP_TOKENS), **common))
        chat = fresh_request(engine, byte_tokens(args.chat_tokens, 1),
                             GenerateOptions(max_new=args.chat_new, **common))
        long = fresh_request(engine, byte_tokens(args.long_tokens, 2),
                             GenerateOptions(max_new=args.long_new, **common))
        slots = engine.cache.arena.n_slots
    model.experts = None
    free_memory(device)
    return {
        "slots": slots, "notes": notes,
        "chat_decode_tok_s": chat.decode_tok_s, "chat_ms_per_round": chat.decode_ms_per_round,
        "kv_dtype": kv_name,
        "chat_hit_rate": chat.cache.decode.hit_rate,
        "chat_cpu_experts_per_layer": chat.cache.decode.cpu_experts_per_layer,
        "long_prefill_s": long.prefill_s, "long_prefill_tok_s": long.prefill_tok_s,
        "long_ms_per_round": long.decode_ms_per_round,
        "long_decode_tok_s": long.decode_tok_s,
        "long_hit_rate": long.cache.hit_rate,
        "kv": long.kv.as_dict() if long.kv is not None else None,
        "chat_tokens": chat.tokens,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(parser, preset="qwen3-30b-a3b")
    add_proportion_arguments(parser)
    parser.add_argument("--stream-misses", type=int,
                        help="the cache's --stream-misses (default: the fixed three eighths "
                        "of the top-k on CUDA, as the earlier results ran; strata generate's "
                        "default is auto)")
    parser.add_argument("--prefill-chunk", type=int, default=512)
    parser.add_argument("--chat-tokens", type=int, default=32)
    parser.add_argument("--chat-new", type=int, default=128)
    parser.add_argument("--long-tokens", type=int, default=32768)
    parser.add_argument("--long-new", type=int, default=32)
    parser.add_argument("--profile-prompts", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2, help="alternations (medians)")
    parser.add_argument("--burn-in", type=int, default=1,
                        help="untimed rounds of both variants before the timed ones")
    add_kv_env_arguments(parser)
    parser.add_argument("--no-prefill-loan", action="store_true")
    parser.add_argument("--kv-dtype", default="auto",
                        help=f"comma-separated K/V cell dtypes, of {', '.join(KV_DTYPES)}: each "
                        "runs every variant; the first is the others' reference (auto)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated, of {', '.join(VARIANTS)} (both)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.chat_new < 2 or args.long_new < 2:
        parser.error("--rounds must be >= 1, --chat-new and --long-new >= 2")
    kv_dtypes = [k for k in args.kv_dtype.split(",") if k]
    variants = [v for v in args.variants.split(",") if v]
    if not kv_dtypes or set(kv_dtypes) - set(KV_DTYPES) or len(set(kv_dtypes)) < len(kv_dtypes):
        parser.error(f"--kv-dtype takes distinct values of {', '.join(KV_DTYPES)}; got "
                     f"{args.kv_dtype!r}")
    if not variants or set(variants) - set(VARIANTS):
        parser.error(f"--variants takes {', '.join(VARIANTS)}; got {args.variants!r}")
    # Each (variant, K/V dtype), named as before when one dtype runs.
    runs_of = [(v, k) for k in kv_dtypes for v in VARIANTS if v in variants]
    label = {run: run[0] if len(kv_dtypes) == 1 else f"{run[0]} {run[1]}" for run in runs_of}
    set_kv_env(args)
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    with tempfile.TemporaryDirectory(prefix="strata-bench-kv-grow-") as tmp:
        ckpt = checkpoint_for(args, Path(tmp), dtype,
                              progress=sys.stderr.isatty() and not args.json)
        cfg = ModelConfig.from_dir(ckpt)
        router_skew = json.loads((ckpt / "config.json").read_text()).get("strata_router_skew", 0.0)
        budget_mib, max_context, figures = proportions(cfg, dtype, args)
        if max_context < args.long_tokens + args.long_new + 16:
            parser.error(f"the window of {max_context} cells does not hold the long run's "
                         f"{args.long_tokens} + {args.long_new} tokens: raise --budget-mib, "
                         "--kv-share or --max-context")
        stream = default_stream_misses(cfg, device) if args.stream_misses is None \
            else args.stream_misses
        sizing = {"max_context": max_context, "prefill_chunk": args.prefill_chunk,
                  "budget_mib": budget_mib, "reserve_mib": args.reserve_mib,
                  "prefill_loan": not args.no_prefill_loan, "stream_misses": stream}
        start = time.perf_counter()
        first = plan_cache(cfg, dtype, device, rank=uniform_rank(cfg.n_layers, cfg.n_experts),
                           **sizing)
        model = load(ckpt, device=device, dtype=dtype, cache=first).model
        load_s = time.perf_counter() - start
        store = model.experts.store
        prompts = [byte_tokens(256, 100 + i) for i in range(args.profile_prompts)]
        counts, _ = collect_counts(model, prompts, decode_tokens=16,
                                   prefill_chunk=args.prefill_chunk)
        rank = rank_from_counts(counts)
        model.experts.close()
        # Untimed whole runs first: on the GPU machine the rounds kept getting faster over the
        # first few runs after the load (34.6, 27.7, 25.7, 25.2 ms), whatever the variant.
        for _ in range(args.burn_in):
            for variant in runs_of:
                run_variant(variant, model, store, cfg, dtype, device, rank, sizing, args)
                print(f"bench/kv_grow.py: {label[variant]}: burn-in done", file=sys.stderr,
                      flush=True)
        runs: dict[str, list[dict]] = {label[v]: [] for v in runs_of}
        for round_ in range(args.rounds):
            for variant in runs_of if round_ % 2 == 0 else runs_of[::-1]:
                name = label[variant]
                runs[name].append(run_variant(variant, model, store, cfg, dtype, device, rank,
                                              sizing, args))
                run = runs[name][-1]
                print(f"bench/kv_grow.py: {name}: {run['slots']} slots, chat "
                      f"{run['chat_decode_tok_s']:.2f} tok/s, long prefill "
                      f"{run['long_prefill_s']:.2f} s, {run['long_ms_per_round']:.1f} ms/round "
                      "after", file=sys.stderr, flush=True)

    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    keys = ("slots", "chat_decode_tok_s", "long_prefill_s", "long_prefill_tok_s",
            "long_ms_per_round", "long_decode_tok_s")
    table = {name: {key: median(name, key) for key in keys} for name in runs}
    first = [label[v] for v in runs_of if v[1] == kv_dtypes[0]]
    ratios = {}
    if len(first) == 2:  # the elastic K/V against the fixed one, in the first dtype
        before, after = (table[name] for name in first)
        ratios = {key: after[key] / before[key] for key in
                  ("slots", "chat_decode_tok_s", "long_prefill_s", "long_ms_per_round")}
    # Each other dtype's run of a variant against the first dtype's (int8 against bf16).
    dtype_ratios = {
        label[v]: {key: table[label[v]][key] / table[label[(v[0], kv_dtypes[0])]][key]
                   for key in ("slots", "chat_decode_tok_s", "long_prefill_tok_s",
                               "long_decode_tok_s")}
        for v in runs_of if v[1] != kv_dtypes[0]}
    result = {
        "model": str(args.model or args.preset), "layers": cfg.n_layers, "dtype": args.dtype,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else
        platform.processor() or platform.machine(),
        "torch": torch.__version__, "date": datetime.date.today().isoformat(),
        "max_context": max_context, "stream_misses": stream, "rounds": args.rounds,
        "kv_dtypes": kv_dtypes,
        "burn_in": args.burn_in,
        "router_skew": router_skew, "proportions": figures,
        "load_s": load_s,
        "table": table, "runs": runs, "ratios": ratios, "kv_dtype_ratios": dtype_ratios,
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"elastic K/V: {result['model']} ({cfg.n_layers} layers, {args.dtype}) on "
          f"{result['device_name']} ({device}); budget {budget_mib:g} MiB, experts "
          f"{figures['experts_over_budget']:.1f}x it, --max-context {max_context} (whole-window "
          f"K/V {100 * figures['window_kv_share']:.0f}% of the budget); medians of "
          f"{args.rounds} alternations")
    for note in next((r[0]["notes"] for r in runs.values() if r[0]["notes"]), []):
        print(f"  {note}")
    width = max(10, *(len(name) + 2 for name in runs))
    print(f"{'':<{width}}{'slots':>8}{'chat tok/s':>12}{'long prefill s':>16}"
          f"{'decode after ms':>17}")
    for name, row in table.items():
        print(f"{name:<{width}}{row['slots']:>8.0f}{row['chat_decode_tok_s']:>12.1f}"
              f"{row['long_prefill_s']:>16.2f}{row['long_ms_per_round']:>17.2f}")
    if ratios:
        print(f"{'ratio':<{width}}{ratios['slots']:>8.2f}{ratios['chat_decode_tok_s']:>12.2f}"
              f"{ratios['long_prefill_s']:>16.2f}{ratios['long_ms_per_round']:>17.2f}")
    for name, r in dtype_ratios.items():
        print(f"{name} / {kv_dtypes[0]}: slots {r['slots']:.2f}x, chat decode tok/s "
              f"{r['chat_decode_tok_s']:.2f}x, long prefill tok/s {r['long_prefill_tok_s']:.2f}x, "
              f"decode after {r['long_decode_tok_s']:.2f}x")
    kv = next((r[0]["kv"] for r in runs.values() if r[0]["kv"]), None)
    if kv:
        print(f"long run's K/V: {kv['init_cells']} -> {kv['cells_mapped']} cells, "
              f"{kv['grows']} grows, {kv['slots_given_up']} slots given up, "
              f"{kv['relocated']} relocated, {kv['fresh_chunks']} fresh chunks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
