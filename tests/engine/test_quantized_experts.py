"""`strata.engine.experts.quantized`: the decode experts from int8 and int4 blobs, against a
float64 reference over the weights the blobs stand for; the Triton kernels under Triton's
interpreter on the CPU (a fresh interpreter: TRITON_INTERPRET must be set before Triton is
imported), and on the GPU with `pytest -m cuda`."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from strata.engine.experts.quant import (
    WEIGHT_FORMATS,
    blob_bytes,
    dequantize_blobs,
    fake_quantize,
    make_blob,
)
from strata.engine.experts.quantized import (
    quantized_rows,
    quantized_rows_gathered,
    quantized_rows_triton,
)
from support.interpreted import run_interpreted


def _blobs(fmt, n_experts, f, d, seed, pad=28):
    """uint8 [S, blob + pad] of `fmt` (slots further apart than a blob, as the arena's), and
    the float32 weights each stands for: [(gate_up [2F, D], down [D, F])]."""
    gen = torch.Generator().manual_seed(seed)
    rows, weights = [], []
    for _ in range(n_experts):
        gate, up = torch.randn(f, d, generator=gen) / d**0.5, torch.randn(f, d, generator=gen)
        down = torch.randn(d, f, generator=gen) / f**0.5
        rows.append(torch.cat((make_blob(fmt, gate, up / d**0.5, down),
                               torch.zeros(pad, dtype=torch.uint8))))
        weights.append((torch.cat([fake_quantize(w, fmt) for w in (gate, up / d**0.5)]),
                        fake_quantize(down, fmt)))
    return torch.stack(rows), weights


def _reference(weights, index, x_rows):
    """[R, D] in float64, one expert at a time."""
    rows = []
    for e, x in zip(index.tolist(), x_rows.double(), strict=True):
        gate_up, down = (w.double() for w in weights[e])
        h = gate_up @ x
        f = down.shape[1]
        rows.append(down @ (F.silu(h[:f]) * h[f:]))
    return torch.stack(rows) if rows else x_rows.new_zeros((0, x_rows.shape[1])).double()


def _relative(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt", WEIGHT_FORMATS)
def test_the_blobs_dequantize_to_the_weights_they_stand_for(fmt, dtype):
    """In float32 exactly the weights; in bf16 those weights rounded once (the product in
    float32, then cast), from blobs further apart than a blob (read in place)."""
    blobs, weights = _blobs(fmt, 3, 64, 128, seed=1)
    gate_up, down = dequantize_blobs(blobs, fmt, 64, 128, dtype)
    assert gate_up.dtype == down.dtype == dtype
    for e, (w_gate_up, w_down) in enumerate(weights):
        assert torch.equal(gate_up[e], w_gate_up.to(dtype))
        assert torch.equal(down[e], w_down.to(dtype))


@pytest.mark.parametrize("fmt", WEIGHT_FORMATS)
def test_the_gathered_path_matches_the_reference(fmt):
    blobs, weights = _blobs(fmt, 5, 64, 192, seed=2)
    index = torch.tensor([4, 0, 4, 2])  # a repeat, out of order
    x_rows = torch.randn(4, 192, generator=torch.Generator().manual_seed(3))
    out = quantized_rows_gathered(blobs, fmt, index, x_rows, 64)
    assert out.shape == (4, 192) and out.dtype == torch.float32
    assert _relative(out, _reference(weights, index, x_rows)) < 1e-5
    assert torch.equal(quantized_rows(blobs, fmt, index, x_rows, 64), out)  # off CUDA


def test_bad_blobs_and_formats_are_refused():
    blobs, _ = _blobs("int8", 2, 32, 64, seed=4, pad=0)
    x_rows, index = torch.randn(1, 64), torch.tensor([0])
    with pytest.raises(ValueError, match=r"blobs must be uint8 \[S, >= 6656\]"):
        quantized_rows(blobs[:, :-1], "int8", index, x_rows, 32)
    with pytest.raises(ValueError, match=r"blobs must be uint8"):
        quantized_rows(blobs.view(torch.int8), "int8", index, x_rows, 32)
    with pytest.raises(ValueError, match=r"fmt must be one of"):
        quantized_rows(blobs, "int2", index, x_rows, 32)
    with pytest.raises(ValueError, match=r"int4-g64 needs F and D multiples of 64, got F = 32"):
        blob_bytes("int4-g64", 32, 64)


# The kernels on CPU tensors: every format, shapes off the blocks' multiples, a repeat, no
# rows, dtypes numpy has (the interpreter has no bfloat16).
_INTERPRETED = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from test_quantized_experts import _blobs, _reference, _relative
from strata.engine.experts.quantized import quantized_rows_triton
results = []
for seed, (fmt, s, f, d, index, dtype) in enumerate([
        ("int8", 5, 48, 80, [3, 0, 3, 4], torch.float32),    # F, D not multiples of blocks
        ("int4-g32", 4, 96, 320, [1, 2, 0, 1], torch.float32),
        ("int4-g64", 3, 64, 384, [2, 0], torch.float16),
        ("int8", 2, 16, 256, [], torch.float32)]):           # no rows
    blobs, weights = _blobs(fmt, s, f, d, seed)
    index = torch.tensor(index, dtype=torch.int64)
    x_rows = torch.randn(len(index), d, generator=torch.Generator().manual_seed(seed)).to(dtype)
    out = quantized_rows_triton(blobs, fmt, index, x_rows, f)
    again = quantized_rows_triton(blobs, fmt, index, x_rows, f)
    ref = _reference(weights, index, x_rows)
    results.append({"shape": list(out.shape), "dtype": str(out.dtype),
                    "error": _relative(out, ref) if len(index) else 0.0,
                    "same_bytes": bool(torch.equal(out, again))})
# A negative slot (a missing expert, `graph_call.resident_rows`): its row is zeros, the
# others those of the same call without it, with NaN in every new buffer (garbage).
for fmt in ("int8", "int4-g32"):
    blobs, _ = _blobs(fmt, 4, 96, 320, 7)
    x_rows = torch.randn(3, 320, generator=torch.Generator().manual_seed(7))
    garbage = x_rows.clone()  # read as it is: its new_empty makes act and y
    garbage.new_empty = lambda *args, **kw: torch.Tensor.new_empty(garbage, *args, **kw).fill_(
        float("nan"))
    out = quantized_rows_triton(blobs, fmt, torch.tensor([2, -1, 0]), garbage, 96)
    results.append({"missing_rows_zero": bool(torch.equal(
        out[[0, 2]], quantized_rows_triton(blobs, fmt, torch.tensor([2, 0]), x_rows[[0, 2]],
                                           96)) and torch.equal(out[1], torch.zeros(320)))})
print(json.dumps(results))
"""


def test_the_triton_kernels_under_the_interpreter_match_the_reference():
    pytest.importorskip("triton", reason="the dev extra installs Triton on Linux x86_64")
    results = run_interpreted(_INTERPRETED, os.path.dirname(__file__))
    expected = [([4, 80], "torch.float32", 1e-5), ([4, 320], "torch.float32", 1e-5),
                ([2, 384], "torch.float16", 2e-3), ([0, 256], "torch.float32", 0.0)]
    for result, (shape, dtype, tolerance) in zip(results[:-2], expected, strict=True):
        assert result["shape"] == shape and result["dtype"] == dtype
        assert result["error"] <= tolerance and result["same_bytes"]
    assert results[len(expected):] == [{"missing_rows_zero": True}] * 2


def test_the_triton_path_refuses_scales_it_cannot_read_aligned():
    pytest.importorskip("triton", reason="the dev extra installs Triton on Linux x86_64")
    blobs, _ = _blobs("int8", 2, 32, 64, seed=5, pad=2)  # a stride of 4*k + 2 bytes
    with pytest.raises(ValueError, match="must keep them 4-byte aligned"):
        quantized_rows_triton(blobs, "int8", torch.tensor([0]), torch.randn(1, 64), 32)


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", WEIGHT_FORMATS)
def test_on_cuda_the_kernels_match_and_repeat(fmt):
    pytest.importorskip("triton")
    cuda = torch.device("cuda")
    f, d = 768, 2048  # qwen3-30b-a3b's expert
    blobs, weights = _blobs(fmt, 10, f, d, seed=6)
    index = torch.tensor([7, 2, 9, 0, 2, 5, 1, 3])
    x_rows = torch.randn(8, d, generator=torch.Generator().manual_seed(7))
    ref = _reference(weights, index, x_rows)
    for dtype, tolerance in ((torch.bfloat16, 1e-2), (torch.float32, 3e-4)):
        out = quantized_rows(blobs.to(cuda), fmt, index.to(cuda), x_rows.to(cuda, dtype), f)
        assert _relative(out.cpu(), ref) < tolerance
        again = quantized_rows(blobs.to(cuda), fmt, index.to(cuda), x_rows.to(cuda, dtype), f)
        assert torch.equal(out, again)


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["int8", "int4-g32"])
def test_under_torch_compile_the_quantized_experts_are_the_same_kernels(fmt):
    pytest.importorskip("triton")
    cuda = torch.device("cuda")
    f, d = 768, 2048
    blobs, _ = _blobs(fmt, 10, f, d, seed=8)
    blobs = blobs.to(cuda)
    index = torch.tensor([7, 2, 9, 0], device=cuda)
    x_rows = torch.randn(4, d, device=cuda).to(torch.bfloat16)

    def layer(x_rows: torch.Tensor) -> torch.Tensor:
        return quantized_rows(blobs, fmt, index, -x_rows, f) * 2

    from strata.engine.experts import quantized

    quantized.define_compiled_op()
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(x_rows), layer(x_rows))


@pytest.mark.parametrize("fmt", [None, *WEIGHT_FORMATS])
def test_grouped_rows_compute_each_run_through_its_blob(fmt, monkeypatch):
    """`BlobStack.grouped_rows` (a prompt chunk's quantized experts as grouped products a batch
    of blobs, on the CPU here as torch's `_grouped_mm` runs there too): each run of rows through
    its own blob, in any order of blobs, an empty run too, across batch boundaries (batches of
    two blobs) as in one batch; bad counts are refused."""
    from strata.engine.experts import blobs as blobs_module
    from strata.engine.experts.blobs import BlobStack

    f, d = 64, 128
    if fmt is None:
        gen = torch.Generator().manual_seed(4)
        plain = (torch.randn(5, 3 * f * d, generator=gen) / d**0.5).to(torch.bfloat16)
        weights = [(w[: 2 * f * d].view(2 * f, d).float(), w[2 * f * d :].view(d, f).float())
                   for w in plain]
        stack = BlobStack(plain.view(torch.uint8), torch.bfloat16, None, f, d)
    else:
        raw, weights = _blobs(fmt, 5, f, d, seed=4)
        stack = BlobStack(raw, torch.bfloat16, fmt, f, d)
    indices, counts = [3, 0, 4, 1], [5, 0, 2, 6]
    x_sorted = torch.randn(13, d, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    experts = torch.repeat_interleave(torch.tensor(indices), torch.tensor(counts))  # [13]
    want = _reference(weights, experts, x_sorted.float())
    whole = stack.grouped_rows(indices, x_sorted, counts)
    assert whole.shape == (13, d) and whole.dtype == torch.bfloat16
    assert _relative(whole, want) < 2e-2  # bf16 rows
    # Batches of 2: bf16 takes 2 bytes a weight, and 4 more through torch's float32 copies.
    weight_bytes = 2 if fmt is None else 6
    monkeypatch.setattr(blobs_module, "DEQUANT_BATCH_BYTES", 2 * 3 * f * d * weight_bytes)
    assert blobs_module.dequant_batch(f, d, weight_bytes) == 2
    torch.testing.assert_close(stack.grouped_rows(indices, x_sorted, counts), whole)
    # Adjacent blobs (batches [1, 2] and [3, 4] here) are read in place, not stacked.
    adjacent, seen = [1, 2, 3, 4], []
    real_products = blobs_module.grouped_products
    monkeypatch.setattr(blobs_module, "grouped_products",
                        lambda gate_up, *a: seen.append(gate_up) or real_products(gate_up, *a))
    if fmt is not None:
        real_dequant = blobs_module.dequantize_blobs
        monkeypatch.setattr(blobs_module, "dequantize_blobs",
                            lambda blobs, *a: seen.append(blobs) or real_dequant(blobs, *a))
    got = stack.grouped_rows(adjacent, x_sorted, counts)
    experts = torch.repeat_interleave(torch.tensor(adjacent), torch.tensor(counts))
    assert _relative(got, _reference(weights, experts, x_sorted.float())) < 2e-2
    viewed = stack.blobs if fmt is not None else stack.gate_up_all()
    firsts = [t.data_ptr() for t in seen[:: 2 if fmt is not None else 1]]
    assert firsts == [viewed[1].data_ptr(), viewed[3].data_ptr()]
    given = torch.tensor([0, 5, 5, 7, 13])  # the runs' ends, uploaded by a caller before
    assert torch.equal(stack.grouped_rows(indices, x_sorted, counts, given),
                       stack.grouped_rows(indices, x_sorted, counts))
    with pytest.raises(ValueError, match=r"ends must be \[5\]"):
        stack.grouped_rows(indices, x_sorted, counts, given[:4])
    assert stack.grouped_rows([], x_sorted[:0], []).shape == (0, d)
    for bad in ([5, 0, 2], [5, 0, 2, 5], [5, -1, 3, 6]):
        with pytest.raises(ValueError, match="one count >= 0 per index summing to the 13 rows"):
            stack.grouped_rows(indices, x_sorted, bad)


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "kernels"])
def test_batches_fill_their_memory_by_the_path_that_dequantizes_them(kernels, monkeypatch):
    """Where the kernels dequantize (bf16 out, no float32 copies) a batch holds three times the
    blobs torch's path does in the same DEQUANT_BATCH_BYTES, and the batches of a call are of
    even sizes; the rows are the same either way."""
    from strata.engine.experts import blobs as blobs_module
    from strata.engine.experts.blobs import BlobStack

    f, d = 64, 128
    raw, _ = _blobs("int8", 16, f, d, seed=6)
    stack = BlobStack(raw, torch.bfloat16, "int8", f, d)
    monkeypatch.setattr(blobs_module, "DEQUANT_BATCH_BYTES", 3 * f * d * 6 * 2)
    monkeypatch.setattr(blobs_module, "dequant_kernels_run", lambda *a: kernels)
    sizes, real_dequant = [], blobs_module.dequantize_blobs
    monkeypatch.setattr(blobs_module, "dequantize_blobs",
                        lambda blobs, *a: sizes.append(blobs.shape[0]) or real_dequant(blobs, *a))
    indices, counts = list(range(13)), [2] * 13
    x_sorted = torch.randn(26, d, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    got = stack.grouped_rows(indices, x_sorted, counts)
    # 2 blobs a batch through float32 (6 bytes a weight), 6 through the kernels (2 bytes): 13
    # blobs in 7 batches of 2 and 1, or in 3 of 5, 5 and 3 (not 6, 6 and 1)
    assert sizes == ([5, 5, 3] if kernels else [2] * 6 + [1])
    sizes.clear()
    monkeypatch.setattr(blobs_module, "DEQUANT_BATCH_BYTES", 1 << 30)  # one batch
    torch.testing.assert_close(stack.grouped_rows(indices, x_sorted, counts), got)
    assert sizes == [13]
