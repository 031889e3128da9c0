"""Shared test setup. Helpers that are not tests live in tests/support/ (imported as `support`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
