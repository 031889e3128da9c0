"""bench/kv_accuracy.py: int8 and bf16 K/V cells against the model's, on the tiny preset."""

import json

import pytest

from support.bench_scripts import load_bench


def test_the_bench_reports_each_kv_dtype_on_the_tiny_preset(capsys):
    bench = load_bench("kv_accuracy.py")
    assert bench.main(["--preset", "tiny", "--device", "cpu", "--dtype", "fp32",
                       "--kv-dtypes", "bf16,int8", "--positions", "64", "--greedy-tokens", "8",
                       "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["reference_kv_dtype"] == "float32" and list(report["kv_dtypes"]) == [
        "bf16", "int8"]
    for r in report["kv_dtypes"].values():
        assert 0.9 <= r["top1_agreement"] <= 1 and 0 <= r["kl_mean"] <= r["kl_max"]
        assert 0 <= r["greedy_equal_prefix"] <= 8
    # bf16 rounds each value to 2^-9 of itself; int8 a row's values to its largest / 254.
    assert report["kv_dtypes"]["bf16"]["kl_mean"] < report["kv_dtypes"]["int8"]["kl_mean"]


def test_bad_kv_dtypes_are_refused(capsys):
    bench = load_bench("kv_accuracy.py")
    with pytest.raises(SystemExit):
        bench.main(["--kv-dtypes", "int4"])
    assert "--kv-dtypes takes bf16, int8; got 'int4'" in capsys.readouterr().err
