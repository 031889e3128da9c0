"""The two answer shapes: a chat completion and a text completion, whole or as chunks.

A reply is built from the same pieces either way: its text, how it ended and its usage, with
the token ids when the request asked for them (`return_token_ids`). `ChatShape` and
`CompletionShape` turn those into the OpenAI API's bodies; `replies` decides when.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from pydantic import BaseModel

from strata.serve.jobs import Finished
from strata.serve.prompts import Work
from strata.serve.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChoice,
    Delta,
    PromptTokensDetails,
    Usage,
)

__all__ = ["ChatShape", "CompletionShape", "Shape", "dump", "usage_of"]


def usage_of(result: Any) -> Usage:
    """The usage of a `GenerateResult`: cached tokens are the ones the engine reused."""
    completion = len(result.tokens)
    return Usage(prompt_tokens=result.prompt_tokens, completion_tokens=completion,
                 total_tokens=result.prompt_tokens + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=result.reused_tokens))


class Shape:
    prefix = ""

    def __init__(self, model: str, work: Work) -> None:
        self.model, self.work = model, work
        self.id = f"{self.prefix}-{secrets.token_hex(12)}"
        self.created = int(time.time())

    def _ids(self, finished: Finished) -> dict[str, Any]:
        """The token ids beside the text, when asked for (vLLM's `return_token_ids`)."""
        if not self.work.return_token_ids:
            return {}
        return {"token_ids": list(finished.result.tokens)}

    def _prompt_ids(self) -> list[int] | None:
        return list(self.work.prompt) if self.work.return_token_ids else None

    def first(self) -> BaseModel | None:
        """The chunk that opens a stream (None: none)."""
        return None

    def piece(self, text: str) -> BaseModel:
        raise NotImplementedError

    def last(self, finished: Finished) -> BaseModel:
        raise NotImplementedError

    def usage(self, finished: Finished) -> BaseModel:
        raise NotImplementedError

    def whole(self, text: str, finished: Finished) -> BaseModel:
        raise NotImplementedError


class ChatShape(Shape):
    """`chat.completion` and `chat.completion.chunk` bodies."""

    prefix = "chatcmpl"

    def _chunk(self, choices: list[ChatChunkChoice], **fields: Any) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                   choices=choices, **fields)

    def first(self) -> BaseModel:
        return self._chunk([ChatChunkChoice(delta=Delta(role="assistant", content=""))],
                           prompt_token_ids=self._prompt_ids())

    def piece(self, text: str) -> BaseModel:
        return self._chunk([ChatChunkChoice(delta=Delta(content=text))])

    def last(self, finished: Finished) -> BaseModel:
        return self._chunk([ChatChunkChoice(delta=Delta(), finish_reason=finished.finish_reason,
                                            **self._ids(finished))])

    def usage(self, finished: Finished) -> BaseModel:
        return self._chunk([], usage=usage_of(finished.result))

    def whole(self, text: str, finished: Finished) -> BaseModel:
        choice = ChatChoice(message=AssistantMessage(content=text),
                            finish_reason=finished.finish_reason, **self._ids(finished))
        return ChatCompletion(id=self.id, created=self.created, model=self.model,
                              choices=[choice], usage=usage_of(finished.result),
                              prompt_token_ids=self._prompt_ids())


class CompletionShape(Shape):
    """`text_completion` bodies, whole and as chunks."""

    prefix = "cmpl"

    def _body(self, choices: list[CompletionChoice], **fields: Any) -> Completion:
        return Completion(id=self.id, created=self.created, model=self.model, choices=choices,
                          **fields)

    def first(self) -> BaseModel | None:
        if not self.work.return_token_ids:
            return None
        return self._body([CompletionChoice(text="")], prompt_token_ids=self._prompt_ids())

    def piece(self, text: str) -> BaseModel:
        return self._body([CompletionChoice(text=text)])

    def last(self, finished: Finished) -> BaseModel:
        return self._body([CompletionChoice(text="", finish_reason=finished.finish_reason,
                                            **self._ids(finished))])

    def usage(self, finished: Finished) -> BaseModel:
        return self._body([], usage=usage_of(finished.result))

    def whole(self, text: str, finished: Finished) -> BaseModel:
        choice = CompletionChoice(text=text, finish_reason=finished.finish_reason,
                                  **self._ids(finished))
        return self._body([choice], usage=usage_of(finished.result),
                          prompt_token_ids=self._prompt_ids())


# Fields of vLLM's extensions: left out of a body unless the request asked for them.
_EXTENSIONS = ("prompt_token_ids", "token_ids")


def dump(body: BaseModel) -> dict[str, Any]:
    """A body as JSON values, the extensions' fields left out where they are None."""
    document = body.model_dump(mode="json")
    for part in (document, *document.get("choices", ())):
        for key in _EXTENSIONS:
            if part.get(key, 0) is None:
                del part[key]
    return document
