/* The two passes of a strata._cpu_experts call on an OpenMP team, with no team barrier before
 * the first task.
 *
 * Cython's prange marks its loop variable firstprivate and lastprivate, and for such a loop
 * GCC puts a barrier of the whole team before the loop's first iteration: no thread starts a
 * task until every thread of the team is up. Between a decode round's calls the team's threads
 * sleep while the host waits for the device, and they wake at different times (70-220 us a call
 * after a 1 ms gap on the H200, bench/results/offload-omp-wait-h200-2026-12-03.md), so each
 * pass began with the last thread's wake-up, whatever the schedule. Here the loops are plain C
 * loop variables: the threads that are up start at once, and under every schedule but static
 * they also take the tasks a late thread would have taken.
 *
 * Between the passes a thread waits only for pass 1's tasks to be done (a count of them, not a
 * barrier of the team), then takes pass 2's: a thread still waking holds no one up until the
 * region's end, where OpenMP waits for every thread (by then it has woken, found no task and
 * left). Which thread runs a task never changes its bytes: each task writes its own outputs.
 *
 * Under SCHEDULE_STEAL the tasks are taken from shares in the call's memory, not handed out by
 * OpenMP, so a thread outside the team can take part too: the thread that waits for a
 * CpuWorker's call, which would otherwise spin idle beside the team (`strata_steal_passes`).
 */
#ifndef STRATA_CPU_EXPERTS_PASSES_H
#define STRATA_CPU_EXPERTS_PASSES_H

#include <omp.h>
#include <sched.h>
#include <stdint.h>
#include <time.h>

#include "_cpu_experts_pin.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define STRATA_PAUSE() _mm_pause()
#else
#define STRATA_PAUSE() ((void)0)
#endif

typedef void (*strata_task)(const void *call, int64_t task);

/* CLOCK_MONOTONIC in nanoseconds: the clock of the worker's hand-over and of a call's times. */
static inline int64_t strata_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000L + t.tv_nsec;
}

/* Where a call's run went (`strata_now_ns`), as its threads saw it: the last of its team's
 * entering the call (`entered_ns`: the team's wake-up ends there; it may come after pass 1,
 * whose tasks the threads already up take), and the first of its threads past pass 1, every
 * task of it done (`pass1_ns`: about when its last task ended, a waiting thread passing at
 * once). Zeroed by the caller before the call; a NULL pointer to it: not timed. A thread from
 * outside the team (the helper of `strata_steal_passes`) notes pass 1 too, not its entry. */
typedef struct {
    int64_t entered_ns;
    int64_t pass1_ns;
} strata_call_times;

/* A thread of the team entering the call: `entered_ns` becomes the latest entry so far. */
static inline void strata_note_entry(strata_call_times *times) {
    if (!times)
        return;
    int64_t now = strata_now_ns();
    int64_t seen = __atomic_load_n(&times->entered_ns, __ATOMIC_RELAXED);
    while (seen < now && !__atomic_compare_exchange_n(&times->entered_ns, &seen, now, 1,
                                                      __ATOMIC_RELAXED, __ATOMIC_RELAXED))
        ;
}

/* A thread of the call past pass 1: `pass1_ns` becomes the earliest such time so far. */
static inline void strata_note_pass1(strata_call_times *times) {
    if (!times)
        return;
    int64_t now = strata_now_ns();
    int64_t seen = __atomic_load_n(&times->pass1_ns, __ATOMIC_RELAXED);
    while ((seen == 0 || now < seen)
           && !__atomic_compare_exchange_n(&times->pass1_ns, &seen, now, 1, __ATOMIC_RELAXED,
                                           __ATOMIC_RELAXED))
        ;
}

/* The schedules, as strata._cpu_experts names them: tasks one at a time to whichever thread
 * asks, equal fixed shares, large shares first, and fixed shares taken in order by their
 * threads, a thread done with its own taking the back half of another's (`strata_steal`). */
enum { SCHEDULE_DYNAMIC = 0, SCHEDULE_STATIC = 1, SCHEDULE_GUIDED = 2, SCHEDULE_STEAL = 3 };

/* One thread's share of a pass's tasks for SCHEDULE_STEAL: the tasks [next, end) not yet taken,
 * packed in one word (next in the low 32 bits, end in the high) so that its owner taking from
 * the front and a thief taking the back half agree with one compare-and-swap; alone on a
 * cache line (the caller's array of them aligned to 64 bytes), so that a thread taking its own
 * tasks touches no other's line. A share's word says which tasks are left in it and nothing
 * else, so a compare-and-swap that finds the word it read is right whatever happened between. */
enum { SHARE_BYTES = 64 };
typedef struct {
    uint64_t range;
    char pad[SHARE_BYTES - sizeof(uint64_t)];
} strata_share;
_Static_assert(sizeof(strata_share) == SHARE_BYTES, "a share is one cache line");

static inline uint64_t strata_range(uint64_t next, uint64_t end) { return next | end << 32; }

/* Split [0, n) into n_owners equal shares, in order, and leave shares [n_owners, n_shares)
 * empty (n < 2^31: `_check` sees to it). */
static void strata_share_out(strata_share *shares, int n_owners, int n_shares, int64_t n)
{
    for (int i = 0; i < n_shares; i++)
        shares[i].range = i < n_owners ? strata_range((uint64_t)(n * i / n_owners),
                                                      (uint64_t)(n * (i + 1) / n_owners))
                                       : 0;
}

/* Take the first task of `share`; -1 when none is left. */
static inline int64_t strata_take(strata_share *share)
{
    uint64_t range = __atomic_load_n(&share->range, __ATOMIC_RELAXED);
    for (;;) {
        uint64_t next = range & 0xffffffffu, end = range >> 32;
        if (next >= end)
            return -1;
        if (__atomic_compare_exchange_n(&share->range, &range, range + 1, 1, __ATOMIC_RELAXED,
                                        __ATOMIC_RELAXED))
            return (int64_t)next;
    }
}

/* Move the back half of `victim`'s tasks (at least one) into `own`, whose tasks are all taken
 * (only its owner stores into it, and others only take from it); returns whether any moved. */
static inline int strata_take_half(strata_share *victim, strata_share *own)
{
    uint64_t range = __atomic_load_n(&victim->range, __ATOMIC_RELAXED);
    for (;;) {
        uint64_t next = range & 0xffffffffu, end = range >> 32;
        if (next >= end)
            return 0;
        uint64_t middle = end - (end - next + 1) / 2;
        if (__atomic_compare_exchange_n(&victim->range, &range, strata_range(next, middle), 1,
                                        __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
            __atomic_store_n(&own->range, strata_range(middle, end), __ATOMIC_RELAXED);
            return 1;
        }
    }
}

/* SCHEDULE_STEAL for the thread whose share is `me` of n_shares: its own share's tasks in
 * order (one run of adjacent rows, as static gives); then, until no share has any left, the
 * back half of the next share that has some, moved into its own and taken in order likewise
 * (so that a thread still asleep holds no task back, as dynamic allows, while every thread's
 * reads stay in runs of adjacent rows, its owner's and the thief's). Returns how many tasks it
 * ran. */
static int64_t strata_steal(const void *call, strata_task task, strata_share *shares,
                            int n_shares, int me)
{
    strata_share *own = &shares[me];
    int64_t t, ran = 0;
    for (;;) {
        while ((t = strata_take(own)) >= 0) {
            task(call, t);
            ran++;
        }
        int k = 1;
        while (k < n_shares && !strata_take_half(&shares[(me + k) % n_shares], own))
            k++;
        if (k == n_shares)
            return ran;
    }
}

/* Run tasks [0, n) of `task` over the team as `schedule` says; returns how many this thread
 * ran. Called by every thread of the region; `nowait`: no barrier before or after. */
static inline int64_t strata_pass(const void *call, strata_task task, int64_t n, int schedule)
{
    int64_t t, ran = 0;
    if (schedule == SCHEDULE_STATIC) {
#pragma omp for schedule(static) nowait
        for (t = 0; t < n; t++) {
            task(call, t);
            ran++;
        }
    } else if (schedule == SCHEDULE_GUIDED) {
#pragma omp for schedule(guided) nowait
        for (t = 0; t < n; t++) {
            task(call, t);
            ran++;
        }
    } else {
#pragma omp for schedule(dynamic) nowait
        for (t = 0; t < n; t++) {
            task(call, t);
            ran++;
        }
    }
    return ran;
}

/* Wait until *done reaches n: spin, yielding the CPU now and then so that a thread that holds
 * a task and was preempted (more threads than CPUs) gets to finish it. */
static inline void strata_wait_done(const int64_t *done, int64_t n)
{
    unsigned spins = 0;
    while (__atomic_load_n(done, __ATOMIC_ACQUIRE) < n) {
        if (++spins % 1024 == 0)
            sched_yield();
        else
            STRATA_PAUSE();
    }
}

/* A SCHEDULE_STEAL call's state on n_threads threads and one helper, 2 * (n_threads + 1) + 1
 * shares (64-byte aligned, the caller's memory: nothing is allocated here, so nothing here can
 * fail): pass 1's n1 tasks in n_threads equal shares and the helper's, empty; pass 2's n2
 * likewise; and one whose word counts pass 1's tasks done. Set before the call is run, and
 * before the helper takes part. */
static void strata_steal_init(strata_share *shares, int n_threads, int64_t n1, int64_t n2)
{
    strata_share_out(shares, n_threads, n_threads + 1, n1);
    strata_share_out(shares + n_threads + 1, n_threads, n_threads + 1, n2);
    shares[2 * (n_threads + 1)].range = 0;
}

/* One thread's part of a SCHEDULE_STEAL call whose state `strata_steal_init` set, its share
 * `me` (a thread of the team: its number; the helper, `CpuWorker.wait`'s thread: n_threads):
 * pass 1's tasks it can take; then, once all of pass 1's are done, pass 2's. Each task runs
 * once whoever takes part. Each notes when it was past pass 1 in `times` (NULL: not timed).
 * Returns how many tasks this thread ran. */
static int64_t strata_steal_passes(const void *call, strata_share *shares, int n_threads,
                                   int me, strata_task pass1, int64_t n1, strata_task pass2,
                                   strata_call_times *times)
{
    int64_t *done = (int64_t *)&shares[2 * (n_threads + 1)].range;
    int64_t ran = strata_steal(call, pass1, shares, n_threads + 1, me);
    if (ran)
        __atomic_fetch_add(done, ran, __ATOMIC_RELEASE);
    strata_wait_done(done, n1);
    strata_note_pass1(times);
    return ran + strata_steal(call, pass2, shares + n_threads + 1, n_threads + 1, me);
}

/* Pass 1's n1 tasks, then, once all of them are done, pass 2's n2, on n_threads threads, as
 * `schedule` says; for SCHEDULE_STEAL, `shares` holds the state `strata_steal_init` set (else
 * it is unused). The threads note the call's times in `times` (NULL: not timed), each first
 * on the CPU `pin` gives it (`strata_pin`; NULL: where it is). */
static void strata_two_passes(const void *call, int n_threads, int schedule,
                              strata_share *shares, strata_task pass1, int64_t n1,
                              strata_task pass2, int64_t n2, strata_call_times *times,
                              const int *pin)
{
    int64_t done = 0; /* pass 1's tasks finished, by all threads (but SCHEDULE_STEAL's) */
    if (schedule == SCHEDULE_STEAL) {
#pragma omp parallel num_threads(n_threads)
        {
            strata_pin(pin);
            strata_note_entry(times);
            strata_steal_passes(call, shares, n_threads, omp_get_thread_num(), pass1, n1,
                                pass2, times);
        }
        return;
    }
#pragma omp parallel num_threads(n_threads)
    {
        strata_pin(pin);
        strata_note_entry(times);
        int64_t ran = strata_pass(call, pass1, n1, schedule);
        if (ran)
            __atomic_fetch_add(&done, ran, __ATOMIC_RELEASE);
        strata_wait_done(&done, n1);
        strata_note_pass1(times);
        strata_pass(call, pass2, n2, schedule);
    }
}

#endif
