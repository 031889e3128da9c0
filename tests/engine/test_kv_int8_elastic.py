"""The elastic K/V with int8 cells on real host memory: growth gives up slots for every segment
(the scales' too), a fault at every chunk rolls it all back, and a trim hands the chunks back
and refills the slots they complete.

The model is the tiny qwen3_moe (L=2, E=8, G=2, Dh=16) in fp32: a blob is 96 KiB, so with 64 KiB
chunks three chunks hold two slots. int8 cells are 32 bytes (2048 a chunk) in 4 value segments
and 1 scale segment (4 pairs of [G] float32 scales a cell: the 2 layers' K and V): a step of
2048 cells is 5 chunks, where fp32 cells (128 bytes) would take 4 chunks for 512.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from strata import _vmm
from strata._residency import ResidencyTable
from strata.books import CheckedPolicy
from strata.engine.cache.arena import Arena, slot_bytes_for
from strata.engine.cache.cached_experts import CachedExperts
from strata.engine.cache.loan import LoanOptions
from strata.engine.kv.elastic import ElasticKV
from strata.engine.kv.kv_cache import KVCache
from strata.policies import KvParams, plugin_manager
from strata.policies.builtin.coldest_in_loan import ColdestInLoan
from support.cache_state import assert_resident_blobs, faults_until_done
from support.checkpoints import cached_checkpoint, store_of

CHUNK = 65536
STEP = 2048  # int8 cells of one segment in a chunk
PARAMS = KvParams(init_cells=STEP, step_cells=STEP, floor_slots=2)


@pytest.fixture(scope="module")
def store():
    return store_of(cached_checkpoint("qwen3_moe", "tiny", dtype=torch.float32))


def _setup(store, n_slots=12, free_chunks=0):
    backend = _vmm.HostBackend(CHUNK)
    slot_bytes = slot_bytes_for(store.blob_bytes)
    table = ResidencyTable(store.n_layers, store.n_experts, n_slots, slot_bytes, CHUNK)
    arena = Arena(backend, n_slots, slot_bytes, hidden_size=store.hidden_size,
                  expert_width=store.expert_width, dtype=store.dtype)
    cached = CachedExperts(store, arena, table, CheckedPolicy(ColdestInLoan(), table), "cpu",
                           events=plugin_manager(entry_points=False),
                           loan=LoanOptions(keep_slots=6))
    cached.fill_hottest()
    table.set_regions(floor=PARAMS.floor_slots)
    kv = KVCache(backend, store.n_layers, 4 * STEP, 2, 16, torch.float32,
                 mapped_cells=PARAMS.init_cells, cell_dtype=torch.int8)
    gen = torch.Generator().manual_seed(0)
    for layer in range(store.n_layers):  # quantized stamps, scales included
        kv.layer(layer).write(torch.arange(STEP), torch.randn(STEP, 2, 16, generator=gen),
                              torch.randn(STEP, 2, 16, generator=gen))
    return ElasticKV(kv, cached, PARAMS, free_chunks=free_chunks), cached


def _state(elastic, cached):
    table, arena, kv = cached.table, cached.arena, elastic.kv
    slots = arena.slots_view()
    return {
        "owner": table.owner.copy(), "chunk_mapped": table.chunk_mapped.copy(),
        "backed": table.backed.copy(), "kv_chunks": kv.mapped_chunks,
        "bytes_mapped": arena.backend.bytes_mapped, "alive": arena.backend.alive_chunks,
        "free": elastic.free_chunks,
        "slots": [slots[s].clone() for s in np.flatnonzero(table.backed)],
        "kv": [t.clone() for layer in range(kv.n_layers) for t in (kv.k(layer), kv.v(layer))]
        + [s.clone() for s in kv.scales()],
    }


def test_int8_growth_and_trim_move_every_segments_chunks(store):
    elastic, cached = _setup(store)
    kv, table = elastic.kv, cached.table
    assert kv.n_segments == 5 and elastic.cells_per_chunk == STEP
    scales = kv.scales()[0][:STEP].clone()
    alive = cached.arena.backend.alive_chunks
    assert elastic.ensure(STEP + 1)  # one step: 5 chunks, all from the cache's slots
    stats = elastic.stats
    assert kv.mapped_cells == 2 * STEP and stats.fresh_chunks == 0
    assert int((~table.chunk_mapped).sum()) >= 5 and stats.slots_given_up >= 3
    # Chunks moved, none created; a chunk the give-up freed past the step went to free budget.
    assert cached.arena.backend.alive_chunks == alive - elastic.free_chunks
    assert not kv.scales()[0][STEP:].any() and not kv.k(1)[STEP:].any()  # zeroed
    assert torch.equal(kv.scales()[0][:STEP], scales)
    assert_resident_blobs(cached)
    assert elastic.trim(0) == 5
    assert kv.mapped_cells == STEP and table.chunk_mapped.all()
    assert stats.refilled == stats.slots_given_up and table.n_resident == table.n_slots
    assert_resident_blobs(cached)
    elastic.close()
    cached.close()


@pytest.mark.parametrize("op", ["create", "unmap", "map", "access"])
def test_a_fault_at_every_chunk_of_an_int8_growth_rolls_everything_back(store, op):
    elastic, cached = _setup(store, free_chunks=4)  # 4 fresh chunks, 6 from slots [2, 6)
    failed = faults_until_done(cached.arena.backend, op, lambda: elastic.ensure(3 * STEP),
                               lambda: _state(elastic, cached),
                               lambda: elastic.stats.last_failure,
                               lambda: assert_resident_blobs(cached))
    # create: 4 chunks; unmap: the arena's runs; map: 10 chunks (2 a segment); access: one
    # run a segment.
    assert failed == {"create": 4, "map": 10, "access": 5}.get(op, failed) and failed > 0
    assert elastic.kv.mapped_cells == 3 * STEP
    assert_resident_blobs(cached)
    elastic.close()
    cached.close()
