"""bench/sampling.py runs on the CPU (its docstring's host-twin example) and times every row,
and its `after_the_sort` is `Sampler.pick`'s own work: the same token for the same draw."""

from __future__ import annotations

import json

import torch

from strata.engine.runtime.sampling import Sampler
from support.bench_scripts import load_bench


def test_the_sampling_bench_times_every_part(capsys):
    bench = load_bench("sampling.py")
    assert bench.main(["--device", "cpu", "--vocab", "4096", "--repeat", "2", "--calls", "2"]) == 0
    report = json.loads(capsys.readouterr().out.splitlines()[0])
    assert set(report["ms"]) == {*(f"pick {name}" for name in bench.SETTINGS), "sort stable",
                                 "sort", "sort bf16 stable", "after the sort", "topk 1024"}
    assert all(ms > 0 for ms in report["ms"].values())


def test_after_the_sort_is_picks_work():
    bench = load_bench("sampling.py")
    logits = torch.randn(4096, generator=torch.Generator().manual_seed(1)) * 3
    values, ids = torch.sort(logits / 0.8, descending=True, stable=True)
    for u in (0.0, 0.37, 0.9, 0.999):
        index = bench.after_the_sort(values, 0.95, u)
        assert ids[index.clamp(max=4095)] == Sampler(temperature=0.8, top_p=0.95).pick(logits, u)
