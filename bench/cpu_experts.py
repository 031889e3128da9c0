"""Benchmark the CPU miss path (`CpuExperts`): microseconds per expert, and where they go.

Builds a random `ExpertStore` of `--layers` layers with the expert shape of `--preset`
(default olmoe-1b-7b: D 2048, F 1024; 4 layers, 3 GiB in bf16), then times, in the same run,
each at T = 1 (K rows, one per distinct expert: a decode round's misses) and at T = 64 (T*K rows
over the experts they route). Successive calls take the next layer, and at T = 1 each round of
the layers other experts (disjoint sets, through all of them), so a call reads weights no
recent call read, as the engine's misses do: with the same few experts of 4 layers, 75 MB of
int8 qwen3-30b-a3b experts (150 MB in bf16) stayed in the 300 MiB last-level cache of the H100
machine's Xeon and read at up to 200 GB/s, past its memory's rate
(bench/results/cpu-weight-rows-h100-2026-12-05.md):

- `bare`: the same two matmuls per expert as plain torch calls on the main thread, nothing else
  (the floor for this CPU, threads and dtype);
- `compute-torch`: `CpuExperts.compute` with `kernel="torch"` (`STRATA_CPU_KERNEL=torch`),
  on the main thread: each expert as two torch matmuls (the path before strata's kernel);
- `compute-main`: `CpuExperts.compute` on the main thread, as the cache calls it (bf16: strata's
  kernel, `strata._cpu_experts`, for experts of up to `KERNEL_MAX_ROWS` rows);
- `compute-static`, `compute-guided`, `compute-steal`: the same with the kernel's tasks in
  equal fixed shares a thread (`CpuExperts.schedule` "static"), in OpenMP's guided shares
  (large first) and in fixed shares that a thread done with its own takes from ("steal"),
  against `compute-main`'s schedule (`CpuExperts`' default);
- `compute-pfN` (`--prefetch-bytes N[,N...]`): `compute-main` with each weight row's next
  cache lines asked for N bytes ahead of the kernel's reads (`CpuExperts.prefetch_bytes`;
  `compute-main` has the default, `_cpu_experts.PREFETCH_BYTES`; `compute-pf0` leaves it to the
  hardware's prefetchers, which stop at each 4 KiB page);
- `kernel-int8`, `kernel-int4` (bf16 stores): strata's kernel over the same experts quantized
  to int8 (per output channel, a little over half the bytes) and to int4 (groups of 32 along
  the input, 0.31x the bytes; `strata.engine.experts.quant`), called directly on the main
  thread: what quantized experts would read (`kernel-int8-steal`, `kernel-int4-steal`: the
  same under the "steal" schedule, at any T: a prompt's calls too); `compute-int8`,
  `compute-int4`: `CpuExperts` over stores of those blobs, as the cache calls it (the kernel up
  to `KERNEL_MAX_ROWS` rows an expert, dequantized torch matmuls beyond);
- `start-dynamic`, `start-steal` (T = 1, strata's kernel), and `start-dynamic-int8` and the
  like over each quantized store: the call as the cache runs a decode call on CUDA,
  `CpuExperts.start` on the kernel's own worker thread (a team one thread short of the cores)
  with the token's one row, then `finish`, under each schedule: under "steal" the thread
  waiting in `finish` takes the call's tasks too, as one more thread of the team, and
  `start-steal-alone` is steal with that thread only waiting (`CpuExperts.caller_helps` off:
  on the H200 steal won on the calling thread's team and lost on the worker's, and this
  tells the helper's part from the team's); `start-dynamic-rowsGxD`, `start-steal-rowsGxD`
  (`--weight-rows GxD[,GxD]`, each 1, 2 or 4): the same with the kernel reading G of gate's and
  up's rows and D adjacent rows of down at once for the token (`CpuExperts.gate_up_rows`,
  `down_rows`); `start-dynamic-downblockN`, `start-steal-downblockN` (`--down-block-rows
  N[,N]`): with pass 2's tasks N rows of down each (`CpuExperts.down_block_rows`; 64 by
  default); `start-dynamic-pinned` (`--pin`): with the worker's team pinned one CPU a thread
  to the process's last CPUs (`CpuExperts.pin_team`);
- `compute-worker`: the same on a worker thread (one `ThreadPoolExecutor` thread), the design
  the cache had before: adds the hand-over and a second intra-op team (the worker's count is
  printed beside the main thread's);
- `worker-main-busy`: the same while the main thread keeps issuing small torch ops until the
  result is ready, as an engine thread launching device work meanwhile would: the worker then
  waits for the GIL between its ops (up to `sys.getswitchinterval()` each), and shares the
  cores.

`--experts N[,N...]` times each T = 1 call again over N distinct experts (a decode round's
calls hold the CPU's share of a layer's misses, 2-3 experts on olmoe at 4 GiB, not the
K experts of T = 1); `--gap-us US[,US...]` waits that long between timed calls, the main
thread busy as the engine's is between a round's calls: OpenMP's idle threads may fall asleep
in a gap, and each call then pays their wake-up. `--wake-us W` starts the kernel's threads
(`CpuExperts.wake`) W microseconds before the end of each gap, as a host could while it waits
for the device.

Each `--memory` kind's store also reports the host memory it took (the drop of MemAvailable
across its making, and the growth of the process's resident memory) beside its blobs' bytes.

Ratios to `bare` are in the same run, so they compare across machines. Medians of `--repeat`.
Each column's GB/s is the experts' bytes over its time, and its share of the host's read
bandwidth, measured in the same run (`host_read_gbps`: a float32 sum over a `--read-mib` buffer
on torch's threads, the best of 5).

`--memory` picks where the store's blobs live: `pageable` (plain torch memory, 4 KiB pages),
`pinned` (`pin_memory=True`: torch's page-locked allocation, the engine's store until
2026-12-04), `pages` (`strata.engine.experts.store.host_blobs`, the engine's store now: one
mapping of 4 KiB pages, page-locked with `cuMemHostRegister` where CUDA is there), `huge` (the
same advised to use 2 MiB pages, as `STRATA_HOST_HUGE_PAGES=1` makes the store): the CPU reads
the same bytes; only the pages differ. `pinned` needs CUDA.

    python bench/cpu_experts.py                    # bf16 and fp32, torch's threads
    python bench/cpu_experts.py --threads 16 --json
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.nn.functional as F

from _common import (
    down_block_rows,
    host_read_bytes_per_s,
    mem_available_bytes,
    rows_at_once,
    rss_bytes,
)
from cpu_experts_report import call_parts, print_report
from cpu_experts_started import start_and_finish, started_columns
from strata import _cpu_experts
from strata.engine.experts import ExpertStore
from strata.engine.experts.cpu import CpuExperts
from strata.engine.experts.quant import int4_blob, int8_blob
from strata.engine.experts.routed import Routed
from strata.engine.experts.store import host_blobs
from strata.engine.model.presets import get_preset

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def host_buffer(n_bytes: int, memory: str) -> torch.Tensor:
    """uint8 [n_bytes] on the host, in `memory`'s kind of pages."""
    if memory == "pageable":
        return torch.empty(n_bytes, dtype=torch.uint8)
    if memory == "pinned":
        return torch.empty(n_bytes, dtype=torch.uint8, pin_memory=True)
    pages, blobs = host_blobs(1, 1, n_bytes, "the bench's experts", huge=memory == "huge")
    if torch.cuda.is_available():
        pages.register(torch.cuda.current_device())
    return blobs.view(-1)


def random_store(hidden_size: int, expert_width: int, n_experts: int,
                 dtype: torch.dtype, memory: str = "pageable", n_layers: int = 1) -> ExpertStore:
    gen = torch.Generator().manual_seed(0)
    numel = 3 * expert_width * hidden_size
    layers = []
    for _ in range(n_layers):
        typed = (torch.randn(n_experts, numel, generator=gen) * hidden_size**-0.5).to(dtype)
        blobs = host_buffer(typed.numel() * typed.element_size(), memory).view(n_experts, -1)
        blobs.copy_(typed.view(torch.uint8))
        layers.append(blobs)
    return ExpertStore(layers, hidden_size, expert_width, dtype)


def routing(n_tokens: int, top_k: int, n_experts: int) -> Routed:
    rng = np.random.default_rng(n_tokens)
    ids = np.stack([rng.choice(n_experts, top_k, replace=False) for _ in range(n_tokens)])
    return Routed.of(ids)


def routings(n_tokens: int, top_k: int, n_experts: int) -> list[Routed]:
    """The routings the calls of a measure take in turn: at T = 1, the experts in a shuffled
    order cut into n_experts // top_k disjoint sets of top_k (each call of a layer reads other
    experts than the last one did, through all of them); else `routing`'s one."""
    if n_tokens != 1 or n_experts < 2 * top_k:
        return [routing(n_tokens, top_k, n_experts)]
    order = np.random.default_rng(n_tokens).permutation(n_experts)
    return [Routed.of(order[i : i + top_k][None])
            for i in range(0, n_experts - top_k + 1, top_k)]


def bare(store: ExpertStore, layer: int, x_rows: torch.Tensor, routed: Routed) -> None:
    f, d = store.expert_width, store.hidden_size
    for i, expert in enumerate(routed.experts.tolist()):
        lo, hi = int(routed.starts[i]), int(routed.starts[i + 1])
        typed = store.blob(layer, expert).view(store.dtype)
        h = F.linear(x_rows[lo:hi], typed[: 2 * f * d].view(2 * f, d))
        F.linear(F.silu(h[:, :f]) * h[:, f:], typed[2 * f * d :].view(d, f))


def busy_until_done(future, scratch: torch.Tensor):
    """Small torch ops on this thread, each taking and giving back the GIL, until `future`."""
    while not future.done():
        scratch.mul_(1.0)
    return future.result()


def median_us(fn, repeat: int, gap_us: float = 0.0, wake=None,
              wake_us: float = 0.0) -> float:
    """The median us of `fn` over `repeat` calls, each after a busy gap of `gap_us`, `wake()`
    called `wake_us` before the gap's end (none: None)."""
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        begin = time.perf_counter()
        until = begin + gap_us * 1e-6
        if wake is not None:
            while time.perf_counter() < until - wake_us * 1e-6:
                pass
            wake()
        while time.perf_counter() < until:  # busy, as the engine's thread between calls
            pass
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


# The quantized columns: (the kernel's format, how a blob is made from gate, up, down, the
# store's format).
QUANTIZED = {
    "kernel-int8": (_cpu_experts.FORMAT_INT8, int8_blob, "int8"),
    "kernel-int4": (_cpu_experts.FORMAT_INT4_G32, lambda *w: int4_blob(*w, group=32),
                    "int4-g32"),
}


def quantized_layers(store: ExpertStore, make_blob) -> list[np.ndarray]:
    """Each layer's experts as quantized blobs: uint8 [E, blob bytes] per layer."""
    layers = []
    for layer in range(store.n_layers):
        blobs = [make_blob(*(w.float() for w in store.weights(layer, e)))
                 for e in range(store.n_experts)]
        layers.append(torch.stack(blobs).numpy())
    return layers


def kernel_call(blobs: np.ndarray, fmt: int, x_rows: torch.Tensor, routed: Routed,
                expert_width: int, threads: int, schedule: str = "dynamic") -> None:
    out = np.empty((routed.n_rows, x_rows.shape[1]), dtype=np.uint16)
    _cpu_experts.compute(blobs, fmt, routed.experts, routed.starts, x_rows.float().numpy(),
                         out, expert_width, threads, schedule)


def _blob_bytes(column: str, store: ExpertStore, quantized: dict | None) -> int:
    """The bytes an expert of `column` reads: its quantized blob's (a column naming "-int8" or
    "-int4"), else the store's."""
    for name in quantized or {}:
        if name.removeprefix("kernel") in column:
            return quantized[name][0].shape[1]
    return store.blob_bytes


def measure(store: ExpertStore, n_tokens: int, top_k: int, threads: int | None,
            repeat: int, quantized: dict[str, list[np.ndarray]] | None = None,
            gap_us: float = 0.0, wake_us: float | None = None,
            prefetches: tuple[int, ...] = (),
            weight_rows: tuple[tuple[int, int], ...] = (),
            down_blocks: tuple[int, ...] = (), pinned: bool = False) -> dict:
    turns = routings(n_tokens, top_k, store.n_experts)
    routed = turns[0]  # the call's routing: `layer()` moves it on (its shape stays the same)
    gen = torch.Generator().manual_seed(1)
    x_rows = torch.randn(routed.n_rows, store.hidden_size, generator=gen).to(store.dtype)
    scratch = torch.zeros(64)
    cpu = CpuExperts(store, threads)
    cpu_torch = CpuExperts(store, threads, kernel="torch")
    scheduled = {}  # compute-static, compute-guided, compute-steal: the kernel's schedules
    for schedule in ("static", "guided", "steal"):
        scheduled[f"compute-{schedule}"] = CpuExperts(store, threads)
        scheduled[f"compute-{schedule}"].schedule = schedule
    for n_bytes in prefetches:  # compute-pfN: the weights prefetched N bytes ahead
        scheduled[f"compute-pf{n_bytes}"] = CpuExperts(store, threads)
        scheduled[f"compute-pf{n_bytes}"].prefetch_bytes = n_bytes
    # `compute-int8`, `compute-int4`: CpuExperts over a store of those blobs, as the cache
    # calls it (the kernel up to KERNEL_MAX_ROWS rows an expert, dequantized matmuls beyond).
    quantized_cpu = {
        name.replace("kernel", "compute"): CpuExperts(ExpertStore(
            [torch.from_numpy(blobs) for blobs in layers], store.hidden_size,
            store.expert_width, store.dtype, QUANTIZED[name][2]), threads)
        for name, layers in (quantized or {}).items()}
    started = started_columns(cpu, quantized_cpu, n_tokens, threads, weight_rows, down_blocks,
                              pinned)
    parts = {name: [] for name in started}  # each started call's `CpuExperts.last_call`
    out = torch.empty((routed.n_rows, store.hidden_size), dtype=store.dtype)  # [R, D]
    pool = ThreadPoolExecutor(max_workers=1)
    calls = itertools.count()
    waking = {"wake": cpu.wake, "wake_us": wake_us} if wake_us is not None else {}

    def layer() -> int:
        """The next layer, round robin, and the next routing each time round the layers (set
        in `routed`): each call reads other weights than the recent ones. Every call below
        passes `layer()` before `routed`, so it reads the routing its layer goes with."""
        nonlocal routed
        call = next(calls)
        routed = turns[call // store.n_layers % len(turns)]
        return call % store.n_layers

    try:
        worker_threads = pool.submit(torch.get_num_threads).result()

        def on_worker():
            return pool.submit(cpu.compute, layer(), x_rows, routed)

        per_expert = {
            "bare": median_us(lambda: bare(store, layer(), x_rows, routed), repeat, gap_us,
                              **waking),
            **{name + suffix: median_us(lambda name=name, schedule=schedule: kernel_call(
                quantized[name][layer()], QUANTIZED[name][0], x_rows, routed,
                store.expert_width, threads or torch.get_num_threads(), schedule), repeat,
                gap_us, **waking)
               for name in quantized or {}
               for suffix, schedule in (("", "dynamic"), ("-steal", "steal"))},
            **{name: median_us(lambda q=q: q.compute(layer(), x_rows, routed), repeat, gap_us,
                               **waking)
               for name, q in quantized_cpu.items()},
            "compute-torch": median_us(lambda: cpu_torch.compute(layer(), x_rows, routed),
                                       repeat, gap_us, **waking),
            "compute-main": median_us(lambda: cpu.compute(layer(), x_rows, routed), repeat,
                                      gap_us, **waking),
            **{name: median_us(lambda c=c: c.compute(layer(), x_rows, routed), repeat, gap_us,
                               **waking)
               for name, c in scheduled.items()},
            **{name: median_us(lambda name=name, c=c: parts[name].append(start_and_finish(
                c, layer(), x_rows[:1], routed, out)), repeat, gap_us, **waking)
               for name, c in started.items()},
            "compute-worker": median_us(lambda: on_worker().result(), repeat, gap_us,
                                        **waking),
            "worker-main-busy": median_us(lambda: busy_until_done(on_worker(), scratch),
                                          repeat, gap_us, **waking),
        }
    finally:
        pool.shutdown()
    per_expert = {k: v / routed.n_experts for k, v in per_expert.items()}
    return {
        "tokens": n_tokens, "experts": routed.n_experts, "rows": routed.n_rows, "gap_us": gap_us,
        "wake_us": wake_us,
        "main_threads": torch.get_num_threads(), "worker_threads": worker_threads,
        "kernel": cpu.kernel, "us_per_expert": per_expert,
        "gbps": {k: _blob_bytes(k, store, quantized) / (v * 1e3) for k, v in per_expert.items()},
        "ratio_to_bare": {k: v / per_expert["bare"] for k, v in per_expert.items()},
        "start_parts": {name: call_parts(times[1:], routed.n_experts
                                         * _blob_bytes(name, store, quantized))
                        for name, times in parts.items()},  # the warm-up call left out
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="olmoe-1b-7b")
    parser.add_argument("--dtypes", default="bf16,fp32", help="comma-separated: bf16, fp32")
    parser.add_argument("--threads", type=int, default=None,
                        help="the worker's cpu_threads and the main thread's (default: torch's)")
    parser.add_argument("--tokens", default="1,64", help="comma-separated T values")
    parser.add_argument("--experts", default="",
                        help="comma-separated N: each T = 1 run again over N distinct experts")
    parser.add_argument("--gap-us", default="0",
                        help="comma-separated microseconds between timed calls (default 0)")
    parser.add_argument("--wake-us", type=float, default=None,
                        help="also run each gap > 0 with the kernel's threads started this "
                        "many microseconds before its end")
    parser.add_argument("--prefetch-bytes", default="",
                        help="comma-separated multiples of 64 (0: none): also time "
                        "compute-main with the weights prefetched that many bytes ahead, "
                        "columns compute-pfN")
    parser.add_argument("--weight-rows", default="",
                        help="comma-separated GxD (G, D: 1, 2 or 4): also time start-dynamic "
                        "and start-steal with the kernel reading G of gate's and up's rows and "
                        "D of down's at once, columns start-dynamic-rowsGxD, "
                        "start-steal-rowsGxD (`CpuExperts.gate_up_rows`, `down_rows`)")
    parser.add_argument("--down-block-rows", default="",
                        help="comma-separated multiples of 16 (up to 1024): also time "
                        "start-dynamic and start-steal with pass 2's tasks that many rows of "
                        "down each, columns start-dynamic-downblockN, start-steal-downblockN "
                        "(`CpuExperts.down_block_rows`)")
    parser.add_argument("--pin", action="store_true",
                        help="also time start-dynamic with the worker's team pinned one CPU a "
                        "thread to the process's last CPUs, column start-dynamic-pinned "
                        "(`CpuExperts.pin_team`)")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--layers", type=int, default=4,
                        help="layers in the store, read round robin (default 4)")
    parser.add_argument("--memory", default="pageable",
                        help="comma-separated: pageable, pinned, pages, huge")
    parser.add_argument("--read-mib", type=int, default=2048,
                        help="MiB the host read bandwidth is measured over (default 2048)")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args(argv)
    if args.read_mib < 1:
        parser.error(f"--read-mib must be >= 1, got {args.read_mib}")
    if args.layers < 1:
        parser.error(f"--layers must be >= 1, got {args.layers}")
    try:
        gaps = [float(us) for us in args.gap_us.split(",")]
        bad_experts = [n for n in args.experts.split(",") if n and not (n.isdigit() and int(n))]
    except ValueError:
        gaps, bad_experts = [-1.0], []
    if any(us < 0 for us in gaps) or bad_experts:
        parser.error(f"--gap-us takes comma-separated microseconds >= 0 and --experts counts "
                     f">= 1, got {args.gap_us!r} and {args.experts!r}")
    prefetches = tuple(int(n) for n in args.prefetch_bytes.split(",") if n.isdigit())
    if len(prefetches) != len([n for n in args.prefetch_bytes.split(",") if n]) \
            or any(n % 64 for n in prefetches):
        parser.error(f"--prefetch-bytes takes comma-separated multiples of 64, got "
                     f"{args.prefetch_bytes!r}")
    weight_rows = rows_at_once(args.weight_rows)
    if weight_rows is None:
        parser.error(f"--weight-rows takes distinct comma-separated GxD, G and D each 1, 2 or "
                     f"4, got {args.weight_rows!r}")
    down_blocks = down_block_rows(args.down_block_rows)
    if down_blocks is None:
        parser.error(f"--down-block-rows takes distinct comma-separated multiples of 16 from 16 "
                     f"to 1024, got {args.down_block_rows!r}")
    down_blocks = tuple(down_blocks)
    memories = args.memory.split(",")
    if set(memories) - {"pageable", "pinned", "pages", "huge"}:
        parser.error(f"--memory takes pageable, pinned, pages, huge; got {args.memory!r}")
    if "pinned" in memories and not torch.cuda.is_available():
        parser.error("--memory pinned needs CUDA")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    preset = get_preset(args.preset)
    read_gbps = host_read_bytes_per_s(args.read_mib) / 1e9
    runs = []
    for memory in memories:
        for name in args.dtypes.split(","):
            store = quantized = None  # the last kind's freed first: its release is not counted
            available, resident = mem_available_bytes(), rss_bytes()
            store = random_store(preset.hidden_size, preset.expert_width, preset.n_experts,
                                 DTYPES[name], memory, args.layers)
            footprint = {"store_bytes": store.n_layers * store.n_experts * store.blob_bytes,
                         "host_taken_bytes": available - mem_available_bytes(),
                         "rss_grown_bytes": rss_bytes() - resident}
            quantized = {column: quantized_layers(store, make_blob)
                         for column, (_, make_blob, _) in QUANTIZED.items()} \
                if name == "bf16" else None
            calls = [(int(t), preset.top_k) for t in args.tokens.split(",")] + [
                (1, int(n)) for n in args.experts.split(",") if n]
            wakes = [None] + ([args.wake_us] if args.wake_us is not None else [])
            for (n_tokens, top_k), gap_us, wake_us in itertools.product(calls, gaps, wakes):
                if wake_us is None or gap_us > wake_us:
                    runs.append({"memory": memory, "dtype": name, **footprint, **measure(
                        store, n_tokens, top_k, args.threads, args.repeat, quantized, gap_us,
                        wake_us, prefetches, tuple(weight_rows), down_blocks, args.pin)})
    result = {
        "command": " ".join(["python", "bench/cpu_experts.py", *(argv or sys.argv[1:])]),
        "date": datetime.date.today().isoformat(), "machine": platform.processor()
        or platform.machine(), "torch": torch.__version__, "preset": args.preset,
        "host_read_gbps": read_gbps, "runs": runs,
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print_report(result, read_gbps, args.read_mib, prefetches, tuple(QUANTIZED))
    return 0


if __name__ == "__main__":
    sys.exit(main())
