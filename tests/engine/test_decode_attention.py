"""`strata.engine.model.decode_attention`: one token's attention as one kernel. Under Triton's
interpreter on the CPU (a fresh interpreter: TRITON_INTERPRET is set before Triton is
imported): against a float32 reference over odd head counts, lengths that end inside a split,
whole splits masked (a sliding window), one cell, no mask, launched twice (the arrival counts
set back); a model's decode steps through it; bad launch shapes refused. On CUDA: the kernel in
bf16 against the reference and the fused path it replaces, its bytes replayed from a CUDA
graph, and the layer taking it for one token alone."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from strata.engine.model import decode_attention
from support.bench_scripts import load_bench
from support.interpreted import run_interpreted


def reference(q, keys, values, mask, scale):
    """q [1, H, Dh] over keys, values [G, N, Dh] in float32 -> [1, H*Dh] (float32)."""
    r = q.shape[1] // keys.shape[0]
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1), keys.float().repeat_interleave(r, 0),
        values.float().repeat_interleave(r, 0),
        attn_mask=None if mask is None else mask.float(), scale=scale)  # [H, 1, Dh]
    return out.reshape(1, -1)


def decode_with(launcher, family="qwen3_moe", preset="tiny"):
    """A float32 checkpoint's logits (`family`, `preset` cut to 2 layers) for a 5-token
    prompt, then 3 decode steps, by the layers' fused path and again with `takes` told yes
    for one token (the interpreter computes no bf16 products), `launcher` (the name of
    decode_attention's launch function to count; "attend_short_triton" also switches
    SHORT_KERNEL on, "rotate_attend_triton" tells `rotates` yes for one token): how far apart
    they are and how many times the launcher ran."""
    import tempfile
    from pathlib import Path

    from strata.engine.kv import new_kv
    from strata.engine.model import load_model
    from support.checkpoints import make_checkpoint

    launched = []

    def logits_of(model, on):
        takes, rotates = decode_attention.takes, decode_attention.rotates
        short = decode_attention.SHORT_KERNEL
        launch = getattr(decode_attention, launcher)
        decode_attention.takes = lambda q, k, v: on and q.shape[0] == 1
        decode_attention.SHORT_KERNEL = on and launcher == "attend_short_triton"
        if launcher == "rotate_attend_triton":
            decode_attention.rotates = lambda qkv, *rest: on and qkv.shape[0] == 1
        setattr(decode_attention, launcher,
                lambda *args, **kw: launched.append(1) or launch(*args, **kw))
        try:
            with new_kv(model, 16) as kv:
                rows = [model.forward(torch.tensor([3, 1, 4, 1, 5]), 0, kv)]
                rows += [model.forward(torch.tensor([9 + step]), 5 + step, kv)
                         for step in range(3)]
                return torch.cat(rows)
        finally:
            decode_attention.takes, decode_attention.rotates = takes, rotates
            decode_attention.SHORT_KERNEL = short
            setattr(decode_attention, launcher, launch)

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_checkpoint(Path(tmp) / "ckpt", family, preset, n_layers=2,
                               dtype=torch.float32)
        model = load_model(ckpt, dtype=torch.float32)
        fused, kernel = logits_of(model, False), logits_of(model, True)
    return {"prompt_equal": torch.equal(fused[:5], kernel[:5]),
            "error": (fused - kernel).abs().max().item(), "scale": fused.abs().max().item(),
            "launches": len(launched),
            "argmax_equal": torch.equal(fused.argmax(-1), kernel.argmax(-1))}


def inputs(n_heads, n_kv_heads, head_dim, n_cells, dtype, seed, device="cpu"):
    """q [1, H, Dh] and keys, values [G, N, Dh] as `LayerCells.read` gives them: views of
    cells [N, G, Dh]."""
    gen = torch.Generator(device).manual_seed(seed)
    q = torch.randn(1, n_heads, head_dim, generator=gen, device=device).to(dtype)
    cells = torch.randn(2, n_cells, n_kv_heads, head_dim, generator=gen, device=device)
    cells = cells.to(dtype)
    return q, cells[0].transpose(0, 1), cells[1].transpose(0, 1)


_INTERPRETED = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from test_decode_attention import decode_with, inputs, reference
from strata.engine.model import decode_attention
from strata.engine.model.layers import attention_mask

results = {"shapes": [], "refused": []}
# (H, G, Dh, N, position, window, split, block): one kv head for all (R = 8), R = 3, no GQA;
# N ending inside a split; a window masking whole splits; one cell; no mask (position None).
for seed, (h, g, dh, n, position, window, split, block) in enumerate((
        (8, 1, 64, 300, 290, None, 64, 32), (6, 2, 16, 40, 39, None, 32, 16),
        (4, 4, 32, 130, 129, 20, 32, 16), (2, 1, 16, 1, 0, None, 64, 16),
        (3, 3, 16, 50, None, None, 32, 32))):
    q, keys, values = inputs(h, g, dh, n, torch.float16, seed)
    mask = None if position is None else attention_mask(torch.tensor([position]), n, window,
                                                        torch.float16)
    exact = reference(q, keys, values, mask, dh ** -0.5)
    # In order; then as reductions, 2 splits at a time, with at most 3 programs a kv head.
    for variant in ({}, {"max_splits": 3, "merge_splits": 2}):
        got = decode_attention.attend_one_triton(q, keys, values, mask, dh ** -0.5,
                                                 split_cells=split, block_cells=block, **variant)
        again = decode_attention.attend_one_triton(q, keys, values, mask, dh ** -0.5,
                                                   split_cells=split, block_cells=block,
                                                   **variant)
        results["shapes"].append({"shape": list(got.shape), "dtype": str(got.dtype),
                                  "repeats": torch.equal(got, again),
                                  "error": ((got.float() - exact).abs().max()
                                            / exact.abs().max()).item()})
q, keys, values = inputs(4, 2, 16, 8, torch.float16, 0)
for kwargs in ({"block_cells": 8}, {"split_cells": 48, "block_cells": 32},
               {"merge_splits": 3}):
    try:
        decode_attention.attend_one_triton(q, keys, values, None, 0.25, **kwargs)
    except ValueError as err:
        results["refused"].append(str(err))
try:
    decode_attention.attend_one_triton(q, keys, values, torch.zeros(1, 7, dtype=torch.float16),
                                       0.25)
except ValueError as err:
    results["refused"].append(str(err))

# A model's decode steps through the kernel against the fused path.
results["model"] = decode_with("attend_one_triton")
print(json.dumps(results))
"""


def test_the_kernel_under_the_interpreter_matches_the_reference_and_a_model_decodes_with_it():
    pytest.importorskip("triton", reason="the dev extra installs Triton on Linux x86_64")
    results = run_interpreted(_INTERPRETED, os.path.dirname(__file__))
    assert [row["shape"] for row in results["shapes"]][::2] == [[1, 512], [1, 96], [1, 128],
                                                                 [1, 32], [1, 48]]
    assert len(results["shapes"]) == 10
    for row in results["shapes"]:
        # float16 P before its product with V: a rounding of the largest output, or two.
        assert row["dtype"] == "torch.float16" and row["repeats"], row
        assert row["error"] <= 2e-3, row
    assert "block_cells must be a power of two >= 16" in results["refused"][0]
    assert "dividing split_cells, got 32 and 48" in results["refused"][1]
    assert "merge_splits 0 or a power of two, got None and 3" in results["refused"][2]
    assert "mask must be [1, 8]" in results["refused"][3]
    model = results["model"]
    assert model["prompt_equal"]  # a prompt chunk never takes the kernel
    assert model["launches"] == 3 * 2  # each decode step's layers (the checkpoint has 2)
    assert model["argmax_equal"] and model["error"] <= 1e-4 * max(model["scale"], 1.0)


def test_off_cuda_the_layer_keeps_the_fused_path():
    q, keys, values = inputs(4, 2, 16, 8, torch.bfloat16, 0)
    assert not decode_attention.takes(q, keys, values)
    with pytest.raises(ValueError, match=r"attend_one takes one token q \[1, H, Dh\] in bf16 "
                       r"or fp16 on CUDA .* got q \[1, 4, 16\] torch.bfloat16 on cpu"):
        decode_attention.attend_one(q, keys, values, None, 0.25)


def test_the_launch_shape_spreads_short_windows_and_merges_fewer_splits_on_long_ones():
    assert decode_attention.launch_shape(256, 1) == (128, 4)  # olmoe: 2 splits a head
    assert decode_attention.launch_shape(1024, 8) == (128, 8)  # qwen3: 8
    assert decode_attention.launch_shape(4096, 8) == (256, 8)  # 16, not 32
    assert decode_attention.launch_shape(16384, 8) == (1024, 8)  # at most 16: not 64
    assert decode_attention.launch_shape(5000, 4) == (512, 8)  # 10 splits


def test_the_bench_cycles_enough_layers_to_read_from_memory(capsys):
    bench = load_bench("decode_attention.py")
    # olmoe at 256 cells: 2 MiB of K/V a layer, so 128 layers for 4x 64 MiB, capped at 64.
    assert bench.layers_for(256, 16, 128, cap=64) == 64
    assert bench.layers_for(16384, 16, 128, cap=256) == 2  # 128 MiB a layer: two suffice
    assert bench.heads("qwen3-30b-a3b") == (32, 4, 128)
    if torch.cuda.is_available():
        pytest.skip("the sweep itself runs on the GPU machine (bench/gpu_session.sh)")
    assert bench.main([]) == 1
    assert "needs CUDA" in capsys.readouterr().out


@pytest.mark.cuda
@pytest.mark.parametrize("n_heads, n_kv_heads, n_cells", [(16, 16, 256), (32, 4, 1000),
                                                          (32, 8, 16384)])
def test_on_cuda_the_kernel_matches_the_fused_path_and_replays_its_bytes(n_heads, n_kv_heads,
                                                                          n_cells):
    """olmoe's heads at a first window, qwen3's inside a later one, mixtral's at 16K cells."""
    pytest.importorskip("triton")
    from strata.engine.model.layers import Attention, attention_mask

    q, keys, values = inputs(n_heads, n_kv_heads, 128, n_cells, torch.bfloat16, 1, "cuda")
    mask = attention_mask(torch.tensor([n_cells - 30], device="cuda"), n_cells, None,
                          torch.bfloat16)
    assert decode_attention.takes(q, keys, values)
    got = decode_attention.attend_one(q, keys, values, mask, 128**-0.5)
    exact = reference(q, keys, values, mask, 128**-0.5)
    fused = Attention._folded(type("A", (), {"n_kv_heads": n_kv_heads, "scale": 128**-0.5}),
                              q, keys, values, mask)
    scale = exact.abs().max()
    assert (got.float() - exact).abs().max() <= 1e-2 * scale
    assert (got.float() - fused.float()).abs().max() <= 2e-2 * scale
    at_once = decode_attention.attend_one_triton(q, keys, values, mask, 128**-0.5,
                                                 max_splits=16, merge_splits=4)
    assert (at_once.float() - exact).abs().max() <= 1e-2 * scale  # the sweep's variant
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = decode_attention.attend_one(q, keys, values, mask, 128**-0.5)
    for _ in range(3):  # each replay finds the arrival counts set back to 0
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, got)


@pytest.mark.cuda
def test_on_cuda_ungrouped_heads_past_one_window_keep_the_fused_path():
    """Without grouped kv heads SDPA read long windows faster: the layer keeps it there."""
    pytest.importorskip("triton")
    q, keys, values = inputs(16, 16, 128, 512, torch.bfloat16, 2, "cuda")
    assert decode_attention.takes(q, keys[:, :256], values[:, :256])
    assert not decode_attention.takes(q, keys, values)
    grouped, keys, values = inputs(32, 4, 128, 512, torch.bfloat16, 2, "cuda")
    assert decode_attention.takes(grouped, keys, values)


_SHORT_INTERPRETED = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from test_decode_attention import decode_with, inputs, reference
from strata.engine.model import decode_attention
from strata.engine.model.layers import attention_mask

results = {"shapes": [], "refused": []}
# (H, G, Dh, N, position, window): grouped heads with keys and values read before the wait
# (N * Dh <= 128 * 128); the keys alone (200 cells of 128: 256 * 128 rounded); R = 3 and a
# window; one cell; no mask.
for seed, (h, g, dh, n, position, window) in enumerate((
        (8, 2, 32, 40, 39, None), (4, 1, 128, 200, 150, None), (6, 2, 16, 130, 129, 20),
        (2, 1, 16, 1, 0, None), (3, 3, 16, 50, None, None))):
    q, keys, values = inputs(h, g, dh, n, torch.float16, seed)
    mask = None if position is None else attention_mask(torch.tensor([position]), n, window,
                                                        torch.float16)
    at = torch.tensor([n - 1 if position is None else position])
    exact = reference(q, keys, values, mask, dh ** -0.5)
    got = decode_attention.attend_short_triton(q, keys, values, mask, dh ** -0.5, at)
    again = decode_attention.attend_short_triton(q, keys, values, mask, dh ** -0.5, at)
    results["shapes"].append({"shape": list(got.shape), "repeats": torch.equal(got, again),
                              "error": ((got.float() - exact).abs().max()
                                        / exact.abs().max()).item()})
q, keys, values = inputs(4, 2, 16, 8, torch.float16, 0)
for args in ((None, torch.tensor([3], dtype=torch.int32)), (None, torch.tensor([1, 2])),
             (torch.zeros(1, 7, dtype=torch.float16), torch.tensor([3]))):
    try:
        decode_attention.attend_short_triton(q, keys, values, args[0], 0.25, args[1])
    except ValueError as err:
        results["refused"].append(str(err))
q, keys, values = inputs(4, 2, 128, 300, torch.float16, 0)
try:
    decode_attention.attend_short_triton(q, keys, values, None, 0.25, torch.tensor([3]))
except ValueError as err:
    results["refused"].append(str(err))

# A model's decode steps through it, as the layer calls it, against the fused path.
results["model"] = decode_with("attend_short_triton")
print(json.dumps(results))
"""


def test_the_short_kernel_under_the_interpreter_matches_the_reference():
    """`attend_short` (`SHORT_KERNEL`, on by default): one program a kv head over every cell,
    with and without the values read before the wait, against the float32 reference; a
    model's decode steps through it; bad positions and masks refused."""
    pytest.importorskip("triton", reason="the dev extra installs Triton on Linux x86_64")
    results = run_interpreted(_SHORT_INTERPRETED, os.path.dirname(__file__))
    assert [row["shape"] for row in results["shapes"]] == [[1, 256], [1, 512], [1, 96],
                                                            [1, 32], [1, 48]]
    for row in results["shapes"]:
        assert row["repeats"] and row["error"] <= 2e-3, row
    assert "position as int64 [1], got torch.int32 [1]" in results["refused"][0]
    assert "got torch.int64 [2]" in results["refused"][1]
    assert "mask must be [1, 8]" in results["refused"][2]
    assert "300 cells of 128 (rounded to 512 x 128) are past its 32768" in results["refused"][3]
    model = results["model"]
    assert model["launches"] == 3 * 2  # each decode step's layers (the checkpoint has 2)
    assert model["argmax_equal"] and model["error"] <= 1e-4 * max(model["scale"], 1.0)


def test_the_short_kernel_takes_a_window_whose_keys_a_program_holds(monkeypatch):
    _, keys, _ = inputs(32, 4, 128, 256, torch.bfloat16, 0)
    at = torch.tensor([255])
    assert decode_attention.SHORT_KERNEL and decode_attention.short_takes(keys, at)  # default
    monkeypatch.setattr(decode_attention, "SHORT_KERNEL", False)
    assert not decode_attention.short_takes(keys, at)  # switched off: the split kernel's
    monkeypatch.setattr(decode_attention, "SHORT_KERNEL", True)
    assert decode_attention.short_takes(keys, at)
    assert not decode_attention.short_takes(keys, None)  # the layer did not say where
    assert not decode_attention.short_takes(keys, torch.tensor([1, 2]))  # two tokens
    _, longer, _ = inputs(32, 4, 128, 257, torch.bfloat16, 0)
    assert not decode_attention.short_takes(longer, at)  # 512 x 128 rounded: past the budget
    _, narrow, _ = inputs(32, 4, 64, 512, torch.bfloat16, 0)
    assert decode_attention.short_takes(narrow, at)  # 512 x 64 is within it


@pytest.mark.cuda
@pytest.mark.parametrize("n_heads, n_kv_heads, n_cells", [(16, 16, 256), (32, 4, 200),
                                                          (32, 8, 100)])
def test_on_cuda_the_short_kernel_reads_the_row_written_just_before(monkeypatch, n_heads,
                                                                     n_kv_heads, n_cells):
    """As a layer runs it: the rotation's kernel writes the token's k and v at its position,
    then the short kernel attends, step after step, as dependents and plainly, eager and from
    a CUDA graph: the same bytes, and the reference's values. A program that kept the row it
    read before its wait would attend the step before's k and v there."""
    pytest.importorskip("triton")
    from strata.engine import dependent_launch
    from strata.engine.model import ops
    from strata.engine.model.kv_cells import LayerCells
    from strata.engine.model.layers import attention_mask, rope_cos_sin, rope_inv_freq

    cuda, head_dim = torch.device("cuda"), 128
    _, keys, values = inputs(n_heads, n_kv_heads, head_dim, n_cells, torch.bfloat16, 3, "cuda")
    cells = LayerCells(keys.transpose(0, 1), values.transpose(0, 1))  # [N, G, Dh] each
    position = torch.tensor([n_cells - 1], device=cuda)
    mask = attention_mask(position, n_cells, None, torch.bfloat16)
    cos, sin = rope_cos_sin(position, rope_inv_freq(head_dim, 10000.0, cuda), torch.bfloat16)
    heads = ops.QKHeads(n_heads, n_kv_heads, head_dim, "none", None, 1e-6, None)
    gen = torch.Generator(cuda).manual_seed(4)
    width = (n_heads + 2 * n_kv_heads) * head_dim
    steps = [torch.randn(1, width, generator=gen, device=cuda).to(torch.bfloat16)
             for _ in range(6)]
    monkeypatch.setattr(decode_attention, "SHORT_KERNEL", True)

    def chain():
        outs = []
        for qkv in steps:
            q = ops.rotate_and_write(qkv, heads, cos, sin, position, cells)  # [1, H, Dh]
            outs.append(decode_attention.attend_one(q, keys, values, mask, head_dim**-0.5,
                                                    position))
        return q, torch.cat(outs)

    monkeypatch.setattr(dependent_launch, "enabled", False)
    q, plain = chain()
    monkeypatch.setattr(dependent_launch, "enabled", True)
    assert torch.equal(chain()[1], plain)
    exact = reference(q, keys, values, mask, head_dim**-0.5)  # the last step's cells
    assert (plain[-1:].float() - exact).abs().max() <= 1e-2 * exact.abs().max()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = chain()[1]
    for _ in range(3):
        replayed.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, plain)


_ROTATE_INTERPRETED = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from test_decode_attention import decode_with, reference
from test_ops import _qk
from strata.engine.model import decode_attention, ops
from strata.engine.model.kv_cells import LayerCells
from strata.engine.model.layers import attention_mask, rope_cos_sin, rope_inv_freq

results = {"shapes": [], "refused": []}
# (H, G, Dh, N, position, window, norm): olmoe's norm over every head, qwen3's each head's,
# none; grouped and not; keys and values before the wait (N * Dh <= 128 * 128) and not.
for seed, (h, g, dh, n, position, window, norm) in enumerate((
        (4, 4, 32, 40, 39, None, "full"), (8, 2, 32, 200, 150, None, "head"),
        (6, 2, 64, 100, 99, 30, "none"), (2, 1, 32, 1, 0, None, "head"))):
    qkv, heads, _, _ = _qk(1, h, g, dh, norm, torch.float16, seed)
    at = torch.tensor([position])
    cos, sin = rope_cos_sin(at, rope_inv_freq(dh, 10000.0, torch.device("cpu")), torch.float16)
    gen = torch.Generator().manual_seed(seed)
    k, v = torch.randn(2, n, g, dh, generator=gen).to(torch.float16)
    apart, fused = LayerCells(k.clone(), v.clone()), LayerCells(k.clone(), v.clone())
    mask = attention_mask(at, n, window, torch.float16)
    q = ops.rotate_and_write_triton(qkv, heads, cos, sin, at, apart)  # [1, H, Dh]
    exact = reference(q, apart.k.transpose(0, 1), apart.v.transpose(0, 1), mask, dh ** -0.5)
    got = decode_attention.rotate_attend_triton(qkv, heads, cos, sin, at, fused, n, mask,
                                                dh ** -0.5)
    results["shapes"].append({
        "shape": list(got.shape), "k_equal": torch.equal(fused.k, apart.k),
        "v_equal": torch.equal(fused.v, apart.v),
        "error": ((got.float() - exact).abs().max() / exact.abs().max()).item()})
qkv, heads, cos, sin = _qk(1, 4, 2, 16, "head", torch.float16, 0)
cells = LayerCells(*torch.zeros(2, 8, 2, 16, dtype=torch.float16))
for args in ((qkv, 8), (qkv[:, :-16], 8)):
    try:
        decode_attention.rotate_attend_triton(args[0], heads, cos[:1], sin[:1],
                                              torch.tensor([3]), cells, args[1], None, 0.25)
    except ValueError as err:
        results["refused"].append(str(err))
results["models"] = [decode_with("rotate_attend_triton", family, "small")
                     for family in ("olmoe", "qwen3_moe")]
print(json.dumps(results))
"""


def test_the_rotating_short_kernel_under_the_interpreter_is_the_rotation_then_attention():
    """`rotate_attend` (`SHORT_ROTATES`, on by default): the cells it writes are the rotation's
    kernel's, byte for byte, for each norm; its attention is the reference's over them; a
    model's decode steps through it (olmoe's norm over every head, qwen3's each head's)."""
    pytest.importorskip("triton", reason="the dev extra installs Triton on Linux x86_64")
    results = run_interpreted(_ROTATE_INTERPRETED, os.path.dirname(__file__))
    assert [row["shape"] for row in results["shapes"]] == [[1, 128], [1, 256], [1, 384],
                                                            [1, 64]]
    for row in results["shapes"]:
        assert row["k_equal"] and row["v_equal"] and row["error"] <= 2e-3, row
    assert "head dim that is a power of two, at least 32: 8 cells of 16" in results["refused"][0]
    assert "needs qkv [1, 128] with contiguous columns" in results["refused"][1]
    for model in results["models"]:
        assert model["prompt_equal"] and model["launches"] == 3 * 2, model
        assert model["argmax_equal"] and model["error"] <= 1e-4 * max(model["scale"], 1.0)


@pytest.mark.cuda
@pytest.mark.parametrize("family", ["olmoe", "qwen3_moe"])
def test_on_cuda_the_rotating_short_kernel_decodes_the_same_tokens_every_way(monkeypatch,
                                                                              family):
    """A small bf16 model's greedy decode with the rotation folded into the short kernel: the
    same tokens from CUDA graphs as dependents and plainly, and eagerly (a program that kept
    the row it read before its wait, or read the token's projection before the kernel
    writing it had finished, would not)."""
    pytest.importorskip("triton")
    import dataclasses

    from strata.engine import dependent_launch
    from strata.engine.model.moe import load_model
    from strata.engine.model.tokenizer import Tokenizer
    from strata.engine.runtime.generate import GenerateOptions, generate
    from support.checkpoints import cached_checkpoint

    ckpt = cached_checkpoint(family, "small", dtype=torch.bfloat16)
    options = GenerateOptions(max_new=40, max_context=256, temperature=0.0, ignore_stop=True)
    monkeypatch.setattr(decode_attention, "SHORT_KERNEL", True)
    monkeypatch.setattr(decode_attention, "SHORT_ROTATES", True)
    launched = []
    launch = decode_attention.rotate_attend_triton
    monkeypatch.setattr(decode_attention, "rotate_attend_triton",
                        lambda *args, **kw: launched.append(1) or launch(*args, **kw))

    def run(**changes):
        model, tok = load_model(ckpt, device="cuda"), Tokenizer.from_dir(ckpt)
        return generate(model, tok, tok.encode("the rotation folded in"),
                        dataclasses.replace(options, **changes))

    fused = run()
    assert launched and fused.decode_path == "cuda-graph"
    monkeypatch.setattr(dependent_launch, "enabled", False)
    plain = run()
    monkeypatch.setattr(dependent_launch, "enabled", True)
    eager = run(cuda_graphs=False)
    assert fused.tokens == plain.tokens == eager.tokens
