"""Installed-package layouts written by hand: a module and its `.dist-info` with a `strata`
entry point, as pip would leave them, so that importlib.metadata finds real distributions."""

import itertools
import textwrap
from pathlib import Path

_unique = itertools.count()


def policy_module(policy_name: str, summary: str = "A test policy.") -> str:
    """Source of a plugin module registering one `Policy` subclass named `policy_name`."""
    return textwrap.dedent(f'''
        from strata.policies import Policy, hookimpl


        class TestPolicy(Policy):
            """{summary}"""

            name = {policy_name!r}


        @hookimpl
        def strata_register_policies(register):
            register(TestPolicy)
    ''')


def write_package(root: Path, dist: str, version: str, source: str, entry_name: str = "") -> str:
    """Write a distribution `dist` whose one module (named uniquely) holds `source` and is
    the entry point `entry_name` of group `strata`. Returns the module's name."""
    module = f"{dist.replace('-', '_')}_{next(_unique)}"
    (root / f"{module}.py").write_text(source)
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[strata]\n{entry_name or dist} = {module}\n")
    (info / "RECORD").write_text("")
    return module
