"""The first-run model: the tiny preset with random weights, written once into the cache
directory, so that `strata generate` runs with no `--model`."""

from __future__ import annotations

import os
from pathlib import Path

from strata.engine.model.init_model import write_checkpoint_atomic

__all__ = ["BUILTIN_FAMILY", "BUILTIN_NAME", "BUILTIN_PRESET", "builtin_checkpoint", "cache_dir"]

BUILTIN_FAMILY = "qwen3_moe"
BUILTIN_PRESET = "tiny"
BUILTIN_NAME = f"builtin-{BUILTIN_PRESET}-{BUILTIN_FAMILY}-seed0-v1"  # bump v on format changes


def cache_dir() -> Path:
    """`$STRATA_CACHE_DIR`, else `$XDG_CACHE_HOME/strata`, else `~/.cache/strata`."""
    from strata.settings import read  # STRATA_* are read and checked there, and only there
    if (chosen := read().cache_dir) is not None:
        return chosen
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "strata"
    return Path.home() / ".cache" / "strata"


def builtin_checkpoint() -> tuple[Path, bool]:
    """The built-in tiny checkpoint (random weights) and whether this call created it.

    Created once, atomically, in `cache_dir()/models`; concurrent first runs are safe: the
    loser of the rename uses the winner's copy, which holds the same bytes.
    """
    path = cache_dir() / "models" / BUILTIN_NAME
    if (path / "config.json").is_file():
        return path, False
    try:
        write_checkpoint_atomic(path, BUILTIN_FAMILY, BUILTIN_PRESET, seed=0)
    except (ValueError, OSError):
        if (path / "config.json").is_file():  # another process made it first
            return path, False
        raise
    return path, True
