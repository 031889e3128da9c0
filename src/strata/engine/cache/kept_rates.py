"""`--stream-misses auto`: the split of a decode layer's misses from the rates kept for this
machine, measured once (`strata.engine.cache.rates`) and read by every later run.

The device and the CPU round differently, so the split is part of what the output bytes depend
on, and a split from timings taken during a run would change them run to run. So the times are
measured once per machine and configuration (`RatesKey`) and kept in `rates.json` in strata's
cache directory (`$STRATA_CACHE_DIR`, else `$XDG_CACHE_HOME/strata`, else `~/.cache/strata`);
every later run with that key reads them and splits identically (`kept_rates`). The file is
written atomically under a lock, so two first runs at once measure once, and the run that
measures splits by the values it wrote, read back. A file strata cannot read is an error
(`RatesError`), not measured over: measuring again would quietly change the split, and so the
output bytes, against the earlier runs; deleting the file is the way to measure again (a new CPU
kernel, a changed machine), and `--stream-misses N` needs no file. A directory that cannot be
written is an error too, for the same reason: every run would measure anew.

`resolve_stream_misses` turns the option's value into what the cache takes: "auto", and None
(not given: auto is the default), the balanced split (0 off CUDA: no bus), an int N the first
min(N, M) misses. `default_stream_misses` is the fixed count a caller sizes with before it
knows whether a cache is used at all (`strata.engine.runtime.options`), so that the rates are
measured only where one is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from strata import settings
from strata.engine.cache.rates import TARGET_BYTES, MissRates, RatesKey, measure_rates
from strata.engine.experts.streamed import StreamSplit
from strata.engine.model.config import ModelConfig

__all__ = [
    "FORMAT",
    "RATES_FILE",
    "RatesError",
    "auto_split",
    "kept_rates",
    "rates_path",
    "resolve_stream_misses",
]

RATES_FILE = "rates.json"
FORMAT = 1  # the file's layout; a file of another is refused (see the module)


class RatesError(ValueError):
    """The rates file cannot be read or written; the message names it and what to do."""


def rates_path() -> Path:
    """`rates.json` in strata's cache directory (`$STRATA_CACHE_DIR`, checked by
    `strata.settings`)."""
    return settings.cache_dir() / RATES_FILE


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[OSError | None]:
    """An exclusive lock on `path`'s sibling `.lock` file (made with its directory); yields
    None, or the OSError that kept it from being made (a read-only directory: the file may
    still be read, not written)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path.with_name(path.name + ".lock"), "a")  # noqa: SIM115
    except OSError as err:
        yield err
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield None
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _unwritable(path: Path, err: OSError) -> str:
    return (f"cannot keep the measured miss rates in {path}: {err.strerror or err}; set "
            "STRATA_CACHE_DIR to a writable directory, or give --stream-misses N")


def _bad_file(path: Path, why: str) -> str:
    return (f"{path} is not a rates file this strata can read ({why}); delete it to measure "
            "the rates again (the split of decode misses, and so the output bytes, may then "
            "differ from earlier runs), or give --stream-misses N")


def _read(path: Path) -> dict[str, object]:
    """The file's entries by key text ({} when there is no file). RatesError for a file that
    is not JSON, not of FORMAT, or whose layout is not ours."""
    try:
        text = path.read_text()
    except (FileNotFoundError, NotADirectoryError):  # none (yet)
        return {}
    except OSError as err:
        raise RatesError(_bad_file(path, err.strerror or str(err))) from None
    try:
        document = json.loads(text)
    except ValueError as err:
        raise RatesError(_bad_file(path, f"not JSON: {err}")) from None
    if not isinstance(document, dict) or not isinstance(document.get("entries"), dict):
        raise RatesError(_bad_file(path, 'not an object with "entries"'))
    if document.get("format") != FORMAT:
        raise RatesError(_bad_file(path, f"format {document.get('format')!r}, this strata "
                                         f"reads {FORMAT}"))
    return document["entries"]


def _write(path: Path, entries: dict[str, object]) -> None:
    """Replace the file atomically (a reader sees the old file or the new one)."""
    document = {"format": FORMAT, "about": "strata's measured decode miss times (seconds for "
                "k = 0..K experts); delete this file to measure again", "entries": entries}
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(document, f, indent=1, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)
    except OSError as err:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        raise RatesError(_unwritable(path, err)) from None


def kept_rates(key: RatesKey, measure: Callable[[], MissRates], path: Path | None = None
               ) -> MissRates:
    """The rates of `key` from the file at `path` (None: `rates_path()`), or `measure()`d now
    and added to it. Either way the values returned are those the file holds, so this run
    splits as every later one. RatesError for a file that cannot be read (or an entry of the
    key that is not ours) or a directory that cannot be written: see the module."""
    path = rates_path() if path is None else Path(path)
    with _locked(path) as unlockable:
        entries = _read(path)
        fresh = key.text() not in entries
        if fresh and unlockable is not None:
            raise RatesError(_unwritable(path, unlockable))
        if fresh:
            entries = {**entries, key.text(): measure().as_entry()}
            _write(path, entries)
            entries = _read(path)
        where = f"measured now, kept in {path}" if fresh else f"read from {path}"
        try:
            rates = MissRates.from_entry(entries[key.text()], where)
        except ValueError as err:
            raise RatesError(_bad_file(path, f"the entry {key.text()!r}: {err}")) from None
    if rates.top_k != key.top_k or rates.blob_bytes != key.blob_bytes:
        raise RatesError(_bad_file(path, f"the entry {key.text()!r} is for K = {rates.top_k} "
                                         f"and {rates.blob_bytes}-byte blobs"))
    if not fresh and rates.measured:
        rates = dataclasses.replace(rates, source=f"{where} (measured {rates.measured})")
    return rates


def auto_split(config: ModelConfig, dtype: torch.dtype, device: torch.device, *,
               cpu_threads: int | None = None, path: Path | None = None,
               target_bytes: int = TARGET_BYTES, quant: str | None = None
               ) -> tuple[StreamSplit, MissRates]:
    """The balanced split for `config` in `dtype` on `device`, the experts in `quant`'s format
    (None: the dtype's), from the kept rates (measured now when the file has none for this
    key). Runs on any device (off CUDA: the host twin)."""
    key = RatesKey.of(config, dtype, device, cpu_threads, quant)
    rates = kept_rates(key, lambda: measure_rates(key, dtype, device, cpu_threads=cpu_threads,
                                                  target_bytes=target_bytes), path)
    return rates.split(), rates


def resolve_stream_misses(value: int | str | None, config: ModelConfig, dtype: torch.dtype,
                          device: torch.device, *, cpu_threads: int | None = None,
                          path: Path | None = None, quant: str | None = None
                          ) -> tuple[int | StreamSplit, list[str]]:
    """`--stream-misses` as the cache takes it, and the notes to print: an int N stays (the
    first min(N, M) misses); "auto", and None (the default), is the balanced split from the
    kept rates of the store's format (`quant`) on CUDA, and 0 elsewhere (no bus). ValueError
    for a bad value; RatesError (a ValueError) as `kept_rates`."""
    device = torch.device(device)
    k = config.top_k
    if value is None or value == "auto":
        if device.type != "cuda":
            return 0, []
        threads = cpu_threads or torch.get_num_threads()
        split, rates = auto_split(config, dtype, device, cpu_threads=cpu_threads, path=path,
                                  quant=quant)
        return split, [rates.note(split, threads)]
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= k:
        raise ValueError(f"--stream-misses must be auto or in [0, {k}] (a decode layer misses "
                         f"at most the model's {k} experts a token), got {value!r}")
    return value, []
