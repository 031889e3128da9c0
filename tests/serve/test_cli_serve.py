"""`strata serve` as a user runs it, in a process of its own: the key from STRATA_API_KEY, a
free port, and SIGTERM, which refuses the waiting request, finishes the one in flight and exits
with status 0. Bad flags are one line and exit status 2 before anything listens."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

KEY = "sk-from-the-environment"
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # see conftest.one_torch_thread


class Process:
    """`strata serve ARGS` with its stderr read line by line in a thread."""

    def __init__(self, args, env):
        self.proc = subprocess.Popen([sys.executable, "-m", "strata.cli", "serve", *args],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, env={**os.environ, **ONE_THREAD, **env})
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line)

    def wait_for(self, pattern, timeout_s=120.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if found := re.search(pattern, line):
                    return found
            assert self.proc.poll() is None, "".join(self.lines)
            time.sleep(0.05)
        raise AssertionError(f"{pattern!r} never appeared in:\n{''.join(self.lines)}")


def test_sigterm_finishes_the_request_in_flight_and_exits_cleanly(ckpt):
    server = Process(["--model", str(ckpt), "--device", "cpu", "--port", "0", "--model-name",
                      "tiny"], {"STRATA_API_KEY": KEY})
    try:
        port = int(server.wait_for(r"listening on http://127\.0\.0\.1:(\d+)")[1])
        url = f"http://127.0.0.1:{port}"
        server.wait_for(r"tiny is ready")
        assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 401  # no key
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        stream = client.completions.create(model="tiny", prompt="go", max_tokens=3000,
                                           stream=True, temperature=0,
                                           extra_body={"ignore_eos": True},
                                           stream_options={"include_usage": True})
        chunks = [next(stream)]
        refused = {}

        def waiting():
            try:
                client.completions.create(model="tiny", prompt="later", max_tokens=2)
            except openai.APIStatusError as err:
                refused["error"] = err

        waiter = threading.Thread(target=waiting)
        waiter.start()
        keyed = {"Authorization": f"Bearer {KEY}"}
        deadline = time.monotonic() + 30
        while httpx.get(f"{url}/v1/status", headers=keyed, timeout=30).json()[
                "queue"]["waiting"] != 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        server.proc.send_signal(signal.SIGTERM)
        chunks += list(stream)  # the request in flight runs to its end
        waiter.join(60)
        assert server.proc.wait(60) == 0
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    assert chunks[-1].usage.completion_tokens == 3000
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert refused["error"].status_code == 503 and refused["error"].body["code"] == "stopping"
    log = "".join(server.lines)
    assert re.search(r"POST /v1/completions 200 .*new 3000", log), log
    assert "POST /v1/completions 503" in log and "Traceback" not in log
    assert KEY not in log  # the key is never logged


@pytest.mark.parametrize(("flags", "env", "message"), [
    (["--max-queue", "-1"], {}, "--max-queue must be an int >= 0, got -1"),
    (["--port", "70000"], {}, "--port must be in [0, 65535]"),
    (["--api-key", "two words"], {}, "--api-key holds a space"),
    ([], {"STRATA_API_KEY": "clé"}, "STRATA_API_KEY holds a space or a character outside"),
    (["--expert-profile", "/nonexistent/p.npz"], {}, "--expert-profile /nonexistent/p.npz"),
    (["--trace", "t.npz"], {}, "use it with strata generate"),
    (["--max-context", "0"], {}, "--max-context must be an int >= 1"),
])
def test_bad_flags_are_one_line_and_status_2(ckpt, flags, env, message):
    result = subprocess.run([sys.executable, "-m", "strata.cli", "serve", "--model", str(ckpt),
                             "--device", "cpu", *flags], capture_output=True, text=True,
                            timeout=120, env={**os.environ, **ONE_THREAD, **env})
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("strata serve:")]
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert "listening" not in result.stderr and "clé" not in result.stderr
