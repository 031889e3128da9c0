"""ModelConfig from config.json: each family's fields, old and new spellings, and rejections."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from strata.engine.model.config import SUPPORTED_FAMILIES, CheckpointError, ModelConfig
from support.hf_models import hf_config

transformers = pytest.importorskip("transformers")


def saved_config(family: str, tmp_path, **overrides) -> dict:
    """config.json as Transformers' save_pretrained writes it."""
    hf_config(family, **{"dtype": "float32", **overrides}).save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


def test_supported_families():
    assert SUPPORTED_FAMILIES == ("mixtral", "olmoe", "qwen2_moe", "qwen3_moe")


@pytest.mark.parametrize(
    ("family", "expected"),
    [
        ("mixtral", {"expert_width": 32, "norm_topk_prob": True, "qk_norm": "none",
                     "qkv_bias": False, "shared_expert_width": 0, "head_dim": 16}),
        ("olmoe", {"expert_width": 32, "norm_topk_prob": False, "qk_norm": "full",
                   "qkv_bias": False, "shared_expert_width": 0, "head_dim": 16}),
        ("qwen2_moe", {"expert_width": 32, "norm_topk_prob": False, "qk_norm": "none",
                       "qkv_bias": True, "shared_expert_width": 48, "head_dim": 16}),
        ("qwen3_moe", {"expert_width": 32, "norm_topk_prob": True, "qk_norm": "head",
                       "qkv_bias": False, "shared_expert_width": 0, "head_dim": 24}),
    ],
)
def test_family_fields(family, expected, tmp_path):
    cfg = ModelConfig.from_hf(saved_config(family, tmp_path))
    assert cfg.family == family
    assert (cfg.vocab_size, cfg.hidden_size, cfg.n_layers) == (96, 64, 2)
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.n_experts, cfg.top_k) == (4, 2, 8, 2)
    assert cfg.dtype == torch.float32
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.eos_token_ids) == (1, 2, (2,))
    for name, value in expected.items():
        assert getattr(cfg, name) == value, name


def test_hub_spelling_of_older_configs():
    """Published configs spell rope_theta at the top level, torch_dtype, and num_experts."""
    hub = {
        "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
        "moe_intermediate_size": 768, "norm_topk_prob": True, "rope_theta": 1000000.0,
        "rope_scaling": None, "torch_dtype": "bfloat16", "decoder_sparse_step": 1,
        "mlp_only_layers": [], "use_sliding_window": False, "sliding_window": None,
        "eos_token_id": [151645, 151643], "max_position_embeddings": 40960,
    }
    cfg = ModelConfig.from_hf(hub)
    assert (cfg.n_experts, cfg.expert_width, cfg.head_dim) == (128, 768, 128)
    assert cfg.rope_theta == 1e6 and cfg.dtype == torch.bfloat16
    assert cfg.eos_token_ids == (151645, 151643)


def test_transformers5_rope_parameters(tmp_path):
    hf = saved_config("mixtral", tmp_path)
    hf.pop("rope_theta", None)
    hf["rope_parameters"] = {"rope_type": "default", "rope_theta": 12345.0}
    assert ModelConfig.from_hf(hf).rope_theta == 12345.0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "llama"},
         "config.json: model_type 'llama' is not supported; supported: mixtral, olmoe, "
         "qwen2_moe, qwen3_moe"),
        ({"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
        ({"mlp_only_layers": [1]}, "mlp_only_layers=[1]"),
        ({"use_sliding_window": True}, "use_sliding_window true is not supported"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}},
         "rope_parameters has rope_type 'yarn', which is not supported; supported: default"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_type 'linear'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported; supported: silu"),
        ({"dtype": "int8"}, "dtype 'int8' is not supported"),
        ({"moe_intermediate_size": None}, "moe_intermediate_size is missing; it is required"),
        ({"num_key_value_heads": 3}, "num_key_value_heads (3) must divide num_attention_heads (4)"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok (9) must be at most num_experts (8)"),
        ({"hidden_size": 0}, "hidden_size must be an integer in [1, 2147483647], got 0"),
    ],
)
def test_rejections_are_one_line(change, message, tmp_path):
    hf = saved_config("qwen2_moe", tmp_path)
    for key, value in change.items():
        if value is None:
            hf.pop(key)
        else:
            hf[key] = value
    with pytest.raises(CheckpointError) as info:
        ModelConfig.from_hf(hf)
    text = str(info.value)
    assert message in text and "\n" not in text
    assert isinstance(info.value, ValueError)


def test_from_dir_errors(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        ModelConfig.from_dir(tmp_path / "nope")
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not readable JSON"):
        ModelConfig.from_dir(tmp_path)


def test_config_hash_and_frozen(tmp_path):
    hf = saved_config("olmoe", tmp_path)
    a, b = ModelConfig.from_hf(hf), ModelConfig.from_hf(dict(hf))
    assert a == b and a.config_hash() == b.config_hash() and len(a.config_hash()) == 64
    assert dataclasses.replace(a, rope_theta=500.0).config_hash() != a.config_hash()
    assert a.to_json_dict()["dtype"] == "float32"
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.top_k = 3  # type: ignore[misc]


def test_direct_construction_validates():
    base = ModelConfig.from_hf(
        {"model_type": "mixtral", "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 1,
         "num_attention_heads": 2, "num_experts_per_tok": 1, "num_local_experts": 2,
         "intermediate_size": 4}
    )
    assert base.head_dim == 4 and base.n_kv_heads == 2
    with pytest.raises(ValueError, match="qk_norm must be one of"):
        dataclasses.replace(base, qk_norm="layer")
    with pytest.raises(ValueError, match="head_dim must be even"):
        dataclasses.replace(base, head_dim=3)
    with pytest.raises(ValueError, match="sliding_window must be None or >= 1"):
        dataclasses.replace(base, sliding_window=0)
