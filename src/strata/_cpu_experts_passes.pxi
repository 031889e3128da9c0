# Included by _cpu_experts.pyx: how a call's two passes of tasks reach the threads
# (`_cpu_experts_passes.h`), and a thread from outside the team taking part (`_help`).

# How a pass's tasks reach the threads (`compute`'s `schedule`). Between a decode round's calls
# the host waits for the device long enough for idle threads to sleep, and they wake at
# different times (bench/results/offload-omp-wait-h200-2026-12-03.md). With equal fixed shares
# (static) a pass lasts until the last thread to wake has done its share; handed out one at a
# time (dynamic, the default) the threads already up take the tasks of those still waking, at
# the cost of each thread's long runs of adjacent rows; guided hands out large shares first and
# single tasks at the end; steal gives each thread a fixed share to take in order (its long
# runs of adjacent rows, as static) and lets a thread done with its own take the back half of
# another's (as dynamic lets it, each thread still reading runs of adjacent rows); under steal
# the thread waiting for a `CpuWorker` call takes tasks too. Which thread computes a task never
# changes its bytes. The passes run in `_cpu_experts_passes.h`, where no thread waits for the
# team before its first task.
cdef extern from "_cpu_experts_passes.h" nogil:
    ctypedef void (*strata_task)(const void *call, int64_t task) noexcept nogil
    enum:
        SCHEDULE_DYNAMIC
        SCHEDULE_STATIC
        SCHEDULE_GUIDED
        SCHEDULE_STEAL
    enum:
        SHARE_BYTES  # sizeof(strata_share): a cache line
    void strata_two_passes(const void *call, int n_threads, int schedule, void *shares,
                           strata_task pass1, int64_t n1, strata_task pass2, int64_t n2,
                           strata_call_times *times, const int *pin)
    int64_t strata_now_ns()
    void strata_steal_init(void *shares, int n_threads, int64_t n1, int64_t n2)
    int64_t strata_steal_passes(const void *call, void *shares, int n_threads, int me,
                                strata_task pass1, int64_t n1, strata_task pass2,
                                strata_call_times *times)

SCHEDULES = {"dynamic": SCHEDULE_DYNAMIC, "static": SCHEDULE_STATIC, "guided": SCHEDULE_GUIDED,
             "steal": SCHEDULE_STEAL}


cdef inline int64_t _blocks(int64_t n_rows, int64_t block_rows) noexcept nogil:
    """The tasks of block_rows rows that n_rows rows of an expert make."""
    return (n_rows + block_rows - 1) // block_rows


cdef void _pass1_task(const void *call, int64_t task) noexcept nogil:
    cdef const Call *c = <const Call *>call
    _activation_task(c, _blocks(c.f_width, BLOCK_ROWS), _scales_at(c.fmt, c.f_width, c.d_hidden),
                     task)


cdef void _pass2_task(const void *call, int64_t task) noexcept nogil:
    cdef const Call *c = <const Call *>call
    _output_task(c, _blocks(c.d_hidden, c.down_block), _scales_at(c.fmt, c.f_width, c.d_hidden),
                 task)


cdef inline int64_t _tasks1(const Call *c) noexcept nogil:
    """Pass 1's tasks: BLOCK_ROWS of an expert's F rows each."""
    return c.n_experts * _blocks(c.f_width, BLOCK_ROWS)


cdef inline int64_t _tasks2(const Call *c) noexcept nogil:
    """Pass 2's tasks: `Call.down_block` of an expert's D rows each."""
    return c.n_experts * _blocks(c.d_hidden, c.down_block)


def n_tasks(int64_t n_experts, int64_t expert_width, int64_t hidden_size,
            int64_t down_block_rows=DOWN_BLOCK_ROWS):
    """The tasks a call of n_experts experts of width F and hidden size D makes, both passes:
    M * (ceil(F / 16) + ceil(D / down_block_rows)); ValueError for down_block_rows < 1."""
    if down_block_rows < 1:
        raise ValueError(f"down_block_rows must be >= 1, got {down_block_rows}")
    return n_experts * (_blocks(expert_width, BLOCK_ROWS) + _blocks(hidden_size, down_block_rows))


cdef void _run(const Call *c) noexcept nogil:
    """Both passes of a call in one OpenMP region: pass 1 (act from x, F rows an expert), then,
    once its tasks are all done, pass 2 (out from act, D rows an expert), each in tasks of
    BLOCK_ROWS rows (pass 2's `Call.down_block`) handed to the call's threads as its schedule
    says."""
    strata_two_passes(c, c.n_threads, c.schedule, c.shares, _pass1_task, _tasks1(c),
                      _pass2_task, _tasks2(c), c.times, c.pin)


cdef int64_t _help(const Call *c) noexcept nogil:
    """Take part in a steal call `_run` runs (or is about to run) on another thread, as one
    more thread of its team with a share of its own, empty at first: it takes half of what is
    left of the team's shares, the first thread's first, in turn, until none is left; return
    how many tasks this thread ran."""
    return strata_steal_passes(c, c.shares, c.n_threads, c.n_threads, _pass1_task, _tasks1(c),
                               _pass2_task, c.times)
