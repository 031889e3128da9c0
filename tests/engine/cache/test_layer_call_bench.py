"""bench/layer_call.py runs on the CPU and reports every run it names, split into its parts,
so that the GPU session's `layer-call` stage does not find it broken."""

from __future__ import annotations

import json

import strata.engine.experts.cpu as cpu_module
from support.bench_scripts import load_bench


def test_the_layer_call_bench_runs_and_reports(capsys):
    kernel_module = cpu_module._cpu_experts
    bench = load_bench("layer_call.py")
    argv = ["--layers", "1", "--calls", "6", "--repeat", "1", "--stream", "0,2",
            "--policy", "default,lru", "--paths", "token,general", "--json"]
    assert bench.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    runs = report["us_per_call"]
    assert set(runs) == {f"{policy} stream={n} {path}" for policy in ("coldest-in-loan", "lru")
                         for n in (0, 2) for path in ("token", "general")}
    for row in runs.values():
        assert row["total"] > 0 and row["kernel"] > 0 and row["wait"] == 0.0
        assert 0.0 < row["hit_rate"] < 1.0
        assert abs(row["kernel"] + row["hits"] + row["rest"] - row["total"]) < 1e-6
    assert cpu_module._cpu_experts is kernel_module  # the timer is taken off again
