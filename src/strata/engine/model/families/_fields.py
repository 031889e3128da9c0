"""Reading a `config.json`'s fields with their types and ranges checked, each error naming one.

A family's `config_fields` and the common fields read every value through `Fields`, so that no
value reaches the engine unchecked: a field of the wrong type, out of range, or missing is a
`FieldError` naming the field and what would be right, before anything is loaded (the config
turns it into a `CheckpointError` naming the file). JSON gives integers, numbers, strings,
booleans, null, arrays and objects; each getter says which it takes. `null` counts as absent
only where a getter takes `optional=True`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from strata.formats.jsonfile import json_repr, json_type

__all__ = ["INT_MAX", "FieldError", "Fields"]

# Sizes and ids are int32 wherever the books, profiles and traces keep them.
INT_MAX = 2**31 - 1
_MISSING = object()


class FieldError(ValueError):
    """A config field that cannot be used; `field` is its name in config.json."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _got(value: Any) -> str:
    return f"got {json_repr(value)} ({json_type(value)})"


class Fields:
    """The fields of one config.json object (`hf`), read one by one with checks."""

    def __init__(self, hf: dict[str, Any], prefix: str = "") -> None:
        self.hf = hf
        self.prefix = prefix  # names a nested object's fields: "rope_parameters."
        self.read: dict[str, Any] = {}  # name -> value, of every field read and checked

    def first(self, *names: str) -> str:
        """The first of `names` present (and not null), else the first: for fields with two
        spellings (`num_local_experts` / `num_experts`)."""
        for name in names:
            if self.hf.get(name) is not None:
                return name
        return names[0]

    def _value(self, name: str, default: Any, optional: bool) -> tuple[Any, bool]:
        """(the value, True), or (`default`, False) when absent (or null, if `optional`)."""
        value = self.hf.get(name, _MISSING)
        if value is _MISSING or (value is None and optional):
            if default is _MISSING:
                raise FieldError(self.prefix + name, f"{self.prefix}{name} is missing; it is "
                                                     "required")
            return default, False
        return value, True

    def fail(self, name: str, message: str) -> FieldError:
        """A FieldError for `name`: `message` follows the field's (prefixed) name."""
        return FieldError(self.prefix + name, f"{self.prefix}{name} {message}")

    def integer(self, name: str, *, low: int = 1, high: int = INT_MAX, default: Any = _MISSING,
                optional: bool = False, bound: str = "") -> Any:
        """An integer in [low, high] (`bound` says where `high` comes from, for the message);
        `default` when absent (or null, if `optional`)."""
        value, given = self._value(name, default, optional)
        if not given:
            return value
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise self.fail(name, f"must be an integer in [{low}, {high}]{bound}, {_got(value)}")
        self.read[name] = value
        return value

    def number(self, name: str, *, default: Any = _MISSING, optional: bool = False,
               positive: bool = True) -> Any:
        """A finite number (> 0 when `positive`), as a float."""
        value, given = self._value(name, default, optional)
        if not given:
            return value
        number = math.nan
        if isinstance(value, float):
            number = value
        elif isinstance(value, int) and not isinstance(value, bool):
            # An integer past float's range (JSON has no bound) is as good as infinite.
            number = float(value) if value.bit_length() <= 1023 else math.inf
        if not math.isfinite(number) or (positive and not number > 0):
            want = "a finite number > 0" if positive else "a finite number"
            raise self.fail(name, f"must be {want}, {_got(value)}")
        self.read[name] = value
        return number

    def boolean(self, name: str, *, default: bool) -> bool:
        """true or false."""
        value, _ = self._value(name, default, optional=False)
        if not isinstance(value, bool):
            raise self.fail(name, f"must be true or false, {_got(value)}")
        self.read[name] = value
        return value

    def text(self, name: str, *, choices: Iterable[str], default: Any = _MISSING,
             optional: bool = False) -> Any:
        """One of `choices` (a string)."""
        value, given = self._value(name, default, optional)
        if not given:
            return value
        choices = tuple(choices)
        if not isinstance(value, str) or value not in choices:
            raise self.fail(name, f"{json_repr(value)} is not supported; supported: "
                                  f"{', '.join(choices)}")
        self.read[name] = value
        return value

    def object(self, name: str) -> dict[str, Any]:
        """A JSON object, or {} when absent or null."""
        value, _ = self._value(name, {}, optional=True)
        if not isinstance(value, dict):
            raise self.fail(name, f"must be an object or null, {_got(value)}")
        return value

    def token_ids(self, name: str, vocab_size: int) -> int | tuple[int, ...] | None:
        """A token id, a list of them, or null; each in [0, vocab_size)."""
        value, given = self._value(name, None, optional=True)
        if not given:
            return None
        ids = value if isinstance(value, list) else [value]
        for token in ids:
            if isinstance(token, bool) or not isinstance(token, int) \
                    or not 0 <= token < vocab_size:
                raise self.fail(name, f"must be a token id in [0, {vocab_size}) (vocab_size), a "
                                      f"list of them, or null, {_got(value)}")
        self.read[name] = value
        return tuple(ids) if isinstance(value, list) else value


def head_dim(fields: Fields, *, explicit: bool = True) -> int:
    """The head size: `head_dim` when `explicit` and given, else hidden_size //
    num_attention_heads; at least 2 and even (RoPE rotates pairs of it)."""
    if explicit and fields.hf.get("head_dim") is not None:
        dim = fields.integer("head_dim", low=2)
        if dim % 2:
            raise fields.fail("head_dim", f"must be even (RoPE rotates pairs), got {dim}")
        return dim
    hidden = fields.integer("hidden_size")
    heads = fields.integer("num_attention_heads")
    dim = hidden // heads
    if dim < 2 or dim % 2:
        raise fields.fail(
            "num_attention_heads",
            f"({heads}) makes the head size hidden_size // num_attention_heads = {hidden} // "
            f"{heads} = {dim}; it must be even and at least 2 (RoPE rotates pairs)"
            + ("" if not explicit else "; or give head_dim"),
        )
    return dim
