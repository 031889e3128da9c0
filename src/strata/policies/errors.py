"""The errors of the policy layer: a bad decision, a bad option, a bad plugin."""

from __future__ import annotations

from typing import Any


class PolicyError(Exception):
    """A policy answered a decision wrongly, or raised while answering it.

    Raised by the checker before anything acts on the answer, so the books are as they were.
    `policy` is the policy's registered name, `method` the decision (`give_up`, ...), `value`
    the offending part of the answer (or the exception it raised) and `reason` what was wrong.
    """

    def __init__(self, policy: str, method: str, value: Any, reason: str) -> None:
        self.policy = policy
        self.method = method
        self.value = value
        self.reason = reason
        super().__init__(f"policy {policy!r}, {method}: {reason} (got {_short(value)})")


class OptionError(ValueError):
    """An unknown option key or an unparsable value; the message lists the policy's options."""


class PluginError(ValueError):
    """A plugin could not be loaded or registered (a duplicate name, a bad class, ...)."""


def _short(value: Any, limit: int = 120) -> str:
    """`repr` of a decision value, cut to one readable line."""
    text = repr(value).replace("\n", " ")
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
