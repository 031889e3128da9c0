"""The `strata` command line.

Each subcommand lives with the stage it drives; this module only builds the parser and maps
user errors to one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from strata import __version__
from strata.cli.errors import UsageError

# Each module adds its subcommand with `register(subparsers)`, setting `run=` to a function
# that takes the parsed namespace and returns an exit status. Listed in the order of `--help`.
COMMAND_MODULES: tuple[str, ...] = (
    "strata.cli.generate",
    "strata.cli.profile",
    "strata.cli.policies",
    "strata.cli.simulate",
    "strata.cli.trace",
    "strata.cli.init_model",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="strata",
        description=(
            "Run Mixture-of-Experts language models larger than the GPU: experts live in host "
            "RAM, a VRAM expert cache holds those that fit, the CPU computes the rest."
        ),
    )
    parser.add_argument("--version", action="version", version=f"strata {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return int(args.run(args) or 0)
    except UsageError as err:
        print(f"strata {args.command}: {err}", file=sys.stderr)
        return 2
