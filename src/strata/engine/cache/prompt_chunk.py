"""The prompt chunk an expert cache is planned for when the user asks for none.

A prompt read through the cache uploads (or computes on the CPU) each expert it misses once a
chunk, so a longer chunk moves fewer expert bytes; its workspace (the routed rows, the
activations, the attention masks) is budgeted against the cache's slots. `choose_prefill_chunk`
takes the longest chunk whose workspace costs little of the cache.
"""

from __future__ import annotations

from collections.abc import Callable

from strata.engine.cache.budget import HOST_DEFAULT_SOURCE, CacheBudget

__all__ = ["PREFILL_CHUNKS", "PREFILL_SLOT_SHARE", "choose_prefill_chunk"]

# The chunks to choose from, and the share of the smallest one's slots a longer one's
# workspace may take.
PREFILL_CHUNKS = (512, 1024, 2048, 4096)
PREFILL_SLOT_SHARE = 0.10


def choose_prefill_chunk(budget_at: Callable[[int], CacheBudget]) -> int:
    """The prompt chunk a cache is planned for when none is asked: the largest of
    PREFILL_CHUNKS whose budget (`budget_at(chunk)`: `plan_budget` at that chunk) keeps at
    least 1 - PREFILL_SLOT_SHARE of the slots the smallest leaves; the smallest where the budget
    is the host's default (every expert: no budget to choose from).

    Why: a prompt through the cache uploads each expert it misses once a chunk, so a longer
    chunk moves fewer bytes; its workspace costs slots. On the H200, qwen3-30b-a3b (16 layers,
    12 GiB) read a 32K prompt in 0.26x the time at chunks of 2,048 against 512, for 7.5% of
    its slots (bench/results/prefill-chunk-h200-2026-11-29.md)."""
    smallest = budget_at(PREFILL_CHUNKS[0])
    if smallest.budget_source == HOST_DEFAULT_SOURCE:
        return PREFILL_CHUNKS[0]
    chosen = PREFILL_CHUNKS[0]
    for chunk in PREFILL_CHUNKS[1:]:
        try:
            slots = budget_at(chunk).n_slots
        except ValueError:  # the budget is too small at this chunk
            break
        if slots < (1 - PREFILL_SLOT_SHARE) * smallest.n_slots:
            break
        chosen = chunk
    return chosen
