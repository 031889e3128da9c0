"""JSON files read without assumptions: whatever is in them, a bad one is one line naming it.

Every JSON file strata reads from a checkpoint or the command line goes through `read_json`: a
file that is not there or not a regular file, too large, not UTF-8, not JSON, or nested deeper
than the parser can follow (Python's parser recurses: `[[[[...]]]]` raises RecursionError) is
the caller's error class, with the path and what is wrong. `json_repr` shows a value in a
message, cut short, whatever its size or depth.
"""

from __future__ import annotations

import json
import os
import reprlib
import stat
from typing import Any

__all__ = ["MAX_JSON_BYTES", "json_repr", "json_type", "read_json", "read_json_object"]

# The largest JSON file read: the biggest a checkpoint holds (a tokenizer_config.json with its
# added tokens, a sharded index) are a few MiB. Bigger is not one of them.
MAX_JSON_BYTES = 64 << 20

_SHORT = reprlib.Repr()
_SHORT.maxlevel = 2
_SHORT.maxstring = 40
_SHORT.maxother = 40
_SHORT.maxlist = _SHORT.maxdict = 4
_SHORT.maxlong = 40

_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
               int: "an integer", float: "a number", type(None): "null"}


def json_type(value: Any) -> str:
    """What a JSON value is, in words ("an object", "a string", ...)."""
    return _JSON_TYPES.get(type(value), type(value).__name__)


def json_repr(value: Any) -> str:
    """`value` for a message: JSON-like, at most a line, whatever its depth."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, int) and value.bit_length() > 128:
        # repr() refuses integers of over 4300 digits; their size is all a message needs.
        return f"<an integer of {int(value.bit_length() * 0.30103) + 1} digits>"
    return _SHORT.repr(value)


def read_json(path: str | os.PathLike[str], *, what: str, error: type[Exception]) -> Any:
    """The JSON value in `path` (`what` names the file in messages: "config.json").

    Raises `error` with one line naming the path for a file that is missing, not a regular
    file, over MAX_JSON_BYTES, not UTF-8, not JSON, or nested too deep to parse.
    """
    path = os.fspath(path)
    name = _named(path, what)
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise error(f"{name} is not a regular file")
        if info.st_size > MAX_JSON_BYTES:
            raise error(f"{name} is {info.st_size:,} bytes; at most {MAX_JSON_BYTES:,} are read")
        with open(path, "rb") as f:
            data = f.read(MAX_JSON_BYTES + 1)
    except OSError as err:
        raise error(f"{name} cannot be read: {err.strerror or err}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise error(f"{name} is not UTF-8 text: byte {err.start} is "
                    f"{data[err.start]:#04x}") from None
    try:
        return json.loads(text)
    except RecursionError:
        raise error(f"{name} is nested too deeply to read as JSON") from None
    except ValueError as err:  # JSONDecodeError, and an integer of over 4300 digits
        raise error(f"{name} is not readable JSON: {' '.join(str(err).split())}") from None


def _named(path: str, what: str) -> str:
    """The path, and what the file is when its name does not say ("bw.json (bandwidths)")."""
    return path if os.path.basename(path) == what else f"{path} ({what})"


def read_json_object(path: str | os.PathLike[str], *, what: str,
                     error: type[Exception]) -> dict[str, Any]:
    """`read_json`, and `error` unless the file holds a JSON object."""
    value = read_json(path, what=what, error=error)
    if not isinstance(value, dict):
        raise error(f"{_named(os.fspath(path), what)} must hold a JSON object, got "
                    f"{json_type(value)}")
    return value
