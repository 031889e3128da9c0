"""`CachedExperts`: the MoE layer's experts through the expert cache.

Dimension letters: T tokens, K experts per token, D hidden size, F expert width, E experts per
layer, L layers, S slots, R routed (token, k) rows.

Per layer call, on the engine's thread:
1. the routed ids go to the host (the one device-to-host sync of the layer; in decode the
   token's x [1, D] is copied to the host just before, so the misses' inputs need no second
   one: `HostRows`) and the books' `lookup` splits the T*K rows into hits and misses; in a
   pass the prompt loan took, the loan's first upload batch is queued at once;
2. the routing is recorded in the books' heat, then the policy's `observe` is told;
3. the hits are issued to the device straight from their slots: when T == 1 (decode) at once
   by the arena's `expert_rows` (on CUDA with Triton, kernels that read the slots in place;
   elsewhere a gather and two bmm), every index uploaded in one copy; otherwise by
   `compute_from_slots` (no weight copy); a loaned pass's misses too, queued first;
4. while the device runs them, the misses are computed on the CPU on this thread
   (`CpuExperts`: each distinct expert once, from the host store), their rows copied back
   (from pinned memory on CUDA). With `stream_misses` (an int N > 0, or a `StreamSplit`), a
   decode call's first min(N, M) of M missed experts (by id; the split's count for M) are
   uploaded and computed on the device instead, while the CPU computes the others;
5. the policy may admit this call's misses (checked, applied to the books and uploaded into
   their slots before the next use, all or nothing);
6. the K rows of each token are weighted and summed in order in float32.
A decode call takes these steps with less host work between them (`token_call`), the same bytes;
a call that is not (a prompt pass, the loan's) takes them in `routed_call`. Piecewise CUDA
graphs split a decode call around themselves by default (`split_calls`, `graph_call`): step 3's
hits and step 6 inside the graphs, the rest on the host; with `prefetch_misses` such calls also
upload the next layer's predicted misses ahead (`use_routers`, `strata.engine.cache.prefetch`).
Steps 3 and 6 are `ResidentExperts`' own math and choice of path, so a cache that holds every
expert gives byte-identical output.

When every expert is resident and the policy does not watch the routing (no `observe` of its
own), a decode call (T == 1) cannot miss and needs nothing on the host: it skips steps 1-2, 4
and 5, reads the slots through the mirror, and counts the routing into a device tensor folded
into the books' heat (`flush_heat`) before anything reads it (the next call through the host,
a phase change, a request's end, the loan's opening). `generate` replays such decode steps
from CUDA graphs as without a cache (`graph_capture` around the capture, `count_replay`).

Every change of the slots (the fill, admissions, the loan, the elastic K/V's give-ups and trims)
is carried out by the cache's `CacheExecutor` (`executor`), all or nothing; the device mirror of
the books (`mirror`, int32 [L, E]) is re-uploaded after each, with a blocking copy, so no kernel
reads it stale. The prompt loan is the cache's own (`loan`, built from `LoanOptions`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import pluggy
import torch

from strata._residency import ResidencyTable
from strata.books import CheckedPolicy
from strata.engine.cache import graph_call
from strata.engine.cache.arena import Arena
from strata.engine.cache.budget import CacheBudget
from strata.engine.cache.device_heat import DeviceHeat
from strata.engine.cache.executor import CacheExecutor
from strata.engine.cache.host_rows import HostRows
from strata.engine.cache.loan import LoanOptions, PromptLoan
from strata.engine.cache.prefetch import MissPrefetch, check_prefetch_misses
from strata.engine.cache.routed_call import routed_forward
from strata.engine.cache.stats import PHASES, CacheStats, PhaseStats, upload_counter
from strata.engine.cache.token_call import token_forward
from strata.engine.experts import ExpertStore, grouped, weighted_sum
from strata.engine.experts.cpu import CpuExperts
from strata.engine.experts.streamed import StreamedMisses, StreamSplit, staging_blobs
from strata.policies import DEFAULT_POLICY, Policy, load_registry

__all__ = ["CachedExperts"]


class CachedExperts:
    """Experts through a cache of `arena.n_slots` slots whose books are `table`.

    `policy` decides admissions (None: the registry's default, `coldest-in-loan`, which admits
    nothing); `events` is the plugin manager whose observers are told each change. `loan`
    lends the top slots to long prompt passes (None: no loan). Requests: `begin_request`,
    `set_phase`, `end_request` (which returns the request's stats). Slots start empty:
    `fill_hottest` fills them. `close` releases the arena.
    """

    def __init__(self, store: ExpertStore, arena: Arena, table: ResidencyTable,
                 policy: CheckedPolicy | None, device: str | torch.device,
                 cpu_threads: int | None = None, *,
                 events: pluggy.PluginManager | None = None, budget: CacheBudget | None = None,
                 stream_misses: int | StreamSplit = 0, loan: LoanOptions | None = None,
                 prefetch_misses: int = 0) -> None:
        self.device = torch.device(device)
        store.check_uploads_to(self.device)  # ValueError before anything is made
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if policy is not None and policy.table is not table:
            raise ValueError("the policy is bound to other books than `table`")
        self.store, self.arena, self.table = store, arena, table
        self.checked = policy or CheckedPolicy(load_registry().create(DEFAULT_POLICY), table)
        self.events = events
        self.budget = budget
        self.n_layers, self.n_experts = store.n_layers, store.n_experts
        self.expert_width, self.hidden_size = store.expert_width, store.hidden_size
        self.phase = "prompt"
        self.stats = CacheStats(slots=arena.n_slots, policy=self.checked.name)
        self.executor = CacheExecutor(store, arena, table, self.device, events=events,
                                      on_upload=upload_counter(self), listener=self.checked)
        self.loan = PromptLoan(self.executor, self.checked, loan) if loan is not None else None
        self.cpu = CpuExperts(store, cpu_threads)
        self.stream_misses = staging_blobs(stream_misses)  # N; ValueError for a bad value
        self.stream_split = stream_misses if isinstance(stream_misses, StreamSplit) else None
        check_prefetch_misses(prefetch_misses, self.stream_misses)
        self.prefetch_misses = prefetch_misses  # the most a layer uploads ahead; 0: off
        self.streamer = StreamedMisses(store, self.device, self.stream_misses,
                                       self.stream_split, prefetch_misses > 0) \
            if self.stream_misses else None
        self.prefetch: MissPrefetch | None = None  # set by `use_routers`
        answering = type(getattr(self.checked.policy, "inner", self.checked.policy))
        self._observes = "observe" in answering.overrides()
        # The policy's checked `observe`, None where it is the default, which does nothing (a
        # wrapper such as a tracer has an `observe` of its own even when its inner does not).
        self.observer = (None if type(self.checked.policy).observe is Policy.observe
                         else self.checked.observe)
        # Decode calls go through `token_forward`; False sends them through `routed_forward`,
        # which gives the same bytes (the tests compare the two).
        self._token_path = True
        # Piecewise graphs split decode calls (`splits_calls`) when True: the same bytes, and
        # 1.07-1.20x faster rounds on the H200 (bench/results/offload-split-h200-2026-12-02.md);
        # False keeps them whole, the A/B's baseline (bench/offload.py --whole-calls).
        self.split_calls = True
        # wake_cpu: the CPU kernel's threads started (`CpuExperts.wake`) before each decode
        # call's routing read; off: it won 2-13% at 4 streamed misses, lost 11-16% at 3 (bench/
        # results/offload-omp-wait-h200-2026-12-03.md). async_cpu: a split call's CPU misses on
        # the CPU's own thread (`CpuExperts.start`) while this one queues the uploads; on: 8 of
        # 10 rounds 1.04-1.22x (offload-async-h200-2026-12-03.md). The same bytes either way.
        self.wake_cpu, self.async_cpu = False, True
        self.heat = DeviceHeat(table, self.device)  # routing counted on the device-only path
        self._last_layer = -1  # the layer of the open pass's latest call; -1: no pass is open
        self._loaned = False
        self._capturing = False  # inside graph_capture: calls run device-only, uncounted
        self._captured_top_k = 0  # K of the captured step, for count_replay
        self.host_rows = HostRows(self.device)  # decode's x to the host, misses' rows back

    # --- the books and the slots ---
    @property
    def mirror(self) -> torch.Tensor:
        """int32 [L, E]: the books' `res` on the device."""
        return self.executor.mirror

    def sync_mirror(self) -> None:
        """Upload the books' `res` to the device mirror; complete when it returns."""
        self.executor.sync_mirror()

    def flush_heat(self) -> None:
        """Fold the routing counted on the device into the books' heat (one host read)."""
        self.heat.flush()

    @property
    def loaned(self) -> bool:
        """Whether the open pass's misses go to the prompt loan."""
        return self._loaned

    @property
    def device_only(self) -> bool:
        """Whether a decode call stays on the device: every expert resident, no loan open and a
        policy without an `observe` of its own."""
        return (not self._observes and not self._loaned
                and self.table.n_resident == self.n_layers * self.n_experts)

    def fill_hottest(self) -> int:
        """Fill slots [0, n) with the n = min(S, L*E) hottest experts by the books' rank, as
        the simulator starts (`strata.sim.replay.start_books`). Returns n."""
        if self.table.n_resident:
            raise ValueError(f"fill_hottest: {self.table.n_resident} slots are filled already")
        n_fill = min(self.table.n_slots, self.n_layers * self.n_experts)
        hottest = np.argsort(self.table.rank.reshape(-1), kind="stable")[:n_fill]
        placements = np.stack([np.arange(n_fill), hottest // self.n_experts,
                               hottest % self.n_experts], axis=1)  # [n, 3]
        with self.executor.change() as change:
            change.fill(placements)
        return n_fill

    # --- requests and passes ---
    def begin_request(self) -> None:
        """Start a request: fresh stats, phase `prompt`."""
        self._close_pass()
        self.flush_heat()
        self.stats = CacheStats(slots=self.arena.n_slots, policy=self.checked.name)
        self.phase = "prompt"

    def set_phase(self, phase: str) -> None:
        """`prompt` or `decode`; turning to decode ends the prompt (the loan gives back)."""
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {', '.join(PHASES)}, got {phase!r}")
        self._close_pass()
        self.flush_heat()
        if self.phase == "prompt" and phase == "decode" and self.loan is not None:
            self.loan.end_prompt()
        self.phase = phase

    def end_request(self) -> CacheStats:
        """End the request; returns its stats."""
        self._close_pass()
        self.flush_heat()
        if self.phase == "prompt" and self.loan is not None:
            self.loan.end_prompt()
        return self.stats

    def _open_pass(self, n_tokens: int) -> None:
        self.stats.phase(self.phase).passes += 1
        self._loaned = False
        if self.loan is not None:
            self.flush_heat()  # the loan's choices read the heat
            loans = self.loan.loans
            self._loaned = self.loan.begin_pass(n_tokens, self.phase)
            if self.loan.loans > loans:
                self.stats.note_lent(int(self.loan.lent.size))

    def _close_pass(self) -> None:
        # A pass the loan took keeps it open until the prompt ends, for the prompt's next pass.
        self._last_layer = -1
        self._loaned = False

    # --- the MoE layer's call ---
    def forward(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """sum_k topk_weights[t, k] * expert[topk_ids[t, k]](x[t]): see `Experts.forward`."""
        entered = time.perf_counter()
        n_tokens, top_k = topk_ids.shape
        if not 0 <= layer < self.n_layers:
            raise IndexError(f"layer {layer} is out of range [0, {self.n_layers})")
        if self._capturing:
            if n_tokens != 1:
                raise RuntimeError(f"only a one-token decode step can be captured, got {n_tokens}")
            self._captured_top_k = top_k
            return self._device_only_forward(layer, x, topk_ids, topk_weights)
        stats = self._enter_call(layer, n_tokens)
        if n_tokens == 1 and self.device_only:
            result = self._device_only_forward(layer, x, topk_ids, topk_weights)
            self._count_all_hits(stats, n_tokens * top_k)
        else:
            self.flush_heat()
            if n_tokens == 1 and not self._loaned and self._token_path:
                result = token_forward(self, layer, x, topk_ids, topk_weights, stats)
            else:
                result = routed_forward(self, layer, x, topk_ids, topk_weights, stats)
        self._leave_call(layer, stats, entered)
        return result

    def _enter_call(self, layer: int, n_tokens: int) -> PhaseStats:
        """A layer call's place in its pass (a pass opens at layer 0's call, or at a call of a
        layer not after the last one's); returns the phase's stats."""
        if layer <= self._last_layer:  # a new pass began before the last one reached layer L-1
            self._close_pass()
        if self._last_layer < 0:
            self._open_pass(n_tokens)
        self._last_layer = layer
        return self.stats.phase(self.phase)

    def _leave_call(self, layer: int, stats: PhaseStats, entered: float) -> None:
        stats.forward_s += time.perf_counter() - entered
        if layer == self.n_layers - 1:
            self._close_pass()

    # --- a decode call split around piecewise CUDA graphs (`graph_call`) ---
    @property
    def splits_calls(self) -> bool:
        """Whether piecewise graphs capture this cache's decode calls split: the hits inside the
        graphs (`resident_rows`), the misses on the host (`fill_misses`). It needs the experts'
        Triton kernels on CUDA, which read nothing for a missing expert's row."""
        return self.split_calls and self.device.type == "cuda" and \
            not grouped.copies_weights(self.device)

    def use_routers(self, routers: list[torch.Tensor], top_k: int) -> None:
        """Predict and prefetch each next layer's misses in split decode calls from the
        model's routers [E, D] per layer (`strata.engine.cache.prefetch`); ValueError unless
        the cache was made with `prefetch_misses`."""
        if self.streamer is None or not self.streamer.prefetching:
            raise ValueError("use_routers: the cache was made without prefetch_misses")
        self.prefetch = MissPrefetch(routers, top_k, self.n_experts, self.device,
                                     self.prefetch_misses)

    def resident_rows(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor
                      ) -> torch.Tensor:
        """[K + 1, D]: the rows of the resident experts of a one-token call (row k + 1 the
        k-th expert's; row 0 scratch), read through the mirror, the others zeros; no host
        work (`graph_call.resident_rows`)."""
        return graph_call.resident_rows(self, layer, x, topk_ids)

    def sum_rows(self, x: torch.Tensor, rows: torch.Tensor, topk_weights: torch.Tensor
                 ) -> torch.Tensor:
        """[1, D]: the staged misses' rows written into rows [K + 1, D], then the K rows'
        weighted sum; no host work (`graph_call.sum_rows`)."""
        return graph_call.sum_rows(self, x, rows, topk_weights)

    def fill_misses(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor,
                    topk_weights: torch.Tensor, rows: torch.Tensor, ahead: bool | None = None,
                    books_after: bool = False) -> Callable[[], None] | None:
        """The rest of a one-token decode call after `resident_rows` filled rows [K + 1, D]:
        the CPU's misses' rows and the streamed ones staged, the books, policy and stats as
        `forward` tells them; `sum_rows` then gives what `forward` would. Returns None, or with
        `books_after` or `ahead` (default `graph_call.LAUNCH_AHEAD`) maybe the call's end,
        which the caller calls once it has queued the next graph (`graph_call.fill_misses`)."""
        entered = time.perf_counter()
        if not 0 <= layer < self.n_layers:
            raise IndexError(f"layer {layer} is out of range [0, {self.n_layers})")
        stats = self._enter_call(layer, 1)
        if self._loaned:
            raise RuntimeError("fill_misses: a loaned pass computes its misses in the loan")
        if self.device_only:  # as `forward`: every row a hit, the routing counted on the device
            self.heat.count(layer, topk_ids)
            self._count_all_hits(stats, topk_ids.shape[1])
            # Nothing of an earlier call written again.
            self.host_rows.stage_cpu_rows(topk_ids.shape[1], x.shape[1], rows.dtype, None)
            if self.streamer is not None:
                self.streamer.stage(layer, None, None)
        else:
            self.flush_heat()
            return graph_call.fill_misses(
                self, layer, x, topk_ids, rows, stats,
                functools.partial(self._leave_call, layer, stats, entered),
                graph_call.LAUNCH_AHEAD if ahead is None else ahead, books_after)
        self._leave_call(layer, stats, entered)
        return None

    @staticmethod
    def _count_all_hits(stats: PhaseStats, n_rows: int) -> None:
        stats.layer_calls += 1
        stats.lookups += n_rows
        stats.hits += n_rows

    def _device_only_forward(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """Every row a hit, nothing on the host: the routing counted on the device."""
        n_tokens, top_k = topk_ids.shape
        self.heat.count(layer, topk_ids)
        # Every row a hit: the slots by the mirror, on the device (no host read).
        slot_ids = self.mirror[layer].index_select(0, topk_ids.reshape(-1))  # [T*K]
        x_rows = x.unsqueeze(1).expand(n_tokens, top_k, -1).reshape(n_tokens * top_k, -1)
        out = self.arena.expert_rows(slot_ids, x_rows)  # [T*K, D]
        return weighted_sum(out, topk_weights, x.dtype)

    # --- decode steps replayed from CUDA graphs ---
    @contextmanager
    def graph_capture(self) -> Iterator[None]:
        """Around capturing a decode step (T == 1) into a CUDA graph, its warm-up runs included:
        every call runs the device-only path uncounted, and the routing the warm-ups count on
        the device is taken back, so that only replays count (`count_replay`). RuntimeError
        unless `device_only` (a graph cannot read the routing on the host)."""
        if not self.device_only:
            raise RuntimeError(
                "a decode step through the expert cache can be captured only while every "
                "expert is resident, no loan is open and the policy does not observe"
            )
        self._close_pass()
        self.flush_heat()  # the device counter is zero from here
        self._capturing = True
        try:
            yield
        finally:
            self._capturing = False
            # The warm-ups ran on a stream the current one has waited for: dropping their
            # counts here follows them.
            self.heat.discard()

    def count_replay(self) -> None:
        """Count one replayed decode step: a pass of L layer calls, every routed row a hit; its
        routing was counted on the device by the replay itself."""
        if not self._captured_top_k or not self.device_only:
            raise RuntimeError("count_replay: no step was captured, or not every expert is "
                               "resident any more")
        stats = self.stats.phase(self.phase)
        stats.passes += 1
        stats.layer_calls += self.n_layers
        stats.lookups += self.n_layers * self._captured_top_k
        stats.hits += self.n_layers * self._captured_top_k
        self.heat.mark_pending()

    def admit_misses(self, layer: int, missed: np.ndarray) -> None:
        """Ask the policy which misses enter; carried out all or nothing."""
        placements = self.checked.admit(layer, missed)  # int64 [n, 3] (slot, layer, expert)
        if not placements.size:
            return
        with self.executor.change() as change:
            evicted = change.admit(layer, placements)
        stats = self.stats.phase(self.phase)
        stats.admitted += int(placements.shape[0])
        stats.evicted += int(evicted.shape[0])

    def close(self) -> None:
        """Release the arena. Idempotent."""
        self.arena.close()

