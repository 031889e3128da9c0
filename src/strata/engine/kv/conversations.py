"""The conversation cache: finished conversations' K/V cells parked in host RAM.

Dimension letters: N cells, G kv heads, Dh head dim, L layers, P scale pairs a scale cell holds.

A conversation is its token ids and the K/V cells they wrote: cell i holds token i's keys and
values in every layer. When a request shares more with a parked conversation than with the
live one, the engine parks the live one here (its cells copied to host RAM, page-locked on
CUDA so that the copies back are fast) and restores the parked one with the longest common
prefix (its cells copied back, the K/V grown for them first). A restored conversation continues
exactly as one never parked: the bytes are the same (int8 cells with their scales).

Each parked conversation holds its cells in one mapping of host pages (`strata._vmm.HostPages`)
of their exact size rounded to whole pages. When it leaves (pushed out, or restored), its pages
are kept as spare for the next park, which takes the smallest spare that holds it and at most
twice its bytes: page-locking fresh pages costs far more than the copy into them (on the H200,
a park into fresh locked pages ran at 2.4 GB/s, a copy into locked pages at 43-49: bench/park.py,
bench/results/park-h200-2026-12-05.md). Spares count against the bound and are given back to the
system first when a park needs the room. Not torch's pinned memory: its caching allocator
rounds each block up to a power of two (a qwen3-30b-a3b layer's keys for 3,000 cells, 3.1 MB,
would take 4 MiB) and keeps freed blocks outside any bound.

Bounded by host bytes (`max_bytes`: the parked conversations' pages and the spares) and entries
(`max_entries`); the least recently used goes first, and a conversation larger than the whole
cache is dropped, not parked. While a conversation is parked, the ones it replaces are still
held: the peak is the bound plus the new one. A park that fails (no host memory, a refused
page-lock) changes nothing a caller sees: the entries it would have pushed out leave only once
its copy is complete.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from strata import _vmm, settings
from strata.engine.kv.kv_cache import KVCache

__all__ = ["ConversationCache", "ParkedConversation", "common_prefix"]

# Each tensor of a parked conversation starts on this boundary of its pages (as cudaMalloc's
# allocations do), so that the copy engine's transfers are aligned.
CELLS_ALIGN_BYTES = 256


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
    host RAM as the K/V holds them, with int8's scale segments' cells [N, P, G] (else none),
    all views of `pages` (None: the tensors own their memory). `name` is its handle in
    events."""

    name: str
    tokens: tuple[int, ...]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    scales: list[torch.Tensor] = field(default_factory=list)
    pages: _vmm.HostPages | None = None

    @property
    def n_cells(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        """Bytes of its cells."""
        return sum(t.numel() * t.element_size()
                   for t in (*self.keys, *self.values, *self.scales))

    @property
    def host_bytes(self) -> int:
        """Bytes of host memory it holds: its pages' (its cells' when it has none)."""
        return self.nbytes if self.pages is None else self.pages.mapped_bytes

    def release(self) -> _vmm.HostPages | None:
        """Its pages, its cells forgotten (it has left the cache: the pages hold another's
        next). Its name and tokens stay, for events."""
        pages, self.pages = self.pages, None
        self.keys, self.values, self.scales = [], [], []
        return pages


class ConversationCache:
    """Parked conversations, at most `max_bytes` of host memory and `max_entries` entries,
    least recently used out first. `pin` page-locks the host copies of CUDA cells; `huge`
    advises their pages to be huge ones (default: the `STRATA_HOST_HUGE_PAGES` setting)."""

    def __init__(self, max_bytes: int, max_entries: int, *, pin: bool = False,
                 huge: bool | None = None) -> None:
        for name, value in (("max_bytes", max_bytes), ("max_entries", max_entries)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        self.max_bytes, self.max_entries, self.pin = max_bytes, max_entries, pin
        self.huge = settings.read().host_huge_pages if huge is None else huge
        self._parked: OrderedDict[str, ParkedConversation] = OrderedDict()  # oldest first
        self._spare: list[_vmm.HostPages] = []  # pages of conversations that left
        self._names = (f"c{i}" for i in itertools.count(1))

    def __len__(self) -> int:
        return len(self._parked)

    @property
    def host_bytes(self) -> int:
        """Bytes of host memory the cache holds: the parked conversations' and the spare
        pages (what `max_bytes` bounds)."""
        return (sum(c.host_bytes for c in self._parked.values())
                + sum(pages.mapped_bytes for pages in self._spare))

    @property
    def spare_bytes(self) -> int:
        """Bytes of the spare pages, kept for the next parks."""
        return sum(pages.mapped_bytes for pages in self._spare)

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
        the cache holds no entries; the conversations pushed out to make room, oldest first,
        released: their pages went back to the cache). The copies are complete when it
        returns. Raises what mapping or page-locking host memory raised
        (`strata._vmm.VmmError`), no entry changed.
        """
        n = len(tokens)
        if not 0 < n <= kv.mapped_cells:
            raise ValueError(f"cannot park {n} cells of a K/V with {kv.mapped_cells} mapped")
        if self.max_entries == 0 or n * self.cell_bytes(kv) > self.max_bytes:
            return None, []
        cells = [kv.k(layer)[:n] for layer in range(kv.n_layers)]
        cells += [kv.v(layer)[:n] for layer in range(kv.n_layers)]
        cells += [scale_cells[:n] for scale_cells in kv.scales()]
        offsets, n_bytes = [], 0
        for source in cells:  # each tensor on an aligned offset of the one mapping
            n_bytes = -(-n_bytes // CELLS_ALIGN_BYTES) * CELLS_ALIGN_BYTES
            offsets.append(n_bytes)
            n_bytes += source.numel() * source.element_size()
        pages = self._pages_for(n_bytes, cells[0].device if cells[0].is_cuda else None)
        if pages is None:
            return None, []  # whole pages take more than the cache has
        memory = torch.frombuffer(pages, dtype=torch.uint8)  # [bytes]
        copies = [memory[offset:offset + source.numel() * source.element_size()]
                  .view(source.dtype).view(source.shape)
                  for offset, source in zip(offsets, cells, strict=True)]
        try:
            for copy, source in zip(copies, cells, strict=True):
                copy.copy_(source, non_blocking=True)
            if cells[0].is_cuda:  # the K/V's cells may be overwritten once this returns
                torch.cuda.synchronize(cells[0].device)
        except BaseException:  # nothing parked: the pages are spare, as far as the bound goes
            del memory, copies
            self._spare.append(pages)
            self._trim_spares()
            raise
        L = kv.n_layers
        entry = ParkedConversation(next(self._names), tuple(int(t) for t in tokens),
                                   copies[:L], copies[L:2 * L], copies[2 * L:], pages)
        self._parked[entry.name] = entry
        dropped = []
        self._trim_spares()
        while len(self._parked) > self.max_entries or self.host_bytes > self.max_bytes:
            oldest = self._parked.popitem(last=False)[1]
            self._spare.append(oldest.release())
            dropped.append(oldest)
            self._trim_spares()
        return entry, dropped

    def _pages_for(self, n_bytes: int, device: torch.device | None) -> _vmm.HostPages | None:
        """Pages of at least `n_bytes` for a park: the smallest spare that holds them and at
        most twice their bytes, else fresh ones (page-locked when `pin` and `device`), the
        spares given back first as far as the bound needs; None if whole pages of `n_bytes`
        exceed the bound."""
        fits = [p for p in self._spare if n_bytes <= p.nbytes and p.mapped_bytes <= 2 * n_bytes]
        if fits:
            pages = min(fits, key=lambda p: p.mapped_bytes)
            self._spare.remove(pages)
            return pages
        pages = _vmm.HostPages(n_bytes, huge=self.huge)  # VmmError: nothing changed
        if pages.mapped_bytes > self.max_bytes:
            return None
        while self._spare and self.host_bytes + pages.mapped_bytes > self.max_bytes:
            self._free(max(self._spare, key=lambda p: p.mapped_bytes))
        if self.pin and device is not None:
            pages.register(device.index or 0)  # VmmError: freed with `pages`
        return pages

    def _trim_spares(self) -> None:
        """Give back the largest spares while the cache holds more than its bound."""
        while self._spare and self.host_bytes > self.max_bytes:
            self._free(max(self._spare, key=lambda p: p.mapped_bytes))

    def _free(self, pages: _vmm.HostPages) -> None:
        """Give spare pages back to the system, unlocked here (see HostPages.unregister)."""
        self._spare.remove(pages)
        pages.unregister()

    def clear(self) -> None:
        """Drop every parked conversation and give all pages back. Idempotent."""
        for entry in self._parked.values():
            self._spare.append(entry.release())
        self._parked.clear()
        while self._spare:
            self._free(self._spare[-1])

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

    def restore(self, entry: ParkedConversation, kv: KVCache, n_cells: int) -> None:
        """Copy the first `n_cells` of a taken `entry`'s cells back into cells [0, n_cells) of
        `kv`, complete when it returns (the K/V must map them: grow it first). The entry is
        then released, its pages spare. ValueError, nothing changed, for a bad request."""
        if entry.name in self._parked or not entry.keys:
            raise ValueError(f"restore takes a conversation taken out of the cache, once; "
                             f"{entry.name} is {'parked' if entry.keys else 'released'}")
        if not 0 <= n_cells <= min(entry.n_cells, kv.mapped_cells):
            raise ValueError(f"cannot restore {n_cells} cells: the conversation holds "
                             f"{entry.n_cells}, the K/V maps {kv.mapped_cells}")
        if entry.keys[0].dtype != kv.cell_dtype or len(entry.scales) != len(kv.scales()):
            raise ValueError(f"cannot restore {entry.keys[0].dtype} cells into a K/V of "
                             f"{kv.cell_dtype} cells")
        for layer in range(kv.n_layers):
            kv.k(layer)[:n_cells].copy_(entry.keys[layer][:n_cells], non_blocking=True)
            kv.v(layer)[:n_cells].copy_(entry.values[layer][:n_cells], non_blocking=True)
        for cells, parked in zip(kv.scales(), entry.scales, strict=True):
            cells[:n_cells].copy_(parked[:n_cells], non_blocking=True)
        if kv.k(0).is_cuda:  # the pages take another's cells once this returns
            torch.cuda.synchronize(kv.k(0).device)
        pages = entry.release()
        if pages is not None:  # spare if the bound has room: a park may have filled it since
            self._spare.append(pages)
            self._trim_spares()
