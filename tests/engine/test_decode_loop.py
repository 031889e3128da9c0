"""`strata.engine.runtime.decode_loop`: a round launched before the host reads the token of
the one before gives the plain loop's tokens, stops, `should_stop` calls and K/V growths.

CUDA graphs are where it runs ahead (`AHEAD_PATHS`); here eager CPU rounds are let run ahead
too, which exercises the same loop (the bookkeeping, the drops, the growth's wait) on CI."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from strata.engine.model.moe import load_model
from strata.engine.model.tokenizer import Tokenizer
from strata.engine.runtime import decode_loop
from strata.engine.runtime.generate import GenerateOptions, generate
from strata.engine.runtime.sampling import Sampler
from support.checkpoints import cached_checkpoint


@pytest.fixture(scope="module")
def tiny():
    ckpt = cached_checkpoint("qwen3_moe", "tiny", dtype=torch.float32)
    return load_model(ckpt), Tokenizer.from_dir(ckpt)


def _both(monkeypatch, run):
    """run() with rounds launched one at a time, then one ahead (eager rounds let run ahead)."""
    results = []
    for paths in (frozenset(), frozenset({"eager"})):
        monkeypatch.setattr(decode_loop, "AHEAD_PATHS", paths)
        results.append(run())
    return results


@pytest.mark.parametrize("sampling", [{"temperature": 0.0},
                                      {"temperature": 0.8, "top_p": 0.95, "seed": 7},
                                      {"temperature": 1.0, "top_k": 5, "seed": 3}])
def test_ahead_gives_the_plain_loops_tokens(monkeypatch, tiny, sampling):
    model, tok = tiny
    options = GenerateOptions(max_new=20, ignore_stop=True, **sampling)
    plain, ahead = _both(monkeypatch,
                         lambda: generate(model, tok, tok.encode("ahead of time"), options))
    assert ahead.tokens == plain.tokens and len(ahead.tokens) == 20
    assert ahead.stop_reason == plain.stop_reason == "max_new"
    assert ahead.decode_rounds == 19


def test_a_stop_id_drops_the_round_launched_after_it(monkeypatch, tiny):
    model, tok = tiny
    greedy = GenerateOptions(max_new=20, temperature=0.0, ignore_stop=True)
    free = generate(model, tok, tok.encode("stop here"), greedy).tokens
    stop = free[6]  # the 7th token ends the request (its first use, if it repeats)
    options = dataclasses.replace(greedy, ignore_stop=False, stop_ids=frozenset({stop}))
    plain, ahead = _both(monkeypatch,
                         lambda: generate(model, tok, tok.encode("stop here"), options))
    assert ahead.tokens == plain.tokens == free[: free.index(stop) + 1]
    assert ahead.stop_reason == plain.stop_reason == "eos"


def test_should_stop_is_asked_as_often_and_at_the_same_tokens(monkeypatch, tiny):
    model, tok = tiny
    options = GenerateOptions(max_new=20, temperature=0.0, ignore_stop=True)

    def run():
        emitted, asked = [], []

        def should_stop():
            asked.append(len(emitted))  # how many pieces of text were out when asked
            return len(asked) > 5

        result = generate(model, tok, tok.encode("asked"), options,
                          on_text=emitted.append, should_stop=should_stop)
        return result, asked

    (plain, plain_asked), (ahead, ahead_asked) = _both(monkeypatch, run)
    assert ahead.tokens == plain.tokens and len(ahead.tokens) == 6
    assert ahead.stop_reason == plain.stop_reason == "stopped"
    assert ahead_asked == plain_asked


class _CountingStep:
    """A step whose round's logits pick token position % 7, recording when rounds launch and
    the K/V grows, against how many tokens the host has read."""

    path = "eager"

    def __init__(self, mapped_cells: int) -> None:
        self.token = torch.zeros(1, dtype=torch.int64)
        self.kv = type("KV", (), {"mapped_cells": mapped_cells})()
        self.launched, self.grown, self.read = [], [], []

    def round(self, position: int) -> torch.Tensor:
        self.launched.append((position, len(self.read)))
        logits = torch.zeros(7)
        logits[position % 7] = 1.0
        return logits

    def grow(self, position: int) -> _CountingStep:
        self.grown.append((position, len(self.launched) - len(self.read)))
        self.kv.mapped_cells = position + 4
        return self


@pytest.mark.parametrize("n_rounds", [0, 1, 9])
def test_at_most_one_round_ahead_none_past_the_last_and_growth_between_rounds(
        monkeypatch, n_rounds):
    monkeypatch.setattr(decode_loop, "AHEAD_PATHS", frozenset({"eager"}))
    step = _CountingStep(mapped_cells=5)
    rounds = decode_loop.decode_rounds(
        step, Sampler(0.0), 1, 2, n_rounds, stop_ids=frozenset(), on_token=step.read.append,
        should_stop=None, grow=step.grow)
    assert not rounds.stopped and rounds.step is step and rounds.token_wait_s >= 0.0
    assert step.read == [p % 7 for p in range(2, 2 + n_rounds)]  # round p picks p % 7
    assert len(step.launched) == n_rounds  # none past the last
    assert all(position - 2 - read <= 1 for position, read in step.launched)  # one ahead
    assert all(in_flight == 0 for _, in_flight in step.grown)  # growth between rounds
    assert [p for p, _ in step.grown] == [p for p in (5, 9) if p < 2 + n_rounds]


def test_the_host_s_waits_for_the_tokens_are_counted(monkeypatch):
    """`Rounds.token_wait_s`: the time each token's read held the host (here 5 ms a read),
    within the rounds' time; none when `should_stop` ends them before the first."""
    read = decode_loop._Pending.read

    def slow(pending):
        time.sleep(0.005)
        return read(pending)

    monkeypatch.setattr(decode_loop._Pending, "read", slow)
    step = _CountingStep(mapped_cells=100)
    started = time.perf_counter()
    rounds = decode_loop.decode_rounds(step, Sampler(0.0), 1, 2, 4, stop_ids=frozenset(),
                                       on_token=step.read.append, should_stop=None, grow=None)
    spent = time.perf_counter() - started
    assert len(step.read) == 4 and 4 * 0.005 <= rounds.token_wait_s <= spent
    stopped = decode_loop.decode_rounds(step, Sampler(0.0), 1, 2, 4, stop_ids=frozenset(),
                                        on_token=step.read.append, should_stop=lambda: True,
                                        grow=None)
    assert stopped.stopped and stopped.token_wait_s == 0.0


@pytest.mark.cuda
@pytest.mark.parametrize("sampling", [{"temperature": 0.0},
                                      {"temperature": 0.8, "top_p": 0.95, "seed": 7}])
def test_on_cuda_graph_rounds_run_ahead_and_give_the_plain_loops_tokens(monkeypatch, sampling):
    ckpt = cached_checkpoint("qwen3_moe", "tiny", dtype=torch.bfloat16)
    tok = Tokenizer.from_dir(ckpt)
    options = GenerateOptions(max_new=300, max_context=512, ignore_stop=True, **sampling)
    runs = []
    for paths in (frozenset(), decode_loop.AHEAD_PATHS):
        monkeypatch.setattr(decode_loop, "AHEAD_PATHS", paths)
        model = load_model(ckpt, device="cuda")  # graphs anew
        runs.append(generate(model, tok, tok.encode("graphs ahead"), options))
    assert runs[1].decode_path == "cuda-graph" and runs[1].tokens == runs[0].tokens
    # A stop id in the middle: the round launched after it is dropped.
    stop = runs[0].tokens[100]
    stopped = generate(model, tok, tok.encode("graphs ahead"), dataclasses.replace(
        options, ignore_stop=False, stop_ids=frozenset({stop})))
    assert stopped.tokens == runs[0].tokens[: runs[0].tokens.index(stop) + 1]


def test_a_step_changed_by_the_growth_reads_the_token_picked_last(monkeypatch):
    """An elastic K/V's growth may give up expert slots and so change the step (a graph's for
    a piecewise one): the new step's first round reads the token the old one's last round
    picked, which the loop wrote into the old step's tensor."""
    monkeypatch.setattr(decode_loop, "AHEAD_PATHS", frozenset({"eager"}))
    fed = []

    class Feeding(_CountingStep):
        def round(self, position):
            fed.append((position, int(self.token[0])))
            return super().round(position)

        def grow(self, position):
            super().grow(position)
            fresh = Feeding(self.kv.mapped_cells)  # a new step, its token tensor zeros
            fresh.read = self.read
            return fresh

    step = Feeding(mapped_cells=5)
    decode_loop.decode_rounds(step, Sampler(0.0), 1, 2, 6, stop_ids=frozenset(),
                              on_token=step.read.append, should_stop=None, grow=step.grow)
    # Round p is fed the token round p - 1 picked (p - 1) % 7; the first the token given.
    assert fed == [(2, 1)] + [(p, (p - 1) % 7) for p in range(3, 8)]


class _PickingStep(_CountingStep):
    """A step that picks inside its round, as a graph with the greedy pick captured in it
    does (`decode_steps.GREEDY_PICK_IN_GRAPH`): the pick (position % 7) left in `token`."""

    picks = True

    def round(self, position: int) -> torch.Tensor:
        logits = super().round(position)
        self.token.fill_(position % 7)
        return torch.full_like(logits, float("nan"))  # the caller must not pick from them


@pytest.mark.parametrize("ahead", [frozenset(), frozenset({"eager"})])
def test_a_step_that_picks_gives_its_picks_and_takes_no_sampled_pick(monkeypatch, ahead):
    monkeypatch.setattr(decode_loop, "AHEAD_PATHS", ahead)
    step = _PickingStep(mapped_cells=100)
    decode_loop.decode_rounds(step, Sampler(0.0), 1, 2, 9, stop_ids=frozenset({5}),
                              on_token=step.read.append, should_stop=None, grow=None)
    assert step.read == [2, 3, 4, 5]  # round p picks p % 7; 5 stops
    sampled = _PickingStep(mapped_cells=100)
    with pytest.raises(ValueError, match="picks greedily inside its rounds was given a "
                       "sampled pick: make the step with greedy=False"):
        decode_loop.decode_rounds(sampled, Sampler(0.8, seed=1), 1, 2, 9, stop_ids=frozenset(),
                                  on_token=sampled.read.append, should_stop=None, grow=None)
    assert sampled.launched == [] and sampled.read == []  # refused before any round


@pytest.mark.cuda
@pytest.mark.parametrize("argmax_kernel", [False, True])
def test_on_cuda_greedy_picks_inside_the_graphs_give_the_same_tokens(monkeypatch,
                                                                     argmax_kernel):
    """GREEDY_PICK_IN_GRAPH: the graphs' own picks are the loop's, across the 256-cell window
    (the second graph captured inside the rounds, its warm-up's token and position put back),
    with a round dropped after a stop id, and the same step's rounds from the start again
    after it; by torch's argmax and by the argmax kernel (`sampling.ARGMAX_KERNEL`)."""
    from strata.engine.kv import new_kv
    from strata.engine.runtime import decode_steps, sampling

    monkeypatch.setattr(sampling, "ARGMAX_KERNEL", argmax_kernel)

    ckpt = cached_checkpoint("qwen3_moe", "tiny", dtype=torch.bfloat16)
    model = load_model(ckpt, device="cuda")
    runs = []
    for on in (False, True):
        monkeypatch.setattr(decode_steps, "GREEDY_PICK_IN_GRAPH", on)
        with new_kv(model, 512) as kv:
            model.forward(torch.tensor([3, 1, 4, 1, 5], device="cuda"), 0, kv)
            step = decode_steps.decode_step(model, kv, None, cuda_graphs=True,
                                            piecewise_graphs=False, compile=False, greedy=True)
            assert step.path == "cuda-graph" and step.picks == on
            step.prepare(9, 5, 5)  # the first window's graph only
            tokens = []
            decode_loop.decode_rounds(step, Sampler(0.0), 9, 5, 300, stop_ids=frozenset(),
                                      on_token=tokens.append, should_stop=None, grow=None)
            assert len(step.graphs) == 2
            stop = tokens[120]
            stopped = []
            decode_loop.decode_rounds(step, Sampler(0.0), 9, 5, 300,
                                      stop_ids=frozenset({stop}), on_token=stopped.append,
                                      should_stop=None, grow=None)
            again = []  # after a dropped round: the position written again, not assumed
            decode_loop.decode_rounds(step, Sampler(0.0), 9, 5, 50, stop_ids=frozenset(),
                                      on_token=again.append, should_stop=None, grow=None)
        runs.append((tokens, stopped, again))
    assert runs[1] == runs[0]
    tokens, stopped, again = runs[0]
    assert stopped == tokens[: tokens.index(tokens[120]) + 1] and again == tokens[:50]


@pytest.mark.cuda
def test_on_cuda_a_failed_capture_of_a_picking_graph_puts_the_token_and_position_back(
        monkeypatch):
    from strata.engine.kv import new_kv
    from strata.engine.runtime import decode_steps

    def warm_up_then_fail(step, device, pool):
        step(), step()  # the warm-ups pick and move the position on
        raise RuntimeError("capture failed")

    model = load_model(cached_checkpoint("qwen3_moe", "tiny", dtype=torch.bfloat16),
                       device="cuda")
    monkeypatch.setattr(decode_steps, "GREEDY_PICK_IN_GRAPH", True)
    monkeypatch.setattr(decode_steps, "capture_graph", warm_up_then_fail)
    with new_kv(model, 64) as kv:
        step = decode_steps.decode_step(model, kv, None, cuda_graphs=True,
                                        piecewise_graphs=False, compile=False, greedy=True)
        with pytest.raises(RuntimeError, match="capture failed"):
            step.prepare(9, 5, 5)
        assert (int(step.token[0]), int(step.position[0])) == (9, 5) and not step.graphs
