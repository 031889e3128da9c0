# cython: boundscheck=False, wraparound=False, cdivision=True
# ARC (Megiddo & Modha, 2003) over the usable slots: T1 holds experts hit once lately, T2 those
# hit again; ghosts B1, B2 remember whom each evicted; T1's target `p` follows the ghosts' hits.
from libc.stdint cimport int32_t
from strata._residency cimport WHY_ADMIT, CacheRule, ExpertLists

cdef enum: T1, T2, B1, B2, GONE

cdef class ArcRule(CacheRule):
    cdef ExpertLists q  # T1, T2, B1, B2, GONE over flat experts; front = most recent
    cdef Py_ssize_t c   # the usable slots: the cache's size
    cdef double p       # T1's target size

    cdef int start(self) except -1:
        self.q = ExpertLists(5, self.n_layers * self.n_experts)

    cdef int step(self, int32_t layer) except -1:
        cdef int32_t x  # below: count the usable slots, adopt their residents at T1's back,
        if self.changed:  # and drop those of slots we may not take (the loan's, say)
            self.c, self.changed = 0, False
            for s in range(self.n_slots):
                x, self.c = self.owner[s], self.c + self.usable(s)
                if x >= 0 and self.usable(s) and self.q.which[x] not in (T1, T2):
                    self.q.push(T1, x, False)
                elif x >= 0 and not self.usable(s) and self.q.which[x] in (T1, T2):
                    self.q.push(GONE, x)

    cdef int routed(self, int32_t x, int32_t slot, int32_t n_tokens) except -1:
        if slot >= 0 and self.q.which[x] in (T1, T2):
            self.q.push(T2, x)

    cdef int32_t evict(self, int k, int to) noexcept:  # k's least recent, moved to list `to`
        cdef int32_t v = self.q.back[k]
        self.q.push(to, v)
        return self.res[v // self.n_experts, v % self.n_experts]

    cdef int32_t admit(self, int32_t x) except -2:
        cdef int w = self.q.which[x], slot = -1
        cdef Py_ssize_t t1 = self.q.size[T1], b1 = self.q.size[B1], b2 = self.q.size[B2], total
        total = t1 + self.q.size[T2]
        if w == B1: self.p = min(<double>self.c, self.p + max(<double>b2 / b1, 1))
        elif w == B2: self.p = max(0.0, self.p - max(<double>b1 / b2, 1))
        elif t1 + b1 >= self.c and t1 >= self.c > 0: slot = self.evict(T1, GONE)
        elif t1 + b1 >= self.c and b1: self.q.remove(self.q.back[B1])
        elif total + b1 + b2 >= 2 * self.c and b2: self.q.remove(self.q.back[B2])
        slot = self.free_slot() if slot < 0 and total < self.c else slot
        if slot < 0 and total:  # REPLACE: T1's least recent past its target, else T2's
            slot = self.evict(T1, B1) if t1 and (t1 > self.p or (w == B2 and t1 == self.p)
                                                 or not self.q.size[T2]) else self.evict(T2, B2)
        return slot

    cdef int entered(self, int32_t x, int32_t slot, int why) except -1:
        if why == WHY_ADMIT:  # in the books now; a ghost's memory makes it frequent
            self.q.push(T2 if self.q.which[x] in (B1, B2) else T1, x)

    cdef int left(self, int32_t x, int32_t slot, int why) except -1:
        if why != WHY_ADMIT and self.q.which[x] in (T1, T2):
            self.q.push(GONE, x)  # not our eviction: forgotten, with no ghost
