"""The prompt loan on the host backend with tiny caches: it lends, streams, refills, agrees."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from strata import _vmm
from strata._residency import ResidencyTable
from strata.books import CheckedPolicy
from strata.engine.cache.arena import Arena, slot_bytes_for
from strata.engine.cache.cached_experts import CachedExperts
from strata.engine.cache.loan import (
    DEFAULT_KEEP_SLOTS,
    KEEP_SLOTS_ENV,
    MIN_BATCH_EXPERTS,
    LoanOptions,
    PromptLoan,
    _reuses,
    loan_slots,
    upload_plan,
)
from strata.engine.experts.routed import Routed
from strata.engine.kv.kv_cache import new_kv
from strata.engine.model.checkpoint import Checkpoint, expert_store
from strata.engine.model.config import ModelConfig
from strata.engine.model.moe import load_model
from strata.engine.runtime.load import load
from strata.policies import Policy, PolicyError
from strata.policies.registry import load_registry
from support.checkpoints import cached_checkpoint, store_of

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
                  dtype=store.dtype, quant=store.quant)
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
    # Every batch's upload is timed (on the host it is complete when queued): seconds where
    # bytes went up.
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


@given(st.integers(0, 300), st.integers(1, 200), st.integers(1, 9))
def test_the_upload_plan_covers_the_misses_and_orders_reused_slots(n_experts, n_slots,
                                                                   batches):
    plan = upload_plan(n_experts, n_slots, batches)
    # The misses in order, each once, each batch in lent slots.
    assert [b0 for b0, _, _ in plan] == [0, *(b1 for _, b1, _ in plan[:-1])][:len(plan)]
    assert (plan[-1][1] if plan else 0) == n_experts
    for b0, b1, first in plan:
        assert b1 > b0 and first >= 0 and first + (b1 - b0) <= n_slots
    if n_experts <= n_slots:  # distinct slots, expert i in slot i; at most `batches` of them
        assert all(first == b0 for b0, _, first in plan)
        assert len(plan) <= batches
        assert all(b1 - b0 >= min(n_experts, MIN_BATCH_EXPERTS) for b0, b1, _ in plan[:-1])
    else:  # halves of the slots, or all of them, taken in turn
        size = n_slots // 2 if batches > 1 and n_slots > 1 else n_slots
        assert all(b1 - b0 == size for b0, b1, _ in plan[:-1])
    for b in range(len(plan)):  # the batch each upload waits for, against every earlier one
        b0, b1, first = plan[b]
        overlapping = [e for e in range(b) if set(range(first, first + b1 - b0))
                       & set(range(plan[e][2], plan[e][2] + plan[e][1] - plan[e][0]))]
        assert _reuses(plan, b) == (overlapping[-1] if overlapping else -1)


def test_upload_plan_refuses_what_cannot_be_planned():
    with pytest.raises(ValueError, match="batches must be >= 1, got 0"):
        upload_plan(4, 4, 0)
    with pytest.raises(ValueError, match="4 experts need a lent slot, there are none"):
        upload_plan(4, 0, 2)
    assert upload_plan(0, 0, 1) == []


@pytest.mark.parametrize("n_slots", [12, 20], ids=["halves", "distinct"])
def test_pipelined_uploads_give_the_bytes_books_and_counts_of_one_batch(setup, n_slots):
    """The loan's upload batches change when the bytes arrive, not what is computed: with
    fewer lent slots than misses (halves taken in turn) and with more (distinct slots), 1, 2
    and 4 batches give the same logits, books and counts."""
    model, store = setup
    runs = []
    for batches in (1, 2, 4):
        cached = _cache(store, n_slots, short_read=8, keep_slots=4, upload_batches=batches)
        try:
            logits = _prefill(model, cached)
            stats = cached.stats.prompt
            runs.append((logits, cached.table.owner.copy(), stats.loan_experts,
                         stats.uploaded_bytes, stats.hits))
        finally:
            cached.close()
    for logits, owner, *counts in runs[1:]:
        assert torch.equal(logits, runs[0][0])
        assert (owner == runs[0][1]).all() and counts == list(runs[0][2:])
    assert runs[0][2] > 0


def test_a_loaned_layer_queues_its_first_blobs_then_its_indexes_then_the_rest_then_its_hits(
        setup, monkeypatch):
    """A loaned layer queues its first upload batch as soon as it knows which experts it
    misses (the copy engine idles from the routing's read until then), then sends the rows,
    the hits' index and the loan's (every batch's, in one copy; pinned, so the host does not
    wait for the blobs ahead of them), then queues the loan's other batches, and only then
    launches the hits' kernels: a copy queued behind all the blobs would wait for all of them
    (and every kernel behind it). The test fails on every earlier order: blobs, blobs, index,
    index; the hits' index and kernels before the loan's blobs; every index before any blob."""
    from strata.engine.cache import from_slots, routed_call
    from strata.engine.experts import routed

    model, store = setup
    cached = _cache(store, 20, short_read=8, keep_slots=4, upload_batches=4)
    order, layers = [], []
    real_index, real_upload = from_slots.to_device_async, cached.loan.executor.upload_queued
    real_rows = routed.to_device_async
    real_compute, real_issue = routed_call.compute_from_slots, routed_call._issue_device_share
    real_start = routed_call._queue_loan_start
    monkeypatch.setattr(from_slots, "to_device_async",
                        lambda host, device: order.append("index") or real_index(host, device))
    monkeypatch.setattr(routed, "to_device_async",
                        lambda host, device: order.append("rows") or real_rows(host, device))
    monkeypatch.setattr(cached.loan.executor, "upload_queued",
                        lambda *args: order.append("blobs") or real_upload(*args))
    monkeypatch.setattr(routed_call, "compute_from_slots",
                        lambda *a, **kw: order.append("hits") or real_compute(*a, **kw))

    def start(*args):
        order.clear()
        return real_start(*args)

    def issue(*args):
        result = real_issue(*args)
        layers.append(list(order))
        return result

    monkeypatch.setattr(routed_call, "_queue_loan_start", start)
    monkeypatch.setattr(routed_call, "_issue_device_share", issue)
    try:
        _prefill(model, cached)
    finally:
        cached.close()
    loaned = [calls for calls in layers if "blobs" in calls]
    assert loaned and any("hits" in calls for calls in loaned), layers
    assert any(calls.count("blobs") > 1 for calls in loaned), layers  # batches, pipelined
    for calls in loaned:
        hits = calls.count("hits")  # the hits' compute: one call, its index uploaded before
        n_blobs = calls.count("blobs")
        assert calls == ["blobs", "rows"] + ["index"] * (1 + hits) + \
            ["blobs"] * (n_blobs - 1) + ["hits"] * hits, calls


def test_the_loans_rows_must_follow_the_experts_it_queued_first(setup):
    """`queue_misses` refuses a first batch queued for other experts or another layer, or
    given its rows already, and `compute_queued` a layer whose rows it was never given,
    naming what is wrong; the right rows after a refusal still compute."""
    _, store = setup
    cached = _cache(store, 20, short_read=8, keep_slots=4, upload_batches=4)
    try:
        loan = cached.loan
        assert loan.begin_pass(64, "prompt")
        x = torch.randn(4, store.hidden_size, dtype=store.dtype)
        ids = np.array([[0, 1], [2, 1], [0, 3], [3, 2]])
        misses = Routed.of(ids)
        job = loan.queue_first(0, x, misses.experts)
        with pytest.raises(ValueError, match="never given their rows"):
            loan.compute_queued(job)
        with pytest.raises(ValueError, match=r"not the ones queued first \(layer 0"):
            loan.queue_misses(0, x, Routed.of(ids[:2]), job)
        with pytest.raises(ValueError, match="not the ones queued first"):
            loan.queue_misses(1, x, misses, job)
        rows = loan.compute_queued(loan.queue_misses(0, x, misses, job))
        with pytest.raises(ValueError, match="given their rows already"):
            loan.queue_misses(0, x, misses, job)
        assert torch.equal(rows, loan.compute_misses(0, x, misses))
    finally:
        cached.close()


def test_a_quantized_loan_batch_fits_one_dequantization_batch(monkeypatch):
    """With quantized slots no upload batch holds more experts than `BlobStack.batch_blobs`
    (each batch is then one set of dequantization launches), whatever `upload_batches` asks;
    the logits are those of one batch a layer."""
    from strata.engine.cache import loan as loan_module
    from strata.engine.experts.blobs import BlobStack

    ckpt = cached_checkpoint("qwen3_moe", "small", dtype=torch.float32)
    model, store = load_model(ckpt), store_of(ckpt, quant="int8")
    monkeypatch.setattr(loan_module, "MIN_BATCH_EXPERTS", 1)
    monkeypatch.setattr(BlobStack, "batch_blobs", lambda self: 3)
    runs = []
    for batches in (1, 2):
        cached = _cache(store, 20, short_read=8, keep_slots=4, upload_batches=batches)
        sizes, real_upload = [], cached.loan.executor.upload_queued
        monkeypatch.setattr(cached.loan.executor, "upload_queued",
                            lambda slots, *args, sizes=sizes, real=real_upload: (
                                sizes.append(len(slots)), real(slots, *args))[1])
        try:
            runs.append(_prefill(model, cached))
        finally:
            cached.close()
    assert sizes and max(sizes) == 3, sizes  # 2 batches asked, of up to 8 misses each
    assert torch.equal(runs[1], runs[0])


def test_a_failed_upload_mid_layer_leaves_the_books_and_the_loan_usable(setup, monkeypatch):
    """Fault injection: the third queued upload of a pass raises. The error reaches the
    caller, the books hold what they held (the loan's uploads are bytes only), the lent slots
    stay empty in them, and the request's end gives the loan back: the next prefill through
    the same cache agrees with the resident model."""
    model, store = setup
    cached = _cache(store, 12, short_read=8, keep_slots=4, upload_batches=4)
    try:
        real, calls = cached.loan.executor.upload_queued, []

        def failing(slots, experts, after):
            calls.append(len(slots))
            if len(calls) == 3:
                raise RuntimeError("injected: the copy failed")
            return real(slots, experts, after)

        monkeypatch.setattr(cached.loan.executor, "upload_queued", failing)
        owner_before = cached.table.owner.copy()
        with pytest.raises(RuntimeError, match="injected: the copy failed"):
            _prefill(model, cached)
        cached.table.validate()
        assert cached.loan.active and (cached.table.owner[cached.loan.lent] < 0).all()
        lent = cached.loan.lent
        kept = np.setdiff1d(np.arange(cached.table.n_slots), lent)
        assert (cached.table.owner[kept] == owner_before[kept]).all()
        _blobs_match_books(cached)
        monkeypatch.setattr(cached.loan.executor, "upload_queued", real)
        cached.end_request()
        assert not cached.loan.active
        _blobs_match_books(cached)
        fp32 = store.dtype == torch.float32
        tol = {"rtol": 1e-5, "atol": 1e-5} if fp32 else {"rtol": 0.02, "atol": 0.02}
        torch.testing.assert_close(_prefill(model, cached), _reference(model), **tol)
    finally:
        cached.close()


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
