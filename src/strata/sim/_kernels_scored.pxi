# Included by _kernels.pyx: the replay of `lru` and `lfu`.

# The adaptive built-ins, `lru` and `lfu`, step by step
#
# Their rule (strata.policies.base.LruState and LfuState; the built-ins' ScoredCache in
# strata.policies.builtin._adaptive): each expert has a score (lru: the observe call it was
# last routed in; lfu: decayed routing counts); per layer step the
# misses, best score first (then hotter in the books' heat order), are paired with the backed
# slots below `top`, empty ones first (ascending), then residents of the lowest score (then
# colder in heat order); lfu admits a pair only while the miss scores above the victim.
# Scores and heat change only in the layer stepped, so the coldest resident of each layer is
# kept (`layer_min`, found among the layer's residents below top, `members`) and the coldest
# overall is the coldest of those L.

cdef struct Books:
    int32_t *res          # [L * E] slot or -1
    int32_t *owner        # [n_slots] flat id or -1
    double *heat          # [L * E]
    const int32_t *rank   # [L * E]
    double *score         # [L * E]
    int64_t *last_use     # [L * E] (lru) or NULL
    uint8_t *taken        # [n_slots]: a victim of this admit call
    int32_t *layer_min    # [L]: slot of the coldest eligible resident of each layer, or -1
    int32_t *members      # [L * E]: layer l's residents below top, flat ids, at [l * E, ...)
    int32_t *n_members    # [L]
    int32_t *member_at    # [L * E]: each expert's index in its layer's members, or -1
    Py_ssize_t n_layers, n_experts, top


cdef inline void _join(Books *b, Py_ssize_t x) noexcept nogil:
    cdef Py_ssize_t layer = x // b.n_experts
    b.member_at[x] = b.n_members[layer]
    b.members[layer * b.n_experts + b.n_members[layer]] = <int32_t>x
    b.n_members[layer] += 1


cdef inline void _leave(Books *b, Py_ssize_t x) noexcept nogil:
    """Swap the last member into x's place."""
    cdef Py_ssize_t layer = x // b.n_experts, i = b.member_at[x]
    cdef int32_t last
    b.n_members[layer] -= 1
    last = b.members[layer * b.n_experts + b.n_members[layer]]
    b.members[layer * b.n_experts + i] = last
    b.member_at[last] = <int32_t>i
    b.member_at[x] = -1


cdef inline bint _colder(Books *b, Py_ssize_t x, Py_ssize_t y) noexcept nogil:
    """Flat expert x is colder than y: lower score, then lower heat, then higher rank."""
    if b.score[x] != b.score[y]:
        return b.score[x] < b.score[y]
    if b.heat[x] != b.heat[y]:
        return b.heat[x] < b.heat[y]
    return b.rank[x] > b.rank[y]


cdef inline bint _better_miss(Books *b, Py_ssize_t x, Py_ssize_t y) noexcept nogil:
    """Missed expert x goes before y: higher score, then hotter (higher heat, lower rank)."""
    if b.score[x] != b.score[y]:
        return b.score[x] > b.score[y]
    if b.heat[x] != b.heat[y]:
        return b.heat[x] > b.heat[y]
    return b.rank[x] < b.rank[y]


cdef void _layer_min(Books *b, Py_ssize_t layer) noexcept nogil:
    cdef Py_ssize_t i, x, best = -1
    cdef const int32_t *members = b.members + layer * b.n_experts
    for i in range(b.n_members[layer]):
        x = members[i]
        if b.taken[b.res[x]]:
            continue
        if best < 0 or _colder(b, x, best):
            best = x
    b.layer_min[layer] = -1 if best < 0 else b.res[best]


cdef Py_ssize_t _coldest_slot(Books *b) noexcept nogil:
    cdef Py_ssize_t layer, best = -1
    cdef int32_t slot
    for layer in range(b.n_layers):
        slot = b.layer_min[layer]
        if slot >= 0 and (best < 0 or _colder(b, b.owner[slot], b.owner[best])):
            best = slot
    return best


cdef void _replay_scored(
    const int32_t[:, :, ::1] ids, const int64_t[::1] step_offsets, Py_ssize_t step_lo,
    Py_ssize_t step_hi, Books *b, int mode, int64_t *clock, double decay, Py_ssize_t max_admits,
    const int32_t[::1] empties, int32_t[::1] missed, int64_t[::1] seen, int32_t[::1] counts,
    int32_t[:, ::1] out_hits, int32_t[:, ::1] out_dhits, int32_t[:, ::1] out_dmisses,
    int32_t[:, ::1] out_admits, int64_t[::1] layer_admits, int64_t[::1] layer_evictions,
) noexcept nogil:
    cdef Py_ssize_t E = b.n_experts, L = b.n_layers, K = ids.shape[2]
    cdef Py_ssize_t s, layer, t, k, e, x, i, j, n_missed, n_take, n_empty_used = 0
    cdef Py_ssize_t victim, row
    cdef int32_t slot, old
    cdef int64_t stamp = 0
    cdef double victim_score, product
    for layer in range(L):
        _layer_min(b, layer)
    for s in range(step_lo, step_hi):
        row = s - step_lo
        for layer in range(L):
            stamp += 1
            n_missed = _lookup_step(ids, step_offsets[s], step_offsets[s + 1], layer, E, b.res,
                                    b.heat, seen, stamp, missed, &out_hits[row, layer],
                                    &out_dhits[row, layer])
            out_dmisses[row, layer] = <int32_t>n_missed
            # observe
            if mode == LRU:
                for t in range(step_offsets[s], step_offsets[s + 1]):
                    for k in range(K):
                        x = layer * E + ids[t, layer, k]
                        b.last_use[x] = clock[0]
                        b.score[x] = <double>clock[0]
                clock[0] += 1
            else:
                for e in range(E):
                    counts[e] = 0
                for t in range(step_offsets[s], step_offsets[s + 1]):
                    for k in range(K):
                        counts[ids[t, layer, k]] += 1
                for e in range(E):
                    # numpy's `row *= decay; row += counts`: two roundings, never fused
                    # (setup.py builds this module with -ffp-contract=off).
                    product = b.score[layer * E + e] * decay
                    b.score[layer * E + e] = product + <double>counts[e]
            # lru: routed experts only got hotter, so the layer's coldest stays unless it was
            # routed (lfu decays the whole row: always look again).
            slot = b.layer_min[layer]
            if mode == LFU or slot < 0 or seen[b.owner[slot] - layer * E] == stamp:
                _layer_min(b, layer)
            if n_missed == 0 or max_admits == 0:
                continue
            # admit: the misses, best first (insertion sort; at most E of them).
            for i in range(1, n_missed):
                old = missed[i]
                j = i - 1
                while j >= 0 and _better_miss(b, layer * E + old, layer * E + missed[j]):
                    missed[j + 1] = missed[j]
                    j -= 1
                missed[j + 1] = old
            n_take = n_missed if n_missed < max_admits else max_admits
            for i in range(n_take):
                x = layer * E + missed[i]
                if n_empty_used < empties.shape[0]:
                    slot = empties[n_empty_used]
                    n_empty_used += 1
                    victim = -1
                else:
                    slot = <int32_t>_coldest_slot(b)
                    if slot < 0:
                        break
                    victim = b.owner[slot]
                    victim_score = b.score[victim]
                    if mode == LFU and not (b.score[x] > victim_score):
                        break
                    b.taken[slot] = 1
                    _layer_min(b, victim // E)
                b.taken[slot] = 1  # what this call admits is no victim of it
                b.res[x] = slot
                b.owner[slot] = <int32_t>x
                _join(b, x)
                layer_admits[layer] += 1
                out_admits[row, layer] += 1
                if victim >= 0:
                    b.res[victim] = -1
                    _leave(b, victim)
                    layer_evictions[victim // E] += 1
            for i in range(n_take):
                slot = b.res[layer * E + missed[i]]
                if slot >= 0:
                    b.taken[slot] = 0
            # lru: the admitted score this step's clock, the most there is; they can be the
            # coldest of their layer only if its coldest was routed in this step too.
            slot = b.layer_min[layer]
            if mode == LFU or slot < 0 or b.score[b.owner[slot]] >= <double>(clock[0] - 1):
                _layer_min(b, layer)


def replay_scored(
    int mode,
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
    double[:, ::1] score,
    int64_t[:, ::1] last_use,
    int64_t clock,
    double decay,
    Py_ssize_t max_admits,
    out_hits_a,
    out_distinct_hits_a,
    out_distinct_misses_a,
    out_admits_a,
    int64_t[::1] layer_admits,
    int64_t[::1] layer_evictions,
):
    cdef Py_ssize_t L = res.shape[0], E = res.shape[1], n_slots = owner.shape[0]
    cdef Py_ssize_t n_steps = step_offsets.shape[0] - 1, n_rows = step_hi - step_lo
    cdef Py_ssize_t i
    _need(mode in (MODE_LRU, MODE_LFU), f"mode must be {MODE_LRU} (lru) or {MODE_LFU} (lfu)")
    _need(ids.shape[1] == L and ids.shape[2] <= E, "ids must be [N, L, K] with K <= E")
    _need(0 <= step_lo <= step_hi <= n_steps, f"steps [{step_lo}, {step_hi}) outside the trace")
    _need(step_offsets[n_steps] == ids.shape[0], "step_offsets must end at the tokens")
    _need(heat.shape[0] == L and heat.shape[1] == E, f"heat must be [L, E] = [{L}, {E}]")
    _need(rank.shape[0] == L and rank.shape[1] == E, f"rank must be [L, E] = [{L}, {E}]")
    _need(score.shape[0] == L and score.shape[1] == E, f"score must be [L, E] = [{L}, {E}]")
    if mode == MODE_LRU:
        _need(last_use.shape[0] == L and last_use.shape[1] == E, "last_use must be [L, E]")
    _need(backed.shape[0] == n_slots and 0 <= top <= n_slots, "backed must be [n_slots]")
    _need(max_admits >= 0 and 0.0 < decay <= 1.0, "max_admits >= 0 and 0 < decay <= 1")
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
    # The policy's state is only compared, never an index, so any values are safe; the
    # kernel trusts ids to be in [0, E) (Trace checks).
    empties = np.flatnonzero((owner_a[:top] < 0) & (np.asarray(backed)[:top] != 0)).astype(
        np.int32)
    missed = np.empty(E, np.int32)
    seen = np.zeros(E, np.int64)
    counts = np.empty(E, np.int32)
    layer_min = np.empty(L, np.int32)
    taken = np.zeros(n_slots, np.uint8)
    # Each layer's residents below top, as `_join` would list them.
    below_top = (res_a >= 0) & (res_a < top)
    layer_of = np.arange(L * E) // E
    member_at = np.full(L * E, -1, np.int32)
    members = np.zeros(L * E, np.int32)
    n_members = np.bincount(layer_of[below_top], minlength=L).astype(np.int32)
    flat_ids = np.flatnonzero(below_top)
    index = np.arange(flat_ids.size) - np.searchsorted(flat_ids, layer_of[flat_ids] * E)
    member_at[flat_ids] = index
    members[layer_of[flat_ids] * E + index] = flat_ids
    cdef int32_t[::1] empties_v = empties, missed_v = missed, counts_v = counts
    cdef int32_t[::1] layer_min_v = layer_min, members_v = members, n_members_v = n_members
    cdef int32_t[::1] member_at_v = member_at
    cdef uint8_t[::1] taken_v = taken
    cdef int64_t[::1] seen_v = seen
    cdef Books b
    b.res = &res[0, 0]
    b.owner = &owner[0] if n_slots else NULL
    b.heat = &heat[0, 0]
    b.rank = &rank[0, 0]
    b.score = &score[0, 0]
    b.last_use = &last_use[0, 0] if mode == MODE_LRU else NULL
    b.taken = &taken_v[0] if n_slots else NULL
    b.layer_min = &layer_min_v[0]
    b.members, b.n_members, b.member_at = &members_v[0], &n_members_v[0], &member_at_v[0]
    b.n_layers, b.n_experts, b.top = L, E, top
    cdef int64_t clock_v = clock
    with nogil:
        _replay_scored(ids, step_offsets, step_lo, step_hi, &b, mode, &clock_v, decay,
                       max_admits, empties_v, missed_v, seen_v, counts_v, out_hits,
                       out_distinct_hits, out_distinct_misses, out_admits, layer_admits,
                       layer_evictions)
    return clock_v
