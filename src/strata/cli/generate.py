"""`strata generate`: stream a model's continuation of a prompt, then its speed.

The text goes to stdout as it is generated; the stats block and notes go to stderr, so
`> file` captures only the text. `--json` prints one JSON object on stdout instead.
Without `--model`, a tiny built-in checkpoint with random weights is created once in the cache
directory and used (its text is gibberish: it shows the machinery works, not a model).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import unicodedata
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from strata import settings
from strata.cli.cache_options import add_cache_arguments, check_trace_path
from strata.cli.device import (
    add_compile_argument,
    add_experts_dtype_argument,
    add_prefill_chunk_argument,
)
from strata.cli.engine_options import (
    add_conversation_arguments,
    engine_options_from_args,
    open_engine,
    with_builtin_cache,
)
from strata.cli.errors import UsageError
from strata.cli.prompt_text import read_prompt
from strata.formats.jsonfile import read_json

# The engine (and torch) are imported in `run`'s helpers, so that building the parser is quick.
if TYPE_CHECKING:
    from strata.engine.model.tokenizer import Tokenizer
    from strata.engine.runtime.engine import Engine
    from strata.engine.runtime.generate import GenerateOptions, GenerateResult

__all__ = ["register", "run"]

DUMP_ENV = settings.DUMP_FIRST_LOGITS


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `strata generate` to `subparsers`."""
    parser = subparsers.add_parser(
        "generate",
        help="generate text from a prompt (no --model: a tiny built-in random model)",
        description=(
            "Generate a continuation of a prompt, streaming the text to stdout and a stats block "
            "(prompt tokens, prefill tok/s, decode ms per round and tok/s) to stderr. Without "
            "--model, a tiny built-in checkpoint with random weights is created once in the "
            "cache directory ($STRATA_CACHE_DIR, else $XDG_CACHE_HOME/strata, else "
            f"~/.cache/strata). {DUMP_ENV}=PATH writes the logits of the first generated "
            "position there (float32, raw bytes)."
        ),
    )
    parser.add_argument("prompt", nargs="?", help="the prompt (else --prompt-file, else stdin)")
    parser.add_argument("--prompt-file", metavar="PATH", help="read the prompt from a file")
    parser.add_argument("--model", metavar="DIR", help="a checkpoint directory (HF layout)")
    parser.add_argument("--max-new", type=int, default=128, help="tokens to generate (128)")
    parser.add_argument(
        "--max-context", type=int, default=4096, help="K/V cells: prompt + max-new must fit (4096)"
    )
    parser.add_argument("--device", help="cuda or cpu (default: cuda when present)")
    parser.add_argument(
        "--dtype", default="auto", help="auto (the checkpoint's own), bf16, fp16 or fp32"
    )
    add_experts_dtype_argument(parser)
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy (0.8)")
    parser.add_argument("--top-p", type=float, default=0.95, help="nucleus mass, 1: off (0.95)")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k likeliest, 0: off (0)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (0)")
    parser.add_argument(
        "--chat", action="store_true", help="wrap the prompt as a user turn (chat template)"
    )
    add_prefill_chunk_argument(parser)
    parser.add_argument(
        "--no-cuda-graphs", action="store_true",
        help="run decode rounds and prompt chunks eagerly on CUDA",
    )
    parser.add_argument(
        "--no-piecewise-graphs", action="store_true",
        help="with an expert cache that misses, on CUDA: run decode rounds eagerly instead of "
        "as CUDA graphs cut at the experts' host calls",
    )
    add_compile_argument(parser)
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object (text, tokens, stats)"
    )
    add_conversation_arguments(parser, mib=0.0, slots=4,
                               what="conversations (one request here: off by default)")
    add_cache_arguments(parser)
    parser.set_defaults(run=run)


# GenerateOptions and Sampler name their fields; the CLI user knows the flags.
FLAG_NAMES = {
    "max_new": "--max-new",
    "max_context": "--max-context",
    "prefill_chunk": "--prefill-chunk",
    "temperature": "--temperature",
    "top_p": "--top-p",
    "top_k": "--top-k",
    "seed": "--seed",
}


def _as_flags(message: str) -> str:
    head, sep, rest = message.partition(" ")
    return FLAG_NAMES.get(head, head) + sep + rest


def _read_prompt(args: argparse.Namespace) -> str:
    return read_prompt(args.prompt, args.prompt_file, max_context=args.max_context)


def model_dir_from_args(args: argparse.Namespace) -> Path:
    """`--model`, or the built-in tiny checkpoint (made once, said on stderr)."""
    from strata.engine.model.builtin import builtin_checkpoint

    if args.model is not None:
        return Path(args.model)
    try:
        path, created = builtin_checkpoint()
    except (ValueError, OSError) as err:
        raise UsageError(f"the built-in model could not be created: {err}") from None
    made = "created" if created else "using"
    print(
        f"strata: no --model: {made} the built-in tiny model in {path}; its weights are "
        "random, so its text is gibberish (pass --model DIR for a real checkpoint)",
        file=sys.stderr,
    )
    return path


def stop_ids_of(
    model_dir: Path, config_eos: tuple[int, ...], tokenizer: Tokenizer
) -> tuple[int, ...]:
    """config.json's eos ids, generation_config.json's, and the tokenizer's eos token."""
    ids = set(config_eos)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    generation_config = model_dir / "generation_config.json"
    if generation_config.is_file():
        try:
            document = read_json(generation_config, what="generation_config.json",
                                 error=UsageError)
        except UsageError:
            document = None  # optional file: a broken one only loses its stop ids
        eos = document.get("eos_token_id") if isinstance(document, dict) else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(i for i in eos if isinstance(i, int))
    return tuple(sorted(ids))


def terminal_safe(text: str) -> str:
    """Control characters other than newline and tab as U+FFFD: a random model's bytes must
    not drive the terminal (escape sequences). Only for a terminal; files get the raw text."""
    return "".join(
        "\ufffd" if unicodedata.category(c) == "Cc" and c not in "\n\t" else c for c in text
    )


def _stats_block(result: GenerateResult) -> str:
    ended = "an end-of-sequence token" if result.stop_reason == "eos" else "--max-new"
    return "\n".join(
        [
            f"prompt tokens  {result.prompt_tokens}",
            f"prefill        {result.prefill_tok_s:.1f} tok/s ({result.prefill_s * 1000:.1f} ms)",
            f"decode         {result.decode_ms_per_round:.2f} ms/round, "
            f"{result.decode_tok_s:.1f} tok/s ({result.decode_rounds} rounds, "
            f"{result.decode_path}; ended by {ended})",
            *(result.cache.summary_lines() if result.cache is not None else []),
            *([result.kv.summary_line()] if result.kv is not None else []),
        ]
    )


def _generate(engine: Engine, prompt_ids: list[int], options: GenerateOptions,
              stream: Callable[[str], None] | None, trace_path: str | None) -> GenerateResult:
    """The engine's request, with the routing recorded to `trace_path` (`--trace`) if given."""
    if trace_path is None:
        return engine.generate(prompt_ids, options, on_text=stream)
    from strata.engine.runtime.recording import RoutingRecorder, installed, new_trace_writer

    model = engine.model
    writer = new_trace_writer(model, "strata generate", kv_dtype=engine.kv.cell_dtype)
    recorder = RoutingRecorder(model.experts, writer)
    with installed(model, recorder), recorder.request(len(prompt_ids)):
        result = engine.generate(prompt_ids, options, on_text=stream)
    try:
        writer.save(trace_path)
    except OSError as err:
        raise UsageError(f"--trace {trace_path}: {err.strerror or err}") from None
    return result


def _dump_path() -> Path | None:
    """`STRATA_DUMP_FIRST_LOGITS`, checked before the (long) run: its directory must exist."""
    path = settings.read().dump_first_logits
    if path is not None and not path.absolute().parent.is_dir():
        raise UsageError(f"{DUMP_ENV}={path}: its directory does not exist")
    return path


def _generate_options(args: argparse.Namespace) -> GenerateOptions:
    """The generation options of the flags; UsageError naming the flag of a bad one."""
    from strata.engine.runtime.generate import GenerateOptions

    try:
        return GenerateOptions(
            max_new=args.max_new,
            max_context=args.max_context,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            prefill_chunk=args.prefill_chunk,
            cuda_graphs=not args.no_cuda_graphs,
            compile=args.compile,
            piecewise_graphs=not args.no_piecewise_graphs,
        )
    except ValueError as err:
        raise UsageError(_as_flags(str(err))) from None


def _open(
    args: argparse.Namespace, text: str, options: GenerateOptions
) -> tuple[Path, list[int], Engine]:
    """(model directory, prompt ids, the engine): the prompt is checked against config.json
    before the (long) load; any bad input is one UsageError."""
    from strata.engine.model.checkpoint import CheckpointError
    from strata.engine.model.config import ModelConfig
    from strata.engine.model.tokenizer import Tokenizer, TokenizerError
    from strata.engine.runtime.generate import check_prompt

    engine_options = engine_options_from_args(args)
    model_dir = model_dir_from_args(args)
    try:
        config = ModelConfig.from_dir(model_dir)  # the directory's first check
        tokenizer = Tokenizer.from_dir(model_dir)
        if args.chat:
            prompt_ids = tokenizer.encode_chat([{"role": "user", "content": text}])
        else:
            prompt_ids = tokenizer.encode(text)
        check_prompt(prompt_ids, options, config.vocab_size)
    except (CheckpointError, TokenizerError, ValueError) as err:
        raise UsageError(" ".join(str(err).split())) from None
    if options.top_k > config.vocab_size:
        raise UsageError(f"--top-k {options.top_k} is more than the model's vocabulary of "
                         f"{config.vocab_size} tokens; give at most {config.vocab_size} "
                         "(0: off)")
    engine_options = with_builtin_cache(args, engine_options, model_dir)
    return model_dir, prompt_ids, open_engine(model_dir, engine_options, tokenizer=tokenizer)


def _stream(args: argparse.Namespace) -> Callable[[str], None] | None:
    """Where the text goes as it is generated: stdout, masked for a terminal; None for --json."""
    if args.json:
        return None
    tty = sys.stdout.isatty()

    def stream(piece: str) -> None:
        sys.stdout.write(terminal_safe(piece) if tty else piece)
        sys.stdout.flush()

    return stream


def _report(args: argparse.Namespace, result: GenerateResult, engine: Engine,
            model_dir: Path) -> None:
    """The JSON object on stdout (--json), else the stats block on stderr."""
    if not args.json:
        if not result.text.endswith("\n"):
            print()
        print(_stats_block(result), file=sys.stderr)
        return
    document = {
        "text": result.text,
        "tokens": result.tokens,
        **result.stats(),
        "model": str(model_dir),
        "device": str(engine.model.device),
        "dtype": str(engine.model.dtype).removeprefix("torch."),
        "experts_dtype": engine.model.experts_dtype,
        "kv_dtype": engine.kv.layout.name,
    }
    if engine.cache is not None:
        document["cache"]["budget"] = engine.cache.budget.as_dict()
    print(json.dumps(document, ensure_ascii=False))


def run(args: argparse.Namespace) -> int:
    """`strata generate`: check every option, open the engine, stream the text, report."""
    dump_path = _dump_path()
    check_trace_path(args.trace)
    text = _read_prompt(args)
    options = _generate_options(args)
    model_dir, prompt_ids, engine = _open(args, text, options)
    with engine:
        if engine.cache is not None:
            print(f"strata: {engine.cache.budget.startup_line()}", file=sys.stderr)
            if args.compile:
                print("strata: --compile applies to the runtime without an expert cache: "
                      "ignored", file=sys.stderr)
        stop_ids = stop_ids_of(model_dir, engine.model.config.eos_token_ids, engine.tokenizer)
        options = dataclasses.replace(options, stop_ids=stop_ids)
        result = _generate(engine, prompt_ids, options, _stream(args), args.trace)
    if dump_path is not None:
        try:
            dump_path.write_bytes(result.first_logits.numpy().tobytes())
        except OSError as err:
            raise UsageError(f"{DUMP_ENV}={dump_path}: {err.strerror or err}") from None
    _report(args, result, engine, model_dir)
    return 0
