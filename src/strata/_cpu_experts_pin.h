/* Pinning a CpuWorker's OpenMP team: thread t of a call's team on CPU cpus[t] (Linux).
 *
 * A decode round's CPU calls run on a team as large as the cores left beside the engine's
 * thread, and the scheduler moves its threads between cores and preempts them for the
 * engine's, the driver's and torch's threads (bench/thread_sched.py counts it: on the H200
 * the team's threads waited 1.0-1.6 ms of a 7-8 ms int8 round for a core, all told).
 * Pinned, each stays on its own core, and the cores outside the team are left to the rest of
 * the process.
 *
 * A call passes the team's CPUs by thread number, or an array whose first entry is negative
 * (the threads back on the CPUs the process had at import, `strata_pin_save`), or NULL (the
 * threads left as they are: `compute`'s calls on the caller's own team, and a worker never
 * pinned). Each thread remembers what it last set, so a syscall is paid only where that
 * changes, and by a thread the pool has just made (it inherits its master's CPU).
 */
#ifndef STRATA_CPU_EXPERTS_PIN_H
#define STRATA_CPU_EXPERTS_PIN_H

#include <omp.h>

#if defined(__linux__)
#include <errno.h>
#include <pthread.h>
#include <sched.h>

#define STRATA_PIN_UNKNOWN (-2) /* a thread that has set nothing yet */
#define STRATA_PIN_PROCESS (-1) /* the process's CPUs */

static cpu_set_t strata_process_cpus;
static __thread int strata_pinned = STRATA_PIN_UNKNOWN;

/* Save the calling thread's CPUs as the process's (the module's import, on the importing
 * thread, before any team is pinned): 0, or the errno of sched_getaffinity. */
static int strata_pin_save(void) {
    return sched_getaffinity(0, sizeof strata_process_cpus, &strata_process_cpus) ? errno : 0;
}

/* The calling thread, thread omp_get_thread_num() of its team, onto cpus[that number] (see
 * the top). A failed syscall leaves the thread where it was and is tried again next call. */
static inline void strata_pin(const int *cpus) {
    if (!cpus)
        return;
    int want = cpus[0] < 0 ? STRATA_PIN_PROCESS : cpus[omp_get_thread_num()];
    if (want == strata_pinned)
        return;
    cpu_set_t set;
    if (want == STRATA_PIN_PROCESS) {
        set = strata_process_cpus;
    } else {
        CPU_ZERO(&set);
        CPU_SET(want, &set);
    }
    if (pthread_setaffinity_np(pthread_self(), sizeof set, &set) == 0)
        strata_pinned = want;
}

#else
static int strata_pin_save(void) { return 0; }
static inline void strata_pin(const int *cpus) { (void)cpus; }
#endif

#endif
