"""A stateful property test of the host backend against a model of which chunk sits where.

Every chunk carries a unique stamp in its bytes. Whatever sequence of maps, unmaps, moves between
two ranges, releases and injected faults hypothesis tries, each mapped index must show the stamp
the model expects, and the backend must count exactly the chunks the model holds.
"""

import gc
import itertools

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from strata import _vmm

CHUNK = 16 << 10
N_CHUNKS = 6

index = st.integers(0, N_CHUNKS)


def span(draw_lo, draw_hi):
    return min(draw_lo, draw_hi), max(draw_lo, draw_hi)


class HostVmmMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.backend = _vmm.HostBackend(chunk_bytes=CHUNK)
        self.ranges = [self.backend.reserve(N_CHUNKS * CHUNK) for _ in range(2)]
        self.model = [dict() for _ in self.ranges]  # index -> stamp, per range
        self.held = []  # (Chunk, stamp) the test holds, unmapped
        self.stamps = itertools.count(1)

    def stamp_of(self, r, i):
        words = self.ranges[r].view(i * CHUNK, (CHUNK // 4,), torch.int32)
        return int(words[0]), int(words[-1])

    def write_stamp(self, r, i, value):
        self.ranges[r].view(i * CHUNK, (CHUNK // 4,), torch.int32).fill_(value)

    faults = st.none() | st.tuples(st.sampled_from(["create", "map", "access"]), st.integers(1, 4))

    @rule(r=st.integers(0, 1), lo=index, hi=index, n_given=st.integers(0, 3), fault=faults)
    def map(self, r, lo, hi, n_given, fault):
        lo, hi = span(lo, hi)
        holes = [i for i in range(lo, hi) if i not in self.model[r]]
        n_given = min(n_given, len(holes), len(self.held))
        given, self.held = self.held[:n_given], self.held[n_given:]
        if fault:
            self.backend.inject_fault(*fault)
        try:
            mapped = self.ranges[r].map(lo, hi, chunks=[c for c, _ in given])
        except _vmm.VmmError:
            self.held = given + self.held  # still the caller's, unmapped
            return
        finally:
            self.backend.clear_faults()
        assert mapped == len(holes)
        for k, i in enumerate(holes):
            if k < len(given):
                self.model[r][i] = given[k][1]
            else:
                self.model[r][i] = next(self.stamps)
                self.write_stamp(r, i, self.model[r][i])

    @rule(r=st.integers(0, 1), lo=index, hi=index, fail=st.booleans())
    def unmap(self, r, lo, hi, fail):
        lo, hi = span(lo, hi)
        expect = sorted(i for i in self.model[r] if lo <= i < hi)
        if fail and expect:
            self.backend.inject_fault("unmap", 1)
            try:
                self.ranges[r].unmap(lo, hi)
                raise AssertionError("the injected unmap fault did not fire")
            except _vmm.VmmError:
                return
            finally:
                self.backend.clear_faults()
        chunks = self.ranges[r].unmap(lo, hi)
        assert len(chunks) == len(expect)
        self.held += [(c, self.model[r].pop(i)) for c, i in zip(chunks, expect, strict=True)]

    @precondition(lambda self: self.held)
    @rule(k=st.integers(0, 10))
    def release(self, k):
        chunk, _ = self.held.pop(k % len(self.held))
        chunk.release()

    @invariant()
    def bytes_follow_their_chunks(self):
        for r, model in enumerate(self.model):
            assert self.ranges[r].mapped_mask().tolist() == [i in model for i in range(N_CHUNKS)]
            for i, want in model.items():
                assert self.stamp_of(r, i) == (want, want)

    @invariant()
    def counts_match(self):
        mapped = sum(len(m) for m in self.model)
        assert self.backend.alive_chunks == mapped + len(self.held)
        assert self.backend.bytes_mapped == mapped * CHUNK

    def teardown(self):
        self.held.clear()
        self.backend.close()
        gc.collect()
        assert self.backend.alive_chunks == 0


TestHostVmm = HostVmmMachine.TestCase
TestHostVmm.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
