"""Shared test setup. Helpers that are not tests live in tests/support/ (imported as `support`).

The suite sees the built-in policies alone. A researcher who follows the policy tutorial
installs its plugin into the environment the tests run in (as `pip install -e .` does for strata
itself); the tests that count, list or name the policies assume exactly the built-ins plus what
they install themselves. So every policy plugin that is installed when the session starts
(anywhere on sys.path, PYTHONPATH included), other than strata's own, is hidden from discovery
(`importlib.metadata.distributions`, which `strata.policies.registry` reads) for every test,
unless the test is marked `installed_plugins`. A package a test writes or installs itself, into a
temporary directory it puts on sys.path, is a new distribution and is found as usual.
`STRATA_LOAD_PLUGINS=` alone could not do this: the tests of that variable, and those that write
packages, must unset it, and would then see the installed plugins again. Subprocesses a test
starts see what their own environment gives them (tests/docs sets `STRATA_LOAD_PLUGINS`).
"""

import importlib.metadata
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
# The benchmarks' shared helpers (bench/_common.py), for the tests that run a benchmark script;
# run directly, a script finds them beside itself.
sys.path.insert(1, str(Path(__file__).parent.parent / "bench"))

from support.recording_driver import recording_driver  # noqa: F401  (a fixture for all)

HOME_DISTRIBUTION = "strata"


def installed_at(dist: importlib.metadata.Distribution) -> str | None:
    """A distribution's own metadata directory: what tells two installs of one name apart."""
    path = getattr(dist, "_path", None)
    return None if path is None else str(Path(path).resolve())


def _installed_policy_plugins() -> frozenset[str]:
    """Where the installed distributions with a `strata` entry point live, strata's own aside."""
    found = set()
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name == HOME_DISTRIBUTION:
            continue
        if any(ep.group == "strata" for ep in dist.entry_points) and installed_at(dist) is not None:
            found.add(installed_at(dist))
    return frozenset(found)


INSTALLED_POLICY_PLUGINS = _installed_policy_plugins()


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "installed_plugins: see the policy plugins installed in the environment "
                   "(the suite hides them from every other test)")


@pytest.fixture
def installed_policy_plugins():
    """(installed_at, INSTALLED_POLICY_PLUGINS): for a test of the hiding itself."""
    return installed_at, INSTALLED_POLICY_PLUGINS


@pytest.fixture(autouse=True)
def _only_the_built_in_policies(request, monkeypatch):
    if not INSTALLED_POLICY_PLUGINS or request.node.get_closest_marker("installed_plugins"):
        return
    every = importlib.metadata.distributions

    def distributions(**kwargs):
        return (d for d in every(**kwargs) if installed_at(d) not in INSTALLED_POLICY_PLUGINS)

    monkeypatch.setattr(importlib.metadata, "distributions", distributions)


@pytest.fixture
def no_host_page_leaks():
    """Fails the test if it leaves host pages (`strata._vmm.HostPages`) alive, or a fault
    injected into them armed."""
    import gc

    from strata import _vmm

    _vmm.clear_pages_faults()
    gc.collect()
    before = _vmm.alive_host_pages()
    yield
    _vmm.clear_pages_faults()
    gc.collect()
    assert _vmm.alive_host_pages() == before, "a test leaked host pages"
