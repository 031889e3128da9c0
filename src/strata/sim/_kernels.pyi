"""The simulator's hot loops in Cython: nogil loops over typed memoryviews, thin wrappers.

Legend: N tokens, L layers, E experts per layer, K experts per token, S steps, A accesses
(N * L * K), B blocks. A flat expert id is `layer * E + expert`. Integer arrays must have the
dtype named, C-contiguous (int32 ids, int64 offsets); wrong shapes are a ValueError, an id out
of range an IndexError, both raised before anything is written. `access_sequence` and the
`replay_*` kernels trust the expert ids of `ids` to be in [0, E): pass a checked `Trace`'s.
"""

import numpy as np

CODE_MISS: int
"""`min_bypass`: a miss, not loaded (bypassed)."""
CODE_HIT: int
"""`min_bypass`: a hit."""
CODE_LOADED: int
"""`min_bypass`: a miss, loaded into the cache (at the end of its block)."""
CODE_REPEAT: int
"""`min_bypass`: a later access, in the same block, of an item that block missed: the bound
counts it as a hit (see `strata.sim.belady`)."""
MODE_LRU: int
"""`replay_scored`: the `lru` rule."""
MODE_LFU: int
"""`replay_scored`: the `lfu` rule."""

def access_sequence(ids: np.ndarray, step_offsets: np.ndarray, n_experts: int) -> np.ndarray:
    """int32 [A]: the flat ids of `ids` int32 [N, L, K] in replay order (step, layer, token, k).

    `step_offsets` int64 [S + 1] are the steps' token ranges.
    """

def next_use(seq: np.ndarray, n_items: int) -> np.ndarray:
    """int64 [A]: for each access of `seq` int32 [A], the index of the next access of the same
    item, or A if there is none."""

def min_bypass(
    seq: np.ndarray, nxt: np.ndarray, starts: np.ndarray, capacity: int, n_items: int
) -> tuple[np.ndarray, np.ndarray]:
    """Belady's MIN with bypass over `seq` int32 [A] with `capacity` slots, block by block.

    Blocks are the accesses [starts[b], starts[b+1]) (int64 [B + 1], from 0 to A). The cache
    starts holding the first `capacity` distinct items of `seq` (a free start). In a block,
    every lookup comes first: a resident item hits; the first access of another misses, its
    later ones are REPEATs. Then each missed item, in order, is loaded only if some resident
    is next used (`nxt`, from `next_use`) after it, evicting the resident next used last; an
    item never used again is never loaded. This minimises the (block, item) misses of any
    cache that loads an item only after a block missed it. Returns uint8 [A] codes
    (CODE_MISS, CODE_HIT, CODE_LOADED, CODE_REPEAT) and int64 [n_items] evictions per item.
    O(A log A).
    """

def block_stats(
    items: np.ndarray,
    codes: np.ndarray,
    starts: np.ndarray,
    n_items: int,
    hits: np.ndarray,
    distinct_hits: np.ndarray,
    distinct_misses: np.ndarray,
    loads: np.ndarray,
) -> None:
    """Per block b (accesses [starts[b], starts[b+1]) of `items` int32 [A] and their `codes`
    uint8 [A], the CODE_* values; bool hit masks viewed as uint8 work): hits (HIT and REPEAT),
    the distinct items hit (HIT), the distinct items missed (MISS or LOADED) and the loads,
    written into four int32 [B] outputs (any stride)."""

def replay_scored(
    mode: int,
    ids: np.ndarray,
    step_offsets: np.ndarray,
    step_lo: int,
    step_hi: int,
    res: np.ndarray,
    owner: np.ndarray,
    heat: np.ndarray,
    rank: np.ndarray,
    backed: np.ndarray,
    top: int,
    score: np.ndarray,
    last_use: np.ndarray,
    clock: int,
    decay: float,
    max_admits: int,
    out_hits: np.ndarray,
    out_distinct_hits: np.ndarray,
    out_distinct_misses: np.ndarray,
    out_admits: np.ndarray,
    layer_admits: np.ndarray,
    layer_evictions: np.ndarray,
) -> int:
    """Steps [step_lo, step_hi) of the `lru` (MODE_LRU) or `lfu` (MODE_LFU) rule
    (`strata.policies.base.LruState`, `LfuState`), exactly as a policy declaring that
    `replay_kernel` (the built-ins `lru`, `lfu`) stepped through the engine's sequence
    (lookup, record heat, observe, admit the distinct misses, apply) would run them.

    Works on copies of the books: `res` int32 [L, E], `owner` int32 [n_slots], `heat` float64
    [L, E] are updated in place; `rank` int32 [L, E], `backed` uint8 [n_slots] and `top` are
    read. The policy's state is updated in place: lru's `last_use` int64 [L, E] with `score`
    float64 [L, E] its copy as floats, from `clock` (returned, advanced by one per layer step);
    lfu's decayed counts as `score`, each layer's row multiplied by `decay` at its step (pass
    an empty `last_use`). `max_admits` is the policies' option.

    Per step of the span (rows) and layer: `out_hits`, `out_distinct_hits`, `out_admits` are
    added to and `out_distinct_misses` written, all int32 [step_hi - step_lo, L] and zero on
    entry; `layer_admits` and `layer_evictions` int64 [L] are added to, by the layer of the
    admitted and of the evicted expert.
    """

def replay_sieve(
    ids: np.ndarray,
    step_offsets: np.ndarray,
    step_lo: int,
    step_hi: int,
    res: np.ndarray,
    owner: np.ndarray,
    heat: np.ndarray,
    rank: np.ndarray,
    backed: np.ndarray,
    top: int,
    visited: np.ndarray,
    inserted: np.ndarray,
    next_insert: int,
    hand: int,
    max_admits: int,
    out_hits: np.ndarray,
    out_distinct_hits: np.ndarray,
    out_distinct_misses: np.ndarray,
    out_admits: np.ndarray,
    layer_admits: np.ndarray,
    layer_evictions: np.ndarray,
) -> tuple[int, int]:
    """Steps [step_lo, step_hi) of the `sieve` rule (`strata.policies.base.SieveState`),
    exactly as a policy declaring that `replay_kernel` (the built-in `sieve`) stepped through
    the engine's sequence would run them.

    The books' copies and the outputs are as for `replay_scored`. The policy's state is updated
    in place: `visited` (its bool [L, E] viewed as uint8) and `inserted` int64 [L, E]; its
    `next_insert` and `hand` are passed in and the new ones returned.
    """
