"""What the scheduler did to this process's threads over a span: the figures that tell a CPU
team that sleeps from one that is scheduled away (Linux's /proc/self/task, read by the
benchmarks; nothing of strata's).

In a decode round through the expert cache the CPU's misses run on a team of threads of their
own (`CpuExperts.start`), and a call is done when its last thread is. On the H200 the same
tree's CPU experts read 30-70 GB/s from one process to the next
(bench/results/decode-read-ahead-h200-2026-12-04.md). Two causes give that, and these counts
tell them apart, per thread, over a span such as a request:

- `voluntary`: the thread blocked (a sleep in a barrier, a futex, a read): a team whose idle
  threads fall asleep between calls shows many, each call then waiting for their wake-up;
- `involuntary`: the thread was preempted while it could run (another thread took its core);
- `runnable_ms`: the time it was ready to run but waited for a core (the second field of
  /proc/self/task/TID/schedstat, where the kernel keeps it): a team scheduled away shows it;
- `migrations`: the times it moved to another core (/proc/self/task/TID/sched, where the
  kernel has it), each costing its caches.

`sched_span(before, after)` sums them over the span for the calling thread (`engine`: the
engine's thread, which issues the device's work) and for every other thread (`others`: the
CPU's team, torch's, the CUDA driver's), and by thread name. A figure the kernel does not keep
is left out, not reported as zero.
"""

from __future__ import annotations

import os
import threading
from typing import NamedTuple

FIELDS = ("voluntary", "involuntary", "runnable_ms", "migrations")


class ThreadSched(NamedTuple):
    """One thread's counts since it started (see the module); None where the kernel keeps
    none."""

    name: str
    voluntary: int
    involuntary: int
    runnable_ms: float | None
    migrations: int | None


def thread_scheds() -> dict[int, ThreadSched]:
    """Every thread of this process now, by thread id (one that exits meanwhile is left out)."""
    threads = {}
    for entry in os.listdir("/proc/self/task"):
        try:
            threads[int(entry)] = _read(f"/proc/self/task/{entry}")
        except (FileNotFoundError, ProcessLookupError):  # exited while being read
            continue
    return threads


def sched_span(before: dict[int, ThreadSched], after: dict[int, ThreadSched],
               engine_tid: int | None = None) -> dict:
    """The counts over the span between two `thread_scheds()`: {"engine": {...}, "others":
    {...}, "by_name": {name: {...}}}, each of `FIELDS` (where kept) summed over its threads;
    a thread started in the span counts from zero, one that ended in it is not counted.
    `engine_tid`: the engine's thread (default: the calling one's)."""
    engine_tid = threading.get_native_id() if engine_tid is None else engine_tid
    groups: dict[str, dict] = {"engine": {}, "others": {}}
    by_name: dict[str, dict] = {}
    for tid, now in after.items():
        then = before.get(tid)
        for group in (groups["engine"] if tid == engine_tid else groups["others"],
                      by_name.setdefault(now.name, {})):
            for field in FIELDS:
                value = getattr(now, field)
                if value is None:
                    continue
                start = getattr(then, field) if then is not None else 0
                group[field] = group.get(field, 0) + value - (start or 0)
    return {**groups, "by_name": by_name}


def sched_per_round(span: dict, rounds: int, by_name: bool = False) -> dict:
    """`sched_span`'s figures divided by `rounds`: the engine's and the others' (and with
    `by_name`, each name's too)."""
    def divided(counts: dict) -> dict:
        return {field: value / rounds for field, value in counts.items()}

    out = {group: divided(span[group]) for group in ("engine", "others")}
    if by_name:
        out["by_name"] = {name: divided(counts) for name, counts in span["by_name"].items()}
    return out


def describe(figures: dict) -> str:
    """`sched_per_round`'s figures in words ("threads a round: the engine's ...; the
    others' ...")."""
    def words(counts: dict) -> str:
        parts = [f"{counts['voluntary']:.1f} sleeps", f"{counts['involuntary']:.1f} preemptions"]
        if "runnable_ms" in counts:
            parts.append(f"{counts['runnable_ms']:.3f} ms waiting for a core")
        if "migrations" in counts:
            parts.append(f"{counts['migrations']:.1f} migrations")
        return ", ".join(parts)

    return (f"threads a round: the engine's {words(figures['engine'])}; the others' "
            f"{words(figures['others'])}")


def _read(task: str) -> ThreadSched:
    with open(f"{task}/comm") as comm:
        name = comm.read().strip()
    counts = {}
    with open(f"{task}/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"):
                counts[key] = int(value)
    runnable_ms = migrations = None
    try:
        with open(f"{task}/schedstat") as schedstat:  # run ns, runnable-waiting ns, slices
            runnable_ms = int(schedstat.read().split()[1]) / 1e6
    except (FileNotFoundError, IndexError, ValueError):
        pass
    try:
        with open(f"{task}/sched") as sched:
            for line in sched:
                if line.startswith("se.nr_migrations"):
                    migrations = int(line.split(":")[1])
    except (FileNotFoundError, ValueError):
        pass
    return ThreadSched(name, counts["voluntary_ctxt_switches"],
                       counts["nonvoluntary_ctxt_switches"], runnable_ms, migrations)
