"""`strata.engine.experts.grouped`: the decode experts from stacked weights, against a float64
reference one expert at a time; the Triton kernels run under Triton's interpreter on the CPU
(in a fresh interpreter, as TRITON_INTERPRET must be set before Triton is imported), and on the
GPU with `pytest -m cuda`."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from strata.engine.experts.grouped import (
    copies_weights,
    expert_rows,
    expert_rows_gathered,
    expert_rows_triton,
)
from support.interpreted import run_interpreted


def _stack(n_experts, f, d, dtype, seed, pad=24):
    """gate_up [S, 2F, D] and down [S, D, F] as views into [S, blob + pad]: experts are further
    apart than a blob, as the arena's slots are."""
    gen = torch.Generator().manual_seed(seed)
    blobs = (torch.randn(n_experts, 3 * f * d + pad, generator=gen) / d**0.5).to(dtype)
    gate_up = blobs[:, : 2 * f * d].unflatten(1, (2 * f, d))
    down = blobs[:, 2 * f * d : 3 * f * d].unflatten(1, (d, f))
    return gate_up, down


def _reference(gate_up, down, index, x_rows):
    """[R, D] in float64, one expert at a time."""
    f = down.shape[2]
    rows = []
    for e, x in zip(index.tolist(), x_rows.double(), strict=True):
        h = gate_up[e].double() @ x
        rows.append(down[e].double() @ (F.silu(h[:f]) * h[f:]))
    return torch.stack(rows) if rows else x_rows.new_zeros((0, x_rows.shape[1])).double()


def _relative(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_the_gathered_path_matches_the_reference(dtype, tolerance):
    gate_up, down = _stack(6, 40, 72, dtype, seed=1)
    index = torch.tensor([5, 0, 5, 2, 3])  # a repeat, and out of order
    x_rows = torch.randn(5, 72, generator=torch.Generator().manual_seed(2)).to(dtype)
    out = expert_rows_gathered(gate_up, down, index, x_rows)
    assert out.shape == (5, 72) and out.dtype == dtype
    assert _relative(out, _reference(gate_up, down, index, x_rows)) < tolerance


def test_off_cuda_expert_rows_is_the_gathered_path_and_copies():
    gate_up, down = _stack(4, 16, 32, torch.float32, seed=3)
    index = torch.tensor([1, 3])
    x_rows = torch.randn(2, 32, generator=torch.Generator().manual_seed(4))
    assert torch.equal(expert_rows(gate_up, down, index, x_rows),
                       expert_rows_gathered(gate_up, down, index, x_rows))
    assert copies_weights(torch.device("cpu"))


# Run in a fresh interpreter with TRITON_INTERPRET=1: the kernels on CPU tensors, several
# shapes (block edges included), dtypes numpy has (the interpreter has no bfloat16).
_INTERPRETED = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from test_grouped_experts import _reference, _relative, _stack
from strata.engine.experts.grouped import expert_rows_triton
results = []
for seed, (s, f, d, index, dtype) in enumerate([
        (5, 48, 80, [3, 0, 3, 4], torch.float32),      # F, D not multiples of the blocks
        (3, 16, 256, [2], torch.float32),             # exactly one block each way
        (4, 40, 300, [1, 2, 0, 3, 1, 1], torch.float16),
        (2, 8, 16, [], torch.float32)]):              # no rows
    gate_up, down = _stack(s, f, d, dtype, seed)
    index = torch.tensor(index, dtype=torch.int64)
    x_rows = torch.randn(len(index), d, generator=torch.Generator().manual_seed(seed)).to(dtype)
    out = expert_rows_triton(gate_up, down, index, x_rows)
    ref = _reference(gate_up, down, index, x_rows)
    again = expert_rows_triton(gate_up, down, index, x_rows)
    results.append({"shape": list(out.shape), "dtype": str(out.dtype),
                    "error": _relative(out, ref) if len(index) else 0.0,
                    "finite": bool(torch.isfinite(out).all()),
                    "same_bytes": bool(torch.equal(out, again))})
# One token's row repeated for its K experts: a stride of 0 between rows, read as it is.
gate_up, down = _stack(5, 48, 80, torch.float32, 9)
index = torch.tensor([3, 0, 3, 4])
row = torch.randn(1, 80, generator=torch.Generator().manual_seed(9))
repeated = expert_rows_triton(gate_up, down, index, row.expand(4, 80))
results.append({"repeated_rows_as_copied": bool(torch.equal(
    repeated, expert_rows_triton(gate_up, down, index, row.expand(4, 80).contiguous())))})
# A negative slot (a missing expert, `graph_call.resident_rows`): its row is zeros, the
# others those of the same call without it; NaN in every new buffer (what garbage may hold,
# the act row a missing expert never writes among them) changes neither.
rows = row.expand(4, 80).contiguous()  # read as it is: its new_empty makes act and y
rows.new_empty = lambda *args, **kw: torch.Tensor.new_empty(rows, *args, **kw).fill_(
    float("nan"))
with_missing = expert_rows_triton(gate_up, down, torch.tensor([3, -1, 4, -1]), rows)
results.append({"missing_rows_zero": bool(torch.equal(
    with_missing[[0, 2]], expert_rows_triton(gate_up, down, torch.tensor([3, 4]),
                                             row.expand(2, 80)))
    and torch.equal(with_missing[[1, 3]], torch.zeros(2, 80)))})
# The weighted sum inside `down` (one token's K rows): `combine`'s bytes, each launch leaving
# the counter at zero for the next (three launches); D not a multiple of the block, and one
# block; F one step of DOWN_BLOCK_F (48), and three (300).
from strata.engine.experts.combine import weighted_sum_triton
from strata.engine.experts.grouped import expert_sum_triton, sum_arrivals
sums = []
for seed, (s, f, d, index, dtype) in enumerate([(5, 48, 80, [3, 0, 3, 4], torch.float32),
                                                 (3, 16, 32, [2, 1], torch.float16),
                                                 (4, 300, 40, [1, 3, 0], torch.float16)]):
    gate_up, down = _stack(s, f, d, dtype, seed)
    index = torch.tensor(index)
    row = torch.randn(1, d, generator=torch.Generator().manual_seed(seed)).to(dtype)
    weights = torch.rand(1, len(index), generator=torch.Generator().manual_seed(seed + 1))
    arrived = sum_arrivals(d, torch.device("cpu"))
    expected = weighted_sum_triton(expert_rows_triton(gate_up, down, index,
                                                      row.expand(len(index), d)), weights, dtype)
    got = [expert_sum_triton(gate_up, down, index, row.expand(len(index), d), weights,
                             arrived) for _ in range(3)]
    sums.append({"same_bytes": all(torch.equal(g, expected) for g in got),
                 "shape": list(got[0].shape), "arrived": arrived.tolist()})
results.append({"sums": sums})
print(json.dumps(results))
"""


def test_the_triton_kernels_under_the_interpreter_match_the_reference():
    pytest.importorskip("triton", reason="the dev extra installs Triton on Linux x86_64")
    results = run_interpreted(_INTERPRETED, os.path.dirname(__file__))
    expected = [([4, 80], "torch.float32", 1e-5), ([1, 256], "torch.float32", 1e-5),
                ([6, 300], "torch.float16", 2e-3), ([0, 16], "torch.float32", 0.0)]
    for result, (shape, dtype, tolerance) in zip(results[:-3], expected, strict=True):
        assert result["shape"] == shape and result["dtype"] == dtype
        assert result["error"] <= tolerance and result["finite"] and result["same_bytes"]
    assert results[len(expected):-1] == [{"repeated_rows_as_copied": True},
                                         {"missing_rows_zero": True}]
    assert results[-1]["sums"] == [
        {"same_bytes": True, "shape": [1, 80], "arrived": [0] * 3},  # 80 = 2.5 blocks of 32
        {"same_bytes": True, "shape": [1, 32], "arrived": [0]},
        {"same_bytes": True, "shape": [1, 40], "arrived": [0] * 2}]


def test_the_triton_path_refuses_weights_it_cannot_read_in_place():
    pytest.importorskip("triton", reason="the dev extra installs Triton on Linux x86_64")
    gate_up, down = _stack(2, 8, 16, torch.float32, seed=5)
    index, x_rows = torch.tensor([0]), torch.randn(1, 16)
    with pytest.raises(ValueError, match="rows contiguous"):
        expert_rows_triton(gate_up.transpose(1, 2), down, index, x_rows)
    with pytest.raises(ValueError, match=r"are not \[S, 2F, D\] and \[S, D, F\]"):
        expert_rows_triton(gate_up[:, :8], down, index, x_rows)


@pytest.mark.cuda
@pytest.mark.parametrize("f, d", [(1024, 2048), (768, 2048), (40, 300)])
def test_the_triton_kernels_on_cuda_match_and_repeat(f, d):
    pytest.importorskip("triton")
    cuda = torch.device("cuda")
    assert not copies_weights(cuda)
    for dtype, tolerance in ((torch.bfloat16, 1e-2), (torch.float32, 3e-4)):
        gate_up, down = (t.to(cuda) for t in _stack(12, f, d, dtype, seed=f + d))
        index = torch.tensor([7, 2, 11, 0, 2, 5, 9, 3], device=cuda)
        x_rows = torch.randn(8, d, device=cuda).to(dtype)
        out = expert_rows(gate_up, down, index, x_rows)
        ref = _reference(gate_up.cpu(), down.cpu(), index.cpu(), x_rows.cpu())
        assert _relative(out.cpu(), ref) < tolerance
        assert torch.equal(out, expert_rows(gate_up, down, index, x_rows))
        # Captured in a CUDA graph, it reads the index and inputs at replay.
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            expert_rows(gate_up, down, index, x_rows)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            captured = expert_rows(gate_up, down, index, x_rows)
        index.copy_(torch.tensor([1, 1, 4, 6, 8, 10, 0, 11], device=cuda))
        x_rows.copy_(torch.randn(8, d, device=cuda).to(dtype))
        graph.replay()
        assert torch.equal(captured, expert_rows(gate_up, down, index, x_rows))


@pytest.mark.cuda
@pytest.mark.parametrize("f, d, k", [(1024, 2048, 8), (768, 2048, 8), (1792, 4096, 2)])
@pytest.mark.parametrize("down", [(32, 128), (8, 1024)], ids=["default-blocks", "whole-rows"])
def test_on_cuda_the_sum_inside_down_gives_combines_bytes_eager_and_replayed(monkeypatch, f, d,
                                                                             k, down):
    """`expert_sum_triton` against `expert_rows_triton` at the same blocks then `weighted_sum`,
    byte for byte in bf16, eagerly and from a CUDA graph replayed several times (each replay
    finds its counter at zero), at the olmoe and qwen3 shapes and mixtral's D and K; down's
    programs at the default blocks and at 8 rows of a whole row each."""
    pytest.importorskip("triton")
    from strata.engine.experts import grouped
    from strata.engine.experts.combine import weighted_sum
    from strata.engine.experts.grouped import expert_sum_triton, sum_arrivals

    for name, value in zip(("DOWN_BLOCK_D", "DOWN_BLOCK_F"), down, strict=True):
        monkeypatch.setattr(grouped, name, value)

    cuda = torch.device("cuda")
    gate_up, down = (t.to(cuda) for t in _stack(12, f, d, torch.bfloat16, seed=k))
    index = torch.tensor([7, 2, 11, 0, 2, 5, 9, 3][:k], device=cuda)
    gen = torch.Generator(cuda).manual_seed(f + k)
    row = torch.randn(1, d, device=cuda, generator=gen).to(torch.bfloat16)
    weights = torch.softmax(torch.randn(1, k, device=cuda, generator=gen), dim=-1)
    arrived = sum_arrivals(d, cuda)
    # `down` at the same blocks (expert_rows_triton's defaults are bound at import): another
    # block sums in another order, and its bf16 bytes may differ now and then.
    rows = grouped.expert_rows_triton(gate_up, down, index, row.expand(k, d),
                                      down_blocks=(grouped.DOWN_BLOCK_D, grouped.DOWN_BLOCK_F))
    expected = weighted_sum(rows, weights, torch.bfloat16)
    assert torch.equal(expert_sum_triton(gate_up, down, index, row.expand(k, d), weights,
                                         arrived), expected)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = expert_sum_triton(gate_up, down, index, row.expand(k, d), weights, arrived)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, expected) and not arrived.any()


@pytest.mark.cuda
def test_under_torch_compile_the_experts_are_the_same_kernels():
    # The custom operator runs the eager path's kernels: the same bytes, not inductor's own
    # reductions over gathered weights.
    pytest.importorskip("triton")
    cuda = torch.device("cuda")
    gate_up, down = (t.to(cuda) for t in _stack(12, 1024, 2048, torch.bfloat16, seed=3))
    index = torch.tensor([7, 2, 11, 0, 2, 5, 9, 3], device=cuda)
    x_rows = torch.randn(8, 2048, device=cuda).to(torch.bfloat16)

    def layer(x_rows: torch.Tensor) -> torch.Tensor:
        return expert_rows(gate_up, down, index, -x_rows) * 2

    from strata.engine.experts import grouped

    grouped.define_compiled_op()
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(x_rows), layer(x_rows))


def test_the_compiled_operators_are_made_once():
    pytest.importorskip("triton", reason="the dev extra installs Triton on Linux x86_64")
    from strata.engine.experts import grouped, quantized

    for module, name in ((grouped, "expert_rows"), (quantized, "quantized_rows")):
        module.define_compiled_op()
        made = module._compiled[name]
        module.define_compiled_op()
        assert module._compiled[name] is made and hasattr(torch.ops.strata, name)


def test_the_launch_shape_sweep_moves_one_kernel_at_a_time_and_sets_its_constants(capsys,
                                                                                   monkeypatch):
    from strata.engine import cache_hints
    from strata.engine.experts import grouped
    from strata.engine.model import decode_attention, products, routing_ops
    from support.bench_scripts import load_bench

    bench = load_bench("decode_shapes.py")
    tried = bench.variants()
    assert tried[0] == bench.DEFAULT
    labels = [bench.label(v) for v in tried]
    assert len(set(labels)) == len(labels)
    assert set(bench.DEFAULT) == {"gate_up", "down", "products", "norm_product",
                                  "product_route", "logits", "router", "attention", "hints"}
    for variant in tried[1:]:  # exactly one kernel's shape differs from the default
        assert sum(variant[k] != bench.DEFAULT[k] for k in bench.DEFAULT) == 1
    assert bench.CUBLAS in [v["products"] for v in tried]
    saved = (grouped.DOWN_BLOCK_D, grouped.DOWN_BLOCK_F,
             grouped.GATE_UP_BLOCK_F, grouped.GATE_UP_BLOCK_D, grouped.NUM_WARPS,
             grouped.NUM_STAGES,
             products.PRODUCT_KERNEL, products.TILE_ELEMENTS, products.NUM_WARPS,
             products.NORM_PRODUCT_KERNEL, products.NORM_TILE_ELEMENTS,
             products.PRODUCT_ROUTE_KERNEL, products.ROUTE_TILE_ELEMENTS, products.ROUTE_PARTS,
             products.LOGITS_KERNEL, routing_ops.ROUTER_SPLITS,
             decode_attention.SHORT_KERNEL, decode_attention.SHORT_ROTATES,
             decode_attention.SHORT_WARPS)

    class Experts:
        _sum_arrivals = None

    experts = Experts()
    for switch in ("EXPERTS_EVICT_FIRST", "PRODUCTS_EVICT_FIRST"):
        monkeypatch.setattr(cache_hints, switch, getattr(cache_hints, switch))  # restored
    try:
        bench.apply({**bench.DEFAULT, "down": (16, 256, 4, 1)}, experts, 2048,
                    torch.device("cpu"))
        assert experts._sum_arrivals.shape == (2048 // 16,)  # a counter per block of 16 rows
        assert (grouped.DOWN_BLOCK_D, grouped.DOWN_BLOCK_F) == (16, 256)
        assert "down 16x256 w4 s1" in bench.label({**bench.DEFAULT, "down": (16, 256, 4, 1)})
        assert (bench.DEFAULT["gate_up"][3], 1) == grouped.NUM_STAGES
        assert (bench.DEFAULT["gate_up"][2], 4) == grouped.NUM_WARPS
        bench.apply({**bench.DEFAULT, "products": (8192, 2), "logits": (False,)}, experts,
                    2048, torch.device("cpu"))
        assert products.PRODUCT_KERNEL and not products.LOGITS_KERNEL
        assert "logits by cuBLAS" in bench.label({**bench.DEFAULT, "logits": (False,)})
        assert "logits" not in bench.label(bench.DEFAULT)  # the kernel: the default
        assert (products.TILE_ELEMENTS, products.NUM_WARPS) == (8192, 2)
        bench.apply({**bench.DEFAULT, "products": bench.CUBLAS}, experts, 2048,
                    torch.device("cpu"))
        assert not products.PRODUCT_KERNEL
        bench.apply({**bench.DEFAULT, "norm_product": (False, 4096)}, experts, 2048,
                    torch.device("cpu"))
        assert not products.NORM_PRODUCT_KERNEL and products.NORM_TILE_ELEMENTS == 4096
        bench.apply({**bench.DEFAULT, "norm_product": (True, 32768)}, experts, 2048,
                    torch.device("cpu"))
        assert products.NORM_PRODUCT_KERNEL and products.NORM_TILE_ELEMENTS == 32768
        assert "norm in q/k/v's product 32768" in bench.label(
            {**bench.DEFAULT, "norm_product": (True, 32768)})
        routed = {**bench.DEFAULT, "product_route": (True, 4096, 8192)}
        bench.apply(routed, experts, 2048, torch.device("cpu"))
        assert (products.PRODUCT_ROUTE_KERNEL, products.ROUTE_TILE_ELEMENTS,
                products.ROUTE_PARTS) == (True, 4096, 8192)
        assert "output product routing 4096 p8192" in bench.label(routed)
        bench.apply({**bench.DEFAULT, "product_route": (False, 16384, 16384)}, experts, 2048,
                    torch.device("cpu"))
        assert not products.PRODUCT_ROUTE_KERNEL
        bench.apply({**bench.DEFAULT, "router": (16,), "attention": (True, True, 16)},
                    experts, 2048, torch.device("cpu"))
        assert routing_ops.ROUTER_SPLITS == 16
        assert decode_attention.SHORT_KERNEL and decode_attention.SHORT_ROTATES
        assert decode_attention.SHORT_WARPS == 16
        hints = {**bench.DEFAULT, "hints": (True, False)}
        bench.apply(hints, experts, 2048, torch.device("cpu"))
        assert (cache_hints.EXPERTS_EVICT_FIRST, cache_hints.PRODUCTS_EVICT_FIRST) == \
            (True, False)
        assert bench.label(hints).endswith(" / experts evict_first")
        assert bench.label({**bench.DEFAULT, "hints": (False, False)}).endswith(
            " / no evict_first")
    finally:
        (grouped.DOWN_BLOCK_D, grouped.DOWN_BLOCK_F,
         grouped.GATE_UP_BLOCK_F, grouped.GATE_UP_BLOCK_D, grouped.NUM_WARPS,
         grouped.NUM_STAGES,
         products.PRODUCT_KERNEL, products.TILE_ELEMENTS, products.NUM_WARPS,
         products.NORM_PRODUCT_KERNEL, products.NORM_TILE_ELEMENTS,
         products.PRODUCT_ROUTE_KERNEL, products.ROUTE_TILE_ELEMENTS, products.ROUTE_PARTS,
         products.LOGITS_KERNEL, routing_ops.ROUTER_SPLITS,
         decode_attention.SHORT_KERNEL, decode_attention.SHORT_ROTATES,
         decode_attention.SHORT_WARPS) = saved
    if torch.cuda.is_available():
        return
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--kernels", "experts"])
    assert "--kernels takes gate_up, down" in capsys.readouterr().err
    assert bench.main(["--device", "cpu"]) == 0
    assert "needs CUDA" in capsys.readouterr().out
