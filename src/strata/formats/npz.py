"""Deterministic, atomic `.npz` files: what profiles and routing traces are written as, and
the one reader of them.

The same arrays give the same bytes (stored members, fixed timestamps, no pickles), and a file
appears whole or not at all (written beside its path, then renamed), with the mode `open()`
would give it.

Reading trusts nothing the file says until it is checked, and decompresses nothing before:
`open_npz` reads each member's zip entry and `.npy` header only (its dtype and shape), refuses
object arrays (pickles), a declared size that disagrees with the header's shape, a member that
would inflate more than MAX_INFLATION times its stored bytes (past MIN_INFLATED_CHECK: a
decompression bomb; strata writes stored members), text scalars over MAX_TEXT_BYTES and a file
whose arrays are larger than the host's memory; the caller then checks the shapes it expects
(`read_npz`'s `check`) before any array is read. A file that is not an `.npz` at all is named
as such, not handed to numpy's pickle loader.
"""

from __future__ import annotations

import lzma
import math
import os
import stat
import tempfile
import zipfile
import zlib
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from strata.machine import bytes_text, host_limit

__all__ = ["Member", "npz_scalar", "open_npz", "read_npz", "write_npz"]

MAX_HEADER_BYTES = 10_000  # numpy's own bound on a .npy header
MAX_TEXT_BYTES = 16 << 20  # a text scalar (a format name, JSON meta) is far smaller
MAX_INFLATION = 100  # stored bytes : declared bytes, for a compressed member ...
MIN_INFLATED_CHECK = 64 << 20  # ... that declares more than this
# What reading a damaged member raises: a bad .npy header, a short or corrupt stream, a CRC
# that does not match, a compression zipfile cannot undo.
BROKEN = (ValueError, EOFError, OSError, zipfile.BadZipFile, NotImplementedError, zlib.error,
          lzma.LZMAError)


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


@dataclass(frozen=True)
class Member:
    """One array of an `.npz` as its headers declare it: nothing of it has been read."""

    name: str  # without ".npy"
    dtype: np.dtype
    shape: tuple[int, ...]
    info: zipfile.ZipInfo

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _header(zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> tuple[np.dtype, tuple[int, ...], int]:
    """(dtype, shape, header bytes) of a member's `.npy` header; ValueError if it has none."""
    with zf.open(info) as f:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(f, MAX_HEADER_BYTES)
        elif version == (2, 0):
            shape, _, dtype = np.lib.format.read_array_header_2_0(f, MAX_HEADER_BYTES)
        else:
            raise ValueError(f".npy format version {version} (supported: 1.0, 2.0)")
        return dtype, tuple(shape), f.tell()


def _member(path: str, zf: zipfile.ZipFile, info: zipfile.ZipInfo, error: type[Exception]
            ) -> Member:
    """The member `info`, its headers checked (see the module's docstring)."""
    name = info.filename.removesuffix(".npy")
    if info.flag_bits & 0x1:  # zipfile would ask for a password
        raise error(f"{path}: {name} is encrypted; .npz members are plain arrays")
    try:
        dtype, shape, header = _header(zf, info)
    except BROKEN as exc:
        raise error(f"{path}: {name} is not a readable .npy array: "
                    f"{' '.join(str(exc).split())}") from None
    member = Member(name, dtype, shape, info)
    if dtype.hasobject:
        raise error(f"{path}: {name} is not a readable array: it holds Python objects "
                    f"({dtype}); only plain arrays are read (no pickles)")
    if info.file_size != header + member.nbytes:
        raise error(f"{path}: {name} declares {info.file_size:,} bytes, but its header's "
                    f"{dtype} {list(shape)} needs {header + member.nbytes:,}")
    if info.compress_type != zipfile.ZIP_STORED and info.file_size > MIN_INFLATED_CHECK \
            and info.file_size > MAX_INFLATION * max(info.compress_size, 1):
        raise error(f"{path}: {name} would inflate {info.compress_size:,} stored bytes to "
                    f"{info.file_size:,}, more than {MAX_INFLATION} times; refused as a "
                    "decompression bomb (strata writes .npz members uncompressed)")
    if not shape and dtype.kind in "SU" and dtype.itemsize > MAX_TEXT_BYTES:
        raise error(f"{path}: {name} is a text of {dtype.itemsize:,} bytes; at most "
                    f"{MAX_TEXT_BYTES:,} are read")
    return member


class NpzFile:
    """An `.npz` opened by `open_npz`: `members` by name, and `read` to decompress one."""

    def __init__(self, path: str, zf: zipfile.ZipFile, members: dict[str, Member],
                 error: type[Exception]) -> None:
        self.path, self._zf, self.members, self._error = path, zf, members, error

    def read(self, name: str) -> np.ndarray:
        """The array `name`, decompressed (its declared size was checked when opened)."""
        member = self.members[name]
        try:
            with self._zf.open(member.info) as f:
                return np.lib.format.read_array(f, allow_pickle=False,
                                                max_header_size=MAX_HEADER_BYTES)
        except BROKEN as exc:
            raise self._error(f"{self.path}: {name} cannot be read: "
                              f"{' '.join(str(exc).split())}") from None


@contextmanager
def open_npz(path: str | os.PathLike[str], *, short: str, error: type[Exception]
             ) -> Iterator[NpzFile]:
    """`path` opened as an `.npz`, every member's headers read and checked, no array read.

    `short` names the kind of file in messages ("trace"); a missing file is
    FileNotFoundError, anything else wrong `error` naming the path and the problem.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no {short} file at {path}")
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise error(f"{path} is not a readable .npz {short}: not a regular file")
    try:
        zf = zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        raise error(f"{path} is not a readable .npz {short}: it is not a zip archive of .npy "
                    "arrays (an .npz file)") from None
    except OSError as exc:
        raise error(f"{path} is not a readable .npz {short}: {exc.strerror or exc}") from None
    with zf:
        members = {}
        for info in zf.infolist():
            if info.filename.endswith(".npy"):
                member = _member(path, zf, info, error)
                members[member.name] = member
        yield NpzFile(path, zf, members, error)


def read_npz(
    path: str | os.PathLike[str], *, fmt: str, short: str, long: str, error: type[Exception],
    fields: Collection[str] | None = None,
    check: Callable[[Mapping[str, Member]], None] | None = None,
) -> dict[str, np.ndarray]:
    """The arrays of `path`, a file whose `format` field is `fmt`, without pickles.

    `short` and `long` name the kind of file in messages ("trace", "routing trace"). Only the
    members named in `fields` are read (None: all); `check` sees their headers first and
    raises `error` for a shape it does not expect. A missing file is FileNotFoundError,
    anything else wrong `error` naming the path and the problem.
    """
    path = os.fspath(path)
    with open_npz(path, short=short, error=error) as npz:
        if "format" not in npz.members:
            raise error(f"{path} is not a{'n' if long[0] in 'aeiou' else ''} {long}: "
                        "it has no 'format' field")
        header = npz.members["format"]
        if header.shape != () or header.dtype.kind != "U":
            raise error(f"{path}: format must be a text scalar, got {header.dtype} "
                        f"{header.shape}")
        found = npz_scalar(path, {"format": npz.read("format")}, "format", "U", error)
        if found != fmt:
            raise error(f"{path} is a {found!r} file, not a {fmt!r}")
        wanted = {name: member for name, member in npz.members.items()
                  if fields is None or name in fields}
        if check is not None:
            check(wanted)
        limit = host_limit()
        total = sum(member.nbytes for member in wanted.values())
        if total > limit.nbytes:
            raise error(f"{path}: its arrays declare {bytes_text(total)}, more than {limit}")
        return {name: npz.read(name) for name in wanted}


def npz_scalar(
    path: str, data: Mapping[str, np.ndarray], name: str, kind: str, error: type[Exception]
) -> Any:
    """The scalar field `name` of `data`, of a numpy dtype kind in `kind` (e.g. "iu", "U")."""
    value = data[name]
    if value.shape != () or value.dtype.kind not in kind:
        raise error(f"{path}: {name} must be a scalar of kind {kind!r}, got {value.dtype} "
                    f"{value.shape}")
    return value.item()
