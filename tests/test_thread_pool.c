/* SPDX-License-Identifier: Apache-2.0 */
/* km_thread_pool (src/index/thread_pool.h): every part of a for_each runs exactly once whichever
 * lanes join, runs come back to back without losing or repeating work, and a job runs on the
 * caller's lane (helpers) and never on a lane outside [0, helpers]. */
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>

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
