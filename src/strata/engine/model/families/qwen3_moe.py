"""Qwen3-MoE (`model_type: qwen3_moe`): RMSNorm over each head's q and k (weights [Dh]).

An explicit `head_dim` (128 in the published models, not hidden_size / heads); routing weights
renormalized when `norm_topk_prob` (true for the published models); no shared expert.
"""

from __future__ import annotations

from typing import Any

from strata.engine.model.families._fields import Fields, head_dim
from strata.engine.model.families._names import (
    attention_names,
    global_names,
    reject_sliding_window,
    require_every_layer_moe,
)
from strata.engine.model.families._shape import ModelShape

MODEL_TYPE = "qwen3_moe"
__all__ = ["MODEL_TYPE", "config_fields", "expert_names", "global_names", "layer_names"]


def config_fields(fields: Fields) -> dict[str, Any]:
    require_every_layer_moe(fields)
    reject_sliding_window(fields)
    bias = fields.boolean("attention_bias", default=False)
    return {
        "n_experts": fields.integer(fields.first("num_experts", "num_local_experts")),
        "head_dim": head_dim(fields),
        "expert_width": fields.integer("moe_intermediate_size"),
        "norm_topk_prob": fields.boolean("norm_topk_prob", default=False),
        "rms_norm_eps": fields.number("rms_norm_eps", default=1e-6),
        "qk_norm": "head",
        "qkv_bias": bias,
        "o_bias": bias,
    }


def layer_names(cfg: ModelShape, layer: int) -> dict[str, str]:
    names = attention_names(layer)
    names["router"] = f"model.layers.{layer}.mlp.gate.weight"
    return names


def expert_names(layer: int, expert: int) -> tuple[str, str, str]:
    p = f"model.layers.{layer}.mlp.experts.{expert}."
    return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"
