"""`strata.engine.model.linear`: the staged one-token product kernel, under Triton's
interpreter on the CPU against float32's product rounded once, and on CUDA against the exact
product, in a CUDA graph, and in a model's decode steps; `F.linear` wherever it is not
switched on."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from strata.engine.kv import new_kv
from strata.engine.model import linear
from strata.engine.model.moe import load_model
from strata.engine.model.tokenizer import Tokenizer
from strata.engine.runtime.generate import GenerateOptions, generate
from support.checkpoints import cached_checkpoint
from support.interpreted import run_interpreted

_INTERPRETED = r"""
import json
import torch
from strata.engine.model import linear

gen = torch.Generator().manual_seed(0)
rows = []
# N and K not multiples of the blocks, one block each way, a bias, a weight whose rows are a
# view's (a stride past K); each launched twice.
for dtype in (torch.float32, torch.float16):
    for n, k, with_bias, block_n, block_k in ((100, 300, False, 16, 256),
                                              (16, 256, True, 16, 256), (37, 64, True, 8, 32)):
        linear.LINEAR_BLOCK_N, linear.LINEAR_BLOCK_K = block_n, block_k
        x = torch.randn(1, k, generator=gen).to(dtype)
        wide = (torch.randn(n, k + 5, generator=gen) * k ** -0.5).to(dtype)
        weight = wide[:, :k]  # rows k + 5 apart
        bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
        got = linear.linear_triton(x, weight, bias)
        again = linear.linear_triton(x, weight, bias)
        expected = torch.nn.functional.linear(x.float(), weight.float(),
                                              bias.float() if with_bias else None).to(dtype)
        rows.append({"dtype": str(dtype), "shape": list(got.shape),
                     "repeats": torch.equal(got, again),
                     "error": ((got.float() - expected.float()).norm()
                               / expected.float().norm()).item()})
try:
    linear.linear_triton(torch.zeros(2, 8), torch.zeros(4, 8))
    refused = None
except ValueError as err:
    refused = str(err)
print(json.dumps({"rows": rows, "refused": refused}))
"""


def test_the_kernel_under_the_interpreter_is_the_float32_product_rounded_once():
    pytest.importorskip("triton", reason="the dev extra installs Triton on Linux x86_64")
    results = run_interpreted(_INTERPRETED, os.path.dirname(__file__))
    assert [row["shape"] for row in results["rows"][:3]] == [[1, 100], [1, 16], [1, 37]]
    for row in results["rows"]:
        assert row["repeats"], row
        assert row["error"] <= {"torch.float32": 1e-6, "torch.float16": 1e-3}[row["dtype"]], row
    assert "linear_triton takes one token [1, 8]" in results["refused"]


def test_off_cuda_or_switched_off_linear_is_f_linear(monkeypatch):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 64, generator=gen).to(torch.bfloat16)
    weight = torch.randn(32, 64, generator=gen).to(torch.bfloat16)
    for switched in (False, True):  # the CPU takes F.linear either way
        monkeypatch.setattr(linear, "LINEAR_KERNEL", switched)
        assert torch.equal(linear.linear(x, weight), F.linear(x, weight))


@pytest.mark.cuda
@pytest.mark.parametrize("n, k", [(6144, 2048), (2048, 4096), (100, 300)])
def test_on_cuda_the_kernel_is_near_the_exact_product_and_replays(monkeypatch, n, k):
    """olmoe's q/k/v, qwen3's output, an odd shape: within a rounding of the float32 product
    (as `F.linear` is); `F.linear` for two tokens; a CUDA graph replays the kernel's bytes."""
    pytest.importorskip("triton")
    monkeypatch.setattr(linear, "LINEAR_KERNEL", True)
    cuda = torch.device("cuda")
    gen = torch.Generator(cuda).manual_seed(3)
    x = torch.randn(1, k, generator=gen, device=cuda).to(torch.bfloat16)
    weight = (torch.randn(n, k, generator=gen, device=cuda) * k ** -0.5).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen, device=cuda).to(torch.bfloat16)
    exact = F.linear(x.float(), weight.float(), bias.float())
    got = linear.linear(x, weight, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (1, n)
    assert ((got.float() - exact).abs() <= exact.abs() * 2.0**-7 + 1e-3).all()
    assert torch.equal(got, linear.linear_triton(x, weight, bias))  # the kernel ran
    two = torch.cat([x, x])
    assert torch.equal(linear.linear(two, weight, bias), F.linear(two, weight, bias))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = linear.linear(x, weight, bias)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, got)


@pytest.mark.cuda
def test_on_cuda_decode_with_the_kernel_repeats_and_stays_near_cublas(monkeypatch):
    """A tiny qwen3's greedy decode with the products' kernel: the same tokens twice (the
    kernel's sums are in a fixed order), and a one-token forward's logits near cuBLAS's (the
    two sum in different orders, so later tokens may part)."""
    pytest.importorskip("triton")
    ckpt = cached_checkpoint("qwen3_moe", "tiny", dtype=torch.bfloat16)
    options = GenerateOptions(max_new=64, max_context=256, temperature=0.0, ignore_stop=True)
    runs, first = [], []
    for kernel in (False, True, True):
        monkeypatch.setattr(linear, "LINEAR_KERNEL", kernel)
        model, tok = load_model(ckpt, device="cuda"), Tokenizer.from_dir(ckpt)  # graphs anew
        runs.append(generate(model, tok, tok.encode("dense products"), options))
        one = torch.tensor(tok.encode("dense products")[:1], device="cuda")  # [1]: the kernel's
        with new_kv(model, 64) as kv:
            first.append(model.forward(one, 0, kv).float())
    assert runs[1].decode_path == "cuda-graph" and runs[1].tokens == runs[2].tokens
    scale = first[0].abs().max()
    assert (first[1] - first[0]).abs().max() <= 0.05 * scale
