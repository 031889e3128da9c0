"""Synthetic traces: seeded, well-formed, and shaped as their kind says."""

import numpy as np
import pytest

from strata.formats.trace import DECODE, PROMPT
from strata.sim.synth import SynthSpec, synth_trace


def small(**kwargs):
    spec = dict(n_layers=3, n_experts=16, top_k=2, n_requests=3, prompt_tokens=(5, 20),
                decode_tokens=(10, 30), prompt_chunk=8)
    return SynthSpec(**{**spec, **kwargs})


def overlap(trace):
    """Mean number of experts a token shares with the previous token at the same layer."""
    ids = trace.expert_ids
    shared = (ids[1:, :, :, None] == ids[:-1, :, None, :]).any(axis=3).sum(axis=2)
    return shared.mean()


@pytest.mark.parametrize("kind", ["uniform", "zipf", "markov"])
def test_seeded_and_well_formed(kind):
    a, b = synth_trace(small(kind=kind)), synth_trace(small(kind=kind))
    assert np.array_equal(a.expert_ids, b.expert_ids)
    assert np.array_equal(a.step_offsets, b.step_offsets)
    c = synth_trace(small(kind=kind, seed=1))
    assert not np.array_equal(a.expert_ids[:5], c.expert_ids[:5])
    # Requests of prompt chunks of at most 8 tokens, then one decode step per token.
    assert a.n_requests == 3
    for r in range(a.n_requests):
        steps = range(a.request_offsets[r], a.request_offsets[r + 1])
        phases = a.step_phase[list(steps)]
        tokens = a.step_tokens[list(steps)]
        assert (tokens[phases == PROMPT] <= 8).all()
        assert (tokens[phases == DECODE] == 1).all()
        assert 5 <= tokens[phases == PROMPT].sum() <= 20
        assert 10 <= tokens[phases == DECODE].sum() <= 30
    assert a.meta["synth"]["kind"] == kind
    assert a.meta["model"]["kv_segments"] == 6


def test_zipf_is_skewed_per_layer_and_uniform_is_not():
    zipf = synth_trace(small(kind="zipf", zipf_s=1.2, n_requests=20))
    uniform = synth_trace(small(kind="uniform", n_requests=20))
    z, u = zipf.routing_counts(), uniform.routing_counts()
    assert (z.max(axis=1) > 4 * np.maximum(z.min(axis=1), 1)).all()
    assert (u.max(axis=1) < 2 * u.min(axis=1)).all()
    # Each layer has its own favourite expert.
    assert len(set(z.argmax(axis=1).tolist())) > 1


def test_popularity_seed_keeps_the_workload():
    a = synth_trace(small(kind="zipf", zipf_s=1.5, n_requests=30)).routing_counts()
    same = synth_trace(small(kind="zipf", zipf_s=1.5, n_requests=30, seed=9)).routing_counts()
    other = synth_trace(small(kind="zipf", zipf_s=1.5, n_requests=30, seed=9,
                              popularity_seed=4)).routing_counts()
    assert (a.argmax(axis=1) == same.argmax(axis=1)).all()
    assert (a.argmax(axis=1) != other.argmax(axis=1)).any()


def test_markov_repeats_the_previous_token():
    zipf = synth_trace(small(kind="zipf", n_requests=10))
    sticky = synth_trace(small(kind="markov", markov_p=0.9, n_requests=10))
    never = synth_trace(small(kind="markov", markov_p=0.0, n_requests=10))
    always = synth_trace(small(kind="markov", markov_p=1.0, n_requests=2))
    assert overlap(sticky) > overlap(zipf) + 0.8
    assert abs(overlap(never) - overlap(zipf)) < 0.3
    # p = 1: each request routes every token to its first token's experts.
    for r in range(always.n_requests):
        t0 = always.step_offsets[always.request_offsets[r]]
        t1 = always.step_offsets[always.request_offsets[r + 1]]
        rows = np.sort(always.expert_ids[t0:t1], axis=2)
        assert (rows == rows[0]).all()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"kind": "pareto"}, "kind must be one of uniform, zipf, markov"),
    ({"top_k": 17}, "top_k 17 exceeds n_experts 16"),
    ({"n_layers": 0}, "n_layers must be an int >= 1"),
    ({"prompt_tokens": (5, 2)}, r"prompt_tokens must satisfy 0 <= lo <= hi"),
    ({"decode_tokens": "many"}, "decode_tokens must be an int or a"),
    ({"prompt_tokens": 0, "decode_tokens": 0}, "at least one token"),
    ({"zipf_s": -1.0}, "zipf_s must be a finite number >= 0"),
    ({"markov_p": 1.5}, r"markov_p must be in \[0, 1\]"),
    ({"seed": -1}, "seed must be an int >= 0"),
])
def test_bad_specs(kwargs, message):
    with pytest.raises(ValueError, match=message):
        small(**kwargs)
