"""The docs runner itself: it reads the format as test_pages.py describes it, and a page whose
documented output differs from what its commands print fails, naming the line."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path, PurePosixPath

import pytest
from docs_outputs import explain, matches
from docs_pages import Command, PageFormatError, WriteFile, parse_page
from docs_session import CACHE_SHOWN_AS, PageSession, rewrite_pip, run_page

FENCE = "```"


def page(tmp_path, text, name="page.md"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).replace("'''", FENCE))
    return parse_page(path)


def test_commands_their_continuations_and_their_output(tmp_path):
    parsed = page(tmp_path, """\
        # A page

        '''console
        $ echo one \\
            two
        one two
        $ printf 'a\\nb\\n' |
          sort -r
        b
        a
        $ python -c "
        print('open quote')"
        open quote
        $ true
        '''
        """)
    assert [(c.text, c.expected) for c in parsed.commands] == [
        ("echo one \\\n    two", ("one two",)),
        ("printf 'a\\nb\\n' |\n  sort -r", ("b", "a")),
        ("python -c \"\nprint('open quote')\"", ("open quote",)),
        ("true", ()),
    ]
    assert [c.line for c in parsed.commands] == [4, 7, 11, 14]


def test_titled_blocks_are_files_in_page_order_and_others_are_shown_only(tmp_path):
    parsed = page(tmp_path, """\
        # A page

        '''python title="pkg/mod.py"
        X = 1
        '''

        '''python
        print("shown, not run")
        '''

        '''console
        $ cat pkg/mod.py
        X = 1
        '''

        ~~~~markdown
        '''console
        $ echo "an example of the format, inside another fence: not run"
        '''
        ~~~~
        """)
    assert parsed.steps == [WriteFile(PurePosixPath("pkg/mod.py"), "X = 1\n", 3),
                            Command("cat pkg/mod.py", ("X = 1",), 12)]


def test_skips_need_a_reason_and_a_block_after_them(tmp_path):
    parsed = page(tmp_path, """\
        # A page

        <!-- docs-test: skip: needs a GPU -->
        '''console
        $ nvidia-smi
        '''
        <!-- docs-test: skip (a download) -->
        '''sh
        hf download x
        '''
        """)
    assert parsed.steps == [] and parsed.skip is None
    assert parsed.skipped_blocks == [(4, "needs a GPU"), (8, "a download")]
    whole = page(tmp_path, "<!-- docs-test: skip: a server -->\n# A page\n", "whole.md")
    assert whole.skip == "a server"


@pytest.mark.parametrize(("text", "says"), [
    ("# P\n\n<!-- docs-test: skip -->\n'''console\n$ x\n'''\n", "a skip needs its reason"),
    ("# P\n\n<!-- docs-test: skip: why -->\n\nSome text.\n", "must come just before the fenced"),
    ("# P\n\n<!-- docs-test: run-twice -->\n", "unknown docs-test directive"),
    ("# P\n\n'''sh\nstrata policies\n'''\n", "a ```sh block is not run"),
    ("# P\n\n'''console\noutput first\n'''\n", "a console block starts with a `$ ` command"),
    ("# P\n\n'''console\n$ echo 'open\n'''\n", "the command never ends"),
    ("# P\n\n'''python title=\"../out.py\"\nx\n'''\n", "must be a relative path inside"),
    ("# P\n\n'''console\n$ true\n", "never closed"),
])
def test_a_page_that_breaks_the_format_is_refused_naming_the_line(tmp_path, text, says):
    with pytest.raises(PageFormatError, match=r"page\.md:\d+: ") as caught:
        page(tmp_path, text)
    assert says in str(caught.value)


@pytest.mark.parametrize(("expected", "actual", "ok"), [
    (["a", "b"], ["a", "b  ", "", ""], True),  # trailing spaces and blank lines aside
    (["a", "b"], ["a", "c"], False),
    (["a", "b"], ["a"], False),
    (["a"], ["a", "b"], False),
    (["...", "z"], ["x", "y", "z"], True),
    (["...", "z"], ["z"], True),  # `...` matches no line too
    (["a", "...", "z"], ["a", "z", "q", "z"], True),
    (["a", "...", "z"], ["a", "q"], False),
    (["took ... ms (... rounds)"], ["took 1.5 ms (3 rounds)"], True),
    (["took ... ms (4 rounds)"], ["took 1.5 ms (3 rounds)"], False),
    (["a ... b"], ["a b"], False),  # the spaces around an inline `...` are text
])
def test_outputs_match_as_documented(expected, actual, ok):
    assert matches(expected, actual) is ok


def test_explain_shows_the_difference_and_the_output():
    text = explain(["a", "b"], ["a", "c"])
    assert "-b" in text and "+c" in text and text.endswith("printed:\na\nc")


def test_a_session_carries_the_folder_not_the_variables(tmp_path):
    session = PageSession(tmp_path)
    assert session.run("mkdir sub && cd sub && X=1").status == 0
    ran = session.run('pwd; echo "X=${X:-unset}"; echo to-stderr >&2; exit 3')
    assert ran.lines() == [str(tmp_path / "work" / "sub"), "X=unset", "to-stderr",
                           "[exit status 3]"]


def test_a_session_runs_the_environment_s_commands_in_a_clean_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("STRATA_TRACE_PLUGINS", "1")  # the caller's settings stay out
    session = PageSession(tmp_path)
    ran = session.run('command -v python; echo "$STRATA_CACHE_DIR"; echo "[$STRATA_LOAD_PLUGINS]"'
                      '; echo "${STRATA_TRACE_PLUGINS:-none}"')
    assert ran.lines() == [str(Path(sys.executable).parent / "python"), CACHE_SHOWN_AS, "[]",
                           "none"]


def test_pip_install_goes_offline_into_the_page_s_own_site(tmp_path):
    site = tmp_path / "site"
    assert rewrite_pip("pip install -e .", site) == (
        f"{sys.executable} -m pip install --no-build-isolation --no-deps --no-index --upgrade "
        f"--quiet --disable-pip-version-check --target {site} .")
    assert rewrite_pip("python -m pip install ./pkg", site).endswith(f"--target {site} ./pkg")
    assert rewrite_pip("pip list", site) is None
    assert rewrite_pip("pip install x | tee log", site) is None  # not alone: run as written


def test_a_page_whose_output_drifted_fails_naming_its_line(tmp_path):
    text = """\
        # A page

        '''text title="greeting.txt"
        hello
        '''

        '''console
        $ cat greeting.txt
        hello
        $ echo "the figure is 0.6887"
        the figure is 0.5553
        $ echo never reached
        never reached
        '''
        """
    failure = run_page(page(tmp_path, text), tmp_path / "run")
    assert failure is not None
    assert failure.startswith(f"{tmp_path / 'page.md'}:10: $ echo \"the figure is 0.6887\"")
    assert "-the figure is 0.5553" in failure and "+the figure is 0.6887" in failure
    fixed = text.replace("0.5553", "0.6887")
    assert run_page(page(tmp_path, fixed, "fixed.md"), tmp_path / "again") is None
