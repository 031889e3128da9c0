"""Discovery: built-ins through the package's own entry points, outside packages through
theirs, STRATA_LOAD_PLUGINS, clashes and bad plugins, observers, and STRATA_TRACE_PLUGINS."""

import importlib.metadata

import pytest

from strata.books import CheckedPolicy
from strata.policies import (
    EngineInfo,
    PluginError,
    UnknownPolicyError,
    announce_start,
    emit,
    hookimpl,
    load_registry,
    plugin_manager,
)
from strata.policies.events import EVENTS, Grown, Parked
from strata.policies.registry import StrataPluginManager, collect_policies
from strata.policies.tracing import TracedPolicy
from support.policy_packages import policy_module, write_package
from support.policy_tables import make_table

BUILT_IN = ["coldest-in-loan", "lfu", "lru", "sieve", "static"]


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A directory on sys.path, as a site-packages, for packages written by the test."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("STRATA_LOAD_PLUGINS", raising=False)
    return tmp_path


def test_built_ins_come_through_the_package_s_entry_points():
    entry_points = importlib.metadata.distribution("strata").entry_points
    modules = {ep.name: ep.value for ep in entry_points if ep.group == "strata"}
    assert sorted(modules) == BUILT_IN
    registry = load_registry()
    assert registry.names() == BUILT_IN
    for name in BUILT_IN:
        entry = registry.get(name)
        assert entry.source == f"strata {importlib.metadata.version('strata')}"
        assert entry.cls.__module__ == modules[name]


@pytest.mark.installed_plugins
def test_a_test_that_asks_sees_the_installed_plugins(monkeypatch, installed_policy_plugins):
    """Every other test sees the built-ins alone (tests/conftest.py); one marked
    `installed_plugins` sees what the environment holds. test_example_plugin.py runs this module
    with the policy tutorial's plugin installed, where there is one to see."""
    monkeypatch.delenv("STRATA_LOAD_PLUGINS", raising=False)
    where, installed = installed_policy_plugins
    assert {where(d) for d in importlib.metadata.distributions()} >= installed


def test_an_unknown_name_lists_the_known_ones():
    with pytest.raises(UnknownPolicyError) as caught:
        load_registry().get("lru2")
    assert str(caught.value) == f"unknown policy 'lru2'; known: {', '.join(BUILT_IN)}"


def test_an_outside_package_s_policy_is_found(site):
    write_package(site, "strata-policy-extra", "1.2", policy_module("extra", "One more."))
    registry = load_registry()
    assert registry.names() == sorted([*BUILT_IN, "extra"])
    assert registry.get("extra").source == "strata-policy-extra 1.2"
    assert registry.get("extra").summary == "One more."


def test_two_packages_registering_one_name_is_an_error_naming_both(site):
    write_package(site, "pkg-a", "1.0", policy_module("twin"))
    write_package(site, "pkg-b", "2.0", policy_module("twin"))
    with pytest.raises(PluginError) as caught:
        load_registry()
    message = str(caught.value)
    assert message.startswith("policy 'twin' is registered twice: by pkg-")
    assert "pkg-a 1.0" in message and "pkg-b 2.0" in message
    assert "STRATA_LOAD_PLUGINS" in message


def test_a_package_clashing_with_a_built_in_is_an_error_naming_both(site):
    write_package(site, "pkg-lru", "0.1", policy_module("lru"))
    with pytest.raises(PluginError, match=r"policy 'lru' is registered twice: by strata .* and "
                                          r"by pkg-lru 0\.1"):
        load_registry()


def test_strata_load_plugins_limits_the_outside_plugins(site, monkeypatch):
    write_package(site, "pkg-a", "1.0", policy_module("twin"))
    write_package(site, "pkg-b", "2.0", policy_module("twin"), entry_name="b-policies")
    monkeypatch.setenv("STRATA_LOAD_PLUGINS", "pkg-a")
    assert load_registry().get("twin").source == "pkg-a 1.0"
    monkeypatch.setenv("STRATA_LOAD_PLUGINS", " b-policies ,")  # an entry point name works too
    assert load_registry().get("twin").source == "pkg-b 2.0"
    monkeypatch.setenv("STRATA_LOAD_PLUGINS", "")  # none of the outside ones
    assert load_registry().names() == BUILT_IN  # the package's own always load
    monkeypatch.setenv("STRATA_LOAD_PLUGINS", "pkg-a,pkg-c")
    with pytest.raises(PluginError, match="STRATA_LOAD_PLUGINS names pkg-c, which no installed "
                                          "plugin is; installed: b-policies, pkg-a, pkg-b"):
        load_registry()


def test_a_plugin_that_fails_to_import_is_named(site):
    write_package(site, "pkg-broken", "0.3", "raise ImportError('no numpy here')\n")
    with pytest.raises(PluginError, match=r"plugin 'pkg-broken' of pkg-broken 0\.3 failed to "
                                          r"load .*ImportError: no numpy here"):
        load_registry()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("register(int)", "registered <class 'int'>, which is not a Policy subclass"),
        ("register(Nameless)", "registered Nameless with name ''"),
        ("register(Bad)", "registered Bad with name 'Bad Name'; a policy name is lower case"),
        ("raise RuntimeError('oops')", "failed to register its policies: RuntimeError: oops"),
    ],
)
def test_a_bad_registration_is_named(body, message):
    from strata.policies import Policy

    class Nameless(Policy):
        pass

    class Bad(Policy):
        name = "Bad Name"

    class Plugin:
        @hookimpl
        def strata_register_policies(self, register):
            exec(body, {"register": register, "Nameless": Nameless, "Bad": Bad})

    pm = StrataPluginManager()
    pm.register(Plugin(), name="bad-plugin")
    with pytest.raises(PluginError) as caught:
        collect_policies(pm)
    assert str(caught.value).startswith(f"plugin bad-plugin {message}")


def test_observers_receive_events_and_the_historic_start():
    seen = []

    class Observer:
        @hookimpl
        def strata_event(self, event):
            seen.append(event)

        @hookimpl
        def strata_engine_started(self, info):
            seen.append(info)

    pm = plugin_manager()
    first, late = Observer(), Observer()
    pm.register(first)
    info = EngineInfo("tiny", "cpu", "lru", 2, 8, 10, 3, 2, 4096, 1024, True)
    announce_start(pm, info)
    emit(pm, Grown(cells_before=1024, cells_after=2048, chunks_from_budget=1, chunks_from_cache=3))
    pm.register(late)  # historic: told about the start on registration
    emit(pm, Parked(conversation="c1", cells=2048, nbytes=1 << 20))
    assert [type(x).__name__ for x in seen] == [
        "EngineInfo", "Grown", "EngineInfo", "Parked", "Parked"]
    assert {e.kind for e in EVENTS} == {
        "grown", "gave_up", "relocated", "trimmed", "refilled", "admitted", "evicted", "parked",
        "restored", "request_started", "request_finished"}


def test_events_reject_negative_counts():
    with pytest.raises(ValueError, match=r"Grown\.chunks_from_cache must be an int >= 0, got -1"):
        Grown(cells_before=1, cells_after=2, chunks_from_budget=0, chunks_from_cache=-1)


def test_trace_prints_every_decision_and_hook_call(monkeypatch, capsys):
    monkeypatch.setenv("STRATA_TRACE_PLUGINS", "1")
    registry = load_registry()
    policy = registry.create("coldest-in-loan")
    assert isinstance(policy, TracedPolicy) and policy.name == "coldest-in-loan"
    checked = CheckedPolicy(policy, make_table(top=8, floor=2))
    checked.give_up(2)
    emit(registry.pm, Grown(cells_before=1, cells_after=2, chunks_from_budget=0,
                            chunks_from_cache=3))
    lines = capsys.readouterr().err.splitlines()
    assert "strata trace: coldest-in-loan.give_up(view=<view top=8 floor=2 resident=10>, " \
           "n_chunks=2) -> [6, 7]:int32" in lines
    assert "strata trace: coldest-in-loan.relocate(view=<view top=8 floor=2 resident=10>, " \
           "slots=[6, 7]:int32) -> [(6, 9), (7, 8)]" in lines
    version = importlib.metadata.version("strata")
    assert f"strata trace: strata {version} registered coldest-in-loan " \
           "(strata.policies.builtin.coldest_in_loan.ColdestInLoan)" in lines
    assert "strata trace: hook strata_event(event=Grown(cells_before=1, cells_after=2, " \
           "chunks_from_budget=0, chunks_from_cache=3)) -> 0 plugins" in lines


def test_without_the_variable_nothing_is_traced(monkeypatch, capsys):
    monkeypatch.delenv("STRATA_TRACE_PLUGINS", raising=False)
    policy = load_registry().create("lru")
    assert type(policy).__name__ == "Lru"
    CheckedPolicy(policy, make_table(top=8, floor=2)).give_up(2)
    assert capsys.readouterr().err == ""
