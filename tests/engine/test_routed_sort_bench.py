"""bench/routed_sort.py runs (small): both sorts give the same groups, each row is timed."""

from __future__ import annotations

import json

from support.bench_scripts import load_bench


def test_the_routed_sort_bench_checks_and_times_both_sorts(tmp_path, capsys):
    bench = load_bench("routed_sort.py")
    out = tmp_path / "routed-sort.json"
    assert bench.main(["--presets", "qwen3-30b-a3b", "--tokens", "64", "--repeat", "2",
                       "--json-out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [row["call"] for row in rows] == ["misses", "hits"]
    assert all(row["same"] and row["int64_us"] > 0 and row["narrow_us"] > 0 for row in rows)
    assert sum(row["rows"] for row in rows) == 64 * 8
    assert "| qwen3-30b-a3b | 64 | misses |" in capsys.readouterr().out
