"""Sampling: greedy, seeded draws, and the top-k / top-p filters."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.engine.runtime.sampling import Sampler


def _draws(sampler, logits, n):
    return [sampler.sample(logits) for _ in range(n)]


def test_greedy_is_argmax_with_the_lowest_id_on_ties():
    logits = torch.tensor([0.0, 3.0, 1.0, 3.0])
    assert Sampler(temperature=0).sample(logits) == 1
    assert Sampler(temperature=0).sample(logits.to(torch.bfloat16)) == 1


def test_same_seed_same_draws_other_seed_other_draws():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(1))
    a = _draws(Sampler(temperature=1.0, seed=3), logits, 40)
    b = _draws(Sampler(temperature=1.0, seed=3), logits, 40)
    c = _draws(Sampler(temperature=1.0, seed=4), logits, 40)
    assert a == b
    assert a != c


def test_draws_follow_the_softmax():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    sampler = Sampler(temperature=1.0, seed=0)
    draws = _draws(sampler, probs.log(), 4000)
    for token, p in enumerate(probs.tolist()):
        freq = draws.count(token) / len(draws)
        assert abs(freq - p) < 4 * math.sqrt(p * (1 - p) / len(draws))


def test_temperature_sharpens():
    logits = torch.tensor([1.0, 0.0])
    cold = _draws(Sampler(temperature=0.1, seed=0), logits, 500).count(0)
    hot = _draws(Sampler(temperature=1.0, seed=0), logits, 500).count(0)
    assert cold > 490 and 300 < hot < 440  # p(0) = 0.99995 and 0.73


def test_top_k_keeps_the_k_most_likely():
    logits = torch.tensor([1.0, 3.0, 2.0, 2.5, 0.0])
    draws = set(_draws(Sampler(temperature=5.0, top_k=2, seed=0), logits, 300))
    assert draws == {1, 3}
    assert set(_draws(Sampler(temperature=5.0, top_k=1, seed=0), logits, 20)) == {1}


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = torch.tensor([0.1, 0.4, 0.2, 0.3])
    draws = set(_draws(Sampler(temperature=1.0, top_p=0.5, seed=0), probs.log(), 300))
    assert draws == {1, 3}  # 0.4 < 0.5, then 0.4 + 0.3 reaches it
    assert set(_draws(Sampler(temperature=1.0, top_p=0.01, seed=0), probs.log(), 20)) == {1}


@settings(max_examples=50, deadline=None)
@given(
    logits=st.lists(st.floats(-20, 20), min_size=1, max_size=30),
    temperature=st.floats(0.05, 3.0),
    top_k=st.integers(0, 40),
    top_p=st.floats(0.01, 1.0),
    seed=st.integers(0, 2**32),
)
def test_the_pick_is_always_an_allowed_candidate(logits, temperature, top_k, top_p, seed):
    values = torch.tensor(logits)
    token = Sampler(temperature, top_p, top_k, seed).sample(values)
    assert 0 <= token < len(logits)
    if top_k:
        assert values[token] >= torch.sort(values, descending=True).values[
            min(top_k, len(logits)) - 1
        ]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, "temperature must be a finite number >= 0"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k must be an int >= 0"),
        ({"seed": -1}, "seed must be an int"),
    ],
)
def test_bad_options_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Sampler(**kwargs)


def test_bad_logits_are_rejected():
    with pytest.raises(ValueError, match="logits must be 1-D"):
        Sampler().sample(torch.zeros(2, 3))
