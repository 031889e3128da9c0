"""The decode call through the expert cache: one token's K rows with little host work between
the kernels.

Dimension letters: K experts per token, D hidden size, R rows.

`CachedExperts.forward` sends a one-token call outside a loaned pass (decode) here. Its steps
are those of `strata.engine.cache.cached_experts`, with less host work between the kernels: one
call of the books (`ResidencyTable.split_token`: lookup, record and the split of the K rows)
writes every index the call uploads into one buffer (pinned on CUDA: one copy that does not wait
for the stream) and the misses' grouping beside them; the hits, the streamed misses and the
CPU's rows are computed as blocks, which the weighted sum reads in row order through the
uploaded positions (no gather); the policy's `observe` is skipped where it is the default. It
gives the general path's bytes (tests/engine/cache/test_token_path.py compares the two), and on
the H200 a call took 0.68-0.90x the general path's time
(bench/results/layer-call-cpu-2026-12-01.md, its H200 section).
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import numpy as np
import torch

from strata.engine.cache.stats import PhaseStats
from strata.engine.experts.combine import weighted_sum
from strata.engine.experts.routed import Routed

__all__ = [
    "DeviceTime",
    "TokenSplit",
    "count_cpu_call",
    "cpu_rows",
    "finish_cpu_rows",
    "split_call",
    "start_cpu_rows",
    "streamed_rows",
    "token_forward",
]


class TokenSplit(NamedTuple):
    """A one-token call's routing as the books split it (`split_call`): x readable on the host,
    the index buffer and its numpy view `split` (`ResidencyTable.split_token`'s layout), the
    hits' and missed experts' counts, how many of the missed experts the copy engine streams
    (`picked`: their rows where the streamer picked them by expert, else None: the first
    `n_streamed` by id, made by `streamed`), and the rows the CPU computes (None: none)."""

    x_host: torch.Tensor
    buffer: torch.Tensor
    split: np.ndarray
    n_hits: int
    n_missed: int
    n_streamed: int
    picked: Routed | None
    misses: Routed | None

    def streamed(self, top_k: int) -> Routed | None:
        """The streamed misses' rows (None: none). Made when asked, so that a split call can
        start the CPU's share first."""
        if self.picked is not None or not self.n_streamed:
            return self.picked
        return Routed.of_split(self.split, top_k, self.n_hits, self.n_missed,
                               hi=self.n_streamed)

    def missed_experts(self, top_k: int) -> np.ndarray:
        """The missed experts, ascending (a copy)."""
        return self.split[3 * top_k:3 * top_k + self.n_missed].copy()


def split_call(cache: Any, layer: int, x: torch.Tensor, topk_ids: torch.Tensor,
               stats: PhaseStats, queued: bool = False) -> TokenSplit:
    """The host's first steps of a one-token call: x and the routing read (the sync; with
    `queued`, the read `HostRows.queue_routing` queued), the books' lookup, record and split,
    the policy's `observe`, the counts."""
    top_k = topk_ids.shape[1]
    started = time.perf_counter()
    if cache.wake_cpu:  # while the device runs up to the routing (counted as the wait)
        cache.cpu.wake()
    x_host, ids = cache.host_rows.read_routing(x, topk_ids, queued)  # [1, D], [1, K]: the sync
    stats.wait_s += time.perf_counter() - started
    buffer, split = cache.host_rows.index_buffer(5 * top_k + 1)  # `split_token`'s layout
    n_hits, n_missed = cache.table.split_token(layer, ids, split)
    if cache.observer is not None:
        hit = (split[n_hits:n_hits + top_k] < n_hits).reshape(1, top_k)  # [1, K]
        cache.observer(cache.checked.view, layer, ids, hit)
    stats.layer_calls += 1
    stats.lookups += top_k
    stats.hits += n_hits
    misses = picked = None
    n_streamed = 0
    if n_missed:
        n = 0 if cache.streamer is None else cache.streamer.count(n_missed, layer)
        if n is None:  # experts prefetched for this layer: the streamer picks them first
            picked, misses = cache.streamer.split(
                Routed.of_split(split, top_k, n_hits, n_missed), layer)
            n_streamed = 0 if picked is None else picked.n_experts
        else:  # the first n by id streamed (made when asked), the CPU's the others
            n_streamed = n
            if n < n_missed:
                misses = Routed.of_split(split, top_k, n_hits, n_missed, lo=n)
    return TokenSplit(x_host, buffer, split, n_hits, n_missed, n_streamed, picked, misses)


class DeviceTime:
    """Counts the time inside into `stats.device_s`: issuing the device's share of a call. A
    class rather than a generator's context manager, which cost a few microseconds a use on a
    path that runs several times a layer."""

    __slots__ = ("_started", "_stats")

    def __init__(self, stats: PhaseStats) -> None:
        self._stats = stats

    def __enter__(self) -> None:
        self._started = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self._stats.device_s += time.perf_counter() - self._started


def streamed_rows(cache: Any, layer: int, x: torch.Tensor, streamed: Routed,
                  stats: PhaseStats) -> torch.Tensor:
    """[R, D] on the device: the streamed misses uploaded to the staging blobs and computed."""
    assert cache.streamer is not None  # only it splits streamed rows off
    rows = cache.streamer.compute(layer, x, streamed)
    stats.streamed_experts += streamed.n_experts
    stats.uploaded_bytes += streamed.n_experts * cache.store.blob_bytes
    return rows


def cpu_rows(cache: Any, layer: int, x_host: torch.Tensor, misses: Routed,
             stats: PhaseStats, out: torch.Tensor | None = None) -> torch.Tensor:
    """[R, D] on the host: the misses computed on the CPU over the one token, into `out` (a
    contiguous [R, D] host tensor of the store's dtype; None: a new one)."""
    started = time.perf_counter()
    # [R, D]: every row's input is the one token's (a copy, as a gather would make).
    x_rows = x_host.expand(misses.n_rows, -1).contiguous()
    rows = cache.cpu.compute(layer, x_rows, misses, out)  # [R, D]
    stats.cpu_s += time.perf_counter() - started
    stats.cpu_experts += misses.n_experts
    stats.cpu_tokens += misses.n_rows
    return rows


def start_cpu_rows(cache: Any, layer: int, x_host: torch.Tensor, misses: Routed,
                   stats: PhaseStats, out: torch.Tensor) -> float | None:
    """Start `cpu_rows`' call into `out` on the CPU's own thread (`CpuExperts.start`) and
    return when it started (`time.perf_counter`), for `finish_cpu_rows`; None, having started
    nothing, for a call that thread does not take (`cpu_rows` computes it then)."""
    started = time.perf_counter()
    if not cache.cpu.start(layer, x_host, misses, out):  # x [1, D]: every row's input
        return None
    stats.cpu_experts += misses.n_experts
    stats.cpu_tokens += misses.n_rows
    stats.cpu_tasks += cache.cpu.tasks(misses)
    return started


def finish_cpu_rows(cache: Any, stats: PhaseStats, started: float, count: bool = True
                    ) -> None:
    """Wait for `start_cpu_rows`' call (taking part in it under "steal"); its time from the
    start counts as the CPU's, and with `count` where it went (`count_cpu_call`; without,
    the caller counts it later, off the path to the next kernel)."""
    stats.cpu_waiter_tasks += cache.cpu.finish()
    stats.cpu_s += time.perf_counter() - started
    if count:
        count_cpu_call(cache, stats)


def count_cpu_call(cache: Any, stats: PhaseStats) -> None:
    """Where the last call `finish_cpu_rows` waited for spent its time (`CpuExperts.last_call`:
    the hand-over, the team's wake-up, the runs, the notice), into `stats`."""
    times = cache.cpu.last_call()
    if times is not None:
        stats.cpu_hand_over_s += times.hand_over_s
        stats.cpu_team_up_s += times.team_up_s
        stats.cpu_pass1_s += times.pass1_s
        stats.cpu_run_s += times.run_s
        stats.cpu_noticed_s += times.noticed_s


def token_forward(cache: Any, layer: int, x: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor, stats: PhaseStats) -> torch.Tensor:
    """[1, D]: `cache`'s layer call (a `CachedExperts`, not imported here: it imports this) for
    one token x [1, D] routed to topk_ids [1, K] with topk_weights [1, K], outside a loaned
    pass; counts into `stats` (the phase's)."""
    top_k = topk_ids.shape[1]
    call = split_call(cache, layer, x, topk_ids, stats)
    n_hits = call.n_hits

    # The device's share is issued first and runs while this thread computes the misses
    # on the CPU; the next host read (the next layer's routing) waits for it.
    parts = []  # [R_i, D] each: the hits', the streamed misses', the CPU's rows
    with DeviceTime(stats):
        index = cache.host_rows.indices_to_device(call.buffer[:n_hits + top_k])  # slots; order
        if n_hits:
            parts.append(cache.arena.expert_rows(index[:n_hits], x.expand(n_hits, -1)))
        streamed = call.streamed(top_k)
        if streamed is not None:
            parts.append(streamed_rows(cache, layer, x, streamed, stats))
    if call.misses is not None:
        parts.append(cache.host_rows.to_device(cpu_rows(cache, layer, call.x_host,
                                                        call.misses, stats)))
    out = parts[0] if len(parts) == 1 else torch.cat(parts)  # [K, D]
    # The hit rows alone are in row order already; else the sum reads row k at index[n_hits + k]
    # (no gather back first).
    positions = index[n_hits:] if n_hits < top_k else None

    if cache.checked.admits and call.n_missed:  # every missed expert, ascending
        cache.admit_misses(layer, call.missed_experts(top_k))
    return weighted_sum(out, topk_weights, x.dtype, positions)
