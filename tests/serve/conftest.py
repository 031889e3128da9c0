"""Real `strata serve` servers for the tests: uvicorn on 127.0.0.1, a free port, in a thread.

`serve_flags(*flags)` starts one configured exactly as `strata serve FLAGS` would be (the
command line's own `prepare`), on the tiny qwen3_moe checkpoint in fp32 on the CPU (the host
memory backend); `serve_loader(load, **options)` starts one on any loader. Each is stopped at
the test's end, as SIGTERM would (the waiting requests refused, the engine closed).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx
import numpy as np
import openai
import pytest
import torch

from strata.cli.main import build_parser
from strata.cli.serve import prepare
from strata.engine.model.config import ModelConfig
from strata.formats.profile import Profile, save_profile
from strata.serve.options import ServeOptions
from strata.serve.server import Server, make_server
from support.checkpoints import cached_checkpoint

MODEL = "tiny"  # the model's name in the API (--model-name)


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The tiny model's ops are too small to share among threads: on a machine of two busy
    cores, torch's spinning thread team made decode rounds 50 times slower (17 tok/s instead
    of 1000). The servers here compute on one; the setting is put back after each test."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def ckpt():
    return cached_checkpoint("qwen3_moe", "tiny", dtype=torch.float32)


@pytest.fixture(scope="session")
def profile(ckpt, tmp_path_factory):
    """A profile of random routing counts for the tiny model (`--expert-profile`)."""
    cfg = ModelConfig.from_dir(ckpt)
    counts = np.random.default_rng(0).integers(1, 1000, (cfg.n_layers, cfg.n_experts))
    path = tmp_path_factory.mktemp("profile") / "tiny.npz"
    save_profile(Profile.for_model(counts, cfg, {}), path)
    return path


class Running:
    """One server running in a thread (see the module's docstring)."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while server.port is None:
            assert self.thread.is_alive() and time.monotonic() < deadline, "did not start"
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{server.port}"
        self.app = server.config.app
        self.worker = server.worker
        self.headers: dict[str, str] = {}  # sent to /v1/status and /metrics (an API key)

    def wait_ready(self, timeout_s: float = 120.0) -> Running:
        deadline = time.monotonic() + timeout_s
        while self.worker.state != "ready":
            assert self.worker.state == "loading", self.worker.error
            assert time.monotonic() < deadline, "the model did not load"
            time.sleep(0.02)
        return self

    def client(self, api_key: str = "none", **kw) -> openai.OpenAI:
        """The official client on this server; it never retries (the tests count answers)."""
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0,
                             timeout=kw.pop("timeout", 120.0), **kw)

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", timeout=30.0, **kw)

    def post(self, path: str, **kw) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", timeout=120.0, **kw)

    def status(self) -> dict:
        response = self.get("/v1/status", headers=self.headers)
        assert response.status_code == 200, response.text
        return response.json()

    def metric(self, name: str, **labels: str) -> float:
        """One sample of /metrics (0 when absent)."""
        text = self.get("/metrics", headers=self.headers).text
        want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"
                       if labels else "")
        for line in text.splitlines():
            if line.startswith(want + " "):
                return float(line.split()[-1])
        return 0.0

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)
        assert not self.thread.is_alive(), "the server did not stop"


class Gate:
    """Holds each long request (`max_tokens` >= LONG) before its HOLD_AT-th decode round
    until `release()`, or until its client leaves: the tests queue other requests behind it
    while it computes, however fast the machine. The engine is the real one; only the
    `should_stop` it is asked before each round is wrapped."""

    LONG, HOLD_AT = 1000, 8

    def __init__(self) -> None:
        self.open = threading.Event()
        self.holding = threading.Event()  # a request is held now
        # ("start" or "end", max_new) of each generation, in the order the engine ran them:
        # the server's own order, which no client's thread scheduling can blur.
        self.ran: list[tuple[str, int]] = []

    def release(self) -> None:
        self.open.set()

    def wrap(self, load: Callable) -> Callable:
        def gated_load():
            served = load()
            generate = served.engine.generate

            def gated_generate(prompt, options, on_text=None, should_stop=None):
                self.ran.append(("start", options.max_new))
                try:
                    return held_generate(prompt, options, on_text, should_stop)
                finally:
                    self.ran.append(("end", options.max_new))

            def held_generate(prompt, options, on_text, should_stop):
                if options.max_new < self.LONG:
                    return generate(prompt, options, on_text, should_stop)
                rounds = [0]

                def held():
                    rounds[0] += 1
                    while rounds[0] >= self.HOLD_AT and not self.open.is_set():
                        self.holding.set()
                        if should_stop():
                            return True
                        time.sleep(0.005)
                    return should_stop()

                return generate(prompt, options, on_text, held)

            served.engine.generate = gated_generate
            return served

        return gated_load


def _serve(ckpt, flags, running, gate=None) -> Running:
    args = build_parser().parse_args(
        ["serve", "--model", str(ckpt), "--device", "cpu", "--port", "0", "--model-name",
         MODEL, "--log-level", "warning", *flags])
    load, options = prepare(args)
    server = Running(make_server(gate.wrap(load) if gate else load, options,
                                 log_level="warning"))
    running.append(server)
    return server


@pytest.fixture
def serve_flags(ckpt):
    """`serve_flags(*flags, ready=True)`: a server started as `strata serve --model CKPT
    --device cpu --port 0 --model-name tiny FLAGS`."""
    running: list[Running] = []

    def start(*flags: str, ready: bool = True) -> Running:
        server = _serve(ckpt, flags, running)
        return server.wait_ready() if ready else server

    yield start
    for server in running:
        server.stop()


@pytest.fixture
def serve_gated(ckpt):
    """`serve_gated(*flags)`: (a server as `serve_flags` starts it, the `Gate` on its long
    requests); the gate is released at the end."""
    running: list[Running] = []
    gates: list[Gate] = []

    def start(*flags: str) -> tuple[Running, Gate]:
        gates.append(Gate())
        return _serve(ckpt, flags, running, gates[-1]).wait_ready(), gates[-1]

    yield start
    for gate in gates:
        gate.release()
    for server in running:
        server.stop()


@pytest.fixture
def serve_loader():
    """`serve_loader(load, **ServeOptions fields)`: a server on any loader (not waited for)."""
    running: list[Running] = []

    def start(load: Callable, **options) -> Running:
        server = Running(make_server(load, ServeOptions(model_name=MODEL, port=0, **options),
                                     log_level="warning"))
        running.append(server)
        return server

    yield start
    for server in running:
        server.stop()
