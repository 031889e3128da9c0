"""The model: its config, families, checkpoint and tokenizer, the plain layers, and loading.

- `config`, `families/`: a checkpoint's `config.json` as a `ModelConfig`, per family;
- `checkpoint`: the safetensors reader; `tokenizer`: tokenizers and chat templates;
- `layers`, `moe`: the decoder layers and `MoEModel` (device-agnostic; experts behind the
  `Experts` interface, the K/V passed in), `load_model`;
- `presets`, `init_model`: shapes of known models and random checkpoints of them.
"""

from strata.engine.model.moe import MoEModel, load_model, runtime_dtype

__all__ = ["MoEModel", "load_model", "runtime_dtype"]
