"""docs/policies/reference.md against the code: every hook and every `Policy` method has a
heading with its exact signature, and every such heading names one that exists."""

import inspect
import re
from pathlib import Path

from strata.policies import Policy, hookspecs

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "policies" / "reference.md"
HEADING = re.compile(r"^### `(?P<name>\w+)\((?P<rest>.*)`$", re.M)


def signature_line(name, function):
    """`name(arg: annotation, ...) -> annotation`, annotations as written in the source."""
    signature = inspect.signature(function)
    params = [
        p.name if p.annotation is inspect.Parameter.empty else f"{p.name}: {p.annotation}"
        for p in signature.parameters.values()
        if p.name != "self"
    ]
    returns = signature.return_annotation
    tail = "" if returns is inspect.Signature.empty else f" -> {returns}"
    return f"{name}({', '.join(params)}){tail}"


def in_code():
    hooks = {name: getattr(hookspecs, name) for name in dir(hookspecs)
             if name.startswith("strata_")}
    methods = {name: getattr(Policy, name) for name, member in vars(Policy).items()
               if not name.startswith("_") and callable(getattr(Policy, name))
               and name != "Options"}
    assert set(methods) >= {"kv_params", "kv_target", "give_up", "relocate", "refill",
                            "observe", "admit", "entered", "left", "moved", "overrides",
                            "listens"}
    assert set(hooks) == {"strata_register_policies", "strata_engine_started", "strata_event"}
    return {name: signature_line(name, f) for name, f in (hooks | methods).items()}


def in_docs():
    text = REFERENCE.read_text()
    return {m["name"]: f"{m['name']}({m['rest']}" for m in HEADING.finditer(text)}


def test_every_hook_and_method_is_documented_with_its_signature():
    code, docs = in_code(), in_docs()
    undocumented = sorted(set(code) - set(docs))
    assert not undocumented, f"not in {REFERENCE.name}: {undocumented}"
    for name, line in code.items():
        assert docs[name] == line, f"{REFERENCE.name} says {docs[name]!r}, the code {line!r}"


def test_nothing_documented_that_is_not_there():
    stale = sorted(set(in_docs()) - set(in_code()))
    assert not stale, f"{REFERENCE.name} documents what the code lacks: {stale}"


def test_the_check_would_see_a_changed_signature():
    def give_up(self, view, n_chunks: int, spare: int = 0) -> list:
        """A stand-in with an extra argument."""

    assert signature_line("give_up", give_up) != in_docs()["give_up"]


def test_the_stateful_example_runs_as_documented():
    """The reference's `StatefulPolicy` example is a FIFO by entry time: replayed, it keeps
    its state in step with the books through the notifications, and its answers pass."""
    import numpy as np

    from strata.sim import ReplayConfig, replay
    from strata.sim.synth import SynthSpec, synth_trace

    text = REFERENCE.read_text()
    section = text[text.index("## Stateful policies"):text.index("## Compiled rules")]
    code = section[section.index("```python\n") + 10:section.index("```\n\n- Options")]
    namespace: dict = {}
    exec(compile(code, "reference.md", "exec"), namespace)
    trace = synth_trace(SynthSpec(kind="markov", n_layers=3, n_experts=16, top_k=2,
                                  n_requests=2, prompt_tokens=16, decode_tokens=40))
    policy = namespace["Fifo"]({"max_admits": 2})
    result = replay(trace, policy, ReplayConfig(slots=12), trace.routing_counts())
    assert result.path == "generic" and result.layer_admissions.sum() > 0
    assert (result.layer_admissions <= 2 * trace.n_steps).all()
    # Entry times: the 12 filled first, then one per admission, each slot's latest.
    assert policy.clock == 12 + result.layer_admissions.sum()
    assert np.unique(policy.entered_at).size == 12


def test_the_stateful_tutorial_shows_the_example_package_as_it_is():
    """Each file the stateful tutorial has the reader write under strata-arc/ is, byte for
    byte, the one in examples/arc-plugin (which tests/policies/test_rule_plugins.py builds and
    holds to the reference)."""
    tutorial = REFERENCE.parent / "stateful-tutorial.md"
    example = REFERENCE.parents[2] / "examples" / "arc-plugin"
    blocks = re.findall(r'^```\w+ title="strata-arc/([^"]+)"\n(.*?)^```$', tutorial.read_text(),
                        re.M | re.S)
    assert sorted(name for name, _ in blocks) == [
        "pyproject.toml", "setup.py", "strata_arc/__init__.py", "strata_arc/rule.pyx"]
    for name, body in blocks:
        assert body == (example / name).read_text(), name
