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
from strata.engine.model.errors import CheckpointError
from strata.engine.model.families._fields import INT_MAX, FieldError, Fields
from strata.engine.model.weight_files import check_tensors, weight_files
from strata.formats.jsonfile import json_repr, json_type, read_json_object

__all__ = ["DTYPES", "QK_NORMS", "SUPPORTED_FAMILIES", "CheckpointError", "ModelConfig",
           "dtype_name", "read_config_json"]

# The HF `model_type`s this engine runs.
SUPPORTED_FAMILIES: tuple[str, ...] = families.SUPPORTED_FAMILIES

# config.json spells dtypes as torch names without the prefix.
DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
QK_NORMS = ("none", "full", "head")


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
    def from_hf(cls, hf: dict[str, Any], *, source: str = "config.json") -> ModelConfig:
        """Build from a Hugging Face `config.json` dict, every field the family reads checked
        for type and range first; `CheckpointError` names `source` and the field."""
        if not isinstance(hf, dict):
            raise CheckpointError(f"{source} must hold a JSON object, got {json_type(hf)}")
        fields = Fields(hf)
        try:
            model_type = fields.text("model_type", choices=SUPPORTED_FAMILIES)
            # The family's fields win: OLMoE, for one, sizes its heads its own way.
            values = _common_fields(fields)
            values.update(families.family(model_type).config_fields(fields))
            _check_together(fields, values)
        except FieldError as err:
            raise CheckpointError(f"{source}: {err}") from None
        return cls(family=model_type, **values)

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read `<path>/config.json`, and check it against the weights files there: every
        tensor it implies, by name, shape and dtype, from the files' headers (no weight is
        read), so that nothing is sized from a config its weights do not bear out."""
        directory = Path(path)
        config = cls.from_hf(read_config_json(directory), source=str(directory / "config.json"))
        check_tensors(config, weight_files(directory))
        return config


def read_config_json(path: str | Path) -> dict[str, Any]:
    """The parsed `config.json` of a checkpoint directory, or a `CheckpointError`."""
    directory = Path(path)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {str(directory)!r} does not exist")
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"no config.json in {str(directory)!r}")
    return read_json_object(config_path, what="config.json", error=CheckpointError)


def _common_fields(fields: Fields) -> dict[str, Any]:
    """The fields every family spells the same way."""
    fields.text("hidden_act", choices=("silu",), default="silu")
    # Without a dtype field the checkpoint's tensors decide (see Checkpoint.open).
    dtype_key = fields.text(fields.first("dtype", "torch_dtype"), choices=DTYPES,
                            default="bfloat16", optional=True)
    vocab_size = fields.integer("vocab_size")
    heads = fields.integer("num_attention_heads")
    kv_heads = fields.integer("num_key_value_heads", default=heads, optional=True)
    if heads % kv_heads:
        raise fields.fail("num_key_value_heads",
                          f"({kv_heads}) must divide num_attention_heads ({heads})")
    return {
        "vocab_size": vocab_size,
        "hidden_size": fields.integer("hidden_size"),
        "n_layers": fields.integer("num_hidden_layers"),
        "n_heads": heads,
        "n_kv_heads": kv_heads,
        "top_k": fields.integer("num_experts_per_tok"),
        "rope_theta": _rope_theta(fields),
        "max_position_embeddings": fields.integer("max_position_embeddings", default=4096),
        "tie_word_embeddings": fields.boolean("tie_word_embeddings", default=False),
        "dtype": DTYPES[dtype_key],
        "bos_token_id": fields.integer("bos_token_id", low=0, high=vocab_size - 1, default=None,
                                       optional=True, bound=" (below vocab_size)"),
        "eos_token_id": fields.token_ids("eos_token_id", vocab_size),
    }


def _rope_theta(fields: Fields) -> float:
    """rope_theta from Transformers 5's `rope_parameters` or the older top-level fields."""
    params = fields.object("rope_parameters")
    scaling = fields.object("rope_scaling")
    for name, spec in (("rope_parameters", params), ("rope_scaling", scaling)):
        kind = spec.get("rope_type", spec.get("type", "default"))
        if kind != "default":
            raise fields.fail(name, f"has rope_type {json_repr(kind)}, which is not supported; "
                                    "supported: default")
    if params.get("rope_theta") is not None:
        return Fields(params, prefix="rope_parameters.").number("rope_theta")
    return fields.number("rope_theta", default=10000.0)


def _check_together(fields: Fields, values: dict[str, Any]) -> None:
    """The rules between fields, named by their config.json names."""
    experts = next(name for name in ("num_experts", "num_local_experts") if name in fields.read)
    if values["top_k"] > values["n_experts"]:
        raise fields.fail("num_experts_per_tok", f"({values['top_k']}) must be at most {experts} "
                                                 f"({values['n_experts']})")
    if values["n_layers"] * values["n_experts"] > INT_MAX:
        raise fields.fail("num_hidden_layers", f"x {experts} = {values['n_layers']} x "
                                               f"{values['n_experts']} experts; at most "
                                               f"{INT_MAX} (2**31 - 1) are supported")
