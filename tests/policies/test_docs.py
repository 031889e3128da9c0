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
                            "observe", "admit"}
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
