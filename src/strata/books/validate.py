"""The checker every policy answer passes before anything acts on it.

The engine and the simulator both call these (through `CheckedPolicy`, or `validate_decision`
directly). Each returns the answer normalised to int64 numpy arrays, or raises `PolicyError`
naming the policy, the decision and the bad value. Nothing here changes the books.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any

import numpy as np

from strata.policies.errors import PolicyError
from strata.policies.kv_params import KvContext, KvParams
from strata.policies.view import ResidencyView

if TYPE_CHECKING:
    from strata._residency import ResidencyTable

PAIRS = "a list of (src_slot, dst_slot) pairs"
TRIPLES = "a list of (slot, layer, expert) triples"


def _int_array(policy: str, method: str, decision: Any, ncols: int | None, what: str):
    """The answer as int64 [n] (ncols None) or [n, ncols], or PolicyError."""
    empty = np.empty((0,) if ncols is None else (0, ncols), np.int64)
    if decision is None:
        raise PolicyError(policy, method, decision, f"returned None; want {what}")
    try:
        array = np.asarray(decision)
    except Exception as exc:  # a policy's own sequence type may raise anything while read
        raise PolicyError(policy, method, decision,
                          f"want {what} ({type(exc).__name__}: {exc})") from None
    if array.size == 0:
        return empty
    if array.dtype.kind not in "iu":
        raise PolicyError(policy, method, decision, f"want {what} of integers, not {array.dtype}")
    shape_ok = array.ndim == 1 if ncols is None else array.ndim == 2 and array.shape[1] == ncols
    if not shape_ok:
        raise PolicyError(policy, method, decision, f"want {what}, got shape {array.shape}")
    return array.astype(np.int64)


def _fail_first(policy: str, method: str, bad: np.ndarray, values, reason) -> None:
    """PolicyError for the first True in `bad`: reason(value) says what is wrong with it."""
    if bad.any():
        value = values[int(np.argmax(bad))]
        value = tuple(int(v) for v in value) if np.ndim(value) else int(value)
        raise PolicyError(policy, method, value, reason(value))


def _twice(values: np.ndarray) -> np.ndarray:
    """bool [n]: entries equal to an earlier one."""
    ordered = np.sort(values)
    if not (ordered[1:] == ordered[:-1]).any():  # the common case, cheaply
        return np.zeros(values.size, bool)
    _, first = np.unique(values, return_index=True)
    seen = np.ones(values.size, bool)
    seen[first] = False
    return seen


def _check_slots_exist(policy: str, method: str, view: ResidencyView, slots, role: str) -> None:
    last = view.n_slots - 1
    _fail_first(
        policy, method, (slots < 0) | (slots > last), slots,
        lambda s: f"{role} slot {s}, which does not exist (slots are 0..{last})",
    )


def _check_experts(policy: str, method: str, view: ResidencyView, triples: np.ndarray) -> None:
    """Layer and expert in range, not resident, none twice."""
    layers, experts = triples[:, 1], triples[:, 2]
    n_layers, n_experts = view.n_layers, view.n_experts
    _fail_first(
        policy, method,
        (layers < 0) | (layers >= n_layers) | (experts < 0) | (experts >= n_experts),
        triples[:, 1:],
        lambda e: f"expert {e} does not exist ({n_layers} layers of {n_experts} experts)",
    )
    where = view.res[layers, experts]
    res = view.res
    _fail_first(
        policy, method, where >= 0, triples[:, 1:],
        lambda e: f"expert {e} is already resident, in slot {int(res[e[0], e[1]])}",
    )
    _fail_first(
        policy, method, _twice(layers * n_experts + experts), triples[:, 1:],
        lambda e: f"names expert {e} twice",
    )


def check_give_up(view: ResidencyView, policy: str, n_chunks: int, decision: Any):
    """(slots, chunks): the given-up slots, ascending, and the chunks they free (int64, int32)."""
    method = "give_up"
    slots = _int_array(policy, method, decision, None, "a list of slots")
    _check_slots_exist(policy, method, view, slots, "gives up")
    _fail_first(policy, method, _twice(slots), slots, lambda s: f"names slot {s} twice")
    floor, top, n_slots = view.floor, view.top, view.n_slots
    _fail_first(
        policy, method, slots < floor, slots,
        lambda s: f"slot {s} is below the floor {floor}: slots [0, {floor}) are never given up",
    )
    _fail_first(
        policy, method, slots >= top, slots,
        lambda s: f"slot {s} is in the loan region [{top}, {n_slots}), which is never given up",
    )
    _fail_first(
        policy, method, ~view.backed[slots], slots,
        lambda s: f"slot {s} has no memory left to give (not backed: given up already)",
    )
    usable_after = int(view.backed.sum()) - slots.size
    if usable_after < floor:
        raise PolicyError(
            policy, method, slots.tolist(),
            f"would leave {usable_after} usable slots, fewer than the floor {floor}",
        )
    slots = np.sort(slots)
    chunks = view.chunks_freed_by(slots)
    if chunks.size < n_chunks:
        raise PolicyError(
            policy, method, slots.tolist(),
            f"frees {chunks.size} chunks of the {n_chunks} needed (a chunk shared with a "
            "slot that is not given up stays mapped)",
        )
    return slots, chunks


def check_relocate(view: ResidencyView, policy: str, slots: np.ndarray, decision: Any):
    """int64 [n, 2] (src, dst): each src given up and holding an expert, each dst backed,
    kept and named once."""
    method = "relocate"
    moves = _int_array(policy, method, decision, 2, PAIRS)
    if moves.size == 0:
        return moves
    src, dst = moves[:, 0], moves[:, 1]
    _check_slots_exist(policy, method, view, src, "moves from")
    _check_slots_exist(policy, method, view, dst, "moves into")
    given = np.zeros(view.n_slots, bool)
    given[np.asarray(slots, dtype=np.int64)] = True
    _fail_first(policy, method, ~given[src], moves,
                lambda m: f"moves from slot {m[0]}, which is not given up")
    _fail_first(policy, method, view.owner[src] < 0, moves,
                lambda m: f"moves from slot {m[0]}, which holds no expert")
    _fail_first(policy, method, _twice(src), moves, lambda m: f"moves slot {m[0]} twice")
    _fail_first(policy, method, given[dst], moves,
                lambda m: f"moves into slot {m[1]}, which is given up too")
    _fail_first(
        policy, method, ~view.backed[dst], moves,
        lambda m: f"moves into slot {m[1]}, which is too small: not wholly backed by memory",
    )
    _fail_first(policy, method, _twice(dst), moves,
                lambda m: f"moves two experts into slot {m[1]}")
    return moves


def check_refill(view: ResidencyView, policy: str, free_slots: np.ndarray, decision: Any):
    """int64 [n, 3] (slot, layer, expert): offered slots, absent experts, nothing twice."""
    method = "refill"
    triples = _int_array(policy, method, decision, 3, TRIPLES)
    if triples.size == 0:
        return triples
    slots = triples[:, 0]
    _check_slots_exist(policy, method, view, slots, "fills")
    offered = np.zeros(view.n_slots, bool)
    offered[np.asarray(free_slots, dtype=np.int64)] = True
    _fail_first(
        policy, method, ~offered[slots], triples,
        lambda t: f"fills slot {t[0]}, which was not offered (free slots: "
        f"{np.asarray(free_slots).tolist()})",
    )
    _fail_first(policy, method, _twice(slots), triples, lambda t: f"fills slot {t[0]} twice")
    _check_experts(policy, method, view, triples)
    return triples


def check_admit(
    view: ResidencyView, policy: str, layer: int, missed_experts: np.ndarray, decision: Any
):
    """int64 [n, 3] (slot, layer, expert): backed slots below top, missed experts of `layer`."""
    method = "admit"
    triples = _int_array(policy, method, decision, 3, TRIPLES)
    if triples.size == 0:
        return triples
    slots = triples[:, 0]
    top, n_slots = view.top, view.n_slots
    _check_slots_exist(policy, method, view, slots, "admits into")
    _fail_first(policy, method, _twice(slots), triples, lambda t: f"admits into slot {t[0]} twice")
    _fail_first(
        policy, method, slots >= top, triples,
        lambda t: f"admits into slot {t[0]}, in the loan region [{top}, {n_slots})",
    )
    _fail_first(policy, method, ~view.backed[slots], triples,
                lambda t: f"admits into slot {t[0]}, which is not backed by memory")
    _fail_first(policy, method, triples[:, 1] != layer, triples,
                lambda t: f"admits an expert of layer {t[1]} when asked about layer {layer}")
    _check_experts(policy, method, view, triples)
    missed = np.asarray(missed_experts, dtype=np.int64)
    _fail_first(
        policy, method, ~(triples[:, 2, None] == missed[None, :]).any(axis=1), triples,
        lambda t: f"admits expert {t[1:]}, which was not missed (missed: {missed.tolist()})",
    )
    return triples


# KvParams' fields and the least each may be. The dataclass checks them when it is made, but a
# policy can force a field past that (object.__setattr__), so the checker reads each again.
KV_FIELDS = (("init_cells", 1), ("step_cells", 1), ("floor_slots", 0))


def _kv_field(policy: str, decision: Any, field: str, lowest: int) -> int:
    try:
        value = getattr(decision, field)
    except Exception as exc:
        raise PolicyError(policy, "kv_params", decision,
                          f"{field} cannot be read ({type(exc).__name__}: {exc})") from None
    # A plain int, whatever int subclass the policy used (its own comparisons are not asked).
    number = None if isinstance(value, bool) or not isinstance(value, int) else operator.index(
        value)
    if number is None or number < lowest:
        raise PolicyError(policy, "kv_params", decision,
                          f"{field} must be an integer >= {lowest}, got {value!r}")
    return number


def check_kv_params(ctx: KvContext, policy: str, decision: Any) -> KvParams:
    """A new KvParams of plain ints, every field checked for type and range, cells in whole
    chunks, `init_cells` within the window and `floor_slots` at most `top`."""
    method = "kv_params"
    if not isinstance(decision, KvParams):
        raise PolicyError(policy, method, decision, "want a KvParams")
    init, step, floor = (_kv_field(policy, decision, field, lowest)
                         for field, lowest in KV_FIELDS)
    per_chunk = ctx.cells_per_chunk
    for field, cells in (("init_cells", init), ("step_cells", step)):
        if cells % per_chunk:
            raise PolicyError(
                policy, method, decision,
                f"{field} {cells} is not whole chunks ({per_chunk} cells a chunk)",
            )
    if init > ctx.max_mapped_cells:
        raise PolicyError(policy, method, decision,
                          f"init_cells {init} is past the window "
                          f"({ctx.max_mapped_cells} cells)")
    if floor > ctx.top:
        raise PolicyError(policy, method, decision,
                          f"floor_slots {floor} is above top {ctx.top}")
    # A copy: the policy keeps its own object, which it could still change.
    return KvParams(init_cells=init, step_cells=step, floor_slots=floor)


def check_kv_target(policy: str, need_cells: int, decision: Any) -> int:
    method = "kv_target"
    if isinstance(decision, bool) or not isinstance(decision, int | np.integer):
        raise PolicyError(policy, method, decision, "want an int number of cells")
    cells = operator.index(decision)  # a plain int, whatever int type the policy used
    if cells < need_cells:
        raise PolicyError(policy, method, cells,
                          f"{cells} cells do not cover the {need_cells} needed")
    return cells


_CHECKS = {
    "give_up": lambda view, policy, decision, *, n_chunks: check_give_up(
        view, policy, n_chunks, decision),
    "relocate": lambda view, policy, decision, *, slots: check_relocate(
        view, policy, slots, decision),
    "refill": lambda view, policy, decision, *, free_slots: check_refill(
        view, policy, free_slots, decision),
    "admit": lambda view, policy, decision, *, layer, missed_experts: check_admit(
        view, policy, layer, missed_experts, decision),
}


def validate_decision(
    table: ResidencyTable, policy: str, method: str, decision: Any, **arguments: Any
) -> Any:
    """Check one answer about `table`: `method` is a decision name, `arguments` its own
    arguments beside the view (`n_chunks`, `slots`, `free_slots`, `layer` and
    `missed_experts`). Returns the normalised answer; raises PolicyError."""
    if method not in _CHECKS:
        raise ValueError(f"no check for decision {method!r}; checked: {', '.join(_CHECKS)}")
    return _CHECKS[method](ResidencyView(table), policy, decision, **arguments)
