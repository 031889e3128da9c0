"""Request and response bodies as typed models, in the OpenAI API's shapes.

Requests: `ChatCompletionRequest` (`POST /v1/chat/completions`) and `CompletionRequest`
(`POST /v1/completions`). Fields a client may send that strata does not use are ignored, except
those whose non-default value would change the answer (`n`, `logprobs`, `tools`, ...): those are
refused by name (`strata.serve.prompts`). Two of vLLM's extensions are taken: `ignore_eos`
(generate `max_tokens` tokens whatever the model says) and `return_token_ids` (the ids of the
prompt and of the completion, beside the text), so that a client can continue a conversation
token for token.

Responses: `ChatCompletion` / `ChatCompletionChunk`, `Completion` / `CompletionChunk`, `Usage`
(with `prompt_tokens_details.cached_tokens`: the prompt tokens the engine's K/V held already,
read by no forward), `ModelList`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatMessage",
    "Completion",
    "CompletionChunk",
    "CompletionRequest",
    "ModelCard",
    "ModelList",
    "Usage",
]

MAX_SEED = 2**63  # the sampler's generator takes seeds in [0, 2**63)


class _Request(BaseModel):
    # Other fields are kept (`model_extra`) so that `prompts` can refuse those it cannot honour.
    model_config = ConfigDict(extra="allow", strict=True)


class TextPart(BaseModel):
    """One part of a message's content given as a list; only text parts are understood."""

    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    """One message of a chat. `developer` is rendered as `system` (templates know that)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart]
    name: str | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(_Request):
    """The fields both endpoints share. None means the default: `max_tokens` the server's
    `--max-new` (less where the window has less room), `temperature` 1, `top_p` 1, `seed` a
    fresh one (sampling is then not repeatable)."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = Field(default=None, ge=0, lt=MAX_SEED)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False


class ChatCompletionRequest(_Sampling):
    """`POST /v1/chat/completions`: `messages` rendered by the checkpoint's chat template.
    `max_completion_tokens` is the newer name of `max_tokens`."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=1)


class CompletionRequest(_Sampling):
    """`POST /v1/completions`: `prompt` as text or token ids (one prompt a request)."""

    prompt: str | list[int] | list[str] | list[list[int]]


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    """Tokens of one request: `prompt_tokens_details.cached_tokens` of the prompt were reused
    from the K/V (the live or a restored conversation), not read again."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: Literal["stop", "length"]
    token_ids: list[int] | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: Literal["stop", "length"] | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: Literal["stop", "length"] | None = None
    token_ids: list[int] | None = None


class Completion(BaseModel):
    """A whole completion, and each chunk of a streamed one (`object` is the same)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None


CompletionChunk = Completion


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "strata"
    max_model_len: int  # the window, in tokens (vLLM's name)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
