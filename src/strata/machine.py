"""The machine's limits: how much memory the host can give, and how many CPUs this process has.

Sizes that come from outside (a config's layer count, `--max-context`, a file's declared array
shapes, `--cpu-threads`) are checked against these before anything is allocated or started, so
that one far beyond the machine is refused with both figures instead of failing half way (or
filling the host's memory). A leaf, like `strata.settings`: the formats, the engine and the
command line all ask here.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass

__all__ = ["CGROUP_MEMORY_MAX", "MemoryLimit", "available_cpus", "bytes_text", "host_limit"]

# cgroup v2: the memory a container may use ("max": no limit).
CGROUP_MEMORY_MAX = "/sys/fs/cgroup/memory.max"


@dataclass(frozen=True)
class MemoryLimit:
    """The most memory a device can give (`nbytes`), and what sets it, for messages ("the
    host's RAM")."""

    nbytes: int
    what: str

    def __str__(self) -> str:
        return f"{self.what} ({bytes_text(self.nbytes)})"


def bytes_text(n_bytes: int) -> str:
    """A byte count in words, in the largest binary unit under 1024 of it ("232.8 TiB")."""
    value, unit = float(n_bytes), "bytes"
    for larger in ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if value < 1024:
            break
        value, unit = value / 1024, larger
    return f"{n_bytes} bytes" if unit == "bytes" else f"{value:.1f} {unit}"


def host_limit() -> MemoryLimit:
    """The host's physical RAM, or less where an address-space limit (`ulimit -v`) or the
    container's memory limit (cgroup v2) is lower."""
    limits = [MemoryLimit(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"),
                          "the host's RAM")]
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        limits.append(MemoryLimit(soft, "the address-space limit (ulimit -v)"))
    try:
        with open(CGROUP_MEMORY_MAX) as f:
            text = f.read().strip()
    except OSError:
        text = "max"
    if text.isdigit():
        limits.append(MemoryLimit(int(text), "the container's memory limit (cgroup)"))
    return min(limits, key=lambda limit: limit.nbytes)


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, which containers narrow)."""
    return len(os.sched_getaffinity(0))
