"""`ModelShape`: what the families read of a model's config.

`strata.engine.model.config.ModelConfig` is one; the families take this protocol instead of
importing it, because `ModelConfig` itself asks the families how to read a `config.json` (the
config sits above the families, and the families import nothing above them).
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["ModelShape"]


class ModelShape(Protocol):
    """The config fields the families' names and shapes depend on (see `ModelConfig`)."""

    family: str
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_experts: int
    expert_width: int
    shared_expert_width: int
    head_dim: int
    qk_norm: str
    qkv_bias: bool
    o_bias: bool
    tie_word_embeddings: bool

    @property
    def q_width(self) -> int: ...

    @property
    def kv_width(self) -> int: ...
