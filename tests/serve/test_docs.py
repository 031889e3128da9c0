"""The Serve page and the agents tutorial run as a reader runs them, the server included.

The site's page runner (docs/contributing.md) skips what needs a server; these pages mark such
blocks with two reasons this test knows: a block that starts `strata serve`
("tests/serve/test_docs.py starts it") is run in the background on a free port (a later one
stops the earlier server first), and a block that talks to it ("tests/serve/test_docs.py runs
it") is run like any other, the default address rewritten to that port. Every command's output
must be what the page shows (a line `...` stands for any lines, `...` in a line for any text),
and the server's own, checked when it stops (SIGTERM, exit status 0).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = ("serve.md", "agents.md")
STARTS, RUNS = "tests/serve/test_docs.py starts it", "tests/serve/test_docs.py runs it"
ADDRESS = "127.0.0.1:8080"
_BLOCK = re.compile(r"(?:<!-- docs-test: skip: (?P<reason>[^>]*?) -->\n)?"
                    r"```(?P<kind>\w+)(?: title=\"(?P<title>[^\"]+)\")?\n(?P<body>.*?)```",
                    re.S)


@dataclass
class Step:
    kind: str  # "file", "command" or "server"
    text: str  # the file's content or the command
    expected: list[str]
    path: str | None = None


def steps_of(page: Path) -> list[Step]:
    """The page's titled files and console commands, those it skips for other reasons left
    out."""
    steps = []
    for block in _BLOCK.finditer(page.read_text()):
        reason = block["reason"] or ""
        if block["title"]:
            steps.append(Step("file", block["body"], [], block["title"]))
            continue
        if block["kind"] != "console" or (reason and STARTS not in reason and
                                          RUNS not in reason):
            continue
        command: list[str] = []
        for line in block["body"].splitlines():
            if line.startswith("$ "):
                command = [line[2:]]
                steps.append(Step("server" if STARTS in reason else "command", "", []))
            elif command and not _complete("\n".join(command)):
                command.append(line)
            else:
                steps[-1].expected.append(line)
                continue
            steps[-1].text = "\n".join(command)
    return steps


def _complete(command: str) -> bool:
    """Whether a command is whole: no trailing `\\`, `|`, `&&` or `||`, no quote left open."""
    if re.search(r"(\\|\||&&)\s*$", command):
        return False
    try:
        shlex.split(command)
    except ValueError:  # a quote left open
        return False
    return True


def matches(expected: list[str], got: list[str]) -> bool:
    """`got` is what `expected` shows, `...` standing for any lines or any text in a line."""
    pattern = "".join(
        r"(?:[^\n]*\n)*?" if line == "..." else
        r"[^\n]*".join(re.escape(part) for part in line.rstrip().split("...")) + r"\n"
        for line in expected)
    text = "".join(line.rstrip() + "\n" for line in got)
    return re.fullmatch(pattern, text) is not None


def _lines(output: str, status: int) -> list[str]:
    lines = output.splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    return lines + ([f"[exit status {status}]"] if status else [])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Reader:
    """The page's folder and environment, and its server."""

    def __init__(self, tmp: Path) -> None:
        self.cwd = tmp / "work"
        self.cwd.mkdir()
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_")}
        # One torch thread, as the other tests of the server (see conftest.one_torch_thread).
        self.env.update(STRATA_CACHE_DIR=str(tmp / "cache"), PYTHONUNBUFFERED="1",
                        OMP_NUM_THREADS="1",
                        PATH=os.pathsep.join([str(Path(sys.executable).parent),
                                              self.env.get("PATH", "")]))
        self.cache = str(tmp / "cache")
        self.port = _free_port()
        self.server: tuple[Step, subprocess.Popen] | None = None

    def local(self, text: str) -> str:
        return text.replace(ADDRESS, f"127.0.0.1:{self.port}")

    def run(self, command: str) -> list[str]:
        done = subprocess.run(["bash", "-c", self.local(command)], cwd=self.cwd, env=self.env,
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, timeout=600)
        output = done.stdout.decode(errors="replace").replace(self.cache, "~/.cache/strata")
        return _lines(output, done.returncode)

    def start(self, step: Step) -> None:
        self.stop()
        self.port = _free_port()
        log = open(self.cwd / f"server-{self.port}.log", "w")  # noqa: SIM115 - kept open
        # `exec env`: the server is the process SIGTERM reaches, whatever variables it sets.
        proc = subprocess.Popen(["bash", "-c", f"exec env {step.text} --port {self.port}"],
                                cwd=self.cwd, env=self.env, stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT)
        self.server = (step, proc)
        # curl retries on 503 (loading) and on a refused connection (not listening yet). The
        # body goes to a file: before a retry curl truncates its output, which fails on
        # /dev/null (exit status 23, curl 7.88) once a 503 came with a body.
        body = self.cwd.parent / "health.out"  # beside the page's folder, not in it
        health = (f"curl -s -o {body} -w '%{{http_code}}' --retry 60 --retry-connrefused "
                  f"--retry-delay 1 {ADDRESS}/health")
        assert self.run(health) == ["200"], self.server_lines()

    def server_lines(self) -> list[str]:
        text = (self.cwd / f"server-{self.port}.log").read_text()
        # The start's health probe (`start`) is this harness's, not a step of the page: whether
        # it met the model still loading (a 503 in the access log) depends on the machine's
        # speed, so those lines are left out of what the page's shown output is matched with.
        text = "\n".join(line for line in text.splitlines() if "GET /health 503" not in line)
        return _lines(self.local(text).replace(self.cache, "~/.cache/strata")
                      .replace(f"127.0.0.1:{self.port}", ADDRESS), 0)

    def stop(self) -> None:
        if self.server is None:
            return
        step, proc = self.server
        self.server = None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        lines = self.server_lines()
        assert matches(step.expected, lines), f"$ {step.text}\nshown:\n" + \
            "\n".join(step.expected) + "\nprinted:\n" + "\n".join(lines)


@pytest.mark.parametrize("page", PAGES)
def test_the_page_runs_as_shown(page, tmp_path):
    steps = steps_of(ROOT / "docs" / page)
    assert any(s.kind == "server" for s in steps), "the page starts no server"
    reader = Reader(tmp_path)
    try:
        for step in steps:
            if step.kind == "file":
                path = reader.cwd / step.path
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(reader.local(step.text))
            elif step.kind == "server":
                reader.start(step)
            else:
                got = reader.run(step.text)
                assert matches(step.expected, got), \
                    f"{page}: $ {step.text}\nshown:\n" + "\n".join(step.expected) + \
                    "\nprinted:\n" + "\n".join(got)
        reader.stop()
    finally:
        if reader.server is not None:
            reader.server[1].kill()


def test_the_matcher():
    assert matches(["a", "...", "d"], ["a", "b", "c", "d"])
    assert matches(["a ... c"], ["a bb c"]) and not matches(["a"], ["a", "b"])
    assert matches(["..."], []) and not matches(["x ... y"], ["x y z"])
