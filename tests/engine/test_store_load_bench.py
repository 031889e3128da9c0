"""bench/store_load.py runs on the CPU and reports what its docstring names, so that a GPU
session does not find it broken: each load in its own process, both kinds of store."""

from __future__ import annotations

import json

import torch

from support.bench_scripts import load_bench
from support.checkpoints import cached_checkpoint


def test_the_store_load_bench_runs_and_reports(capsys):
    bench = load_bench("store_load.py")
    model = cached_checkpoint("mixtral", "tiny", dtype=torch.bfloat16)
    assert bench.main(["--model", str(model), "--repeat", "1", "--experts", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [load["kind"] for load in report["loads"]] == ["pages", "huge", "torch"]
    median = report["median"]
    assert median["pages"]["store_bytes"] == median["huge"]["store_bytes"] \
        == median["torch"]["store_bytes"] > 0  # the same store each way
    for figures in median.values():
        assert figures["load_s"] > 0 and figures["cpu_gbps"] > 0
        assert "upload_gbps" not in figures  # no CUDA here
    for kind in ("pages", "huge"):
        ratios = report["over_torch"][kind]
        assert {"load_s", "cpu_gbps", "store_bytes"} <= set(ratios)
        assert ratios["store_bytes"] == 1
