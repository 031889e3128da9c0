"""The memory backend of a device: the one the K/V's range and the expert cache's arena share.

They must share one (`strata._vmm` moves chunks only between ranges of one backend), so both ask
here.
"""

from __future__ import annotations

import torch

from strata import _vmm

__all__ = ["device_backend"]


def device_backend(device: str | torch.device) -> _vmm.Backend:
    """The memory backend for ranges on `device` (the K/V's, the arena's): HostBackend on the CPU,
    CudaBackend on CUDA."""
    device = torch.device(device)
    if device.type == "cpu":
        return _vmm.HostBackend()
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        # torch must have created its context on the device before the backend retains it.
        torch.zeros(1, device=torch.device("cuda", index))
        return _vmm.CudaBackend(index)
    raise ValueError(f"no K/V backend for device {str(device)!r}; supported: cpu, cuda")
