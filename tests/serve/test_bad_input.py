"""Bad input gets a 4xx with an OpenAI-style error body that names the field and what would be
right, and the server keeps serving with nothing lost: the conversation parked before the bad
requests is restored after them."""

from __future__ import annotations

import httpx
import openai
import pytest

MODEL = "tiny"
WINDOW = 256
USER = [{"role": "user", "content": "hi"}]
LONG_IDS = [3 + i % 250 for i in range(WINDOW + 40)]

# (what, endpoint, body, status, param, code, words the message holds). A body of bytes is
# sent as it is; a dict through the openai client (which sends what it is given).
CASES = [
    ("malformed JSON", "chat", b'{"model": "tiny", "messages": [', 400, None, None,
     "not valid JSON"),
    ("a body that is not an object", "chat", b"[1, 2, 3]", 400, None, None,
     "must be a JSON object"),
    ("max_tokens of the wrong type", "chat", {"messages": USER, "max_tokens": "lots"}, 400,
     "max_tokens", "invalid_value", "valid integer"),
    ("messages of the wrong type", "chat", {"messages": "hi"}, 400, "messages",
     "invalid_value", "valid list"),
    ("a role no template knows", "chat", {"messages": [{"role": "robot", "content": "x"}]},
     400, "messages.0.role", "invalid_value", "'user'"),
    ("content of the wrong type", "chat", {"messages": [{"role": "user", "content": 5}]},
     400, "messages.0.content", "invalid_value", "must be str or list[TextPart] (got 5)"),
    ("a prompt of booleans", "completions", {"prompt": [True, 2]}, 400, "prompt",
     "invalid_value", "must be str, list[int], list[str] or list[list[int]]"),
    ("a temperature given as text", "chat", {"messages": USER, "temperature": "hot"}, 400,
     "temperature", "invalid_value", "valid number"),
    ("stream given as text", "completions", {"prompt": "a", "stream": "yes"}, 400, "stream",
     "invalid_value", "valid boolean"),
    ("messages missing", "chat", b'{"model": "tiny"}', 400, "messages", "missing",
     "Field required"),
    ("an empty message list", "chat", {"messages": []}, 400, "messages", None,
     "at least one message"),
    ("an unknown model", "chat", {"model": "gpt-4o", "messages": USER}, 404, "model",
     "model_not_found", "serves 'tiny'"),
    ("a prompt longer than the window", "completions", {"prompt": LONG_IDS}, 400, "prompt",
     "context_length_exceeded", f"at most {WINDOW - 1} tokens"),
    ("a chat longer than the window", "chat",
     {"messages": [{"role": "user", "content": "y" * (WINDOW + 10)}]}, 400, "messages",
     "context_length_exceeded", "shorten it"),
    ("max_tokens that cannot fit", "completions",
     {"prompt": LONG_IDS[:200], "max_tokens": 100}, 400, "max_tokens",
     "context_length_exceeded", f"give max_tokens <= {WINDOW - 200}"),
    ("max_tokens below 1", "chat", {"messages": USER, "max_tokens": 0}, 400, "max_tokens",
     "invalid_value", "greater than or equal to 1"),
    ("a temperature past 2", "chat", {"messages": USER, "temperature": 5}, 400,
     "temperature", "invalid_value", "less than or equal to 2"),
    ("a negative seed", "completions", {"prompt": "a", "seed": -1}, 400, "seed",
     "invalid_value", "greater than or equal to 0"),
    ("n above 1", "chat", {"messages": USER, "n": 2}, 400, "n", "unsupported_parameter",
     "one choice per request"),
    ("a token id past the vocabulary", "completions", {"prompt": [1, 2, 100000]}, 400,
     "prompt", None, "outside the model's vocabulary"),
    ("an empty prompt", "completions", {"prompt": ""}, 400, "prompt", None, "empty"),
    ("two prompts at once", "completions", {"prompt": ["a", "b"]}, 400, "prompt", None,
     "one prompt a request"),
    ("five stop strings", "chat", {"messages": USER, "stop": list("abcde")}, 400, "stop",
     None, "at most 4"),
]


def _send(server, endpoint, body):
    """(status, error object) of one bad request."""
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    if isinstance(body, bytes):
        response = httpx.post(server.url + path, content=body, timeout=30,
                              headers={"Content-Type": "application/json"})
        return response.status_code, response.json()
    client = server.client()
    create = client.chat.completions.create if endpoint == "chat" else \
        client.completions.create
    with pytest.raises(openai.APIStatusError) as caught:
        create(**{"model": MODEL, **body})
    return caught.value.status_code, {"error": caught.value.body}


def test_each_bad_input_is_a_4xx_naming_it_and_nothing_is_lost(serve_flags):
    server = serve_flags("--max-context", str(WINDOW), "--conversation-cache-mib", "4",
                         "--conversation-cache-slots", "2")
    client = server.client()
    # A conversation, parked by the request after it (which shares nothing with it).
    first = client.completions.create(model=MODEL, prompt=list(range(3, 83)), max_tokens=6,
                                      temperature=0, extra_body={"ignore_eos": True,
                                                                 "return_token_ids": True})
    client.completions.create(model=MODEL, prompt=[200, 201, 202], max_tokens=2)
    assert server.status()["conversations"]["parked"] == 1
    for what, endpoint, body, status, param, code, words in CASES:
        got, document = _send(server, endpoint, body)
        error = document["error"]
        assert set(error) == {"message", "type", "param", "code"}, what
        assert (got, error["param"], error["code"]) == (status, param, code), (what, error)
        assert error["type"] == "invalid_request_error", what
        assert words in error["message"], (what, error["message"])
    # Still serving; the parked conversation was kept and continues where it was.
    assert server.get("/health").status_code == 200
    follow = list(range(3, 83)) + first.choices[0].token_ids[:-1] + [9]
    after = client.completions.create(model=MODEL, prompt=follow, max_tokens=2)
    assert after.usage.prompt_tokens_details.cached_tokens == len(follow) - 1
    assert server.status()["events"]["restored"] == 1


def test_the_most_max_tokens_the_message_names_fits(serve_flags):
    server = serve_flags("--max-context", str(WINDOW))
    client = server.client()
    prompt = LONG_IDS[:200]
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=WINDOW)
    most = int(caught.value.body["message"].rsplit("<= ", 1)[1])
    done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=most,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == most == WINDOW - len(prompt)


def test_unknown_routes_and_methods(serve_flags):
    server = serve_flags()
    missing = server.get("/v1/engines")
    assert missing.status_code == 404
    assert "/v1/chat/completions" in missing.json()["error"]["message"]
    wrong = httpx.delete(server.url + "/v1/models", timeout=30)
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"
