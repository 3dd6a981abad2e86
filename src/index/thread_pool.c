/* SPDX-License-Identifier: Apache-2.0 */
/* The helper-thread pool of src/index/thread_pool.h.
 *
 * A job (a scoring batch of ~1000 requests) takes a few hundred microseconds; waking a parked
 * helper can take tens (more on a busy or virtualised machine). So the caller never waits for a
 * helper to wake: it starts on the job at once, the job's work is claimed in small chunks, and a
 * helper that wakes after all of it has been claimed backs out. The caller waits only for helpers
 * actually inside the job.
 * Batches often come back to back, so a helper that has finished one watches `open_generation` for
 * a while (POOL_SPIN_BEFORE_PARKING pause loops, about a tenth of a millisecond) before it parks,
 * and joins the next job from there without a wake-up.
 *
 * Joining is a Dekker pair on sequentially consistent atomics: a helper increments `inside` and
 * then checks that `open_generation` is still the generation it woke for or saw; the caller clears
 * `open_generation` and then reads `inside`. At least one of them sees
 * the other's write, so either the helper backs out or the caller waits for it. */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "index/thread_pool.h"

struct km_thread_pool {
    pthread_t *threads;
    uint32_t n_threads; /* helper threads; the caller is thread n_threads */
    pthread_mutex_t mutex;
    pthread_cond_t start;
    uint64_t generation; /* under mutex */
    int stop;            /* under mutex */
    km_pool_job job;     /* written before generation advances, read after */
    void *arg;
    atomic_uint_fast64_t open_generation; /* the generation that may still be joined, else 0 */
    atomic_uint inside;  /* helpers running the current job */
    atomic_int caller_cpu; /* the CPU the caller opened the current job on, or -1 */
    cpu_set_t allowed;     /* the CPUs the creating thread could run on */
    int have_allowed;
};

typedef struct pool_thread_arg {
    km_thread_pool *pool;
    uint32_t index;
} pool_thread_arg;

static inline void cpu_pause(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* After a job a helper watches for the next one this many pause loops before it parks. */
#define POOL_SPIN_BEFORE_PARKING 4096u

/* Run the job of generation g if it is still open (the Dekker pair above): while a helper is
 * inside an open job, job and arg stay as they are. */
static void pool_join(km_thread_pool *pool, uint64_t g, uint32_t index)
{
    atomic_fetch_add(&pool->inside, 1);
    if (atomic_load(&pool->open_generation) == g)
        pool->job(pool->arg, index);
    atomic_fetch_sub(&pool->inside, 1);
}

/* A woken helper on the CPU its caller opened the job on (the kernel tends to place a woken thread
 * beside its waker) moves to the others the creating thread could use, so the two do not share
 * one core for the batch. */
static void pool_step_aside(km_thread_pool *pool)
{
    int here = sched_getcpu();
    if (!pool->have_allowed || here < 0 || here != atomic_load(&pool->caller_cpu) ||
        here >= CPU_SETSIZE)
        return;
    cpu_set_t others = pool->allowed;
    CPU_CLR(here, &others);
    if (CPU_COUNT(&others) > 0)
        pthread_setaffinity_np(pthread_self(), sizeof others, &others);
}

static void *pool_main(void *p)
{
    pool_thread_arg self = *(pool_thread_arg *)p;
    free(p);
    km_thread_pool *pool = self.pool;
    uint64_t seen = 0;
    for (;;) {
        uint64_t open = 0;
        for (uint32_t spin = 0; spin < POOL_SPIN_BEFORE_PARKING && !open; spin++) {
            uint64_t g = atomic_load_explicit(&pool->open_generation, memory_order_relaxed);
            if (g != 0 && g != seen)
                open = g;
            else
                cpu_pause();
        }
        if (open) {
            seen = open;
            pool_join(pool, open, self.index);
            continue;
        }
        pthread_mutex_lock(&pool->mutex);
        while (!pool->stop && pool->generation == seen)
            pthread_cond_wait(&pool->start, &pool->mutex);
        int stop = pool->stop;
        seen = pool->generation;
        pthread_mutex_unlock(&pool->mutex);
        if (stop)
            break;
        pool_step_aside(pool);
        pool_join(pool, seen, self.index); /* backs out of a job that has since closed */
    }
    return NULL;
}

void km_thread_pool_destroy(km_thread_pool *pool)
{
    if (!pool)
        return;
    pthread_mutex_lock(&pool->mutex);
    pool->stop = 1;
    pthread_cond_broadcast(&pool->start);
    pthread_mutex_unlock(&pool->mutex);
    for (uint32_t i = 0; i < pool->n_threads; i++)
        pthread_join(pool->threads[i], NULL);
    pthread_mutex_destroy(&pool->mutex);
    pthread_cond_destroy(&pool->start);
    free(pool->threads);
    free(pool);
}

km_thread_pool *km_thread_pool_create(uint32_t helpers, const char *thread_name)
{
    km_thread_pool *pool = calloc(1, sizeof *pool);
    if (!pool)
        return NULL;
    pthread_mutex_init(&pool->mutex, NULL);
    pthread_cond_init(&pool->start, NULL);
    atomic_init(&pool->caller_cpu, -1);
    pool->have_allowed = pthread_getaffinity_np(pthread_self(), sizeof pool->allowed,
                                                &pool->allowed) == 0;
    atomic_init(&pool->open_generation, 0);
    atomic_init(&pool->inside, 0);
    pool->threads = calloc(helpers ? helpers : 1, sizeof *pool->threads);
    if (!pool->threads) {
        km_thread_pool_destroy(pool);
        return NULL;
    }
    for (uint32_t i = 0; i < helpers; i++) {
        pool_thread_arg *arg = malloc(sizeof *arg);
        if (arg) { /* filled before the thread starts: it reads them at once */
            arg->pool = pool;
            arg->index = i;
        }
        if (!arg || pthread_create(&pool->threads[i], NULL, pool_main, arg) != 0) {
            free(arg);
            km_thread_pool_destroy(pool);
            return NULL;
        }
        pthread_setname_np(pool->threads[i], thread_name);
        pool->n_threads++;
    }
    return pool;
}

/* Run job(arg, t) on the caller (t = n_threads) and on every helper that wakes while the job is
 * open (t = 0 .. n_threads-1); return when the caller's call has returned and no helper is inside.
 * Contract for the job: it claims its work dynamically and returns once none is left to claim, so
 * it is correct whichever lanes run it, the caller's alone included. */
void km_thread_pool_run(km_thread_pool *pool, km_pool_job job, void *arg)
{
    atomic_store(&pool->caller_cpu, sched_getcpu());
    pthread_mutex_lock(&pool->mutex);
    pool->job = job;
    pool->arg = arg;
    pool->generation++;
    atomic_store(&pool->open_generation, pool->generation);
    pthread_cond_broadcast(&pool->start);
    pthread_mutex_unlock(&pool->mutex);
    job(arg, pool->n_threads);
    atomic_store(&pool->open_generation, 0);
    uint32_t spins = 0;
    while (atomic_load(&pool->inside) != 0)
        km_spin_relax(&spins);
}

uint32_t km_thread_pool_lanes(const km_thread_pool *pool)
{
    return pool ? pool->n_threads + 1 : 1;
}

typedef struct for_each_job {
    km_pool_part part;
    void *arg;
    size_t n_parts;
    atomic_size_t next;
} for_each_job;

static void for_each_lane(void *p, uint32_t lane)
{
    (void)lane;
    for_each_job *job = p;
    for (;;) {
        size_t i = atomic_fetch_add_explicit(&job->next, 1, memory_order_relaxed);
        if (i >= job->n_parts)
            return;
        job->part(job->arg, i);
    }
}

void km_thread_pool_for_each(km_thread_pool *pool, size_t n_parts, km_pool_part part, void *arg)
{
    if (!pool || n_parts < 2) {
        for (size_t i = 0; i < n_parts; i++)
            part(arg, i);
        return;
    }
    for_each_job job = {.part = part, .arg = arg, .n_parts = n_parts};
    atomic_init(&job.next, 0);
    km_thread_pool_run(pool, for_each_lane, &job);
}
