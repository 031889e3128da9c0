"""Tiny real checkpoints made on the fly with `write_checkpoint`, and ways to break them.

    from support.checkpoints import make_checkpoint, cached_checkpoint

    def test_x(tmp_path):
        ckpt = make_checkpoint(tmp_path / "ckpt", "qwen3_moe", "tiny", dtype=torch.float32)

`cached_checkpoint` writes each distinct checkpoint once per test session (treat it as
read-only); `make_checkpoint` writes a fresh one you may change. The corruptions rewrite a
checkpoint in place the way a bad download or a mismatched config would.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from strata.engine.model.init_model import write_checkpoint

_SESSION_DIR: Path | None = None
_CACHE: dict[tuple[Any, ...], Path] = {}


def make_checkpoint(
    out_dir: str | Path,
    family: str = "mixtral",
    preset: str = "tiny",
    *,
    n_layers: int | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int | None = None,
) -> Path:
    """A fresh checkpoint in `out_dir` (absent or empty)."""
    extra = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
    return write_checkpoint(
        out_dir, family, preset, n_layers=n_layers, seed=seed, dtype=dtype, **extra
    )


def cached_checkpoint(
    family: str = "mixtral",
    preset: str = "tiny",
    *,
    n_layers: int | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int | None = None,
) -> Path:
    """A checkpoint shared by every test of the session that asks for the same one: read only."""
    global _SESSION_DIR
    key = (family, preset, n_layers, seed, dtype, max_shard_bytes)
    if key not in _CACHE:
        if _SESSION_DIR is None:
            # Lives as long as the process; pytest's tmp dirs are per test or need a fixture.
            _SESSION_DIR = Path(tempfile.mkdtemp(prefix="strata-test-ckpts-"))
        name = "-".join(str(part).replace("torch.", "") for part in key)
        _CACHE[key] = make_checkpoint(
            _SESSION_DIR / name,
            family,
            preset,
            n_layers=n_layers,
            seed=seed,
            dtype=dtype,
            max_shard_bytes=max_shard_bytes,
        )
    return _CACHE[key]


def store_of(ckpt_dir: Path, **options: Any):
    """The `ExpertStore` of the checkpoint at `ckpt_dir` (`expert_store`'s `options`), the
    checkpoint closed after."""
    from strata.engine.model.checkpoint import Checkpoint, expert_store

    ckpt = Checkpoint.open(ckpt_dir)
    try:
        return expert_store(ckpt, **options)
    finally:
        ckpt.close()


def shard_files(ckpt: Path) -> list[Path]:
    return sorted(Path(ckpt).glob("*.safetensors"))


def shard_of(ckpt: Path, tensor_name: str) -> Path:
    """The safetensors file that holds `tensor_name`."""
    index = Path(ckpt) / "model.safetensors.index.json"
    if index.is_file():
        return Path(ckpt) / json.loads(index.read_text())["weight_map"][tensor_name]
    return Path(ckpt) / "model.safetensors"


def truncate_shard(ckpt: Path, keep_fraction: float = 0.5) -> Path:
    """Cut the first shard short, as an interrupted download does; returns the file."""
    path = shard_files(ckpt)[0]
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep_fraction)])
    return path


def remove_tensor(ckpt: Path, tensor_name: str) -> Path:
    """Rewrite the shard holding `tensor_name` without it (the index still names it)."""
    path = shard_of(ckpt, tensor_name)
    tensors = load_file(str(path))
    del tensors[tensor_name]
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def replace_tensor(ckpt: Path, tensor_name: str, value: torch.Tensor) -> Path:
    """Rewrite the shard holding `tensor_name` with `value` in its place (any shape)."""
    path = shard_of(ckpt, tensor_name)
    tensors = load_file(str(path))
    tensors[tensor_name] = value.contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def edit_config(ckpt: Path, **fields: Any) -> dict[str, Any]:
    """Set `fields` in config.json (None removes a field); returns the new config."""
    path = Path(ckpt) / "config.json"
    config = json.loads(path.read_text())
    for key, value in fields.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config, indent=2))
    return config


def fake_quantize_experts(ckpt: Path, fmt: str) -> Path:
    """Rewrite every expert weight of the checkpoint at `ckpt` in place as the weights `fmt`
    (`strata.engine.experts.quant.WEIGHT_FORMATS`) stands for, in the checkpoint's dtype: what
    a model quantized at load computes with, as a plain checkpoint to compare against."""
    from strata.engine.experts.quant import fake_quantize
    from strata.engine.model import families
    from strata.engine.model.config import ModelConfig

    cfg = ModelConfig.from_dir(ckpt)
    fam = families.family(cfg.family)
    names = {name for layer in range(cfg.n_layers) for expert in range(cfg.n_experts)
             for name in fam.expert_names(layer, expert)}
    for path in shard_files(ckpt):
        tensors = load_file(str(path))
        for name in names & tensors.keys():
            tensors[name] = fake_quantize(tensors[name], fmt).to(tensors[name].dtype)
        save_file(tensors, str(path), metadata={"format": "pt"})
    return Path(ckpt)
