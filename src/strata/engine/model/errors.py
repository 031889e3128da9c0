"""`CheckpointError`: a checkpoint directory that cannot be loaded.

Its own module so that everything reading a checkpoint (the config, the weights' files, the
safetensors reader) raises the same class without importing each other.
"""

from __future__ import annotations

__all__ = ["CheckpointError"]


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message is one line saying what was wrong.

    Raised for a missing or unreadable `config.json` or safetensors file, a config field of the
    wrong type or out of range (named), weights files outside the directory or too small for
    the config, a missing tensor, a shape that disagrees with `config.json`, and an unsupported
    `model_type`.
    """
