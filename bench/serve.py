"""Benchmark the agent scenario of bench/agents.py over HTTP: `strata serve` and the openai client.

The same turns (agents.TURNS: main, side, side, main, main2, side, main2, main), the same
prompts and the same engine configuration, without and with `--kv-grow`; each variant runs
first in-process (agents.run_variant, on an `Engine`), then through a `strata serve` process of
its own, driven by the official `openai` client: completions of token-id prompts, streamed,
greedy, `ignore_eos` (every turn generates `--new-tokens`) and `return_token_ids` (a follow-up
continues its conversation token for token, as in-process).

Per turn: the time to first token and decode tok/s in-process (the engine's `first_token_s`),
as the server measured them (`/v1/status`: the engine's, and from the request's arrival to its
first text), and as the client saw them (from sending the request to the first text; decode
from the first text to the last); the server's overhead is the client's figure against the
in-process one, per request (TTFT) and per token (ms).

    python bench/serve.py --preset tiny --device cpu --dtype fp32 --budget-mib 4 \\
        --max-context 1024 --chunk-bytes 4096 --kv-init 64 --kv-step 64 --kv-floor 2 \\
        --main-tokens 300 --side-tokens 40 --main2-tokens 400 --turn-tokens 8 \\
        --new-tokens 4 --prefill-chunk 64 --no-prefill-loan            # here, on the CPU
    python bench/serve.py --model CKPT --kv-floor 32 --kv-init 4096 --json  # the GPU machine
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai
import torch

from _common import (
    byte_tokens,
    checkpoint_for,
    set_kv_env,
)
from agents import (
    TURNS,
    VARIANTS,
    add_scenario_arguments,
    run_variant,
    scenario_counts,
    scenario_sizing,
)
from strata.engine.model.config import ModelConfig
from strata.formats.profile import Profile, rank_from_counts, save_profile

MODEL = "bench"


def turn_prompt(i: int, who: str, held: dict[str, list[int]], args) -> list[int]:
    """Turn `i`'s prompt, as agents.run_variant makes it (the smoke test checks they agree)."""
    if who in held:
        return held[who] + byte_tokens(args.turn_tokens, 1000 + i)
    lengths = {"main": args.main_tokens, "side": args.side_tokens, "main2": args.main2_tokens}
    return byte_tokens(lengths[who], 10 + i)


class ServerProcess:
    """`strata serve FLAGS` on a free port, its log read in a thread; a context manager that
    stops it with SIGTERM (the request in flight finishes) and waits for it."""

    def __init__(self, flags: list[str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "strata.cli", "serve", "--port", "0", "--model-name", MODEL,
             "--log-level", "info", *flags], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        port = self._wait(r"listening on http://[^:]+:(\d+)")[1]
        self.url = f"http://127.0.0.1:{port}"
        self._wait(rf"{MODEL} is ready")

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)

    def _wait(self, pattern: str, timeout_s: float = 1800.0) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if found := re.search(pattern, line):
                    return found
            if self.proc.poll() is not None:
                raise RuntimeError("strata serve stopped:\n" + "".join(self.lines[-20:]))
            time.sleep(0.05)
        raise TimeoutError(f"strata serve never said {pattern!r}")

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def server_flags(name: str, ckpt: Path, profile: Path, budget_mib: float, max_context: int,
                 args) -> list[str]:
    """`strata serve`'s flags for the engine agents.run_variant builds for variant `name`."""
    flags = ["--model", str(ckpt), "--device", args.device, "--dtype", args.dtype,
             "--max-context", str(max_context), "--prefill-chunk", str(args.prefill_chunk),
             "--vram-budget-mib", str(budget_mib), "--expert-profile", str(profile),
             "--conversation-cache-mib", str(args.conversation_cache_mib),
             "--conversation-cache-slots", str(args.conversation_cache_slots),
             "--max-new", str(args.new_tokens)]
    if args.reserve_mib is not None:
        flags += ["--vram-reserve-mib", str(args.reserve_mib)]
    if args.no_prefill_loan:
        flags.append("--no-prefill-loan")
    if name == "kv-grow":
        flags.append("--kv-grow")
    return flags


def timed_turn(client: openai.OpenAI, prompt: list[int], args) -> dict:
    """One streamed completion: its token ids and the client's clocks."""
    sent = time.perf_counter()
    first = last = None
    ids, usage = [], None
    for chunk in client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=args.new_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "return_token_ids": True}):
        now = time.perf_counter()
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.text and first is None:
                first = now  # the first text (a held-back partial character waits a round)
            if choice.finish_reason is not None:  # sent after the last decode round
                ids, last = choice.token_ids, now
                first = first or now
    rounds = usage.completion_tokens - 1
    return {"ids": ids, "reused_tokens": usage.prompt_tokens_details.cached_tokens,
            "client_ttft_s": first - sent,
            "client_decode_tok_s": rounds / (last - first) if rounds and last > first else 0.0}


def run_http(name: str, ckpt: Path, profile: Path, budget_mib: float, max_context: int,
             args) -> dict:
    """The turns through a `strata serve` process of variant `name`; per-turn figures."""
    flags = server_flags(name, ckpt, profile, budget_mib, max_context, args)
    turns, held = [], {}
    with ServerProcess(flags) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                               timeout=3600.0)
        for i in range(args.burn_in):  # untimed, as in-process
            timed_turn(client, byte_tokens(args.side_tokens, 900 + i), args)
        for i, who in enumerate(TURNS):
            prompt = turn_prompt(i, who, held, args)
            turn = timed_turn(client, prompt, args)
            if who != "side":
                held[who] = prompt + turn.pop("ids")[:-1]
            else:
                turn.pop("ids")
            last = httpx.get(f"{server.url}/v1/status", timeout=60).json()["last_request"]
            turn.update(turn=who, prompt_tokens=len(prompt),
                        server_first_token_s=last["first_token_s"],
                        server_ttft_s=last["ttft_s"], server_decode_tok_s=last["decode_tok_s"])
            turns.append(turn)
            print(f"bench/serve.py: {name}: {who} {len(prompt)} tokens ({turn['reused_tokens']} "
                  f"reused): client ttft {turn['client_ttft_s']:.3f} s, engine "
                  f"{last['first_token_s']:.3f} s; {turn['client_decode_tok_s']:.1f} tok/s",
                  file=sys.stderr, flush=True)
    return {"turns": turns}


def make_profile(ckpt: Path, cfg: ModelConfig, dtype, device, sizing: dict, args,
                 path: Path):
    """agents.py's profile: the routing of `--profile-prompts` prompts; saved to `path` for
    the server, and its rank for the in-process runs."""
    counts = scenario_counts(ckpt, cfg, dtype, device, sizing, args)
    save_profile(Profile.for_model(counts, cfg, {"bench": "serve.py"}), path)
    return rank_from_counts(counts)


def _ms_per_token_more(slow_tok_s: float, fast_tok_s: float) -> float | None:
    return 1000 / slow_tok_s - 1000 / fast_tok_s if slow_tok_s and fast_tok_s else None


def compare(inproc: list[dict], http: list[dict]) -> list[dict]:
    """Per turn: the in-process, server and client figures, and the server's overhead: the
    client's figures against the in-process ones (`overhead_*`), and against the server's own
    engine in the same process (`http_*`: HTTP, the event loop and the bridge alone)."""
    rows = []
    for a, b in zip(inproc, http, strict=True):
        rows.append({
            "turn": a["turn"], "prompt_tokens": a["prompt_tokens"],
            "reused_tokens": a["reused_tokens"], "http_reused_tokens": b["reused_tokens"],
            "inproc_ttft_s": a["ttft_s"], **{k: b[k] for k in b if k != "turn"},
            "inproc_decode_tok_s": a["decode_tok_s"],
            "overhead_ttft_s": b["client_ttft_s"] - a["ttft_s"],
            "overhead_ms_per_token": _ms_per_token_more(b["client_decode_tok_s"],
                                                        a["decode_tok_s"]),
            "http_ttft_s": b["client_ttft_s"] - b["server_first_token_s"],
            "http_ms_per_token": _ms_per_token_more(b["client_decode_tok_s"],
                                                    b["server_decode_tok_s"]),
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_scenario_arguments(parser)
    parser.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    args = parser.parse_args(argv)
    set_kv_env(args)  # the server processes inherit them
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    with tempfile.TemporaryDirectory(prefix="strata-bench-serve-") as tmp:
        ckpt = checkpoint_for(args, Path(tmp), dtype)
        cfg = ModelConfig.from_dir(ckpt)
        budget_mib, max_context, figures, sizing = scenario_sizing(parser, args, cfg, dtype,
                                                                   device)
        profile = Path(tmp) / "profile.npz"
        rank = make_profile(ckpt, cfg, dtype, device, sizing, args, profile)
        runs = {}
        for name in VARIANTS:
            inproc = run_variant(name, ckpt, cfg, dtype, device, rank, sizing, args)["turns"]
            http = run_http(name, ckpt, profile, budget_mib, max_context, args)["turns"]
            runs[name] = compare(inproc, http)
    result = {"model": str(args.model or args.preset), "layers": cfg.n_layers,
              "dtype": args.dtype, "device": str(device), "torch": torch.__version__,
              "date": datetime.date.today().isoformat(), "max_context": max_context,
              "proportions": figures, "turns": list(TURNS), "runs": runs,
              "command": "python bench/serve.py " + " ".join(argv or sys.argv[1:])}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"serve: {result['model']} ({cfg.n_layers} layers, {args.dtype}) on {device}; "
          f"budget {budget_mib:g} MiB, window {max_context} cells; ttft in s, decode in tok/s")
    print("ttft: in-process, the server's engine, the client; decode tok/s: in-process, the "
          "server's engine, the client; http: the client's over the server's engine")
    print(f"{'variant':<9}{'turn':<7}{'tokens':>8}{'reused':>8}{'ttft':>8}{'server':>8}"
          f"{'client':>8}{'tok/s':>8}{'server':>8}{'client':>8}{'http s':>8}{'ms/tok':>8}")
    nan = float("nan")
    for name, rows in runs.items():
        for r in rows:
            per_token = r["http_ms_per_token"]
            print(f"{name:<9}{r['turn']:<7}{r['prompt_tokens']:>8}{r['http_reused_tokens']:>8}"
                  f"{r['inproc_ttft_s']:>8.3f}{r['server_first_token_s']:>8.3f}"
                  f"{r['client_ttft_s']:>8.3f}{r['inproc_decode_tok_s']:>8.1f}"
                  f"{r['server_decode_tok_s']:>8.1f}{r['client_decode_tok_s']:>8.1f}"
                  f"{r['http_ttft_s']:>8.3f}{per_token if per_token is not None else nan:>8.2f}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
