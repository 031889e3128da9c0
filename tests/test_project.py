"""The project's own checks: the CLI's front door, lint, and the documentation site."""

import importlib
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

import strata
from strata import cli
from strata.cli import UsageError
from strata.policies import OptionError, PluginError, PolicyError, UnknownPolicyError
from strata.settings import SettingError

# strata.cli exports the function `main`, which hides the module of the same name.
main_module = importlib.import_module("strata.cli.main")

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


# Each runs in a fresh interpreter: the command's code path, then whether torch was imported.
QUICK_COMMANDS = [["--help"], ["policies"], ["trace", "info", "TRACE"], ["simulate", "--help"]]
NO_TORCH = """
import contextlib, io, sys
from strata.cli.main import main
with contextlib.redirect_stdout(io.StringIO()):
    try:
        status = main(sys.argv[1:])
    except SystemExit as exit_info:
        status = exit_info.code
assert status == 0, status
print(sorted(name for name in sys.modules if name.split(".")[0] in ("torch", "safetensors")))
"""


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "t.npz"
    argv = ["trace", "synth", str(path), "--layers", "2", "--experts", "8", "--requests", "1",
            "--prompt-tokens", "8", "--decode-tokens", "4"]
    assert cli.main(argv) == 0
    return path


@pytest.mark.parametrize("argv", QUICK_COMMANDS, ids=" ".join)
def test_quick_commands_import_no_torch(argv, trace_file, capsys):
    argv = [str(trace_file) if arg == "TRACE" else arg for arg in argv]
    result = subprocess.run([sys.executable, "-c", NO_TORCH, *argv], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_package_imports_no_torch():
    code = "import sys, strata, strata.cli, strata.settings; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, timeout=60)
    assert result.stdout.strip() == "False"


def failing_command(monkeypatch, error):
    """`strata fail`: a command whose run raises `error`."""
    module = types.ModuleType("strata_test_failing_command")

    def run(args):
        raise error

    module.register = lambda subparsers: subparsers.add_parser("fail").set_defaults(run=run)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(main_module, "COMMAND_MODULES",
                        (*main_module.COMMAND_MODULES, module.__name__))


@pytest.mark.parametrize(("error", "line"), [
    (UsageError("--x must be >= 1, got 0"), "--x must be >= 1, got 0"),
    (SettingError("STRATA_KV_GROW", "yes", "want 1 (on) or 0 (off)"),
     "STRATA_KV_GROW='yes': want 1 (on) or 0 (off)"),
    (PluginError("plugin 'x' failed to load:\n  ImportError: no"),
     "plugin 'x' failed to load: ImportError: no"),
    (OptionError("unknown option 'speed'"), "unknown option 'speed'"),
    (UnknownPolicyError("unknown policy 'nope'"), "unknown policy 'nope'"),
    (PolicyError("lru", "give_up", [9], "slot 9 is not backed"),
     "policy 'lru', give_up: slot 9 is not backed (got [9]) "
     "(STRATA_TRACE_PLUGINS=1 prints every decision)"),
])
def test_bad_input_is_one_line_with_status_2(capsys, monkeypatch, error, line):
    failing_command(monkeypatch, error)
    assert main_module.main(["fail"]) == 2
    assert capsys.readouterr() == ("", f"strata fail: {line}\n")


def test_a_bug_keeps_its_traceback(monkeypatch):
    failing_command(monkeypatch, ValueError("a bug, not bad input"))
    with pytest.raises(ValueError, match="a bug"):
        main_module.main(["fail"])


def test_a_bad_setting_stops_a_command_that_reads_the_settings(capsys, monkeypatch):
    monkeypatch.setenv("STRATA_KV_GROW_STEP", "lots")
    assert cli.main(["policies"]) == 2
    assert capsys.readouterr().err == ("strata policies: STRATA_KV_GROW_STEP='lots': want a "
                                       "positive integer (for example STRATA_KV_GROW_STEP=8192)\n")
