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

The profiler makes the host's steps slower than they are. `clocked()` times the same steps,
and a few inside and around them, by the host's clock alone (`Clock`: about 0.2 µs a step),
for `--host-steps`: where a layer's host-side time goes in a round as it runs.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from round_profile import merged
from strata.engine.cache import graph_call
from strata.engine.cache.cached_experts import CachedExperts
from strata.engine.cache.host_rows import HostRows

__all__ = ["Clock", "clocked", "marked", "summarize", "trace"]

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


# More steps for the clock, which costs little: the routing's read (inside split_call), the
# admissions, the cache's own entry and exit around graph_call's, and each graph's launch.
CLOCKED = [
    (HostRows, "read_routing", "read"),
    (graph_call, "_admit", "admit"),
    (CachedExperts, "fill_misses", "cache_fill_misses"),
    (torch.cuda.CUDAGraph, "replay", "graph_replay"),
]


@contextlib.contextmanager
def _wrapped(steps: list[tuple[object, str, str]],
             wrap: Callable[[Callable, str], Callable]) -> Iterator[None]:
    """Each step of `steps` replaced by `wrap(real, label)` (named as the real one), while
    open."""
    saved = []
    for owner, name, label in steps:
        real = getattr(owner, name)
        saved.append((owner, name, real))
        setattr(owner, name, functools.wraps(real)(wrap(real, label)))
    try:
        yield
    finally:
        for owner, name, real in reversed(saved):
            setattr(owner, name, real)


@contextlib.contextmanager
def marked() -> Iterator[None]:
    """The steps of `STEPS` in profiler ranges named by their labels, while open."""
    def wrap(real: Callable, label: str) -> Callable:
        def wrapper(*args, **kwargs):
            with torch.profiler.record_function(label):
                return real(*args, **kwargs)
        return wrapper

    with _wrapped(STEPS, wrap):
        yield


class Clock:
    """Seconds and calls of each clocked step (a step inside another counts in both), and
    the host's time between one layer call's end and the next one's start: `gaps` within a
    round (the next graph's launch, then the call's books, which a round calls after it:
    `fill_misses`' books_after; and the device up to its routing, which the next call's read
    then waits for less), `round_gaps` from a round's last call to the next round's first
    (the last graph, the logits, the token's pick and read, the next round's start)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.gaps: list[float] = []
        self.round_gaps: list[float] = []
        self._last: tuple[int, float] | None = None  # the last call's layer and end

    def add(self, label: str, seconds: float) -> None:
        self.seconds[label] = self.seconds.get(label, 0.0) + seconds
        self.calls[label] = self.calls.get(label, 0) + 1

    def call_started(self, layer: int, now: float) -> None:
        if self._last is not None:
            last_layer, ended = self._last
            (self.gaps if layer > last_layer else self.round_gaps).append(now - ended)

    def call_ended(self, layer: int, now: float) -> None:
        self._last = (layer, now)

    def summary(self) -> dict:
        """µs a layer call of each step (`<label>_us`), `gap_us` and `round_gap_us` (means),
        and `inside_rest_us`: graph_call's call less its clocked steps (the split, the CPU's
        start and finish, the uploads, the rows' copy), the host's own work between them. The
        admissions (`admit_us`) are not subtracted: a round calls them after the call
        returns, in the gap. Empty before any call."""
        n = self.calls.get(CALL, 0)
        if not n:
            return {}
        figures = {"layer_calls": n}
        for label, seconds in self.seconds.items():
            figures[f"{label}_us"] = seconds / n * 1e6
        parts = ("split_call", "start_cpu", "stage_uploads", "finish_cpu", "stage_cpu_rows")
        figures["inside_rest_us"] = figures[f"{CALL}_us"] - sum(
            figures.get(f"{label}_us", 0.0) for label in parts)
        for name, gaps in (("gap_us", self.gaps), ("round_gap_us", self.round_gaps)):
            figures[name] = sum(gaps) / len(gaps) * 1e6 if gaps else 0.0
        return figures


@contextlib.contextmanager
def clocked(clock: Clock) -> Iterator[None]:
    """The steps of `STEPS` and `CLOCKED` timed into `clock` by `time.perf_counter`, while
    open; graph_call's call also marks the gaps between calls (its second argument is the
    layer)."""
    def wrap(real: Callable, label: str) -> Callable:
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            if label == CALL:
                clock.call_started(args[1], started)
            try:
                return real(*args, **kwargs)
            finally:
                ended = time.perf_counter()
                clock.add(label, ended - started)
                if label == CALL:
                    clock.call_ended(args[1], ended)
        return wrapper

    with _wrapped(STEPS + CLOCKED, wrap):
        yield


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
