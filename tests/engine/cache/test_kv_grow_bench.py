"""bench/kv_grow.py runs its docstring's CPU example (a smaller one) and reports both variants,
so a GPU session does not find it broken."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path


def test_the_kv_grow_bench_runs_and_reports(capsys, monkeypatch):
    for name in ("STRATA_KV_GROW_INIT", "STRATA_KV_GROW_STEP", "STRATA_KV_GROW_FLOOR",
                 "STRATA_VMM_CHUNK_BYTES"):
        monkeypatch.setenv(name, "1")
        monkeypatch.delenv(name)  # the bench sets them: restored after the test
    path = Path(__file__).resolve().parents[3] / "bench" / "kv_grow.py"
    spec = importlib.util.spec_from_file_location("bench_kv_grow", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    argv = ["--preset", "small", "--device", "cpu", "--budget-mib", "12", "--chunk-bytes",
            "65536", "--kv-init", "128", "--kv-step", "128", "--kv-floor", "4",
            "--long-tokens", "600", "--chat-new", "4", "--long-new", "4", "--prefill-chunk",
            "64", "--no-prefill-loan", "--rounds", "1", "--profile-prompts", "1", "--router-skew",
            "0.5", "--json"]
    assert bench.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["stream_misses"] == 0  # strata generate's default off CUDA
    assert report["router_skew"] == 0.5
    without, grown = report["table"]["without"], report["table"]["kv-grow"]
    assert grown["slots"] > without["slots"]
    kv = report["runs"]["kv-grow"][0]["kv"]
    assert kv["grows"] == 1 and kv["slots_given_up"] > 0
    assert report["runs"]["without"][0]["kv"] is None
