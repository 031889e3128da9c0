"""Times of the two sides of a decode layer's misses, measured, and the split they give.

Dimension letters: K experts per token, M missed experts of a layer call, D hidden size,
F expert width, B blob bytes.

In a decode call (one token) the cache's misses go two ways at once: the CPU computes some from
the host store (`CpuExperts`), the copy engine uploads the others into a staging buffer where
the device computes them (`StreamedMisses`). A layer is done when both are, so the best split
of M misses streams the s that minimizes max(stream_s[s], cpu_s[M - s]): `stream_s[k]` the
seconds to upload and compute k blobs, `cpu_s[k]` the seconds the CPU takes for k experts, both
measured here for k = 0..K (`MissRates`, `balanced_split`). With times proportional to k (no
fixed costs) that is s = M * stream_rate / (stream_rate + cpu_rate), rounded; the table also
carries each side's fixed cost per call. The hits' compute, which runs on the device before the
streamed copies in stream order, is left out: on the GPU it is a few tens of microseconds
against the copies' fraction of a millisecond an expert. So is the two sides' contention for
the host's memory while both read it.

Measured alone, the two sides mislead: on the H200 the split they gave was 1.2x slower in
whole rounds than a fixed one (bench/results/offload-split-h200-2026-12-02.md), because in a
call both sides read the host's memory at once and each carries costs of its own per call (the
CPU's threads, the device's launches), which sharing the misses pays twice. So `joint_s` is
also measured: `joint_s[M][s]`, the wall time of a call of M misses with s streamed, both
sides run as a call runs them (the device's share queued first, the CPU's computed meanwhile,
then the wait for the device). The split took each M's fastest s from it, where it is there
(`MissRates.split`); a table kept without it (measured by an earlier strata) splits by the
two sides' times.

Those calls are whole calls (the device's kernels launched from the host, as
`token_forward` runs them), while a decode round on CUDA splits its calls around the graphs
(`strata.engine.cache.graph_call`: the device's share is only its uploads on the host, and
the staged experts are computed by the next graph). On the H200 the whole calls' split tied
a fixed half of K on olmoe-1b-7b and was 1.17x slower on a 16-layer qwen3-30b-a3b, where it
streamed nothing below 4 misses (bench/results/offload-host-h200-2026-12-02.md). So
`staged_s` is measured too: `staged_s[M][s]`, the wall time of a call as `fill_misses` and
the next graph run it (the s blobs staged, the other M - s experts computed on the CPU
meanwhile, then the staged experts computed on the device after their uploads). The split
is taken from it first, then from `joint_s` (each M's fastest s, then; the rule is below): a
table kept by a strata that measured neither, or only whole calls, splits as it did. In a
round on the H200 that split (0,1,2,2,3,3,4,4,4 on olmoe-1b-7b at 4 GiB) was still 1.07x
slower than streaming a fixed 2 (bench/results/offload-balance-staged-h200-2026-12-03.md):
calls timed back to back do not pay what a round's calls do on the CPU's side, whose threads
wake after each wait for the device. So the calls of both sides are now timed as a round runs them
(`strata.engine.cache.rate_calls`): each after an untimed wait of the host, a split call's
CPU share on the CPU's own thread (the caller's OpenMP pool shrunk first, as in a round), the
engine thread's calls and the split calls one kind after the other each round; the key names
the timing (`TIMING`), so rates kept by a strata that timed calls otherwise are measured
anew.

Even so, timed calls carry fixed costs a round's calls do not: on an H100 machine on
2026-12-07 one expert streamed alone took 335 µs and one on the CPU alone 670, against about
90 and 70 µs an expert in the rounds, and each M's fastest call streamed so much
(0,1,2,3,3,4,4,4,5) that tables streaming less took 0.73-0.88x its rounds
(bench/results/split-tables-h100-2026-12-07.md). So the split balances the two sides'
per-expert times fitted to the same calls instead, their fixed costs left out ("slopes",
`per_expert_s`): on an H100 machine on 2026-12-07 its rounds took 0.71x (uniform routing) and
0.76x (skewed) those of each M's fastest call ("calls";
bench/results/split-rule-h100-2026-12-07.md). The rule, "slopes-upload" (`SPLIT_RULE`,
`upload_fixed_s`), adds the uploads' fixed cost a call, which a round pays too, to the
device's side: 0.87-0.94x the slopes' rounds on two H100 machines on 2026-12-08
(split-rule-upload-h100-2026-12-08.md).

The times depend on the machine and the configuration (`RatesKey`: the GPU's name, the CPU's
model, the CPU experts' threads, the dtype, the experts' format and the expert's shape), not on
the weights, and the split made from them is part of what the output bytes depend on: they
are measured once and kept (`strata.engine.cache.kept_rates`), never taken during a run.

`measure_rates` times its calls over a synthetic store of the model's expert shape
(`rate_calls.synthetic_store`: the checkpoint is not loaded yet when the budget is planned,
and the staging buffer is part of the budget). The medians of `REPEAT` timed rounds after an
untimed one; each side's table made non-decreasing in k. Off CUDA the same code runs as the
host twin (a host-to-host copy for the upload, `perf_counter` for the clock), which is what
the tests exercise.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import platform
import statistics
from dataclasses import dataclass

import torch

from strata.engine.cache.rate_calls import ROUND_GAP_S, TimedCalls, samples, synthetic_store
from strata.engine.experts.cpu import default_team, kernel_id
from strata.engine.experts.quant import expert_blob_bytes
from strata.engine.experts.streamed import StreamSplit
from strata.engine.model.config import ModelConfig

__all__ = ["SPLIT_RULE", "SPLIT_RULES", "MissRates", "RatesKey", "balanced_split", "cpu_model",
           "measure_rates", "per_expert_s", "upload_fixed_s"]

REPEAT = 7  # timed rounds of every k, after one untimed
# How a timed grid of calls gives the split (`MissRates.split`; the module): each M's fastest
# call, the two sides' per-expert times balanced, or those with the uploads' fixed cost a call
# on the device's side, the rule. bench/offload.py --split-rules times each beside auto's.
SPLIT_RULES = ("calls", "slopes", "slopes-upload")
SPLIT_RULE = "slopes-upload"
TARGET_BYTES = 512 << 20  # the synthetic store: at least this many bytes, read round robin
# How the calls are timed (`rate_calls`), part of the key: rates kept by a strata that timed
# them otherwise are measured anew. "round-gap500us-shrunk-grouped-grown-primed": each call
# after the round's untimed gap of 0.5 ms, a split call's CPU share on the CPU's own thread
# with the caller's OpenMP pool shrunk first (`CpuExperts.shrink_caller_team`, on by
# default), the engine thread's calls and the split calls timed apart, one kind after the
# other, each round, the engine thread's pool grown again by an untimed call before its calls
# are timed, and shrunk again by an untimed split call before the split calls are timed, so
# that none of them pays the shrink (`rate_calls.samples`).
TIMING = f"round-gap{round(ROUND_GAP_S * 1e6)}us-shrunk-grouped-grown-primed"


@dataclass(frozen=True)
class RatesKey:
    """What the times depend on: the device (a GPU's name; "cpu" for the host twin), the CPU's
    model, the CPU experts' threads, the team a split call's CPU share runs on (`default_team`
    of them) and kernel (`kernel_id`: with its prefetch distance), the dtype, the experts'
    format (`quant`: a quantized store's blobs are fewer bytes, read by the kernel's own code
    for the format; None, the dtype's own blobs), the expert's shape and K, and how the calls
    were timed (`TIMING`)."""

    device: str
    cpu: str
    threads: int
    team: int
    kernel: str
    dtype: str
    hidden_size: int
    expert_width: int
    top_k: int
    timing: str = TIMING
    quant: str | None = None

    @classmethod
    def of(cls, config: ModelConfig, dtype: torch.dtype, device: torch.device,
           cpu_threads: int | None = None, quant: str | None = None) -> RatesKey:
        """ValueError for a `quant` that is not a format (`expert_blob_bytes`)."""
        device = torch.device(device)
        if quant is not None:
            expert_blob_bytes(config.expert_width, config.hidden_size, dtype, quant)
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        threads = cpu_threads or torch.get_num_threads()
        return cls(device=name, cpu=cpu_model(), threads=threads, team=default_team(threads),
                   kernel=kernel_id(dtype), dtype=str(dtype).removeprefix("torch."),
                   hidden_size=config.hidden_size, expert_width=config.expert_width,
                   top_k=config.top_k, quant=quant)

    @property
    def blob_bytes(self) -> int:
        return expert_blob_bytes(self.expert_width, self.hidden_size, getattr(torch, self.dtype),
                                 self.quant)

    def text(self) -> str:
        """The key of its entry in the file: readable, one line. Rates kept before the team
        was part of it were timed on a team one short of the threads, and are measured anew."""
        experts = f" experts in {self.quant}" if self.quant is not None else ""
        return (f"{self.device} | {self.cpu} | {self.threads} threads, team {self.team}, "
                f"{self.kernel} kernel | "
                f"{self.dtype}{experts} | "
                f"D {self.hidden_size} F {self.expert_width} K {self.top_k} | "
                f"timed {self.timing}")


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what `platform` knows."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


_Line = tuple[float, float]  # (seconds an expert, seconds a call): a side's calls fitted


def _one_side_lines(grid: tuple[tuple[float, ...], ...]) -> tuple[_Line, _Line]:
    """((slope, intercept) of the calls that stream every miss, grid[M][M]; the same of those
    that stream none, grid[M][0]) over M = K // 2 (at least 1) .. K of `grid` (`staged_s` or
    `joint_s`): the repeated median (each call's median slope to the others, their median;
    the intercept the median of what is left): one noisy call of five moves it little, where
    it flipped least squares' slope (an H100's CPU calls on 2026-12-08: 67 µs an expert, 149
    by the fallback). A slope that is not positive is the largest M's call over M, intercept 0."""
    k = len(grid) - 1
    ms = range(max(1, k // 2), k + 1)

    def line(times: list[float]) -> _Line:
        if len(times) > 1:
            fitted = statistics.median(statistics.median(
                (t - t_i) / (m - m_i) for m, t in zip(ms, times, strict=True) if m != m_i)
                for m_i, t_i in zip(ms, times, strict=True))
            if fitted > 0:
                return fitted, statistics.median(
                    t - fitted * m for m, t in zip(ms, times, strict=True))
        return times[-1] / k, 0.0

    return line([grid[m][m] for m in ms]), line([grid[m][0] for m in ms])


def per_expert_s(grid: tuple[tuple[float, ...], ...]) -> tuple[float, float]:
    """(stream, cpu): the seconds one more expert adds to a call of a side alone in `grid`
    (`MissRates.staged_s` or `joint_s`): the slopes of `_one_side_lines`. The calls'
    intercepts, their fixed costs, are left out (the module)."""
    (stream_t, _), (cpu_t, _) = _one_side_lines(grid)
    return stream_t, cpu_t


def upload_fixed_s(grid: tuple[tuple[float, ...], ...]) -> float:
    """The seconds a call that streams any miss pays once, whatever its count: the intercept
    of the calls that stream every miss in `grid` (`_one_side_lines`), at least 0."""
    (_, fixed), _ = _one_side_lines(grid)
    return max(fixed, 0.0)


def balanced_split(stream_s: tuple[float, ...], cpu_s: tuple[float, ...]) -> tuple[int, ...]:
    """counts[M] for M = 0..K: the s in [0, M] that minimizes max(stream_s[s], cpu_s[M - s]),
    the smaller s on a tie (fewer uploads)."""
    if len(stream_s) != len(cpu_s) or not stream_s:
        raise ValueError(f"the two tables must be [K + 1] alike, got {len(stream_s)} and "
                         f"{len(cpu_s)}")
    return tuple(min(range(m + 1), key=lambda s, m=m: (max(stream_s[s], cpu_s[m - s]), s))
                 for m in range(len(cpu_s)))


@dataclass(frozen=True)
class MissRates:
    """Seconds for k of a decode layer call's missed experts, k = 0..K (index 0 is 0.0):
    `stream_s[k]` uploading k blobs from the pinned store and computing them on the device
    (`StreamedMisses.compute`), `cpu_s[k]` computing k experts on the CPU
    (`CpuExperts.compute`). `measured` is the date; `source` says where they came from."""

    stream_s: tuple[float, ...]
    cpu_s: tuple[float, ...]
    blob_bytes: int
    measured: str = ""
    source: str = ""
    # joint_s[M][s] for M = 0..K, s = 0..M: a whole call's wall time with M misses, s
    # streamed; staged_s[M][s] the same of a call split around the graphs (the module); ()
    # where not measured.
    joint_s: tuple[tuple[float, ...], ...] = ()
    staged_s: tuple[tuple[float, ...], ...] = ()

    def __post_init__(self) -> None:
        for name in ("stream_s", "cpu_s"):
            table = tuple(getattr(self, name))
            object.__setattr__(self, name, table)
            if len(table) < 2 or table[0] != 0.0 or not all(
                    isinstance(t, float) and math.isfinite(t) and t >= 0 for t in table):
                raise ValueError(f"{name} must be [0.0, t1, ..., tK] of finite seconds >= 0, "
                                 f"got {list(table)}")
        if len(self.stream_s) != len(self.cpu_s):
            raise ValueError(f"stream_s and cpu_s must both be [K + 1], got "
                             f"{len(self.stream_s)} and {len(self.cpu_s)}")
        for name in ("joint_s", "staged_s"):
            grid = tuple(tuple(row) for row in getattr(self, name))
            object.__setattr__(self, name, grid)
            if grid and (len(grid) != len(self.cpu_s) or grid[0] != (0.0,) or any(
                    len(row) != m + 1 or not all(isinstance(t, float) and math.isfinite(t)
                                                 and t >= 0 for t in row)
                    for m, row in enumerate(grid))):
                raise ValueError(f"{name} must be [[0.0], [t10, t11], ..., [tK0, ..., tKK]] of "
                                 f"finite seconds >= 0 (row M: s = 0..M), got "
                                 f"{[list(row) for row in grid]}")
        if isinstance(self.blob_bytes, bool) or not isinstance(self.blob_bytes, int) \
                or self.blob_bytes < 1:
            raise ValueError(f"blob_bytes must be an int >= 1, got {self.blob_bytes!r}")

    @property
    def top_k(self) -> int:
        return len(self.cpu_s) - 1

    def _rate(self, table: tuple[float, ...]) -> float:
        k = self.top_k
        return k * self.blob_bytes / table[k] if table[k] > 0 else math.inf

    @property
    def stream_bytes_per_s(self) -> float:
        """Blob bytes a second through the bus and the device's compute, at K blobs."""
        return self._rate(self.stream_s)

    @property
    def cpu_bytes_per_s(self) -> float:
        """Expert bytes a second the CPU reads computing K experts."""
        return self._rate(self.cpu_s)

    @property
    def timed_calls(self) -> str:
        """What the split is taken from: "split" calls (`staged_s`), "whole" calls
        (`joint_s`), or "" (each side timed alone)."""
        return "split" if self.staged_s else "whole" if self.joint_s else ""

    def split(self, rule: str | None = None) -> StreamSplit:
        """The split by `rule` (default `SPLIT_RULE`) where `staged_s`, else `joint_s`, was
        timed: "calls", for each M the s of the fastest call (the smaller s on a tie: fewer
        uploads); "slopes", the split that makes the two sides finish together at their
        per-expert times in those calls (`per_expert_s`), without the calls' fixed costs;
        "slopes-upload", the same with the fixed cost of the calls that stream every miss
        (`upload_fixed_s`) added to the device's side of any s > 0. Without either grid,
        the split that makes the two sides alone finish together (`balanced_split`).
        ValueError for another rule."""
        rule = SPLIT_RULE if rule is None else rule
        if rule not in SPLIT_RULES:
            raise ValueError(f"a split rule is one of {SPLIT_RULES}, got {rule!r}")
        grid = self.staged_s or self.joint_s
        if grid and rule == "calls":
            counts = tuple(min(range(len(row)), key=lambda s, row=row: (row[s], s))
                           for row in grid)
        elif grid:
            stream_t, cpu_t = per_expert_s(grid)
            fixed = upload_fixed_s(grid) if rule == "slopes-upload" else 0.0
            ks = range(self.top_k + 1)
            counts = balanced_split(tuple((fixed if k else 0.0) + k * stream_t for k in ks),
                                    tuple(k * cpu_t for k in ks))
        else:
            counts = balanced_split(self.stream_s, self.cpu_s)
        return StreamSplit(counts, f"--stream-misses auto ({self.source})")

    def as_entry(self) -> dict:
        """The file's entry (JSON floats round-trip exactly, so a run that measured splits as
        every later run that reads them)."""
        entry = {"stream_s": list(self.stream_s), "cpu_s": list(self.cpu_s),
                 "blob_bytes": self.blob_bytes, "measured": self.measured,
                 "stream_gb_s": self.stream_bytes_per_s / 1e9,
                 "cpu_gb_s": self.cpu_bytes_per_s / 1e9}
        for name in ("joint_s", "staged_s"):
            if getattr(self, name):
                entry[name] = [list(row) for row in getattr(self, name)]
        return entry

    @classmethod
    def from_entry(cls, entry: object, source: str) -> MissRates:
        """ValueError for an entry that is not one `as_entry` wrote."""
        if not isinstance(entry, dict):
            raise ValueError(f"an entry is an object, got {type(entry).__name__}")
        try:
            return cls(stream_s=tuple(entry["stream_s"]), cpu_s=tuple(entry["cpu_s"]),
                       blob_bytes=entry["blob_bytes"], measured=str(entry.get("measured", "")),
                       source=source, joint_s=tuple(map(tuple, entry.get("joint_s", ()))),
                       staged_s=tuple(map(tuple, entry.get("staged_s", ()))))
        except (KeyError, TypeError) as err:
            raise ValueError(f"an entry lacks or mistypes {err}") from None

    def note(self, split: StreamSplit, threads: int) -> str:
        """One line for the startup notes: the split, the rates, where they came from."""
        how = _HOW_TIMED[self.timed_calls]
        if self.timed_calls:
            how += _HOW_SPLIT[SPLIT_RULE]
        return (f"--stream-misses auto: of M = 0..{self.top_k} missed experts a decode layer "
                f"streams {split.text()} to the device ({split.n_blobs} staging blobs), the CPU "
                f"the rest; rates: upload and compute {self.stream_bytes_per_s / 1e9:.1f} GB/s, "
                f"CPU experts {self.cpu_bytes_per_s / 1e9:.1f} GB/s on {threads} threads (at "
                f"{self.top_k} experts), split by {how}, {self.source}")


_HOW_SPLIT = {"slopes": ", their per-expert times balanced", "calls": ", each M's fastest call",
              "slopes-upload": ", their per-expert times and the uploads' fixed cost balanced"}
_HOW_TIMED = {"split": "both sides timed together in calls split around the graphs",
              "whole": "both sides timed together in whole calls",
              "": "each side timed alone"}


def _table(samples: list[list[float]]) -> tuple[float, ...]:
    """[0.0, median of k = 1, ...], made non-decreasing."""
    out = [0.0]
    for k in range(1, len(samples)):
        out.append(max(out[-1], float(statistics.median(samples[k]))))
    return tuple(out)


def measure_rates(key: RatesKey, dtype: torch.dtype, device: torch.device, *,
                  cpu_threads: int | None = None, repeat: int = REPEAT,
                  target_bytes: int = TARGET_BYTES, gap_s: float = ROUND_GAP_S) -> MissRates:
    """Time both sides for k = 1..K on `device` (see the module), each call after the host's
    untimed `gap_s` (`rate_calls.ROUND_GAP_S`, the key's `TIMING`; another gap is for a
    benchmark's A/B, its rates not to be kept under this key); `source` left empty."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    store = synthetic_store(key.hidden_size, key.expert_width, key.top_k, dtype,
                            device.type == "cuda", target_bytes, key.quant)
    try:
        stream_t, cpu_t, joint_t, staged_t = samples(
            TimedCalls(store, key.top_k, device, cpu_threads, gap_s), key.top_k, repeat)
    finally:
        store.close()  # unlocked here, not whenever the collector frees it
        del store
        if device.type == "cuda" and hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()  # give the pinned buffer back to the system
    return MissRates(_table(stream_t), _table(cpu_t), key.blob_bytes,
                     measured=datetime.date.today().isoformat(), joint_s=_grid(joint_t),
                     staged_s=_grid(staged_t))


def _grid(samples: list[list[list[float]]]) -> tuple[tuple[float, ...], ...]:
    """[[0.0], [median of M = 1, s = 0, 1], ...]: each call's median, as measured (() for no
    samples)."""
    if not samples:
        return ()
    return ((0.0,), *(tuple(float(statistics.median(t)) for t in row) for row in samples[1:]))
