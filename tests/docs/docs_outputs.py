"""Comparing what a command printed with what the page documents.

Both are compared line by line, each line without its trailing spaces, without trailing blank
lines. A documented line of just `...` matches any number of lines, none included; `...` inside
a line matches any text within that line (a timing: `prefill        ... tok/s (... ms)`).
Everything else must be equal.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from functools import cache

ELLIPSIS = "..."


def _clean(lines: Sequence[str]) -> list[str]:
    out = [line.rstrip() for line in lines]
    while out and not out[-1]:
        out.pop()
    return out


@cache
def _pattern(line: str) -> re.Pattern[str]:
    return re.compile(".*?".join(re.escape(part) for part in line.split(ELLIPSIS)))


def _line_matches(expected: str, actual: str) -> bool:
    if ELLIPSIS not in expected:
        return expected == actual
    return _pattern(expected).fullmatch(actual) is not None


def matches(expected: Sequence[str], actual: Sequence[str]) -> bool:
    """Whether `actual` is what `expected` documents (the rules above)."""
    want, got = _clean(expected), _clean(actual)
    memo: dict[tuple[int, int], bool] = {}

    def match(i: int, j: int) -> bool:
        key = (i, j)
        if key not in memo:
            if i == len(want):
                memo[key] = j == len(got)
            elif want[i].strip() == ELLIPSIS:
                memo[key] = match(i + 1, j) or (j < len(got) and match(i, j + 1))
            else:
                memo[key] = j < len(got) and _line_matches(want[i], got[j]) and match(i + 1, j + 1)
        return memo[key]

    return match(0, 0)


def explain(expected: Sequence[str], actual: Sequence[str], limit: int = 80) -> str:
    """What differs, for the failure message: the diff, then what was printed."""
    want, got = _clean(expected), _clean(actual)
    diff = difflib.unified_diff(want, got, "documented", "printed", lineterm="", n=2)
    shown = got[:limit] + ([f"... ({len(got) - limit} more lines)"] if len(got) > limit else [])
    return "\n".join(["the output differs from the page (`...` lines match any lines):",
                      *diff, "", "printed:", *shown])
