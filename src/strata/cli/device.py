"""`--device`, `--dtype` and `--experts-dtype`: named as text in the parsers, resolved to
torch's only in `run`.

Building a parser must not import torch (`strata --help` would take seconds), so the dtype
choices are names here and torch is imported by the functions that resolve them.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING

from strata.cli.errors import UsageError

if TYPE_CHECKING:
    import torch

# The command-line name of each dtype -> the attribute of `torch` it names (None: the
# checkpoint's own).
DTYPE_NAMES: dict[str, str | None] = {
    "auto": None,
    "bf16": "bfloat16",
    "fp16": "float16",
    "fp32": "float32",
}


def torch_dtype(name: str, allowed: Sequence[str] = tuple(DTYPE_NAMES)) -> torch.dtype | None:
    """The torch dtype of a `--dtype` name (None for auto); UsageError for a name not in
    `allowed` (the command's choices)."""
    if name not in allowed:
        raise UsageError(f"unknown --dtype {name!r}; choose one of: {', '.join(allowed)}")
    attribute = DTYPE_NAMES[name]
    if attribute is None:
        return None
    import torch

    return getattr(torch, attribute)


def add_experts_dtype_argument(parser: argparse.ArgumentParser) -> None:
    """`--experts-dtype`, checked by `EngineOptions` (its names are
    `strata.engine.experts.quant.EXPERTS_DTYPES`, which imports torch)."""
    parser.add_argument(
        "--experts-dtype", default="auto", metavar="DTYPE",
        help="how the experts are kept, in host RAM and on the device: auto (the model's "
        "dtype), bf16, or quantized at load: int8 (a scale per output row), int4 (groups of "
        "32 along the input; int4-g64: of 64); the dense weights stay in --dtype (auto)")


def add_prefill_chunk_argument(parser: argparse.ArgumentParser) -> None:
    """`--prefill-chunk` (`GenerateOptions.prefill_chunk`, `EngineOptions.prefill_chunk`)."""
    parser.add_argument(
        "--prefill-chunk", type=int, metavar="N",
        help="prompt tokens per forward, each reading its experts once (default: 4096 with "
        "every expert resident; through the expert cache, where it sizes the workspace, the "
        "longest of 512-4096 whose workspace costs at most 10%% of the cache's slots)")


def add_compile_argument(parser: argparse.ArgumentParser) -> None:
    """`--compile` (`GenerateOptions.compile`). Off by default: it costs tens of seconds of
    compiling, which a later process partly reuses
    (bench/results/decode-profile-h200-2026-12-01.md)."""
    parser.add_argument(
        "--compile", action="store_true",
        help="torch.compile the CUDA-graph decode step of resident experts: a faster decode "
        "round after tens of seconds of compiling (twice in a run past its first 256-cell "
        "window), which later runs partly reuse")


def parse_device(name: str | None) -> torch.device:
    """--device: cuda or cpu (default: cuda when present); a UsageError names a bad one."""
    import torch

    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise UsageError(f"unknown --device {name!r}; use cuda or cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available here; use --device cpu")
    return device
