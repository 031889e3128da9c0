"""Plugin: `coldest-in-loan`, the default and the reference engine's behaviour."""

from __future__ import annotations

from strata.policies.base import Policy
from strata.policies.hookspecs import hookimpl


class ColdestInLoan(Policy):
    """The reference engine: give up below top, move hot experts into the coldest loan slots.

    Gives up the backed slots just below `top`, downward, never below the floor; a given-up
    expert hotter than the coldest resident of the loan region first moves into that
    resident's slot, so the cache loses its coldest experts, as a smaller cache would. Refills
    from the profile, hottest missing first. The K/V grows by whole steps and is trimmed when
    two steps are spare. It admits no misses: the cache's contents change only on growth,
    trim and loan.
    """

    name = "coldest-in-loan"


@hookimpl
def strata_register_policies(register):
    register(ColdestInLoan)
