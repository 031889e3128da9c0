"""The machine's rates that bench/offload.py's bounds are made of, measured at its start.

- the host's read bandwidth: a torch float32 sum on all threads (`_common.host_read_bytes_per_s`);
- the copy rate of pinned host memory to the device: one large copy, timed by CUDA events;
- both at once: the copy engine reads the same memory the CPU does, so pinned copies are queued
  and sums run on every thread until they are done; what the memory gave the two together
  bounds a round's misses however they are split between the CPU and the copies.

Off CUDA there is no bus: the copy figures are None.
"""

from __future__ import annotations

import time

import torch

from _common import host_read_bytes_per_s
from strata.machine import transparent_huge_pages

GB = 1e9


def copy_bytes_per_s(device: torch.device, mib: int, repeat: int = 5) -> float | None:
    """Bytes a second of one large copy from pinned host memory to `device` (None off CUDA)."""
    if device.type != "cuda":
        return None
    host = torch.ones(mib << 20, dtype=torch.uint8, pin_memory=True)
    dest = torch.empty_like(host, device=device)
    times = []
    for _ in range(repeat + 1):
        begin, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        begin.record()
        dest.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / 1000)
    del host, dest
    _release_pinned()
    return (mib << 20) / min(times[1:])


def joint_bytes_per_s(device: torch.device, mib: int, copies: int = 8) -> dict | None:
    """The host's memory read by both of a round's readers at once: `copies` pinned copies of
    `mib` MiB to `device` queued, and torch sums over a `mib` MiB host buffer run on every
    thread until the copies are done. {"cpu": the sums' bytes a second, "copy": the copies',
    "total": the two added}: what the host's memory gave both together (None off CUDA)."""
    if device.type != "cuda":
        return None
    host = torch.ones(mib << 20, dtype=torch.uint8, pin_memory=True)
    dest = torch.empty_like(host, device=device)
    buffer = torch.ones((mib << 20) // 4, dtype=torch.float32)
    buffer.sum()
    dest.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    begin, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    begin.record()
    for _ in range(copies):
        dest.copy_(host, non_blocking=True)
    end.record()
    sums = 0
    started = time.perf_counter()
    while not end.query() or sums == 0:
        buffer.sum()
        sums += 1
    cpu_s = time.perf_counter() - started
    end.synchronize()
    copy_s = begin.elapsed_time(end) / 1000
    del host, dest
    _release_pinned()
    cpu, copy = sums * buffer.numel() * 4 / cpu_s, copies * (mib << 20) / copy_s
    return {"cpu": cpu, "copy": copy, "total": cpu + copy}


def _release_pinned() -> None:
    """The pinned buffers just freed back to the system, not kept by torch's host cache."""
    if hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()


def measure_machine(device: torch.device, host_read_mib: int, copy_mib: int) -> dict:
    """The machine's figures in the JSON's `machine`: the three rates (bytes a second), torch's
    threads and the transparent huge page mode (the CPU's rate depends on its pages)."""
    return {"host_read_bytes_per_s": host_read_bytes_per_s(host_read_mib),
            "copy_bytes_per_s": copy_bytes_per_s(device, copy_mib),
            "joint_bytes_per_s": joint_bytes_per_s(device, copy_mib),
            "threads": torch.get_num_threads(),
            "transparent_huge_pages": transparent_huge_pages()}


def machine_line(machine: dict) -> str:
    """`measure_machine`'s figures in a line."""
    copy = machine["copy_bytes_per_s"]
    joint = machine["joint_bytes_per_s"]
    return (f"host read {machine['host_read_bytes_per_s'] / GB:.1f} GB/s on "
            f"{machine['threads']} threads, pinned copies "
            + (f"{copy / GB:.1f} GB/s" if copy else "none (no bus)")
            + (f"; both at once {joint['total'] / GB:.1f} GB/s (CPU {joint['cpu'] / GB:.1f}, "
               f"copies {joint['copy'] / GB:.1f})" if joint else ""))
