"""`strata.engine.runtime.piecewise` without a GPU: what the stand-in for the experts does during
the warm-ups (the captures themselves are tested by the `cuda` tests of the expert cache)."""

import torch

from strata.engine.experts import weighted_sum
from strata.engine.runtime.piecewise import Cut


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
