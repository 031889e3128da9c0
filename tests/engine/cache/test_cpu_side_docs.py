"""docs/expert-cache.md's table of how the CPU side runs: every setting it names has the
default the table says, read from a cache built the way the engine builds one."""

import re
from pathlib import Path

import torch

from support.token_calls import make_cache, small_store

DOC = Path(__file__).resolve().parents[3] / "docs" / "expert-cache.md"


def _table_defaults() -> dict[str, str]:
    """{"CpuExperts.schedule": '"dynamic"', ...}: the settings table's first two columns."""
    doc = DOC.read_text()
    table = doc[doc.index("| setting | default | what it does |"):]
    rows = table[:table.index("\n\n")].splitlines()[2:]
    return {re.fullmatch(r"`(\w+\.\w+)`", cells[1].strip()).group(1): cells[2].strip()
            for cells in (row.split("|") for row in rows)}


def _value(text: str):
    """A default as the table writes it: on/off, a quoted string (as code) or an int."""
    text = text.strip("`")
    if text in ("on", "off"):
        return text == "on"
    if text.startswith('"'):
        return text.strip('"')
    return int(text)


def test_every_default_in_the_cpu_sides_table_is_the_codes():
    defaults = _table_defaults()
    assert {"CpuExperts.down_block_rows", "CpuExperts.schedule",
            "CachedExperts.async_cpu"} <= set(defaults)  # the table was found and read
    cached = make_cache(small_store(torch.bfloat16), 8, "lru", 0, True)
    try:
        owners = {"CachedExperts": cached, "CpuExperts": cached.cpu}
        for name, text in defaults.items():
            owner, attribute = name.split(".")
            assert getattr(owners[owner], attribute) == _value(text), name
    finally:
        cached.close()
