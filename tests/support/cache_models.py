"""Models whose experts run through the expert cache on the host backend, sized by a budget.

    model = cached_model(ckpt, expert_cache_mib=0.5)        # a mixed cache
    model = cached_model(ckpt)                              # every expert (the host default)

Chunks are 64 KiB (`CHUNK_BYTES`), so that tiny arenas span many chunks. `model.experts.close()`
releases the arena and the CPU worker.
"""

from __future__ import annotations

import torch

from strata import _vmm
from strata.engine.cache.arena import slot_bytes_for
from strata.engine.cache.budget import plan_budget
from strata.engine.cache.build import CacheConfig
from strata.engine.config import ModelConfig
from strata.engine.model import load_model, runtime_dtype

CHUNK_BYTES = 65536


def cache_config(
    ckpt,
    *,
    dtype: torch.dtype | None = None,
    max_context: int = 128,
    prefill_chunk: int = 48,
    budget_mib: float | None = None,
    reserve_mib: float | None = None,
    expert_cache_mib: float | None = None,
    **options,
) -> CacheConfig:
    """The CacheConfig `strata generate` would build on the CPU for these flag values."""
    cfg = ModelConfig.from_dir(ckpt)
    dtype = runtime_dtype(cfg, dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    backend = _vmm.HostBackend(CHUNK_BYTES)
    budget = plan_budget(
        cfg, dtype, torch.device("cpu"),
        slot_bytes=slot_bytes_for(3 * cfg.expert_width * cfg.hidden_size * itemsize),
        chunk_bytes=CHUNK_BYTES, max_context=max_context, prefill_chunk=prefill_chunk,
        budget_mib=budget_mib, reserve_mib=reserve_mib, expert_cache_mib=expert_cache_mib,
    )
    options.setdefault("prefill_loan", False)
    return CacheConfig(budget=budget, backend=backend, **options)


def cached_model(ckpt, *, dtype: torch.dtype | None = None, **kwargs):
    """`load_model(ckpt, cache=cache_config(ckpt, ...))` on the CPU."""
    return load_model(ckpt, dtype=dtype, cache=cache_config(ckpt, dtype=dtype, **kwargs))
