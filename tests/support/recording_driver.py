"""A recording stand-in of `cuda.bindings.driver`, as far as `strata._vmm.HostPages` uses it:
the page-locking's calls checked where no GPU runs (`pytest -m cuda` runs the real driver).
tests/conftest.py makes `recording_driver` a fixture of every test."""

import sys
import types

import pytest


class RecordingDriver(types.ModuleType):
    """`cuda.bindings.driver` as far as HostPages uses it: each call recorded, each result
    (CUresult, *values) as cuda-python returns them; `fail` names a call that returns
    CUDA_ERROR_OUT_OF_MEMORY (2)."""

    def __init__(self, fail: str | None = None) -> None:
        super().__init__("cuda.bindings.driver")
        self.calls: list[tuple] = []
        self.fail = fail

    def __getattr__(self, name: str):
        if not name.startswith("cu"):
            raise AttributeError(name)
        values = {"cuDeviceGet": ("device",), "cuDevicePrimaryCtxRetain": ("context",),
                  "cuGetErrorName": (b"CUDA_ERROR_OUT_OF_MEMORY",)}.get(name, ())

        def call(*args):
            if name != "cuGetErrorName":
                self.calls.append((name, *args))
            return (2 if name == self.fail else 0, *values)
        return call


@pytest.fixture
def recording_driver(monkeypatch):
    def install(fail: str | None = None) -> RecordingDriver:
        driver = RecordingDriver(fail)
        bindings = types.ModuleType("cuda.bindings")
        bindings.driver = driver
        cuda = types.ModuleType("cuda")
        cuda.bindings = bindings
        for name, module in (("cuda", cuda), ("cuda.bindings", bindings),
                             ("cuda.bindings.driver", driver)):
            monkeypatch.setitem(sys.modules, name, module)
        return driver
    return install
