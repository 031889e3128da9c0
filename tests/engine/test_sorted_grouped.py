"""The prompt chunk's grouped expert products (`strata.engine.experts.sorted_grouped`) against
a per-expert loop in float32: on the GPU machine (marked cuda), and where they do not apply."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.engine.experts import sorted_grouped

E, F_WIDTH, D, K = 16, 128, 256, 4


def reference(gate_up, down, x, topk_ids):
    """[T*K, D] in float32: each (token, k) row through its expert, one at a time."""
    rows = []
    for t in range(topk_ids.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            h = F.linear(x[t].float(), gate_up[e].float())
            rows.append(F.linear(F.silu(h[:F_WIDTH]) * h[F_WIDTH:], down[e].float()))
    return torch.stack(rows)


def inputs(device, n_tokens, seed=0):
    g = torch.Generator().manual_seed(seed)
    blobs = torch.randn(E, 3 * F_WIDTH * D, generator=g) * 0.05
    blobs = blobs.to(device=device, dtype=torch.bfloat16)
    gate_up = blobs[:, : 2 * F_WIDTH * D].view(E, 2 * F_WIDTH, D)  # views, as ResidentExperts'
    down = blobs[:, 2 * F_WIDTH * D :].view(E, D, F_WIDTH)
    x = torch.randn(n_tokens, D, generator=g).to(device=device, dtype=torch.bfloat16)
    # Experts 0..E/2 only: half the experts get no rows at all.
    ids = torch.stack([torch.randperm(E // 2, generator=g)[:K] for _ in range(n_tokens)])
    return gate_up, down, x, ids.to(device)


def test_not_taken_off_the_gpu_or_outside_bf16():
    assert not sorted_grouped.available(torch.zeros(2, 2, dtype=torch.bfloat16))
    if torch.cuda.is_available():
        assert not sorted_grouped.available(torch.zeros(2, 2, device="cuda"))  # float32


@pytest.mark.cuda
@pytest.mark.parametrize("n_tokens", [2, 37, 512])
def test_grouped_products_match_the_loop_and_repeat_exactly(n_tokens):
    gate_up, down, x, ids = inputs("cuda", n_tokens)
    assert sorted_grouped.available(x), "the H200 should take the grouped path"
    got = sorted_grouped.sorted_grouped_rows(gate_up, down, x, ids)  # [T*K, D]
    want = reference(gate_up.cpu(), down.cpu(), x.cpu(), ids.cpu())
    torch.testing.assert_close(got.float().cpu(), want, atol=2e-2, rtol=2e-2)
    again = sorted_grouped.sorted_grouped_rows(gate_up, down, x, ids)
    assert torch.equal(got, again)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 9).flatmap(
    lambda e: st.tuples(st.just(e), st.lists(st.integers(0, e - 1), min_size=1, max_size=64))))
def test_expert_runs_group_the_rows_by_expert_as_counting_does(case):
    n_experts, routed = case
    ids = torch.tensor(routed, dtype=torch.int64)
    order, ends = sorted_grouped.expert_runs(ids, n_experts)
    assert ends.dtype == torch.int32 and ends.shape == (n_experts,)
    assert torch.equal(ends.long(), torch.cumsum(torch.bincount(ids, minlength=n_experts), 0))
    assert torch.equal(order, torch.argsort(ids, stable=True))  # ascending within an expert


@pytest.mark.parametrize("n_experts", [256, 300, 32768, 40000])
def test_expert_runs_past_a_byte_of_ids_sort_as_int64_does(n_experts):
    # The ids are sorted as uint8, int16 or int32 by their count: the same order and ends.
    gen = torch.Generator().manual_seed(n_experts)
    ids = torch.cat([torch.randint(0, n_experts, (500,), generator=gen),
                     torch.tensor([0, n_experts - 1, n_experts - 1])])
    order, ends = sorted_grouped.expert_runs(ids, n_experts)
    assert torch.equal(order, torch.argsort(ids, stable=True))
    assert ends.shape == (n_experts,) and int(ends[-1]) == ids.numel()
    assert torch.equal(ends.long(), torch.cumsum(torch.bincount(ids, minlength=n_experts), 0))
