"""The machine's limits: how much memory the host can give, and how many CPUs this process has;
and how its kernel gives huge pages (`transparent_huge_pages`, `huge_page_bytes`), which the
benchmarks report beside the CPU's read rates.

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

__all__ = ["CGROUP_MEMORY_MAX", "MemoryLimit", "available_cpus", "bytes_text", "host_limit",
           "huge_page_bytes", "transparent_huge_pages"]

# cgroup v2: the memory a container may use ("max": no limit).
CGROUP_MEMORY_MAX = "/sys/fs/cgroup/memory.max"
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


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


def huge_page_bytes(address: int, n_bytes: int) -> int:
    """About how many bytes of [address, address + n_bytes) of this process's memory the
    kernel backs with transparent huge pages now: AnonHugePages of /proc/self/smaps summed
    over the mappings that overlap the span, at most n_bytes; 0 where the kernel does not say.
    Exact where those mappings hold nothing else, as an advised `strata._vmm.HostPages`' does
    (its huge-page flag keeps the kernel from merging it with its neighbours); an unadvised
    one may share a mapping with other memory, whose huge pages would count too."""
    total, inside = 0, False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(maxsplit=1)[0]
                if not head.endswith(":"):  # a mapping's first line: "start-end perms ..."
                    lo, hi = (int(part, 16) for part in head.split("-"))
                    inside = lo < address + n_bytes and address < hi
                elif inside and head == "AnonHugePages:":
                    total += int(line.split()[1]) * 1024
    except OSError:
        return 0
    return min(total, n_bytes)


def transparent_huge_pages() -> str | None:
    """The kernel's transparent huge page mode: "always", "madvise" (only where advised, as
    `strata._vmm.HostPages` advises) or "never"; None where the kernel has none."""
    try:
        with open(THP_ENABLED) as f:
            text = f.read()
    except OSError:
        return None
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else None
