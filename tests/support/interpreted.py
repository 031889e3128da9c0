"""Triton kernels under Triton's interpreter on the CPU: a script run in a fresh Python (the
interpreter is chosen by TRITON_INTERPRET when Triton is imported), its last line JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parents[1]  # where `support` is found, as pytest finds it


def run_interpreted(script: str, test_dir: str) -> Any:
    """Run `script` with TRITON_INTERPRET=1 (its sys.argv[1] is `test_dir`, to import the test
    module's helpers from); the JSON of its last line of output."""
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    done = subprocess.run([sys.executable, "-c", script, test_dir], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])
