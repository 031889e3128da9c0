"""ExpertStore blobs and ResidentExperts against a per-token reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from strata.engine.experts import ExpertStore, ResidentExperts
from strata.engine.model import families
from strata.engine.model.checkpoint import Checkpoint, expert_store
from strata.engine.model.layers import route, swiglu
from support.checkpoints import cached_checkpoint


@pytest.fixture(scope="module")
def ckpt():
    return Checkpoint.open(cached_checkpoint("qwen2_moe", dtype=torch.float32))


@pytest.fixture(scope="module")
def store(ckpt):
    return expert_store(ckpt)


def checkpoint_weights(ckpt, layer, expert):
    names = families.family(ckpt.config.family).expert_names(layer, expert)
    return [ckpt.tensor(name) for name in names]


def test_blob_layout(ckpt, store):
    cfg = ckpt.config
    f, d = cfg.expert_width, cfg.hidden_size
    assert store.blob_bytes == 3 * f * d * 4
    assert (store.n_layers, store.n_experts) == (cfg.n_layers, cfg.n_experts)
    assert store.layer_blobs(1).shape == (cfg.n_experts, store.blob_bytes)
    for layer, expert in ((0, 0), (1, cfg.n_experts - 1)):
        gate, up, down = checkpoint_weights(ckpt, layer, expert)
        blob = store.blob(layer, expert)
        assert blob.dtype == torch.uint8 and blob.is_contiguous()
        expected = torch.cat((gate.flatten(), up.flatten(), down.flatten())).view(torch.uint8)
        assert torch.equal(blob, expected)
        views = store.weights(layer, expert)
        for view, tensor in zip(views, (gate, up, down), strict=True):
            assert torch.equal(view, tensor)
        # The views alias the blob: [gate | up | down] back to back.
        base = blob.data_ptr()
        assert [v.data_ptr() - base for v in views] == [0, f * d * 4, 2 * f * d * 4]


def test_store_converts_dtype(ckpt):
    store = expert_store(ckpt, torch.bfloat16)
    gate, up, down = checkpoint_weights(ckpt, 1, 2)
    assert store.blob_bytes == 3 * gate.numel() * 2
    for view, tensor in zip(store.weights(1, 2), (gate, up, down), strict=True):
        assert view.dtype == torch.bfloat16 and torch.equal(view, tensor.to(torch.bfloat16))


def test_store_index_errors(store):
    with pytest.raises(IndexError, match=r"layer 2 is out of range \[0, 2\)"):
        store.blob(2, 0)
    with pytest.raises(IndexError, match=r"expert -1 is out of range \[0, 8\)"):
        store.weights(0, -1)
    with pytest.raises(ValueError, match="expected a uint8 tensor"):
        ExpertStore([torch.zeros(4, 10)], 4, 2, torch.float32)


def reference(store, layer, x, ids, weights):
    """Per token, per k, in order: sum_k w[t, k] * expert(x[t]) in float32."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            gate, up, down = store.weights(layer, int(ids[t, k]))
            y = F.linear(F.silu(F.linear(x[t], gate)) * F.linear(x[t], up), down)
            out[t] += weights[t, k] * y
    return out


@pytest.mark.parametrize("n_tokens", [1, 4, 37])  # T == 1: gathered; larger: per expert
def test_resident_matches_reference(store, n_tokens):
    experts = ResidentExperts(store, "cpu")
    generator = torch.Generator().manual_seed(n_tokens)
    x = torch.randn(n_tokens, store.hidden_size, generator=generator)
    logits = torch.randn(n_tokens, store.n_experts, generator=generator)
    ids, weights = route(logits, 2, normalize=True)
    out = experts.forward(1, x, ids, weights)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out, reference(store, 1, x, ids, weights), rtol=1e-5, atol=1e-5)
    again = experts.forward(1, x, ids, weights)
    assert torch.equal(out.view(torch.int32), again.view(torch.int32))  # same bytes


def test_gathered_and_per_expert_paths_agree(store):
    experts = ResidentExperts(store, "cpu")
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(30, store.hidden_size, generator=generator)
    ids, weights = route(torch.randn(30, store.n_experts, generator=generator), 2, False)
    together = experts.forward(0, x, ids, weights)  # per-expert path
    one_by_one = torch.cat([experts.forward(0, x[t : t + 1], ids[t : t + 1], weights[t : t + 1])
                            for t in range(30)])  # gathered path
    torch.testing.assert_close(together, one_by_one, rtol=1e-5, atol=1e-6)


def test_resident_on_cpu_shares_the_store(store):
    experts = ResidentExperts(store, "cpu")
    assert experts.gate_up(0).data_ptr() == store.layer_blobs(0).data_ptr()
    assert experts.gate_up(0).shape == (store.n_experts, 2 * store.expert_width, store.hidden_size)
    assert experts.down(1).shape == (store.n_experts, store.hidden_size, store.expert_width)
    gate, up, down = store.weights(1, 5)
    assert torch.equal(experts.gate_up(1)[5], torch.cat((gate, up)))
    assert torch.equal(experts.down(1)[5], down)
    converted = ResidentExperts(store, "cpu", torch.bfloat16)
    assert converted.gate_up(0).dtype == torch.bfloat16
    assert torch.equal(converted.down(1)[5], down.to(torch.bfloat16))


def test_route_and_swiglu():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 2.9]])
    ids, weights = route(logits, 2, normalize=False)
    assert ids.tolist() == [[1, 2], [0, 3]] and ids.dtype == torch.int64
    probs = torch.softmax(logits, dim=-1)
    torch.testing.assert_close(weights, probs.gather(1, ids))
    _, normalized = route(logits, 2, normalize=True)
    torch.testing.assert_close(normalized.sum(-1), torch.ones(2))
    x, gate_up, down = torch.randn(3, 8), torch.randn(10, 8), torch.randn(8, 5)
    expected = F.linear(F.silu(x @ gate_up[:5].T) * (x @ gate_up[5:].T), down)
    torch.testing.assert_close(swiglu(x, gate_up, down), expected)
