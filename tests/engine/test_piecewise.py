"""`strata.engine.runtime.piecewise` without a GPU: what the stand-in for the experts does during
the warm-ups, and the order a round replays its graphs and calls in (the captures themselves are
tested by the `cuda` tests of the expert cache)."""

from types import SimpleNamespace

import pytest
import torch

from strata.engine.experts import weighted_sum
from strata.engine.runtime.piecewise import Cut, Pieces


class Counting:
    def __init__(self):
        self.calls = 0

    def forward(self, layer, x, topk_ids, topk_weights):
        self.calls += 1
        return x


def test_a_warm_up_tells_the_experts_nothing():
    inner = Counting()
    cut = Cut(inner, pool=None)
    x = torch.randn(1, 8)
    out = cut.forward(0, x, torch.zeros(1, 2, dtype=torch.int64), torch.ones(1, 2))
    assert inner.calls == 0 and torch.equal(out, torch.zeros_like(x))
    assert cut.inner is inner and cut.pieces is None


class Splitting(Counting):
    """A cache that splits its calls: the resident rows are K copies of x (after the scratch
    row); its sum counts itself."""

    splits_calls = True

    def __init__(self):
        super().__init__()
        self.rows_read = 0
        self.sums = 0

    def resident_rows(self, layer, x, topk_ids):
        self.rows_read += 1
        return x.expand(topk_ids.shape[1] + 1, -1).clone()  # [K + 1, D]

    def sum_rows(self, x, rows, topk_weights):
        self.sums += 1
        return weighted_sum(rows[1:], topk_weights, x.dtype)

    def fill_misses(self, *call):
        self.calls += 1


def test_a_warm_up_of_a_splitting_cache_sums_its_resident_rows_and_tells_it_nothing():
    inner = Splitting()
    cut = Cut(inner, pool=None)
    x = torch.randn(1, 8)
    weights = torch.tensor([[0.25, 0.5]])
    out = cut.forward(0, x, torch.zeros(1, 2, dtype=torch.int64), weights)
    assert cut.split and inner.rows_read == 1 and inner.sums == 1 and inner.calls == 0
    assert torch.allclose(out, 0.75 * x)
    assert not Cut(Counting(), pool=None).split


class Logged:
    """A graph that logs its replays into `log` (and raises, with `fail`)."""

    def __init__(self, log, name, fail=False):
        self.log, self.name, self.fail = log, name, fail

    def replay(self):
        self.log.append(self.name)
        if self.fail:
            raise RuntimeError(f"{self.name} failed")


class HandingBack:
    """A splitting cache whose calls of `ahead_layers` hand back their end (`ahead`, or the
    books a round asks for: `books_after`); it logs its calls and their ends into `log`."""

    def __init__(self, log, ahead_layers):
        self.log, self.ahead_layers = log, ahead_layers

    def fill_misses(self, layer, x, topk_ids, topk_weights, rows, books_after=False):
        assert books_after  # a round asks every call for its books after the next launch
        self.log.append(f"fill {layer}")
        if layer in self.ahead_layers:
            return lambda: self.log.append(f"end {layer}")
        return None


def _round(log, ahead_layers, failing=()):
    n_layers = 3
    graphs = [Logged(log, f"graph {i}", fail=i in failing) for i in range(n_layers + 1)]
    calls = [(layer, None, None, None) for layer in range(n_layers)]
    model = SimpleNamespace(experts=HandingBack(log, ahead_layers))
    return Pieces(model, split=True, graphs=graphs, calls=calls, outputs=[None] * n_layers)


def test_a_call_that_hands_back_its_end_ends_after_the_next_graph_is_launched():
    log = []
    _round(log, ahead_layers={0, 2}).replay()
    assert log == ["graph 0", "fill 0", "graph 1", "end 0", "fill 1", "graph 2", "fill 2",
                   "graph 3", "end 2"]


def test_a_call_s_end_is_called_even_when_the_next_graph_s_launch_fails():
    """The end sets the signal the device waits on: never skipped, or the stream would wait
    for it forever."""
    log = []
    with pytest.raises(RuntimeError, match="graph 2 failed"):
        _round(log, ahead_layers={1}, failing={2}).replay()
    assert log == ["graph 0", "fill 0", "graph 1", "fill 1", "graph 2", "end 1"]
