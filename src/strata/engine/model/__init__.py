"""The model: its config, families, checkpoint and tokenizer, the plain layers, and loading.

- `config`, `families/`: a checkpoint's `config.json` as a `ModelConfig`, per family;
- `checkpoint`: the safetensors reader; `tokenizer`: tokenizers and chat templates;
- `layers`, `moe`: the decoder layers and `MoEModel` (device-agnostic; experts behind the
  `Experts` interface, the K/V passed in), `load_model`;
- `presets`, `init_model`, `builtin`: shapes of known models, random checkpoints of them, the
  first-run model.

`MoEModel`, `load_model` and `runtime_dtype` are importable from here; they are loaded on first
use, so that the torch-free parts (`presets`, `families`) import without torch (the command
line's help names them).
"""

from typing import Any

__all__ = ["MoEModel", "load_model", "runtime_dtype"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from strata.engine.model import moe

        return getattr(moe, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
