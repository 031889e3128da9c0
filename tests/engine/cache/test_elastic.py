"""The elastic K/V's executor on real host memory: growth from free budget and from the cache's
slots (relocations first), trims with refills, and exact rollbacks with a fault at every chunk.

The model is the tiny qwen3_moe (L=2, E=8) in fp32: a blob is 96 KiB, so with 64 KiB chunks
slots straddle chunks (three chunks per two slots), and a K/V segment holds 512 cells a chunk.
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
from strata.engine.kv.elastic import ElasticKV, KvFullError, loan_top
from strata.engine.kv.kv_cache import KVCache
from strata.policies import KvParams, PolicyError, plugin_manager
from strata.policies.builtin.coldest_in_loan import ColdestInLoan
from support.cache_state import assert_resident_blobs, assert_same_state, faults_until_done
from support.checkpoints import cached_checkpoint, store_of
from support.events import EventLog

CHUNK = 65536
CELLS_PER_CHUNK = 512  # 2 kv heads * 16 dims * 4 bytes = 128-byte cells
WINDOW = 4096
PARAMS = KvParams(init_cells=512, step_cells=512, floor_slots=2)


@pytest.fixture(scope="module")
def store():
    return store_of(cached_checkpoint("qwen3_moe", "tiny", dtype=torch.float32))


class Recorder(ColdestInLoan):
    """The default policy, remembering each give-up and relocation it answered."""

    name = "recorder"

    def __init__(self, options=None):
        super().__init__(options)
        self.given_up: list[list[int]] = []
        self.moves: list[list[tuple[int, int]]] = []

    def give_up(self, view, n_chunks):
        slots = super().give_up(view, n_chunks)
        self.given_up.append(sorted(int(s) for s in slots))
        return slots

    def relocate(self, view, slots):
        moves = super().relocate(view, slots)
        self.moves.append([(int(s), int(d)) for s, d in moves])
        return moves


def _setup(store, n_slots=12, free_chunks=0, policy=None, keep_slots=6, params=PARAMS):
    """(elastic, cached, events): a filled cache of `n_slots`, a loan region of the top
    `n_slots - keep_slots` slots (at most E), and a K/V of WINDOW cells with 512 mapped."""
    backend = _vmm.HostBackend(CHUNK)
    slot_bytes = slot_bytes_for(store.blob_bytes)
    table = ResidencyTable(store.n_layers, store.n_experts, n_slots, slot_bytes, CHUNK)
    # Heat by rank only: rank flat order, so the fill puts expert (l, e) hottest for low ids.
    arena = Arena(backend, n_slots, slot_bytes, hidden_size=store.hidden_size,
                  expert_width=store.expert_width, dtype=store.dtype)
    pm = plugin_manager(entry_points=False)
    events = EventLog()
    pm.register(events)
    policy = policy or Recorder()
    cached = CachedExperts(store, arena, table, CheckedPolicy(policy, table), "cpu", events=pm,
                           loan=LoanOptions(keep_slots=keep_slots))
    cached.fill_hottest()
    table.set_regions(floor=params.floor_slots)
    kv = KVCache(backend, store.n_layers, WINDOW, 2, 16, torch.float32,
                 mapped_cells=params.init_cells)
    for layer in range(store.n_layers):  # stamps in the cells mapped at start
        kv.k(layer).copy_(torch.arange(kv.k(layer).numel()).view_as(kv.k(layer)) + layer)
        kv.v(layer).fill_(-1.0 - layer)
    elastic = ElasticKV(kv, cached, params, free_chunks=free_chunks, on_note=events.seen.append)
    return elastic, cached, events


def _close(elastic, cached):
    elastic.close()
    cached.close()


def _state(elastic, cached):
    """Everything a rolled-back step must leave as it was: books, mappings, bytes, mirror."""
    table, arena, kv = cached.table, cached.arena, elastic.kv
    slots = arena.slots_view()
    return {
        "owner": table.owner.copy(), "res": table.res.copy(),
        "chunk_mapped": table.chunk_mapped.copy(), "backed": table.backed.copy(),
        "regions": (table.top, table.floor), "arena_mapped": arena.mapped_chunks(),
        "kv_chunks": kv.mapped_chunks, "bytes_mapped": arena.backend.bytes_mapped,
        "alive": arena.backend.alive_chunks, "free": elastic.free_chunks,
        "mirror": cached.mirror.clone(),
        "slots": [slots[s].clone() for s in np.flatnonzero(table.backed)],
        "kv": [t.clone() for layer in range(kv.n_layers) for t in (kv.k(layer), kv.v(layer))],
        "counts": (elastic.stats.grows, elastic.stats.trims, elastic.stats.cells_mapped,
                   elastic.stats.slots_given_up, elastic.stats.refilled),
    }


def test_growth_from_free_budget_takes_no_slot(store):
    elastic, cached, events = _setup(store, free_chunks=20)
    owner = cached.table.owner.copy()
    alive = cached.arena.backend.alive_chunks
    assert elastic.ensure(1000)  # 2 chunks a segment: 4 more chunks
    assert elastic.kv.mapped_cells == 1024 and elastic.free_chunks == 16
    assert cached.arena.backend.alive_chunks == alive + 4
    assert np.array_equal(cached.table.owner, owner)
    assert not elastic.kv.k(1)[512:].any()  # new cells are zero
    stats = elastic.stats
    assert (stats.grows, stats.fresh_chunks, stats.slots_given_up, stats.cells_mapped) == (
        1, 4, 0, 1024)
    assert [type(e).__name__ for e in events.seen] == ["Grown"]
    assert elastic.ensure(1024) and elastic.stats.grows == 1  # mapped already: nothing to do
    _close(elastic, cached)


def test_growth_gives_up_the_slots_below_the_loan_and_moves_hot_experts_first(store):
    elastic, cached, events = _setup(store)
    table, arena = cached.table, cached.arena
    assert loan_top(cached) == 6 and table.top == 12  # the loan region is slots [6, 12)
    before_owner = table.owner.copy()
    alive = arena.backend.alive_chunks
    assert elastic.ensure(600)  # one step: 4 chunks from the cache
    policy = cached.checked.policy
    assert policy.given_up == [[3, 4, 5]]  # slots 3-5 span chunks 4-7 (chunk 4 shared with 2?)
    given = np.array(policy.given_up[0])
    # Chunks moved, none created: the K/V took the arena's chunks.
    assert arena.backend.alive_chunks == alive and elastic.stats.fresh_chunks == 0
    assert not table.backed[given].any() and table.top == 12
    assert not arena.mapped_chunks()[table.chunk_mapped == 0].any()
    # Each given-up expert was hotter than every loan resident: all three moved into the loan
    # region, taking the coldest residents' slots (the highest ranks: slots 11, 10, 9).
    moves = policy.moves[0]
    assert moves == [(3, 11), (4, 10), (5, 9)]
    for src, dst in moves:
        assert table.owner[dst] == before_owner[src]
    assert elastic.stats.slots_given_up == 3 and elastic.stats.relocated == 3
    assert_resident_blobs(cached)
    kinds = [type(e).__name__ for e in events.seen]
    assert kinds == ["Relocated", "GaveUp", "Grown"]
    gave_up = events.seen[1]
    assert gave_up.slots == (3, 4, 5)
    assert sorted(gave_up.evicted) == sorted(
        (int(f) // 8, int(f) % 8) for f in before_owner[[9, 10, 11]])
    _close(elastic, cached)


def test_growth_takes_free_budget_first_then_slots(store):
    elastic, cached, _ = _setup(store, free_chunks=2)
    assert elastic.ensure(1024)  # 4 chunks: 2 from free budget, 2 from the cache
    stats = elastic.stats
    # Two slots free three chunks (a slot is 1.5 chunks): the third stands in for a new one,
    # and one chunk of free budget is left, as the simulator counts it.
    assert cached.checked.policy.given_up == [[4, 5]]
    assert stats.slots_given_up == 2 and int((~cached.table.chunk_mapped).sum()) == 3
    assert stats.fresh_chunks == 1 and elastic.free_chunks == 1
    assert_resident_blobs(cached)
    _close(elastic, cached)


def test_a_growth_the_cache_cannot_give_is_refused_and_the_run_goes_on(store):
    elastic, cached, events = _setup(store, params=KvParams(512, 512, floor_slots=5))
    before = _state(elastic, cached)
    # [5, 6) is one slot, bytes [480, 576) KiB: it frees chunk 8 alone, the step needs 4.
    assert not elastic.ensure(600)
    assert_same_state(_state(elastic, cached), before)
    failure = elastic.stats.last_failure
    assert "needs 4 chunks from the expert cache, which can give 1" in failure
    assert elastic.stats.failures == 1
    assert "rolled back; going on with 512 cells mapped" in events.seen[-1]
    elastic.require(512)  # what is mapped still serves
    with pytest.raises(KvFullError, match="needs 600 K/V cells, 512 are mapped"):
        elastic.require(600)
    _close(elastic, cached)


@pytest.mark.parametrize("op", ["create", "unmap", "map", "access"])
def test_a_fault_at_every_chunk_of_a_growth_rolls_everything_back(store, op):
    elastic, cached, _ = _setup(store, free_chunks=2)  # 2 fresh chunks, the rest from slots
    failed = faults_until_done(cached.arena.backend, op,
                               lambda: elastic.ensure(1536),  # 8 chunks: 2 created, 6 cached
                               lambda: _state(elastic, cached),
                               lambda: elastic.stats.last_failure,
                               lambda: assert_resident_blobs(cached))
    # create: 2 chunks; unmap: the arena's runs; map: 8 chunks; access: one per segment.
    assert failed > 0 and (op != "map" or failed == 8) and (op != "access" or failed == 4)
    assert elastic.kv.mapped_cells == 1536 and elastic.stats.failures == failed
    assert_resident_blobs(cached)
    _close(elastic, cached)


def test_trim_returns_chunks_and_refills_the_slots_they_complete(store):
    elastic, cached, events = _setup(store, free_chunks=2)
    table = cached.table
    assert elastic.ensure(1536)  # 8 chunks: 2 from free budget, 6 from slots [2, 6)
    assert cached.checked.policy.given_up == [[2, 3, 4, 5]]
    assert np.flatnonzero(~table.chunk_mapped).tolist() == [3, 4, 5, 6, 7, 8]
    evicted = next(e for e in events.seen if type(e).__name__ == "GaveUp").evicted
    alive = cached.arena.backend.alive_chunks
    events.seen.clear()
    # The default target trims once two steps are spare, to the step grid.
    assert elastic.trim(600) == 0 and elastic.stats.trims == 0
    assert elastic.trim(500) == 8
    assert elastic.kv.mapped_cells == 512 and table.chunk_mapped.all()
    # Six chunks filled the arena's holes, the two past them were released.
    assert cached.arena.backend.alive_chunks == alive - 2 and elastic.free_chunks == 2
    stats = elastic.stats
    assert (stats.trims, stats.returned_chunks, stats.freed_chunks, stats.refilled) == (1, 6, 2, 4)
    # The refill is the policy's: the hottest missing experts (those the growth evicted),
    # into the slots the chunks completed, ascending.
    refilled = next(e for e in events.seen if type(e).__name__ == "Refilled")
    assert [p[0] for p in refilled.placements] == [2, 3, 4, 5]
    assert sorted(p[1:] for p in refilled.placements) == sorted(evicted)
    assert [type(e).__name__ for e in events.seen] == ["Trimmed", "Refilled"]
    assert table.n_resident == table.n_slots
    assert_resident_blobs(cached)
    assert elastic.trim(0) == 0  # the start cells stay
    _close(elastic, cached)


@pytest.mark.parametrize("op", ["unmap", "map", "access"])
def test_a_fault_at_every_chunk_of_a_trim_rolls_everything_back(store, op):
    elastic, cached, _ = _setup(store, free_chunks=2)
    assert elastic.ensure(1536)
    for layer in range(elastic.kv.n_layers):  # stamps in every cell, the grown ones too
        elastic.kv.k(layer).copy_(torch.randn(1536, 2, 16, generator=torch.Generator()
                                              .manual_seed(layer)))
    failed = faults_until_done(cached.arena.backend, op, lambda: elastic.trim(0) != 0,
                               lambda: _state(elastic, cached),
                               lambda: elastic.stats.last_failure)
    # unmap: one run per K/V segment; map: one per arena hole; access: the holes are one run.
    assert failed == {"unmap": 4, "map": 6, "access": 1}[op]
    assert elastic.kv.mapped_cells == 512
    assert_resident_blobs(cached)
    _close(elastic, cached)


class BadRefill(ColdestInLoan):
    name = "bad-refill"

    def refill(self, view, free_slots):
        return [(int(free_slots[0]), 0, 0)]  # expert (0, 0) is resident: refused


def test_a_wrong_refill_leaves_the_trim_undone(store):
    elastic, cached, _ = _setup(store, free_chunks=2, policy=BadRefill())
    assert elastic.ensure(1536)
    before = _state(elastic, cached)
    with pytest.raises(PolicyError, match="bad-refill"):
        elastic.trim(0)
    assert_same_state(_state(elastic, cached), before)
    _close(elastic, cached)


def test_views_made_before_a_growth_work_after_it(store):
    elastic, cached, _ = _setup(store, free_chunks=2)
    k0 = elastic.kv.k(0)
    gate_up = cached.arena.gate_up_all()
    slot0 = gate_up[0].clone()
    assert elastic.ensure(1536)
    assert elastic.kv.k(0).data_ptr() == k0.data_ptr()
    k0[5] = 42.0
    assert elastic.kv.k(0)[5].eq(42.0).all()
    assert torch.equal(gate_up[0], slot0)  # a kept slot, through the view made at start
    _close(elastic, cached)


def test_bad_needs_are_refused(store):
    elastic, cached, _ = _setup(store)
    with pytest.raises(ValueError, match=r"need_cells 4097 is outside \[0, 4096\]"):
        elastic.ensure(4097)
    with pytest.raises(ValueError, match="share one memory backend"):
        ElasticKV(KVCache(_vmm.HostBackend(CHUNK), 2, 64, 2, 16, torch.float32), cached, PARAMS,
                  free_chunks=0)
    _close(elastic, cached)


def test_the_arena_checks_chunk_hand_overs_before_changing_anything(store):
    elastic, cached, _ = _setup(store)
    arena = cached.arena
    mapped = arena.mapped_chunks()
    with pytest.raises(ValueError, match=r"chunks \[4, 3\] must be ascending, distinct"):
        arena.unmap_chunks([4, 3])
    with pytest.raises(ValueError, match=r"must be ascending, distinct and in \[0, 18\)"):
        arena.unmap_chunks([17, 18])
    with pytest.raises(ValueError, match=r"map_chunks: chunks \[2\] must all be unmapped"):
        arena.map_chunks([2], arena.backend.create_chunks(1))
    with pytest.raises(ValueError, match="map_chunks: 2 chunks for 1 indices"):
        arena.map_chunks([2], arena.backend.create_chunks(2))
    with pytest.raises(ValueError, match="distinct destinations that are not sources"):
        arena.copy_blobs([(1, 2), (2, 3)])
    assert np.array_equal(arena.mapped_chunks(), mapped)
    taken = arena.unmap_chunks([3, 4, 7])  # two runs
    assert len(taken) == 3 and not arena.mapped_chunks()[[3, 4, 7]].any()
    arena.map_chunks([3, 4, 7], taken)
    assert arena.mapped_chunks().all()
    _close(elastic, cached)
