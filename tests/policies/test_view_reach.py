"""Nothing a policy is given leads back to the books: a plugin that walks everything reachable
from its arguments (the view, its arrays, the frozen arrays beside it) in every decision finds
no table, no method bound to one and no writeable array over its memory; and the walk itself
finds each of those where they are (so that an empty answer means something)."""

import os
from unittest import mock

import numpy as np
import pytest

from strata._residency import ResidencyTable, frozen
from strata.books import CheckedPolicy
from strata.formats.trace import DECODE, PROMPT, Trace
from strata.policies import PolicyError, ResidencyView
from strata.policies.builtin.lru import Lru
from strata.sim.kv_sim import KvConfig
from strata.sim.replay import Replay, ReplayConfig
from support.policy_tables import make_table
from support.reach import leaks

DECISIONS = ("give_up", "relocate", "refill", "observe", "admit")


class Walker(Lru):
    """`lru` (a subclass: the generic path, so every decision is asked), walking what each
    decision is given before answering it."""

    name = "walker"
    table: ResidencyTable | None = None  # the books to look for, set by the test

    def __init__(self, options=None):
        super().__init__(options)
        self.walked: dict[str, int] = dict.fromkeys(DECISIONS, 0)
        self.found: list[str] = []

    def _walk(self, method, *given):
        self.walked[method] += 1
        self.found += [f"{method}: {leak}" for leak in leaks(given, self.table)]

    def give_up(self, view, n_chunks):
        self._walk("give_up", view, n_chunks)
        return super().give_up(view, n_chunks)

    def relocate(self, view, slots):
        self._walk("relocate", view, slots)
        return super().relocate(view, slots)

    def refill(self, view, free_slots):
        self._walk("refill", view, free_slots)
        return super().refill(view, free_slots)

    def observe(self, view, layer, expert_ids, hit_mask):
        self._walk("observe", view, expert_ids, hit_mask)
        super().observe(view, layer, expert_ids, hit_mask)

    def admit(self, view, layer, missed_experts):
        self._walk("admit", view, missed_experts)
        return super().admit(view, layer, missed_experts)


def _trace():
    """Two requests: a long prompt that grows the K/V, then a short one that trims it."""
    rng = np.random.default_rng(3)
    steps = [6] + [1] * 4 + [1] * 3
    ids = np.stack([rng.permutation(8)[:2] for _ in range(sum(steps))]).reshape(-1, 1, 2)
    ids = np.repeat(ids, 2, axis=1).astype(np.int32)  # 2 layers
    phase = [PROMPT] + [DECODE] * 7
    return Trace(8, ids, np.concatenate([[0], np.cumsum(steps)]), phase, [0, 5, 8])


def test_every_decision_of_a_replay_sees_nothing_that_leads_to_the_books():
    trace = _trace()
    kv = KvConfig(max_context=10, slot_bytes=2, kv_segment_cell_bytes=1, kv_segments=1,
                  chunk_bytes=2, floor_slots=1)
    policy = Walker({"max_admits": 2})
    env = {"STRATA_KV_GROW_INIT": "2", "STRATA_KV_GROW_STEP": "2", "STRATA_KV_GROW_FLOOR": ""}
    with mock.patch.dict(os.environ, env):
        replay = Replay(trace, policy, ReplayConfig(slots=8, loan_slots=2, kv=kv),
                        np.arange(16).reshape(2, 8))
        Walker.table = replay.table
        try:
            replay.run()
        finally:
            Walker.table = None
    assert replay.path == "generic"
    assert all(policy.walked[method] for method in DECISIONS), policy.walked
    assert policy.found == []


def test_a_give_up_asked_with_the_loan_region_sees_nothing_either():
    table = make_table(top=8, floor=2)
    policy = Walker()
    Walker.table = table
    try:
        CheckedPolicy(policy, table).give_up(2, top=6)
    finally:
        Walker.table = None
    assert policy.walked["give_up"] == policy.walked["relocate"] == 1
    assert policy.found == []


def test_a_policy_cannot_reach_the_table_through_the_view():
    table = make_table(top=8, floor=2)
    view = ResidencyView(table)
    with pytest.raises(AttributeError):
        view._table  # noqa: B018 (the attribute of the view this replaced)
    with pytest.raises(AttributeError):
        view._t  # noqa: B018 (the field the table is kept in, not readable from Python)
    with pytest.raises(AttributeError):
        view.evil = table
    with pytest.raises(TypeError):
        type(view).evict = ResidencyTable.evict
    with pytest.raises(TypeError):
        class _Sub(ResidencyView):
            pass
    with pytest.raises(ValueError):
        view.owner.flags.writeable = True
    owner = view.owner
    owner.shape = (2, 5)  # an array's own shape: not the next reader's
    assert view.owner.shape == (10,) and table.owner.shape == (10,)


def test_what_a_policy_raises_reaching_for_the_books_is_its_error():
    class Reaching(Lru):
        name = "reaching"

        def give_up(self, view, n_chunks):
            view._table.evict(0)

    table = make_table(top=8, floor=2)
    with pytest.raises(PolicyError, match=r"'reaching', give_up: raised AttributeError"):
        CheckedPolicy(Reaching(), table).give_up(2)
    assert table.owner[0] == 0


class _OldView:
    """The view as it was: the table in a slot."""

    __slots__ = ("_table",)

    def __init__(self, table):
        self._table = table


class _PropertyView:
    """A view whose property closes over the table."""

    def __init__(self, table):
        type(self).res = property(lambda _: table.res)


@pytest.mark.parametrize(("make", "where"), [
    (lambda t: _OldView(t), "_table']: the table"),  # through what pickling would save
    (lambda t: {"view": [lambda: t.owner]}, "__closure__[0]: the table"),
    (lambda t: _PropertyView(t), ".res.fget.__closure__[0]: the table"),
    (lambda t: t.evict, "root: a method bound to the table"),
])
def test_the_walk_finds_the_books_where_they_are(make, where):
    table = make_table()
    found = leaks(make(table), table)
    assert any(leak.endswith(where) for leak in found), found


def test_the_walk_finds_a_writeable_array_behind_a_read_only_one():
    # The books' arrays used to be read-only arrays over a read-only memoryview, whose `.obj`
    # is the writeable array itself.
    books = np.full(4, -1, np.int32)
    old_style = np.frombuffer(memoryview(books).toreadonly(), np.int32)
    assert not old_style.flags.writeable
    assert leaks(old_style, _TableLike(books)) == [
        "root.base.obj: a writeable array over the books"]
    assert leaks(frozen(books), _TableLike(books)) == []
    assert leaks(old_style, _TableLike(np.zeros(4, np.int32))) == []  # other memory


class _TableLike:
    """Stands in for a table whose memory is `array`, to test the walk on arrays."""

    def __init__(self, array):
        self.res = self.owner = self.heat = self.rank = self.chunk_mapped = self.backed = array
