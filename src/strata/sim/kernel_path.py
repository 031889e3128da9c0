"""The `kernel` path: a span of steps of a policy that declares a simulator kernel, in Cython.

A policy class declares `replay_kernel` (`strata.policies.base.Policy`): its `observe` and
`admit` follow exactly the rule of one of `REPLAY_KERNELS` (`lru`, `lfu`, `sieve`). Before a
span the policy hands its state out (`kernel_state`); the kernel (`strata.sim._kernels`) replays
the span on copies of the state and of the books, and the state goes back to the policy
(`set_kernel_state`), so that the K/V events between spans ask the policy object itself. A
state of the wrong kind, dtype or shape, or a raise, is a `PolicyError` naming the policy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from strata.books import CheckedPolicy
from strata.books.checked import POLICY_FAULTS
from strata.policies import Policy, PolicyError
from strata.policies.base import REPLAY_KERNELS, KernelState, LfuState, LruState, SieveState
from strata.sim import _kernels

# Each state's [L, E] arrays and their dtypes, and its int fields.
_ARRAYS: dict[type, dict[str, type]] = {
    LruState: {"last_use": np.int64},
    LfuState: {"counts": np.float64},
    SieveState: {"visited": np.bool_, "inserted": np.int64},
}
_INTS: dict[type, tuple[str, ...]] = {
    LruState: ("clock", "max_admits"),
    LfuState: ("max_admits",),
    SieveState: ("next_insert", "hand", "max_admits"),
}


def declared_kernel(policy: Policy, name: str) -> str | None:
    """The kernel `policy`'s own class declares (`replay_kernel` in its class body; a subclass
    that does not declare it again has none), or None. PolicyError for an unknown kernel."""
    kernel = vars(type(policy)).get("replay_kernel")
    if kernel is not None and kernel not in REPLAY_KERNELS:
        raise PolicyError(name, "replay_kernel", kernel,
                          f"no such kernel; the simulator has {', '.join(REPLAY_KERNELS)}")
    return kernel


def _ask(name: str, method: str, call: Callable[[], Any]) -> Any:
    try:
        return call()
    except PolicyError:
        raise
    except POLICY_FAULTS as exc:
        raise PolicyError(name, method, exc, f"raised {type(exc).__name__}: {exc}") from exc


def checked_state(state: Any, kernel: str, shape: tuple[int, int], name: str) -> KernelState:
    """`state` as `kernel_state` answered it, checked, its arrays copied (C-contiguous) for the
    kernel to write into; PolicyError naming `name` for a wrong kind, dtype, shape or value."""
    want = REPLAY_KERNELS[kernel]
    if type(state) is not want:
        raise PolicyError(name, "kernel_state", state, f"want a {want.__name__}")
    copies = {}
    for field, dtype in _ARRAYS[want].items():
        array = getattr(state, field)
        if not isinstance(array, np.ndarray) or array.dtype != dtype or array.shape != shape:
            raise PolicyError(name, "kernel_state", array,
                              f"{field} must be a numpy {np.dtype(dtype)} [L, E] = {list(shape)}")
        copies[field] = np.array(array, order="C")
    for field in _INTS[want]:
        value = getattr(state, field)
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise PolicyError(name, "kernel_state", value, f"{field} must be an int")
        copies[field] = int(value)
    if copies["max_admits"] < 0:
        raise PolicyError(name, "kernel_state", state.max_admits, "max_admits must be >= 0")
    if isinstance(state, LfuState) and not (
            isinstance(state.decay, float | int) and 0.0 < state.decay <= 1.0):
        raise PolicyError(name, "kernel_state", state.decay, "decay must be in (0, 1]")
    return dataclasses.replace(state, **copies)


def run_kernel(state: KernelState, span: tuple, books: tuple, outs: tuple) -> KernelState:
    """Replay a span in the kernel of `state` (a checked copy), with the span, the books'
    copies and the outputs as `strata.sim._kernels` takes them; the state it advanced."""
    if isinstance(state, SieveState):
        next_insert, hand = _kernels.replay_sieve(
            *span, *books, state.visited.view(np.uint8), state.inserted, state.next_insert,
            state.hand, state.max_admits, *outs)
        return dataclasses.replace(state, next_insert=next_insert, hand=hand)
    if isinstance(state, LruState):
        score = state.last_use.astype(np.float64)
        clock = _kernels.replay_scored(_kernels.MODE_LRU, *span, *books, score, state.last_use,
                                       state.clock, 1.0, state.max_admits, *outs)
        return dataclasses.replace(state, clock=clock)
    no_last_use = np.empty((0, 0), np.int64)
    _kernels.replay_scored(_kernels.MODE_LFU, *span, *books, state.counts, no_last_use, 0,
                           state.decay, state.max_admits, *outs)
    return state


def kernel_span(checked: CheckedPolicy, kernel: str, span: tuple, books: tuple, outs: tuple,
                shape: tuple[int, int]) -> None:
    """One span on the kernel path: the policy's state out, replayed, and back to the policy."""
    policy, name = checked.policy, checked.name
    given = _ask(name, "kernel_state", lambda: policy.kernel_state(*shape))
    state = run_kernel(checked_state(given, kernel, shape, name), span, books, outs)
    _ask(name, "set_kernel_state", lambda: policy.set_kernel_state(state))
