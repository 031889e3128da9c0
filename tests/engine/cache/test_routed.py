"""Routed rows grouped by expert, against a per-row reference."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from strata._residency import ResidencyTable
from strata.engine.experts.routed import Routed


def _reference(ids, mask):
    """{expert: [rows ascending]} of the masked rows, one row at a time."""
    grouped = {}
    for row, (expert, kept) in enumerate(zip(ids.reshape(-1).tolist(), mask.reshape(-1).tolist(),
                                             strict=True)):
        if kept:
            grouped.setdefault(expert, []).append(row)
    return dict(sorted(grouped.items()))


def _as_dict(routed):
    return {e: routed.expert_rows(i).tolist() for i, e in enumerate(routed.experts.tolist())}


routings = st.tuples(st.integers(1, 6), st.integers(1, 4), st.integers(1, 9)).flatmap(
    lambda tke: st.tuples(
        arrays(np.int64, (tke[0], tke[1]), elements=st.integers(0, tke[2] - 1)),
        arrays(np.bool_, (tke[0], tke[1]))))


wide_routings = st.sampled_from([9, 300, 70_000, 1 << 40]).flatmap(
    lambda n_experts: st.tuples(
        arrays(np.int64, (5, 4), elements=st.integers(0, n_experts - 1)),
        arrays(np.bool_, (5, 4))))


@given(wide_routings)
def test_of_sorts_ids_of_every_width_as_the_reference(routing):
    """The sort keys narrow to uint8 or uint16 where the ids fit (radix sorts), stay int64
    where they do not; the groups are the reference's either way."""
    ids, mask = routing
    assert _as_dict(Routed.of(ids, mask)) == _reference(ids, mask)


def test_sort_keys_take_the_narrowest_type_that_holds_the_ids():
    from strata.engine.experts.routed import sort_keys

    for top, dtype in ((255, np.uint8), (256, np.uint16), (65_535, np.uint16),
                       (65_536, np.int64)):
        keys = sort_keys(np.array([3, top, 0], dtype=np.int64))
        assert keys.dtype == dtype and keys.tolist() == [3, top, 0]
    assert sort_keys(np.array([-1, 2])).dtype == np.int64  # not narrowed: order would change
    assert sort_keys(np.empty(0, dtype=np.int64)).size == 0


@given(routings, st.data())
def test_of_and_group_match_the_reference(routing, data):
    ids, mask = routing
    routed = Routed.of(ids, mask)
    assert _as_dict(routed) == _reference(ids, mask)
    lo = data.draw(st.integers(0, routed.n_experts))
    hi = data.draw(st.integers(lo, routed.n_experts))
    group = routed.group(lo, hi)
    kept = set(routed.experts[lo:hi].tolist())
    in_group = mask & np.isin(ids, list(kept))
    assert _as_dict(group) == _reference(ids, in_group) and group.top_k == routed.top_k
    assert group.starts[0] == 0 and group.starts[-1] == group.n_rows
    # Views of the parent's arrays, read-only as its own (no copies on a decode call's path).
    for array in (group.experts, group.starts, group.rows):
        assert array.dtype == np.int64 and not array.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            array[:1] = 0
    assert routed.group(0, routed.n_experts) is routed


@given(st.integers(1, 8), st.data())
def test_the_books_split_of_one_token_is_its_misses_grouped(top_k, data):
    """`Routed.of_split` over `ResidencyTable.split_token`'s layout: the missed rows grouped by
    expert as `Routed.of` groups them, read-only."""
    n_experts = data.draw(st.integers(top_k, 12))
    ids = np.array([data.draw(st.permutations(range(n_experts)))[:top_k]], dtype=np.int64)
    resident = data.draw(st.sets(st.sampled_from(ids[0].tolist())))
    table = ResidencyTable(1, n_experts, len(resident) + 1, 64, 64)
    for slot, expert in enumerate(sorted(resident)):
        table.assign(slot, 0, expert)
    split = np.zeros(5 * top_k + 1, dtype=np.int64)
    n_hits, n_missed = table.split_token(0, ids, split)
    misses = Routed.of_split(split, top_k, n_hits, n_missed)
    mask = ~np.isin(ids, sorted(resident))
    assert _as_dict(misses) == _reference(ids, mask) and misses.top_k == top_k
    assert not misses.rows.flags.writeable and split.flags.writeable
    if not n_missed:
        return
    # A part of them in one step: what `group` makes of the whole.
    lo = data.draw(st.integers(0, n_missed - 1))
    hi = data.draw(st.integers(lo + 1, n_missed))
    part, group = Routed.of_split(split, top_k, n_hits, n_missed, lo, hi), misses.group(lo, hi)
    for name in ("experts", "starts", "rows"):
        assert getattr(part, name).tolist() == getattr(group, name).tolist()
        assert not getattr(part, name).flags.writeable
    with pytest.raises(ValueError, match="not a part of"):
        Routed.of_split(split, top_k, n_hits, n_missed, lo, lo)


@given(routings, st.data())
def test_pick_matches_the_reference_for_any_experts(routing, data):
    ids, mask = routing
    routed = Routed.of(ids, mask)
    chosen = sorted(data.draw(st.sets(st.integers(0, max(routed.n_experts - 1, 0)),
                                      max_size=routed.n_experts)))
    picked = routed.pick(chosen)
    kept = routed.experts[chosen].tolist()
    assert _as_dict(picked) == _reference(ids, mask & np.isin(ids, kept))
    assert picked.starts[0] == 0 and picked.starts[-1] == picked.n_rows
    if len(chosen) >= 2:  # not ascending: refused
        with pytest.raises(ValueError, match="must ascend"):
            routed.pick(chosen[::-1])


def test_groups_rows_by_expert_ascending():
    ids = np.array([[3, 1], [1, 0], [3, 2]])  # [T=3, K=2]
    routed = Routed.of(ids)
    assert routed.experts.tolist() == [0, 1, 2, 3]
    assert routed.starts.tolist() == [0, 1, 3, 4, 6]
    # rows t*K + k: expert 1 at (0, 1) = 1 and (1, 0) = 2; expert 3 at 0 and 4
    assert routed.rows.tolist() == [3, 1, 2, 5, 0, 4]
    assert routed.tokens().tolist() == [1, 0, 1, 2, 0, 2]
    assert routed.expert_rows(3).tolist() == [0, 4]
    assert (routed.n_experts, routed.n_rows, routed.top_k) == (4, 6, 2)


def test_mask_keeps_only_its_rows():
    rng = np.random.default_rng(0)
    ids = np.stack([rng.permutation(8)[:3] for _ in range(20)])  # [20, 3]
    mask = rng.random(ids.shape) < 0.4
    routed = Routed.of(ids, mask)
    flat = ids.reshape(-1)
    expected = {}
    for row in np.flatnonzero(mask.reshape(-1)):
        expected.setdefault(int(flat[row]), []).append(int(row))
    assert routed.experts.tolist() == sorted(expected)
    for i, expert in enumerate(routed.experts.tolist()):
        assert routed.expert_rows(i).tolist() == expected[expert]
    assert not routed.rows.flags.writeable


def test_empty_mask():
    routed = Routed.of(np.array([[1, 2]]), np.zeros((1, 2), bool))
    assert routed.n_experts == 0 and routed.n_rows == 0 and routed.starts.tolist() == [0]


def test_bad_shapes():
    with pytest.raises(ValueError, match=r"expert_ids must be \[T, K\]"):
        Routed.of(np.arange(4))
    with pytest.raises(ValueError, match=r"mask must be \(2, 2\)"):
        Routed.of(np.zeros((2, 2), int), np.zeros((2, 3), bool))
    with pytest.raises(ValueError, match="starts must be"):
        Routed(np.array([1]), np.array([0, 2]), np.array([0], np.int64), 1)
    # An expert that owns no row: R == M would then not mean one row each.
    with pytest.raises(ValueError, match=r"rising from 0 to R = 3, every expert owning a row, "
                       r"got \[0, 0, 3\]"):
        Routed(np.array([1, 2]), np.array([0, 0, 3]), np.arange(3, dtype=np.int64), 1)
    with pytest.raises(ValueError, match="starts must be"):
        Routed(np.array([1]), np.array([1, 1]), np.array([0], np.int64), 1)
    with pytest.raises(ValueError, match=r"experts \[2, 1\) are not within \[0, 1\]"):
        Routed.of(np.array([[1, 1]])).group(2, 1)
    with pytest.raises(ValueError, match="rows must be int64"):
        Routed(np.array([1]), np.array([0, 1]), np.array([0], np.int32), 1)
