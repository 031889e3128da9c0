"""Benchmark the reference's agent scenario through `Engine`: conversations taking turns.

A main conversation, side agents and a second main conversation take turns on one engine, with
the conversation cache on, without and with `--kv-grow` (the reference: a 60K main agent, 15K
subagents and a 100K second main agent; time to first token never longer with the flag, 3.0 ->
2.8 s and 2.8 -> 2.6 s at the main agent's returns). The lengths are `--main-tokens`,
`--side-tokens` and `--main2-tokens` (scale them to the window: the reference's proportions are
4 : 1 : 6.7). The turns:

    main, side, side, main (its follow-up), main2, side, main2 (follow-up), main (follow-up)

A follow-up is the conversation so far plus `--turn-tokens` new ones: the engine restores it
from the conversation cache (growing the K/V first) and reads only what is new. Per turn: time
to first token (`first_token_s`: parking, the K/V's trim or growth and the restore included),
decode tok/s, reused tokens, and the K/V's cells, grows, trims, slots given up and refilled
during the turn. Before the turns, `--burn-in` untimed requests on the variant's engine (the
process's first kernels, cuBLAS handles and decode graphs) so that neither variant pays the
warm-up for the other.

    python bench/agents.py --preset small --device cpu --budget-mib 12 --chunk-bytes 65536 \\
        --kv-init 128 --kv-step 128 --kv-floor 4 --main-tokens 512 --side-tokens 128 \\
        --main2-tokens 768 --prefill-chunk 64 --no-prefill-loan           # here, on the CPU
    python bench/agents.py --preset qwen3-30b-a3b --layers 16 --kv-floor 32 --kv-init 4096 \\
        --main-tokens 16384 --side-tokens 4096 --main2-tokens 27648             # the GPU
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
from pathlib import Path

import torch

from _common import (
    add_kv_env_arguments,
    add_model_arguments,
    add_proportion_arguments,
    byte_tokens,
    checkpoint_for,
    free_memory,
    proportions,
    set_kv_env,
)
from strata.engine.cache.build import default_stream_misses, plan_cache
from strata.engine.kv.plan import plan_elastic_cache
from strata.engine.model.config import ModelConfig
from strata.engine.runtime.calibrate import collect_counts
from strata.engine.runtime.engine import Engine
from strata.engine.runtime.generate import GenerateOptions
from strata.engine.runtime.load import load
from strata.formats.profile import rank_from_counts, uniform_rank

VARIANTS = ("without", "kv-grow")
TURNS = ("main", "side", "side", "main", "main2", "side", "main2", "main")


def run_variant(name: str, ckpt: Path, cfg: ModelConfig, dtype: torch.dtype,
                device: torch.device, rank, sizing: dict, args) -> dict:
    """The turns on a fresh engine of variant `name`; per-turn figures."""
    if name == "kv-grow":
        cache, kv_grow, notes = plan_elastic_cache(cfg, dtype, device, profile=True, rank=rank,
                                                   **sizing)
    else:
        cache, kv_grow, notes = plan_cache(cfg, dtype, device, rank=rank, **sizing), None, []
    engine = Engine.open(ckpt, device=device, dtype=dtype, max_context=sizing["max_context"],
                         cache=cache, kv_grow=kv_grow,
                         conversation_cache_mib=args.conversation_cache_mib,
                         conversation_cache_slots=args.conversation_cache_slots)
    lengths = {"main": args.main_tokens, "side": args.side_tokens, "main2": args.main2_tokens}
    held: dict[str, list[int]] = {}  # each main conversation so far
    turns = []
    options = GenerateOptions(max_new=args.new_tokens, max_context=sizing["max_context"],
                              temperature=0.0, prefill_chunk=sizing["prefill_chunk"],
                              ignore_stop=True)
    with engine:
        for i in range(args.burn_in):  # untimed; parked by the first turn, never reused
            engine.generate(byte_tokens(args.side_tokens, 900 + i), options)
        for i, who in enumerate(TURNS):
            if who in held:
                prompt = held[who] + byte_tokens(args.turn_tokens, 1000 + i)
            else:
                prompt = byte_tokens(lengths[who], 10 + i)
            before = engine.elastic.stats.copy() if engine.elastic is not None else None
            result = engine.generate(prompt, options)
            if who != "side":
                held[who] = prompt + result.tokens[:-1]
            turn = {"turn": who, "prompt_tokens": len(prompt),
                    "reused_tokens": result.reused_tokens, "ttft_s": result.first_token_s,
                    "decode_tok_s": result.decode_tok_s,
                    "cells_mapped": engine.kv.mapped_cells,
                    "slots": engine.cache.arena.n_slots - int((~engine.cache.table.backed).sum())}
            if before is not None:
                after = engine.elastic.stats
                for key in ("grows", "trims", "slots_given_up", "refilled"):
                    turn[key] = getattr(after, key) - getattr(before, key)
            turns.append(turn)
            print(f"bench/agents.py: {name}: {who} {len(prompt)} tokens "
                  f"({result.reused_tokens} reused): ttft {result.first_token_s:.2f} s, "
                  f"{result.decode_tok_s:.1f} tok/s, {engine.kv.mapped_cells} cells",
                  file=sys.stderr, flush=True)
    free_memory(device)
    return {"notes": notes, "turns": turns}


def add_scenario_arguments(parser: argparse.ArgumentParser) -> None:
    """The scenario's flags (bench/serve.py runs the same scenario over HTTP)."""
    add_model_arguments(parser, preset="qwen3-30b-a3b")
    add_proportion_arguments(parser)
    for flag, default, text in (
            ("--main-tokens", 16384, None), ("--side-tokens", 4096, None),
            ("--main2-tokens", 27648, None),
            ("--turn-tokens", 64, "new tokens a follow-up adds to its conversation"),
            ("--new-tokens", 32, "tokens each turn generates"), ("--prefill-chunk", 2048, None),
            ("--conversation-cache-slots", 4, None), ("--profile-prompts", 2, None),
            ("--burn-in", 1, "untimed requests on each engine before its turns (1)")):
        parser.add_argument(flag, type=int, default=default, help=text)
    parser.add_argument("--conversation-cache-mib", type=float, default=16384.0)
    add_kv_env_arguments(parser)
    parser.add_argument("--no-prefill-loan", action="store_true")


def scenario_sizing(parser: argparse.ArgumentParser, args: argparse.Namespace,
                    cfg: ModelConfig, dtype: torch.dtype, device: torch.device):
    """(budget MiB, window cells, the proportions' figures, the cache's sizing) at the
    reference's proportions; the parser's error when the window cannot hold the longest
    conversation."""
    budget_mib, max_context, figures = proportions(cfg, dtype, args)
    longest = max(args.main_tokens, args.main2_tokens) + 2 * (args.turn_tokens +
                                                              args.new_tokens) + 16
    if max_context < longest:
        parser.error(f"the window of {max_context} cells does not hold the longest "
                     f"conversation ({longest} cells): raise --budget-mib, --kv-share or "
                     "--max-context, or shorten the turns")
    sizing = {"max_context": max_context, "prefill_chunk": args.prefill_chunk,
              "budget_mib": budget_mib, "reserve_mib": args.reserve_mib,
              "prefill_loan": not args.no_prefill_loan,
              "stream_misses": default_stream_misses(cfg, device)}  # fixed, as its results ran
    return budget_mib, max_context, figures, sizing


def scenario_counts(ckpt: Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                    sizing: dict, args: argparse.Namespace):
    """The profile's counts [L, E]: the routing of `--profile-prompts` prompts of 256 tokens
    and 16 decoded, through a cache planned with the uniform rank."""
    first = plan_cache(cfg, dtype, device, rank=uniform_rank(cfg.n_layers, cfg.n_experts),
                       **sizing)
    with load(ckpt, device=device, dtype=dtype, cache=first) as loaded:
        prompts = [byte_tokens(256, 100 + i) for i in range(args.profile_prompts)]
        counts, _ = collect_counts(loaded.model, prompts, decode_tokens=16,
                                   prefill_chunk=args.prefill_chunk)
    free_memory(device)
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_scenario_arguments(parser)
    parser.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    args = parser.parse_args(argv)
    set_kv_env(args)
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    with tempfile.TemporaryDirectory(prefix="strata-bench-agents-") as tmp:
        ckpt = checkpoint_for(args, Path(tmp), dtype)
        cfg = ModelConfig.from_dir(ckpt)
        budget_mib, max_context, figures, sizing = scenario_sizing(parser, args, cfg, dtype,
                                                                   device)
        rank = rank_from_counts(scenario_counts(ckpt, cfg, dtype, device, sizing, args))
        runs = {name: run_variant(name, ckpt, cfg, dtype, device, rank, sizing, args)
                for name in VARIANTS}
    result = {
        "model": str(args.model or args.preset), "layers": cfg.n_layers, "dtype": args.dtype,
        "device": str(device), "torch": torch.__version__,
        "date": datetime.date.today().isoformat(), "max_context": max_context,
        "proportions": figures, "turns": list(TURNS), "runs": runs,
        "ttft_ratio": [w["ttft_s"] / max(o["ttft_s"], 1e-9) for o, w in
                       zip(runs["without"]["turns"], runs["kv-grow"]["turns"], strict=True)],
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"agents: {result['model']} ({cfg.n_layers} layers, {args.dtype}) on {device}; "
          f"budget {budget_mib:g} MiB, window {max_context} cells")
    print(f"{'turn':<7}{'tokens':>8}{'reused':>8}{'ttft s':>9}{'+grow':>9}{'tok/s':>8}"
          f"{'+grow':>8}{'cells':>8}{'given':>7}{'refill':>7}")
    for plain, grown in zip(runs["without"]["turns"], runs["kv-grow"]["turns"], strict=True):
        print(f"{plain['turn']:<7}{plain['prompt_tokens']:>8}{grown['reused_tokens']:>8}"
              f"{plain['ttft_s']:>9.2f}{grown['ttft_s']:>9.2f}{plain['decode_tok_s']:>8.1f}"
              f"{grown['decode_tok_s']:>8.1f}{grown['cells_mapped']:>8}"
              f"{grown.get('slots_given_up', 0):>7}{grown.get('refilled', 0):>7}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
