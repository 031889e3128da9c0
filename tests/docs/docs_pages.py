"""Reading a documentation page into what the docs tests run: commands with their documented
output, and files to write, in page order. The format is described in test_pages.py.

Fences follow CommonMark: three or more backticks (or tildes), closed by a line of at least as
many of the same character; a fence may be indented (inside a list item), and its lines lose
that indentation. A longer fence can therefore show a shorter one as an example (the
contributing page does), and what it shows is not run.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

SHELL_LANGUAGES = {"sh", "bash", "shell", "zsh", "shell-session"}
_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_TITLE = re.compile(r"""\btitle=(?:"(?P<dq>[^"]*)"|'(?P<sq>[^']*)')""")
_DIRECTIVE = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<body>.*?)\s*-->\s*$")
_SKIP = re.compile(r"^skip\b[\s:,.(\-–—]*(?P<reason>.*?)\)?$")
_CONTINUES = ("\\", "|", "&&", "||")


class PageFormatError(ValueError):
    """A page that breaks the format; the message names the page and the line."""


@dataclass(frozen=True)
class Command:
    """`$ text` (its continuation lines included) and the lines documented after it."""

    text: str
    expected: tuple[str, ...]
    line: int  # of the `$ ` line, 1-based


@dataclass(frozen=True)
class WriteFile:
    """A fenced block with `title="path"`: written to `path` (relative to the page's folder)."""

    path: PurePosixPath
    content: str
    line: int


@dataclass
class Page:
    """What a page asks the docs tests to do, in order; `skip` is the reason it opts out."""

    path: Path
    steps: list[Command | WriteFile] = field(default_factory=list)
    skip: str | None = None
    skipped_blocks: list[tuple[int, str]] = field(default_factory=list)  # (line, reason)

    @property
    def commands(self) -> list[Command]:
        return [step for step in self.steps if isinstance(step, Command)]


@dataclass(frozen=True)
class _Block:
    info: str
    lines: list[str]
    line: int  # of the opening fence, 1-based

    @property
    def language(self) -> str:
        words = self.info.strip().lstrip("{").split()
        return words[0].lstrip(".").lower() if words else ""

    @property
    def title(self) -> str | None:
        match = _TITLE.search(self.info)
        return None if match is None else match["dq"] if match["dq"] is not None else match["sq"]


def _skip_reason(body: str, where: str) -> str:
    match = _SKIP.match(body)
    if match is None:
        raise PageFormatError(f"{where}: unknown docs-test directive {body!r}; the one there is "
                              "`<!-- docs-test: skip: REASON -->`")
    if not match["reason"].strip():
        raise PageFormatError(f"{where}: a skip needs its reason, e.g. "
                              "`<!-- docs-test: skip: needs a GPU -->`")
    return match["reason"].strip()


def _blocks(path: Path, text: str):
    """(kind, value, line): ("block", _Block, n) and ("skip", reason, n) in page order, plus
    ("text", None, n) for any other non-blank line (so a skip knows what follows it)."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line, number = lines[i], i + 1
        opening = _FENCE.match(line)
        if opening:
            fence, indent = opening["fence"], len(opening["indent"])
            body, i = [], i + 1
            while i < len(lines):
                closing = re.match(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[i])
                if closing:
                    break
                content = lines[i]
                body.append(content[indent:] if content[:indent].strip() == "" else content)
                i += 1
            else:
                raise PageFormatError(f"{path}:{number}: the fence opened here is never closed")
            yield "block", _Block(opening["info"], body, number), number
        elif (directive := _DIRECTIVE.match(line)) is not None:
            yield "skip", _skip_reason(directive["body"], f"{path}:{number}"), number
        elif line.strip():
            yield "text", None, number
        i += 1


def _complete(command: str) -> bool:
    """Whether `command` ends here: no trailing `\\`, pipe or `&&`, and no open quote."""
    if command.rstrip().endswith(_CONTINUES):
        return False
    try:
        shlex.split(command)
    except ValueError:  # "No closing quotation"
        return False
    return True


def parse_console(block: _Block, where: str) -> list[Command]:
    """The commands of a ```console block: `$ ` lines (and the lines that continue them), each
    followed by its output up to the next `$ ` line."""
    commands: list[tuple[list[str], list[str], int]] = []
    for offset, line in enumerate(block.lines):
        if line.startswith("$ ") or line == "$":
            commands.append(([line[2:]], [], block.line + 1 + offset))
        elif not commands:
            raise PageFormatError(f"{where}:{block.line + 1 + offset}: a console block starts "
                                  "with a `$ ` command; its output follows it")
        elif not commands[-1][1] and not _complete("\n".join(commands[-1][0])):
            commands[-1][0].append(line)
        else:
            commands[-1][1].append(line)
    for text, _, number in commands:
        if not _complete("\n".join(text)):
            raise PageFormatError(f"{where}:{number}: the command never ends (a trailing `\\` "
                                  "or `|`, or a quote left open)")
    return [Command("\n".join(text), tuple(out), number) for text, out, number in commands]


def _target(title: str, where: str) -> PurePosixPath:
    path = PurePosixPath(title)
    if path.is_absolute() or ".." in path.parts or not path.parts:
        raise PageFormatError(f"{where}: title={title!r} must be a relative path inside the "
                              "page's folder")
    return path


def parse_page(path: Path, text: str | None = None) -> Page:
    """The page at `path` (its `text`, if given); PageFormatError for a page that breaks the
    format: an unknown directive or a skip without a reason, a skip not just before a block,
    a console block not starting with a command, a shell block neither console nor skipped."""
    text = path.read_text() if text is None else text
    page, pending, seen_heading = Page(path), None, False
    for kind, value, number in _blocks(path, text):
        where = f"{path}:{number}"
        if kind == "skip":
            if not seen_heading and page.skip is None and not page.steps:
                page.skip = value
                continue
            if pending is not None:
                raise PageFormatError(f"{where}: two skips in a row")
            pending = (value, number)
            continue
        if kind == "text":
            seen_heading = True
            if pending is not None:
                raise PageFormatError(f"{path}:{pending[1]}: a skip comment must come just "
                                      "before the fenced block it skips")
            continue
        seen_heading = True
        block, skip, pending = value, pending, None
        if skip is not None:
            page.skipped_blocks.append((number, skip[0]))
            continue
        if block.language in SHELL_LANGUAGES:
            raise PageFormatError(
                f"{where}: a ```{block.language} block is not run; write it as a ```console "
                "block (`$ ` before each command, its output after) or mark it "
                "`<!-- docs-test: skip: REASON -->`")
        if block.title is not None:
            if block.language == "console":
                raise PageFormatError(f"{where}: a console block is run, not written: drop "
                                      "its title")
            content = "\n".join(block.lines) + "\n"
            page.steps.append(WriteFile(_target(block.title, where), content, number))
        elif block.language == "console":
            page.steps.extend(parse_console(block, str(path)))
    if pending is not None:
        raise PageFormatError(f"{path}:{pending[1]}: a skip comment must come just before the "
                              "fenced block it skips")
    return page
