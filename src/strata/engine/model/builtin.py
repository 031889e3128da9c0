"""The first-run model: the tiny preset with random weights, written once into the cache
directory, so that `strata generate` runs with no `--model`.

It runs with an expert cache that holds half of its experts (`builtin_expert_cache_mib`), as a
GPU too small for a model would: the cache misses, the CPU computes the misses, and `--policy`
has something to decide on the first model a user tries."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from strata.engine.model.init_model import write_checkpoint_atomic
from strata.engine.model.presets import get_preset
from strata.settings import cache_dir

if TYPE_CHECKING:
    import torch

__all__ = ["BUILTIN_CACHE_SHARE", "BUILTIN_FAMILY", "BUILTIN_NAME", "BUILTIN_PRESET",
           "builtin_checkpoint", "builtin_expert_cache_mib"]

BUILTIN_FAMILY = "qwen3_moe"
BUILTIN_PRESET = "tiny"
BUILTIN_NAME = f"builtin-{BUILTIN_PRESET}-{BUILTIN_FAMILY}-seed0-v1"  # bump v on format changes
# The share of the built-in model's experts its cache holds when no size or budget is given.
BUILTIN_CACHE_SHARE = 0.5


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


def builtin_expert_cache_mib(dtype: torch.dtype, experts_quant: str | None = None) -> float:
    """The `--expert-cache`, in MiB, that the built-in model runs with when neither
    `--expert-cache` nor `--vram-budget-mib` is given: BUILTIN_CACHE_SHARE of its experts (8 of
    16) in `dtype` (the dtype it runs in), or in `experts_quant` (`--experts-dtype`'s format).
    Its blob is a whole number of the cache's 256-byte slot alignment in every dtype and
    format (3 x 128 x 64 weights, scales a row or a group), so the MiB are exactly that many
    slots."""
    from strata.engine.experts.quant import expert_blob_bytes

    preset = get_preset(BUILTIN_PRESET)
    blob_bytes = expert_blob_bytes(preset.expert_width, preset.hidden_size, dtype,
                                   experts_quant)
    slots = int(preset.n_layers * preset.n_experts * BUILTIN_CACHE_SHARE)
    return slots * blob_bytes / (1 << 20)
