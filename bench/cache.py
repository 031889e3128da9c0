"""Benchmark the expert cache: decode with every expert resident and at a small budget, prefill
of a long prompt with and without the loan, and transformers + accelerate offloading as the peer.

Makes its own checkpoint (`write_checkpoint` into a temporary directory, removed at the end) and
its own profile (the routing of a few seeded random prompts through the model with every expert
resident, as `strata profile` counts it), then measures, each engine on a fresh load:

- `resident`: no cache, every expert on the device (CUDA graphs on CUDA, as `strata generate`);
  `resident-eager`: the same, eager (the cache decodes eagerly: its host reads per layer);
- `cache-full`: the cache holding every expert (the target: within 1.1x of `resident`);
- `cache-budget`: the cache at `--budget-mib` (default: an `--expert-cache` of `--expert-share`
  of the experts), filled by the profile, every miss on the CPU and rounds eager (the baseline,
  not `strata generate`'s defaults on CUDA, which are `-streamauto-piecewise`);
  decode, and where a round's time goes;
- `cache-budget-streamN`, for each N of `--stream-misses` (or `auto`: the split from the rates
  kept for this machine, `strata.engine.cache.kept_rates`): the same with N of each decode
  layer's misses uploaded and computed on the device while the CPU computes the rest;
- with `--piecewise`, a `-piecewise` twin of each of those: decode replayed as CUDA graphs cut
  at the experts calls (`strata.engine.runtime.piecewise`; CUDA only, eager elsewhere);
- `prefill-loan` / `prefill-cpu`: a `--prefill-tokens` prompt at that budget, with the prompt
  loan and without it (its misses on the CPU).

Each model's K/V (and so its budget's share for the cache) is sized for its own runs: the prompt
and the new tokens for decode, the long prompt for prefill.
- `accelerate` (CUDA only, when `accelerate` is installed): transformers with `device_map`
  `max_memory={0: budget, "cpu": ...}` (the budget, or the small cache's MiB), offloading
  what does not fit to the CPU.

Decode tok/s for strata is its own figure (rounds / decode time); for transformers (new - 1) /
(time of `new` tokens - time of 1 token). Medians over `--repeat` runs after a warm-up. Each
decode run's JSON also has what the scheduler did to the process's threads a round
(`threads_per_round`, the median request's; `threads_per_round_each`: bench/thread_sched.py).

    python bench/cache.py --preset tiny --device cpu --loan-keep-slots 0    # here, a minute
    python bench/cache.py --preset olmoe-1b-7b --device cuda --budget-mib 4096 \
        --stream-misses auto,4 --piecewise                               # the defaults too
    python bench/cache.py ... --layers 8 --json                             # one JSON object
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from _common import add_model_arguments, byte_tokens, free_memory, fresh_request, sync
from strata.engine.cache.arena import slot_bytes_for
from strata.engine.cache.budget import MIB
from strata.engine.cache.build import plan_cache
from strata.engine.cache.kept_rates import resolve_stream_misses
from strata.engine.cache.loan import KEEP_SLOTS_ENV
from strata.engine.experts.quant import expert_blob_bytes
from strata.engine.model.config import ModelConfig
from strata.engine.model.init_model import write_checkpoint
from strata.engine.model.moe import load_model
from strata.engine.model.presets import get_preset
from strata.engine.runtime.calibrate import collect_counts
from strata.engine.runtime.engine import Engine
from strata.engine.runtime.generate import GenerateOptions
from strata.formats.profile import Profile, fill_rank
from thread_sched import sched_per_round, sched_span, thread_scheds

PROFILE_PROMPTS = 4  # seeded random prompts of 256 tokens the profile counts, + 32 decoded


def make_profile(ckpt: Path, device, dtype) -> Profile:
    model = load_model(ckpt, device=device, dtype=dtype)
    prompts = [byte_tokens(256, 100 + i) for i in range(PROFILE_PROMPTS)]
    counts, figures = collect_counts(model, prompts, decode_tokens=32)
    del model
    free_memory(device)
    return Profile.for_model(counts, ModelConfig.from_dir(ckpt), {"source": "bench/cache.py",
                                                                  **figures})


def cached(ckpt, device, dtype, profile, max_context, small, *, loan=True, **options):
    """An engine whose model runs through the cache; `small`: None (every expert), or the
    flags' values {"budget_mib": ...} or {"expert_cache_mib": ...}; `options`: CacheConfig's
    others, `stream_misses` N or "auto" (resolved from the kept rates, its note on stderr)."""
    config = ModelConfig.from_dir(ckpt)
    rank, _ = fill_rank(profile, config.n_layers, config.n_experts)
    stream, notes = resolve_stream_misses(options.pop("stream_misses", 0), config, dtype, device)
    for note in notes:
        print(f"bench/cache.py: {note}", file=sys.stderr, flush=True)
    cache = plan_cache(config, dtype, device, max_context=max_context, prefill_chunk=512,
                       rank=rank, prefill_loan=loan, stream_misses=stream, **(small or {}),
                       **options)
    return Engine.open(ckpt, device=device, dtype=dtype, cache=cache, max_context=max_context)


def run_decode(engine, prompt, n_new, repeat, max_context, cuda_graphs=True,
               piecewise=False, sampling: dict | None = None) -> dict:
    """Greedy, or with `sampling`'s options (temperature, top_p, top_k, seed)."""
    options = GenerateOptions(max_new=n_new, max_context=max_context, ignore_stop=True,
                              cuda_graphs=cuda_graphs, piecewise_graphs=piecewise,
                              **(sampling or {"temperature": 0.0}))
    fresh_request(engine, prompt, options)  # warm-up
    return decode_figures([scheduled_request(engine, prompt, options) for _ in range(repeat)])


def run_decode_interleaved(engine, prompt, n_new, repeat, max_context, setups: dict,
                           cuda_graphs=True, piecewise=False) -> dict[str, dict]:
    """`run_decode`'s figures (greedy) for each of `setups`, a name -> a function that sets
    `engine` up for it (an attribute of its cache, say), their requests interleaved: a warm-up
    each, then `repeat` sweeps of one request each. A machine's drift over the run then falls
    on every setup alike, where runs one after the other would each catch a part of it."""
    options = GenerateOptions(max_new=n_new, max_context=max_context, ignore_stop=True,
                              cuda_graphs=cuda_graphs, piecewise_graphs=piecewise,
                              temperature=0.0)
    requests: dict[str, list] = {name: [] for name in setups}
    for sweep in range(repeat + 1):  # the first sweep warms up each setup
        for name, setup in setups.items():
            setup()
            request = scheduled_request(engine, prompt, options)
            if sweep:
                requests[name].append(request)
    return {name: decode_figures(runs) for name, runs in requests.items()}


def scheduled_request(engine, prompt, options) -> tuple:
    """(`fresh_request`'s result, what the scheduler did to the process's threads over it:
    `thread_sched.sched_span`)."""
    before = thread_scheds()
    request = fresh_request(engine, prompt, options)
    return request, sched_span(before, thread_scheds())


def decode_figures(requests: list) -> dict:
    """A decode run's figures from its requests (`scheduled_request`'s): the median request's
    speed and cache stats, every request's round, whether all repeated the first's tokens, and
    each request's threads' counts a round (`thread_sched.sched_per_round`: the prompt's part
    included, a short prompt's being small beside the rounds')."""
    runs = [run for run, _ in requests]
    threads = [sched_per_round(span, max(1, len(run.tokens) - 1)) for run, span in requests]
    median = sorted(range(len(runs)), key=lambda i: runs[i].decode_tok_s)[len(runs) // 2]
    best = runs[median]  # the median run
    out = {
        "tokens": runs[0].tokens,
        "prefill_tok_s": statistics.median(r.prefill_tok_s for r in runs),
        "decode_tok_s": best.decode_tok_s,
        "decode_ms_per_round": best.decode_ms_per_round,
        "decode_ms_per_round_each": [r.decode_ms_per_round for r in runs],
        # The host's waits for the tokens (the device's work), a round: `decode_token_wait_s`.
        "decode_token_wait_ms_per_round":
            1000 * best.decode_token_wait_s / max(best.decode_rounds, 1),
        "decode_path": best.decode_path,
        "deterministic": all(r.tokens == runs[0].tokens for r in runs),
        "threads_per_round": sched_per_round(requests[median][1],
                                             max(1, len(best.tokens) - 1), by_name=True),
        "threads_per_round_each": threads,
    }
    if best.cache is not None:
        out["cache"] = best.cache.as_dict()
    return out


def run_prefill(engine, prompt, repeat, max_context, prefill_chunk: int | None = 512) -> dict:
    """`prefill_chunk` None: the engine's default (through a cache, the chunk it planned)."""
    options = GenerateOptions(max_new=1, max_context=max_context, temperature=0.0,
                              ignore_stop=True, prefill_chunk=prefill_chunk)
    fresh_request(engine, prompt, options)  # warm-up (and the loan's first refill)
    runs = [fresh_request(engine, prompt, options) for _ in range(repeat)]
    best = sorted(runs, key=lambda r: r.prefill_s)[len(runs) // 2]
    return {"prefill_s": best.prefill_s, "prefill_tok_s": best.prefill_tok_s,
            "cache": best.cache.as_dict()}


def run_accelerate(ckpt, device, dtype, prompt, n_new, budget_mib) -> dict | None:
    """transformers + accelerate offloading, or None (with a note on stderr) when it cannot run."""
    if device.type != "cuda":
        print("bench/cache.py: the accelerate peer runs on CUDA only: skipped", file=sys.stderr)
        return None
    try:
        import accelerate  # noqa: F401  (device_map needs it)
        import transformers
    except ImportError as err:
        print(f"bench/cache.py: the accelerate peer is skipped: {err}", file=sys.stderr)
        return None
    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="strata-bench-offload-") as offload:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            ckpt, dtype=dtype, device_map="auto", offload_folder=offload,
            max_memory={device.index or 0: f"{int(budget_mib)}MiB", "cpu": "200GiB"},
        )
        model.eval()
        ids = torch.tensor([prompt], device=device)

        def timed(n: int) -> float:
            sync(device)
            start = time.perf_counter()
            with torch.inference_mode():
                model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
            sync(device)
            return time.perf_counter() - start

        one, full = timed(1), timed(n_new)
    return {"decode_tok_s": (n_new - 1) / (full - one) if full > one else float("nan"),
            "decode_ms_per_round": 1000 * (full - one) / (n_new - 1), "generate_s": full}


def cache_mib_for_share(ckpt, dtype, share: float) -> float:
    """The `--expert-cache` MiB that holds `share` of the experts (at least one slot)."""
    config = ModelConfig.from_dir(ckpt)
    return share_mib(config, expert_blob_bytes(config.expert_width, config.hidden_size, dtype),
                     share)


def share_mib(config: ModelConfig, blob_bytes: int, share: float) -> float:
    """The `--expert-cache` MiB that holds `share` of the experts (at least one slot) in slots
    of `blob_bytes` blobs (a quantized store's are smaller)."""
    slots = max(1, round(share * config.n_layers * config.n_experts))
    return slots * slot_bytes_for(blob_bytes) / MIB


def _split(cache: dict) -> dict:
    """Per decode round: ms in the cache's device part, the CPU, waiting, and outside."""
    d = cache["decode"]
    n = max(d["passes"], 1)
    return {k: 1000 * d[f"{k}_s"] / n for k in ("device", "cpu", "wait", "forward")}


def _progress(name: str, run: dict) -> None:
    """One line on stderr as each decode run ends: a cut-short run still says what it measured."""
    each = ", ".join(f"{ms:.1f}" for ms in run["decode_ms_per_round_each"])
    split = "".join(f", {k} {ms:.1f}" for k, ms in _split(run["cache"]).items()) \
        if "cache" in run else ""
    print(f"bench/cache.py: {name}: {run['decode_tok_s']:.2f} tok/s, "
          f"{run['decode_ms_per_round']:.2f} ms/round (each run: {each}{split})",
          file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(parser, preset="olmoe-1b-7b")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prefill-tokens", type=int, default=4096,
                        help="the long prompt's tokens (0: no prefill runs)")
    parser.add_argument("--budget-mib", type=float,
                        help="the small cache's --vram-budget-mib (default: --expert-share)")
    parser.add_argument("--expert-share", type=float, default=0.25,
                        help="without --budget-mib: --expert-cache MiB for this share of the "
                        "experts (the budget: the host's default)")
    parser.add_argument("--loan-keep-slots", type=int,
                        help=f"slots a loan leaves (sets {KEEP_SLOTS_ENV}; engine default 128)")
    parser.add_argument("--peer-new-tokens", type=int, default=16,
                        help="tokens the (slow) accelerate peer generates")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per engine (median)")
    parser.add_argument("--no-peer", action="store_true", help="skip transformers + accelerate")
    parser.add_argument("--stream-misses", default="",
                        help="comma-separated N or auto: a cache-budget run with "
                        "--stream-misses N each")
    parser.add_argument("--piecewise", action="store_true",
                        help="a piecewise-graph twin of each cache-budget run")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    args = parser.parse_args(argv)
    if args.new_tokens < 2 or args.peer_new_tokens < 2 or args.repeat < 1:
        parser.error("--new-tokens and --peer-new-tokens must be >= 2, --repeat >= 1")
    if args.loan_keep_slots is not None:
        os.environ[KEEP_SLOTS_ENV] = str(args.loan_keep_slots)

    preset = get_preset(args.preset)
    family = args.family or preset.default_family
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    device = torch.device(args.device)
    try:
        streams = [n if n == "auto" else int(n) for n in args.stream_misses.split(",") if n]
    except ValueError:
        streams = [0]
    if any(n != "auto" and n < 1 for n in streams):
        parser.error("--stream-misses takes auto or N >= 1 (cache-budget is the run with 0)")
    prompt = byte_tokens(args.prompt_tokens, 0)
    long_prompt = byte_tokens(args.prefill_tokens, 1)
    decode_context = args.prompt_tokens + args.new_tokens  # each model is sized for its runs
    prefill_context = args.prefill_tokens + 1
    runs: dict[str, dict | None] = {}
    with tempfile.TemporaryDirectory(prefix="strata-bench-cache-") as tmp:
        start = time.perf_counter()
        ckpt = write_checkpoint(Path(tmp) / "ckpt", family, preset, n_layers=args.layers,
                                dtype=dtype, progress=sys.stderr.isatty() and not args.json,
                                router_skew=args.router_skew)
        write_s = time.perf_counter() - start
        profile = make_profile(ckpt, device, dtype)
        small = ({"budget_mib": args.budget_mib} if args.budget_mib else
                 {"expert_cache_mib": cache_mib_for_share(ckpt, dtype, args.expert_share)})

        with Engine.open(ckpt, device=device, dtype=dtype, max_context=decode_context) as engine:
            runs["resident"] = run_decode(engine, prompt, args.new_tokens, args.repeat,
                                          decode_context)
            runs["resident-eager"] = run_decode(engine, prompt, args.new_tokens, args.repeat,
                                                decode_context, cuda_graphs=False)
        _progress("resident", runs["resident"])
        _progress("resident-eager", runs["resident-eager"])
        del engine
        free_memory(device)
        budget_runs = [("cache-budget", 0), *((f"cache-budget-stream{n}", n) for n in streams)]
        decode_runs = [("cache-full", None, 0, False)]
        for name, stream in budget_runs:
            decode_runs.append((name, small, stream, False))
            if args.piecewise:
                decode_runs.append((f"{name}-piecewise", small, stream, True))
        for name, size, stream, piecewise in decode_runs:
            with cached(ckpt, device, dtype, profile, decode_context, size, loan=False,
                        stream_misses=stream) as engine:
                if size is None and not engine.cache.budget.holds_every_expert:
                    print("bench/cache.py: the device cannot hold every expert: cache-full is "
                          "partial", file=sys.stderr)
                runs[name] = run_decode(engine, prompt, args.new_tokens, args.repeat,
                                        decode_context, piecewise=piecewise)
                runs[name]["startup"] = engine.cache.budget.startup_line()
            _progress(name, runs[name])
            del engine
            free_memory(device)
        prefill_runs = (("prefill-loan", True), ("prefill-cpu", False))
        for name, loan in prefill_runs if args.prefill_tokens else ():
            with cached(ckpt, device, dtype, profile, prefill_context, small,
                        loan=loan) as engine:
                runs[name] = run_prefill(engine, long_prompt, args.repeat, prefill_context)
                runs[name]["startup"] = engine.cache.budget.startup_line()
            print(f"bench/cache.py: {name}: {runs[name]['prefill_s']:.3f} s", file=sys.stderr,
                  flush=True)
            del engine
            free_memory(device)
        peer_mib = args.budget_mib or small["expert_cache_mib"]
        runs["accelerate"] = None if args.no_peer else run_accelerate(
            ckpt, device, dtype, prompt, args.peer_new_tokens, peer_mib)
        if runs["accelerate"]:
            print(f"bench/cache.py: accelerate: {runs['accelerate']['decode_tok_s']:.3f} tok/s",
                  file=sys.stderr, flush=True)
        free_memory(device)

    full, small, peer = runs["cache-full"], runs["cache-budget"], runs["accelerate"]
    result = {
        "preset": preset.name, "family": family, "layers": args.layers or preset.n_layers,
        "router_skew": args.router_skew,
        "dtype": args.dtype, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else
        platform.processor() or platform.machine(),
        "torch": torch.__version__, "date": datetime.date.today().isoformat(),
        "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
        "prefill_tokens": args.prefill_tokens, "small_cache": small,
        "checkpoint_write_s": write_s, "runs": runs,
        "full_over_resident": runs["resident"]["decode_tok_s"] / full["decode_tok_s"],
        "full_over_resident_eager": runs["resident-eager"]["decode_tok_s"]
        / full["decode_tok_s"],
        "full_tokens_equal": full["tokens"] == runs["resident-eager"]["tokens"],
        "budget_over_peer": small["decode_tok_s"] / peer["decode_tok_s"] if peer else None,
        "budget_runs_over_peer": {name: runs[name]["decode_tok_s"] / peer["decode_tok_s"]
                                  for name, *_ in decode_runs[1:]} if peer else None,
        "loan_speedup": runs["prefill-cpu"]["prefill_s"] / runs["prefill-loan"]["prefill_s"]
        if args.prefill_tokens else None,
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"expert cache: {family} {preset.name} ({result['layers']} layers), {args.dtype}, "
          f"{result['device_name']} ({device}); {args.prompt_tokens}-token prompt, "
          f"{args.new_tokens} new tokens, greedy; medians of {args.repeat}")
    print(f"decode at the small budget: {small['startup']}")
    if args.prefill_tokens:
        print(f"a long prompt at the small budget: {runs['prefill-loan']['startup']}")
    print(f"{'run':<32}{'slots':>7}{'hit rate':>10}{'CPU exp/layer':>15}{'decode tok/s':>14}"
          f"{'ms/round':>10}  path")
    names = ["resident", "resident-eager", *(name for name, *_ in decode_runs), "accelerate"]
    for name in names:
        r = runs[name]
        if r is None:
            continue
        c = r.get("cache", {}).get("decode")
        slots = str(r["cache"]["slots"]) if "cache" in r else "-"
        hit = f"{100 * c['hit_rate']:.1f}%" if c else "-"
        cpu = f"{c['cpu_experts_per_layer']:.2f}" if c else "-"
        print(f"{name:<32}{slots:>7}{hit:>10}{cpu:>15}{r['decode_tok_s']:>14.1f}"
              f"{r['decode_ms_per_round']:>10.2f}  {r.get('decode_path', 'transformers')}")
    split = _split(small["cache"])
    print(f"cache-budget, a decode round of {small['decode_ms_per_round']:.2f} ms: device "
          f"{split['device']:.2f} ms, CPU {split['cpu']:.2f} ms (waiting {split['wait']:.2f}), "
          f"in the cache {split['forward']:.2f} ms, outside it "
          f"{small['decode_ms_per_round'] - split['forward']:.2f} ms")
    print(f"resident / cache-full decode: {result['full_over_resident']:.2f}x (CUDA graphs "
          f"where there are), {result['full_over_resident_eager']:.2f}x eager; tokens equal: "
          f"{result['full_tokens_equal']}")
    if peer:
        for name, ratio in result["budget_runs_over_peer"].items():
            print(f"{name} / accelerate decode: {ratio:.1f}x")
    if not args.prefill_tokens:
        return 0
    for name in ("prefill-loan", "prefill-cpu"):
        r = runs[name]
        c = r["cache"]["prompt"]
        print(f"{name:<13} {args.prefill_tokens} tokens: {r['prefill_s']:.3f} s, "
              f"{r['prefill_tok_s']:.0f} tok/s; hit rate {100 * c['hit_rate']:.1f}%, CPU "
              f"{c['cpu_experts_per_layer']:.2f} experts a layer, lent "
              f"{r['cache']['lent_slots']} slots")
    print(f"loan speed-up on the prompt: {result['loan_speedup']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
