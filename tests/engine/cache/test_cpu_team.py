"""The caller's OpenMP pool beside the CPU's own thread: `_cpu_experts.shrink_team` lets its
idle threads go, and `CpuExperts.shrink_caller_team` does it before a call on the worker
whenever something may have grown the pool, with the same bytes."""

import gc
import json
import os
import time

import numpy as np
import torch

from strata import _cpu_experts
from strata.engine.cache.rate_calls import synthetic_store
from strata.engine.experts.cpu import CpuExperts
from strata.engine.experts.routed import Routed
from support.bench_scripts import load_bench


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _four_thread_call() -> None:
    """A call of strata's kernel on this thread's 4-thread OpenMP team."""
    f, d = 8, 16
    blobs = np.zeros((2, _cpu_experts.blob_bytes(_cpu_experts.FORMAT_BF16, f, d)), np.uint8)
    out = np.zeros((2, d), dtype=np.uint16)
    _cpu_experts.compute(blobs, _cpu_experts.FORMAT_BF16, np.array([0, 1], dtype=np.int64),
                         np.array([0, 1, 2], dtype=np.int64), np.ones((2, d), np.float32),
                         out, f, 4)


def test_shrinking_the_callers_team_lets_its_idle_threads_exit():
    gc.collect()  # no earlier test's worker thread left to stop in the middle of the counts
    _four_thread_call()  # this thread's pool: at least 3 idle threads
    grown = _threads()
    _cpu_experts.shrink_team()
    deadline = time.monotonic() + 5
    while _threads() > grown - 2 and time.monotonic() < deadline:
        time.sleep(0.01)  # released threads exit on their own
    shrunk = _threads()
    assert shrunk <= grown - 2
    _four_thread_call()  # the pool grows again for a larger team
    assert _threads() >= shrunk + 2


def test_a_call_on_the_worker_shrinks_the_callers_team_once_after_it_grew(monkeypatch):
    store = synthetic_store(64, 32, 4, torch.bfloat16, False, 1 << 16)
    cpu = CpuExperts(store, 3)
    shrunk = []
    monkeypatch.setattr(_cpu_experts, "shrink_team", lambda: shrunk.append(1))
    routed = Routed.of(np.array([[0, 2]]))
    x = torch.full((2, 64), 0.01, dtype=torch.bfloat16)

    def on_worker() -> torch.Tensor:
        out = torch.empty((2, 64), dtype=torch.bfloat16)
        assert cpu.start(0, x, routed, out)
        cpu.finish()
        return out

    expected = cpu.compute(0, x, routed)
    assert cpu.shrink_caller_team  # on by default
    assert torch.equal(on_worker(), expected) and shrunk == [1]  # grown by the compute above
    on_worker()
    assert shrunk == [1]  # nothing grew it since
    cpu.shrink_caller_team = False  # the way before: never
    cpu.compute(0, x, routed)
    assert torch.equal(on_worker(), expected) and shrunk == [1]
    cpu.shrink_caller_team = True  # the compute above grew it: shrunk at the next call
    on_worker()
    assert shrunk == [1, 1]
    cpu.compute(0, x, routed)  # this thread's team (a prompt's CPU misses)
    on_worker()
    cpu.wake()
    assert torch.equal(on_worker(), expected) and shrunk == [1, 1, 1, 1]


def test_the_sleeps_bench_reports_each_mode(capsys):
    """bench/cpu_sleeps.py runs (on the GPU machine it tells whether the shrink stops the
    worker's threads sleeping); its figures for both modes."""
    bench = load_bench("cpu_sleeps.py")
    assert bench.main(["--preset", "tiny", "--calls", "3", "--gap-us", "0", "--store-mib", "1",
                       "--threads", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [m["mode"] for m in report["modes"]] == list(bench.MODES)
    for mode in report["modes"]:
        assert mode["call_us"] > 0
        sleeps = mode["switches_per_call"]
        assert sleeps["sum"] >= sleeps["largest"] >= 0 and len(sleeps["threads"]) >= 1
