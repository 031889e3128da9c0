"""A policy's options: its `Options` dataclass, filled from `key=value` strings or a dict.

Fields are int, float, bool or str, each with a default; `metadata={"help": ...}` on a field
is the line `strata policies NAME` prints for it. Every error names the policy and lists its
options with their types and defaults.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from strata.policies.errors import OptionError, PluginError

_TYPES = (int, float, bool, str)
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclasses.dataclass(frozen=True)
class OptionSpec:
    name: str
    type: type
    default: Any
    help: str

    def describe(self) -> str:
        return f"{self.name}: {self.type.__name__} = {self.default!r}"


def option_specs(options_cls: type, policy: str = "?") -> list[OptionSpec]:
    """The fields of an Options dataclass; PluginError if it is not one this module can fill."""
    if not (isinstance(options_cls, type) and dataclasses.is_dataclass(options_cls)):
        raise PluginError(f"policy {policy!r}: Options must be a dataclass, got {options_cls!r}")
    try:
        hints = typing.get_type_hints(options_cls)
    except Exception as exc:
        raise PluginError(f"policy {policy!r}: cannot read its Options' types: {exc}") from exc
    specs = []
    for field in dataclasses.fields(options_cls):
        kind = hints.get(field.name)
        if kind not in _TYPES:
            raise PluginError(
                f"policy {policy!r}: option {field.name!r} has type {kind!r}; "
                "options are int, float, bool or str"
            )
        if field.default is dataclasses.MISSING:
            raise PluginError(f"policy {policy!r}: option {field.name!r} has no default")
        specs.append(OptionSpec(field.name, kind, field.default, field.metadata.get("help", "")))
    return specs


def _listing(policy: str, specs: list[OptionSpec]) -> str:
    if not specs:
        return f"policy {policy!r} takes no options"
    return f"the options of policy {policy!r} are: " + ", ".join(s.describe() for s in specs)


def _a(kind: type) -> str:
    return ("an " if kind.__name__[0] in "aeiou" else "a ") + kind.__name__


def _parse(spec: OptionSpec, raw: Any) -> Any:
    """`raw` as the field's type; ValueError if it is not one."""
    if spec.type is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.strip().lower() in _TRUE + _FALSE:
            return raw.strip().lower() in _TRUE
        raise ValueError
    if isinstance(raw, str):
        return spec.type(raw.strip()) if spec.type is not str else raw
    if isinstance(raw, bool):
        raise ValueError
    if spec.type is float and isinstance(raw, int | float):
        return float(raw)
    if spec.type is int and isinstance(raw, int):
        return raw
    raise ValueError


def _pairs(policy: str, given: Sequence[str], specs: list[OptionSpec]) -> dict[str, str]:
    values: dict[str, str] = {}
    for item in given:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise OptionError(
                f"policy {policy!r}: option {item!r} is not key=value; {_listing(policy, specs)}"
            )
        if key in values:
            raise OptionError(f"policy {policy!r}: option {key!r} is given twice")
        values[key] = value
    return values


def parse_options(
    policy: str, options_cls: type, given: Mapping[str, Any] | Sequence[str] | None = None
) -> Any:
    """An `options_cls` instance from `key=value` strings or a dict (strings or typed values).

    OptionError for an unknown key, a value that does not parse, or one the dataclass's own
    `__post_init__` rejects; each message names the policy and lists its options.
    """
    specs = option_specs(options_cls, policy)
    if given is None:
        given = {}
    if isinstance(given, str):
        given = [given]
    values = dict(given) if isinstance(given, Mapping) else _pairs(policy, given, specs)
    by_name = {spec.name: spec for spec in specs}
    parsed = {}
    for key, raw in values.items():
        spec = by_name.get(key)
        if spec is None:
            raise OptionError(
                f"policy {policy!r}: unknown option {key!r}; {_listing(policy, specs)}"
            )
        try:
            parsed[key] = _parse(spec, raw)
        except ValueError:
            raise OptionError(
                f"policy {policy!r}: option {key}={raw!r} is not {_a(spec.type)}; "
                f"{_listing(policy, specs)}"
            ) from None
    try:
        return options_cls(**parsed)
    except (TypeError, ValueError) as exc:
        raise OptionError(f"policy {policy!r}: {exc}; {_listing(policy, specs)}") from None
