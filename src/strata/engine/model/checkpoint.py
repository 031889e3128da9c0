"""Reading a Hugging Face checkpoint directory: `config.json` and memory-mapped safetensors.

`Checkpoint.open` checks everything it can before any weight is read: the config, that every
file lies inside the directory and opens, and that every tensor the family needs is there with
the shape `config.json` implies (`strata.engine.model.weight_files`).
A failure is one `CheckpointError` line saying what was wrong (the CLI turns it into exit
status 2). Tensors are read lazily from the memory-mapped files, one at a time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from strata.engine.experts.quant import expert_blob_bytes, make_blob
from strata.engine.experts.store import ExpertStore, host_blobs
from strata.engine.model import families
from strata.engine.model.config import CheckpointError, ModelConfig, read_config_json
from strata.engine.model.weight_files import (
    INDEX_NAME,
    SAFETENSORS_DTYPE_NAMES,
    check_tensors,
    weight_files,
)

__all__ = ["INDEX_NAME", "Checkpoint", "CheckpointError", "expert_store"]

# safetensors' dtype tags of the float dtypes a checkpoint may hold, as torch's.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    tag: getattr(torch, name) for tag, name in SAFETENSORS_DTYPE_NAMES.items()
}


class Checkpoint:
    """An opened checkpoint directory: its config and its tensors by published HF name."""

    def __init__(
        self,
        path: Path,
        config: ModelConfig,
        files: dict[str, Any],
        locations: dict[str, str],
    ) -> None:
        self.path = path
        self.config = config
        self._files = files  # file name -> open safe_open handle (memory-mapped)
        self._locations = locations  # tensor name -> file name

    @classmethod
    def open(cls, path: str | Path) -> Checkpoint:
        """Open and check `path`; `CheckpointError` with one line saying what was wrong."""
        directory = Path(path)
        hf = read_config_json(directory)
        config = ModelConfig.from_hf(hf, source=str(directory / "config.json"))
        found = weight_files(directory)
        check_tensors(config, found)
        files, locations = found.handles, found.locations
        if not ("dtype" in hf or "torch_dtype" in hf):
            # No dtype in config.json: the checkpoint's own tensors say what it is.
            embed = families.family(config.family).global_names(config)["embed"]
            stored = files[locations[embed]].get_slice(embed).get_dtype()
            config = dataclasses.replace(config, dtype=SAFETENSORS_DTYPES[stored])
        return cls(directory, config, files, locations)

    def names(self) -> list[str]:
        """Every tensor name in the checkpoint, sorted."""
        return sorted(self._locations)

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor `name` on the CPU, in its stored dtype."""
        file_name = self._locations.get(name)
        if file_name is None:
            raise CheckpointError(f"tensor {name!r} is not in the checkpoint at {self.path}")
        try:
            return self._files[file_name].get_tensor(name)
        except SafetensorError as err:
            raise CheckpointError(
                f"{self.path / file_name}: cannot read tensor {name!r}: {_one_line(err)}"
            ) from None

    def close(self) -> None:
        """Drop the file handles (tensors already read stay valid)."""
        self._files.clear()

    def __repr__(self) -> str:
        n_tensors = len(self._locations)
        return f"Checkpoint({str(self.path)!r}, {self.config.family}, {n_tensors} tensors)"


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())


def expert_store(
    ckpt: Checkpoint,
    dtype: torch.dtype | None = None,
    *,
    pin_memory: bool = False,
    on_tensor: Callable[[], None] | None = None,
    quant: str | None = None,
) -> ExpertStore:
    """Gather every expert of `ckpt` into blobs of `dtype` (default: the checkpoint's), or,
    with `quant` (a `strata.engine.experts.quant.WEIGHT_FORMATS`), into blobs of that format,
    quantized here from the checkpoint's weights (`dtype` is then what they compute in).

    The blobs are one mapping of host memory (`strata.engine.experts.store.host_blobs`;
    ValueError, before any is read, if the host has too little), page-locked for CUDA's copies
    with `pin_memory` once they are loaded."""
    cfg = ckpt.config
    dtype = dtype or cfg.dtype
    fam = families.family(cfg.family)
    f, d = cfg.expert_width, cfg.hidden_size
    blob_bytes = expert_blob_bytes(f, d, dtype, quant)
    fmt = quant or str(dtype).removeprefix("torch.")
    pages, blobs = host_blobs(cfg.n_layers, cfg.n_experts, blob_bytes,
                              f"{ckpt.path}: its experts as {fmt}")  # ValueError: too big
    layers = []
    for layer in range(cfg.n_layers):
        buf = blobs[layer]  # [E, blob_bytes]
        typed = buf.view(dtype) if quant is None else None  # [E, 3*F*D]
        for expert in range(cfg.n_experts):
            gate, up, down = (ckpt.tensor(name) for name in fam.expert_names(layer, expert))
            if typed is None:
                buf[expert].copy_(make_blob(quant, gate, up, down))
            else:  # copy_ converts the stored dtype to the blob's dtype
                typed[expert, : f * d].view(f, d).copy_(gate)
                typed[expert, f * d : 2 * f * d].view(f, d).copy_(up)
                typed[expert, 2 * f * d :].view(d, f).copy_(down)
            if on_tensor is not None:
                for _ in range(3):
                    on_tensor()
        layers.append(buf)
    if pin_memory:  # after the loading, so a checkpoint that fails to load locks nothing
        pages.register(torch.cuda.current_device())
    return ExpertStore(layers, d, f, dtype, quant, pages)
