"""strata-clock: CLOCK (second chance), a compiled rule that replays at kernel speed."""

from strata.policies import RulePolicy, hookimpl
from strata_clock.rule import ClockRule


class Clock(RulePolicy):
    """CLOCK: a hand sweeps the slots; a slot hit since it last passed gets a second chance."""

    name = "clock"
    Rule = ClockRule


@hookimpl
def strata_register_policies(register):
    register(Clock)
