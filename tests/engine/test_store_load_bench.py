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
    assert [load["kind"] for load in report["loads"]] == ["pages", "torch"]
    pages, torch_layers = report["median"]["pages"], report["median"]["torch"]
    assert pages["store_bytes"] == torch_layers["store_bytes"] > 0  # the same store both ways
    for figures in (pages, torch_layers):
        assert figures["load_s"] > 0 and figures["cpu_gbps"] > 0
        assert "upload_gbps" not in figures  # no CUDA here
    ratios = report["pages_over_torch"]
    assert {"load_s", "cpu_gbps", "store_bytes"} <= set(ratios) and ratios["store_bytes"] == 1
