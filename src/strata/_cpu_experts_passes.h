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
 */
#ifndef STRATA_CPU_EXPERTS_PASSES_H
#define STRATA_CPU_EXPERTS_PASSES_H

#include <omp.h>
#include <sched.h>
#include <stdint.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define STRATA_PAUSE() _mm_pause()
#else
#define STRATA_PAUSE() ((void)0)
#endif

typedef void (*strata_task)(const void *call, int64_t task);

/* The schedules, as strata._cpu_experts names them: tasks one at a time to whichever thread
 * asks, equal fixed shares, large shares first, and fixed shares taken in order by their
 * threads and, once a thread's own is done, by it from the others' (`strata_steal`). */
enum { SCHEDULE_DYNAMIC = 0, SCHEDULE_STATIC = 1, SCHEDULE_GUIDED = 2, SCHEDULE_STEAL = 3 };

/* One thread's share of a pass's tasks for SCHEDULE_STEAL: the next task to take and the end,
 * alone on a cache line (the caller's array of them aligned to 64 bytes) so that a thread
 * taking its own tasks touches no other's line. */
enum { SHARE_BYTES = 64 };
typedef struct {
    int64_t next;
    int64_t end;
    char pad[SHARE_BYTES - 2 * sizeof(int64_t)];
} strata_share;
_Static_assert(sizeof(strata_share) == SHARE_BYTES, "a share is one cache line");

/* Split [0, n) into n_shares equal shares, in order. */
static void strata_share_out(strata_share *shares, int n_shares, int64_t n)
{
    for (int i = 0; i < n_shares; i++) {
        shares[i].next = n * i / n_shares;
        shares[i].end = n * (i + 1) / n_shares;
    }
}

/* Take tasks of `share` one at a time until none is left; returns how many were run. */
static inline int64_t strata_take(const void *call, strata_task task, strata_share *share)
{
    int64_t t, ran = 0;
    while (__atomic_load_n(&share->next, __ATOMIC_RELAXED) < share->end) {
        t = __atomic_fetch_add(&share->next, 1, __ATOMIC_RELAXED);
        if (t >= share->end)
            break;
        task(call, t);
        ran++;
    }
    return ran;
}

/* SCHEDULE_STEAL for this thread: its own share first, in order (one run of adjacent rows, as
 * static gives), then what is left of the others', the next thread's first (so that a thread
 * still asleep holds no task back, as dynamic allows). */
static int64_t strata_steal(const void *call, strata_task task, strata_share *shares,
                            int n_shares)
{
    int me = omp_get_thread_num();
    int64_t ran = 0;
    for (int k = 0; k < n_shares; k++)
        ran += strata_take(call, task, &shares[(me + k) % n_shares]);
    return ran;
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

/* Pass 1's n1 tasks, then, once all of them are done, pass 2's n2, on n_threads threads.
 * `shares`: for SCHEDULE_STEAL, 2 * n_threads of them, 64-byte aligned, for pass 1 and pass 2
 * (the caller's memory: nothing is allocated here, so nothing here can fail); else unused. */
static void strata_two_passes(const void *call, int n_threads, int schedule,
                              strata_share *shares, strata_task pass1, int64_t n1,
                              strata_task pass2, int64_t n2)
{
    int64_t done = 0; /* pass 1's tasks finished, by all threads */
    int steal = schedule == SCHEDULE_STEAL;
    if (steal) {
        strata_share_out(shares, n_threads, n1);
        strata_share_out(shares + n_threads, n_threads, n2);
    }
#pragma omp parallel num_threads(n_threads)
    {
        int64_t ran = steal ? strata_steal(call, pass1, shares, n_threads)
                            : strata_pass(call, pass1, n1, schedule);
        if (ran)
            __atomic_fetch_add(&done, ran, __ATOMIC_RELEASE);
        strata_wait_done(&done, n1);
        if (steal)
            strata_steal(call, pass2, shares + n_threads, n_threads);
        else
            strata_pass(call, pass2, n2, schedule);
    }
}

#endif
