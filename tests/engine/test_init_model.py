"""init-model: complete checkpoints that transformers and strata's config reader both accept."""

import dataclasses
import hashlib
import json

import pytest
import torch
from safetensors import safe_open

from strata.engine.model.config import ModelConfig
from strata.engine.model.init_model import (
    FAMILIES,
    checkpoint_bytes,
    hf_config,
    iter_presets_and_families,
    tensor_specs,
    write_checkpoint,
)
from strata.engine.model.presets import PRESETS


def _digests(ckpt):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(ckpt.iterdir())}


def _read(ckpt, name):
    index = ckpt / "model.safetensors.index.json"
    file = "model.safetensors"
    if index.exists():
        file = json.loads(index.read_text())["weight_map"][name]
    with safe_open(str(ckpt / file), "pt") as f:
        return f.get_tensor(name)


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_loads_every_tensor(tmp_path, family):
    transformers = pytest.importorskip("transformers")
    ckpt = write_checkpoint(tmp_path / "ckpt", family, "tiny", max_shard_bytes=200_000)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        ckpt, output_loading_info=True
    )
    assert not info["missing_keys"]
    assert not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    assert model.dtype == torch.bfloat16
    # The loaded values are the written ones: expert 3 of layer 1 (fused by transformers 5).
    experts = model.model.layers[1].mlp.experts
    gate, up, down = (
        ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    )
    moe = "block_sparse_moe" if family == "mixtral" else "mlp"
    prefix = f"model.layers.1.{moe}.experts.3."
    written_gate_up = torch.cat([_read(ckpt, prefix + gate + ".weight"),
                                 _read(ckpt, prefix + up + ".weight")])
    assert torch.equal(experts.gate_up_proj[3], written_gate_up)
    assert torch.equal(experts.down_proj[3], _read(ckpt, prefix + down + ".weight"))


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_head_dim_other_than_hidden_over_heads_reaches_transformers(tmp_path, family):
    transformers = pytest.importorskip("transformers")
    shape = dataclasses.replace(PRESETS["tiny"], head_dim=32)  # 4 * 32 != 64
    ckpt = write_checkpoint(tmp_path / "ckpt", family, shape)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        ckpt, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (128, 64)


@pytest.mark.parametrize(("family", "preset"), list(iter_presets_and_families()))
def test_strata_reads_the_config_as_the_preset(family, preset):
    shape = PRESETS[preset]
    config = ModelConfig.from_hf(hf_config(family, shape))
    assert config.family == family
    assert (config.n_layers, config.hidden_size, config.n_heads, config.n_kv_heads) == (
        shape.n_layers, shape.hidden_size, shape.n_heads, shape.n_kv_heads
    )
    assert (config.head_dim, config.n_experts, config.top_k, config.expert_width) == (
        shape.head_dim, shape.n_experts, shape.top_k, shape.expert_width
    )
    assert config.vocab_size == shape.vocab_size
    assert config.rope_theta == shape.rope_theta and config.rms_norm_eps == shape.rms_norm_eps
    assert config.shared_expert_width == (shape.shared_expert_width if family == "qwen2_moe" else 0)
    assert config.norm_topk_prob == (True if family == "mixtral" else shape.norm_topk_prob)


def test_real_presets_have_the_real_parameter_counts():
    olmoe = checkpoint_bytes("olmoe", PRESETS["olmoe-1b-7b"]) / 2  # bf16: 2 bytes a parameter
    qwen3 = checkpoint_bytes("qwen3_moe", PRESETS["qwen3-30b-a3b"]) / 2
    assert 6.90e9 < olmoe < 6.95e9  # OLMoE-1B-7B: 6.9B parameters
    assert 30.4e9 < qwen3 < 30.6e9  # Qwen3-30B-A3B: 30.5B parameters
    mixtral = checkpoint_bytes("mixtral", PRESETS["mixtral-8x7b"]) / 2
    assert 46.6e9 < mixtral < 46.8e9  # Mixtral-8x7B: 46.7B parameters


def test_olmoe_family_refuses_a_shape_it_cannot_express():
    with pytest.raises(ValueError, match=r"olmoe needs n_heads \* head_dim == hidden_size"):
        hf_config("olmoe", PRESETS["qwen3-30b-a3b"])


def test_a_shared_expert_only_for_qwen2_moe():
    for family in FAMILIES:
        names = [s.name for s in tensor_specs(family, PRESETS["tiny"])]
        assert any("shared_expert" in n for n in names) == (family == "qwen2_moe")


def test_same_arguments_same_bytes(tmp_path):
    a = write_checkpoint(tmp_path / "a", "qwen2_moe", "tiny", seed=7, max_shard_bytes=100_000)
    b = write_checkpoint(tmp_path / "b", "qwen2_moe", "tiny", seed=7, max_shard_bytes=100_000)
    c = write_checkpoint(tmp_path / "c", "qwen2_moe", "tiny", seed=8, max_shard_bytes=100_000)
    assert _digests(a) == _digests(b)
    shards = sorted(p.name for p in a.glob("*.safetensors"))
    assert len(shards) > 1
    assert _digests(a)["config.json"] == _digests(c)["config.json"]
    assert all(_digests(a)[name] != _digests(c)[name] for name in shards)


def test_fewer_layers_leave_the_kept_tensors_unchanged(tmp_path):
    full = write_checkpoint(tmp_path / "full", "olmoe", "small")
    short = write_checkpoint(tmp_path / "short", "olmoe", "small", n_layers=1)
    assert json.loads((short / "config.json").read_text())["num_hidden_layers"] == 1
    for name in ("model.layers.0.mlp.experts.5.up_proj.weight", "lm_head.weight"):
        assert torch.equal(_read(full, name), _read(short, name))
    with safe_open(str(short / "model.safetensors"), "pt") as f:
        assert not any(k.startswith("model.layers.1.") for k in f.keys())  # noqa: SIM118


def test_shards_and_index_cover_every_tensor(tmp_path):
    ckpt = write_checkpoint(tmp_path / "ckpt", "mixtral", "tiny", max_shard_bytes=50_000)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    specs = tensor_specs("mixtral", PRESETS["tiny"])
    assert set(index["weight_map"]) == {s.name for s in specs}
    files = sorted(p.name for p in ckpt.glob("*.safetensors"))
    assert len(files) > 1 and set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == checkpoint_bytes("mixtral", PRESETS["tiny"])
    for spec in specs[:5] + specs[-3:]:
        assert tuple(_read(ckpt, spec.name).shape) == spec.shape


def test_one_shard_has_no_index_and_fp32_is_written_as_fp32(tmp_path):
    ckpt = write_checkpoint(tmp_path / "ckpt", "qwen3_moe", "tiny", dtype=torch.float32)
    assert not (ckpt / "model.safetensors.index.json").exists()
    assert json.loads((ckpt / "config.json").read_text())["torch_dtype"] == "float32"
    assert _read(ckpt, "model.norm.weight").dtype == torch.float32


def test_refuses_a_directory_with_files(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="not an empty directory"):
        write_checkpoint(tmp_path / "ckpt", "mixtral", "tiny")
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["keep.txt"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"family": "llama"}, "unknown family 'llama'; choose one of: mixtral"),
        ({"preset": "huge"}, "unknown preset 'huge'"),
        ({"n_layers": 3}, "exceeds preset 'tiny'"),
        ({"seed": -1}, "seed must be a non-negative int"),
        ({"dtype": torch.int8}, "dtype must be one of"),
        ({"router_skew": -0.5}, "router_skew must be a finite number >= 0, got -0.5"),
        ({"router_skew": float("nan")}, "router_skew must be a finite number >= 0"),
    ],
)
def test_bad_arguments_write_nothing(tmp_path, kwargs, message):
    args = {"family": "mixtral", "preset": "tiny", **kwargs}
    with pytest.raises(ValueError, match=message):
        write_checkpoint(tmp_path / "ckpt", args.pop("family"), args.pop("preset"), **args)
    assert not (tmp_path / "ckpt").exists()


def test_router_skew_scales_router_rows_and_nothing_else(tmp_path):
    plain = write_checkpoint(tmp_path / "plain", "olmoe", "tiny")
    skewed = write_checkpoint(tmp_path / "skewed", "olmoe", "tiny", router_skew=1.0)
    assert "strata_router_skew" not in json.loads((plain / "config.json").read_text())
    assert json.loads((skewed / "config.json").read_text())["strata_router_skew"] == 1.0
    assert ModelConfig.from_dir(skewed) == ModelConfig.from_dir(plain)
    scales = []
    for spec in tensor_specs("olmoe", PRESETS["tiny"]):
        a, b = _read(plain, spec.name), _read(skewed, spec.name)
        if spec.init != "router":
            assert torch.equal(a, b), spec.name
            continue
        ratio = b.float().norm(dim=1) / a.float().norm(dim=1)  # [E]: the row scales
        expected = (torch.arange(ratio.numel()) + 1.0) ** -1.0
        expected /= expected.square().mean().sqrt()
        assert torch.allclose(ratio.sort(descending=True).values, expected, rtol=2e-2)
        scales.append(ratio.argmax().item())
    # Each layer favours its own experts: the permutation is drawn per router (seeded).
    assert len(scales) == PRESETS["tiny"].n_layers == 2 and scales[0] != scales[1]


def test_router_skew_concentrates_the_routing(tmp_path):
    from strata.engine.model.moe import load_model
    from strata.engine.runtime.calibrate import collect_counts

    prompts = [torch.randint(0, 256, (48,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(3)]
    shares = {}
    for skew in (0.0, 1.0):
        ckpt = write_checkpoint(tmp_path / f"skew{skew}", "qwen3_moe", "small",
                                dtype=torch.float32, router_skew=skew)
        counts, _ = collect_counts(load_model(ckpt, device="cpu"), prompts, decode_tokens=8,
                                   prefill_chunk=48)  # [L, E]
        ranked = -torch.sort(-torch.as_tensor(counts, dtype=torch.float64), dim=1).values
        quarter = ranked.shape[1] // 4
        shares[skew] = (ranked[:, :quarter].sum() / ranked.sum()).item()
    # The hottest quarter of each layer's experts takes a larger share of the routing.
    assert shares[1.0] > shares[0.0] + 0.05, shares
