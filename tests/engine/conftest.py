"""The fixture the K/V tests share: a host (mmap) memory backend of `HOST_CHUNK` chunks."""

import pytest

from strata import _vmm
from support.host_backend import HOST_CHUNK


@pytest.fixture
def backend():
    """A `HostBackend` of HOST_CHUNK-byte chunks, closed after the test."""
    backend = _vmm.HostBackend(HOST_CHUNK)
    yield backend
    backend.close()
