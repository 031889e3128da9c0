"""A pure-Python ResidencyTable: dicts and brute force, straight from the definitions.

It answers the same calls as `strata._residency.ResidencyTable` with the same results and the same
exception types (IndexError for an index out of range, ValueError for what the state forbids),
but shares no code or formula with it: geometry is found by testing every slot against every
chunk for overlapping bytes, heat order by sorting on (-heat, rank), and batch calls are made
atomic by copying the whole state and putting it back. The model test checks the Cython table
against it step by step; bench/residency.py times its `lookup` as the baseline.
"""

import copy

import numpy as np


def _in_range(value: int, bound: int, what: str) -> int:
    if not 0 <= value < bound:
        raise IndexError(f"{what} {value} is out of range [0, {bound})")
    return value


def _ints(values, what: str) -> list[int]:
    a = np.asarray(values)
    if a.size and a.dtype.kind not in "iu":
        raise ValueError(f"{what} must be integers, got {a.dtype}")
    return [int(v) for v in a.reshape(-1).tolist()]


class ReferenceResidency:
    def __init__(self, n_layers, n_experts, n_slots, slot_bytes, chunk_bytes):
        self.n_layers, self.n_experts, self.n_slots = n_layers, n_experts, n_slots
        self.slot_bytes, self.chunk_bytes = slot_bytes, chunk_bytes
        self.n_chunks = -(-n_slots * slot_bytes // chunk_bytes)
        self.experts = [(layer, e) for layer in range(n_layers) for e in range(n_experts)]
        self.res: dict[tuple[int, int], int] = {}  # resident expert -> slot
        self.owner: dict[int, tuple[int, int]] = {}  # occupied slot -> expert
        self.heat = {x: 0.0 for x in self.experts}
        self.rank = {x: i for i, x in enumerate(self.experts)}
        self.mapped = [True] * self.n_chunks
        self.top, self.floor = n_slots, 0
        self.hits = self.lookups = 0

    # --- the state as dense arrays, for comparing with the real table ---
    def arrays(self) -> dict[str, np.ndarray]:
        L, E, S = self.n_layers, self.n_experts, self.n_slots
        res = np.full((L, E), -1, np.int32)
        for x, s in self.res.items():
            res[x] = s
        owner = np.full(S, -1, np.int32)
        for s, (layer, e) in self.owner.items():
            owner[s] = layer * E + e
        heat = np.array([self.heat[x] for x in self.experts], np.float64).reshape(L, E)
        rank = np.array([self.rank[x] for x in self.experts], np.int32).reshape(L, E)
        return {
            "res": res,
            "owner": owner,
            "heat": heat,
            "rank": rank,
            "chunk_mapped": np.array(self.mapped, dtype=bool),
            "backed": np.array([self.is_backed(s) for s in range(S)], dtype=bool),
        }

    # --- geometry, by overlapping byte ranges ---
    def touches(self, slot: int, chunk: int) -> bool:
        s_lo, s_hi = slot * self.slot_bytes, (slot + 1) * self.slot_bytes
        c_lo, c_hi = chunk * self.chunk_bytes, (chunk + 1) * self.chunk_bytes
        return s_lo < c_hi and c_lo < s_hi

    def chunks_of(self, slot: int) -> list[int]:
        return [c for c in range(self.n_chunks) if self.touches(slot, c)]

    def slots_of(self, chunk: int) -> list[int]:
        return [s for s in range(self.n_slots) if self.touches(s, chunk)]

    def is_backed(self, slot: int) -> bool:
        return all(self.mapped[c] for c in self.chunks_of(slot))

    def slot_chunks(self, slot):
        chunks = self.chunks_of(_in_range(slot, self.n_slots, "slot"))
        return (chunks[0], chunks[-1] + 1)

    def chunk_slots(self, chunk):
        slots = self.slots_of(_in_range(chunk, self.n_chunks, "chunk"))
        return (slots[0], slots[-1] + 1)

    def _span(self, lo, hi):
        _in_range(lo, self.n_slots + 1, "lo")
        _in_range(hi, self.n_slots + 1, "hi")
        if lo > hi:
            raise ValueError(f"lo {lo} > hi {hi}")

    def chunks_within(self, lo, hi) -> set[int]:
        """The set of chunks every one of whose slots lies in [lo, hi)."""
        self._span(lo, hi)
        return {c for c in range(self.n_chunks) if all(lo <= s < hi for s in self.slots_of(c))}

    def slots_completed_by(self, chunks):
        chunks = set(self._chunk_list(chunks))
        return [
            s
            for s in range(self.n_slots)
            if not self.is_backed(s)
            and all(self.mapped[c] or c in chunks for c in self.chunks_of(s))
        ]

    def _chunk_list(self, chunks):
        chunks = _ints(chunks, "chunks")
        for c in chunks:
            _in_range(c, self.n_chunks, "chunk")
        return chunks

    def mark_chunks(self, chunks, mapped):
        if not isinstance(mapped, (bool, np.bool_)):
            raise TypeError(f"mapped must be a bool, got {mapped!r}")
        chunks = self._chunk_list(chunks)
        if not mapped:
            for c in chunks:
                for s in self.slots_of(c):
                    if s in self.owner:
                        raise ValueError(f"chunk {c} is under slot {s}, which holds an expert")
        for c in chunks:
            self.mapped[c] = bool(mapped)

    # --- regions ---
    def set_regions(self, *, top=None, floor=None):
        top = self.top if top is None else _in_range(top, self.n_slots + 1, "top")
        floor = self.floor if floor is None else _in_range(floor, self.n_slots + 1, "floor")
        if floor > top:
            raise ValueError(f"floor {floor} > top {top}")
        self.top, self.floor = top, floor

    # --- residency ---
    def _expert(self, layer, expert):
        layer = _in_range(layer, self.n_layers, "layer")
        return (layer, _in_range(expert, self.n_experts, "expert"))

    def _assign_checked(self, slot, x):
        if slot in self.owner:
            raise ValueError(f"slot {slot} already holds {self.owner[slot]}")
        if not self.is_backed(slot):
            raise ValueError(f"slot {slot} is not backed")
        if x in self.res:
            raise ValueError(f"expert {x} is already in slot {self.res[x]}")
        self.res[x], self.owner[slot] = slot, x

    def _evict_checked(self, slot):
        if slot not in self.owner:
            raise ValueError(f"slot {slot} holds no expert")
        x = self.owner.pop(slot)
        del self.res[x]
        return x

    def _move_checked(self, src, dst):
        if src not in self.owner:
            raise ValueError(f"src_slot {src} holds no expert")
        if src == dst or dst in self.owner:
            raise ValueError(f"dst_slot {dst} is occupied")
        if not self.is_backed(dst):
            raise ValueError(f"dst_slot {dst} is not backed")
        x = self.owner.pop(src)
        self.owner[dst], self.res[x] = x, dst

    def assign(self, slot, layer, expert):
        slot = _in_range(slot, self.n_slots, "slot")
        self._assign_checked(slot, self._expert(layer, expert))

    def evict(self, slot):
        return self._evict_checked(_in_range(slot, self.n_slots, "slot"))

    def move(self, src_slot, dst_slot):
        src = _in_range(src_slot, self.n_slots, "src_slot")
        dst = _in_range(dst_slot, self.n_slots, "dst_slot")
        self._move_checked(src, dst)

    def _atomically(self, apply):
        saved = copy.deepcopy((self.res, self.owner))
        try:
            return apply()
        except ValueError:
            self.res, self.owner = saved
            raise

    def assign_many(self, slots, layers, experts):
        slots, layers, experts = (_ints(a, "ids") for a in (slots, layers, experts))
        if not len(slots) == len(layers) == len(experts):
            raise ValueError("lengths differ")
        for s in slots:
            _in_range(s, self.n_slots, "slot")
        for layer in layers:
            _in_range(layer, self.n_layers, "layer")
        for e in experts:
            _in_range(e, self.n_experts, "expert")
        batch = list(zip(slots, zip(layers, experts, strict=True), strict=True))
        self._atomically(lambda: [self._assign_checked(s, x) for s, x in batch])

    def evict_many(self, slots):
        slots = [_in_range(s, self.n_slots, "slot") for s in _ints(slots, "slots")]
        evicted = self._atomically(lambda: [self._evict_checked(s) for s in slots])
        return np.array(evicted, dtype=np.int32).reshape(len(slots), 2)

    def move_many(self, src_slots, dst_slots):
        src, dst = _ints(src_slots, "src_slots"), _ints(dst_slots, "dst_slots")
        if len(src) != len(dst):
            raise ValueError("lengths differ")
        for s in src:
            _in_range(s, self.n_slots, "src_slot")
        for s in dst:
            _in_range(s, self.n_slots, "dst_slot")
        self._atomically(lambda: [self._move_checked(s, d) for s, d in zip(src, dst, strict=True)])

    def slot_of(self, layer, expert):
        return self.res.get(self._expert(layer, expert), -1)

    def expert_in(self, slot):
        return self.owner.get(_in_range(slot, self.n_slots, "slot"))

    @property
    def n_resident(self):
        return len(self.owner)

    # --- heat: order is (-heat, rank) ascending, hottest first ---
    def _key(self, x):
        return (-self.heat[x], self.rank[x])

    def set_rank(self, rank):
        rank = np.asarray(rank)
        if rank.dtype.kind not in "iu" or rank.shape != (self.n_layers, self.n_experts):
            raise ValueError(f"bad rank {rank.dtype} {rank.shape}")
        values = [int(v) for v in rank.reshape(-1).tolist()]
        for v in values:
            _in_range(v, len(self.experts), "rank")
        if sorted(values) != list(range(len(self.experts))):
            raise ValueError("rank is not a permutation")
        self.rank = dict(zip(self.experts, values, strict=True))

    def set_rank_from_counts(self, counts):
        counts = np.asarray(counts)
        if counts.dtype.kind not in "iuf" or counts.shape != (self.n_layers, self.n_experts):
            raise ValueError(f"bad counts {counts.dtype} {counts.shape}")
        flat = counts.reshape(-1).tolist()
        if not all(np.isfinite(flat)):
            raise ValueError("counts must be finite")
        order = sorted(range(len(flat)), key=lambda f: (-flat[f], f))
        self.rank = {self.experts[f]: r for r, f in enumerate(order)}

    def record(self, layer, expert_ids):
        layer = _in_range(layer, self.n_layers, "layer")
        ids = _ints(expert_ids, "expert_ids")
        for e in ids:
            _in_range(e, self.n_experts, "expert id")
        for e in ids:
            self.heat[(layer, e)] += 1.0

    def decay(self, factor):
        if not 0.0 < factor <= 1.0:
            raise ValueError(f"factor {factor} not in (0, 1]")
        for x in self.heat:
            self.heat[x] *= factor

    def residents_by_heat(self, lo, hi):
        self._span(lo, hi)
        slots = [s for s in range(lo, hi) if s in self.owner]
        return sorted(slots, key=lambda s: self._key(self.owner[s]), reverse=True)

    def coldest(self, lo, hi):
        slots = self.residents_by_heat(lo, hi)
        return slots[0] if slots else -1

    def hottest_missing(self, k):
        if k < 0:
            raise ValueError(f"k {k} < 0")
        missing = sorted((x for x in self.experts if x not in self.res), key=self._key)
        return np.array(missing[:k], dtype=np.int32).reshape(-1, 2)

    # --- the hot path ---
    def lookup(self, layer, expert_ids):
        layer = _in_range(layer, self.n_layers, "layer")
        ids = np.asarray(expert_ids)
        if ids.ndim != 2 or (ids.size and ids.dtype.kind not in "iu"):
            raise ValueError(f"expert_ids must be int [T, K], got {ids.dtype} {ids.shape}")
        res, n_experts = self.res, self.n_experts
        slots = []
        for row in ids.tolist():
            for e in row:
                if not 0 <= e < n_experts:
                    raise IndexError(f"expert id {e} is out of range [0, {n_experts})")
                slots.append(res.get((layer, e), -1))
        out_slots = np.array(slots, dtype=np.int32).reshape(ids.shape)
        out_hit = out_slots >= 0
        self.lookups += len(slots)
        self.hits += int(out_hit.sum())
        return out_slots, out_hit

    def split_token(self, layer, expert_ids, out):
        """`lookup` then `record` of one token's ids, its rows split into `out` (the layout of
        `ResidencyTable.split_token`), row by row."""
        layer = _in_range(layer, self.n_layers, "layer")
        a = np.asarray(expert_ids)
        if a.size and a.dtype.kind not in "iu":
            raise ValueError(f"expert_ids must be integers, got {a.dtype}")
        if not (a.ndim == 1 or (a.ndim == 2 and a.shape[0] == 1)):
            raise ValueError(f"expert_ids must be one token's [K] or [1, K], got {a.shape}")
        k = a.size
        if (not isinstance(out, np.ndarray) or out.dtype != np.int64 or out.ndim != 1
                or out.size < 5 * k + 1 or not out.flags.c_contiguous
                or not out.flags.writeable):
            raise ValueError("out must be a writeable C-contiguous int64 [>= 5K + 1]")
        ids = _ints(a, "expert_ids")
        slots, hit = self.lookup(layer, np.array(ids, dtype=np.int64).reshape(1, k))
        self.record(layer, ids)
        hit_rows = [r for r in range(k) if hit[0, r]]
        missed = sorted((ids[r], r) for r in range(k) if not hit[0, r])  # by expert, then row
        order = hit_rows + [r for _, r in missed]  # the outputs' order: hits, then misses
        experts = sorted({e for e, _ in missed})
        h, m = len(hit_rows), len(experts)
        out[:h] = [slots[0, r] for r in hit_rows]
        out[h:h + k] = [order.index(r) for r in range(k)]
        out[2 * k:2 * k + len(missed)] = [r for _, r in missed]
        out[3 * k:3 * k + m] = experts
        out[4 * k:4 * k + m + 1] = [[e for e, _ in missed].index(e) for e in experts] + [
            len(missed)]
        return h, m

    def reset_counters(self):
        self.hits = self.lookups = 0
