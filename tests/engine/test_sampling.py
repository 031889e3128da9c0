"""Sampling: greedy, seeded draws, the top-k / top-p filters, and the exponential race: its
noise, its torch pick against the race's definition (a sort), its Triton kernels against the
same under Triton's interpreter on the CPU (a fresh interpreter: TRITON_INTERPRET must be set
before Triton is imported), and on CUDA against the CPU's picks."""

import math
import os

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from strata.engine.runtime import sampling
from strata.engine.runtime.sampling import (
    Sampler,
    gumbel_noise,
    hash32,
    race_keys,
)
from support.interpreted import run_interpreted


def definition(logits, temperature, top_p, top_k, keys):
    """The race's pick by its definition: the tokens sorted by s = logits / temperature
    (descending, stable), the first top_k, the smallest prefix reaching top_p of their
    softmax, and of those the largest s + g (the lowest id on ties)."""
    scaled = logits.float() / temperature
    race = scaled + gumbel_noise(keys, scaled.shape[0], "cpu")
    values, ids = torch.sort(scaled, descending=True, stable=True)
    if 0 < top_k < values.shape[0]:
        values, ids = values[:top_k], ids[:top_k]
    if top_p < 1.0:
        probs = torch.softmax(values, dim=0)
        ids = ids[(torch.cumsum(probs, dim=0) - probs) < top_p]
    candidate_race = race[ids]
    return int(ids[candidate_race == candidate_race.max()].min())


def near_the_boundary(logits, temperature, top_p, top_k, tolerance=1e-5):
    """Whether a token's mass before it is within `tolerance` of top_p: there float
    rounding, not the method, decides whether it is a candidate."""
    values = torch.sort(logits.float() / temperature, descending=True, stable=True).values
    if 0 < top_k < values.shape[0]:
        values = values[:top_k]
    probs = torch.softmax(values.double(), dim=0)
    return bool(((torch.cumsum(probs, dim=0) - probs - top_p).abs() < tolerance).any())


def first_winner_is_candidate(logits, temperature, top_p, top_k, keys):
    """Whether the race's winner over the tokens at or above the top_k-th is a candidate:
    when not, the kernels take their slow path."""
    scaled = logits.float() / temperature
    race = scaled + gumbel_noise(keys, scaled.shape[0], "cpu")
    if 0 < top_k < scaled.shape[0]:
        race = torch.where(scaled >= torch.topk(scaled, top_k).values[-1], race, -torch.inf)
    winner = int(torch.argmax(race))
    return definition(logits, temperature, top_p, top_k, keys) == winner


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
    draws = _draws(Sampler(temperature=1.0, top_p=0.5, seed=0), probs.log(), 2000)
    assert set(draws) == {1, 3}  # 0.4 < 0.5, then 0.4 + 0.3 reaches it
    # Within the candidates, the softmax renormalised: 0.4 / 0.7 of the draws are token 1.
    p = 0.4 / 0.7
    assert abs(draws.count(1) / len(draws) - p) < 4 * math.sqrt(p * (1 - p) / len(draws))
    assert set(_draws(Sampler(temperature=1.0, top_p=0.01, seed=0), probs.log(), 20)) == {1}


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


@pytest.mark.parametrize("u", [None, 1.0, -0.1, float("nan"), 1])
def test_a_sampled_pick_without_a_draw_in_range_is_rejected(u):
    with pytest.raises(ValueError, match=r"needs the step's draw u, a float in \[0, 1\)"):
        Sampler(temperature=1.0).pick(torch.zeros(4), u)


def test_the_hash_is_the_same_on_ints_and_tensors_and_a_bijection():
    values = torch.randint(0, 2**32, (2000,), generator=torch.Generator().manual_seed(0))
    assert hash32(values).tolist() == [hash32(v) for v in values.tolist()]
    assert hash32(values).max() < 2**32 and hash32(values).min() >= 0
    assert hash32(torch.arange(2**16)).unique().numel() == 2**16  # no collisions


def test_the_noise_is_gumbel_and_a_function_of_the_draw_and_the_token():
    keys = race_keys(0.25)
    noise = gumbel_noise(keys, 200_000, "cpu")
    assert noise.dtype == torch.float32 and torch.isfinite(noise).all()
    assert torch.equal(noise, gumbel_noise(keys, 200_000, "cpu"))
    assert torch.equal(noise[:1000], gumbel_noise(keys, 1000, "cpu"))  # token i's, whatever V
    euler_gamma, variance = 0.5772157, math.pi**2 / 6
    assert abs(noise.double().mean() - euler_gamma) < 4 * math.sqrt(variance / noise.numel())
    assert abs(noise.double().var() - variance) < 0.05
    other = gumbel_noise(race_keys(0.26), 200_000, "cpu")
    assert abs(torch.corrcoef(torch.stack((noise, other)))[0, 1]) < 0.01
    assert len({race_keys(i / 997) for i in range(997)}) == 997


@settings(max_examples=200, deadline=None)
@given(
    logits=st.lists(st.integers(-40, 40), min_size=1, max_size=40),
    temperature=st.floats(0.05, 3.0),
    top_k=st.integers(0, 45),
    top_p=st.floats(0.01, 1.0),
    u=st.floats(0.0, 1.0, exclude_max=True),
)
def test_the_pick_is_the_definitions(logits, temperature, top_k, top_p, u):
    values = torch.tensor(logits, dtype=torch.float32) / 4  # quarters: ties are common
    assume(top_p == 1.0 or not near_the_boundary(values, temperature, top_p, top_k))
    picked = Sampler(temperature, top_p, top_k).pick(values, u)
    assert picked.shape == (1,) and picked.dtype == torch.int64
    assert int(picked) == definition(values, temperature, top_p, top_k, race_keys(u))


def test_the_pick_is_a_candidate_with_minus_infinity_logits():
    logits = torch.tensor([float("-inf"), 2.0, float("-inf"), 1.0])
    draws = set(_draws(Sampler(temperature=1.0, seed=0), logits, 200))
    assert draws == {1, 3}
    every = torch.full((5,), float("-inf"))
    assert Sampler(temperature=1.0).sample(every) in range(5)
    for nans in (torch.full((5,), float("nan")), torch.tensor([1.0, float("nan"), 0.0])):
        assert Sampler(temperature=1.0, top_p=0.5).sample(nans) in range(len(nans))


# The kernels under Triton's interpreter: the cases' rows of logits, seeded, and the draws.
_CASES = [  # V, temperature, top_p, top_k, kind
    (1, 1.0, 0.9, 0, "normal"), (3, 0.8, 0.95, 0, "normal"), (1000, 1.0, 1.0, 0, "normal"),
    (1024, 0.8, 0.95, 0, "ties"), (1025, 2.0, 0.1, 0, "normal"), (3000, 0.5, 0.3, 0, "ties"),
    (3000, 1.0, 1.0, 5, "normal"), (2500, 1.0, 0.7, 7, "ties"), (2100, 0.7, 0.9, 2000, "normal"),
    (2048, 1.0, 0.5, 0, "flat"), (1500, 1.0, 0.95, 0, "minus-inf"), (1100, 1.0, 0.8, 0, "bf16"),
]


def case_logits(n_tokens, kind, seed):
    """A row of logits [V] of a kind: normal, ties (rounded to halves), flat (all but two
    equal: the winner is rarely a candidate at top_p 0.5), minus-inf (most of them -inf), bf16."""
    logits = torch.randn(n_tokens, generator=torch.Generator().manual_seed(seed)) * 3
    if kind == "ties":
        logits = (logits * 2).round() / 2
    elif kind == "flat":
        logits = torch.zeros(n_tokens)
        logits[:2] = 8.0
    elif kind == "minus-inf":
        logits[torch.arange(n_tokens) % 5 != 0] = float("-inf")
    elif kind == "bf16":
        logits = logits.to(torch.bfloat16)
    return logits


_INTERPRETED = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from test_sampling import _CASES, case_logits, definition, first_winner_is_candidate
from strata.engine.runtime import _sampling_triton
from strata.engine.runtime.sampling import _race_pick_cuda, race_keys
results = []
for seed, (n_tokens, temperature, top_p, top_k, kind) in enumerate(_CASES):
    logits = case_logits(n_tokens, kind, seed)
    for draw in range(6):
        keys = race_keys((seed * 6 + draw) / 97.0 % 1.0)
        got = _race_pick_cuda(_sampling_triton, logits, temperature, top_p, top_k, keys)
        results.append({"case": seed, "got": int(got),
                        "want": definition(logits, temperature, top_p, top_k, keys),
                        "slow": not first_winner_is_candidate(logits, temperature, top_p,
                                                              top_k, keys)})
# NaN logits order nothing: the pick is only required to be a token of the row (and to end).
nan_picks = []
for n_tokens, nan_every in [(3000, 7), (1500, 1)]:
    logits = case_logits(n_tokens, "normal", 0)
    logits[::nan_every] = float("nan")
    for top_p in (0.3, 0.95):
        nan_picks.append([n_tokens, int(_race_pick_cuda(_sampling_triton, logits, 1.0, top_p, 0,
                                                        race_keys(0.5)))])
results.append(nan_picks)
print(json.dumps(results))
"""


def test_the_kernels_under_the_interpreter_pick_the_definitions_token():
    pytest.importorskip("triton", reason="the dev extra installs Triton on Linux x86_64")
    results = run_interpreted(_INTERPRETED, os.path.dirname(__file__))
    nan_picks = results.pop()
    assert all(0 <= token < n_tokens for n_tokens, token in nan_picks)
    assert len(results) == 6 * len(_CASES)
    assert [r["got"] for r in results] == [r["want"] for r in results]
    slow = [r for r in results if r["slow"]]
    assert len(slow) >= 6 and {r["case"] for r in slow} >= {9}  # the slow path, checked too


@pytest.mark.cuda
@pytest.mark.parametrize("n_tokens", [50304, 151936])
def test_on_cuda_the_kernels_pick_the_cpus_tokens(n_tokens):
    pytest.importorskip("triton")
    cuda = torch.device("cuda")
    logits = torch.randn(n_tokens, generator=torch.Generator().manual_seed(3)) * 3
    for options in ({"temperature": 0.8, "top_p": 0.95}, {"temperature": 0.8},
                    {"temperature": 1.0, "top_p": 0.5}, {"temperature": 0.8, "top_k": 50},
                    {"temperature": 1.0, "top_p": 0.9, "top_k": 50}):
        gpu, cpu = Sampler(**options, seed=5), Sampler(**options, seed=5)
        assert gpu.uses_kernels(logits.to(cuda)) and not cpu.uses_kernels(logits)
        for row in (logits, logits.to(torch.bfloat16)):
            on_cuda = row.to(cuda)
            assert [gpu.sample(on_cuda) for _ in range(60)] == [
                cpu.sample(row) for _ in range(60)], options


@pytest.mark.cuda
def test_on_cuda_a_graph_of_picks_replays_the_eager_picks():
    pytest.importorskip("triton")
    from strata.engine.runtime.decode_steps import capture_graph

    cuda = torch.device("cuda")
    logits = (torch.randn(50304, generator=torch.Generator().manual_seed(4)) * 3).to(cuda)
    sampler = Sampler(temperature=1.0, top_p=0.5, seed=9)
    draws = [sampler.draw() for _ in range(24)]
    eager = [int(sampler.pick(logits, u)) for u in draws]
    graph, picked = capture_graph(lambda: torch.cat([sampler.pick(logits, u) for u in draws]),
                                  cuda, None)
    for _ in range(2):
        graph.replay()
        assert picked.tolist() == eager
    assert any(not first_winner_is_candidate(logits.cpu(), 1.0, 0.5, 0, race_keys(u))
               for u in draws)  # the graph holds the slow path too


def argmax_rows():
    """Rows of logits [V] whose greedy pick torch.argmax says: ties, equal rows, -inf, +inf,
    NaN (the first NaN wins), one token, bf16."""
    rows = []
    for n_tokens in (1, 3, 1000, 1024, 1025, 3000):
        rows.append(case_logits(n_tokens, "normal", n_tokens))
        rows.append(case_logits(n_tokens, "ties", n_tokens))
    rows += [torch.zeros(2048), torch.full((1500,), float("-inf")),
             case_logits(1500, "minus-inf", 1), case_logits(1100, "bf16", 2)]
    late = case_logits(3000, "ties", 4)
    late[2999] = late.max()  # a tie with the last token of a partial block
    rows.append(late)
    infinite = case_logits(3000, "normal", 5)
    infinite[[700, 2100]] = float("inf")
    rows.append(infinite)
    for nan_at in ([0], [2500], [1100, 40], list(range(3000))):
        nans = case_logits(3000, "normal", 6)
        nans[nan_at] = float("nan")
        nans[10] = float("inf")
        rows.append(nans)
    return rows


_ARGMAX_INTERPRETED = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from test_sampling import argmax_rows
from strata.engine.runtime import _sampling_triton
from strata.engine.runtime.sampling import _argmax_cuda
# Each row twice, the second into a given tensor: the first launch's last program must leave
# the count at zero for the next.
out = torch.full((1,), -1, dtype=torch.int64)
print(json.dumps([[int(_argmax_cuda(_sampling_triton, row)),
                   int(_argmax_cuda(_sampling_triton, row, out)), int(out[0])]
                  for row in argmax_rows()]))
"""


def test_the_argmax_kernel_under_the_interpreter_picks_torchs_token():
    pytest.importorskip("triton", reason="the dev extra installs Triton on Linux x86_64")
    got = run_interpreted(_ARGMAX_INTERPRETED, os.path.dirname(__file__))
    assert got == [[int(torch.argmax(row))] * 3 for row in argmax_rows()]


def test_the_greedy_pick_is_torchs_argmax_off_cuda(monkeypatch):
    monkeypatch.setattr(sampling, "ARGMAX_KERNEL", True)  # off CUDA: torch's argmax anyway
    out = torch.zeros(1, dtype=torch.int64)
    for row in argmax_rows():
        assert Sampler(0.0).pick(row, None).tolist() == [int(torch.argmax(row))]
        assert sampling.argmax_pick(row, out=out) is out and out.tolist() == [
            int(torch.argmax(row))]


def test_a_pick_refuses_an_out_it_cannot_write_before_launching():
    class Kernels:
        BLOCK = 1024
        argmax_blocks = None  # a launch would fail on it

    logits = torch.zeros(5000)
    for bad in (torch.zeros(1, dtype=torch.int32), torch.zeros(2, dtype=torch.int64)):
        with pytest.raises(ValueError, match=r"out must be one int64 \[1\] on cpu"):
            sampling._argmax_cuda(Kernels, logits, bad)
        for options in ({"temperature": 0.0}, {"temperature": 0.8}):  # torch's paths too
            with pytest.raises(ValueError, match=r"out must be one int64 \[1\] on cpu"):
                Sampler(**options).pick(logits, 0.5, out=bad)
        assert bad.eq(0).all()  # nothing written


@pytest.mark.cuda
@pytest.mark.parametrize("n_tokens", [50304, 151936])
def test_on_cuda_the_argmax_kernel_picks_torchs_token_eager_and_in_a_graph(monkeypatch,
                                                                             n_tokens):
    pytest.importorskip("triton")
    from strata.engine.runtime.decode_steps import capture_graph

    monkeypatch.setattr(sampling, "ARGMAX_KERNEL", True)
    rows = [row.cuda() for row in argmax_rows()]
    rows += [(torch.randn(n_tokens, generator=torch.Generator().manual_seed(s)) * 3).cuda()
             for s in range(8)]
    want = [int(torch.argmax(row)) for row in rows]
    assert [int(sampling.argmax_pick(row)) for row in rows] == want
    graph, picked = capture_graph(lambda: torch.cat([sampling.argmax_pick(r) for r in rows]),
                                  torch.device("cuda"), None)
    for _ in range(2):
        graph.replay()
        assert picked.tolist() == want


def test_a_pick_goes_into_the_tensor_given_and_is_the_same_token():
    logits = case_logits(3000, "normal", 8)
    for options in ({"temperature": 0.0}, {"temperature": 0.8, "top_p": 0.95},
                    {"temperature": 1.0, "top_k": 5}):
        sampler = Sampler(**options, seed=3)
        draws = [sampler.draw() for _ in range(5)]
        out = torch.full((1,), -1, dtype=torch.int64)
        for u in draws:
            alone = sampler.pick(logits, u)
            assert sampler.pick(logits, u, out=out) is out and torch.equal(out, alone)
