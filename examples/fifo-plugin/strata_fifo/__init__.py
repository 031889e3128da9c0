"""strata-fifo: first in, first out, a compiled rule that replays at kernel speed."""

from strata.policies import RulePolicy, hookimpl
from strata_fifo.rule import FifoRule


class Fifo(RulePolicy):
    """First in, first out: every miss enters the slot after the last one filled."""

    name = "fifo"
    Rule = FifoRule


@hookimpl
def strata_register_policies(register):
    register(Fifo)
