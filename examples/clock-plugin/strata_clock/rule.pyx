# cython: boundscheck=False, wraparound=False
"""CLOCK over the slots below `top`: a hit sets its slot's reference bit; to admit, the hand
clears set bits as it passes and takes the first slot whose bit is clear."""

from libc.stdint cimport int32_t, int64_t

import numpy as np

from strata._residency cimport CacheRule


cdef class ClockRule(CacheRule):
    cdef unsigned char[::1] ref  # per slot: hit since the hand last passed it
    cdef int64_t[::1] taken      # per slot: the layer step that last took it
    cdef int64_t steps           # layer steps so far
    cdef Py_ssize_t hand, passed

    cdef int start(self) except -1:
        self.ref = np.zeros(self.n_slots, np.uint8)
        self.taken = np.full(self.n_slots, -1, np.int64)

    cdef int step(self, int32_t layer) except -1:
        self.steps += 1
        self.passed = 0

    cdef int routed(self, int32_t flat, int32_t slot, int32_t n_tokens) except -1:
        if slot >= 0:
            self.ref[slot] = 1

    cdef int32_t admit(self, int32_t flat) except -2:
        cdef Py_ssize_t slot
        while self.passed < 2 * self.top:  # two turns: the first clears every bit
            slot = self.hand
            self.hand = (self.hand + 1) % self.top
            self.passed += 1
            if not self.usable(slot) or self.taken[slot] == self.steps:
                continue
            if self.ref[slot]:
                self.ref[slot] = 0  # its second chance
                continue
            self.taken[slot] = self.steps
            return <int32_t>slot
        return -1

    cdef int entered(self, int32_t flat, int32_t slot, int why) except -1:
        self.ref[slot] = 0  # a newcomer has not been hit yet
