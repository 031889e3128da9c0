"""The project's own checks: the CLI's front door, lint, and the documentation site."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import strata
from strata import cli

ROOT = Path(__file__).resolve().parent.parent


def test_version_and_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"strata {strata.__version__}"
    assert cli.main([]) == 0
    assert "larger than the GPU" in capsys.readouterr().out


def test_the_console_script_runs():
    exe = shutil.which("strata")
    assert exe, "the `strata` console script is not installed"
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, check=True).stdout
    assert "usage: strata" in out


def test_ruff_is_clean():
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "src", "tests", "bench", "examples"],
        cwd=ROOT, capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_docs_build_strict(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
