"""`ServeOptions`: how the server listens and admits requests; `ServedModel`: what it serves.

The command line (`strata serve`) builds both: the options from its flags, and a loader that
returns the `ServedModel` (the engine, and the generation options every request starts from).
The server calls the loader on its engine thread after it starts listening, so `/health`
answers 503 while a large checkpoint loads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from strata.engine.runtime.engine import Engine
    from strata.engine.runtime.generate import GenerateOptions

__all__ = ["LOG_LEVELS", "ServeOptions", "ServedModel", "check_api_key"]

LOG_LEVELS = ("debug", "info", "warning", "error")  # --log-level; info: a line per request

# What an HTTP header can carry of a bearer token: visible ASCII, no spaces.
_KEY_CHARACTERS = frozenset(chr(c) for c in range(0x21, 0x7F))


def check_api_key(key: str | None, where: str) -> str | None:
    """`key` if it can travel as `Authorization: Bearer KEY`; ValueError naming `where` (the
    flag or variable it came from) and the first bad character's position, never the key."""
    if key is None:
        return None
    if key == "":
        raise ValueError(f"{where} is empty; give a key, or leave it out to serve without one")
    for i, character in enumerate(key):
        if character not in _KEY_CHARACTERS:
            raise ValueError(f"{where} holds a space or a character outside visible ASCII at "
                             f"position {i}; an API key travels in an HTTP header, so use "
                             "letters, digits and punctuation only")
    return key


def _count(value: object, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


@dataclass(frozen=True)
class ServeOptions:
    """How the server listens and admits requests. ValueError naming the flag for a bad value.

    `model_name`: the id `/v1/models` lists and requests must name. `port` 0 takes a free
    port (the log says which). `api_key`: the bearer key every /v1 and /metrics request must
    carry (None: none). `max_queue`: requests that may wait behind the one computing; more
    get 503 with `Retry-After: retry_after_s`. `default_max_tokens`: what a request that sets no
    `max_tokens` may generate (less where the window has less room).
    """

    model_name: str
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = field(default=None, repr=False)  # a secret: kept out of reprs
    max_queue: int = 16
    default_max_tokens: int = 512
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.model_name, str) or not self.model_name.strip():
            raise ValueError(f"--model-name must be a non-empty name, got {self.model_name!r}")
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"--host must be an address to listen on, got {self.host!r}")
        if not _count(self.port, 0) or self.port > 65535:
            raise ValueError(f"--port must be in [0, 65535] (0: a free port), got {self.port!r}")
        for flag, value, low in (("--max-queue", self.max_queue, 0),
                                 ("--max-new", self.default_max_tokens, 1),
                                 ("retry_after_s", self.retry_after_s, 1)):
            if not _count(value, low):
                raise ValueError(f"{flag} must be an int >= {low}, got {value!r}")
        check_api_key(self.api_key, "--api-key")


@dataclass(frozen=True)
class ServedModel:
    """What the server runs requests on: the engine (with its tokenizer: chat needs its
    template) and `defaults`, the generation options every request starts from (stop ids,
    prompt chunk, CUDA graphs); a request sets max_new, temperature, top_p and seed. The engine
    is closed by the server when it stops."""

    engine: Engine
    defaults: GenerateOptions

    def __post_init__(self) -> None:
        if self.engine.tokenizer is None:
            raise ValueError("the served engine needs a tokenizer (Engine.from_options(..., "
                             "tokenizer=Tokenizer.from_dir(path)))")
        window = self.engine.max_context
        if self.defaults.max_context != window:
            raise ValueError(f"defaults.max_context {self.defaults.max_context} must be the "
                             f"engine's window of {window} cells")
