"""`Routed`: the (token, k) rows of one layer's routing that go to some experts, grouped by expert.

Dimension letters: T tokens, K experts per token, M distinct experts, R rows.

A *row* is one (token, k) pair, numbered flat as `t * K + k`: the row of the [T*K, D] buffer its
expert's output lands in. Grouping rows by expert lets each expert run once over all of its
tokens, on the device (hits, the loan) or on the CPU (misses).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from strata.engine.experts.blobs import to_device_async


def sort_keys(ids: np.ndarray) -> np.ndarray:
    """ids int [R] as the narrowest unsigned integers that hold them (uint8 below 256, uint16
    below 65,536), else as they are: the same stable order, but numpy sorts 8- and 16-bit
    integers by radix, in one or two passes, where int64 takes a merge sort (`Routed.of` of a
    4,096-token chunk's misses 3.7-4.8x as fast on the development machine,
    bench/results/routed-sort-cpu-2026-12-04.md; 5x on the H200's host,
    bench/results/prompt-host-h200-2026-12-04.md)."""
    if not ids.size or ids.min() < 0:
        return ids
    top = ids.max()
    return ids.astype(np.uint8) if top < 1 << 8 else ids.astype(np.uint16) if top < 1 << 16 \
        else ids


@dataclass(frozen=True)
class Routed:
    """Rows of one layer grouped by expert: expert `experts[i]` owns `rows[starts[i]:starts[i+1]]`.

    experts int64 [M] ascending and distinct; starts int64 [M+1] from 0 to R, strictly
    ascending (every expert owns at least one row: so R == M means one row each); rows int64
    [R], flat `t * top_k + k`, ascending within each expert (the order a stable sort by expert
    gives, which is the order `ResidentExperts` runs them in). Arrays are read-only.
    """

    experts: np.ndarray
    starts: np.ndarray
    rows: np.ndarray
    top_k: int

    def __post_init__(self) -> None:
        for name in ("experts", "starts", "rows"):
            array = getattr(self, name)
            if array.dtype != np.int64 or array.ndim != 1:
                raise ValueError(f"{name} must be int64 [n], got {array.dtype} {array.shape}")
            array.flags.writeable = False
        if self.starts.size != self.experts.size + 1 or self.starts[0] != 0 \
                or self.starts[-1] != self.rows.size or (np.diff(self.starts) < 1).any():
            raise ValueError(
                f"starts must be [M+1] = [{self.experts.size + 1}] rising from 0 to R = "
                f"{self.rows.size}, every expert owning a row, got {self.starts.tolist()}"
            )
        if self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")

    @classmethod
    def _of_valid(cls, experts: np.ndarray, starts: np.ndarray, rows: np.ndarray,
                  top_k: int) -> Routed:
        """A Routed of parts that are valid by construction (slices of a valid one, the books'
        split), without `__post_init__`'s checks: a decode call makes a few of these a layer,
        and the checks were a third of the time it spent grouping its misses on the host. An
        array read-only already (a slice of a valid one's) is not set again: reading the flag
        costs a quarter of setting it."""
        routed = object.__new__(cls)
        for name, value in (("experts", experts), ("starts", starts), ("rows", rows)):
            if value.flags.writeable:
                value.flags.writeable = False
            object.__setattr__(routed, name, value)
        object.__setattr__(routed, "top_k", top_k)
        return routed

    @classmethod
    def of(cls, expert_ids: np.ndarray, mask: np.ndarray | None = None) -> Routed:
        """The rows of ids int [T, K] where `mask` bool [T, K] is True (None: every row)."""
        ids = np.asarray(expert_ids)
        if ids.ndim != 2:
            raise ValueError(f"expert_ids must be [T, K], got shape {ids.shape}")
        flat = ids.reshape(-1).astype(np.int64)  # [T*K]
        if mask is None:
            rows = np.arange(flat.size, dtype=np.int64)
        else:
            mask = np.asarray(mask, dtype=bool)
            if mask.shape != ids.shape:
                raise ValueError(f"mask must be {ids.shape}, got {mask.shape}")
            rows = np.flatnonzero(mask.reshape(-1)).astype(np.int64)  # [R] ascending
        chosen = flat[rows]
        order = np.argsort(sort_keys(chosen), kind="stable")  # by expert, rows ascending within
        rows, chosen = rows[order], chosen[order]
        first = np.flatnonzero(np.diff(chosen, prepend=-1))  # [M]: where each expert begins
        starts = np.append(first, chosen.size).astype(np.int64)
        return cls(chosen[first], starts, rows, int(ids.shape[1]))

    @classmethod
    def of_split(cls, split: np.ndarray, top_k: int, n_hits: int, n_experts: int,
                 lo: int = 0, hi: int | None = None) -> Routed:
        """The missed rows of one token as `ResidencyTable.split_token` wrote them into `split`
        int64 (it returned `n_hits`, `n_experts`), or those of the missed experts [lo, hi)
        alone (`group(lo, hi)` of the whole, made in one step): views of `split`, made
        read-only."""
        hi = n_experts if hi is None else hi
        k2, k3, k4 = 2 * top_k, 3 * top_k, 4 * top_k
        if lo == 0 and hi == n_experts:  # the whole (maybe empty): its rows end at K - n_hits
            return cls._of_valid(split[k3:k3 + n_experts], split[k4:k4 + n_experts + 1],
                                 split[k2:k2 + top_k - n_hits], top_k)
        if not 0 <= lo < hi <= n_experts:
            raise ValueError(f"missed experts [{lo}, {hi}) are not a part of [0, {n_experts})")
        starts = split[k4 + lo:k4 + hi + 1]
        r0, r1 = int(starts[0]), int(starts[-1])
        return cls._of_valid(split[k3 + lo:k3 + hi], starts if r0 == 0 else starts - r0,
                             split[k2 + r0:k2 + r1], top_k)

    def group(self, lo: int, hi: int) -> Routed:
        """The rows of experts[lo:hi] (0 <= lo <= hi <= M) as a Routed of their own: views of
        this one's read-only arrays where they can be (valid as long as this one's are)."""
        if not 0 <= lo <= hi <= self.n_experts:
            raise ValueError(f"experts [{lo}, {hi}) are not within [0, {self.n_experts}]")
        if lo == 0 and hi == self.n_experts:
            return self
        r0, r1 = int(self.starts[lo]), int(self.starts[hi])
        starts = self.starts[lo:hi + 1]
        return Routed._of_valid(self.experts[lo:hi], starts if r0 == 0 else starts - r0,
                                self.rows[r0:r1], self.top_k)

    def pick(self, indices: np.ndarray) -> Routed:
        """The rows of experts[indices] (indices int, ascending, distinct, within [0, M)) as a
        Routed of their own: `group` for experts that need not be adjacent."""
        indices = np.asarray(indices, dtype=np.int64)
        if indices.size and (indices[0] < 0 or indices[-1] >= self.n_experts
                             or (np.diff(indices) <= 0).any()):
            raise ValueError(f"expert indices must ascend within [0, {self.n_experts}), got "
                             f"{indices.tolist()}")
        lo, hi = self.starts[indices], self.starts[indices + 1]  # [m] each
        rows = np.concatenate([self.rows[a:b] for a, b in zip(lo, hi, strict=True)]) \
            if indices.size else np.empty(0, dtype=np.int64)
        starts = np.concatenate(([0], np.cumsum(hi - lo))).astype(np.int64)
        return Routed(self.experts[indices].copy(), starts, rows.astype(np.int64), self.top_k)

    @property
    def n_experts(self) -> int:
        """M, the distinct experts."""
        return int(self.experts.size)

    @property
    def n_rows(self) -> int:
        """R, the (token, k) rows."""
        return int(self.rows.size)

    def tokens(self) -> np.ndarray:
        """int64 [R]: the token of each row."""
        return self.rows // self.top_k

    def expert_rows(self, i: int) -> np.ndarray:
        """int64 [n]: the rows of the i-th expert (`experts[i]`)."""
        return self.rows[self.starts[i] : self.starts[i + 1]]


def rows_to_device(device: torch.device, *groups: np.ndarray | None, pinned: bool = False
                   ) -> list[torch.Tensor | None]:
    """Each int [R_i] array (rows, slots) as an int64 tensor on `device` (None stays None), in
    one host-to-device copy: on CUDA from pageable memory, which waits for the stream and the
    copies queued before it; `pinned` through pinned memory, which waits for neither (a
    staging copy more on the host)."""
    present = [g for g in groups if g is not None]
    if not present:
        return [None] * len(groups)
    host = torch.from_numpy(np.concatenate(present).astype(np.int64, copy=False))  # [sum R_i]
    flat = to_device_async(host, device) if pinned else host.to(device)
    views: list[torch.Tensor | None] = []
    at = 0
    for group in groups:
        views.append(None if group is None else flat[at : at + group.size])
        at += 0 if group is None else group.size
    return views
