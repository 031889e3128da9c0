"""The read-only view: its arrays cannot be written, and its numpy geometry is the table's."""

import itertools

import numpy as np
import pytest

from strata.policies import ResidencyView
from support.policy_tables import make_table

GEOMETRIES = [(3, 2), (2, 3), (5, 5), (4, 16), (7, 3), (1, 1)]  # (slot_bytes, chunk_bytes)


def test_arrays_are_read_only():
    view = ResidencyView(make_table())
    for name in ("res", "owner", "heat", "rank", "chunk_mapped", "backed"):
        array = getattr(view, name)
        assert not array.flags.writeable, name
        with pytest.raises(ValueError):
            array[...] = 0
    for mutator in ("assign", "evict", "move", "mark_chunks", "record", "set_regions"):
        assert not hasattr(view, mutator)


@pytest.mark.parametrize(("slot_bytes", "chunk_bytes"), GEOMETRIES)
def test_bounds_match_the_table(slot_bytes, chunk_bytes):
    table = make_table(n_slots=9, slot_bytes=slot_bytes, chunk_bytes=chunk_bytes)
    view = ResidencyView(table)
    lo, hi = view.slot_chunk_bounds()
    pairs = [(int(a), int(b)) for a, b in zip(lo, hi, strict=True)]
    assert pairs == [table.slot_chunks(s) for s in range(9)]
    lo, hi = view.chunk_slot_bounds()
    assert [(int(a), int(b)) for a, b in zip(lo, hi, strict=True)] == [
        table.chunk_slots(c) for c in range(table.n_chunks)
    ]


def _freed_by_brute_force(table, slots):
    """Chunks every backed slot touching which is given up, from the table's own calls."""
    freed = []
    for chunk in range(table.n_chunks):
        touching = range(*table.chunk_slots(chunk))
        if not table.chunk_mapped[chunk] or not set(touching) & set(slots):
            continue
        if all(s in slots or not table.backed[s] for s in touching):
            freed.append(chunk)
    return freed


@pytest.mark.parametrize(("slot_bytes", "chunk_bytes"), GEOMETRIES)
def test_chunks_freed_by_every_contiguous_run(slot_bytes, chunk_bytes):
    table = make_table(n_slots=8, slot_bytes=slot_bytes, chunk_bytes=chunk_bytes)
    view = ResidencyView(table)
    for lo, hi in itertools.combinations(range(9), 2):
        slots = list(range(lo, hi))
        assert view.chunks_freed_by(slots).tolist() == _freed_by_brute_force(table, slots)
        if hi < 8:
            # For a run the table's own chunks_within answers the same.
            c_lo, c_hi = table.chunks_within(lo, hi)
            assert view.chunks_freed_by(slots).tolist() == list(range(c_lo, c_hi))


def test_chunks_freed_after_a_neighbour_lost_its_memory():
    # Slots of 3 bytes over chunks of 2: slot 6 is [18, 21) (chunks 9, 10), slot 7 [21, 24)
    # (chunks 10, 11). With chunk 11 unmapped slot 7 is unbacked, so giving up slot 6 frees 10.
    table = make_table(top=8, floor=2)
    view = ResidencyView(table)
    assert view.chunks_freed_by([6]).tolist() == [9]
    table.evict(7)
    table.mark_chunks(np.array([11]), False)
    assert view.chunks_freed_by([6]).tolist() == [9, 10]
    assert view.givable_slots().tolist() == [2, 3, 4, 5, 6]
    assert view.givable_chunks() == 8  # chunks 3 .. 10


def test_heat_position_is_heat_then_rank():
    table = make_table(n_layers=1, n_experts=4, n_slots=4, slot_bytes=1, chunk_bytes=1)
    table.set_rank(np.array([[3, 2, 1, 0]]))
    table.record(0, np.array([1, 1, 0]))
    # heat: expert 1 twice, expert 0 once; then by rank, expert 3 (rank 0) before expert 2.
    assert ResidencyView(table).heat_position().tolist() == [[1, 0, 3, 2]]
