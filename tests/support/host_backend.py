"""The chunk size of the K/V tests' host backend (tests/engine/conftest.py's `backend`)."""

HOST_CHUNK = 65536  # bytes
