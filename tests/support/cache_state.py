"""Checks shared by the tests of the expert cache's changes: two snapshots of state are equal,
and every resident slot holds its expert's blob.

    from support.cache_state import assert_resident_blobs, assert_same_state
"""

from __future__ import annotations

import numpy as np
import torch

from strata import _vmm


def assert_same_state(a: dict, b: dict) -> None:
    """Two snapshots (dicts of lists of tensors, tensors, arrays or plain values) are equal,
    key by key; the failing key is named."""
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, list):
            assert all(torch.equal(p, q) for p, q in zip(x, y, strict=True)), key
        elif isinstance(x, torch.Tensor):
            assert torch.equal(x, y), key
        elif isinstance(x, np.ndarray):
            assert np.array_equal(x, y), key
        else:
            assert x == y, key


def assert_resident_blobs(cached) -> None:
    """Every resident slot of `cached` (a CachedExperts) holds its expert's blob, the books
    validate, and the mirror is the books."""
    table, slots = cached.table, cached.arena.slots_view()
    table.validate()
    for slot in np.flatnonzero(table.owner >= 0):
        layer, expert = table.expert_in(int(slot))
        blob = cached.store.blob(layer, expert)
        assert torch.equal(slots[slot, : blob.numel()], blob), (slot, layer, expert)
    assert np.array_equal(cached.mirror.numpy(), table.res)


def faults_until_done(backend, op: str, attempt, state, failure, check=None) -> int:
    """Inject a fault at `backend`'s 1st `op`, then its 2nd, ... and call `attempt()` each
    time until it succeeds (returns something true), clearing the fault then. After each
    failed attempt, `failure()` (the message recorded) names the injected fault, `state()` is
    what it was before the attempt and `check()` (if given) holds. Returns how many attempts
    failed."""
    nth = 1
    while True:
        before = state()
        backend.inject_fault(op, nth)
        if attempt():
            backend.clear_faults()
            return nth - 1
        assert f"injected fault in {op}" in failure()
        assert_same_state(state(), before)
        if check is not None:
            check()
        nth += 1


def raising_faults_until_done(backend, op: str, attempt, state, check=None, prepare=None):
    """`faults_until_done` for an `attempt()` that raises the injected `VmmError` (the K/V's
    own calls): after each failure `state()` is what it was before and `check()` (if given)
    holds; `prepare()` (if given) runs before each attempt, before the state is taken and the
    fault injected. Returns (how many attempts failed, what the successful one returned)."""
    nth = 1
    while True:
        if prepare is not None:
            prepare()
        before = state()
        backend.inject_fault(op, nth)
        try:
            result = attempt()
        except _vmm.VmmError as err:
            assert f"injected fault in {op}" in str(err)
            assert_same_state(state(), before)
            if check is not None:
                check()
            nth += 1
            continue
        backend.clear_faults()
        return nth - 1, result
