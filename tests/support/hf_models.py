"""Tiny random Hugging Face models of each supported family, saved with `save_pretrained`.

    from support.hf_models import hf_checkpoint

    path, hf_model = hf_checkpoint(tmp_path / "olmoe", "olmoe")

The weights are random but spread wider than Transformers' default init (std 0.02), so router
probabilities and logits are far from ties: a 1e-7 difference between two implementations must
not flip a top-k choice or a greedy token. Transformers 5 keeps experts fused in memory
(`experts.gate_up_proj`) but `save_pretrained` writes the published per-expert names
(`...experts.0.gate_proj.weight`, Mixtral's `block_sparse_moe.experts.0.w1.weight`);
`hf_checkpoint` checks that it did, so the loader is tested against the real on-disk layout.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch

FAMILIES = ("mixtral", "olmoe", "qwen2_moe", "qwen3_moe")

# Shared by every family: 2 layers, hidden 64, 4 heads over 2 kv heads, 8 experts, top 2.
BASE: dict[str, Any] = {
    "vocab_size": 96,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


def hf_config(family: str, **overrides: Any):
    """A Transformers config of `family` with the tiny shape above (overrides win)."""
    import transformers

    if family == "mixtral":
        fields = {"num_local_experts": 8, "intermediate_size": 32, "rope_theta": 10000.0}
        cls = transformers.MixtralConfig
    elif family == "olmoe":
        fields = {"num_experts": 8, "intermediate_size": 32, "norm_topk_prob": False}
        cls = transformers.OlmoeConfig
    elif family == "qwen2_moe":
        fields = {
            "num_experts": 8,
            "moe_intermediate_size": 32,
            "intermediate_size": 48,
            "shared_expert_intermediate_size": 48,
            "norm_topk_prob": False,
        }
        cls = transformers.Qwen2MoeConfig
    elif family == "qwen3_moe":
        # head_dim 24 != hidden / heads (16): the explicit head_dim must be honoured.
        fields = {
            "num_experts": 8,
            "moe_intermediate_size": 32,
            "intermediate_size": 48,
            "head_dim": 24,
            "norm_topk_prob": True,
        }
        cls = transformers.Qwen3MoeConfig
    else:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
    fields = {**BASE, **fields, **overrides}
    return cls(**fields)


def random_hf_model(family: str, *, seed: int = 0, std: float = 0.25, **overrides: Any):
    """A float32 Transformers model of `family` with N(0, std) weights and unit-ish norms."""
    import transformers

    config = hf_config(family, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight") or "layernorm" in name:
                # Norm weights near 1, not exactly 1, so a norm applied to the wrong axis shows.
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(std * torch.randn(param.shape, generator=generator))
    model.eval()
    # Greedy runs compare a fixed number of tokens: Transformers' generate must not stop at eos.
    model.generation_config.eos_token_id = None
    return model


def hf_checkpoint(out_dir: str | Path, family: str, *, seed: int = 0, **overrides: Any):
    """`save_pretrained` a random model of `family` to `out_dir`; return (path, model)."""
    from safetensors import safe_open

    model = random_hf_model(family, seed=seed, **overrides)
    out = Path(out_dir)
    model.save_pretrained(out)
    names: set[str] = set()
    for file in out.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as handle:
            names.update(handle.keys())
    expert0 = {
        "mixtral": "model.layers.0.block_sparse_moe.experts.0.w1.weight",
    }.get(family, "model.layers.0.mlp.experts.0.gate_proj.weight")
    if expert0 not in names or any("gate_up_proj" in name for name in names):
        raise AssertionError(
            f"save_pretrained did not write the published per-expert names for {family}"
        )
    return out, model


def hf_new_cache(model):
    """An empty Transformers K/V cache for `model` (4.x and 5.x constructors)."""
    import transformers

    try:
        return transformers.DynamicCache(config=model.config)
    except TypeError:
        return transformers.DynamicCache()


def hf_logits(model, token_ids: list[int], cache) -> torch.Tensor:
    """Logits [T, V] of one forward over `token_ids`, extending `cache` in place.

    Transformers 5 renamed forward's `past_key_values` to `cache`; use whichever it takes.
    """
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        out = model(torch.tensor([token_ids]), use_cache=True, **{name: cache})
    return out.logits[0]
