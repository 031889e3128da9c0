"""Walk everything reachable from an object, as a plugin could, and say what leads to the books.

    from support.reach import leaks
    assert leaks(view, table) == []

The walk follows what Python hands anyone holding an object: its `__dict__` and `__slots__`,
every name `dir()` lists (properties are read, so what their getters return is walked), what
`__reduce_ex__` would pickle, bound methods' `__self__` and `__func__`, functions' closures,
defaults and `__wrapped__`, properties' getter, setter and deleter functions, `functools.partial`,
containers, and arrays' `.base` chains (through memoryviews' `.obj`). It does not enter classes
or modules (a class's methods need an instance to change anything) nor functions' `__globals__`
(module globals are not held by the object), and it does not follow raw addresses
(`ndarray.ctypes`, `__array_interface__`): a plugin runs in the engine's process, so raw memory
and the interpreter's own introspection (frames, `gc`) are out of any object's hands to guard.

What leads to the books: the table itself, a method bound to it, or an array or memoryview over
the table's memory that is writeable or can be made so.
"""

from __future__ import annotations

import functools
import types

import numpy as np

# Attributes that give raw addresses, not objects.
RAW = {"ctypes", "__array_interface__", "__array_struct__"}
ATOMS = (str, bytes, int, float, complex, bool, type(None), np.dtype, np.generic, range, slice)
MAX_DEPTH = 12
_NOTHING = object()


def _get(read):
    """What `read()` gives, or _NOTHING if it raises: a getter or an empty cell that refuses
    gives nothing."""
    try:
        return read()
    except Exception:
        return _NOTHING


def _can_write(array: np.ndarray) -> bool:
    if array.flags.writeable:
        return True
    probe = array.view()
    try:
        probe.flags.writeable = True
    except ValueError:
        return False
    return True


def _table_memory(table) -> list[np.ndarray]:
    return [table.res, table.owner, table.heat, table.rank, table.chunk_mapped, table.backed]


def _children(obj):
    """(name, child) pairs of what holding `obj` gives."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield f"[{key!r}]", value
        return
    if isinstance(obj, list | tuple | set | frozenset):
        for i, value in enumerate(obj):
            yield f"[{i}]", value
        return
    if isinstance(obj, np.ndarray):
        yield ".base", obj.base
        return
    if isinstance(obj, memoryview):
        yield ".obj", obj.obj
        return
    if isinstance(obj, types.MethodType | types.BuiltinMethodType | types.MethodWrapperType):
        yield ".__self__", getattr(obj, "__self__", None)
        yield ".__func__", getattr(obj, "__func__", None)
        return
    if isinstance(obj, types.FunctionType) or type(obj).__name__ == "cython_function_or_method":
        for i, cell in enumerate(getattr(obj, "__closure__", None) or ()):
            yield f".__closure__[{i}]", _get(lambda cell=cell: cell.cell_contents)
        yield ".__defaults__", getattr(obj, "__defaults__", None)
        yield ".__kwdefaults__", getattr(obj, "__kwdefaults__", None)
        yield ".__wrapped__", getattr(obj, "__wrapped__", None)
        return
    if isinstance(obj, functools.partial):
        yield ".func", obj.func
        yield ".args", obj.args
        yield ".keywords", obj.keywords
        return
    yield from _instance_children(obj)


def _instance_children(obj):
    yield ".__dict__", getattr(obj, "__dict__", None)
    for cls in type(obj).__mro__:
        for slot in getattr(cls, "__slots__", ()) if isinstance(
                getattr(cls, "__slots__", ()), tuple | list) else (cls.__slots__,):
            yield f".{slot}", _get(lambda slot=slot: getattr(obj, slot))
        for name, member in vars(cls).items():
            if isinstance(member, property):
                yield f".{name}.fget", member.fget
                yield f".{name}.fset", member.fset
                yield f".{name}.fdel", member.fdel
    for name in dir(obj):
        if name in RAW or name == "__class__":
            continue
        yield f".{name}", _get(lambda name=name: getattr(obj, name))
    yield ".__reduce_ex__(2)", _get(lambda: obj.__reduce_ex__(2))  # what pickling would save


def leaks(root, table) -> list[str]:
    """Paths from `root` to anything that changes `table` (empty: none)."""
    memory = _table_memory(table)
    found: list[str] = []
    seen: set[int] = set()
    keep = []  # what was walked stays alive, so that no id is reused during the walk
    stack = [("root", root, 0)]
    while stack:
        path, obj, depth = stack.pop()
        if obj is None or obj is _NOTHING or isinstance(obj, (*ATOMS, type, types.ModuleType)):
            continue
        if id(obj) in seen or depth > MAX_DEPTH:
            continue
        seen.add(id(obj))
        keep.append(obj)
        if obj is table:
            found.append(f"{path}: the table")
            continue
        if getattr(obj, "__self__", None) is table and callable(obj):
            found.append(f"{path}: a method bound to the table")
            continue
        if isinstance(obj, np.ndarray) and _can_write(obj) and any(
                np.shares_memory(obj, books) for books in memory):
            found.append(f"{path}: a writeable array over the books")
        if isinstance(obj, memoryview) and not obj.readonly and any(
                np.shares_memory(np.asarray(obj), books) for books in memory):
            found.append(f"{path}: a writeable memoryview over the books")
        for name, child in _children(obj):
            stack.append((path + name, child, depth + 1))
    return found
