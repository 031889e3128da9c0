"""ResidencyTable by example: geometry, heat order, lookups, bad input, save and load.

The model test (test_residency_model.py) checks random sequences against the reference; these
tests pin down hand-worked cases and the error contract: every refused call names the bad value
and leaves the table byte-identical.
"""

import zipfile

import numpy as np
import pytest

from strata._residency import ResidencyTable

ARRAYS = ("res", "owner", "heat", "rank", "chunk_mapped", "backed")


def state(table: ResidencyTable) -> tuple:
    arrays = tuple(getattr(table, name).tobytes() for name in ARRAYS)
    return (*arrays, table.top, table.floor, table.hits, table.lookups, table.n_resident)


def small() -> ResidencyTable:
    """2 layers × 4 experts, 6 slots of 3 bytes over 5 chunks of 4 bytes (18 bytes, 2 spare).

    slot:   0   1   2   3   4   5
    bytes: 0-2 3-5 6-8 ...          chunk c covers bytes 4c .. 4c+3
    Slot 1 straddles chunks 0 and 1; chunk 4 holds the end of slot 5 and 2 bytes past the arena.
    """
    t = ResidencyTable(2, 4, 6, 3, 4)
    t.assign(0, 0, 0)
    t.assign(2, 1, 3)
    t.assign(5, 0, 2)
    return t


# ---------------------------------------------------------------- construction and views


def test_a_new_table_is_empty_mapped_and_ranked_by_flat_id():
    t = ResidencyTable(3, 5, 7, 100, 64)
    assert (t.n_layers, t.n_experts, t.n_slots, t.slot_bytes, t.chunk_bytes) == (3, 5, 7, 100, 64)
    assert t.n_chunks == 11  # ceil(700 / 64)
    assert (t.res == -1).all() and t.res.dtype == np.int32 and t.res.shape == (3, 5)
    assert (t.owner == -1).all() and t.owner.dtype == np.int32 and t.owner.shape == (7,)
    assert (t.heat == 0).all() and t.heat.dtype == np.float64
    np.testing.assert_array_equal(t.rank, np.arange(15).reshape(3, 5))
    assert t.chunk_mapped.all() and t.backed.all()
    assert (t.top, t.floor, t.n_resident, t.hits, t.lookups) == (7, 0, 0, 0, 0)
    t.validate()
    assert "n_slots=7" in repr(t)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ((0, 4, 2, 8, 8), "n_layers must be in [1,"),
        ((2, 0, 2, 8, 8), "n_experts must be in [1,"),
        ((2, 4, -1, 8, 8), "n_slots must be in [0,"),
        ((2, 4, 2, 0, 8), "slot_bytes must be in [1,"),
        ((2, 4, 2, 8, 0), "chunk_bytes must be in [1,"),
        ((2**16, 2**16, 2, 8, 8), "does not fit flat int32 ids"),
        ((2, 4, 2**30, 2**40, 8), "exceeds the"),
        ((2, 4, 2**20, 2**20, 1), "use larger chunks"),
        ((2, 4, 2**80, 8, 8), "n_slots must be in [0,"),
    ],
)
def test_bad_geometry_is_a_value_error(args, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[")):
        ResidencyTable(*args)


def test_a_non_integer_size_is_a_type_error():
    with pytest.raises(TypeError, match=r"n_slots must be an integer, got 2\.5"):
        ResidencyTable(2, 4, 2.5, 8, 8)


def test_views_are_live_and_cannot_be_written_or_made_writeable():
    t = ResidencyTable(2, 4, 6, 3, 4)
    res, owner = t.res, t.owner
    t.assign(3, 1, 2)
    assert res[1, 2] == 3 and owner[3] == 1 * 4 + 2  # the same view shows the change
    for name in ARRAYS:
        view = getattr(t, name)
        assert not view.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            view.reshape(-1)[0] = 1
        with pytest.raises(ValueError, match="cannot set WRITEABLE flag"):
            view.flags.writeable = True
    t.validate()


# ---------------------------------------------------------------- residency


def test_assign_evict_move_keep_res_and_owner_inverse():
    t = small()
    assert t.slot_of(1, 3) == 2 and t.expert_in(2) == (1, 3) and t.n_resident == 3
    t.move(2, 4)
    assert t.slot_of(1, 3) == 4 and t.expert_in(2) is None and t.owner[4] == 7
    assert t.evict(4) == (1, 3)
    assert t.slot_of(1, 3) == -1 and t.n_resident == 2
    t.validate()


def test_batch_forms_apply_in_order():
    t = ResidencyTable(2, 4, 6, 3, 4)
    t.assign_many(np.array([4, 1, 0]), [0, 1, 1], np.array([3, 0, 2], np.uint8))
    assert [t.expert_in(s) for s in range(6)] == [(1, 2), (1, 0), None, None, (0, 3), None]
    # A chain: 4 -> 2, then 1 -> 4 (vacated by the first move), then 0 -> 1.
    t.move_many([4, 1, 0], [2, 4, 1])
    assert [t.expert_in(s) for s in range(6)] == [None, (1, 2), (0, 3), None, (1, 0), None]
    evicted = t.evict_many(np.array([2, 1], np.int16))
    assert evicted.dtype == np.int32 and evicted.tolist() == [[0, 3], [1, 2]]
    assert t.n_resident == 1
    t.validate()


def test_many_ids_of_any_integer_dtype_and_lists_are_accepted():
    ids = [0, 3, 1]
    for dtype in (np.int8, np.uint8, np.int16, np.uint32, np.int64, np.uint64, ">i8", np.longlong):
        t = ResidencyTable(2, 4, 6, 3, 4)
        t.assign_many(np.array([5, 0, 2], dtype), np.array([1, 0, 1], dtype), np.array(ids, dtype))
        assert [t.expert_in(s) for s in (5, 0, 2)] == [(1, 0), (0, 3), (1, 1)], dtype
    t.evict_many([])
    t.assign_many(np.array([]), [], np.empty(0, np.float32))  # nothing, in any dtype
    assert t.n_resident == 3


# ---------------------------------------------------------------- bad input changes nothing


def _bad_calls():
    i64 = np.int64
    return [
        # (call on small(), exception, words the message must contain)
        (lambda t: t.assign(6, 0, 1), IndexError, "slot 6 is out of range [0, 6)"),
        (lambda t: t.assign(-1, 0, 1), IndexError, "slot -1 is out of range"),
        (lambda t: t.assign(1, 2, 1), IndexError, "layer 2 is out of range [0, 2)"),
        (lambda t: t.assign(1, 0, 4), IndexError, "expert 4 is out of range [0, 4)"),
        (lambda t: t.assign(2**70, 0, 1), IndexError, f"slot {2**70} is out of range"),
        (lambda t: t.assign(1.0, 0, 1), TypeError, "slot must be an integer, got 1.0"),
        (lambda t: t.assign(1, 0, 0), ValueError, "expert (0, 0) is already in slot 0"),
        (lambda t: t.assign(0, 0, 1), ValueError, "slot 0 already holds expert (0, 0)"),
        (lambda t: t.assign(0, 0, 0), ValueError, "slot 0 already holds expert (0, 0)"),
        (lambda t: t.evict(1), ValueError, "slot 1 holds no expert"),
        (lambda t: t.move(1, 3), ValueError, "src_slot 1 holds no expert"),
        (lambda t: t.move(0, 2), ValueError, "dst_slot 2 already holds expert (1, 3)"),
        (lambda t: t.move(0, 0), ValueError, "src_slot and dst_slot are both 0"),
        (lambda t: t.move(0, 9), IndexError, "dst_slot 9 is out of range"),
        # Batch forms: a bad element anywhere, and nothing changes.
        (lambda t: t.assign_many([1, 3, 4], [0, 0, 0], [1, 3, 9]), IndexError,
         "element 2: expert 9 is out of range"),
        (lambda t: t.assign_many([1, 3], [0, 0], [1, 1]), ValueError,
         "element 1: expert (0, 1) is already in slot 1"),
        (lambda t: t.assign_many([1, 5], [0, 0], [1, 3]), ValueError,
         "element 1: slot 5 is not backed"),
        (lambda t: t.assign_many([1, 3, 1], [0, 0, 1], [1, 3, 1]), ValueError,
         "element 2: slot 1 already holds expert (0, 1)"),
        (lambda t: t.assign_many([1, 3], [0, 0, 0], [1, 3, 1]), ValueError,
         "same length"),
        (lambda t: t.assign_many([[1]], [[0]], [[1]]), ValueError, "slots must be 1-D"),
        (lambda t: t.assign_many([1.5], [0], [1]), ValueError,
         "slots must be an integer array, got dtype float64"),
        (lambda t: t.assign_many(np.array([2**64 - 1], np.uint64), [0], [1]), IndexError,
         str(2**64 - 1)),
        (lambda t: t.evict_many([0, 4, 0]), ValueError, "element 2: slot 0 holds no expert"),
        (lambda t: t.evict_many([0, 4, 1]), ValueError, "element 2: slot 1 holds no expert"),
        (lambda t: t.move_many([0, 2, 4], [1, 3, 1]), ValueError,
         "element 2: dst_slot 1 already holds expert (0, 0)"),
        (lambda t: t.move_many([0, 2], [1, 6]), IndexError, "element 1: dst_slot 6"),
        (lambda t: t.slot_of(0, -2), IndexError, "expert -2 is out of range"),
        (lambda t: t.expert_in(6), IndexError, "slot 6 is out of range"),
        # Heat.
        (lambda t: t.record(2, np.array([1])), IndexError, "layer 2 is out of range"),
        (lambda t: t.record(0, np.array([[1, 2], [3, 4]])), IndexError,
         "expert_ids(1, 1) = 4 is out of range [0, 4)"),
        (lambda t: t.record(0, np.array([1.0])), ValueError, "got dtype float64"),
        (lambda t: t.record(0, np.array([True])), ValueError, "got dtype bool"),
        (lambda t: t.decay(0.0), ValueError, "factor must be in (0, 1], got 0.0"),
        (lambda t: t.decay(1.5), ValueError, "got 1.5"),
        (lambda t: t.decay(float("nan")), ValueError, "got nan"),
        (lambda t: t.set_rank(np.arange(8).reshape(4, 2)), ValueError,
         "rank must have shape (2, 4), got (4, 2)"),
        (lambda t: t.set_rank(np.array([[0, 1, 2, 3], [4, 5, 6, 6]])), ValueError,
         "6 appears more than once"),
        (lambda t: t.set_rank(np.array([[0, 1, 2, 3], [4, 5, 6, 8]])), IndexError,
         "rank(1, 3) = 8 is out of range [0, 8)"),
        (lambda t: t.set_rank(np.zeros((2, 4))), ValueError, "got dtype float64"),
        (lambda t: t.set_rank_from_counts(np.full((2, 4), np.nan)), ValueError,
         "counts(0, 0) = nan"),
        (lambda t: t.set_rank_from_counts(np.zeros(8)), ValueError, "got (8,)"),
        (lambda t: t.set_rank_from_counts(np.full((2, 4), "a")), ValueError, "numeric"),
        (lambda t: t.coldest(4, 2), ValueError, "lo 4 must not exceed hi 2"),
        (lambda t: t.coldest(0, 7), IndexError, "hi 7 is out of range"),
        (lambda t: t.residents_by_heat(-1, 2), IndexError, "lo -1 is out of range"),
        (lambda t: t.hottest_missing(-1), ValueError, "k must be in [0,"),
        # The hot path.
        (lambda t: t.lookup(2, np.zeros((1, 8), i64)), IndexError, "layer 2 is out of range"),
        (lambda t: t.lookup(0, np.array([[0, 1], [2, 4]])), IndexError,
         "expert_ids[1, 1] = 4 is out of range [0, 4)"),
        (lambda t: t.lookup(0, np.array([[0, -1]], np.int32)), IndexError,
         "expert_ids[0, 1] = -1"),
        (lambda t: t.lookup(0, np.zeros(8, i64)), ValueError, "must be 2-D [T, K], got shape (8,)"),
        (lambda t: t.lookup(0, np.zeros((1, 2, 8), i64)), ValueError, "got shape (1, 2, 8)"),
        (lambda t: t.lookup(0, np.zeros((1, 8), np.float32)), ValueError, "got dtype float32"),
        (lambda t: t.lookup(0, np.zeros((1, 8), i64), np.zeros((1, 8), i64)), ValueError,
         "out_slots must be a writeable C-contiguous int32 array of shape (1, 8), got int64"),
        (lambda t: t.lookup(0, np.zeros((1, 8), i64), np.zeros((2, 8), np.int32)), ValueError,
         "got int32 (2, 8)"),
        (lambda t: t.lookup(0, np.zeros((1, 8), i64), None, np.zeros((1, 8), np.uint8)),
         ValueError, "out_hit must be a writeable C-contiguous bool array"),
        (lambda t: t.lookup(0, np.zeros((2, 4), i64), None, np.zeros((4, 2), bool).T),
         ValueError, "out_hit must be a writeable C-contiguous"),
        (lambda t: t.lookup(0, np.zeros((1, 6), i64), t.owner.reshape(1, 6)), ValueError,
         "out_slots must be a writeable"),
        (lambda t: t.lookup(0, np.zeros((1, 1), i64), [[0]]), ValueError,
         "out_slots must be a numpy array, got list"),
        (lambda t: t.split_token(2, np.zeros(8, i64), np.empty(41, i64)), IndexError,
         "layer 2 is out of range"),
        (lambda t: t.split_token(0, np.array([[0, 1, 4]]), np.empty(16, i64)), IndexError,
         "expert_ids(0, 2) = 4 is out of range [0, 4)"),
        (lambda t: t.split_token(0, np.array([0, -1], np.int32), np.empty(11, i64)),
         IndexError, "expert_ids(1,) = -1"),
        (lambda t: t.split_token(0, np.zeros((2, 4), i64), np.empty(41, i64)), ValueError,
         "one token's [K] or [1, K], got shape (2, 4)"),
        (lambda t: t.split_token(0, np.zeros(8, np.float32), np.empty(41, i64)), ValueError,
         "got dtype float32"),
        (lambda t: t.split_token(0, np.zeros(8, i64), np.empty(40, i64)), ValueError,
         "out must be a writeable C-contiguous int64 array of at least 5K + 1 = 41 elements, "
         "got int64 (40,)"),
        (lambda t: t.split_token(0, np.zeros(2, i64), np.empty(11, np.int32)), ValueError,
         "got int32 (11,)"),
        (lambda t: t.split_token(0, np.zeros(2, i64), np.empty(22, i64)[::2]), ValueError,
         "out must be a writeable C-contiguous"),
        (lambda t: t.split_token(0, np.zeros(2, i64), [0] * 11), ValueError,
         "out must be a numpy array, got list"),
        # Chunks and regions.
        (lambda t: t.mark_chunks([1, 5], True), IndexError, "element 1: chunk 5 is out of range"),
        (lambda t: t.mark_chunks([4, 1], False), ValueError,
         "element 1: chunk 1 cannot be unmapped, slot 2 touching it holds expert (1, 3)"),
        (lambda t: t.mark_chunks([3], 0), TypeError, "mapped must be a bool, got 0"),
        (lambda t: t.slots_completed_by(np.array([0.5])), ValueError, "chunks must be an integer"),
        (lambda t: t.slot_chunks(6), IndexError, "slot 6"),
        (lambda t: t.chunk_slots(5), IndexError, "chunk 5 is out of range [0, 5)"),
        (lambda t: t.chunks_within(3, 1), ValueError, "lo 3 must not exceed hi 1"),
        (lambda t: t.set_regions(top=2, floor=3), ValueError, "floor 3 must not exceed top 2"),
        (lambda t: t.set_regions(floor=7), IndexError, "floor 7 is out of range"),
    ]


@pytest.mark.parametrize(("call", "error", "words"), _bad_calls())
def test_bad_input_is_refused_by_name_and_changes_nothing(call, error, words):
    t = small()
    t.record(0, np.array([[1, 2, 2]]))
    t.lookup(1, np.array([[3, 0]]))
    t.evict(5)  # (0, 2) moves from slot 5 to slot 4, and slot 5 loses its last chunk
    t.assign(4, 0, 2)
    t.mark_chunks([4], False)
    before = state(t)
    with pytest.raises(error) as raised:
        call(t)
    assert words in str(raised.value)
    assert state(t) == before
    t.validate()


def test_unbacked_slots_cannot_be_filled():
    t = ResidencyTable(2, 4, 6, 3, 4)
    t.mark_chunks(np.array([1]), False)  # chunk 1 = bytes 4-7: slots 1 and 2
    assert t.backed.tolist() == [True, False, False, True, True, True]
    before = state(t)
    with pytest.raises(ValueError, match=r"slot 2 is not backed \(chunks \(1, 3\)"):
        t.assign(2, 0, 0)
    with pytest.raises(ValueError, match=r"element 1: slot 1 is not backed"):
        t.assign_many([0, 1], [0, 0], [0, 1])
    t.assign(0, 0, 0)
    with pytest.raises(ValueError, match="dst_slot 1 is not backed"):
        t.move(0, 1)
    t.evict(0)
    assert state(t) == before


# ---------------------------------------------------------------- geometry


def test_geometry_of_straddling_slots():
    t = ResidencyTable(1, 1, 6, 3, 4)  # see small()
    assert [t.slot_chunks(s) for s in range(6)] == [(0, 1), (0, 2), (1, 3), (2, 3), (3, 4), (3, 5)]
    assert [t.chunk_slots(c) for c in range(5)] == [(0, 2), (1, 3), (2, 4), (4, 6), (5, 6)]
    assert t.chunks_within(0, 6) == (0, 5)
    assert t.chunks_within(0, 2) == (0, 1)  # chunk 1 also touches slot 2
    assert t.chunks_within(4, 6) == (3, 5)  # chunk 4 reaches past the arena: slot 5 only
    assert t.chunks_within(5, 6) == (4, 5)
    assert t.chunks_within(1, 4) == (1, 3)
    lo, hi = t.chunks_within(1, 2)
    assert lo == hi  # a slot smaller than a chunk frees no chunk
    lo, hi = t.chunks_within(6, 6)
    assert lo == hi


def test_geometry_of_slots_spanning_many_chunks():
    t = ResidencyTable(1, 1, 3, 5 * 2**20, 2 * 2**20)  # 5 MiB slots over 2 MiB chunks
    assert t.n_chunks == 8
    assert [t.slot_chunks(s) for s in range(3)] == [(0, 3), (2, 5), (5, 8)]
    assert t.chunk_slots(2) == (0, 2) and t.chunk_slots(7) == (2, 3)
    assert t.chunks_within(1, 3) == (3, 8)


def test_giving_up_slots_and_giving_chunks_back():
    """The elastic K/V's path: unmap the chunks of the slots below top, later map them back."""
    t = ResidencyTable(1, 8, 6, 3, 4)
    t.assign_many(np.arange(6), np.zeros(6, int), np.arange(6))
    t.set_regions(top=5, floor=2)
    c_lo, c_hi = t.chunks_within(2, 5)  # give up slots 2-4: chunks lying wholly inside
    assert (c_lo, c_hi) == (2, 3)
    with pytest.raises(ValueError, match="chunk 2 cannot be unmapped, slot 2"):
        t.mark_chunks(np.arange(c_lo, c_hi), False)
    t.evict_many(t.residents_by_heat(2, 5))
    t.mark_chunks(np.arange(c_lo, c_hi), False)
    assert t.backed.tolist() == [True, True, False, False, True, True]
    assert t.slots_completed_by(np.array([], np.int64)).tolist() == []
    assert t.slots_completed_by(np.array([2, 2])).tolist() == [2, 3]
    t.mark_chunks([2], True)
    assert t.backed.all()
    t.validate()


# ---------------------------------------------------------------- heat


def test_record_counts_every_occurrence_and_decay_scales():
    t = ResidencyTable(2, 4, 2, 8, 8)
    t.record(1, np.array([[3, 0], [3, 2]], np.int32))
    t.record(1, [3])
    t.record(0, np.array([], np.int64))
    assert t.heat.tolist() == [[0, 0, 0, 0], [1, 0, 1, 3]]
    t.decay(0.5)
    assert t.heat.tolist() == [[0, 0, 0, 0], [0.5, 0, 0.5, 1.5]]


def test_heat_order_breaks_ties_by_profile_rank():
    t = ResidencyTable(1, 6, 6, 8, 8)
    t.set_rank(np.array([[5, 4, 3, 2, 1, 0]]))  # expert 5 hottest in the profile
    t.assign_many(np.arange(4), np.zeros(4, int), [0, 1, 2, 3])  # slot s holds expert s
    t.record(0, np.array([2, 2, 1]))
    # Heat: expert 2 (2.0), 1 (1.0), then 0 and 3 at 0.0 where rank 5 (expert 0) is colder.
    assert t.coldest(0, 6) == 0
    assert t.residents_by_heat(0, 6).tolist() == [0, 3, 1, 2]
    assert t.coldest(1, 4) == 3
    assert t.coldest(4, 6) == -1 and t.residents_by_heat(4, 4).tolist() == []
    assert t.hottest_missing(1).tolist() == [[0, 5]]
    assert t.hottest_missing(10).tolist() == [[0, 5], [0, 4]]
    t.record(0, [4])
    assert t.hottest_missing(2).tolist() == [[0, 4], [0, 5]]
    assert t.hottest_missing(0).shape == (0, 2)


def test_rank_from_counts_is_highest_first_with_ties_by_flat_id():
    t = ResidencyTable(2, 3, 2, 8, 8)
    t.set_rank_from_counts(np.array([[5, 0, 7], [5, 9, 0]], np.uint64))
    assert t.rank.tolist() == [[2, 4, 1], [3, 0, 5]]
    t.set_rank_from_counts(np.array([[0.5, 0.25, 0.5], [0, 1, 0]]))
    assert t.rank.tolist() == [[1, 3, 2], [4, 0, 5]]


# ---------------------------------------------------------------- the hot path


def test_lookup_returns_slots_and_hits_and_counts_them():
    t = small()
    slots, hit = t.lookup(0, np.array([[0, 1, 2], [2, 2, 3]]))
    assert slots.dtype == np.int32 and hit.dtype == np.bool_
    assert slots.tolist() == [[0, -1, 5], [5, 5, -1]]
    assert hit.tolist() == [[True, False, True], [True, True, False]]
    assert (t.hits, t.lookups) == (4, 6)
    out = (np.empty((1, 2), np.int32), np.empty((1, 2), bool))
    returned = t.lookup(1, np.array([[3, 1]], np.uint8), *out)
    assert returned[0] is out[0] and returned[1] is out[1]
    assert out[0].tolist() == [[2, -1]] and out[1].tolist() == [[True, False]]
    assert (t.hits, t.lookups) == (5, 8)
    empty_slots, _ = t.lookup(0, np.zeros((0, 8), np.int64))
    assert empty_slots.shape == (0, 8) and t.lookups == 8
    t.reset_counters()
    assert (t.hits, t.lookups) == (0, 0)


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.int16, np.uint32, ">i8"])
def test_lookup_reads_any_integer_layout(dtype):
    rng = np.random.default_rng(1)
    t = ResidencyTable(2, 16, 8, 8, 8)
    t.assign_many(np.arange(8), np.ones(8, int), rng.permutation(16)[:8])
    ids = rng.integers(0, 16, (5, 3)).astype(dtype)
    expected = t.res[1][ids.astype(np.int64)]
    np.testing.assert_array_equal(t.lookup(1, ids)[0], expected)
    np.testing.assert_array_equal(t.lookup(1, np.asfortranarray(ids))[0], expected)
    np.testing.assert_array_equal(t.lookup(1, ids.tolist())[0], expected)


def test_large_lookups_release_the_gil_and_agree():
    t = ResidencyTable(1, 128, 64, 8, 8)
    t.assign_many(np.arange(64), np.zeros(64, int), np.arange(0, 128, 2))
    ids = np.random.default_rng(2).integers(0, 128, (2048, 8))
    slots, hit = t.lookup(0, ids)
    np.testing.assert_array_equal(slots, np.where(ids % 2 == 0, ids // 2, -1))
    np.testing.assert_array_equal(hit, ids % 2 == 0)
    assert (t.hits, t.lookups) == (int(hit.sum()), ids.size)
    ids[2047, 7] = 128
    with pytest.raises(IndexError, match=r"expert_ids\[2047, 7\] = 128"):
        t.lookup(0, ids)
    assert t.lookups == ids.size


# ---------------------------------------------------------------- save and load


def busy() -> ResidencyTable:
    t = small()
    t.set_rank(np.array([[7, 6, 5, 4], [3, 2, 1, 0]]))
    t.record(1, np.array([[0, 1, 1]]))
    t.decay(0.75)
    t.lookup(0, np.array([[0, 1]]))
    t.evict(5)
    t.mark_chunks([4], False)
    t.set_regions(top=4, floor=1)
    return t


def test_save_and_load_round_trip_byte_for_byte(tmp_path):
    t = busy()
    t.save(tmp_path / "books.npz")
    loaded = ResidencyTable.load(str(tmp_path / "books.npz"), n_layers=2, chunk_bytes=4)
    assert state(loaded) == state(t)
    assert loaded.slot_bytes == 3 and loaded.n_chunks == 5
    loaded.save(tmp_path / "again.npz")
    t.save(tmp_path / "books.npz")  # over the old file
    assert (tmp_path / "again.npz").read_bytes() == (tmp_path / "books.npz").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again.npz", "books.npz"]


def test_load_checks_the_expected_geometry(tmp_path):
    busy().save(tmp_path / "books.npz")
    with pytest.raises(ValueError, match="n_experts = 4, expected 8"):
        ResidencyTable.load(tmp_path / "books.npz", n_experts=8)


def _rewrite(path, **changes):
    with np.load(path) as z:
        fields = {name: z[name] for name in z.files}
    fields.update(changes)
    for name in [k for k, v in fields.items() if v is None]:
        del fields[name]
    np.savez(path, **fields)


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"res": None}, "fields ['res'] are missing"),
        ({"format": np.array("something else")}, "is not a residency table"),
        ({"version": np.array(2)}, "format version 2, this build reads version 1"),
        ({"shape": np.array([2, 4, 6, 3])}, "shape must be int64 [5]"),
        ({"shape": np.array([2, 4, 6, 3, 0])}, "chunk_mapped must be bool (-1,)"),
        # Arrays that fit the stored shape, but slots past the arena cap (5 chunks, as stored).
        ({"shape": np.array([2, 4, 6, 2**61, -(-6 * 2**61 // 5)])}, "slot_bytes must be in [1,"),
        ({"shape": np.array([2, 4, 2**31 - 1, 3, 4])}, "owner must be int32 (2147483647,)"),
        ({"res": np.full((2, 4), -1, np.int64)}, ("res must be int32 (2, 4)", "got int64 (2, 4)")),
        ({"heat": np.zeros((4, 2))}, ("heat must be float64 (2, 4)", "got float64 (4, 2)")),
        ({"chunk_mapped": np.ones(6, bool)}, "chunk_mapped must be bool (5,) for a table"),
        ({"owner": np.array([0, -1, 7, -1, -1, 1], np.int32)},
         "owner[5] = 1 but res(0, 1) = -1"),
        ({"rank": np.zeros((2, 4), np.int32)}, "rank is not a permutation"),
        ({"heat": np.full((2, 4), -1.0)}, "negative or non-finite"),
        ({"regions": np.array([2, 3])}, "floor (3) <= top (2)"),
        ({"counters": np.array([9, 2])}, "hits (9) <= lookups (2)"),
        ({"chunk_mapped": np.array([True, False, True, True, False])},
         "slot 2 holds expert (1, 3) but is not backed"),
    ],
)
def test_a_corrupt_file_is_a_clear_error(tmp_path, changes, words):
    path = tmp_path / "books.npz"
    busy().save(path)
    _rewrite(path, **changes)
    with pytest.raises(ValueError) as raised:
        ResidencyTable.load(path)
    for fragment in (str(path), *([words] if isinstance(words, str) else words)):
        assert fragment in str(raised.value)


def test_a_file_that_is_not_an_npz_is_a_clear_error(tmp_path):
    path = tmp_path / "books.npz"
    busy().save(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="is not a readable residency table"):
        ResidencyTable.load(path)
    path.write_bytes(b"not a zip at all")
    with pytest.raises(ValueError, match="is not a readable residency table"):
        ResidencyTable.load(path)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("res.npy", b"\x93NUMPY garbage")
    with pytest.raises(ValueError, match="is not a readable residency table"):
        ResidencyTable.load(path)
    with pytest.raises(FileNotFoundError):
        ResidencyTable.load(tmp_path / "missing.npz")
