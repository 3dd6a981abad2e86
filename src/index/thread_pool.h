/* SPDX-License-Identifier: Apache-2.0 */
/* A persistent pool of helper threads for batch work that takes tens to hundreds of microseconds
 * (a scoring batch, staging a batch's hashes). The caller never waits for a helper to wake: it
 * runs the job itself at once, helpers that wake while the job is still open join it, and a job
 * claims its work dynamically, so it is correct on any set of lanes, the caller's alone included.
 * One caller at a time per pool (the owner serialises its runs). */
#ifndef KM_THREAD_POOL_H
#define KM_THREAD_POOL_H

#include <sched.h>
#include <stddef.h>
#include <stdint.h>

typedef struct km_thread_pool km_thread_pool;

/* A job as run on one lane: lane is 0 .. helpers-1 on a helper, helpers on the caller. It claims
 * its work dynamically and returns once none is left to claim. */
typedef void (*km_pool_job)(void *arg, uint32_t lane);

/* Start `helpers` threads named `thread_name` (at most 15 characters, for top -H and perf).
 * NULL when a thread or allocation failed (nothing is left running). */
km_thread_pool *km_thread_pool_create(uint32_t helpers, const char *thread_name);
/* Stop and join every helper; NULL is a no-op. */
void km_thread_pool_destroy(km_thread_pool *pool);
/* Lanes a job may run on: the helpers plus the caller. */
uint32_t km_thread_pool_lanes(const km_thread_pool *pool);
/* Run job(arg, lane) on the caller and on every helper that joins while it is open; return when
 * the caller's call has returned and no helper is still inside. */
void km_thread_pool_run(km_thread_pool *pool, km_pool_job job, void *arg);

/* Call part(arg, i) once for every i in [0, n_parts), parts claimed one at a time by whichever
 * lanes run; return when all have returned. A NULL pool runs them in order on the caller. */
typedef void (*km_pool_part)(void *arg, size_t part);
void km_thread_pool_for_each(km_thread_pool *pool, size_t n_parts, km_pool_part part, void *arg);

/* One step of a brief wait for another running thread (a helper finishing a chunk): a pause
 * instruction for the first 256 steps, then a yield so a thread sharing this core can run. */
static inline void km_spin_relax(uint32_t *spins)
{
    if (++*spins < 256) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
    } else {
        sched_yield();
    }
}

#endif
