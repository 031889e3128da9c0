"""`products.linear_add_norm_route`: a decode layer's attention output product, the residual
sum, the MoE's norm and its routing as one kernel. Where it runs and where the two kernels do;
under Triton's interpreter on the CPU, h is the product then the sum to the bit, the norm is
`add_rms_norm`'s, and the routing is the top K of the logits in float64 (the router takes the
norm before its rounding, so only a near tie may go the other way), the same bytes call to call
with the arrival count left at zero; its refusals; on CUDA the same at the presets' shapes,
replayed from a CUDA graph and launched as a dependent."""

from __future__ import annotations

import pytest
import torch

from strata.engine import dependent_launch
from strata.engine.model import ops, products
from support.interpreted import run_interpreted


def _inputs(n_out, k_in, n_experts, dtype, seed, bias=False):
    """(a [1, K], weight [N, K], bias [N] or None, x [1, N], norm [N], router [E, N])."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(1, k_in, generator=gen).to(dtype)
    weight = (torch.randn(n_out, k_in, generator=gen) / k_in**0.5).to(dtype)
    b = torch.randn(n_out, generator=gen).to(dtype) if bias else None
    x = (torch.randn(1, n_out, generator=gen) * 2).to(dtype)
    norm = (torch.rand(n_out, generator=gen) + 0.5).to(dtype)
    router = (torch.randn(n_experts, n_out, generator=gen) / n_out**0.5).to(dtype)
    return a, weight, b, x, norm, router


def _routes_a_top_k(ids, weights, normed_h, router, top_k, normalize, dtype):
    """Whether ids [1, K] are the K largest float64 logits of `normed_h` (h times rstd times
    the norm's weight, unrounded) in order, up to a rounding of the logits to `dtype` (a tie
    there may go either way), and weights their softmax's (renormalized where `normalize`)."""
    logits = (router.double() @ normed_h.double()[0])  # [E]
    step = {torch.float32: 2.0**-20, torch.float16: 2.0**-9, torch.bfloat16: 2.0**-6}[dtype]
    slack = step * (logits.abs().max().item() + 1)
    chosen = logits[ids[0]]
    kth = torch.topk(logits, top_k).values[-1].item()
    ordered = bool((chosen[:-1] >= chosen[1:] - slack).all())
    probs = torch.softmax(logits, 0)[ids[0]]
    if normalize:
        probs = probs / probs.sum()
    return (len(set(ids[0].tolist())) == top_k and bool((chosen >= kth - slack).all())
            and ordered and torch.allclose(weights[0].double(), probs, rtol=0.05, atol=1e-3))


def test_off_cuda_it_is_the_product_then_the_norm_and_the_router():
    a, weight, b, x, norm, router = _inputs(48, 40, 8, torch.bfloat16, seed=0, bias=True)
    got = products.linear_add_norm_route(a, weight, b, x, norm, 1e-5, router, 2, True)
    want = ops.add_norm_router_route(x, products.linear(a, weight, b), norm, 1e-5, router, 2,
                                     True)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_it_takes_the_kernel_only_where_linear_would_and_the_shapes_fit(monkeypatch):
    a, weight, _, x, norm, router = _inputs(64, 32, 8, torch.bfloat16, seed=1)
    ran = []
    monkeypatch.setattr(products, "linear_add_norm_route_triton",
                        lambda *args: ran.append("fused") or (x, x, None, None))
    monkeypatch.setattr(products, "add_norm_router_route",
                        lambda *args: ran.append("two") or (x, x, None, None))
    monkeypatch.setattr(products, "takes", lambda a, weight: True)
    monkeypatch.setattr(products, "linear", lambda a, weight, bias: a)

    def route(a=a, x=x, router=router, top_k=2):
        ran.clear()
        products.linear_add_norm_route(a, weight, None, x, norm, 1e-5, router, top_k, True)
        return ran[0]

    assert route() == "fused"
    assert route(x=x.half()) == "two"  # the stream's dtype apart
    assert route(x=torch.cat((x, x))) == "two"  # two tokens' streams
    assert route(router=router.t().contiguous().t()) == "two"  # a column-major router
    assert route(top_k=9) == "two"  # more than its experts: the two kernels refuse it
    monkeypatch.setattr(products, "MAX_ROUTE_TILE", 16)  # a program could not hold 1 x 32
    assert route() == "two"
    monkeypatch.setattr(products, "MAX_ROUTE_TILE", 65536)
    monkeypatch.setattr(products, "PRODUCT_ROUTE_KERNEL", False)
    assert route() == "two"
    monkeypatch.setattr(products, "PRODUCT_ROUTE_KERNEL", True)
    monkeypatch.setattr(products, "takes", lambda a, weight: False)
    assert route() == "two"


def test_bad_operands_are_refused_by_name():
    a, weight, _, x, norm, router = _inputs(16, 32, 4, torch.float32, seed=2)
    run = products.linear_add_norm_route_triton
    with pytest.raises(ValueError, match=r"linear_add_norm_route_triton takes one token"):
        run(torch.cat((a, a)), weight, None, x, norm, 1e-5, router, 2, True)
    with pytest.raises(ValueError, match=r"x must be one token \[1, 16\] of dtype "
                                         r"torch.float32.*got \[1, 8\]"):
        run(a, weight, None, x[:, :8], norm, 1e-5, router, 2, True)
    with pytest.raises(ValueError, match=r"a router \[E, 16\].*got \[16\] and \[4, 15\]"):
        run(a, weight, None, x, norm, 1e-5, router[:, :15], 2, True)
    with pytest.raises(ValueError, match=r"top_k must be in \[1, 4\], got 5"):
        run(a, weight, None, x, norm, 1e-5, router, 5, True)
    with pytest.raises(ValueError, match=r"cannot hold a weight \[16, 32\] with 4 experts at "
                                         r"131072 elements"):
        run(a, weight, None, x, norm, 1e-5, router, 2, True, tile_elements=131072)


_INTERPRETED = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from test_product_route import _inputs, _routes_a_top_k
from strata.engine.model import products
from strata.engine.model.ops import add_rms_norm_triton, rms_norm
from strata.engine.model.products import linear_add_norm_route_triton, linear_one_triton
from strata.engine.model.routing_ops import arrival_counts
results = []
for seed, (n_out, k_in, n_experts, top_k, dtype, bias, parts) in enumerate([
        (96, 40, 6, 2, torch.float32, True, 16384),   # N not a power of two; a bias
        (64, 128, 64, 8, torch.bfloat16, False, 16384),  # olmoe's experts and top 8
        (33, 16, 5, 3, torch.float16, False, 64),  # 16 rows a program, the last one partial
        (256, 64, 128, 8, torch.bfloat16, True, 4096)]):  # qwen3's experts: 8 rows a program
    products.ROUTE_PARTS = parts
    a, weight, b, x, norm, router = _inputs(n_out, k_in, n_experts, dtype, seed, bias)
    normalize = seed % 2 == 0
    h, normed, ids, weights = linear_add_norm_route_triton(a, weight, b, x, norm, 1e-5, router,
                                                           top_k, normalize, tile_elements=256)
    block_n = products._route_shape(n_out, k_in, n_experts, 256)
    delta = linear_one_triton(a, weight, b, tile_elements=block_n * products._block(k_in))
    want_h, want_normed = add_rms_norm_triton(x, delta, norm, 1e-5)
    exact = rms_norm(want_h.double(), norm.double(), 1e-5)  # the norm unrounded, in float64
    again = linear_add_norm_route_triton(a, weight, b, x, norm, 1e-5, router, top_k, normalize,
                                         tile_elements=256)
    results.append({
        "h": torch.equal(h, want_h), "normed": torch.equal(normed, want_normed),
        "routed": _routes_a_top_k(ids, weights, exact, router, top_k, normalize, dtype),
        "same_bytes": all(torch.equal(g.view(torch.uint8), w.view(torch.uint8))
                          for g, w in zip((h, normed, ids, weights), again)),
        "count_back_to_zero": int(arrival_counts(a.device)[0]) == 0})
print(json.dumps(results))
"""


def test_the_kernel_under_the_interpreter():
    pytest.importorskip("triton")
    import os

    results = run_interpreted(_INTERPRETED, os.path.dirname(__file__))
    assert len(results) == 4
    for result in results:
        assert all(result.values()), result


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


# (N, K, E, top K) of the presets' layers: olmoe-1b-7b's, qwen3-30b-a3b's, mixtral-8x7b's.
PRESETS = [(2048, 2048, 64, 8), (2048, 4096, 128, 8), (4096, 4096, 8, 2)]


@pytest.mark.cuda
def test_on_cuda_at_the_presets_shapes_as_a_dependent_and_from_a_graph(monkeypatch):
    """h and the norm are the two kernels' bytes (at the norm's warps for both), the routing
    the float64 logits' top K; eager as dependents, eager plainly and replayed from a CUDA
    graph, a chain of layers whose each token and stream the one before wrote, the same
    bytes. A program that read a before its wait, or a last program that summed before every
    part had arrived, would not."""
    from strata.engine.model.op_kernels import NORM_WARPS

    for seed, (n_out, k_in, n_experts, top_k) in enumerate(PRESETS):
        a, weight, b, x, norm, router = (
            t.cuda() if t is not None else None
            for t in _inputs(n_out, k_in, n_experts, torch.bfloat16, seed, seed == 1))
        h, normed, ids, weights = products.linear_add_norm_route_triton(
            a, weight, b, x, norm, 1e-5, router, top_k, True)
        block_n = products._route_shape(n_out, k_in, n_experts, products.ROUTE_TILE_ELEMENTS)
        delta = products.linear_one_triton(a, weight, b, num_warps=NORM_WARPS,
                                           tile_elements=block_n * products._block(k_in))
        want_h, want_normed = ops.add_rms_norm(x, delta, norm, 1e-5)
        assert torch.equal(h, want_h) and torch.equal(normed, want_normed), (n_out, k_in)
        exact = ops.rms_norm(want_h.double(), norm.double(), 1e-5)
        assert _routes_a_top_k(ids.cpu(), weights.cpu(), exact.cpu(), router.cpu(), top_k, True,
                               torch.bfloat16)
        if _hopper():
            got = products.linear_add_norm_route(a, weight, b, x, norm, 1e-5, router, top_k,
                                                 True)
            assert all(torch.equal(g, w) for g, w in zip(got, (h, normed, ids, weights),
                                                              strict=True))
    if not _hopper():
        return
    n_out, k_in, n_experts, top_k = PRESETS[0]
    a, weight, _, x, norm, router = (t.cuda() if t is not None else None
                                     for t in _inputs(n_out, k_in, n_experts, torch.bfloat16, 9))
    square = torch.randn(k_in, n_out, device="cuda", dtype=torch.bfloat16) / n_out**0.5

    def chain(x):
        token, routed = a, []
        for _ in range(16):  # the next token is this one's norm through another product
            x, normed, ids, weights = products.linear_add_norm_route_triton(
                token, weight, None, x, norm, 1e-5, router, top_k, True)
            token = products.linear_one_triton(normed, square)
            routed.append((ids, weights))
        return x, routed

    monkeypatch.setattr(dependent_launch, "enabled", False)
    plain = chain(x)
    monkeypatch.setattr(dependent_launch, "enabled", True)
    dependent = chain(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = chain(x)
    for _ in range(3):
        captured[0].zero_()
        graph.replay()
        torch.cuda.synchronize()
        for run in (dependent, captured):
            assert torch.equal(run[0], plain[0])
            assert all(torch.equal(i, j) and torch.equal(v, w)
                       for (i, v), (j, w) in zip(run[1], plain[1], strict=True))
