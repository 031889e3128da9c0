"""`strata.engine.model.projected_attention`: one token's rotation, K/V write, short attention
and output projection as one kernel. Under Triton's interpreter on the CPU (a fresh
interpreter): against `decode_attention.rotate_attend` then wo's product in float32, over
each q/k norm, grouped and ungrouped heads, R not a power of two, rows of wo that end inside a
block, one cell, launched twice (the arrival counts set back); the cells it writes the
rotation's; a model's decode steps through it; bad operands refused. On CUDA: its bytes from
plain launches, as dependents and from a CUDA graph; against the two kernels in bf16; a
model's greedy tokens every way."""

from __future__ import annotations

import os

import pytest
import torch

from strata.engine.model import decode_attention, projected_attention
from strata.engine.model.projected_attention import row_block, tile_elements
from support.interpreted import run_interpreted


def test_a_launch_is_one_wave_of_programs_and_holds_its_tile():
    """A block of wo's rows keeps the G kv heads' programs within the most asked for, and the
    layer takes the kernel only where that tile fits MAX_TILE_ELEMENTS: at olmoe-1b-7b's
    shape, not at qwen3-30b-a3b's or mixtral-8x7b's."""
    from strata.engine.model.ops import QKHeads

    assert row_block(2048, 16, 128) == 256  # olmoe: 8 blocks of 256 rows a kv head
    assert row_block(2048, 4, 128) == 64  # qwen3: 32 blocks
    assert row_block(40, 2, 128) == 1  # no fewer than one row a block
    assert row_block(2048, 16, 8) == 2048  # no fewer than one block a kv head
    olmoe, qwen3, mixtral = (QKHeads(16, 16, 128, "full", None, 1e-6, None),
                             QKHeads(32, 4, 128, "head", None, 1e-6, None),
                             QKHeads(32, 8, 128, "none", None, 1e-6, None))
    assert tile_elements(2048, olmoe, 128) == 32768 == projected_attention.MAX_TILE_ELEMENTS
    assert tile_elements(2048, qwen3, 128) == 8 * 64 * 128
    assert tile_elements(4096, mixtral, 128) == 4 * 256 * 128


def _qk_inputs(monkeypatch):
    """test_ops' `_qk` (a layer's qkv, heads, cos, sin), imported from beside this file."""
    monkeypatch.syspath_prepend(os.path.dirname(__file__))
    from test_ops import _qk

    return _qk


def test_off_by_default_and_never_with_a_bias(monkeypatch):
    """Staged: the layer takes the kernel only where PROJECT_KERNEL is on; a bias on wo (which
    the kernel does not add) keeps the two kernels whatever the switch."""
    _qk = _qk_inputs(monkeypatch)

    from strata.engine.model.kv_cells import LayerCells

    qkv, heads, _, _ = _qk(1, 4, 2, 32, "head", torch.float16, 0)
    cells = LayerCells(*torch.zeros(2, 8, 2, 32, dtype=torch.float16))
    wo = torch.zeros(64, 128, dtype=torch.float16)
    at = torch.tensor([3])
    assert not projected_attention.PROJECT_KERNEL
    assert not projected_attention.projects(qkv, heads, cells, 8, at, wo, None)
    monkeypatch.setattr(projected_attention, "PROJECT_KERNEL", True)
    monkeypatch.setattr(decode_attention, "rotates", lambda *args: True)
    assert projected_attention.projects(qkv, heads, cells, 8, at, wo, None)
    assert not projected_attention.projects(qkv, heads, cells, 8, at, wo,
                                            torch.zeros(64, dtype=torch.float16))
    assert not projected_attention.projects(qkv, heads, cells, 8, at, wo.float(), None)
    monkeypatch.setattr(decode_attention, "rotates", lambda *args: False)
    assert not projected_attention.projects(qkv, heads, cells, 8, at, wo, None)


_INTERPRETED = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from test_ops import _qk
from strata.engine.model import decode_attention, projected_attention
from strata.engine.model.kv_cells import LayerCells
from strata.engine.model.layers import attention_mask, rope_cos_sin, rope_inv_freq

results = {"shapes": [], "refused": []}
# (H, G, Dh, D, N, position, window, norm, programs): olmoe's norm over every head and
# qwen3's each head's, none; grouped (R = 4, and R = 3: a tile's head padded) and not; values
# before the wait and not; D = 40 ending inside a block of 16 rows; blocks of one row; one
# cell.
for seed, (h, g, dh, d, n, position, window, norm, programs) in enumerate((
        (4, 4, 32, 64, 40, 39, None, "full", 16), (8, 2, 32, 96, 200, 150, None, "head", 8),
        (6, 2, 64, 40, 100, 99, 30, "none", 8), (2, 1, 32, 48, 1, 0, None, "head", 128))):
    qkv, heads, _, _ = _qk(1, h, g, dh, norm, torch.float16, seed)
    at = torch.tensor([position])
    cos, sin = rope_cos_sin(at, rope_inv_freq(dh, 10000.0, torch.device("cpu")), torch.float16)
    gen = torch.Generator().manual_seed(seed)
    k, v = torch.randn(2, n, g, dh, generator=gen).to(torch.float16)
    wo = (torch.randn(d, h * dh, generator=gen) / (h * dh) ** 0.5).to(torch.float16)
    apart, fused = LayerCells(k.clone(), v.clone()), LayerCells(k.clone(), v.clone())
    mask = attention_mask(at, n, window, torch.float16)
    heads_out = decode_attention.rotate_attend_triton(qkv, heads, cos, sin, at, apart, n, mask,
                                                      dh ** -0.5)  # [1, H*Dh]
    exact = heads_out.float() @ wo.float().T  # [1, D]
    got = [projected_attention.rotate_attend_project_triton(
        qkv, heads, cos, sin, at, fused, n, mask, dh ** -0.5, wo, max_programs=programs)
        for _ in range(2)]
    results["shapes"].append({
        "shape": list(got[0].shape), "dtype": str(got[0].dtype),
        "k_equal": torch.equal(fused.k, apart.k), "v_equal": torch.equal(fused.v, apart.v),
        "again_equal": torch.equal(got[0], got[1]),
        "error": ((got[0].float() - exact).abs().max() / exact.abs().max()).item()})
qkv, heads, cos, sin = _qk(1, 4, 2, 32, "head", torch.float16, 0)
cells = LayerCells(*torch.zeros(2, 8, 2, 32, dtype=torch.float16))
for wo in (torch.zeros(64, 96, dtype=torch.float16), torch.zeros(64, 128)):
    try:
        projected_attention.rotate_attend_project_triton(qkv, heads, cos[:1], sin[:1],
                                                         torch.tensor([3]), cells, 8, None,
                                                         0.25, wo)
    except ValueError as err:
        results["refused"].append(str(err))
try:
    projected_attention.rotate_attend_project_triton(
        qkv[:, :-32], heads, cos[:1], sin[:1], torch.tensor([3]), cells, 8, None, 0.25,
        torch.zeros(64, 128, dtype=torch.float16))
except ValueError as err:
    results["refused"].append(str(err))
try:
    projected_attention.rotate_attend_project(qkv, heads, cos[:1], sin[:1], torch.tensor([3]),
                                              cells, 8, None, 0.25,
                                              torch.zeros(64, 128, dtype=torch.float16))
except ValueError as err:
    results["refused"].append(str(err))
print(json.dumps(results))
"""


def test_under_the_interpreter_the_kernel_is_the_rotating_attention_then_the_product():
    pytest.importorskip("triton", reason="the dev extra installs Triton on Linux x86_64")
    results = run_interpreted(_INTERPRETED, os.path.dirname(__file__))
    assert [(row["shape"], row["dtype"]) for row in results["shapes"]] == [
        ([1, 64], "torch.float16"), ([1, 96], "torch.float16"), ([1, 40], "torch.float16"),
        ([1, 48], "torch.float16")]
    for row in results["shapes"]:
        assert row["k_equal"] and row["v_equal"] and row["again_equal"], row
        assert row["error"] <= 2e-3, row
    assert "needs wo [D, 128] in torch.float16 with contiguous rows, got [64, 96]" \
        in results["refused"][0]
    assert "got [64, 128] torch.float32" in results["refused"][1]
    assert "rotate_attend_project needs qkv [1, 256] with contiguous columns" \
        in results["refused"][2]
    assert "with PROJECT_KERNEL on" in results["refused"][3]


_MODEL_INTERPRETED = r"""
import json, sys, tempfile
from pathlib import Path
import torch
sys.path.insert(0, sys.argv[1])
from strata.engine.kv import new_kv
from strata.engine.model import decode_attention, load_model, projected_attention
from support.checkpoints import make_checkpoint

def logits_of(model, on, launched):
    projects, launch = projected_attention.projects, projected_attention.rotate_attend_project
    rotates = decode_attention.rotates
    # The interpreter computes no bf16 products: a float32 model, the kernels told yes.
    projected_attention.projects = lambda qkv, *rest: on and qkv.shape[0] == 1
    decode_attention.rotates = lambda qkv, *rest: on and qkv.shape[0] == 1
    projected_attention.rotate_attend_project = (
        lambda *args: launched.append(1) or projected_attention.rotate_attend_project_triton(
            *args))
    try:
        with new_kv(model, 16) as kv:
            rows = [model.forward(torch.tensor([3, 1, 4, 1, 5]), 0, kv)]
            rows += [model.forward(torch.tensor([9 + step]), 5 + step, kv) for step in range(3)]
            return torch.cat(rows)
    finally:
        projected_attention.projects = projects
        projected_attention.rotate_attend_project = launch
        decode_attention.rotates = rotates

results = []
for family in ("olmoe", "qwen3_moe"):
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_checkpoint(Path(tmp) / "ckpt", family, "small", n_layers=2,
                               dtype=torch.float32)
        model = load_model(ckpt, dtype=torch.float32)
        launched = []
        apart, kernel = logits_of(model, False, launched), logits_of(model, True, launched)
    results.append({"prompt_equal": torch.equal(apart[:5], kernel[:5]),
                    "error": (apart - kernel).abs().max().item(),
                    "scale": apart.abs().max().item(), "launches": len(launched),
                    "argmax_equal": torch.equal(apart.argmax(-1), kernel.argmax(-1))})
print(json.dumps(results))
"""


def test_under_the_interpreter_a_model_decodes_through_the_kernel():
    """A float32 model's three decode steps with the kernel in the layers' place of the
    rotating attention and wo's product (olmoe's norm over every head, qwen3's each head's):
    the prompt's logits untouched, the steps' within float32 rounding, the same argmax."""
    pytest.importorskip("triton", reason="the dev extra installs Triton on Linux x86_64")
    for model in run_interpreted(_MODEL_INTERPRETED, os.path.dirname(__file__)):
        assert model["prompt_equal"] and model["launches"] == 3 * 2, model
        assert model["argmax_equal"] and model["error"] <= 1e-4 * max(model["scale"], 1.0)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(16, 16, 128, 2048, "full"), (32, 4, 128, 2048, "head"),
                                   (32, 8, 128, 4096, "none")],
                         ids=["olmoe", "qwen3", "mixtral"])
def test_on_cuda_the_kernel_is_the_two_kernels_within_rounding_and_its_own_bytes_every_way(
        monkeypatch, shape):
    """At the presets' heads in bf16, 64 cells: the kernel against `rotate_attend` then
    `products.linear` (the path it replaces) within bf16 rounding, the cells the same bytes;
    32 chained launches (each attending the cells the last wrote) the same bytes plainly, as
    dependents and replayed from a CUDA graph."""
    pytest.importorskip("triton")
    _qk = _qk_inputs(monkeypatch)

    from strata.engine import dependent_launch
    from strata.engine.model import products
    from strata.engine.model.kv_cells import LayerCells
    from strata.engine.model.layers import attention_mask, rope_cos_sin, rope_inv_freq

    h, g, dh, d, norm = shape
    qkv, heads, _, _ = _qk(1, h, g, dh, norm, torch.bfloat16, 0)
    qkv, heads = qkv.cuda(), heads._replace(weight=None if heads.weight is None
                                            else heads.weight.cuda())
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, 64, g, dh, generator=gen).to(torch.bfloat16).cuda()
    wo = (torch.randn(d, h * dh, generator=gen) / (h * dh) ** 0.5).to(torch.bfloat16).cuda()
    inv_freq = rope_inv_freq(dh, 10000.0, torch.device("cuda"))
    at = torch.tensor([40], device="cuda")
    cos, sin = rope_cos_sin(at, inv_freq, torch.bfloat16)
    mask = attention_mask(at, 64, None, torch.bfloat16)
    apart, fused = LayerCells(k.clone(), v.clone()), LayerCells(k.clone(), v.clone())
    two = products.linear(decode_attention.rotate_attend_triton(
        qkv, heads, cos, sin, at, apart, 64, mask, dh ** -0.5), wo, None)
    one = projected_attention.rotate_attend_project_triton(qkv, heads, cos, sin, at, fused, 64,
                                                           mask, dh ** -0.5, wo)
    assert torch.equal(fused.k, apart.k) and torch.equal(fused.v, apart.v)
    assert (one.float() - two.float()).abs().max() <= 2e-2 * two.float().abs().max()

    def chain():
        cells = LayerCells(k.clone(), v.clone())
        return torch.cat([projected_attention.rotate_attend_project_triton(
            qkv, heads, cos, sin, torch.tensor([step], device="cuda"), cells, 64, mask,
            dh ** -0.5, wo) for step in range(32)])

    monkeypatch.setattr(dependent_launch, "enabled", False)
    plain = chain()
    monkeypatch.setattr(dependent_launch, "enabled", True)
    assert torch.equal(chain(), plain)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = chain()
    for _ in range(3):
        replayed.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, plain)


@pytest.mark.cuda
@pytest.mark.parametrize("family", ["olmoe", "qwen3_moe"])
def test_on_cuda_a_model_decodes_the_same_tokens_every_way_through_the_kernel(monkeypatch,
                                                                             family):
    """A small bf16 model's greedy decode with PROJECT_KERNEL on: the kernel runs, and gives
    the same tokens from CUDA graphs as dependents and plainly, and eagerly (a program that
    summed a partial before its writer stored it, or a count left set, would not)."""
    pytest.importorskip("triton")
    import dataclasses

    from strata.engine import dependent_launch
    from strata.engine.model.moe import load_model
    from strata.engine.model.tokenizer import Tokenizer
    from strata.engine.runtime.generate import GenerateOptions, generate
    from support.checkpoints import cached_checkpoint

    ckpt = cached_checkpoint(family, "small", dtype=torch.bfloat16)
    options = GenerateOptions(max_new=40, max_context=256, temperature=0.0, ignore_stop=True)
    monkeypatch.setattr(projected_attention, "PROJECT_KERNEL", True)
    launched = []
    launch = projected_attention.rotate_attend_project_triton
    monkeypatch.setattr(projected_attention, "rotate_attend_project_triton",
                        lambda *args, **kw: launched.append(1) or launch(*args, **kw))

    def run(**changes):
        model, tok = load_model(ckpt, device="cuda"), Tokenizer.from_dir(ckpt)
        return generate(model, tok, tok.encode("the projection folded in"),
                        dataclasses.replace(options, **changes))

    fused = run()
    assert launched and fused.decode_path == "cuda-graph"
    monkeypatch.setattr(dependent_launch, "enabled", False)
    plain = run()
    monkeypatch.setattr(dependent_launch, "enabled", True)
    eager = run(cuda_graphs=False)
    assert fused.tokens == plain.tokens == eager.tokens
