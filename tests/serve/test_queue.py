"""One request computes at a time, in arrival order, through a bounded queue: the waiting ones
are answered after it, in order; past the queue, 503 with Retry-After; a client that leaves,
mid-stream or while it waits, stops or skips its generation, and the cells it wrote stay as the
live conversation (parked by the next request that leaves it).

A long request is held at a decode round by the gate (conftest.Gate) while the others are
queued behind it, so that the order does not depend on the machine's speed."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

MODEL = "tiny"
LONG = 1200  # max_tokens of the request the gate holds
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def _wait_for(condition, what, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.01)


class Streaming(threading.Thread):
    """A long streamed completion read in a thread: `first` is set at its first chunk,
    `chunks` holds what came."""

    def __init__(self, client):
        super().__init__(daemon=True)
        self.client = client
        self.first = threading.Event()
        self.chunks, self.error = [], None

    def run(self):
        try:
            for chunk in self.client.completions.create(
                    model=MODEL, prompt="a long story", max_tokens=LONG, stream=True,
                    stream_options={"include_usage": True}, **GREEDY):
                self.chunks.append(chunk)
                self.first.set()
        except Exception as err:  # the test reads it
            self.error = err
            self.first.set()


class Asking(threading.Thread):
    """One short whole completion of `max_tokens` in a thread."""

    def __init__(self, client, prompt, max_tokens=3):
        super().__init__(daemon=True)
        self.client, self.prompt, self.max_tokens = client, prompt, max_tokens
        self.answer = self.error = None

    def run(self):
        try:
            self.answer = self.client.completions.create(model=MODEL, prompt=self.prompt,
                                                         max_tokens=self.max_tokens)
        except Exception as err:
            self.error = err


def _hold_a_long_one(server, gate):
    long = Streaming(server.client())
    long.start()
    assert gate.holding.wait(60) and long.error is None
    return long


def test_clients_at_once_are_answered_one_after_the_other_in_order(serve_gated):
    server, gate = serve_gated()
    long = _hold_a_long_one(server, gate)
    second = Asking(server.client(), "second", max_tokens=3)
    second.start()
    _wait_for(lambda: server.status()["queue"]["waiting"] == 1, "the second waits")
    third = Asking(server.client(), "third", max_tokens=4)
    third.start()
    _wait_for(lambda: server.status()["queue"]["waiting"] == 2, "the third waits behind it")
    assert server.status()["queue"]["computing"]
    gate.release()
    for thread in (long, second, third):
        thread.join(120)
    assert long.error is second.error is third.error is None
    assert long.chunks[-1].usage.completion_tokens == LONG  # not cut short by the others
    # One at a time, in arrival order: the engine's own record (the clients' threads may read
    # their answers in another order than the server sent them).
    assert gate.ran == [("start", LONG), ("end", LONG), ("start", 3), ("end", 3),
                        ("start", 4), ("end", 4)]
    assert second.answer.choices[0].finish_reason and third.answer.choices[0].finish_reason


def test_past_the_queue_is_503_with_retry_after(serve_gated):
    server, gate = serve_gated("--max-queue", "1")
    long = _hold_a_long_one(server, gate)
    waiting = Asking(server.client(), "waits")
    waiting.start()
    _wait_for(lambda: server.status()["queue"]["waiting"] == 1, "one waits")
    with pytest.raises(openai.APIStatusError) as refused:
        server.client().completions.create(model=MODEL, prompt="one too many", max_tokens=2)
    assert refused.value.status_code == 503
    assert refused.value.response.headers["retry-after"] == "1"
    assert refused.value.body["code"] == "queue_full" and "--max-queue 1" in \
        refused.value.body["message"]
    gate.release()
    long.join(120)
    waiting.join(120)
    assert waiting.error is None and waiting.answer.usage.completion_tokens >= 1
    assert server.metric("strata_http_requests_total", route="/v1/completions",
                         status="503") == 1


def test_a_client_that_leaves_mid_stream_stops_its_generation(serve_gated):
    server, gate = serve_gated()
    body = {"model": MODEL, "prompt": "never read to the end", "max_tokens": LONG,
            "stream": True, "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()  # kept: a dropped iterator would close the connection now
        assert next(line for line in lines if line.startswith("data: "))
        assert gate.holding.wait(60)
    # Leaving the block closed the connection while the generation was held: it stops there.
    _wait_for(lambda: server.status()["last_request"] is not None, "the request ended")
    status = server.status()
    last = status["last_request"]
    assert last["stopped"] and last["completion_tokens"] == gate.HOLD_AT
    # Its cells are kept as the live conversation: the prompt and all but the last token.
    assert status["live_conversation_tokens"] == \
        last["prompt_tokens"] + last["completion_tokens"] - 1
    parked = status["events"]["parked"]
    server.client().completions.create(model=MODEL, prompt=[250, 251], max_tokens=2)
    status = server.status()
    assert status["events"]["parked"] == parked + 1 and status["conversations"]["parked"] >= 1


def test_a_client_that_leaves_while_waiting_is_skipped(serve_gated):
    server, gate = serve_gated()
    long = _hold_a_long_one(server, gate)
    with pytest.raises(openai.APITimeoutError):
        server.client(timeout=0.5).completions.create(model=MODEL, prompt="gone", max_tokens=2)
    _wait_for(lambda: server.status()["queue"]["waiting"] == 0, "the one that left leaves")
    gate.release()
    long.join(120)
    assert long.error is None
    _wait_for(lambda: server.status()["requests_completed"] == 1, "the long one ends")
    time.sleep(0.2)
    assert server.status()["requests_completed"] == 1  # the one that left never ran
