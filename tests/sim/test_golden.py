"""Golden counts: each built-in policy on a small fixed trace, with a fixed cache and with the
elastic K/V, gives the recorded hits, misses, admissions, evictions and K/V events.

When a policy changes on purpose, regenerate: `python tests/sim/golden/regenerate.py`.
"""

import importlib.util
import json
from pathlib import Path

import pytest

from strata.policies import load_registry

GOLDEN = Path(__file__).resolve().parent / "golden"
_spec = importlib.util.spec_from_file_location("golden_regenerate", GOLDEN / "regenerate.py")
regenerate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(regenerate)


@pytest.fixture(scope="module")
def counts():
    return regenerate.golden_counts()


def test_every_built_in_policy_is_recorded():
    recorded = json.loads(regenerate.COUNTS.read_text())
    for setup in regenerate.SETUPS:
        assert set(recorded[setup]) == {*load_registry().names(), "belady", "oracle-static"}


@pytest.mark.parametrize("setup", list(regenerate.SETUPS))
def test_golden_counts(counts, setup):
    recorded = json.loads(regenerate.COUNTS.read_text())[setup]
    assert counts[setup] == recorded, (
        "a policy's counts changed; if on purpose, run python tests/sim/golden/regenerate.py"
    )


def test_the_golden_trace_exercises_every_decision():
    recorded = json.loads(regenerate.COUNTS.read_text())
    fixed, kv = recorded["fixed"], recorded["kv-grow"]
    for name in ("lru", "lfu", "sieve"):
        assert fixed[name]["admissions"] > 0 and fixed[name]["evictions"] > 0
    for name in load_registry().names():
        assert kv[name]["gave_up_slots"] > 0 and kv[name]["refills"] > 0
        assert kv[name]["trims"] > 0
        assert fixed[name]["hits"] <= fixed["belady"]["hits"]
    assert kv["coldest-in-loan"]["relocations"] > 0 and kv["static"]["relocations"] == 0
