"""Reading a Hugging Face checkpoint directory: `config.json` and memory-mapped safetensors.

`Checkpoint.open` checks everything it can before any weight is read: the config, that every
file opens, and that every tensor the family needs is there with the shape `config.json` implies.
A failure is one `CheckpointError` line saying what was wrong (the CLI turns it into exit
status 2). Tensors are read lazily from the memory-mapped files, one at a time.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from strata.engine.experts.store import ExpertStore
from strata.engine.model import families
from strata.engine.model.config import DTYPES, CheckpointError, ModelConfig, read_config_json

__all__ = ["Checkpoint", "CheckpointError", "expert_store"]

INDEX_NAME = "model.safetensors.index.json"
# safetensors' dtype tags of the float dtypes a checkpoint may hold.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
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
        config = ModelConfig.from_hf(hf)
        files, locations = _open_files(directory)
        expected = families.expected_tensors(config)
        for name, shape in expected.items():
            _check_tensor(directory, files, locations, name, shape)
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


def _open_files(directory: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """Open every shard; return file name -> handle and tensor name -> file name."""
    index_path = directory / INDEX_NAME
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise CheckpointError(
                f"{index_path} is not a safetensors index (a JSON object with a weight_map): "
                f"{_one_line(err)}"
            ) from None
        file_names = sorted(set(weight_map.values()))
    else:
        weight_map = None
        file_names = sorted(p.name for p in directory.glob("*.safetensors"))
        if not file_names:
            raise CheckpointError(f"no *.safetensors files (and no {INDEX_NAME}) in {directory}")
    files: dict[str, Any] = {}
    locations: dict[str, str] = {}
    for file_name in file_names:
        file_path = directory / file_name
        if not file_path.is_file():
            raise CheckpointError(f"{file_path} is missing ({INDEX_NAME} lists it)")
        try:
            handle = safe_open(str(file_path), framework="pt")
        except (SafetensorError, OSError) as err:
            raise CheckpointError(
                f"{file_path} is truncated or not a safetensors file: {_one_line(err)}"
            ) from None
        files[file_name] = handle
        for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
            locations.setdefault(name, file_name)
    if weight_map is not None:
        # The index decides where each tensor lives; a tensor the index places in a file that
        # lacks it is reported when it is needed (see _check_tensor).
        locations = dict(weight_map)
    return files, locations


def _check_tensor(
    directory: Path,
    files: dict[str, Any],
    locations: dict[str, str],
    name: str,
    shape: tuple[int, ...],
) -> None:
    file_name = locations.get(name)
    if file_name is None:
        where = INDEX_NAME if (directory / INDEX_NAME).is_file() else ", ".join(sorted(files))
        raise CheckpointError(f"tensor {name!r} is missing from {where} in {directory}")
    handle = files[file_name]
    try:
        info = handle.get_slice(name)
    except SafetensorError:
        raise CheckpointError(
            f"tensor {name!r} is missing from {directory / file_name} "
            f"({INDEX_NAME} places it there)"
        ) from None
    found = tuple(info.get_shape())
    if found != shape:
        raise CheckpointError(
            f"tensor {name!r} in {directory / file_name} has shape {list(found)}, but "
            f"config.json implies {list(shape)}"
        )
    dtype = info.get_dtype()
    if dtype not in SAFETENSORS_DTYPES:
        raise CheckpointError(
            f"tensor {name!r} in {directory / file_name} has dtype {dtype}; supported: "
            f"{', '.join(SAFETENSORS_DTYPES)} ({', '.join(DTYPES)})"
        )


def expert_store(
    ckpt: Checkpoint,
    dtype: torch.dtype | None = None,
    *,
    pin_memory: bool = False,
    on_tensor: Callable[[], None] | None = None,
) -> ExpertStore:
    """Gather every expert of `ckpt` into blobs of `dtype` (default: the checkpoint's)."""
    cfg = ckpt.config
    dtype = dtype or cfg.dtype
    fam = families.family(cfg.family)
    f, d = cfg.expert_width, cfg.hidden_size
    itemsize = torch.empty((), dtype=dtype).element_size()
    layers = []
    for layer in range(cfg.n_layers):
        buf = torch.empty(
            (cfg.n_experts, 3 * f * d * itemsize), dtype=torch.uint8, pin_memory=pin_memory
        )
        typed = buf.view(dtype)  # [E, 3*F*D]
        for expert in range(cfg.n_experts):
            gate_name, up_name, down_name = fam.expert_names(layer, expert)
            # copy_ converts the stored dtype to the blob's dtype.
            typed[expert, : f * d].view(f, d).copy_(ckpt.tensor(gate_name))
            typed[expert, f * d : 2 * f * d].view(f, d).copy_(ckpt.tensor(up_name))
            typed[expert, 2 * f * d :].view(d, f).copy_(ckpt.tensor(down_name))
            if on_tensor is not None:
                for _ in range(3):
                    on_tensor()
        layers.append(buf)
    return ExpertStore(layers, d, f, dtype)
