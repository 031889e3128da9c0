# Included by _residency.pyx, after _residency_view.pxi: `CacheRule`, the base of a policy rule
# compiled in C (declared in _residency.pxd, so that a plugin's own .pyx can cimport it; its
# spec is in _residency.pyi).
#
# Why here: the rule reads the books through memoryviews of the table's own buffers, which only
# this module can reach; and the simulator's step loop (_residency_step.pxi), which calls a
# rule's cdef methods with no Python in between, applies admissions to the table directly.
# The engine calls the same cdef methods through `observe_step`, `admit_step` and `notify`,
# so a rule decides alike in both.

WHY_NAMES = ("fill", "admit", "refill", "trim", "relocate", "give_up", "loan", "rollback")
_WHY_CODE = {name: code for code, name in enumerate(WHY_NAMES)}


def why_code(why):
    """The WHY_* code of a reason's name (`WHY_NAMES`); ValueError for an unknown one."""
    try:
        return _WHY_CODE[why]
    except (KeyError, TypeError):
        raise ValueError(f"unknown reason {why!r}; the reasons are {', '.join(WHY_NAMES)}") \
            from None


cdef class ExpertLists:
    """`n_lists` doubly linked lists over items 0 .. n_items-1; O(1) push and remove."""

    def __cinit__(self, Py_ssize_t n_lists, Py_ssize_t n_items):
        if n_lists < 1 or n_items < 0 or n_items > _MAX_INT32:
            raise ValueError(f"want n_lists >= 1 and 0 <= n_items <= {_MAX_INT32}, "
                             f"got {n_lists}, {n_items}")
        self.n_lists, self.n_items = n_lists, n_items
        self.which = np.full(n_items, -1, np.int32)
        self.prev, self.next = np.full(n_items, -1, np.int32), np.full(n_items, -1, np.int32)
        self.front, self.back = np.full(n_lists, -1, np.int32), np.full(n_lists, -1, np.int32)
        self.size = np.zeros(n_lists, np.int64)

    cdef void push(self, Py_ssize_t k, int32_t item, bint at_front=True) noexcept:
        self.remove(item)
        if self.front[k] < 0:
            self.prev[item] = self.next[item] = -1
            self.front[k] = self.back[k] = item
        elif at_front:
            self.prev[item], self.next[item] = -1, self.front[k]
            self.prev[self.front[k]] = item
            self.front[k] = item
        else:
            self.prev[item], self.next[item] = self.back[k], -1
            self.next[self.back[k]] = item
            self.back[k] = item
        self.which[item] = <int32_t>k
        self.size[k] += 1

    cdef void remove(self, int32_t item) noexcept:
        cdef int32_t k = self.which[item]
        if k < 0:
            return
        if self.prev[item] >= 0:
            self.next[self.prev[item]] = self.next[item]
        else:
            self.front[k] = self.next[item]
        if self.next[item] >= 0:
            self.prev[self.next[item]] = self.prev[item]
        else:
            self.back[k] = self.prev[item]
        self.size[k] -= 1
        self.which[item] = -1

    # Python access, for tests and for rules' own Python-level checks.
    def py_push(self, k, item, at_front=True):
        self.push(_index(k, self.n_lists, "k"), <int32_t>_index(item, self.n_items, "item"),
                  at_front)

    def py_remove(self, item):
        self.remove(<int32_t>_index(item, self.n_items, "item"))

    def items(self, k):
        """The items of list `k`, front to back."""
        cdef int32_t x = self.front[_index(k, self.n_lists, "k")]
        out = []
        while x >= 0:
            out.append(x)
            x = self.next[x]
        return out

    def list_of(self, item):
        """The list `item` is in, or -1."""
        return self.which[_index(item, self.n_items, "item")]


cdef int _bind(CacheRule rule, ResidencyTable t, Py_ssize_t top) except -1:
    """Bind `rule` to the books `t` (its state made fresh by `start` for new books), with
    `top` as the caller sees it."""
    if rule._books is not t:
        rule.res = t._res_a
        rule.owner = t._owner_a
        rule.backed = t._backed_a.view(np.uint8)  # the same memory: live
        rule.n_layers, rule.n_experts, rule.n_slots = t.n_layers, t.n_experts, t.n_slots
        rule._books = t
        rule.top = top
        rule.changed, rule._free_from = True, 0
        rule.start()
    if top != rule.top:
        rule.top, rule.changed, rule._free_from = top, True, 0
    return 0


cdef _check_experts_range(int64_t[::1] values, Py_ssize_t bound):
    cdef Py_ssize_t i
    for i in range(values.shape[0]):
        if values[i] < 0 or values[i] >= bound:
            raise IndexError(f"expert {values[i]} is out of range [0, {bound})")


cdef class CacheRule:
    """Base of a compiled rule; subclasses override the cdef methods of _residency.pxd."""

    def __cinit__(self):
        self.max_admits = -1

    cdef int start(self) except -1:
        return 0

    cdef int step(self, int32_t layer) except -1:
        return 0

    cdef int routed(self, int32_t flat, int32_t slot, int32_t n_tokens) except -1:
        return 0

    cdef int32_t admit(self, int32_t flat) except -2:
        return -1

    cdef int entered(self, int32_t flat, int32_t slot, int why) except -1:
        return 0

    cdef int left(self, int32_t flat, int32_t slot, int why) except -1:
        return 0

    cdef int moved(self, int32_t flat, int32_t src, int32_t dst) except -1:
        return 0

    cdef bint usable(self, Py_ssize_t slot) noexcept:
        return 0 <= slot < self.top and self.backed[slot] != 0

    cdef int32_t free_slot(self) noexcept:
        cdef Py_ssize_t s
        for s in range(self._free_from, self.top):
            if self.backed[s] and self.owner[s] < 0:
                self._free_from = s + 1
                return <int32_t>s
        self._free_from = self.top
        return -1

    def bind(self, ResidencyView view not None):
        _bind(self, view._t, view.top)

    @property
    def bound(self):
        return self._books is not None

    def observe_step(self, ResidencyView view not None, layer, expert_ids):
        cdef ResidencyTable t = view._t
        cdef Py_ssize_t l = _index(layer, t.n_layers, "layer")
        _bind(self, t, view.top)
        ids = np.asarray(expert_ids).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= t.n_experts):
            raise IndexError(f"expert_ids holds an expert out of range [0, {t.n_experts})")
        experts, counts = np.unique(ids, return_counts=True)
        cdef int64_t[::1] ev = experts.astype(np.int64)
        cdef int64_t[::1] cv = counts.astype(np.int64)
        cdef Py_ssize_t i
        cdef int32_t base = <int32_t>(l * t.n_experts)
        self.step(<int32_t>l)
        for i in range(ev.shape[0]):
            self.routed(base + <int32_t>ev[i], t._res[l, ev[i]], <int32_t>cv[i])

    def admit_step(self, ResidencyView view not None, layer, missed_experts):
        cdef ResidencyTable t = view._t
        cdef Py_ssize_t l = _index(layer, t.n_layers, "layer")
        _bind(self, t, view.top)
        cdef int64_t[::1] mv = _ids_1d(missed_experts, "missed_experts")
        _check_experts_range(mv, t.n_experts)
        out = np.empty((mv.shape[0], 3), np.int64)
        cdef int64_t[:, ::1] ov = out
        cdef Py_ssize_t i, n = 0
        cdef int32_t slot
        for i in range(mv.shape[0]):
            if n == self.max_admits:
                break
            slot = self.admit(<int32_t>(l * t.n_experts + mv[i]))
            if slot != -1:
                ov[n, 0], ov[n, 1], ov[n, 2] = slot, l, mv[i]
                n += 1
        return out[:n]

    def notify(self, ResidencyView view not None, kind, why, rows):
        """Tell the rule of a change of the books: `kind` `entered` or `left` with rows
        (slot, layer, expert), or `moved` with rows (src_slot, dst_slot, layer, expert)."""
        cdef ResidencyTable t = view._t
        _bind(self, t, view.top)
        cdef int code = why_code(why)
        if code != WHY_ADMIT and len(rows):
            self.changed, self._free_from = True, 0
        width = 4 if kind == "moved" else 3
        if kind not in ("entered", "left", "moved"):
            raise ValueError(f"kind must be entered, left or moved, got {kind!r}")
        a = np.asarray(rows, dtype=np.int64).reshape(-1, width)
        cdef int64_t[:, ::1] rv = np.ascontiguousarray(a)
        cdef Py_ssize_t i, E = t.n_experts
        cdef int32_t flat
        for i in range(rv.shape[0]):
            flat = <int32_t>(rv[i, width - 2] * E + rv[i, width - 1])
            if kind == "entered":
                self.entered(flat, <int32_t>rv[i, 0], code)
            elif kind == "left":
                self.left(flat, <int32_t>rv[i, 0], code)
            else:
                self.moved(flat, <int32_t>rv[i, 0], <int32_t>rv[i, 1])
