"""A store of quantized experts read from a checkpoint, and the CPU's miss path over it (the
resident experts and the cache's slots: tests/engine/test_quantized_engine.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from strata.engine.experts.cpu import CpuExperts
from strata.engine.experts.quant import WEIGHT_FORMATS, blob_bytes, fake_quantize, make_blob
from strata.engine.experts.routed import Routed
from strata.engine.model import families
from strata.engine.model.checkpoint import Checkpoint, expert_store
from support.checkpoints import cached_checkpoint


@pytest.fixture(scope="module")
def ckpt():
    opened = Checkpoint.open(cached_checkpoint("qwen3_moe"))  # tiny: D 64, F 128
    yield opened
    opened.close()


@pytest.mark.parametrize("quant", WEIGHT_FORMATS)
def test_a_quantized_store_holds_each_expert_s_blob(ckpt, quant):
    cfg = ckpt.config
    store = expert_store(ckpt, torch.bfloat16, quant=quant)
    assert store.quant == quant and store.dtype == torch.bfloat16
    assert store.blob_bytes == blob_bytes(quant, cfg.expert_width, cfg.hidden_size)
    fam = families.family(cfg.family)
    for layer, expert in ((0, 0), (cfg.n_layers - 1, cfg.n_experts - 1)):
        weights = [ckpt.tensor(n) for n in fam.expert_names(layer, expert)]
        assert torch.equal(store.blob(layer, expert), make_blob(quant, *weights))
        for got, w in zip(store.weights(layer, expert), weights, strict=True):
            assert torch.equal(got, fake_quantize(w, quant))


@pytest.mark.parametrize("quant", WEIGHT_FORMATS)
def test_the_cpu_computes_quantized_experts_as_their_weights(ckpt, quant):
    store = expert_store(ckpt, torch.bfloat16, quant=quant)
    rng = np.random.default_rng(0)
    # Experts of 1 to 5 rows: all through the kernel, whatever their rows.
    ids = np.stack([rng.choice(store.n_experts, 2, replace=False) for _ in range(5)])
    routed = Routed.of(ids)
    x_rows = torch.randn(routed.n_rows, store.hidden_size,
                         generator=torch.Generator().manual_seed(1)).bfloat16()
    out = CpuExperts(store, 2).compute(1, x_rows, routed)
    assert torch.equal(CpuExperts(store, 1).compute(1, x_rows, routed), out)  # any threads
    f = store.expert_width
    for i, expert in enumerate(routed.experts.tolist()):
        lo, hi = int(routed.starts[i]), int(routed.starts[i + 1])
        gate, up, down = store.weights(1, expert)
        h = (x_rows[lo:hi].float() @ torch.cat((gate, up)).T).bfloat16()
        expected = ((F.silu(h[:, :f]) * h[:, f:]).float() @ down.T)  # [n, D]
        magnitude = (F.silu(h[:, :f].float()) * h[:, f:].float()).abs() @ down.abs().T
        assert ((out[lo:hi].float() - expected).abs() <= magnitude * 2**-5 + 1e-6).all()


def test_a_float32_quantized_store_computes_on_the_cpu_through_torch(ckpt):
    """The reference numerics: each expert dequantized to float32, then torch's matmuls."""
    store = expert_store(ckpt, torch.float32, quant="int8")
    cpu = CpuExperts(store)
    assert cpu.kernel == "torch"
    routed = Routed.of(np.array([[0, 3], [3, 5]]))
    x_rows = torch.randn(routed.n_rows, store.hidden_size,
                         generator=torch.Generator().manual_seed(2))
    out = cpu.compute(0, x_rows, routed)
    f = store.expert_width
    for i, expert in enumerate(routed.experts.tolist()):
        lo, hi = int(routed.starts[i]), int(routed.starts[i + 1])
        gate, up, down = store.weights(0, expert)
        h = x_rows[lo:hi] @ torch.cat((gate, up)).T
        assert torch.allclose(out[lo:hi], (F.silu(h[:, :f]) * h[:, f:]) @ down.T, atol=1e-5)
    with pytest.raises(ValueError, match=r"fmt must be one of"):
        expert_store(ckpt, torch.bfloat16, quant="int2")
