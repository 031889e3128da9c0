"""bench/kv_grow.py runs on the CPU with a tiny model and reports the table's figures."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ENV = ("STRATA_KV_GROW_INIT", "STRATA_KV_GROW_STEP", "STRATA_KV_GROW_FLOOR",
       "STRATA_VMM_CHUNK_BYTES", "STRATA_LOAN_KEEP_SLOTS")


def test_the_kv_grow_bench_runs_and_reports(capsys, monkeypatch):
    for name in ENV:  # the bench sets them: restored after the test
        monkeypatch.setenv(name, "1")
        monkeypatch.delenv(name)
    path = Path(__file__).resolve().parents[3] / "bench" / "kv_grow.py"
    spec = importlib.util.spec_from_file_location("bench_kv_grow", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    argv = ["--preset", "tiny", "--device", "cpu", "--budget-mib", "1.875", "--max-context",
            "2048", "--chunk-bytes", "4096", "--kv-init", "64", "--kv-step", "64", "--kv-floor",
            "2", "--long-tokens", "300", "--chat-new", "4", "--long-new", "4",
            "--prefill-chunk", "32", "--no-prefill-loan", "--rounds", "1",
            "--profile-prompts", "1", "--json"]
    assert bench.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    table = report["table"]
    # 5 slots beside the whole window's K/V (512 KiB); 15 beside its first 64 cells.
    assert (table["without"]["slots"], table["kv-grow"]["slots"]) == (5, 15)
    assert report["ratios"]["slots"] == 3.0
    kv = report["runs"]["kv-grow"][0]["kv"]
    assert kv["grows"] == 1 and kv["cells_mapped"] == 320 and kv["init_cells"] == 64
    assert report["runs"]["without"][0]["kv"] is None
    for row in table.values():
        assert row["chat_decode_tok_s"] > 0 and row["long_prefill_s"] > 0
