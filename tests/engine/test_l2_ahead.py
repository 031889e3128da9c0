"""`strata.engine.l2_ahead`: the launch options that ask a weight into L2, where the compiled
kernels ask for it and mark their loads, the model's links from layer to layer, and (on CUDA)
a decode step's same bytes whichever switch is on."""

from __future__ import annotations

import itertools

import pytest
import torch

from strata.engine import l2_ahead
from strata.engine.kv import new_kv
from strata.engine.model import load_model
from support.checkpoints import cached_checkpoint
from support.hopper import compile_for_hopper

PREFETCH = {False: "prefetch.global.L2::evict_last",
            True: "cp.async.bulk.prefetch.L2.global.L2::cache_hint"}


def test_nothing_is_asked_for_unless_the_switch_names_the_kernel_on_cuda(monkeypatch):
    like, weight = torch.zeros(4), torch.zeros(8, 4)
    nothing = {"ahead_ptr": like, "ahead_n": 0, "AHEAD_CHUNK": 0,
               "AHEAD_STEP": l2_ahead.CHUNKS_A_STEP, "AHEAD_BULK": True}
    assert l2_ahead.AHEAD == "" and l2_ahead.ahead_options("router", weight, like) == nothing
    monkeypatch.setattr(l2_ahead, "AHEAD", "router")
    assert l2_ahead.ahead_options("attention", weight, like) == nothing
    assert l2_ahead.ahead_options("router", None, like) == nothing
    assert l2_ahead.ahead_options("router", weight, like) == nothing  # the CPU: no prefetch
    monkeypatch.setattr(l2_ahead, "AHEAD", "experts")
    with pytest.raises(ValueError, match=r"l2_ahead.AHEAD must be one of \('', 'attention', "
                                         r"'router'\), got 'experts'"):
        l2_ahead.ahead_options("router", weight, like)
    monkeypatch.setattr(l2_ahead, "AHEAD", "router")
    monkeypatch.setattr(l2_ahead, "AHEAD_METHOD", "words")
    with pytest.raises(ValueError, match=r"l2_ahead.AHEAD_METHOD must be one of \('bulk', "
                                         r"'lines', 'sectors'\), got 'words'"):
        l2_ahead.ahead_options("router", weight, like)


def test_the_eviction_marks_follow_their_switches(monkeypatch):
    assert (l2_ahead.experts_eviction(), l2_ahead.products_eviction()) == ("", "")
    monkeypatch.setattr(l2_ahead, "EXPERTS_EVICT_FIRST", True)
    assert (l2_ahead.experts_eviction(), l2_ahead.products_eviction()) == ("evict_first", "")
    monkeypatch.setattr(l2_ahead, "PRODUCTS_EVICT_FIRST", True)
    assert l2_ahead.products_eviction() == "evict_first"


def test_each_layer_holds_the_next_layers_qkv_weight_and_the_last_none():
    model = load_model(cached_checkpoint("olmoe", "small", dtype=torch.float32))
    layers = model.layers
    assert len(layers) > 2
    assert all(layer.ahead is after.attn.wqkv for layer, after in itertools.pairwise(layers))
    assert layers[-1].ahead is None


def _asks(ptx: str, bulk: bool) -> tuple[int, int]:
    """(prefetches before the dependent-launch wait, after it) in a kernel's PTX."""
    before, _, after = ptx.partition("griddepcontrol.wait")
    return before.count(PREFETCH[bulk]), after.count(PREFETCH[bulk])


@pytest.mark.parametrize("chunk, bulk", [(0, True), (64, False), (8192, True)])
def test_compiled_for_hopper_the_attention_and_router_ask_after_their_wait(chunk, bulk):
    """AHEAD_CHUNK > 0: the short attention's and the router's programs ask for lines or
    bulk chunks (one a thread a step) after their wait, and load none of them; 0: the kernels
    have no prefetch."""
    pytest.importorskip("triton", reason="the dev extra installs Triton on Linux x86_64")
    from strata.engine.model import _attention_triton, _ops_triton

    attention = compile_for_hopper(
        _attention_triton.rotate_attend_short,
        {"NORM": 2, "HAS_MASK": False, "BLOCK_C": 64, "BLOCK_R": 16, "BLOCK_P": 16,
         "HEAD_DIM": 128, "VALUES_FIRST": True, "AHEAD_CHUNK": chunk, "AHEAD_BULK": bulk},
        {}, num_warps=8).asm["ptx"]
    router = compile_for_hopper(
        _ops_triton.add_norm_router_route,
        {"HAS_DELTA": True, "NORMALIZE": False, "SPLITS": 64, "BLOCK_ROW": 2048, "BLOCK_D": 32,
         "BLOCK_E": 64, "BLOCK_K": 8, "AHEAD_CHUNK": chunk, "AHEAD_BULK": bulk},
        {"partial_ptr": "*fp32", "arrived_ptr": "*i32", "ids_ptr": "*i64",
         "weights_ptr": "*fp32", "eps": "fp32"}, num_warps=8).asm["ptx"]
    for ptx in (attention, router):
        before, after = _asks(ptx, bulk)
        assert before == 0 and (after > 0) == (chunk > 0)
        assert "cp.async.bulk" not in ptx or bulk


def test_compiled_for_hopper_evict_first_marks_the_weight_loads():
    """EVICT="evict_first": the products' and the experts' weight loads carry the L2 cache
    hint; by default no load of theirs does."""
    pytest.importorskip("triton", reason="the dev extra installs Triton on Linux x86_64")
    from strata.engine.experts import _grouped_triton
    from strata.engine.model import _products_triton

    kernels = [(_products_triton.product_one, {"HAS_BIAS": False, "BLOCK_N": 2,
                                               "BLOCK_K": 2048}, {}),
               (_products_triton.add_norm_product_one,
                {"HAS_DELTA": True, "HAS_BIAS": False, "BLOCK_N": 8, "BLOCK_K": 2048},
                {"eps": "fp32"}),
               (_grouped_triton.gate_up_act, {"BLOCK_F": 32, "BLOCK_D": 128}, {}),
               (_grouped_triton.down_sum, {"BLOCK_D": 32, "BLOCK_F": 128},
                {"arrived_ptr": "*i32", "weights_ptr": "*fp32"})]
    for kernel, constexprs, types in kernels:
        plain = compile_for_hopper(kernel, constexprs, types, num_warps=8).asm["ptx"]
        marked = compile_for_hopper(kernel, {**constexprs, "EVICT": "evict_first"}, types,
                                    num_warps=8).asm["ptx"]
        assert "cache_hint" not in plain, kernel.__name__
        assert "L1::evict_first.L2::cache_hint" in marked, kernel.__name__


def _decode_logits(model, steps: int = 3) -> torch.Tensor:
    """A prompt of 5 tokens, then `steps` one-token steps: their logits [steps, V]."""
    with new_kv(model, 32) as kv:
        model.forward(torch.tensor([3, 1, 4, 1, 5], device="cuda"), 0, kv)
        return torch.cat([model.forward(torch.tensor([9 + step], device="cuda"), 5 + step, kv)
                          for step in range(steps)])


@pytest.mark.cuda
@pytest.mark.parametrize("ahead", ["attention", "router"])
def test_on_cuda_the_switches_change_no_byte_and_the_weight_is_asked_for(monkeypatch, ahead):
    """Every one-token layer but the last asks for the next layer's q/k/v weight from the
    kernel AHEAD names, with the experts' and the products' loads marked evict_first: the
    logits are the bytes of the switches off."""
    model = load_model(cached_checkpoint("olmoe", "small", dtype=torch.bfloat16),
                       device="cuda", dtype=torch.bfloat16)
    reference = _decode_logits(model)
    asked = []
    options = l2_ahead.ahead_options

    def recorded(kernel, weight, like):
        got = options(kernel, weight, like)
        if got["ahead_n"]:
            asked.append((kernel, got["ahead_ptr"].data_ptr()))
        return got

    monkeypatch.setattr(l2_ahead, "ahead_options", recorded)
    monkeypatch.setattr(l2_ahead, "AHEAD", ahead)
    monkeypatch.setattr(l2_ahead, "EXPERTS_EVICT_FIRST", True)
    monkeypatch.setattr(l2_ahead, "PRODUCTS_EVICT_FIRST", True)
    assert torch.equal(_decode_logits(model), reference)
    nexts = [layer.attn.wqkv.data_ptr() for layer in model.layers[1:]]
    assert asked == [(ahead, ptr) for _ in range(3) for ptr in nexts]
