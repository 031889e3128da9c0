"""bench/grouped_experts.py off CUDA: its options are checked before it needs the device, and
a partial call (K + 1 rows, only some naming an expert) is built as a split decode call's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from support.bench_scripts import load_bench


def test_a_partial_call_keeps_the_first_experts_and_zeros_the_rest():
    bench = load_bench("grouped_experts.py")
    index = torch.tensor([7, 3, 5, 1])  # K = 4
    x_rows = torch.arange(2.0).reshape(1, 2).expand(4, 2)
    reference = torch.arange(8.0).reshape(4, 2) + 1
    calls, xs, expected = bench.partial_rows(index, x_rows, reference, 2)
    assert calls.tolist() == [-1, -1, -1, 7, 3]  # K + 1 rows, the last 2 experts
    assert xs.shape == (5, 2) and torch.equal(xs, x_rows[:1].expand(5, 2))
    assert torch.equal(expected, torch.cat((torch.zeros(3, 2), reference[:2])))


@pytest.mark.parametrize("value, message", [("0", "within \\[1, K\\] \\(K = 8\\), got 0"),
                                            ("2,9", "got 9"), ("two", "comma-separated ints")])
def test_bad_valid_rows_are_refused_before_the_device_is_asked_for(value, message, capsys):
    bench = load_bench("grouped_experts.py")
    with pytest.raises(SystemExit):
        bench.main(["--presets", "qwen3-30b-a3b", "--valid-rows", value])
    err = capsys.readouterr().err
    assert "--valid-rows" in err and re.search(message, err)


def test_off_cuda_it_says_so():
    bench = load_bench("grouped_experts.py")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert bench.main(["--presets", "qwen3-30b-a3b", "--valid-rows", "2,3"]) == 2


_INTERPRETED = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from support.bench_scripts import load_bench
bench = load_bench("grouped_experts.py")
bench.time_graph = bench.time_eager = lambda call, repeat: (call(), 1.0)[1]  # run once, untimed
result = bench.measure("tiny", 1, 1, torch.float32, (1, 2), device=torch.device("cpu"))
print(json.dumps([[row["variant"], row["relative_error"], row["gb_per_s"]]
                  for row in result["variants"]]))
"""


def test_the_partial_calls_run_every_quantized_variant_and_match_their_experts():
    """The measurement itself, on the CPU under Triton's interpreter (the timers stubbed):
    every quantized block size also over 1 and 2 valid rows of K + 1 = 3, each within its
    format's error of the gathered path's rows (zeros where no expert is named), its bytes
    those of the valid rows only."""
    from support.interpreted import run_interpreted

    rows = {name: (error, rate) for name, error, rate in
            run_interpreted(_INTERPRETED, str(Path(__file__).parent))}
    for fmt, bound in (("int8", 0.05), ("int4-g32", 0.3)):
        for blocks in bench_blocks():
            full = rows[f"{fmt} {blocks}"]
            for n_valid in (1, 2):
                error, rate = rows[f"{fmt} {blocks} {n_valid} of 3 rows"]
                assert error < bound, (fmt, blocks, n_valid, error)
                assert rate == pytest.approx(full[1] * n_valid / 2)  # K = 2: bytes of N of 2


def bench_blocks():
    bench = load_bench("grouped_experts.py")
    return [f"{a[0]}x{a[1]} / {b[0]}x{b[1]}" for a, b in bench.QUANT_BLOCKS]
