"""The prompt loan on the host backend with tiny caches: it lends, streams, refills, agrees."""

import numpy as np
import pytest
import torch

from strata import _vmm
from strata._residency import ResidencyTable
from strata.books import CheckedPolicy
from strata.engine.cache.arena import Arena, slot_bytes_for
from strata.engine.cache.cached_experts import CachedExperts
from strata.engine.cache.loan import (
    DEFAULT_KEEP_SLOTS,
    KEEP_SLOTS_ENV,
    LoanOptions,
    PromptLoan,
    loan_slots,
)
from strata.engine.experts.routed import Routed
from strata.engine.kv.kv_cache import new_kv
from strata.engine.model.checkpoint import Checkpoint, expert_store
from strata.engine.model.config import ModelConfig
from strata.engine.model.moe import load_model
from strata.engine.runtime.load import load
from strata.policies import Policy, PolicyError
from strata.policies.registry import load_registry
from support.checkpoints import cached_checkpoint

CHUNK_BYTES = 65536
PROMPT = torch.arange(3, 63)  # 60 tokens: one pass routes to every expert of the tiny model


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def setup(request):
    """(model with every expert resident, its expert store), in one dtype."""
    ckpt = cached_checkpoint("qwen3_moe", "small", dtype=request.param)  # L=4, E=16, K=4
    model = load_model(ckpt)
    ckpt_file = Checkpoint.open(ckpt)
    try:
        store = expert_store(ckpt_file)
    finally:
        ckpt_file.close()
    return model, store


def _cache(store, n_slots, policy="coldest-in-loan", **loan):
    """A filled cache of `n_slots`; with `loan` options (LoanOptions'), its prompt loan."""
    slot_bytes = slot_bytes_for(store.blob_bytes)
    table = ResidencyTable(store.n_layers, store.n_experts, n_slots, slot_bytes, CHUNK_BYTES)
    arena = Arena(_vmm.HostBackend(CHUNK_BYTES), n_slots, slot_bytes,
                  hidden_size=store.hidden_size, expert_width=store.expert_width,
                  dtype=store.dtype)
    policy = policy if isinstance(policy, Policy) else load_registry().create(policy)
    cached = CachedExperts(store, arena, table, CheckedPolicy(policy, table), "cpu",
                           loan=LoanOptions(**loan) if loan else None)
    cached.fill_hottest()
    return cached


def _prefill(model, cached, prompt=PROMPT, chunk=None):
    """Logits [T, V] of the prompt read through `cached` in passes of `chunk` tokens; the
    prompt phase is left open (the loan, if any, still lent)."""
    resident, model.experts = model.experts, cached
    try:
        cached.begin_request()
        with new_kv(model, len(prompt)) as kv:
            chunk = chunk or len(prompt)
            return torch.cat([model.forward(prompt[i:i + chunk], i, kv)
                              for i in range(0, len(prompt), chunk)])
    finally:
        model.experts = resident


def _blobs_match_books(cached):
    """Every resident slot holds its expert's blob, byte for byte."""
    table, view = cached.table, cached.arena.slots_view()
    for slot in np.flatnonzero(table.owner >= 0):
        layer, expert = divmod(int(table.owner[slot]), table.n_experts)
        blob = cached.store.blob(layer, expert)
        assert torch.equal(view[slot, : blob.numel()], blob), f"slot {slot}"


def _reference(model, prompt=PROMPT):
    with new_kv(model, len(prompt)) as kv:
        return model.forward(prompt, 0, kv)


def test_loan_slots_arithmetic():
    assert loan_slots(300, 64, 128, 0.85) == 64  # E binds: a layer never needs more
    assert loan_slots(150, 64, 128, 0.85) == 22  # the kept 128 bind
    assert loan_slots(100, 64, 128, 0.85) == 0  # too small a cache: no loan
    assert loan_slots(10, 64, 0, 0.85) == 8  # 85% binds
    assert loan_slots(10, 64, 0, 0.85, floor=5) == 5  # the floor stays below
    assert loan_slots(0, 64, 0, 0.85) == 0


def test_the_loan_path_agrees_with_the_cpu_path_and_the_resident_model(setup):
    model, store = setup
    exact = _reference(model)
    # CPU rounding: fp32 agrees to float32 noise (here it is even bit-equal), bf16 to its
    # 8-bit mantissa through 4 layers.
    fp32 = store.dtype == torch.float32
    tol = {"rtol": 1e-5, "atol": 1e-5} if fp32 else {"rtol": 0.02, "atol": 0.02}
    lent = _cache(store, 12, short_read=8, keep_slots=4)  # lends min(10, 8, 16) = 8
    cpu = _cache(store, 12)
    with_loan, without = _prefill(model, lent), _prefill(model, cpu)
    stats, cpu_stats = lent.stats.prompt, cpu.stats.prompt
    assert lent.stats.lent_slots == 8 and lent.loan.loans == 1
    assert stats.cpu_experts == 0 and stats.loan_experts > 8  # streamed in batches of 8
    # Every batch's upload is timed (the host waits for it): seconds where bytes went up.
    assert stats.uploaded_bytes > 0 and stats.upload_s > 0
    assert (cpu_stats.upload_s > 0) == (cpu_stats.uploaded_bytes > 0)
    assert cpu_stats.loan_experts == 0 and cpu_stats.lookups == stats.lookups
    # The lent slots' residents are misses during the loan: more misses, fewer hits.
    assert stats.loan_experts > cpu_stats.cpu_experts and stats.hits < cpu_stats.hits
    torch.testing.assert_close(with_loan, without, **tol)
    torch.testing.assert_close(with_loan, exact, **tol)
    assert with_loan.argmax(-1).tolist() == without.argmax(-1).tolist()
    lent.close()
    cpu.close()


def test_lend_then_refill_keeps_books_and_bytes_in_agreement(setup):
    model, store = setup
    # lru admits misses: they must stay below top
    cached = _cache(store, 12, policy="lru", short_read=8, keep_slots=4)
    loan = cached.loan
    before = cached.table.owner.copy()
    _prefill(model, cached, chunk=20)  # three long passes share one loan
    assert loan.active and loan.loans == 1 and cached.table.top == 4
    assert loan.lent.tolist() == list(range(4, 12))
    assert (cached.table.owner[4:] == -1).all()  # nothing admitted into a lent slot
    assert cached.stats.prompt.passes == 3
    uploaded = cached.stats.prompt.uploaded_bytes
    cached.set_phase("decode")  # the prompt ends: refill, top back
    assert not loan.active and cached.table.top == 12
    assert (cached.table.owner >= 0).all()  # every lent slot refilled
    assert cached.stats.prompt.uploaded_bytes == uploaded + 8 * store.blob_bytes
    # Refilled by the policy's default: the hottest missing experts by the books' heat.
    heat_order = np.lexsort((cached.table.rank.reshape(-1), -cached.table.heat.reshape(-1)))
    refilled = np.sort(cached.table.owner[4:])
    resident_low = set(cached.table.owner[:4].tolist())
    hottest_missing = [f for f in heat_order.tolist() if f not in resident_low][:8]
    assert refilled.tolist() == sorted(hottest_missing)
    cached.table.validate()
    _blobs_match_books(cached)
    assert np.array_equal(cached.mirror.numpy(), cached.table.res)
    assert not np.array_equal(before, cached.table.owner)
    cached.close()


def test_short_passes_and_decode_do_not_borrow(setup):
    model, store = setup
    cached = _cache(store, 12, short_read=8, keep_slots=4)
    loan = cached.loan
    _prefill(model, cached, prompt=PROMPT[:8])  # 8 tokens: not longer than short_read
    assert not loan.active and cached.stats.lent_slots == 0
    assert cached.stats.prompt.cpu_experts > 0 and cached.stats.prompt.loan_experts == 0
    assert not loan.begin_pass(100, "decode")
    stats = cached.end_request()
    assert stats.lent_slots == 0 and cached.table.top == 12
    cached.close()


def test_a_cache_too_small_to_lend_reads_on_the_cpu(setup):
    model, store = setup
    cached = _cache(store, 6, short_read=8)  # keeps 128 > 6 slots
    loan = cached.loan
    assert loan.options.keep_slots == DEFAULT_KEEP_SLOTS
    out = _prefill(model, cached)
    assert not loan.active and cached.stats.prompt.cpu_experts > 0
    torch.testing.assert_close(out, _reference(model), rtol=0.02, atol=0.02)
    cached.close()


def test_a_request_that_ends_in_the_prompt_gives_the_loan_back(setup):
    model, store = setup
    cached = _cache(store, 12, short_read=8, keep_slots=4)
    _prefill(model, cached)
    assert cached.loan.active
    stats = cached.end_request()
    assert stats.lent_slots == 8 and not cached.loan.active and cached.table.top == 12
    cached.table.validate()
    _blobs_match_books(cached)
    cached.close()


def test_a_lent_slot_filled_behind_the_loans_back_is_refused(setup):
    model, store = setup
    cached = _cache(store, 12, short_read=8, keep_slots=4)
    loan = cached.loan
    _prefill(model, cached)
    missing = np.flatnonzero(cached.table.res.reshape(-1) < 0)[0]
    cached.table.assign(int(loan.lent[3]), *divmod(int(missing), store.n_experts))
    x = torch.zeros(1, store.hidden_size, dtype=store.dtype)
    misses = Routed.of(np.array([[0, 1, 2, 3]]))
    with pytest.raises(RuntimeError, match=rf"lent slots \[{loan.lent[3]}\] hold experts"):
        loan.compute_misses(0, x, misses)
    cached.close()


class BadRefill(Policy):
    """Refills a slot that was not offered."""

    name = "bad-refill"

    def refill(self, view, free_slots):
        return [(0, 0, 0)]


def test_a_bad_refill_is_refused_and_the_cache_carries_on(setup):
    model, store = setup
    cached = _cache(store, 12, policy=BadRefill(), short_read=8, keep_slots=4)
    _prefill(model, cached)
    with pytest.raises(PolicyError, match=r"bad-refill.*slot 0, which was not offered"):
        cached.set_phase("decode")
    # The books are whole: top is back, the lent slots empty, the mirror current.
    assert cached.table.top == 12 and (cached.table.owner[4:] == -1).all()
    assert not cached.loan.active
    cached.table.validate()
    assert np.array_equal(cached.mirror.numpy(), cached.table.res)
    cached.close()


def test_keep_slots_from_the_environment(setup, monkeypatch):
    _, store = setup
    cached = _cache(store, 4)
    monkeypatch.setenv(KEEP_SLOTS_ENV, "3")
    assert LoanOptions().keep_slots == 3
    assert LoanOptions(keep_slots=1).keep_slots == 1  # the argument wins
    monkeypatch.setenv(KEEP_SLOTS_ENV, "lots")
    with pytest.raises(ValueError, match=f"{KEEP_SLOTS_ENV}='lots': want an integer >= 0"):
        LoanOptions()
    cached.close()


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"short_read": 0}, "short_read must be an int >= 1, got 0"),
        ({"keep_slots": -1}, "keep_slots must be an int >= 0, got -1"),
        ({"max_fraction": 1.5}, r"max_fraction must be in \[0, 1\], got 1.5"),
    ],
)
def test_bad_options_are_refused(setup, kwargs, message):
    _, store = setup
    cached = _cache(store, 4)
    with pytest.raises(ValueError, match=message):
        LoanOptions(**kwargs)
    loan = PromptLoan(cached.executor, cached.checked, LoanOptions())
    with pytest.raises(ValueError, match="no loan is open"):
        loan.compute_misses(0, torch.zeros(1, 4), None)
    cached.close()


def test_generate_with_the_loan_agrees_with_generate_without(monkeypatch):
    """Through `load(cache=...).model` and `generate`: the loan is built by the cache's config
    (keeping STRATA_LOAN_KEEP_SLOTS slots), lends for the long prompt and gives back."""
    from strata.engine.cache.budget import MIB, CacheBudget
    from strata.engine.cache.build import CacheConfig
    from strata.engine.runtime.generate import GenerateOptions, generate

    monkeypatch.setenv(KEEP_SLOTS_ENV, "6")
    ckpt = cached_checkpoint("qwen3_moe", "small", dtype=torch.float32)
    cfg = ModelConfig.from_dir(ckpt)
    slot_bytes = slot_bytes_for(3 * cfg.expert_width * cfg.hidden_size * 4)
    results = {}
    for loan in (True, False):
        budget = CacheBudget(budget_bytes=1 << 40, reserve_bytes=0, dense_bytes=0, kv_bytes=0,
                             workspace_bytes=0, slot_bytes=slot_bytes, chunk_bytes=CHUNK_BYTES,
                             total_experts=64, expert_cache_mib=20 * slot_bytes / MIB)
        config = CacheConfig(budget=budget, backend=_vmm.HostBackend(CHUNK_BYTES),
                             prefill_loan=loan, short_read=16)
        model = load(ckpt, cache=config).model
        assert isinstance(model.experts.loan, PromptLoan) == loan
        options = GenerateOptions(max_new=8, temperature=0, prefill_chunk=32, ignore_stop=True)
        results[loan] = generate(model, None, list(range(40, 110)), options)
        model.experts.table.validate()
        assert model.experts.table.top == 20
        _blobs_match_books(model.experts)
        model.experts.close()
    lent, cpu = results[True], results[False]
    assert lent.cache.lent_slots == 14  # min(floor(0.85 * 20), 20 - 6, 16)
    # Passes of 32, 32 and 6 tokens: the two long ones stream, the short one goes to the CPU.
    assert lent.cache.prompt.loan_experts > 0 and lent.cache.prompt.passes == 3
    assert lent.cache.prompt.cpu_experts > 0
    assert cpu.cache.lent_slots == 0 and cpu.cache.prompt.loan_experts == 0
    assert lent.tokens == cpu.tokens
    torch.testing.assert_close(lent.first_logits, cpu.first_logits, rtol=1e-5, atol=1e-5)


def test_the_command_line_lends_and_no_prefill_loan_does_not(monkeypatch, capsys):
    """`strata generate` with a small cache: the long prompt borrows (STRATA_LOAN_KEEP_SLOTS
    lets a tiny cache lend), `--no-prefill-loan` sends its misses to the CPU, the tokens agree."""
    import json

    from strata.cli.main import main

    monkeypatch.setenv(KEEP_SLOTS_ENV, "2")
    ckpt = cached_checkpoint("qwen3_moe", "small", dtype=torch.float32)
    runs = {}
    for flags in ([], ["--no-prefill-loan"]):
        status = main(["generate", "--model", str(ckpt), "--device", "cpu", "--temperature",
                       "0", "--max-new", "6", "--expert-cache", "8", "--short-read", "16",
                       "--json", *flags, "A prompt long enough to take the loan, surely."])
        out, err = capsys.readouterr()
        assert status == 0, err
        runs[bool(flags)] = json.loads(out)
    lent, cpu = runs[False], runs[True]
    slots = lent["cache"]["slots"]
    assert lent["cache"]["lent_slots"] == min(int(0.85 * slots), slots - 2, 16) > 0
    assert lent["cache"]["prompt"]["loan_experts"] > 0
    assert lent["cache"]["prompt"]["cpu_experts"] == 0
    assert cpu["cache"]["lent_slots"] == 0 and cpu["cache"]["prompt"]["loan_experts"] == 0
    assert lent["tokens"] == cpu["tokens"]
