"""The docs tests' helpers (pages, outputs, session) are imported by name from this folder."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
