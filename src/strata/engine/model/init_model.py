"""Complete checkpoints with random weights, named exactly as each family's published ones.

`write_checkpoint` writes what a Hugging Face MoE checkpoint holds: `config.json` with the family's
fields and `model_type`, `generation_config.json`, safetensors shards (plus
`model.safetensors.index.json` when there is more than one), and a byte-level `tokenizer.json`
with its `tokenizer_config.json` (a ChatML chat template). So tests, benchmarks and a newcomer's
first run all go through the loader that reads real checkpoints.

The bytes are a function of (family, preset, layers, seed, dtype, shard size) alone: each tensor
is drawn on the CPU from a torch.Generator seeded by a hash of the seed and the tensor's name, so
`n_layers` shortening a preset leaves every tensor it keeps unchanged.

Weights are scaled so activations stay near unit size at any width: linear weights (out, in) have
std in**-0.5, the embedding std 1, norm weights 1 + N(0, 0.1²), biases N(0, 0.1²).

Routing: with such weights every expert is about equally likely, unlike a trained model's, whose
routing favours some experts in each layer (which is what makes a cache's choices matter).
`router_skew` a > 0 scales row e of each router by (r_e + 1)^-a, r a permutation of the
experts drawn per layer (so each layer favours others), normalized to a mean square of 1: a
larger row gives larger logits, so its expert is routed more often. On isotropic inputs a = 0.5
sends 72% of the routing of a 128-expert top-8 layer to the top quarter of its experts (52% of
a 64-expert one); `strata profile` measures what a model actually does. The value is written
into config.json as `strata_router_skew`; at 0 (the default) nothing changes.

Legend: L layers, D hidden size, H query heads, G kv heads, Dh head dim, E experts per layer,
F expert width, S shared expert width, V vocabulary.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from strata.engine.model.presets import (
    BYTE_TOKENS,
    DEFAULT_MAX_SHARD_BYTES,
    FAMILIES,
    PRESETS,
    SPECIAL_TOKENS,
    Preset,
    get_preset,
)
from strata.engine.model.tokenizer import byte_level_tokenizer_config, byte_level_tokenizer_json

ARCHITECTURES = {
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}

DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}

# The specials of the byte-level tokenizer (strata.engine.model.presets.SPECIAL_TOKENS).
ENDOFTEXT_ID = BYTE_TOKENS + SPECIAL_TOKENS.index("<|endoftext|>")
IM_END_ID = BYTE_TOKENS + SPECIAL_TOKENS.index("<|im_end|>")
PAD_ID = BYTE_TOKENS + SPECIAL_TOKENS.index("<|pad|>")



@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a checkpoint: its published name, shape, and how it is drawn."""

    name: str
    shape: tuple[int, ...]
    # "linear" (std in**-0.5), "router" (linear, rows scaled by the skew), "embedding" (std 1),
    # "norm" (1 + 0.1 N), "bias" (0.1 N)
    init: str


def check_family(family: str, preset: Preset) -> None:
    """ValueError unless `family` is known and can carry `preset`'s shape."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of: {', '.join(FAMILIES)}")
    if family == "olmoe" and preset.n_heads * preset.head_dim != preset.hidden_size:
        # OLMoE normalises q over the whole hidden size, so its q width must be D.
        raise ValueError(
            f"family olmoe needs n_heads * head_dim == hidden_size, and preset {preset.name!r} "
            f"has {preset.n_heads} * {preset.head_dim} != {preset.hidden_size}; "
            f"use family qwen3_moe or mixtral for this shape"
        )


def hf_config(family: str, preset: Preset, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """config.json of a `family` checkpoint of `preset`'s shape, fields as published."""
    check_family(family, preset)
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {list(DTYPE_NAMES.values())}, got {dtype}")
    p = preset
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[family]],
        "model_type": family,
        "vocab_size": p.vocab_size,
        "hidden_size": p.hidden_size,
        "num_hidden_layers": p.n_layers,
        "num_attention_heads": p.n_heads,
        "num_key_value_heads": p.n_kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": p.max_position_embeddings,
        "initializer_range": 0.02,
        "rms_norm_eps": p.rms_norm_eps,
        "rope_theta": p.rope_theta,
        "rope_scaling": None,
        "attention_dropout": 0.0,
        "num_experts_per_tok": p.top_k,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": ENDOFTEXT_ID,
        "eos_token_id": ENDOFTEXT_ID,
        "pad_token_id": PAD_ID,
        "torch_dtype": DTYPE_NAMES[dtype],
    }
    if family == "mixtral":
        config.update(
            intermediate_size=p.expert_width,
            num_local_experts=p.n_experts,
            sliding_window=None,
            router_jitter_noise=0.0,
        )
    elif family == "olmoe":
        config.update(
            intermediate_size=p.expert_width,
            num_experts=p.n_experts,
            norm_topk_prob=p.norm_topk_prob,
            attention_bias=False,
            clip_qkv=None,
            router_aux_loss_coef=0.01,
        )
    else:  # qwen2_moe, qwen3_moe: every layer sparse, no sliding window
        config.update(
            intermediate_size=p.shared_expert_width,
            moe_intermediate_size=p.expert_width,
            num_experts=p.n_experts,
            norm_topk_prob=p.norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=p.n_layers,
        )
        if family == "qwen2_moe":
            config["shared_expert_intermediate_size"] = p.shared_expert_width
        else:
            config["attention_bias"] = False
    # head_dim defaults to D / H; the published Qwen3 configs always state it.
    if family == "qwen3_moe" or p.head_dim * p.n_heads != p.hidden_size:
        config["head_dim"] = p.head_dim
    return dict(sorted(config.items()))


def tensor_specs(family: str, preset: Preset) -> list[TensorSpec]:
    """Every tensor of a `family` checkpoint of `preset`'s shape, in file order."""
    check_family(family, preset)
    p = preset
    D, Dh, F, S, E, V = (
        p.hidden_size,
        p.head_dim,
        p.expert_width,
        p.shared_expert_width,
        p.n_experts,
        p.vocab_size,
    )
    q_width, kv_width = p.n_heads * Dh, p.n_kv_heads * Dh
    specs = [TensorSpec("model.embed_tokens.weight", (V, D), "embedding")]
    for layer in range(p.n_layers):
        pre = f"model.layers.{layer}"
        specs.append(TensorSpec(f"{pre}.input_layernorm.weight", (D,), "norm"))
        for proj, width in (("q_proj", q_width), ("k_proj", kv_width), ("v_proj", kv_width)):
            specs.append(TensorSpec(f"{pre}.self_attn.{proj}.weight", (width, D), "linear"))
            if family == "qwen2_moe":
                specs.append(TensorSpec(f"{pre}.self_attn.{proj}.bias", (width,), "bias"))
        specs.append(TensorSpec(f"{pre}.self_attn.o_proj.weight", (D, q_width), "linear"))
        if family == "qwen3_moe":  # RMSNorm over each head's Dh
            specs.append(TensorSpec(f"{pre}.self_attn.q_norm.weight", (Dh,), "norm"))
            specs.append(TensorSpec(f"{pre}.self_attn.k_norm.weight", (Dh,), "norm"))
        elif family == "olmoe":  # RMSNorm over the whole projection
            specs.append(TensorSpec(f"{pre}.self_attn.q_norm.weight", (q_width,), "norm"))
            specs.append(TensorSpec(f"{pre}.self_attn.k_norm.weight", (kv_width,), "norm"))
        specs.append(TensorSpec(f"{pre}.post_attention_layernorm.weight", (D,), "norm"))
        if family == "mixtral":
            moe = f"{pre}.block_sparse_moe"
            expert_names = (("w1", (F, D)), ("w3", (F, D)), ("w2", (D, F)))  # gate, up, down
        else:
            moe = f"{pre}.mlp"
            expert_names = (("gate_proj", (F, D)), ("up_proj", (F, D)), ("down_proj", (D, F)))
        specs.append(TensorSpec(f"{moe}.gate.weight", (E, D), "router"))  # [E, D]
        for expert in range(E):
            for proj, shape in expert_names:
                specs.append(TensorSpec(f"{moe}.experts.{expert}.{proj}.weight", shape, "linear"))
        if family == "qwen2_moe":
            for proj, shape in (("gate_proj", (S, D)), ("up_proj", (S, D)), ("down_proj", (D, S))):
                specs.append(TensorSpec(f"{moe}.shared_expert.{proj}.weight", shape, "linear"))
            specs.append(TensorSpec(f"{moe}.shared_expert_gate.weight", (1, D), "linear"))
    specs.append(TensorSpec("model.norm.weight", (D,), "norm"))
    specs.append(TensorSpec("lm_head.weight", (V, D), "linear"))
    return specs


def tensor_seed(seed: int, name: str) -> int:
    """The generator seed of tensor `name`: a hash, so it depends on nothing else."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def router_row_scale(n_experts: int, skew: float, generator: torch.Generator) -> torch.Tensor:
    """[E] float32: (r_e + 1)^-skew for a random permutation r, with a mean square of 1."""
    rank = torch.randperm(n_experts, generator=generator).to(torch.float32)
    scale = (rank + 1.0) ** -skew
    return scale / scale.square().mean().sqrt()


def random_tensor(
    spec: TensorSpec, seed: int, dtype: torch.dtype, router_skew: float = 0.0
) -> torch.Tensor:
    """The tensor of `spec` for `seed`: drawn in float32 on the CPU, then cast to `dtype`; a
    router's rows scaled by `router_row_scale` when `router_skew` > 0."""
    generator = torch.Generator(device="cpu").manual_seed(tensor_seed(seed, spec.name))
    values = torch.randn(spec.shape, generator=generator, dtype=torch.float32)
    if spec.init in ("linear", "router"):
        values.mul_(spec.shape[-1] ** -0.5)
        if spec.init == "router" and router_skew > 0:
            values.mul_(router_row_scale(spec.shape[0], router_skew, generator).unsqueeze(1))
    elif spec.init == "norm":
        values.mul_(0.1).add_(1.0)
    elif spec.init == "bias":
        values.mul_(0.1)
    return values.to(dtype)


def _shards(specs: list[TensorSpec], itemsize: int, max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Consecutive groups of at most `max_shard_bytes` (a larger tensor gets a shard alone)."""
    shards: list[list[TensorSpec]] = [[]]
    shard_bytes = 0
    for spec in specs:
        nbytes = itemsize * _numel(spec.shape)
        if shards[-1] and shard_bytes + nbytes > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(spec)
        shard_bytes += nbytes
    return shards


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _write_json(path: Path, document: dict[str, Any]) -> None:
    path.write_text(json.dumps(document, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def checkpoint_bytes(family: str, preset: Preset, dtype: torch.dtype = torch.bfloat16) -> int:
    """The size of the weights `write_checkpoint` writes, in bytes."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return sum(itemsize * _numel(spec.shape) for spec in tensor_specs(family, preset))


def write_checkpoint(
    out_dir: str | os.PathLike[str],
    family: str,
    preset: str | Preset,
    *,
    n_layers: int | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: bool = False,
    router_skew: float = 0.0,
) -> Path:
    """Write a complete random checkpoint into `out_dir` (absent or empty) and return its path.

    `preset` is a name from `strata.engine.model.presets.PRESETS` or a `Preset`; `n_layers` shortens
    it. `progress` shows a tqdm bar over the tensors (for the big presets). `router_skew` >= 0
    makes routing favour some experts in each layer (see the module).
    """
    shape = get_preset(preset) if isinstance(preset, str) else preset
    if n_layers is not None:
        shape = shape.with_layers(n_layers)
    config = hf_config(family, shape, dtype)  # validates family, shape and dtype
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    if isinstance(router_skew, bool) or not isinstance(router_skew, int | float) \
            or not math.isfinite(router_skew) or router_skew < 0:
        raise ValueError(f"router_skew must be a finite number >= 0, got {router_skew!r}")
    if router_skew > 0:
        config = dict(sorted({**config, "strata_router_skew": float(router_skew)}.items()))
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not an empty directory; choose a new one")
    specs = tensor_specs(family, shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards = _shards(specs, itemsize, max_shard_bytes)
    if len(shards) == 1:
        files = ["model.safetensors"]
    else:
        files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]

    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": ENDOFTEXT_ID,
            "eos_token_id": [ENDOFTEXT_ID, IM_END_ID],  # end of text, end of a chat turn
            "pad_token_id": PAD_ID,
        },
    )
    (out / "tokenizer.json").write_text(byte_level_tokenizer_json(), encoding="utf-8")
    _write_json(
        out / "tokenizer_config.json",
        byte_level_tokenizer_config(model_max_length=shape.max_position_embeddings),
    )

    bar = tqdm(
        total=len(specs), desc=f"init-model {shape.name}", unit="tensor", disable=not progress
    )
    weight_map: dict[str, str] = {}
    try:
        for file_name, shard in zip(files, shards, strict=True):
            tensors = {}
            for spec in shard:
                tensors[spec.name] = random_tensor(spec, seed, dtype, router_skew)
                weight_map[spec.name] = file_name
                bar.update(1)
            save_file(tensors, str(out / file_name), metadata={"format": "pt"})
            del tensors
    finally:
        bar.close()
    if len(files) > 1:
        total_size = itemsize * sum(_numel(spec.shape) for spec in specs)
        weight_map = dict(sorted(weight_map.items()))
        index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
        _write_json(out / "model.safetensors.index.json", index)
    return out


def write_checkpoint_atomic(out_dir: str | os.PathLike[str], *args: Any, **kwargs: Any) -> Path:
    """`write_checkpoint` into a temporary sibling of `out_dir`, then one rename: an interrupted
    write leaves no `out_dir` at all, never a half-written one. Same arguments."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not an empty directory; choose a new one")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        write_checkpoint(staging, *args, **kwargs)
        os.replace(staging, out)  # onto an absent or empty directory: atomic on POSIX
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already after a successful rename
    return out


def iter_presets_and_families() -> Iterator[tuple[str, str]]:
    """Every (family, preset name) pair that `write_checkpoint` accepts."""
    for family in FAMILIES:
        for name, preset in PRESETS.items():
            try:
                check_family(family, preset)
            except ValueError:
                continue
            yield family, name
