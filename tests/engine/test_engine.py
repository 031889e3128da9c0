"""`Engine` across requests on the host backend: the reference's served scenario (grow at the
request and mid-decode, trim and refill, park and restore), prefix reuse, a restored
conversation continuing exactly as one never parked, and many random requests leaking nothing.

Chunks are 4 KiB so the tiny model grows in many small steps: a K/V cell of the tiny qwen3_moe in
fp32 is 128 bytes (32 cells a chunk, 4 segments), a slot 96 KiB (24 chunks).
"""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
import torch

from strata import _vmm
from strata.engine.cache.build import plan_cache
from strata.engine.kv.plan import plan_elastic_cache
from strata.engine.model.config import ModelConfig
from strata.engine.runtime import decode_loop
from strata.engine.runtime.engine import Engine
from strata.engine.runtime.generate import GenerateOptions
from strata.formats.profile import rank_from_counts
from strata.policies import hookimpl, load_registry, plugin_manager
from strata.policies.events import EVENTS
from support.checkpoints import cached_checkpoint
from support.events import EventLog

CHUNK = 4096
WINDOW = 512
GROW = {"STRATA_KV_GROW_INIT": "32", "STRATA_KV_GROW_STEP": "32", "STRATA_KV_GROW_FLOOR": "2"}


def options(max_new, **kw):
    return GenerateOptions(max_new=max_new, max_context=WINDOW, temperature=0.0,
                           prefill_chunk=32, ignore_stop=True, **kw)


@pytest.fixture(scope="module")
def ckpt():
    return cached_checkpoint("qwen3_moe", "tiny", dtype=torch.float32)


@pytest.fixture(scope="module")
def rank(ckpt):
    cfg = ModelConfig.from_dir(ckpt)
    counts = np.random.default_rng(0).integers(0, 1000, (cfg.n_layers, cfg.n_experts))
    return rank_from_counts(counts)


class Started:
    """Remembers `strata_engine_started`."""

    def __init__(self):
        self.infos = []

    @hookimpl
    def strata_engine_started(self, info):
        self.infos.append(info)


def _engine(ckpt, rank, *, kv_grow=True, conversations=True, **sizing):
    """(engine, event log): the tiny model through the expert cache sized as `strata generate`
    sizes it (the host default budget: every expert and the start cells, no free budget)."""
    cfg = ModelConfig.from_dir(ckpt)
    pm = plugin_manager(entry_points=False)
    log = EventLog()
    pm.register(log)
    log.started = Started()
    pm.register(log.started)
    sizing = {"max_context": WINDOW, "prefill_chunk": 32, "prefill_loan": True, "rank": rank,
              "backend": _vmm.HostBackend(CHUNK), "events": pm, **sizing}
    if kv_grow:
        cache, elastic, _ = plan_elastic_cache(cfg, torch.float32, torch.device("cpu"),
                                               profile=True, environ=GROW, **sizing)
    else:
        cache, elastic = plan_cache(cfg, torch.float32, torch.device("cpu"), **sizing), None
    engine = Engine.open(ckpt, cache=cache, kv_grow=elastic, max_context=WINDOW,
                         conversation_cache_mib=4.0 if conversations else 0.0,
                         conversation_cache_slots=2 if conversations else 0)
    return engine, log


def _kinds(log, since=0):
    return [type(e).__name__ for e in log.seen[since:]]


@pytest.mark.parametrize("ahead", [False, True])
def test_the_served_scenario(ckpt, rank, monkeypatch, ahead):
    # ahead: the decode rounds launched one ahead of the host's reads, as CUDA graphs' are
    # (strata.engine.runtime.decode_loop): the growths mid-decode wait for the round in flight.
    monkeypatch.setattr(decode_loop, "AHEAD_PATHS", frozenset({"eager"} if ahead else ()))
    monkeypatch.setenv("STRATA_LOAN_KEEP_SLOTS", "8")  # a loan region of the top 8 slots
    engine, log = _engine(ckpt, rank)
    table = engine.cache.table
    with engine:
        assert engine.kv.mapped_cells == 32
        # A chat: fits the start cells.
        chat = engine.generate(list(range(100, 110)), options(6))
        assert chat.kv.grows == 0 and chat.reused_tokens == 0
        table.validate()
        # A long prompt: grown at the request for the prompt, then mid-decode.
        long_prompt = [3 + i % 250 for i in range(250)]
        seen = len(log.seen)
        long = engine.generate(long_prompt, options(60))
        kinds = _kinds(log, seen)
        assert kinds.count("Grown") >= 2 and "Parked" in kinds  # the chat shared nothing
        grown = [e for e in log.seen[seen:] if type(e).__name__ == "Grown"]
        assert grown[0].cells_after >= 250 + 16 and grown[0].cells_after < 250 + 59
        assert engine.kv.mapped_cells >= 250 + 59 and long.kv.slots_given_up > 0
        table.validate()
        given_up = long.kv.slots_given_up
        # Two short chats: the long conversation is parked, the K/V trimmed, slots refilled.
        seen = len(log.seen)
        engine.generate(list(range(200, 210)), options(6))
        engine.generate(list(range(230, 240)), options(6))
        kinds = _kinds(log, seen)
        assert "Trimmed" in kinds and "Refilled" in kinds and kinds.count("Parked") == 2
        assert engine.kv.mapped_cells < 100 and engine.elastic.stats.refilled > 0
        assert table.n_resident > 16 - given_up
        table.validate()
        # The long conversation's follow-up: restored from its parked copy after growing.
        follow = long_prompt + long.tokens[:-1] + [7, 8, 9]
        seen = len(log.seen)
        result = engine.generate(follow, options(4))
        kinds = _kinds(log, seen)
        assert "Restored" in kinds and kinds.index("Grown") < kinds.index("Restored")
        assert result.reused_tokens == len(long_prompt) + len(long.tokens) - 1
        assert result.stats()["reused_tokens"] == result.reused_tokens
        table.validate()
    done = [e for e in log.seen if type(e).__name__ == "RequestFinished"]
    assert [e.reused_tokens for e in done] == [0, 0, 0, 0, result.reused_tokens]
    assert len([e for e in log.seen if type(e).__name__ == "RequestStarted"]) == 5


def test_a_chat_reuses_the_live_conversation(ckpt, rank):
    engine, _ = _engine(ckpt, rank, kv_grow=False, conversations=False)
    with engine:
        first = engine.generate(list(range(3, 23)), options(5))
        turn = list(range(3, 23)) + first.tokens[:-1] + [1, 2, 3]
        second = engine.generate(turn, options(5))
        assert second.reused_tokens == 20 + 4
        # A request that differs after 10 tokens reuses those 10 and drops the rest.
        third = engine.generate([*range(3, 13), 99, 98], options(3))
        assert third.reused_tokens == 10
        # One decode step for the engine's life (on CUDA, with the graphs it captured).
        assert len(engine.warm) == 1


def test_a_stopped_request_keeps_its_cells_for_the_next_turn(ckpt, rank):
    engine, _ = _engine(ckpt, rank, kv_grow=True, conversations=False)
    with engine:
        asked = []

        def stop_after_four_rounds():
            asked.append(True)
            return len(asked) > 4

        first = engine.generate(list(range(3, 23)), options(20),
                                should_stop=stop_after_four_rounds)
        assert first.stop_reason == "stopped" and len(first.tokens) == 5
        assert first.decode_rounds == 4
        # The next turn continues what was generated: every cell written is reused.
        second = engine.generate(list(range(3, 23)) + first.tokens[:-1] + [7], options(3))
        assert second.reused_tokens == 20 + 4
        engine.elastic.table.validate()


def test_a_restored_conversation_continues_as_one_never_parked(ckpt, rank):
    prompt = list(range(3, 83))
    unrelated = list(range(100, 120))
    results = []
    for park in (False, True):
        engine, log = _engine(ckpt, rank, kv_grow=False)
        with engine:
            first = engine.generate(prompt, options(12))
            if park:
                engine.generate(unrelated, options(4))  # parks the first conversation
            follow = prompt + first.tokens[:-1] + [5, 6, 7]
            results.append(engine.generate(follow, options(8)))
        assert ("Restored" in _kinds(log)) == park
    kept, restored = results
    assert kept.reused_tokens == restored.reused_tokens == 80 + 11
    assert torch.equal(kept.first_logits, restored.first_logits)
    assert kept.tokens == restored.tokens


def test_the_cache_gets_its_slots_back_whole_after_many_requests(ckpt, rank, monkeypatch):
    """A give-up frees whole slots, more chunks than a step needs; the rest go to the free
    budget. Once the K/V is trimmed back to its start, the arena's holes are filled again (from
    the K/V's chunks, then the free budget): every slot backed, as many chunks alive as at the
    start, however many requests ran before."""
    monkeypatch.setenv("STRATA_LOAN_KEEP_SLOTS", "8")
    rng = np.random.default_rng(0)
    engine, _ = _engine(ckpt, rank)
    with engine:
        table = engine.cache.table
        backed, alive = int(table.backed.sum()), _vmm.alive_chunks()
        assert backed == table.n_slots
        for round_ in range(3):
            for _ in range(20):
                prompt = [int(t) for t in rng.integers(3, 250, rng.integers(1, 200))]
                engine.generate(prompt, options(int(rng.integers(1, 9))))
            engine.generate([250 - round_] + [5] * 299, options(2))  # grows, gives slots up
            assert int(table.backed.sum()) < backed
            engine.generate([9, 8, 7], options(1))  # trimmed back to the start cells
            assert engine.kv.mapped_cells == 32
            assert int(table.backed.sum()) == backed, f"round {round_}"
            assert _vmm.alive_chunks() == alive
            table.validate()


@pytest.mark.parametrize("op", ["create", "map", "access"])
def test_a_fault_while_the_trim_fills_holes_from_the_budget_changes_nothing(ckpt, rank, op,
                                                                           monkeypatch):
    monkeypatch.setenv("STRATA_LOAN_KEEP_SLOTS", "8")
    engine, _ = _engine(ckpt, rank)
    with engine:
        table, backend = engine.cache.table, engine.cache.arena.backend
        engine.generate([250] + [5] * 299, options(2))  # grown: slots given up
        mapped, owners = engine.kv.mapped_cells, table.owner.copy()
        alive, free = _vmm.alive_chunks(), engine.elastic.free_chunks
        assert free > 0  # the give-up's spare chunks: the trim will draw on them
        for nth in range(1, 1000):  # a fault at every call of `op` the trim makes, in turn
            backend.inject_fault(op, nth)
            engine.elastic.trim(4)  # to the start cells; a fault rolls it back
            backend.clear_faults()
            if engine.kv.mapped_cells < mapped:
                break  # the fault came after the trim's last call of `op`: it completed
            assert np.array_equal(table.owner, owners) and _vmm.alive_chunks() == alive
            assert engine.elastic.free_chunks == free and engine.elastic.stats.failures == nth
            table.validate()
        else:
            raise AssertionError(f"the trim never completed past {op} faults")
        assert int(table.backed.sum()) == table.n_slots
        table.validate()


def test_random_requests_leak_nothing(ckpt, rank, monkeypatch):
    monkeypatch.setenv("STRATA_LOAN_KEEP_SLOTS", "8")
    rng = np.random.default_rng(7)
    _engine(ckpt, rank)[0].close()  # files opened once per process are not leaks
    gc.collect()
    alive, fds = _vmm.alive_chunks(), len(os.listdir("/proc/self/fd"))
    engine, _ = _engine(ckpt, rank)
    history: list[list[int]] = []
    failures = 0
    with engine:
        backend = engine.cache.arena.backend
        for _ in range(1000):
            kind = rng.integers(3)
            if kind == 0 or not history:  # a new conversation
                prompt = [int(t) for t in rng.integers(3, 250, rng.integers(1, 200))]
            else:  # a continuation of an earlier one (live or parked)
                prompt = history[rng.integers(len(history))] + [int(rng.integers(3, 250))]
            prompt = prompt[: WINDOW - 40][-300:]
            if rng.random() < 0.2:
                backend.inject_fault(str(rng.choice(["map", "unmap"])), int(rng.integers(1, 6)))
            try:
                result = engine.generate(prompt, options(int(rng.integers(1, 24))))
                history.append(prompt + result.tokens[:-1])
            except Exception as err:  # a failed growth the run could not go on without
                failures += 1
                assert "K/V cells" in str(err) or "injected fault" in str(err)
            backend.clear_faults()
            engine.cache.table.validate()
    del engine, backend  # a memory backend closes its files when it is dropped
    gc.collect()
    assert _vmm.alive_chunks() == alive and len(os.listdir("/proc/self/fd")) <= fds
    assert 0 < failures < 300  # some growths failed under the faults, most requests ran


def test_every_documented_hook_and_event_fires(ckpt, rank, monkeypatch):
    # lru admits misses (Admitted, Evicted); the rest come from the served scenario's steps.
    monkeypatch.setenv("STRATA_LOAN_KEEP_SLOTS", "8")
    engine, log = _engine(ckpt, rank, policy=load_registry().create("lru"))
    long_prompt = [3 + i % 250 for i in range(250)]
    with engine:
        engine.generate(list(range(100, 110)), options(6))
        long = engine.generate(long_prompt, options(60))
        engine.generate(list(range(200, 210)), options(6))
        engine.generate(list(range(230, 240)), options(6))
        engine.generate(long_prompt + long.tokens[:-1] + [7], options(4))
    assert [info.kv_grow for info in log.started.infos] == [True]
    assert log.started.infos[0].n_slots == 16 and log.started.infos[0].policy == "lru"
    missing = {event.__name__ for event in EVENTS} - set(_kinds(log))
    assert not missing, f"documented events never fired in a real run: {sorted(missing)}"


class FailingTarget(load_registry().get("coldest-in-loan").cls):
    """The default policy, whose `kv_target` raises while `failing` is set."""

    name = "failing-target"
    failing = False

    def kv_target(self, need_cells, mapped_cells, params):
        if self.failing:
            raise RuntimeError("no target today")
        return super().kv_target(need_cells, mapped_cells, params)


def test_a_failed_restore_or_policy_loses_no_parked_conversation(ckpt, rank, monkeypatch):
    monkeypatch.setenv("STRATA_LOAN_KEEP_SLOTS", "8")
    policy = FailingTarget()
    engine, log = _engine(ckpt, rank, policy=policy)
    long_prompt = [3 + i % 250 for i in range(250)]
    with engine:
        long = engine.generate(long_prompt, options(20))
        engine.generate(list(range(100, 110)), options(4))  # parks the long one, trims
        assert len(engine.conversations) == 1 and engine.kv.mapped_cells < 250
        follow = long_prompt + long.tokens[:-1] + [7]
        # The restore cannot grow the K/V: nothing left to give, no free budget.
        table = engine.cache.table
        floor = table.floor
        table.set_regions(floor=table.top)
        with pytest.raises(Exception, match="K/V cells"):
            engine.generate(follow, options(4))
        assert engine.conversations.best(follow)[1] == len(follow) - 1  # still parked
        table.set_regions(floor=floor)
        table.validate()
        # A policy that raises: a PolicyError naming it, then the engine serves on.
        policy.failing = True
        with pytest.raises(Exception, match="failing-target"):
            engine.generate(follow, options(4))
        policy.failing = False
        assert engine.conversations.best(follow)[1] == len(follow) - 1
        result = engine.generate(follow, options(4))
        assert result.reused_tokens == len(follow) - 1 and "Restored" in _kinds(log)
        table.validate()


def test_a_park_that_fails_loses_neither_the_live_nor_the_parked_conversations(ckpt, rank):
    engine, log = _engine(ckpt, rank)
    first = [3 + i % 250 for i in range(60)]
    with engine:
        answer = engine.generate(first, options(4))
        engine.generate(list(range(100, 110)), options(4))  # parks the first conversation
        live, parked = list(engine.live), engine.conversations.entries()
        follow = first + answer.tokens[:-1] + [7]
        for prompt in (follow, list(range(200, 210))):  # with a restore taken out, without
            _vmm.inject_pages_fault("map")  # the live conversation's pages
            with pytest.raises(_vmm.VmmError, match="injected fault in the host pages' map"):
                engine.generate(prompt, options(4))
            assert engine.live == live and engine.conversations.entries() == parked
        since = len(log.seen)
        result = engine.generate(follow, options(4))
        assert result.reused_tokens == len(follow) - 1
        assert _kinds(log, since).count("Parked") == 1 and "Restored" in _kinds(log, since)


def test_an_engine_from_the_user_s_options(ckpt, tmp_path):
    from strata.engine.runtime.options import CacheOptions, EngineOptions
    from strata.formats.profile import Profile, save_profile

    cfg = ModelConfig.from_dir(ckpt)
    counts = np.random.default_rng(3).integers(1, 500, (cfg.n_layers, cfg.n_experts))
    save_profile(Profile.for_model(counts, cfg, {}), tmp_path / "p.npz")
    user = EngineOptions(max_context=WINDOW, prefill_chunk=32, conversation_cache_mib=4.0,
                            conversation_cache_slots=2,
                            cache=CacheOptions(expert_cache_mib=0.5, policy="lru",
                                               expert_profile=str(tmp_path / "p.npz")))
    with Engine.from_options(ckpt, user) as engine:
        assert engine.cache is not None and engine.cache.checked.name == "lru"
        assert engine.cache.arena.n_slots < cfg.n_layers * cfg.n_experts
        result = engine.generate(list(range(3, 40)), options(8))
        assert len(result.tokens) == 8 and result.cache.lookups > 0
    # Every value is checked before anything loads, the flag named.
    with pytest.raises(ValueError, match="--cpu-threads must be >= 1"):
        CacheOptions(cpu_threads=0)
    with pytest.raises(ValueError, match=r"--expert-profile .*nope\.npz"):
        Engine.from_options(ckpt, EngineOptions(cache=CacheOptions(
            expert_profile=str(tmp_path / "nope.npz"))))
    with pytest.raises(ValueError, match="conversation_cache_mib"):
        EngineOptions(conversation_cache_mib=-1.0)
