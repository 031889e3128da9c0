"""`load`: a model with the expert cache and the elastic K/V composed around it.

The order: the model's dense weights and the host store of experts (`load_model`); the expert
cache over the store, its books ranked by the profile, filled hottest first, with the prompt
loan (`build_cached_experts`); then the elastic K/V beside the cache (`start_elastic`), which
takes the cache's executor, so that the slots it gives up and refills go through the same
steps as every other decision. `Loaded` owns all three and closes them in reverse.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from strata.engine.cache.build import CacheConfig, build_cached_experts
from strata.engine.cache.cached_experts import CachedExperts
from strata.engine.experts import ExpertStore
from strata.engine.kv.elastic import ElasticKV
from strata.engine.kv.plan import KvGrowConfig, start_elastic
from strata.engine.model import MoEModel, load_model

__all__ = ["Loaded", "load"]


@dataclass
class Loaded:
    """A loaded model and what was composed around it: `cache`, its experts through the expert
    cache (None: every expert resident), and `kv`, the elastic K/V kept across requests (None:
    each request makes its own K/V, `--kv-grow` off or not applicable). `owns_store`: whether
    closing unlocks the cache's expert store too; False where the caller shares one store among
    several caches in turn (the benchmarks' variants) and closes it after the last."""

    model: MoEModel
    cache: CachedExperts | None = None
    kv: ElasticKV | None = None
    owns_store: bool = True

    def close(self) -> None:
        """Release the K/V's range, then the arena (the K/V's chunks come from its backend),
        then the backend's own resources (host files); unlock the expert store's pages where
        it owns the store. Idempotent."""
        if self.kv is not None:
            self.kv.close()
        if self.cache is not None:
            self.cache.close()
            self.cache.arena.backend.close()
            if self.owns_store:
                self.cache.store.close()

    def __enter__(self) -> Loaded:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load(
    path: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    progress: bool = False,
    cache: CacheConfig | None = None,
    kv_grow: KvGrowConfig | None = None,
    experts_quant: str | None = None,
) -> Loaded:
    """Load the checkpoint at `path` (see `load_model`, which quantizes the experts into
    `experts_quant` if given); with `cache`, its experts run through the expert cache it
    configures (whose slots must be sized for that format: `CacheConfig.experts_quant`), and
    with `kv_grow` (`plan_elastic_cache`'s) the elastic K/V is started beside it. Raises as
    `load_model`; anything made before a failure is released again."""
    if kv_grow is not None and cache is None:
        raise ValueError("the elastic K/V grows into the expert cache: give `cache` too")
    if cache is not None and cache.experts_quant != experts_quant:
        raise ValueError(f"the cache was planned for experts in {cache.experts_quant or dtype}, "
                         f"the load asks for {experts_quant or dtype}; plan it with "
                         f"experts_quant={experts_quant!r}")
    if cache is None:
        return Loaded(load_model(path, device=device, dtype=dtype, progress=progress,
                                 experts_quant=experts_quant))
    made: list[CachedExperts] = []

    def make_experts(store: ExpertStore) -> CachedExperts:
        made.append(build_cached_experts(cache, store, device))
        return made[0]

    try:
        model = load_model(path, device=device, dtype=dtype, progress=progress,
                           make_experts=make_experts, experts_quant=experts_quant)
        cached = made[0]
        if cache.prefetch_misses:  # the next layer's misses predicted by its router
            cached.use_routers([layer.moe.router for layer in model.layers],
                               model.config.top_k)
        kv = start_elastic(cached, kv_grow) if kv_grow is not None else None
    except BaseException:
        for cached in made:
            cached.close()
        raise
    return Loaded(model, cached, kv)
