"""`HostRows`: the host's side of a decode layer call's rows, with as few waits as it takes.

Dimension letters: D hidden size, R rows.

- `x_to_host`: the token's x [1, D] is copied into a host buffer kept for it (pinned on CUDA),
  asynchronously, just before the routing's read, which waits for it: the misses' inputs then
  need no second read, and no second wait, of the device. The next call rewrites the buffer
  only after this one has read it (`index_select` copies).
- `to_device`: the CPU's output rows [R, D] go to the device from pinned memory on CUDA, so the
  host issues on without waiting for the device's share (a copy from pageable memory waits for
  the stream); the caching host allocator keeps the pinned block until the copy is done.
- `index_buffer` / `indices_to_device`: the call's indices, written by the books straight into
  a host buffer (pinned on CUDA, from the same allocator, so the block is not handed out again
  before its copy is done), go to the device in one copy that does not wait for the stream.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["HostRows"]


class HostRows:
    """Host copies for a cache on `device` (see the module)."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._pin = self.device.type == "cuda"
        self._x: torch.Tensor | None = None  # [1, D]

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

    def index_buffer(self, n: int) -> tuple[torch.Tensor, np.ndarray]:
        """A new int64 [n] host buffer for `indices_to_device` (pinned on CUDA), and the same
        memory as a numpy array for the host to fill."""
        if not self._pin:  # numpy's allocation is the cheaper one on the host
            array = np.empty(n, dtype=np.int64)
            return torch.from_numpy(array), array
        buffer = torch.empty(n, dtype=torch.int64, pin_memory=True)
        return buffer, buffer.numpy()

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
