"""`strata policies`, and the shared `--policy` / `--policy-opt` helpers."""

import argparse
import importlib.metadata
import json

import pytest

from strata import cli
from strata.cli.policies import add_policy_arguments, policy_from_args

VERSION = importlib.metadata.version("strata")


def run(capsys, *argv):
    status = cli.main(["policies", *argv])
    out, err = capsys.readouterr()
    return status, out, err


def test_the_listing_shows_every_policy_with_its_facts(capsys):
    status, out, err = run(capsys)
    assert status == 0 and err == ""
    assert out.splitlines()[:5] == [
        "coldest-in-loan (default)",
        "    The reference engine: give up below top, move hot experts into the coldest loan "
        "slots.",
        f"    source: strata {VERSION}",
        "    overrides: none (the defaults)",
        "    options: none",
    ]
    assert "static\n    A smaller fixed cache" in out
    assert "    overrides: relocate\n" in out
    assert "    options: decay: float = 0.95, max_admits: int = 4" in out
    for name in ("lru", "lfu", "sieve"):
        assert f"\n{name}\n" in out


def test_one_policy_in_full(capsys):
    status, out, _ = run(capsys, "lfu")
    assert status == 0
    assert out.startswith(f"lfu\nsource: strata {VERSION} (strata.policies.builtin.lfu.Lfu)\n")
    assert "A missed expert replaces the resident with the lowest count" in out
    assert "overrides: give_up, relocate, observe, admit" in out
    assert "    decay: float = 0.95  each layer's counts are multiplied by it per step" in out


def test_json_for_scripts(capsys):
    _, out, _ = run(capsys, "--json")
    listed = json.loads(out)
    assert [p["name"] for p in listed] == ["coldest-in-loan", "lfu", "lru", "sieve", "static"]
    lru = listed[2]
    assert lru["default"] is False and lru["source"] == f"strata {VERSION}"
    assert lru["overrides"] == ["give_up", "relocate", "observe", "admit"]
    assert lru["options"] == [{"name": "max_admits", "type": "int", "default": 4,
                               "help": "misses admitted per layer per step"}]
    _, out, _ = run(capsys, "static", "--json")
    assert json.loads(out)["overrides"] == ["relocate"]


def test_an_unknown_name_is_a_usage_error(capsys):
    status, out, err = run(capsys, "belady")
    assert status == 2 and out == ""
    assert err == ("strata policies: unknown policy 'belady'; known: coldest-in-loan, lfu, lru, "
                   "sieve, static\n")


def parser():
    parser = argparse.ArgumentParser()
    add_policy_arguments(parser)
    return parser


def test_policy_from_args_selects_and_configures():
    args = parser().parse_args(["--policy", "lfu", "--policy-opt", "decay=0.5",
                                "--policy-opt", "max_admits=1"])
    policy = policy_from_args(args)
    assert policy.name == "lfu"
    assert (policy.options.decay, policy.options.max_admits) == (0.5, 1)
    assert policy_from_args(parser().parse_args([])).name == "coldest-in-loan"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--policy", "fifo"], "unknown policy 'fifo'; known: coldest-in-loan, lfu, lru, sieve"),
        (["--policy", "lru", "--policy-opt", "size=3"],
         "policy 'lru': unknown option 'size'; the options of policy 'lru' are: max_admits: "
         "int = 4"),
        (["--policy", "lru", "--policy-opt", "max_admits=many"],
         "policy 'lru': option max_admits='many' is not an int"),
    ],
)
def test_bad_policy_arguments_are_usage_errors(argv, message):
    with pytest.raises(cli.UsageError) as caught:
        policy_from_args(parser().parse_args(argv))
    assert message in str(caught.value)
