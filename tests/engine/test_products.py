"""`strata.engine.model.products`: where the one-token kernel runs and where `F.linear` does;
the kernel under Triton's interpreter on the CPU (a fresh interpreter: TRITON_INTERPRET must be
set before Triton is imported) against the product in float64, within float32's summing error
and the output's rounding; its refusals; on CUDA, the kernel at the presets' q/k/v and output
shapes, its bytes the same call to call, replayed from a CUDA graph and launched as a dependent
of a kernel that writes its token (a program that read the token before its wait would not).
The same for `add_norm_linear`, the norm and the product in one kernel: the bytes of
`ops.add_rms_norm` then the product's kernel at the same launch shape; and for the logits
(`logits`), stored in float32 by the kernel: its bytes widened."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from strata.engine import dependent_launch
from strata.engine.model import ops, products
from strata.engine.model.op_kernels import NORM_WARPS
from support.interpreted import run_interpreted


def _operands(n_out, k_in, dtype, seed, bias=False):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n_out, k_in, generator=gen) / k_in**0.5).to(dtype)
    x = (torch.randn(1, k_in, generator=gen) * 2).to(dtype)
    b = torch.randn(n_out, generator=gen).to(dtype) if bias else None
    return x, weight, b


def _within(got, x, weight, bias):
    """Whether got [1, N] is the float64 product within float32's summing error over K and one
    rounding to got's dtype (its mantissa's half step, doubled for the bias's add)."""
    wide_x, wide_w = x.double(), weight.double()
    exact = wide_x @ wide_w.T
    magnitude = wide_x.abs() @ wide_w.abs().T
    if bias is not None:
        exact, magnitude = exact + bias.double(), magnitude + bias.double().abs()
    step = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
    bound = magnitude * (x.shape[1] + 2) * 2.0**-23 + exact.abs() * step[got.dtype]
    return bool(((got.double() - exact).abs() <= bound + 1e-30).all())


def test_off_cuda_and_for_more_than_one_token_it_is_f_linear():
    x, weight, bias = _operands(24, 40, torch.bfloat16, seed=0, bias=True)
    assert not products.takes(x, weight)  # CPU
    assert torch.equal(products.linear(x, weight, bias), F.linear(x, weight, bias))
    rows = torch.cat((x, x))
    assert torch.equal(products.linear(rows, weight), F.linear(rows, weight))


def test_the_logits_are_f_linear_widened_and_take_the_kernel_only_where_switched_on(
        monkeypatch):
    x, weight, _ = _operands(24, 40, torch.bfloat16, seed=0)
    want = F.linear(x, weight).float()
    got = products.logits(x, weight)
    assert got.dtype == torch.float32 and torch.equal(got, want)  # CPU: not taken
    taken = []

    def kernel(x, w, *, out_dtype):
        taken.append(out_dtype)
        return F.linear(x, w).to(out_dtype)

    monkeypatch.setattr(products, "takes", lambda x, w: True)
    monkeypatch.setattr(products, "linear_one_triton", kernel)
    monkeypatch.setattr(products, "LOGITS_KERNEL", False)
    assert torch.equal(products.logits(x, weight), want) and not taken
    monkeypatch.setattr(products, "LOGITS_KERNEL", True)
    assert torch.equal(products.logits(x, weight), want) and taken == [torch.float32]


def test_takes_only_one_token_in_bf16_or_fp16_of_rows_it_can_hold(monkeypatch):
    monkeypatch.setattr(dependent_launch, "supported", lambda device: True)

    class Cuda(torch.Tensor):  # a CPU tensor that says it is on CUDA: `takes` reads shapes only
        @property
        def is_cuda(self):
            return True

    def takes(x, weight):
        return products.takes(x.as_subclass(Cuda), weight)

    x, weight, _ = _operands(8, 64, torch.bfloat16, seed=1)
    if products._kernels() is None:
        pytest.skip("Triton is not installed")
    assert takes(x, weight)
    assert takes(x.half(), weight.half())
    assert not takes(x.float(), weight.float())  # float32: cuBLAS
    assert not takes(torch.cat((x, x)), weight)  # two tokens
    assert not takes(x, weight.half())  # dtypes apart
    assert not takes(x, weight.t().contiguous().t())  # a column-major weight
    wide = torch.zeros(1, products.MAX_K + 1, dtype=torch.bfloat16)
    assert not takes(wide, torch.zeros(4, products.MAX_K + 1, dtype=torch.bfloat16))
    monkeypatch.setattr(products, "PRODUCT_KERNEL", False)
    assert not takes(x, weight)
    monkeypatch.setattr(products, "PRODUCT_KERNEL", True)
    monkeypatch.setattr(dependent_launch, "supported", lambda device: False)
    assert not takes(x, weight)  # no dependent launches: nothing to gain over cuBLAS


def test_bad_operands_are_refused_by_name():
    x, weight, _ = _operands(8, 64, torch.float32, seed=2)
    with pytest.raises(ValueError, match=r"one token x \[1, K\].*got x \[2, 64\]"):
        products.linear_one_triton(torch.cat((x, x)), weight)
    with pytest.raises(ValueError, match=r"got x \[1, 64\] torch.float16"):
        products.linear_one_triton(x.half(), weight)
    with pytest.raises(ValueError, match=r"bias must be \[8\], got \[7\]"):
        products.linear_one_triton(x, weight, torch.zeros(7))
    with pytest.raises(ValueError, match="tile_elements must be a power of two, got 96"):
        products.linear_one_triton(x, weight, tile_elements=96)


def test_add_norm_linear_off_cuda_is_the_norm_then_the_product():
    x, weight, bias = _operands(24, 40, torch.bfloat16, seed=3, bias=True)
    delta = _operands(24, 40, torch.bfloat16, seed=4)[0]
    norm = torch.rand(40, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    for rows, d in ((x, delta), (x, None), (torch.cat((x, delta)), torch.cat((delta, x)))):
        h, y = products.add_norm_linear(rows, d, norm, 1e-6, weight, bias)
        want_h, normed = ops.add_rms_norm(rows, d, norm, 1e-6)
        assert torch.equal(h, want_h) and torch.equal(y, F.linear(normed, weight, bias))


def test_add_norm_linear_takes_the_kernel_only_where_linear_would(monkeypatch):
    x, weight, _ = _operands(8, 64, torch.bfloat16, seed=6)
    norm = torch.ones(64, dtype=torch.bfloat16)
    fused, unfused = [], []
    monkeypatch.setattr(products, "add_norm_linear_triton",
                        lambda *args: fused.append(args) or (args[0], args[0]))
    monkeypatch.setattr(products, "linear", lambda x, w, b: unfused.append(x) or x)
    monkeypatch.setattr(products, "takes", lambda x, weight: True)
    products.add_norm_linear(x, x, norm, 1e-6, weight)
    assert (len(fused), len(unfused)) == (1, 0)
    strided = torch.zeros(64, 2, dtype=torch.bfloat16)[:, 0].unsqueeze(0)  # [1, 64], stride 2
    products.add_norm_linear(x, strided, norm, 1e-6, weight)
    products.add_norm_linear(x, torch.zeros(1, 64, dtype=torch.float16), norm, 1e-6, weight)
    monkeypatch.setattr(products, "NORM_PRODUCT_KERNEL", False)
    products.add_norm_linear(x, x, norm, 1e-6, weight)
    monkeypatch.setattr(products, "NORM_PRODUCT_KERNEL", True)
    monkeypatch.setattr(products, "takes", lambda x, weight: False)
    products.add_norm_linear(x, None, norm, 1e-6, weight)
    # A strided delta, delta's dtype apart, switched off, and where `takes` refuses: the norm,
    # then `linear`.
    assert (len(fused), len(unfused)) == (1, 4)


def test_add_norm_linear_refuses_bad_operands_by_name():
    x, weight, _ = _operands(8, 64, torch.float32, seed=7)
    norm = torch.ones(64)
    with pytest.raises(ValueError, match=r"add_norm_linear_triton takes one token x \[1, K\]"):
        products.add_norm_linear_triton(torch.cat((x, x)), None, norm, 1e-6, weight)
    with pytest.raises(ValueError, match=r"delta must be x's shape \[1, 64\] and dtype "
                                         r"torch.float32.*got \[1, 32\]"):
        products.add_norm_linear_triton(x, x[:, :32], norm, 1e-6, weight)
    with pytest.raises(ValueError, match=r"norm_weight must be a contiguous \[64\], got \[63\]"):
        products.add_norm_linear_triton(x, None, norm[:63], 1e-6, weight)
    with pytest.raises(ValueError, match=r"got \[64\] with strides \[2\]"):
        products.add_norm_linear_triton(x, None, torch.ones(128)[::2], 1e-6, weight)
    with pytest.raises(ValueError, match=r"bias must be \[8\], got \[7\]"):
        products.add_norm_linear_triton(x, None, norm, 1e-6, weight, torch.zeros(7))


_INTERPRETED = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from test_products import _operands, _within
from strata.engine.model.products import linear_one_triton
results = []
for seed, (n_out, k_in, dtype, bias, tile) in enumerate([
        (37, 96, torch.float32, False, 256),   # K not a power of two; a partial last program
        (64, 128, torch.float32, True, 512),   # K a power of two, a bias
        (5, 2048, torch.float16, True, None),  # the default tile: one program, rows masked
        (33, 40, torch.float16, False, 16),    # a tile narrower than a row: one row a program
        (0, 16, torch.float32, False, None)]): # no outputs
    x, weight, b = _operands(n_out, k_in, dtype, seed, bias)
    got = linear_one_triton(x, weight, b, tile_elements=tile)
    again = linear_one_triton(x, weight, b, tile_elements=tile)
    wide = linear_one_triton(x, weight, b, tile_elements=tile, out_dtype=torch.float32)
    results.append({"shape": list(got.shape) == [1, n_out], "dtype": got.dtype == dtype,
                    "within": _within(got, x, weight, b),
                    "same_bytes": torch.equal(got.view(torch.uint8), again.view(torch.uint8)),
                    "widened": wide.dtype == torch.float32 and torch.equal(wide, got.float())})
print(json.dumps(results))
"""


_INTERPRETED_NORM = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from test_products import _operands
from strata.engine.model.ops import add_rms_norm_triton
from strata.engine.model.products import add_norm_linear_triton, linear_one_triton
results = []
for seed, (n_out, k_in, dtype, delta, bias, tile) in enumerate([
        (37, 96, torch.float32, True, False, 256),   # K not a power of two; a partial program
        (64, 128, torch.bfloat16, True, True, 512),  # a bias
        (5, 2048, torch.float16, False, True, None), # no delta: h is x; one program
        (33, 40, torch.bfloat16, True, False, 16),   # one row a program: 33 programs store h?
        (0, 16, torch.float32, True, False, None)]): # no outputs: h all the same
    x, weight, b = _operands(n_out, k_in, dtype, seed, bias)
    d = _operands(1, k_in, dtype, seed + 10)[1] if delta else None
    norm = torch.rand(k_in, generator=torch.Generator().manual_seed(seed)).to(dtype) + 0.5
    h, got = add_norm_linear_triton(x, d, norm, 1e-6, weight, b, tile_elements=tile)
    want_h, normed = add_rms_norm_triton(x, d, norm, 1e-6)
    want = linear_one_triton(normed, weight, b, tile_elements=tile)
    again = add_norm_linear_triton(x, d, norm, 1e-6, weight, b, tile_elements=tile)[1]
    results.append({"h": torch.equal(h, want_h), "h_is_x": (h is x) == (d is None),
                    "product": torch.equal(got, want),
                    "same_bytes": torch.equal(got.view(torch.uint8), again.view(torch.uint8))})
print(json.dumps(results))
"""


@pytest.mark.parametrize("script", ["product", "norm and product"])
def test_the_kernels_under_the_interpreter(script):
    """The product kernel is the product in float64 (within float32's summing error); the
    norm and product kernel is the norm's kernel, then the product's, to the bit."""
    pytest.importorskip("triton")
    import os

    script = {"product": _INTERPRETED, "norm and product": _INTERPRETED_NORM}[script]
    results = run_interpreted(script, os.path.dirname(__file__))
    assert len(results) == 5
    for result in results:
        assert all(result.values()), result


# (N, K) of the presets' decode products: olmoe's q/k/v and output, qwen3's, mixtral's, and
# the logits of olmoe, qwen3 and mixtral (`products.LOGITS_KERNEL`).
SHAPES = [(6144, 2048), (2048, 2048), (5120, 2048), (2048, 4096), (6144, 4096), (4096, 4096),
          (50304, 2048), (151936, 2048), (32000, 4096)]


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_on_cuda_the_kernel_is_the_product_at_the_presets_shapes(dtype):
    for seed, (n_out, k_in) in enumerate(SHAPES):
        x, weight, bias = (t.cuda() if t is not None else None
                           for t in _operands(n_out, k_in, dtype, seed, bias=seed % 2 == 1))
        got = products.linear_one_triton(x, weight, bias)
        assert _within(got, x, weight, bias), (n_out, k_in)
        again = products.linear_one_triton(x, weight, bias)
        assert torch.equal(got.view(torch.int16), again.view(torch.int16))
        wide = products.linear_one_triton(x, weight, bias, out_dtype=torch.float32)
        assert torch.equal(wide, got.float())  # the logits' float32: rounded, then widened
        if _hopper():
            assert products.takes(x, weight)
            assert torch.equal(products.linear(x, weight, bias), got)


@pytest.mark.cuda
@pytest.mark.parametrize("fused", [False, True])
def test_on_cuda_as_a_dependent_it_reads_the_token_the_kernel_before_wrote(monkeypatch, fused):
    """A chain of norms and products, each product's token written by the norm just before it
    (and each norm reading the product before), or of the fused norm and product, each reading
    the residual and output the one before wrote: eager as dependents, eager plainly and
    replayed from a CUDA graph give the same bytes. A program that read its token before its
    wait would read a row the kernel before was still writing."""
    if not _hopper():
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    gen = torch.Generator().manual_seed(5)
    weights = [(torch.randn(4096, 4096, generator=gen) / 64).to(torch.bfloat16).cuda()
               for _ in range(8)]
    norm = torch.rand(4096, generator=gen).to(torch.bfloat16).cuda()
    x = torch.randn(1, 4096, generator=gen).to(torch.bfloat16).cuda()

    def chain(x):
        delta = None
        for weight in weights * 4:
            if fused:
                x, delta = products.add_norm_linear_triton(x, delta, norm, 1e-6, weight)
            else:
                x, normed = ops.add_rms_norm(x, None, norm, 1e-6)
                x = products.linear_one_triton(normed, weight)
        return x if delta is None else x + delta

    monkeypatch.setattr(dependent_launch, "enabled", False)
    plain = chain(x)
    monkeypatch.setattr(dependent_launch, "enabled", True)
    assert torch.equal(chain(x), plain)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(x)
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, plain)


@pytest.mark.cuda
def test_on_cuda_the_norm_and_product_kernel_is_the_two_kernels_bytes():
    """At the presets' q/k/v shapes: h is `add_rms_norm`'s and the product is the product
    kernel's at the same tile and warps, to the bit; the same bytes call to call; and where
    `takes`, `add_norm_linear` is the kernel."""
    for seed, (n_out, k_in) in enumerate(SHAPES[::2][:3]):  # olmoe's, qwen3's, mixtral's qkv
        x, weight, bias = (t.cuda() if t is not None else None
                           for t in _operands(n_out, k_in, torch.bfloat16, seed, seed % 2 == 1))
        delta = _operands(1, k_in, torch.bfloat16, seed + 10)[1].cuda()
        norm = (torch.rand(k_in, generator=torch.Generator().manual_seed(seed)) + 0.5).to(
            torch.bfloat16).cuda()
        h, got = products.add_norm_linear_triton(x, delta, norm, 1e-6, weight, bias)
        want_h, normed = ops.add_rms_norm(x, delta, norm, 1e-6)
        want = products.linear_one_triton(normed, weight, bias,
                                          tile_elements=products.NORM_TILE_ELEMENTS,
                                          num_warps=NORM_WARPS)
        assert torch.equal(h, want_h) and torch.equal(got, want), (n_out, k_in)
        again = products.add_norm_linear_triton(x, delta, norm, 1e-6, weight, bias)
        assert torch.equal(again[1].view(torch.int16), got.view(torch.int16))
        if _hopper():
            fused = products.add_norm_linear(x, delta, norm, 1e-6, weight, bias)
            assert torch.equal(fused[0], h) and torch.equal(fused[1], got)


def test_the_l2_probe_marks_its_reads_for_the_cache_and_needs_cuda(capsys):
    """bench/l2_keep.py's read kernel, compiled for compute capability 9.0, carries the L2
    cache hints it is named for (or none), and its prefetch kernel asks for lines without
    loading any; without CUDA the probe says so and exits."""
    from support.bench_scripts import load_bench
    from support.hopper import compile_for_hopper

    bench = load_bench("l2_keep.py")
    pytest.importorskip("triton", reason="the dev extra installs Triton on Linux x86_64")
    read, prefetch = bench._kernels()
    for evict, mark in (("", "ld.global.v4"), ("evict_first", "L1::evict_first.L2::cache_hint"),
                        ("evict_last", "L1::evict_last.L2::cache_hint")):
        ptx = compile_for_hopper(read, {"BLOCK": 4096, "EVICT": evict},
                                 {"out_ptr": "*fp32"}).asm["ptx"]
        assert mark in ptx and ("cache_hint" in ptx) == bool(evict)
    # The prefetch's instruction survives though its dummy result is never used.
    for bulk, last, mark in ((False, True, "prefetch.global.L2::evict_last"),
                             (False, False, "prefetch.global.L2 "),
                             (True, True, "cp.async.bulk.prefetch.L2.global.L2::cache_hint"),
                             (True, False, "cp.async.bulk.prefetch.L2.global [")):
        ptx = compile_for_hopper(prefetch, {"CHUNK": 64, "STEP": 256, "BULK": bulk,
                                            "LAST": last}, num_warps=8).asm["ptx"]
        assert ptx.count(mark) >= 1 and "ld.global" not in ptx
        assert ("evict_last" in ptx) == last
    if torch.cuda.is_available():
        pytest.skip("the probe itself runs on the GPU machine (bench/gpu_session.sh l2-keep)")
    with pytest.raises(SystemExit):
        bench.main(["--stream-mib", "0"])
    assert "--stream-mib must be at least 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--persisting-mib", "-1"])
    assert "--persisting-mib must be at least 0, got -1" in capsys.readouterr().err
    assert bench.main([]) == 0
    assert "needs CUDA" in capsys.readouterr().out
