"""bench/quant_accuracy.py: the comparison it prints, and its run on the tiny preset."""

import json

import torch

from support.bench_scripts import load_bench


def test_identical_logits_agree_fully_with_no_divergence():
    bench = load_bench("quant_accuracy.py")
    logits = torch.randn(6, 11, generator=torch.Generator().manual_seed(0))
    assert bench.compare(logits, logits.clone()) == {
        "top1_agreement": 1.0, "kl_mean": 0.0, "kl_max": 0.0}
    shifted = logits.clone()
    shifted[0] = shifted[0].flip(0)  # another distribution, another top token, at position 0
    moved = bench.compare(logits, shifted)
    assert moved["top1_agreement"] == 5 / 6 and moved["kl_max"] > 0 and moved["kl_mean"] > 0


def test_the_bench_reports_each_format_on_the_tiny_preset(capsys):
    bench = load_bench("quant_accuracy.py")
    assert bench.main(["--preset", "tiny", "--positions", "64", "--greedy-tokens", "8",
                       "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(report["formats"]) == ["int8", "int4-g32", "int4-g64"]
    for r in report["formats"].values():
        assert 0 <= r["top1_agreement"] <= 1 and 0 <= r["kl_mean"] <= r["kl_max"]
        assert 0 <= r["greedy_equal_prefix"] <= 8
    # int8 keeps 7 bits a weight against int4's 3: it moves this model's distributions less.
    int8 = report["formats"]["int8"]["kl_mean"]
    assert int8 < report["formats"]["int4-g32"]["kl_mean"]
    assert int8 < report["formats"]["int4-g64"]["kl_mean"]
