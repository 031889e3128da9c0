"""The hooks of the pluggy project `strata`: what a plugin may implement.

A plugin is a module (or object) with functions marked `@strata.policies.hookimpl`, found
through an entry point of group `strata`. Registration and the observers go through pluggy;
the decisions themselves are methods of the `Policy` a plugin registers, called directly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from strata.policies.base import Policy
    from strata.policies.events import EngineInfo, Event

PROJECT = "strata"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def strata_register_policies(register: Callable[[type[Policy]], None]) -> None:
    """Register policy classes: call `register(PolicyClass)` once for each.

    Called once per plugin, when the policy registry is built (at the start of every command
    that runs a policy, and by `strata policies`). `register` takes a `Policy` subclass whose
    `name` is set; the name is what `--policy` selects. A name registered twice, by the same
    package or by two, is an error naming both, and so is a class that is not a `Policy` or
    whose `Options` cannot be filled from `--policy-opt`. Return nothing; a return value is
    ignored.
    """


@hookspec(historic=True)
def strata_engine_started(info: EngineInfo) -> None:
    """The engine has started: `info` (an `EngineInfo`) holds its shape and the policy chosen.

    Called once per engine, after the cache is filled and before the first request. Historic:
    a plugin registered later is called with it too. Any number of plugins may observe;
    return nothing (a return value is ignored). An exception propagates and stops the engine.
    """


@hookspec
def strata_event(event: Event) -> None:
    """Something happened to the cache or the K/V: `event` is one of the frozen dataclasses of
    `strata.policies.events` (`Grown`, `GaveUp`, `Relocated`, `Trimmed`, `Refilled`,
    `Admitted`, `Evicted`, `Parked`, `Restored`, `RequestStarted`, `RequestFinished`) with its
    figures.

    Called after the books and the memory agree again, once per event, in the order things
    happened. Any number of plugins may observe (tracing and metrics are observers); return
    nothing (a return value is ignored). An exception propagates to the caller.
    """
