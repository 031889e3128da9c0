# Included by _cpu_experts.pyx: `CpuWorker`, a call of the kernel run on a thread of its own.

cdef extern from "_cpu_experts_worker.h" nogil:
    ctypedef struct strata_worker:
        int64_t posted
        int stop
        int64_t posted_ns
        int64_t begun_ns
        int64_t ended_ns
        strata_call_times times
    int strata_worker_start(strata_worker *w)
    void strata_worker_post(strata_worker *w, void (*run)(void *) noexcept nogil, void *job,
                            int n_threads)
    void strata_worker_set_park(
        strata_worker *w, void (*park)(strata_worker *, int64_t, int) noexcept nogil)
    void strata_worker_wait(strata_worker *w)
    void strata_worker_stop(strata_worker *w)
    int strata_spin_until(const int64_t *counter, int64_t target, const int *stop)
    const char *strata_worker_name

# The name of the worker's thread and of its OpenMP team's threads, on Linux (see the header).
WORKER_NAME = (<bytes>strata_worker_name).decode()

cdef extern from "_cpu_experts_pin.h" nogil:
    int strata_pin_save()

# The CPUs a pinned team's threads go back to when it is unpinned: the process's at import,
# read on the importing thread before any team is pinned (`_cpu_experts_pin.h`).
if strata_pin_save():
    raise OSError("could not read the process's CPUs (sched_getaffinity)")
_UNPINNED = np.full(1, -1, dtype=np.intc)  # `Call.pin` of a team put back on those CPUs


cdef void _run_job(void *job) noexcept nogil:
    _run(<const Call *>job)


cdef void _park(strata_worker *w, int64_t taken, int n_threads) noexcept nogil:
    """After job `taken`: each of the job's n_threads team threads spins until the next job is
    posted, or for the worker's spin time (2 ms), or until the worker stops; so a call that
    comes within it finds its team up rather than asleep."""
    cdef int64_t t
    for t in prange(n_threads, num_threads=n_threads, schedule="static"):
        strata_spin_until(&w.posted, taken + 1, &w.stop)


cdef class CpuWorker:
    """One thread that runs `compute`'s calls while the thread that posts them goes on.

    `start` checks a call as `compute` does and hands it to the worker's thread, which runs
    both passes on an OpenMP team of its own (it is the team's master; the poster's thread is
    not in it) and returns at once; `wait` returns when it is done, and `out` holds its rows.
    One call at a time. The arrays stay referenced here until `wait`, so the call never reads
    freed memory. Between calls the thread spins about 2 ms for the next, then sleeps. On Linux
    the thread and its team are named `WORKER_NAME`.
    The bytes are `compute`'s: the same passes over the same tasks.
    """

    cdef strata_worker _worker
    cdef bint _running
    cdef bint _pending
    cdef bint _keep_team_up
    cdef object _team_cpus  # `team_cpus`: a tuple, or None
    cdef object _pin  # its `Call.pin`: the CPUs as C ints, _UNPINNED, or None (never pinned)
    cdef Call _call
    cdef object _keep  # the arrays of the call in flight
    cdef int64_t _waited_ns  # when `wait` saw the last call done; 0: no call waited for yet
    # When the thread in `wait` began and ended taking part in the last call; 0: it did not.
    cdef int64_t _help_begun_ns
    cdef int64_t _help_ended_ns

    def __cinit__(self):
        self._running = False
        self._pending = False
        self._keep_team_up = False
        self._team_cpus = self._pin = None
        self._keep = None
        self._waited_ns = self._help_begun_ns = self._help_ended_ns = 0
        cdef int error = strata_worker_start(&self._worker)
        if error:
            raise OSError(error, "could not start the CPU experts' worker thread")
        self._running = True

    def __dealloc__(self):
        if self._running:
            with nogil:
                strata_worker_wait(&self._worker)
                strata_worker_stop(&self._worker)

    def start(self, const uint8_t[:, ::1] blobs, int fmt, const int64_t[::1] experts,
              const int64_t[::1] row_starts, const float[:, ::1] x, uint16_t[:, ::1] out,
              int64_t expert_width, int n_threads, str schedule="dynamic",
              int64_t prefetch_bytes=PREFETCH_BYTES, int gate_up_rows=GATE_UP_ROWS,
              int down_rows=DOWN_ROWS, int64_t down_block_rows=DOWN_BLOCK_ROWS):
        """Start `compute(blobs, fmt, experts, row_starts, x, out, expert_width, n_threads,
        schedule, prefetch_bytes, gate_up_rows, down_rows, down_block_rows)` on the worker's
        thread and return. ValueError as `compute` raises it, RuntimeError while a call is in
        flight (`wait` for it first); nothing starts then."""
        if self._pending:
            raise RuntimeError("a call is in flight on this CpuWorker: wait() for it first")
        _check(blobs, fmt, experts, row_starts, x, out, expert_width, n_threads, schedule,
               prefetch_bytes, gate_up_rows, down_rows, down_block_rows)
        if self._team_cpus is not None and n_threads > len(self._team_cpus):
            raise ValueError(f"a team of {n_threads} threads, but team_cpus names "
                             f"{len(self._team_cpus)} CPUs: one a thread, or None")
        if out.shape[0] == 0:
            self._waited_ns = 0  # nothing posted: no times to give for this call
            return
        act = np.empty((out.shape[0], expert_width), dtype=np.float32)  # [R, F]
        cdef float[:, ::1] act_view = act
        shares = _shares(n_threads, SCHEDULES[schedule])
        self._call = _call(blobs, fmt, experts, row_starts, x, act_view, out, expert_width,
                           n_threads, SCHEDULES[schedule], prefetch_bytes, gate_up_rows,
                           down_rows, down_block_rows, shares)
        self._call.times = &self._worker.times  # the call's threads note its run here
        cdef const int[::1] pin
        if self._pin is not None:
            pin = self._pin
            self._call.pin = &pin[0]
        self._keep = (blobs, experts, row_starts, x, out, act, shares, self._pin)
        self._pending = True
        with nogil:
            strata_worker_post(&self._worker, _run_job, &self._call, n_threads)

    def wait(self, bint help=True):
        """Return when the call in flight is done (at once when none is), and how many of its
        tasks the calling thread ran.

        Under the "steal" schedule, with `help`, the calling thread first takes the call's
        tasks as one more thread of its team (`_help`) until none is left, rather than
        spinning idle beside the team: the worker's team is one thread short of the cores,
        leaving this thread its core for what it does between `start` and `wait`. Without
        `help` (a benchmark's A/B), and under the other schedules, it only waits, and returns
        0. The bytes are the same either way."""
        cdef int64_t ran = 0
        if not self._pending:
            return 0
        self._help_begun_ns = self._help_ended_ns = 0
        with nogil:
            if help and self._call.shares != NULL:
                self._help_begun_ns = strata_now_ns()
                ran = _help(&self._call)
                self._help_ended_ns = strata_now_ns()
            strata_worker_wait(&self._worker)
            self._waited_ns = strata_now_ns()
        self._pending = False
        self._keep = None
        return ran

    @property
    def last_call_us(self):
        """Where the last call `wait` returned from spent its time, in microseconds:
        (hand_over, team_up, pass1, run, noticed), one after another from `start` posting it
        to `wait` seeing it done. `hand_over`: until the first of its threads began (the
        worker's, or under "steal" the thread in `wait`, which may begin first); `run`: from
        there to the last of them ending; of the run, `team_up` until the team's last thread
        had entered (the threads' wake-up, where they slept; it may end after pass 1, whose
        tasks the threads already up take) and `pass1` until the first of its threads was past
        pass 1, all of its tasks done (gate and up: two thirds of the bytes; the rest of the
        run is pass 2, down); `noticed`: from the run's end to `wait` seeing it. None before
        any call, and after a start that posted nothing (no rows), so that no call's times are
        counted twice. The clock is CLOCK_MONOTONIC; the call pays only a few clock reads for
        them."""
        if not self._waited_ns:
            return None
        w = &self._worker
        begun, ended = w.begun_ns, w.ended_ns
        if self._help_begun_ns:  # the thread in `wait` took part: the call ran on it too
            begun, ended = min(begun, self._help_begun_ns), max(ended, self._help_ended_ns)
        return ((begun - w.posted_ns) / 1e3, (w.times.entered_ns - begun) / 1e3,
                (w.times.pass1_ns - begun) / 1e3, (ended - begun) / 1e3,
                (self._waited_ns - ended) / 1e3)

    @property
    def keep_team_up(self) -> bool:
        """Whether, after each call, the call's OpenMP team spins for the next one (up to 2 ms,
        each thread pausing between its reads) instead of going back to OpenMP, whose idle
        threads sleep after a short spin and cost the next call their wake-up (70-220 us a
        call after a 1 ms gap on the H200: bench/results/offload-omp-wait-h200-2026-12-03.md).
        Off by default: the spinning takes the cores from anything else for those 2 ms. Takes
        effect from the next call that finishes; the bytes are the same either way."""
        return bool(self._keep_team_up)

    @keep_team_up.setter
    def keep_team_up(self, bint on):
        self._keep_team_up = on
        with nogil:
            if on:
                strata_worker_set_park(&self._worker, _park)
            else:
                strata_worker_set_park(&self._worker, NULL)

    @property
    def team_cpus(self):
        """The CPU each thread of a call's team runs on, by thread number (the worker's own
        thread first), as a tuple; None (the default): wherever the scheduler puts them.
        Set between calls; takes effect from the next call, whose threads each move to their
        CPU as they enter it (one syscall a thread, and only where its CPU changes). Set back
        to None, the threads return to the CPUs the process had at import. A call whose team
        is larger than the tuple is refused (ValueError). The bytes are the same either way
        (`_cpu_experts_pin.h`). ValueError for CPUs that repeat or that this process may not
        run on, RuntimeError while a call is in flight."""
        return self._team_cpus

    @team_cpus.setter
    def team_cpus(self, cpus):
        if self._pending:
            raise RuntimeError("a call is in flight on this CpuWorker: wait() for it first")
        if cpus is None:
            if self._pin is not None:  # pinned once: put back on the process's CPUs
                self._pin = _UNPINNED
            self._team_cpus = None
            return
        allowed = os.sched_getaffinity(0)
        given = cpus
        try:
            cpus = tuple(cpus)
        except TypeError:
            cpus = ()  # not a sequence: refused below, named
        if not cpus or len(set(cpus)) != len(cpus) or not all(
                isinstance(cpu, (int, np.integer)) and not isinstance(cpu, bool)
                and cpu in allowed for cpu in cpus):
            raise ValueError(f"team_cpus takes distinct CPUs this process may run on "
                             f"({sorted(allowed)}), one a thread, or None; got {given!r}")
        cpus = tuple(int(cpu) for cpu in cpus)
        self._pin = np.array(cpus, dtype=np.intc)
        self._team_cpus = cpus

    @property
    def pending(self) -> bool:
        """Whether a call is in flight (started and not waited for)."""
        return bool(self._pending)
