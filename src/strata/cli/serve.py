"""`strata serve`: the OpenAI-compatible server (`strata.serve`) on one engine.

This module turns the flags into the server's options and a loader: every value is checked,
the checkpoint's config and tokenizer are read and the cache is planned (then released) before
the server starts, so that bad input is one line and exit status 2 at once; the long load runs
on the server's engine thread while `/health` answers 503. Every engine option of
`strata generate` applies (the expert cache's group, `--kv-grow`, `--policy`, ...).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from strata import settings
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
from strata.serve.options import LOG_LEVELS  # a light module: no torch, no web framework

__all__ = ["prepare", "register", "run"]

MIB = 1 << 20
# The conversation cache a server keeps by default: a quarter of the host's memory, at most
# this much (a bound on what parked conversations may take, not an allocation).
DEFAULT_CONVERSATION_CACHE_MIB = 16384
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `strata serve` to `subparsers`."""
    parser = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description=(
            "Serve a checkpoint over HTTP with the OpenAI API (/v1/chat/completions, "
            "/v1/completions, /v1/models), plus /v1/status, /metrics and /health. One request "
            "computes at a time, in arrival order; conversations are parked in host RAM and "
            "restored when they come back. Without --model, the tiny built-in random model."
        ),
    )
    parser.add_argument("--model", metavar="DIR", help="a checkpoint directory (HF layout)")
    parser.add_argument("--model-name", metavar="NAME",
                        help="the model's id in the API (default: the directory's name)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    parser.add_argument("--port", type=int, default=8080, help="port (8080; 0: a free one)")
    parser.add_argument("--api-key", metavar="KEY",
                        help="require 'Authorization: Bearer KEY' (also STRATA_API_KEY, which "
                        "keeps it out of the process list)")
    parser.add_argument("--max-queue", type=int, default=16, metavar="N",
                        help="requests that may wait behind the one computing; more get 503 "
                        "(16)")
    parser.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                        help="info: a line per request (info)")
    parser.add_argument("--max-new", type=int, default=512,
                        help="tokens a reply may take when the request gives no max_tokens "
                        "(512)")
    parser.add_argument("--max-context", type=int, default=4096,
                        help="K/V cells: a conversation's prompt and reply must fit (4096)")
    parser.add_argument("--device", help="cuda or cpu (default: cuda when present)")
    parser.add_argument("--dtype", default="auto",
                        help="auto (the checkpoint's own), bf16, fp16 or fp32")
    add_experts_dtype_argument(parser)
    add_prefill_chunk_argument(parser)
    parser.add_argument("--no-cuda-graphs", action="store_true",
                        help="run decode rounds and prompt chunks eagerly on CUDA")
    parser.add_argument("--no-piecewise-graphs", action="store_true",
                        help="with an expert cache that misses, on CUDA: eager decode rounds")
    add_compile_argument(parser)
    add_conversation_arguments(parser, mib=_default_conversation_cache_mib(), slots=8,
                               what="the conversations that requests leave")
    add_cache_arguments(parser)
    parser.set_defaults(run=run)


def _default_conversation_cache_mib() -> float:
    """A quarter of the host's memory, at most DEFAULT_CONVERSATION_CACHE_MIB."""
    from strata.machine import host_limit

    return float(min(DEFAULT_CONVERSATION_CACHE_MIB, host_limit().nbytes // 4 // MIB))


def _api_key(args: argparse.Namespace) -> str | None:
    from strata.serve.options import check_api_key

    key, where = args.api_key, "--api-key"
    if key is None:
        key, where = settings.read().api_key, settings.API_KEY
    try:
        return check_api_key(key, where)
    except ValueError as err:
        raise UsageError(str(err)) from None


def _options(args: argparse.Namespace, model_dir: Path) -> tuple[Any, Any]:
    """(ServeOptions, EngineOptions) of the flags; UsageError naming a bad one."""
    from strata.serve.options import ServeOptions

    if args.trace is not None:
        raise UsageError("--trace records the routing of one run: use it with strata generate; "
                         "strata serve does not take it")
    try:
        serve = ServeOptions(
            model_name=args.model_name or model_dir.resolve().name, host=args.host,
            port=args.port, api_key=_api_key(args), max_queue=args.max_queue,
            default_max_tokens=args.max_new)
    except ValueError as err:
        raise UsageError(str(err)) from None
    return serve, with_builtin_cache(args, engine_options_from_args(args), model_dir)


def _check_before_loading(model_dir: Path, engine: Any) -> Any:
    """The tokenizer; first every check the load would make that is quick: the config, the
    tokenizer, the cache's plan (profile, policy, budget; released at once, the load plans it
    again on the engine thread). UsageError for bad input."""
    from strata.engine.model.checkpoint import CheckpointError
    from strata.engine.model.config import ModelConfig
    from strata.engine.model.tokenizer import Tokenizer, TokenizerError
    from strata.engine.runtime.options import plan_engine_cache
    from strata.policies import OptionError, PolicyError, UnknownPolicyError

    try:
        config = ModelConfig.from_dir(model_dir)
        tokenizer = Tokenizer.from_dir(model_dir)
        plan, _ = plan_engine_cache(engine, config)
    except (CheckpointError, TokenizerError, ValueError, UnknownPolicyError,
            OptionError) as err:
        if isinstance(err, PolicyError) and not isinstance(err, ValueError):
            raise  # the front door's error path adds the tracing hint
        raise UsageError(" ".join(str(err).split())) from None
    if plan.config is not None:
        plan.config.backend.close()
    return tokenizer


def _loader(args: argparse.Namespace, model_dir: Path, engine_options: Any,
            tokenizer: Any) -> Any:
    """The function the server calls on its engine thread: the engine and its defaults."""
    from strata.cli.generate import stop_ids_of
    from strata.engine.runtime.generate import GenerateOptions
    from strata.serve.options import ServedModel

    def load() -> ServedModel:
        engine = open_engine(model_dir, engine_options, tokenizer=tokenizer)
        try:
            defaults = GenerateOptions(
                max_context=engine_options.max_context,
                prefill_chunk=args.prefill_chunk,
                stop_ids=stop_ids_of(model_dir, engine.model.config.eos_token_ids, tokenizer),
                cuda_graphs=not args.no_cuda_graphs, compile=args.compile,
                piecewise_graphs=not args.no_piecewise_graphs)
            return ServedModel(engine, defaults)
        except BaseException:
            engine.close()
            raise

    return load


def prepare(args: argparse.Namespace) -> tuple[Any, Any]:
    """(the loader, ServeOptions) of `strata serve`'s parsed flags, every quick check made
    (see the module's docstring); UsageError for bad input. The tests serve through this."""
    from strata.cli.generate import model_dir_from_args

    model_dir = model_dir_from_args(args)
    serve_options, engine_options = _options(args, model_dir)
    tokenizer = _check_before_loading(model_dir, engine_options)
    return _loader(args, model_dir, engine_options, tokenizer), serve_options


def run(args: argparse.Namespace) -> int:
    """`strata serve`: check everything quick, start listening, load, serve until SIGTERM."""
    from strata.engine.kv.elastic import KvFullError
    from strata.engine.model.checkpoint import CheckpointError
    from strata.engine.model.tokenizer import TokenizerError
    from strata.serve.server import serve

    load, options = prepare(args)
    if options.host not in LOOPBACK and options.api_key is None:
        print(f"strata: listening on {options.host} without an API key: anyone who can reach "
              "this port may use the model (--api-key or STRATA_API_KEY)", file=sys.stderr)
    try:
        serve(load, options, log_level=args.log_level)
    except (CheckpointError, TokenizerError, ValueError, KvFullError) as err:
        raise UsageError(f"the model could not be loaded: {' '.join(str(err).split())}") \
            from None
    return 0
