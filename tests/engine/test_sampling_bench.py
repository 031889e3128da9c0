"""bench/sampling.py runs on the CPU (its docstring's host-twin example) and times every row;
its baseline, `inverse_cdf_pick`, is the sampler the race replaced: the softmax's distribution
over top-p's candidates; its share of first winners outside the candidates is the race's."""

from __future__ import annotations

import json
import math

import torch

from strata.engine.runtime import sampling
from support.bench_scripts import load_bench


def test_the_sampling_bench_times_every_row(capsys):
    bench = load_bench("sampling.py")
    assert bench.main(["--device", "cpu", "--vocab", "4096", "--repeat", "2", "--calls", "2",
                       "--picks", "3", "--draws", "20"]) == 0
    report = json.loads(capsys.readouterr().out.splitlines()[0])
    sampled = [name for name, options in bench.SETTINGS.items() if options["temperature"]]
    other_argmax = "kernel" if not sampling.ARGMAX_KERNEL else "torch"  # the switch's other side
    assert set(report["ms"]) == {"pick greedy", f"pick greedy {other_argmax}",
                                 *(f"pick {name}" for name in sampled),
                                 *(f"sorted {name}" for name in sampled)}
    assert all(ms > 0 for ms in report["ms"].values())
    assert set(report["first_winner_outside"]) == set(sampled)
    assert report["first_winner_outside"]["temperature"] == 0.0  # every token a candidate


def test_the_baseline_is_the_former_samplers_distribution():
    bench = load_bench("sampling.py")
    probs = torch.tensor([0.1, 0.4, 0.2, 0.3])
    draws = torch.rand(3000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    picks = [int(bench.inverse_cdf_pick(probs.log(), 1.0, 0.5, 0, float(u))) for u in draws]
    assert set(picks) == {1, 3}
    p = 0.4 / 0.7
    assert abs(picks.count(1) / len(picks) - p) < 4 * math.sqrt(p * (1 - p) / len(picks))


def test_the_first_winner_outside_is_the_slow_paths_share():
    bench = load_bench("sampling.py")
    from strata.engine.runtime.sampling import Sampler

    logits = torch.zeros(1000)
    logits[0] = 5.0  # p0 = e^5 / (e^5 + 999) = 0.129: top-p 0.1 keeps token 0 alone
    share = bench.first_winner_outside(logits, Sampler(temperature=1.0, top_p=0.1, seed=2), 400)
    assert abs(share - (1 - 0.129)) < 0.06


def test_with_top_k_the_first_winner_is_the_kernels_own():
    bench = load_bench("sampling.py")
    from strata.engine.runtime.sampling import Sampler

    logits = torch.arange(1000, dtype=torch.float32) / 100  # no ties: the top-k race only
    sampler = Sampler(temperature=1.0, top_k=50, seed=2)
    assert bench.first_winner_outside(logits, sampler, 100) == 0.0
