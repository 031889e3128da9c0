"""A one-token call's own path (`strata.engine.cache.token_call`) against the general one
(`routed_call.routed_forward`), and the call split around piecewise graphs
(`strata.engine.cache.graph_call`) against the token path, byte for byte: the same outputs,
books, stats and admissions, at every hit rate, with streamed misses, observing and admitting
policies, and repeated experts."""

import gc
import weakref

import pytest
import torch

from strata import _cpu_experts, _vmm
from strata._residency import ResidencyTable
from strata.books import CheckedPolicy
from strata.engine.cache import graph_call
from strata.engine.cache.arena import Arena, slot_bytes_for
from strata.engine.cache.cached_experts import CachedExperts
from strata.engine.experts.cpu import CpuExperts
from strata.engine.model.layers import route
from strata.policies import load_registry
from support.cache_models import CHUNK_BYTES
from support.checkpoints import cached_checkpoint, store_of
from support.token_calls import (
    DTYPES,
    books,
    bytes_of,
    counts,
    make_cache,
    small_store,
    split_call,
    token_calls,
)

# (dtype, cached share, policy, --stream-misses, ids drawn with repeats): mixed, empty and full
# caches, streamed misses, observing (lru) and admitting (sieve) policies. Streamed misses
# are one row an expert, so they meet no repeats (routing never repeats an expert).
CASES = [
    ("fp32", 0.5, "coldest-in-loan", 0, False), ("bf16", 0.5, "coldest-in-loan", 0, False),
    ("fp32", 0.5, "coldest-in-loan", 2, False), ("bf16", 0.5, "coldest-in-loan", 2, False),
    ("bf16", 0.0, "coldest-in-loan", 0, False), ("bf16", 0.0, "coldest-in-loan", 2, False),
    ("bf16", 1.0, "lru", 0, False), ("fp32", 0.5, "lru", 0, False),
    ("bf16", 0.5, "sieve", 1, False), ("fp32", 0.5, "sieve", 0, True),
    ("bf16", 0.5, "coldest-in-loan", 0, True), ("fp32", 0.0, "lru", 0, True),
    ("fp32", 1.0, "coldest-in-loan", 0, False),  # every expert resident: device-only calls
    ("bf16", 1.0, "coldest-in-loan", 2, False),  # the same with a stage map (never used)
]


@pytest.mark.parametrize("dtype,share,policy,stream,repeats", CASES,
                         ids=["-".join(str(v) for v in case) for case in CASES])
def test_the_token_path_gives_the_general_pathsbytes(dtype, share, policy, stream, repeats):
    _same_bytes(small_store(DTYPES[dtype]), share, policy, stream, repeats, "cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,share,policy,stream,repeats", CASES[:4] + CASES[6:9],
                         ids=["-".join(str(v) for v in case) for case in CASES[:4] + CASES[6:9]])
def test_the_token_path_gives_the_general_paths_bytes_on_cuda(dtype, share, policy, stream,
                                                               repeats):
    """The same on CUDA: pinned index uploads, the hits' kernels, the CPU's rows uploaded."""
    store = store_of(cached_checkpoint("qwen3_moe", "small", dtype=DTYPES[dtype]),
                     pin_memory=True)
    _same_bytes(store, share, policy, stream, repeats, "cuda")


@pytest.mark.parametrize("dtype,share,policy,stream,repeats", CASES,
                         ids=["-".join(str(v) for v in case) for case in CASES])
def test_a_call_split_around_the_graphs_gives_the_token_pathsbytes(dtype, share, policy,
                                                                     stream, repeats):
    _same_bytes(small_store(DTYPES[dtype]), share, policy, stream, repeats, "cpu", split=True)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,share,policy,stream,repeats", CASES[:4] + CASES[6:9],
                         ids=["-".join(str(v) for v in case) for case in CASES[:4] + CASES[6:9]])
def test_a_call_split_around_the_graphs_gives_the_token_paths_bytes_on_cuda(
        dtype, share, policy, stream, repeats):
    """On CUDA the resident rows are the Triton kernels' over every K row, a missing expert's
    row left unwritten (its slot -1 reads nothing), then written by the host."""
    store = store_of(cached_checkpoint("qwen3_moe", "small", dtype=DTYPES[dtype]),
                     pin_memory=True)
    _same_bytes(store, share, policy, stream, repeats, "cuda", split=True)


@pytest.mark.parametrize("split", [False, True], ids=["token", "split"])
def test_waking_the_cpu_threads_before_the_routing_read_changes_no_byte(split, monkeypatch):
    """`CachedExperts.wake_cpu`: each decode call starts the CPU kernel's threads once, before
    its routing read; the bytes, books and counts are those of the calls without it."""
    woken = []
    wake = CpuExperts.wake
    monkeypatch.setattr(CpuExperts, "wake", lambda cpu: woken.append(1) or wake(cpu))
    _same_bytes(small_store(torch.bfloat16), 0.5, "sieve", 1, False, "cpu", split=split,
                wake_cpu=True)
    assert len(woken) == 32


@pytest.mark.parametrize("dtype,share,policy,stream,repeats", CASES,
                         ids=["-".join(str(v) for v in case) for case in CASES])
def test_a_split_call_with_its_cpu_misses_on_their_own_thread_gives_the_same_bytes(
        dtype, share, policy, stream, repeats, monkeypatch):
    """`CachedExperts.async_cpu`: a split call's CPU misses start on the CPU's own thread right
    after the routing read and are waited for after the uploads; the bytes, books and counts
    are the token path's. bf16's decode misses take that thread; fp32's (torch's matmuls), and
    an expert of more rows than the kernel takes, do not and are computed as before."""
    started = []
    start = CpuExperts.start
    monkeypatch.setattr(CpuExperts, "start",
                        lambda cpu, *args: started.append(start(cpu, *args)) or started[-1])
    _same_bytes(small_store(DTYPES[dtype]), share, policy, stream, repeats, "cpu", split=True,
                async_cpu=True)
    # (With repeated ids an expert may have more rows than the kernel takes: computed now.)
    assert any(started) == (dtype == "bf16" and share < 1.0)
    assert all(started) or dtype == "fp32" or repeats


def _async_caches(share, stream):
    """A bf16 store, and over it a general-path cache and a token-path one whose split calls
    run their CPU misses on the CPU's own thread (`async_cpu`), `share` of the experts cached
    and `stream` misses a call streamed (sieve)."""
    store = small_store(torch.bfloat16)
    n_slots = round(share * store.n_layers * store.n_experts)
    general = make_cache(store, n_slots, "sieve", stream, token_path=True, device="cpu")
    token = make_cache(store, n_slots, "sieve", stream, token_path=True, device="cpu")
    token.async_cpu = True
    return store, general, token


def test_a_split_call_with_the_cpu_team_kept_up_between_calls_gives_the_same_bytes():
    """`CpuExperts.keep_team_up` with the CPU's own thread: the team spins between the calls
    and the bytes, books and counts stay the token path's."""
    store, general, token = _async_caches(0.5, 1)
    token.cpu.keep_team_up = True
    for call in token_calls(store, 32, seed=3, repeats=False, device="cpu"):
        expected = general.forward(*call)
        assert bytes_of(split_call(token, *call)) == bytes_of(expected)
        assert books(token) == books(general)
    assert token.cpu._worker is not None and token.cpu._worker.keep_team_up
    assert counts(token) == counts(general)


@pytest.mark.parametrize("schedule", ["dynamic", "steal", "steal-alone"])
def test_the_cpu_s_tasks_and_those_the_engine_thread_ran_are_counted(schedule):
    """Split calls with their CPU misses on the CPU's own thread: `cpu_tasks` counts the
    kernel's tasks of those calls (`CpuExperts.tasks`), `cpu_waiter_tasks` the ones the engine's
    thread ran while it waited (under "steal" only, and none with `caller_helps` off); the
    bytes stay the token path's."""
    store, general, token = _async_caches(0.25, 0)
    token.cpu.schedule = schedule.removesuffix("-alone")
    token.cpu.caller_helps = schedule != "steal-alone"
    for call in token_calls(store, 32, seed=4, repeats=False, device="cpu"):
        assert bytes_of(split_call(token, *call)) == bytes_of(general.forward(*call))
    stats = token.stats.decode
    blocks = -(-store.expert_width // 16) \
        - (-store.hidden_size // _cpu_experts.DOWN_BLOCK_ROWS)  # F and D in tasks
    assert stats.cpu_experts > 0 and stats.cpu_tasks == stats.cpu_experts * blocks
    assert general.stats.decode.cpu_tasks == 0  # computed on the engine's thread: not counted
    if schedule == "steal":
        assert 0 <= stats.cpu_waiter_tasks <= stats.cpu_tasks
    else:
        assert stats.cpu_waiter_tasks == 0
    # Where the CPU's time went: its hand-over, its runs (the team up within them) and their
    # notice, all within the CPU's time from each start to each finish.
    assert stats.cpu_run_s > 0
    assert 0 <= stats.cpu_team_up_s <= stats.cpu_run_s
    assert 0 < stats.cpu_pass1_s <= stats.cpu_run_s
    assert stats.cpu_hand_over_s >= 0 and stats.cpu_noticed_s >= 0
    assert stats.cpu_hand_over_s + stats.cpu_run_s + stats.cpu_noticed_s <= stats.cpu_s
    assert general.stats.decode.cpu_run_s == 0  # the engine's own thread: no parts


@pytest.mark.cuda
@pytest.mark.parametrize("share,stream", [(0.5, 0), (0.5, 2), (0.0, 2)],
                         ids=["half-0", "half-2", "empty-2"])
def test_a_split_call_with_its_cpu_misses_on_their_own_thread_gives_the_same_bytes_on_cuda(
        share, stream):
    """The same on CUDA: the CPU's thread computes while this one queues the uploads, the
    stage map and the CPU rows' copy on the device's stream."""
    store = store_of(cached_checkpoint("qwen3_moe", "small", dtype=torch.bfloat16),
                     pin_memory=True)
    _same_bytes(store, share, "coldest-in-loan", stream, False, "cuda", split=True,
                async_cpu=True)


@pytest.mark.parametrize("share,stream", [(0.25, 0), (0.5, 1), (0.0, 2)],
                         ids=["quarter-0", "half-1", "empty-2"])
def test_a_split_call_that_hands_back_its_end_gives_the_same_bytes(share, stream):
    """`fill_misses(ahead=True)` with the CPU's misses on its own thread: the call returns
    while they run, the rows' copy waiting on the cache's signal, and its end (the wait for the
    CPU, the signal set, admissions, the call's close) is handed back; the bytes, books and
    counts stay the token path's (admitting with sieve)."""
    _same_bytes(small_store(torch.bfloat16), share, "sieve", stream, False, "cpu", split=True,
                async_cpu=True, ahead=True)


@pytest.mark.parametrize("share,stream,async_cpu",
                         [(0.25, 0, True), (0.5, 1, True), (0.25, 1, False), (0.0, 2, True)],
                         ids=["quarter-0", "half-1", "quarter-1-sync", "empty-2"])
def test_a_split_call_with_its_books_after_the_sum_gives_the_same_bytes(share, stream,
                                                                        async_cpu):
    """`fill_misses(books_after=True)`: the call returns once its rows are staged and hands
    back its books (the CPU call's times counted, the admissions, the call's end), called
    after the sum as a round calls them after the next graph's launch; the bytes, books and
    counts stay the token path's (admitting with sieve)."""
    _same_bytes(small_store(torch.bfloat16), share, "sieve", stream, False, "cpu", split=True,
                async_cpu=async_cpu, books_after=True)


def test_a_split_call_counts_its_books_only_when_they_are_called():
    """What `books_after` hands back is the call's books alone: the CPU's rows are done and
    staged when the call returns; the CPU call's parts and the call's time are counted, and
    the call left, only when the books are called."""
    store, _, token = _async_caches(0.25, 0)
    try:
        call = token_calls(store, 1, seed=5, repeats=False)[0]
        rows = token.resident_rows(*call[:3])
        end = token.fill_misses(*call, rows, books_after=True)
        stats = token.stats.decode
        assert end is not None and not token.cpu._worker.pending
        assert stats.cpu_experts > 0 and stats.cpu_s > 0  # started and waited for
        assert stats.cpu_run_s == 0 and stats.forward_s == 0
        end()
        assert stats.cpu_run_s > 0 and stats.forward_s > 0
    finally:
        token.close()


@pytest.mark.cuda
@pytest.mark.parametrize("share,stream", [(0.5, 0), (0.5, 2)], ids=["half-0", "half-2"])
def test_a_split_call_with_its_books_after_the_sum_gives_the_same_bytes_on_cuda(share, stream):
    """The same on CUDA, the sum queued on the stream before the call's books run."""
    store = store_of(cached_checkpoint("qwen3_moe", "small", dtype=torch.bfloat16),
                     pin_memory=True)
    _same_bytes(store, share, "sieve", stream, False, "cuda", split=True, async_cpu=True,
                books_after=True)


def test_a_split_call_hands_back_its_end_only_when_its_cpu_misses_run_on_their_thread():
    store, _, token = _async_caches(0.25, 0)
    ends = []
    for async_cpu in (True, False):
        token.async_cpu = async_cpu
        call = token_calls(store, 1, seed=5, repeats=False)[0]
        rows = token.resident_rows(*call[:3])
        ends.append(token.fill_misses(*call, rows, ahead=True))
        if ends[-1] is not None:
            assert token.host_rows.signal.pending and token.cpu._worker.pending
            ends[-1]()
        assert not token.host_rows.signal.pending
    assert ends[0] is not None and ends[1] is None
    token.close()


def test_a_failure_of_the_cpu_rows_handed_back_still_sets_the_signal(monkeypatch):
    """The end of a call handed back whose CPU misses fail: the signal is set all the same
    (the device's stream would wait for it forever), the error goes up, and the next call
    runs."""
    from strata.engine.cache import token_call

    store, _, token = _async_caches(0.25, 0)
    calls = token_calls(store, 2, seed=6, repeats=False)
    finish = token_call.finish_cpu_rows

    def failing(*args):
        finish(*args)
        raise RuntimeError("injected")

    monkeypatch.setattr(graph_call, "finish_cpu_rows", failing)
    try:
        rows = token.resident_rows(*calls[0][:3])
        end = token.fill_misses(*calls[0], rows, ahead=True)
        with pytest.raises(RuntimeError, match="injected"):
            end()
        assert not token.host_rows.signal.pending and not token.cpu._worker.pending
        monkeypatch.setattr(graph_call, "finish_cpu_rows", finish)
        split_call(token, *calls[1], ahead=True)
    finally:
        token.close()


def test_a_failing_copy_behind_the_signal_sets_it_and_waits_for_the_cpu(monkeypatch):
    """Queueing the CPU rows' copy behind the wait fails: the signal is set, the CPU's
    thread waited for, nothing handed back."""
    from strata.engine.cache.host_rows import HostRows

    store, _, token = _async_caches(0.25, 0)
    call = token_calls(store, 1, seed=7, repeats=False)[0]
    monkeypatch.setattr(HostRows, "stage_cpu_rows",
                        lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("injected")))
    try:
        rows = token.resident_rows(*call[:3])
        with pytest.raises(RuntimeError, match="injected"):
            token.fill_misses(*call, rows, ahead=True)
        assert not token.host_rows.signal.pending and not token.cpu._worker.pending
    finally:
        token.close()


@pytest.mark.cuda
@pytest.mark.parametrize("share,stream", [(0.5, 0), (0.5, 2), (0.0, 2)],
                         ids=["half-0", "half-2", "empty-2"])
def test_a_split_call_that_hands_back_its_end_gives_the_same_bytes_on_cuda(share, stream):
    """The same on CUDA, where the sum is queued on the stream behind the signal's wait before
    the call's end sets it (as the next graph is in a round)."""
    store = store_of(cached_checkpoint("qwen3_moe", "small", dtype=torch.bfloat16),
                     pin_memory=True)
    _same_bytes(store, share, "sieve", stream, False, "cuda", split=True, async_cpu=True,
                ahead=True)


def _same_bytes(store, share, policy, stream, repeats, device, split=False, wake_cpu=False,
                async_cpu=False, ahead=False, books_after=False):
    """The general path against the token path, or (`split`) the token path against the split
    call; `wake_cpu`, `async_cpu`, `ahead` and `books_after` on the latter."""
    n_slots = round(share * store.n_layers * store.n_experts)
    general = make_cache(store, n_slots, policy, stream, token_path=split, device=device)
    token = make_cache(store, n_slots, policy, stream, token_path=True, device=device)
    token.wake_cpu = wake_cpu
    token.async_cpu = async_cpu
    try:
        for call in token_calls(store, 32, seed=int(share * 10) + stream, repeats=repeats,
                           device=device):
            expected = general.forward(*call)
            got = split_call(token, *call, ahead=ahead, books_after=books_after) if split \
                else token.forward(*call)
            assert got.dtype == expected.dtype and bytes_of(got) == bytes_of(expected)
            assert books(token) == books(general)
        assert counts(token) == counts(general)
        assert token.stats.decode.lookups == 32 * 4
    finally:
        general.close()
        token.close()


def test_the_token_path_runs_where_it_should(monkeypatch):
    """Decode calls take it, a call of more tokens does not (and still counts the same)."""
    from strata.engine.cache import cached_experts

    store = small_store(torch.float32)
    cached = make_cache(store, 32, "coldest-in-loan", 0, token_path=True)
    taken = []
    token_forward = cached_experts.token_forward
    monkeypatch.setattr(cached_experts, "token_forward",
                        lambda *args: taken.append(args[1]) or token_forward(*args))
    try:
        for layer, x, ids, weights in token_calls(store, 4, seed=5, repeats=False):
            cached.forward(layer, x, ids, weights)
        x = torch.randn(3, store.hidden_size)
        ids, weights = route(torch.randn(3, store.n_experts), 4, False)
        cached.forward(0, x, ids, weights)
        assert taken == [0, 1, 2, 3]
        assert cached.stats.decode.lookups == 4 * 4 + 3 * 4
    finally:
        cached.close()


def test_a_tracing_wrapper_still_sees_observe():
    """The token path skips `observe` only where the policy's is the default: a wrapper with
    an `observe` of its own (the tracer) is told, though what it wraps keeps none."""
    from strata.policies.tracing import TracedPolicy

    store = small_store(torch.float32)
    slot_bytes = slot_bytes_for(store.blob_bytes)
    table = ResidencyTable(store.n_layers, store.n_experts, 32, slot_bytes, CHUNK_BYTES)
    arena = Arena(_vmm.HostBackend(CHUNK_BYTES), 32, slot_bytes,
                  hidden_size=store.hidden_size, expert_width=store.expert_width,
                  dtype=store.dtype)
    seen = []

    class Stream:
        def write(self, text):
            seen.append(text)

    traced = TracedPolicy(load_registry().create("coldest-in-loan"), Stream())
    cached = CachedExperts(store, arena, table, CheckedPolicy(traced, table), "cpu")
    try:
        cached.fill_hottest()
        cached.set_phase("decode")
        layer, x, ids, weights = token_calls(store, 1, seed=6, repeats=False)[0]
        cached.forward(layer, x, ids, weights)
        assert any(".observe(" in line for line in seen)
    finally:
        cached.close()



def test_a_failure_while_the_cpu_misses_run_on_their_thread_waits_for_them(monkeypatch):
    """An upload that fails after the CPU's misses started: the call waits for them before the
    error goes up, so no thread writes the kept buffer after the call, and the next call runs."""
    store = small_store(torch.bfloat16)
    cache = make_cache(store, round(0.25 * store.n_layers * store.n_experts), "coldest-in-loan",
                       1, token_path=True)
    cache.async_cpu = True
    calls = list(token_calls(store, 4, seed=3, repeats=False))
    stage = graph_call._stage_uploads
    monkeypatch.setattr(graph_call, "_stage_uploads",
                        lambda *args: (_ for _ in ()).throw(RuntimeError("injected")))
    try:
        with pytest.raises(RuntimeError, match="injected"):
            split_call(cache, *calls[0])
        assert not cache.cpu._worker.pending  # waited for, not left running
        monkeypatch.setattr(graph_call, "_stage_uploads", stage)
        split_call(cache, *calls[1])  # the next call starts its own
    finally:
        cache.close()


def test_a_cache_goes_with_its_last_name_not_at_a_collection():
    """No reference cycle keeps a cache alive past its last name (the executor's upload
    counter holds it weakly): it goes at once, with what it holds, and not wherever Python's
    collector next runs. On CUDA a store's page-locked pages unlock only on an idle device, so
    an unlock at a collection inside another cache's signal window would wait on a stream
    that waits on the host (`host_signal`)."""
    store = store_of(cached_checkpoint("qwen3_moe", "small", dtype=torch.bfloat16))
    cache = make_cache(store, 8, "sieve", 2, token_path=True)
    cache.async_cpu = True
    for call in token_calls(store, 4, seed=7, repeats=False):
        split_call(cache, *call, ahead=True)
    gone = weakref.ref(cache)
    executor = cache.executor  # as an elastic K/V holds it: it does not hold the cache
    was_on = gc.isenabled()
    gc.disable()
    try:
        cache.close()
        del cache, call
        assert gone() is None
        executor.on_upload(4096, 0.001)  # an upload after the cache went counts nowhere
    finally:
        if was_on:
            gc.enable()
