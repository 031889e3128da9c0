"""`HostRows`: the host's side of a decode layer call's rows, with as few waits as it takes.

Dimension letters: D hidden size, R rows.

- `x_to_host`: the token's x [1, D] is copied into a host buffer kept for it (pinned on CUDA),
  asynchronously, just before the routing's read, which waits for it: the misses' inputs then
  need no second read, and no second wait, of the device. The next call rewrites the buffer
  only after this one has read it (`index_select` copies).
- `queue_routing` / `read_routing`, for a call split around piecewise graphs: x and the
  routing go to host buffers kept for them, and an event is recorded after them, from inside
  the graph (queued right after the routing, before the hits' kernels); the host then waits
  for that event alone, not for the hits the graph runs after it, which overlap the host's
  work instead of holding up its read.
- `to_device`: the CPU's output rows [R, D] go to the device from pinned memory on CUDA, so the
  host issues on without waiting for the device's share (a copy from pageable memory waits for
  the stream); the caching host allocator keeps the pinned block until the copy is done.
- `index_buffer` / `indices_to_device`: the call's indices, written by the books straight into
  a host buffer kept for them (pinned on CUDA), go to the device in one copy that does not
  wait for the stream.
- `cpu_out` / `stage_cpu_rows` / `scatter_cpu_rows`, for a call split around piecewise graphs
  (`strata.engine.cache.graph_call`): the CPU writes its misses' rows straight into a host
  buffer kept for them (pinned on CUDA), which goes to the device with the rows' targets in one
  copy, by address through the driver (`ByteCopies`: no torch views or `copy_` dispatch
  between the CPU's rows and the next graph); the next graph writes them where the targets say
  (`scatter_cpu_rows`, no host work). With the next graph launched ahead of the CPU's rows,
  the copy is queued behind `signal`'s wait, which the host sets once the rows are written
  (`strata.engine.cache.host_signal`).

The kept buffers are rewritten by the next call only after its routing's read, which waits
for the stream to run past every copy queued by this call (each call's copies are queued
before the graph whose output the next call reads; `queue_routing`'s event is in that graph,
so waiting for it alone is enough too). So one buffer of each serves every call;
a call that reads no routing (every expert resident) clears the CPU rows' targets on the
device instead.
"""

from __future__ import annotations

import numpy as np
import torch

from strata.engine.cache.host_signal import HostSignal
from strata.engine.experts.blob_copies import ByteCopies

__all__ = ["HostRows"]


class HostRows:
    """Host copies for a cache on `device` (see the module)."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._pin = self.device.type == "cuda"
        self._x: torch.Tensor | None = None  # [1, D]
        self._indices: torch.Tensor | None = None  # int64 [n], the largest asked for
        self._index_views: dict[int, tuple[torch.Tensor, np.ndarray]] = {}  # by n, of it
        # The CPU's rows of a split call: [K] int64 targets then [K, D] rows, as bytes, on the
        # host and on the device (`_cpu_staging`); whether the device's names any row.
        self._cpu_host: torch.Tensor | None = None
        self._cpu_device: torch.Tensor | None = None
        self._cpu_shape: tuple[int, int, torch.dtype] | None = None
        self._cpu_host_views: tuple[torch.Tensor, torch.Tensor] | None = None
        self._cpu_targets: np.ndarray | None = None  # int64 [K], the host views' targets
        self._cpu_device_views: tuple[torch.Tensor, torch.Tensor] | None = None
        self._cpu_outs: dict[int, torch.Tensor] = {}  # `cpu_out`'s views by R, of this shape
        self._cpu_names_rows = False
        self._copies = ByteCopies(self.device)
        self._signal: HostSignal | None = None  # made on first use (`signal`)
        # `queue_routing`'s buffers and event by (x's shape and dtype, the ids' shape and
        # dtype): never freed, since a captured graph writes into them at every replay.
        self._routing: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.cuda.Event]] = {}

    @property
    def signal(self) -> HostSignal:
        """What the stream waits on for the CPU's rows when the next graph is launched ahead of
        them (`graph_call`, `stage_cpu_rows`' behind_signal); made on first use, so a cache
        that never launches ahead maps no word for it."""
        if self._signal is None:
            self._signal = HostSignal(self.device)
        return self._signal

    def x_to_host(self, x: torch.Tensor) -> torch.Tensor:
        """x [1, D] on the host, once the stream has run to here (the caller's next read of
        the device waits for it)."""
        buffer = self._x
        if buffer is None or buffer.shape != x.shape or buffer.dtype != x.dtype:
            buffer = self._x = torch.empty(x.shape, dtype=x.dtype, pin_memory=self._pin)
        buffer.copy_(x, non_blocking=True)
        return buffer

    def x_on_host(self, x: torch.Tensor) -> torch.Tensor:
        """x [1, D] (on this device) readable on the host: x itself on a host device, else
        `x_to_host`'s buffer."""
        return x if self.device.type == "cpu" else self.x_to_host(x)

    def queue_routing(self, x: torch.Tensor, topk_ids: torch.Tensor) -> None:
        """On CUDA, queue on the stream (a CUDA graph captures them) the copies of x [1, D] and
        topk_ids [1, K] into host buffers kept for them (pinned), then an event
        (`external`: a graph records it where it was captured); `read_routing` then waits for
        that event only. Nothing on the host, where `read_routing` reads them as they are."""
        if not self._pin:
            return
        x_host, ids_host, read = self._routing_buffers(x, topk_ids)
        x_host.copy_(x, non_blocking=True)
        ids_host.copy_(topk_ids, non_blocking=True)
        read.record()

    def read_routing(self, x: torch.Tensor, topk_ids: torch.Tensor, queued: bool
                     ) -> tuple[torch.Tensor, np.ndarray]:
        """(x [1, D] readable on the host, the routing int64 [1, K] as a numpy array of its
        own) once the device has run to them: with `queued`, what the last `queue_routing` of
        their shapes queued (the caller's graph ran it), waiting for its event alone; else
        `x_on_host` and a read of topk_ids, which waits for the whole stream. RuntimeError
        for `queued` where nothing of these shapes was ever queued (the buffers would hold
        nothing)."""
        if queued and self._pin:
            buffers = self._routing.get(_routing_key(x, topk_ids))
            if buffers is None:
                raise RuntimeError(f"no routing of x {list(x.shape)} {x.dtype} and ids "
                                   f"{list(topk_ids.shape)} {topk_ids.dtype} was queued: "
                                   "queue_routing (resident_rows) comes first")
            x_host, ids_host, read = buffers
            read.synchronize()
            return x_host, ids_host.numpy().astype(np.int64)  # a copy: the buffer is reused
        x_host = self.x_on_host(x)
        return x_host, np.ascontiguousarray(topk_ids.cpu().numpy(), dtype=np.int64)

    def _routing_buffers(self, x: torch.Tensor, topk_ids: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.cuda.Event]:
        key = _routing_key(x, topk_ids)
        buffers = self._routing.get(key)
        if buffers is None:
            buffers = self._routing[key] = (
                torch.empty(x.shape, dtype=x.dtype, pin_memory=True),
                torch.empty(topk_ids.shape, dtype=topk_ids.dtype, pin_memory=True),
                torch.cuda.Event(external=True))
        return buffers

    def index_buffer(self, n: int) -> tuple[torch.Tensor, np.ndarray]:
        """The kept int64 [n] host buffer for `indices_to_device` (pinned on CUDA), and the
        same memory as a numpy array for the host to fill; valid until the next call's routing
        is read (see the module)."""
        if self._indices is None or self._indices.numel() < n:
            self._indices = torch.empty(n, dtype=torch.int64, pin_memory=self._pin)
            self._index_views = {}
        views = self._index_views.get(n)  # a decode call asks for the same n each layer
        if views is None:
            buffer = self._indices[:n]
            views = self._index_views[n] = (buffer, buffer.numpy())
        return views

    def indices_to_device(self, indices: torch.Tensor) -> torch.Tensor:
        """int64 [n] of an `index_buffer` on the device (queued on the stream; on the host, the
        same tensor)."""
        if not self._pin:
            return indices
        return indices.to(self.device, non_blocking=True)

    def to_device(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [R, D] on the host, on the device (queued on the stream)."""
        if not self._pin:
            return rows.to(self.device)
        return rows.pin_memory().to(self.device, non_blocking=True)

    def _cpu_staging(self, top_k: int, hidden_size: int, dtype: torch.dtype
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(targets int64 [K], rows [K, D] of `dtype`) views of the host's CPU-rows buffer,
        made (zeros: every target the scratch row) on first use or a new shape."""
        if self._cpu_shape != (top_k, hidden_size, dtype):
            n_bytes = 8 * top_k + top_k * hidden_size * dtype.itemsize
            self._cpu_host = torch.zeros(n_bytes, dtype=torch.uint8, pin_memory=self._pin)
            self._cpu_device = torch.zeros(n_bytes, dtype=torch.uint8, device=self.device)
            self._cpu_shape = (top_k, hidden_size, dtype)
            self._cpu_names_rows = False
            self._cpu_host_views = _cpu_views(self._cpu_host, top_k, hidden_size, dtype)
            self._cpu_device_views = _cpu_views(self._cpu_device, top_k, hidden_size, dtype)
            self._cpu_targets = self._cpu_host_views[0].numpy()  # the same memory, for the host
            self._cpu_outs = {}
        return self._cpu_host_views

    def cpu_out(self, top_k: int, n_rows: int, hidden_size: int, dtype: torch.dtype
                ) -> torch.Tensor:
        """[R, D] of `dtype`, R <= K: where the CPU writes a split call's misses' rows (a view
        of the kept host buffer; `stage_cpu_rows` sends them)."""
        rows = self._cpu_staging(top_k, hidden_size, dtype)[1]
        out = self._cpu_outs.get(n_rows)
        if out is None:
            out = self._cpu_outs[n_rows] = rows[:n_rows]
        return out

    def write_cpu_targets(self, top_k: int, hidden_size: int, dtype: torch.dtype,
                          targets: np.ndarray) -> None:
        """Write a split call's CPU rows' targets [R] (rows of the call's [K + 1, D] rows,
        >= 1) into the host buffer ahead of `stage_cpu_rows`, which then sends them without
        writing them: so the CPU's rows, once done, wait only for their copy. Only after the
        call's routing read, which the last copy of this buffer precedes on the stream."""
        self._cpu_staging(top_k, hidden_size, dtype)
        n = targets.size
        view = self._cpu_targets
        view[:n] = targets
        view[n:] = 0  # the scratch row

    def stage_cpu_rows(self, top_k: int, hidden_size: int, dtype: torch.dtype,
                       targets: np.ndarray | None, behind_signal: bool = False,
                       targets_written: bool = False) -> None:
        """Send the R rows `cpu_out` holds with their targets [R] (rows of the call's
        [K + 1, D] rows, >= 1) to the device, for `scatter_cpu_rows`; None: no CPU rows (the
        targets cleared, one copy skipped when they are clear already). `targets_written`:
        `write_cpu_targets` wrote these targets already. `behind_signal`: the copy queued
        behind `signal`'s pending wait, the rows still being written (the targets are written
        now)."""
        self._cpu_staging(top_k, hidden_size, dtype)
        n = 0 if targets is None else targets.size
        if not n:
            # Cleared on the device: a call without a routing read (every expert resident)
            # must not rewrite the host buffer, whose last copy may not have run yet.
            if self._cpu_names_rows:
                self._cpu_device[:8 * top_k].zero_()
                self._cpu_names_rows = False
            return
        if not targets_written:
            self.write_cpu_targets(top_k, hidden_size, dtype, targets)
        n_bytes = 8 * top_k + n * hidden_size * dtype.itemsize  # the targets and the R rows
        device, host = self._cpu_device.data_ptr(), self._cpu_host.data_ptr()

        def copy() -> None:
            self._copies.to_device(device, host, n_bytes, "the CPU's rows")

        if behind_signal:
            self.signal.behind(copy)
        else:
            copy()
        self._cpu_names_rows = True

    def scatter_cpu_rows(self, rows: torch.Tensor) -> None:
        """Write the staged CPU rows into rows [K + 1, D] where their targets say, the unused
        ones into the scratch row 0 (no host read: a CUDA graph holds it)."""
        top_k, hidden_size = rows.shape[0] - 1, rows.shape[1]
        self._cpu_staging(top_k, hidden_size, rows.dtype)
        targets, staged = self._cpu_device_views
        rows.index_copy_(0, targets, staged)


def _routing_key(x: torch.Tensor, topk_ids: torch.Tensor) -> tuple:
    """What `queue_routing`'s buffers are kept by: x's and the ids' shapes and dtypes."""
    return tuple(x.shape), x.dtype, tuple(topk_ids.shape), topk_ids.dtype


def _cpu_views(buffer: torch.Tensor, top_k: int, hidden_size: int, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64 [K], [K, D] of `dtype`): the targets and the rows in a CPU-rows byte buffer."""
    targets = buffer[:8 * top_k].view(torch.int64)
    rows = buffer[8 * top_k:].view(dtype).view(top_k, hidden_size)
    return targets, rows
