"""examples/policy-plugin, installed as an outside package: listed by `strata policies`,
selected with `--policy`, and its decisions are the ones used.

It is installed with pip into a temporary `--target` directory (no build isolation, no index:
nothing is downloaded) and used from subprocesses with that directory on PYTHONPATH, so the
test environment itself is left as it was.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "policy-plugin"

DECIDE = textwrap.dedent("""
    import argparse, json, sys
    import numpy as np
    from strata._residency import ResidencyTable
    from strata.books import CheckedPolicy
    from strata.cli.policies import add_policy_arguments, policy_from_args

    parser = argparse.ArgumentParser()
    add_policy_arguments(parser)
    policy = policy_from_args(parser.parse_args(sys.argv[1:]))
    # 2 layers of 8 experts, slot s holds flat expert s; loan [8, 10), floor 2.
    table = ResidencyTable(2, 8, 10, 3, 2)
    table.set_regions(top=8, floor=2)
    slots = np.arange(10)
    table.assign_many(slots, slots // 8, slots % 8)
    for layer, expert, times in [(0, 6, 3), (0, 7, 3), (1, 0, 5), (1, 1, 5)]:
        table.record(layer, np.full(times, expert))
    plan = CheckedPolicy(policy, table).give_up(2)
    print(json.dumps({"policy": type(policy).__name__, "slots": plan.slots.tolist(),
                      "moves": plan.moves.tolist()}))
""")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    source = tmp_path_factory.mktemp("src") / "policy-plugin"
    shutil.copytree(EXAMPLE, source)  # pip builds in the tree: keep the checkout clean
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-build-isolation", "--no-deps",
         "--no-index", "--target", str(target), str(source)],
        check=True, capture_output=True, text=True,
    )
    return target


def strata(site, *argv, script=None):
    env = os.environ | {"PYTHONPATH": os.pathsep.join(
        [str(site), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("STRATA_LOAD_PLUGINS", None)
    command = ["-c", script, *argv] if script else ["-m", "strata.cli", *argv]
    return subprocess.run([sys.executable, *command], env=env, capture_output=True, text=True,
                          check=True).stdout


def test_the_registry_tests_pass_with_the_example_installed(site):
    """The README's `pytest` after the tutorial's own step of installing the plugin: the suite
    hides installed plugins (tests/conftest.py), so the tests that count and name the policies
    still see the built-ins alone. Run in a fresh pytest with the example on PYTHONPATH, where
    `strata policies` lists it (test_strata_policies_lists_it)."""
    root = Path(__file__).resolve().parents[2]
    env = os.environ | {"PYTHONPATH": os.pathsep.join(
        [str(site), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("STRATA_LOAD_PLUGINS", None)
    count = "import sys; sys.path.insert(0, 'tests'); import conftest; " \
            "print(len(conftest.INSTALLED_POLICY_PLUGINS))"
    hidden = subprocess.run([sys.executable, "-c", count], cwd=root, env=env, check=True,
                            capture_output=True, text=True).stdout
    assert hidden.strip() == "1"  # the example, seen as installed (and so hidden)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider",
         "tests/policies/test_registry.py", "tests/policies/test_cli.py"],
        cwd=root, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "::test_a_test_that_asks_sees_the_installed_plugins PASSED" in result.stdout
    assert re.search(r"\b\d+ passed\b", result.stdout.splitlines()[-1]), result.stdout[-2000:]


def test_the_example_is_small():
    lines = (EXAMPLE / "strata_coldest_anywhere.py").read_text().splitlines()
    assert len(lines) < 50


def test_strata_policies_lists_it(site):
    listed = {p["name"]: p for p in json.loads(strata(site, "policies", "--json"))}
    mine = listed["coldest-anywhere"]
    assert mine["source"] == "strata-coldest-anywhere 0.1.0"
    assert mine["overrides"] == ["relocate"]
    assert mine["options"] == [{"name": "max_moves", "type": "int", "default": 64, "help": ""}]
    assert mine["class"] == "strata_coldest_anywhere.ColdestAnywhere"
    assert "coldest-in-loan" in listed


def test_selected_its_decisions_are_used(site):
    # The loan's residents are hotter than the given-up experts: the default moves nothing.
    default = json.loads(strata(site, script=DECIDE))
    assert default == {"policy": "ColdestInLoan", "slots": [6, 7], "moves": []}
    # coldest-anywhere moves them into the coldest kept slots, 5 and 4.
    mine = json.loads(strata(site, "--policy", "coldest-anywhere", script=DECIDE))
    assert mine == {"policy": "ColdestAnywhere", "slots": [6, 7], "moves": [[6, 5], [7, 4]]}
    capped = json.loads(strata(site, "--policy", "coldest-anywhere", "--policy-opt",
                               "max_moves=1", script=DECIDE))
    assert capped["moves"] == [[6, 5]]


TUTORIAL = EXAMPLE.parents[1] / "docs" / "policies" / "tutorial.md"
TITLED = re.compile(r'^```\w* title="strata-coldest-anywhere/(?P<name>[^"]+)"\n(?P<body>.*?)^```$',
                    re.M | re.S)


def test_the_tutorial_writes_the_example_as_it_is():
    """The tutorial's package is this one, file for file: its titled blocks are what the docs
    tests write and install (tests/docs runs the tutorial's commands and checks their output)."""
    written = {m["name"]: m["body"] for m in TITLED.finditer(TUTORIAL.read_text())}
    for name in ("pyproject.toml", "strata_coldest_anywhere.py"):
        assert written[name] == (EXAMPLE / name).read_text(), name
