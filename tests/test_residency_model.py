"""The Cython ResidencyTable against the pure-Python reference, step by step (hypothesis).

Geometries are tiny and deliberately unaligned (slots smaller and larger than chunks, straddling
chunk boundaries) so that collisions, double assigns, unbacked slots and partial chunks are all
common. Arguments are sometimes out of range. After every step the two must agree on every array
and counter, and `validate()` must pass; a call the reference refuses must be refused with the same
exception type and leave the Cython table byte-identical.
"""

import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from strata._residency import ResidencyTable
from support.reference_residency import ReferenceResidency

ARRAYS = ("res", "owner", "heat", "rank", "chunk_mapped", "backed")


def snapshot(table: ResidencyTable) -> tuple:
    arrays = tuple(getattr(table, name).tobytes() for name in ARRAYS)
    return (*arrays, table.top, table.floor, table.hits, table.lookups, table.n_resident)


class ResidencyModel(RuleBasedStateMachine):
    @initialize(
        n_layers=st.integers(1, 3),
        n_experts=st.integers(1, 5),
        n_slots=st.integers(0, 9),
        slot_bytes=st.integers(1, 12),
        chunk_bytes=st.integers(1, 16),
        data=st.data(),
    )
    def init(self, n_layers, n_experts, n_slots, slot_bytes, chunk_bytes, data):
        shape = (n_layers, n_experts, n_slots, slot_bytes, chunk_bytes)
        self.table = ResidencyTable(*shape)
        self.ref = ReferenceResidency(*shape)
        self.L, self.E, self.S, self.C = n_layers, n_experts, n_slots, self.ref.n_chunks
        self.data = data
        self.tmp = tempfile.TemporaryDirectory()

    def teardown(self):
        if hasattr(self, "tmp"):
            self.tmp.cleanup()

    # --- argument strategies: mostly in range, sometimes one past either end ---
    def draw(self, strategy):
        return self.data.draw(strategy)

    def index(self, bound):
        """In [0, bound) nine times in ten (when it can be); otherwise -1 or bound."""
        if bound > 0 and self.draw(st.integers(0, 9)) > 0:
            return self.draw(st.integers(0, bound - 1))
        return self.draw(st.sampled_from([-1, bound]))

    def slot(self):
        return self.index(self.S)

    def layer(self):
        return self.index(self.L)

    def expert(self):
        return self.index(self.E)

    def bound(self):
        return self.index(self.S + 1)

    def ids(self, shape):
        ids = self.draw(st.lists(st.integers(0, self.E - 1), min_size=shape, max_size=shape))
        if ids and self.draw(st.integers(0, 9)) == 0:  # one bad id, anywhere
            ids[self.draw(st.integers(0, len(ids) - 1))] = self.draw(st.sampled_from([-1, self.E]))
        return ids

    def both(self, method, *args, **kwargs):
        """Call method on both; returns (expected, got), or None when both refused it."""
        before = snapshot(self.table)
        try:
            expected = getattr(self.ref, method)(*args, **kwargs)
        except (IndexError, ValueError, TypeError) as e:
            event(f"{method}: refused ({type(e).__name__})")
            with pytest.raises(type(e)):
                getattr(self.table, method)(*args, **kwargs)
            assert snapshot(self.table) == before, f"{method} failed but changed the table"
            return None
        event(f"{method}: done")
        return expected, getattr(self.table, method)(*args, **kwargs)

    # --- residency ---
    @rule()
    def assign(self):
        self.both("assign", self.slot(), self.layer(), self.expert())

    @rule()
    def evict(self):
        result = self.both("evict", self.slot())
        if result:
            assert result[0] == result[1]

    @rule()
    def move(self):
        self.both("move", self.slot(), self.slot())

    @rule(n=st.integers(0, 4))
    def assign_many(self, n):
        slots = [self.slot() for _ in range(n)]
        layers = [self.layer() for _ in range(n)]
        experts = [self.expert() for _ in range(n)]
        self.both("assign_many", np.array(slots), np.array(layers), np.array(experts))

    @rule(n=st.integers(0, 4))
    def evict_many(self, n):
        result = self.both("evict_many", np.array([self.slot() for _ in range(n)], np.int32))
        if result:
            assert result[1].dtype == np.int32
            np.testing.assert_array_equal(result[1], result[0])

    @rule(n=st.integers(0, 4))
    def move_many(self, n):
        self.both("move_many", [self.slot() for _ in range(n)], [self.slot() for _ in range(n)])

    # --- guided steps that are valid by construction, so that the books fill up and move ---
    @rule(data=st.data())
    def fill(self, data):
        free = [s for s in range(self.S) if s not in self.ref.owner and self.ref.is_backed(s)]
        missing = [x for x in self.ref.experts if x not in self.ref.res]
        n = data.draw(st.integers(0, min(len(free), len(missing))))
        slots = data.draw(st.permutations(free))[:n]
        experts = data.draw(st.permutations(missing))[:n]
        layers, ids = [x[0] for x in experts], [x[1] for x in experts]
        assert self.both("assign_many", np.array(slots), np.array(layers), np.array(ids))

    @rule(data=st.data())
    def valid_move(self, data):
        free = [s for s in range(self.S) if s not in self.ref.owner and self.ref.is_backed(s)]
        if free and self.ref.owner:
            src = data.draw(st.sampled_from(sorted(self.ref.owner)))
            assert self.both("move", src, data.draw(st.sampled_from(free)))

    @rule(data=st.data(), under_resident=st.booleans())
    def unmap_chunks(self, data, under_resident):
        """Unmap chunks no resident sits on (done), or with one that one does (refused)."""
        def occupied(c):
            return any(s in self.ref.owner for s in self.ref.slots_of(c))

        free = [c for c in range(self.C) if not occupied(c)]
        taken = [c for c in range(self.C) if occupied(c)]
        chunks = data.draw(st.lists(st.sampled_from(free), max_size=3)) if free else []
        if under_resident and taken:
            chunks.insert(data.draw(st.integers(0, len(chunks))), data.draw(st.sampled_from(taken)))
        result = self.both("mark_chunks", chunks, False)
        assert (result is None) == (under_resident and bool(taken))

    @rule()
    def queries(self):
        result = self.both("slot_of", self.layer(), self.expert())
        if result:
            assert result[0] == result[1]
        result = self.both("expert_in", self.slot())
        if result:
            assert result[0] == result[1]

    # --- heat ---
    @rule(t=st.integers(0, 3), k=st.integers(1, 3))
    def record(self, t, k):
        ids = np.array(self.ids(t * k), np.int64).reshape(t, k)
        self.both("record", self.layer(), ids)

    @rule(factor=st.sampled_from([0.5, 0.75, 0.9, 1.0, 0.0, 1.5, -0.25]))
    def decay(self, factor):
        self.both("decay", factor)

    @rule()
    def coldest(self):
        lo, hi = self.bound(), self.bound()
        result = self.both("coldest", lo, hi)
        if result:
            assert result[0] == result[1]
        result = self.both("residents_by_heat", lo, hi)
        if result:
            assert result[1].dtype == np.int32
            assert result[1].tolist() == result[0]

    @rule(k=st.integers(-1, 20))
    def hottest_missing(self, k):
        result = self.both("hottest_missing", k)
        if result:
            assert result[1].dtype == np.int32
            np.testing.assert_array_equal(result[1], result[0])

    @rule(data=st.data())
    def set_rank(self, data):
        perm = data.draw(st.permutations(range(self.L * self.E)))
        self.both("set_rank", np.array(perm, np.int64).reshape(self.L, self.E))

    @rule(data=st.data())
    def set_rank_from_counts(self, data):
        n = self.L * self.E
        counts = data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
        self.both("set_rank_from_counts", np.array(counts, np.uint16).reshape(self.L, self.E))

    # --- the hot path ---
    @rule(t=st.integers(0, 4), k=st.integers(1, 3), dtype=st.sampled_from([np.int64, np.int32]))
    def lookup(self, t, k, dtype):
        ids = np.array(self.ids(t * k), dtype).reshape(t, k)
        layer = self.layer()
        out = (np.full((t, k), 7, np.int32), np.zeros((t, k), bool))
        before = snapshot(self.table)
        result = self.both("lookup", layer, ids)
        if result:
            (slots, hit), (got_slots, got_hit) = result
            assert got_slots.dtype == np.int32 and got_hit.dtype == np.bool_
            np.testing.assert_array_equal(got_slots, slots)
            np.testing.assert_array_equal(got_hit, hit)
            # The same lookup into preallocated buffers: same answer, the buffers returned.
            self.ref.lookup(layer, ids)
            returned = self.table.lookup(layer, ids, *out)
            assert returned[0] is out[0] and returned[1] is out[1]
            np.testing.assert_array_equal(out[0], slots)
            np.testing.assert_array_equal(out[1], hit)
        else:
            assert snapshot(self.table) == before

    @rule(k=st.integers(0, 5), dtype=st.sampled_from([np.int64, np.int32]),
          two_d=st.booleans(), spare=st.integers(0, 2), bad_out=st.integers(0, 19))
    def split_token(self, k, dtype, two_d, spare, bad_out):
        ids = np.array(self.ids(k), dtype).reshape((1, k) if two_d else (k,))
        layer = self.layer()
        size = 5 * k + 1 + spare  # a longer buffer is fine: only the sections are written
        # One time in twenty a buffer one element short: refused.
        outs = [np.full(size - (bad_out == 0) * (spare + 1), -7, np.int64) for _ in range(2)]
        before = snapshot(self.table)
        try:
            expected = self.ref.split_token(layer, ids, outs[0])
        except (IndexError, ValueError) as e:
            event(f"split_token: refused ({type(e).__name__})")
            with pytest.raises(type(e)):
                self.table.split_token(layer, ids, outs[1])
            assert snapshot(self.table) == before, "split_token failed but changed the table"
            return
        event(f"split_token: done, {expected[0]} hits")
        got = self.table.split_token(layer, ids, outs[1])
        assert got == expected
        h, m = expected
        r = k - h
        for lo, n in ((0, h + k), (2 * k, r), (3 * k, m), (4 * k, m + 1)):
            np.testing.assert_array_equal(outs[1][lo:lo + n], outs[0][lo:lo + n])

    @rule()
    def reset_counters(self):
        self.both("reset_counters")

    # --- geometry and chunks ---
    @rule(data=st.data())
    def mark_chunks(self, data):
        chunks = [self.index(self.C) for _ in range(data.draw(st.integers(0, 3)))]
        self.both("mark_chunks", np.array(chunks, np.int64), data.draw(st.booleans()))

    @rule(data=st.data())
    def slots_completed_by(self, data):
        chunks = [self.index(self.C) for _ in range(data.draw(st.integers(0, 4)))]
        result = self.both("slots_completed_by", np.array(chunks, np.int16))
        if result:
            assert result[1].dtype == np.int32
            assert result[1].tolist() == result[0]

    @rule()
    def geometry(self):
        for method, index in (("slot_chunks", self.slot()),
                              ("chunk_slots", self.index(self.C))):
            result = self.both(method, index)
            if result:
                assert result[0] == result[1]
        result = self.both("chunks_within", self.bound(), self.bound())
        if result:
            c_lo, c_hi = result[1]
            assert c_lo <= c_hi
            assert set(range(c_lo, c_hi)) == result[0]

    @rule()
    def set_regions(self):
        kwargs = {}
        if self.draw(st.booleans()):
            kwargs["top"] = self.bound()
        if self.draw(st.booleans()):
            kwargs["floor"] = self.bound()
        self.both("set_regions", **kwargs)

    # --- persistence: the loaded table carries on in place of the saved one ---
    @rule()
    def save_and_load(self):
        path = Path(self.tmp.name) / "books.npz"
        self.table.save(path)
        loaded = ResidencyTable.load(path)
        assert snapshot(loaded) == snapshot(self.table)
        self.table = loaded

    # --- after every step ---
    @invariant()
    def agrees_with_reference(self):
        if not hasattr(self, "table"):
            return
        self.table.validate()
        expected = self.ref.arrays()
        for name in ARRAYS:
            got = getattr(self.table, name)
            assert got.dtype == expected[name].dtype, name
            np.testing.assert_array_equal(got, expected[name], err_msg=name)
        assert (self.table.top, self.table.floor) == (self.ref.top, self.ref.floor)
        assert (self.table.hits, self.table.lookups) == (self.ref.hits, self.ref.lookups)
        assert self.table.n_resident == self.ref.n_resident


ResidencyModel.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestResidencyModel = ResidencyModel.TestCase
