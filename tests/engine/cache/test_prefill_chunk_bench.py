"""bench/prefill_chunk.py runs its docstring's CPU example and reports every chunk size, so a GPU
session does not find it broken."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path


def test_the_prefill_chunk_bench_runs_and_reports(capsys, monkeypatch):
    monkeypatch.setenv("STRATA_VMM_CHUNK_BYTES", "65536")
    bench_dir = Path(__file__).resolve().parents[3] / "bench"
    monkeypatch.syspath_prepend(str(bench_dir))  # it imports _common as a script does
    spec = importlib.util.spec_from_file_location("bench_prefill_chunk",
                                                  bench_dir / "prefill_chunk.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    argv = ["--preset", "small", "--device", "cpu", "--budget-mib", "24", "--max-context",
            "1536", "--prompt-tokens", "600", "--chunks", "64,256", "--json"]
    assert bench.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    small, large = report["table"]["64"], report["table"]["256"]
    # A larger chunk's workspace (routed rows, activations) leaves fewer slots.
    assert large["workspace_mib"] > small["workspace_mib"]
    assert large["slots"] < small["slots"]
    assert small["prefill_over_first"] == 1.0 and large["prefill_s"] > 0
    assert all(len(runs) == 1 for runs in report["runs"].values())
