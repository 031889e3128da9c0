"""A decode round's layer calls over time, for bench/offload.py's `--trace`: the host's steps of
each split call marked in torch's profiler, the device's copies and kernels beside them, and a
summary of where a layer's time goes.

`marked()` wraps the steps of `strata.engine.cache.graph_call.fill_misses` (the host's part of
a decode call between two graphs) in `torch.profiler.record_function` ranges, for as long as
it is open; the engine's code is not changed. `trace(fn, path)` runs `fn` under the profiler
with them, writes the Chrome trace (gzip) to `path` and returns `summarize`'s figures:

- each step's mean µs a layer call (`split_call` includes the routing's read, `read`);
- `between`: from the end of one call's host steps to the start of the next one's, the
  graph's replay and the device running up to the next routing;
- the device in a layer's window (from one call's start to the next's): µs busy copying to
  the device, computing, and neither.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from round_profile import merged
from strata.engine.cache import graph_call
from strata.engine.cache.host_rows import HostRows

__all__ = ["marked", "summarize", "trace"]

CALL = "fill_misses"
# (owner, attribute, label): the host's steps of a split decode call.
STEPS = [
    (graph_call, "fill_misses", CALL),
    (graph_call, "split_call", "split_call"),
    (graph_call, "start_cpu_rows", "start_cpu"),
    (graph_call, "_stage_uploads", "stage_uploads"),
    (graph_call, "finish_cpu_rows", "finish_cpu"),
    (HostRows, "stage_cpu_rows", "stage_cpu_rows"),
]


@contextlib.contextmanager
def marked() -> Iterator[None]:
    """The steps of `STEPS` in profiler ranges named by their labels, while open."""
    saved = []
    for owner, name, label in STEPS:
        real = getattr(owner, name)

        def wrapper(*args, _real=real, _label=label, **kwargs):
            with torch.profiler.record_function(_label):
                return _real(*args, **kwargs)

        saved.append((owner, name, real))
        setattr(owner, name, functools.wraps(real)(wrapper))
    try:
        yield
    finally:
        for owner, name, real in saved:
            setattr(owner, name, real)


def _covered(union: list[tuple[float, float]], lo: float, hi: float) -> float:
    return sum(max(0.0, min(end, hi) - max(start, lo)) for start, end in union)


def summarize(events: list[dict]) -> dict:
    """The figures of the module's docstring from a Chrome trace's events (µs)."""
    spans = [e for e in events if e.get("ph") == "X"]
    steps: dict[str, list[tuple[float, float]]] = {}
    for e in spans:
        if e.get("cat") == "user_annotation":
            steps.setdefault(e["name"], []).append((e["ts"], e["ts"] + e["dur"]))
    calls = sorted(steps.get(CALL, []))
    if len(calls) < 2:
        return {}
    copies = merged([(e["ts"], e["ts"] + e["dur"]) for e in spans
                     if e.get("cat") == "gpu_memcpy" and "HtoD" in e["name"]])
    computes = merged([(e["ts"], e["ts"] + e["dur"]) for e in spans
                       if e.get("cat") == "kernel"])
    either = merged(copies + computes)
    n = len(calls) - 1  # windows from one call's start to the next's
    window = [(calls[i][0], calls[i + 1][0]) for i in range(n)]
    figures = {"layer_calls": len(calls),
               "window_us": sum(hi - lo for lo, hi in window) / n,
               "between_us": sum(calls[i + 1][0] - calls[i][1] for i in range(n)) / n,
               "copies_us": sum(_covered(copies, lo, hi) for lo, hi in window) / n,
               "compute_us": sum(_covered(computes, lo, hi) for lo, hi in window) / n,
               "idle_us": sum((hi - lo) - _covered(either, lo, hi) for lo, hi in window) / n}
    for label, intervals in steps.items():
        figures[f"{label}_us"] = sum(end - start for start, end in intervals) / len(calls)
    return figures


def trace(fn: Callable[[], object], path: Path) -> dict:
    """Run `fn` under torch's profiler with the steps marked; the Chrome trace to `path`
    (gzip), `summarize`'s figures back. Empty off CUDA."""
    if not torch.cuda.is_available():
        return {}
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with marked(), torch.profiler.profile(activities=activities) as prof:
        fn()
        torch.cuda.synchronize()
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = path.with_suffix("")
    prof.export_chrome_trace(str(raw))
    text = raw.read_text()
    raw.unlink()
    with gzip.open(path, "wt") as out:
        out.write(text)
    return summarize(json.loads(text)["traceEvents"])
