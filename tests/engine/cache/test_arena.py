"""The arena: slots on a real host range, views that alias it, uploads byte for byte."""

import numpy as np
import pytest
import torch

from strata import _vmm
from strata.engine.cache.arena import (
    SLOT_ALIGN_BYTES,
    Arena,
    record_event,
    slot_bytes_for,
    wait_for,
)
from strata.engine.experts import ExpertStore
from support.checkpoints import cached_checkpoint, store_of

CHUNK_BYTES = 65536


@pytest.fixture(scope="module")
def store():
    # L=2, E=8, D=64, F=128: 96 KiB blobs
    return store_of(cached_checkpoint("qwen3_moe", "tiny", dtype=torch.float32))


def _arena(store, n_slots, backend=None, slot_bytes=None):
    return Arena(backend or _vmm.HostBackend(CHUNK_BYTES), n_slots,
                 slot_bytes or slot_bytes_for(store.blob_bytes), hidden_size=store.hidden_size,
                 expert_width=store.expert_width, dtype=store.dtype)


def test_slot_bytes_round_up():
    assert slot_bytes_for(1) == SLOT_ALIGN_BYTES
    assert slot_bytes_for(256) == 256 and slot_bytes_for(257) == 512
    with pytest.raises(ValueError, match="blob_bytes must be >= 1"):
        slot_bytes_for(0)


def test_range_mapped_whole_in_many_chunks(store):
    backend = _vmm.HostBackend(CHUNK_BYTES)
    arena = _arena(store, 5, backend, slot_bytes=store.blob_bytes + 256)  # slots straddle chunks
    try:
        n_chunks = -(-5 * arena.slot_bytes // CHUNK_BYTES)
        assert n_chunks > 5 and arena.nbytes == n_chunks * CHUNK_BYTES
        assert backend.bytes_mapped == arena.nbytes
        assert arena.slots_view().shape == (5, arena.slot_bytes)
        assert arena.gate_up_all().shape == (5, 2 * store.expert_width, store.hidden_size)
        assert arena.down_all().shape == (5, store.hidden_size, store.expert_width)
    finally:
        arena.close()
    assert backend.bytes_mapped == 0 and arena.closed


def test_upload_and_views_alias_the_slots(store):
    arena = _arena(store, 4)
    try:
        uploaded = arena.upload([2, 0], np.array([[1, 5], [0, 3]]), store)
        assert uploaded == 2 * store.blob_bytes
        view = arena.slots_view()
        assert torch.equal(view[2, : store.blob_bytes], store.blob(1, 5))
        assert torch.equal(view[0, : store.blob_bytes], store.blob(0, 3))
        gate, up, down = store.weights(1, 5)
        assert torch.equal(arena.gate_up(2), torch.cat([gate, up]))
        assert torch.equal(arena.down(2), down)
        # Zero-copy: the per-slot views and the stacked ones read the range's own bytes.
        base = view.data_ptr()
        assert arena.gate_up(2).data_ptr() == base + 2 * arena.slot_bytes
        assert arena.down_all()[2].data_ptr() == base + 2 * arena.slot_bytes + 2 * gate.nbytes
        arena.copy_slot(2, 3)
        assert torch.equal(view[3], view[2])
    finally:
        arena.close()


def test_a_queued_upload_on_the_host_is_complete_and_has_no_event(store):
    arena = _arena(store, 4)
    try:
        assert arena.upload_queued([3, 1], np.array([[1, 2], [0, 6]]), store, None) is None
        view = arena.slots_view()
        assert torch.equal(view[3, : store.blob_bytes], store.blob(1, 2))
        assert torch.equal(view[1, : store.blob_bytes], store.blob(0, 6))
        assert arena.upload_queued([], np.empty((0, 2), int), store, None) is None
    finally:
        arena.close()


@pytest.mark.parametrize("pad", [0, 256], ids=["unpadded", "padded"])
def test_an_upload_copies_a_run_of_experts_into_a_run_of_slots_at_once(store, pad,
                                                                        monkeypatch):
    """Consecutive experts of a layer into consecutive slots (a loan's misses into its lent
    slots) are one copy where slots are as long as blobs; padded slots take one copy a blob
    and keep their padding; a run never crosses layers."""
    from strata.engine.experts.blob_copies import ByteCopies

    made, to_device = [], ByteCopies.to_device
    monkeypatch.setattr(ByteCopies, "to_device", lambda self, dst, src, n_bytes, what: (
        made.append(n_bytes), to_device(self, dst, src, n_bytes, what)))
    arena = _arena(store, 6, slot_bytes=store.blob_bytes + pad)
    try:
        arena.slots_view().fill_(9)
        experts = np.array([[0, 5], [0, 6], [0, 7], [1, 0], [1, 1], [1, 3]])
        arena.upload([1, 2, 3, 4, 5, 0], experts, store)
        blob = store.blob_bytes
        assert made == ([3 * blob, 2 * blob, blob] if not pad else [blob] * 6)
        view = arena.slots_view()
        for slot, (layer, expert) in zip([1, 2, 3, 4, 5, 0], experts, strict=True):
            assert torch.equal(view[slot, :blob], store.blob(int(layer), int(expert)))
        assert (view[:, blob:] == 9).all()
    finally:
        arena.close()
    with pytest.raises(IndexError, match="out of range"):
        arena.upload([0], np.array([[0, 1]]), store)  # the slots are gone


@pytest.mark.parametrize("queued", [False, True], ids=["upload", "upload_queued"])
def test_bad_uploads_copy_nothing(store, queued):
    arena = _arena(store, 3)
    upload = (lambda slots, experts, store: arena.upload_queued(slots, experts, store, None)) \
        if queued else arena.upload
    try:
        before = arena.slots_view().clone()
        cases = [
            (IndexError, r"slot 3 is out of range \[0, 3\)", [0, 3], [[0, 1], [0, 2]]),
            (IndexError, r"expert 8 is out of range", [0, 1], [[0, 1], [0, 8]]),
            (IndexError, r"layer 2 is out of range", [0], [[2, 1]]),
            (ValueError, "name a slot twice", [1, 1], [[0, 1], [0, 2]]),
            (ValueError, "2 slots for 1 experts", [0, 1], [[0, 1]]),
        ]
        for error, match, slots, experts in cases:
            with pytest.raises(error, match=match):
                upload(slots, np.array(experts), store)
        assert torch.equal(arena.slots_view(), before)
        with pytest.raises(IndexError, match="slot -1"):
            arena.gate_up(-1)
        with pytest.raises(ValueError, match="both slot 1"):
            arena.copy_slot(1, 1)
    finally:
        arena.close()


def test_geometry_errors(store):
    backend = _vmm.HostBackend(CHUNK_BYTES)
    with pytest.raises(ValueError, match="must hold a blob"):
        _arena(store, 2, backend, slot_bytes=store.blob_bytes - 256)
    with pytest.raises(ValueError, match="multiple of 256"):
        _arena(store, 2, backend, slot_bytes=store.blob_bytes + 4)
    with pytest.raises(ValueError, match="n_slots must be an int >= 0"):
        _arena(store, -1, backend)
    assert backend.alive_chunks == 0


def test_zero_slots_reserve_nothing(store):
    backend = _vmm.HostBackend(CHUNK_BYTES)
    arena = _arena(store, 0, backend)
    assert arena.nbytes == 0 and backend.alive_chunks == 0
    assert arena.gate_up_all().shape[0] == 0
    assert arena.upload([], np.empty((0, 2), int), store) == 0
    arena.close()


def test_a_failed_mapping_leaves_nothing(store):
    backend = _vmm.HostBackend(CHUNK_BYTES)
    backend.inject_fault("map")
    with pytest.raises(_vmm.VmmError):
        _arena(store, 4, backend)
    assert backend.alive_chunks == 0 and backend.bytes_mapped == 0


@pytest.mark.cuda
def test_cuda_upload_from_pinned_store(store):
    pinned = ExpertStore([store.layer_blobs(i).pin_memory() for i in range(store.n_layers)],
                         store.hidden_size, store.expert_width, store.dtype)
    arena = _arena(pinned, 3, _vmm.CudaBackend(0))
    try:
        arena.upload([1, 2], np.array([[0, 4], [1, 7]]), pinned)
        view = arena.slots_view().cpu()
        assert torch.equal(view[1, : store.blob_bytes], store.blob(0, 4))
        assert torch.equal(view[2, : store.blob_bytes], store.blob(1, 7))
        arena.upload([0, 1, 2], np.array([[1, 4], [1, 5], [1, 6]]), pinned)  # one copy
        assert torch.equal(arena.slots_view()[:, : store.blob_bytes].cpu(),
                           store.layer_blobs(1)[4:7])
        arena.upload([1, 2], np.array([[0, 4], [1, 7]]), pinned)
        arena.copy_slot(2, 0)
        assert torch.equal(arena.slots_view()[0].cpu(), view[2])
        # Queued: after an event of the compute stream, done at the returned event, the host
        # not waiting (torch's sync debug mode raises on a sync).
        after = record_event(arena.device)
        torch.cuda.set_sync_debug_mode("error")
        try:
            done = arena.upload_queued([0], np.array([[1, 3]]), pinned, after)
            wait_for(done, arena.device)
            copied = arena.slots_view()[0, : store.blob_bytes].clone()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(copied.cpu(), store.blob(1, 3))
    finally:
        arena.close()


def test_every_preset_s_blobs_fill_their_slots_in_every_format():
    """docs/prompt-loan.md: a loan's run of blobs is one copy because slots are as long as
    blobs; that holds for every preset in every experts format."""
    from strata.engine.experts.quant import WEIGHT_FORMATS, expert_blob_bytes
    from strata.engine.model.presets import PRESETS, get_preset

    for name in PRESETS:
        preset = get_preset(name)
        for quant in (None, *WEIGHT_FORMATS):
            blob = expert_blob_bytes(preset.expert_width, preset.hidden_size, torch.bfloat16,
                                     quant)
            assert slot_bytes_for(blob) == blob, (name, quant)
