"""The calls `strata.engine.cache.rates` times: a decode layer's misses over a synthetic store,
each side alone, or both in one call as a round runs it.

Dimension letters: K experts per token, M missed experts of a layer call, s streamed, D hidden
size.

The store is a few layers of K experts of the model's shape and the real store's format
(bf16, int8, int4: the CPU's kernel and the uploads read each at its own rate), in its kind of
memory (`host_blobs`' pages, page-locked on CUDA: the rates depend on the pages), read
round robin so that each call reads weights no recent call read (a CPU's last-level
cache would flatter one layer), as the engine's misses do.

A call of both sides is timed as a round runs it, not back to back. In a round the host waits
for the device between two layers' calls (the next graph, the routing's read): on the H200
0.3-0.5 ms a layer of `olmoe-1b-7b` at 4 GiB, while the CPU's call took 0.5-0.8
(bench/results/offload-prefetch-round-h200-2026-12-03.md). The CPU's idle threads fall asleep
in that wait, and the next call pays their wake-up, a cost back-to-back calls never see: timed
back to back, the split they gave streamed more than the fastest fixed counts and its rounds
were 1.07x slower (bench/results/offload-balance-staged-h200-2026-12-03.md). So before each
timed call the host waits `ROUND_GAP_S` untimed, busy as the driver's wait is, and a split
call's CPU share runs on the CPU's own thread (`CpuExperts.start`), as `fill_misses` runs it
by default (`CachedExperts.async_cpu`), while the host queues the uploads.
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import torch

from strata.engine.experts import ExpertStore, grouped
from strata.engine.experts.cpu import CpuExperts
from strata.engine.experts.quant import expert_blob_bytes, make_blob
from strata.engine.experts.routed import Routed
from strata.engine.experts.store import host_blobs
from strata.engine.experts.streamed import StreamedMisses

__all__ = ["MAX_LAYERS", "ROUND_GAP_S", "TimedCalls", "samples", "synthetic_store"]

MAX_LAYERS = 64
ROUND_GAP_S = 0.0005  # the host's wait for the device between two calls, untimed (above)


def synthetic_store(hidden_size: int, expert_width: int, top_k: int, dtype: torch.dtype,
                    pin: bool, target_bytes: int, quant: str | None = None) -> ExpertStore:
    """Layers of K experts of the shape, at least `target_bytes` in all (at most MAX_LAYERS
    layers), filled with small values, page-locked for CUDA when `pin`; with `quant`, in that
    format (`strata.engine.experts.quant`: the blobs a quantized store holds)."""
    blob = expert_blob_bytes(expert_width, hidden_size, dtype, quant)
    n_layers = max(1, min(MAX_LAYERS, -(-target_bytes // (top_k * blob))))
    gen = torch.Generator().manual_seed(0)
    if quant is None:
        numel = blob // dtype.itemsize
        pattern = (torch.randn(numel, generator=gen) * hidden_size ** -0.5).to(dtype)
        pattern = pattern.view(torch.uint8)  # [B]
    else:
        f, d = expert_width, hidden_size
        gate, up, down = (torch.randn(shape, generator=gen) * d ** -0.5
                          for shape in ((f, d), (f, d), (d, f)))
        pattern = make_blob(quant, gate, up, down)  # [B]
    pages, buffer = host_blobs(n_layers, top_k, blob, "the rates' synthetic experts")
    if pin:
        pages.register(torch.cuda.current_device())
    buffer.copy_(pattern.expand_as(buffer))
    return ExpertStore(list(buffer.unbind(0)), hidden_size, expert_width, dtype, quant=quant,
                       pages=pages)


class TimedCalls:
    """The calls `samples` times over `store` (K = `top_k`) on `device`, each reading the
    store's next layer (round robin): one side alone, or a call of both."""

    def __init__(self, store: ExpertStore, top_k: int, device: torch.device,
                 cpu_threads: int | None, gap_s: float = ROUND_GAP_S) -> None:
        self.store, self.device, self.cuda = store, device, device.type == "cuda"
        self.gap_s = gap_s
        self.cpu = CpuExperts(store, cpu_threads)
        self.streamer = StreamedMisses(store, device, top_k)
        hidden_size, dtype = store.hidden_size, store.dtype
        self.x_host = torch.full((top_k, hidden_size), 0.01, dtype=dtype)  # [K, D]
        self.x_dev = self.x_host[:1].to(device)  # [1, D]
        self.out = torch.empty((top_k, hidden_size), dtype=dtype)  # [K, D]: the CPU's rows
        self.rows = torch.zeros((top_k + 1, hidden_size), dtype=dtype,
                                device=device)  # [K + 1, D], as `fill_misses` fills them
        # routed[k]: experts 0..k-1, one row each (routed[0] unused).
        self.routed = [Routed.of(np.arange(max(k, 1))[None, :]) for k in range(top_k + 1)]
        self._layers = itertools.count()
        # Calls are split only where the experts' kernels read nothing for an unused staging
        # blob (`CachedExperts.splits_calls`); the host twin times them too, for its tests.
        self.splits = not self.cuda or not grouped.copies_weights(device)
        self.cpu_started = 0  # split calls whose CPU share ran on the CPU's own thread

    def _layer(self) -> int:
        return next(self._layers) % self.store.n_layers

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def _gap(self) -> None:
        """The host busy for `gap_s`, as while it waits for a layer's graph in a round."""
        until = time.perf_counter() + self.gap_s
        while time.perf_counter() < until:
            pass

    def stream(self, k: int) -> float:
        """k blobs uploaded and computed, on the device's clock on CUDA."""
        layer = self._layer()
        if not self.cuda:
            start = time.perf_counter()
            self.streamer.compute(layer, self.x_dev, self.routed[k])
            return time.perf_counter() - start
        self._sync()
        begin, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        begin.record()
        self.streamer.compute(layer, self.x_dev, self.routed[k])
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1000

    def grow_caller_team(self) -> None:
        """One untimed call of the CPU's on this thread: its OpenMP pool grown again, after the
        split calls' `CpuExperts.start` shrank it, before its calls are timed."""
        self.cpu.compute(self._layer(), self.x_host[:1], self.routed[1])

    def shrink_caller_team(self) -> None:
        """One untimed split call with a CPU share: the engine thread's OpenMP pool shrunk
        (`CpuExperts.start`, after the engine thread's timed calls grew it) before the split
        calls are timed, as a round's calls find it after its first layer. Timed, the first
        split call of each round paid the shrink: on two H100 machines on 2026-12-07 one
        expert on the CPU took 670 and 358 µs where two took 514 and 243
        (bench/results/split-tables-rates-h100-2026-12-07.json)."""
        self.call(1, 0, split=True)

    def on_cpu(self, k: int) -> float:
        layer = self._layer()
        start = time.perf_counter()
        self.cpu.compute(layer, self.x_host[:k], self.routed[k])
        return time.perf_counter() - start

    def call(self, m: int, s: int, split: bool) -> float:
        """M misses, s streamed, after the round's gap. Whole, as `token_forward` runs one:
        the device's share launched first, then the CPU's. Split, as `fill_misses` and the
        next graph run one: the CPU's share started on its own thread, the uploads and the
        stage map queued meanwhile (no kernel), then, after the CPU's share, the staged
        experts."""
        stream_layer, cpu_layer = self._layer(), self._layer()
        on_cpu = m - s
        self._sync()
        self._gap()
        start = time.perf_counter()
        if split:
            started = on_cpu and self.cpu.start(cpu_layer, self.x_host[:on_cpu],
                                                self.routed[on_cpu], self.out[:on_cpu])
            try:
                streamed = self.routed[s] if s else None
                self.streamer.stage(stream_layer, streamed, streamed.rows + 1 if s else None)
            finally:  # the CPU's thread writes `out`: never left running past the call
                if started:
                    self.cpu.finish()
            self.cpu_started += bool(started)
            if on_cpu and not started:  # a call that thread does not take
                self.cpu.compute(cpu_layer, self.x_host[:on_cpu], self.routed[on_cpu],
                                 self.out[:on_cpu])
            self.streamer.staged_rows(self.x_dev, self.rows)  # after the uploads
        else:
            if s:
                self.streamer.compute(stream_layer, self.x_dev, self.routed[s])
            if on_cpu:
                self.cpu.compute(cpu_layer, self.x_host[:on_cpu], self.routed[on_cpu])
        self._sync()
        return time.perf_counter() - start


def samples(calls: TimedCalls, top_k: int, repeat: int) -> tuple[list, ...]:
    """(stream, cpu, joint, staged): `repeat` timings in seconds of each side for each k
    (index 0 empty), and of a whole and a split call for each M and s (joint[M][s],
    staged[M][s]; row 0 empty; staged [] where calls are not split).

    Each round times every call of the engine's thread (each side alone, the whole calls),
    then, after one untimed split call (`TimedCalls.shrink_caller_team`), every split call. A
    round of decode runs one kind or the other throughout, and the CPU's OpenMP teams follow
    the kind: the engine thread's pool grows for its `compute`, and the CPU's own thread
    shrinks it before its first call after (`CpuExperts.start`); taking the kinds in turn call
    by call would time that pool's threads made and let go on every call, which no round
    pays."""
    sides = [[] for _ in range(top_k + 1)], [[] for _ in range(top_k + 1)]
    grids = tuple([[[] for _ in range(m + 1)] for m in range(top_k + 1)] for _ in range(2))
    for round_ in range(repeat + 1):  # the first untimed
        times = []
        calls.grow_caller_team()
        for k in range(1, top_k + 1):
            times += [(sides[0][k], calls.stream(k)), (sides[1][k], calls.on_cpu(k))]
            times += [(grids[0][k][s], calls.call(k, s, split=False)) for s in range(k + 1)]
        if calls.splits:
            calls.shrink_caller_team()
            times += [(grids[1][k][s], calls.call(k, s, split=True))
                      for k in range(1, top_k + 1) for s in range(k + 1)]
        if round_:
            for sampled, t in times:
                sampled.append(t)
    joint_t, staged_t = grids
    return *sides, joint_t, staged_t if calls.splits else []
