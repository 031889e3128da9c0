"""Model shapes for `strata init-model`: two toy sizes and copies of two published MoE models.

A preset is only a shape (layers, experts, top-k, widths, heads, vocabulary, RoPE and norm
constants). The family (`mixtral`, `qwen2_moe`, `qwen3_moe`, `olmoe`) decides the tensor names and
config fields a checkpoint carries; see `strata.engine.model.init_model`. The two real presets copy
the published configs, so that speed and memory figures measured on random weights are realistic:

| preset | L | D | H | G | Dh | E | K | F | V |
| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |
| tiny | 2 | 64 | 4 | 2 | 16 | 8 | 2 | 128 | 260 |
| small | 4 | 256 | 8 | 4 | 32 | 16 | 4 | 256 | 260 |
| olmoe-1b-7b | 16 | 2048 | 16 | 16 | 128 | 64 | 8 | 1024 | 50304 |
| qwen3-30b-a3b | 48 | 2048 | 32 | 4 | 128 | 128 | 8 | 768 | 151936 |

(L layers, D hidden size, H query heads, G kv heads, Dh head dim, E experts per layer, K experts
per token, F expert width, V vocabulary.)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# The random checkpoints' tokenizer: the 256 bytes, then these specials, in this order.
BYTE_TOKENS = 256
SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")
BYTE_LEVEL_VOCAB = BYTE_TOKENS + len(SPECIAL_TOKENS)


# The families `init-model` writes tensor names and config fields for.
FAMILIES: tuple[str, ...] = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
# The largest safetensors shard `init-model` writes.
DEFAULT_MAX_SHARD_BYTES = 4 * 1024**3


@dataclass(frozen=True)
class Preset:
    """The shape of a MoE model, independent of the family that names its tensors.

    `shared_expert_width` is used only by the `qwen2_moe` family, the one whose published
    checkpoints carry a shared expert (its width is also what the Qwen configs carry as the
    dense `intermediate_size`). `norm_topk_prob` says whether the top-k routing weights are
    renormalised to sum to 1; Mixtral always renormalises, whatever the preset says.
    """

    name: str
    default_family: str  # the family `strata init-model` uses when none is given
    n_layers: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_experts: int
    top_k: int
    expert_width: int
    vocab_size: int
    shared_expert_width: int
    norm_topk_prob: bool
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int

    def __post_init__(self) -> None:
        for field in (
            "n_layers",
            "hidden_size",
            "n_heads",
            "n_kv_heads",
            "head_dim",
            "n_experts",
            "top_k",
            "expert_width",
            "vocab_size",
            "shared_expert_width",
            "max_position_embeddings",
        ):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(
                    f"preset {self.name!r}: {field} must be a positive int, got {value!r}"
                )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"preset {self.name!r}: n_heads ({self.n_heads}) must be a multiple of "
                f"n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"preset {self.name!r}: head_dim must be even for RoPE, got {self.head_dim}"
            )
        if self.top_k > self.n_experts:
            raise ValueError(
                f"preset {self.name!r}: top_k ({self.top_k}) must be at most n_experts "
                f"({self.n_experts})"
            )
        if self.vocab_size < BYTE_LEVEL_VOCAB:
            raise ValueError(
                f"preset {self.name!r}: vocab_size must be at least {BYTE_LEVEL_VOCAB} (the "
                f"byte-level tokenizer's), got {self.vocab_size}"
            )
        if not (self.rope_theta > 0 and self.rms_norm_eps > 0):
            raise ValueError(f"preset {self.name!r}: rope_theta and rms_norm_eps must be > 0")

    def with_layers(self, n_layers: int) -> Preset:
        """The same shape with `n_layers` layers (at most the preset's own: it only shortens)."""
        if not isinstance(n_layers, int) or isinstance(n_layers, bool) or n_layers < 1:
            raise ValueError(f"n_layers must be a positive int, got {n_layers!r}")
        if n_layers > self.n_layers:
            raise ValueError(
                f"n_layers {n_layers} exceeds preset {self.name!r}'s {self.n_layers} layers; "
                f"--layers only shortens a preset"
            )
        return dataclasses.replace(self, n_layers=n_layers)


PRESETS: dict[str, Preset] = {
    preset.name: preset
    for preset in (
        Preset(
            name="tiny",
            default_family="qwen3_moe",
            n_layers=2,
            hidden_size=64,
            n_heads=4,
            n_kv_heads=2,
            head_dim=16,
            n_experts=8,
            top_k=2,
            expert_width=128,
            vocab_size=BYTE_LEVEL_VOCAB,
            shared_expert_width=256,
            norm_topk_prob=False,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
            max_position_embeddings=4096,
        ),
        Preset(
            name="small",
            default_family="qwen3_moe",
            n_layers=4,
            hidden_size=256,
            n_heads=8,
            n_kv_heads=4,
            head_dim=32,
            n_experts=16,
            top_k=4,
            expert_width=256,
            vocab_size=BYTE_LEVEL_VOCAB,
            shared_expert_width=1024,
            norm_topk_prob=True,
            rope_theta=10000.0,
            rms_norm_eps=1e-6,
            max_position_embeddings=4096,
        ),
        # allenai/OLMoE-1B-7B-0924, config.json.
        Preset(
            name="olmoe-1b-7b",
            default_family="olmoe",
            n_layers=16,
            hidden_size=2048,
            n_heads=16,
            n_kv_heads=16,
            head_dim=128,
            n_experts=64,
            top_k=8,
            expert_width=1024,
            vocab_size=50304,
            shared_expert_width=4096,
            norm_topk_prob=False,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
            max_position_embeddings=4096,
        ),
        # Qwen/Qwen3-30B-A3B, config.json (its dense intermediate_size is 6144).
        Preset(
            name="qwen3-30b-a3b",
            default_family="qwen3_moe",
            n_layers=48,
            hidden_size=2048,
            n_heads=32,
            n_kv_heads=4,
            head_dim=128,
            n_experts=128,
            top_k=8,
            expert_width=768,
            vocab_size=151936,
            shared_expert_width=6144,
            norm_topk_prob=True,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            max_position_embeddings=40960,
        ),
        # mistralai/Mixtral-8x7B-v0.1, config.json: few wide experts (no shared expert; the
        # width below is what a qwen2_moe checkpoint of this shape would give it).
        Preset(
            name="mixtral-8x7b",
            default_family="mixtral",
            n_layers=32,
            hidden_size=4096,
            n_heads=32,
            n_kv_heads=8,
            head_dim=128,
            n_experts=8,
            top_k=2,
            expert_width=14336,
            vocab_size=32000,
            shared_expert_width=14336,
            norm_topk_prob=True,
            rope_theta=1000000.0,
            rms_norm_eps=1e-5,
            max_position_embeddings=32768,
        ),
    )
}


def get_preset(name: str) -> Preset:
    """The preset called `name`; a ValueError listing the known ones otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}"
        ) from None
