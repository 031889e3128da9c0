"""`strata profile --model DIR --prompts FILE -o profile.npz`: count which experts a model's
router picks while it reads some prompts, and write the counts as an expert profile.

The model runs in an `Engine` opened as `strata generate` opens it (every expert resident, or
through the expert cache when the cache options ask for it or the experts do not fit the
device), with a `RoutingCounter` around its experts: the model code does not change. Each
prompt is read in chunks of `--prefill-chunk` tokens, then `--decode N` tokens are generated
greedily and counted too. `--trace FILE` also records the run as a routing trace, one request
per prompt. The profile (`strata.formats.profile`) is what `--expert-profile` fills the
cache by and what `strata simulate --profile` starts from.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from strata.cli.cache_options import add_cache_arguments, check_trace_path
from strata.cli.device import torch_dtype
from strata.cli.engine_options import engine_options_from_args, open_engine
from strata.cli.errors import UsageError
from strata.cli.prompt_text import read_text_file

# The engine (and torch) are imported inside the functions `run` calls, so that building the
# parser is quick.
DTYPES = ("auto", "bf16", "fp32")
SOURCE = "strata profile"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `strata profile` to `subparsers`."""
    parser = subparsers.add_parser(
        "profile",
        help="count a model's expert routing over some prompts: an expert profile (.npz)",
        description=(
            "Run a model over prompts (one per line, or JSON Lines: a string or an object with "
            "'prompt' or 'text' per line) and write how often each expert was routed to, with "
            "the ranking and the model's identity, to an .npz that --expert-profile fills the "
            "expert cache by and `strata simulate --profile` reads."
        ),
    )
    parser.add_argument("--model", metavar="DIR", required=True,
                        help="a checkpoint directory (HF layout)")
    parser.add_argument("--prompts", metavar="FILE", required=True,
                        help="prompts, one per line (blank lines skipped); .jsonl: JSON Lines")
    parser.add_argument("-o", "--output", metavar="PATH", required=True,
                        help="where to write the profile (.npz)")
    parser.add_argument("--decode", type=int, default=0, metavar="N",
                        help="tokens to generate greedily after each prompt, counted too (0)")
    parser.add_argument("--prefill-chunk", type=int, default=512, metavar="N",
                        help="prompt tokens per forward (512)")
    parser.add_argument("--chat", action="store_true",
                        help="wrap each prompt as a user turn (chat template)")
    parser.add_argument("--device", help="cuda or cpu (default: cuda when present)")
    parser.add_argument("--dtype", default="auto", choices=list(DTYPES),
                        help="auto (the checkpoint's own, bf16 if it is fp16), bf16 or fp32")
    parser.add_argument("--json", action="store_true",
                        help="print the profile's summary as one JSON object")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    add_cache_arguments(parser)
    parser.set_defaults(run=run)


def read_prompts(path: str | Path) -> list[str]:
    """The prompts in a file: one per non-blank line, or for `.jsonl` one JSON value per
    non-blank line (a string, or an object with a string 'prompt' or 'text').

    Raises:
        UsageError: the file cannot be read, a JSON line is bad (its number is named), or the
            file holds no prompt.
    """
    path = Path(path)
    text = read_text_file(str(path), flag="--prompts")
    prompts = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        if path.suffix != ".jsonl":
            prompts.append(line)
            continue
        try:
            value = json.loads(line)
        except (ValueError, RecursionError) as err:  # not JSON, nested too deep, or 4300 digits
            reason = getattr(err, "msg", None) or (
                "nested too deeply" if isinstance(err, RecursionError) else "a number too long")
            raise UsageError(f"--prompts {path}:{number}: not JSON ({reason})") from None
        if isinstance(value, dict):
            value = value.get("prompt", value.get("text"))
        if not isinstance(value, str) or not value:
            raise UsageError(
                f"--prompts {path}:{number}: want a non-empty string or an object with a "
                "string 'prompt' or 'text'"
            )
        prompts.append(value)
    if not prompts:
        raise UsageError(f"--prompts {path} holds no prompt (every line is blank)")
    return prompts


def _progress(args: argparse.Namespace, total: int):
    from tqdm import tqdm

    return tqdm(total=total, unit="prompt", desc="profiling", file=sys.stderr, leave=False,
                disable=True if args.quiet else None)


def _encode_prompts(args: argparse.Namespace, tokenizer: Any, vocab_size: int) -> list[list[int]]:
    from strata.engine.runtime.generate import GenerateOptions, check_prompt

    prompts = []
    for number, text in enumerate(read_prompts(args.prompts), start=1):
        chat = [{"role": "user", "content": text}]
        ids = tokenizer.encode_chat(chat) if args.chat else tokenizer.encode(text)
        need = len(ids) + args.decode + 1
        try:
            check_prompt(ids, GenerateOptions(max_new=args.decode + 1, max_context=need),
                         vocab_size)
        except ValueError as err:
            raise UsageError(f"--prompts {args.prompts}: prompt {number}: {err}") from None
        prompts.append(ids)
    return prompts


def _open(args: argparse.Namespace) -> tuple[Any, list[list[int]]]:
    """(the engine, with the expert cache if the options ask for it; the prompts' ids): its
    window is the longest prompt and its decoded tokens."""
    from strata.engine.model.checkpoint import CheckpointError
    from strata.engine.model.config import ModelConfig
    from strata.engine.model.tokenizer import Tokenizer, TokenizerError

    torch_dtype(args.dtype, DTYPES)  # this command's choices
    model_dir = Path(args.model)
    try:
        config = ModelConfig.from_dir(model_dir)
        tokenizer = Tokenizer.from_dir(model_dir)
    except (CheckpointError, TokenizerError, ValueError) as err:
        raise UsageError(" ".join(str(err).split())) from None
    prompts = _encode_prompts(args, tokenizer, config.vocab_size)
    window = max(len(ids) for ids in prompts) + args.decode + 1
    options = engine_options_from_args(args, max_context=window)
    return open_engine(model_dir, options, tokenizer=None), prompts


def run(args: argparse.Namespace) -> int:
    """`strata profile`: run the model over the prompts, write the counts as a profile."""
    from strata.engine.runtime.calibrate import collect_counts
    from strata.engine.runtime.recording import new_trace_writer
    from strata.formats.profile import Profile, save_profile

    for flag, value, low in (("--decode", args.decode, 0), ("--prefill-chunk",
                                                            args.prefill_chunk, 1)):
        if value < low:
            raise UsageError(f"{flag} must be >= {low}, got {value}")
    output = Path(args.output)
    if not output.absolute().parent.is_dir():
        raise UsageError(f"-o {output}: its directory does not exist")
    if output.is_dir():
        raise UsageError(f"-o {output} is a directory; give a file path (profile.npz)")
    check_trace_path(args.trace)
    engine, prompts = _open(args)
    model = engine.model
    if engine.cache is not None:
        print(f"strata: {engine.cache.budget.startup_line()}", file=sys.stderr)
    writer = None if args.trace is None else new_trace_writer(model, SOURCE,
                                                              kv_dtype=engine.kv.cell_dtype)
    with engine, _progress(args, len(prompts)) as bar:
        counts, figures = collect_counts(
            model, prompts, decode_tokens=args.decode, prefill_chunk=args.prefill_chunk,
            on_prompt=bar.update, writer=writer, kv=engine.elastic, cells=engine.fixed,
        )
    meta = {
        "source": SOURCE,
        "model": str(args.model),
        "prompts_file": str(args.prompts),
        "device": model.device.type,
        "dtype": str(model.dtype).removeprefix("torch."),
        "chat": bool(args.chat),
        **figures,
    }
    profile = Profile.for_model(counts, model.config, meta)
    for flag, path, save in (("-o", output, lambda p: save_profile(profile, p)),
                             ("--trace", args.trace, lambda p: writer.save(p))):
        if path is None:
            continue
        try:
            save(path)
        except OSError as err:
            raise UsageError(f"{flag} {path}: {err.strerror or err}") from None
    summary = profile.summary()
    if args.json:
        print(json.dumps({"path": str(output), **summary}, sort_keys=True))
        return 0
    hottest = profile.order()[:3]
    names = ", ".join(f"{f // profile.n_experts}/{f % profile.n_experts}" for f in hottest)
    print(
        f"profiled {figures['prompts']} prompts: {figures['prompt_tokens']} prompt + "
        f"{figures['decode_tokens']} decoded tokens, {profile.n_layers} layers x "
        f"{profile.n_experts} experts ({summary['unused_experts']} never routed to); "
        f"hottest (layer/expert): {names}; wrote {output}",
        file=sys.stderr,
    )
    return 0
