"""`strata.engine.experts.combine.weighted_sum`: the torch path against the arithmetic the
experts calls used before it, byte for byte; the Triton kernel under Triton's interpreter on the
CPU (a fresh interpreter: TRITON_INTERPRET must be set before Triton is imported) against a
plain float32 loop over k in order, with and without positions; on CUDA, the kernel against the
same loop and the grouped prompt path's sum against its rows put back in order first."""

from __future__ import annotations

import os

import pytest
import torch

from strata.engine.experts.combine import weighted_sum
from support.interpreted import run_interpreted


def _rows(n_tokens, top_k, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(n_tokens * top_k, 1, generator=gen) * 6)
    rows = (torch.randn(n_tokens * top_k, d, generator=gen) * scale).to(dtype)
    rows[0, :3] = 0.0
    weights = torch.randn(n_tokens, top_k, generator=gen)  # float32, as `route` gives
    return rows, weights


def _in_order(rows, weights, dtype, positions=None):
    """The sum over k = 0..K-1 one term at a time in float32: the kernel's order."""
    n_tokens, top_k = weights.shape
    if positions is not None:
        rows = rows[positions]
    rows = rows.view(n_tokens, top_k, rows.shape[1]).float()
    total = torch.zeros(n_tokens, rows.shape[2])
    for k in range(top_k):
        total = total + rows[:, k] * weights[:, k : k + 1]
    return total.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_off_cuda_it_is_the_experts_former_arithmetic(dtype):
    for n_tokens, top_k, d in [(1, 8, 2048), (1, 2, 64), (5, 4, 96), (1, 1, 7)]:
        for seed in range(30):
            rows, weights = _rows(n_tokens, top_k, d, dtype, seed)
            expected = (rows.view(n_tokens, top_k, -1).float()
                        * weights.float().unsqueeze(-1)).sum(dim=1).to(dtype)
            got = weighted_sum(rows, weights, dtype)
            assert got.dtype == dtype and torch.equal(got.view(torch.uint8),
                                                      expected.view(torch.uint8))


def test_positions_read_rows_left_in_another_order():
    rows, weights = _rows(6, 4, 40, torch.float32, seed=3)
    order = torch.randperm(24, generator=torch.Generator().manual_seed(1))
    sorted_rows = rows[order]  # sorted_rows[j] is row order[j]
    positions = torch.empty_like(order)
    positions[order] = torch.arange(24)
    assert torch.equal(weighted_sum(sorted_rows, weights, torch.float32, positions),
                       weighted_sum(rows, weights, torch.float32))


_INTERPRETED = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from test_combine import _in_order, _rows
from strata.engine.experts.combine import weighted_sum_triton
results = []
for seed, (n_tokens, top_k, d, dtype, permuted) in enumerate([
        (3, 8, 2100, torch.float32, False),   # D past one block, not a multiple of it
        (5, 2, 64, torch.float16, True),
        (1, 1, 7, torch.float32, True),
        (0, 4, 16, torch.float32, False)]):   # no tokens
    rows, weights = _rows(max(n_tokens, 1), top_k, d, dtype, seed)
    rows, weights = rows[: n_tokens * top_k], weights[:n_tokens]
    positions = None
    if permuted:
        order = torch.randperm(n_tokens * top_k, generator=torch.Generator().manual_seed(seed))
        positions = torch.empty_like(order)
        positions[order] = torch.arange(n_tokens * top_k)
        rows = rows[order]
    got = weighted_sum_triton(rows, weights, dtype, positions)
    expected = _in_order(rows, weights, dtype, positions)
    results.append({"shape": list(got.shape), "dtype": str(got.dtype),
                    "error": (got.float() - expected.float()).abs().max().item()
                    / max(expected.float().abs().max().item(), 1e-30) if n_tokens else 0.0})
print(json.dumps(results))
"""


def test_the_kernel_under_the_interpreter_sums_in_order():
    pytest.importorskip("triton", reason="the dev extra installs Triton on Linux x86_64")
    results = run_interpreted(_INTERPRETED, os.path.dirname(__file__))
    expected = [([3, 2100], "torch.float32"), ([5, 64], "torch.float16"),
                ([1, 7], "torch.float32"), ([0, 16], "torch.float32")]
    for result, (shape, dtype) in zip(results, expected, strict=True):
        assert (result["shape"], result["dtype"]) == (shape, dtype)
        # A fused multiply-add rounds once where the loop rounds twice: within float32's
        # rounding (fp16's for the fp16 row).
        assert result["error"] <= (1e-3 if dtype == "torch.float16" else 1e-6)


@pytest.mark.cuda
def test_on_cuda_the_kernel_sums_in_order_and_the_prompt_path_reads_sorted_rows():
    pytest.importorskip("triton")
    from strata.engine.experts.sorted_grouped import (
        available,
        sorted_grouped_rows,
        sorted_grouped_sum,
    )

    cuda = torch.device("cuda")
    rows, weights = _rows(40, 8, 2048, torch.bfloat16, seed=9)
    got = weighted_sum(rows.to(cuda), weights.to(cuda), torch.bfloat16)
    assert torch.equal(got, weighted_sum(rows.to(cuda), weights.to(cuda), torch.bfloat16))
    expected = _in_order(rows, weights, torch.bfloat16)
    assert (got.cpu().float() - expected.float()).abs().max() <= \
        expected.float().abs().max() * 2**-7
    x = torch.randn(64, 256, device=cuda).to(torch.bfloat16)
    if not available(x):
        pytest.skip("the grouped products need bf16 on sm90 or later")
    gen = torch.Generator(device=cuda).manual_seed(2)
    blobs = torch.randn(16, 3 * 128 * 256, device=cuda, generator=gen).div_(16).to(x.dtype)
    gate_up = blobs[:, : 2 * 128 * 256].unflatten(1, (256, 256))
    down = blobs[:, 2 * 128 * 256 :].unflatten(1, (256, 128))
    ids = torch.randint(0, 16, (64, 4), device=cuda, generator=gen)
    topk_weights = torch.rand(64, 4, device=cuda, generator=gen)
    in_order = sorted_grouped_rows(gate_up, down, x, ids)  # [R, D] in (token, k) order
    assert torch.equal(sorted_grouped_sum(gate_up, down, x, ids, topk_weights),
                       weighted_sum(in_order, topk_weights, x.dtype))
