"""How strata's CPU kernel runs a call: the settings `CpuExperts` hands each one.

Each is an attribute a benchmark may set for its A/B (bench/cpu_experts.py, bench/offload.py),
checked when set; none changes a byte of the output (`_cpu_experts.compute` computes each value
on one thread in one order whatever they are).
"""

from __future__ import annotations

from strata import _cpu_experts

__all__ = ["KernelSettings"]


def _rows_at_once(name: str, n_rows: int) -> int:
    """n_rows, a count of weight rows read at once (`gate_up_rows`, `down_rows`); ValueError
    naming `name` for anything but 1, 2 or 4."""
    if not isinstance(n_rows, int) or isinstance(n_rows, bool) or n_rows not in (1, 2, 4):
        raise ValueError(f"{name} must be 1, 2 or 4, got {n_rows!r}")
    return n_rows


class KernelSettings:
    """The kernel's settings of a call, each `_cpu_experts.compute`'s argument of that name,
    at the module's defaults until set."""

    def __init__(self) -> None:
        self.schedule = "dynamic"
        self.prefetch_bytes = _cpu_experts.PREFETCH_BYTES
        self.gate_up_rows = _cpu_experts.GATE_UP_ROWS
        self.down_rows = _cpu_experts.DOWN_ROWS
        self.down_block_rows = _cpu_experts.DOWN_BLOCK_ROWS

    def kernel_settings(self) -> tuple[str, int, int, int, int]:
        """(schedule, prefetch_bytes, gate_up_rows, down_rows, down_block_rows): `compute`'s and
        `CpuWorker.start`'s arguments after n_threads (the checked values, read past the
        properties: a decode call's start reads them)."""
        return (self._schedule, self._prefetch_bytes, self._gate_up_rows, self._down_rows,
                self._down_block_rows)

    @property
    def schedule(self) -> str:
        """How strata's kernel hands its tasks to its threads (`_cpu_experts.compute`'s
        `schedule`): "dynamic", one at a time to whichever asks, the default, 1.09-1.10x the
        rounds that the CPU holds on the H200 against "static", equal fixed shares, the
        schedule before (bench/results/offload-balance-staged-h200-2026-12-03.md); "guided"
        and "steal" (fixed shares, a thread done with its own taking the back half of
        another's, and the thread waiting in `finish` taking part: 0.59-0.66x dynamic's time
        alone on the 2-core development machine, bench/results/cpu-passes-cpu-2026-12-04.md
        and cpu-steal-cpu-2026-12-04.md) are there to be measured in rounds. The benchmarks set
        it for their A/B (bench/cpu_experts.py's `compute-static`, `compute-guided` and
        `compute-steal`, bench/offload.py --cpu-schedule); the same bytes whichever.
        ValueError when set to another name."""
        return self._schedule

    @schedule.setter
    def schedule(self, name: str) -> None:
        if name not in _cpu_experts.SCHEDULES:
            raise ValueError(f"schedule must be one of {sorted(_cpu_experts.SCHEDULES)}, got "
                             f"{name!r}")
        self._schedule = name

    @property
    def prefetch_bytes(self) -> int:
        """How far ahead of its reads strata's kernel asks for a weight row's next cache
        lines (`_cpu_experts.compute`'s `prefetch_bytes`): `_cpu_experts.PREFETCH_BYTES` by
        default, 4096, which made an expert 1.5-2.0x as fast as 0, the hardware's prefetchers
        alone (they stop at each 4 KiB page). The benchmarks set it for their A/B
        (bench/cpu_experts.py `--prefetch-bytes`, bench/offload.py `--cpu-prefetch`); the same
        bytes whatever. ValueError when set to anything but a multiple of 64 >= 0."""
        return self._prefetch_bytes

    @prefetch_bytes.setter
    def prefetch_bytes(self, n_bytes: int) -> None:
        if not isinstance(n_bytes, int) or n_bytes < 0 or n_bytes % 64:
            raise ValueError(f"prefetch_bytes must be a multiple of 64 (a cache line) >= 0, "
                             f"got {n_bytes!r}")
        self._prefetch_bytes = n_bytes

    @property
    def gate_up_rows(self) -> int:
        """How many of gate's and up's rows strata's kernel reads at once for one row of x
        (`_cpu_experts.compute`'s `gate_up_rows`): 1, each alone; 2, gate's and up's of one f
        together; 4, those of two f. 1, `_cpu_experts.GATE_UP_ROWS`, by default: the others
        read faster only from the last-level cache on an H100 machine's Xeon, not in a decode
        round. The benchmarks set it for their A/B (bench/cpu_experts.py `--weight-rows`,
        bench/offload.py `--cpu-weight-rows`); the same bytes whichever. ValueError when set to
        another value."""
        return self._gate_up_rows

    @gate_up_rows.setter
    def gate_up_rows(self, n_rows: int) -> None:
        self._gate_up_rows = _rows_at_once("gate_up_rows", n_rows)

    @property
    def down_rows(self) -> int:
        """How many adjacent rows of down strata's kernel reads at once for one row of act
        (`_cpu_experts.compute`'s `down_rows`): 1, `_cpu_experts.DOWN_ROWS`, the default; 2 or
        4, for the benchmarks' A/B as `gate_up_rows`; the same bytes whichever. ValueError when
        set to another value."""
        return self._down_rows

    @down_rows.setter
    def down_rows(self, n_rows: int) -> None:
        self._down_rows = _rows_at_once("down_rows", n_rows)

    @property
    def down_block_rows(self) -> int:
        """How many rows of down one task of the kernel's pass 2 reads
        (`_cpu_experts.compute`'s `down_block_rows`): `_cpu_experts.DOWN_BLOCK_ROWS`, 64, by
        default; others for the benchmarks' A/B (bench/cpu_experts.py `--down-block-rows`,
        bench/offload.py `--cpu-down-block-rows`); the same bytes whatever. ValueError when set
        to anything but a multiple of 16 from 16 to 1024."""
        return self._down_block_rows

    @down_block_rows.setter
    def down_block_rows(self, n_rows: int) -> None:
        if not isinstance(n_rows, int) or isinstance(n_rows, bool) or not 16 <= n_rows <= 1024 \
                or n_rows % 16:
            raise ValueError(f"down_block_rows must be a multiple of 16 from 16 to 1024, got "
                             f"{n_rows!r}")
        self._down_block_rows = n_rows
