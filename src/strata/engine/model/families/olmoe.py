"""OLMoE (`model_type: olmoe`): RMSNorm over the whole q and k projections, before RoPE.

Routing weights are renormalized only when `norm_topk_prob` (false for the published model).
"""

from __future__ import annotations

from typing import Any

from strata.engine.model.families._names import attention_names, global_names
from strata.engine.model.families._shape import ModelShape

MODEL_TYPE = "olmoe"
__all__ = ["MODEL_TYPE", "config_fields", "expert_names", "global_names", "layer_names"]


def config_fields(hf: dict[str, Any]) -> dict[str, Any]:
    bias = bool(hf.get("attention_bias", False))
    return {
        "n_experts": hf.get("num_experts", hf.get("num_local_experts")),
        "expert_width": hf["intermediate_size"],
        "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
        "rms_norm_eps": hf.get("rms_norm_eps", 1e-5),
        "qk_norm": "full",
        "qkv_bias": bias,
        "o_bias": bias,
        "clip_qkv": hf.get("clip_qkv"),
        # OLMoE sizes its q/k norms and heads from hidden_size // num_attention_heads.
        "head_dim": hf["hidden_size"] // hf["num_attention_heads"],
    }


def layer_names(cfg: ModelShape, layer: int) -> dict[str, str]:
    names = attention_names(layer)
    names["router"] = f"model.layers.{layer}.mlp.gate.weight"
    return names


def expert_names(layer: int, expert: int) -> tuple[str, str, str]:
    p = f"model.layers.{layer}.mlp.experts.{expert}."
    return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"
