# Included by _residency.pyx, after _residency_rule.pxi: the layer step of the engine's sequence
# (look up, record heat, observe, admit the distinct misses, check, apply) in one C loop over a
# span of steps, and the fast check of an `admit` answer. Spec in _residency.pyi.
#
# Why in C: on the simulator's generic path the sequence's own overhead per layer step (views,
# checks, applying, counting) was nearly all of its time; a plugin's `observe` and `admit` are
# now the only Python left per step. The checks here only ever accept: an answer they are not
# sure of goes to the Python checker (`strata.books.validate`), whose verdict and message rule.

from cpython.long cimport PyLong_AsLongLong, PyLong_CheckExact
from cpython.list cimport PyList_CheckExact
from cpython.tuple cimport PyTuple_CheckExact


cdef class _Scratch:
    """Per-span buffers of one layer step, sized E and S; marks avoid clearing them."""
    cdef int32_t[::1] count, distinct, missed, pl_slot, pl_expert, ev_flat, ev_slot
    cdef int64_t[::1] slot_mark, expert_mark, named_mark
    cdef int64_t smark, emark, nmark  # the marks of now: slots named, missed, experts named

    def __cinit__(self, Py_ssize_t n_experts, Py_ssize_t n_slots):
        self.count = np.zeros(n_experts, np.int32)
        self.distinct, self.missed = np.zeros(n_experts, np.int32), np.zeros(n_experts, np.int32)
        self.pl_slot, self.pl_expert = np.zeros(n_experts, np.int32), np.zeros(n_experts, np.int32)
        self.ev_flat, self.ev_slot = np.zeros(n_experts, np.int32), np.zeros(n_experts, np.int32)
        self.slot_mark = np.zeros(n_slots, np.int64)
        self.expert_mark = np.zeros(n_experts, np.int64)
        self.named_mark = np.zeros(n_experts, np.int64)
        self.smark = self.emark = self.nmark = 0


cdef Py_ssize_t _route(ResidencyTable t, Py_ssize_t layer, const int32_t* ids, Py_ssize_t n,
                       _Scratch sc, cnp.npy_bool* hit, int64_t* n_hits) except -1:
    """Look up and record one layer step's `n` ids: hits counted (and marked in `hit` if
    given), heat added, the distinct experts ascending in `sc.distinct` with their token
    counts in `sc.count`. Returns how many are distinct."""
    cdef Py_ssize_t i, j, nd = 0
    cdef int32_t e, x
    cdef int64_t h = 0
    for i in range(n):
        e = ids[i]
        if <uint64_t>e >= <uint64_t>t.n_experts:
            raise IndexError(f"expert id {e} is out of range [0, {t.n_experts})")
        t._heat[layer, e] += 1.0
        if t._res[layer, e] >= 0:
            h += 1
            if hit != NULL:
                hit[i] = 1
        elif hit != NULL:
            hit[i] = 0
        if sc.count[e] == 0:
            sc.distinct[nd] = e
            nd += 1
        sc.count[e] += 1
    for i in range(1, nd):  # insertion sort: a step routes few distinct experts
        x = sc.distinct[i]
        j = i - 1
        while j >= 0 and sc.distinct[j] > x:
            sc.distinct[j + 1] = sc.distinct[j]
            j -= 1
        sc.distinct[j + 1] = x
    t.hits += h
    t.lookups += n
    n_hits[0] = h
    return nd


cdef bint _slots_ok(ResidencyTable t, Py_ssize_t top, _Scratch sc, Py_ssize_t na) noexcept:
    """The admissions' slots exist, lie below `top`, are backed and are named once."""
    cdef Py_ssize_t j, s
    sc.smark += 1
    for j in range(na):
        s = sc.pl_slot[j]
        if s < 0 or s >= t.n_slots or s >= top or not t._backed[s] or sc.slot_mark[s] == sc.smark:
            return False
        sc.slot_mark[s] = sc.smark
    return True


cdef Py_ssize_t _apply(ResidencyTable t, Py_ssize_t layer, _Scratch sc, Py_ssize_t na) noexcept:
    """Evict the residents of the (checked) admissions' slots, in order, then assign the
    admitted: as `strata.books.apply_admit`. Returns how many were evicted."""
    cdef Py_ssize_t j, ne = 0, s
    for j in range(na):
        s = sc.pl_slot[j]
        if t._owner[s] >= 0:
            sc.ev_slot[ne] = <int32_t>s
            sc.ev_flat[ne] = t._take(s)
            ne += 1
    for j in range(na):
        t._put(sc.pl_slot[j], <int32_t>(layer * t.n_experts + sc.pl_expert[j]))
    return ne


cdef Py_ssize_t _parse_admit(object answer, Py_ssize_t layer, _Scratch sc, Py_ssize_t m,
                             Py_ssize_t n_experts) except -2:
    """An `admit` answer as rows into sc.pl_*: how many, or -1 when only the Python checker
    can judge it. Takes a list or tuple of (slot, layer, expert) tuples or lists of plain
    ints, or an int ndarray [n, 3]; each expert of `layer`, one of the `m` missed (marked by
    `_mark_missed`), named once. The slots are `_slots_ok`'s to judge."""
    cdef Py_ssize_t n, j
    cdef object row, value
    cdef int64_t slot, lay, e
    if PyList_CheckExact(answer) or PyTuple_CheckExact(answer):
        n = len(answer)
    elif cnp.PyArray_Check(answer) and (<cnp.ndarray>answer).dtype.kind in "iu" \
            and (<cnp.ndarray>answer).ndim == 2 and (<cnp.ndarray>answer).shape[1] == 3:
        n = (<cnp.ndarray>answer).shape[0]
        answer = answer.tolist()
    else:
        return -1
    if n > m:
        return -1
    sc.nmark += 1
    for j in range(n):
        row = answer[j]
        if not (PyTuple_CheckExact(row) or PyList_CheckExact(row)) or len(row) != 3:
            return -1
        for value in row:
            if not PyLong_CheckExact(value):  # bools, floats, numpy scalars: Python judges
                return -1
        try:
            slot, lay, e = PyLong_AsLongLong(row[0]), PyLong_AsLongLong(row[1]), \
                PyLong_AsLongLong(row[2])
        except OverflowError:
            return -1
        if lay != layer or e < 0 or e >= n_experts or sc.expert_mark[e] != sc.emark \
                or sc.named_mark[e] == sc.nmark:
            return -1
        sc.named_mark[e] = sc.nmark
        sc.pl_slot[j] = <int32_t>max(-1, min(slot, <int64_t>_MAX_INT32))
        sc.pl_expert[j] = <int32_t>e
    return n


cdef void _mark_missed(_Scratch sc, Py_ssize_t m) noexcept:
    """Mark the step's `m` missed experts (sc.missed) for `_parse_admit`."""
    cdef Py_ssize_t j
    sc.emark += 1
    for j in range(m):
        sc.expert_mark[sc.missed[j]] = sc.emark


def admit_answer(ResidencyView view not None, layer, missed_experts, answer):
    """The fast check of an `admit` answer: int64 [n, 3] if it surely passes
    `strata.books.validate.check_admit`, else None (ask the Python checker)."""
    cdef ResidencyTable t = view._t
    cdef Py_ssize_t l = _index(layer, t.n_layers, "layer")
    cdef int64_t[::1] mv = _ids_1d(missed_experts, "missed_experts")
    cdef _Scratch sc = _Scratch(t.n_experts, t.n_slots)
    cdef Py_ssize_t j, n
    for j in range(mv.shape[0]):
        if mv[j] < 0 or mv[j] >= t.n_experts:
            return None
        sc.missed[j] = <int32_t>mv[j]
    _mark_missed(sc, mv.shape[0])
    n = _parse_admit(answer, l, sc, mv.shape[0], t.n_experts)
    if n < 0 or not _slots_ok(t, view.top, sc, n):
        return None
    out = np.empty((n, 3), np.int64)
    for j in range(n):
        out[j, 0], out[j, 1], out[j, 2] = sc.pl_slot[j], l, sc.pl_expert[j]
    return out


cdef cnp.ndarray _frozen_from(cnp.ndarray keeper, void* data, int type_num, int nd,
                              cnp.npy_intp* dims):
    """A new read-only C-contiguous array over `data` (memory of `keeper`) whose base is a
    `_Held` of `keeper`: what `_frozen` makes, at an offset, without a Python slice."""
    cdef _Held held = _Held.__new__(_Held)
    held._array = keeper
    descr = cnp.PyArray_DescrFromType(type_num)
    Py_INCREF(descr)  # PyArray_NewFromDescr steals this reference
    cdef cnp.ndarray out = _new_from_descr(&PyArray_Type, <cnp.PyArray_Descr*>descr, nd, dims,
                                           NULL, data, 0, None)
    cnp.set_array_base(out, held)
    return out

