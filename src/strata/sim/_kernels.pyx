# The simulator's hot loops: the access sequence, Belady's MIN with bypass, per-block counts, and
# the replays of the `lru`, `lfu` and `sieve` rules. Each is a nogil loop over typed
# memoryviews behind a thin `def` wrapper that checks shapes; `_kernels.pyi` documents them.
# Directives (bounds and wraparound checks off) are set once in setup.py.
#
# Legend: N tokens, L layers, E experts per layer, K experts per token, S steps, A accesses
# (N * L * K), B blocks, C capacity in slots. A flat expert id is `layer * E + expert`.

from libc.stdint cimport int32_t, int64_t, uint8_t

import numpy as np

# Codes of `min_bypass`: what happened at each access.
cdef enum:
    MISS = 0
    HIT = 1
    LOADED = 2
    REPEAT = 3

CODE_MISS, CODE_HIT, CODE_LOADED, CODE_REPEAT = MISS, HIT, LOADED, REPEAT

cdef enum:
    LRU = 0
    LFU = 1

MODE_LRU, MODE_LFU = LRU, LFU


def _need(bint ok, str message):
    if not ok:
        raise ValueError(message)


# ---------------------------------------------------------------------------------------------
# The access sequence

cdef void _sequence(const int32_t[:, :, ::1] ids, const int64_t[::1] step_offsets,
                    int32_t n_experts, int32_t[::1] out) noexcept nogil:
    cdef Py_ssize_t n_steps = step_offsets.shape[0] - 1
    cdef Py_ssize_t n_layers = ids.shape[1], top_k = ids.shape[2]
    cdef Py_ssize_t s, layer, t, k, i = 0
    cdef int32_t base
    for s in range(n_steps):
        for layer in range(n_layers):
            base = <int32_t>layer * n_experts
            for t in range(step_offsets[s], step_offsets[s + 1]):
                for k in range(top_k):
                    out[i] = base + ids[t, layer, k]
                    i += 1


def access_sequence(const int32_t[:, :, ::1] ids, const int64_t[::1] step_offsets,
                    int n_experts):
    _need(step_offsets.shape[0] >= 1 and step_offsets[step_offsets.shape[0] - 1] == ids.shape[0],
          "step_offsets must end at the number of tokens")
    out = np.empty(ids.shape[0] * ids.shape[1] * ids.shape[2], np.int32)
    cdef int32_t[::1] out_v = out
    with nogil:
        _sequence(ids, step_offsets, n_experts, out_v)
    return out


# ---------------------------------------------------------------------------------------------
# Belady's MIN with bypass

cdef void _next_use(const int32_t[::1] seq, int64_t[::1] last, int64_t[::1] out) noexcept nogil:
    cdef Py_ssize_t n = seq.shape[0], i
    cdef Py_ssize_t j
    for j in range(last.shape[0]):
        last[j] = n
    for i in range(n - 1, -1, -1):
        out[i] = last[seq[i]]
        last[seq[i]] = i


def next_use(const int32_t[::1] seq, Py_ssize_t n_items):
    cdef Py_ssize_t i
    for i in range(seq.shape[0]):
        if seq[i] < 0 or seq[i] >= n_items:
            raise IndexError(f"seq[{i}] = {seq[i]} is outside [0, {n_items})")
    out = np.empty(seq.shape[0], np.int64)
    last = np.empty(n_items, np.int64)
    cdef int64_t[::1] out_v = out, last_v = last
    with nogil:
        _next_use(seq, last_v, out_v)
    return out


cdef inline void _heap_push(int64_t[::1] keys, int32_t[::1] items, Py_ssize_t *size,
                            int64_t key, int32_t item) noexcept nogil:
    # A max-heap on key.
    cdef Py_ssize_t i = size[0], parent
    size[0] += 1
    while i > 0:
        parent = (i - 1) >> 1
        if keys[parent] >= key:
            break
        keys[i] = keys[parent]
        items[i] = items[parent]
        i = parent
    keys[i] = key
    items[i] = item


cdef inline void _heap_pop(int64_t[::1] keys, int32_t[::1] items, Py_ssize_t *size) noexcept nogil:
    cdef Py_ssize_t n = size[0] - 1, i = 0, child
    cdef int64_t key = keys[n]
    cdef int32_t item = items[n]
    size[0] = n
    while True:
        child = 2 * i + 1
        if child >= n:
            break
        if child + 1 < n and keys[child + 1] > keys[child]:
            child += 1
        if keys[child] <= key:
            break
        keys[i] = keys[child]
        items[i] = items[child]
        i = child
    if n > 0:
        keys[i] = key
        items[i] = item


cdef inline int32_t _furthest(int64_t[::1] heap_keys, int32_t[::1] heap_items, Py_ssize_t *size,
                              const uint8_t[::1] resident, const int64_t[::1] cur_next) noexcept nogil:
    """The live resident next used last; stale heap entries are dropped on the way."""
    while not (resident[heap_items[0]] and cur_next[heap_items[0]] == heap_keys[0]):
        _heap_pop(heap_keys, heap_items, size)
    return heap_items[0]


cdef void _min_bypass(const int32_t[::1] seq, const int64_t[::1] nxt, const int64_t[::1] starts,
                      Py_ssize_t capacity, uint8_t[::1] resident, int64_t[::1] cur_next,
                      int64_t[::1] seen, int32_t[::1] missed, int64_t[::1] heap_keys,
                      int32_t[::1] heap_items, uint8_t[::1] codes,
                      int64_t[::1] evictions) noexcept nogil:
    cdef Py_ssize_t n = seq.shape[0], i, b, j, size = 0, n_resident = 0, n_missed
    cdef int32_t x, f
    cdef int64_t nx
    # The free start: the `capacity` items used first are resident before the first access.
    for i in range(n):
        if n_resident >= capacity:
            break
        x = seq[i]
        if not resident[x]:
            resident[x] = 1
            cur_next[x] = i
            _heap_push(heap_keys, heap_items, &size, i, x)
            n_resident += 1
    for b in range(starts.shape[0] - 1):
        # The block's lookups: all of them before any load, as in the engine.
        n_missed = 0
        for i in range(starts[b], starts[b + 1]):
            x = seq[i]
            if resident[x]:
                codes[i] = HIT
                cur_next[x] = nxt[i]
                _heap_push(heap_keys, heap_items, &size, nxt[i], x)
            elif seen[x] == b:
                codes[i] = REPEAT
                cur_next[x] = nxt[i]  # its next use after the block, once the block is done
            else:
                codes[i] = MISS
                seen[x] = b
                cur_next[x] = nxt[i]
                missed[n_missed] = <int32_t>i
                n_missed += 1
        # Then the loads: a missed item enters only if it is needed before some resident.
        for j in range(n_missed):
            i = missed[j]
            x = seq[i]
            nx = cur_next[x]
            if nx == n or capacity == 0:  # never used again: never worth a slot
                continue
            if n_resident < capacity:
                n_resident += 1
            else:
                f = _furthest(heap_keys, heap_items, &size, resident, cur_next)
                if cur_next[f] <= nx:
                    continue  # bypass: every resident is needed before x is
                _heap_pop(heap_keys, heap_items, &size)
                resident[f] = 0
                evictions[f] += 1
            resident[x] = 1
            _heap_push(heap_keys, heap_items, &size, nx, x)
            codes[i] = LOADED


def min_bypass(const int32_t[::1] seq, const int64_t[::1] nxt, const int64_t[::1] starts,
               Py_ssize_t capacity, Py_ssize_t n_items):
    cdef Py_ssize_t i, n = seq.shape[0], n_blocks = starts.shape[0] - 1
    _need(nxt.shape[0] == n, "nxt must have seq's length")
    _need(capacity >= 0, f"capacity must be >= 0, got {capacity}")
    _need(n_blocks >= 0 and starts[0] == 0 and starts[n_blocks] == n,
          "starts must run from 0 to len(seq)")
    for i in range(n_blocks):
        _need(starts[i] <= starts[i + 1], "starts must not decrease")
    for i in range(n):
        if seq[i] < 0 or seq[i] >= n_items:
            raise IndexError(f"seq[{i}] = {seq[i]} is outside [0, {n_items})")
        if nxt[i] <= i or nxt[i] > n:
            raise ValueError(f"nxt[{i}] = {nxt[i]} is not a later index (or {n})")
    codes = np.zeros(n, np.uint8)
    resident = np.zeros(n_items, np.uint8)
    cur_next = np.zeros(n_items, np.int64)
    seen = np.full(n_items, -1, np.int64)
    missed = np.empty(max(n, 1), np.int32)
    evictions = np.zeros(n_items, np.int64)
    heap_keys = np.empty(n + min(capacity, n) + 1, np.int64)
    heap_items = np.empty(n + min(capacity, n) + 1, np.int32)
    cdef uint8_t[::1] codes_v = codes, resident_v = resident
    cdef int64_t[::1] cur_v = cur_next, keys_v = heap_keys, evictions_v = evictions
    cdef int64_t[::1] seen_v = seen
    cdef int32_t[::1] items_v = heap_items, missed_v = missed
    with nogil:
        _min_bypass(seq, nxt, starts, capacity, resident_v, cur_v, seen_v, missed_v, keys_v,
                    items_v, codes_v, evictions_v)
    return codes, evictions


# ---------------------------------------------------------------------------------------------
# Per-block counts

cdef void _block_stats(const int32_t[::1] items, const uint8_t[::1] codes,
                       const int64_t[::1] starts, int64_t[::1] seen_hit,
                       int64_t[::1] seen_miss, int32_t[:] hits, int32_t[:] distinct_hits,
                       int32_t[:] distinct_misses, int32_t[:] loads) noexcept nogil:
    cdef Py_ssize_t b, i
    cdef int32_t x
    for b in range(starts.shape[0] - 1):
        hits[b] = 0
        distinct_hits[b] = 0
        distinct_misses[b] = 0
        loads[b] = 0
        for i in range(starts[b], starts[b + 1]):
            x = items[i]
            if codes[i] == HIT:
                hits[b] += 1
                if seen_hit[x] != b:
                    seen_hit[x] = b
                    distinct_hits[b] += 1
            elif codes[i] == REPEAT:
                hits[b] += 1
            else:
                if seen_miss[x] != b:
                    seen_miss[x] = b
                    distinct_misses[b] += 1
                if codes[i] == LOADED:
                    loads[b] += 1


def block_stats(const int32_t[::1] items, const uint8_t[::1] codes, const int64_t[::1] starts,
                Py_ssize_t n_items, int32_t[:] hits, int32_t[:] distinct_hits,
                int32_t[:] distinct_misses, int32_t[:] loads):
    cdef Py_ssize_t n_blocks = starts.shape[0] - 1, i
    _need(codes.shape[0] == items.shape[0], "codes must have items' length")
    _need(n_blocks >= 0 and starts[0] == 0 and starts[n_blocks] == items.shape[0],
          "starts must run from 0 to len(items)")
    for i in range(n_blocks):
        _need(starts[i] <= starts[i + 1], "starts must not decrease")
    _need(hits.shape[0] == n_blocks and distinct_hits.shape[0] == n_blocks
          and distinct_misses.shape[0] == n_blocks and loads.shape[0] == n_blocks,
          f"outputs must have {n_blocks} entries")
    for i in range(items.shape[0]):
        if items[i] < 0 or items[i] >= n_items:
            raise IndexError(f"items[{i}] = {items[i]} is outside [0, {n_items})")
    seen_hit = np.full(n_items, -1, np.int64)
    seen_miss = np.full(n_items, -1, np.int64)
    cdef int64_t[::1] seen_hit_v = seen_hit, seen_miss_v = seen_miss
    with nogil:
        _block_stats(items, codes, starts, seen_hit_v, seen_miss_v, hits, distinct_hits,
                     distinct_misses, loads)


# ---------------------------------------------------------------------------------------------
# One layer of one step, as the engine runs it: look up, and record the routing into the heat

cdef Py_ssize_t _lookup_step(const int32_t[:, :, ::1] ids, Py_ssize_t t0, Py_ssize_t t1,
                             Py_ssize_t layer, Py_ssize_t n_experts, const int32_t *res,
                             double *heat, int64_t[::1] seen, int64_t stamp,
                             int32_t[::1] missed, int32_t *hits,
                             int32_t *distinct_hits) noexcept nogil:
    """Counts the hits; lists the distinct missed experts (layer-local ids) in `missed`, in the
    order first seen, and returns how many. `seen[e] == stamp` marks experts met this step."""
    cdef Py_ssize_t t, k, x, n_missed = 0
    cdef int32_t e
    for t in range(t0, t1):
        for k in range(ids.shape[2]):
            e = ids[t, layer, k]
            x = layer * n_experts + e
            heat[x] += 1.0
            if res[x] >= 0:
                hits[0] += 1
                if seen[e] != stamp:
                    seen[e] = stamp
                    distinct_hits[0] += 1
            elif seen[e] != stamp:
                seen[e] = stamp
                missed[n_missed] = e
                n_missed += 1
    return n_missed


include "_kernels_scored.pxi"
include "_kernels_sieve.pxi"
