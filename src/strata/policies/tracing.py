"""`STRATA_TRACE_PLUGINS=1`: every decision and notification printed with its arguments and
result.

The registry wraps each policy it makes in a `TracedPolicy` when the variable is set, so the
engine, the simulator and the checker see no difference; the plugin manager also prints every
hook call (registration, observers).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Mapping
from typing import Any, TextIO

import numpy as np
import pluggy

from strata import settings
from strata.policies.base import DECISIONS, NOTIFICATIONS, Policy
from strata.policies.view import ResidencyView

ENV_TRACE = settings.TRACE_PLUGINS
PREFIX = "strata trace:"


def tracing_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether `STRATA_TRACE_PLUGINS` in `environ` (os.environ) asks for tracing (any value but
    empty or 0); SettingError for a bad value of any `STRATA_*` variable."""
    return settings.read(environ).trace_plugins


def describe(value: Any) -> str:
    """One short line for an argument or a result."""
    if isinstance(value, ResidencyView):
        return f"<view top={value.top} floor={value.floor} resident={value.n_resident}>"
    if isinstance(value, np.ndarray):
        body = np.array2string(value, threshold=24, edgeitems=4, separator=", ")
        return " ".join(f"{body}:{value.dtype}".split())
    text = " ".join(repr(value).split())
    return text if len(text) <= 200 else text[:197] + "..."


class TracedPolicy(Policy):
    """Wraps a policy: each decision is printed as `name.method(args) -> result` on `stream`."""

    def __init__(self, inner: Policy, stream: TextIO | None = None) -> None:
        self.inner = inner
        self.options = inner.options
        self.name = inner.name  # type: ignore[misc]  # per instance: the wrapped policy's name
        self.stream = stream

    def _call(self, method: str, *args: Any) -> Any:
        params = list(inspect.signature(getattr(Policy, method)).parameters)[1:]
        shown = ", ".join(f"{p}={describe(a)}" for p, a in zip(params, args, strict=True))
        stream = self.stream or sys.stderr
        try:
            result = getattr(self.inner, method)(*args)
        except Exception as exc:
            print(f"{PREFIX} {self.name}.{method}({shown}) raised {exc!r}", file=stream)
            raise
        print(f"{PREFIX} {self.name}.{method}({shown}) -> {describe(result)}", file=stream)
        return result


def _traced(method: str):
    def decision(self: TracedPolicy, *args: Any) -> Any:
        return self._call(method, *args)

    decision.__name__ = method
    decision.__doc__ = getattr(Policy, method).__doc__
    return decision


for _method in (*DECISIONS, *NOTIFICATIONS):
    setattr(TracedPolicy, _method, _traced(_method))


def trace_hook_calls(pm: pluggy.PluginManager, stream: TextIO | None = None) -> None:
    """Print every hook call on `pm` with its arguments and results."""

    def before(hook_name: str, hook_impls: list, kwargs: dict[str, Any]) -> None:
        shown = ", ".join(f"{k}={describe(v)}" for k, v in kwargs.items())
        print(f"{PREFIX} hook {hook_name}({shown}) -> {len(hook_impls)} plugins",
              file=stream or sys.stderr)

    def after(outcome: Any, hook_name: str, hook_impls: list, kwargs: dict[str, Any]) -> None:
        if outcome.exception is not None:
            print(f"{PREFIX} hook {hook_name} raised {outcome.exception!r}",
                  file=stream or sys.stderr)

    pm.add_hookcall_monitoring(before, after)
