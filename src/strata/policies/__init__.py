"""Policies: the plugin API and the built-in policies.

A policy reads the books through a read-only `ResidencyView` and answers decisions; the engine
and the simulator ask through `strata.books.CheckedPolicy`, which checks every answer
(`PolicyError`), and apply them with `strata.books`' `apply_*`. Plugins register policies and
observe events through pluggy hooks (`strata.policies.hookspecs`), marked with `hookimpl`.
A policy learns every entry and exit of an expert through its notifications (`entered`,
`left`, `moved`); `StatefulPolicy` is the pattern of one that keeps its own state, and
`RulePolicy` runs a compiled `CacheRule` (a plugin's Cython) at the built-ins' speed.
"""

from strata.policies.base import (
    DECISIONS,
    NOTIFICATIONS,
    REPLAY_KERNELS,
    WHY,
    LfuState,
    LruState,
    NoOptions,
    Policy,
    SieveState,
)
from strata.policies.errors import OptionError, PluginError, PolicyError
from strata.policies.events import EngineInfo, Event, announce_start, emit
from strata.policies.hookspecs import hookimpl
from strata.policies.kv_params import KvContext, KvParams
from strata.policies.registry import (
    DEFAULT_POLICY,
    PolicyEntry,
    PolicyRegistry,
    UnknownPolicyError,
    load_registry,
    plugin_manager,
)
from strata.policies.rule import CacheRule, RulePolicy, compiled_rule
from strata.policies.stateful import StatefulPolicy
from strata.policies.view import ResidencyView

__all__ = [
    "DECISIONS",
    "DEFAULT_POLICY",
    "NOTIFICATIONS",
    "REPLAY_KERNELS",
    "WHY",
    "CacheRule",
    "EngineInfo",
    "Event",
    "KvContext",
    "KvParams",
    "LfuState",
    "LruState",
    "NoOptions",
    "OptionError",
    "PluginError",
    "Policy",
    "PolicyEntry",
    "PolicyError",
    "PolicyRegistry",
    "ResidencyView",
    "RulePolicy",
    "SieveState",
    "StatefulPolicy",
    "UnknownPolicyError",
    "announce_start",
    "compiled_rule",
    "emit",
    "hookimpl",
    "load_registry",
    "plugin_manager",
]
