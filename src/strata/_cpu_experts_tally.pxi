# Included by _cpu_experts.pyx: `tally_passes`, the passes' scheduling run over tasks that only
# count, so that a test sees what the kernel's bytes cannot: a task run twice writes the same
# bytes twice, and a pass-2 task begun early may still read finished values by luck.

cdef extern from *:
    """
    static inline void strata_tally_add(int64_t *counter) {
        __atomic_fetch_add(counter, 1, __ATOMIC_ACQ_REL);
    }
    static inline int64_t strata_tally_read(const int64_t *counter) {
        return __atomic_load_n(counter, __ATOMIC_ACQUIRE);
    }
    """
    void strata_tally_add(int64_t *counter) nogil
    int64_t strata_tally_read(const int64_t *counter) nogil


cdef struct Tally:
    # A counting call: each task adds one to its count and spins `spins` times.
    int64_t *runs1  # [n1]: the times each pass-1 task ran
    int64_t *runs2  # [n2]: the times each pass-2 task ran
    int64_t *seen  # [n2]: pass-1 tasks finished when each pass-2 task began
    int64_t *finished1  # [1]: pass-1 tasks finished so far
    int64_t spins
    int n_threads
    int schedule
    void *shares
    int64_t n1
    int64_t n2


cdef inline void _spin(int64_t spins) noexcept nogil:
    cdef volatile int64_t i = 0
    while i < spins:
        i += 1


cdef void _tally1(const void *call, int64_t task) noexcept nogil:
    cdef const Tally *t = <const Tally *>call
    strata_tally_add(&t.runs1[task])
    _spin(t.spins)
    strata_tally_add(t.finished1)


cdef void _tally2(const void *call, int64_t task) noexcept nogil:
    cdef const Tally *t = <const Tally *>call
    t.seen[task] = strata_tally_read(t.finished1)
    strata_tally_add(&t.runs2[task])
    _spin(t.spins)


cdef void _tally_job(void *job) noexcept nogil:
    cdef Tally *t = <Tally *>job
    strata_two_passes(t, t.n_threads, t.schedule, t.shares, _tally1, t.n1, _tally2, t.n2,
                      NULL, NULL)


def tally_passes(int n_threads, str schedule, int64_t n1, int64_t n2, int64_t spins=0,
                 bint helper=False):
    """Run n1 pass-1 and n2 pass-2 tasks that only count, as `compute` runs a call's (on
    n_threads threads as `schedule` says), and return (runs1 [n1], runs2 [n2], seen [n2],
    helped): the times each task ran, the pass-1 tasks finished when each pass-2 task began,
    and the tasks the calling thread ran. Each task spins `spins` times, so that threads
    overlap. `helper`: the call runs on a worker thread while the calling thread takes part,
    as `CpuWorker.wait` does (steal only). For the tests; ValueError for a bad argument."""
    if schedule not in SCHEDULES or n_threads < 1 or n1 < 0 or n2 < 0 or n1 >= 2**31 \
            or n2 >= 2**31 or (helper and schedule != "steal"):
        raise ValueError(f"tally_passes takes n_threads >= 1, a schedule of {sorted(SCHEDULES)}, "
                         f"0 <= n1, n2 < 2**31 and a helper only under 'steal', got "
                         f"{n_threads}, {schedule!r}, {n1}, {n2}, helper={helper}")
    runs1 = np.zeros(max(n1, 1), dtype=np.int64)
    runs2 = np.zeros(max(n2, 1), dtype=np.int64)
    seen = np.full(max(n2, 1), -1, dtype=np.int64)
    finished1 = np.zeros(1, dtype=np.int64)
    shares = _shares(n_threads, SCHEDULES[schedule])
    cdef int64_t[::1] runs1_view = runs1, runs2_view = runs2, seen_view = seen
    cdef int64_t[::1] finished_view = finished1
    cdef Tally tally
    cdef strata_worker worker
    cdef int64_t helped = 0
    tally.runs1, tally.runs2, tally.seen = &runs1_view[0], &runs2_view[0], &seen_view[0]
    tally.finished1 = &finished_view[0]
    tally.spins, tally.n_threads, tally.schedule = spins, n_threads, SCHEDULES[schedule]
    tally.n1, tally.n2 = n1, n2
    tally.shares = _steal_state(shares, n_threads, n1, n2)
    if not helper:
        with nogil:
            _tally_job(&tally)
    else:
        if strata_worker_start(&worker):
            raise OSError("could not start a worker thread")
        with nogil:
            strata_worker_post(&worker, _tally_job, &tally, n_threads)
            helped = strata_steal_passes(&tally, tally.shares, n_threads, n_threads, _tally1,
                                         n1, _tally2, NULL)
            strata_worker_wait(&worker)
            strata_worker_stop(&worker)
    return runs1[:n1], runs2[:n2], seen[:n2], helped
