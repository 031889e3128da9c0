"""bench/round_trace.py: its marks wrap the decode call's host steps while open and only then,
and its summary reads a trace's layer windows as the module says."""

from __future__ import annotations

import pytest
import torch

from strata.engine.cache import graph_call
from strata.engine.cache.host_rows import HostRows
from support.bench_scripts import load_bench


def _span(name, cat, ts, dur):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur}


def test_marks_name_the_steps_in_the_profiler_and_come_off_after():
    bench = load_bench("round_trace.py")
    before = graph_call.split_call, graph_call.fill_misses, HostRows.stage_cpu_rows
    with bench.marked():
        assert graph_call.split_call is not before[0]
        assert graph_call.split_call.__name__ == "split_call"  # functools.wraps
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            graph_call._stage_uploads(_NoCache(), 0, _NoCall(), 4, None)
        assert "stage_uploads" in {event.name for event in prof.events()}
    assert (graph_call.split_call, graph_call.fill_misses, HostRows.stage_cpu_rows) == before


class _NoCache:
    """The least a cache needs for `_stage_uploads` to do nothing."""

    prefetch = None
    streamer = None

    class store:
        blob_bytes = 1


class _NoCall:
    def streamed(self, top_k):
        return None


def test_the_summary_reads_each_layer_window():
    bench = load_bench("round_trace.py")
    events = [
        # Two layer calls' host steps: [0, 100) and [300, 380), a third starting at 600.
        _span("fill_misses", "user_annotation", 0, 100),
        _span("split_call", "user_annotation", 0, 40),
        _span("fill_misses", "user_annotation", 300, 80),
        _span("split_call", "user_annotation", 300, 20),
        _span("fill_misses", "user_annotation", 600, 50),
        # The device: copies [50, 250) and [350, 450), kernels [200, 280) and [500, 560).
        _span("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", 50, 200),
        _span("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", 350, 100),
        _span("Memcpy DtoH (Device -> Pageable)", "gpu_memcpy", 280, 10),  # not a copy in
        _span("some_kernel", "kernel", 200, 80),
        _span("some_kernel", "kernel", 500, 60),
    ]
    figures = bench.summarize(events)
    assert figures["layer_calls"] == 3
    assert figures["window_us"] == 300  # [0, 300) and [300, 600)
    assert figures["between_us"] == (200 + 220) / 2
    assert figures["copies_us"] == (200 + 100) / 2
    assert figures["compute_us"] == (80 + 60) / 2
    # Busy [50, 280) in the first window, [350, 450) and [500, 560) in the second.
    assert figures["idle_us"] == ((300 - 230) + (300 - 160)) / 2
    assert figures["fill_misses_us"] == (100 + 80 + 50) / 3
    assert figures["split_call_us"] == (40 + 20) / 3
    assert bench.summarize(events[:1]) == {}


def test_the_clock_times_the_steps_while_open_and_comes_off_after():
    bench = load_bench("round_trace.py")
    before = (graph_call._stage_uploads, graph_call.fill_misses, HostRows.read_routing,
              torch.cuda.CUDAGraph.replay)
    clock = bench.Clock()
    with bench.clocked(clock):
        assert graph_call._stage_uploads.__name__ == "_stage_uploads"
        for _ in range(3):
            graph_call._stage_uploads(_NoCache(), 0, _NoCall(), 4, None)
    assert (graph_call._stage_uploads, graph_call.fill_misses, HostRows.read_routing,
            torch.cuda.CUDAGraph.replay) == before
    assert clock.calls == {"stage_uploads": 3}
    assert clock.seconds["stage_uploads"] > 0
    assert clock.summary() == {}  # no layer call


def test_the_clock_marks_a_layer_call_and_the_gaps_between_calls():
    bench = load_bench("round_trace.py")
    clock = bench.Clock()
    calls = []

    def fake_fill_misses(cache, layer, *rest):
        calls.append(layer)
        return None

    real = graph_call.fill_misses
    graph_call.fill_misses = fake_fill_misses
    try:
        with bench.clocked(clock):
            for layer in (0, 1, 2, 0, 1, 2):  # two rounds of three layers
                graph_call.fill_misses(None, layer, None, None, None, None, None)
    finally:
        graph_call.fill_misses = real
    assert calls == [0, 1, 2, 0, 1, 2]
    assert len(clock.gaps) == 4 and len(clock.round_gaps) == 1
    summary = clock.summary()
    assert summary["layer_calls"] == 6
    assert summary["gap_us"] > 0 and summary["round_gap_us"] > 0


def test_the_clock_summary_divides_by_the_layer_calls():
    bench = load_bench("round_trace.py")
    clock = bench.Clock()
    for _ in range(4):
        clock.add("fill_misses", 100e-6)
        clock.add("split_call", 30e-6)
        clock.add("read", 20e-6)  # inside split_call: not subtracted again
        clock.add("finish_cpu", 50e-6)
        clock.add("admit", 5e-6)  # in the gap, after the call (books_after): not subtracted
    clock.gaps = [10e-6, 30e-6]
    summary = clock.summary()
    assert summary["fill_misses_us"] == pytest.approx(100)
    assert summary["inside_rest_us"] == pytest.approx(100 - 30 - 50)
    assert summary["gap_us"] == pytest.approx(20)
    assert summary["round_gap_us"] == 0.0
