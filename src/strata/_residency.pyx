"""The books of the expert cache: residency, heat, slot/chunk geometry and the per-layer lookup.

The spec, with the semantics of every call, is _residency.pyi. Conventions here:
- Every state array is a C-contiguous numpy array allocated once in __cinit__ and never
  reallocated, so the read-only views handed to policies stay live; the nogil kernels work on
  typed memoryviews of the same buffers. numpy owns the memory, so no __dealloc__ is needed.
- Every call checks all its arguments before changing anything, in this order: scalar indices
  (IndexError), array dtypes and shapes (ValueError), array elements (IndexError), then what the
  state allows (ValueError). Batch forms apply their elements in order and undo the applied ones
  if a later one fails, so they are all or nothing.
- The hot calls (`lookup`, `record`) take the caller's arrays as raw pointers after checking them
  through the numpy C API: acquiring a typed memoryview costs ~0.25 us per array (measured on the
  dev box), which alone would be most of the ~1 us a [1, 8] lookup may take.
"""

import os
import tempfile
import zipfile

import numpy as np

cimport cython
cimport numpy as cnp
from cpython.number cimport PyNumber_Index
from cpython.object cimport PyTypeObject
from cpython.ref cimport PyObject, Py_INCREF
from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t

cnp.import_array()

ctypedef fused id_t:
    int32_t
    int64_t

# Geometry products ((s + 1) * slot_bytes + chunk_bytes, ...) stay below 2**63 under these caps.
cdef int64_t _MAX_BYTES = (<int64_t>1) << 60
cdef Py_ssize_t _MAX_INT32 = 2147483647
# Lookups at least this large release the GIL (below it, releasing costs more than it frees).
cdef Py_ssize_t _NOGIL_MIN_IDS = 4096

_FORMAT = "strata.residency"
_FORMAT_VERSION = 1
_FIELDS = ("format", "version", "shape", "res", "owner", "heat", "rank", "chunk_mapped",
           "regions", "counters")


# ---------------------------------------------------------------- argument checks

cdef Py_ssize_t _index(object value, Py_ssize_t bound, str what) except -1:
    """value as an index in [0, bound); IndexError naming it otherwise."""
    cdef Py_ssize_t i
    try:
        i = PyNumber_Index(value)  # ints and numpy integers; not floats, which C casts accept
    except OverflowError:
        raise IndexError(f"{what} {value} is out of range [0, {bound})") from None
    except TypeError:
        raise TypeError(f"{what} must be an integer, got {value!r}") from None
    if i < 0 or i >= bound:
        raise IndexError(f"{what} {value} is out of range [0, {bound})")
    return i


cdef Py_ssize_t _slot_bound(object value, Py_ssize_t n_slots, str what) except -1:
    """value as a slot bound in [0, n_slots] (a range end may equal n_slots)."""
    return _index(value, n_slots + 1, what)


cdef int64_t _count(object value, int64_t lo, int64_t hi, str what) except -1:
    """value as a count in [lo, hi]; ValueError naming it otherwise."""
    cdef int64_t v
    try:
        v = PyNumber_Index(value)
    except OverflowError:
        raise ValueError(f"{what} must be in [{lo}, {hi}], got {value}") from None
    except TypeError:
        raise TypeError(f"{what} must be an integer, got {value!r}") from None
    if v < lo or v > hi:
        raise ValueError(f"{what} must be in [{lo}, {hi}], got {value}")
    return v


cdef cnp.ndarray _id_array(object obj, str name):
    """obj as a native, aligned, C-contiguous int32 or int64 array; no copy when it is one.

    Any integer dtype is accepted (others are converted to int64), and so is an empty array of
    any dtype; anything else is a ValueError.
    """
    cdef cnp.ndarray a
    cdef int t
    if cnp.PyArray_Check(obj):
        a = <cnp.ndarray>obj
        t = cnp.PyArray_TYPE(a)
        if ((t == cnp.NPY_INT64 or t == cnp.NPY_INT32) and cnp.PyArray_IS_C_CONTIGUOUS(a)
                and cnp.PyArray_ISNOTSWAPPED(a) and cnp.PyArray_ISALIGNED(a)):
            return a
    else:
        a = np.asarray(obj)
    if a.size == 0 and a.dtype.kind not in "iu":
        a = a.astype(np.int64)  # no ids: np.array([]) and [] are float64, and harmless
    if a.dtype.kind not in "iu":
        raise ValueError(f"{name} must be an integer array, got dtype {a.dtype}")
    if a.dtype.kind == "u" and a.dtype.itemsize == 8 and a.size and a.max() > (1 << 63) - 1:
        raise IndexError(f"{name} holds {a.max()}, which is out of range")
    return np.ascontiguousarray(a, dtype=np.int64 if a.dtype.itemsize > 4 else np.int32)


cdef cnp.ndarray _ids_1d(object obj, str name):
    cdef cnp.ndarray a = _id_array(obj, name)
    if cnp.PyArray_NDIM(a) != 1:
        raise ValueError(f"{name} must be 1-D, got shape {np.shape(a)}")
    return a.astype(np.int64, copy=False)


cdef _check_out(object out, int type_num, str dtype, cnp.npy_intp t, cnp.npy_intp k, str name):
    """A caller's output buffer: exactly `dtype`, [t, k], C-contiguous, aligned, writeable."""
    cdef cnp.ndarray a
    if not cnp.PyArray_Check(out):
        raise ValueError(f"{name} must be a numpy array, got {type(out).__name__}")
    a = <cnp.ndarray>out
    if (cnp.PyArray_TYPE(a) != type_num or cnp.PyArray_NDIM(a) != 2
            or cnp.PyArray_DIM(a, 0) != t or cnp.PyArray_DIM(a, 1) != k
            or not cnp.PyArray_IS_C_CONTIGUOUS(a) or not cnp.PyArray_ISNOTSWAPPED(a)
            or not cnp.PyArray_ISALIGNED(a) or not cnp.PyArray_ISWRITEABLE(a)):
        raise ValueError(f"{name} must be a writeable C-contiguous {dtype} array of "
                         f"shape ({t}, {k}), got {a.dtype} {np.shape(a)}")


cdef tuple _at(object flat_index, object shape):
    """The index tuple of a flat position, as plain ints (for messages)."""
    return tuple(int(i) for i in np.unravel_index(flat_index, shape))


cdef int _check_ids(cnp.ndarray a, Py_ssize_t n_experts) except -1:
    """IndexError naming the first id of `a` (an `_id_array`) outside [0, n_experts)."""
    cdef Py_ssize_t bad, n = cnp.PyArray_SIZE(a)
    cdef void* p = cnp.PyArray_DATA(a)
    if cnp.PyArray_TYPE(a) == cnp.NPY_INT64:
        bad = _first_out_of_range(<const int64_t*>p, n, n_experts)
    else:
        bad = _first_out_of_range(<const int32_t*>p, n, n_experts)
    if bad >= 0:
        raise IndexError(f"expert_ids{_at(bad, np.shape(a))} = "
                         f"{a.reshape(-1)[bad]} is out of range [0, {n_experts})")
    return 0


# ---------------------------------------------------------------- nogil kernels

cdef Py_ssize_t _lookup_kernel(const int32_t[::1] res_row, const id_t* ids, Py_ssize_t n,
                               int32_t* out_slots, cnp.npy_bool* out_hit,
                               int64_t* n_hits) noexcept nogil:
    """out_slots[i] = res_row[ids[i]]; returns the first i whose id is out of range, else -1."""
    cdef Py_ssize_t i
    cdef int64_t hits = 0
    cdef int32_t s
    cdef uint64_t n_experts = <uint64_t>res_row.shape[0]
    for i in range(n):
        if <uint64_t>ids[i] >= n_experts:  # negative ids wrap to huge
            return i
        s = res_row[ids[i]]
        out_slots[i] = s
        out_hit[i] = s >= 0
        hits += s >= 0
    n_hits[0] = hits
    return -1


cdef Py_ssize_t _first_out_of_range(const id_t* ids, Py_ssize_t n, Py_ssize_t bound) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        if <uint64_t>ids[i] >= <uint64_t>bound:
            return i
    return -1


cdef Py_ssize_t _split_token_kernel(const int32_t* res_row, double* heat_row, const id_t* ids,
                                    Py_ssize_t k, int64_t* out, Py_ssize_t* n_experts
                                    ) noexcept nogil:
    """`split_token`'s pass over one token's k ids, already checked to be in range: heat
    counted, `out` filled (the layout is the .pyi's). Returns the hits H."""
    cdef Py_ssize_t i, j, h = 0, r = 0, m = 0
    cdef int32_t s
    cdef int64_t* rows = out + 2 * k       # [R] missed rows by (expert, row)
    cdef int64_t* experts = out + 3 * k    # [M]
    cdef int64_t* starts = out + 4 * k     # [M + 1]
    cdef int64_t* perm
    for i in range(k):
        heat_row[ids[i]] += 1.0  # in id order, as `record` adds
        s = res_row[ids[i]]
        if s >= 0:
            out[h] = s
            h += 1
        else:
            # Insertion by expert: rows come ascending, so equal experts keep row order (the
            # stable sort `Routed.of` does); k is a handful.
            j = r
            while j > 0 and ids[rows[j - 1]] > ids[i]:
                rows[j] = rows[j - 1]
                j -= 1
            rows[j] = i
            r += 1
    perm = out + h  # [k]: where each row's output sits in [hit outputs; missed outputs]
    j = 0
    for i in range(k):
        if res_row[ids[i]] >= 0:
            perm[i] = j
            j += 1
    for j in range(r):
        perm[rows[j]] = h + j
        if j == 0 or ids[rows[j]] != ids[rows[j - 1]]:
            experts[m] = ids[rows[j]]
            starts[m] = j
            m += 1
    starts[m] = r
    n_experts[0] = m
    return h


cdef void _add_counts(double[::1] heat_row, const id_t* ids, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        heat_row[ids[i]] += 1.0


cdef void _scale(double[::1] heat, double factor) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(heat.shape[0]):
        heat[i] *= factor


cdef Py_ssize_t _coldest(const int32_t[::1] owner, const double[::1] heat, const int32_t[::1] rank,
                         Py_ssize_t lo, Py_ssize_t hi) noexcept nogil:
    """The slot in [lo, hi) whose expert comes last in heat order (heat desc, rank asc), or -1."""
    cdef Py_ssize_t s, best = -1
    cdef int32_t f, best_rank = -1
    cdef double best_heat = 0.0
    for s in range(lo, hi):
        f = owner[s]
        if f < 0:
            continue
        if best < 0 or heat[f] < best_heat or (heat[f] == best_heat and rank[f] > best_rank):
            best, best_heat, best_rank = s, heat[f], rank[f]
    return best


# ---------------------------------------------------------------- the table

cdef class ResidencyTable:
    cdef readonly Py_ssize_t n_layers, n_experts, n_slots, n_chunks
    cdef readonly int64_t slot_bytes, chunk_bytes
    cdef readonly Py_ssize_t top, floor, n_resident
    cdef readonly int64_t hits, lookups
    # The numpy arrays own the memory; the memoryviews below alias them.
    cdef cnp.ndarray _res_a, _owner_a, _heat_a, _rank_a, _mapped_a, _backed_a
    cdef object _res_ro, _owner_ro, _heat_ro, _rank_ro, _mapped_ro, _backed_ro
    cdef int32_t[:, ::1] _res            # [L, E] slot or -1
    cdef int32_t[::1] _res_flat          # [L*E]
    cdef int32_t[::1] _owner             # [S] flat id or -1
    cdef double[:, ::1] _heat            # [L, E]
    cdef double[::1] _heat_flat          # [L*E]
    cdef int32_t[::1] _rank_flat         # [L*E] permutation of 0 .. L*E-1
    cdef cnp.npy_bool[::1] _mapped       # [n_chunks]
    cdef cnp.npy_bool[::1] _backed       # [S], derived from _mapped

    def __cinit__(self, n_layers, n_experts, n_slots, slot_bytes, chunk_bytes):
        self.n_layers = _count(n_layers, 1, _MAX_INT32, "n_layers")
        self.n_experts = _count(n_experts, 1, _MAX_INT32, "n_experts")
        if self.n_layers * self.n_experts > _MAX_INT32:
            raise ValueError(f"n_layers * n_experts = {self.n_layers * self.n_experts} does not "
                             f"fit flat int32 ids (at most {_MAX_INT32})")
        self.n_slots = _count(n_slots, 0, _MAX_INT32, "n_slots")
        self.slot_bytes = _count(slot_bytes, 1, _MAX_BYTES, "slot_bytes")
        self.chunk_bytes = _count(chunk_bytes, 1, _MAX_BYTES, "chunk_bytes")
        if self.n_slots > _MAX_BYTES // self.slot_bytes:
            raise ValueError(f"n_slots * slot_bytes = {self.n_slots * self.slot_bytes} exceeds "
                             f"the {_MAX_BYTES}-byte cap of the arena")
        self.n_chunks = (self.n_slots * self.slot_bytes + self.chunk_bytes - 1) // self.chunk_bytes
        if self.n_chunks > _MAX_INT32:
            raise ValueError(f"the arena would have {self.n_chunks} chunks of {self.chunk_bytes} "
                             f"bytes, more than {_MAX_INT32}: use larger chunks")
        cdef Py_ssize_t L = self.n_layers, E = self.n_experts
        self._res_a = np.full((L, E), -1, dtype=np.int32)
        self._owner_a = np.full(self.n_slots, -1, dtype=np.int32)
        self._heat_a = np.zeros((L, E), dtype=np.float64)
        self._rank_a = np.arange(L * E, dtype=np.int32).reshape(L, E)
        self._mapped_a = np.ones(self.n_chunks, dtype=np.bool_)
        self._backed_a = np.ones(self.n_slots, dtype=np.bool_)
        self._res, self._res_flat = self._res_a, self._res_a.reshape(-1)
        self._owner = self._owner_a
        self._heat, self._heat_flat = self._heat_a, self._heat_a.reshape(-1)
        self._rank_flat = self._rank_a.reshape(-1)
        self._mapped, self._backed = self._mapped_a, self._backed_a
        self._res_ro, self._owner_ro = _frozen(self._res_a), _frozen(self._owner_a)
        self._heat_ro, self._rank_ro = _frozen(self._heat_a), _frozen(self._rank_a)
        self._mapped_ro, self._backed_ro = _frozen(self._mapped_a), _frozen(self._backed_a)
        self.top, self.floor = self.n_slots, 0

    def __repr__(self):
        return (f"ResidencyTable(n_layers={self.n_layers}, n_experts={self.n_experts}, "
                f"n_slots={self.n_slots}, slot_bytes={self.slot_bytes}, "
                f"chunk_bytes={self.chunk_bytes}; {self.n_resident} resident, top={self.top}, "
                f"floor={self.floor})")

    # ------------------------------------------------------------ views

    @property
    def res(self):
        return self._res_ro

    @property
    def owner(self):
        return self._owner_ro

    @property
    def heat(self):
        return self._heat_ro

    @property
    def rank(self):
        return self._rank_ro

    @property
    def chunk_mapped(self):
        return self._mapped_ro

    @property
    def backed(self):
        return self._backed_ro

    # ------------------------------------------------------------ regions

    def set_regions(self, *, top=None, floor=None):
        cdef Py_ssize_t new_top = self.top if top is None else _slot_bound(top, self.n_slots, "top")
        cdef Py_ssize_t new_floor = (self.floor if floor is None
                                     else _slot_bound(floor, self.n_slots, "floor"))
        if new_floor > new_top:
            raise ValueError(f"floor {new_floor} must not exceed top {new_top} "
                             f"(0 <= floor <= top <= n_slots = {self.n_slots})")
        self.top, self.floor = new_top, new_floor

    # ------------------------------------------------------------ residency

    cdef inline tuple _pair(self, int32_t flat):
        return (flat // self.n_experts, flat % self.n_experts)

    cdef str _assign_problem(self, Py_ssize_t slot, int32_t flat):
        """Why flat cannot go into slot now, or None (indices already in range)."""
        if self._owner[slot] >= 0:
            return f"slot {slot} already holds expert {self._pair(self._owner[slot])}"
        if not self._backed[slot]:
            return f"slot {slot} is not backed (chunks {self.slot_chunks(slot)} not all mapped)"
        if self._res_flat[flat] >= 0:
            return f"expert {self._pair(flat)} is already in slot {self._res_flat[flat]}"
        return None

    cdef str _move_problem(self, Py_ssize_t src, Py_ssize_t dst):
        if self._owner[src] < 0:
            return f"src_slot {src} holds no expert"
        if src == dst:
            return f"src_slot and dst_slot are both {src}"
        if self._owner[dst] >= 0:
            return f"dst_slot {dst} already holds expert {self._pair(self._owner[dst])}"
        if not self._backed[dst]:
            return f"dst_slot {dst} is not backed (chunks {self.slot_chunks(dst)} not all mapped)"
        return None

    cdef inline void _put(self, Py_ssize_t slot, int32_t flat):
        self._owner[slot] = flat
        self._res_flat[flat] = <int32_t>slot
        self.n_resident += 1

    cdef inline int32_t _take(self, Py_ssize_t slot):
        cdef int32_t flat = self._owner[slot]
        self._owner[slot] = -1
        self._res_flat[flat] = -1
        self.n_resident -= 1
        return flat

    cdef inline void _shift(self, Py_ssize_t src, Py_ssize_t dst):
        self._put(dst, self._take(src))

    def assign(self, slot, layer, expert):
        cdef Py_ssize_t s = _index(slot, self.n_slots, "slot")
        cdef Py_ssize_t l = _index(layer, self.n_layers, "layer")
        cdef Py_ssize_t e = _index(expert, self.n_experts, "expert")
        cdef int32_t flat = <int32_t>(l * self.n_experts + e)
        problem = self._assign_problem(s, flat)
        if problem is not None:
            raise ValueError(f"assign: {problem}")
        self._put(s, flat)

    def evict(self, slot):
        cdef Py_ssize_t s = _index(slot, self.n_slots, "slot")
        if self._owner[s] < 0:
            raise ValueError(f"evict: slot {s} holds no expert")
        return self._pair(self._take(s))

    def move(self, src_slot, dst_slot):
        cdef Py_ssize_t src = _index(src_slot, self.n_slots, "src_slot")
        cdef Py_ssize_t dst = _index(dst_slot, self.n_slots, "dst_slot")
        problem = self._move_problem(src, dst)
        if problem is not None:
            raise ValueError(f"move: {problem}")
        self._shift(src, dst)

    cdef _check_range(self, cnp.ndarray a, Py_ssize_t bound, str call, str what):
        """IndexError naming the first element of a outside [0, bound)."""
        bad = np.flatnonzero((a < 0) | (a >= bound))
        if bad.size:
            i = bad[0]
            raise IndexError(f"{call}: element {i}: {what} {a[i]} is out of range [0, {bound})")

    cdef _same_length(self, str call, dict arrays):
        lengths = {name: a.shape[0] for name, a in arrays.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"{call}: arrays must have the same length, got {lengths}")

    def assign_many(self, slots, layers, experts):
        cdef cnp.ndarray s_a = _ids_1d(slots, "slots")
        cdef cnp.ndarray l_a = _ids_1d(layers, "layers")
        cdef cnp.ndarray e_a = _ids_1d(experts, "experts")
        self._same_length("assign_many", {"slots": s_a, "layers": l_a, "experts": e_a})
        self._check_range(s_a, self.n_slots, "assign_many", "slot")
        self._check_range(l_a, self.n_layers, "assign_many", "layer")
        self._check_range(e_a, self.n_experts, "assign_many", "expert")
        cdef int64_t[::1] sv = s_a, fv = l_a * self.n_experts + e_a
        cdef Py_ssize_t i, j
        for i in range(sv.shape[0]):
            problem = self._assign_problem(sv[i], <int32_t>fv[i])
            if problem is not None:
                for j in range(i - 1, -1, -1):
                    self._take(sv[j])
                raise ValueError(f"assign_many: element {i}: {problem}; nothing was assigned")
            self._put(sv[i], <int32_t>fv[i])

    def evict_many(self, slots):
        cdef cnp.ndarray s_a = _ids_1d(slots, "slots")
        self._check_range(s_a, self.n_slots, "evict_many", "slot")
        cdef int64_t[::1] sv = s_a
        cdef Py_ssize_t i, j, n = sv.shape[0]
        cdef cnp.ndarray out = np.empty((n, 2), dtype=np.int32)
        cdef int32_t[:, ::1] ov = out
        cdef int32_t flat
        for i in range(n):
            if self._owner[sv[i]] < 0:
                for j in range(i - 1, -1, -1):
                    self._put(sv[j], <int32_t>(ov[j, 0] * self.n_experts + ov[j, 1]))
                raise ValueError(f"evict_many: element {i}: slot {sv[i]} holds no expert; "
                                 f"nothing was evicted")
            flat = self._take(sv[i])
            ov[i, 0], ov[i, 1] = flat // self.n_experts, flat % self.n_experts
        return out

    def move_many(self, src_slots, dst_slots):
        cdef cnp.ndarray src_a = _ids_1d(src_slots, "src_slots")
        cdef cnp.ndarray dst_a = _ids_1d(dst_slots, "dst_slots")
        self._same_length("move_many", {"src_slots": src_a, "dst_slots": dst_a})
        self._check_range(src_a, self.n_slots, "move_many", "src_slot")
        self._check_range(dst_a, self.n_slots, "move_many", "dst_slot")
        cdef int64_t[::1] sv = src_a, dv = dst_a
        cdef Py_ssize_t i, j
        for i in range(sv.shape[0]):
            problem = self._move_problem(sv[i], dv[i])
            if problem is not None:
                for j in range(i - 1, -1, -1):
                    self._shift(dv[j], sv[j])
                raise ValueError(f"move_many: element {i}: {problem}; nothing was moved")
            self._shift(sv[i], dv[i])

    def slot_of(self, layer, expert):
        cdef Py_ssize_t l = _index(layer, self.n_layers, "layer")
        return self._res[l, _index(expert, self.n_experts, "expert")]

    def expert_in(self, slot):
        cdef int32_t flat = self._owner[_index(slot, self.n_slots, "slot")]
        return None if flat < 0 else self._pair(flat)

    # ------------------------------------------------------------ heat

    def set_rank(self, rank):
        cdef Py_ssize_t n = self.n_layers * self.n_experts
        a = _id_array(rank, "rank")
        if np.shape(a) != (self.n_layers, self.n_experts):
            raise ValueError(f"rank must have shape ({self.n_layers}, {self.n_experts}), "
                             f"got {np.shape(a)}")
        flat = a.reshape(-1).astype(np.int64)
        bad = np.flatnonzero((flat < 0) | (flat >= n))
        if bad.size:
            raise IndexError(f"rank{_at(bad[0], np.shape(a))} = {flat[bad[0]]} is out of range "
                             f"[0, {n})")
        seen = np.bincount(flat, minlength=n)
        if (seen != 1).any():
            raise ValueError(f"rank must be a permutation of 0 .. {n - 1}: "
                             f"{np.flatnonzero(seen > 1)[0]} appears more than once")
        self._rank_a[...] = a

    def set_rank_from_counts(self, counts):
        c = np.asarray(counts)
        if c.dtype.kind not in "iuf":
            raise ValueError(f"counts must be a numeric array, got dtype {c.dtype}")
        if c.shape != (self.n_layers, self.n_experts):
            raise ValueError(f"counts must have shape ({self.n_layers}, {self.n_experts}), "
                             f"got {c.shape}")
        if c.dtype.kind == "f" and not np.isfinite(c).all():
            bad = np.flatnonzero(~np.isfinite(c.reshape(-1)))[0]
            raise ValueError(f"counts must be finite, got counts"
                             f"{_at(bad, c.shape)} = {c.reshape(-1)[bad]}")
        flat_ids = np.arange(c.size)
        # Ascending counts with ties by descending id, reversed: counts desc, ties by id asc.
        # (lexsort on the counts themselves, so unsigned counts need no negation.)
        order = np.lexsort((-flat_ids, c.reshape(-1)))[::-1]
        rank = np.empty(c.size, dtype=np.int32)
        rank[order] = np.arange(c.size, dtype=np.int32)
        self._rank_a[...] = rank.reshape(c.shape)

    def record(self, layer, expert_ids):
        cdef Py_ssize_t l = _index(layer, self.n_layers, "layer")
        cdef cnp.ndarray a = _id_array(expert_ids, "expert_ids")
        cdef Py_ssize_t n = cnp.PyArray_SIZE(a)
        cdef void* p = cnp.PyArray_DATA(a)
        cdef bint wide = cnp.PyArray_TYPE(a) == cnp.NPY_INT64
        # Check every id before adding any: a float addition cannot be undone exactly.
        _check_ids(a, self.n_experts)
        if wide:
            _add_counts(self._heat[l], <const int64_t*>p, n)
        else:
            _add_counts(self._heat[l], <const int32_t*>p, n)

    def decay(self, double factor):
        if not 0.0 < factor <= 1.0:
            raise ValueError(f"decay factor must be in (0, 1], got {factor}")
        with nogil:
            _scale(self._heat_flat, factor)

    def coldest(self, lo, hi):
        cdef Py_ssize_t a = _slot_bound(lo, self.n_slots, "lo")
        cdef Py_ssize_t b = _slot_bound(hi, self.n_slots, "hi")
        if a > b:
            raise ValueError(f"coldest: lo {a} must not exceed hi {b}")
        return _coldest(self._owner, self._heat_flat, self._rank_flat, a, b)

    def residents_by_heat(self, lo, hi):
        cdef Py_ssize_t a = _slot_bound(lo, self.n_slots, "lo")
        cdef Py_ssize_t b = _slot_bound(hi, self.n_slots, "hi")
        if a > b:
            raise ValueError(f"residents_by_heat: lo {a} must not exceed hi {b}")
        slots = np.flatnonzero(self._owner_a[a:b] >= 0).astype(np.int32) + np.int32(a)
        flat = self._owner_a[slots]
        # lexsort: last key first; heat ascending, then rank descending = coldest first.
        order = np.lexsort((-self._rank_a.reshape(-1)[flat], self._heat_a.reshape(-1)[flat]))
        return slots[order]

    def hottest_missing(self, k):
        cdef Py_ssize_t want = _count(k, 0, _MAX_INT32, "k")
        missing = np.flatnonzero(self._res_a.reshape(-1) < 0)
        order = np.lexsort((self._rank_a.reshape(-1)[missing], -self._heat_a.reshape(-1)[missing]))
        flat = missing[order[:want]]
        return np.stack([flat // self.n_experts, flat % self.n_experts], axis=1).astype(np.int32)

    # ------------------------------------------------------------ the hot path

    def lookup(self, layer, expert_ids, out_slots=None, out_hit=None):
        cdef Py_ssize_t l = _index(layer, self.n_layers, "layer")
        cdef cnp.ndarray ids = _id_array(expert_ids, "expert_ids")
        if cnp.PyArray_NDIM(ids) != 2:
            raise ValueError(f"expert_ids must be 2-D [T, K], got shape {np.shape(ids)}")
        cdef cnp.npy_intp* dims = cnp.PyArray_DIMS(ids)
        if out_slots is None:
            out_slots = cnp.PyArray_EMPTY(2, dims, cnp.NPY_INT32, 0)
        else:
            _check_out(out_slots, cnp.NPY_INT32, "int32", dims[0], dims[1], "out_slots")
        if out_hit is None:
            out_hit = cnp.PyArray_EMPTY(2, dims, cnp.NPY_BOOL, 0)
        else:
            _check_out(out_hit, cnp.NPY_BOOL, "bool", dims[0], dims[1], "out_hit")
        cdef Py_ssize_t n = dims[0] * dims[1], bad
        cdef void* p = cnp.PyArray_DATA(ids)
        cdef int32_t* o = <int32_t*>cnp.PyArray_DATA(<cnp.ndarray>out_slots)
        cdef cnp.npy_bool* h = <cnp.npy_bool*>cnp.PyArray_DATA(<cnp.ndarray>out_hit)
        cdef int64_t n_hits = 0
        cdef bint wide = cnp.PyArray_TYPE(ids) == cnp.NPY_INT64
        if n < _NOGIL_MIN_IDS:
            if wide:
                bad = _lookup_kernel(self._res[l], <const int64_t*>p, n, o, h, &n_hits)
            else:
                bad = _lookup_kernel(self._res[l], <const int32_t*>p, n, o, h, &n_hits)
        else:
            with nogil:
                if wide:
                    bad = _lookup_kernel(self._res[l], <const int64_t*>p, n, o, h, &n_hits)
                else:
                    bad = _lookup_kernel(self._res[l], <const int32_t*>p, n, o, h, &n_hits)
        if bad >= 0:
            raise IndexError(f"expert_ids[{bad // dims[1]}, {bad % dims[1]}] = "
                             f"{ids.reshape(-1)[bad]} is out of range [0, {self.n_experts})")
        self.hits += n_hits
        self.lookups += n
        return out_slots, out_hit

    def split_token(self, layer, expert_ids, out):
        cdef Py_ssize_t l = _index(layer, self.n_layers, "layer")
        cdef cnp.ndarray ids = _id_array(expert_ids, "expert_ids")
        cdef int nd = cnp.PyArray_NDIM(ids)
        if not (nd == 1 or (nd == 2 and cnp.PyArray_DIM(ids, 0) == 1)):
            raise ValueError(f"expert_ids must be one token's [K] or [1, K], got shape "
                             f"{np.shape(ids)}")
        cdef Py_ssize_t k = cnp.PyArray_SIZE(ids)
        cdef cnp.ndarray o
        if not cnp.PyArray_Check(out):
            raise ValueError(f"out must be a numpy array, got {type(out).__name__}")
        o = <cnp.ndarray>out
        if (cnp.PyArray_TYPE(o) != cnp.NPY_INT64 or cnp.PyArray_NDIM(o) != 1
                or cnp.PyArray_DIM(o, 0) < 5 * k + 1 or not cnp.PyArray_IS_C_CONTIGUOUS(o)
                or not cnp.PyArray_ISNOTSWAPPED(o) or not cnp.PyArray_ISALIGNED(o)
                or not cnp.PyArray_ISWRITEABLE(o)):
            raise ValueError(f"out must be a writeable C-contiguous int64 array of at least "
                             f"5K + 1 = {5 * k + 1} elements, got {o.dtype} {np.shape(o)}")
        cdef void* p = cnp.PyArray_DATA(ids)
        cdef bint wide = cnp.PyArray_TYPE(ids) == cnp.NPY_INT64
        # Check every id before counting any: a float addition cannot be undone exactly.
        _check_ids(ids, self.n_experts)
        cdef Py_ssize_t n_hits, n_experts = 0
        cdef const int32_t* res_row = &self._res_flat[l * self.n_experts]
        cdef double* heat_row = &self._heat_flat[l * self.n_experts]
        cdef int64_t* o_data = <int64_t*>cnp.PyArray_DATA(o)
        if wide:
            n_hits = _split_token_kernel(res_row, heat_row, <const int64_t*>p, k, o_data,
                                         &n_experts)
        else:
            n_hits = _split_token_kernel(res_row, heat_row, <const int32_t*>p, k, o_data,
                                         &n_experts)
        self.hits += n_hits
        self.lookups += k
        return n_hits, n_experts

    def reset_counters(self):
        self.hits = self.lookups = 0

    # ------------------------------------------------------------ geometry

    cdef inline Py_ssize_t _slot_chunk_lo(self, Py_ssize_t slot):
        return slot * self.slot_bytes // self.chunk_bytes

    cdef inline Py_ssize_t _slot_chunk_hi(self, Py_ssize_t slot):
        return ((slot + 1) * self.slot_bytes + self.chunk_bytes - 1) // self.chunk_bytes

    cdef inline Py_ssize_t _chunk_slot_lo(self, Py_ssize_t chunk):
        return chunk * self.chunk_bytes // self.slot_bytes

    cdef inline Py_ssize_t _chunk_slot_hi(self, Py_ssize_t chunk):
        return min(self.n_slots,
                   ((chunk + 1) * self.chunk_bytes + self.slot_bytes - 1) // self.slot_bytes)

    def slot_chunks(self, slot):
        cdef Py_ssize_t s = _index(slot, self.n_slots, "slot")
        return (self._slot_chunk_lo(s), self._slot_chunk_hi(s))

    def chunk_slots(self, chunk):
        cdef Py_ssize_t c = _index(chunk, self.n_chunks, "chunk")
        return (self._chunk_slot_lo(c), self._chunk_slot_hi(c))

    def chunks_within(self, lo, hi):
        cdef Py_ssize_t a = _slot_bound(lo, self.n_slots, "lo")
        cdef Py_ssize_t b = _slot_bound(hi, self.n_slots, "hi")
        if a > b:
            raise ValueError(f"chunks_within: lo {a} must not exceed hi {b}")
        # First chunk starting at or after slot a's start; the chunks past the last slot's end
        # belong to no other slot, so with b == n_slots they all count as inside.
        cdef Py_ssize_t c_lo = (a * self.slot_bytes + self.chunk_bytes - 1) // self.chunk_bytes
        cdef Py_ssize_t c_hi = (self.n_chunks if b == self.n_slots
                                else b * self.slot_bytes // self.chunk_bytes)
        return (c_lo, max(c_lo, c_hi))

    cdef cnp.ndarray _chunk_array(self, object chunks, str call):
        cdef cnp.ndarray c = _ids_1d(chunks, "chunks")
        self._check_range(c, self.n_chunks, call, "chunk")
        return c

    def slots_completed_by(self, chunks):
        cdef cnp.ndarray c = self._chunk_array(chunks, "slots_completed_by")
        cdef cnp.ndarray would_a = self._mapped_a.copy()
        would_a[c] = True
        cdef cnp.npy_bool[::1] would = would_a
        cdef int64_t[::1] cv = c
        cdef Py_ssize_t i, s, k
        cdef set completed = set()
        for i in range(cv.shape[0]):
            for s in range(self._chunk_slot_lo(cv[i]), self._chunk_slot_hi(cv[i])):
                if self._backed[s] or s in completed:
                    continue
                for k in range(self._slot_chunk_lo(s), self._slot_chunk_hi(s)):
                    if not would[k]:
                        break
                else:
                    completed.add(s)
        return np.array(sorted(completed), dtype=np.int32)

    def mark_chunks(self, chunks, mapped):
        if not isinstance(mapped, (bool, np.bool_)):
            raise TypeError(f"mapped must be a bool, got {mapped!r}")
        cdef cnp.ndarray c = self._chunk_array(chunks, "mark_chunks")
        cdef int64_t[::1] cv = c
        cdef Py_ssize_t i, s, k
        if not mapped:
            for i in range(cv.shape[0]):
                for s in range(self._chunk_slot_lo(cv[i]), self._chunk_slot_hi(cv[i])):
                    if self._owner[s] >= 0:
                        raise ValueError(
                            f"mark_chunks: element {i}: chunk {cv[i]} cannot be unmapped, slot "
                            f"{s} touching it holds expert {self._pair(self._owner[s])}")
        cdef cnp.npy_bool flag = 1 if mapped else 0
        for i in range(cv.shape[0]):
            self._mapped[cv[i]] = flag
        for i in range(cv.shape[0]):
            for s in range(self._chunk_slot_lo(cv[i]), self._chunk_slot_hi(cv[i])):
                self._backed[s] = True
                for k in range(self._slot_chunk_lo(s), self._slot_chunk_hi(s)):
                    if not self._mapped[k]:
                        self._backed[s] = False
                        break

    # ------------------------------------------------------------ checks and persistence

    cdef cnp.ndarray _backed_from_chunks(self):
        """backed, recomputed from chunk_mapped for every slot at once."""
        slots = np.arange(self.n_slots, dtype=np.int64)
        lo = slots * self.slot_bytes // self.chunk_bytes
        hi = ((slots + 1) * self.slot_bytes + self.chunk_bytes - 1) // self.chunk_bytes
        unmapped_before = np.concatenate([[0], np.cumsum(~self._mapped_a)])  # [n_chunks + 1]
        return unmapped_before[hi] == unmapped_before[lo]

    def validate(self):
        L, E, S = self.n_layers, self.n_experts, self.n_slots
        res, owner = self._res_a.reshape(-1), self._owner_a

        def fail(message):
            raise AssertionError(f"ResidencyTable invariant broken: {message}")

        if not 0 <= self.floor <= self.top <= S:
            fail(f"0 <= floor ({self.floor}) <= top ({self.top}) <= n_slots ({S})")
        bad = np.flatnonzero((res < -1) | (res >= S))
        if bad.size:
            fail(f"res{_at(bad[0], (L, E))} = {res[bad[0]]} not in [-1, {S})")
        bad = np.flatnonzero((owner < -1) | (owner >= L * E))
        if bad.size:
            fail(f"owner[{bad[0]}] = {owner[bad[0]]} not in [-1, {L * E})")
        occupied = np.flatnonzero(res >= 0)
        bad = occupied[owner[res[occupied]] != occupied]
        if bad.size:
            f = bad[0]
            fail(f"res{self._pair(f)} = {res[f]} but owner[{res[f]}] = {owner[res[f]]}")
        held = np.flatnonzero(owner >= 0)
        bad = held[res[owner[held]] != held]
        if bad.size:
            s = bad[0]
            fail(f"owner[{s}] = {owner[s]} but res{self._pair(owner[s])} = {res[owner[s]]}")
        if self.n_resident != held.size:
            fail(f"n_resident {self.n_resident} != {held.size} occupied slots")
        backed = self._backed_from_chunks()
        bad = np.flatnonzero(backed != self._backed_a)
        if bad.size:
            fail(f"backed[{bad[0]}] = {self._backed_a[bad[0]]} but its chunks say {backed[bad[0]]}")
        bad = held[~backed[held]]
        if bad.size:
            fail(f"slot {bad[0]} holds expert {self._pair(owner[bad[0]])} but is not backed")
        if not np.array_equal(np.sort(self._rank_a.reshape(-1)), np.arange(L * E)):
            fail(f"rank is not a permutation of 0 .. {L * E - 1}")
        if not (np.isfinite(self._heat_a).all() and (self._heat_a >= 0).all()):
            fail("heat holds a negative or non-finite value")
        if not 0 <= self.hits <= self.lookups:
            fail(f"0 <= hits ({self.hits}) <= lookups ({self.lookups})")

    def save(self, path):
        arrays = {
            "format": np.array(_FORMAT),
            "version": np.array(_FORMAT_VERSION, dtype=np.int64),
            "shape": np.array([self.n_layers, self.n_experts, self.n_slots, self.slot_bytes,
                               self.chunk_bytes], dtype=np.int64),
            "res": self._res_a, "owner": self._owner_a, "heat": self._heat_a,
            "rank": self._rank_a, "chunk_mapped": self._mapped_a,
            "regions": np.array([self.top, self.floor], dtype=np.int64),
            "counters": np.array([self.hits, self.lookups], dtype=np.int64),
        }
        path = os.fspath(path)
        # A stored zip with fixed timestamps (same books, same bytes), written to a temporary
        # file and renamed over path, so that a crash never leaves half a file behind.
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f, zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as z:
                for name in _FIELDS:
                    info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
                    with z.open(info, "w") as member:
                        np.lib.format.write_array(member, np.asarray(arrays[name]),
                                                  allow_pickle=False)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise

    @classmethod
    def load(cls, path, *, n_layers=None, n_experts=None, n_slots=None, slot_bytes=None,
             chunk_bytes=None):
        path = os.fspath(path)
        try:
            with np.load(path, allow_pickle=False) as z:
                missing = [name for name in _FIELDS if name not in z.files]
                if missing:
                    raise ValueError(f"fields {missing} are missing")
                data = {name: z[name] for name in _FIELDS}
        except FileNotFoundError:
            raise
        except Exception as e:
            raise ValueError(f"{path} is not a readable residency table: {e}") from e
        if data["format"].shape != () or str(data["format"]) != _FORMAT:
            raise ValueError(f"{path} is not a residency table (format {data['format']!r})")
        if (data["version"].dtype != np.int64 or data["version"].shape != ()
                or int(data["version"]) != _FORMAT_VERSION):
            raise ValueError(f"{path} has format version {data['version']}, this build reads "
                             f"version {_FORMAT_VERSION}")
        for name, n in (("shape", 5), ("regions", 2), ("counters", 2)):
            if data[name].dtype != np.int64 or data[name].shape != (n,):
                raise ValueError(f"{path}: {name} must be int64 [{n}], got "
                                 f"{data[name].dtype} {data[name].shape}")
        names = ("n_layers", "n_experts", "n_slots", "slot_bytes", "chunk_bytes")
        stored = dict(zip(names, (int(v) for v in data["shape"])))
        expected = dict(zip(names, (n_layers, n_experts, n_slots, slot_bytes, chunk_bytes)))
        for name in names:
            if expected[name] is not None and expected[name] != stored[name]:
                raise ValueError(f"{path} holds a table with {name} = {stored[name]}, "
                                 f"expected {expected[name]}")
        # Check the arrays against the stored shape before building a table of that shape, so
        # that a corrupt shape cannot make us allocate more than the file itself holds.
        L, E, S, slot_b, chunk_b = stored.values()
        n_chunks = -(-S * slot_b // chunk_b) if S >= 0 and slot_b >= 1 and chunk_b >= 1 else -1
        wanted = {"res": (np.int32, (L, E)), "owner": (np.int32, (S,)),
                  "heat": (np.float64, (L, E)), "rank": (np.int32, (L, E)),
                  "chunk_mapped": (np.bool_, (n_chunks,))}
        for name, (dtype, shape) in wanted.items():
            a = data[name]
            if a.dtype != dtype or a.shape != shape:
                raise ValueError(f"{path}: {name} must be {np.dtype(dtype)} {shape} for a table "
                                 f"of shape {stored}, got {a.dtype} {a.shape}")
        try:
            table = cls(*stored.values())
        except (ValueError, TypeError, IndexError) as e:
            raise ValueError(f"{path}: bad shape {stored}: {e}") from e
        cdef ResidencyTable t = table
        for name, target in (("res", t._res_a), ("owner", t._owner_a), ("heat", t._heat_a),
                             ("rank", t._rank_a), ("chunk_mapped", t._mapped_a)):
            target[...] = data[name]
        t.top, t.floor = (int(v) for v in data["regions"])
        t.hits, t.lookups = (int(v) for v in data["counters"])
        t.n_resident = np.count_nonzero(t._owner_a >= 0)
        t._backed_a[...] = t._backed_from_chunks()
        try:
            t.validate()
        except AssertionError as e:
            raise ValueError(f"{path} holds inconsistent books: {e}") from None
        return table


include "_residency_view.pxi"
include "_residency_rule.pxi"
include "_residency_step.pxi"
include "_residency_drive.pxi"
