"""Every `STRATA_*` environment variable: what it means, what it accepts, its default.

This module is the one place that reads them. `read()` parses and checks all of them at once
into a frozen `Settings`; a bad value is a `SettingError` (a ValueError) whose message names the
variable, the value and what would be right. A field that is None was not set, and the part of
strata that owns the figure applies its own default (the engine's 128 slots a loan keeps, the
memory backend's 2 MiB chunk, ...), which `VARIABLES` records for the documentation.

It is a leaf: the standard library only, nothing else from strata, so every layer may import it
without an import cycle. The two build-time variables are read by setup.py, which runs before
the package exists; they are listed here so that the table (and docs/reference/settings.md, which
a test checks against it) is complete.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "VARIABLES",
    "SettingError",
    "Settings",
    "Variable",
    "cache_dir",
    "read",
    "variable",
]

PAGE_BYTES = mmap.PAGESIZE
# The host backend keeps its chunks in memfd files of this size, so a chunk must divide it
# (strata._vmm.HOST_FILE_BYTES; a test checks that the two agree).
HOST_FILE_BYTES = 8 << 30

VMM_CHUNK_BYTES = "STRATA_VMM_CHUNK_BYTES"
LOAN_KEEP_SLOTS = "STRATA_LOAN_KEEP_SLOTS"
LOAN_UPLOAD_BATCHES = "STRATA_LOAN_UPLOAD_BATCHES"
KV_GROW = "STRATA_KV_GROW"
KV_GROW_INIT = "STRATA_KV_GROW_INIT"
KV_GROW_STEP = "STRATA_KV_GROW_STEP"
KV_GROW_FLOOR = "STRATA_KV_GROW_FLOOR"
TRACE_PLUGINS = "STRATA_TRACE_PLUGINS"
LOAD_PLUGINS = "STRATA_LOAD_PLUGINS"
CACHE_DIR = "STRATA_CACHE_DIR"
DUMP_FIRST_LOGITS = "STRATA_DUMP_FIRST_LOGITS"
API_KEY = "STRATA_API_KEY"
CPU_KERNEL = "STRATA_CPU_KERNEL"
HOST_HUGE_PAGES = "STRATA_HOST_HUGE_PAGES"
CYTHON_DEBUG = "STRATA_CYTHON_DEBUG"
BUILD_ONLY = "STRATA_BUILD_ONLY"


class SettingError(ValueError):
    """A `STRATA_*` variable holds a value it does not accept.

    Attributes:
        name: the variable.
        value: the bad value, as read (text) or as given to `Settings` (typed).
    """

    def __init__(self, name: str, value: Any, want: str) -> None:
        super().__init__(f"{name}={value!r}: {want}")
        self.name = name
        self.value = value


# Converters take the variable's text (stripped, except for paths) and return the field's value,
# raising ValueError when the text is not of the right kind; the checks then judge the value.


def _is_int(value: Any) -> bool:
    # bool is an int subclass; True slots is a bug, not a count.
    return isinstance(value, int) and not isinstance(value, bool)


def _optional_int(text: str) -> int | None:
    return None if text == "" else int(text, 10)


def _switch(text: str) -> bool:
    if text not in ("", "0", "1"):
        raise ValueError(text)
    return text == "1"


def _names(text: str) -> frozenset[str]:
    return frozenset(name.strip() for name in text.split(",") if name.strip())


def _optional_text(text: str) -> str | None:
    return None if text == "" else text


def _optional_path(text: str) -> Path | None:
    return None if text == "" else Path(text)


def _chunk_ok(value: Any) -> bool:
    return value is None or (
        _is_int(value) and value > 0 and value % PAGE_BYTES == 0 and HOST_FILE_BYTES % value == 0
    )


def _count_ok(value: Any) -> bool:
    return value is None or (_is_int(value) and value >= 0)


def _positive_ok(value: Any) -> bool:
    return value is None or (_is_int(value) and value >= 1)


def _bool_ok(value: Any) -> bool:
    return isinstance(value, bool)


def _names_ok(value: Any) -> bool:
    return value is None or (
        isinstance(value, frozenset) and all(isinstance(n, str) and n for n in value)
    )


def _cpu_kernel_ok(value: Any) -> bool:
    return value in (None, "strata", "torch")


def _path_ok(value: Any) -> bool:
    return value is None or isinstance(value, Path)


def _text_ok(value: Any) -> bool:
    return value is None or (isinstance(value, str) and value != "")


@dataclass(frozen=True)
class Variable:
    """One variable: its name, what it means, what it accepts and its default (the docs table's
    columns), and for a run-time one the `Settings` attribute it fills and how it is parsed.

    `attribute` is None for the build-time variables, which only setup.py reads.
    """

    name: str
    meaning: str
    accepted: str
    default: str
    attribute: str | None = None
    want: str = ""  # an error's "what would be right"
    convert: Callable[[str], Any] | None = field(default=None, repr=False, compare=False)
    check: Callable[[Any], bool] | None = field(default=None, repr=False, compare=False)
    strip: bool = True  # paths keep their spaces; every other value is stripped first

    @property
    def build_time(self) -> bool:
        """Read by setup.py when the extensions are built, not by the package."""
        return self.attribute is None

    def parse(self, raw: str) -> Any:
        """The value of `raw` (the variable's text), or SettingError saying what is accepted."""
        if self.convert is None or self.check is None:
            raise TypeError(f"{self.name} is read by setup.py at build time, not by strata")
        text = raw.strip() if self.strip else raw
        try:
            value = self.convert(text)
        except ValueError:
            raise SettingError(self.name, text, self.want) from None
        if not self.check(value):
            raise SettingError(self.name, text, self.want)
        return value


def _positive_cells(name: str, meaning: str, default: str, attribute: str) -> Variable:
    return Variable(
        name, meaning, "a positive integer", default, attribute,
        want=f"want a positive integer (for example {name}=8192)",
        convert=_optional_int, check=_positive_ok,
    )


VARIABLES: tuple[Variable, ...] = (
    Variable(
        VMM_CHUNK_BYTES,
        "bytes of one physical chunk of the host memory backend, which the engine uses on the "
        "CPU (the cuda backend always takes the device's granularity)",
        "a positive multiple of the page size that divides 8 GiB, e.g. 65536",
        "2097152 (2 MiB)",
        "vmm_chunk_bytes",
        want=f"expected a positive multiple of the page size ({PAGE_BYTES} bytes) that divides "
        "8 GiB, e.g. 65536",
        convert=_optional_int, check=_chunk_ok,
    ),
    Variable(
        LOAN_KEEP_SLOTS,
        "the fewest expert-cache slots a prompt loan leaves to the cache",
        "an integer >= 0",
        "128",
        "loan_keep_slots",
        want="want an integer >= 0 (slots a loan leaves)",
        convert=_optional_int, check=_count_ok,
    ),
    Variable(
        LOAN_UPLOAD_BATCHES,
        "the batches a prompt loan uploads a layer's missed experts in, each computed while "
        "the next ones upload (1: all of them uploaded, the host waiting, then computed)",
        "a positive integer",
        "4",
        "loan_upload_batches",
        want="want a positive integer (batches a layer's loan uploads, for example 4)",
        convert=_optional_int, check=_positive_ok,
    ),
    Variable(
        KV_GROW,
        "the elastic K/V, as `--kv-grow` turns it on",
        "1 (on) or 0 (off)",
        "0 (off)",
        "kv_grow",
        want="want 1 (on) or 0 (off)",
        convert=_switch, check=_bool_ok,
    ),
    _positive_cells(KV_GROW_INIT, "K/V cells mapped at start, overriding the default "
                    "`kv_params`", "16384", "kv_grow_init"),
    _positive_cells(KV_GROW_STEP, "K/V cells a growth step maps, overriding the default "
                    "`kv_params`", "8192", "kv_grow_step"),
    # A count of slots, not cells: 0 is a floor (the K/V may take every slot below the loan).
    Variable(
        KV_GROW_FLOOR,
        "the fewest slots the cache keeps while the K/V grows, overriding the default "
        "`kv_params`",
        "an integer >= 0",
        "128 (`strata simulate`: `--floor-slots`)",
        "kv_grow_floor",
        want=f"want an integer >= 0 (slots the cache keeps, for example {KV_GROW_FLOOR}=128)",
        convert=_optional_int, check=_count_ok,
    ),
    Variable(
        TRACE_PLUGINS,
        "print every policy decision with its arguments and result, every registration and "
        "every hook call, to stderr",
        "any value but 0 turns it on",
        "off",
        "trace_plugins",
        convert=lambda text: text not in ("", "0"), check=_bool_ok,
    ),
    Variable(
        LOAD_PLUGINS,
        "load only these outside policy plugins (distribution or entry point names); the "
        "package's own always load",
        "a comma list of names; empty loads none",
        "every installed plugin",
        "load_plugins",
        convert=_names, check=_names_ok,
    ),
    Variable(
        CACHE_DIR,
        "where `strata generate` keeps the built-in tiny model it creates on a first run, and "
        "the expert cache keeps the rates `--stream-misses auto` (the default on CUDA) "
        "measured (rates.json)",
        "a directory path",
        "`$XDG_CACHE_HOME/strata`, else `~/.cache/strata`",
        "cache_dir",
        convert=_optional_path, check=_path_ok, strip=False,
    ),
    Variable(
        DUMP_FIRST_LOGITS,
        "`strata generate` writes the logits of the first generated position there, as raw "
        "float32 bytes",
        "a file path in an existing directory",
        "not written",
        "dump_first_logits",
        convert=_optional_path, check=_path_ok, strip=False,
    ),
    # Any text is taken here; `strata serve` checks that it can travel in an HTTP header, in
    # a message that does not repeat the secret (a SettingError would print the value).
    Variable(
        API_KEY,
        "the key `strata serve` requires of every request to /v1 and /metrics, as "
        "`Authorization: Bearer KEY` (what `--api-key` sets)",
        "visible ASCII characters, no spaces",
        "no key: every request is served",
        "api_key",
        convert=_optional_text, check=_text_ok,
    ),
    Variable(
        CPU_KERNEL,
        "how the CPU computes missed bf16 experts: strata's kernel (every expert of a layer "
        "call spread over the cores, each weight read once) or torch's matmuls, one expert "
        "at a time (the path before it, kept to measure against)",
        "strata or torch",
        "strata",
        "cpu_kernel",
        want="want strata or torch",
        convert=_optional_text, check=_cpu_kernel_ok,
    ),
    Variable(
        HOST_HUGE_PAGES,
        "the expert store's and the parked conversations' host memory advised to use 2 MiB "
        "pages: fewer page walks for the CPU's and the copies' streaming reads, and on the "
        "H200 machine a conversation's first park 1.8-2.3x faster (fewer pages to lock, "
        "bench/results/park-h200-2026-12-05.md); but on a virtual machine whose memory the "
        "host backs only when first touched the store loaded 1.5-3.9x slower (on the "
        "development VM, bench/results/host-pages-cpu-2026-12-04.md)",
        "1 (on) or 0 (off)",
        "0 (off)",
        "host_huge_pages",
        want="want 1 (on) or 0 (off)",
        convert=_switch, check=_bool_ok,
    ),
    Variable(
        CYTHON_DEBUG,
        "build time (setup.py): turn Cython's bounds, wraparound and initialisation checks "
        "back on",
        "any value but 0 turns them on",
        "off",
    ),
    Variable(
        BUILD_ONLY,
        "build time (setup.py): build only these extensions, e.g. while one is mid-edit",
        "a comma list of extension names, e.g. `_vmm,_residency`",
        "every extension",
    ),
)


def variable(name: str) -> Variable:
    """The variable called `name`; KeyError for a name strata does not read."""
    for var in VARIABLES:
        if var.name == name:
            return var
    raise KeyError(f"{name} is not a strata variable; known: "
                   f"{', '.join(v.name for v in VARIABLES)}")


@dataclass(frozen=True)
class Settings:
    """The run-time `STRATA_*` settings, checked; None (or False) where a variable is unset.

    Built by `read()` from the environment, or directly (tests); either way every field is
    checked, and a bad one is a SettingError naming its variable.
    """

    vmm_chunk_bytes: int | None = None
    loan_keep_slots: int | None = None
    loan_upload_batches: int | None = None
    kv_grow: bool = False
    kv_grow_init: int | None = None
    kv_grow_step: int | None = None
    kv_grow_floor: int | None = None
    trace_plugins: bool = False
    load_plugins: frozenset[str] | None = None
    cache_dir: Path | None = None
    dump_first_logits: Path | None = None
    api_key: str | None = field(default=None, repr=False)  # a secret: kept out of reprs
    cpu_kernel: str | None = None
    host_huge_pages: bool = False

    def __post_init__(self) -> None:
        for var in VARIABLES:
            if var.attribute is None or var.check is None:
                continue
            value = getattr(self, var.attribute)
            if not var.check(value):
                raise SettingError(var.name, value, var.want or f"want {var.accepted}")


def cache_dir() -> Path:
    """strata's cache directory (the built-in model, the kept rates): `$STRATA_CACHE_DIR`, else
    `$XDG_CACHE_HOME/strata`, else `~/.cache/strata`."""
    if (chosen := read().cache_dir) is not None:
        return chosen
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "strata"
    return Path.home() / ".cache" / "strata"


def read(environ: Mapping[str, str] | None = None) -> Settings:
    """The settings in `environ` (default: os.environ), every variable parsed and checked.

    Read afresh on each call, so a change to the environment (a test's, a benchmark's) applies
    from the next call on. Raises SettingError for the first bad value, in `VARIABLES` order.
    """
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for var in VARIABLES:
        if var.attribute is None:
            continue
        raw = env.get(var.name)
        if raw is not None:
            values[var.attribute] = var.parse(raw)
    return Settings(**values)
