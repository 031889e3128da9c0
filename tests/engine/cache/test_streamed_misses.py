"""StreamedMisses on the CPU: which misses it takes, and its math against a float64 reference
one expert at a time from the host store."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from strata.engine.experts.routed import Routed
from strata.engine.experts.streamed import StreamedMisses
from support.checkpoints import cached_checkpoint, store_of


@pytest.fixture(scope="module")
def store():
    return store_of(cached_checkpoint("qwen3_moe", "small", dtype=torch.float32))  # L=4, E=16, K=4


def test_it_takes_the_first_missed_experts_by_id(store):
    streamer = StreamedMisses(store, torch.device("cpu"), 2)
    ids = np.array([[9, 3, 12, 5]])  # [T, K]
    hit = np.array([[False, True, False, False]])
    streamed, rest = streamer.split(Routed.of(ids, ~hit))
    assert streamed.experts.tolist() == [5, 9] and sorted(streamed.rows.tolist()) == [0, 3]
    assert rest.experts.tolist() == [12] and rest.rows.tolist() == [2]
    streamed, rest = StreamedMisses(store, torch.device("cpu"), 4).split(Routed.of(ids, ~hit))
    assert streamed.experts.tolist() == [5, 9, 12] and rest is None
    # The count a split call asks for first: the same, up to the blobs.
    assert [streamer.count(m, layer=1) for m in (0, 1, 2, 3)] == [0, 1, 2, 2]


def test_it_computes_the_streamed_experts_over_the_token(store):
    streamer = StreamedMisses(store, torch.device("cpu"), 3)
    ids = np.array([[7, 0, 15, 2]])
    hit = np.array([[True, False, False, False]])
    x = torch.randn(1, store.hidden_size, generator=torch.Generator().manual_seed(3))
    for layer in (0, 3):
        streamed, _ = streamer.split(Routed.of(ids, ~hit))
        out = streamer.compute(layer, x, streamed)  # [R, D], rows in streamed.rows order
        f = store.expert_width
        for row, expert in zip(streamed.rows.tolist(), streamed.experts.tolist(), strict=True):
            gate, up, down = (w.double() for w in store.weights(layer, expert))
            h = torch.cat([gate, up]) @ x[0].double()
            expected = down @ (F.silu(h[:f]) * h[f:])
            got = out[streamed.rows.tolist().index(row)].double()
            assert ((got - expected).norm() / expected.norm()).item() < 1e-5


def test_it_refuses_what_it_cannot_hold(store):
    with pytest.raises(ValueError, match="n_blobs must be an int >= 1, got 0"):
        StreamedMisses(store, torch.device("cpu"), 0)
    streamer = StreamedMisses(store, torch.device("cpu"), 1)
    ids = np.array([[1, 2, 3, 4]])
    misses = Routed.of(ids, np.ones_like(ids, dtype=bool))
    with pytest.raises(ValueError, match="do not fit 1 staging blobs"):
        streamer.compute(0, torch.zeros(1, store.hidden_size), misses)
    two = np.array([[1, 2, 3, 4], [1, 5, 6, 7]])
    with pytest.raises(ValueError, match="for one token"):
        streamer.compute(0, torch.zeros(2, store.hidden_size),
                         Routed.of(two, np.ones_like(two, dtype=bool)))


def test_staged_then_computed_in_the_graph_gives_the_rows_compute_gives(store):
    """A split call's halves: `stage` (the uploads, the map) then `staged_rows` write each
    streamed expert's row where the map says, the bytes `compute` gives; an unused blob's row
    goes to the scratch row 0, and a cleared map computes nothing."""
    streamer = StreamedMisses(store, torch.device("cpu"), 3)
    x = torch.randn(1, store.hidden_size, generator=torch.Generator().manual_seed(4))
    ids = np.array([[7, 0, 15, 2]])
    streamed, _ = streamer.split(Routed.of(ids, np.array([[False, True, False, True]])))  # misses
    expected = streamer.compute(2, x, streamed)  # [R, D] in streamed.rows order
    rows = torch.full((5, store.hidden_size), 7.0)  # [K + 1, D]: row 0 scratch
    streamer.stage(2, streamed, streamed.rows + 1)
    assert streamer.stage_map.tolist()[:3] == [0, 1, -1]  # two blobs used, one not
    streamer.staged_rows(x, rows)
    for i, row in enumerate(streamed.rows.tolist()):
        assert torch.equal(rows[row + 1], expected[i])
    untouched = [k + 1 for k in range(4) if k not in streamed.rows.tolist()]
    assert (rows[untouched] == 7.0).all()
    streamer.stage(2, None, None)  # nothing streamed: the map cleared
    assert streamer.stage_map.tolist() == [-1, -1, -1, 0, 0, 0]
    before = rows.clone()
    streamer.staged_rows(x, rows)
    assert torch.equal(rows, before)


def test_a_stage_map_refuses_rows_that_are_not_one_per_expert_or_the_scratch_row(store):
    streamer = StreamedMisses(store, torch.device("cpu"), 2)
    streamed, _ = streamer.split(Routed.of(np.array([[1, 2, 3, 4]]), np.ones((1, 4), bool)))
    for rows in (np.array([1]), np.array([0, 2]), None):
        with pytest.raises(ValueError, match="one row >= 1 per streamed expert"):
            streamer.stage(0, streamed, rows)
    assert streamer.stage_map.tolist() == [-1, -1, 0, 0]  # left as it was
