"""The core's side of a decision: check a policy's answer, then apply it to the books.

- `checked`: `CheckedPolicy`, a policy bound to one residency table; every answer is checked
  (`validate`) and a bad one raises `PolicyError` naming the policy, the books untouched;
- `apply`: `apply_admit`, `apply_give_up`, `apply_refill`, each all or nothing on the books.

The engine (`strata.engine.cache.executor`, which also moves the bytes) and the simulator both
apply decisions through these, so a decision means the same in both.
"""

from strata.books.apply import GiveUpPlan, apply_admit, apply_give_up, apply_refill
from strata.books.checked import CheckedPolicy
from strata.books.validate import validate_decision

__all__ = [
    "CheckedPolicy",
    "GiveUpPlan",
    "apply_admit",
    "apply_give_up",
    "apply_refill",
    "validate_decision",
]
