"""bench/park.py runs on the CPU and reports what its docstring names, so that a GPU session
does not find it broken: both kinds of host memory, each in its own process."""

from __future__ import annotations

import json

from support.bench_scripts import load_bench


def test_the_park_bench_runs_and_reports(capsys):
    bench = load_bench("park.py")
    assert bench.main(["--preset", "tiny", "--cells", "512", "--rounds", "4", "--device", "cpu",
                       "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [run["kind"] for run in report["runs"]] == ["pages", "huge", "torch"]
    cell_bytes = report["cells_bytes"] // 512
    assert report["held_cells_bytes"] == (512 + 384) * cell_bytes
    for figures in report["median"].values():
        assert figures["first_park_s"] > 0 and figures["park_gbps"] > 0
        assert figures["restore_gbps"] > 0
    assert {"park_s", "restore_s", "rss_grown_bytes"} <= set(report["over_torch"]["pages"])
