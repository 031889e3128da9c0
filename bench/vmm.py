"""Benchmark strata._vmm: map + access, unmap + release, and a move of one chunk between ranges.

Each operation is timed on strata's ranges and on the same system or driver calls made directly
in a Python loop (the baseline: ctypes mmap/mprotect on the host, cuda-python's driver calls on
cuda, without strata's error checks and bookkeeping), alternating round by round in the same
run, and reported as µs per chunk and the ratio strata / direct. Medians of `--repeat` rounds.

    python bench/vmm.py                       # host backend
    python bench/vmm.py --backend cuda --json # on the GPU machine
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import mmap
import os
import platform
import statistics
import sys
import time

from strata import _vmm

SIZES = (1, 16, 256)


def interleaved_us(mine, theirs, repeat: int) -> tuple[float, float]:
    """Median µs of mine() and of theirs(), run alternately; each returns its timed part in ns.

    Alternating puts both sides under the same machine and driver state, round by round. The
    cyclic garbage collector is off while timing (as in `timeit`), for both sides alike.
    """
    mine(), theirs()  # warm-up
    gc.disable()
    try:
        pairs = [(mine(), theirs()) for _ in range(repeat)]
    finally:
        gc.enable()
    return (statistics.median(a for a, _ in pairs) / 1e3,
            statistics.median(b for _, b in pairs) / 1e3)


def timed_ops(map_all, unmap_all, move_one) -> dict:
    """The three timed operations of a baseline, from its untimed map-all and unmap-all steps.

    Each returns the ns of its timed part: map (creating chunks), unmap (releasing them), and
    `move_one` as given.
    """

    def map_new():
        t0 = time.perf_counter_ns()
        map_all()
        t1 = time.perf_counter_ns()
        unmap_all()
        return t1 - t0

    def unmap_release():
        map_all()
        t0 = time.perf_counter_ns()
        unmap_all()
        return time.perf_counter_ns() - t0

    return {"map": map_new, "unmap": unmap_release, "move": move_one}


# --- strata ----------------------------------------------------------------------------------


def strata_ops(backend: _vmm.Backend, n: int):
    """The timed operations on strata's ranges, and a function that frees what they use."""
    rng = backend.reserve(n * backend.chunk_bytes)
    other = backend.reserve(backend.chunk_bytes)

    def map_new():
        t0 = time.perf_counter_ns()
        rng.map(0, n)
        t1 = time.perf_counter_ns()
        for chunk in rng.unmap(0, n):
            chunk.release()
        return t1 - t0

    def unmap_release():
        rng.map(0, n)
        t0 = time.perf_counter_ns()
        for chunk in rng.unmap(0, n):
            chunk.release()
        return time.perf_counter_ns() - t0

    def move_one():
        rng.map(0, n)
        t0 = time.perf_counter_ns()
        other.map(0, 1, chunks=rng.unmap(0, 1))
        t1 = time.perf_counter_ns()
        rng.map(0, 1, chunks=other.unmap(0, 1))
        for chunk in rng.unmap(0, n):
            chunk.release()
        return t1 - t0

    def close():
        rng.close()
        other.close()

    return {"map": map_new, "unmap": unmap_release, "move": move_one}, close


# --- direct host calls (ctypes) ------------------------------------------------------------


class HostDirect:
    """The host backend's system calls made straight from Python through ctypes."""

    PROT_NONE, PROT_RW = 0, mmap.PROT_READ | mmap.PROT_WRITE
    FALLOC = 0x01 | 0x02  # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE
    ANON_RESERVE = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x4000  # MAP_NORESERVE
    MAP_FIXED = 0x10

    def __init__(self, chunk_bytes: int):
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.mmap.restype = ctypes.c_void_p
        self.libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                   ctypes.c_int, ctypes.c_long]
        self.libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self.libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
        self.chunk = chunk_bytes
        self.fd = os.memfd_create("bench", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, 1 << 33)

    def ops(self, n: int):
        libc, c = self.libc, self.chunk
        base = libc.mmap(None, n * c, self.PROT_NONE, self.ANON_RESERVE, -1, 0)
        spare = libc.mmap(None, c, self.PROT_NONE, self.ANON_RESERVE, -1, 0)
        fixed = mmap.MAP_SHARED | self.MAP_FIXED

        def map_all():
            for i in range(n):
                libc.mmap(base + i * c, c, self.PROT_NONE, fixed, self.fd, i * c)
            libc.mprotect(base, n * c, self.PROT_RW)

        def unmap_all():
            libc.mmap(base, n * c, self.PROT_NONE, self.ANON_RESERVE | self.MAP_FIXED, -1, 0)
            for i in range(n):
                libc.fallocate(self.fd, self.FALLOC, i * c, c)

        def move_one():
            map_all()
            t0 = time.perf_counter_ns()
            libc.mmap(base, c, self.PROT_NONE, self.ANON_RESERVE | self.MAP_FIXED, -1, 0)
            libc.mmap(spare, c, self.PROT_NONE, fixed, self.fd, 0)
            libc.mprotect(spare, c, self.PROT_RW)
            t1 = time.perf_counter_ns()
            libc.mmap(spare, c, self.PROT_NONE, self.ANON_RESERVE | self.MAP_FIXED, -1, 0)
            unmap_all()
            return t1 - t0

        def close():
            libc.munmap(ctypes.c_void_p(base), n * c)
            libc.munmap(ctypes.c_void_p(spare), c)

        return timed_ops(map_all, unmap_all, move_one), close


# --- direct driver calls (cuda-python) ------------------------------------------------------


class CudaDirect:
    """The cuda backend's driver calls made straight from Python through cuda-python."""

    def __init__(self, backend: _vmm.CudaBackend):
        from cuda.bindings import driver as drv

        self.drv, self.c = drv, backend.chunk_bytes
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = backend.device
        access = drv.CUmemAccessDesc()
        access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = backend.device
        access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.prop, self.access = prop, [access]

    def ops(self, n: int):
        drv, c = self.drv, self.c
        _, base = drv.cuMemAddressReserve(n * c, c, 0, 0)
        _, spare = drv.cuMemAddressReserve(c, c, 0, 0)
        base, spare = int(base), int(spare)
        handles = []

        def map_all():
            for i in range(n):
                _, h = drv.cuMemCreate(c, self.prop, 0)
                drv.cuMemMap(drv.CUdeviceptr(base + i * c), c, 0, h, 0)
                handles.append(h)
            drv.cuMemSetAccess(drv.CUdeviceptr(base), n * c, self.access, 1)

        def unmap_all(lo=0):
            for i in range(lo, n):
                drv.cuMemUnmap(drv.CUdeviceptr(base + i * c), c)
            for h in handles:
                drv.cuMemRelease(h)
            handles.clear()

        def move_one():
            map_all()
            t0 = time.perf_counter_ns()
            drv.cuMemUnmap(drv.CUdeviceptr(base), c)
            drv.cuMemMap(drv.CUdeviceptr(spare), c, 0, handles[0], 0)
            drv.cuMemSetAccess(drv.CUdeviceptr(spare), c, self.access, 1)
            t1 = time.perf_counter_ns()
            drv.cuMemUnmap(drv.CUdeviceptr(spare), c)
            unmap_all(lo=1)
            return t1 - t0

        def close():
            drv.cuMemAddressFree(drv.CUdeviceptr(base), n * c)
            drv.cuMemAddressFree(drv.CUdeviceptr(spare), c)

        return timed_ops(map_all, unmap_all, move_one), close


def run(kind: str, repeat: int) -> list[dict]:
    if kind == "cuda":
        import torch

        torch.zeros(1, device="cuda")
        backend = _vmm.CudaBackend(0)
        direct = CudaDirect(backend)
    else:
        backend = _vmm.HostBackend()
        direct = HostDirect(backend.chunk_bytes)
    rows = []
    for n in SIZES:
        mine, close_mine = strata_ops(backend, n)
        theirs, close_theirs = direct.ops(n)
        for op in ("map", "unmap", "move"):
            mine_us, theirs_us = interleaved_us(mine[op], theirs[op], repeat)
            per = 1 if op == "move" else n
            rows.append({
                "backend": kind, "chunks": n, "op": op,
                "strata_us_per_chunk": mine_us / per,
                "direct_us_per_chunk": theirs_us / per,
                "ratio": mine_us / theirs_us,
            })
        close_mine()
        close_theirs()
    backend.close()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["host", "cuda", "both"], default="host")
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    kinds = ["host", "cuda"] if args.backend == "both" else [args.backend]
    rows = [row for kind in kinds for row in run(kind, args.repeat)]
    meta = {"bench": "vmm", "python": sys.version.split()[0], "machine": platform.node(),
            "chunk_bytes": 2 << 20, "repeat": args.repeat, "date": time.strftime("%Y-%m-%d")}
    if args.json:
        print(json.dumps({**meta, "rows": rows}))
        return 0
    print(f"{'backend':8} {'chunks':>6} {'op':6} {'strata µs/chunk':>16} {'direct µs/chunk':>16} "
          f"{'ratio':>6}")
    for r in rows:
        print(f"{r['backend']:8} {r['chunks']:>6} {r['op']:6} {r['strata_us_per_chunk']:>16.2f} "
              f"{r['direct_us_per_chunk']:>16.2f} {r['ratio']:>6.2f}")
    print("(move: one chunk unmapped from one range and mapped into another, µs per move)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
