"""Benchmark a long prompt's prefill at several `--prefill-chunk` sizes, at one device budget.

Each forward reads (with an expert cache: uploads through the prompt loan) the experts its
tokens route to once, so larger chunks move fewer expert bytes; attention runs in pieces of
`ATTENTION_PIECE_TOKENS` whatever the chunk, so they cost the routed rows' and activations'
workspace, which the cache pays in slots. For each size, in turn (the order reversed each
round): a fresh cache planned for that chunk around one shared host store, an untimed short
prompt, then the `--prompt-tokens` prompt and one token. Reported: slots, the workspace, prefill
seconds, expert bytes uploaded for the prompt, and each size's time over the first size's.

    STRATA_VMM_CHUNK_BYTES=65536 python bench/prefill_chunk.py --preset small --device cpu \\
        --budget-mib 24 --max-context 1536 --prompt-tokens 1024 --chunks 64,256   # the CPU
    python bench/prefill_chunk.py --preset qwen3-30b-a3b --layers 16 --budget-mib 12288 \\
        --max-context 36864 --chunks 512,2048                             # the GPU
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from _common import (
    add_model_arguments,
    add_proportion_arguments,
    byte_tokens,
    checkpoint_for,
    engine_around,
    free_memory,
    fresh_request,
    proportions,
    sync,
)
from strata.engine.cache.build import build_cached_experts, plan_cache
from strata.engine.cache.kept_rates import resolve_stream_misses
from strata.engine.model.config import ModelConfig
from strata.engine.runtime.calibrate import collect_counts
from strata.engine.runtime.generate import GenerateOptions
from strata.engine.runtime.load import load
from strata.formats.profile import rank_from_counts, uniform_rank

WARMUP_TOKENS = 1024  # the untimed prompt each run starts with


def run_chunk(chunk, model, store, cfg, dtype, device, rank, sizing, args) -> dict:
    """One size: a fresh cache planned for `chunk`, then the long prompt."""
    config = plan_cache(cfg, dtype, device, rank=rank, **{**sizing, "prefill_chunk": chunk})
    model.experts = build_cached_experts(config, store, device)
    options = GenerateOptions(max_new=1, max_context=sizing["max_context"], temperature=0.0,
                              ignore_stop=True, prefill_chunk=chunk)
    with engine_around(model, None, sizing["max_context"]) as engine:
        fresh_request(engine, byte_tokens(min(WARMUP_TOKENS, args.prompt_tokens), 3), options)
        sync(device)
        result = fresh_request(engine, byte_tokens(args.prompt_tokens, 2), options)
        slots = engine.cache.arena.n_slots
    model.experts = None
    free_memory(device)
    return {"chunk": chunk, "slots": slots, "workspace_mib": config.budget.workspace_bytes / 2**20,
            "prefill_s": result.prefill_s,
            "uploaded_gib": result.cache.prompt.uploaded_bytes / 2**30,
            "first_token": result.tokens[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(parser, preset="qwen3-30b-a3b")
    add_proportion_arguments(parser)
    parser.add_argument("--prompt-tokens", type=int, default=32768)
    parser.add_argument("--chunks", default="512,2048", help="comma-separated chunk sizes")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    args = parser.parse_args(argv)
    try:
        chunks = [int(c) for c in args.chunks.split(",")]
    except ValueError:
        chunks = []
    if not chunks or min(chunks) < 1 or len(set(chunks)) != len(chunks):
        parser.error(f"--chunks must be distinct positive sizes such as 512,2048, got "
                     f"{args.chunks!r}")
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    with tempfile.TemporaryDirectory(prefix="strata-bench-prefill-") as tmp:
        ckpt = checkpoint_for(args, Path(tmp), dtype)
        cfg = ModelConfig.from_dir(ckpt)
        budget_mib, max_context, figures = proportions(cfg, dtype, args)
        if max_context < args.prompt_tokens + 2:
            parser.error(f"the window of {max_context} cells does not hold the prompt's "
                         f"{args.prompt_tokens} tokens: raise --budget-mib or --max-context")
        stream, notes = resolve_stream_misses(None, cfg, dtype, device)  # strata generate's
        for note in notes:
            print(f"bench/prefill_chunk.py: {note}", file=sys.stderr, flush=True)
        sizing = {"max_context": max_context, "budget_mib": budget_mib,
                  "reserve_mib": args.reserve_mib, "prefill_loan": True, "stream_misses": stream}
        first = plan_cache(cfg, dtype, device, rank=uniform_rank(cfg.n_layers, cfg.n_experts),
                           **{**sizing, "prefill_chunk": min(chunks)})
        model = load(ckpt, device=device, dtype=dtype, cache=first).model
        store = model.experts.store
        counts, _ = collect_counts(model, [byte_tokens(256, 100)], decode_tokens=16,
                                   prefill_chunk=min(chunks))
        rank = rank_from_counts(counts)
        model.experts.close()
        runs: dict[int, list[dict]] = {c: [] for c in chunks}
        for round_ in range(args.rounds):
            for chunk in chunks if round_ % 2 == 0 else chunks[::-1]:
                start = time.perf_counter()
                run = run_chunk(chunk, model, store, cfg, dtype, device, rank, sizing, args)
                runs[chunk].append(run)
                print(f"bench/prefill_chunk.py: chunk {chunk}: {run['slots']} slots, prefill "
                      f"{run['prefill_s']:.2f} s, {run['uploaded_gib']:.1f} GiB uploaded "
                      f"({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
    base = statistics.median(r["prefill_s"] for r in runs[chunks[0]])
    table = {c: {"slots": runs[c][0]["slots"], "workspace_mib": runs[c][0]["workspace_mib"],
                 "prefill_s": statistics.median(r["prefill_s"] for r in runs[c]),
                 "uploaded_gib": runs[c][0]["uploaded_gib"]} for c in chunks}
    for row in table.values():
        row["prefill_over_first"] = row["prefill_s"] / base
    result = {"model": str(args.model or args.preset), "layers": cfg.n_layers,
              "device": str(device), "device_name": torch.cuda.get_device_name(device)
              if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "date": datetime.date.today().isoformat(), "prompt_tokens": args.prompt_tokens,
              "max_context": max_context, "proportions": figures, "rounds": args.rounds,
              "table": table, "runs": runs}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{args.prompt_tokens}-token prompt, {cfg.n_layers} layers, budget "
              f"{budget_mib:.0f} MiB, window {max_context} cells, {device}")
        print(f"{'chunk':>6} {'slots':>6} {'workspace MiB':>14} {'prefill s':>10} "
              f"{'GiB uploaded':>13} {'x first':>8}")
        for c, row in table.items():
            print(f"{c:>6} {row['slots']:>6} {row['workspace_mib']:>14.0f} "
                  f"{row['prefill_s']:>10.2f} {row['uploaded_gib']:>13.1f} "
                  f"{row['prefill_over_first']:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
