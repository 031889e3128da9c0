"""The scripts of bench/ loaded as modules, the way `python bench/X.py` runs them."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load_bench(script: str) -> ModuleType:
    """bench/`script` (e.g. "decode.py") as a fresh module; its `main(argv)` runs it."""
    spec = importlib.util.spec_from_file_location(f"bench_{Path(script).stem}", BENCH / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
