"""A CpuWorker's team pinned one CPU a thread (`CpuWorker.team_cpus`, `_cpu_experts_pin.h`), and
`CpuExperts.pin_team`, which pins its started calls' team to the last CPUs of the process: each
thread where it was put, back on the process's CPUs when unpinned, the same bytes, and bad
values refused before anything changes."""

import contextlib
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from strata import _cpu_experts
from strata.engine.experts import ExpertStore
from strata.engine.experts.cpu import CpuExperts, default_team
from strata.engine.experts.routed import Routed

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="threads are pinned on Linux")

F, D = 16, 64


def _named_threads() -> set[int]:
    """The ids of this process's threads named `_cpu_experts.WORKER_NAME`."""
    tids = set()
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
            if (task / "comm").read_text().strip() == _cpu_experts.WORKER_NAME:
                tids.add(int(task.name))
    return tids


def _call(seed: int):
    """(blobs, experts, starts, x): a call of three bf16 experts over four rows."""
    gen = torch.Generator().manual_seed(seed)
    blobs = (torch.randn(4, 3 * F * D, generator=gen) * 0.1).bfloat16()
    x = torch.randn(4, D, generator=gen).float()
    return (blobs.view(torch.uint8).numpy(), np.array([2, 0, 3], dtype=np.int64),
            np.array([0, 1, 3, 4], dtype=np.int64), x.numpy())


def _run(worker, n_threads: int, seed: int = 1) -> torch.Tensor:
    blobs, experts, starts, x = _call(seed)
    out = torch.zeros(4, D, dtype=torch.bfloat16)
    worker.start(blobs, _cpu_experts.FORMAT_BF16, experts, starts, x,
                 out.view(torch.int16).numpy().view(np.uint16), F, n_threads)
    worker.wait()
    return out


def test_a_pinned_team_runs_each_thread_on_its_cpu_then_back_on_the_process_s():
    allowed = sorted(os.sched_getaffinity(0))
    n_threads = len(allowed)
    before = _named_threads()
    worker = _cpu_experts.CpuWorker()
    plain = _run(worker, n_threads)
    team = _named_threads() - before  # the worker's thread and its team's
    assert len(team) == n_threads
    assert all(os.sched_getaffinity(tid) == set(allowed) for tid in team)
    worker.team_cpus = np.array(allowed[::-1])  # by thread number: any order, numpy's ints
    assert worker.team_cpus == tuple(allowed[::-1])
    assert all(type(cpu) is int for cpu in worker.team_cpus)
    pinned = _run(worker, n_threads)
    masks = [os.sched_getaffinity(tid) for tid in team]
    assert all(len(mask) == 1 for mask in masks)  # one CPU each, every CPU once
    assert set().union(*masks) == set(allowed)
    assert torch.equal(pinned.view(torch.int16), plain.view(torch.int16))
    worker.team_cpus = None
    assert torch.equal(_run(worker, n_threads).view(torch.int16), plain.view(torch.int16))
    assert all(os.sched_getaffinity(tid) == set(allowed) for tid in team)
    assert os.sched_getaffinity(0) == set(allowed)  # the caller's own CPUs never changed


def test_bad_team_cpus_are_refused_and_change_nothing():
    allowed = sorted(os.sched_getaffinity(0))
    worker = _cpu_experts.CpuWorker()
    worker.team_cpus = allowed[-1:]
    for bad in ([], [allowed[0], allowed[0]], [max(allowed) + 1], ["0"], [-1], [True], 1):
        with pytest.raises(ValueError, match=r"team_cpus takes distinct CPUs this process "
                                             r"may run on \(\[.*\]\), one a thread, or None"):
            worker.team_cpus = bad
        assert worker.team_cpus == tuple(allowed[-1:])
    with pytest.raises(ValueError, match=r"a team of 2 threads, but team_cpus names 1 CPUs: "
                                         r"one a thread, or None"):
        _run(worker, 2)
    assert not worker.pending  # refused before anything was posted
    blobs, experts, starts, x = _call(2)
    out = torch.zeros(4, D, dtype=torch.bfloat16)
    worker.start(blobs, _cpu_experts.FORMAT_BF16, experts, starts, x,
                 out.view(torch.int16).numpy().view(np.uint16), F, 1)
    with pytest.raises(RuntimeError, match="a call is in flight on this CpuWorker"):
        worker.team_cpus = None
    worker.wait()
    assert worker.team_cpus == tuple(allowed[-1:])


def test_pin_team_pins_a_started_call_s_team_to_the_last_cpus_with_the_same_bytes():
    """CpuExperts' team is a quarter short of its cpu_threads (`default_team`: the caller and
    the driver keep cores), or `team_threads` where set: with `pin_team` it runs on the last
    CPUs of the process, the first left free; off again, the worker's threads are unpinned. A
    team larger than the process's CPUs is refused, naming the counts, before anything
    starts."""
    gen = torch.Generator().manual_seed(0)
    typed = (torch.randn(8, 3 * 96 * D, generator=gen) * 0.1).bfloat16()
    store = ExpertStore([typed.view(torch.uint8)], D, 96, torch.bfloat16)
    allowed = sorted(os.sched_getaffinity(0))
    cpu = CpuExperts(store, len(allowed))
    routed = Routed.of(np.array([[1, 2, 5]]))
    x = torch.randn(1, D, generator=gen).bfloat16()
    expected = cpu.compute(0, x.expand(3, -1), routed)
    assert not cpu.pin_team  # off by default
    for pin in (True, False, True):
        cpu.pin_team = pin
        out = torch.zeros(3, D, dtype=torch.bfloat16)
        assert cpu.start(0, x, routed, out)
        cpu.finish()
        assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
        team = default_team(len(allowed))
        assert cpu._worker.team_cpus == (tuple(allowed[-team:]) if pin else None)
    cpu.team_threads = 1
    assert cpu.start(0, x, routed, out)
    cpu.finish()
    assert cpu._worker.team_cpus == tuple(allowed[-1:])
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
    for bad in (0, -2, True, 2.0):
        with pytest.raises(ValueError, match=r"team_threads must be None or an int >= 1, got "):
            cpu.team_threads = bad
    assert cpu.team_threads == 1  # a refused value changes nothing
    cpu.team_threads = len(allowed) + 1
    with pytest.raises(ValueError, match=rf"pin_team: a team of {len(allowed) + 1} threads, "
                                         rf"but this process may run on {len(allowed)} CPUs; "
                                         rf"set team_threads to at most {len(allowed)}"):
        cpu.start(0, x, routed, torch.zeros(3, D, dtype=torch.bfloat16))
    assert not cpu._worker.pending


def test_the_default_team_leaves_a_quarter_of_the_threads_and_keeps_one():
    """A quarter of the threads left out (at least one), at least one in the team: 12 of 16,
    the size that took 0.89-0.93x the rounds of a team of 15 on the H200 and an H100."""
    assert [default_team(n) for n in (1, 2, 3, 4, 5, 8, 16, 64)] == [1, 1, 2, 3, 4, 6, 12, 48]
