"""Run `python -m strata.cli ...` many times without paying for torch's import each time.

    with CliRunner() as cli:
        result = cli.run(["generate", "hi", "--model", str(ckpt)], timeout=30)
        assert result.status == 2 and result.stderr.count("\\n") == 1

A driver process imports strata and torch once and forks one child per run. The child is what
`python -m strata.cli ARGV` is after its imports: it sets `sys.argv`, the environment, the
working directory and fds 0/1/2 (stdin from bytes or a file, stdout and stderr to files), runs
the `strata.cli` package's `__main__` with `runpy` as `-m` does, and exits with its status; an
exception that escapes prints its traceback and exits 1, as the interpreter would. So the
command's whole path runs, its error path included; only the imports are shared.

Each run has a wall-clock limit (the child is killed past it) and an address-space limit
(RLIMIT_AS, `headroom_bytes` above the child's own at its start), so a size that is not refused
fails its test instead of filling the machine; the result holds the child's time and its peak
RSS above what it started with (`extra_rss_bytes`).
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

DRIVER = r'''
import base64, io, json, os, resource, runpy, signal, sys, time, traceback

import torch  # noqa: F401  (the import the children share)
import strata.cli.main  # noqa: F401
import strata.engine.runtime.load  # noqa: F401

def status_kib(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0

def child(case, out_dir):
    os.chdir(case["cwd"])
    os.environ.clear()
    os.environ.update(case["env"])
    if case.get("stdin_path"):
        fd = os.open(case["stdin_path"], os.O_RDONLY)
    else:
        path = os.path.join(out_dir, "stdin")
        with open(path, "wb") as f:
            f.write(base64.b64decode(case["stdin"]))
        fd = os.open(path, os.O_RDONLY)
    os.dup2(fd, 0)
    for number, name in ((1, "stdout"), (2, "stderr")):
        fd = os.open(os.path.join(out_dir, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, number)
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)),
                                 encoding="utf-8")
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8",
                                  line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8",
                                  errors="backslashreplace", line_buffering=True)
    limit = status_kib("VmSize") * 1024 + case["headroom_bytes"]
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    with open(os.path.join(out_dir, "base_rss_kib"), "w") as f:
        f.write(str(status_kib("VmRSS")))
    sys.argv = ["strata", *[os.fsdecode(base64.b64decode(a)) for a in case["argv"]]]
    status = 1
    try:
        runpy.run_module("strata.cli", run_name="__main__", alter_sys=True)
        status = 0
    except SystemExit as exit_info:
        code = exit_info.code
        status = code if isinstance(code, int) else (0 if code is None else 1)
        if not isinstance(code, int) and code is not None:
            print(code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)

def serve():
    for line in sys.stdin:
        case = json.loads(line)
        out_dir = case["out_dir"]
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:
            try:
                child(case, out_dir)
            finally:
                os._exit(70)
        timed_out = False
        while True:
            done, status, usage = os.wait4(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() - start > case["timeout"]:
                os.kill(pid, signal.SIGKILL)
                done, status, usage = os.wait4(pid, 0)
                timed_out = True
                break
            time.sleep(0.005)
        code = os.waitstatus_to_exitcode(status)
        try:
            with open(os.path.join(out_dir, "base_rss_kib")) as f:
                base_kib = int(f.read())
        except (OSError, ValueError):
            base_kib = 0
        print(json.dumps({"status": code, "seconds": time.monotonic() - start,
                          "timed_out": timed_out,
                          "extra_rss_bytes": max(0, usage.ru_maxrss - base_kib) * 1024}),
              flush=True)

serve()
'''


@dataclass
class CliResult:
    """What one run of the command line did."""

    status: int
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool
    extra_rss_bytes: int

    @property
    def stderr_lines(self) -> list[str]:
        return self.stderr.splitlines()


class CliRunner:
    """The driver process; `run` is one `python -m strata.cli ARGV`."""

    def __init__(self, work_dir: str | os.PathLike[str]) -> None:
        self.work_dir = os.fspath(work_dir)
        self._count = 0
        self._proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> CliRunner:
        self._proc = subprocess.Popen([sys.executable, "-c", DRIVER], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, env=dict(os.environ))
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._proc is not None
        self._proc.stdin.close()
        self._proc.wait(timeout=30)

    def run(self, argv: list[str | bytes | os.PathLike[str]], *, stdin: bytes = b"",
            stdin_path: str | None = None, env: dict[str, str] | None = None,
            cwd: str | None = None, timeout: float = 60.0,
            headroom_bytes: int = 3 << 30) -> CliResult:
        """Run `strata ARGV` (bytes arguments are passed as the bytes of the command line)."""
        assert self._proc is not None and self._proc.poll() is None, "the driver has stopped"
        self._count += 1
        out_dir = os.path.join(self.work_dir, f"run{self._count}")
        os.makedirs(out_dir)
        case: dict[str, Any] = {
            "argv": [base64.b64encode(os.fsencode(a)).decode() for a in argv],
            "stdin": base64.b64encode(stdin).decode(), "stdin_path": stdin_path,
            "env": {**os.environ, **(env or {})}, "cwd": cwd or self.work_dir,
            "timeout": timeout, "headroom_bytes": headroom_bytes, "out_dir": out_dir,
        }
        self._proc.stdin.write(json.dumps(case) + "\n")
        self._proc.stdin.flush()
        reply = json.loads(self._proc.stdout.readline())
        with open(os.path.join(out_dir, "stdout"), encoding="utf-8", errors="replace") as f:
            stdout = f.read()
        with open(os.path.join(out_dir, "stderr"), encoding="utf-8", errors="replace") as f:
            stderr = f.read()
        return CliResult(reply["status"], stdout, stderr, reply["seconds"], reply["timed_out"],
                         reply["extra_rss_bytes"])


def run_subprocess(argv: list[str | bytes | os.PathLike[str]], *, stdin: bytes = b"",
                   env: dict[str, str] | None = None, cwd: str | None = None,
                   timeout: float = 60.0) -> CliResult:
    """`python -m strata.cli ARGV` in a fresh interpreter, as a user runs it."""
    import time

    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "strata.cli", *argv], input=stdin,
                          capture_output=True, env={**os.environ, **(env or {})}, cwd=cwd,
                          timeout=timeout)
    return CliResult(done.returncode, done.stdout.decode(errors="replace"),
                     done.stderr.decode(errors="replace"), time.monotonic() - start, False, 0)
