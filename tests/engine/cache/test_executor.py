"""`CacheExecutor`: a change that fails part way leaves the books, the bytes and the mirror as
they were (the restored residents' blobs uploaded again), and tells no observer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from strata import _vmm
from strata._residency import ResidencyTable
from strata.books import CheckedPolicy
from strata.engine.cache.arena import Arena, slot_bytes_for
from strata.engine.cache.executor import CacheExecutor
from strata.policies import load_registry, plugin_manager
from support.checkpoints import cached_checkpoint, store_of
from support.events import EventLog

CHUNK = 65536


@pytest.fixture(scope="module")
def store():
    return store_of(cached_checkpoint("qwen3_moe", "tiny", dtype=torch.float32))


@pytest.fixture
def executor(store):
    slot_bytes = slot_bytes_for(store.blob_bytes)
    table = ResidencyTable(store.n_layers, store.n_experts, 6, slot_bytes, CHUNK)
    arena = Arena(_vmm.HostBackend(CHUNK), 6, slot_bytes, hidden_size=store.hidden_size,
                  expert_width=store.expert_width, dtype=store.dtype)
    pm = plugin_manager(entry_points=False)
    log = EventLog()
    pm.register(log)
    executor = CacheExecutor(store, arena, table, torch.device("cpu"), events=pm)
    with executor.change() as change:  # slot s holds expert (0, s)
        change.fill(np.array([[s, 0, s] for s in range(6)]))
    executor.log = log
    yield executor
    arena.close()


def _blobs_match_books(executor):
    table, arena, store = executor.table, executor.arena, executor.store
    slots = arena.slots_view()
    for slot in np.flatnonzero(table.owner >= 0).tolist():
        layer, expert = divmod(int(table.owner[slot]), table.n_experts)
        blob = store.blob(layer, expert)
        assert torch.equal(slots[slot, : blob.numel()], blob)


def test_an_admission_whose_upload_fails_puts_the_evicted_experts_back(executor, monkeypatch):
    table = executor.table
    before = table.owner.copy()
    seen = len(executor.log.seen)
    real = executor.arena.upload
    calls = []

    def failing_upload(slots, experts, store):
        calls.append(np.asarray(slots).tolist())
        if len(calls) == 1:  # the admission's upload: half the bytes land, then it fails
            real(np.asarray(slots)[:1], np.asarray(experts)[:1], store)
            raise RuntimeError("the copy failed")
        return real(slots, experts, store)

    monkeypatch.setattr(executor.arena, "upload", failing_upload)
    placements = np.array([[2, 1, 0], [3, 1, 1]])  # evict (0, 2) and (0, 3)
    with pytest.raises(RuntimeError, match="the copy failed"), executor.change() as change:
        change.admit(1, placements)
    assert np.array_equal(table.owner, before)
    assert calls[1] == [2, 3]  # the evicted residents' blobs uploaded again
    table.validate()
    _blobs_match_books(executor)
    assert np.array_equal(executor.mirror.numpy(), table.res)
    assert len(executor.log.seen) == seen  # nothing told of a change that did not happen


def test_a_completed_change_tells_its_events_in_order(executor):
    with executor.change() as change:
        evicted = change.admit(1, np.array([[4, 1, 5]]))
        change.evict(np.array([0]))
    assert evicted.tolist() == [[0, 4]]
    kinds = [type(e).__name__ for e in executor.log.seen[-3:]]
    assert kinds == ["Admitted", "Evicted", "Evicted"]
    executor.table.validate()
    _blobs_match_books(executor)
    assert np.array_equal(executor.mirror.numpy(), executor.table.res)


def test_a_failed_give_up_maps_the_chunks_back(executor):
    table, arena = executor.table, executor.arena
    before = (table.owner.copy(), table.chunk_mapped.copy())
    plan = CheckedPolicy(load_registry().create("coldest-in-loan"), table).give_up(2)
    with pytest.raises(RuntimeError, match="the K/V refused"), executor.change() as change:
        taken = change.give_up(plan)
        assert not table.chunk_mapped[plan.chunks].any() and len(taken) == plan.chunks.size
        raise RuntimeError("the K/V refused")
    assert np.array_equal(table.owner, before[0]) and np.array_equal(table.chunk_mapped, before[1])
    assert arena.mapped_chunks().all()
    table.validate()
    _blobs_match_books(executor)
