"""bench/cache.py runs on the CPU with a tiny model and reports every run it names (it has no
GPU here: no CUDA graphs, no accelerate peer), so a GPU session does not find it broken."""

from __future__ import annotations

import json

from support.bench_scripts import load_bench


def test_the_cache_bench_runs_and_reports(capsys, monkeypatch):
    monkeypatch.setenv("STRATA_LOAN_KEEP_SLOTS", "1")
    monkeypatch.delenv("STRATA_LOAN_KEEP_SLOTS")  # the bench sets it: restored after the test
    bench = load_bench("cache.py")
    argv = ["--preset", "tiny", "--device", "cpu", "--repeat", "1", "--new-tokens", "4",
            "--prefill-tokens", "96", "--loan-keep-slots", "0", "--stream-misses", "1",
            "--piecewise", "--json"]
    assert bench.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    runs = report["runs"]
    assert set(runs) == {"resident", "resident-eager", "cache-full", "cache-budget",
                         "cache-budget-piecewise", "cache-budget-stream1",
                         "cache-budget-stream1-piecewise", "prefill-loan", "prefill-cpu",
                         "accelerate"}
    assert runs["accelerate"] is None and report["budget_runs_over_peer"] is None
    assert runs["cache-budget-piecewise"]["decode_path"] == "eager"  # no CUDA here
    assert report["full_tokens_equal"]
    budget, streamed = runs["cache-budget"]["cache"], runs["cache-budget-stream1"]["cache"]
    assert budget["slots"] == streamed["slots"] < runs["cache-full"]["cache"]["slots"]
    assert streamed["decode"]["streamed_experts"] > 0 == budget["decode"]["streamed_experts"]
    assert runs["prefill-loan"]["cache"]["lent_slots"] > 0
    assert runs["prefill-cpu"]["cache"]["lent_slots"] == 0
