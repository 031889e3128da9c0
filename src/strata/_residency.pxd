# What a compiled policy rule cimports: `from strata._residency cimport CacheRule, WHY_ADMIT`.
#
# A `CacheRule` is a policy's `observe` and `admit` (and its lifecycle notifications) in C: the
# simulator's step loop and the engine call its cdef methods directly, once per routed expert
# and per missed expert, with no Python in between (docs/policies/reference.md, "Compiled
# rules"). Only `CacheRule` is declared here; the books' own types stay private to the .pyx.
# A rule reads the books through the read-only memoryviews below, which strata binds to the live
# books before it calls the rule; every slot it answers is checked before anything acts on it.

from libc.stdint cimport int32_t, int64_t, uint8_t

# Why an expert entered or left the cache (the `why` of `entered`, `left`; the Python names are
# `strata._residency.WHY_NAMES`).
cdef enum:
    WHY_FILL = 0       # the initial fill from the profile (entered)
    WHY_ADMIT = 1      # admitted on a miss (entered), or evicted to make room for one (left)
    WHY_REFILL = 2     # a loan's slots refilled after the prompt (entered)
    WHY_TRIM = 3       # slots completed by a K/V trim, refilled (entered)
    WHY_RELOCATE = 4   # evicted to make room for a relocated expert (left)
    WHY_GIVE_UP = 5    # its slot's memory went to the K/V (left)
    WHY_LOAN = 6       # its slot was lent to the prompt path (left)
    WHY_ROLLBACK = 7   # a change that failed was undone (entered or left)


# Doubly linked lists over items 0 .. n-1 (flat experts, or slots), each item in at most one
# list: the building block of LRU-like rules (ARC's T1, T2, B1, B2; 2Q; SLRU). O(1) each.
cdef class ExpertLists:
    cdef readonly Py_ssize_t n_lists, n_items
    cdef int32_t[::1] which     # [n_items]: the list an item is in, -1 none
    cdef int32_t[::1] prev      # [n_items]: the neighbour toward the front (most recent), -1
    cdef int32_t[::1] next      # [n_items]: the neighbour toward the back (least recent), -1
    cdef int32_t[::1] front     # [n_lists]: each list's first item, -1 empty
    cdef int32_t[::1] back      # [n_lists]: each list's last item, -1 empty
    cdef int64_t[::1] size      # [n_lists]: items in each list
    # Put `item` at the front (or the back) of list `k`, out of the list it was in.
    cdef void push(self, Py_ssize_t k, int32_t item, bint at_front=*) noexcept
    # Take `item` out of its list (nothing if it is in none).
    cdef void remove(self, int32_t item) noexcept


cdef class CacheRule:
    # The books, bound by strata before any call; read-only, live, never reallocated.
    cdef const int32_t[:, ::1] res      # [n_layers, n_experts]: each expert's slot, -1 if none
    cdef const int32_t[::1] owner       # [n_slots]: each slot's flat expert id, -1 if empty
    cdef const uint8_t[::1] backed      # [n_slots]: 1 where the slot's memory is mapped
    cdef readonly Py_ssize_t n_layers   # L, the MoE layers
    cdef readonly Py_ssize_t n_experts  # E, routed experts per layer; flat id = layer * E + e
    cdef readonly Py_ssize_t n_slots    # S, the arena's slots
    cdef readonly Py_ssize_t top        # the loan region's first slot: admit only below it
    cdef public bint changed            # set by strata when the books changed other than by
                                        # this rule's admissions (a notification not WHY_ADMIT,
                                        # or a new `top`); the rule clears it when it has caught up
    cdef public Py_ssize_t max_admits   # the most admissions per layer step: `admit` is not
                                        # asked once that many were made; -1 (default): no cap
    cdef object _books                  # the books bound (identity only)
    cdef Py_ssize_t _free_from          # where `free_slot` resumes (0 after an outside change)

    # Called once, when the rule is first bound to books (the shape fields are set): make the
    # rule's own per-slot or per-expert state here.
    cdef int start(self) except -1
    # A layer step of `layer` begins: called before its `routed` calls (engine and simulator).
    cdef int step(self, int32_t layer) except -1
    # Once per distinct expert routed at a layer step, ascending flat id, before any admit of
    # that step: `slot` where it is resident (a hit), -1 (a miss); `n_tokens` routed to it.
    cdef int routed(self, int32_t flat, int32_t slot, int32_t n_tokens) except -1
    # Once per distinct missed expert of a layer step, ascending: the slot it should enter
    # (below `top`, backed, not named before in this step; its resident is evicted), or -1.
    cdef int32_t admit(self, int32_t flat) except -2
    # Lifecycle: an expert entered `slot`, or left it, for reason `why` (WHY_*); after the
    # books changed, in the books' order. A rule's own admissions come back here too (WHY_ADMIT).
    cdef int entered(self, int32_t flat, int32_t slot, int why) except -1
    cdef int left(self, int32_t flat, int32_t slot, int why) except -1
    # A relocation (or its rollback) moved an expert from `src` to `dst`; it stays resident.
    cdef int moved(self, int32_t flat, int32_t src, int32_t dst) except -1
    # Whether `slot` may take an admission now: below `top` and backed.
    cdef bint usable(self, Py_ssize_t slot) noexcept
    # An empty usable slot, lowest first from where the last one was found, or -1: each slot
    # once until the books change other than by admissions (then the search starts over), so
    # it never hands out a slot twice in a layer step.
    cdef int32_t free_slot(self) noexcept
