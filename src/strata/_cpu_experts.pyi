"""The CPU miss path's kernel: a layer call's experts read in place from the host store.

A blob is bf16 (gate [F, D] | up [F, D] | down [D, F]), int8 (the same matrices in int8, then
their fp32 row scales) or int4 (two weights a byte, then an fp32 scale per group of 32 or 64
along a row): `strata.engine.experts.quant` has the layouts. Each output value is computed by one
thread in one fixed order (the result does not depend on the thread count); the roundings to
bf16 are where torch's bf16 matmul path has them.
"""

from collections.abc import Sequence

import numpy as np

FORMAT_BF16: int
FORMAT_INT8: int
FORMAT_INT4_G32: int
FORMAT_INT4_G64: int
SCHEDULES: dict[str, int]
PREFETCH_BYTES: int  # compute's default prefetch_bytes: 4096
GATE_UP_ROWS: int  # compute's default gate_up_rows: 1
DOWN_ROWS: int  # compute's default down_rows: 1
DOWN_BLOCK_ROWS: int  # compute's default down_block_rows: 64
WORKER_NAME: str  # the name of CpuWorker's thread and its OpenMP team's, on Linux: "strata-cpu"
REVISION: int  # the kernel's revision, part of the kept rates' key: 3

def blob_bytes(fmt: int, expert_width: int, hidden_size: int) -> int:
    """Bytes of one blob of format `fmt` for F and D; ValueError for an unknown format, or an
    int4 one whose group does not divide F and D."""

def compute(
    blobs: np.ndarray,
    fmt: int,
    experts: np.ndarray,
    row_starts: np.ndarray,
    x: np.ndarray,
    out: np.ndarray,
    expert_width: int,
    n_threads: int,
    schedule: str = "dynamic",
    prefetch_bytes: int = 4096,
    gate_up_rows: int = 1,
    down_rows: int = 1,
    down_block_rows: int = 64,
) -> None:
    """Compute `experts` of one layer over their rows, into `out`.

    Args:
        blobs: uint8 [E, blob_bytes(fmt, F, D)], C-contiguous: the layer's blobs, the store's
            bytes, not a copy.
        fmt: FORMAT_BF16, FORMAT_INT8, FORMAT_INT4_G32 or FORMAT_INT4_G64.
        experts: int64 [M]: the blob row of each expert of the call.
        row_starts: int64 [M+1] from 0 to R, not decreasing: expert i owns rows
            [row_starts[i], row_starts[i+1]) of `out` (and of `x`).
        x: float32 [R, D]: each row's input; or [1, D]: the one input every row reads (a
            decode call's token, not copied R times).
        out: uint16 [R, D]: each row's output as bf16 bits (written, not read).
        expert_width: F.
        n_threads: the OpenMP threads of both passes, >= 1.
        schedule: how the passes' tasks reach the threads, a key of `SCHEDULES`: "dynamic"
            (one at a time to whichever thread asks, the default: threads that wake late from
            sleep take fewer), "static" (equal fixed shares), "guided" (large shares first,
            single tasks at the end) or "steal" (equal fixed shares, each taken in order by
            its thread, a thread done with its own taking the back half of another's; fewer
            than 2**31 tasks a pass); the same bytes whichever. No thread waits for the team
            before its first task, and pass 2 starts once pass 1's tasks are done.
        prefetch_bytes: how far ahead of its reads a weight row's dot product asks for the
            next cache lines (software prefetch, across the 4 KiB pages where the hardware's
            prefetchers stop), a multiple of 64; `PREFETCH_BYTES` by default, 0: not at all.
            The same bytes whatever. A quantized row read for four rows of x at once (a
            prompt's) does not prefetch.
        gate_up_rows: how many of pass 1's weight rows are read at once for one row of x: 1
            (gate's, then up's; `GATE_UP_ROWS`, the default), 2 (gate's and up's of one f
            together) or 4 (those of two f, half a block apart): more independent sums and
            streams of memory in flight a thread.
        down_rows: how many adjacent rows of down pass 2 reads at once for one row of x: 1
            (`DOWN_ROWS`, the default), 2 or 4. int4 rows are read one at a time whatever. The
            same bytes whatever both.
        down_block_rows: the rows of down one task of pass 2 reads, a multiple of 16 from 16
            to 1024 (`DOWN_BLOCK_ROWS`, the default, 64: down's rows are short, and pass 1's
            tasks take 16 rows of gate and of up). The same bytes whatever.

    Raises:
        ValueError: an unknown format, shapes that disagree, an expert out of range, bad
            row_starts, n_threads < 1, an unknown schedule, rows at once not 1, 2 or 4, a
            down_block_rows not a multiple of 16 from 16 to 1024, a
            prefetch_bytes that is not a multiple of 64 >= 0, or a "steal" call of 2**31
            tasks a pass or more, before anything is written.
    """

def wake(n_threads: int) -> None:
    """Start the n_threads OpenMP team `compute` runs on (an empty task a thread), so that its
    threads are up when the next call comes; returns once all have arrived. ValueError for
    n_threads < 1."""

def shrink_team() -> None:
    """Run an empty two-thread OpenMP region on the calling thread, so that libgomp keeps one
    idle thread for it and lets the others exit: with fewer OpenMP threads than CPUs, idle
    threads spin before they sleep (about a microsecond otherwise)."""

def n_tasks(n_experts: int, expert_width: int, hidden_size: int,
            down_block_rows: int = 64) -> int:
    """The tasks a call of n_experts experts of width F and hidden size D makes, both passes:
    M * (ceil(F / 16) + ceil(D / down_block_rows)); ValueError for down_block_rows < 1."""

def tally_passes(
    n_threads: int,
    schedule: str,
    n1: int,
    n2: int,
    spins: int = 0,
    helper: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """For the tests: n1 pass-1 and n2 pass-2 tasks that only count, run as `compute` runs a
    call's (n_threads threads, `schedule`; with `helper`, on a worker thread while the caller
    takes part, "steal" only). Returns (runs1 [n1], runs2 [n2], seen [n2], helped): the times
    each task ran, the pass-1 tasks finished when each pass-2 task began, and the tasks the
    calling thread ran. Each task spins `spins` times. ValueError for a bad argument."""

class CpuWorker:
    """One thread that runs `compute`'s calls while the thread that posts them goes on: the
    master of an OpenMP team of its own. One call at a time; the call's arrays are kept
    referenced until `wait`. OSError when the thread cannot be started."""

    def start(
        self,
        blobs: np.ndarray,
        fmt: int,
        experts: np.ndarray,
        row_starts: np.ndarray,
        x: np.ndarray,
        out: np.ndarray,
        expert_width: int,
        n_threads: int,
        schedule: str = "dynamic",
        prefetch_bytes: int = 4096,
        gate_up_rows: int = 1,
        down_rows: int = 1,
        down_block_rows: int = 64,
    ) -> None:
        """Start `compute` with these arguments on the worker's thread and return at once.
        ValueError as `compute` raises it; RuntimeError while a call is in flight."""

    def wait(self, help: bool = True) -> int:
        """Return when the call in flight is done (at once when none is), and how many of its
        tasks the calling thread ran: under the "steal" schedule, with `help`, it takes the
        call's tasks as one more thread of the team (halves of the team's shares) until none
        is left; without `help`, or under the others, it only waits (0). The same bytes either
        way."""

    @property
    def last_call_us(self) -> tuple[float, float, float, float, float] | None:
        """The last call `wait` returned from, in microseconds, one after another: (hand_over:
        posted to its first thread beginning (the worker's, or under "steal" `wait`'s), then
        of the run team_up: to the team's last thread entering, and pass1: to its first thread
        past pass 1, run: to its last thread ending, noticed: then to `wait` seeing it); None
        before any, and after a start of no rows (nothing posted)."""

    @property
    def keep_team_up(self) -> bool:
        """Whether, after each call, the call's OpenMP team spins for the next (up to 2 ms)
        rather than going back to OpenMP, whose idle threads soon sleep. Off by default; from
        the next call that finishes; the same bytes either way."""

    @keep_team_up.setter
    def keep_team_up(self, on: bool) -> None: ...

    @property
    def team_cpus(self) -> tuple[int, ...] | None:
        """The CPU each thread of a call's team runs on, by thread number (the worker's own
        first); None (the default): wherever the scheduler puts them. Set between calls, from
        the next call on; set back to None, the threads return to the process's CPUs at
        import. A larger team than the tuple: ValueError at `start`. The same bytes either
        way. ValueError for repeated CPUs or ones this process may not run on, RuntimeError
        while a call is in flight."""

    @team_cpus.setter
    def team_cpus(self, cpus: Sequence[int] | None) -> None: ...

    @property
    def pending(self) -> bool:
        """Whether a call is in flight (started and not waited for)."""
