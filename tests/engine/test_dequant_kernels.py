"""`strata.engine.experts.quant.dequantize_blobs_triton`: a batch of int8 and int4 blobs turned
into the weights they stand for by the Triton kernels, against torch's path byte for byte: under
Triton's interpreter on the CPU (a fresh interpreter: TRITON_INTERPRET must be set before Triton
is imported), and on the GPU with `pytest -m cuda`, where `dequantize_blobs` runs them."""

from __future__ import annotations

import os

import pytest
import torch

from strata.engine.experts.quant import (
    WEIGHT_FORMATS,
    blob_bytes,
    dequantize_blobs,
    dequantize_blobs_triton,
    make_blob,
)
from support.interpreted import run_interpreted

# (F, D): one block's rows and columns, several blocks with partial last ones (the int8 rows
# of 132 columns; int4 widths are multiples of its groups, 320 past one block of 256)
SHAPES = {"int8": [(64, 128), (68, 132), (200, 36)],
          "int4-g32": [(64, 128), (96, 320)], "int4-g64": [(64, 128), (192, 320)]}


def _blobs(fmt, n_blobs, f, d, seed, pad=12):
    """uint8 [B, blob + pad] of `fmt` (blobs further apart than their bytes, as a stack of
    the arena's slots), weights over a few orders of magnitude."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n_blobs):
        scale = torch.exp(torch.randn(1, generator=gen) * 3)
        rows.append(torch.cat((make_blob(fmt, torch.randn(f, d, generator=gen) * scale,
                                         torch.randn(f, d, generator=gen),
                                         torch.randn(d, f, generator=gen) / scale),
                               torch.zeros(pad, dtype=torch.uint8))))
    return torch.stack(rows)


def _bytes(t):
    return t.contiguous().view(torch.uint8)


_INTERPRETED = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from test_dequant_kernels import SHAPES, _blobs, _bytes
from strata.engine.experts.quant import dequantize_blobs, dequantize_blobs_triton
results = []
for fmt, shapes in SHAPES.items():
    for seed, (f, d) in enumerate(shapes):
        blobs = _blobs(fmt, 3, f, d, seed)
        exact = dequantize_blobs(blobs, fmt, f, d, torch.float32)
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            got = dequantize_blobs_triton(blobs, fmt, f, d, dtype)
            want = dequantize_blobs(blobs, fmt, f, d, dtype)
            if dtype == torch.bfloat16:  # the interpreter narrows by truncating
                want = [(w.view(torch.int32) >> 16).to(torch.int16).view(dtype) for w in exact]
            results.append({"case": [fmt, f, d, str(dtype)],
                            "shapes": [list(g.shape) for g in got],
                            "same": all(torch.equal(_bytes(g), _bytes(w))
                                        for g, w in zip(got, want, strict=True))})
    none = dequantize_blobs_triton(_blobs(fmt, 1, 64, 128, 9)[:0], fmt, 64, 128, torch.float16)
    results.append({"case": [fmt, "no blobs"], "shapes": [list(t.shape) for t in none],
                    "same": True})
print(json.dumps(results))
"""


def test_the_kernels_under_the_interpreter_give_torchs_bytes():
    pytest.importorskip("triton", reason="the dev extra installs Triton on Linux x86_64")
    results = run_interpreted(_INTERPRETED, os.path.dirname(__file__))
    cases = 0
    for result in results:
        rest = result["case"][1:]
        if rest == ["no blobs"]:
            assert result["shapes"] == [[0, 128, 128], [0, 128, 64]]
            continue
        f, d, _ = rest
        assert result["shapes"] == [[3, 2 * f, d], [3, d, f]], result
        assert result["same"], result
        cases += 1
    assert cases == 3 * sum(len(shapes) for shapes in SHAPES.values())


def test_blobs_the_kernels_cannot_read_are_named():
    pytest.importorskip("triton", reason="the dev extra installs Triton on Linux x86_64")
    blobs = _blobs("int8", 2, 64, 128, 0)
    # not uint8; a byte short of a blob; the scales a byte off their float32 boundary
    for bad in (blobs.view(torch.int8), blobs[:, : blob_bytes("int8", 64, 128) - 1],
                blobs[:, 1:]):
        with pytest.raises(ValueError, match=r"uint8 \[B, >= 25600\] with contiguous bytes and "
                                             r"4-byte aligned scales"):
            dequantize_blobs_triton(bad, "int8", 64, 128, torch.bfloat16)
    with pytest.raises(ValueError, match="fmt must be one of"):
        dequantize_blobs_triton(blobs, "int3", 64, 128, torch.bfloat16)


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", WEIGHT_FORMATS)
def test_on_cuda_dequantize_blobs_gives_torchs_bytes_and_repeats(fmt):
    """On CUDA `dequantize_blobs` runs the kernels; torch's path on the CPU rounds the same
    float32 products the same way (to nearest, ties to even), so the bytes are equal. Blobs
    whose scales are not aligned take torch's path on CUDA too, with the same bytes."""
    pytest.importorskip("triton")
    cuda = torch.device("cuda")
    for f, d, n_blobs in [(768, 2048, 7), (64, 128, 1), (1024, 2048, 2)]:
        blobs = _blobs(fmt, n_blobs, f, d, f)
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            want = dequantize_blobs(blobs, fmt, f, d, dtype)
            got = dequantize_blobs(blobs.to(cuda), fmt, f, d, dtype)
            again = dequantize_blobs(blobs.to(cuda), fmt, f, d, dtype)
            for g, a, w in zip(got, again, want, strict=True):
                assert torch.equal(_bytes(g.cpu()), _bytes(w))
                assert torch.equal(_bytes(a), _bytes(g))
        shifted = torch.zeros(n_blobs, blobs.shape[1] + 1, dtype=torch.uint8)
        shifted[:, 1:] = blobs
        off = dequantize_blobs(shifted.to(cuda)[:, 1:], fmt, f, d, torch.bfloat16)
        for g, w in zip(off, dequantize_blobs(blobs, fmt, f, d, torch.bfloat16), strict=True):
            assert torch.equal(_bytes(g.cpu()), _bytes(w))


@pytest.mark.parametrize("fmt", WEIGHT_FORMATS)
def test_torchs_path_reads_scales_off_their_float32_boundary(fmt):
    """A single blob whose scales start a byte off a float32 boundary is already contiguous:
    torch's path copies its scales instead of viewing them (a view would fail)."""
    blobs = _blobs(fmt, 1, 64, 128, 3)
    shifted = torch.zeros(1, blobs.shape[1] + 1, dtype=torch.uint8)
    shifted[:, 1:] = blobs
    for got, want in zip(dequantize_blobs(shifted[:, 1:], fmt, 64, 128, torch.bfloat16),
                         dequantize_blobs(blobs, fmt, 64, 128, torch.bfloat16), strict=True):
        assert torch.equal(_bytes(got), _bytes(want))
