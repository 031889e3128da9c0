"""Where a decode round's time goes, for bench/offload.py's `--profile`: the host's Python by
function (cProfile) and the device's engines over time (torch's profiler).

`device_busy` runs a callable under torch's profiler and reduces the device's activity to three
unions of intervals: the host-to-device copies (the copy engine), everything else on the device
(kernels, memsets, device copies) and the two together, plus their overlap. Two requests that
differ only in their new tokens, profiled alike, give per-round figures by difference
(`per_round`): the prompt, the warm-up and the profiler's own start cancel out.

`host_functions` runs a callable under cProfile and returns the top functions by their own
time. cProfile adds a fixed cost to every Python call, so read its times as a ranking of where
the host's time goes, not as the time each takes without it.
"""

from __future__ import annotations

import cProfile
import io
import pstats
from collections.abc import Callable

import torch

__all__ = ["device_busy", "host_functions", "merged", "per_round"]


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of [start, end) intervals as sorted, disjoint intervals (any one unit)."""
    union: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if union and start <= union[-1][1]:
            union[-1] = (union[-1][0], max(union[-1][1], end))
        else:
            union.append((start, end))
    return union


def _union_us(intervals: list[tuple[int, int]]) -> tuple[float, list[tuple[int, int]]]:
    """(µs covered by the union of [start, end) ns intervals, the merged intervals)."""
    union = merged(intervals)
    return sum(end - start for start, end in union) / 1000, union


def _overlap_us(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> float:
    """µs where two sorted, merged interval lists overlap."""
    i = j = 0
    total = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0, end - start)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total / 1000


def device_busy(fn: Callable[[], object]) -> dict:
    """{"copies_us", "compute_us", "either_us", "both_us", "n_copies", "span_us"}: the device's
    busy time while `fn()` runs (see the module); empty off CUDA."""
    if not torch.cuda.is_available():
        return {}
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        torch.cuda.synchronize()
    copies, compute = [], []
    for event in prof.profiler.kineto_results.events():
        if event.device_type() != torch.autograd.DeviceType.CUDA:
            continue
        start = event.start_ns()
        interval = (start, start + event.duration_ns())
        (copies if "HtoD" in event.name() else compute).append(interval)
    copies_us, copies_merged = _union_us(copies)
    compute_us, compute_merged = _union_us(compute)
    either_us, either = _union_us(copies + compute)
    span_us = (either[-1][1] - either[0][0]) / 1000 if either else 0.0
    return {"copies_us": copies_us, "compute_us": compute_us, "either_us": either_us,
            "both_us": _overlap_us(copies_merged, compute_merged), "n_copies": len(copies),
            "span_us": span_us}


def per_round(short: dict, long: dict, rounds: int) -> dict:
    """Each figure of `device_busy` a round: (long - short) / rounds, the two runs differing
    only in `rounds` more decode rounds."""
    return {key: (long[key] - short[key]) / rounds for key in long}


def host_functions(fn: Callable[[], object], top: int = 30) -> str:
    """The `top` functions by own time while `fn()` runs (cProfile's table, as text)."""
    profile = cProfile.Profile()
    profile.enable()
    try:
        fn()
    finally:
        profile.disable()
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("tottime").print_stats(top)
    return text.getvalue()
