"""`StatefulPolicy`: the pattern of a policy that keeps its own state about the books.

A policy is made once per engine and once per replay, before it meets the books; their shape
(layers, experts, slots) is known only from the first view it is handed. So a stateful policy:
- takes its settings as `Options` (a frozen dataclass; `self.options` once constructed);
- makes its state in `start(view)`, which `ready(view)` calls the first time it meets books of
  a shape (and anew for books of another shape);
- calls `ready(view)` first in every method that reads its state: the decisions it answers and
  the notifications it listens to (`entered` with `why="fill"` comes first of all, at start);
- keeps the state in step with the books through `observe` (routing), its own `admit`
  answers, and the notifications (`entered`, `left`, `moved`: every other entry and exit).

Per-slot state is indexed by slot in [0, n_slots); per-expert state is [n_layers, n_experts],
or flat (`layer * n_experts + expert`, as `view.owner` stores experts).
"""

from __future__ import annotations

from typing import Any

from strata.policies.base import Policy
from strata.policies.view import ResidencyView

__all__ = ["StatefulPolicy"]


class StatefulPolicy(Policy):
    """Base of a policy with its own state: `start(view)` makes it, `ready(view)` first."""

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        # (n_layers, n_experts, n_slots) of the books the state was made for; None: not yet.
        self.shape: tuple[int, int, int] | None = None

    def start(self, view: ResidencyView) -> None:
        """Make the state for the books `view` shows (their shape; the cache is empty or
        being filled). Default: nothing."""

    def ready(self, view: ResidencyView) -> None:
        """Make the state (`start`) if it is not made yet for books of `view`'s shape."""
        shape = (view.n_layers, view.n_experts, view.n_slots)
        if shape != self.shape:
            self.shape = shape
            self.start(view)
