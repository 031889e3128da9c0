"""`strata chat`: a multi-turn chat in the terminal, on one `Engine` for the whole session.

Each turn is the whole conversation rendered by the checkpoint's chat template; the engine
reuses the longest common prefix with the conversation it holds, so a turn reads only what is
new (the template may render the last reply's end differently from how generation stopped:
prefix reuse, not exact extension, makes that cheap). `/reset` starts a new conversation;
end of input (Ctrl-D) leaves. `--verbose` prints a line of figures per turn on stderr.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from strata.cli.cache_options import add_cache_arguments
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

RESET = "/reset"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `strata chat` to `subparsers`."""
    parser = subparsers.add_parser(
        "chat",
        help="chat with a model in the terminal; each turn reuses the last one's K/V",
        description=(
            "Chat with a checkpoint through its chat template: type a message, the reply "
            f"streams back. {RESET} starts a new conversation; end of input (Ctrl-D) leaves. "
            "Without --model, the tiny built-in random model."
        ),
    )
    parser.add_argument("--model", metavar="DIR", help="a checkpoint directory (HF layout)")
    parser.add_argument("--system", metavar="TEXT", help="a system message to start with")
    parser.add_argument("--max-new", type=int, default=512, help="tokens a reply may take (512)")
    parser.add_argument("--max-context", type=int, default=4096,
                        help="K/V cells: the whole conversation must fit (4096)")
    parser.add_argument("--device", help="cuda or cpu (default: cuda when present)")
    parser.add_argument("--dtype", default="auto",
                        help="auto (the checkpoint's own), bf16, fp16 or fp32")
    add_experts_dtype_argument(parser)
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy (0.8)")
    parser.add_argument("--top-p", type=float, default=0.95, help="nucleus mass, 1: off (0.95)")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k likeliest, 0: off (0)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (0)")
    add_prefill_chunk_argument(parser)
    add_compile_argument(parser)
    parser.add_argument("--verbose", action="store_true",
                        help="a line of figures per turn on stderr")
    add_conversation_arguments(parser, mib=0.0, slots=4, what="the conversations /reset leaves")
    add_cache_arguments(parser)
    parser.set_defaults(run=run)


def _options(args: argparse.Namespace) -> Any:
    from strata.engine.runtime.generate import GenerateOptions

    try:
        return GenerateOptions(max_new=args.max_new, max_context=args.max_context,
                               temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                               seed=args.seed, prefill_chunk=args.prefill_chunk,
                               compile=args.compile)
    except ValueError as err:
        raise UsageError(str(err)) from None


def _engine(args: argparse.Namespace) -> tuple[Any, Any]:
    """(engine, stop ids): the model, its cache and K/V as `strata generate` opens them."""
    from strata.cli.generate import model_dir_from_args, stop_ids_of
    from strata.engine.model.tokenizer import Tokenizer, TokenizerError

    engine_options = engine_options_from_args(args)
    model_dir = model_dir_from_args(args)
    try:
        tokenizer = Tokenizer.from_dir(model_dir)
    except TokenizerError as err:
        raise UsageError(" ".join(str(err).split())) from None
    engine_options = with_builtin_cache(args, engine_options, model_dir)
    engine = open_engine(model_dir, engine_options, tokenizer=tokenizer)
    return engine, stop_ids_of(model_dir, engine.model.config.eos_token_ids, tokenizer)


def _figures(result: Any) -> str:
    return (f"strata: {result.prompt_tokens} prompt tokens ({result.reused_tokens} reused), "
            f"prefill {result.prefill_tok_s:.1f} tok/s, decode {result.decode_tok_s:.1f} tok/s "
            f"({len(result.tokens)} tokens, {result.stop_reason})")


def run(args: argparse.Namespace) -> int:
    """`strata chat`: read a message a line, stream each reply, until end of input."""
    import dataclasses

    from strata.cli.generate import terminal_safe
    from strata.engine.kv.elastic import KvFullError

    options = _options(args)
    engine, stop_ids = _engine(args)
    options = dataclasses.replace(options, stop_ids=stop_ids)
    start = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(start)
    tty = sys.stdout.isatty()

    def stream(piece: str) -> None:
        sys.stdout.write(terminal_safe(piece) if tty else piece)
        sys.stdout.flush()

    with engine:
        while True:
            if sys.stdin.isatty():
                sys.stderr.write("> ")
                sys.stderr.flush()
            line = sys.stdin.readline()
            if not line:  # end of input
                break
            text = line.strip()
            if text == RESET:
                messages = list(start)
                print("(a new conversation)", flush=True)
                continue
            if not text:
                continue
            messages.append({"role": "user", "content": text})
            ids = engine.tokenizer.encode_chat(messages)
            try:
                result = engine.generate(ids, options, on_text=stream)
            except (ValueError, KvFullError) as err:
                # The conversation outgrew the window, or the K/V could not grow for it: this
                # turn is dropped, the chat goes on (a policy's error still ends it, exit 2).
                messages.pop()
                print(f"strata chat: {err}", file=sys.stderr)
                continue
            messages.append({"role": "assistant", "content": result.text})
            print(flush=True)
            if args.verbose:
                print(_figures(result), file=sys.stderr, flush=True)
    return 0
