"""Copies between host and device memory by address: whole expert blobs from the host store
into a device buffer (`BlobCopies`), and any kept host buffer to a device one (`ByteCopies`).

A decode call streams a few experts a layer. Through torch each copy costs two views (the
staging row, the store's row) and a `copy_` dispatch: about 15-20 µs of host time a copy on
the H200, on the path between a layer's routing read and its next graph
(bench/results/offload-host-h200-2026-12-02.md). Here a copy is one driver call,
`cuMemcpyHtoDAsync`, on torch's current stream (so ordered exactly as torch's `copy_` there
is), between addresses computed once. On the host (no device) the same addresses are copied
with `memmove`, synchronously: the host twin that the tests run.

The memory on both sides lives as long as its owner (the store, a cache's kept buffers), which
outlives every copy queued from or into it; so torch's bookkeeping of pinned blocks (which
holds a freed pinned block back until its copies are done) is not needed here. A kept host
buffer is rewritten only once the copies queued from it have run (its owner says why).
"""

from __future__ import annotations

import ctypes

import torch

from strata.engine.experts.store import ExpertStore

__all__ = ["BlobCopies", "ByteCopies"]


class ByteCopies:
    """Copies of n bytes from host memory to memory of `device`, by address (see the module):
    on CUDA queued on torch's current stream, on the host done now."""

    def __init__(self, device: torch.device) -> None:
        self._device = torch.device(device)
        self._driver = None
        if self._device.type == "cuda":
            from cuda.bindings import driver

            self._driver = driver
            if self._device.index is None:  # "cuda": the current device's stream
                self._device = torch.device("cuda", torch.cuda.current_device())

    def to_device(self, dst: int, src: int, n_bytes: int, what: str) -> None:
        """Copy n_bytes from host address `src` to device address `dst`; RuntimeError naming
        `what` (the copy, for the message) and the driver's error."""
        if self._driver is None:
            ctypes.memmove(dst, src, n_bytes)
            return
        driver = self._driver
        stream = driver.CUstream(torch._C._cuda_getCurrentRawStream(self._device.index))
        (result,) = driver.cuMemcpyHtoDAsync(dst, src, n_bytes, stream)
        if result != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuMemcpyHtoDAsync of {what} failed: "
                               f"{driver.cuGetErrorName(result)[1]}")


class BlobCopies:
    """Copies of `store`'s blobs into the rows of `dest`, uint8 [N, blob_bytes] on the
    store's compute device (see the module)."""

    def __init__(self, store: ExpertStore, dest: torch.Tensor) -> None:
        layers = [store.layer_blobs(layer) for layer in range(store.n_layers)]  # [E, blob] each
        if dest.dim() != 2 or dest.dtype != torch.uint8 or dest.shape[1] != store.blob_bytes \
                or dest.stride(1) != 1 or any(blobs.stride(1) != 1 for blobs in layers):
            raise ValueError(f"blob copies go between rows of uint8 [., {store.blob_bytes}] "
                             f"buffers with contiguous rows, got {list(dest.shape)} "
                             f"{dest.dtype}")
        self.n_bytes = store.blob_bytes
        self.n_experts = store.n_experts
        self.n_dest = dest.shape[0]
        self._sources = [(blobs.data_ptr(), blobs.stride(0)) for blobs in layers]
        self._dest, self._dest_stride = dest.data_ptr(), dest.stride(0)
        self.copies = ByteCopies(dest.device)

    def queue(self, layer: int, copies: list[tuple[int, int]]) -> None:
        """Copy each (row of dest, expert of `layer`) in `copies`, in order: on CUDA queued on
        torch's current stream, on the host done now. A run of copies into consecutive rows
        from consecutive experts is one copy where the two buffers space their rows alike (the
        run is then one span of bytes on each side: a prompt loan's misses into its lent
        slots, a layer's blobs into a slot per expert). IndexError for a row or an expert out
        of range (checked before any copy); RuntimeError naming the driver's error."""
        source, source_stride = self._sources[layer]
        copies = [(int(row), int(expert)) for row, expert in copies]
        for row, expert in copies:
            if not (0 <= row < self.n_dest and 0 <= expert < self.n_experts):
                raise IndexError(f"blob copy ({row}, {expert}) out of range: rows [0, "
                                 f"{self.n_dest}), experts [0, {self.n_experts})")
        spans = source_stride == self._dest_stride
        i = 0
        while i < len(copies):
            row, expert = copies[i]
            n = 1
            while spans and i + n < len(copies) and copies[i + n] == (row + n, expert + n):
                n += 1
            what = f"expert ({layer}, {expert})" if n == 1 else \
                f"experts ({layer}, {expert}..{expert + n - 1})"
            self.copies.to_device(self._dest + row * self._dest_stride,
                                  source + expert * source_stride,
                                  (n - 1) * source_stride + self.n_bytes, what)
            i += n
