"""What a request asks of the engine: its prompt ids and generation options, checked.

Every check a request can fail is made here, before it waits in the queue, so that bad input
is answered at once with a 400 (or 404 for a model the server does not serve) that names the
field, and the engine only ever sees requests it can run. A chat is rendered by the
checkpoint's chat template (`Tokenizer.encode_chat`); a completion's prompt is text or ids.
The window holds the prompt and every token generated: a prompt that leaves no room, or a
`max_tokens` that cannot fit beside it, is refused with the most that would fit.
"""

from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass
from typing import Any

from strata.engine.model.tokenizer import TokenizerError
from strata.engine.runtime.generate import GenerateOptions
from strata.serve.errors import ApiError
from strata.serve.options import ServedModel, ServeOptions
from strata.serve.schemas import ChatCompletionRequest, CompletionRequest

__all__ = ["MAX_STOPS", "Work", "chat_work", "completion_work"]

MAX_STOPS = 4  # stop strings a request may give, as in the OpenAI API
CHAT_SOURCE = ("messages", "the messages rendered by the chat template")

# Fields strata does not implement, with the value that asks nothing of it: a request may send
# them with that value (clients often do), any other value is refused by name.
UNSUPPORTED: dict[str, tuple[object, str]] = {
    "n": (1, "one choice per request"),
    "best_of": (1, "one choice per request"),
    "echo": (False, "the prompt is not echoed"),
    "logprobs": (False, "no log probabilities"),
    "top_logprobs": (0, "no log probabilities"),
    "logit_bias": ({}, "no logit bias"),
    "frequency_penalty": (0, "no penalties"),
    "presence_penalty": (0, "no penalties"),
    "suffix": ("", "no insertion"),
    "tools": ([], "no tool calls"),
    "functions": ([], "no function calls"),
    "response_format": ({"type": "text"}, "plain text only"),
}


@dataclass(frozen=True)
class Work:
    """A checked request: the prompt's ids, the engine's options for it, the stop strings
    (cut from the text), and how the answer is shaped."""

    prompt: list[int]
    options: GenerateOptions
    stops: tuple[str, ...]
    stream: bool
    include_usage: bool
    return_token_ids: bool
    user: str | None


def _check_model(name: str, options: ServeOptions) -> None:
    if name != options.model_name:
        raise ApiError(404, f"the model {name!r} is not served here; this server serves "
                       f"{options.model_name!r} (GET /v1/models lists it)", param="model",
                       code="model_not_found")


def _check_unsupported(extra: dict[str, Any] | None) -> None:
    for name, value in (extra or {}).items():
        if name in UNSUPPORTED and value is not None:
            default, what = UNSUPPORTED[name]
            if value != default and not (default in (0, False) and value in (0, False)):
                raise ApiError(400, f"{name} {value!r} is not supported by strata serve "
                               f"({what}); leave it out or give {default!r}", param=name,
                               code="unsupported_parameter")


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOPS:
        raise ApiError(400, f"stop has {len(stops)} strings; give at most {MAX_STOPS}",
                       param="stop")
    if any(s == "" for s in stops):
        raise ApiError(400, "stop holds an empty string, which would end every reply at once; "
                       "give non-empty strings", param="stop")
    return tuple(stops)


def _fit(prompt: list[int], asked: int | None, param: str, source: tuple[str, str],
         served: ServedModel, options: ServeOptions) -> int:
    """The tokens the request may generate: `asked` (the field `param`), or the server's
    default; 400 when the prompt leaves no room in the window, or `asked` cannot fit beside it.
    `source`: the field the prompt came from, and how it was made (for the message)."""
    field, what = source
    window, n = served.engine.max_context, len(prompt)
    room = window - n
    if room < 1:
        raise ApiError(400, f"the prompt is {n} tokens ({what}); the window of {window} "
                       f"tokens (the server's --max-context) holds a prompt of at most "
                       f"{window - 1} tokens and its reply: shorten it",
                       param=field, code="context_length_exceeded")
    if asked is None:
        return min(options.default_max_tokens, room)
    if asked > room:
        raise ApiError(400, f"{param} {asked} cannot fit: the prompt is {n} tokens ({what}), "
                       f"and {n} + {asked} = {n + asked} exceed the window of {window} tokens; "
                       f"give {param} <= {room}", param=param, code="context_length_exceeded")
    return asked


def _work(body: Any, prompt: list[int], asked: int | None, param: str,
          source: tuple[str, str], served: ServedModel, options: ServeOptions) -> Work:
    if not prompt:
        raise ApiError(400, f"the prompt is empty (0 tokens); give at least one token in "
                       f"{source[0]}", param=source[0])
    max_new = _fit(prompt, asked, param, source, served, options)
    seed = body.seed if body.seed is not None else secrets.randbelow(2**63)
    generate = dataclasses.replace(
        served.defaults, max_new=max_new,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p, seed=seed,
        ignore_stop=body.ignore_eos)
    return Work(prompt=prompt, options=generate, stops=_stops(body.stop),
                stream=bool(body.stream),
                include_usage=bool(body.stream_options and body.stream_options.include_usage),
                return_token_ids=body.return_token_ids, user=body.user)


def _message(message: Any) -> dict[str, str]:
    content = message.content
    if not isinstance(content, str):
        content = "".join(part.text for part in content)
    role = "system" if message.role == "developer" else message.role
    return {"role": role, "content": content}


def chat_work(body: ChatCompletionRequest, served: ServedModel, options: ServeOptions) -> Work:
    """The checked work of a chat request (see the module's docstring); ApiError if bad."""
    _check_model(body.model, options)
    _check_unsupported(body.model_extra)
    if not body.messages:
        raise ApiError(400, "messages is empty; give at least one message, e.g. "
                       '[{"role": "user", "content": "Hello"}]', param="messages")
    messages = [_message(m) for m in body.messages]
    try:
        prompt = served.engine.tokenizer.encode_chat(messages)
    except TokenizerError as err:  # the template refused these messages (order, roles, ...)
        raise ApiError(400, f"messages: {err}", param="messages") from None
    if body.max_tokens is not None and body.max_completion_tokens is not None \
            and body.max_tokens != body.max_completion_tokens:
        raise ApiError(400, "max_tokens and max_completion_tokens disagree; give one of them",
                       param="max_completion_tokens")
    asked, param = (body.max_completion_tokens, "max_completion_tokens") \
        if body.max_completion_tokens is not None else (body.max_tokens, "max_tokens")
    return _work(body, prompt, asked, param, CHAT_SOURCE, served, options)


def _prompt_ids(prompt: Any, served: ServedModel) -> list[int]:
    """The ids of a completion's prompt: text encoded, or ids checked against the vocabulary."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        raise ApiError(400, f"prompt holds {len(prompt)} prompts; strata serve answers one "
                       "prompt a request: send them one by one", param="prompt")
    if isinstance(prompt, str):
        return served.engine.tokenizer.encode(prompt)
    vocab = served.engine.model.config.vocab_size
    bad = [i for i in prompt if not 0 <= i < vocab]
    if bad:
        raise ApiError(400, f"prompt token id {bad[0]} is outside the model's vocabulary "
                       f"[0, {vocab})", param="prompt")
    return list(prompt)


def completion_work(body: CompletionRequest, served: ServedModel,
                    options: ServeOptions) -> Work:
    """The checked work of a completion request; ApiError if bad."""
    _check_model(body.model, options)
    _check_unsupported(body.model_extra)
    try:
        prompt = _prompt_ids(body.prompt, served)
    except TokenizerError as err:
        raise ApiError(400, f"prompt: {err}", param="prompt") from None
    text = isinstance(body.prompt, str) or (bool(body.prompt) and isinstance(body.prompt[0], str))
    source = ("prompt", "the prompt's text encoded" if text else "the prompt's token ids")
    return _work(body, prompt, body.max_tokens, "max_tokens", source, served, options)
