"""The OpenAI-compatible API through the official `openai` client, on a real server: chat and
completions (whole and streamed), models, stop strings, seeds, the API key, /health while
loading, one log line per request."""

from __future__ import annotations

import json
import logging
import re
import threading
import time

import httpx
import openai
import pytest

from strata.engine.model.tokenizer import Tokenizer

MODEL = "tiny"
HELLO = [{"role": "user", "content": "Hello there"}]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def test_chat_whole_and_streamed(serve_flags, ckpt):
    server = serve_flags()
    client = server.client()
    prompt_tokens = len(Tokenizer.from_dir(ckpt).encode_chat(HELLO))
    whole = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, **GREEDY)
    assert whole.object == "chat.completion" and whole.model == MODEL
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (prompt_tokens, 8)
    assert whole.usage.total_tokens == prompt_tokens + 8
    assert whole.usage.prompt_tokens_details.cached_tokens == 0  # a fresh engine
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=8, stream=True,
        stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content  # greedy: the same reply
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 8
    # The same prompt again: the engine's K/V holds all of it but the last token, which is
    # always read again (its logits give the first new token).
    assert usage.prompt_tokens_details.cached_tokens == prompt_tokens - 1


def test_a_chat_s_next_turn_reuses_the_conversation(serve_flags):
    client = serve_flags().client()
    first = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6, **GREEDY)
    turn = [*HELLO, {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "And then?"}]
    second = client.chat.completions.create(model=MODEL, messages=turn, max_tokens=6, **GREEDY)
    # At least the first turn's prompt is not read again (the template may render the reply's
    # end differently from how generation stopped: prefix reuse, not exact extension).
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens <= cached < second.usage.prompt_tokens


def test_the_stream_is_server_sent_events_ending_in_done(serve_flags):
    server = serve_flags()
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 4, "stream": True,
            "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in c or c["usage"] is None for c in chunks)  # not asked for


def test_completions_of_text_and_of_token_ids(serve_flags, ckpt):
    client = serve_flags().client()
    ids = Tokenizer.from_dir(ckpt).encode("The quick brown fox")
    by_text = client.completions.create(model=MODEL, prompt="The quick brown fox",
                                        max_tokens=6, **GREEDY)
    extra = {"ignore_eos": True, "return_token_ids": True}
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0,
                                       extra_body=extra)
    assert by_text.object == "text_completion" and by_text.choices[0].finish_reason == "length"
    assert by_text.choices[0].text == by_ids.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids) and by_ids.usage.completion_tokens == 6
    assert by_ids.prompt_token_ids == ids and len(by_ids.choices[0].token_ids) == 6
    streamed = list(client.completions.create(model=MODEL, prompt=ids, max_tokens=6,
                                              temperature=0, stream=True, extra_body=extra))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == by_ids.choices[0].text
    assert streamed[-1].choices[0].token_ids == by_ids.choices[0].token_ids


def test_models_lists_the_one_model_and_its_window(serve_flags):
    models = serve_flags("--max-context", "1024").client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].owned_by == "strata" and models.data[0].max_model_len == 1024


def test_a_stop_string_ends_the_reply_and_is_cut(serve_flags):
    client = serve_flags().client()
    full = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=40, **GREEDY)
    text = full.choices[0].text
    stop = text[10:12]  # a string the greedy reply holds
    expected = text[: text.find(stop)]
    whole = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=40,
                                      stop=[stop, "never in it \u2603"], **GREEDY)
    assert whole.choices[0].text == expected and whole.choices[0].finish_reason == "stop"
    assert whole.usage.completion_tokens < 40  # generation ended there
    streamed = list(client.completions.create(model=MODEL, prompt="Once upon", max_tokens=40,
                                              stop=stop, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_a_seed_makes_sampling_repeatable(serve_flags):
    client = serve_flags().client()

    def sample(seed):
        return client.completions.create(model=MODEL, prompt="x", max_tokens=12, seed=seed,
                                         temperature=1.0, top_p=0.9,
                                         extra_body={"ignore_eos": True}).choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(seed) for seed in (1, 2, 3)}) > 1  # the seed changes the draws


def test_the_api_key(serve_flags):
    server = serve_flags("--api-key", "sk-test-123")
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 2}
    missing = server.post("/v1/chat/completions", json=body)
    assert missing.status_code == 401
    assert missing.json()["error"]["code"] == "missing_api_key"
    assert "Authorization: Bearer" in missing.json()["error"]["message"]
    with pytest.raises(openai.AuthenticationError) as wrong:
        server.client(api_key="sk-wrong").chat.completions.create(model=MODEL, messages=HELLO)
    assert wrong.value.status_code == 401 and wrong.value.body["code"] == "invalid_api_key"
    assert "sk-test-123" not in wrong.value.body["message"]  # the key is never told
    right = server.client(api_key="sk-test-123")
    assert right.models.list().data[0].id == MODEL
    assert right.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2).choices
    for path in ("/v1/status", "/metrics", "/v1/models"):
        assert server.get(path).status_code == 401, path
    assert server.get("/health").status_code == 200  # load balancers ask without a key
    keyed = {"Authorization": "Bearer sk-test-123"}
    assert server.get("/metrics", headers=keyed).status_code == 200


def test_health_is_503_while_loading_then_200(serve_loader, ckpt):
    from strata.cli.main import build_parser
    from strata.cli.serve import prepare

    load, _ = prepare(build_parser().parse_args(["serve", "--model", str(ckpt), "--device",
                                                 "cpu"]))
    release = threading.Event()

    def slow_load():
        assert release.wait(60)
        return load()

    server = serve_loader(slow_load)
    loading = server.get("/health")
    assert loading.status_code == 503 and loading.json()["status"] == "loading"
    with pytest.raises(openai.APIStatusError) as early:
        server.client().chat.completions.create(model=MODEL, messages=HELLO)
    assert early.value.status_code == 503 and early.value.body["code"] == "loading"
    assert early.value.response.headers["retry-after"] == "1"
    release.set()
    server.wait_ready()
    assert server.get("/health").json() == {"status": "ok", "model": MODEL}


def test_a_model_that_fails_to_load_stops_the_server(serve_loader):
    def broken():
        raise ValueError("--vram-budget-mib 1 holds no expert")

    server = serve_loader(broken)
    server.thread.join(30)
    assert not server.thread.is_alive()  # it stopped by itself
    assert server.worker.state == "failed" and "holds no expert" in str(server.worker.error)


def test_one_log_line_per_request(serve_flags, caplog):
    caplog.set_level(logging.INFO, logger="strata.serve")
    server = serve_flags()
    client = server.client()
    client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5, **GREEDY)
    client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5, **GREEDY)
    server.post("/v1/completions", content=b"{oops")
    # The middleware logs once the response's last byte is sent, so a line may land just
    # after the client has its answer: wait for the three (at most 10 s).
    deadline = time.monotonic() + 10.0
    while True:
        lines = [r.getMessage() for r in caplog.records if r.name == "strata.serve"]
        if len([line for line in lines if line.startswith("POST ")]) >= 3 \
                or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    chats = [line for line in lines if line.startswith("POST /v1/chat/completions")]
    assert len(chats) == 2
    pattern = (r"POST /v1/chat/completions 200 [\d.]+ s: prompt (\d+) \(reused (\d+)\), new 5, "
               r"queued [\d.]+ s, ttft [\d.]+ s, [\d.]+ tok/s, length")
    first, second = (re.fullmatch(pattern, line) for line in chats)
    assert first and second and int(second[2]) == int(second[1]) - 1
    assert [line for line in lines if line.startswith("POST /v1/completions 400")]
