"""`strata.engine.cache_hints`: the switches, the marks they put on the compiled kernels'
weight loads, the launches that pass them, and (on CUDA) a decode step's same bytes whichever
switch is on."""

from __future__ import annotations

import pytest
import torch

from strata.engine import cache_hints
from strata.engine.kv import new_kv
from strata.engine.model import load_model
from support.checkpoints import cached_checkpoint
from support.hopper import compile_for_hopper


def test_the_marks_follow_their_switches_and_are_on_by_default(monkeypatch):
    assert (cache_hints.experts_eviction(), cache_hints.products_eviction()) == \
        ("evict_first", "evict_first")
    monkeypatch.setattr(cache_hints, "EXPERTS_EVICT_FIRST", False)
    assert (cache_hints.experts_eviction(), cache_hints.products_eviction()) == \
        ("", "evict_first")
    monkeypatch.setattr(cache_hints, "PRODUCTS_EVICT_FIRST", False)
    assert cache_hints.products_eviction() == ""


def test_compiled_for_hopper_evict_first_marks_the_weight_loads():
    """EVICT="evict_first": the products' and the experts' weight loads carry the L2 cache
    hint (PTX's evict-first cache policy); left out, no load of theirs does."""
    pytest.importorskip("triton", reason="the dev extra installs Triton on Linux x86_64")
    from strata.engine.experts import _grouped_triton
    from strata.engine.model import _products_triton

    kernels = [(_products_triton.product_one, {"HAS_BIAS": False, "BLOCK_N": 2,
                                               "BLOCK_K": 2048}, {}),
               (_products_triton.add_norm_product_one,
                {"HAS_DELTA": True, "HAS_BIAS": False, "BLOCK_N": 8, "BLOCK_K": 2048},
                {"eps": "fp32"}),
               (_grouped_triton.gate_up_act, {"BLOCK_F": 32, "BLOCK_D": 128}, {}),
               (_grouped_triton.down, {"BLOCK_D": 32, "BLOCK_F": 128}, {}),
               (_grouped_triton.down_sum, {"BLOCK_D": 32, "BLOCK_F": 128, "BLOCK_R": 8},
                {"arrived_ptr": "*i32", "weights_ptr": "*fp32"})]
    for kernel, constexprs, types in kernels:
        plain = compile_for_hopper(kernel, constexprs, types, num_warps=8).asm["ptx"]
        marked = compile_for_hopper(kernel, {**constexprs, "EVICT": "evict_first"}, types,
                                    num_warps=8).asm["ptx"]
        assert "cache_hint" not in plain, kernel.__name__
        assert "createpolicy.fractional.L2::evict_first" in marked, kernel.__name__
        assert "L1::evict_first.L2::cache_hint" in marked, kernel.__name__


def test_the_launches_pass_the_switches_to_the_kernels(monkeypatch):
    """Each launch site hands its kernel the mark its switch says, read at the launch."""
    from strata.engine.experts import grouped
    from strata.engine.model import products

    seen = []

    class Kernel:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **options: seen.append((self.name, options["EVICT"]))

    class Kernels:
        gate_up_act, down, down_sum = Kernel("gate_up_act"), Kernel("down"), Kernel("down_sum")
        product_one, add_norm_product_one = Kernel("product_one"), Kernel("add_norm")

    monkeypatch.setattr(grouped, "_kernels", lambda: Kernels)
    monkeypatch.setattr(products, "_kernels", lambda: Kernels)
    x, index = torch.zeros(2, 64), torch.zeros(2, dtype=torch.int64)
    gate_up, down = torch.zeros(3, 256, 64), torch.zeros(3, 64, 128)
    for experts, products_too in ((True, True), (False, True), (True, False)):
        monkeypatch.setattr(cache_hints, "EXPERTS_EVICT_FIRST", experts)
        monkeypatch.setattr(cache_hints, "PRODUCTS_EVICT_FIRST", products_too)
        seen.clear()
        grouped.expert_rows_triton(gate_up, down, index, x)
        grouped.expert_sum_triton(gate_up, down, index, x, torch.zeros(1, 2),
                                  grouped.sum_arrivals(64, torch.device("cpu")))
        products.linear_one_triton(x[:1], torch.zeros(8, 64))
        products.add_norm_linear_triton(x[:1], None, torch.ones(64), 1e-6,
                                        torch.zeros(8, 64))
        mark, product_mark = ("evict_first" if experts else ""), \
            ("evict_first" if products_too else "")
        assert seen == [("gate_up_act", mark), ("down", mark), ("gate_up_act", mark),
                        ("down_sum", mark), ("product_one", product_mark),
                        ("add_norm", product_mark)]


def _decode_logits(model, steps: int = 3) -> torch.Tensor:
    """A prompt of 5 tokens, then `steps` one-token steps: their logits [steps, V]."""
    with new_kv(model, 32) as kv:
        model.forward(torch.tensor([3, 1, 4, 1, 5], device="cuda"), 0, kv)
        return torch.cat([model.forward(torch.tensor([9 + step], device="cuda"), 5 + step, kv)
                          for step in range(steps)])


@pytest.mark.cuda
def test_on_cuda_the_marks_change_no_byte():
    """Decode steps through the marked kernels give the bytes of the unmarked ones."""
    model = load_model(cached_checkpoint("olmoe", "small", dtype=torch.bfloat16),
                       device="cuda", dtype=torch.bfloat16)
    marked = _decode_logits(model)
    for experts, products_too in ((False, True), (True, False), (False, False)):
        cache_hints.EXPERTS_EVICT_FIRST, cache_hints.PRODUCTS_EVICT_FIRST = experts, products_too
        try:
            assert torch.equal(_decode_logits(model), marked), (experts, products_too)
        finally:
            cache_hints.EXPERTS_EVICT_FIRST = cache_hints.PRODUCTS_EVICT_FIRST = True
