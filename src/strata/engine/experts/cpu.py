"""The miss path: experts computed on the CPU from the host store, on the engine's thread.

Dimension letters: U distinct tokens of the misses, D hidden size, F expert width, R rows,
M experts of a call.

A bf16 store's experts with up to `KERNEL_MAX_ROWS` rows go through `strata._cpu_experts`: every
expert of the call at once, each weight row read once and the rows of all of them spread over
all cores, so the call streams the weights at close to the memory's rate (at a few tokens an
expert, computing it is reading it). The other experts (more rows, where the matmul's arithmetic
rather than the bytes sets the time, or a store in another dtype) run one at a time as two torch
matmuls in the store's dtype, each spread by torch over its intra-op threads. `STRATA_CPU_KERNEL
=torch` sends every expert the second way (the path before the kernel, to measure against).

Experts run in ascending order and each output row has its own place, and the kernel computes
each output value on one thread in one order, so the result does not depend on timing, on
the kernel's thread count or on how it hands its tasks to the threads (`CpuExperts.schedule`);
torch's matmuls may split their sums by the thread count, so that count is fixed for a run.

`compute` runs on the thread that calls it: the cache issues the device's share first (kernels
run asynchronously), then computes the misses here, so the two overlap without a second thread.
A Python worker thread was measured to cost 1.7-2.8x per expert on the 16-core GPU machine
(bench/cpu_experts.py, `worker`): it needs the GIL to start each call, and its intra-op team
and the calling thread's contend for the same cores. `start` / `finish` run a decode call of
strata's kernel on a native thread instead (`_cpu_experts.CpuWorker`: no GIL, an OpenMP team
of its own a quarter smaller than the caller's count, `default_team`), so that the caller can
queue the call's uploads meanwhile (`CachedExperts.async_cpu`, on by default: 1.04-1.22x
rounds in 8 of 10 interleaved pairs on the H200, bench/results/offload-async-h200-2026-12-03.md).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from strata import _cpu_experts, settings
from strata.engine.experts import ExpertStore
from strata.engine.experts.activation import silu_and_mul
from strata.engine.experts.blobs import BlobStack
from strata.engine.experts.cpu_settings import KernelSettings
from strata.engine.experts.routed import Routed

__all__ = ["KERNEL_FORMATS", "KERNEL_MAX_ROWS", "CpuCallTimes", "CpuExperts", "default_team",
           "kernel_for", "kernel_id"]

# The kernel's format of each quantized store (`ExpertStore.quant`).
KERNEL_FORMATS = {"int8": _cpu_experts.FORMAT_INT8, "int4-g32": _cpu_experts.FORMAT_INT4_G32,
                  "int4-g64": _cpu_experts.FORMAT_INT4_G64}

# An expert with more rows than this goes to torch's matmul: the kernel converts each weight
# row once per row it computes, while the matmul's blocked arithmetic (AMX where the CPU has
# it) does not grow with the rows. At 8 rows an expert the kernel took 1.9x torch's time on the
# 2-core development machine; at 1-2 rows it took 0.45-0.69x on the H200's 16 cores
# (bench/results/cpu-experts-kernel-h200-2026-12-01.md). Between 2 and 8 was not measured.
KERNEL_MAX_ROWS = 2


def kernel_for(dtype: torch.dtype, kernel: str | None = None) -> str:
    """The kernel `CpuExperts` uses for a store of `dtype` when asked for `kernel` (None:
    `STRATA_CPU_KERNEL`, else "strata"): strata's for bf16, torch's for any other dtype."""
    if kernel is None:
        kernel = settings.read().cpu_kernel or "strata"
    if kernel not in ("strata", "torch"):
        raise ValueError(f"kernel must be 'strata' or 'torch', got {kernel!r}")
    return kernel if dtype == torch.bfloat16 else "torch"


def kernel_id(dtype: torch.dtype) -> str:
    """`kernel_for(dtype)`, strata's kernel named with its revision and default prefetch
    distance ("strata-r3-pf4096"): what measured CPU rates depend on, so that rates kept before
    a change of either are measured again (`strata.engine.cache.rates.RatesKey`)."""
    kernel = kernel_for(dtype)
    if kernel != "strata":
        return kernel
    return f"{kernel}-r{_cpu_experts.REVISION}-pf{_cpu_experts.PREFETCH_BYTES}"


def default_team(n_threads: int) -> int:
    """The OpenMP team of `CpuExperts.start`'s thread for `n_threads` CPU threads: a quarter of
    them fewer (at least one fewer, at least one in the team), the cores left to the engine's
    thread, the driver's and the copies'. With one fewer (15 of 16) the team's threads waited
    0.6-1.0 ms a round for a core; with 12 the rounds took 0.89-0.92x as long on the H200
    (6 of 6 requests faster) and 0.93x on an H100 (10 of 12), the same tokens
    (bench/offload.py --cpu-team; bench/results/h200-figures-2026-12-06.md)."""
    return max(1, n_threads - max(1, n_threads // 4))


class CpuCallTimes(NamedTuple):
    """Where a call `CpuExperts.start` ran on its own thread spent its time, in seconds
    (`_cpu_experts.CpuWorker.last_call_us`), one after another: `hand_over` from the start to
    its first thread beginning, `run` from there to its end (of it `team_up`, until the team's
    last thread had entered: their wake-up, and `pass1`, until pass 1's tasks were done: gate
    and up, two thirds of the bytes; the rest is pass 2, down), `noticed` from its end to
    `finish` seeing it."""

    hand_over_s: float
    team_up_s: float
    pass1_s: float
    run_s: float
    noticed_s: float


def _all_small(routed: Routed) -> bool:
    """Whether every expert of `routed` has at most `KERNEL_MAX_ROWS` rows. A decode call's
    R rows are M experts' one each (R == M, every expert having at least one), which says so
    without the per-expert counts (3.4 against 0.3 us a call on the development VM,
    bench/results/cpu-start-cpu-2026-12-05.md), on the path before the CPU starts."""
    return routed.n_rows == routed.n_experts or bool(
        (np.diff(routed.starts) <= KERNEL_MAX_ROWS).all())


def _u16(tensor: torch.Tensor) -> np.ndarray:
    """The same bytes as a uint16 numpy array (a view: bf16 bits)."""
    return tensor.view(torch.uint16).numpy()


class CpuExperts(KernelSettings):
    """Computes routed rows of experts from `store` on the CPU, on the calling thread.

    `cpu_threads`: the threads of these calls (torch's intra-op threads are set around each
    call, the caller's count restored after); None: torch's count (by default the physical
    cores). `kernel`: "strata" (the default where `STRATA_CPU_KERNEL` is unset) or "torch",
    as the module's docstring says; a store in another dtype than bf16 always uses torch. A
    quantized store (`ExpertStore.quant`) computing in bf16 goes through strata's kernel for
    every expert, whatever its rows: torch has no matmul that reads the blobs, and dequantizing
    an expert for torch's matmuls took 5.5x the kernel's time at 64 rows an expert (int8, the
    2-core development VM, `compute-int8` in bench/cpu_experts.py); there the kernel takes a
    quantized expert's rows four at a time, at 1.1-1.3x bf16's matmuls (int8) and 1.3-1.5x
    (int4) for 64 rows. One computing in another dtype
    (float32, the reference numerics) goes through torch, each expert dequantized once for its
    rows.
    """

    def __init__(self, store: ExpertStore, cpu_threads: int | None = None,
                 kernel: str | None = None) -> None:
        if cpu_threads is not None and (isinstance(cpu_threads, bool) or cpu_threads < 1):
            raise ValueError(f"cpu_threads must be None or an int >= 1, got {cpu_threads!r}")
        self.store = store
        self.cpu_threads = cpu_threads
        if store.quant is not None and store.dtype == torch.bfloat16:
            kernel_for(store.dtype, kernel)  # a bad name is still an error
            self.kernel, self._format = "strata", KERNEL_FORMATS[store.quant]
        else:
            self.kernel, self._format = kernel_for(store.dtype, kernel), _cpu_experts.FORMAT_BF16
        # Per layer, the blobs uint8 [E, blob_bytes] (the store's bytes, not a copy) for the
        # kernel.
        self._blobs = [store.layer_blobs(layer).numpy() for layer in range(store.n_layers)] \
            if self.kernel == "strata" else []
        # Per layer, the store's blobs as torch's matmuls read them (views, no copy; a
        # quantized blob dequantized when an expert is computed).
        self._stacks = [BlobStack(store.layer_blobs(layer), store.dtype, store.quant,
                                  store.expert_width, store.hidden_size)
                        for layer in range(store.n_layers)]
        super().__init__()  # the kernel's settings, at their defaults
        # `start`'s team spinning between calls (`CpuWorker.keep_team_up`): off, its rounds
        # 0.95-1.12x on the H200 (bench/offload.py --cpu-spin; bench/results/
        # offload-shrink-h200-2026-12-03.md), its threads holding their cores between calls;
        # the same bytes either way.
        self.keep_team_up = False
        # `start`'s team pinned, one CPU a thread: the last of the CPUs this process may run on
        # (`CpuWorker.team_cpus`), the first left to the engine's thread and the rest of the
        # process. Off: on an H100 machine the rounds took 0.99x and 1.02x the unpinned ones
        # (bench/offload.py --cpu-pin, bench/results/pin-cpu-2026-12-05.md); the same bytes
        # either way.
        self.pin_team = False
        self._team_threads: int | None = None  # `team_threads`
        self._pinned_cpus: dict[int, tuple[int, ...]] = {}  # by team size, read once
        # `start` shrinking its caller's OpenMP pool first, after anything that may have grown
        # it (`_cpu_experts.shrink_team`): on the H200 the worker's threads slept 64 times a
        # call beside the caller's pool and never with it shrunk, a call 1.35-1.61x as fast,
        # the rounds 0.94-1.60x (7 of 8 pairs won; bench/results/offload-shrink-h200-2026-12-03.md).
        # The same bytes either way; bench/offload.py --no-cpu-shrink runs the way before.
        self.shrink_caller_team = True
        # Under "steal", the thread waiting in `finish` taking the call's tasks as one more
        # thread of the worker's team (`CpuWorker.wait`'s `help`); False only waits, for the
        # benchmarks' A/B (bench/cpu_experts.py's `start-steal-alone`). The same bytes.
        self.caller_helps = True
        self._caller_team_grown = True  # a new engine's load ran torch's own teams
        self._worker = None  # `start`'s thread, made on first use
        # `start`'s kept buffers, rewritten only while no call is in flight: the token as
        # float32 [1, D] (torch's, and numpy's view of the same memory), and the uint16 views
        # of the `out` tensors it was given, by (address, rows) (a decode call's `out` is a
        # slice of one kept buffer: a handful of these). Each saved about 1.5 us a call on
        # the development VM (bench/results/split-host-cpu-2026-12-05.md).
        self._x_float = torch.empty((1, store.hidden_size), dtype=torch.float32)
        self._x_float_view = self._x_float.numpy()
        self._out_views: dict[tuple[int, int], np.ndarray] = {}

    @property
    def team_threads(self) -> int | None:
        """`start`'s team, in threads; None (the default): `default_team` of the call's
        threads. The benchmarks set it for their A/B (bench/offload.py --cpu-team); the same
        bytes whatever it is. ValueError when set to anything but None or an int >= 1."""
        return self._team_threads

    @team_threads.setter
    def team_threads(self, n_threads: int | None) -> None:
        if n_threads is not None and (isinstance(n_threads, bool) or not isinstance(
                n_threads, int) or n_threads < 1):
            raise ValueError(f"team_threads must be None or an int >= 1, got {n_threads!r}")
        self._team_threads = n_threads

    def wake(self) -> None:
        """Start the threads strata's kernel computes on (`_cpu_experts.wake`), so that a call
        soon after finds them up; nothing where these calls go through torch."""
        if self.kernel == "strata":
            _cpu_experts.wake(self.cpu_threads or torch.get_num_threads())
            self._caller_team_grown = True

    def start(self, layer: int, x_rows: torch.Tensor, routed: Routed, out: torch.Tensor) -> bool:
        """Start `compute(layer, x_rows, routed, out)` on a thread of its own and return at
        once, where the call is strata's kernel's whole (a quantized store's, or a bf16 one's
        of up to `KERNEL_MAX_ROWS` rows an expert: a decode call); `finish` returns when out
        holds its rows. Returns False, and starts nothing, for any other call. x_rows may also
        be [1, D]: the one input every row reads (a decode call's token, not copied R times).

        The thread (`_cpu_experts.CpuWorker`, made on first use) is the master of an OpenMP
        team of its own, `team_threads` strong (by default `default_team`: a quarter fewer
        than `compute`'s, so that the caller and the driver keep cores for what they do
        meanwhile; under "steal", the caller's core joins the call in `finish`); the bytes are
        `compute`'s whatever the count. With
        `shrink_caller_team`, the caller's own OpenMP pool is first cut to one idle thread if a
        `compute` or `wake` (or, before any, the load) may have grown it, so that the two teams
        fit the CPUs and the worker's threads spin between barriers instead of sleeping
        (`_cpu_experts.shrink_team`). One call at a time: RuntimeError while one is in
        flight."""
        if self.kernel != "strata" or (self.store.quant is None and not _all_small(routed)):
            return False
        if out.shape != (routed.n_rows, self.store.hidden_size) \
                or out.dtype != self.store.dtype or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous [{routed.n_rows}, "
                             f"{self.store.hidden_size}] {self.store.dtype} tensor, got "
                             f"{list(out.shape)} {out.dtype}")
        if self.shrink_caller_team and self._caller_team_grown:
            _cpu_experts.shrink_team()  # see there: the caller's idle threads let go
            self._caller_team_grown = False
        if self._worker is None:
            self._worker = _cpu_experts.CpuWorker()
        if self._worker.keep_team_up != self.keep_team_up:  # set under the worker's mutex
            self._worker.keep_team_up = self.keep_team_up
        if self._worker.pending:  # before the kept buffers, which the call in flight reads
            raise RuntimeError("a call is in flight on these CpuExperts: finish() it first")
        team = self._team_threads or default_team(self.cpu_threads or torch.get_num_threads())
        team_cpus = self._team_cpus(team) if self.pin_team else None
        if self._worker.team_cpus != team_cpus:
            self._worker.team_cpus = team_cpus
        lo, hi = int(routed.starts[0]), int(routed.starts[-1])
        starts = routed.starts if lo == 0 else routed.starts - lo
        x = x_rows if x_rows.shape[0] == 1 else x_rows[lo:hi]  # [1, D]: every row's input
        if x.dtype != self.store.dtype:
            x = x.to(self.store.dtype)
        if x.shape[0] == 1:
            self._x_float.copy_(x)  # x.float(), into the kept buffer
            x_float = self._x_float_view
        else:
            x_float = x.float().numpy()
        self._worker.start(
            self._blobs[layer], self._format, np.ascontiguousarray(routed.experts, np.int64),
            np.ascontiguousarray(starts, np.int64), x_float,
            self._out_view(out if lo == 0 and hi == out.shape[0] else out[lo:hi]),
            self.store.expert_width, team, *self.kernel_settings())
        return True

    def _team_cpus(self, n_threads: int) -> tuple[int, ...]:
        """The last n_threads of the CPUs this process may run on, ascending (`pin_team`);
        ValueError where it may run on fewer."""
        cpus = self._pinned_cpus.get(n_threads)
        if cpus is None:
            allowed = sorted(os.sched_getaffinity(0))
            if n_threads > len(allowed):
                raise ValueError(f"pin_team: a team of {n_threads} threads, but this process "
                                 f"may run on {len(allowed)} CPUs; set team_threads to at most "
                                 f"{len(allowed)}, or pin_team off")
            cpus = self._pinned_cpus[n_threads] = tuple(allowed[-n_threads:])
        return cpus

    def _out_view(self, out: torch.Tensor) -> np.ndarray:
        """`_u16(out)`, kept by out's address and rows: the same memory whatever tensor names
        it (the view holds its memory, so nothing else is placed there while it is kept)."""
        key = (out.data_ptr(), out.shape[0])
        view = self._out_views.get(key)
        if view is None:
            if len(self._out_views) >= 64:  # a caller passing new buffers: start again
                self._out_views.clear()
            view = self._out_views[key] = _u16(out)
        return view

    def finish(self) -> int:
        """Return when the call `start` started is done (at once when none is), and how many
        of its tasks (`tasks`) this thread ran. Under the "steal" schedule this thread takes
        the call's tasks too until none is left, as one more thread of the worker's team
        (`_cpu_experts.CpuWorker.wait`), rather than waiting idle beside it; under the others
        it runs none, nor without `caller_helps`."""
        return self._worker.wait(self.caller_helps) if self._worker is not None else 0

    def last_call(self) -> CpuCallTimes | None:
        """The times of the last call `finish` waited for (None before any)."""
        times = self._worker.last_call_us if self._worker is not None else None
        return None if times is None else CpuCallTimes(*(us / 1e6 for us in times))

    def tasks(self, routed: Routed) -> int:
        """The tasks strata's kernel splits a call of `routed`'s experts into: each expert's F
        rows of gate and up 16 at a time, and its D rows of down `down_block_rows` at a time
        (`_cpu_experts.n_tasks`)."""
        return _cpu_experts.n_tasks(routed.n_experts, self.store.expert_width,
                                    self.store.hidden_size, self.down_block_rows)

    def compute(self, layer: int, x_rows: torch.Tensor, routed: Routed,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """Outputs [R, D] in the store's dtype, rows in `routed.rows` order.

        x_rows [R, D] on the CPU: the input of each row (its token's hidden state), in the
        same order. `out`: a contiguous [R, D] CPU tensor of the store's dtype to write them
        into and return (None: a new one).
        """
        if out is not None and (out.shape != (routed.n_rows, self.store.hidden_size)
                                or out.dtype != self.store.dtype or not out.is_contiguous()):
            raise ValueError(f"out must be a contiguous [{routed.n_rows}, "
                             f"{self.store.hidden_size}] {self.store.dtype} tensor, got "
                             f"{list(out.shape)} {out.dtype}")
        caller_threads = torch.get_num_threads()
        if self.cpu_threads is not None and self.cpu_threads != caller_threads:
            torch.set_num_threads(self.cpu_threads)
        self._caller_team_grown = True  # the kernel's team, or torch's, on this thread
        try:
            return self._compute(layer, x_rows, routed, out)
        finally:
            if torch.get_num_threads() != caller_threads:
                torch.set_num_threads(caller_threads)

    def _compute(self, layer: int, x_rows: torch.Tensor, routed: Routed,
                 out: torch.Tensor | None) -> torch.Tensor:
        if out is None:
            out = torch.empty((routed.n_rows, self.store.hidden_size), dtype=self.store.dtype)
        x_rows = x_rows.to(self.store.dtype)
        if self.store.quant is not None and self.kernel == "strata":  # every expert
            self._kernel(layer, x_rows, out, routed.experts, routed.starts)
            return out
        matmul = np.arange(routed.n_experts)  # [M]: the experts torch computes
        if self.kernel == "strata":
            if _all_small(routed):  # a decode call: every expert, rows in the kernel's order
                self._kernel(layer, x_rows, out, routed.experts, routed.starts)
                return out
            small = np.diff(routed.starts) <= KERNEL_MAX_ROWS  # [M]
            matmul = np.flatnonzero(~small)
            self._kernel_some(layer, x_rows, out, routed, np.flatnonzero(small))
        self._matmuls(layer, x_rows, out, routed, matmul)
        return out

    def _kernel(self, layer: int, x_rows: torch.Tensor, out: torch.Tensor,
                experts: np.ndarray, starts: np.ndarray) -> None:
        """out[starts[0]:starts[-1]] of `experts` [M] over x_rows (rows contiguous by expert)."""
        lo, hi = int(starts[0]), int(starts[-1])
        _cpu_experts.compute(
            self._blobs[layer], self._format,
            np.ascontiguousarray(experts, dtype=np.int64),
            np.ascontiguousarray(starts - lo, dtype=np.int64),
            x_rows[lo:hi].float().numpy(), _u16(out[lo:hi]), self.store.expert_width,
            self.cpu_threads or torch.get_num_threads(), *self.kernel_settings())

    def _kernel_some(self, layer: int, x_rows: torch.Tensor, out: torch.Tensor,
                     routed: Routed, chosen: np.ndarray) -> None:
        """The kernel over the experts `chosen` [m] (indices into routed.experts), their rows
        gathered into one contiguous block and scattered back."""
        if not chosen.size:
            return
        counts = routed.starts[chosen + 1] - routed.starts[chosen]  # [m]
        rows = np.concatenate([np.arange(routed.starts[i], routed.starts[i + 1])
                               for i in chosen])  # [r]: positions in x_rows / out
        index = torch.from_numpy(rows)
        block = torch.empty((rows.size, out.shape[1]), dtype=out.dtype)
        self._kernel(layer, x_rows.index_select(0, index), block, routed.experts[chosen],
                     np.concatenate(([0], np.cumsum(counts))))
        out.index_copy_(0, index, block)

    def _matmuls(self, layer: int, x_rows: torch.Tensor, out: torch.Tensor, routed: Routed,
                 chosen: np.ndarray) -> None:
        """Each expert `chosen` [m] (indices into routed.experts) as two torch matmuls."""
        # [2F, D], [D, F] each: views, or dequantized in batches for a quantized store.
        weights = self._stacks[layer].each_weights(routed.experts[chosen].tolist())
        for i, (gate_up, down) in zip(chosen.tolist(), weights, strict=True):
            lo, hi = int(routed.starts[i]), int(routed.starts[i + 1])
            h = F.linear(x_rows[lo:hi], gate_up)  # [n, 2F]
            act = silu_and_mul(h)  # [n, F]
            out[lo:hi] = F.linear(act, down)  # [n, D]
