"""Mixtral (`model_type: mixtral`): plain GQA attention, top-k routing always renormalized.

Experts are `block_sparse_moe.experts.N.w1` (gate), `w3` (up) and `w2` (down), as published.
"""

from __future__ import annotations

from typing import Any

from strata.engine.model.families._fields import Fields, head_dim
from strata.engine.model.families._names import attention_names, global_names
from strata.engine.model.families._shape import ModelShape

MODEL_TYPE = "mixtral"
__all__ = ["MODEL_TYPE", "config_fields", "expert_names", "global_names", "layer_names"]


def config_fields(fields: Fields) -> dict[str, Any]:
    return {
        "n_experts": fields.integer(fields.first("num_local_experts", "num_experts")),
        "head_dim": head_dim(fields),
        "expert_width": fields.integer("intermediate_size"),
        "norm_topk_prob": True,
        "rms_norm_eps": fields.number("rms_norm_eps", default=1e-5),
        "sliding_window": fields.integer("sliding_window", default=None, optional=True),
    }


def layer_names(cfg: ModelShape, layer: int) -> dict[str, str]:
    names = attention_names(layer)
    names["router"] = f"model.layers.{layer}.block_sparse_moe.gate.weight"
    return names


def expert_names(layer: int, expert: int) -> tuple[str, str, str]:
    p = f"model.layers.{layer}.block_sparse_moe.experts.{expert}."
    return p + "w1.weight", p + "w3.weight", p + "w2.weight"
