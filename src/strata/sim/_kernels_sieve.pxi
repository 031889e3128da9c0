# Included by _kernels.pyx: the replay of `sieve`.
#
# The rule (strata.policies.base.SieveState, the built-in `sieve`): the residents below `top` form
# a queue ordered by key = (admission number + 1) * L*E + (L*E - 1 - rank), oldest (smallest)
# first; a hit marks an expert visited. An admit call takes the empty slots first, then victims:
# the hand's order is fixed for the call (from the first key >= the hand, round the queue); each
# victim is the next expert in that order neither visited nor taken, the marks passed are cleared;
# at the end of the order the rest are cleared and the walk starts over, taking the first not yet
# taken. The hand then stands on the one after the last victim (-1 past the end of the order). The
# queue is a doubly linked list of slots behind a sentinel; victims leave it and the admitted join
# at the new end after the call, as the policy sees them once the books have them.

cdef struct Queue:
    int32_t *prev      # [n_slots + 1]; index n_slots is the sentinel
    int32_t *next
    int64_t *key       # [n_slots]: the queue key of each listed slot
    Py_ssize_t sentinel
    Py_ssize_t n_listed
    int64_t hand_key   # the policy's `hand`: start at the first key >= it; -1: the oldest
    Py_ssize_t hand    # the listed slot of that first key, or -1: look it up


cdef inline Py_ssize_t _after(Queue *q, Py_ssize_t node) noexcept nogil:
    """The next slot toward the newest, wrapping round to the oldest."""
    cdef Py_ssize_t n = q.next[node]
    return q.next[n] if n == q.sentinel else n


cdef inline Py_ssize_t _before(Queue *q, Py_ssize_t node) noexcept nogil:
    cdef Py_ssize_t p = q.prev[node]
    return q.prev[p] if p == q.sentinel else p


cdef inline void _unlink(Queue *q, Py_ssize_t node) noexcept nogil:
    q.next[q.prev[node]] = q.next[node]
    q.prev[q.next[node]] = q.prev[node]
    q.n_listed -= 1


cdef inline void _append(Queue *q, Py_ssize_t node) noexcept nogil:
    """Join at the newest end."""
    cdef Py_ssize_t last = q.prev[q.sentinel]
    q.next[last] = <int32_t>node
    q.prev[node] = <int32_t>last
    q.next[node] = <int32_t>q.sentinel
    q.prev[q.sentinel] = <int32_t>node
    q.n_listed += 1


cdef Py_ssize_t _hand_start(Queue *q) noexcept nogil:
    """Where the hand starts: the first listed key >= hand_key, else (or with no hand) the
    oldest. Keys rise along the list, and the slot found stays first until it is evicted."""
    cdef Py_ssize_t node
    if q.hand >= 0:
        return q.hand
    node = q.next[q.sentinel]
    if q.hand_key >= 0:
        while node != q.sentinel and q.key[node] < q.hand_key:
            node = q.next[node]
        if node == q.sentinel:
            node = q.next[q.sentinel]
    return node


cdef Py_ssize_t _sieve_victims(Queue *q, const int32_t *owner, uint8_t *visited,
                               uint8_t *taken, Py_ssize_t count, int32_t[::1] out) noexcept nogil:
    """Up to `count` victims into `out` (slots, in order), marked in `taken` and still listed;
    moves the hand. Returns how many."""
    cdef Py_ssize_t start, last, node, cur, found, v, n = q.n_listed
    cdef bint at_end = False
    if n == 0 or count == 0:
        return 0
    if count > n:
        count = n
    start = _hand_start(q)
    last = _before(q, start)
    cur = start
    for v in range(count):
        found = -1
        if not at_end:
            node = cur
            while True:
                if not taken[node] and not visited[owner[node]]:
                    found = node
                    break
                visited[owner[node]] = 0  # the hand clears what it passes
                if node == last:
                    break
                node = _after(q, node)
        if found < 0:  # the end of the order: start over, the first not yet taken
            found = start
            while taken[found]:
                found = _after(q, found)
        taken[found] = 1
        out[v] = <int32_t>found
        at_end = found == last
        cur = _after(q, found)
    if at_end:
        q.hand, q.hand_key = -1, -1
    else:
        q.hand_key = q.key[cur]
        q.hand = -1 if taken[cur] else cur  # a victim leaves: look the key up next time
    return count


cdef inline bint _hotter(Books *b, Py_ssize_t x, Py_ssize_t y) noexcept nogil:
    """x before y in the books' heat order: higher heat, then lower rank."""
    if b.heat[x] != b.heat[y]:
        return b.heat[x] > b.heat[y]
    return b.rank[x] < b.rank[y]


cdef void _replay_sieve(
    const int32_t[:, :, ::1] ids, const int64_t[::1] step_offsets, Py_ssize_t step_lo,
    Py_ssize_t step_hi, Books *b, Queue *q, uint8_t *visited, int64_t *inserted,
    int64_t *next_insert, Py_ssize_t max_admits, const int32_t[::1] empties,
    int32_t[::1] missed, int64_t[::1] seen, int32_t[::1] placed, int32_t[::1] victims,
    uint8_t *taken,
    int32_t[:, ::1] out_hits, int32_t[:, ::1] out_dhits, int32_t[:, ::1] out_dmisses,
    int32_t[:, ::1] out_admits, int64_t[::1] layer_admits, int64_t[::1] layer_evictions,
) noexcept nogil:
    cdef Py_ssize_t E = b.n_experts, K = ids.shape[2], n_total = b.n_layers * b.n_experts
    cdef Py_ssize_t s, layer, t, k, x, i, j, n_missed, n_take, n_empty, n_victims
    cdef Py_ssize_t n_empty_used = 0
    cdef Py_ssize_t row, victim, slot
    cdef int32_t old
    cdef int64_t stamp = 0
    for s in range(step_lo, step_hi):
        row = s - step_lo
        for layer in range(b.n_layers):
            stamp += 1
            n_missed = _lookup_step(ids, step_offsets[s], step_offsets[s + 1], layer, E, b.res,
                                    b.heat, seen, stamp, missed, &out_hits[row, layer],
                                    &out_dhits[row, layer])
            out_dmisses[row, layer] = <int32_t>n_missed
            # observe: a hit marks its expert visited.
            for t in range(step_offsets[s], step_offsets[s + 1]):
                for k in range(K):
                    x = layer * E + ids[t, layer, k]
                    if b.res[x] >= 0:
                        visited[x] = 1
            # admit: the misses, hottest first in the books' heat order.
            for i in range(1, n_missed):
                old = missed[i]
                j = i - 1
                while j >= 0 and _hotter(b, layer * E + old, layer * E + missed[j]):
                    missed[j + 1] = missed[j]
                    j -= 1
                missed[j + 1] = old
            n_take = n_missed if n_missed < max_admits else max_admits
            n_empty = empties.shape[0] - n_empty_used
            if n_empty > n_take:
                n_empty = n_take
            n_victims = _sieve_victims(q, b.owner, visited, taken, n_take - n_empty, victims)
            for i in range(n_empty + n_victims):
                x = layer * E + missed[i]
                if i < n_empty:
                    slot = empties[n_empty_used]
                    n_empty_used += 1
                else:
                    slot = victims[i - n_empty]
                    victim = b.owner[slot]
                    b.res[victim] = -1
                    layer_evictions[victim // E] += 1
                    _unlink(q, slot)
                    taken[slot] = 0
                inserted[x] = next_insert[0]
                next_insert[0] += 1
                visited[x] = 0
                b.res[x] = <int32_t>slot
                b.owner[slot] = <int32_t>x
                layer_admits[layer] += 1
                out_admits[row, layer] += 1
                # The newest key: it joins at the new end, after the call's victims left.
                q.key[slot] = (inserted[x] + 1) * n_total + (n_total - 1 - b.rank[x])
                placed[i] = <int32_t>slot
            for i in range(n_empty + n_victims):
                _append(q, placed[i])


def replay_sieve(
    const int32_t[:, :, ::1] ids,
    const int64_t[::1] step_offsets,
    Py_ssize_t step_lo,
    Py_ssize_t step_hi,
    int32_t[:, ::1] res,
    int32_t[::1] owner,
    double[:, ::1] heat,
    const int32_t[:, ::1] rank,
    const uint8_t[::1] backed,
    Py_ssize_t top,
    uint8_t[:, ::1] visited,
    int64_t[:, ::1] inserted,
    int64_t next_insert,
    int64_t hand,
    Py_ssize_t max_admits,
    out_hits_a,
    out_distinct_hits_a,
    out_distinct_misses_a,
    out_admits_a,
    int64_t[::1] layer_admits,
    int64_t[::1] layer_evictions,
):
    cdef Py_ssize_t L = res.shape[0], E = res.shape[1], n_slots = owner.shape[0]
    cdef Py_ssize_t n_steps = step_offsets.shape[0] - 1, n_rows = step_hi - step_lo, i
    _need(ids.shape[1] == L and ids.shape[2] <= E, "ids must be [N, L, K] with K <= E")
    _need(0 <= step_lo <= step_hi <= n_steps, f"steps [{step_lo}, {step_hi}) outside the trace")
    _need(step_offsets[n_steps] == ids.shape[0], "step_offsets must end at the tokens")
    _need(heat.shape[0] == L and heat.shape[1] == E, f"heat must be [L, E] = [{L}, {E}]")
    _need(rank.shape[0] == L and rank.shape[1] == E, f"rank must be [L, E] = [{L}, {E}]")
    _need(visited.shape[0] == L and visited.shape[1] == E, "visited must be [L, E]")
    _need(inserted.shape[0] == L and inserted.shape[1] == E, "inserted must be [L, E]")
    _need(backed.shape[0] == n_slots and 0 <= top <= n_slots, "backed must be [n_slots]")
    _need(max_admits >= 0, "max_admits must be >= 0")
    for out in (out_hits_a, out_distinct_hits_a, out_distinct_misses_a, out_admits_a):
        _need(np.shape(out) == (n_rows, L), f"outputs must be [{n_rows}, {L}]")
    _need(layer_admits.shape[0] == L and layer_evictions.shape[0] == L, "per-layer outputs [L]")
    cdef int32_t[:, ::1] out_hits = out_hits_a, out_distinct_hits = out_distinct_hits_a
    cdef int32_t[:, ::1] out_distinct_misses = out_distinct_misses_a, out_admits = out_admits_a
    owner_a = np.asarray(owner)
    res_a = np.asarray(res).reshape(-1)
    held = np.flatnonzero(owner_a >= 0)
    _need(bool(((owner_a < L * E) & (owner_a >= -1)).all()), "owner holds an id out of range")
    _need(bool((res_a[owner_a[held]] == held).all()) and
          int((res_a >= 0).sum()) == held.size, "res and owner are not inverse")
    # The queue: the residents below top, oldest key first; the hand on the first key >= hand.
    n_total = L * E
    queued = held[held < top]
    flat = owner_a[queued].astype(np.int64)
    keys = ((np.asarray(inserted).reshape(-1)[flat] + 1) * n_total
            + (n_total - 1 - np.asarray(rank).reshape(-1)[flat]))
    order = np.argsort(keys, kind="stable")
    queued, keys = queued[order], keys[order]
    start = int(np.searchsorted(keys, hand))
    chain = np.concatenate([[n_slots], queued, [n_slots]]).astype(np.int32)
    prev = np.empty(n_slots + 1, np.int32)
    nxt = np.empty(n_slots + 1, np.int32)
    links = chain.size - 1
    nxt[chain[:links]] = chain[1:]
    prev[chain[1:]] = chain[:links]
    empties = np.flatnonzero((owner_a[:top] < 0) & (np.asarray(backed)[:top] != 0)).astype(
        np.int32)
    missed = np.empty(E, np.int32)
    seen = np.zeros(E, np.int64)
    placed = np.empty(E, np.int32)
    victims = np.empty(E, np.int32)
    taken = np.zeros(n_slots + 1, np.uint8)
    node_keys = np.zeros(max(n_slots, 1), np.int64)
    node_keys[queued] = keys
    cdef int32_t[::1] prev_v = prev, next_v = nxt, empties_v = empties, missed_v = missed
    cdef int32_t[::1] placed_v = placed, victims_v = victims
    cdef uint8_t[::1] taken_v = taken
    cdef int64_t[::1] seen_v = seen, keys_v = node_keys
    cdef Queue q
    q.prev, q.next, q.key = &prev_v[0], &next_v[0], &keys_v[0]
    q.sentinel, q.n_listed = n_slots, queued.size
    q.hand_key = hand
    q.hand = queued[start] if hand >= 0 and start < queued.size else -1
    cdef Books b
    b.res = &res[0, 0]
    b.owner = &owner[0] if n_slots else NULL
    b.heat = &heat[0, 0]
    b.rank = &rank[0, 0]
    b.n_layers, b.n_experts, b.top = L, E, top
    cdef int64_t next_insert_v = next_insert
    with nogil:
        _replay_sieve(ids, step_offsets, step_lo, step_hi, &b, &q, &visited[0, 0],
                      &inserted[0, 0], &next_insert_v, max_admits, empties_v, missed_v, seen_v,
                      placed_v, victims_v, &taken_v[0], out_hits, out_distinct_hits, out_distinct_misses, out_admits,
                      layer_admits, layer_evictions)
    return next_insert_v, q.hand_key
