"""The memory backend of a device: the one the K/V's range and the expert cache's arena share.

They must share one (`strata._vmm` moves chunks only between ranges of one backend), so both ask
here. The host backend's chunk size is the `STRATA_VMM_CHUNK_BYTES` setting (`strata.settings`;
2 MiB when unset): `strata._vmm` does not read the environment itself.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch

from strata import _vmm, settings
from strata.machine import MemoryLimit, host_limit

__all__ = ["backend_limit", "device_backend", "given_or_own_backend", "memory_limit"]


def memory_limit(device: str | torch.device) -> MemoryLimit:
    """The most memory `device` has: the GPU's total memory on CUDA, `strata.machine.
    host_limit` on the CPU (the host backend maps host memory). What would be mapped is checked
    against it before it is mapped."""
    device = torch.device(device)
    if device.type != "cuda":
        return host_limit()
    index = device.index if device.index is not None else torch.cuda.current_device()
    _, total = torch.cuda.mem_get_info(index)
    return MemoryLimit(int(total), f"the memory of cuda:{index}")


def backend_limit(backend: _vmm.Backend) -> MemoryLimit:
    """`memory_limit` of the device whose memory `backend` maps."""
    if isinstance(backend, _vmm.CudaBackend):
        return memory_limit(torch.device("cuda", backend.device))
    return host_limit()


def device_backend(
    device: str | torch.device, environ: Mapping[str, str] | None = None
) -> _vmm.Backend:
    """The memory backend for ranges on `device` (the K/V's, the arena's): HostBackend on the CPU,
    with chunks of the `STRATA_VMM_CHUNK_BYTES` setting read from `environ` (os.environ),
    CudaBackend on CUDA (the device's granularity). SettingError for a bad chunk size."""
    device = torch.device(device)
    if device.type == "cpu":
        return _vmm.HostBackend(settings.read(environ).vmm_chunk_bytes)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        # torch must have created its context on the device before the backend retains it.
        torch.zeros(1, device=torch.device("cuda", index))
        return _vmm.CudaBackend(index)
    raise ValueError(f"no K/V backend for device {str(device)!r}; supported: cpu, cuda")


@contextmanager
def given_or_own_backend(backend: _vmm.Backend | None,
                         device: str | torch.device) -> Iterator[_vmm.Backend]:
    """`backend`, or (None) a new one for `device`, which is closed again if the block raises
    (a plan that fails must not leave a backend nobody owns)."""
    if backend is not None:
        yield backend
        return
    own = device_backend(device)
    try:
        yield own
    except BaseException:
        own.close()
        raise
