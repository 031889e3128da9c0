"""`StopText`: generated text cut at the first stop string a request gave.

Text arrives in pieces, and a stop string may be split across them, so what could be the start
of a stop string is held back until the next piece says whether it is one. Once a stop string
is seen, the text before it is the reply and generation ends (the engine asks `should_stop`
before each decode round).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["StopText"]


class StopText:
    """Pieces in, the text that is safe to send out; `hit` once a stop string was seen."""

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        self.stops = tuple(stops)
        self.held = ""  # the tail that may begin a stop string
        self.hit = False

    def feed(self, piece: str) -> str:
        """The text `piece` completes that is not (and cannot become) part of a stop string."""
        if self.hit:
            return ""
        text = self.held + piece
        cuts = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if cuts:
            self.hit, self.held = True, ""
            return text[: min(cuts)]
        keep = max((k for s in self.stops for k in range(1, min(len(s), len(text) + 1))
                    if text.endswith(s[:k])), default=0)
        self.held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep]

    def finish(self) -> str:
        """What was held back, once generation ended without completing a stop string."""
        out, self.held = ("" if self.hit else self.held), ""
        return out
