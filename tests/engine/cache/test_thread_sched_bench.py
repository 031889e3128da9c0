"""bench/thread_sched.py: what the scheduler did to the process's threads over a span, counted
from /proc for a thread that sleeps and one that computes, apart from the caller's."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from support.bench_scripts import load_bench

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/task")


def _in_a_thread(work) -> tuple[int, threading.Thread]:
    """`work` started on a thread of its own: (its native id, once it runs; the thread)."""
    ready = threading.Event()
    tid = []

    def run() -> None:
        tid.append(threading.get_native_id())
        ready.set()
        work()

    thread = threading.Thread(target=run)
    thread.start()
    ready.wait()
    return tid[0], thread


def _until_gone(tid: int, timeout_s: float = 5.0) -> None:
    """Wait until thread `tid` has left /proc/self/task: `Thread.join` returns once Python is
    done with the thread, a moment before the kernel has reaped it (CI saw the entry still
    there)."""
    deadline = time.monotonic() + timeout_s
    while os.path.exists(f"/proc/self/task/{tid}"):
        assert time.monotonic() < deadline, f"thread {tid} still listed after {timeout_s} s"
        time.sleep(0.001)


def test_a_thread_that_ends_in_the_span_is_left_out_and_the_caller_is_the_engine():
    sched = load_bench("thread_sched.py")
    go = threading.Event()
    tid, thread = _in_a_thread(lambda: (go.wait(), time.sleep(0.002)))
    before = sched.thread_scheds()
    go.set()
    thread.join()
    _until_gone(tid)
    after = sched.thread_scheds()
    assert tid in before and tid not in after
    assert sched.sched_span(before, after, engine_tid=tid)["engine"] == {}
    caller = sched.sched_span(before, after)  # the calling thread is the engine by default
    assert set(caller["engine"]) >= {"voluntary", "involuntary"}
    for group in ("engine", "others"):
        for field, value in caller[group].items():
            assert field in sched.FIELDS and value >= 0


def test_a_thread_s_sleeps_and_run_time_over_a_span_it_lives_through():
    sched = load_bench("thread_sched.py")
    go, done, leave = threading.Event(), threading.Event(), threading.Event()

    def work() -> None:
        go.wait()
        for _ in range(20):
            time.sleep(0.002)  # a voluntary switch each
        until = time.perf_counter() + 0.05
        while time.perf_counter() < until:  # runs: preemptible, never blocking
            pass
        done.set()
        leave.wait()

    tid, thread = _in_a_thread(work)
    before = sched.thread_scheds()
    go.set()
    done.wait()
    after = sched.thread_scheds()
    leave.set()
    thread.join()
    span = sched.sched_span(before, after, engine_tid=tid)
    assert 20 <= span["engine"]["voluntary"] <= 25
    assert span["engine"]["involuntary"] >= 0
    if "runnable_ms" in span["engine"]:  # where the kernel keeps it (schedstat)
        assert span["engine"]["runnable_ms"] >= 0
    # Every other thread (the caller, pytest's) is in `others`, and every thread by name.
    assert threading.get_native_id() in after and "voluntary" in span["others"]
    assert sum(counts["voluntary"] for counts in span["by_name"].values()) == \
        span["engine"]["voluntary"] + span["others"]["voluntary"]
    rounds = sched.sched_per_round(span, 4, by_name=True)
    assert rounds["engine"]["voluntary"] == span["engine"]["voluntary"] / 4
    assert set(rounds["by_name"]) == set(span["by_name"])
    line = sched.describe(rounds)
    assert line.startswith("threads a round: the engine's ") and " sleeps, " in line
    assert "; the others' " in line and " preemptions" in line
