"""`strata.engine.runtime.piecewise` without a GPU: what the stand-in for the experts does during
the warm-ups (the captures themselves are tested by the `cuda` tests of the expert cache)."""

import torch

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
