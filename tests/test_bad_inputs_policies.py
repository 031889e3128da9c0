"""Bad input on the policy path, through the real command line, as a user runs it: every case is
exit status 2, one error line on stderr naming what is wrong, and no traceback.

The cases: a policy plugin that breaks each decision (`kv_params`, `kv_target`, `give_up`,
`relocate`, `refill`, `observe`, `admit`) in the ways tests/support/faulty_policies.py lists,
under `strata generate`, `strata simulate` and `strata profile`; bad `--policy` and
`--policy-opt` values; and bad `STRATA_*` values. The plugin is installed as an outside package
in a temporary directory and selected with `STRATA_LOAD_PLUGINS`.

A decision that breaks after the model has loaded comes after the run's notes (`strata: ...`
lines: the elastic K/V's figures, the cache's budget): those are allowed before the error line,
and nothing else is. Every other case is exactly one line.

The subprocesses run a few at a time from one fixture (each starts Python and, for the engine's
commands, torch), and each case is its own test reading its result.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

from strata.engine.model.config import ModelConfig
from strata.formats.profile import Profile
from support.checkpoints import cached_checkpoint
from support.faulty_policies import RULES
from support.policy_packages import write_package

PLUGIN_SOURCE = Path(__file__).parent / "support" / "faulty_policies.py"
DIST = "faulty-policies"
WORKERS = 2  # the machine's cores
PROMPT = "word " * 20  # 100 byte-level tokens: long enough to take the prompt loan
# 4 KiB chunks: the tiny model's K/V grows 32 cells a chunk; the cache gives slots for it.
GENERATE_ENV = {"STRATA_VMM_CHUNK_BYTES": "4096", "STRATA_KV_GROW_INIT": "32",
                "STRATA_KV_GROW_STEP": "32", "STRATA_KV_GROW_FLOOR": "2",
                "STRATA_LOAN_KEEP_SLOTS": "8"}
SIMULATE_ENV = {"STRATA_KV_GROW_INIT": "32", "STRATA_KV_GROW_STEP": "32"}
# Every rule runs under `strata simulate` (a fraction of a second each); these run under
# `strata generate` too (a second or two each: torch and a model load), a few of every decision
# and every one the issue named, and a few under `strata profile`.
GENERATE_RULES = (
    "kv_params_raises", "kv_params_floor_negative", "kv_params_step_zero",
    "kv_params_init_float", "kv_params_init_past_window",
    "kv_target_raises", "kv_target_float", "kv_target_short",
    "give_up_raises", "give_up_lent", "give_up_nothing", "give_up_unreadable",
    "give_up_reaches_books", "give_up_exits",
    "relocate_raises", "relocate_into_given", "relocate_writes_slots",
    "refill_raises", "refill_not_offered", "refill_writes_view",
    "admit_raises", "admit_lent", "admit_wrong_layer",
    "observe_raises", "observe_reaches_books", "observe_writes_routing", "observe_writes_view",
)
PROFILE_RULES = ("kv_params_step_zero", "give_up_reaches_books", "refill_raises",
                 "observe_raises", "admit_lent")


@dataclass(frozen=True)
class Case:
    command: str  # generate, simulate or profile
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    says: tuple[str, ...] = ()  # what the error line must hold
    notes: bool = False  # the run's `strata: ` notes may come before the error line
    traced: bool = False  # STRATA_TRACE_PLUGINS is on: its lines may come first too


def _decision_cases() -> dict[str, Case]:
    cases = {}
    for rule, (decision, _) in RULES.items():
        says = ("policy 'faulty'", f"{decision}:")
        # kv_params is asked while the cache is planned, before any note is printed.
        notes = decision != "kv_params"
        option = ("--policy", "faulty", "--policy-opt", f"rule={rule}")
        cases[f"simulate-{rule}"] = Case("simulate", option, says=says)
        if rule in GENERATE_RULES:
            cases[f"generate-{rule}"] = Case("generate", option, says=says, notes=notes)
        if rule in PROFILE_RULES:
            cases[f"profile-{rule}"] = Case("profile", option, says=says, notes=notes)
    return cases


# (name, --policy/--policy-opt arguments, what the line says): for each command.
OPTION_CASES = [
    ("unknown-policy", ("--policy", "nosuch"), ("unknown policy 'nosuch'", "faulty")),
    ("unknown-option", ("--policy", "lru", "--policy-opt", "colour=red"),
     ("unknown option 'colour'", "max_admits")),
    ("option-without-value", ("--policy", "lru", "--policy-opt", "max_admits"),
     ("max_admits",)),
    ("option-twice", ("--policy", "lru", "--policy-opt", "max_admits=1", "--policy-opt",
                      "max_admits=2"), ("max_admits",)),
    ("option-not-an-int", ("--policy", "lru", "--policy-opt", "max_admits=lots"),
     ("max_admits", "lots")),
    ("option-out-of-range", ("--policy", "lfu", "--policy-opt", "decay=2"), ("decay",)),
    ("rule-unknown", ("--policy", "faulty", "--policy-opt", "rule=nosuch"), ("rule",)),
]

# (name, variable, value, what the line says, commands)
ENV_CASES = [
    ("floor-negative", "STRATA_KV_GROW_FLOOR", "-1", ("STRATA_KV_GROW_FLOOR='-1'",
                                                      "integer >= 0"), "gsp"),
    ("floor-cells", "STRATA_KV_GROW_FLOOR", "8k", ("STRATA_KV_GROW_FLOOR='8k'", "slots"), "g"),
    ("step-zero", "STRATA_KV_GROW_STEP", "0", ("STRATA_KV_GROW_STEP='0'", "positive"), "gs"),
    ("init-text", "STRATA_KV_GROW_INIT", "lots", ("STRATA_KV_GROW_INIT='lots'",), "gsp"),
    ("grow-switch", "STRATA_KV_GROW", "maybe", ("STRATA_KV_GROW='maybe'",), "gp"),
    ("loan-keep-negative", "STRATA_LOAN_KEEP_SLOTS", "-1", ("STRATA_LOAN_KEEP_SLOTS='-1'",),
     "gsp"),
    ("chunk-not-pages", "STRATA_VMM_CHUNK_BYTES", "1000", ("STRATA_VMM_CHUNK_BYTES='1000'",),
     "gsp"),
    ("load-unknown-plugin", "STRATA_LOAD_PLUGINS", "no-such-plugin",
     ("STRATA_LOAD_PLUGINS names no-such-plugin",), "gsp"),
    ("dump-in-missing-dir", "STRATA_DUMP_FIRST_LOGITS", "/nonexistent/dir/logits.bin",
     ("STRATA_DUMP_FIRST_LOGITS=/nonexistent/dir/logits.bin",), "g"),
]
COMMANDS = {"g": "generate", "s": "simulate", "p": "profile"}


def _cases() -> dict[str, Case]:
    cases = _decision_cases()
    for name, args, says in OPTION_CASES:
        for command in ("generate", "simulate", "profile"):
            if command == "profile" and name not in ("unknown-policy", "option-out-of-range"):
                continue
            cases[f"{command}-{name}"] = Case(command, args, says=says)
    for name, variable, value, says, commands in ENV_CASES:
        for letter in commands:
            command = COMMANDS[letter]
            cases[f"{command}-env-{name}"] = Case(command, env={variable: value}, says=says)
    # Options in an order the command refuses: an option before the policy it would set.
    cases["simulate-option-before-policy"] = Case(
        "simulate", ("--policy-opt", "max_admits=1", "--policy", "lru"),
        says=("comes before any --policy",))
    # The logits cannot be written where the variable says (a directory): found after the run.
    cases["generate-env-dump-into-directory"] = Case(
        "generate", env={"STRATA_DUMP_FIRST_LOGITS": "{tmp}"},
        says=("STRATA_DUMP_FIRST_LOGITS=",), notes=True)
    # With every decision printed, the error is still one line, after the trace's own.
    for command in ("generate", "simulate"):
        cases[f"{command}-traced-observe-raises"] = Case(
            command, ("--policy", "faulty", "--policy-opt", "rule=observe_raises"),
            env={"STRATA_TRACE_PLUGINS": "1"}, says=("policy 'faulty'", "observe:"),
            notes=command == "generate", traced=True)
    cases["simulate-traced-bad-floor"] = Case(
        "simulate", env={"STRATA_TRACE_PLUGINS": "1", "STRATA_KV_GROW_FLOOR": "x"},
        says=("STRATA_KV_GROW_FLOOR='x'",))
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The plugin installed, a model, its profile, a trace and prompts: paths by name."""
    root = tmp_path_factory.mktemp("bad-inputs-policies")
    site = root / "site"
    site.mkdir()
    write_package(site, DIST, "1.0", PLUGIN_SOURCE.read_text(), entry_name="faulty")
    ckpt = cached_checkpoint("qwen3_moe", "tiny", dtype=torch.float32)
    profile = root / "profile.npz"
    counts = np.random.default_rng(1).integers(1, 500, (2, 8))
    Profile.for_model(counts, ModelConfig.from_dir(ckpt)).save(profile)
    trace = root / "trace.npz"
    # Requests of 4 to 160 tokens: the K/V grows, then trims for a short one (a refill).
    subprocess.run([sys.executable, "-m", "strata.cli", "trace", "synth", str(trace),
                    "--layers", "2", "--experts", "8", "--top-k", "2", "--requests", "6",
                    "--prompt-tokens", "4:160", "--decode-tokens", "2", "--prompt-chunk", "32",
                    "--seed", "1"], check=True, capture_output=True)
    prompts = root / "prompts.txt"
    prompts.write_text(PROMPT + "\n" + "short one\n")
    return {"root": root, "site": site, "ckpt": ckpt, "profile": profile, "trace": trace,
            "prompts": prompts}


def _argv(case: Case, world: dict, name: str) -> list[str]:
    if case.command == "generate":
        head = ["generate", PROMPT, "--model", str(world["ckpt"]), "--max-new", "6",
                "--device", "cpu", "--temperature", "0", "--max-context", "256",
                "--kv-grow", "--expert-profile", str(world["profile"]), "--short-read", "16",
                "--prefill-chunk", "32"]
    elif case.command == "profile":
        head = ["profile", "--model", str(world["ckpt"]), "--prompts", str(world["prompts"]),
                "-o", str(world["root"] / f"{name}.npz"), "--decode", "4", "--device", "cpu",
                "--kv-grow", "--expert-profile", str(world["profile"]), "--short-read", "16",
                "--prefill-chunk", "32", "--quiet"]
    else:
        head = ["simulate", str(world["trace"]), "--slots", "12", "--loan-slots", "2",
                "--kv-grow", "--chunk-bytes", "4096", "--slot-bytes", "8192",
                "--kv-segment-cell-bytes", "128", "--kv-segments", "4", "--floor-slots", "2",
                "--quiet", "--bounds", "none"]
    return [sys.executable, "-m", "strata.cli", *head, *case.args]


def _env(case: Case, world: dict) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_")}
    env["PYTHONPATH"] = os.pathsep.join([str(world["site"]),
                                         *filter(None, [os.environ.get("PYTHONPATH")])])
    env["OMP_NUM_THREADS"] = "1"  # a few runs at once on a small machine
    env["STRATA_LOAD_PLUGINS"] = DIST
    env.update(GENERATE_ENV if case.command != "simulate" else SIMULATE_ENV)
    env.update({k: v.format(tmp=world["root"]) for k, v in case.env.items()})
    return env


@pytest.fixture(scope="module")
def results(world):
    """name -> CompletedProcess of every case, run WORKERS at a time."""
    def run(name):
        case = CASES[name]
        return name, subprocess.run(_argv(case, world, name), env=_env(case, world),
                                    capture_output=True, text=True, timeout=300,
                                    stdin=subprocess.DEVNULL)

    with ThreadPoolExecutor(WORKERS) as pool:
        return dict(pool.map(run, CASES))


def test_the_matrix_is_large_enough():
    assert len(CASES) >= 50
    every = {"kv_params", "kv_target", "give_up", "relocate", "refill", "observe", "admit"}
    for command in ("generate", "simulate"):
        decisions = {RULES[name.split("-", 1)[1]][0] for name in CASES
                     if name.startswith(f"{command}-") and name.split("-", 1)[1] in RULES}
        assert decisions == every, command
    assert {case.command for case in CASES.values()} == {"generate", "simulate", "profile"}
    assert set(GENERATE_RULES) <= set(RULES) and set(PROFILE_RULES) <= set(RULES)


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_line_and_status_2(results, name):
    case, done = CASES[name], results[name]
    lines = done.stderr.splitlines()
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 2, done.stderr
    assert lines, "nothing on stderr"
    error = lines[-1]
    assert error.startswith(f"strata {case.command}: "), done.stderr
    for words in case.says:
        assert words in error, error
    before = lines[:-1]
    allowed = (("strata: ",) if case.notes else ()) + (("strata trace:",) if case.traced else ())
    assert all(line.startswith(allowed) for line in before) if allowed else before == [], \
        done.stderr
