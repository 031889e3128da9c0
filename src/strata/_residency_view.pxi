# Included by _residency.pyx (at its end): the read-only view of the books that policies are
# given (re-exported as strata.policies.view.ResidencyView; its spec is in _residency.pyi), and
# the read-only arrays it and the table hand out (`_frozen`).
#
# Why an extension type: a policy must not reach anything that changes the books. The table sits
# in a cdef field, which Python cannot read; the type is final and static, so neither the view
# nor its class takes new attributes; and every array it hands out is a new read-only array
# object over the books' memory (`_frozen`), whose `.base` ends in an opaque `_Held`. A policy
# that reshapes or re-states an array it was given changes only that object, never what the
# checker, the engine or the next decision reads.


cdef extern from "numpy/arrayobject.h":
    PyTypeObject PyArray_Type
    # Commented out in numpy's own .pxd; steals the reference to `descr`.
    object _new_from_descr "PyArray_NewFromDescr" (
        PyTypeObject* subtype, cnp.PyArray_Descr* descr, int nd, cnp.npy_intp* dims,
        cnp.npy_intp* strides, void* data, int flags, object obj)


@cython.final
@cython.auto_pickle(False)
cdef class _Held:
    """Keeps an array alive behind the read-only views of it and shows nothing of it: a view's
    `.base` ends here (no attribute, no buffer), so no chain of `.base` / `.obj` leads from a
    view to the writeable array, and numpy cannot turn a view's write flag back on."""
    cdef object _array


cdef cnp.ndarray _frozen(cnp.ndarray a):
    """A new read-only array over a's memory (a's dtype, shape and strides) whose base is a
    `_Held`: one array object, so a holder that reshapes or re-states its own changes no other."""
    cdef _Held held = _Held.__new__(_Held)
    held._array = a
    cdef cnp.PyArray_Descr* descr = cnp.PyArray_DESCR(a)
    Py_INCREF(<object><PyObject*>descr)  # PyArray_NewFromDescr steals this reference
    # flags 0: the write flag off; numpy sets contiguity and alignment from the strides.
    cdef cnp.ndarray out = _new_from_descr(&PyArray_Type, descr, cnp.PyArray_NDIM(a),
                                           cnp.PyArray_DIMS(a), cnp.PyArray_STRIDES(a),
                                           cnp.PyArray_DATA(a), 0, None)
    cnp.set_array_base(out, held)
    return out


def frozen(array):
    """A read-only view of `array` (a numpy array, or anything np.asarray takes) that cannot be
    made writeable and whose `.base` leads to nothing writeable. For arrays handed to a policy."""
    if not isinstance(array, cnp.ndarray):
        array = np.asarray(array)
    return _frozen(array)


@cython.final
@cython.auto_pickle(False)
cdef class ResidencyView:
    cdef ResidencyTable _t
    cdef Py_ssize_t _top  # the loan region's first slot as the caller sees it; -1: the books'
    cdef tuple _slot_bounds, _chunk_bounds  # (lo, hi) int64, computed once: geometry is fixed

    def __cinit__(self, ResidencyTable table not None, *, top=None):
        self._t = table
        self._top = -1
        if top is not None:
            value = PyNumber_Index(top)
            if not table.floor <= value <= table.n_slots:
                raise ValueError(f"top {top} is outside [floor {table.floor}, {table.n_slots}]")
            self._top = value

    def __repr__(self):
        return (f"<ResidencyView top={self.top} floor={self._t.floor} "
                f"resident={self._t.n_resident} of {self._t.n_slots} slots>")

    # --- shape and regions ---
    @property
    def n_layers(self):
        return self._t.n_layers

    @property
    def n_experts(self):
        return self._t.n_experts

    @property
    def n_slots(self):
        return self._t.n_slots

    @property
    def slot_bytes(self):
        return self._t.slot_bytes

    @property
    def chunk_bytes(self):
        return self._t.chunk_bytes

    @property
    def n_chunks(self):
        return self._t.n_chunks

    @property
    def top(self):
        return self._t.top if self._top < 0 else self._top

    @property
    def floor(self):
        return self._t.floor

    @property
    def n_resident(self):
        return self._t.n_resident

    # --- arrays: a new read-only array object on every read ---
    @property
    def res(self):
        return _frozen(self._t._res_a)

    @property
    def owner(self):
        return _frozen(self._t._owner_a)

    @property
    def heat(self):
        return _frozen(self._t._heat_a)

    @property
    def rank(self):
        return _frozen(self._t._rank_a)

    @property
    def chunk_mapped(self):
        return _frozen(self._t._mapped_a)

    @property
    def backed(self):
        return _frozen(self._t._backed_a)

    # --- the table's read-only queries ---
    def slot_of(self, layer, expert):
        return self._t.slot_of(layer, expert)

    def expert_in(self, slot):
        return self._t.expert_in(slot)

    def coldest(self, lo, hi):
        return self._t.coldest(lo, hi)

    def residents_by_heat(self, lo, hi):
        return self._t.residents_by_heat(lo, hi)

    def hottest_missing(self, k):
        return self._t.hottest_missing(k)

    def slot_chunks(self, slot):
        return self._t.slot_chunks(slot)

    def chunk_slots(self, chunk):
        return self._t.chunk_slots(chunk)

    # --- derived in numpy ---
    def heat_position(self):
        heat = self._t._heat_a.reshape(-1)
        order = np.lexsort((self._t._rank_a.reshape(-1), -heat))  # hottest first
        position = np.empty(order.size, np.int64)
        position[order] = np.arange(order.size)
        return position.reshape(self._t.n_layers, self._t.n_experts)

    cdef tuple _slot_chunk_bounds(self):
        if self._slot_bounds is None:
            start = np.arange(self._t.n_slots, dtype=np.int64) * self._t.slot_bytes
            lo = start // self._t.chunk_bytes
            hi = -(-(start + self._t.slot_bytes) // self._t.chunk_bytes)
            self._slot_bounds = (lo, hi)
        return self._slot_bounds

    def slot_chunk_bounds(self):
        lo, hi = self._slot_chunk_bounds()
        return (_frozen(lo), _frozen(hi))

    def chunk_slot_bounds(self):
        if self._chunk_bounds is None:
            start = np.arange(self._t.n_chunks, dtype=np.int64) * self._t.chunk_bytes
            lo = start // self._t.slot_bytes
            hi = np.minimum(-(-(start + self._t.chunk_bytes) // self._t.slot_bytes),
                            self._t.n_slots)
            self._chunk_bounds = (lo, hi)
        lo, hi = self._chunk_bounds
        return (_frozen(lo), _frozen(hi))

    cdef object _touched(self, slot_mask):
        """bool [n_chunks]: chunks that some slot in `slot_mask` touches."""
        lo, hi = self._slot_chunk_bounds()
        n = self._t.n_chunks
        edges = np.bincount(lo[slot_mask], minlength=n + 1) - np.bincount(
            hi[slot_mask], minlength=n + 1
        )
        return np.cumsum(edges[:n]) > 0

    def chunks_freed_by(self, slots):
        given = np.zeros(self._t.n_slots, bool)
        given[np.asarray(slots, dtype=np.int64)] = True
        kept = self._touched(self._t._backed_a & ~given)
        freed = self._t._mapped_a & self._touched(given) & ~kept
        return np.flatnonzero(freed).astype(np.int32)

    def givable_slots(self):
        backed = np.flatnonzero(self._t._backed_a).astype(np.int32)
        return backed[(backed >= self._t.floor) & (backed < self.top)]

    def givable_chunks(self):
        return int(self.chunks_freed_by(self.givable_slots()).size)

    def empty_slots(self, lo, hi):
        owner = self._t._owner_a[lo:hi]
        backed = self._t._backed_a[lo:hi]
        return (np.flatnonzero(backed & (owner < 0)) + lo).astype(np.int32)
