"""`strata init-model`: write a complete checkpoint with random weights."""

from __future__ import annotations

import argparse
import math
import sys

from strata.cli.device import torch_dtype
from strata.cli.errors import UsageError
from strata.engine.model.presets import DEFAULT_MAX_SHARD_BYTES, FAMILIES, PRESETS

DTYPE_CHOICES = ("bf16", "fp16", "fp32")
DEFAULT_MAX_SHARD_MIB = DEFAULT_MAX_SHARD_BYTES // 2**20


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `strata init-model` to `subparsers`."""
    parser = subparsers.add_parser(
        "init-model",
        help="write a checkpoint with random weights (for tests, benchmarks, a first run)",
        description=(
            "Write a complete checkpoint of a family and shape with random weights: config.json, "
            "safetensors shards named as the family's published checkpoints name them, and a "
            "byte-level tokenizer.json with a chat template. The bytes depend only on the "
            "arguments. Written into a temporary directory and renamed, so an interrupted run "
            "leaves nothing behind."
        ),
    )
    parser.add_argument("dir", metavar="DIR", help="where to write it (absent or empty)")
    parser.add_argument(
        "--family",
        help=f"tensor names and config fields: {', '.join(FAMILIES)} (default: the preset's own)",
    )
    parser.add_argument(
        "--preset", default="tiny", help=f"the shape: {', '.join(PRESETS)} (default: tiny)"
    )
    parser.add_argument(
        "--layers", type=int, metavar="N", help="keep only the first N layers (fits a disk)"
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument(
        "--router-skew", type=float, default=0.0, metavar="A",
        help="make routing favour some experts in each layer, as a trained model's does: "
        "router rows scaled by (rank + 1)^-A (default: 0, every expert about equally likely; "
        "0.5 sends about 70%% of a 128-expert layer's routing to a quarter of its experts)",
    )
    parser.add_argument(
        "--dtype", default="bf16", help="bf16, fp16 or fp32 (default: bf16)"
    )
    parser.add_argument(
        "--max-shard-mib",
        type=int,
        default=DEFAULT_MAX_SHARD_MIB,
        metavar="MIB",
        help="largest safetensors shard (default: %(default)s)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """`strata init-model`: check the arguments, write the checkpoint, say what was written."""
    from strata.engine.model.init_model import checkpoint_bytes, write_checkpoint_atomic
    from strata.engine.model.presets import get_preset

    try:
        preset = get_preset(args.preset)
        dtype = torch_dtype(args.dtype, DTYPE_CHOICES)
        if not (math.isfinite(args.router_skew) and args.router_skew >= 0):
            raise ValueError(
                f"--router-skew must be a finite number >= 0, got {args.router_skew:g}"
            )
        if args.max_shard_mib < 1:
            raise ValueError(f"--max-shard-mib must be at least 1, got {args.max_shard_mib}")
        if args.layers is not None:
            preset = preset.with_layers(args.layers)
        family = args.family or preset.default_family
        total_bytes = checkpoint_bytes(family, preset, dtype)  # also checks the family
        out = write_checkpoint_atomic(
            args.dir,
            family,
            preset,
            seed=args.seed,
            dtype=dtype,
            max_shard_bytes=args.max_shard_mib * 2**20,
            progress=sys.stderr.isatty(),
            router_skew=args.router_skew,
        )
    except ValueError as err:
        raise UsageError(str(err)) from None
    n_shards = len(list(out.glob("*.safetensors")))
    print(
        f"wrote {out}: {family} {preset.name}, {preset.n_layers} layers, "
        f"{total_bytes / 1e9:.3g} GB {args.dtype} in {n_shards} shard(s), seed {args.seed} "
        f"(random weights{f', router skew {args.router_skew:g}' if args.router_skew else ''})"
    )
    return 0
