"""`HostSignal`: a word of host memory that the device's stream waits on and the host sets.

A split decode call (`strata.engine.cache.graph_call`) ends with the CPU's misses: the host
waits for them, queues their rows' copy and only then launches the next layer's graph. On the
H200 that launch held the host 30-43 µs and the graph's first kernel started 48 µs after it
(bench/results/decode-read-ahead-h200-2026-12-04.md), a layer's critical path after the CPU
is done. With a signal the order on the stream stays the same but the host issues it early:
a wait for the signal's next value (`cuStreamWaitValue32`), the rows' copy, the next graph,
all queued while the CPU still computes; the host sets the value once the rows are written
(`set`), and the device runs on from there without the host in between.

The rule that keeps it from hanging: between `queue_wait` and `set` the host waits for
nothing the device does after the wait (no read of the device, no synchronisation); `set` is
called on every path, errors included (`graph_call` does it in `finally`), and a signal
dropped with its wait pending sets it then. Code the caller does not see could break the rule:
Python's cyclic garbage collector runs finalizers in whichever thread allocates, and a
finalizer may synchronise the device (registered host pages unlock only once the device is
idle, `_vmm.HostPages.unregister`). So the collector is off while any signal's wait is
pending, and back as it was once none is (a finalizer due then runs after the `set`).

The word is pinned and mapped (torch's pinned memory is, under unified addressing); the values
count up by one a wait, compared cyclically (`CU_STREAM_WAIT_VALUE_GEQ`), so a wait never
passes on an old value. On the host (no device) there is no stream: what would be queued behind
the wait (`behind`) is kept and run by `set`, in order, so the host twin runs the same steps
in the device's order.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable

import numpy as np
import torch

__all__ = ["HostSignal"]

_WAIT_GEQ = 0  # CU_STREAM_WAIT_VALUE_GEQ: (int32_t)(*addr - value) >= 0

# The cyclic collector's hold (see the module): how many waits are pending, over every
# signal of the process, and whether the collector was on when the first was queued.
_hold_lock = threading.Lock()
_holds = 0
_collector_was_on = False


def _hold_collector() -> None:
    global _holds, _collector_was_on
    with _hold_lock:
        if _holds == 0:
            _collector_was_on = gc.isenabled()
            gc.disable()
        _holds += 1


def _release_collector() -> None:
    global _holds
    with _hold_lock:
        _holds -= 1
        if _holds == 0 and _collector_was_on:
            gc.enable()


class HostSignal:
    """A signal for the stream of `device` (see the module)."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self._word = torch.zeros(1, dtype=torch.int32, pin_memory=cuda)
        self._value = self._word.numpy().view(np.uint32)  # the same memory, for the host
        self._queued = 0  # the value of the last wait queued (uint32, cyclic)
        self._behind: list[Callable[[], None]] = []  # on the host: what waits for `set`
        self._driver = None
        if cuda:
            from cuda.bindings import driver

            self._driver = driver
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            result, self._address = driver.cuMemHostGetDevicePointer(self._word.data_ptr(), 0)
            _check(driver, result, "mapping the signal's word (cuMemHostGetDevicePointer)")

    @property
    def pending(self) -> bool:
        """Whether a wait is queued that `set` has not yet let past."""
        return int(self._value[0]) != self._queued

    def queue_wait(self) -> None:
        """Queue on torch's current stream a wait for the next value: work queued after it
        runs once `set` is called. RuntimeError while a wait is pending, or naming the
        driver's error (nothing queued then)."""
        if self.pending:
            raise RuntimeError("a signal's wait is queued already: set() it first")
        value = (self._queued + 1) & 0xFFFFFFFF
        if self._driver is not None:
            driver = self._driver
            stream = driver.CUstream(torch._C._cuda_getCurrentRawStream(self.device.index))
            (result,) = driver.cuStreamWaitValue32(stream, self._address, value, _WAIT_GEQ)
            _check(driver, result, "queueing the wait for the CPU's rows (cuStreamWaitValue32)")
        _hold_collector()  # only once the wait is queued: a refused one holds nothing
        self._queued = value

    def behind(self, queue: Callable[[], None]) -> None:
        """Run `queue` (work it queues on the stream) behind the pending wait: on CUDA now,
        since the stream orders it after the wait; on the host at `set`."""
        if self._driver is not None or not self.pending:
            queue()
        else:
            self._behind.append(queue)

    def set(self) -> None:
        """Let the stream past the pending wait (nothing when none is pending); on the host,
        run what was queued behind it, in order. Every one of them runs even if one raises
        (the first error is raised after)."""
        if not self.pending:
            return
        self._value[0] = self._queued
        _release_collector()
        behind, self._behind = self._behind, []
        error = None
        for queue in behind:
            try:
                queue()
            except BaseException as exc:  # raised after the rest has run
                error = error or exc
        if error is not None:
            raise error

    def __del__(self) -> None:
        # Dropped with its wait pending (a path that missed its `set`): the stream, and the
        # collector, are let go rather than held for good.
        if "_queued" in self.__dict__ and self.pending:
            self.set()


def _check(driver, result, what: str) -> None:
    if result != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what} failed: {driver.cuGetErrorName(result)[1]}")
