"""OLMoE (`model_type: olmoe`): RMSNorm over the whole q and k projections, before RoPE.

Routing weights are renormalized only when `norm_topk_prob` (false for the published model).
"""

from __future__ import annotations

from typing import Any

from strata.engine.model.families._fields import Fields, head_dim
from strata.engine.model.families._names import attention_names, global_names
from strata.engine.model.families._shape import ModelShape

MODEL_TYPE = "olmoe"
__all__ = ["MODEL_TYPE", "config_fields", "expert_names", "global_names", "layer_names"]


def config_fields(fields: Fields) -> dict[str, Any]:
    bias = fields.boolean("attention_bias", default=False)
    return {
        "n_experts": fields.integer(fields.first("num_experts", "num_local_experts")),
        "expert_width": fields.integer("intermediate_size"),
        "norm_topk_prob": fields.boolean("norm_topk_prob", default=False),
        "rms_norm_eps": fields.number("rms_norm_eps", default=1e-5),
        "qk_norm": "full",
        "qkv_bias": bias,
        "o_bias": bias,
        "clip_qkv": fields.number("clip_qkv", default=None, optional=True),
        # OLMoE sizes its q/k norms and heads from hidden_size // num_attention_heads.
        "head_dim": head_dim(fields, explicit=False),
    }


def layer_names(cfg: ModelShape, layer: int) -> dict[str, str]:
    names = attention_names(layer)
    names["router"] = f"model.layers.{layer}.mlp.gate.weight"
    return names


def expert_names(layer: int, expert: int) -> tuple[str, str, str]:
    p = f"model.layers.{layer}.mlp.experts.{expert}."
    return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"
