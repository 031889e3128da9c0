"""examples/fifo-plugin, clock-plugin and arc-plugin: outside packages whose policies are
compiled rules (`strata.policies.RulePolicy`). Each is built and installed with pip into a
temporary target (no build isolation, no index: nothing is downloaded); the environment itself
is left as it was. On the simulator's `kernel` path their rules run in the C step loop; the
same rules driven step by step from Python (`strata.sim.reference`) give the same counts and
books; ARC is the textbook's; a rule that answers wrongly is a PolicyError naming it."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections import OrderedDict
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch

from sim.test_replay import assert_same, decode_trace
from strata.policies import PolicyError, RulePolicy, compiled_rule
from strata.sim import KvConfig, SynthSpec, synth_trace
from strata.sim.reference import ReferenceReplay
from strata.sim.replay import Replay, ReplayConfig
from support.checkpoints import cached_checkpoint

pytestmark = pytest.mark.slow  # builds four small Cython extensions (about 30 s on 2 cores)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
PLUGINS = {"fifo": "Fifo", "clock": "Clock", "arc": "Arc"}

BAD_RULES = textwrap.dedent("""
    from libc.stdint cimport int32_t
    from strata._residency cimport CacheRule

    cdef class LoanRule(CacheRule):
        cdef int32_t admit(self, int32_t flat) except -2:
            return <int32_t>self.top  # the loan region's first slot: refused

    cdef class RaisingRule(CacheRule):
        cdef int routed(self, int32_t flat, int32_t slot, int32_t n_tokens) except -1:
            raise ValueError(f"expert {flat} is not welcome")
""")


def _bad_rules_package(root: Path) -> Path:
    package = root / "bad-rules"
    (package / "bad_rules").mkdir(parents=True)
    (package / "bad_rules" / "__init__.py").write_text("")
    (package / "bad_rules" / "rules.pyx").write_text(BAD_RULES)
    (package / "setup.py").write_text(
        "from Cython.Build import cythonize\nfrom setuptools import setup\n"
        "setup(name='bad-rules', version='0', packages=['bad_rules'],\n"
        "      ext_modules=cythonize('bad_rules/rules.pyx', language_level=3))\n")
    return package


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    sources = tmp_path_factory.mktemp("src")
    target = tmp_path_factory.mktemp("site")
    packages = [shutil.copytree(EXAMPLES / f"{n}-plugin", sources / f"{n}-plugin")
                for n in PLUGINS]  # pip builds in the tree: keep the checkout clean
    for package in [*packages, _bad_rules_package(sources)]:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-build-isolation",
             "--no-deps", "--no-index", "--target", str(target), str(package)],
            check=True, capture_output=True, text=True)
    return target


@contextlib.contextmanager
def importable(site):
    """The site on sys.path while importing from it (not for the rest of the tests, whose
    registry is the built-ins')."""
    sys.path.insert(0, str(site))
    try:
        yield
    finally:
        sys.path.remove(str(site))


@pytest.fixture(scope="module")
def classes(site):
    with importable(site):
        found = {n: getattr(importlib.import_module(f"strata_{n}"), c) for n, c in PLUGINS.items()}
        found["bad"] = importlib.import_module("bad_rules.rules")
    return found


def test_each_plugin_is_small():
    for name in PLUGINS:
        package = EXAMPLES / f"{name}-plugin" / f"strata_{name}"
        assert len((package / "rule.pyx").read_text().splitlines()) < 60, name
        assert len((package / "__init__.py").read_text().splitlines()) < 30, name


def test_strata_policies_lists_them(site):
    env = os.environ | {"PYTHONPATH": os.pathsep.join(
        [str(site), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("STRATA_LOAD_PLUGINS", None)
    out = subprocess.run([sys.executable, "-m", "strata.cli", "policies", "--json"], env=env,
                         capture_output=True, text=True, check=True).stdout
    listed = {p["name"]: p for p in json.loads(out)}
    for name in PLUGINS:
        assert listed[name]["source"] == f"strata-{name} 0.1.0"
        assert listed[name]["overrides"] == ["observe", "admit"]


def kv_run():
    """A trace whose K/V grows into the cache and trims back, with a loan region."""
    spec = SynthSpec(kind="markov", n_layers=4, n_experts=16, top_k=2, n_requests=6,
                     prompt_tokens=(8, 300), decode_tokens=(4, 40), prompt_chunk=64, seed=3)
    trace = synth_trace(spec)
    kv = KvConfig(max_context=512, slot_bytes=4096, kv_segment_cell_bytes=64, kv_segments=2,
                  chunk_bytes=4096, floor_slots=2)
    return trace, ReplayConfig(slots=24, loan_slots=4, kv=kv)


@pytest.mark.parametrize("name", list(PLUGINS))
@pytest.mark.parametrize("start", ["profile", "empty"])
def test_the_kernel_path_equals_the_engines_sequence(classes, name, start):
    trace, config = kv_run()
    profile = trace.routing_counts() if start == "profile" else None
    env = {"STRATA_KV_GROW_INIT": "64", "STRATA_KV_GROW_STEP": "64"}
    with mock.patch.dict(os.environ, env):
        fast = Replay(trace, classes[name](), config, profile)
        fast.run()
        slow = ReferenceReplay(trace, classes[name](), config, profile)
        slow.run()
    assert fast.result.path == "kernel"
    assert fast.result.events["grows"] and fast.result.events["trims"]
    assert fast.result.layer_admissions.sum() > 0
    assert_same(fast, slow)
    # Sizes without the K/V, as a sweep replays them.
    for slots in (3, 17, 64):
        plain = dataclasses.replace(config, slots=slots, loan_slots=1, kv=None)
        fast = Replay(trace, classes[name](), plain, profile)
        fast.run()
        slow = ReferenceReplay(trace, classes[name](), plain, profile)
        slow.run()
        assert_same(fast, slow)


def textbook_arc_hits(sequence, c):
    """ARC (Megiddo & Modha, FAST 2003, Fig. 4) over a sequence of keys, cache size c."""
    t1, t2, b1, b2 = OrderedDict(), OrderedDict(), OrderedDict(), OrderedDict()  # LRU first
    p, hits = 0.0, 0

    def replace(x):
        if t1 and (len(t1) > p or (x in b2 and len(t1) == p) or not t2):
            b1[t1.popitem(last=False)[0]] = None
        else:
            b2[t2.popitem(last=False)[0]] = None

    for x in sequence:
        if x in t1 or x in t2:
            hits += 1
            (t1 if x in t1 else t2).pop(x)
            t2[x] = None
        elif x in b1:
            p = min(c, p + max(len(b2) / len(b1), 1))
            replace(x)
            b1.pop(x)
            t2[x] = None
        elif x in b2:
            p = max(0, p - max(len(b1) / len(b2), 1))
            replace(x)
            b2.pop(x)
            t2[x] = None
        else:
            if len(t1) + len(b1) == c:
                if len(t1) < c:
                    b1.popitem(last=False)
                    replace(x)
                else:
                    t1.popitem(last=False)
            elif len(t1) + len(t2) + len(b1) + len(b2) >= c:
                if len(t1) + len(t2) + len(b1) + len(b2) == 2 * c:
                    b2.popitem(last=False)
                replace(x)
            t1[x] = None
    return hits


@pytest.mark.parametrize("seed", range(6))
def test_arc_is_the_textbooks(classes, seed):
    rng = np.random.default_rng(seed)
    # A Zipf-ish mix with scans: where ARC's lists and ghosts all come into play.
    keys = np.concatenate([rng.zipf(1.3, 400) % 40, np.arange(40, 70), rng.zipf(1.2, 400) % 50])
    trace = decode_trace(keys.tolist(), n_experts=70)
    for c in (2, 5, 12):
        result = Replay(trace, classes["arc"](), ReplayConfig(slots=c)).run()
        assert result.hits == textbook_arc_hits(keys.tolist(), c), c


def test_a_rule_that_answers_wrongly_is_a_policy_error(classes):
    class Loaner(RulePolicy):
        name = "loaner"
        Rule = classes["bad"].LoanRule

    class Raiser(RulePolicy):
        name = "raiser"
        Rule = classes["bad"].RaisingRule

    trace = decode_trace([0, 1, 2, 3], n_experts=8)
    for path in ("auto", "generic"):
        config = ReplayConfig(slots=3, loan_slots=1, path=path)
        with pytest.raises(PolicyError, match=r"policy 'loaner', admit: admits into slot 2, "
                                              r"in the loan region"):
            Replay(trace, Loaner(), config, np.arange(8)[None, ::-1]).run()
        with pytest.raises(PolicyError, match=r"policy 'raiser', (rule|observe): raised "
                                              r"ValueError: expert 0 is not welcome"):
            Replay(trace, Raiser(), config, np.arange(8)[None, ::-1]).run()
    assert compiled_rule(Loaner()) is not None


def test_arc_decides_in_the_engine(classes, monkeypatch):
    """ARC in a real engine run: the engine asks the rule once per layer step and tells it
    every change; it admits misses once the K/V has taken slots."""
    from engine.cache.test_notifications import engine_with, options

    class CountingArc(classes["arc"]):
        def __init__(self, options=None):
            super().__init__(options)
            self.admitted = 0

        def entered(self, view, why, placements):
            super().entered(view, why, placements)
            self.admitted += len(placements) if why == "admit" else 0

    monkeypatch.setenv("STRATA_LOAN_KEEP_SLOTS", "8")
    policy = CountingArc()
    assert compiled_rule(policy) is policy.rule  # a Python `entered` keeps the rule compiled
    engine = engine_with(cached_checkpoint("qwen3_moe", "tiny", dtype=torch.float32), policy)
    with engine:
        engine.generate([3 + i % 250 for i in range(250)], options(40))
        engine.generate(list(range(200, 210)), options(6))
        engine.cache.table.validate()
    assert policy.rule.bound and policy.admitted > 0
