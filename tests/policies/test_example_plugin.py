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
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.M | re.S)


def tutorial_blocks():
    return [(lang, body) for lang, body in FENCE.findall(TUTORIAL.read_text())]


def test_the_tutorial_shows_the_example_as_it_is():
    blocks = tutorial_blocks()
    plugin = (EXAMPLE / "strata_coldest_anywhere.py").read_text()
    assert ("python", plugin) in blocks
    toml = next(body for lang, body in blocks if lang == "toml")
    example_toml = (EXAMPLE / "pyproject.toml").read_text()
    for line in toml.splitlines():
        assert line in example_toml.splitlines(), line


def test_the_tutorial_runs_to_the_end_with_the_output_it_shows(site, monkeypatch, capsys):
    """Its Python blocks, run in order as one script, print what the text blocks after them
    show; `strata policies coldest-anywhere` prints what it shows."""
    blocks = tutorial_blocks()
    plugin = (EXAMPLE / "strata_coldest_anywhere.py").read_text()
    script, expected = [], []
    for (lang, body), (next_lang, next_body) in zip(blocks, [*blocks[1:], ("", "")],
                                                    strict=True):
        if lang == "python" and body != plugin:
            script.append(body)
            script.append("print('--- block ---')\n")
            expected.append(next_body if next_lang == "text" else "")
    printed = strata(site, script="\n".join(script)).split("--- block ---\n")
    assert printed[:-1] == expected
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delenv("STRATA_LOAD_PLUGINS", raising=False)
    shown = next(body for lang, body in blocks if body.startswith("coldest-anywhere\nsource:"))
    from strata import cli

    assert cli.main(["policies", "coldest-anywhere"]) == 0
    assert capsys.readouterr().out == shown
