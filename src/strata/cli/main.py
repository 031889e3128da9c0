"""The `strata` command line.

Each subcommand lives with the stage it drives; this module only builds the parser and maps
bad input to one line on stderr and exit status 2.

Building the parser imports every command module, so none of them imports torch or the engine
at module level: `strata --help`, `strata policies` and `strata trace info` start in a fraction
of a second, and a command imports what it runs inside its `run`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NoReturn

from strata import __version__
from strata.cli.errors import UsageError
from strata.policies.errors import OptionError, PluginError, PolicyError
from strata.policies.registry import UnknownPolicyError
from strata.settings import SettingError

# Each module adds its subcommand with `register(subparsers)`, setting `run=` to a function
# that takes the parsed namespace and returns an exit status. Listed in the order of `--help`.
COMMAND_MODULES: tuple[str, ...] = (
    "strata.cli.generate",
    "strata.cli.chat",
    "strata.cli.profile",
    "strata.cli.policies",
    "strata.cli.simulate",
    "strata.cli.trace",
    "strata.cli.init_model",
)

# Bad input, wherever it is found: a bad option or file (UsageError), a bad STRATA_* variable,
# an unknown policy or option, a plugin that cannot load, a policy that answers wrongly. Each
# names what is wrong, so one line says it all; any other exception is a bug and keeps its
# traceback.
BAD_INPUT: tuple[type[Exception], ...] = (
    UsageError,
    SettingError,
    UnknownPolicyError,
    OptionError,
    PluginError,
    PolicyError,
)
TRACE_HINT = "STRATA_TRACE_PLUGINS=1 prints every decision"


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser, whose errors (an unknown option, `--max-context 1e12` for an
    integer) are one line like every other bad input, exit status 2; the usage is one `--help`
    away. Subcommands' parsers are of the same class (argparse makes them as their parent)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The `strata` parser, with every command of COMMAND_MODULES."""
    parser = OneLineParser(
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


def error_line(err: Exception) -> str:
    """The one line that reports bad input: the message with its line breaks folded, and for
    a policy's wrong answer how to watch its decisions."""
    text = " ".join(part.strip() for part in str(err).splitlines() if part.strip())
    if isinstance(err, PolicyError) and TRACE_HINT not in text:
        text += f" ({TRACE_HINT})"
    return text


def main(argv: list[str] | None = None) -> int:
    """Run `strata` with `argv` (default: sys.argv[1:]); the exit status (argparse's own errors
    exit through SystemExit, status 2)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return int(args.run(args) or 0)
    except BAD_INPUT as err:
        print(f"strata {args.command}: {error_line(err)}", file=sys.stderr)
        return 2
