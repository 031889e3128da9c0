/* A worker thread of strata._cpu_experts: one job at a time, posted by the Python thread and
 * run on this thread (which becomes the master of the job's OpenMP team), so that the Python
 * thread goes on meanwhile and waits for the job only when it needs its output.
 *
 * Hand-over: the poster bumps `posted`; the worker, between jobs, spins on it for about
 * STRATA_WORKER_SPIN_NS before sleeping on the condition variable (a decode round posts a job
 * a layer, well within that, so a posted job is taken within a few hundred nanoseconds); the
 * waiter spins on `done` the same way. Every field is read and written under the mutex or with
 * atomic loads and stores.
 *
 * `park`, when set, runs on the worker's thread after each job, before its own spin: the
 * extension's hook that keeps the job's OpenMP team spinning for the next job too (a decode
 * round's next call comes about a millisecond later, by when idle OpenMP threads would sleep).
 *
 * The last job's times are kept (posted, begun and ended, and what the job's threads note in
 * `times`: its team's last thread up, its pass 1 done), a few clock reads a job, for
 * `CpuWorker.last_call_us`: where a call's time went, the hand-over, the team's wake-up, the
 * passes, the waiter's notice.
 *
 * On Linux the worker names itself `strata_worker_name`, and the OpenMP team it starts (its
 * threads are made by it) takes the name from it: `top -H`, `perf` and /proc/self/task tell the
 * CPU experts' threads from torch's and the driver's (bench/thread_sched.py counts them apart).
 */
#ifndef STRATA_CPU_EXPERTS_WORKER_H
#define STRATA_CPU_EXPERTS_WORKER_H

#include <pthread.h>
#include <stdint.h>
#if defined(__linux__)
#include <sys/prctl.h>
#endif

#include "_cpu_experts_passes.h" /* strata_now_ns */

#define STRATA_WORKER_SPIN_NS 2000000L /* 2 ms */
static const char strata_worker_name[] = "strata-cpu"; /* at most 15 bytes: the kernel's limit */

typedef struct strata_worker strata_worker;
struct strata_worker {
    pthread_t thread;
    pthread_mutex_t mutex;
    pthread_cond_t cond;
    void (*run)(void *);
    void *job;
    int64_t posted; /* jobs posted, all told */
    int64_t done;   /* jobs done, all told */
    int stop;
    void (*park)(strata_worker *, int64_t, int); /* after job `taken`; NULL: none */
    int park_threads; /* the team `park` keeps up: the last job's thread count */
    /* The last job's times (`strata_now_ns`): posted, begun and ended on the worker's thread,
     * and those its threads note (`strata_call_times`; zeroed at each post). */
    int64_t posted_ns, begun_ns, ended_ns;
    strata_call_times times;
};

/* Spin until *counter reaches `target` or the spin's time is up; returns whether it did. */
static inline int strata_spin_until(const int64_t *counter, int64_t target, const int *stop) {
    int64_t until = strata_now_ns() + STRATA_WORKER_SPIN_NS;
    unsigned spins = 0;
    while (__atomic_load_n(counter, __ATOMIC_ACQUIRE) < target) {
        if (stop && __atomic_load_n(stop, __ATOMIC_ACQUIRE)) return 0;
        if (++spins % 64 == 0 && strata_now_ns() > until) return 0;
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
    }
    return 1;
}

static void *strata_worker_main(void *arg) {
    strata_worker *w = (strata_worker *)arg;
    int64_t taken = 0;
#if defined(__linux__)
    prctl(PR_SET_NAME, strata_worker_name, 0, 0, 0); /* a name only: nothing depends on it */
#endif
    for (;;) {
        if (!strata_spin_until(&w->posted, taken + 1, &w->stop)) {
            pthread_mutex_lock(&w->mutex);
            while (!w->stop && __atomic_load_n(&w->posted, __ATOMIC_ACQUIRE) <= taken)
                pthread_cond_wait(&w->cond, &w->mutex);
            pthread_mutex_unlock(&w->mutex);
        }
        if (__atomic_load_n(&w->stop, __ATOMIC_ACQUIRE)) return NULL;
        taken += 1;
        w->begun_ns = strata_now_ns();
        w->run(w->job);
        w->ended_ns = strata_now_ns(); /* published with `done`, which the waiter acquires */
        pthread_mutex_lock(&w->mutex);
        __atomic_store_n(&w->done, taken, __ATOMIC_RELEASE);
        pthread_cond_broadcast(&w->cond);
        void (*park)(strata_worker *, int64_t, int) = w->park;
        int park_threads = w->park_threads;
        pthread_mutex_unlock(&w->mutex);
        if (park) park(w, taken, park_threads);
    }
}

/* 0, or the error pthread_create returned (the worker is then not running). */
static int strata_worker_start(strata_worker *w) {
    w->run = NULL;
    w->job = NULL;
    w->posted = 0;
    w->done = 0;
    w->stop = 0;
    w->park = NULL;
    w->park_threads = 1;
    w->posted_ns = w->begun_ns = w->ended_ns = 0;
    w->times.entered_ns = w->times.pass1_ns = 0;
    pthread_mutex_init(&w->mutex, NULL);
    pthread_cond_init(&w->cond, NULL);
    int error = pthread_create(&w->thread, NULL, strata_worker_main, w);
    if (error) {
        pthread_cond_destroy(&w->cond);
        pthread_mutex_destroy(&w->mutex);
    }
    return error;
}

/* Post `run(job)`, whose OpenMP team is `n_threads` strong; the caller has waited for the job
 * before (one at a time). */
static void strata_worker_post(strata_worker *w, void (*run)(void *), void *job, int n_threads) {
    pthread_mutex_lock(&w->mutex);
    w->run = run;
    w->job = job;
    w->park_threads = n_threads;
    w->times.entered_ns = w->times.pass1_ns = 0;
    w->posted_ns = strata_now_ns();
    __atomic_store_n(&w->posted, w->posted + 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&w->cond);
    pthread_mutex_unlock(&w->mutex);
}

/* Set (or, with NULL, clear) the hook run after each job, for the jobs that finish from now. */
static void strata_worker_set_park(strata_worker *w,
                                   void (*park)(strata_worker *, int64_t, int)) {
    pthread_mutex_lock(&w->mutex);
    w->park = park;
    pthread_mutex_unlock(&w->mutex);
}

/* Wait until every posted job is done. */
static void strata_worker_wait(strata_worker *w) {
    int64_t target = __atomic_load_n(&w->posted, __ATOMIC_ACQUIRE);
    if (strata_spin_until(&w->done, target, NULL)) return;
    pthread_mutex_lock(&w->mutex);
    while (__atomic_load_n(&w->done, __ATOMIC_ACQUIRE) < target)
        pthread_cond_wait(&w->cond, &w->mutex);
    pthread_mutex_unlock(&w->mutex);
}

/* Stop the worker (after the job it runs, if any) and free what it holds. */
static void strata_worker_stop(strata_worker *w) {
    pthread_mutex_lock(&w->mutex);
    __atomic_store_n(&w->stop, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&w->cond);
    pthread_mutex_unlock(&w->mutex);
    pthread_join(w->thread, NULL);
    pthread_cond_destroy(&w->cond);
    pthread_mutex_destroy(&w->mutex);
}

#endif
