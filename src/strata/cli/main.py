"""The `strata` command line.

Each subcommand lives with the stage it drives; this module only builds the parser and maps
bad input to one line on stderr and exit status 2.

Building the parser imports every command module, so none of them imports torch or the engine
at module level: `strata --help`, `strata policies` and `strata trace info` start in a fraction
of a second, and a command imports what it runs inside its `run`.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import re
import select
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
    "strata.cli.serve",
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
    away. Subcommands' parsers are of the same class (argparse makes them as their parent).

    An option the command does not have is reported by the subcommand that was given it
    (`strata generate: ...`, pointing to `strata generate --help`), not by `strata`, with the
    closest option it does have; a misspelt command gets the closest command."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}{_did_you_mean_choice(message)} "
                     f"(see {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            chosen = chosen_parser(self, parsed)
            chosen.error(f"unrecognized arguments: {' '.join(extras)}"
                         f"{did_you_mean_option(chosen, extras)}")
        return parsed


def chosen_parser(parser: argparse.ArgumentParser,
                  args: argparse.Namespace) -> argparse.ArgumentParser:
    """The innermost subcommand's parser that `args` went through (`strata trace synth`'s for
    `trace synth ...`), or `parser` itself."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            sub = action.choices.get(getattr(args, action.dest, None) or "")
            if sub is not None:
                return chosen_parser(sub, args)
    return parser


def did_you_mean_option(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """'; did you mean --max-new?' for the first unknown option in `extras` that is close to
    one of `parser`'s, else ''."""
    known = [flag for action in parser._actions for flag in action.option_strings]
    for extra in extras:
        if extra.startswith("-"):
            close = difflib.get_close_matches(extra.split("=", 1)[0], known, n=1, cutoff=0.6)
            if close:
                return f"; did you mean {close[0]}?"
    return ""


_INVALID_CHOICE = re.compile(r"invalid choice: '(?P<given>[^']*)' \(choose from (?P<choices>.*)\)")


def _did_you_mean_choice(message: str) -> str:
    """'; did you mean generate?' for argparse's "invalid choice" of a close command."""
    match = _INVALID_CHOICE.search(message)
    if match is None:
        return ""
    choices = re.findall(r"'([^']*)'", match["choices"])
    close = difflib.get_close_matches(match["given"], choices, n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


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
    exit through SystemExit, status 2).

    A reader that stops reading early (`strata policies --json | head -1`, `strata generate
    ... | head -c 5`) ends the command quietly with status 0: it asked for no more, so the
    output it got is what it wanted. Python's signal docs ("Note on SIGPIPE") give the
    recipe: catch BrokenPipeError at the entry point, with stdout flushed inside the `try` so
    the error surfaces there, and point stdout at /dev/null so the flush at exit does not fail
    again (they exit 1; status 0 is what `head` in a `set -o pipefail` script needs). SIGPIPE
    is left ignored, as Python sets it: restoring its default would kill the process on any
    closed socket as well. Only stdout's own closed pipe is quiet; any other BrokenPipeError
    keeps its traceback."""
    try:
        try:
            return _main(argv)
        finally:
            sys.stdout.flush()
    except BrokenPipeError:
        if not _stdout_reader_gone():
            raise
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 0


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reading end is closed (poll says POLLERR)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    poll = select.poll()
    poll.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poll.poll(0))


def _main(argv: list[str] | None) -> int:
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
