"""Deterministic, atomic `.npz` files: what profiles and routing traces are written as.

The same arrays give the same bytes (stored members, fixed timestamps, no pickles), and a file
appears whole or not at all (written beside its path, then renamed), with the mode `open()`
would give it.
"""

from __future__ import annotations

import os
import tempfile
import zipfile
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["npz_scalar", "read_npz", "write_npz"]


def write_npz(path: str | os.PathLike[str], arrays: Mapping[str, np.ndarray]) -> None:
    """Write `arrays` to `path` as an uncompressed .npz, atomically and byte-deterministically."""
    path = os.fspath(path)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".tmp")
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.fchmod(fd, 0o666 & ~umask)  # as open() would make it, not mkstemp's 0600
        with os.fdopen(fd, "wb") as f, zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as z:
            for name, array in arrays.items():
                info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
                with z.open(info, "w") as member:
                    np.lib.format.write_array(member, np.asarray(array), allow_pickle=False)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def read_npz(
    path: str | os.PathLike[str], *, fmt: str, short: str, long: str, error: type[Exception]
) -> dict[str, np.ndarray]:
    """The arrays of `path`, a file whose `format` field is `fmt`, without pickles.

    `short` and `long` name the kind of file in messages ("trace", "routing trace"); a missing
    file is FileNotFoundError, anything else wrong `error` naming the path and the problem.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no {short} file at {path}")
    try:
        with np.load(path, allow_pickle=False) as z:
            data = {name.removesuffix(".npy"): z[name] for name in z.files}
    except Exception as exc:
        raise error(f"{path} is not a readable .npz {short}: {exc}") from None
    if "format" not in data:
        raise error(f"{path} is not a{'n' if long[0] in 'aeiou' else ''} {long}: "
                    "it has no 'format' field")
    found = npz_scalar(path, data, "format", "U", error)
    if found != fmt:
        raise error(f"{path} is a {found!r} file, not a {fmt!r}")
    return data


def npz_scalar(
    path: str, data: Mapping[str, np.ndarray], name: str, kind: str, error: type[Exception]
) -> Any:
    """The scalar field `name` of `data`, of a numpy dtype kind in `kind` (e.g. "iu", "U")."""
    value = data[name]
    if value.shape != () or value.dtype.kind not in kind:
        raise error(f"{path}: {name} must be a scalar of kind {kind!r}, got {value.dtype} "
                    f"{value.shape}")
    return value.item()
