"""Qwen2-MoE (`model_type: qwen2_moe`): q/k/v biases, and a shared expert beside the routed ones.

The shared expert (width `shared_expert_intermediate_size`) sees every token; its output is
scaled by `sigmoid(shared_expert_gate(x))` and added to the routed experts' sum.
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

MODEL_TYPE = "qwen2_moe"
__all__ = ["MODEL_TYPE", "config_fields", "expert_names", "global_names", "layer_names"]


def config_fields(fields: Fields) -> dict[str, Any]:
    require_every_layer_moe(fields)
    reject_sliding_window(fields)
    return {
        "n_experts": fields.integer(fields.first("num_experts", "num_local_experts")),
        "head_dim": head_dim(fields),
        "expert_width": fields.integer("moe_intermediate_size"),
        "shared_expert_width": fields.integer("shared_expert_intermediate_size", low=0),
        "norm_topk_prob": fields.boolean("norm_topk_prob", default=False),
        "rms_norm_eps": fields.number("rms_norm_eps", default=1e-6),
        # Published Qwen1.5/Qwen2 MoE configs have no qkv_bias field: the bias is always there.
        "qkv_bias": fields.boolean("qkv_bias", default=True),
    }


def layer_names(cfg: ModelShape, layer: int) -> dict[str, str]:
    p = f"model.layers.{layer}.mlp."
    names = attention_names(layer)
    names.update(
        router=p + "gate.weight",
        shared_gate=p + "shared_expert.gate_proj.weight",
        shared_up=p + "shared_expert.up_proj.weight",
        shared_down=p + "shared_expert.down_proj.weight",
        shared_router=p + "shared_expert_gate.weight",
    )
    return names


def expert_names(layer: int, expert: int) -> tuple[str, str, str]:
    p = f"model.layers.{layer}.mlp.experts.{expert}."
    return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"
