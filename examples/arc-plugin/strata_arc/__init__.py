"""strata-arc: ARC (Megiddo & Modha, 2003), a compiled rule that replays at kernel speed."""

from dataclasses import dataclass, field

from strata.policies import RulePolicy, hookimpl
from strata_arc.rule import ArcRule


@dataclass(frozen=True)
class ArcOptions:
    max_admits: int = field(default=4, metadata={"help": "misses admitted per layer per step"})

    def __post_init__(self):
        if self.max_admits < 0:
            raise ValueError(f"max_admits must be >= 0, got {self.max_admits}")


class Arc(RulePolicy):
    """ARC: recency and frequency lists whose balance adapts to the ghosts of the evicted."""

    name = "arc"
    Options = ArcOptions
    Rule = ArcRule  # RulePolicy hands the rule `max_admits`


@hookimpl
def strata_register_policies(register):
    register(Arc)
