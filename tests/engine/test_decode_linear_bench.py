"""bench/decode_linear.py: the matrices it sweeps are each preset's decode products, and off
CUDA it says it needs CUDA instead of timing anything."""

import pytest
import torch

from support.bench_scripts import load_bench


def test_the_decode_linear_bench_names_each_presets_products(capsys):
    bench = load_bench("decode_linear.py")
    # olmoe-1b-7b: 16 heads of 128 for q, k and v over D = 2048; a vocabulary of 50,304.
    assert bench.matrices("olmoe-1b-7b") == {"qkv": (6144, 2048), "o": (2048, 2048),
                                             "logits": (50304, 2048)}
    # qwen3-30b-a3b: 32 query heads and 4 kv heads of 128: q is wider than D.
    assert bench.matrices("qwen3-30b-a3b")["o"] == (2048, 4096)
    if torch.cuda.is_available():
        pytest.skip("the sweep itself runs on the GPU machine (bench/gpu_session.sh)")
    assert bench.main([]) == 1
    assert "needs CUDA" in capsys.readouterr().out
