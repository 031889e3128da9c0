"""`strata.engine.cache_hints`: the switches, the marks they put on the compiled kernels'
weight loads, the launch options that ask a weight into L2 and where the compiled kernels ask,
the model's links from layer to layer, and (on CUDA) a decode step's same bytes whichever
switch is on."""

from __future__ import annotations

import itertools

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
               (_grouped_triton.down_sum, {"BLOCK_D": 32, "BLOCK_F": 128},
                {"arrived_ptr": "*i32", "weights_ptr": "*fp32"}),
               (_grouped_triton.down_sum, {"BLOCK_D": 32, "BLOCK_F": 128, "W_FIRST": True},
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


def test_nothing_is_asked_for_unless_the_switch_names_the_kernel_on_cuda(monkeypatch):
    like, weight = torch.zeros(4), torch.zeros(8, 4)
    nothing = {"ahead_ptr": like, "ahead_n": 0, "AHEAD_LINE": 0,
               "AHEAD_STEP": cache_hints.LINES_A_STEP, "AHEAD_LAST": False}
    assert cache_hints.AHEAD == "" and cache_hints.ahead_options("router", weight, like) == nothing
    for ahead in ("router", "both"):
        monkeypatch.setattr(cache_hints, "AHEAD", ahead)
        assert cache_hints.ahead_options("attention" if ahead == "router" else "router",
                                         None, like) == nothing
        assert cache_hints.ahead_options("router", weight, like) == nothing  # the CPU
    monkeypatch.setattr(cache_hints, "AHEAD", "experts")
    with pytest.raises(ValueError, match=r"cache_hints.AHEAD must be one of \('', 'attention', "
                                         r"'router', 'both'\), got 'experts'"):
        cache_hints.ahead_options("router", weight, like)


def test_each_layer_holds_the_next_layers_qkv_weight_and_the_last_none():
    model = load_model(cached_checkpoint("olmoe", "small", dtype=torch.float32))
    layers = model.layers
    assert len(layers) > 2
    assert all(layer.ahead is after.attn.wqkv for layer, after in itertools.pairwise(layers))
    assert layers[-1].ahead is None


@pytest.mark.parametrize("line, last", [(0, False), (64, False), (64, True)])
def test_compiled_for_hopper_the_attention_and_router_ask_after_their_wait(line, last):
    """AHEAD_LINE > 0: the short attention's and the router's programs ask for lines (one a
    thread a step, marked evict_last where AHEAD_LAST) after their wait, and load none of
    them; 0: the kernels have no prefetch."""
    pytest.importorskip("triton", reason="the dev extra installs Triton on Linux x86_64")
    from strata.engine.model import _attention_triton, _ops_triton

    attention = compile_for_hopper(
        _attention_triton.rotate_attend_short,
        {"NORM": 2, "HAS_MASK": False, "BLOCK_C": 64, "BLOCK_R": 16, "BLOCK_P": 16,
         "HEAD_DIM": 128, "VALUES_FIRST": True, "AHEAD_LINE": line, "AHEAD_LAST": last},
        {}, num_warps=8).asm["ptx"]
    router = compile_for_hopper(
        _ops_triton.add_norm_router_route,
        {"HAS_DELTA": True, "NORMALIZE": False, "SPLITS": 64, "BLOCK_ROW": 2048, "BLOCK_D": 32,
         "BLOCK_E": 64, "BLOCK_K": 8, "AHEAD_LINE": line, "AHEAD_LAST": last},
        {"partial_ptr": "*fp32", "arrived_ptr": "*i32", "ids_ptr": "*i64",
         "weights_ptr": "*fp32", "eps": "fp32"}, num_warps=8).asm["ptx"]
    for ptx in (attention, router):
        before, _, after = ptx.partition("griddepcontrol.wait")
        assert "prefetch.global" not in before
        assert after.count("prefetch.global.L2") == (1 if line else 0)  # in the loop
        assert ("prefetch.global.L2::evict_last" in after) == (line > 0 and last)


def _decode_logits(model, steps: int = 3) -> torch.Tensor:
    """A prompt of 5 tokens, then `steps` one-token steps: their logits [steps, V]."""
    with new_kv(model, 32) as kv:
        model.forward(torch.tensor([3, 1, 4, 1, 5], device="cuda"), 0, kv)
        return torch.cat([model.forward(torch.tensor([9 + step], device="cuda"), 5 + step, kv)
                          for step in range(steps)])


@pytest.mark.cuda
@pytest.mark.parametrize("ahead", ["attention", "router", "both"])
def test_on_cuda_the_switches_change_no_byte_and_the_weight_is_asked_for(monkeypatch, ahead):
    """Decode steps through the marked kernels give the bytes of the unmarked ones; with AHEAD
    on too, every one-token layer but the last asks for the next layer's q/k/v weight (or
    its halves) from the kernels AHEAD names, and the bytes are still the same."""
    model = load_model(cached_checkpoint("olmoe", "small", dtype=torch.bfloat16),
                       device="cuda", dtype=torch.bfloat16)
    marked = _decode_logits(model)
    asked = []
    options = cache_hints.ahead_options

    def recorded(kernel, weight, like):
        got = options(kernel, weight, like)
        if got["ahead_n"]:
            asked.append((kernel, got["ahead_ptr"].data_ptr(), got["ahead_n"]))
        return got

    monkeypatch.setattr(cache_hints, "ahead_options", recorded)
    monkeypatch.setattr(cache_hints, "AHEAD", ahead)
    assert torch.equal(_decode_logits(model), marked)
    expected = []
    for weight in (layer.attn.wqkv for layer in model.layers[1:]):
        ptr, n, size = weight.data_ptr(), weight.numel(), weight.element_size()
        expected += {"attention": [("attention", ptr, n)], "router": [("router", ptr, n)],
                     "both": [("attention", ptr, n // 2),
                              ("router", ptr + n // 2 * size, n - n // 2)]}[ahead]
    assert asked == expected * 3
    monkeypatch.setattr(cache_hints, "AHEAD", "")
    monkeypatch.setattr(cache_hints, "EXPERTS_EVICT_FIRST", False)
    monkeypatch.setattr(cache_hints, "PRODUCTS_EVICT_FIRST", False)
    assert torch.equal(_decode_logits(model), marked)
