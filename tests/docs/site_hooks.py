"""The site's build step (mkdocs.yml `hooks:`): the package's version beside the site's name,
and the figures the pages show, made at every build by running the commands of the page they
come from, so that no picture on the site is older than the code.

A figure is not kept in docs/: `FIGURES` names, for each, the page whose commands write it and
the file they write. The build runs that page's steps as the docs tests do (tests/docs/
docs_session.py: a temporary folder, the venv's commands, offline) until the file exists, and
adds it to the site where the pages link it. A command on the way that does not print what the
page shows (its exit status included) stops the build, as it fails the docs tests.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

sys.path.insert(0, str(Path(__file__).parent))

from docs_outputs import explain, matches
from docs_pages import Command, parse_page
from docs_session import PageSession

# the figure's path in the site -> (the page whose commands make it, the file they write)
FIGURES = {
    "sim/hit-rate.png": ("sim/tutorial.md", "hit-rate.png"),
    "policies/arc-hit-rate.png": ("policies/stateful-tutorial.md", "arc-hit-rate.png"),
}


def on_config(config):
    from strata import __version__

    if not config["site_name"].endswith(__version__):
        config["site_name"] = f"{config['site_name']} {__version__}"
    return config


def make_figure(page_path: Path, made: str) -> bytes:
    """The bytes of `made`, written by the first steps of the page at `page_path`."""
    page = parse_page(page_path)
    with tempfile.TemporaryDirectory(prefix="strata-site-") as tmp:
        session = PageSession(Path(tmp))
        for step in page.steps:
            ran = session.step(step)
            if isinstance(step, Command) and not matches(step.expected, ran.lines()):
                raise PluginError(f"{page_path}:{step.line}: $ {step.text}\n(making {made}) "
                                  f"{explain(step.expected, ran.lines())}")
            if (session.cwd / made).is_file():
                return (session.cwd / made).read_bytes()
    raise PluginError(f"{page_path}: its commands never wrote {made}")


def on_files(files, config):
    docs = Path(config["docs_dir"])
    for site_path, (page, made) in FIGURES.items():
        kept = files.get_file_from_path(site_path)
        if kept is not None:  # a copy left in docs/: the build's own replaces it
            files.remove(kept)
        files.append(File.generated(config, site_path, content=make_figure(docs / page, made)))
    return files
