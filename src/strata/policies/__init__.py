"""Policies: the plugin API and the built-in policies.

A policy reads the books through a read-only `ResidencyView` and answers decisions; the engine
and the simulator ask through `CheckedPolicy`, which checks every answer (`PolicyError`), and
act with `apply_give_up` / `apply_refill` / `apply_admit`. Plugins register policies and
observe events through pluggy hooks (`strata.policies.hookspecs`), marked with `hookimpl`.
"""

from strata.policies.apply import GiveUpPlan, apply_admit, apply_give_up, apply_refill
from strata.policies.base import DECISIONS, NoOptions, Policy
from strata.policies.checked import CheckedPolicy
from strata.policies.errors import OptionError, PluginError, PolicyError
from strata.policies.events import EngineInfo, Event, announce_start, emit
from strata.policies.hookspecs import hookimpl
from strata.policies.kv import KvContext, KvParams
from strata.policies.registry import (
    DEFAULT_POLICY,
    PolicyEntry,
    PolicyRegistry,
    UnknownPolicyError,
    load_registry,
    plugin_manager,
)
from strata.policies.validate import validate_decision
from strata.policies.view import ResidencyView

__all__ = [
    "DECISIONS",
    "DEFAULT_POLICY",
    "CheckedPolicy",
    "EngineInfo",
    "Event",
    "GiveUpPlan",
    "KvContext",
    "KvParams",
    "NoOptions",
    "OptionError",
    "PluginError",
    "Policy",
    "PolicyEntry",
    "PolicyError",
    "PolicyRegistry",
    "ResidencyView",
    "UnknownPolicyError",
    "announce_start",
    "apply_admit",
    "apply_give_up",
    "apply_refill",
    "emit",
    "hookimpl",
    "load_registry",
    "plugin_manager",
    "validate_decision",
]
