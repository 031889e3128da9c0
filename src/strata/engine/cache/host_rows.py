"""`HostRows`: the host's side of a decode layer call's rows, with as few waits as it takes.

Dimension letters: D hidden size, R rows.

- `x_to_host`: the token's x [1, D] is copied into a host buffer kept for it (pinned on CUDA),
  asynchronously, just before the routing's read, which waits for it: the misses' inputs then
  need no second read, and no second wait, of the device. The next call rewrites the buffer
  only after this one has read it (`index_select` copies).
- `to_device`: the CPU's output rows [R, D] go to the device from pinned memory on CUDA, so the
  host issues on without waiting for the device's share (a copy from pageable memory waits for
  the stream); the caching host allocator keeps the pinned block until the copy is done.
"""

from __future__ import annotations

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

    def to_device(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [R, D] on the host, on the device (queued on the stream)."""
        if not self._pin:
            return rows.to(self.device)
        return rows.pin_memory().to(self.device, non_blocking=True)
