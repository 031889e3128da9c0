"""The package's layout: which rooms import which, no import cycles, and no oversized code.

Every module under src/strata is parsed with `ast`; every import counts, wherever it is: at the
top, inside a function, under `if TYPE_CHECKING:`. Relative imports are resolved, and
`from package import name` names the submodule when `name` is one. The Cython sources
(`.pyx`, and the `.pxi` files they include) are not Python: their `import`/`cimport` lines of
strata modules are read by a regular expression, their sizes are counted, their functions are
not. Imports made by name at run time (`importlib.import_module`) are not seen.

A module's folder is its package (`strata.engine.cache` for `strata/engine/cache/arena.py`,
and for `strata/engine/cache/__init__.py`); a room is a top-level part of the package
(`strata.engine`, `strata.sim`, `strata._vmm`, ...).
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from itertools import pairwise
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "strata"

MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80

# Files over MAX_MODULE_LINES that may stay so, by path under src/strata, each with its reason.
LONG_MODULES_ALLOWED: dict[str, str] = {
    "_residency.pyx": "Cython, not parsed here: the books' one extension type, whose cdef "
                      "methods share its typed fields",
    "_vmm.pyx": "Cython, not parsed here: the memory's extension types, host and cuda "
                "backends behind one cdef interface (the cuda calls are in _vmm_cuda.pxi)",
}
# Functions over MAX_FUNCTION_LINES that may stay so, as "module:qualname", with the reason.
LONG_FUNCTIONS_ALLOWED: dict[str, str] = {}

# The engine's rooms, top first: each imports only rooms after it in this list.
ENGINE_ROOMS = tuple(f"strata.engine.{room}" for room in
                     ("runtime", "kv", "cache", "model", "experts"))
# (importer room, imported room, why not): rooms are matched as a prefix of dotted names.
FORBIDDEN: list[tuple[str, str, str]] = [
    ("strata.engine", "strata.sim", "the engine and the simulator are peers over policies"),
    ("strata.sim", "strata.engine", "the engine and the simulator are peers over policies"),
    ("strata.formats", "strata.engine", "formats lie below the engine"),
    ("strata.formats", "strata.sim", "formats lie below the simulator"),
    ("strata.formats", "strata.cli", "formats lie below the command line"),
    ("strata.policies", "strata.engine", "policies decide, they know no engine"),
    ("strata.policies", "strata.sim", "policies decide, they know no simulator"),
    ("strata.policies", "strata.books", "the books check and apply policies, not the reverse"),
    ("strata.policies", "strata.formats", "policies read the books' view, not files"),
    ("strata.policies", "strata.cli", "policies know no command line"),
    ("strata.books", "strata.engine", "the books lie below the engine"),
    ("strata.books", "strata.sim", "the books lie below the simulator"),
    ("strata.books", "strata.cli", "the books know no command line"),
    ("strata.serve", "strata.sim", "the server runs the engine, not the simulator"),
    ("strata.serve", "strata.books", "the server reaches the books only through the engine"),
    # The engine's rooms stack: runtime > kv > cache > model > experts (docs/architecture.md).
    *[(low, high, "the engine's rooms import only the rooms below them")
      for i, high in enumerate(ENGINE_ROOMS) for low in ENGINE_ROOMS[i + 1:]],
]
# Rooms only the named rooms may import; `strata.cli` is the top, importable by nothing else.
ONLY_FROM: dict[str, tuple[tuple[str, ...], str]] = {
    "strata.cli": (("strata.cli",), "the command line is the top: nothing imports it"),
    "strata.serve": (("strata.serve", "strata.cli"),
                     "the server is a client of the engine, just below the command line"),
    "strata._vmm": (("strata.engine", "strata.cli"),
                    "memory is the engine's alone: the books, policies and simulator never "
                    "touch it"),
    "strata._residency": (("strata.books", "strata.policies", "strata.engine", "strata.sim",
                           "strata.cli"), "the books, below everything but memory"),
}

_CYTHON_IMPORT = re.compile(
    r"^\s*(?:from\s+(?P<src>strata[\w.]*)\s+c?import\s+(?P<names>[\w, ]+)"
    r"|c?import\s+(?P<mod>strata[\w.]*))", re.M)


# --- reading the package ---

def module_name(path: Path) -> str:
    """The dotted name of a source file under SRC (`.py`, or a `.pyx` extension)."""
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def folder_of(module: str, is_package: bool) -> str:
    """The package a module lies in: itself for a package's `__init__`."""
    return module if is_package else module.rpartition(".")[0]


def room_of(module: str) -> str:
    """`strata.engine` for `strata.engine.cache.arena`; `strata` for `strata` itself."""
    return ".".join(module.split(".")[:2])


def in_room(module: str, room: str) -> bool:
    return module == room or module.startswith(room + ".")


def resolve(name: str, modules: set[str]) -> str | None:
    """The module `name` imports: itself, or the nearest known module it lies in (an object
    of that module); None outside the package."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(source: str, module: str, is_package: bool,
               modules: set[str]) -> list[tuple[str, int]]:
    """(imported module, line) for every import of a package module in Python `source`."""
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(resolve(alias.name, modules), node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = folder_of(module, is_package).split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((sub if sub in modules else resolve(base, modules), node.lineno))
    return [(name, line) for name, line in found if name is not None]


def cython_imports_of(source: str, modules: set[str]) -> list[tuple[str, int]]:
    """(imported module, line) for the `import` / `cimport` lines of strata modules."""
    found = []
    for match in _CYTHON_IMPORT.finditer(source):
        line = source.count("\n", 0, match.start()) + 1
        if match["mod"]:
            found.append((resolve(match["mod"], modules), line))
            continue
        for name in match["names"].split(","):
            sub = f"{match['src']}.{name.strip()}"
            found.append((sub if sub in modules else resolve(match["src"], modules), line))
    return [(name, line) for name, line in found if name is not None]


class Package:
    """The package's modules, their imports and the folders they lie in."""

    def __init__(self, root: Path = SRC / PACKAGE) -> None:
        self.files = {path: module_name(path) for path in sorted(root.rglob("*.py"))}
        self.cython = {path: module_name(path) for path in sorted(root.rglob("*.pyx"))}
        self.includes = sorted(root.rglob("*.pxi"))
        self.modules = set(self.files.values()) | set(self.cython.values())
        self.packages = {name for path, name in self.files.items() if path.name == "__init__.py"}
        # module -> [(imported module, path, line)]
        self.imports: dict[str, list[tuple[str, Path, int]]] = defaultdict(list)
        for path, name in self.files.items():
            for target, line in imports_of(path.read_text(), name, name in self.packages,
                                           self.modules):
                self.imports[name].append((target, path, line))
        for path in [*self.cython, *self.includes]:
            name = self.cython.get(path) or self._including(path)
            for target, line in cython_imports_of(path.read_text(), self.modules):
                self.imports[name].append((target, path, line))

    def _including(self, include: Path) -> str:
        """The extension a `.pxi` belongs to: the `.pyx` of its folder that includes it."""
        for pyx, name in self.cython.items():
            if pyx.parent == include.parent and f'include "{include.name}"' in pyx.read_text():
                return name
        raise AssertionError(f"{include} is included by no .pyx beside it")

    def folder(self, module: str) -> str:
        return folder_of(module, module in self.packages)

    def module_graph(self) -> dict[str, set[str]]:
        graph: dict[str, set[str]] = {name: set() for name in self.modules}
        for name, targets in self.imports.items():
            graph[name] |= {target for target, _, _ in targets if target != name}
        return graph

    def folder_graph(self) -> dict[str, set[str]]:
        graph: dict[str, set[str]] = defaultdict(set)
        for name, targets in self.imports.items():
            if name == PACKAGE:
                # The package's face (`strata.Engine`, loaded on first use): the top of the
                # graph, imported by nothing inside; its folder's other modules are the bottom.
                continue
            for target, _, _ in targets:
                if self.folder(target) != self.folder(name):
                    graph[self.folder(name)].add(self.folder(target))
        return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (`[a, b, ..., a]`) through each strongly connected part of more than one node
    (Tarjan's algorithm, iterative), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    parts: list[set[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    part = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        part.add(member)
                        if member == node:
                            break
                    parts.append(part)
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return sorted(_cycle_in(graph, part) for part in parts if len(part) > 1)


def _cycle_in(graph: dict[str, set[str]], part: set[str]) -> list[str]:
    """The shortest cycle through the first node of `part`, by breadth-first search."""
    start = min(part)
    came_from = {start: None}
    queue = [start]
    for node in queue:
        for child in sorted(graph.get(node, ())):
            if child == start:
                path = [node]
                while came_from[path[-1]] is not None:
                    path.append(came_from[path[-1]])
                return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, start]
            if child in part and child not in came_from:
                came_from[child] = node
                queue.append(child)
    raise AssertionError(f"no cycle through {start}")


def long_functions(source: str) -> list[tuple[str, int, int]]:
    """(qualname, first line, lines) of every function or method in `source`, nested too."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                found.append((name, child.lineno, child.end_lineno - child.lineno + 1))
                visit(child, f"{name}.<locals>.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


@pytest.fixture(scope="module")
def package() -> Package:
    return Package()


def _where(path: Path, line: int) -> str:
    return f"{path.relative_to(SRC.parent)}:{line}"


# --- the reader itself ---

def test_imports_are_read_wherever_they_are():
    modules = {"strata", "strata.a", "strata.a.b", "strata.a.c", "strata.d", "strata._x"}
    source = (
        "from typing import TYPE_CHECKING\n"
        "import numpy\n"
        "from . import c\n"                    # a sibling submodule, relatively
        "from .. import d\n"                   # up one package
        "from strata.a import c as alias\n"    # `from package import submodule`
        "from strata.a import name\n"          # an object of the package: its __init__
        "if TYPE_CHECKING:\n"
        "    from strata._x import Table\n"
        "def f():\n"
        "    import strata.d.nothing\n"        # the nearest module it lies in
    )
    found = imports_of(source, "strata.a.b", False, modules)
    assert found == [("strata.a.c", 3), ("strata.d", 4), ("strata.a.c", 5), ("strata.a", 6),
                     ("strata._x", 8), ("strata.d", 10)]
    # In a package's __init__, `from . import b` is its own submodule.
    assert imports_of("from . import b\n", "strata.a", True, modules) == [("strata.a.b", 1)]


def test_cython_imports_are_read():
    modules = {"strata", "strata._x", "strata.a", "strata.a.b"}
    source = "import numpy as np\nfrom strata.a import b, thing\ncimport strata._x\n"
    assert cython_imports_of(source, modules) == [("strata.a.b", 2), ("strata.a", 2),
                                                  ("strata._x", 3)]


def test_cycles_are_found_and_named():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"f"}, "f": {"e"}}
    assert cycles(graph) == [["a", "b", "c", "a"], ["e", "f", "e"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_long_functions_are_measured():
    source = ("class A:\n    def m(self):\n        def inner():\n            pass\n"
              "        return 1\n")
    assert long_functions(source) == [("A.m", 2, 4), ("A.m.<locals>.inner", 3, 2)]


def test_the_package_is_read(package):
    assert "strata.sim.replay" in package.modules and "strata._residency" in package.modules
    replay = {target for target, _, _ in package.imports["strata.sim.replay"]}
    assert {"strata.books", "strata._residency", "strata.sim._kernels"} <= replay
    assert package.folder("strata.engine.cache") == "strata.engine.cache"
    assert package.folder("strata.engine.cache.arena") == "strata.engine.cache"


# --- the rules ---

def _explain(package: Package, found: list[list[str]], node) -> str:
    """Each cycle, and under it the imports that make each of its steps."""
    lines = []
    for cycle in found:
        lines.append(" -> ".join(cycle))
        for src, dst in pairwise(cycle):
            lines += [f"    {src} -> {dst}: {_where(path, line)} imports {target}"
                      for name, targets in sorted(package.imports.items()) if node(name) == src
                      for target, path, line in targets if node(target) == dst]
    return "\n".join(lines)


def test_no_import_cycle_between_modules(package):
    found = cycles(package.module_graph())
    assert not found, "import cycles between modules:\n" + _explain(
        package, found, lambda name: name)


def test_no_import_cycle_between_folders(package):
    found = cycles(package.folder_graph())
    assert not found, "import cycles between folders:\n" + _explain(
        package, found, package.folder)


def test_rooms_import_only_what_lies_below(package):
    broken = []
    for name, targets in sorted(package.imports.items()):
        for target, path, line in targets:
            for importer, imported, why in FORBIDDEN:
                if in_room(name, importer) and in_room(target, imported):
                    broken.append(f"{_where(path, line)}: {name} imports {target} ({why})")
            for room, (allowed, why) in ONLY_FROM.items():
                if in_room(target, room) and not any(in_room(name, r) for r in allowed):
                    broken.append(f"{_where(path, line)}: {name} imports {target} ({why})")
    assert not broken, "imports across the layers:\n" + "\n".join(broken)


def test_no_module_is_too_long(package):
    too_long, stale = [], []
    for path in [*package.files, *package.cython, *package.includes]:
        key = path.relative_to(SRC / PACKAGE).as_posix()
        lines = len(path.read_text().splitlines())
        if lines > MAX_MODULE_LINES and key not in LONG_MODULES_ALLOWED:
            too_long.append(f"{key}: {lines} lines")
        if lines <= MAX_MODULE_LINES and key in LONG_MODULES_ALLOWED:
            stale.append(key)
    assert not too_long, f"modules over {MAX_MODULE_LINES} lines:\n" + "\n".join(too_long)
    assert not stale, f"allowed long, no longer long (drop them from the list): {stale}"


def test_no_function_is_too_long(package):
    too_long, seen = [], set()
    for path, name in package.files.items():
        for qualname, line, lines in long_functions(path.read_text()):
            key = f"{name}:{qualname}"
            if lines > MAX_FUNCTION_LINES:
                seen.add(key)
                if key not in LONG_FUNCTIONS_ALLOWED:
                    too_long.append(f"{_where(path, line)}: {key}, {lines} lines")
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(too_long)
    stale = sorted(set(LONG_FUNCTIONS_ALLOWED) - seen)
    assert not stale, f"allowed long, no longer long (drop them from the list): {stale}"


def test_every_allowance_gives_its_reason():
    for key, reason in {**LONG_MODULES_ALLOWED, **LONG_FUNCTIONS_ALLOWED}.items():
        assert reason.strip() and "\n" not in reason, key


def test_settings_import_nothing_of_strata(package):
    # Every layer reads its STRATA_* variables through strata.settings: a leaf, so no cycle.
    assert [target for target, _, _ in package.imports.get("strata.settings", [])] == []


def test_machine_imports_nothing_of_strata(package):
    # The machine's limits are asked for by formats, the engine and the cli: a leaf too.
    assert [target for target, _, _ in package.imports.get("strata.machine", [])] == []
