"""`HostSignal`: the wait the device's stream holds for the CPU's rows, and its host twin."""

import gc
import time

import pytest
import torch

from strata.engine.cache.host_signal import HostSignal


def test_what_is_queued_behind_a_wait_runs_at_its_set_in_order():
    signal = HostSignal("cpu")
    ran = []
    signal.behind(lambda: ran.append("now"))  # no wait pending: at once
    signal.queue_wait()
    assert signal.pending
    signal.behind(lambda: ran.append("first"))
    signal.behind(lambda: ran.append("second"))
    assert ran == ["now"]
    signal.set()
    assert ran == ["now", "first", "second"] and not signal.pending
    signal.set()  # nothing pending: nothing happens
    assert ran == ["now", "first", "second"]


def test_a_second_wait_before_the_first_is_set_is_refused():
    signal = HostSignal("cpu")
    signal.queue_wait()
    with pytest.raises(RuntimeError, match=r"queued already: set\(\) it first"):
        signal.queue_wait()
    signal.set()
    signal.queue_wait()  # the next one
    assert signal.pending


def test_one_failing_queue_behind_the_wait_still_lets_the_rest_run():
    signal = HostSignal("cpu")
    ran = []
    signal.queue_wait()
    signal.behind(lambda: (_ for _ in ()).throw(RuntimeError("injected")))
    signal.behind(lambda: ran.append("after"))
    with pytest.raises(RuntimeError, match="injected"):
        signal.set()
    assert ran == ["after"] and not signal.pending


@pytest.fixture
def collector_on():
    """The cyclic collector on, as a process has it, and as it was afterwards."""
    was_on = gc.isenabled()
    gc.enable()
    yield
    if not was_on:
        gc.disable()


def test_the_collector_is_off_while_any_wait_is_pending(collector_on):
    """A finalizer run by the collector inside the window could synchronise the device, which
    waits for the set: the collector is off from the first wait queued to the last set."""
    first, second = HostSignal("cpu"), HostSignal("cpu")
    first.queue_wait()
    assert not gc.isenabled()
    second.queue_wait()
    with pytest.raises(RuntimeError, match="queued already"):
        first.queue_wait()  # refused: holds nothing more
    first.set()
    assert not gc.isenabled()  # the second's wait still pending
    second.set()
    assert gc.isenabled()
    second.set()  # nothing pending: nothing released twice
    first.queue_wait()
    first.set()
    assert gc.isenabled()


def test_a_collector_the_process_turned_off_stays_off(collector_on):
    gc.disable()
    signal = HostSignal("cpu")
    signal.queue_wait()
    signal.set()
    assert not gc.isenabled()


def test_a_signal_dropped_with_its_wait_pending_lets_the_stream_and_the_collector_go(
        collector_on):
    signal = HostSignal("cpu")
    ran = []
    signal.queue_wait()
    signal.behind(lambda: ran.append("behind"))
    del signal
    assert ran == ["behind"] and gc.isenabled()


def test_the_values_wrap_around_32_bits():
    signal = HostSignal("cpu")
    signal._queued = 0xFFFFFFFF
    signal._value[0] = 0xFFFFFFFF
    signal.queue_wait()
    assert signal._queued == 0 and signal.pending
    signal.set()
    assert not signal.pending and int(signal._value[0]) == 0


@pytest.mark.cuda
def test_the_stream_waits_for_the_set():
    """Work queued behind the wait does not run until the host sets the signal, then does."""
    signal = HostSignal("cuda")
    src = torch.arange(1024, dtype=torch.float32, device="cuda")
    dst = torch.zeros_like(src)
    torch.cuda.synchronize()
    for _ in range(3):  # values counting up: each wait is for the next one
        dst.zero_()
        signal.queue_wait()
        signal.behind(lambda: dst.copy_(src))
        done = torch.cuda.Event()
        done.record()
        time.sleep(0.05)
        assert not done.query()  # held by the wait
        signal.set()
        done.synchronize()
        assert torch.equal(dst, src)
