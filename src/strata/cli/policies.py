"""`strata policies [NAME] [--json]`, and the `--policy` / `--policy-opt` options every command
that runs a policy shares (`add_policy_arguments`, `policy_from_args`)."""

from __future__ import annotations

import argparse
import inspect
import json
from typing import Any

from strata.cli.errors import UsageError
from strata.policies.base import Policy
from strata.policies.errors import OptionError, PluginError
from strata.policies.registry import (
    DEFAULT_POLICY,
    PolicyEntry,
    PolicyRegistry,
    UnknownPolicyError,
    load_registry,
)


def add_policy_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `--policy NAME` and repeatable `--policy-opt KEY=VALUE` to a command's parser."""
    group = parser.add_argument_group("policy")
    group.add_argument(
        "--policy",
        metavar="NAME",
        default=DEFAULT_POLICY,
        help=f"the cache policy (default {DEFAULT_POLICY}; `strata policies` lists them)",
    )
    group.add_argument(
        "--policy-opt",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        dest="policy_opts",
        help="set one of the policy's options; repeat for more",
    )


def _registry() -> PolicyRegistry:
    try:
        return load_registry()
    except PluginError as exc:
        raise UsageError(str(exc)) from None


def policy_from_args(
    args: argparse.Namespace, registry: PolicyRegistry | None = None
) -> Policy:
    """The policy `--policy` names with its `--policy-opt` options; UsageError if it cannot be."""
    registry = registry or _registry()
    try:
        return registry.create(args.policy, args.policy_opts)
    except (UnknownPolicyError, OptionError) as exc:
        raise UsageError(str(exc)) from None


def describe_entry(entry: PolicyEntry) -> dict[str, Any]:
    """One policy as a JSON-ready dict."""
    return {
        "name": entry.name,
        "default": entry.name == DEFAULT_POLICY,
        "summary": entry.summary,
        "description": inspect.cleandoc(entry.cls.__doc__ or ""),
        "source": entry.source,
        "class": f"{entry.cls.__module__}.{entry.cls.__qualname__}",
        "overrides": list(entry.overrides),
        "options": [
            {"name": o.name, "type": o.type.__name__, "default": o.default, "help": o.help}
            for o in entry.options
        ],
    }


def _heading(entry: PolicyEntry) -> str:
    return entry.name + (" (default)" if entry.name == DEFAULT_POLICY else "")


def _overrides(entry: PolicyEntry) -> str:
    return ", ".join(entry.overrides) or "none (the defaults)"


def _short_listing(entry: PolicyEntry) -> str:
    options = ", ".join(o.describe() for o in entry.options) or "none"
    return "\n".join([
        _heading(entry),
        f"    {entry.summary}",
        f"    source: {entry.source}",
        f"    overrides: {_overrides(entry)}",
        f"    options: {options}",
    ])


def _full_listing(entry: PolicyEntry) -> str:
    lines = [
        _heading(entry),
        f"source: {entry.source} ({entry.cls.__module__}.{entry.cls.__qualname__})",
        "",
        inspect.cleandoc(entry.cls.__doc__ or "(no description)"),
        "",
        f"overrides: {_overrides(entry)}",
        "options:" if entry.options else "options: none",
    ]
    for option in entry.options:
        lines.append(f"    {option.describe()}" + (f"  {option.help}" if option.help else ""))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """`strata policies [NAME] [--json]`: list the policies, or show one in full."""
    registry = _registry()
    if args.name is not None:
        try:
            entries = [registry.get(args.name)]
        except UnknownPolicyError as exc:
            raise UsageError(str(exc)) from None
    else:
        entries = list(registry.entries.values())
    if args.json:
        described = [describe_entry(e) for e in entries]
        print(json.dumps(described[0] if args.name else described, indent=2))
    elif args.name:
        print(_full_listing(entries[0]))
    else:
        print("\n".join(_short_listing(e) for e in entries))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `strata policies` to `subparsers`."""
    parser = subparsers.add_parser(
        "policies",
        help="list the cache policies, their sources and options",
        description=(
            "List the cache policies the installed plugins register: name, summary, source "
            "package, the decisions each overrides, and its options with defaults."
        ),
    )
    parser.add_argument("name", nargs="?", metavar="NAME", help="show this policy in full")
    parser.add_argument("--json", action="store_true", help="print JSON, for scripts")
    parser.set_defaults(run=run)
