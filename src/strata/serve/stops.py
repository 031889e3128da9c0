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
        first = min(cuts, default=len(text))
        # A stop string found is the first one only if none that begins before it may still
        # be completed by the next pieces ("aba" may yet begin before a "b" already seen).
        pending = self._may_begin(text, first)
        if pending < first or not cuts:
            self.held = text[pending:]
            return text[:pending]
        self.hit, self.held = True, ""
        return text[:first]

    def finish(self) -> str:
        """What was held back, once generation ended: up to the first stop string in it."""
        if self.hit:
            return ""
        text, self.held = self.held, ""
        cuts = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if cuts:
            self.hit = True
            return text[: min(cuts)]
        return text

    def _may_begin(self, text: str, end: int) -> int:
        """The first place before `end` from which the rest of `text` begins a stop string
        without completing it (it could be completed by what comes next); `end` if none."""
        longest = max((len(s) for s in self.stops), default=0)
        for start in range(max(0, len(text) - longest + 1), end):
            tail = text[start:]
            if any(len(s) > len(tail) and s.startswith(tail) for s in self.stops):
                return start
        return end
