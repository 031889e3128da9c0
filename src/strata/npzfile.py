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

import numpy as np

__all__ = ["write_npz"]


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
