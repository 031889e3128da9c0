"""Random JSON in every config field each family reads: a config, or a CheckpointError naming
the field (issue 18), never another exception.

The base configs are the tiny checkpoints' (what `strata init-model --preset tiny` writes);
each example replaces one field with any JSON value (nested, huge, NaN, of any type) or
removes it, and `ModelConfig.from_hf` must either accept it (the value is valid, or its
default applies) or refuse it with one line that names the field.
"""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strata.engine.model.config import CheckpointError, ModelConfig
from support.checkpoints import cached_checkpoint

COMMON = ("model_type", "hidden_act", "torch_dtype", "dtype", "vocab_size", "hidden_size",
          "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
          "num_experts_per_tok", "rope_theta", "rope_scaling", "rope_parameters",
          "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id")
FAMILY = {
    "mixtral": ("num_local_experts", "num_experts", "intermediate_size", "rms_norm_eps",
                "sliding_window", "head_dim"),
    "olmoe": ("num_experts", "num_local_experts", "intermediate_size", "norm_topk_prob",
              "rms_norm_eps", "attention_bias", "clip_qkv"),
    "qwen2_moe": ("num_experts", "moe_intermediate_size", "shared_expert_intermediate_size",
                  "norm_topk_prob", "rms_norm_eps", "qkv_bias", "decoder_sparse_step",
                  "mlp_only_layers", "use_sliding_window", "head_dim"),
    "qwen3_moe": ("num_experts", "moe_intermediate_size", "norm_topk_prob", "rms_norm_eps",
                  "attention_bias", "decoder_sparse_step", "mlp_only_layers",
                  "use_sliding_window", "head_dim"),
}
# What a field's message may name instead of it: the fields it is checked against.
RELATED = {
    "vocab_size": ("eos_token_id", "bos_token_id"),
    "hidden_size": ("num_attention_heads",),
    "num_attention_heads": ("num_key_value_heads",),
    "num_experts": ("num_experts_per_tok", "num_hidden_layers"),
    "num_local_experts": ("num_experts_per_tok", "num_hidden_layers"),
    "num_hidden_layers": (),
}

SCALARS = (st.none() | st.booleans() | st.integers() | st.integers(-(2**70), 2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12)
           | st.sampled_from(["silu", "bfloat16", "float32", "default", "qwen3_moe", "mixtral"]))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=8) | st.sampled_from(
                        ["rope_type", "type", "rope_theta", "content"]), inner, max_size=4),
                    max_leaves=12)
ABSENT = object()


def base_config(family: str) -> dict:
    return json.loads((cached_checkpoint(family, "tiny") / "config.json").read_text())


def check_one(family: str, name: str, value: object) -> None:
    hf = base_config(family)
    if value is ABSENT:
        hf.pop(name, None)
    else:
        hf[name] = value
    # Another supported model_type reads the config as that family's: its own fields are
    # then the ones missing or wrong.
    other_family = name == "model_type" and isinstance(value, str) and value in FAMILY \
        and value != family
    try:
        config = ModelConfig.from_hf(hf)
    except CheckpointError as err:
        text = str(err)
        assert "\n" not in text and text.startswith("config.json: ")
        if other_family:
            return
        named = (name, *RELATED.get(name, ()))
        assert any(candidate in text for candidate in named), (name, value, text)
        return
    assert config.family == (value if other_family else family)
    assert math.isfinite(config.rope_theta) and math.isfinite(config.rms_norm_eps)


@pytest.mark.parametrize("family", sorted(FAMILY))
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_json_in_a_field_is_a_config_or_an_error_naming_it(family, data):
    name = data.draw(st.sampled_from(COMMON + FAMILY[family]), label="field")
    value = data.draw(JSON | st.just(ABSENT), label="value")
    check_one(family, name, value)


@pytest.mark.parametrize("family", sorted(FAMILY))
def test_extremes_of_every_field(family):
    extremes = [None, ABSENT, True, 0, -1, 2**31, 10**5000, math.nan, math.inf, -0.0, 1.5,
                "", "1", [], [1], {}, {"rope_type": "yarn"}, [[[[[]]]]]]
    for name in COMMON + FAMILY[family]:
        for value in extremes:
            check_one(family, name, value)
