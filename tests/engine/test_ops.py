"""`strata.engine.model.ops`: the torch references (what the CPU runs) against the ops they
replaced, byte for byte; each Triton kernel under Triton's interpreter on the CPU (a fresh
interpreter: TRITON_INTERPRET must be set before Triton is imported) against its reference in
float32 and float16, odd sizes and ties included; on CUDA, the kernels against the references
in bf16, and a model's decode step eager and replayed from its graph."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

from strata.engine.model import ops
from strata.engine.model.kv_cells import LayerCells
from strata.engine.model.layers import attention_mask, rope_cos_sin, rope_inv_freq
from strata.engine.model.moe import load_model
from strata.engine.model.op_kernels import NORM_WARPS
from strata.engine.model.tokenizer import Tokenizer
from strata.engine.runtime.generate import GenerateOptions, generate
from support.checkpoints import cached_checkpoint
from support.interpreted import run_interpreted


def _qk(n_tokens, n_heads, n_kv_heads, head_dim, norm, dtype, seed, clip=None):
    """(qkv [T, (H+2G)*Dh], QKHeads, cos, sin): the op's inputs as a layer has them."""
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(n_tokens, (n_heads + 2 * n_kv_heads) * head_dim, generator=gen) * 3)
    qkv = qkv.to(dtype)
    weight = None
    if norm == "full":
        weight = torch.randn((n_heads + n_kv_heads) * head_dim, generator=gen).to(dtype)
    elif norm == "head":
        q_norm, k_norm = torch.randn(2, head_dim, generator=gen).to(dtype)
        weight = torch.cat((q_norm.expand(n_heads, -1), k_norm.expand(n_kv_heads, -1)))
    positions = torch.randint(0, 4096, (n_tokens,), generator=gen)
    cos, sin = rope_cos_sin(positions, rope_inv_freq(head_dim, 10000.0, torch.device("cpu")),
                            dtype)
    heads = ops.QKHeads(n_heads, n_kv_heads, head_dim, norm, weight, 1e-6, clip)
    return qkv, heads, cos, sin


def _qk_of(qkv, heads):
    """qkv's q and k columns: strided rows, as a layer's split leaves them."""
    return qkv[:, : (heads.n_heads + heads.n_kv_heads) * heads.head_dim]


def _former_qk(qk, n_heads, head_dim, norm, weight, eps, cos, sin, clip=None):
    """The attention's ops before `qk_norm_rope` (q's and k's norms apart), one by one."""
    n_tokens = qk.shape[0]
    q_width = n_heads * head_dim
    q, k = qk[:, :q_width], qk[:, q_width:]
    if norm == "full":
        q = weight[:q_width] * F.rms_norm(q, (q_width,), eps=eps)
        k = weight[q_width:] * F.rms_norm(k, (k.shape[1],), eps=eps)
    if clip is not None:
        q, k = q.clamp(-clip, clip), k.clamp(-clip, clip)
    heads = torch.cat((q, k), dim=1).reshape(n_tokens, -1, head_dim)
    if norm == "head":
        heads = weight * F.rms_norm(heads, (head_dim,), eps=eps)
    rotated = torch.cat((-heads[..., head_dim // 2:], heads[..., : head_dim // 2]), dim=-1)
    sign = torch.ones(head_dim, dtype=cos.dtype)
    sign[: head_dim // 2] = -1
    return heads * cos.unsqueeze(1) + rotated * (sin * sign).unsqueeze(1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("norm", ["none", "full", "head"])
@pytest.mark.parametrize("clip", [None, 0.5])
def test_off_cuda_qk_norm_rope_is_the_former_ops(dtype, norm, clip):
    for seed, (n_tokens, n_heads, n_kv_heads) in enumerate([(1, 16, 16), (5, 8, 2), (3, 6, 1)]):
        qkv, heads, cos, sin = _qk(n_tokens, n_heads, n_kv_heads, 16, norm, dtype, seed, clip)
        qk = _qk_of(qkv, heads)
        got = ops.qk_norm_rope(qk, heads, cos, sin)
        expected = _former_qk(qk, n_heads, 16, norm, heads.weight, 1e-6, cos, sin, clip)
        assert got.shape == (n_tokens, n_heads + n_kv_heads, 16)
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("cell_dtype", [None, torch.int8])
@pytest.mark.parametrize("clip", [None, 0.5])
def test_off_cuda_rotate_and_write_stores_k_and_v_as_the_cells_write(cell_dtype, clip):
    qkv, heads, cos, sin = _qk(3, 8, 2, 16, "full", torch.bfloat16, seed=4, clip=clip)
    positions = torch.tensor([7, 2, 5])
    cells, expected_cells = _cells(10, 2, 16, cell_dtype), _cells(10, 2, 16, cell_dtype)
    q = ops.rotate_and_write(qkv, heads, cos, sin, positions, cells)
    qk = ops.qk_norm_rope(_qk_of(qkv, heads), heads, cos, sin)
    v = qkv[:, 10 * 16:].reshape(3, 2, 16)
    expected_cells.write(positions, qk[:, 8:], v if clip is None else v.clamp(-clip, clip))
    assert torch.equal(q, qk[:, :8])
    for got, expected in zip(cells, expected_cells, strict=True):
        assert (got is None and expected is None) or torch.equal(got, expected)


def _cells(n_cells, n_kv_heads, head_dim, cell_dtype=None, dtype=torch.bfloat16):
    """A `LayerCells` of n_cells zeroed cells (int8 ones with their scales)."""
    if cell_dtype is None:
        return LayerCells(*torch.zeros(2, n_cells, n_kv_heads, head_dim, dtype=dtype))
    return LayerCells(*torch.zeros(2, n_cells, n_kv_heads, head_dim, dtype=torch.int8),
                      *torch.zeros(2, n_cells, n_kv_heads))


def test_off_cuda_add_rms_norm_sums_then_norms():
    gen = torch.Generator().manual_seed(0)
    x, delta = torch.randn(2, 3, 64, generator=gen).to(torch.bfloat16)
    weight = torch.randn(64, generator=gen).to(torch.bfloat16)
    h, normed = ops.add_rms_norm(x, delta, weight, 1e-5)
    assert torch.equal(h, x + delta)
    assert torch.equal(normed, weight * F.rms_norm(x + delta, (64,), eps=1e-5))
    h, normed = ops.add_rms_norm(x, None, weight, 1e-5)
    assert h is x and torch.equal(normed, ops.rms_norm(x, weight, 1e-5))


def test_off_cuda_route_is_softmax_then_top_k():
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    for normalize in (False, True):
        ids, weights = ops.route(logits, 8, normalize)
        probs = torch.softmax(logits.float(), dim=-1)
        top, top_ids = probs.topk(8, dim=-1)
        assert torch.equal(ids, top_ids) and ids.dtype == torch.int64
        expected = top / top.sum(dim=-1, keepdim=True) if normalize else top
        assert torch.equal(weights, expected) and weights.dtype == torch.float32


def test_off_cuda_router_route_is_the_product_then_route():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 96, generator=gen).to(torch.bfloat16)
    router = torch.randn(16, 96, generator=gen).to(torch.bfloat16)
    ids, weights = ops.router_route(x, router, 4, True)
    expected_ids, expected_weights = ops.route(F.linear(x, router), 4, True)
    assert torch.equal(ids, expected_ids) and torch.equal(weights, expected_weights)
    with pytest.raises(ValueError, match="at most 8 tokens"):
        ops.router_route_triton(torch.zeros(9, 96), router.float(), 4, True)


def _norm_router_inputs(n_tokens, d, n_experts, dtype, seed):
    """(x, delta [T, D], norm weight [D], router [E, D]): a layer's residual, what attention
    adds to it, its MoE norm's weight and its router."""
    gen = torch.Generator().manual_seed(seed)
    x, delta = (torch.randn(2, n_tokens, d, generator=gen) * 4).to(dtype)
    weight = torch.randn(d, generator=gen).to(dtype)
    router = (torch.randn(n_experts, d, generator=gen) * d ** -0.5).to(dtype)
    return x, delta, weight, router


def _same_bytes(got, expected):
    return got.dtype == expected.dtype and got.shape == expected.shape and \
        torch.equal(got.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("switched", [False, True])
def test_off_cuda_add_norm_router_route_is_the_norm_then_the_router(monkeypatch, switched):
    """Off CUDA, switched on or not, the two ops as they ran before, byte for byte."""
    monkeypatch.setattr(ops, "NORM_ROUTER_KERNEL", switched)
    for seed, (n_tokens, with_delta) in enumerate([(1, True), (3, False), (12, True)]):
        x, delta, weight, router = _norm_router_inputs(n_tokens, 96, 16, torch.bfloat16, seed)
        delta = delta if with_delta else None
        h, normed, ids, weights = ops.add_norm_router_route(x, delta, weight, 1e-5, router, 4,
                                                            seed % 2 == 0)
        expected_h, expected_normed = ops.add_rms_norm(x, delta, weight, 1e-5)
        expected_ids, expected_weights = ops.router_route(expected_normed, router, 4,
                                                          seed % 2 == 0)
        assert _same_bytes(h, expected_h) and (with_delta or h is x)
        assert _same_bytes(normed, expected_normed)
        assert _same_bytes(ids, expected_ids) and _same_bytes(weights, expected_weights)


def test_add_norm_router_route_takes_its_kernel_only_where_switched_on_and_it_fits(
        monkeypatch):
    """The one kernel where switched on, for up to ROUTER_MAX_TOKENS tokens of at most
    MAX_KERNEL_WIDTH; else `add_rms_norm` then `router_route`, each choosing as it does alone
    (stand-ins for the kernels record which ran)."""
    calls = []

    def stand_in(name, result):
        return lambda *args, **kwargs: calls.append(name) or result(*args)

    monkeypatch.setattr(ops, "use_kernels", lambda x: True)  # as on CUDA
    monkeypatch.setattr(ops, "add_norm_router_route_triton", stand_in(
        "fused", lambda x, delta, weight, eps, router, k, normalize: (x, x, None, None)))
    monkeypatch.setattr(ops, "add_rms_norm_triton", stand_in("norm", lambda x, *_: (x, x)))
    monkeypatch.setattr(ops, "router_route_triton", stand_in("router", lambda *_: (None, None)))
    monkeypatch.setattr(ops, "route_triton", stand_in("route", lambda *_: (None, None)))
    ran = {}
    for switched in (False, True):
        monkeypatch.setattr(ops, "NORM_ROUTER_KERNEL", switched)
        for n_tokens, d in ((1, 64), (8, 64), (9, 64), (1, ops.MAX_KERNEL_WIDTH + 1)):
            x, delta, weight, router = _norm_router_inputs(n_tokens, d, 4, torch.float32, 0)
            calls.clear()
            ops.add_norm_router_route(x, delta, weight, 1e-5, router, 2, True)
            ran[switched, n_tokens, d] = calls[:]
    wide = ops.MAX_KERNEL_WIDTH + 1
    assert ran == {
        (False, 1, 64): ["norm", "router"], (False, 8, 64): ["norm", "router"],
        (False, 9, 64): ["norm", "route"], (False, 1, wide): ["router"],
        (True, 1, 64): ["fused"], (True, 8, 64): ["fused"],
        (True, 9, 64): ["norm", "route"],  # too many tokens: the product, then route
        (True, 1, wide): ["router"]}  # too wide a row: the norm's torch ops, then the router


def test_add_norm_router_route_triton_refuses_what_its_kernel_cannot_take():
    x, delta, weight, router = _norm_router_inputs(2, 64, 8, torch.float32, 0)
    run = ops.add_norm_router_route_triton
    for args, match in [
        ((x[:, ::2], None, weight[::2], 1e-5, router[:, ::2], 2, True), "contiguous rows"),
        ((x, delta.T.contiguous().T, weight, 1e-5, router, 2, True), "delta of x's shape"),
        ((x, delta[:1], weight, 1e-5, router, 2, True), "delta of x's shape"),
        ((torch.zeros(9, 64), None, weight, 1e-5, router, 2, True), "at most 8 tokens"),
        ((x, delta, weight[:32], 1e-5, router, 2, True), "norm weight"),
        ((x, delta, weight, 1e-5, router[:, :32], 2, True), "norm weight"),
        ((x, delta, weight, 1e-5, router, 9, True), "top_k must be in"),
    ]:
        with pytest.raises(ValueError, match=match):
            run(*args)
    with pytest.raises(ValueError, match="powers of two"):
        run(x, delta, weight, 1e-5, router, 2, True, splits=3)


_INTERPRETED = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from test_ops import _cells, _qk, _qk_of
from strata.engine.model import ops
from strata.engine.model.kv_cells import LayerCells

def rel(got, expected):
    scale = max(expected.float().abs().max().item(), 1e-30)
    return (got.float() - expected.float()).abs().max().item() / scale

results = {"add_rms_norm": [], "qk_norm_rope": [], "route": [], "router_route": [],
           "rope_and_mask": []}
gen = torch.Generator().manual_seed(0)
for dtype in (torch.float32, torch.float16):
    for n_tokens, d in ((1, 2048), (3, 1000), (0, 64)):  # D not a power of two; no tokens
        x, delta = (torch.randn(2, max(n_tokens, 1), d, generator=gen) * 4).to(dtype)
        x, delta = x[:n_tokens], delta[:n_tokens]
        weight = torch.randn(d, generator=gen).to(dtype)
        for with_delta in (True, False):
            h, normed = ops.add_rms_norm_triton(x, delta if with_delta else None, weight, 1e-5)
            expected_h = x + delta if with_delta else x
            results["add_rms_norm"].append({
                "dtype": str(dtype), "shape": list(normed.shape),
                "h_equal": torch.equal(h, expected_h) and (with_delta or h is x),
                "error": rel(normed, ops.rms_norm(expected_h, weight, 1e-5)) if n_tokens else 0.0})
    for seed, (n_tokens, n_heads, n_kv_heads, head_dim) in enumerate(
            ((1, 16, 16, 64), (4, 6, 2, 16), (2, 5, 1, 8))):  # heads not powers of two
        for norm in ("none", "full", "head"):
            qkv, heads, cos, sin = _qk(n_tokens, n_heads, n_kv_heads, head_dim, norm, dtype, seed)
            qk = _qk_of(qkv, heads)
            got = ops.qk_norm_rope_triton(qk, heads, cos, sin)
            expected = ops.qk_norm_rope(qk, heads, cos, sin)
            # The same kernel storing k and v in cells (rows 9, 0, ...), q alone out.
            positions = (torch.arange(n_tokens) * 7 + 9) % 32
            cells = _cells(32, n_kv_heads, head_dim, dtype=dtype)
            expected_cells = _cells(32, n_kv_heads, head_dim, dtype=dtype)
            q = ops.rotate_and_write_triton(qkv, heads, cos, sin, positions, cells)
            expected_q = ops.rotate_and_write(qkv, heads, cos, sin, positions, expected_cells)
            results["qk_norm_rope"].append({
                "dtype": str(dtype), "norm": norm, "shape": list(got.shape),
                "error": max(rel(got, expected), rel(q, expected_q),
                             rel(cells.k, expected_cells.k)),
                "q_shape": list(q.shape), "v_equal": torch.equal(cells.v, expected_cells.v)})
for n_tokens, n_experts, top_k in ((1, 64, 8), (5, 60, 6), (2, 128, 8), (3, 8, 2)):
    logits = torch.randn(n_tokens, n_experts, generator=gen) * 2
    for normalize in (False, True):
        ids, weights = ops.route_triton(logits, top_k, normalize)
        expected_ids, expected_weights = ops.route(logits, top_k, normalize)
        results["route"].append({"ids_equal": torch.equal(ids, expected_ids),
                                 "error": rel(weights, expected_weights)})
tied = torch.tensor([[0.0, 1.0, 1.0, 0.5, 1.0, 0.0, 0.0, 0.0]])
ids, weights = ops.route_triton(tied, 4, True)
results["tied"] = {"ids": ids.tolist(), "weights": weights.tolist()}
# The router's product inside: one split (D small), several, several blocks a split; E and D
# not powers of two; the most tokens; each launched twice (the arrival count set back to 0).
for dtype in (torch.float32, torch.float16):
    for n_tokens, d, n_experts, top_k in ((1, 2048, 64, 8), (3, 1000, 60, 6), (2, 200, 128, 8),
                                         (1, 4096, 8, 2), (8, 96, 16, 4), (0, 64, 8, 2)):
        x = torch.randn(n_tokens, d, generator=gen).to(dtype)
        router = (torch.randn(n_experts, d, generator=gen) * d ** -0.5).to(dtype)
        for normalize in (False, True):
            ids, weights = ops.router_route_triton(x, router, top_k, normalize)
            again = ops.router_route_triton(x, router, top_k, normalize)
            expected_ids, expected_weights = ops.route(torch.nn.functional.linear(x, router),
                                                       top_k, normalize)
            results["router_route"].append({
                "dtype": str(dtype), "shape": list(ids.shape),
                "ids_equal": torch.equal(ids, expected_ids),
                "repeats": torch.equal(ids, again[0]) and torch.equal(weights, again[1]),
                "error": rel(weights, expected_weights) if n_tokens else 0.0})
# A forward's rotary tables and mask: one token, several (one far out: a large angle), a
# sliding window, a window past the mask's first block of cells.
from strata.engine.model.layers import attention_mask, rope_cos_sin, rope_inv_freq
for dtype in (torch.float32, torch.float16):
    for positions, n_ctx, window, head_dim in (([5], 256, None, 64), ([0, 3, 40000], 40001,
                                                None, 128), ([100, 130], 300, 64, 16),
                                               ([2000], 2500, 1500, 8)):
        positions = torch.tensor(positions)
        inv_freq = rope_inv_freq(head_dim, 10000.0, torch.device("cpu"))
        cos, sin, mask = ops.rope_and_mask_triton(positions, inv_freq, n_ctx, window, dtype)
        expected_cos, expected_sin = rope_cos_sin(positions, inv_freq, dtype)
        results["rope_and_mask"].append({
            "dtype": str(dtype), "shapes": [list(cos.shape), list(mask.shape)],
            "mask_equal": torch.equal(mask, attention_mask(positions, n_ctx, window, dtype)),
            "error": max((cos.float() - expected_cos.float()).abs().max().item(),
                         (sin.float() - expected_sin.float()).abs().max().item()),
            "signs_equal": torch.equal(torch.signbit(sin[:, :head_dim // 2]),
                                       torch.signbit(-sin[:, head_dim // 2:]))})
print(json.dumps(results))
"""


def test_the_kernels_under_the_interpreter_match_the_references():
    pytest.importorskip("triton", reason="the dev extra installs Triton on Linux x86_64")
    results = run_interpreted(_INTERPRETED, os.path.dirname(__file__))
    bound = {"torch.float32": 1e-6, "torch.float16": 1e-3}  # a sum's order: a rounding or two
    assert len(results["add_rms_norm"]) == 12
    for row in results["add_rms_norm"]:
        assert row["h_equal"] and row["error"] <= bound[row["dtype"]], row
    assert [row["shape"] for row in results["add_rms_norm"][:6:2]] == [[1, 2048], [3, 1000],
                                                                         [0, 64]]
    assert len(results["qk_norm_rope"]) == 18
    for row in results["qk_norm_rope"]:
        assert row["error"] <= bound[row["dtype"]] * 4 and row["v_equal"], row
        assert row["q_shape"] == [row["shape"][0], row["shape"][1] - {32: 16, 8: 2, 6: 1}[
            row["shape"][1]], row["shape"][2]], row
    assert [row["shape"] for row in results["qk_norm_rope"][:9:3]] == [[1, 32, 64], [4, 8, 16],
                                                                        [2, 6, 8]]
    for row in results["route"]:
        assert row["ids_equal"] and row["error"] <= 1e-6, row
    assert len(results["router_route"]) == 24
    for row in results["router_route"]:  # float16's logits rounded once, as F.linear's
        assert row["ids_equal"] and row["repeats"], row
        assert row["error"] <= {"torch.float32": 1e-5, "torch.float16": 2e-3}[row["dtype"]], row
    assert [row["shape"] for row in results["router_route"][:12:2]] == [
        [1, 8], [3, 6], [2, 8], [1, 2], [8, 4], [0, 2]]
    # The interpreter's sin and cos against torch's: the last bit of a float32, now and then
    # (one float16 rounding: an ulp there); the mask exactly.
    assert len(results["rope_and_mask"]) == 8
    for row in results["rope_and_mask"]:
        assert row["mask_equal"] and row["signs_equal"], row
        assert row["error"] <= {"torch.float32": 2e-6, "torch.float16": 1e-3}[row["dtype"]], row
    assert results["rope_and_mask"][1]["shapes"] == [[3, 128], [3, 40001]]
    # Equal probabilities: the lower expert id first.
    assert results["tied"]["ids"] == [[1, 2, 4, 3]]
    third = 1 / (3 + math.exp(-0.5))  # e^1 / (3 e^1 + e^0.5)
    assert results["tied"]["weights"][0][:3] == pytest.approx([third] * 3, rel=1e-6)


_NORM_ROUTER_INTERPRETED = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from test_ops import _norm_router_inputs, _same_bytes
from strata.engine.model import ops

rows = []
# (T, D, E, K, splits, block_d): the default launch (8 splits of one block); 4 splits, the
# last past D; 2 splits of 8 blocks; one split, its block past D; the most tokens; D and E
# not powers of two, several blocks a split; no tokens.
cases = ((1, 256, 64, 8, None, None), (3, 96, 8, 2, None, None), (3, 256, 128, 8, 2, 16),
         (1, 96, 128, 1, 1, 64), (8, 64, 16, 4, None, None), (2, 1000, 60, 6, 4, 64),
         (0, 64, 8, 2, None, None))
for dtype in (torch.bfloat16, torch.float16):
    for seed, (n_tokens, d, n_experts, top_k, splits, block_d) in enumerate(cases):
        x, delta, weight, router = _norm_router_inputs(n_tokens, d, n_experts, dtype, seed)
        for with_delta in (True, False):
            normalize = (seed + with_delta) % 2 == 0
            given = delta if with_delta else None
            shape = {"splits": splits, "block_d": block_d}
            got = ops.add_norm_router_route_triton(x, given, weight, 1e-5, router, top_k,
                                                   normalize, **shape)
            again = ops.add_norm_router_route_triton(x, given, weight, 1e-5, router, top_k,
                                                     normalize, **shape)
            h, normed = ops.add_rms_norm_triton(x, given, weight, 1e-5)
            ids, weights = ops.router_route_triton(normed, router, top_k, normalize, **shape)
            rows.append({
                "dtype": str(dtype), "shape": [n_tokens, d, n_experts, top_k],
                "h_equal": _same_bytes(got[0], h) and (with_delta or got[0] is x),
                "h_is_the_sum": _same_bytes(got[0], x + delta if with_delta else x),
                "normed_equal": _same_bytes(got[1], normed),
                "ids_equal": _same_bytes(got[2], ids),
                "weights_equal": _same_bytes(got[3], weights),
                "repeats": all(_same_bytes(a, b) for a, b in zip(got, again))})
# The op switched on (its kernel at the default launch) against the op switched off (the two
# kernels), as a layer calls it.
switched = []
ops.use_kernels = lambda x: True
x, delta, weight, router = _norm_router_inputs(3, 256, 64, torch.bfloat16, 9)
for switch in (True, False):
    ops.NORM_ROUTER_KERNEL = switch
    switched.append(ops.add_norm_router_route(x, delta, weight, 1e-5, router, 8, True))
print(json.dumps({"rows": rows, "switched_equal": all(
    _same_bytes(a, b) for a, b in zip(*switched))}))
"""


def test_the_norm_and_router_kernel_under_the_interpreter_is_the_two_kernels():
    """h and normed are `add_rms_norm_triton`'s bytes, ids and weights `router_route_triton`'s
    of that normed at the same launch shape (the interpreter's sums are numpy's, in one order
    whatever the warps; on a GPU, `test_on_cuda_the_norm_and_router_kernel_is_the_two_kernels`);
    a second launch gives the same bytes (the arrival counts set back to 0)."""
    pytest.importorskip("triton", reason="the dev extra installs Triton on Linux x86_64")
    results = run_interpreted(_NORM_ROUTER_INTERPRETED, os.path.dirname(__file__))
    assert len(results["rows"]) == 28
    for row in results["rows"]:
        assert all(row[key] for key in ("h_equal", "normed_equal", "ids_equal",
                                        "weights_equal", "repeats")), row
        # The interpreter narrows float32 to bf16 by truncation, not to nearest as torch and
        # the GPU do: in bf16 the kernels agree with each other, not with torch's sum.
        assert row["h_is_the_sum"] or row["dtype"] == "torch.bfloat16", row
    assert {row["dtype"] for row in results["rows"]} == {"torch.bfloat16", "torch.float16"}
    assert results["switched_equal"]


_TOP_K_INTERPRETED = r"""
import json
import torch
from strata.engine.model import ops, routing_ops
gen = torch.Generator().manual_seed(3)
cases = [torch.randn(n, e, generator=gen) * 2 for n, e in ((1, 64), (5, 60), (2, 128), (3, 8))]
cases.append(torch.tensor([[0.0, 1.0, 1.0, 0.5, 1.0, 0.0, 0.0, 0.0]]))  # ties
rows = []
for logits in cases:
    for normalize in (False, True):
        top_k = min(8, logits.shape[1] // 2)
        routing_ops.TOP_K_BY_RANK = False
        ids, weights = ops.route_triton(logits, top_k, normalize)
        routing_ops.TOP_K_BY_RANK = True
        ranked_ids, ranked_weights = ops.route_triton(logits, top_k, normalize)
        rows.append({"ids_equal": torch.equal(ids, ranked_ids),
                     "error": (weights - ranked_weights).abs().max().item()})
print(json.dumps(rows))
"""


def test_the_top_k_by_rank_is_the_top_k_by_rounds():
    """`routing_ops.TOP_K_BY_RANK` on and off: the same ids in the same order (ties to the
    lower id), the same weights up to the renormalizing sum's order."""
    pytest.importorskip("triton", reason="the dev extra installs Triton on Linux x86_64")
    rows = run_interpreted(_TOP_K_INTERPRETED, os.path.dirname(__file__))
    assert len(rows) == 10
    for row in rows:
        assert row["ids_equal"] and row["error"] <= 1e-6, row


@pytest.mark.cuda
def test_on_cuda_the_kernels_match_the_references_in_bf16():
    pytest.importorskip("triton")
    cuda = torch.device("cuda")
    gen = torch.Generator().manual_seed(3)
    x, delta = (torch.randn(2, 7, 2048, generator=gen) * 4).to(torch.bfloat16)
    weight = torch.randn(2048, generator=gen).to(torch.bfloat16)
    h, normed = ops.add_rms_norm(x.to(cuda), delta.to(cuda), weight.to(cuda), 1e-5)
    assert torch.equal(h.cpu(), x + delta)
    expected = ops.rms_norm(x + delta, weight, 1e-5)
    # bf16 rounds at 2^-8 relative; the sum of squares' order can flip a rounding.
    assert ((normed.cpu().float() - expected.float()).abs() <= expected.float().abs() * 2**-7
            + 1e-6).all()
    for norm in ("none", "full", "head"):
        qkv, heads, cos, sin = _qk(3, 16, 4, 128, norm, torch.bfloat16, seed=5)
        on_cuda = heads._replace(weight=heads.weight.to(cuda) if heads.weight is not None
                                 else None)
        positions = torch.tensor([5, 0, 3])
        cells, expected_cells = _cells(8, 4, 128), _cells(8, 4, 128)
        cuda_cells = LayerCells(cells.k.to(cuda), cells.v.to(cuda))
        q = ops.rotate_and_write(qkv.to(cuda), on_cuda, cos.to(cuda), sin.to(cuda),
                                 positions.to(cuda), cuda_cells)
        expected_q = ops.rotate_and_write(qkv, heads, cos, sin, positions, expected_cells)
        for got, expected in ((q, expected_q), (cuda_cells.k, expected_cells.k)):
            assert (got.cpu().float() - expected.float()).abs().max() <= \
                expected.float().abs().max() * 2**-6, norm
        assert torch.equal(cuda_cells.v.cpu(), expected_cells.v)
    # Distinct logits (bf16 holds k/16 exactly): no ties, whose order torch leaves open.
    logits = torch.stack([torch.randperm(128, generator=gen) / 16 for _ in range(9)])
    logits = logits.to(torch.bfloat16)
    ids, weights = ops.route(logits.to(cuda), 8, True)
    expected_ids, expected_weights = ops.route(logits, 8, True)
    assert torch.equal(ids.cpu(), expected_ids)
    assert torch.allclose(weights.cpu(), expected_weights, rtol=1e-5, atol=1e-7)


@pytest.mark.cuda
@pytest.mark.parametrize("n_experts, dim, top_k", [(64, 2048, 8), (128, 2048, 8), (8, 4096, 2)])
def test_on_cuda_router_route_picks_the_top_probabilities_and_replays_in_a_graph(
        n_experts, dim, top_k):
    """The kernel's picks are the top k of the exact logits' probabilities (up to the bf16
    rounding of the logits, which may swap near-equal ones); a CUDA graph replays its bytes."""
    pytest.importorskip("triton")
    cuda = torch.device("cuda")
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(1, dim, generator=gen).to(torch.bfloat16).to(cuda)
    router = (torch.randn(n_experts, dim, generator=gen) * dim ** -0.5).to(torch.bfloat16)
    router = router.to(cuda)
    ids, weights = ops.router_route(x, router, top_k, True)
    probs = torch.softmax(x.float() @ router.float().T, dim=-1)  # [1, E]
    chosen = probs.gather(1, ids)
    assert torch.allclose(chosen, probs.topk(top_k).values, rtol=2e-2)
    assert torch.allclose(weights, chosen / chosen.sum(), rtol=2e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_ids, graph_weights = ops.router_route(x, router, top_k, True)
    for _ in range(3):  # each replay finds the arrival count set back to 0
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(graph_ids, ids) and torch.equal(graph_weights, weights)


def test_rope_and_mask_takes_its_kernel_only_where_switched_on_and_the_head_dim_fits(
        monkeypatch):
    from strata.engine.model import layers

    calls = []
    monkeypatch.setattr(layers, "rope_and_mask_triton", lambda *args: calls.append(args))
    monkeypatch.setattr(ops, "use_kernels", lambda x: True)  # as on CUDA
    positions = torch.tensor([3, 9])
    head_dims = {}
    for head_dim in (16, 24):  # 24: Qwen3's test models', not a power of two
        inv_freq = rope_inv_freq(head_dim, 10000.0, torch.device("cpu"))
        for switched in (False, True):
            monkeypatch.setattr(ops, "ROPE_MASK_KERNEL", switched)
            out = layers.rope_and_mask(positions, inv_freq, 16, None, torch.float32)
            head_dims[head_dim, switched] = out is None  # None: the stand-in kernel ran
            if out is not None:  # the torch ops, as forward_at had them
                assert torch.equal(out[0], rope_cos_sin(positions, inv_freq, torch.float32)[0])
                assert torch.equal(out[2], attention_mask(positions, 16, None, torch.float32))
    assert head_dims == {(16, False): False, (16, True): True, (24, False): False,
                         (24, True): False}
    assert len(calls) == 1


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_on_cuda_rope_and_mask_is_the_torch_ops_byte_for_byte(dtype):
    """CUDA's sinf and cosf, as torch's kernels call them: the same bytes, far positions (large
    angles) included."""
    pytest.importorskip("triton")
    cuda = torch.device("cuda")
    positions = torch.tensor([0, 7, 4095, 40000], device=cuda)
    for head_dim, theta, window in ((128, 1e6, None), (64, 10000.0, 1000)):
        inv_freq = rope_inv_freq(head_dim, theta, cuda)
        cos, sin, mask = ops.rope_and_mask_triton(positions, inv_freq, 40001, window, dtype)
        expected_cos, expected_sin = rope_cos_sin(positions, inv_freq, dtype)
        assert torch.equal(cos, expected_cos) and torch.equal(sin, expected_sin)
        assert torch.equal(mask, attention_mask(positions, 40001, window, dtype))


@pytest.mark.cuda
@pytest.mark.parametrize("switch, family", [
    ("ROPE_MASK_KERNEL", "qwen3_moe"), ("NORM_ROUTER_KERNEL", "qwen3_moe"),
    ("NORM_ROUTER_KERNEL", "qwen2_moe")])  # qwen2_moe: a shared expert after the routing
def test_on_cuda_decode_with_a_staged_kernel_gives_the_tokens_without_it(monkeypatch, switch,
                                                                         family):
    """300 rounds, each replayed from a graph captured with the kernel switched on (rotary
    tables and mask; a layer's sum, norm and routing), give the tokens of the ops it stands
    in for."""
    pytest.importorskip("triton")
    ckpt = cached_checkpoint(family, "tiny", dtype=torch.bfloat16)
    options = GenerateOptions(max_new=300, max_context=512, temperature=0.0, ignore_stop=True)
    runs = []
    for kernel in (False, True):
        monkeypatch.setattr(ops, switch, kernel)
        model, tok = load_model(ckpt, device="cuda"), Tokenizer.from_dir(ckpt)  # graphs anew
        runs.append(generate(model, tok, tok.encode("rotary tables"), options))
    assert runs[1].decode_path == "cuda-graph" and runs[1].tokens == runs[0].tokens


@pytest.mark.cuda
@pytest.mark.parametrize("n_tokens, n_experts, dim, top_k", [(1, 64, 2048, 8), (3, 128, 2048, 8),
                                                             (1, 8, 4096, 2)])
def test_on_cuda_the_norm_and_router_kernel_is_the_two_kernels(monkeypatch, n_tokens,
                                                                n_experts, dim, top_k):
    """h and normed: `add_rms_norm`'s kernel's bytes (launched with its warps, NORM_WARPS, the
    kernel sums a row's squares in its order). ids and weights: `router_route_triton`'s of
    that normed at those warps, byte for byte; against `router_route` at its own ROUTER_WARPS,
    whose last program sums the splits' parts in another order (a logit may round the other
    way, now and then), the same experts and close weights. A CUDA graph replays its bytes
    (each replay finds the arrival counts set back to 0)."""
    pytest.importorskip("triton")
    cuda = torch.device("cuda")
    x, delta, weight, router = (t.to(cuda) for t in _norm_router_inputs(
        n_tokens, dim, n_experts, torch.bfloat16, seed=11))
    for given in (delta, None):
        got = ops.add_norm_router_route_triton(x, given, weight, 1e-6, router, top_k, True)
        h, normed = ops.add_rms_norm(x, given, weight, 1e-6)
        assert _same_bytes(got[0], h) and (given is not None or got[0] is x)
        assert _same_bytes(got[1], normed)
        ids, weights = ops.router_route_triton(normed, router, top_k, True,
                                               num_warps=NORM_WARPS)
        assert _same_bytes(got[2], ids) and _same_bytes(got[3], weights)
        ids, weights = ops.router_route(normed, router, top_k, True)
        assert torch.equal(got[2], ids) and torch.allclose(got[3], weights, rtol=2e-2)
    monkeypatch.setattr(ops, "NORM_ROUTER_KERNEL", True)
    eager = ops.add_norm_router_route(x, delta, weight, 1e-6, router, top_k, True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = ops.add_norm_router_route(x, delta, weight, 1e-6, router, top_k, True)
    for _ in range(3):
        for out in replayed:
            out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert all(_same_bytes(a, b) for a, b in zip(replayed, eager, strict=True))


_MODEL_INTERPRETED = r"""
import json, sys, tempfile
import torch
from pathlib import Path
from support.checkpoints import make_checkpoint
from strata.engine.kv import new_kv
from strata.engine.model import load_model, ops

def logits_of(model, kernels):
    # A prompt of 5 tokens, then 2 decode steps: every op of every layer, the K/V written by
    # the rotation's kernel read back by the later steps.
    # Then 2 steps through forward_at (a decode graph's): its rotary tables and mask by
    # their kernel too. Each layer's sum, norm and routing after attention by their one
    # kernel (the prompt's 5 tokens too): its launches counted.
    use, rope_mask, norm_router = ops.use_kernels, ops.ROPE_MASK_KERNEL, ops.NORM_ROUTER_KERNEL
    fused = ops.add_norm_router_route_triton
    launches = []
    ops.use_kernels = (lambda x: True) if kernels else (lambda x: False)
    ops.ROPE_MASK_KERNEL = ops.NORM_ROUTER_KERNEL = kernels
    ops.add_norm_router_route_triton = lambda *args: launches.append(1) or fused(*args)
    try:
        with new_kv(model, 16) as kv:
            rows = [model.forward(torch.tensor([3, 1, 4, 1, 5]), 0, kv)]
            rows += [model.forward(torch.tensor([9 + step]), 5 + step, kv) for step in range(2)]
            rows += [model.forward_at(torch.tensor([2 + step]), torch.tensor([7 + step]), kv, 16)
                     for step in range(2)]
            return torch.cat(rows), len(launches)
    finally:
        ops.use_kernels, ops.ROPE_MASK_KERNEL, ops.NORM_ROUTER_KERNEL = use, rope_mask, norm_router
        ops.add_norm_router_route_triton = fused

results = {}
with tempfile.TemporaryDirectory() as tmp:
    for family in ("olmoe", "qwen3_moe", "mixtral"):
        ckpt = make_checkpoint(Path(tmp) / family, family, dtype=torch.float32)
        model = load_model(ckpt, dtype=torch.float32)
        (reference, none), (kernels, launches) = logits_of(model, False), logits_of(model, True)
        results[family] = {"error": (kernels - reference).abs().max().item(),
                           "scale": reference.abs().max().item(),
                           "argmax_equal": torch.equal(kernels.argmax(-1), reference.argmax(-1)),
                           "fused_launches": [none, launches, model.config.n_layers]}
print(json.dumps(results))
"""


def test_a_model_run_through_the_kernels_under_the_interpreter_matches_the_torch_ops():
    """The kernels in place of the torch ops in a whole forward (the residual handed on
    unsummed, k and v written by the rotation's kernel, the sum after attention, the MoE's
    norm and its routing by one kernel in every layer: 5 forwards' worth of launches, none
    switched off), one family per norm kind."""
    pytest.importorskip("triton", reason="the dev extra installs Triton on Linux x86_64")
    results = run_interpreted(_MODEL_INTERPRETED, os.path.dirname(__file__))
    assert sorted(results) == ["mixtral", "olmoe", "qwen3_moe"]
    for family, row in results.items():
        assert row["argmax_equal"] and row["error"] <= 1e-4 * max(row["scale"], 1.0), family
        none, launches, n_layers = row["fused_launches"]
        assert none == 0 and launches == 5 * n_layers, family
