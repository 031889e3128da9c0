"""Prompt text from the command line, a file or stdin: UTF-8, and no more than can be used.

A prompt is text: its bytes must be UTF-8 wherever they come from. A command-line argument
that is not reaches Python as lone surrogates (`surrogateescape`), which the tokenizer cannot
take; a file or stdin is decoded strictly as it is read, so that random bytes (`/dev/urandom`)
stop at the first bad byte, naming its offset. Reading also stops at a size: `strata generate`
reads at most `BYTES_PER_CELL` bytes a `--max-context` cell (no tokenizer's tokens are longer
on average, so more text cannot fit), and any prompts file at most MAX_TEXT_BYTES; an endless
stream (`/dev/zero`) is refused instead of read into memory.
"""

from __future__ import annotations

import codecs
import os
import sys
from typing import BinaryIO

from strata.cli.errors import UsageError

__all__ = ["BYTES_PER_CELL", "MAX_TEXT_BYTES", "check_utf8", "read_prompt", "read_text_file"]

BYTES_PER_CELL = 1024
MAX_TEXT_BYTES = 256 << 20
_BLOCK = 1 << 20


def check_utf8(text: str, where: str) -> str:
    """`text` if it came from UTF-8 bytes; UsageError naming the first byte that did not."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        code = ord(text[err.start])
        byte = f"byte {code - 0xDC00:#04x}" if 0xDC80 <= code <= 0xDCFF else f"U+{code:04X}"
        raise UsageError(f"{where} is not UTF-8 text: {byte} at character {err.start} (give the "
                         "prompt as UTF-8)") from None
    return text


def _decode(stream: BinaryIO, where: str, limit: int, too_long: str) -> str:
    """The UTF-8 text of `stream`, decoded as it is read, at most `limit` bytes of it."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    parts: list[str] = []
    total = 0
    while True:
        block = stream.read(min(_BLOCK, limit + 1 - total))
        total += len(block)
        if total > limit:
            raise UsageError(f"{where} is over {limit:,} bytes: {too_long}")
        try:
            parts.append(decoder.decode(block, final=not block))
        except UnicodeDecodeError as err:
            offset = total - len(err.object) + err.start
            what = "ends inside a character" if not block else \
                f"byte {offset:,} is {err.object[err.start]:#04x}"
            raise UsageError(f"{where} is not UTF-8 text: {what}") from None
        if not block:
            return "".join(parts)


def read_text_file(path: str, *, flag: str, limit: int = MAX_TEXT_BYTES,
                   too_long: str = "give a smaller file") -> str:
    """The UTF-8 text of the file `path` given with `flag`; UsageError naming them for a file
    that cannot be read, is not UTF-8, or is over `limit` bytes."""
    where = f"{flag} {path}"
    try:
        with open(path, "rb") as f:
            return _decode(f, where, limit, too_long)
    except OSError as err:
        raise UsageError(f"{where}: {err.strerror or err}") from None


def read_prompt(prompt: str | None, prompt_file: str | None, *, max_context: int) -> str:
    """The prompt: the argument, else `--prompt-file`, else stdin; UTF-8, and at most
    BYTES_PER_CELL bytes a `--max-context` cell."""
    if prompt is not None and prompt_file is not None:
        raise UsageError("give the prompt as an argument or with --prompt-file, not both")
    if prompt is not None:
        return check_utf8(prompt, "the prompt argument")
    cells = max(1, max_context)
    limit = min(MAX_TEXT_BYTES, cells * BYTES_PER_CELL)
    too_long = (f"more text than --max-context {cells} tokens can hold (raise --max-context or "
                "shorten the prompt)")
    if prompt_file is not None:
        return read_text_file(prompt_file, flag="--prompt-file", limit=limit, too_long=too_long)
    if sys.stdin is None or sys.stdin.isatty():
        raise UsageError("no prompt: give one as an argument, --prompt-file PATH, or on stdin")
    where = "the prompt on stdin"
    try:
        binary = getattr(sys.stdin, "buffer", None)
        if binary is not None:
            return _decode(binary, where, limit, too_long)
        # A text stream in stdin's place (an embedding program's, a test's): already text.
        text = sys.stdin.read(limit + 1)
        if len(text) > limit:
            raise UsageError(f"{where} is over {limit:,} characters: {too_long}")
        return check_utf8(text, where)
    except OSError as err:
        raise UsageError(f"the prompt on stdin cannot be read: {os.strerror(err.errno or 0)}") \
            from None
