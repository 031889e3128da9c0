"""Plugin: `static`, a smaller fixed cache."""

from __future__ import annotations

from strata.policies.base import Policy
from strata.policies.hookspecs import hookimpl


class Static(Policy):
    """A smaller fixed cache: give up below top, move nothing, admit nothing.

    What a cache sized for the K/V from the start would hold: the slots given up lose their
    experts, however hot. A baseline for `coldest-in-loan`'s relocations.
    """

    name = "static"

    def relocate(self, view, slots):
        return []


@hookimpl
def strata_register_policies(register):
    register(Static)
