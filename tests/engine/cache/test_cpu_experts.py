"""The CPU miss path: each expert once over its rows, the same bytes call after call at the
set thread count; bf16 experts of few rows through strata's kernel, the rest through torch;
bench/cpu_experts.py runs and reports its ratios.

The thread count itself may change torch's bytes (fp32 at 64 tokens, 1 against 2 threads,
here): `--cpu-threads` is part of what a run's output depends on."""

import json
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from strata import _cpu_experts, settings
from strata.engine.experts import ExpertStore
from strata.engine.experts.cpu import KERNEL_MAX_ROWS, CpuExperts
from strata.engine.experts.routed import Routed
from support.bench_scripts import load_bench


def _store(dtype):
    gen = torch.Generator().manual_seed(0)
    d, f, e = 64, 96, 8
    typed = (torch.randn(e, 3 * f * d, generator=gen) * 0.1).to(dtype)
    return ExpertStore([typed.view(torch.uint8)], d, f, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n_tokens", [1, 64])
def test_each_expert_runs_once_over_its_rows_at_the_set_thread_count(dtype, n_tokens):
    store = _store(dtype)
    rng = np.random.default_rng(n_tokens)
    ids = np.stack([rng.choice(store.n_experts, 2, replace=False) for _ in range(n_tokens)])
    routed = Routed.of(ids)
    x_rows = torch.randn(routed.n_rows, store.hidden_size,
                         generator=torch.Generator().manual_seed(1)).to(dtype)
    caller_threads = torch.get_num_threads()
    f = store.expert_width
    for threads in (None, 1):
        cpu = CpuExperts(store, threads, kernel="torch")
        first = cpu.compute(0, x_rows, routed)
        assert torch.get_num_threads() == caller_threads  # the caller's count is given back
        assert torch.equal(cpu.compute(0, x_rows, routed).view(torch.uint8),
                           first.view(torch.uint8))
        # Each expert's rows are its output for their inputs, computed over all of them at
        # once, at the thread count of the call (the count may change the bytes).
        torch.set_num_threads(threads or caller_threads)
        try:
            for i, expert in enumerate(routed.experts.tolist()):
                lo, hi = int(routed.starts[i]), int(routed.starts[i + 1])
                gate, up, down = store.weights(0, expert)
                h = F.linear(x_rows[lo:hi], torch.cat((gate, up)))
                expected = F.linear(F.silu(h[:, :f]) * h[:, f:], down)
                assert torch.equal(first[lo:hi], expected)
        finally:
            torch.set_num_threads(caller_threads)


def _torch_rows(store, x_rows, routed, i):
    f = store.expert_width
    lo, hi = int(routed.starts[i]), int(routed.starts[i + 1])
    gate, up, down = store.weights(0, int(routed.experts[i]))
    h = F.linear(x_rows[lo:hi], torch.cat((gate, up)))
    return F.linear(F.silu(h[:, :f]) * h[:, f:], down)


def test_bf16_experts_of_few_rows_go_to_the_kernel_and_the_others_to_torch():
    store = _store(torch.bfloat16)
    # Expert 1 has KERNEL_MAX_ROWS + 1 rows (torch), experts 2 and 5 fewer (the kernel).
    n_tokens = KERNEL_MAX_ROWS + 1
    ids = np.array([[1, 2 if t % 2 else 5] for t in range(n_tokens)])
    routed = Routed.of(ids)
    x_rows = torch.randn(routed.n_rows, store.hidden_size,
                         generator=torch.Generator().manual_seed(1)).bfloat16()
    cpu = CpuExperts(store)
    assert cpu.kernel == "strata"
    out = cpu.compute(0, x_rows, routed)
    assert torch.equal(cpu.compute(0, x_rows, routed), out)
    assert routed.experts.tolist() == [1, 2, 5]
    lo, hi = int(routed.starts[1]), int(routed.starts[1 + 1])
    assert torch.equal(out[: routed.starts[1]], _torch_rows(store, x_rows, routed, 0))
    # The kernel's experts alone, through the same call: the same bytes as in the mixed call.
    kernel_only = Routed.of(ids[:, 1:])
    alone = cpu.compute(0, x_rows[lo:], kernel_only)
    assert torch.equal(out[lo:], alone)
    for i in (1, 2):
        expected = _torch_rows(store, x_rows, routed, i)
        got = out[int(routed.starts[i]) : int(routed.starts[i + 1])]
        assert torch.allclose(got.float(), expected.float(), rtol=2**-5, atol=2**-5)
    # torch's path, asked for, gives torch's bytes for every expert.
    torch_out = CpuExperts(store, kernel="torch").compute(0, x_rows, routed)
    for i in range(3):
        lo, hi = int(routed.starts[i]), int(routed.starts[i + 1])
        assert torch.equal(torch_out[lo:hi], _torch_rows(store, x_rows, routed, i))


def test_the_cpu_s_own_thread_takes_a_bf16_call_only_when_every_expert_has_few_rows():
    """`start` takes a decode call (one row an expert, known from R == M without counting
    them) and a call whose experts have up to KERNEL_MAX_ROWS rows each; it refuses, starting
    nothing, a call with one expert past that (the engine's thread computes it then). What it
    takes gives `compute`'s bytes."""
    store = _store(torch.bfloat16)
    cpu = CpuExperts(store, 2)
    gen = torch.Generator().manual_seed(2)
    one_each = Routed.of(np.array([[1, 2, 5]]))  # R == M: a decode call
    few = Routed.of(np.array([[1, 2], [1, 5]]))  # expert 1 has 2 rows, the others 1
    many = Routed.of(np.array([[1, 2]] * (KERNEL_MAX_ROWS + 1)))
    for routed, taken in ((one_each, True), (few, True), (many, False)):
        x_rows = torch.randn(routed.n_rows, store.hidden_size, generator=gen).bfloat16()
        out = torch.full((routed.n_rows, store.hidden_size), 7.0, dtype=torch.bfloat16)
        assert cpu.start(0, x_rows, routed, out) is taken
        if taken:
            cpu.finish()
            assert torch.equal(out, cpu.compute(0, x_rows, routed))
        else:
            assert (out == 7.0).all()  # nothing started, nothing written


def test_started_decode_calls_reuse_kept_buffers_and_a_second_start_disturbs_none():
    """`start` copies a one-token call's input into a kept float32 buffer and keeps the views
    of the `out`s it was given: calls after one another, with new tokens, new experts and
    `out`s that alias the same memory or not, each give `compute`'s bytes; a start while a
    call is in flight is refused before it touches what that call reads."""
    store = _store(torch.bfloat16)
    cpu = CpuExperts(store, 2)
    gen = torch.Generator().manual_seed(3)
    kept = torch.empty((store.n_experts, store.hidden_size), dtype=torch.bfloat16)
    for step, ids in enumerate(([1, 2, 5], [0, 7], [3, 4, 6], [2, 5])):
        routed = Routed.of(np.array([ids]))
        x = torch.randn(1, store.hidden_size, generator=gen).bfloat16()  # [1, D]
        out = kept[:routed.n_rows] if step % 2 == 0 else torch.empty_like(kept[:routed.n_rows])
        assert cpu.start(0, x, routed, out)
        if step == 2:  # in flight: refused, the call's input and output untouched
            other = torch.randn(1, store.hidden_size, generator=gen).bfloat16()
            with pytest.raises(RuntimeError, match="a call is in flight"):
                cpu.start(0, other, Routed.of(np.array([[0, 1, 2]])), kept[:3])
            assert torch.equal(cpu._x_float, x.float())  # the kept input is still this call's
        cpu.finish()
        expected = cpu.compute(0, x.expand(routed.n_rows, -1), routed)
        assert torch.equal(out.view(torch.int16), expected.view(torch.int16))


def test_the_kernel_is_chosen_by_argument_or_strata_cpu_kernel(monkeypatch):
    store = _store(torch.bfloat16)
    assert CpuExperts(store).kernel == "strata"
    monkeypatch.setenv("STRATA_CPU_KERNEL", "torch")
    assert CpuExperts(store).kernel == "torch"
    assert CpuExperts(store, kernel="strata").kernel == "strata"
    assert CpuExperts(_store(torch.float32), kernel="strata").kernel == "torch"  # bf16 only
    monkeypatch.setenv("STRATA_CPU_KERNEL", "mkl")
    with pytest.raises(settings.SettingError, match="STRATA_CPU_KERNEL='mkl': want strata or "
                                                    "torch"):
        CpuExperts(store)
    with pytest.raises(ValueError, match="kernel must be 'strata' or 'torch', got 'fast'"):
        CpuExperts(store, kernel="fast")


def test_a_bad_thread_count_is_refused():
    for bad in (0, -1, True):
        with pytest.raises(ValueError, match="cpu_threads must be None or an int >= 1"):
            CpuExperts(_store(torch.float32), bad)


def test_every_schedule_gives_the_same_bytes_and_a_bad_one_is_refused_when_set():
    store = _store(torch.bfloat16)
    cpu = CpuExperts(store, 3)
    routed = Routed.of(np.array([[1, 3], [3, 6]]))
    x = torch.randn(4, store.hidden_size, generator=torch.Generator().manual_seed(7)).bfloat16()
    assert cpu.schedule == "dynamic"  # the default
    dynamic = cpu.compute(0, x, routed)
    for name in ("static", "guided", "steal"):
        cpu.schedule = name
        assert torch.equal(cpu.compute(0, x, routed).view(torch.int16), dynamic.view(torch.int16))
    with pytest.raises(ValueError, match=r"schedule must be one of \['dynamic', 'guided', "
                                         r"'static', 'steal'\], got 'fast'"):
        cpu.schedule = "fast"
    assert cpu.schedule == "steal"  # unchanged by the refused name


def test_prefetching_the_weights_changes_no_byte_and_a_bad_distance_is_refused_when_set():
    """`CpuExperts.prefetch_bytes` reaches the kernel of a call and of a started one."""
    store = _store(torch.bfloat16)
    cpu = CpuExperts(store, 3)
    routed = Routed.of(np.array([[1, 3], [3, 6]]))
    x = torch.randn(4, store.hidden_size, generator=torch.Generator().manual_seed(7)).bfloat16()
    assert cpu.prefetch_bytes == _cpu_experts.PREFETCH_BYTES == 4096  # the default
    cpu.prefetch_bytes = 0  # the hardware's prefetchers alone
    plain = cpu.compute(0, x, routed)
    cpu.prefetch_bytes = 1024
    assert torch.equal(cpu.compute(0, x, routed).view(torch.int16), plain.view(torch.int16))
    out = torch.empty_like(plain)
    assert cpu.start(0, x, routed, out)
    cpu.finish()
    assert torch.equal(out.view(torch.int16), plain.view(torch.int16))
    assert not cpu.keep_team_up  # off by default; set, it reaches the next started call
    cpu.keep_team_up = True
    assert cpu.start(0, x, routed, out)
    cpu.finish()
    assert cpu._worker.keep_team_up
    assert torch.equal(out.view(torch.int16), plain.view(torch.int16))
    for bad in (-64, 100, 64.0):
        with pytest.raises(ValueError, match=r"prefetch_bytes must be a multiple of 64 \(a "
                                             r"cache line\) >= 0, got"):
            cpu.prefetch_bytes = bad
    assert cpu.prefetch_bytes == 1024  # unchanged by the refused values


def test_reading_weight_rows_at_once_changes_no_byte_and_a_bad_count_is_refused_when_set():
    """`CpuExperts.gate_up_rows`, `down_rows` and `down_block_rows` reach the kernel of a call
    and of a started one, and the last the count of its tasks."""
    store = _store(torch.bfloat16)
    cpu = CpuExperts(store, 3)
    routed = Routed.of(np.array([[1, 3], [3, 6]]))
    x = torch.randn(4, store.hidden_size, generator=torch.Generator().manual_seed(7)).bfloat16()
    assert (cpu.gate_up_rows, cpu.down_rows) == (_cpu_experts.GATE_UP_ROWS,
                                                 _cpu_experts.DOWN_ROWS) == (1, 1)  # defaults
    assert cpu.down_block_rows == _cpu_experts.DOWN_BLOCK_ROWS == 64
    one = Routed.of(np.array([[1, 3]]))  # a decode call: one token's row
    assert cpu.tasks(one) == 2 * (96 // 16 + 1)  # F = 96, D = 64: M * (6 + down in one task)
    alone, alone_one = cpu.compute(0, x, routed), cpu.compute(0, x[:1], one)
    out = torch.empty_like(alone_one)
    for gate_up, down, block in [(2, 1, 16), (4, 2, 32), (1, 4, 64), (1, 1, 16)]:
        cpu.gate_up_rows, cpu.down_rows, cpu.down_block_rows = gate_up, down, block
        assert torch.equal(cpu.compute(0, x, routed).view(torch.int16), alone.view(torch.int16))
        assert cpu.start(0, x[:1], one, out)
        cpu.finish()
        assert torch.equal(out.view(torch.int16), alone_one.view(torch.int16))
    assert cpu.tasks(one) == 2 * (96 // 16 + 64 // 16)  # down's 64 rows 16 a task: 6 + 4
    for name in ("gate_up_rows", "down_rows"):
        for bad in (0, 3, 8, True, 2.0):
            with pytest.raises(ValueError, match=rf"{name} must be 1, 2 or 4, got"):
                setattr(cpu, name, bad)
    for bad in (0, 24, 2048, 32.0, True):
        with pytest.raises(ValueError, match=r"down_block_rows must be a multiple of 16 from 16 "
                                             r"to 1024, got"):
            cpu.down_block_rows = bad
    assert (cpu.gate_up_rows, cpu.down_rows, cpu.down_block_rows) == (1, 1, 16)  # unchanged
    with pytest.raises(ValueError, match=r"down_block_rows must be >= 1, got 0"):
        _cpu_experts.n_tasks(2, 96, 64, 0)


def test_the_cpu_experts_bench_runs_and_reports(capsys):
    bench = load_bench("cpu_experts.py")
    assert bench.main(["--preset", "tiny", "--repeat", "1", "--tokens", "1,4", "--read-mib", "8",
                       "--weight-rows", "4x1,1x2", "--down-block-rows", "64", "--pin",
                       "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [(run["dtype"], run["tokens"]) for run in result["runs"]] == [
        ("bf16", 1), ("bf16", 4), ("fp32", 1), ("fp32", 4)]
    for run in result["runs"]:
        assert run["experts"] >= 1 and run["rows"] == run["tokens"] * 2
        assert run["ratio_to_bare"]["bare"] == 1.0
        quantized = {"kernel-int8", "kernel-int4", "kernel-int8-steal", "kernel-int4-steal",
                     "compute-int8", "compute-int4"} if run["dtype"] == "bf16" else set()
        # The worker path's columns: decode calls (T = 1) through strata's kernel (bf16).
        started = {f"start-{schedule}{suffix}" for schedule in ("dynamic", "steal", "steal-alone",
                                                               "dynamic-rows4x1", "steal-rows4x1",
                                                               "dynamic-rows1x2", "steal-rows1x2",
                                                               "dynamic-downblock64",
                                                               "steal-downblock64",
                                                               "dynamic-pinned")
                   for suffix in ("", "-int8", "-int4")} \
            if run["dtype"] == "bf16" and run["tokens"] == 1 else set()
        assert set(run["us_per_expert"]) == set(run["gbps"]) == {
            "bare", "compute-torch", "compute-main", "compute-static", "compute-guided",
            "compute-steal",
            "compute-worker", "worker-main-busy", *quantized, *started}
        if started:  # a quantized column's GB/s counts its blobs' bytes, the others the store's
            bytes_of = {name: run["gbps"][name] * run["us_per_expert"][name]
                        for name in ("start-steal", "start-steal-int8", "compute-int8",
                                     "kernel-int8-steal")}
            assert bytes_of["start-steal-int8"] == pytest.approx(bytes_of["compute-int8"]) \
                == pytest.approx(bytes_of["kernel-int8-steal"])
            assert bytes_of["start-steal-int8"] < 0.6 * bytes_of["start-steal"]
        assert run["kernel"] == ("strata" if run["dtype"] == "bf16" else "torch")
        # Where the started calls' time went, to compare with a round's (`cpu_parts`).
        assert set(run["start_parts"]) == started
        for parts in run["start_parts"].values():
            assert parts["run_us"] > 0 and parts["run_gb_s"] > 0 and parts["pass1_gb_s"] > 0
            assert min(parts["team_up_us"], parts["hand_over_us"], parts["noticed_us"]) >= 0
    assert result["host_read_gbps"] > 0
    bench.print_report(result, result["host_read_gbps"], 8, (), tuple(bench.QUANTIZED))
    assert re.search(r"start-dynamic-int8 \(T = 1, \d+ experts, gap 0 us, pageable\): run \d+ us "
                     r"at [\d.]+ GB/s \(gate and up [\d.]+, down [\d.]+\), team up [\d.]+ us, "
                     r"hand-over [\d.]+, noticed [\d.]+", capsys.readouterr().out)
    assert bench.main(["--preset", "tiny", "--repeat", "1", "--dtypes", "fp32",
                       "--tokens", "1", "--read-mib", "8"]) == 0
    assert "| pageable | fp32 | 1 |" in capsys.readouterr().out


def test_the_cpu_experts_bench_times_small_calls_after_gaps_with_and_without_a_wake(capsys):
    bench = load_bench("cpu_experts.py")
    assert bench.main(["--preset", "tiny", "--repeat", "1", "--dtypes", "bf16", "--tokens", "2",
                       "--experts", "1", "--gap-us", "0,300", "--wake-us", "100",
                       "--read-mib", "8", "--json"]) == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    # T = 2 over the preset's K experts, then T = 1 over 1; each without a gap, after a gap,
    # and after a gap with a wake (no wake for a gap no longer than it).
    assert [(r["tokens"], r["experts"], r["gap_us"], r["wake_us"]) for r in runs] == [
        (2, runs[0]["experts"], 0.0, None), (2, runs[0]["experts"], 300.0, None),
        (2, runs[0]["experts"], 300.0, 100.0), (1, 1, 0.0, None), (1, 1, 300.0, None),
        (1, 1, 300.0, 100.0)]
    for bad in (["--gap-us", "-1"], ["--experts", "two"], ["--experts", "0"]):
        with pytest.raises(SystemExit):
            bench.main(["--preset", "tiny", *bad])


def test_waking_the_kernels_threads_changes_no_byte():
    """`CpuExperts.wake` starts the kernel's team and nothing else: the same bytes after it;
    a bad thread count is refused; on torch's path it does nothing."""
    from strata import _cpu_experts

    store = _store(torch.bfloat16)
    cpu = CpuExperts(store, 2)
    routed = Routed.of(np.array([[1, 3]]))
    x = torch.randn(2, store.hidden_size, generator=torch.Generator().manual_seed(5)).bfloat16()
    before = cpu.compute(0, x, routed)
    cpu.wake()
    assert torch.equal(cpu.compute(0, x, routed), before)
    with pytest.raises(ValueError, match="n_threads must be >= 1, got 0"):
        _cpu_experts.wake(0)
    CpuExperts(_store(torch.float32), 2).wake()  # torch's path: nothing to start


def test_the_dot_stream_bench_builds_runs_and_each_row_keeps_its_bits(capsys):
    """bench/dot_stream.py compiles bench/dot_stream.c against the kernel's own dot products
    and runs its grid; every run of a format, row and thread count gives the same checksum (the
    XOR of each row's dot product's bits) at any rows at once, layout, prefetch distance and
    schedule."""
    bench = load_bench("dot_stream.py")
    assert bench.main(["--formats", "int8,bf16", "--row-bytes", "768,192", "--prefetch",
                       "0,4096", "--threads", "1,2", "--weight-mib", "2", "--repeat", "1",
                       "--json"]) == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    # Per format, row, prefetch, threads and schedule: one at a time, then 2 and 4 adjacent
    # and apart.
    assert len(runs) == 2 * 2 * 2 * 2 * 2 * 5  # at --block-rows 16, the default
    assert {run["schedule"] for run in runs} == {"parts", "dynamic"}
    checksums = {}
    for run in runs:
        assert run["gb_s"] > 0 and 1 << 20 < run["weight_bytes"] <= 2 << 20  # whole blocks
        key = run["format"], run["row_bytes"], run["threads"]  # the weights each thread writes
        checksums.setdefault(key, set()).add(run["checksum"])
    assert all(len(sums) == 1 for sums in checksums.values()), checksums
    assert bench.main(["--weight-mib", "1", "--repeat", "1", "--threads", "1", "--row-bytes",
                       "256", "--prefetch", "0", "--block-rows", "16,64"]) == 0
    table = capsys.readouterr().out
    assert "| int8 | 256 | 0 | 1 | dynamic | 16 | 4 | apart |" in table
    assert "| int8 | 256 | 0 | 1 | parts | 64 | 2 | adjacent |" in table
    with pytest.raises(SystemExit):
        bench.main(["--row-bytes", "100"])  # not a multiple of 64
    assert "--row-bytes and --prefetch multiples of 64" in capsys.readouterr().err
