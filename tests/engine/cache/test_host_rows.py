"""HostRows on the host: decode's x copied into one kept buffer, the rows going back as they
are (the pinned, asynchronous twin runs on CUDA through the cache's own tests)."""

import torch

from strata.engine.cache.host_rows import HostRows


def test_x_is_copied_into_one_kept_buffer():
    rows = HostRows(torch.device("cpu"))
    x = torch.randn(1, 8)
    first = rows.x_to_host(x)
    assert torch.equal(first, x) and first.data_ptr() != x.data_ptr()
    x.add_(1.0)  # the device's x moves on; the host's copy does not
    assert not torch.equal(first, x)
    second = rows.x_to_host(x)
    assert second.data_ptr() == first.data_ptr() and torch.equal(second, x)
    other = rows.x_to_host(x.to(torch.bfloat16))  # another dtype: a buffer of its own
    assert other.dtype == torch.bfloat16 and torch.equal(other, x.to(torch.bfloat16))


def test_rows_go_to_the_device_unchanged():
    rows = torch.randn(3, 8)
    assert torch.equal(HostRows(torch.device("cpu")).to_device(rows), rows)
