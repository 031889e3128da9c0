"""What points at the documentation points at a page that exists: the paths the code's help and
docstrings name (`strata trace --help` once named a page that was never written), the README's,
and the site's navigation, which lists every page."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
NAMED = re.compile(r"\bdocs/[\w./-]+?\.md\b")


def named_pages() -> dict[str, set[str]]:
    """docs/....md path -> the files that name it."""
    found: dict[str, set[str]] = {}
    for path in [*sorted((ROOT / "src" / "strata").rglob("*.py")), ROOT / "README.md"]:
        for name in NAMED.findall(path.read_text()):
            found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_page_the_code_names_exists():
    named = named_pages()
    assert "docs/sim/reference.md" in named  # strata trace --help's
    missing = {name: sorted(where) for name, where in named.items() if not (ROOT / name).is_file()}
    assert not missing, f"named but not written: {missing}"


def nav_pages(nav) -> set[str]:
    if isinstance(nav, str):
        return {nav}
    if isinstance(nav, dict):
        return set().union(*map(nav_pages, nav.values()))
    return set().union(*map(nav_pages, nav))


def test_the_site_navigation_lists_every_page():
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)
    listed = nav_pages(config["nav"])
    pages = {str(path.relative_to(DOCS)) for path in DOCS.rglob("*.md")}
    assert pages - listed == set(), "pages the navigation does not list"
    assert listed - pages == set(), "navigation entries without a page"
