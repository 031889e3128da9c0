"""The conversation cache: finished conversations' K/V cells parked in host RAM.

Dimension letters: N cells, G kv heads, Dh head dim, L layers, P scale pairs a scale cell holds.

A conversation is its token ids and the K/V cells they wrote: cell i holds token i's keys and
values in every layer. When a request shares more with a parked conversation than with the
live one, the engine parks the live one here (its cells copied to host RAM, pinned on CUDA so
that the copies back are fast) and restores the parked one with the longest common prefix
(its cells copied back, the K/V grown for them first). A restored conversation continues
exactly as one never parked: the bytes are the same (int8 cells with their scales).

Bounded by bytes (`max_bytes`) and entries (`max_entries`); the least recently used goes
first, and a conversation larger than the whole cache is dropped, not parked.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from strata.engine.kv.kv_cache import KVCache

__all__ = ["ConversationCache", "ParkedConversation", "common_prefix"]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of two id sequences."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass
class ParkedConversation:
    """One parked conversation: `tokens` and, per layer, their K and V cells [N, G, Dh] in
    host RAM as the K/V holds them, with int8's scale segments' cells [N, P, G] (else none).
    `name` is its handle in events."""

    name: str
    tokens: tuple[int, ...]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    scales: list[torch.Tensor] = field(default_factory=list)

    @property
    def n_cells(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (*self.keys, *self.values, *self.scales))


class ConversationCache:
    """Parked conversations, at most `max_bytes` of cells and `max_entries` entries, least
    recently used out first. `pin` page-locks the host copies (on CUDA)."""

    def __init__(self, max_bytes: int, max_entries: int, *, pin: bool = False) -> None:
        for name, value in (("max_bytes", max_bytes), ("max_entries", max_entries)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        self.max_bytes, self.max_entries, self.pin = max_bytes, max_entries, pin
        self._parked: OrderedDict[str, ParkedConversation] = OrderedDict()  # oldest first
        self._names = (f"c{i}" for i in itertools.count(1))

    def __len__(self) -> int:
        return len(self._parked)

    @property
    def nbytes(self) -> int:
        """Bytes held by the parked conversations."""
        return sum(c.nbytes for c in self._parked.values())

    def entries(self) -> list[ParkedConversation]:
        """The parked conversations, least recently used first."""
        return list(self._parked.values())

    def cell_bytes(self, kv: KVCache) -> int:
        """Bytes one cell of `kv` takes parked (K and V of every layer, int8's scales)."""
        return kv.layout.bytes_per_cell

    def park(self, tokens: Sequence[int], kv: KVCache) -> tuple[ParkedConversation | None,
                                                                list[ParkedConversation]]:
        """Copy the cells of `tokens` (cells [0, len(tokens)) of `kv`) to host RAM.

        Returns (the parked conversation, or None when it is larger than the whole cache or
        the cache holds no entries; the conversations dropped to make room, oldest first).
        The copies are complete when it returns.
        """
        n = len(tokens)
        if not 0 < n <= kv.mapped_cells:
            raise ValueError(f"cannot park {n} cells of a K/V with {kv.mapped_cells} mapped")
        nbytes = n * self.cell_bytes(kv)
        if self.max_entries == 0 or nbytes > self.max_bytes:
            return None, []
        dropped = []
        while self._parked and (len(self._parked) >= self.max_entries
                                or self.nbytes + nbytes > self.max_bytes):
            dropped.append(self._parked.popitem(last=False)[1])
        keys = [self._host_copy(kv.k(layer)[:n]) for layer in range(kv.n_layers)]
        values = [self._host_copy(kv.v(layer)[:n]) for layer in range(kv.n_layers)]
        scales = [self._host_copy(cells[:n]) for cells in kv.scales()]
        entry = ParkedConversation(next(self._names), tuple(int(t) for t in tokens), keys, values,
                                   scales)
        self._parked[entry.name] = entry
        return entry, dropped

    def _host_copy(self, cells: torch.Tensor) -> torch.Tensor:
        out = torch.empty(cells.shape, dtype=cells.dtype, device="cpu",
                          pin_memory=self.pin and cells.is_cuda)  # [N, G, Dh] or [N, P, G]
        out.copy_(cells)  # blocking: the K/V's cells may be overwritten after this returns
        return out

    def best(self, tokens: Sequence[int]) -> tuple[ParkedConversation | None, int]:
        """The parked conversation sharing the longest prefix with `tokens`, and that length
        (None, 0 when none shares any)."""
        best, best_n = None, 0
        for entry in self._parked.values():
            n = common_prefix(entry.tokens, tokens)
            if n > best_n:
                best, best_n = entry, n
        return best, best_n

    def take(self, entry: ParkedConversation) -> ParkedConversation:
        """Remove `entry` from the cache (it becomes the live conversation)."""
        return self._parked.pop(entry.name)

    def put_back(self, entry: ParkedConversation) -> None:
        """Return a taken entry, as the most recently used (a restore that failed)."""
        self._parked[entry.name] = entry

    @staticmethod
    def restore(entry: ParkedConversation, kv: KVCache, n_cells: int) -> None:
        """Copy the first `n_cells` of `entry`'s cells back into cells [0, n_cells) of `kv`,
        complete when it returns (the K/V must map them: grow it first)."""
        if not 0 <= n_cells <= min(entry.n_cells, kv.mapped_cells):
            raise ValueError(f"cannot restore {n_cells} cells: the conversation holds "
                             f"{entry.n_cells}, the K/V maps {kv.mapped_cells}")
        if entry.keys[0].dtype != kv.cell_dtype or len(entry.scales) != len(kv.scales()):
            raise ValueError(f"cannot restore {entry.keys[0].dtype} cells into a K/V of "
                             f"{kv.cell_dtype} cells")
        for layer in range(kv.n_layers):
            kv.k(layer)[:n_cells].copy_(entry.keys[layer][:n_cells])
            kv.v(layer)[:n_cells].copy_(entry.values[layer][:n_cells])
        for cells, parked in zip(kv.scales(), entry.scales, strict=True):
            cells[:n_cells].copy_(parked[:n_cells])
        if kv.k(0).is_cuda:
            torch.cuda.synchronize(kv.k(0).device)
