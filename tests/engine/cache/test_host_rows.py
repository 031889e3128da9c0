"""HostRows on the host: decode's x copied into one kept buffer, the rows going back as they
are (the pinned, asynchronous twin runs on CUDA through the cache's own tests)."""

import numpy as np
import pytest
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


def test_the_index_buffer_is_kept_and_grows():
    rows = HostRows(torch.device("cpu"))
    first, view = rows.index_buffer(4)
    view[:] = [1, 2, 3, 4]
    second, _ = rows.index_buffer(3)  # fits: the same memory
    assert second.data_ptr() == first.data_ptr() and second.tolist() == [1, 2, 3]
    third, _ = rows.index_buffer(9)  # larger: a new buffer
    assert third.numel() == 9


def test_cpu_rows_are_staged_then_scattered_to_their_targets():
    host = HostRows(torch.device("cpu"))
    top_k, hidden = 4, 6
    out = host.cpu_out(top_k, 2, hidden, torch.bfloat16)  # [2, D], where the CPU writes
    out.copy_(torch.tensor([[1.0] * hidden, [2.0] * hidden]))
    host.stage_cpu_rows(top_k, hidden, torch.bfloat16, np.array([3, 1]))
    rows = torch.full((top_k + 1, hidden), 9.0, dtype=torch.bfloat16)  # [K + 1, D]
    host.scatter_cpu_rows(rows)
    assert rows[3].tolist() == [1.0] * hidden and rows[1].tolist() == [2.0] * hidden
    assert rows[2].tolist() == rows[4].tolist() == [9.0] * hidden  # not the CPU's: untouched
    # Cleared: the next scatter writes only the scratch row 0.
    host.stage_cpu_rows(top_k, hidden, torch.bfloat16, None)
    rows = torch.full((top_k + 1, hidden), 9.0, dtype=torch.bfloat16)
    host.scatter_cpu_rows(rows)
    assert torch.equal(rows[1:], torch.full((top_k, hidden), 9.0, dtype=torch.bfloat16))


def test_cpu_rows_targets_written_ahead_are_sent_with_the_rows():
    """A split call writes its targets while the CPU computes (`write_cpu_targets`) and sends
    them with the rows after (`targets_written`); `cpu_out` gives the same view for the same R
    (kept), a new one for another shape."""
    host = HostRows(torch.device("cpu"))
    top_k, hidden = 4, 6
    out = host.cpu_out(top_k, 2, hidden, torch.bfloat16)
    assert host.cpu_out(top_k, 2, hidden, torch.bfloat16) is out
    host.write_cpu_targets(top_k, hidden, torch.bfloat16, np.array([4, 2]))
    out.copy_(torch.tensor([[1.0] * hidden, [2.0] * hidden]))  # the rows after the targets
    host.stage_cpu_rows(top_k, hidden, torch.bfloat16, np.array([4, 2]), targets_written=True)
    rows = torch.full((top_k + 1, hidden), 9.0, dtype=torch.bfloat16)
    host.scatter_cpu_rows(rows)
    assert rows[4].tolist() == [1.0] * hidden and rows[2].tolist() == [2.0] * hidden
    assert rows[1].tolist() == rows[3].tolist() == [9.0] * hidden
    other = host.cpu_out(top_k, 2, hidden + 2, torch.bfloat16)  # another shape: new buffers
    assert other is not out and other.shape == (2, hidden + 2)


def test_the_routing_is_read_as_it_is_on_the_host_queued_or_not():
    rows = HostRows(torch.device("cpu"))
    x, ids = torch.randn(1, 8), torch.tensor([[3, 1, 2]], dtype=torch.int32)
    rows.queue_routing(x, ids)  # nothing to queue on the host
    for queued in (True, False):
        x_host, ids_host = rows.read_routing(x, ids, queued)
        assert x_host is x  # the host's x is read where it is
        assert ids_host.dtype == np.int64 and ids_host.tolist() == [[3, 1, 2]]


def test_a_queued_read_of_a_routing_never_queued_is_refused():
    """Where the copies would be pinned (CUDA), a queued read of shapes nothing queued would
    read buffers nothing wrote: refused, naming the shapes. (Faked on the host: the check
    comes before any device work.)"""
    rows = HostRows(torch.device("cpu"))
    rows._pin = True
    with pytest.raises(RuntimeError, match=r"no routing of x \[1, 8\] torch.float32 .* "
                                           r"queue_routing \(resident_rows\) comes first"):
        rows.read_routing(torch.zeros(1, 8), torch.zeros(1, 2, dtype=torch.int64), queued=True)


@pytest.mark.cuda
def test_a_graph_queues_the_routing_read_and_the_host_reads_each_replays():
    """`queue_routing` captured in a graph, before more work: each replay's x and ids reach
    the host through the kept buffers, and the read waits for the event, which the graph
    records before the work after it."""
    device = torch.device("cuda")
    rows = HostRows(device)
    source = torch.zeros(1, 8, device=device)
    x = torch.empty(1, 8, device=device)
    ids = torch.empty(1, 4, dtype=torch.int64, device=device)
    after = torch.zeros(2048, 2048, device=device)

    def step():
        x.copy_(source + 1)
        ids.copy_(torch.arange(4, device=device).unsqueeze(0) + source[:, :1].long())
        rows.queue_routing(x, ids)
        after.add_(1.0)  # the work a read must not wait for (the hits)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # a warm-up: the buffers and the event are made outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for value in (5.0, 9.0):
        source.fill_(value)
        graph.replay()
        x_host, ids_host = rows.read_routing(x, ids, queued=True)
        assert torch.equal(x_host, torch.full((1, 8), value + 1))
        assert ids_host.tolist() == [[int(value) + k for k in range(4)]]
        assert x_host.is_pinned()
    torch.cuda.synchronize()
    x_host, ids_host = rows.read_routing(x, ids, queued=False)  # the stream's own read
    assert torch.equal(x_host, torch.full((1, 8), 10.0))
    assert ids_host.tolist() == [[9, 10, 11, 12]]
