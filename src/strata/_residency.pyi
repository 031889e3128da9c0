"""The books of the expert cache: which expert sits in which slot, heat, and slot/chunk geometry.

Experts are named by (layer, expert); `owner` stores them flat, as `layer * n_experts + expert`.
The arena is `n_slots` slots of `slot_bytes`, back to back, over `n_chunks` chunks of `chunk_bytes`
(the memory layer's granularity). This module knows nothing of memory: it records which arena
chunks are mapped (`chunk_mapped`) and derives which slots are usable (`backed`).

Regions: slots [top, n_slots) are lent to the prompt path (the loan); `floor` is the fewest slots
the cache keeps. 0 <= floor <= top <= n_slots.

Heat orders experts: higher decayed routing count first, then lower profile rank (0 = hottest).
Profile ranks are a permutation of 0 .. L*E-1, so the order is total and deterministic.

Errors: every call checks all its arguments before it changes anything, and a call that raises
leaves the table exactly as it was (byte for byte). An index out of range (layer, expert, slot,
chunk, an id in an array) is an `IndexError` naming it; an array of the wrong dtype or shape, or a
request the state forbids (a double assign, an empty slot evicted, an unbacked slot filled), is a
`ValueError` naming it; a scalar that is not an integer is a `TypeError`. Id arrays may have any
integer dtype (int32 and int64 are used without a copy) and may be lists.
"""

from os import PathLike

import numpy as np

class ResidencyTable:
    """The books for `n_layers` × `n_experts` experts and `n_slots` slots of `slot_bytes`.

    At start no expert is resident, every chunk is mapped (every slot backed), heat is zero, the
    profile rank is the flat id order, `top = n_slots` (nothing lent) and `floor = 0`.

    Args:
        n_layers: MoE layers, L >= 1.
        n_experts: routed experts per layer, E >= 1; L * E must fit in int32.
        n_slots: slots in the arena, S >= 0.
        slot_bytes: bytes per slot (a blob rounded up), >= 1.
        chunk_bytes: bytes per physical chunk of the arena, >= 1.

    Raises:
        ValueError: a size below 1 (n_slots below 0), flat ids or chunk ids beyond int32, or an
            arena beyond 2**60 bytes.
    """

    def __init__(
        self, n_layers: int, n_experts: int, n_slots: int, slot_bytes: int, chunk_bytes: int
    ) -> None: ...
    # --- shape ---
    @property
    def n_layers(self) -> int:
        """L, the MoE layers."""
    @property
    def n_experts(self) -> int:
        """E, the routed experts per layer."""
    @property
    def n_slots(self) -> int:
        """S, the slots of the arena."""
    @property
    def slot_bytes(self) -> int:
        """Bytes per slot."""
    @property
    def chunk_bytes(self) -> int:
        """Bytes per arena chunk."""
    @property
    def n_chunks(self) -> int:
        """ceil(n_slots * slot_bytes / chunk_bytes)."""
    # --- read-only numpy views (write flag off) ---
    # Live views of the table's own buffers: they show later changes, are never reallocated,
    # and cannot be made writeable; their `.base` leads to nothing writeable. Each property
    # returns the same array object every time: for the engine and the simulator, never handed
    # to a policy (a policy reads `ResidencyView`'s, a new object on every read).
    @property
    def res(self) -> np.ndarray:
        """int32 [L, E]: slot of each expert, or -1."""
    @property
    def owner(self) -> np.ndarray:
        """int32 [S]: flat expert id in each slot, or -1."""
    @property
    def heat(self) -> np.ndarray:
        """float64 [L, E]: decayed routing counts."""
    @property
    def rank(self) -> np.ndarray:
        """int32 [L, E]: profile rank, 0 = hottest."""
    @property
    def chunk_mapped(self) -> np.ndarray:
        """bool [n_chunks]: arena chunks the books count as mapped (all, at start)."""
    @property
    def backed(self) -> np.ndarray:
        """bool [S]: slots whose every chunk is mapped; only these can hold an expert."""
    # --- regions ---
    @property
    def top(self) -> int:
        """The first lent slot; slots [top, n_slots) are the loan (none at start: n_slots)."""
    @property
    def floor(self) -> int:
        """The fewest slots the cache keeps (0 at start)."""
    def set_regions(self, *, top: int | None = None, floor: int | None = None) -> None:
        """Set `top`, `floor` or both; the result must keep 0 <= floor <= top <= n_slots.

        Regions are bookkeeping only: they do not restrict `assign` or `move`.
        """
    # --- residency; every call checks all its arguments before changing anything ---
    def assign(self, slot: int, layer: int, expert: int) -> None:
        """Record that `slot` now holds (layer, expert).

        Raises:
            IndexError: slot, layer or expert out of range.
            ValueError: the slot already holds an expert, is not backed, or the expert is already
                resident (in any slot).
        """
    def evict(self, slot: int) -> tuple[int, int]:
        """Empty `slot`; returns the (layer, expert) it held. ValueError if it held none."""
    def move(self, src_slot: int, dst_slot: int) -> None:
        """Move the expert in `src_slot` to `dst_slot`, which must be backed and empty."""
    def assign_many(self, slots: np.ndarray, layers: np.ndarray, experts: np.ndarray) -> None:
        """`assign` for each element of three 1-D arrays of one length, in order, or none at all.

        A duplicate slot or expert within the batch fails like the second of two `assign` calls.
        """
    def evict_many(self, slots: np.ndarray) -> np.ndarray:
        """`evict` each slot of a 1-D array, in order, or none at all (a duplicate slot fails).

        Returns:
            int32 [n, 2]: (layer, expert) of the evicted, in the order given.
        """
    def move_many(self, src_slots: np.ndarray, dst_slots: np.ndarray) -> None:
        """`move` each pair, in order, or none at all.

        The moves are sequential: a slot vacated by an earlier move may be the destination of a
        later one (a chain `a -> b, c -> a` is fine), which is also a safe order to copy blobs in.
        """
    def slot_of(self, layer: int, expert: int) -> int:
        """The slot holding (layer, expert), or -1."""
    def expert_in(self, slot: int) -> tuple[int, int] | None:
        """The (layer, expert) in `slot`, or None."""
    @property
    def n_resident(self) -> int:
        """Experts resident now (occupied slots)."""
    # --- heat ---
    def set_rank(self, rank: np.ndarray) -> None:
        """int [L, E], a permutation of 0 .. L*E-1."""
    def set_rank_from_counts(self, counts: np.ndarray) -> None:
        """Rank by counts [L, E] (int or float, finite): highest first, ties by flat id."""
    def record(self, layer: int, expert_ids: np.ndarray) -> None:
        """heat[layer, e] += 1 for each id in an int array of any shape (repeats count again).

        Cheap enough to call once per layer per step (a fraction of a microsecond for [1, 8]).
        """
    def decay(self, factor: float) -> None:
        """heat *= factor, 0 < factor <= 1."""
    def coldest(self, lo: int, hi: int) -> int:
        """The slot in [lo, hi) holding the coldest resident, or -1 if none holds one.

        Coldest = last in heat order: lowest heat, ties broken by the highest (coldest) rank.
        0 <= lo <= hi <= n_slots.
        """
    def residents_by_heat(self, lo: int, hi: int) -> np.ndarray:
        """int32 slots in [lo, hi) that hold an expert, coldest first."""
    def hottest_missing(self, k: int) -> np.ndarray:
        """int32 [n, 2] (layer, expert) of up to k non-resident experts, hottest first."""
    # --- the hot path ---
    def lookup(
        self,
        layer: int,
        expert_ids: np.ndarray,
        out_slots: np.ndarray | None = None,
        out_hit: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Slots int32 [T, K] (-1 for a miss) and hit mask bool [T, K] for ids int [T, K].

        Counts every routed id in `lookups` and every resident one in `hits`.

        Pass preallocated `out_slots` (int32) and `out_hit` (bool), C-contiguous, writeable and
        of shape [T, K], to avoid allocating per call; they are filled and returned. Native int64
        or int32 C-contiguous ids are read in place. Batches of 4096 ids or more are looked up
        with the GIL released. If an id is out of range, the IndexError names its position, the
        counters are unchanged and the contents of the output arrays are unspecified.
        """
    def split_token(self, layer: int, expert_ids: np.ndarray, out: np.ndarray) -> tuple[int, int]:
        """One token's routing (a decode call): `lookup` and `record` of its K ids in one pass,
        and its K rows split into hits and misses, written into `out`.

        `expert_ids` int [K] or [1, K]; row k is the k-th id. `out` int64 [>= 5K + 1],
        C-contiguous and writeable, receives, for H hit rows, R = K - H missed rows and M
        distinct missed experts (the first two sections back to back, the last three at 2K,
        3K and 4K):

        - out[0:H]: the slot of each hit row, rows ascending;
        - out[H:H+K]: each row's position in [hit rows ascending; missed rows in the order
          below], so out[0:H+K] is every index a call uploads, contiguous;
        - out[2K:2K+R]: the missed rows, by expert ascending, rows ascending within;
        - out[3K:3K+M]: the missed experts, ascending and distinct;
        - out[4K:4K+M+1]: where each expert's rows begin in out[2K:], then R.

        The last three are `Routed.of(ids, ~hit)`'s rows, experts and starts. The books change
        as `lookup` followed by `record` change them (the counters, then heat in id order);
        the other elements of `out` are unspecified. Returns (H, M).

        Raises:
            IndexError: layer out of range, or an id out of range (nothing changes).
            ValueError: ids not one token's integer array, or `out` not as above.
        """
    @property
    def hits(self) -> int:
        """Routed ids found resident by `lookup` since the last `reset_counters`."""
    @property
    def lookups(self) -> int:
        """Routed ids passed to `lookup` since the last `reset_counters`."""
    def reset_counters(self) -> None:
        """Set `hits` and `lookups` to 0."""
    # --- geometry ---
    def slot_chunks(self, slot: int) -> tuple[int, int]:
        """Chunks [lo, hi) that slot touches."""
    def chunk_slots(self, chunk: int) -> tuple[int, int]:
        """Slots [lo, hi) that touch chunk."""
    def chunks_within(self, lo: int, hi: int) -> tuple[int, int]:
        """Chunks [c_lo, c_hi) lying wholly inside slots [lo, hi) (empty: c_lo == c_hi).

        A chunk lies inside when every slot it touches is in [lo, hi): these are the chunks that
        giving up slots [lo, hi) frees. The bytes of the last chunk past the arena's end belong
        to no slot, so with hi == n_slots the last chunk is inside as soon as its slots are.
        """
    def slots_completed_by(self, chunks: np.ndarray) -> np.ndarray:
        """int32 slots, ascending, not backed now that would be if `chunks` were mapped too."""
    def mark_chunks(self, chunks: np.ndarray, mapped: bool) -> None:
        """Record arena chunks as mapped or unmapped; unmapping one under a resident is an error.

        Marking a chunk with the state it already has is allowed. `backed` follows: a slot is
        backed iff every chunk it touches is mapped.

        Raises:
            IndexError: a chunk out of range.
            ValueError: `mapped` is False and a slot touching one of the chunks holds an expert.
        """
    # --- checks and persistence ---
    def validate(self) -> None:
        """Check every invariant; AssertionError naming the first broken one.

        res and owner are inverse; every resident slot is backed; backed agrees with
        chunk_mapped; rank is a permutation; heat is finite and >= 0; n_resident counts the
        occupied slots; 0 <= floor <= top <= n_slots; 0 <= hits <= lookups.
        """
    def save(self, path: str | PathLike[str]) -> None:
        """Write the books to an `.npz` at `path` (exactly that name, replaced atomically).

        The same books always give the same bytes.
        """
    @classmethod
    def load(
        cls,
        path: str | PathLike[str],
        *,
        n_layers: int | None = None,
        n_experts: int | None = None,
        n_slots: int | None = None,
        slot_bytes: int | None = None,
        chunk_bytes: int | None = None,
    ) -> ResidencyTable:
        """Read books written by `save`; the geometry given must match the stored one.

        Raises:
            FileNotFoundError: no file at `path`.
            ValueError: the file is not a readable table, is of another format version, holds
                arrays of the wrong dtype or shape or inconsistent books, or its geometry differs
                from one given here; the message names the path and the problem.
        """


class ResidencyView:
    """The books as a policy sees them: arrays with the write flag off, regions, geometry.

    Every decision and notification is handed one. Units: slots, experts, layers and chunks
    are counts or indices (ints); `slot_bytes` and `chunk_bytes` are bytes; an expert is
    (layer, expert), or flat as `layer * n_experts + expert` (how `owner` stores it). The
    arena is `n_slots` slots back to back, `slot_bytes` each, over `n_chunks` chunks of
    `chunk_bytes`: a slot may straddle a chunk boundary, and a slot is *backed* (usable) only
    while every chunk it touches is mapped.

    Regions: slots [top, n_slots) are the loan region (lent to the prompt path; never
    admitted into, never given up); slots [0, floor) are never given up;
    0 <= floor <= top <= n_slots. `top`, when given, is the loan region's first slot as the
    caller sees it (the elastic K/V asks its give-up with the region the prompt loan would
    lend, open or not); by default the books'.

    The view shows the table live and cannot change it: the table is kept where Python cannot
    read it, the view takes no attributes (nor does its class), it cannot be pickled, and every
    array it hands out is a new read-only array object that cannot be made writeable and whose
    `.base` leads to nothing writeable. Nothing reachable from it leads to a method that changes
    the books. A plugin runs in the engine's process, so this keeps a policy from reaching the
    books through what it is given; it is not a sandbox.

    Raises:
        TypeError: `table` is not a `ResidencyTable`, or `top` is not an integer.
        ValueError: `top` is outside [floor, n_slots].
    """

    def __init__(self, table: ResidencyTable, *, top: int | None = None) -> None: ...
    # --- shape and regions ---
    @property
    def n_layers(self) -> int:
        """L, the MoE layers (a count); layers are 0 .. L-1."""
    @property
    def n_experts(self) -> int:
        """E, the routed experts of each layer (a count); experts are 0 .. E-1 in each layer,
        L * E in all."""
    @property
    def n_slots(self) -> int:
        """S, the arena's slots (a count), each holding at most one expert; slots 0 .. S-1.
        Fixed for the engine's life: a slot whose memory went to the K/V still counts (it is
        not `backed`)."""
    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot: an expert's blob (gate, up, down) rounded up to 256 bytes."""
    @property
    def chunk_bytes(self) -> int:
        """Bytes of one arena chunk: the memory backend's granularity (2 MiB on NVIDIA)."""
    @property
    def n_chunks(self) -> int:
        """The arena's chunks (a count): ceil(n_slots * slot_bytes / chunk_bytes)."""
    @property
    def top(self) -> int:
        """The loan region's first slot: admissions only below it; n_slots when no loan."""
    @property
    def floor(self) -> int:
        """The fewest slots the cache keeps (a count): slots below it are never given up."""
    @property
    def n_resident(self) -> int:
        """Slots that hold an expert now (a count)."""
    # --- arrays: the books' own memory, a new read-only array object on every read ---
    @property
    def res(self) -> np.ndarray:
        """int32 [L, E]: the slot of each expert, or -1 when it is not resident."""
    @property
    def owner(self) -> np.ndarray:
        """int32 [S]: the flat expert id (`layer * n_experts + expert`) in each slot, or -1
        for an empty slot. `res` and `owner` are always each other's inverse."""
    @property
    def heat(self) -> np.ndarray:
        """float64 [L, E]: routed tokens counted per expert (the engine records every routed
        (token, expert) at every layer step, before `observe`), decayed by the engine's
        `decay` calls; how hot an expert is now."""
    @property
    def rank(self) -> np.ndarray:
        """int32 [L, E]: the profile rank, 0 = hottest by the calibration profile; a
        permutation of 0 .. L*E-1 that breaks heat's ties."""
    @property
    def chunk_mapped(self) -> np.ndarray:
        """bool [n_chunks]: arena chunks whose memory is mapped (not lent to the K/V)."""
    @property
    def backed(self) -> np.ndarray:
        """bool [S]: slots whose every chunk is mapped; only these can hold an expert."""
    # --- the table's read-only queries ---
    def slot_of(self, layer: int, expert: int) -> int:
        """The slot holding (layer, expert), or -1."""
    def expert_in(self, slot: int) -> tuple[int, int] | None:
        """The (layer, expert) in `slot`, or None."""
    def coldest(self, lo: int, hi: int) -> int:
        """The slot in [lo, hi) holding the coldest resident, or -1."""
    def residents_by_heat(self, lo: int, hi: int) -> np.ndarray:
        """int32 slots in [lo, hi) that hold an expert, coldest first."""
    def hottest_missing(self, k: int) -> np.ndarray:
        """int32 [n, 2] (layer, expert) of up to k non-resident experts, hottest first."""
    def slot_chunks(self, slot: int) -> tuple[int, int]:
        """Chunks [lo, hi) that slot touches."""
    def chunk_slots(self, chunk: int) -> tuple[int, int]:
        """Slots [lo, hi) that touch chunk."""
    # --- derived in numpy ---
    def heat_position(self) -> np.ndarray:
        """int64 [L, E]: each expert's place in the heat order, 0 = hottest.

        The books' order: higher heat first, then lower profile rank; ranks are a permutation,
        so no two experts share a place.
        """
    def slot_chunk_bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """int64 [S] twice, read-only: the chunks [lo, hi) each slot touches."""
    def chunk_slot_bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """int64 [n_chunks] twice, read-only: the slots [lo, hi) that touch each chunk."""
    def chunks_freed_by(self, slots: np.ndarray) -> np.ndarray:
        """int32 chunks, ascending, that giving up `slots` (valid, distinct) frees.

        A mapped chunk is freed when the given-up slots touch it and no other backed slot
        does: a slot straddling a chunk boundary keeps the chunk it shares with a neighbour
        unless that neighbour goes too (or has no memory left already).
        """
    def givable_slots(self) -> np.ndarray:
        """int32 backed slots in [floor, top), ascending: those a give-up may name."""
    def givable_chunks(self) -> int:
        """How many chunks giving up every givable slot would free: the most a growth can ask."""
    def empty_slots(self, lo: int, hi: int) -> np.ndarray:
        """int32 backed slots in [lo, hi) that hold no expert, ascending."""

def frozen(array: np.ndarray) -> np.ndarray:
    """A read-only view of `array` (or of `np.asarray(array)`): a new array object over the same
    memory that cannot be made writeable and whose `.base` leads to nothing writeable.

    The checker hands policies their array arguments (`slots`, `free_slots`, `missed_experts`,
    and `observe`'s `expert_ids` and `hit_mask`) this way, keeping the arrays it checks against.
    """


# --- compiled policy rules (`from strata._residency cimport CacheRule`; _residency.pxd) ---

WHY_NAMES: tuple[str, ...]
"""Why an expert entered or left the cache, by the code a compiled rule is told (`WHY_FILL` = 0
.. `WHY_ROLLBACK` = 7 in _residency.pxd): fill, admit, refill, trim, relocate, give_up, loan,
rollback. The same names as `strata.policies.WHY`."""

def why_code(why: str) -> int:
    """The code of a reason's name; ValueError for an unknown one."""

class ExpertLists:
    """`n_lists` doubly linked lists over items 0 .. n_items-1 (flat experts, or slots), each
    item in at most one list; O(1) push to either end and removal. The building block of
    LRU-like compiled rules (ARC's T1, T2, B1, B2; 2Q; SLRU): their cdef code reads the fields
    `which`, `prev`, `next`, `front`, `back`, `size` and calls `push(k, item, at_front=True)`
    and `remove(item)` (_residency.pxd). From Python, for tests: `py_push`, `py_remove`,
    `items`, `list_of`.

    Raises:
        ValueError: n_lists < 1, or n_items outside [0, 2**31 - 1].
    """

    n_lists: int
    n_items: int
    def __init__(self, n_lists: int, n_items: int) -> None: ...
    def py_push(self, k: int, item: int, at_front: bool = True) -> None:
        """Put `item` at the front (or back) of list `k`, out of the list it was in."""
    def py_remove(self, item: int) -> None:
        """Take `item` out of its list (nothing if it is in none)."""
    def items(self, k: int) -> list[int]:
        """List `k`'s items, front to back."""
    def list_of(self, item: int) -> int:
        """The list `item` is in, or -1."""

class CacheRule:
    """Base of a policy's `observe` and `admit` (and its notifications) compiled in C.

    A plugin subclasses it in its own Cython (`cdef class MyRule(CacheRule)`, cimported from
    _residency.pxd) and overrides the cdef methods it needs: `start()` (make the state, once
    the shape is known), `step(layer)` (a layer step begins), `routed(flat, slot, n_tokens)`
    (each distinct routed expert, ascending; `slot` -1 for a miss), `admit(flat) -> slot`
    (each distinct missed expert, ascending; -1 admits nothing), `entered(flat, slot, why)`,
    `left(flat, slot, why)`, `moved(flat, src, dst)`. It reads the books through the cdef
    read-only memoryviews `res` [L, E], `owner` [S], `backed` [S] and the ints `n_layers`,
    `n_experts`, `n_slots`, `top`; `usable(slot)` and `free_slot()` help choose. `changed` is
    set by strata when the books changed other than by the rule's own admissions.
    `strata.policies.RulePolicy` wraps one as a policy; the simulator's kernel path calls the
    cdef methods from its C step loop (`drive_rule_span`), the engine through the methods below,
    once per layer step.
    """

    n_layers: int
    n_experts: int
    n_slots: int
    top: int
    changed: bool
    @property
    def bound(self) -> bool:
        """Whether the rule has met books (and made its state)."""
    def bind(self, view: ResidencyView) -> None:
        """Bind to `view`'s books (`start` for new books) and its `top`."""
    def observe_step(self, view: ResidencyView, layer: int, expert_ids: np.ndarray) -> None:
        """`step(layer)`, then `routed` for each distinct expert of `expert_ids` (int [T, K])."""
    def admit_step(self, view: ResidencyView, layer: int,
                   missed_experts: np.ndarray) -> np.ndarray:
        """int64 [n, 3] (slot, layer, expert): `admit` asked for each missed expert, in order."""
    def notify(self, view: ResidencyView, kind: str, why: str, rows: np.ndarray) -> None:
        """Tell the rule of a change of the books: `kind` `entered` or `left` with rows
        (slot, layer, expert), or `moved` with rows (src_slot, dst_slot, layer, expert); `why`
        one of `WHY_NAMES` (not `admit`: sets `changed`)."""

def admit_answer(view: ResidencyView, layer: int, missed_experts: np.ndarray,
                 answer: object) -> np.ndarray | None:
    """The fast check of an `admit` answer: int64 [n, 3] when it surely passes
    `strata.books.validate.check_admit` (a list or tuple of 3-tuples or 3-lists of plain ints,
    or an int array [n, 3]: experts of `layer`, each one of `missed_experts` and named once,
    slots that exist, lie below `top`, are backed and are named once), else None: only the
    Python checker judges it then. Never accepts what the Python checker refuses (a property
    test holds it to that)."""

def drive_rule_span(rule: CacheRule, view: ResidencyView, ids_by_layer: np.ndarray,
                    step_offsets: np.ndarray, s0: int, s1: int, out_hits: np.ndarray,
                    out_distinct_hits: np.ndarray, out_distinct_misses: np.ndarray,
                    out_admits: np.ndarray, layer_admits: np.ndarray,
                    layer_evictions: np.ndarray, reject: object) -> None:
    """Replay steps [s0, s1) of a trace through a compiled rule on the live books, in C: per
    step and layer, look up and record the routing (`ids_by_layer` int32 [L, N, K],
    `step_offsets` int64 [S + 1]), call `step` and `routed`, ask `admit` for each distinct
    missed expert ascending, check the answers (`reject(layer, missed, answer)` is called for
    a bad batch and must raise), apply them (evictions first, as `apply_admit`) and tell the
    rule `left` and `entered` (WHY_ADMIT). The outputs are the simulator's counts: int32
    [s1 - s0, L] hits, distinct hits, distinct misses (written), admissions (added to); int64
    [L] admissions and evictions by layer (added to)."""

def drive_policy_span(policy: object, asker: object, view: ResidencyView,
                      ids_by_layer: np.ndarray, step_offsets: np.ndarray, s0: int, s1: int,
                      observes: bool, listens: bool, out_hits: np.ndarray,
                      out_distinct_hits: np.ndarray, out_distinct_misses: np.ndarray,
                      out_admits: np.ndarray, layer_admits: np.ndarray,
                      layer_evictions: np.ndarray) -> None:
    """`drive_rule_span` for any Python policy: its `observe(view, layer, expert_ids,
    hit_mask)` (when `observes`) and `admit(view, layer, missed_experts)` called once per layer
    step with new read-only arrays; an answer `admit_answer` cannot pass is judged by
    `asker.admit_slow(layer, missed, answer)` (int64 [n, 3], or it raises); what the policy
    raises becomes `asker.fault(method, exc)`; with `listens`, `asker.tell(kind, "admit",
    rows)` after each applied admission (`left`, then `entered`)."""
