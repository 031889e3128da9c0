"""The engine's options of `strata generate`, `strata chat`, `strata profile` and `strata serve`,
and the `Engine` they open.

The flags here (`--device`, `--dtype`, `--max-context`, `--prefill-chunk`, the conversation
cache's) and the `expert cache` group (`strata.cli.cache_options`) become one frozen
`EngineOptions`; `open_engine` plans the cache from it (every value checked and the cache sized
before the long load, the plan's notes printed) and opens the engine. Any bad input is one
`UsageError` naming its flag.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from strata.cli.cache_options import cache_options_from_args
from strata.cli.device import parse_device, torch_dtype
from strata.cli.errors import UsageError

if TYPE_CHECKING:
    from strata.engine.model.tokenizer import Tokenizer
    from strata.engine.runtime.engine import Engine
    from strata.engine.runtime.options import EngineOptions

__all__ = ["add_conversation_arguments", "engine_options_from_args", "open_engine",
           "with_builtin_cache"]

PROGRESS_BAR_BYTES = 1 << 30  # show a loading bar for checkpoints at least this large


def add_conversation_arguments(parser: argparse.ArgumentParser, *, mib: float, slots: int,
                               what: str) -> None:
    """`--conversation-cache-mib` (default `mib`) and `--conversation-cache-slots` (`slots`);
    `what` says which conversations are parked, for the help."""
    group = parser.add_argument_group(
        "conversation cache",
        f"Park {what} in host RAM (pinned on CUDA), to be restored when a request continues "
        "one: only its new tokens are read. 0 MiB: off.",
    )
    group.add_argument("--conversation-cache-mib", type=float, default=mib, metavar="MIB",
                       help=f"host RAM for parked conversations ({mib:g})")
    group.add_argument("--conversation-cache-slots", type=int, default=slots, metavar="N",
                       help=f"at most this many parked conversations ({slots})")


def engine_options_from_args(args: argparse.Namespace, *,
                             max_context: int | None = None) -> EngineOptions:
    """The flags as one `EngineOptions` (`max_context`: instead of `--max-context`, for a
    command that sizes the window itself); UsageError naming the flag of a bad value."""
    from strata.engine.runtime.options import EngineOptions

    mib = getattr(args, "conversation_cache_mib", 0.0)
    slots = getattr(args, "conversation_cache_slots", 0)
    if mib < 0 or slots < 0:
        raise UsageError("--conversation-cache-mib and --conversation-cache-slots must be >= 0, "
                         f"got {mib:g} and {slots}")
    try:
        return EngineOptions(
            device=parse_device(args.device), dtype=torch_dtype(args.dtype),
            experts_dtype=getattr(args, "experts_dtype", "auto"),
            kv_dtype=getattr(args, "kv_dtype", "auto"),
            max_context=args.max_context if max_context is None else max_context,
            # Without a flag, a cache chooses its chunk from its budget.
            prefill_chunk=args.prefill_chunk,
            cache=cache_options_from_args(args),
            conversation_cache_mib=mib, conversation_cache_slots=slots)
    except ValueError as err:
        raise UsageError(str(err).replace("max_context", "--max-context", 1)
                         .replace("prefill_chunk", "--prefill-chunk", 1)) from None


def with_builtin_cache(args: argparse.Namespace, options: EngineOptions,
                       model_dir: Path) -> EngineOptions:
    """`options`, and for the built-in model (no `--model`: `model_dir` is its checkpoint) with
    neither `--expert-cache` nor `--vram-budget-mib`, an expert cache of half its experts
    (`builtin_expert_cache_mib`): as on a GPU too small for it, the cache misses and
    `--policy` has something to decide."""
    cache = options.cache
    if args.model is not None or cache.expert_cache_mib is not None or \
            cache.vram_budget_mib is not None:
        return options
    import dataclasses

    from strata.engine.experts.quant import experts_quant_for
    from strata.engine.model.builtin import builtin_expert_cache_mib
    from strata.engine.model.config import ModelConfig
    from strata.engine.model.moe import runtime_dtype

    dtype = runtime_dtype(ModelConfig.from_dir(model_dir), options.dtype)
    try:
        quant = experts_quant_for(options.experts_dtype, dtype)
    except ValueError as err:
        raise UsageError(str(err)) from None
    mib = builtin_expert_cache_mib(dtype, quant)
    return dataclasses.replace(options, cache=dataclasses.replace(cache, expert_cache_mib=mib))


def open_engine(model_dir: Path, options: EngineOptions, *,
                tokenizer: Tokenizer | None) -> Engine:
    """`Engine.from_options`, its plan's notes on stderr before the load, a loading bar for a
    large checkpoint on a terminal; UsageError for a bad checkpoint, tokenizer, value or a
    budget too small (a policy's own errors pass: `strata.cli.main` reports them)."""
    from strata.engine.model.checkpoint import CheckpointError
    from strata.engine.model.tokenizer import TokenizerError
    from strata.engine.runtime.engine import Engine

    weights_bytes = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    try:
        return Engine.from_options(
            model_dir, options, tokenizer=tokenizer,
            progress=sys.stderr.isatty() and weights_bytes >= PROGRESS_BAR_BYTES,
            on_note=lambda note: print(f"strata: {note}", file=sys.stderr))
    except (CheckpointError, TokenizerError, ValueError) as err:
        raise UsageError(" ".join(str(err).split())) from None
