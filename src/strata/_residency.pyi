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

    Slots [top, n_slots) are the loan region; slots below `floor` are never given up. `top`, when
    given, is the loan region's first slot as the caller sees it (the elastic K/V asks its
    give-up with the region the prompt loan would lend, open or not); by default the books'.

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
        """The arena's chunks."""
    @property
    def top(self) -> int:
        """The first slot of the loan region."""
    @property
    def floor(self) -> int:
        """The fewest slots the cache keeps: slots below it are never given up."""
    @property
    def n_resident(self) -> int:
        """Slots that hold an expert."""
    # --- arrays: the books' own memory, a new read-only array object on every read ---
    @property
    def res(self) -> np.ndarray:
        """int32 [L, E]: slot of each expert, or -1."""
    @property
    def owner(self) -> np.ndarray:
        """int32 [S]: flat expert id (`layer * n_experts + expert`) in each slot, or -1."""
    @property
    def heat(self) -> np.ndarray:
        """float64 [L, E]: decayed routing counts."""
    @property
    def rank(self) -> np.ndarray:
        """int32 [L, E]: profile rank, 0 = hottest."""
    @property
    def chunk_mapped(self) -> np.ndarray:
        """bool [n_chunks]: arena chunks that are mapped."""
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
