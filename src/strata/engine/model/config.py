"""The model's shape and options, read from a checkpoint's `config.json`.

One `ModelConfig` describes every supported family; the family's module (in
`strata.engine.model.families`) maps its Hugging Face fields onto it. Fields a family does not have
take the neutral value (no shared expert: `shared_expert_width = 0`; no q/k norm: `qk_norm =
"none"`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from strata.engine.model import families

# The HF `model_type`s this engine runs.
SUPPORTED_FAMILIES: tuple[str, ...] = families.SUPPORTED_FAMILIES

# config.json spells dtypes as torch names without the prefix.
DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
QK_NORMS = ("none", "full", "head")


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message is one line saying what was wrong.

    Raised for a missing or unreadable `config.json` or safetensors file, a missing tensor, a
    shape that disagrees with `config.json`, and an unsupported `model_type`.
    """


def dtype_name(dtype: torch.dtype) -> str:
    for name, candidate in DTYPES.items():
        if candidate == dtype:
            return name
    raise ValueError(f"dtype {dtype} is not supported; supported: {', '.join(DTYPES)}")


@dataclass(frozen=True)
class ModelConfig:
    """The shape and options of one MoE model. Every layer is an MoE layer.

    Dimension letters (used in shape comments across the engine): D `hidden_size`, H `n_heads`,
    G `n_kv_heads`, Dh `head_dim`, E `n_experts`, K `top_k`, F `expert_width`, V `vocab_size`,
    L `n_layers`.
    """

    family: str
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_experts: int
    top_k: int
    expert_width: int
    shared_expert_width: int = 0  # 0: no shared expert (Qwen2-MoE has one, with a sigmoid gate)
    norm_topk_prob: bool = False  # renormalize the top-k routing weights to sum to 1
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    dtype: torch.dtype = torch.bfloat16
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    # "none"; "full": RMSNorm over the whole q and k projections (OLMoE); "head": over each
    # head's Dh (Qwen3-MoE).
    qk_norm: str = "none"
    qkv_bias: bool = False  # biases on q, k and v projections (Qwen2-MoE)
    o_bias: bool = False  # a bias on the output projection
    clip_qkv: float | None = None  # clamp q, k, v to [-clip, clip] (OLMoE option)
    sliding_window: int | None = None  # attend to the last `sliding_window` positions only

    def __post_init__(self) -> None:
        if self.family not in SUPPORTED_FAMILIES:
            raise ValueError(
                f"unsupported model_type {self.family!r}; "
                f"supported: {', '.join(SUPPORTED_FAMILIES)}"
            )
        for name in ("vocab_size", "hidden_size", "n_layers", "n_heads", "n_kv_heads",
                     "head_dim", "n_experts", "top_k", "expert_width", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k ({self.top_k}) must be at most n_experts ({self.n_experts})")
        if self.shared_expert_width < 0:
            raise ValueError(f"shared_expert_width must be >= 0, got {self.shared_expert_width}")
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm must be one of {QK_NORMS}, got {self.qk_norm!r}")
        if self.dtype not in DTYPES.values():
            raise ValueError(f"dtype {self.dtype} is not supported; supported: {', '.join(DTYPES)}")
        if not self.rope_theta > 0 or not self.rms_norm_eps > 0:
            raise ValueError(
                f"rope_theta and rms_norm_eps must be positive, got {self.rope_theta}, "
                f"{self.rms_norm_eps}"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be None or >= 1, got {self.sliding_window}")
        if self.clip_qkv is not None and not self.clip_qkv > 0:
            raise ValueError(f"clip_qkv must be None or positive, got {self.clip_qkv}")

    @property
    def q_width(self) -> int:
        """H * Dh: the width of the query projection."""
        return self.n_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """G * Dh: the width of the key (and value) projection."""
        return self.n_kv_heads * self.head_dim

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The end-of-sequence ids as a tuple (empty when the checkpoint names none)."""
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return self.eos_token_id

    def to_json_dict(self) -> dict[str, Any]:
        """The fields as JSON values (dtype by name, eos ids as a list)."""
        out = dataclasses.asdict(self)
        out["dtype"] = dtype_name(self.dtype)
        if isinstance(self.eos_token_id, tuple):
            out["eos_token_id"] = list(self.eos_token_id)
        return out

    def config_hash(self) -> str:
        """sha256 (hex) of the canonical JSON of the fields: equal configs, equal hashes."""
        canonical = json.dumps(self.to_json_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face `config.json` dict; `CheckpointError` says what was wrong."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_FAMILIES:
            raise CheckpointError(
                f"unsupported model_type {model_type!r} in config.json; "
                f"supported: {', '.join(SUPPORTED_FAMILIES)}"
            )
        try:
            # The family's fields win: OLMoE, for one, sizes its heads its own way.
            fields = _common_fields(hf)
            fields.update(families.family(model_type).config_fields(hf))
            return cls(family=model_type, **fields)
        except (ValueError, TypeError, KeyError) as err:
            if isinstance(err, CheckpointError):
                raise
            raise CheckpointError(f"config.json ({model_type}): {_one_line(err)}") from None

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read `<path>/config.json`."""
        return cls.from_hf(read_config_json(path))


def read_config_json(path: str | Path) -> dict[str, Any]:
    """The parsed `config.json` of a checkpoint directory, or a `CheckpointError`."""
    directory = Path(path)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {str(directory)!r} does not exist")
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"no config.json in {str(directory)!r}")
    try:
        hf = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{config_path} is not readable JSON: {_one_line(err)}") from None
    if not isinstance(hf, dict):
        raise CheckpointError(f"{config_path} must hold a JSON object, got {type(hf).__name__}")
    return hf


def _one_line(err: BaseException) -> str:
    text = str(err.args[0]) if isinstance(err, KeyError) and err.args else str(err)
    if isinstance(err, KeyError):
        text = f"missing field {text!r}"
    return " ".join(text.split())


def _common_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The fields every family spells the same way."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported; supported: silu")
    # Without a dtype field the checkpoint's tensors decide (see Checkpoint.open).
    dtype_key = hf.get("dtype") or hf.get("torch_dtype") or "bfloat16"
    if dtype_key not in DTYPES:
        raise ValueError(f"dtype {dtype_key!r} is not supported; supported: {', '.join(DTYPES)}")
    eos = hf.get("eos_token_id")
    if isinstance(eos, list):
        eos = tuple(int(i) for i in eos)
    return {
        "vocab_size": hf["vocab_size"],
        "hidden_size": hf["hidden_size"],
        "n_layers": hf["num_hidden_layers"],
        "n_heads": hf["num_attention_heads"],
        "n_kv_heads": hf.get("num_key_value_heads") or hf["num_attention_heads"],
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        "top_k": hf["num_experts_per_tok"],
        "rope_theta": float(_rope_theta(hf)),
        "max_position_embeddings": hf.get("max_position_embeddings", 4096),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "dtype": DTYPES[dtype_key],
        "bos_token_id": hf.get("bos_token_id"),
        "eos_token_id": eos,
    }


def _rope_theta(hf: dict[str, Any]) -> float:
    """rope_theta from Transformers 5's `rope_parameters` or the older top-level fields."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    for spec in (params, scaling):
        kind = spec.get("rope_type", spec.get("type", "default"))
        if kind != "default":
            raise ValueError(f"rope_type {kind!r} is not supported; supported: default")
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    return theta
