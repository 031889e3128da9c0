"""strata.settings: every STRATA_* variable's good and bad values, the one place that reads
them, and the documentation's table checked against the code."""

import ast
import mmap
import re
import sys
from pathlib import Path

import pytest

from strata import _vmm, settings
from strata.engine.cache.loan import DEFAULT_KEEP_SLOTS, DEFAULT_UPLOAD_BATCHES, LoanOptions
from strata.engine.memory import device_backend
from strata.policies.kv_params import DEFAULT_FLOOR_SLOTS, DEFAULT_INIT_CELLS, DEFAULT_STEP_CELLS
from strata.settings import SettingError, Settings, read

ROOT = Path(__file__).resolve().parent.parent
PAGE = mmap.PAGESIZE
RUN_TIME = [v.name for v in settings.VARIABLES if not v.build_time]

# variable -> [(text, the Settings attribute's value)]
GOOD = {
    "STRATA_VMM_CHUNK_BYTES": [("65536", 65536), (str(PAGE), PAGE), (" 2097152 ", 2 << 20),
                               ("", None)],
    "STRATA_LOAN_KEEP_SLOTS": [("0", 0), ("8", 8), (" 128", 128), ("", None)],
    "STRATA_LOAN_UPLOAD_BATCHES": [("1", 1), (" 4 ", 4), ("", None)],
    "STRATA_KV_GROW": [("1", True), ("0", False), (" 1 ", True), ("", False)],
    "STRATA_KV_GROW_INIT": [("1", 1), (" 1000 ", 1000), ("", None)],
    "STRATA_KV_GROW_STEP": [("8192", 8192), ("", None)],
    "STRATA_KV_GROW_FLOOR": [("2", 2), ("0", 0), ("", None)],
    "STRATA_TRACE_PLUGINS": [("1", True), ("yes", True), ("0", False), (" ", False)],
    "STRATA_LOAD_PLUGINS": [("pkg-a", frozenset({"pkg-a"})), (" a , b,", frozenset({"a", "b"})),
                            ("", frozenset())],
    "STRATA_CACHE_DIR": [("/tmp/strata cache", Path("/tmp/strata cache")), ("", None)],
    "STRATA_DUMP_FIRST_LOGITS": [("out/logits.bin", Path("out/logits.bin")), ("", None)],
    "STRATA_API_KEY": [("sk-local-123", "sk-local-123"), (" key ", "key"), ("", None)],
    "STRATA_CPU_KERNEL": [("strata", "strata"), (" torch ", "torch"), ("", None)],
    "STRATA_HOST_HUGE_PAGES": [("1", True), ("0", False), (" 1 ", True), ("", False)],
}

# variable -> [(text, what the message says after `NAME='text': `)]
BAD = {
    "STRATA_VMM_CHUNK_BYTES": [
        (raw, f"expected a positive multiple of the page size ({PAGE} bytes) that divides 8 GiB, "
              "e.g. 65536")
        for raw in ("0", "-4096", "1000", "lots", "65536.0", str(3 * PAGE), str(16 << 30))
    ],
    "STRATA_LOAN_KEEP_SLOTS": [(raw, "want an integer >= 0 (slots a loan leaves)")
                               for raw in ("lots", "-1", "1.5")],
    "STRATA_LOAN_UPLOAD_BATCHES": [
        (raw, "want a positive integer (batches a layer's loan uploads, for example 4)")
        for raw in ("0", "-2", "two", "1.5")],
    "STRATA_KV_GROW": [(raw, "want 1 (on) or 0 (off)") for raw in ("maybe", "yes", "2", "true")],
    **{name: [(raw, f"want a positive integer (for example {name}=8192)")
              for raw in ("abc", "0", "-8", "1.5", "8k")]
       for name in ("STRATA_KV_GROW_INIT", "STRATA_KV_GROW_STEP")},
    # A floor is slots, and 0 of them is a floor.
    "STRATA_KV_GROW_FLOOR": [
        (raw, "want an integer >= 0 (slots the cache keeps, for example STRATA_KV_GROW_FLOOR=128)")
        for raw in ("abc", "-8", "1.5", "8k")],
    "STRATA_CPU_KERNEL": [(raw, "want strata or torch") for raw in ("Torch", "mkl", "1")],
    "STRATA_HOST_HUGE_PAGES": [(raw, "want 1 (on) or 0 (off)") for raw in ("yes", "2", "on")],
}
# Every value is accepted: a switch that anything but 0 turns on, a list of names, paths.
NO_BAD_VALUES = {"STRATA_TRACE_PLUGINS", "STRATA_LOAD_PLUGINS", "STRATA_CACHE_DIR",
                 "STRATA_DUMP_FIRST_LOGITS",
                 # `strata serve` checks the key's characters, without printing the secret.
                 "STRATA_API_KEY"}


def test_every_run_time_variable_is_tested():
    assert set(GOOD) == set(RUN_TIME)
    assert set(BAD) | NO_BAD_VALUES == set(RUN_TIME) and not set(BAD) & NO_BAD_VALUES


@pytest.mark.parametrize(("name", "raw", "value"),
                         [(name, raw, value) for name, cases in GOOD.items()
                          for raw, value in cases])
def test_good_values(name, raw, value):
    attribute = settings.variable(name).attribute
    assert getattr(read({name: raw}), attribute) == value


@pytest.mark.parametrize(("name", "raw", "want"),
                         [(name, raw, want) for name, cases in BAD.items() for raw, want in cases])
def test_bad_values_name_the_variable_the_value_and_what_is_right(name, raw, want):
    with pytest.raises(SettingError) as caught:
        read({name: raw, "UNRELATED": "x"})
    assert str(caught.value) == f"{name}={raw!r}: {want}"
    assert isinstance(caught.value, ValueError)
    assert (caught.value.name, caught.value.value) == (name, raw)


def test_unset_is_the_defaults_and_empty_is_unset_but_for_the_plugin_list():
    assert read({}) == Settings()
    assert read({"UNRELATED": "x"}).load_plugins is None
    empty = {name: "" for name in RUN_TIME}
    assert read(empty) == Settings(load_plugins=frozenset())


def test_read_follows_os_environ(monkeypatch):
    for name in RUN_TIME:
        monkeypatch.delenv(name, raising=False)
    assert read() == Settings()
    monkeypatch.setenv("STRATA_KV_GROW_STEP", "32")
    assert read().kv_grow_step == 32
    monkeypatch.setenv("STRATA_KV_GROW", "yes")
    with pytest.raises(SettingError, match=r"STRATA_KV_GROW='yes'"):
        read()
    assert read({}).kv_grow is False  # a mapping given is read instead of os.environ


def test_settings_built_directly_are_checked_too():
    assert Settings(vmm_chunk_bytes=65536, kv_grow=True).kv_grow
    for field, value, name in [("vmm_chunk_bytes", 1000, "STRATA_VMM_CHUNK_BYTES"),
                               ("loan_keep_slots", -1, "STRATA_LOAN_KEEP_SLOTS"),
                               ("kv_grow_init", 0, "STRATA_KV_GROW_INIT"),
                               ("kv_grow_step", True, "STRATA_KV_GROW_STEP"),
                               ("kv_grow", 1, "STRATA_KV_GROW"),
                               ("load_plugins", {"a"}, "STRATA_LOAD_PLUGINS"),
                               ("cache_dir", "/tmp", "STRATA_CACHE_DIR")]:
        with pytest.raises(SettingError, match=f"^{name}={re.escape(repr(value))}: "):
            Settings(**{field: value})
    with pytest.raises(AttributeError):
        Settings().kv_grow = True  # frozen


def test_variables_are_known_by_name():
    assert settings.variable("STRATA_KV_GROW").attribute == "kv_grow"
    assert settings.variable("STRATA_BUILD_ONLY").build_time
    with pytest.raises(KeyError, match="STRATA_NOPE is not a strata variable"):
        settings.variable("STRATA_NOPE")
    with pytest.raises(TypeError, match=r"setup\.py"):
        settings.variable("STRATA_CYTHON_DEBUG").parse("1")


def test_the_table_s_defaults_are_the_code_s():
    default = {v.name: v.default for v in settings.VARIABLES}
    assert default["STRATA_VMM_CHUNK_BYTES"].startswith(f"{_vmm.DEFAULT_CHUNK_BYTES} ")
    assert settings.HOST_FILE_BYTES == _vmm.HOST_FILE_BYTES
    assert default["STRATA_LOAN_KEEP_SLOTS"] == str(DEFAULT_KEEP_SLOTS)
    assert default["STRATA_LOAN_UPLOAD_BATCHES"] == str(DEFAULT_UPLOAD_BATCHES)
    assert default["STRATA_KV_GROW_INIT"] == str(DEFAULT_INIT_CELLS)
    assert default["STRATA_KV_GROW_STEP"] == str(DEFAULT_STEP_CELLS)
    assert default["STRATA_KV_GROW_FLOOR"].startswith(f"{DEFAULT_FLOOR_SLOTS} ")


def test_the_loan_takes_its_upload_batches_from_the_environment(monkeypatch):
    monkeypatch.delenv("STRATA_LOAN_UPLOAD_BATCHES", raising=False)
    assert LoanOptions().upload_batches == DEFAULT_UPLOAD_BATCHES
    monkeypatch.setenv("STRATA_LOAN_UPLOAD_BATCHES", "2")
    assert LoanOptions().upload_batches == 2
    assert LoanOptions(upload_batches=1).upload_batches == 1  # given beats the environment
    monkeypatch.setenv("STRATA_LOAN_UPLOAD_BATCHES", "0")
    with pytest.raises(SettingError, match="STRATA_LOAN_UPLOAD_BATCHES='0'"):
        LoanOptions()
    monkeypatch.delenv("STRATA_LOAN_UPLOAD_BATCHES")
    with pytest.raises(ValueError, match="upload_batches must be an int >= 1, got 0"):
        LoanOptions(upload_batches=0)


def test_the_engine_passes_the_chunk_size_to_the_host_backend(monkeypatch):
    monkeypatch.setenv("STRATA_VMM_CHUNK_BYTES", "65536")
    assert device_backend("cpu").chunk_bytes == 65536
    assert device_backend("cpu", {}).chunk_bytes == 2 << 20
    monkeypatch.delenv("STRATA_VMM_CHUNK_BYTES")
    assert device_backend("cpu").chunk_bytes == 2 << 20
    monkeypatch.setenv("STRATA_VMM_CHUNK_BYTES", "1000")
    with pytest.raises(SettingError, match="STRATA_VMM_CHUNK_BYTES='1000'"):
        device_backend("cpu")


def test_the_module_is_a_leaf():
    # The standard library only: every layer, down to the memory backend's callers, imports it.
    tree = ast.parse((ROOT / "src" / "strata" / "settings.py").read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported and {name.split(".")[0] for name in imported} <= sys.stdlib_module_names


def _sources():
    for path in sorted((ROOT / "src" / "strata").rglob("*")):
        if path.suffix in (".py", ".pyx", ".pxi") and path.name != "settings.py":
            yield path, path.read_text()


def test_nothing_else_reads_a_strata_variable_from_the_environment():
    read_env = re.compile(r"""(environ\s*(\.get\(|\[)|getenv\()\s*["']STRATA_""")
    offenders = [str(path.relative_to(ROOT)) for path, text in _sources()
                 if read_env.search(text)]
    assert not offenders, f"read STRATA_* themselves, not through strata.settings: {offenders}"


def test_every_variable_named_in_the_code_is_in_the_table():
    known = {v.name for v in settings.VARIABLES}
    named = set()
    for _, text in _sources():
        named |= set(re.findall(r"\bSTRATA_[A-Z_]*[A-Z]\b", text))
    setup = (ROOT / "setup.py").read_text()
    in_setup = set(re.findall(r"""environ\.get\(\s*["'](STRATA_\w+)""", setup))
    assert in_setup == {v.name for v in settings.VARIABLES if v.build_time}
    assert named - known == set(), "add them to strata.settings.VARIABLES"


def test_the_docs_table_is_the_code_s():
    page = (ROOT / "docs" / "reference" / "settings.md").read_text()
    rows = re.findall(r"^\| `(STRATA_\w+)` \| (.*) \| (.*) \| (.*) \|$", page, re.M)
    assert rows == [(v.name, v.meaning, v.accepted, v.default) for v in settings.VARIABLES]
    nav = (ROOT / "mkdocs.yml").read_text()
    assert "reference/settings.md" in nav
