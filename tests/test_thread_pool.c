/* SPDX-License-Identifier: Apache-2.0 */
/* km_thread_pool (src/index/thread_pool.h): every part of a for_each runs exactly once whichever
 * lanes join, runs come back to back without losing or repeating work, and a job runs on the
 * caller's lane (helpers) and never on a lane outside [0, helpers]. */
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#include <criterion/criterion.h>

#include "index/thread_pool.h"
#include "test_util.h"

typedef struct part_counts {
    atomic_uint *calls; /* per part */
    atomic_uint busy;   /* a little work per part, so helpers have time to join */
} part_counts;

static void count_part(void *arg, size_t part)
{
    part_counts *c = arg;
    atomic_fetch_add_explicit(&c->calls[part], 1, memory_order_relaxed);
    for (uint32_t i = 0; i < 200; i++)
        atomic_fetch_add_explicit(&c->busy, 1, memory_order_relaxed);
}

Test(thread_pool, for_each_runs_every_part_exactly_once_on_any_pool, .timeout = 60)
{
    km_rng rng;
    km_rng_init(&rng, km_test_seed());
    const uint32_t helper_counts[] = {0, 1, 3, 7};
    for (size_t h = 0; h < sizeof helper_counts / sizeof helper_counts[0]; h++) {
        km_thread_pool *pool = NULL;
        if (helper_counts[h] > 0) {
            pool = km_thread_pool_create(helper_counts[h], "km-test");
            cr_assert_not_null(pool, "pool of %u helpers", helper_counts[h]);
        }
        KM_CHECK(km_thread_pool_lanes(pool) == helper_counts[h] + 1, "lanes %u with %u helpers",
                 km_thread_pool_lanes(pool), helper_counts[h]);
        for (uint32_t round = 0; round < 300; round++) {
            size_t n = km_rng_below(&rng, 4) == 0 ? km_rng_below(&rng, 3)
                                                   : km_rng_below(&rng, 2000);
            part_counts c = {.calls = calloc(n ? n : 1, sizeof(atomic_uint))};
            cr_assert_not_null(c.calls);
            atomic_init(&c.busy, 0);
            km_thread_pool_for_each(pool, n, count_part, &c);
            for (size_t i = 0; i < n; i++)
                KM_CHECK(atomic_load(&c.calls[i]) == 1,
                         "helpers %u round %u: part %zu of %zu ran %u times", helper_counts[h],
                         round, i, n, atomic_load(&c.calls[i]));
            KM_CHECK(atomic_load(&c.busy) == 200u * n, "all work done before the return");
            free(c.calls);
        }
        km_thread_pool_destroy(pool);
    }
}

typedef struct lane_record {
    uint32_t helpers;
    atomic_uint caller_runs;
    atomic_uint bad_lanes;
    atomic_size_t next; /* work claimed dynamically, as the contract asks */
    size_t n_items;
    atomic_uint *done;
} lane_record;

static void record_lane(void *arg, uint32_t lane)
{
    lane_record *r = arg;
    if (lane > r->helpers)
        atomic_fetch_add(&r->bad_lanes, 1);
    if (lane == r->helpers)
        atomic_fetch_add(&r->caller_runs, 1);
    for (;;) {
        size_t i = atomic_fetch_add(&r->next, 1);
        if (i >= r->n_items)
            return;
        atomic_fetch_add(&r->done[i], 1);
    }
}

Test(thread_pool, a_job_runs_on_the_caller_and_only_on_known_lanes, .timeout = 60)
{
    const uint32_t helpers = 3;
    km_thread_pool *pool = km_thread_pool_create(helpers, "km-test");
    cr_assert_not_null(pool);
    enum { ITEMS = 5000 };
    atomic_uint *done = calloc(ITEMS, sizeof *done);
    cr_assert_not_null(done);
    for (uint32_t round = 0; round < 200; round++) {
        lane_record r = {.helpers = helpers, .n_items = ITEMS, .done = done};
        atomic_init(&r.caller_runs, 0);
        atomic_init(&r.bad_lanes, 0);
        atomic_init(&r.next, 0);
        km_thread_pool_run(pool, record_lane, &r);
        cr_assert_eq(atomic_load(&r.caller_runs), 1, "round %u: the caller runs the job once",
                     round);
        cr_assert_eq(atomic_load(&r.bad_lanes), 0, "round %u: a lane past the helpers", round);
        for (size_t i = 0; i < ITEMS; i++)
            cr_assert_eq(atomic_load(&done[i]), round + 1, "round %u item %zu", round, i);
    }
    free(done);
    km_thread_pool_destroy(pool);
    km_thread_pool_destroy(NULL);
}

/* ---- late lanes, idle pools, long runs of jobs ---------------------------------------------- */

typedef struct late_job {
    uint32_t helpers;
    uint32_t slow_lane;   /* this lane sleeps before it claims anything (may never join) */
    atomic_uint active;   /* lanes inside the job right now */
    atomic_uint max_seen; /* lanes inside at once, at most */
    atomic_size_t next;
    size_t n_items;
    atomic_uint *done;
} late_job;

static void late_lane(void *arg, uint32_t lane)
{
    late_job *j = arg;
    unsigned now = atomic_fetch_add(&j->active, 1) + 1;
    unsigned seen = atomic_load(&j->max_seen);
    while (now > seen && !atomic_compare_exchange_weak(&j->max_seen, &seen, now))
        ;
    if (lane == j->slow_lane) {
        struct timespec ts = {0, 2 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    for (;;) {
        size_t i = atomic_fetch_add(&j->next, 1);
        if (i >= j->n_items)
            break;
        atomic_fetch_add(&j->done[i], 1);
    }
    atomic_fetch_sub(&j->active, 1);
}

/* A lane that starts late (the caller's own, or a helper's) neither loses nor repeats work, and
 * run() returns only once every lane that joined has left: a slow helper is waited for. */
Test(thread_pool, a_late_lane_is_waited_for_and_work_is_done_once, .timeout = 30)
{
    const uint32_t helper_counts[] = {1, 2, 5};
    for (size_t h = 0; h < sizeof helper_counts / sizeof helper_counts[0]; h++) {
        uint32_t helpers = helper_counts[h];
        km_thread_pool *pool = km_thread_pool_create(helpers, "km-test");
        cr_assert_not_null(pool);
        enum { ITEMS = 3000 };
        atomic_uint *done = calloc(ITEMS, sizeof *done);
        cr_assert_not_null(done);
        for (uint32_t round = 0; round < 60; round++) {
            late_job j = {.helpers = helpers, .slow_lane = round % (helpers + 1),
                          .n_items = ITEMS, .done = done};
            atomic_init(&j.active, 0);
            atomic_init(&j.max_seen, 0);
            atomic_init(&j.next, 0);
            km_thread_pool_run(pool, late_lane, &j);
            cr_assert_eq(atomic_load(&j.active), 0,
                         "helpers %u round %u: run returned with a lane inside", helpers, round);
            cr_assert_leq(atomic_load(&j.max_seen), helpers + 1);
            for (size_t i = 0; i < ITEMS; i++)
                cr_assert_eq(atomic_load(&done[i]), round + 1, "helpers %u round %u item %zu",
                             helpers, round, i);
        }
        free(done);
        km_thread_pool_destroy(pool);
    }
}

/* Destroyed at once after creation (helpers still starting), after a job (helpers watching for
 * the next), and idle (helpers parked): every helper is joined, nothing hangs. */
Test(thread_pool, destroy_at_any_moment_of_the_helpers, .timeout = 30)
{
    for (int round = 0; round < 50; round++) {
        km_thread_pool *pool = km_thread_pool_create(1 + (uint32_t)round % 4, "km-test");
        cr_assert_not_null(pool);
        if (round % 3 >= 1) {
            part_counts c = {.calls = calloc(64, sizeof(atomic_uint))};
            cr_assert_not_null(c.calls);
            atomic_init(&c.busy, 0);
            km_thread_pool_for_each(pool, 64, count_part, &c);
            for (size_t i = 0; i < 64; i++)
                cr_assert_eq(atomic_load(&c.calls[i]), 1);
            free(c.calls);
        }
        if (round % 3 == 2) {
            struct timespec ts = {0, 3 * 1000 * 1000}; /* past the watch: helpers park */
            nanosleep(&ts, NULL);
        }
        km_thread_pool_destroy(pool);
    }
}

/* Many jobs back to back, some with nothing to claim: helpers watching between jobs join the
 * next one or back out, and no job's work is lost or done twice. */
Test(thread_pool, many_jobs_in_a_row, .timeout = 30)
{
    km_thread_pool *pool = km_thread_pool_create(3, "km-test");
    cr_assert_not_null(pool);
    atomic_uint *done = calloc(64, sizeof *done);
    cr_assert_not_null(done);
    for (uint32_t round = 0; round < 20000; round++) {
        size_t n = round % 5 == 0 ? 0 : round % 64;
        for (size_t i = 0; i < n; i++)
            atomic_store(&done[i], 0);
        lane_record r = {.helpers = 3, .n_items = n, .done = done};
        atomic_init(&r.caller_runs, 0);
        atomic_init(&r.bad_lanes, 0);
        atomic_init(&r.next, 0);
        km_thread_pool_run(pool, record_lane, &r);
        cr_assert_eq(atomic_load(&r.caller_runs), 1, "round %u", round);
        cr_assert_eq(atomic_load(&r.bad_lanes), 0, "round %u", round);
        for (size_t i = 0; i < n; i++)
            cr_assert_eq(atomic_load(&done[i]), 1, "round %u item %zu", round, i);
    }
    free(done);
    km_thread_pool_destroy(pool);
}
