"""The streamed share of a decode call's misses: uploaded over the bus, computed on the device.

Dimension letters: T tokens, K experts per token, D hidden size, F expert width, N staging blobs,
R rows, M missed experts.

The cache keeps a staging buffer of N blobs on the device (counted in the budget's workspace).
In a decode call (T == 1) with M missed experts, the first `split.streamed(M)` of them (by id)
are copied into it from the host store, asynchronously (the store is pinned on CUDA) and in
stream order before their compute, and computed over the staging slots by the decode path of
their format (`strata.engine.experts.blobs.BlobStack.expert_rows`); the CPU computes the other
misses meanwhile (`CpuExperts`), so the bus and the CPU share the misses. `StreamSplit` is that
rule, a table of M -> streamed experts: `StreamSplit.fixed(N, K)` streams min(N, M)
(`--stream-misses N`); `--stream-misses auto` builds the table from the rates measured once per
machine (`strata.engine.cache.rates`), so that both sides finish a layer together.

The device and the CPU round differently, so the table is part of what the output bytes depend
on: it never depends on timings taken during a run. A call's copies are queued after the
previous call's reads of the buffer (one stream), so the buffer is reused safely without a sync.

A call split around piecewise CUDA graphs (`strata.engine.cache.graph_call`) takes the two
halves apart: the host queues the copies and writes the stage map (`stage`), and the next
graph computes the staged experts over all N blobs, an unused one reading nothing, and puts
their rows where the map says (`staged_rows`). So the host launches no kernel for them.

With `prefetch`, a split call can also upload the experts the next layer is predicted to
miss before that layer is reached (`prefetch`; the cache predicts them,
`CachedExperts.use_routers`). The buffer then holds 2N blobs, a half for even layers and one
for odd ones, so a layer's prefetched blobs are written while the previous layer's are read.
Every upload then runs on a copy stream of its own, in the order the host queues them: a
layer's own misses, then the next layer's predicted ones, which go on while the device
computes the layer (the compute stream waits only for the layer's own). Of a layer's misses,
those prefetched are streamed first, whatever the split's count (they are uploaded already),
then the others by id up to the count.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from strata.engine.experts import ExpertStore
from strata.engine.experts.blob_copies import BlobCopies
from strata.engine.experts.blobs import BlobStack
from strata.engine.experts.routed import Routed

__all__ = ["StreamSplit", "StreamedMisses", "staging_blobs"]


@dataclass(frozen=True)
class StreamSplit:
    """Of M missed experts of a decode layer call, `counts[M]` are streamed (M = 0..K).

    counts: ints, counts[0] == 0, 0 <= counts[M] <= M; `n_blobs` (their largest) is the
    staging buffer's blobs. `source` says where the table came from, for messages (two
    splits are equal when their tables are). ValueError for a table that breaks these."""

    counts: tuple[int, ...]
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        counts = tuple(self.counts)
        object.__setattr__(self, "counts", counts)
        if not counts or any(isinstance(c, bool) or not isinstance(c, int) for c in counts) \
                or counts[0] != 0 or any(not 0 <= c <= m for m, c in enumerate(counts)):
            raise ValueError(f"a stream split is [0, s1, ..., sK] with 0 <= s_m <= m, got "
                             f"{list(counts)}")

    @classmethod
    def fixed(cls, n_blobs: int, top_k: int) -> StreamSplit:
        """min(N, M): the first N misses (`--stream-misses N`)."""
        if isinstance(n_blobs, bool) or not isinstance(n_blobs, int) or n_blobs < 0:
            raise ValueError(f"n_blobs must be an int >= 0, got {n_blobs!r}")
        return cls(tuple(min(n_blobs, m) for m in range(top_k + 1)), f"--stream-misses {n_blobs}")

    @property
    def top_k(self) -> int:
        return len(self.counts) - 1

    @property
    def n_blobs(self) -> int:
        """N, the most experts a call streams: the staging buffer's blobs."""
        return max(self.counts)

    def streamed(self, n_missed: int) -> int:
        """How many of `n_missed` experts to stream (beyond K: as many as at K)."""
        return self.counts[min(n_missed, len(self.counts) - 1)]

    def text(self) -> str:
        """The table as "0,1,1,2,2", for notes."""
        return ",".join(str(c) for c in self.counts)


def staging_blobs(stream_misses: int | StreamSplit) -> int:
    """The staging buffer's blobs for `stream_misses` (`CacheConfig`'s, `CachedExperts`');
    ValueError for a value that is neither an int >= 0 nor a StreamSplit."""
    if isinstance(stream_misses, StreamSplit):
        return stream_misses.n_blobs
    if isinstance(stream_misses, bool) or not isinstance(stream_misses, int) \
            or stream_misses < 0:
        raise ValueError(f"stream_misses must be an int >= 0 or a StreamSplit, got "
                         f"{stream_misses!r}")
    return stream_misses


class StreamedMisses:
    """A staging buffer of `n_blobs` blobs of `store` on `device`, and the math over it.

    `split` decides how many of a call's misses are streamed (None: the first `n_blobs`);
    its `n_blobs` must not exceed the buffer's."""

    def __init__(self, store: ExpertStore, device: torch.device, n_blobs: int,
                 split: StreamSplit | None = None, prefetch: bool = False) -> None:
        if isinstance(n_blobs, bool) or not isinstance(n_blobs, int) or n_blobs < 1:
            raise ValueError(f"n_blobs must be an int >= 1, got {n_blobs!r}")
        if split is not None and split.n_blobs > n_blobs:
            raise ValueError(f"the split streams up to {split.n_blobs} experts, the staging "
                             f"buffer holds {n_blobs}")
        self.store, self.n_blobs, self.split_rule = store, n_blobs, split
        self.prefetching = bool(prefetch)
        n_staged = 2 * n_blobs if prefetch else n_blobs  # a half for each layer parity
        self._staging = torch.empty((n_staged, store.blob_bytes), dtype=torch.uint8,
                                    device=device)  # [N or 2N, blob]
        self._stack = BlobStack(self._staging, store.dtype, store.quant, store.expert_width,
                                store.hidden_size)
        self._index = torch.arange(n_blobs, device=device)  # [N]: staging slot of each
        self._copies = BlobCopies(store, self._staging)  # by address, on the current stream
        # The stage map `staged_rows` reads (a graph holds its address): [N] the blob of each
        # entry (-1: unused, its row reads nothing), then [N] the row of the rows it is
        # written to (0 for an unused entry: the rows' scratch row).
        self._cleared_map = torch.cat((torch.full((n_blobs,), -1, dtype=torch.int64),
                                       torch.zeros(n_blobs, dtype=torch.int64))).to(device)
        self.stage_map = self._cleared_map.clone()
        self._map_names_blobs = False  # whether the device's map has any used entry
        self._pin = torch.device(device).type == "cuda"
        self._stage_entries = torch.empty(2 * n_blobs, dtype=torch.int64,
                                          pin_memory=self._pin)  # the map's host side, kept
        self._stage_view = self._stage_entries.numpy()  # the same memory, for the host
        # Prefetching: the uploads' own stream on CUDA; the layer whose predicted misses are
        # staged, and their blobs by expert.
        self._copy_stream = torch.cuda.Stream(device) if prefetch and self._pin else None
        self._prefetched_layer = -1
        self._prefetched: dict[int, int] = {}
        self.prefetched_experts = 0  # uploaded ahead, all told
        self.prefetch_used = 0  # of them, streamed by the layer they were uploaded for

    @property
    def nbytes(self) -> int:
        return self._staging.numel()

    def count(self, m: int, layer: int = -1) -> int | None:
        """How many of a call's m missed experts `split` streams, the first m by id; None
        where experts prefetched for `layer` are staged, which `split` streams first: call it
        then."""
        if layer == self._prefetched_layer and self._prefetched:
            return None
        return self._count(m)

    def _count(self, m: int) -> int:
        return min(self.n_blobs, m) if self.split_rule is None else self.split_rule.streamed(m)

    def split(self, misses: Routed, layer: int = -1) -> tuple[Routed | None, Routed | None]:
        """(the rows of the missed experts the split streams, the other misses'), None for a
        side with none: the first by id; of `layer`'s call with prefetched experts among its
        misses, those first (all of them), then the first others by id up to the count."""
        m = misses.n_experts
        n = self._count(m)
        ready = [] if layer != self._prefetched_layer or not self._prefetched else [
            i for i, expert in enumerate(misses.experts.tolist()) if expert in self._prefetched]
        if ready:
            others = [i for i in range(m) if i not in ready]  # ready: at most N entries
            chosen = sorted(ready + others[:max(n - len(ready), 0)])
            rest = sorted(set(range(m)) - set(chosen))
            return misses.pick(chosen), misses.pick(rest) if rest else None
        if n == 0:
            return None, misses
        if n == m:
            return misses, None
        return misses.group(0, n), misses.group(n, m)

    def compute(self, layer: int, x: torch.Tensor, streamed: Routed) -> torch.Tensor:
        """[R, D] on the device, rows in `streamed.rows` order: the experts' blobs copied from
        the host store into the staging buffer, then computed over the one token x [1, D]
        (T == 1: one row an expert)."""
        n = streamed.n_experts
        if streamed.n_rows != n or x.shape[0] != 1:
            raise ValueError(f"streamed misses are for one token: {n} experts, "
                             f"{streamed.n_rows} rows, {x.shape[0]} tokens")
        if n > self.n_blobs:
            raise ValueError(f"{n} streamed experts do not fit {self.n_blobs} staging blobs")
        self._drop_prefetched()  # this path reads blobs 0..n-1 on the compute stream
        self._upload(layer, list(enumerate(streamed.experts.tolist())))
        self._wait_for_uploads()
        return self._stack.expert_rows(self._index[:n], x.expand(n, -1))

    def _upload(self, layer: int, copies: list[tuple[int, int]]) -> None:
        """(staging blob, expert) copies of `layer`'s blobs, queued in order: on the compute
        stream, or when prefetching on the copy stream, after what the compute stream has
        queued (nothing reads a blob while it is written)."""
        if not copies:
            return
        if self._copy_stream is None:
            self._copies.queue(layer, copies)
            return
        with self._on_copy_stream():
            self._copies.queue(layer, copies)

    @contextlib.contextmanager
    def _on_copy_stream(self) -> Iterator[None]:
        if self._copy_stream is None:
            yield
            return
        self._copy_stream.wait_stream(torch.cuda.current_stream(self._staging.device))
        with torch.cuda.stream(self._copy_stream):
            yield

    def _wait_for_uploads(self) -> None:
        """The compute stream waits for the uploads queued so far (none to wait for without
        a copy stream)."""
        if self._copy_stream is not None:
            torch.cuda.current_stream(self._staging.device).wait_stream(self._copy_stream)

    def _drop_prefetched(self) -> None:
        self._prefetched_layer, self._prefetched = -1, {}

    def prefetch(self, layer: int, experts: list[int]) -> int:
        """Upload `layer`'s `experts` (at most N, distinct: those its next call is predicted
        to miss) into the staging half of `layer`, for that call to find (`split`, `stage`);
        replaces any earlier prefetch. Returns the blobs uploaded."""
        if not self.prefetching:
            raise RuntimeError("this staging buffer was made without prefetch")
        if len(experts) > self.n_blobs or len(set(experts)) != len(experts):
            raise ValueError(f"prefetch takes at most {self.n_blobs} distinct experts, got "
                             f"{experts}")
        base = (layer % 2) * self.n_blobs
        copies = [(base + i, expert) for i, expert in enumerate(experts)]
        self._upload(layer, copies)
        self._prefetched_layer = layer
        self._prefetched = {expert: blob for blob, expert in copies}
        self.prefetched_experts += len(copies)
        return len(copies)

    def stage(self, layer: int, streamed: Routed | None, rows: np.ndarray | None) -> int:
        """The host's half of a split call: the streamed experts' blobs uploaded (those
        prefetched for `layer` are there already), and the stage map set so that `staged_rows`
        writes staged expert i's row to rows[rows[i]] (rows [n] indices >= 1, row 0 being the
        scratch row); None: nothing streamed (the map cleared, so a later graph computes
        nothing stale). One upload of the map, skipped when it is already clear. Returns the
        blobs uploaded now."""
        prefetched = self._prefetched if layer == self._prefetched_layer else {}
        self._drop_prefetched()  # used now or never
        if streamed is None:
            if not self._map_names_blobs:
                return 0
            n, blobs, uploads = 0, [], []
        else:
            n = streamed.n_experts
            targets = [] if rows is None else rows.tolist()
            if streamed.n_rows != n or rows is None or rows.shape != (n,) \
                    or (n and min(targets) < 1):
                raise ValueError(f"a stage map is one row >= 1 per streamed expert: {n} "
                                 f"experts, {streamed.n_rows} rows, rows {rows}")
            if n > self.n_blobs:
                raise ValueError(f"{n} streamed experts do not fit {self.n_blobs} staging blobs")
            experts = streamed.experts.tolist()
            base = (layer % 2) * self.n_blobs if self.prefetching else 0
            if prefetched:  # those there already keep their blobs; the others take free ones
                taken = {prefetched[e] for e in experts if e in prefetched}
                free = iter([b for b in range(base, base + self.n_blobs) if b not in taken])
                blobs = [prefetched[e] if e in prefetched else next(free) for e in experts]
                uploads = [(b, e) for b, e in zip(blobs, experts, strict=True)
                           if e not in prefetched]
                self.prefetch_used += n - len(uploads)
            else:
                blobs = list(range(base, base + n))
                uploads = list(zip(blobs, experts, strict=True))
            self._upload(layer, uploads)
            self._wait_for_uploads()  # the next graph reads this layer's blobs
        if not n:  # cleared on the device: this call may have read no routing (see below)
            self.stage_map.copy_(self._cleared_map)
            self._map_names_blobs = False
            return 0
        # The kept host map is rewritten only after this call's routing was read, which ran
        # the stream past the copy of the last call's map.
        view, n_blobs = self._stage_view, self.n_blobs
        view[:n] = blobs
        view[n:n_blobs] = -1
        view[n_blobs:n_blobs + n] = targets
        view[n_blobs + n:] = 0
        self._copies.copies.to_device(self.stage_map.data_ptr(), self._stage_entries.data_ptr(),
                                      self._stage_entries.nbytes, "the stage map")
        self._map_names_blobs = True
        return len(uploads)

    def staged_rows(self, x: torch.Tensor, rows: torch.Tensor) -> None:
        """The graph's half of a split call: the staged experts over the one token x [1, D],
        each row written to rows [K + 1, D] where the stage map says (unused entries to the
        scratch row 0). No host read on CUDA; the host twin picks the used entries."""
        blobs, targets = self.stage_map[:self.n_blobs], self.stage_map[self.n_blobs:]  # [N]
        if not x.is_cuda:  # the torch path gathers by blob index: only the used ones
            used = torch.nonzero(blobs >= 0).reshape(-1)
            blobs, targets = blobs[used], targets[used]
        staged = self._stack.expert_rows(blobs, x.expand(blobs.numel(), -1))  # [N, D]
        rows.index_copy_(0, targets, staged.to(rows.dtype))
