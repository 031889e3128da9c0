"""Shared test setup. Helpers that are not tests live in tests/support/ (imported as `support`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
# The benchmarks' shared helpers (bench/_common.py), for the tests that run a benchmark script;
# run directly, a script finds them beside itself.
sys.path.insert(1, str(Path(__file__).parent.parent / "bench"))
