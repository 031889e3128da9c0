# cython: boundscheck=False, wraparound=False
"""FIFO as a ring over the slots below `top`: the hand admits into the next usable slot, so the
expert evicted is the one that entered longest ago (the fill counts in slot order)."""

from libc.stdint cimport int32_t

from strata._residency cimport CacheRule


cdef class FifoRule(CacheRule):
    cdef Py_ssize_t hand    # the next slot to fill
    cdef Py_ssize_t passed  # slots the hand passed in this layer step: at most one turn

    cdef int step(self, int32_t layer) except -1:
        self.passed = 0

    cdef int32_t admit(self, int32_t flat) except -2:
        cdef Py_ssize_t slot
        while self.passed < self.top:  # one turn at most: no slot twice in a step
            slot = self.hand
            self.hand = (self.hand + 1) % self.top
            self.passed += 1
            if self.usable(slot):
                return <int32_t>slot
        return -1
