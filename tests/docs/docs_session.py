"""Running a page's steps as a reader would, in a temporary folder of its own.

A `PageSession` owns three folders under its root: `work` (the page's working folder, where
commands run and titled blocks are written), `cache` (`STRATA_CACHE_DIR`: the built-in model
is made afresh for each page) and `site` (where the page's `pip install`s go). Each command
runs in its own `bash`, so variables set by one are gone in the next; the working directory
carries over (a `cd` holds for the commands after it).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from docs_outputs import explain, matches
from docs_pages import Command, Page, WriteFile

COMMAND_TIMEOUT_S = 600
CACHE_SHOWN_AS = "~/.cache/strata"  # where the cache directory is by default
# `pip install ...` or `python -m pip install ...`, alone on its line.
_PIP = re.compile(r"^\s*(?:python3?\s+-m\s+)?pip3?\s+install\s+(?P<args>[^|;&<>\n]*)$")
_EDITABLE = {"-e", "--editable"}


@dataclass(frozen=True)
class Ran:
    """A command as run: the command line bash got, its exit status, stdout and stderr merged."""

    command: str
    status: int
    output: str

    def lines(self) -> list[str]:
        """The output's lines, and `[exit status N]` last when N is not 0."""
        lines = self.output.splitlines()
        while lines and not lines[-1].strip():
            lines.pop()
        return lines + ([f"[exit status {self.status}]"] if self.status else [])


def rewrite_pip(command: str, site: Path) -> str | None:
    """The offline, isolated form of a page's `pip install ARGS`, or None if it is not one:
    `python -m pip install --no-build-isolation --no-deps --no-index --upgrade --target SITE
    ARGS`, without `-e`/`--editable` (a `--target` install is a copy: `.pth` files, which an
    editable install needs, are read only in site-packages). Nothing is downloaded, and the
    environment the tests run in is left as it was."""
    match = _PIP.match(command)
    if match is None:
        return None
    args = [arg for arg in shlex.split(match["args"]) if arg not in _EDITABLE]
    flags = ["--no-build-isolation", "--no-deps", "--no-index", "--upgrade", "--quiet",
             "--disable-pip-version-check", "--target", str(site)]
    return shlex.join([sys.executable, "-m", "pip", "install", *flags, *args])


def _plugin_distributions(site: Path) -> list[str]:
    """The distributions in `site` with an entry point of group `strata`."""
    names = []
    for info in sorted(site.glob("*.dist-info")):
        entry_points = info / "entry_points.txt"
        if entry_points.is_file() and "[strata]" in entry_points.read_text():
            for line in (info / "METADATA").read_text().splitlines():
                if line.startswith("Name:"):
                    names.append(line.split(":", 1)[1].strip())
                    break
    return names


class PageSession:
    """The folders and environment of one page's run; `step` runs its steps in order."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.work, self.cache, self.site = root / "work", root / "cache", root / "site"
        for folder in (self.work, self.cache, self.site):
            folder.mkdir(parents=True, exist_ok=True)
        self.cwd = self.work
        self.env = self._environment()

    def _environment(self) -> dict[str, str]:
        """The reader's environment, made repeatable: none of the caller's STRATA_* settings;
        the venv's commands first on PATH; the page's own cache, site and plugins; unbuffered
        Python (stdout and stderr interleave as on a terminal); fixed width and no colour;
        torch's CPU kernels without their vector instructions (ATEN_CPU_CAPABILITY) and MKL's
        products in its reproducible mode (MKL_CBWR): each instruction set rounds some ops in
        its own way, enough to flip a random tiny model's near-tied routing, so the pages'
        figures would differ between an AVX2 machine and an AVX-512 one."""
        env = {key: value for key, value in os.environ.items() if not key.startswith("STRATA_")}
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self.site),
                                                          os.environ.get("PYTHONPATH")]))
        env.update(STRATA_CACHE_DIR=str(self.cache), STRATA_LOAD_PLUGINS="",
                   PYTHONUNBUFFERED="1", PYTHONIOENCODING="utf-8", PYTHONDONTWRITEBYTECODE="1",
                   COLUMNS="100", TERM="dumb", NO_COLOR="1", MPLBACKEND="Agg",
                   ATEN_CPU_CAPABILITY="default", MKL_CBWR="COMPATIBLE")
        return env

    def write(self, step: WriteFile) -> Path:
        """Write a titled block's content into the working folder."""
        path = self.work / step.path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(step.content)
        return path

    def run(self, command: str, timeout: float = COMMAND_TIMEOUT_S) -> Ran:
        """Run `command` with bash in the current folder; stdout and stderr merged, in order.

        Only the plugins the page installed itself are loaded (`STRATA_LOAD_PLUGINS`): a
        plugin installed in the environment the tests run in is no part of the page."""
        pip = rewrite_pip(command, self.site)
        state = self.root / "cwd"
        script = (f"cd {shlex.quote(str(self.cwd))} || exit 97\n{pip or command}\n"
                  f"__status=$?\npwd > {shlex.quote(str(state))}\nexit $__status\n")
        done = subprocess.run(["bash", "--noprofile", "--norc", "-c", script], env=self.env,
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, timeout=timeout)
        if state.is_file():
            self.cwd = Path(state.read_text().strip())
            state.unlink()
        if pip is not None:
            self.env["STRATA_LOAD_PLUGINS"] = ",".join(_plugin_distributions(self.site))
        output = done.stdout.decode("utf-8", errors="replace")
        return Ran(pip or command, done.returncode, output.replace(str(self.cache),
                                                                   CACHE_SHOWN_AS))

    def step(self, step: Command | WriteFile) -> Ran | None:
        if isinstance(step, WriteFile):
            self.write(step)
            return None
        return self.run(step.text)


def run_page(page: Page, root: Path) -> str | None:
    """Run `page`'s steps in a session under `root`; the first difference from what the page
    shows ("page:line: $ command" and the diff), or None when every command printed it. Later
    commands build on earlier ones, so the run stops at the first difference."""
    session = PageSession(root)
    for step in page.steps:
        ran = session.step(step)
        if isinstance(step, Command) and not matches(step.expected, ran.lines()):
            return f"{page.path}:{step.line}: $ {step.text}\n{explain(step.expected, ran.lines())}"
    return None
