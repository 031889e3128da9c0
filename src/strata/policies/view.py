"""A read-only view of the books (`strata._residency.ResidencyTable`) for policies.

A policy reads the books through this view and never changes them. The view is an extension
type of `strata._residency` (it lives beside the table so that it can keep the table in a field
Python cannot read): nothing reachable from it (its attributes, its methods, its arrays and
their `.base`) leads to the table or to a writeable array over the books' memory. Every array it
hands out is a new read-only array object that cannot be made writeable again. Beside the
table's own read-only queries it derives, in numpy, what decisions need: a total heat order and
the chunks a set of slots would free.
"""

from __future__ import annotations

from strata._residency import ResidencyView

__all__ = ["ResidencyView"]
