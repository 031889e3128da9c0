"""Small hand-built residency tables for the policy tests, and a way to see they did not change."""

import numpy as np

from strata._residency import ResidencyTable


def make_table(
    n_layers=2, n_experts=8, n_slots=10, slot_bytes=3, chunk_bytes=2, *, top=None, floor=0,
    fill=True,
):
    """A table whose slot s holds flat expert s (layer s // E, expert s % E), like a profile fill
    of the default rank order (flat id 0 hottest) from slot 0 up."""
    table = ResidencyTable(n_layers, n_experts, n_slots, slot_bytes, chunk_bytes)
    table.set_regions(top=n_slots if top is None else top, floor=floor)
    if fill:
        slots = np.arange(min(n_slots, n_layers * n_experts))
        table.assign_many(slots, slots // n_experts, slots % n_experts)
    return table


def heat_up(table, counts):
    """Record routing: {(layer, expert): times}."""
    for (layer, expert), times in counts.items():
        table.record(layer, np.full(times, expert, np.int64))


def snapshot(table):
    return {
        "res": table.res.copy(),
        "owner": table.owner.copy(),
        "heat": table.heat.copy(),
        "rank": table.rank.copy(),
        "chunk_mapped": table.chunk_mapped.copy(),
        "regions": (table.top, table.floor),
        "n_resident": table.n_resident,
    }


def assert_unchanged(table, before):
    after = snapshot(table)
    for key, value in before.items():
        assert np.array_equal(np.asarray(after[key]), np.asarray(value)), f"{key} changed"
    table.validate()
