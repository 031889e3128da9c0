"""Which files hold a checkpoint's weights, and whether they hold what config.json describes.

The files are those `model.safetensors.index.json` names (its `weight_map`: tensor name ->
file name), else every `*.safetensors` in the directory. Weights are read only from regular
files inside the checkpoint directory: a name that is absolute or climbs out with `..`, or a
symlink that leads out of the directory (or round in a loop), is a `CheckpointError` before
any file is opened. `check_tensors` then checks every tensor config.json implies, by name,
shape and dtype, from the files' headers (no weight is read), one at a time: it stops at the
first one missing, so a config of a billion layers costs no more than the files hold, and is
refused before anything is sized from it.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from safetensors import SafetensorError, safe_open

from strata.engine.model import families
from strata.engine.model.errors import CheckpointError
from strata.engine.model.families._shape import ModelShape
from strata.formats.jsonfile import json_repr, json_type, read_json_object

__all__ = ["INDEX_NAME", "SAFETENSORS_DTYPE_NAMES", "WeightFiles", "check_tensors", "weight_files"]

INDEX_NAME = "model.safetensors.index.json"
# safetensors' dtype tags of the float dtypes a checkpoint may hold (torch's names).
SAFETENSORS_DTYPE_NAMES: dict[str, str] = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


@dataclass(frozen=True)
class WeightFiles:
    """The weights files of a checkpoint, opened (memory-mapped, nothing read): `handles` (file
    name as listed -> its `safe_open` handle), `locations` (tensor name -> file name: the
    index's `weight_map`, else where each tensor was found) and whether an index was read."""

    directory: Path
    handles: dict[str, Any]
    locations: dict[str, str]
    indexed: bool

    @property
    def where(self) -> str:
        """Where a tensor is looked up, for messages: the index, or the files."""
        return INDEX_NAME if self.indexed else ", ".join(sorted(self.handles))

    @property
    def n_tensors(self) -> int:
        return len(self.locations)


def weight_files(directory: Path) -> WeightFiles:
    """The weights files of `directory`, each checked to be a regular file inside it."""
    index_path = directory / INDEX_NAME
    if os.path.lexists(index_path):
        weight_map = _read_index(index_path)
        names = sorted(set(weight_map.values()))
        listed_by = INDEX_NAME
    else:
        weight_map = None
        names = sorted(p.name for p in directory.glob("*.safetensors"))
        if not names:
            raise CheckpointError(f"no *.safetensors files (and no {INDEX_NAME}) in {directory}")
        listed_by = "the directory"
    root = Path(os.path.realpath(directory))
    handles: dict[str, Any] = {}
    locations: dict[str, str] = {}
    for name in names:
        handles[name] = _open(directory / name, _inside(directory, root, name, listed_by))
        for tensor in handles[name].keys():  # noqa: SIM118 (safe_open is not a mapping)
            locations.setdefault(tensor, name)
    if weight_map is not None:
        # The index decides where each tensor lives; a tensor the index places in a file that
        # lacks it is reported when it is checked.
        locations = dict(weight_map)
    return WeightFiles(directory, handles, locations, weight_map is not None)


def _open(shown: Path, path: Path) -> Any:
    """A `safe_open` handle of `path` (its header read and checked against its length; no
    tensor read); CheckpointError naming `shown` otherwise."""
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{shown} is truncated or not a safetensors file: "
                              f"{' '.join(str(err).split())}") from None


def _read_index(index_path: Path) -> dict[str, str]:
    index = read_json_object(index_path, what="a safetensors index", error=CheckpointError)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(
            f"{index_path}: weight_map must be a non-empty object (tensor name -> file name), "
            f"got {json_type(weight_map) if 'weight_map' in index else 'none'}"
        )
    for tensor, file_name in weight_map.items():
        if not isinstance(file_name, str) or not file_name:
            raise CheckpointError(f"{index_path}: weight_map[{json_repr(tensor)}] must be a "
                                  f"file name, got {json_repr(file_name)}")
    return weight_map


def _inside(directory: Path, root: Path, name: str, listed_by: str) -> Path:
    """The real path of the file `name`, which must be a regular file inside `root`."""
    parts = PurePosixPath(name).parts
    if PurePosixPath(name).is_absolute() or ".." in parts or "\0" in name:
        raise CheckpointError(
            f"{listed_by} in {directory} names {json_repr(name)}, outside the checkpoint "
            "directory; weights are read only from files inside it (a name relative to it)"
        )
    path = directory / name
    try:
        real = Path(os.path.realpath(path, strict=True))
        info = os.stat(real)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise CheckpointError(f"{path} is a symlink loop; it must lead to a safetensors "
                                  "file inside the checkpoint directory") from None
        if err.errno == errno.ENOENT:
            raise CheckpointError(f"{path} is missing ({listed_by} lists it)") from None
        raise CheckpointError(f"{path} cannot be read: {err.strerror or err}") from None
    if real != root and root not in real.parents:
        raise CheckpointError(
            f"{path} leads to {real}, outside the checkpoint directory {root}; weights are read "
            "only from files inside it (copy the file in, or download with --local-dir)"
        )
    if not stat.S_ISREG(info.st_mode):
        raise CheckpointError(f"{path} is not a regular file (a safetensors file was expected)")
    return real


def check_tensors(config: ModelShape, files: WeightFiles) -> None:
    """CheckpointError for the first tensor `config` implies that the files lack, or hold with
    another shape or an unsupported dtype; tensors are checked one at a time, in load order."""
    directory = files.directory
    for name, shape in families.iter_expected_tensors(config):
        file_name = files.locations.get(name)
        if file_name is None:
            raise CheckpointError(f"tensor {name!r} is missing from {files.where} in "
                                  f"{directory}{_count_note(config, files)}")
        try:
            info = files.handles[file_name].get_slice(name)
        except SafetensorError:
            raise CheckpointError(
                f"tensor {name!r} is missing from {directory / file_name} ({INDEX_NAME} places "
                f"it there){_count_note(config, files)}"
            ) from None
        found = tuple(info.get_shape())
        if found != shape:
            raise CheckpointError(f"tensor {name!r} in {directory / file_name} has shape "
                                  f"{list(found)}, but config.json implies {list(shape)}")
        dtype = info.get_dtype()
        if dtype not in SAFETENSORS_DTYPE_NAMES:
            tags, names = SAFETENSORS_DTYPE_NAMES, SAFETENSORS_DTYPE_NAMES.values()
            raise CheckpointError(
                f"tensor {name!r} in {directory / file_name} has dtype {dtype}; supported: "
                f"{', '.join(tags)} ({', '.join(names)})"
            )


def _count_note(config: ModelShape, files: WeightFiles) -> str:
    """When config.json implies more tensors than the files hold, by a layer's worth or more:
    how many, and from what."""
    want = families.tensor_count(config)
    per_layer = families.tensor_count(config, 1) - families.tensor_count(config, 0)
    if want < files.n_tensors + per_layer:
        return ""
    return (f" (config.json implies {want:,} tensors, {config.n_layers:,} layers x "
            f"{config.n_experts:,} experts, the files hold {files.n_tensors:,}: does "
            "num_hidden_layers or the expert count match the weights?)")
