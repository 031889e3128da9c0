"""Models whose experts run through the expert cache on the host backend, sized by a budget.

    model = cached_model(ckpt, expert_cache_mib=0.5)        # a mixed cache
    model = cached_model(ckpt)                              # every expert (the host default)

Chunks are 64 KiB (`CHUNK_BYTES`), so that tiny arenas span many chunks; the prompt loan is off
unless asked for. `model.experts.close()` releases the arena and the CPU worker.
"""

from __future__ import annotations

import torch

from strata import _vmm
from strata.engine.cache.build import CacheConfig, plan_cache
from strata.engine.model.config import ModelConfig
from strata.engine.model.moe import runtime_dtype
from strata.engine.runtime.load import load

CHUNK_BYTES = 65536


def cache_config(ckpt, *, dtype: torch.dtype | None = None, max_context: int = 128,
                 prefill_chunk: int = 48, **options) -> CacheConfig:
    """The CacheConfig `strata generate` would build on the CPU (`plan_cache`'s options)."""
    cfg = ModelConfig.from_dir(ckpt)
    options.setdefault("prefill_loan", False)
    return plan_cache(cfg, runtime_dtype(cfg, dtype), torch.device("cpu"),
                      max_context=max_context, prefill_chunk=prefill_chunk,
                      backend=_vmm.HostBackend(CHUNK_BYTES), **options)


def cached_model(ckpt, *, dtype: torch.dtype | None = None, **kwargs):
    """`load(ckpt, cache=cache_config(ckpt, ...)).model` on the CPU."""
    return load(ckpt, dtype=dtype, cache=cache_config(ckpt, dtype=dtype, **kwargs)).model
