"""bench/offload.py runs its docstring's CPU example and reports every figure it names (no GPU
here: no copy rate, so no streamed misses and no upload bound), so a GPU session does not find
it broken; so does bench/stream_issue.py, on the host twin; bench/rounds.py and
bench/split_model.py read what it writes."""

from __future__ import annotations

import argparse
import json
import os
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from strata.engine.cache import graph_call
from strata.engine.cache.rates import MissRates
from strata.engine.experts.cpu import CpuExperts
from strata.machine import transparent_huge_pages
from support.bench_scripts import load_bench


@pytest.fixture
def offload_bench(monkeypatch):
    """bench/offload.py loaded, the STRATA_LOAN_KEEP_SLOTS it sets put back after the test."""
    monkeypatch.setenv("STRATA_LOAN_KEEP_SLOTS", "1")
    monkeypatch.delenv("STRATA_LOAN_KEEP_SLOTS")
    return load_bench("offload.py")


def test_the_offload_bench_runs_and_reports(capsys, offload_bench):
    bench = offload_bench
    argv = ["--preset", "tiny", "--device", "cpu", "--new-tokens", "6", "--prefill-tokens",
            "160", "--prefill-chunk", "80", "--host-read-mib", "16", "--loan-keep-slots", "0",
            "--repeat", "1", "--stream-misses", "auto,1", "--expert-share", "0.25", "--json",
            "--whole-calls", "--prefetch", "1,2", "--wake-cpu", "--cli-sampling",
            "--cpu-schedule", "static"]
    assert bench.main(argv) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    # Each run's progress line: the round, its bound, and where its time went.
    assert re.search(r"decode-stream-1: [\d.]+ ms a round \(bound [\d.]+\), [\d.]+ ms a layer, "
                     r"host-side [\d.]+ ms, CPU experts [\d.]+ \([\d.]+ GB/s\), wait [\d.]+", err)
    # The prompt's: its time, the uploads, tok/s and scaled (no copy rate off CUDA: no bound).
    assert re.search(r"prefill-loan: [\d.]+ s, [\d.]+ GB uploaded, [\d,]+ tok/s, [\d,]+ scaled "
                     r"to \d+ layers", err)
    # What the scheduler did to the threads a round: the engine's and the others' (the CPU's
    # team among them), to tell a team that sleeps from one scheduled away.
    assert re.search(r"decode-stream-1, threads a round: the engine's [\d.]+ sleeps, [\d.]+ "
                     r"preemptions.*; the others' [\d.]+ sleeps", err)
    assert report["machine"]["host_read_bytes_per_s"] > 0
    assert report["machine"]["copy_bytes_per_s"] is None  # no bus off CUDA
    # The store's pages beside the CPU's rate: the kernel's mode, and how much of the store
    # it backs with huge pages (none where it gives none; tests/test_host_pages.py checks
    # that advised pages get them).
    assert report["machine"]["transparent_huge_pages"] == transparent_huge_pages()
    (share,) = report["store_huge_page_share"].values()
    assert 0.0 <= share <= 1.0
    if transparent_huge_pages() in (None, "never"):
        assert share == 0.0
    assert report["device_round_ms"] > 0
    runs = report["runs"]
    # Off CUDA auto streams nothing, and 1 stages 1 blob: no prefetch run of auto, nor of 2.
    assert set(runs) == {"decode-stream-auto", "decode-stream-auto-whole",
                         "decode-stream-auto-wake", "decode-stream-auto-static",
                         "decode-stream-auto-sampled", "decode-stream-1",
                         "decode-stream-1-whole", "decode-stream-1-wake", "decode-stream-1-static",
                         "decode-stream-1-sampled", "decode-stream-1-prefetch1", "prefill-loan"}
    # Waking the CPU's threads before each routing read changes no token.
    assert runs["decode-stream-1-wake"]["tokens"] == runs["decode-stream-1"]["tokens"]
    # Nor does the CPU kernel's schedule (its tasks in fixed shares a thread).
    assert runs["decode-stream-1-static"]["tokens"] == runs["decode-stream-1"]["tokens"]
    # The CLI's sampling: other tokens than greedy's, the same ones run to run.
    sampled = runs["decode-stream-1-sampled"]
    assert sampled["deterministic"] and sampled["tokens"] != runs["decode-stream-1"]["tokens"]
    # Off CUDA no call is split, so none predicts: nothing prefetched, the same tokens.
    assert runs["decode-stream-1-prefetch1"]["prefetch"] == {"prefetched_experts": 0, "used": 0}
    assert runs["decode-stream-1-prefetch1"]["tokens"] == runs["decode-stream-1"]["tokens"]
    # Off CUDA no graphs split the calls: the same rounds.
    assert runs["decode-stream-1-whole"]["tokens"] == runs["decode-stream-1"]["tokens"]
    auto, one = runs["decode-stream-auto"]["round"], runs["decode-stream-1"]["round"]
    assert auto["streamed_experts_per_round"] == 0 < auto["cpu_experts_per_round"]  # auto: 0
    assert one["streamed_experts_per_round"] > 0 and 0 < one["copy_share"] < 1
    for r in (auto, one):
        assert r["deterministic"]
        assert r["bound_ms"] >= r["device_round_ms"] and r["over_bound"] > 0
        assert r["device_round_ms"] <= r["best_split_bound_ms"] <= r["bound_ms"]
        # The token's wait is the device's, not the host's: off CUDA a token is read as it is
        # computed, a wait of the read alone.
        assert 0 <= r["token_wait_ms"] < r["round_ms"]
        assert r["host_ms_with_token_wait"] == r["round_ms"] - r["cpu_ms"] - r["wait_ms"]
        assert r["host_ms"] == r["host_ms_with_token_wait"] - r["token_wait_ms"]
        assert r["cpu_gb_s"] > 0 and r["cpu_share_of_host_read"] > 0
        # Off CUDA no call is split, so none runs on the CPU's own thread: no tasks counted,
        # no runs of its own timed.
        assert r["cpu_waiter_task_share"] is None
        assert r["cpu_run_gb_s"] is None and r["cpu_run_ms"] == r["cpu_team_up_ms"] == 0
    threads = runs["decode-stream-1"]["threads_per_round"]
    assert threads["engine"]["voluntary"] >= 0 and threads["others"]["involuntary"] >= 0
    assert len(runs["decode-stream-1"]["threads_per_round_each"]) == 1  # --repeat 1
    prefill = runs["prefill-loan"]
    assert prefill["cache"]["lent_slots"] > 0 and prefill["upload_bound_s"] is None
    prompt = prefill["cache"]["prompt"]
    assert prompt["uploaded_bytes"] > 0 and 0 < prompt["upload_s"] < prompt["forward_s"]
    assert prefill["prefill_chunk"] == 80  # the asked chunk, reported with the run
    assert prefill["scaled_tok_s"] == prefill["prefill_tok_s"]  # the preset's own depth


def test_the_offload_bench_interleaves_the_cache_s_settings_in_one_engine(capsys, monkeypatch,
                                                                          offload_bench):
    """--interleave: the schedules and the wake-up run in the base run's engine, a request of
    each in turn, each reported as its own run with the base's tokens."""
    bench = offload_bench
    argv = ["--preset", "tiny", "--device", "cpu", "--new-tokens", "4", "--prefill-tokens", "0",
            "--host-read-mib", "16", "--loan-keep-slots", "0", "--repeat", "2",
            "--stream-misses", "2", "--expert-share", "0.25", "--json", "--interleave",
            "--wake-cpu", "--sync-cpu", "--cpu-spin", "--cpu-pin", "--no-cpu-shrink",
            "--launch-ahead",
            "--cpu-weight-rows", "1x2", "--cpu-down-block-rows", "32", "--cpu-team", "1,3",
            "--cpu-schedule",
            "static,steal,steal-alone", "--cpu-prefetch", "512", "--split-counts", "1,3"]
    # Which team each CPU call was set to run on (`team_threads`: -teamN's N, the base's None,
    # `default_team`; on the host twin the misses run on the engine's thread, `compute`).
    # And how many weight rows its kernel read at once (-rows1x2's, the others' the defaults)
    # and its pass-2 tasks' rows (-downblock32's, the others' the default 64).
    teams, weight_rows, down_blocks = set(), set(), set()
    compute = CpuExperts.compute

    def counting(self, *args, **kwargs):
        teams.add(self.team_threads)
        weight_rows.add((self.gate_up_rows, self.down_rows))
        down_blocks.add(self.down_block_rows)
        return compute(self, *args, **kwargs)

    monkeypatch.setattr(CpuExperts, "compute", counting)
    assert bench.main(argv) == 0
    assert teams == {None, 1, 3} and weight_rows == {(1, 1), (1, 2)} and down_blocks == {64, 32}
    assert not graph_call.LAUNCH_AHEAD  # the -ahead run's switch put back
    printed = capsys.readouterr()
    runs = json.loads(printed.out)["runs"]
    # -split3 is left out, and said: the run's staging buffer holds 2 blobs.
    assert "-split3 left out: the run's staging buffer holds 2 experts" in printed.err
    # With --sync-cpu each count runs again on the engine's thread, -split1-sync, and with
    # --no-cpu-shrink with the caller's team left grown, -split1-noshrink.
    names = ["decode-stream-2", "decode-stream-2-wake", "decode-stream-2-sync",
             "decode-stream-2-spin", "decode-stream-2-pin", "decode-stream-2-noshrink",
             "decode-stream-2-ahead",
             "decode-stream-2-static", "decode-stream-2-steal", "decode-stream-2-steal-alone",
             "decode-stream-2-cpupf512", "decode-stream-2-rows1x2", "decode-stream-2-downblock32",
             "decode-stream-2-team1",
             "decode-stream-2-team3", "decode-stream-2-split1",
             "decode-stream-2-split1-sync", "decode-stream-2-split1-noshrink"]
    assert sorted(runs) == sorted(names)
    counts = ("passes", "hits", "cpu_experts", "streamed_experts")
    base = runs["decode-stream-2"]
    split = runs.pop("decode-stream-2-split1")  # streams 1 of a call's misses, not 2
    split_sync = runs.pop("decode-stream-2-split1-sync")
    split_shrink = runs.pop("decode-stream-2-split1-noshrink")
    assert runs["decode-stream-2-steal-alone"]["cache"]["cpu_waiter_tasks"] == 0  # only waits
    assert 0 < split["round"]["streamed_experts_per_round"] \
        < base["round"]["streamed_experts_per_round"]
    for run in [*runs.values(), split, split_sync, split_shrink]:
        assert run["interleaved"] and run["deterministic"]
        assert len(run["decode_ms_per_round_each"]) == 2
        assert run["cache"]["passes"] == 4  # one request's counts: the prompt's and 3 rounds
    # The settings change no token and no count: against the base, or the count's own run.
    for run, same in [*((run, base) for run in runs.values()), (split_sync, split),
                      (split_shrink, split)]:
        assert run["tokens"] == same["tokens"]
        assert {k: run["cache"][k] for k in counts} == {k: same["cache"][k] for k in counts}
    with pytest.raises(SystemExit):
        bench.main([*argv[:-7], "0", *argv[-6:]])  # not a team: --cpu-team 0
    assert "--cpu-team takes distinct comma-separated counts >= 1, got '0'" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main([*argv[:-11], "3x1", *argv[-10:]])  # not 1, 2 or 4: --cpu-weight-rows 3x1
    assert "--cpu-weight-rows takes distinct comma-separated GxD, G and D each 1, 2 or 4 (the " \
        "defaults, 1x1, run anyway), got '3x1'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main([*argv[:-9], "24", *argv[-8:]])  # not a multiple of 16
    assert "--cpu-down-block-rows takes distinct comma-separated multiples of 16 from 16 to " \
        "1024, got '24'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main([*argv[:-5], "fixed"])  # not a schedule
    with pytest.raises(SystemExit):
        bench.main([*argv[:-3], "100"])  # not a multiple of 64
    with pytest.raises(SystemExit):
        bench.main([a for a in argv if a != "--interleave"])  # split counts need it


def test_the_offload_bench_interleaves_split_tables_and_refuses_bad_ones(capsys, offload_bench):
    """--split-tables: each table a run in the base run's engine that streams what it says
    (-table<counts>, its `split` in the JSON), one the staging buffer cannot hold left out;
    a bad table, rule or gap, or any of them without --interleave, is the parser's error."""
    bench = offload_bench
    argv = ["--preset", "tiny", "--device", "cpu", "--new-tokens", "4", "--prefill-tokens", "0",
            "--host-read-mib", "16", "--loan-keep-slots", "0", "--repeat", "2",
            "--stream-misses", "1", "--expert-share", "0.25", "--json", "--interleave",
            "--split-tables", "0,0,1/0,0,0/0,1,2"]
    assert bench.main(argv) == 0
    printed = capsys.readouterr()
    runs = json.loads(printed.out)["runs"]
    # 0,1,2 is left out, and said: the run's staging buffer (--stream-misses 1) holds 1 blob.
    assert "-table012 (0,1,2) left out: it streams up to 2 experts, the run's staging buffer " \
        "holds 1" in printed.err
    assert sorted(runs) == ["decode-stream-1", "decode-stream-1-table000",
                            "decode-stream-1-table001"]
    assert runs["decode-stream-1-table000"]["split"] == "0,0,0"
    assert runs["decode-stream-1-table000"]["round"]["streamed_experts_per_round"] == 0
    assert 0 < runs["decode-stream-1-table001"]["round"]["streamed_experts_per_round"] \
        <= runs["decode-stream-1"]["round"]["streamed_experts_per_round"]
    # --split-room: the base run's buffer holds 2 blobs, so 0,1,2 runs too, the base still
    # streaming at most 1 (its split said in the JSON) and 0,1,2 more.
    assert bench.main([*argv, "--split-room"]) == 0
    printed = capsys.readouterr()
    roomy = json.loads(printed.out)["runs"]
    assert sorted(roomy) == [*sorted(runs), "decode-stream-1-table012"]
    assert "--split-room: the staging buffer holds 2 experts, the base run streams 0,1,1" \
        in printed.err and "left out" not in printed.err
    assert roomy["decode-stream-1"]["split"] == "0,1,1"
    assert roomy["decode-stream-1-table012"]["split"] == "0,1,2"
    assert roomy["decode-stream-1-table012"]["round"]["streamed_experts_per_round"] \
        > roomy["decode-stream-1"]["round"]["streamed_experts_per_round"]
    # --stream-misses 0: no staging buffer, so no table runs, and that is said.
    assert bench.main([("0" if a == "1" and argv[i - 1] == "--stream-misses" else a)
                       for i, a in enumerate(argv)]) == 0
    printed = capsys.readouterr()
    assert sorted(json.loads(printed.out)["runs"]) == ["decode-stream-0"]
    assert "the split settings left out: the run streams no misses" in printed.err
    for table, message in [("0,2,1", "each 0 first and counts[M] <= M"),
                           ("1,1,1", "each 0 first"), ("0,0,1/0,0,1", "distinct"),
                           ("0,a", "comma-separated counts")]:
        with pytest.raises(SystemExit):
            bench.main([*argv[:-1], table])
        assert message in capsys.readouterr().err
    for flag, value, message in [("--split-rules", "fastest", "--split-rules takes"),
                                 ("--rates-gaps", "-5", "--rates-gaps takes")]:
        with pytest.raises(SystemExit):
            bench.main([*argv[:-2], flag, value])
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main([a for a in argv if a != "--interleave"])
    assert "give --interleave too" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main([*argv[:-3], "--split-room"])  # without --interleave
    assert "--split-room gives the base run's engine room" in capsys.readouterr().err
    with pytest.raises(SystemExit, match=r"table 0,0,1,1 is not K \+ 1 = 3 counts \(the "
                       r"model's K is 2\)"):
        bench.main([*argv[:-1], "0,0,1,1"])


def test_the_offload_bench_runs_a_prefill_for_each_count_of_upload_batches(capsys, monkeypatch,
                                                                            offload_bench):
    monkeypatch.setenv("STRATA_LOAN_UPLOAD_BATCHES", "3")
    bench = offload_bench
    argv = ["--preset", "tiny", "--device", "cpu", "--new-tokens", "2", "--prefill-tokens",
            "160", "--prefill-chunk", "80", "--host-read-mib", "16", "--loan-keep-slots", "0",
            "--repeat", "1", "--stream-misses", "0", "--expert-share", "0.25", "--json",
            "--loan-upload-batches", "1,4"]
    assert bench.main(argv) == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    one, four = runs["prefill-loan-b1"], runs["prefill-loan-b4"]
    assert (one["loan_upload_batches"], four["loan_upload_batches"]) == (1, 4)
    for name in ("uploaded_bytes", "loan_experts", "lookups", "hits"):
        assert one["cache"]["prompt"][name] == four["cache"]["prompt"][name], name
    assert four["cache"]["prompt"]["loan_experts"] > 0
    assert os.environ["STRATA_LOAN_UPLOAD_BATCHES"] == "3"  # given back
    with pytest.raises(SystemExit):
        bench.main([*argv[:-1], "2,0"])
    assert "--loan-upload-batches takes distinct comma-separated counts >= 1, got '2,0'" in \
        capsys.readouterr().err


def test_the_offload_bench_measures_each_experts_dtype(capsys, offload_bench):
    bench = offload_bench
    argv = ["--preset", "tiny", "--device", "cpu", "--new-tokens", "4", "--prefill-tokens",
            "96", "--prefill-chunk", "48", "--host-read-mib", "16", "--loan-keep-slots", "0",
            "--repeat", "1", "--stream-misses", "1", "--expert-share", "0.25",
            "--experts-dtype", "auto,int8"]
    assert bench.main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    runs = report["runs"]
    assert set(runs) == {"decode-stream-1-auto", "prefill-loan-auto", "decode-stream-1-int8",
                         "prefill-loan-int8"}
    blob = report["blob_bytes_by_format"]
    assert blob["int8"] < 0.6 * blob["auto"]
    # The same cache MiB holds about twice the quantized experts.
    assert runs["decode-stream-1-int8"]["slots"] > 1.5 * runs["decode-stream-1-auto"]["slots"]
    assert "(int8)" in runs["decode-stream-1-int8"]["startup"]
    assert all(ms > 0 for ms in report["device_round_ms_by_format"].values())
    assert bench.main(argv) == 0  # the table
    table = capsys.readouterr().out
    assert "decode-stream-1-int8:" in table and "prefill-loan-int8," in table
    assert "where it went: the cache's uploads" in table
    with pytest.raises(SystemExit):  # argparse's error: a usage line naming the values
        bench.main([*argv[:-1], "auto,int3"])
    assert "--experts-dtype takes distinct comma-separated values" in capsys.readouterr().err
    # --share-per-format: each format's cache holds the share of the experts, at its blob size.
    assert bench.main([*argv, "--share-per-format", "--prefill-tokens", "0", "--json"]) == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert runs["decode-stream-1-int8"]["slots"] == runs["decode-stream-1-auto"]["slots"]
    with pytest.raises(SystemExit):
        bench.main([*argv, "--share-per-format", "--budget-mib", "64"])
    assert "--share-per-format sizes each format's cache by --expert-share" \
        in capsys.readouterr().err


def test_the_stream_issue_bench_times_each_part_for_each_k(capsys):
    bench = load_bench("stream_issue.py")
    assert bench.main(["--preset", "tiny", "--device", "cpu", "--repeat", "1", "--store-mib",
                       "1", "--sync-check"]) == 0
    report = json.loads(capsys.readouterr().out.split("\n", 2)[-1])  # after K progress lines
    assert sorted(report["host_us"]) == ["1", "2"]  # tiny: K = 2
    for row in report["host_us"].values():
        assert all(row[part] > 0 for part in ("compute", "copies", "kernels", "indices"))
        assert set(row["sync"].values()) == {"n/a (no device)"}


def test_the_offload_bench_profiles_a_decode_run(capsys, offload_bench, tmp_path):
    bench = offload_bench
    argv = ["--preset", "tiny", "--device", "cpu", "--new-tokens", "8", "--prefill-tokens", "0",
            "--host-read-mib", "16", "--repeat", "1", "--stream-misses", "1",
            "--expert-share", "0.25", "--json", "--profile", str(tmp_path)]
    assert bench.main(argv) == 0
    run = json.loads(capsys.readouterr().out)["runs"]["decode-stream-1"]
    assert run["profile"] == {}  # no device timeline off CUDA
    host = (tmp_path / "decode-stream-1.host.txt").read_text()
    assert "function calls" in host and "fill_misses" not in host  # no split calls off CUDA
    assert "token_forward" in host  # the cache's one-token calls were profiled


def test_the_round_profile_unions_and_overlaps_intervals():
    profile = load_bench("round_profile.py")
    total, merged = profile._union_us([(5_000, 9_000), (0, 2_000), (1_000, 3_000)])
    assert (total, merged) == (7.0, [(0, 3_000), (5_000, 9_000)])
    _, other = profile._union_us([(2_000, 6_000), (8_000, 12_000)])
    assert profile._overlap_us(merged, other) == 1.0 + 1.0 + 1.0
    assert profile.per_round({"a": 2.0}, {"a": 10.0}, 4) == {"a": 2.0}


def test_the_offload_bench_profiles_a_prefill_run(capsys, tmp_path):
    bench = load_bench("offload.py")
    argv = ["--preset", "tiny", "--device", "cpu", "--new-tokens", "2", "--prefill-tokens",
            "128", "--host-read-mib", "16", "--repeat", "1", "--stream-misses", "1",
            "--expert-share", "0.25", "--json", "--profile", str(tmp_path)]
    assert bench.main(argv) == 0
    run = json.loads(capsys.readouterr().out)["runs"]["prefill-loan"]
    assert run["profile"] == {}  # no device timeline off CUDA
    host = (tmp_path / "prefill-loan.host.txt").read_text()
    assert "function calls" in host and "routed_forward" in host  # the cache's prompt calls


def test_a_round_s_cpu_runs_on_its_own_thread_are_reported_with_their_parts():
    """Where the CPU's own thread ran a round's misses (a decode call's on CUDA), the report
    gives the rate of its runs alone beside their hand-over, team wake-up and notice, per
    round; where it ran none, no rate and no parts in the line."""
    report = load_bench("offload_report.py")
    decode = {"passes": 2, "cpu_s": 0.004, "wait_s": 0.001, "cpu_experts": 8,
              "streamed_experts": 4, "hit_rate": 0.5, "device_s": 0.0, "forward_s": 0.006,
              "cpu_waiter_tasks": 0, "cpu_tasks": 80, "cpu_hand_over_s": 0.0002,
              "cpu_team_up_s": 0.0006, "cpu_pass1_s": 0.002, "cpu_run_s": 0.0032,
              "cpu_noticed_s": 0.0002}
    run = {"cache": {"decode": decode}, "decode_ms_per_round": 5.0, "decode_tok_s": 200.0,
           "decode_path": "piecewise", "deterministic": True}
    machine = {"host_read_bytes_per_s": 100e9, "copy_bytes_per_s": 50e9}
    r = report.round_figures(run, 10**7, machine, 1.0, n_layers=4, full_layers=4)
    assert r["cpu_ms"] == 2.0 and r["cpu_gb_s"] == 4 * 10**7 / 0.002 / 1e9  # 20 GB/s
    assert r["cpu_run_ms"] == 1.6 and r["cpu_run_gb_s"] == 4 * 10**7 / 0.0016 / 1e9  # 25
    assert (r["cpu_team_up_ms"], r["cpu_hand_over_ms"], r["cpu_noticed_ms"]) == (0.3, 0.1, 0.1)
    # Gate and up: 2/3 of 40 MB in 1.0 ms a round; down: 1/3 in the run's other 0.6 ms.
    assert r["cpu_pass1_gb_s"] == pytest.approx(26.67, abs=0.01)
    assert r["cpu_pass2_gb_s"] == pytest.approx(22.22, abs=0.01)
    assert report.cpu_parts(r) == ("; run 1.60 ms at 25.0 GB/s (gate and up 26.7, down 22.2), "
                                   "team up 0.30, hand-over 0.10, noticed 0.10")
    decode.update(cpu_run_s=0.0, cpu_team_up_s=0.0, cpu_pass1_s=0.0, cpu_hand_over_s=0.0,
                  cpu_noticed_s=0.0)
    r = report.round_figures(run, 10**7, machine, 1.0, n_layers=4, full_layers=4)
    assert r["cpu_run_gb_s"] is None and r["cpu_pass1_gb_s"] is None
    assert report.cpu_parts(r) == ""


def test_a_split_that_streams_too_much_raises_its_own_bound_not_the_best_split_s():
    """The bound counts the split taken (its copies at the copy rate), the best split's bound
    the same misses split so that both sides finish together, and the host's memory shared
    where both read it at once."""
    report = load_bench("offload_report.py")
    decode = {"passes": 1, "cpu_s": 0.001, "wait_s": 0.0, "cpu_experts": 4,
              "streamed_experts": 8, "hit_rate": 0.0, "device_s": 0.0, "forward_s": 0.0,
              "cpu_waiter_tasks": 0, "cpu_tasks": 0, **{f"cpu_{part}_s": 0.0 for part in (
                  "hand_over", "team_up", "pass1", "run", "noticed")}}
    run = {"cache": {"decode": decode}, "decode_ms_per_round": 6.0, "decode_tok_s": 1.0,
           "decode_path": "piecewise", "deterministic": True}
    machine = {"host_read_bytes_per_s": 100e9, "copy_bytes_per_s": 50e9}
    r = report.round_figures(run, 10**7, machine, 1.0, n_layers=1, full_layers=1)
    # 40 MB on the CPU (0.4 ms), 80 MB streamed (1.6 ms): its own bound 2.6 ms; the 120 MB
    # split 80 / 40 finish together in 0.8 ms: 1.8.
    assert r["bound_ms"] == pytest.approx(2.6) and r["best_split_bound_ms"] == pytest.approx(1.8)
    assert r["over_best_split_bound"] == pytest.approx(6.0 / 1.8)
    machine["joint_bytes_per_s"] = {"cpu": 60e9, "copy": 40e9, "total": 100e9}  # 1.2 ms
    r = report.round_figures(run, 10**7, machine, 1.0, n_layers=1, full_layers=1)
    assert r["bound_ms"] == pytest.approx(2.6) and r["best_split_bound_ms"] == pytest.approx(2.2)


def test_the_rounds_summary_tables_offload_s_lines_and_pairs_an_a_b(capsys, tmp_path):
    """bench/rounds.py reads offload.py's JSON lines as gpu_session.sh writes them (progress
    lines among them) and prints a row a decode run; with --ab, each base line's pair with the
    next new line of its round and run, in order (a file may repeat round numbers)."""
    bench = load_bench("offload.py")
    argv = ["--preset", "tiny", "--device", "cpu", "--new-tokens", "3", "--prefill-tokens", "0",
            "--host-read-mib", "16", "--loan-keep-slots", "0", "--repeat", "1",
            "--stream-misses", "1", "--expert-share", "0.25", "--json"]
    assert bench.main(argv) == 0
    line = capsys.readouterr().out.strip()
    tagged = [line.replace("{", f'{{"side": "{side}", "round": {n}, ', 1)
              for n, side in ((1, "base"), (1, "new"), (1, "base"), (1, "new"))]
    path = tmp_path / "offload-ab.jsonl"
    path.write_text("base 1: 1 lines\n" + "\n".join(tagged) + "\n")
    rounds = load_bench("rounds.py")
    assert rounds.main([str(path), "--ab"]) == 0
    out = capsys.readouterr().out
    round_ms = json.loads(line)["runs"]["decode-stream-1"]["round"]["round_ms"]
    # A row a line's run, and one a pair.
    assert out.count("| decode-stream-1 |") == 4 + 2 and f"| {round_ms:.2f} |" in out
    # Off CUDA no run of the CPU's own thread: 0 ms of runs and team wake-up, no rate.
    assert re.search(r"\| decode-stream-1 \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \| "
                     r"[\d.]+ \| 0\.00 \| - \| 0\.00 \|", out)
    # Two pairs (lines 2-3 and 4-5 of the file), each the same figures: 1.000.
    pairs = [row for row in out.splitlines() if "side base round 1 | 1 |" in row]
    assert len(pairs) == 2 and all(row.endswith("| 1.000 | 1.000 | 1.000 |") for row in pairs)
    path.write_text("{not json\n")
    with pytest.raises(SystemExit):
        rounds.main([str(path)])
    assert "offload-ab.jsonl:1 is not a JSON object" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        rounds.main([str(tmp_path / "none.jsonl")])
    assert "no such file" in capsys.readouterr().err


def test_the_rounds_summary_puts_each_interleaved_setting_against_its_base(capsys, tmp_path):
    """bench/rounds.py --interleaved: each setting of an `--interleave` run over its base,
    request by request (the median and range of the ratios), and whether its tokens are the
    base's; an error where no run took turns."""
    bench = load_bench("offload.py")
    argv = ["--preset", "tiny", "--device", "cpu", "--new-tokens", "3", "--prefill-tokens", "0",
            "--host-read-mib", "16", "--loan-keep-slots", "0", "--repeat", "3",
            "--stream-misses", "1", "--expert-share", "0.25", "--json", "--interleave",
            "--cpu-down-block-rows", "32"]
    assert bench.main(argv) == 0
    line = capsys.readouterr().out.strip()
    runs = json.loads(line)["runs"]
    base, other = runs["decode-stream-1"], runs["decode-stream-1-downblock32"]
    assert other["interleaved_base"] == "decode-stream-1"
    ratios = sorted(new / old for new, old in zip(other["decode_ms_per_round_each"],
                                                  base["decode_ms_per_round_each"], strict=True))
    path = tmp_path / "offload.jsonl"
    path.write_text("bench/offload.py: progress\n" + line + "\n")
    rounds = load_bench("rounds.py")
    assert rounds.main([str(path), "--interleaved"]) == 0
    row = [r for r in capsys.readouterr().out.splitlines() if "| decode-stream-1-downblock32 | 3 |"
           in r]
    assert row == [f"| offload.jsonl:2 | decode-stream-1 | decode-stream-1-downblock32 | 3 | "
                   f"{ratios[1]:.3f} | {ratios[0]:.3f} | {ratios[2]:.3f} | yes |"]
    for run in runs.values():
        run["interleaved"] = False
    path.write_text(json.dumps({"runs": runs}) + "\n")
    with pytest.raises(SystemExit):
        rounds.main([str(path), "--interleaved"])
    assert "no process's runs took turns" in capsys.readouterr().err


def test_the_benches_read_pass_2s_rows_a_task_as_the_kernel_takes_them():
    """bench/_common.down_block_rows, which bench/offload.py's --cpu-down-block-rows and
    bench/cpu_experts.py's --down-block-rows both parse with: distinct multiples of 16 from 16
    to 1024, None for anything else."""
    parse = load_bench("_common.py").down_block_rows
    assert parse("") == [] and parse("16,1024,64") == [16, 1024, 64]
    for bad in ("24", "0", "1040", "16,16", "x", "32,-16", "3.2e1"):
        assert parse(bad) is None, bad


def test_the_split_model_fits_rounds_made_by_its_own_model_and_predicts_an_unrun_table(
        capsys, tmp_path, monkeypatch):
    """bench/split_model.py: runs whose rounds its model made (known per-call figures, a
    constant a routing) are fitted back exactly, and a table not among them is predicted as
    the model gives it."""
    model = load_bench("split_model.py")
    monkeypatch.setattr(model, "GRID_US", {"cpu_each": (50, 70, 10), "upload_each": (80, 100, 10),
                                           "cpu_fixed": (0, 40, 20),
                                           "upload_fixed": (60, 100, 20)})
    truth = np.array([[0.06, 0.09, 0.02, 0.08]])  # cpu_each, upload_each, fixed: ms
    constants = {0.0: 2.0, 0.5: 1.5}
    auto = [0, 1, 2, 3, 3, 4, 4, 4, 5]
    tables = {"": auto, "-table001112223": [0, 0, 1, 1, 1, 2, 2, 2, 3],
              "-table000111222": [0, 0, 0, 1, 1, 1, 2, 2, 2]}
    lines = []
    for skew, misses in ((0.0, 6.2), (0.5, 3.5)):
        chances = model.binomial(8, misses / 8)
        runs = {f"decode-stream-auto{suffix}": {
            "split": None if not suffix else ",".join(map(str, table)),
            "round": {"round_ms": 16 * model.layer_ms(np.array(table), chances, truth)[0]
                      + constants[skew], "misses_per_round": 16 * misses}}
            for suffix, table in tables.items()}
        lines.append(json.dumps({"router_skew": skew, "layers": 16, "runs": runs}))
    path = tmp_path / "runs.jsonl"
    path.write_text("\n".join(["not JSON: a progress line", *lines]) + "\n")
    unrun = [0, 0, 1, 1, 2, 2, 3, 3, 4]
    assert model.main([str(path), "--auto", ",".join(map(str, auto)),
                       "--tables", ",".join(map(str, unrun))]) == 0
    out = capsys.readouterr().out
    assert "cpu_each 60 µs, upload_each 90 µs, cpu_fixed 20 µs, upload_fixed 80 µs" in out
    assert "rms relative error 0.000 over 6 runs" in out
    for skew, misses in ((0.0, 6.2), (0.5, 3.5)):
        expected = 16 * model.layer_ms(np.array(unrun), model.binomial(8, misses / 8),
                                       truth)[0] + constants[skew]
        assert f"skew {skew}: 0,0,1,1,2,2,3,3,4 {expected:.2f} ms predicted\n" in out
    # Bad input is the parser's error, naming what was wrong: a table that is not one, a table
    # of another K than auto's, runs split by another K, no runs at all.
    for argv, message in [(["--auto", "0,x"], "--auto takes one table"),
                          (["--auto", ",".join(map(str, auto)), "--tables", "0,1"],
                           "must be K + 1 = 9 counts as --auto's"),
                          (["--auto", "0,1,2"], "splits by [0, 0, 1, 1, 1, 2, 2, 2, 3], not K + 1 "
                                                "= 3 counts")]:
        with pytest.raises(SystemExit):
            model.main([str(path), *argv])
        assert message in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("progress only\n")
    with pytest.raises(SystemExit):
        model.main([str(empty), "--auto", ",".join(map(str, auto))])
    assert "no decode run in" in capsys.readouterr().err


def test_the_split_rules_and_gaps_take_the_kept_and_the_new_rates_splits(monkeypatch):
    """On CUDA, -rule<name> is the kept rates' split by that rule and -gap<us> the split of rates
    measured with that gap (both stood in for here: there is no GPU), beside the tables; each
    said."""
    variants = load_bench("offload_variants.py")
    grid = ((0.0,), *(tuple(max(0.25 + 0.086 * s if s else 0.0,
                                0.6 + 0.083 * (m - s) if m - s else 0.0) for s in range(m + 1))
                      for m in range(1, 9)))
    kept = MissRates(tuple(0.086 * k for k in range(9)), tuple(0.083 * k for k in range(9)),
                     1000, staged_s=grid)
    gaps = []

    def measure(key, dtype, device, *, cpu_threads=None, gap_s):
        gaps.append(gap_s)
        return kept

    monkeypatch.setattr(variants, "auto_split", lambda *a, **k: (kept.split(), kept))
    monkeypatch.setattr(variants, "measure_rates", measure)
    monkeypatch.setattr(variants.RatesKey, "of", classmethod(lambda cls, *a: None))
    args = argparse.Namespace(split_tables=[(0, 0, 1, 1, 1, 2, 2, 2, 3)],
                              split_rules=["slopes", "calls"], rates_gaps=[100],
                              cpu_threads=None)
    said = []
    variants.table_splits(args, SimpleNamespace(top_k=8), torch.bfloat16, "cuda", "int8",
                          said.append)
    assert {name: rule.counts for name, rule in args.table_rules.items()} == {
        "-table001112223": (0, 0, 1, 1, 1, 2, 2, 2, 3),
        "-ruleslopes": kept.split("slopes").counts, "-rulecalls": kept.split("calls").counts,
        "-gap100": kept.split().counts}
    assert gaps == [100e-6] and len(said) == 3
    assert said[0] == f"the kept rates split by slopes: {kept.split('slopes').text()}"
