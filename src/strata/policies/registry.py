"""Discovery: the plugin manager, entry points of group `strata`, and the policy registry.

Built-in policies are registered by plugin modules inside the package, through the package's
own `strata` entry points, exactly as an outside package registers its own.
`STRATA_LOAD_PLUGINS` (a comma list of distribution or entry point names) limits which outside
plugins load; the package's own always do, since the default policy lives there.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pluggy

from strata import settings
from strata.policies import hookspecs
from strata.policies.base import Policy
from strata.policies.errors import PluginError
from strata.policies.options import OptionSpec, option_specs, parse_options
from strata.policies.tracing import PREFIX as TRACE_PREFIX
from strata.policies.tracing import TracedPolicy, trace_hook_calls, tracing_enabled

ENTRY_POINT_GROUP = "strata"
ENV_LOAD = settings.LOAD_PLUGINS
DEFAULT_POLICY = "coldest-in-loan"
HOME_DISTRIBUTION = "strata"
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]*$")


class UnknownPolicyError(ValueError):
    """No policy of that name is registered; the message lists the known ones."""


class StrataPluginManager(pluggy.PluginManager):
    """pluggy's manager for project `strata`, remembering each plugin's distribution."""

    def __init__(self) -> None:
        super().__init__(hookspecs.PROJECT)
        self.add_hookspecs(hookspecs)
        # plugin name -> "distribution version", for `strata policies` and error messages
        self.sources: dict[str, str] = {}

    def source_of(self, plugin_name: str) -> str:
        return self.sources.get(plugin_name, f"plugin {plugin_name}")


def load_entry_points(pm: StrataPluginManager, environ: Mapping[str, str] | None = None) -> None:
    """Register every plugin of entry point group `strata` on sys.path that is let load
    (`STRATA_LOAD_PLUGINS` in `environ`, default os.environ)."""
    wanted = settings.read(environ).load_plugins
    seen_dists: set[str] = set()
    outside: set[str] = set()
    matched: set[str] = set()
    for dist in importlib.metadata.distributions():
        dist_name = dist.metadata["Name"] or "?"
        key = dist_name.lower().replace("_", "-")
        if key in seen_dists:  # the same distribution twice on sys.path: the first is imported
            continue
        seen_dists.add(key)
        for ep in dist.entry_points:
            if ep.group != ENTRY_POINT_GROUP:
                continue
            names = {dist_name, key, ep.name}
            matched.update(names & (wanted or set()))
            if key != HOME_DISTRIBUTION:
                outside.update((dist_name, ep.name))
                if wanted is not None and not names & wanted:
                    continue
            source = f"{dist_name} {dist.version}"
            try:
                plugin = ep.load()
            except Exception as exc:
                raise PluginError(
                    f"plugin {ep.name!r} of {source} failed to load ({ep.value}): "
                    f"{type(exc).__name__}: {exc}; set {ENV_LOAD} to leave it out"
                ) from exc
            plugin_name = f"{dist_name}:{ep.name}"
            pm.register(plugin, name=plugin_name)
            pm.sources[plugin_name] = source
    if wanted is not None and wanted - matched:
        raise PluginError(
            f"{ENV_LOAD} names {', '.join(sorted(wanted - matched))}, which no installed plugin "
            f"is; installed: {', '.join(sorted(outside)) or 'none'}"
        )


def plugin_manager(
    *, entry_points: bool = True, environ: Mapping[str, str] | None = None
) -> StrataPluginManager:
    """A plugin manager with the hookspecs, the plugins found, and tracing if asked for."""
    pm = StrataPluginManager()
    if tracing_enabled(environ):
        trace_hook_calls(pm)
    if entry_points:
        load_entry_points(pm, environ)
    return pm


@dataclass(frozen=True)
class PolicyEntry:
    """One registered policy: its class and where it came from."""

    name: str
    cls: type[Policy]
    source: str

    @property
    def summary(self) -> str:
        doc = (self.cls.__doc__ or "").strip()
        return doc.splitlines()[0] if doc else ""

    @property
    def overrides(self) -> tuple[str, ...]:
        return self.cls.overrides()

    @property
    def options(self) -> list[OptionSpec]:
        return option_specs(self.cls.Options, self.name)


class PolicyRegistry:
    """The policies that the plugins registered, by name."""

    def __init__(self, entries: Mapping[str, PolicyEntry], pm: pluggy.PluginManager) -> None:
        self.entries = dict(sorted(entries.items()))
        self.pm = pm

    def names(self) -> list[str]:
        return list(self.entries)

    def get(self, name: str) -> PolicyEntry:
        entry = self.entries.get(name)
        if entry is None:
            raise UnknownPolicyError(
                f"unknown policy {name!r}; known: {', '.join(self.entries) or 'none'}"
            )
        return entry

    def create(
        self, name: str, options: Mapping[str, Any] | Sequence[str] | None = None
    ) -> Policy:
        """A new instance of policy `name` with `options` (`key=value` strings or a dict),
        wrapped for tracing when STRATA_TRACE_PLUGINS is set."""
        entry = self.get(name)
        policy = entry.cls(parse_options(name, entry.cls.Options, options))
        return TracedPolicy(policy) if tracing_enabled() else policy


def _check_class(cls: Any, source: str) -> None:
    if not (isinstance(cls, type) and issubclass(cls, Policy)) or cls is Policy:
        raise PluginError(f"{source} registered {cls!r}, which is not a Policy subclass")
    if not isinstance(cls.name, str) or not _NAME.match(cls.name):
        raise PluginError(
            f"{source} registered {cls.__name__} with name {cls.name!r}; a policy name is "
            "lower case letters, digits, '.', '_' or '-'"
        )
    option_specs(cls.Options, cls.name)


def collect_policies(pm: StrataPluginManager) -> PolicyRegistry:
    """Ask every plugin to register its policies; PluginError for a clash or a bad class."""
    entries: dict[str, PolicyEntry] = {}
    tracing = tracing_enabled()
    for impl in reversed(pm.hook.strata_register_policies.get_hookimpls()):  # registration order
        source = pm.source_of(impl.plugin_name)

        def register(cls: type[Policy], source: str = source) -> None:
            _check_class(cls, source)
            old = entries.get(cls.name)
            if old is not None:
                raise PluginError(
                    f"policy {cls.name!r} is registered twice: by {old.source} "
                    f"({old.cls.__module__}.{old.cls.__qualname__}) and by {source} "
                    f"({cls.__module__}.{cls.__qualname__}); uninstall one, or leave one out "
                    f"with {ENV_LOAD}"
                )
            entries[cls.name] = PolicyEntry(cls.name, cls, source)
            if tracing:
                print(f"{TRACE_PREFIX} {source} registered {cls.name} "
                      f"({cls.__module__}.{cls.__qualname__})", file=sys.stderr)

        try:
            impl.function(**{arg: register for arg in impl.argnames})
        except PluginError:
            raise
        except Exception as exc:
            raise PluginError(
                f"{source} failed to register its policies: {type(exc).__name__}: {exc}"
            ) from exc
    return PolicyRegistry(entries, pm)


def load_registry(pm: StrataPluginManager | None = None) -> PolicyRegistry:
    """The registry of every policy the installed plugins register."""
    return collect_policies(plugin_manager() if pm is None else pm)
