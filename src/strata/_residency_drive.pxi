# Included by _residency.pyx, after _residency_step.pxi: the span drivers. Each replays steps
# [s0, s1) of a trace layer by layer in the engine's order (look up, record heat, observe,
# admit the distinct misses ascending, check, apply, notify) on the live books:
# - `drive_rule_span`: a compiled `CacheRule`, its cdef methods called directly (the
#   simulator's `kernel` path for a plugin's rule);
# - `drive_policy_span`: any Python policy, its `observe` and `admit` called once per layer step
#   with read-only arrays (the simulator's `generic` path).
# Spec in _residency.pyi. `asker` is the `strata.books.CheckedPolicy` the policy is asked
# through: it turns what a policy raises into its `PolicyError` (`fault`), judges the answers
# the fast check cannot (`admit_slow`, which raises for a bad one) and tells a listening policy
# of the books' changes (`tell`).


cdef _check_span(ResidencyTable t, cnp.ndarray ids_by_layer, const int64_t[::1] offsets,
                 Py_ssize_t s0, Py_ssize_t s1, tuple outs):
    if (cnp.PyArray_TYPE(ids_by_layer) != cnp.NPY_INT32 or ids_by_layer.ndim != 3
            or not cnp.PyArray_IS_C_CONTIGUOUS(ids_by_layer)
            or ids_by_layer.shape[0] != t.n_layers):
        raise ValueError(f"ids_by_layer must be C-contiguous int32 [L={t.n_layers}, N, K]")
    if not 0 <= s0 <= s1 < offsets.shape[0] or offsets[offsets.shape[0] - 1] \
            != ids_by_layer.shape[1]:
        raise ValueError(f"steps [{s0}, {s1}) are not steps of offsets ending at the tokens")
    for out in outs[:4]:
        if out.shape != (s1 - s0, t.n_layers):
            raise ValueError(f"the per-step outputs must be [{s1 - s0}, {t.n_layers}]")
    for out in outs[4:]:
        if out.shape != (t.n_layers,):
            raise ValueError(f"the per-layer outputs must be [{t.n_layers}]")


cdef void _count_step(Py_ssize_t row, Py_ssize_t layer, int64_t h, Py_ssize_t dh,
                      Py_ssize_t m, int32_t[:, ::1] hits, int32_t[:, ::1] distinct_hits,
                      int32_t[:, ::1] distinct_misses) noexcept:
    hits[row, layer] = <int32_t>h
    distinct_hits[row, layer] = <int32_t>dh
    distinct_misses[row, layer] = <int32_t>m


cdef Py_ssize_t _split(ResidencyTable t, Py_ssize_t layer, _Scratch sc, Py_ssize_t nd) noexcept:
    """The missed among the step's distinct experts into sc.missed, ascending; returns how
    many. (Residency is as at the lookup: nothing has changed the books since.)"""
    cdef Py_ssize_t j, m = 0
    for j in range(nd):
        if t._res[layer, sc.distinct[j]] < 0:
            sc.missed[m] = sc.distinct[j]
            m += 1
    return m


cdef cnp.ndarray _rows(ResidencyTable t, Py_ssize_t layer, _Scratch sc, Py_ssize_t n,
                       bint evicted):
    """int64 [n, 3] (slot, layer, expert) of the step's placements, or of its evicted."""
    out = np.empty((n, 3), np.int64)
    cdef int64_t[:, ::1] ov = out
    cdef Py_ssize_t j
    for j in range(n):
        if evicted:
            ov[j, 0], ov[j, 1], ov[j, 2] = sc.ev_slot[j], sc.ev_flat[j] // t.n_experts, \
                sc.ev_flat[j] % t.n_experts
        else:
            ov[j, 0], ov[j, 1], ov[j, 2] = sc.pl_slot[j], layer, sc.pl_expert[j]
    return out


cdef cnp.ndarray _missed_array(_Scratch sc, Py_ssize_t m):
    cdef cnp.npy_intp dim = m
    cdef cnp.ndarray a = cnp.PyArray_EMPTY(1, &dim, cnp.NPY_INT32, 0)
    cdef int32_t* p = <int32_t*>cnp.PyArray_DATA(a)
    cdef Py_ssize_t j
    for j in range(m):
        p[j] = sc.missed[j]
    return _frozen(a)


def drive_rule_span(CacheRule rule not None, ResidencyView view not None,
                    cnp.ndarray ids_by_layer not None, const int64_t[::1] step_offsets,
                    Py_ssize_t s0, Py_ssize_t s1, int32_t[:, ::1] out_hits,
                    int32_t[:, ::1] out_distinct_hits, int32_t[:, ::1] out_distinct_misses,
                    int32_t[:, ::1] out_admits, int64_t[::1] layer_admits,
                    int64_t[::1] layer_evictions, reject):
    cdef ResidencyTable t = view._t
    _check_span(t, ids_by_layer, step_offsets, s0, s1, (
        out_hits, out_distinct_hits, out_distinct_misses, out_admits, layer_admits,
        layer_evictions))
    cdef Py_ssize_t top = view.top, L = t.n_layers, E = t.n_experts
    _bind(rule, t, top)
    cdef _Scratch sc = _Scratch(E, t.n_slots)
    cdef const int32_t* base = <const int32_t*>cnp.PyArray_DATA(ids_by_layer)
    cdef Py_ssize_t N = ids_by_layer.shape[1], K = ids_by_layer.shape[2]
    cdef Py_ssize_t s, layer, j, nd, m, na, ne, n, row
    cdef int64_t h, t0
    cdef int32_t e, slot, c
    for s in range(s0, s1):
        t0, n, row = step_offsets[s], (step_offsets[s + 1] - step_offsets[s]) * K, s - s0
        for layer in range(L):
            nd = _route(t, layer, base + (layer * N + t0) * K, n, sc, NULL, &h)
            m = _split(t, layer, sc, nd)
            _count_step(row, layer, h, nd - m, m, out_hits, out_distinct_hits,
                        out_distinct_misses)
            rule.step(<int32_t>layer)
            for j in range(nd):
                e = sc.distinct[j]
                c, sc.count[e] = sc.count[e], 0
                rule.routed(<int32_t>(layer * E + e), t._res[layer, e], c)
            na = 0
            for j in range(m):
                if na == rule.max_admits:
                    break
                slot = rule.admit(<int32_t>(layer * E + sc.missed[j]))
                if slot != -1:
                    sc.pl_slot[na], sc.pl_expert[na] = slot, sc.missed[j]
                    na += 1
            if na == 0:
                continue
            if not _slots_ok(t, top, sc, na):
                reject(layer, _missed_array(sc, m), _rows(t, layer, sc, na, False))
                raise AssertionError("reject() accepted an answer the books refuse")
            ne = _apply(t, layer, sc, na)
            for j in range(ne):
                layer_evictions[sc.ev_flat[j] // E] += 1
                rule.left(sc.ev_flat[j], sc.ev_slot[j], WHY_ADMIT)
            for j in range(na):
                rule.entered(<int32_t>(layer * E + sc.pl_expert[j]), sc.pl_slot[j], WHY_ADMIT)
            out_admits[row, layer] += <int32_t>na
            layer_admits[layer] += na


cdef _fault(asker, str method, exc):
    """The error to raise for what the policy raised in `method` (its PolicyError)."""
    err = asker.fault(method, exc)
    if err is exc:
        raise exc
    raise err from exc


def drive_policy_span(policy, asker, ResidencyView view not None,
                      cnp.ndarray ids_by_layer not None, const int64_t[::1] step_offsets,
                      Py_ssize_t s0, Py_ssize_t s1, bint observes, bint listens,
                      int32_t[:, ::1] out_hits, int32_t[:, ::1] out_distinct_hits,
                      int32_t[:, ::1] out_distinct_misses, int32_t[:, ::1] out_admits,
                      int64_t[::1] layer_admits, int64_t[::1] layer_evictions):
    cdef ResidencyTable t = view._t
    _check_span(t, ids_by_layer, step_offsets, s0, s1, (
        out_hits, out_distinct_hits, out_distinct_misses, out_admits, layer_admits,
        layer_evictions))
    cdef Py_ssize_t L = t.n_layers, E = t.n_experts
    cdef _Scratch sc = _Scratch(E, t.n_slots)
    cdef const int32_t* base = <const int32_t*>cnp.PyArray_DATA(ids_by_layer)
    cdef Py_ssize_t N = ids_by_layer.shape[1], K = ids_by_layer.shape[2]
    cdef Py_ssize_t s, layer, j, nd, m, na, ne, row
    cdef int64_t h, t0
    cdef cnp.npy_intp dims[2]
    cdef cnp.ndarray hit
    cdef int64_t[:, ::1] checked
    cdef const int32_t* ids
    observe, admit = policy.observe, policy.admit
    dims[1] = K
    for s in range(s0, s1):
        t0, dims[0], row = step_offsets[s], step_offsets[s + 1] - step_offsets[s], s - s0
        for layer in range(L):
            ids = base + (layer * N + t0) * K
            hit = cnp.PyArray_EMPTY(2, dims, cnp.NPY_BOOL, 0) if observes else None
            nd = _route(t, layer, ids, dims[0] * K, sc,
                        <cnp.npy_bool*>cnp.PyArray_DATA(hit) if observes else NULL, &h)
            for j in range(nd):
                sc.count[sc.distinct[j]] = 0
            m = _split(t, layer, sc, nd)
            _count_step(row, layer, h, nd - m, m, out_hits, out_distinct_hits,
                        out_distinct_misses)
            if observes:
                try:
                    observe(view, layer, _frozen_from(ids_by_layer, <void*>ids,
                                                      cnp.NPY_INT32, 2, dims), _frozen(hit))
                except (Exception, SystemExit) as exc:
                    _fault(asker, "observe", exc)
            if m == 0:
                continue
            missed = _missed_array(sc, m)
            try:
                answer = admit(view, layer, missed)
            except (Exception, SystemExit) as exc:
                _fault(asker, "admit", exc)
            _mark_missed(sc, m)
            na = _parse_admit(answer, layer, sc, m, E)
            if na < 0 or (na > 0 and not _slots_ok(t, view.top, sc, na)):
                checked = asker.admit_slow(layer, missed, answer)  # raises for a bad answer
                na = checked.shape[0]
                for j in range(na):
                    sc.pl_slot[j], sc.pl_expert[j] = <int32_t>checked[j, 0], \
                        <int32_t>checked[j, 2]
            if na == 0:
                continue
            ne = _apply(t, layer, sc, na)
            for j in range(ne):
                layer_evictions[sc.ev_flat[j] // E] += 1
            out_admits[row, layer] += <int32_t>na
            layer_admits[layer] += na
            if listens:
                if ne:
                    asker.tell("left", "admit", _rows(t, layer, sc, ne, True))
                asker.tell("entered", "admit", _rows(t, layer, sc, na, False))
