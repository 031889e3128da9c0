"""Tensor names shared by the families that follow the Llama layout (`model.layers.N.…`)."""

from __future__ import annotations

from strata.engine.model.families._fields import Fields
from strata.engine.model.families._shape import ModelShape
from strata.formats.jsonfile import json_repr


def global_names(cfg: ModelShape) -> dict[str, str]:
    return {
        "embed": "model.embed_tokens.weight",
        "final_norm": "model.norm.weight",
        "lm_head": "lm_head.weight",
    }


def attention_names(layer: int) -> dict[str, str]:
    """The attention and norm roles, named as every supported family names them."""
    p = f"model.layers.{layer}."
    return {
        "attn_norm": p + "input_layernorm.weight",
        "mlp_norm": p + "post_attention_layernorm.weight",
        "q": p + "self_attn.q_proj.weight",
        "k": p + "self_attn.k_proj.weight",
        "v": p + "self_attn.v_proj.weight",
        "o": p + "self_attn.o_proj.weight",
        "q_bias": p + "self_attn.q_proj.bias",
        "k_bias": p + "self_attn.k_proj.bias",
        "v_bias": p + "self_attn.v_proj.bias",
        "o_bias": p + "self_attn.o_proj.bias",
        "q_norm": p + "self_attn.q_norm.weight",
        "k_norm": p + "self_attn.k_norm.weight",
    }


def require_every_layer_moe(fields: Fields) -> None:
    """Qwen-style configs can make some layers dense; this engine runs all-MoE models only."""
    step = fields.integer("decoder_sparse_step", default=1)
    dense = fields.hf.get("mlp_only_layers")
    if dense is not None and not isinstance(dense, list):
        raise fields.fail("mlp_only_layers", f"must be a list of layer numbers (empty: every "
                                             f"layer MoE), got {json_repr(dense)}")
    if step != 1 or dense:
        raise fields.fail(
            "decoder_sparse_step" if step != 1 else "mlp_only_layers",
            f"(decoder_sparse_step={step} and mlp_only_layers={json_repr(dense or [])}) makes "
            "some layers dense; supported: decoder_sparse_step=1 and mlp_only_layers=[] (every "
            "layer MoE)",
        )


def reject_sliding_window(fields: Fields) -> None:
    if fields.boolean("use_sliding_window", default=False):
        raise fields.fail("use_sliding_window", "true is not supported; supported: false")
