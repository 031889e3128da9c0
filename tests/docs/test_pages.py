"""Every page of docs/ runs as written: its commands print what it shows.

The format (also in docs/contributing.md, for those who write pages):

- A ```` ```console ```` block is a terminal session. A line starting with `$ ` is a command;
  it goes on over the next lines while it is not complete (a trailing `\\`, `|`, `&&` or `||`,
  or a quote left open). The lines after it, up to the next `$ `, are its exact output.
- stdout and stderr are shown as one stream, in the order they were written, as on a terminal
  (Python runs unbuffered, so a command's notes on stderr and its text on stdout interleave as
  the reader sees them). A command that exits with status N other than 0 prints, as its last
  line, `[exit status N]`: the page shows it, and a command that fails unexpectedly fails the
  test.
- Output is compared line by line, trailing spaces and trailing blank lines aside. A line of
  just `...` matches any number of lines (none included); `...` inside a line matches any text
  within that line. Use them for what changes from run to run (timings, a random model's
  text), never for a figure the page discusses.
- A fenced block with `title="path"` (mkdocs-material's syntax, e.g.
  ```` ```python title="my_policy/fifo.py" ````) is written to that path, relative to the page's
  folder, before the next command runs.
- `<!-- docs-test: skip: REASON -->` just before a block leaves it out (it needs a GPU, a
  download, a server); at the top of the page, before its heading, it leaves the page out. A
  reason is required. A ```` ```sh ```` (or bash, shell) block is an error unless skipped: a
  command the reader is told to run is run, or says why not.

How it runs (tests/docs/docs_session.py): each page in a temporary folder of its own, shared by its
blocks in order; each command in its own `bash`, from the folder the previous one ended in
(variables do not carry over); with the venv's commands first on PATH; with a temporary
STRATA_CACHE_DIR, shown in outputs as `~/.cache/strata` (its default place); with no STRATA_*
setting of the caller's, and only the policy plugins the page installed itself loaded.
`pip install ARGS` runs offline and into the page's own folder, never the environment's:
`python -m pip install --no-build-isolation --no-deps --no-index --upgrade --target SITE
ARGS` with `-e` dropped, SITE on the page's PYTHONPATH; its output is the page's `...`.

The site's build runs the same steps to make the figures pages show (tests/docs/site_hooks.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from docs_pages import PageFormatError, parse_page
from docs_session import run_page

DOCS = Path(__file__).resolve().parents[2] / "docs"
PAGES = sorted(DOCS.rglob("*.md"))


def page_id(path: Path) -> str:
    return str(path.relative_to(DOCS))


def test_every_page_is_found():
    assert {"index.md", "getting-started.md", "policies/tutorial.md",
            "sim/tutorial.md"} <= {page_id(path) for path in PAGES}


@pytest.mark.parametrize("path", PAGES, ids=page_id)
def test_the_page_runs_as_written(path, tmp_path):
    try:
        page = parse_page(path)
    except PageFormatError as err:
        pytest.fail(str(err), pytrace=False)
    if page.skip is not None:
        pytest.skip(f"{page_id(path)}: {page.skip}")
    if page.steps:
        failure = run_page(page, tmp_path)
        if failure is not None:
            pytest.fail(failure, pytrace=False)
