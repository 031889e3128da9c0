# Included by _cpu_experts.pyx: a kernel call's checks, and the `Call` of its raw pointers that
# `compute` and `CpuWorker.start` hand to the passes.

cdef _check(const uint8_t[:, ::1] blobs, int fmt, const int64_t[::1] experts,
            const int64_t[::1] row_starts, const float[:, ::1] x, uint16_t[:, ::1] out,
            int64_t expert_width, int n_threads, str schedule, int64_t prefetch_bytes,
            int gate_up_rows, int down_rows, int64_t down_block_rows):
    """`compute`'s checks of a call (ValueError naming what is wrong), before any work."""
    cdef int64_t d_hidden = x.shape[1]
    cdef int64_t n_rows = out.shape[0]
    cdef Py_ssize_t i
    if expert_width < 1 or blobs.shape[1] != blob_bytes(fmt, expert_width, d_hidden):
        raise ValueError(f"blobs must be [E, blob_bytes] = [E, "
                         f"{blob_bytes(fmt, expert_width, d_hidden)}] for format {fmt}, "
                         f"F = {expert_width}, D = {d_hidden}, got [{blobs.shape[0]}, "
                         f"{blobs.shape[1]}]")
    if (x.shape[0] != n_rows and x.shape[0] != 1) or out.shape[1] != d_hidden:
        raise ValueError(f"x must be [R, D] or [1, D] and out [R, D], got x [{x.shape[0]}, "
                         f"{d_hidden}] and out [{out.shape[0]}, {out.shape[1]}]")
    if row_starts.shape[0] != experts.shape[0] + 1 or row_starts[0] != 0 \
            or row_starts[experts.shape[0]] != n_rows:
        raise ValueError(f"row_starts must be [M+1] = [{experts.shape[0] + 1}] from 0 to "
                         f"R = {n_rows}, got {np.asarray(row_starts).tolist()}")
    for i in range(experts.shape[0]):
        if row_starts[i + 1] < row_starts[i]:
            raise ValueError(f"row_starts must not decrease, got "
                             f"{np.asarray(row_starts).tolist()}")
        if not 0 <= experts[i] < blobs.shape[0]:
            raise ValueError(f"expert {experts[i]} is out of range [0, {blobs.shape[0]})")
    if n_threads < 1:
        raise ValueError(f"n_threads must be >= 1, got {n_threads}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
    if schedule == "steal" \
            and experts.shape[0] * _blocks(max(expert_width, d_hidden), BLOCK_ROWS) >= 2**31:
        raise ValueError(f"a 'steal' call takes fewer than 2**31 tasks a pass (M * ceil(F / "
                         f"{BLOCK_ROWS}) and M * ceil(D / {BLOCK_ROWS})), got M = "
                         f"{experts.shape[0]}, F = {expert_width}, D = {d_hidden}: split it, "
                         f"or use another schedule")
    if prefetch_bytes < 0 or prefetch_bytes % 64:
        raise ValueError(f"prefetch_bytes must be a multiple of 64 (a cache line) >= 0, got "
                         f"{prefetch_bytes}")
    if gate_up_rows not in (1, 2, 4) or down_rows not in (1, 2, 4):
        raise ValueError(f"gate_up_rows and down_rows must be 1, 2 or 4 (weight rows a pass "
                         f"reads at once), got {gate_up_rows} and {down_rows}")
    if down_block_rows < 16 or down_block_rows > 1024 or down_block_rows % 16:
        raise ValueError(f"down_block_rows must be a multiple of 16 from 16 to 1024 (rows of "
                         f"down a task reads), got {down_block_rows}")


cdef object _shares(int n_threads, int schedule):
    """For SCHEDULE_STEAL, the memory of the call's state: 2 * (n_threads + 1) + 1 shares
    (`strata_steal_init`; `_check` saw that a pass's tasks fit a share), a cache line each,
    and one line more so that they can start on a line (`_call` aligns them and sets them);
    None for the other schedules. Made here, so that the passes allocate nothing and a
    failure is Python's MemoryError before any work."""
    if schedule != SCHEDULE_STEAL:
        return None
    return np.empty((2 * n_threads + 4) * SHARE_BYTES, dtype=np.uint8)


cdef void *_steal_state(object shares, int n_threads, int64_t n1, int64_t n2) except? NULL:
    """The first cache line of `shares` (from `_shares`), where the steal state of a call of n1
    and n2 tasks on n_threads threads is now set, before any thread takes part; NULL for
    None (another schedule)."""
    if shares is None:
        return NULL
    cdef uint8_t[::1] share_bytes = shares
    cdef uintptr_t at = <uintptr_t>&share_bytes[0]
    cdef void *state = <void *>((at + SHARE_BYTES - 1) & ~(<uintptr_t>SHARE_BYTES - 1))
    strata_steal_init(state, n_threads, n1, n2)
    return state


cdef Call _call(const uint8_t[:, ::1] blobs, int fmt, const int64_t[::1] experts,
                const int64_t[::1] row_starts, const float[:, ::1] x, float[:, ::1] act,
                uint16_t[:, ::1] out, int64_t expert_width, int n_threads, int schedule,
                int64_t prefetch_bytes, int gate_up_rows, int down_rows, int64_t down_block_rows,
                object shares):
    """The Call over checked arrays of at least one row, and `shares` from `_shares` (the
    pointers are theirs: the caller keeps the arrays alive until the call has run)."""
    cdef Call call
    call.blobs = &blobs[0, 0]
    call.blob_bytes = blobs.shape[1]
    call.fmt = fmt
    call.experts = &experts[0]
    call.row_starts = &row_starts[0]
    call.n_experts = experts.shape[0]
    call.x = &x[0, 0]
    call.x_stride = 0 if x.shape[0] == 1 else x.shape[1]  # [1, D]: every row reads the one
    call.act = &act[0, 0]
    call.out = &out[0, 0]
    call.f_width = expert_width
    call.d_hidden = x.shape[1]
    call.n_threads = n_threads
    call.schedule = schedule
    call.prefetch = prefetch_bytes
    call.gate_up_rows = gate_up_rows
    call.down_rows = down_rows
    call.down_block = down_block_rows
    call.shares = _steal_state(shares, n_threads, _tasks1(&call), _tasks2(&call))
    call.times = NULL  # untimed; a CpuWorker points it at its own
    call.pin = NULL  # the threads left where they are; a CpuWorker's may be pinned
    return call
