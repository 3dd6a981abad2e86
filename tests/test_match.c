/* SPDX-License-Identifier: Apache-2.0 */
/* Scoring (km_index_match_batch) against the brute-force oracle of tests/test_util.c, on fresh
 * random inputs every run (seed printed on failure; replay with KM_TEST_SEED=...): prefix trees
 * of token sequences, workers storing runs (continuations, orphans, out of order, duplicates,
 * broadcasts), removing arbitrary subsets and clearing; after every step thousands of requests are
 * scored and compared worker by worker. Every segment size (32, 4, 1, 0), 8 and 1024 workers, 1
 * and 2 threads. Then edge cases (empty requests, request size limit, results reuse) and the
 * Mooncake conversation trace. */
#include <dirent.h>
#include <inttypes.h>
#include <pthread.h>
#include <sched.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "index/index_internal.h"
#include "test_util.h"

static km_index *make_index(uint32_t max_workers, uint32_t S, uint32_t threads)
{
    return km_test_growing_index(max_workers, S, threads); /* small, so the tables grow */
}

/* ---- random property tests ----------------------------------------------------------------- */

static void property(uint32_t S, uint32_t W, uint32_t threads)
{
    /* One stream per configuration, all derived from the printed seed. */
    km_rng r;
    km_rng_init(&r, km_test_seed() ^ ((uint64_t)S << 40) ^ ((uint64_t)W << 20) ^ threads);
    km_index *index = make_index(W, S, threads);
    km_oracle o;
    km_oracle_init(&o, W);
    km_corpus corpus;
    const uint32_t block_sizes[] = {1, 2, 4, 16};
    km_corpus_generate(&corpus, &r, 150, block_sizes[km_rng_below(&r, 4)], 200);
    km_workload wl;
    km_workload_init(&wl, &corpus, W);
    km_request_set rs = {0};
    km_match_results res;
    km_match_results_init(&res);
    char why[512];
    const int steps = 50;
    for (int step = 0; step < steps; step++) {
        km_workload_step(&wl, &r, &o, 6);
        km_update_stats got, expect;
        int rc = km_index_apply(index, wl.updates, wl.n_updates, &got);
        KM_CHECK(rc == KM_OK, "S=%u W=%u step %d: apply: %s (%s)", S, W, step, km_error_name(rc),
                 km_index_last_error(index));
        km_oracle_apply(&o, wl.updates, wl.n_updates, &expect);
        KM_CHECK(km_update_stats_equal(&got, &expect, why, sizeof why), "S=%u W=%u step %d: %s", S,
                 W, step, why);
        KM_CHECK(km_check_counters(&o, index, why, sizeof why), "S=%u W=%u step %d: %s", S, W,
                 step, why);
        km_request_set_generate(&rs, &r, &corpus, 2000);
        rc = km_index_match_batch(index, rs.requests, rs.n, &res);
        KM_CHECK(rc == KM_OK, "S=%u W=%u step %d: match: %s", S, W, step, km_error_name(rc));
        KM_CHECK(km_check_results(&o, rs.requests, rs.n, &res, S, why, sizeof why),
                 "S=%u W=%u threads %u step %d: %s", S, W, threads, step, why);
    }
    /* At the end, everything observable: holders of every block ever seen, counters, scoring. */
    km_request_set_generate(&rs, &r, &corpus, 3000);
    KM_CHECK(km_check_index(&o, index, S, rs.requests, rs.n, &res, why, sizeof why),
             "S=%u W=%u final: %s", S, W, why);
    KM_CHECK(o.pairs > 0, "the workload stored nothing");
    km_index_stats st;
    cr_assert_eq(km_index_get_stats(index, &st), KM_OK);
    KM_CHECK(S == 0 || st.segment_keys > 0, "S=%u: no segment keys at all: the segment path went "
             "untested", S);
    KM_CHECK(S != 0 || st.segment_keys == 0, "S=0 must disable segment keys");
    km_match_results_free(&res);
    km_request_set_free(&rs);
    km_workload_free(&wl);
    km_corpus_free(&corpus);
    km_oracle_free(&o);
    km_index_destroy(index);
}

#define PROPERTY(S, W, T) \
    Test(match_property, s##S##_w##W##_t##T, .timeout = 60) { property(S, W, T); }

/* Scoring while the block table grows incrementally reads both of its arrays (src/index/host_table.h): store
 * whole corpus chains (and now and then remove part of one, so keys are erased from the old array
 * too) until the block table has grown past KM_TABLE_INCREMENTAL_SLOTS twice, and after every
 * update that leaves it mid-growth, score requests against the oracle. */
static void property_growing(uint32_t S, uint32_t W, uint32_t threads)
{
    km_rng r;
    km_rng_init(&r, km_test_seed() ^ ((uint64_t)S << 40) ^ ((uint64_t)W << 20) ^ threads ^ 0x6E0);
    km_index *index = make_index(W, S, threads);
    km_oracle o;
    km_oracle_init(&o, W);
    km_corpus corpus;
    km_corpus_generate(&corpus, &r, 1500, 4, 200);
    km_request_set rs = {0};
    km_match_results res;
    km_match_results_init(&res);
    char why[512];
    int checks = 0, incremental_growths = 0;
    uint64_t capacity = index->blocks.capacity;
    for (int step = 0; step < 20000 && incremental_growths < 2; step++) {
        km_update u;
        uint64_t tail[8];
        if (!km_growth_update(&r, &corpus, W, &u, tail))
            continue;
        km_update_stats got, expect;
        int rc = km_index_apply(index, &u, 1, &got);
        KM_CHECK(rc == KM_OK, "step %d: apply: %s (%s)", step, km_error_name(rc),
                 km_index_last_error(index));
        km_oracle_apply(&o, &u, 1, &expect);
        KM_CHECK(km_update_stats_equal(&got, &expect, why, sizeof why), "step %d: %s", step, why);
        if (index->blocks.capacity != capacity) {
            capacity = index->blocks.capacity;
            incremental_growths += index->blocks.old_slots != NULL;
        }
        if (index->blocks.old_slots && checks < 60) {
            checks++;
            km_request_set_generate(&rs, &r, &corpus, 500);
            rc = km_index_match_batch(index, rs.requests, rs.n, &res);
            KM_CHECK(rc == KM_OK, "step %d: match: %s", step, km_error_name(rc));
            KM_CHECK(km_check_results(&o, rs.requests, rs.n, &res, S, why, sizeof why),
                     "S=%u W=%u threads %u step %d, mid-growth (%llu of %llu old slots moved): %s",
                     S, W, threads, step, (unsigned long long)index->blocks.migrated,
                     (unsigned long long)index->blocks.old_capacity, why);
        }
    }
    cr_assert_eq(incremental_growths, 2, "the block table grew incrementally %d times",
                 incremental_growths);
    cr_assert_gt(checks, 10, "only %d scoring batches ran mid-growth", checks);
    km_request_set_generate(&rs, &r, &corpus, 2000);
    KM_CHECK(km_check_index(&o, index, S, rs.requests, rs.n, &res, why, sizeof why),
             "S=%u W=%u final: %s", S, W, why);
    km_match_results_free(&res);
    km_request_set_free(&rs);
    km_corpus_free(&corpus);
    km_oracle_free(&o);
    km_index_destroy(index);
}

#define PROPERTY_GROWING(S, W, T)                                                                 \
    Test(match_property, growing_s##S##_w##W##_t##T, .timeout = 120) { property_growing(S, W, T); }
PROPERTY_GROWING(4, 64, 2)
PROPERTY_GROWING(0, 8, 1)

PROPERTY(32, 8, 1)
PROPERTY(32, 8, 2)
PROPERTY(32, 1024, 1)
PROPERTY(32, 1024, 2)
PROPERTY(4, 8, 1)
PROPERTY(4, 8, 2)
PROPERTY(4, 1024, 1)
PROPERTY(4, 1024, 2)
PROPERTY(1, 8, 1)
PROPERTY(1, 8, 2)
PROPERTY(1, 1024, 1)
PROPERTY(1, 1024, 2)
PROPERTY(0, 8, 1)
PROPERTY(0, 8, 2)
PROPERTY(0, 1024, 1)
PROPERTY(0, 1024, 2)
PROPERTY(32, 64, 7) /* more lanes than this machine's cores: helpers join late or not at all */
/* Wide bitmaps: fewer requests in flight per lane (their scratch is capped), so a lane's walks
 * interleave less. */
PROPERTY(32, 8192, 2)
PROPERTY(4, 40000, 1)

/* ---- edge cases ---------------------------------------------------------------------------- */

static void store_chain(km_index *index, km_oracle *o, uint32_t w, const uint64_t *h, uint32_t n)
{
    km_update u = {KM_UPDATE_STORE, w, KM_NO_PARENT, h, n, KM_TIER_DEVICE};
    km_update_stats got, expect;
    cr_assert_eq(km_index_apply(index, &u, 1, &got), KM_OK);
    km_oracle_apply(o, &u, 1, &expect);
}

/* Prefixes every worker holds: each of a few corpus chains is stored by every worker, each to a
 * depth drawn from a handful (so many workers tie for the deepest, in one 64-worker word and across
 * words), so block 0's holder set fills whole words of the bitmap: the case where every worker
 * appears in an answer. Scored against the oracle; at least one answer must name every worker. */
static void property_every_worker(uint32_t S, uint32_t W, uint32_t threads)
{
    km_rng r;
    km_rng_init(&r, km_test_seed() ^ ((uint64_t)S << 40) ^ ((uint64_t)W << 20) ^ threads ^ 0xA11);
    km_index *index = make_index(W, S, threads);
    km_oracle o;
    km_oracle_init(&o, W);
    km_corpus corpus;
    km_corpus_generate(&corpus, &r, 40, 4, 120);
    km_request_set rs = {0};
    km_match_results res;
    km_match_results_init(&res);
    char why[512];
    for (int round = 0; round < 4; round++) {
        const km_seq *q = &corpus.seqs[km_rng_below(&r, (uint32_t)corpus.n_seqs)];
        if (q->n_blocks == 0)
            continue;
        uint32_t depths[4] = {1, q->n_blocks, 1 + km_rng_below(&r, q->n_blocks),
                              1 + km_rng_below(&r, q->n_blocks)};
        for (uint32_t w = 0; w < W; w++)
            store_chain(index, &o, w, q->chain, depths[km_rng_below(&r, 4)]);
        km_request_set_generate(&rs, &r, &corpus, 1500);
        int rc = km_index_match_batch(index, rs.requests, rs.n, &res);
        KM_CHECK(rc == KM_OK, "match: %s", km_error_name(rc));
        KM_CHECK(km_check_results(&o, rs.requests, rs.n, &res, S, why, sizeof why),
                 "S=%u W=%u threads %u round %d: %s", S, W, threads, round, why);
    }
    uint32_t widest = 0;
    for (size_t i = 0; i < res.n_requests; i++)
        widest = res.requests[i].count > widest ? res.requests[i].count : widest;
    KM_CHECK(widest == W, "no answer named every worker (widest %u of %u)", widest, W);
    km_match_results_free(&res);
    km_request_set_free(&rs);
    km_corpus_free(&corpus);
    km_oracle_free(&o);
    km_index_destroy(index);
}

#define PROPERTY_EVERY_WORKER(S, W, T)                                                            \
    Test(match_property, every_worker_s##S##_w##W##_t##T, .timeout = 60)                          \
    {                                                                                             \
        property_every_worker(S, W, T);                                                           \
    }
PROPERTY_EVERY_WORKER(32, 64, 1)
PROPERTY_EVERY_WORKER(32, 64, 2)
PROPERTY_EVERY_WORKER(4, 130, 2) /* two whole words and a part */
PROPERTY_EVERY_WORKER(32, 1024, 2)
PROPERTY_EVERY_WORKER(0, 1024, 1)

Test(match, empty_requests, .timeout = 30)
{
    km_index *index = make_index(8, 4, 2);
    km_oracle o;
    km_oracle_init(&o, 8);
    uint64_t h[10];
    km_rng r;
    km_rng_init(&r, km_test_seed());
    for (int i = 0; i < 10; i++)
        h[i] = km_rng_hash(&r);
    store_chain(index, &o, 3, h, 10);
    km_request q[5] = {{h, 0}, {h, 10}, {NULL, 0}, {h, 0}, {h, 3}};
    km_match_results res;
    km_match_results_init(&res);
    cr_assert_eq(km_index_match_batch(index, q, 5, &res), KM_OK);
    char why[512];
    KM_CHECK(km_check_results(&o, q, 5, &res, 4, why, sizeof why), "%s", why);
    const int empty_index[] = {0, 2, 3};
    for (int k = 0; k < 3; k++) {
        int i = empty_index[k];
        const km_request_result *rr = &res.requests[i];
        cr_assert(rr->count == 0 && rr->owner == KM_NO_WORKER && rr->owner_depth == 0 &&
                  rr->probes == 0, "empty request %d: count %u owner %u probes %u", i, rr->count,
                  rr->owner, rr->probes);
    }
    cr_assert(res.requests[1].owner == 3 && res.requests[1].owner_depth == 10);
    cr_assert(res.requests[4].owner == 3 && res.requests[4].owner_depth == 3);
    /* A batch of nothing but empty requests. */
    km_request e[3] = {{h, 0}, {NULL, 0}, {h, 0}};
    cr_assert_eq(km_index_match_batch(index, e, 3, &res), KM_OK);
    cr_assert(res.n_requests == 3 && res.probes == 0);
    for (int i = 0; i < 3; i++)
        cr_assert(res.requests[i].count == 0 && res.requests[i].owner == KM_NO_WORKER);
    km_match_results_free(&res);
    km_oracle_free(&o);
    km_index_destroy(index);
}

/* Found by fuzzing (tests/fuzz/fuzz_snapshot.c): a first batch in which nothing matches left
 * results.matches and results.tiers NULL, and scoring computed `matches + first` from it, which is
 * undefined behaviour (UBSan: "applying zero offset to null pointer"); so did every caller that
 * reads a request's rows. The arrays exist after any successful batch. */
Test(match, no_match_batch_leaves_result_arrays_allocated, .timeout = 30)
{
    km_index *index = make_index(8, 4, 1);
    uint64_t h[3] = {0x1234, 0x5678, 0x9abc};
    km_request q[2] = {{h, 3}, {h, 0}};
    km_match_results res;
    km_match_results_init(&res);
    cr_assert_eq(km_index_match_batch(index, q, 2, &res), KM_OK);
    cr_assert_eq(res.n_requests, 2);
    cr_assert_eq(res.n_matches, 0);
    cr_assert(res.requests[0].count == 0 && res.requests[1].count == 0);
    cr_assert(res.matches != NULL, "matches is NULL after a batch without matches");
    cr_assert(res.tiers != NULL, "tiers is NULL after a batch without matches");
    km_match_results_free(&res);
    km_index_destroy(index);
}

Test(match, request_over_the_limit_is_too_large, .timeout = 30)
{
    km_index_config cfg;
    km_test_config(&cfg, NULL);
    cfg.backend = KM_BACKEND_CPU;
    cfg.max_workers = 8;
    cfg.max_request_blocks = 100;
    cfg.threads = 2;
    km_index *index = NULL;
    cr_assert_eq(km_index_create(&cfg, &index), KM_OK);
    km_oracle o;
    km_oracle_init(&o, 8);
    uint64_t h[101];
    km_rng r;
    km_rng_init(&r, km_test_seed());
    for (int i = 0; i < 101; i++)
        h[i] = km_rng_hash(&r);
    store_chain(index, &o, 1, h, 101);
    km_match_results res;
    km_match_results_init(&res);
    km_request ok[2] = {{h, 100}, {h, 50}};
    cr_assert_eq(km_index_match_batch(index, ok, 2, &res), KM_OK, "exactly the limit is accepted");
    cr_assert(res.requests[0].owner_depth == 100 && res.requests[1].owner_depth == 50);
    km_request big[3] = {{h, 10}, {h, 101}, {h, 20}};
    cr_assert_eq(km_index_match_batch(index, big, 3, &res), KM_ERR_TOO_LARGE);
    cr_assert_neq(km_index_last_error(index)[0], 0, "no detail for KM_ERR_TOO_LARGE");
    /* The index and the results struct stay usable. */
    cr_assert_eq(km_index_match_batch(index, ok, 2, &res), KM_OK);
    char why[512];
    KM_CHECK(km_check_results(&o, ok, 2, &res, cfg.segment_blocks, why, sizeof why), "%s", why);
    km_match_results_free(&res);
    km_oracle_free(&o);
    km_index_destroy(index);
}

/* A live index beside its oracle, with a corpus and workload to drive both (the edge-case tests'
 * common setup). */
typedef struct scoring_fixture {
    km_rng r;
    km_index *index;
    km_oracle o;
    km_corpus corpus;
    km_workload wl;
    km_request_set rs;
    km_match_results res;
} scoring_fixture;

static void fixture_init(scoring_fixture *f, uint32_t W, uint32_t S, uint32_t threads,
                         uint64_t seed_mix)
{
    memset(f, 0, sizeof *f);
    km_rng_init(&f->r, km_test_seed() ^ seed_mix);
    f->index = make_index(W, S, threads);
    km_oracle_init(&f->o, W);
    km_corpus_generate(&f->corpus, &f->r, 100, 4, 120);
    km_workload_init(&f->wl, &f->corpus, W);
    km_match_results_init(&f->res);
}

/* One workload step applied to the index and the oracle, which must agree on its statistics. */
static void fixture_step(scoring_fixture *f)
{
    char why[512];
    km_workload_step(&f->wl, &f->r, &f->o, 4);
    km_update_stats got, expect;
    int rc = km_index_apply(f->index, f->wl.updates, f->wl.n_updates, &got);
    KM_CHECK(rc == KM_OK, "apply: %s", km_error_name(rc));
    km_oracle_apply(&f->o, f->wl.updates, f->wl.n_updates, &expect);
    KM_CHECK(km_update_stats_equal(&got, &expect, why, sizeof why), "%s", why);
}

static void fixture_free(scoring_fixture *f)
{
    km_match_results_free(&f->res);
    km_request_set_free(&f->rs);
    km_workload_free(&f->wl);
    km_corpus_free(&f->corpus);
    km_oracle_free(&f->o);
    km_index_destroy(f->index);
}

Test(match, results_struct_reused_across_batches, .timeout = 60)
{
    const uint32_t S = 8;
    scoring_fixture f;
    fixture_init(&f, 64, S, 2, 0);
    cr_assert(f.res.n_requests == 0 && f.res.n_matches == 0 && f.res.probes == 0);
    const size_t sizes[] = {1000, 10, 0, 3000, 5, 1, 2500, 0, 7};
    size_t prev_req_cap = 0, prev_match_cap = 0;
    char why[512];
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
        for (int s = 0; s < 3; s++)
            fixture_step(&f);
        km_request_set_generate(&f.rs, &f.r, &f.corpus, sizes[k]);
        int rc = km_index_match_batch(f.index, f.rs.requests, f.rs.n, &f.res);
        KM_CHECK(rc == KM_OK, "batch %zu: %s", k, km_error_name(rc));
        KM_CHECK(km_check_results(&f.o, f.rs.requests, f.rs.n, &f.res, S, why, sizeof why),
                 "batch %zu of %zu requests: %s", k, sizes[k], why);
        KM_CHECK(f.res.requests_capacity >= prev_req_cap && f.res.matches_capacity >= prev_match_cap,
                 "buffers shrank at batch %zu", k);
        KM_CHECK(f.res.requests_capacity >= f.res.n_requests &&
                     f.res.matches_capacity >= f.res.n_matches,
                 "capacities below the counts at batch %zu", k);
        prev_req_cap = f.res.requests_capacity;
        prev_match_cap = f.res.matches_capacity;
    }
    fixture_free(&f);
}

/* Many small and odd-sized batches on more lanes than cores: every batch size around the chunk
 * sizes and the single-lane threshold, so helpers join before, during and after each phase (or
 * never), and the hand-off between the phases is exercised hundreds of times. */
Test(match, many_lanes_every_batch_size, .timeout = 90)
{
    const uint32_t S = 4;
    scoring_fixture f;
    fixture_init(&f, 64, S, 7, 0x7A7E5);
    char why[512];
    for (int step = 0; step < 6; step++) {
        fixture_step(&f);
        for (size_t n = 1; n <= 300; n += 1 + (n > 140) * 3) {
            km_request_set_generate(&f.rs, &f.r, &f.corpus, n);
            int rc = km_index_match_batch(f.index, f.rs.requests, f.rs.n, &f.res);
            KM_CHECK(rc == KM_OK, "step %d, %zu requests: %s", step, n, km_error_name(rc));
            KM_CHECK(km_check_results(&f.o, f.rs.requests, f.rs.n, &f.res, S, why, sizeof why),
                     "step %d, batch of %zu requests on 7 lanes: %s", step, n, why);
        }
    }
    fixture_free(&f);
}

/* The CPUs a scoring helper (thread name km-index) of this process may run on, merged over all of
 * them; false when none is found. */
static bool helpers_affinity(cpu_set_t *out)
{
    CPU_ZERO(out);
    bool found = false;
    DIR *d = opendir("/proc/self/task");
    if (!d)
        return false;
    struct dirent *de;
    while ((de = readdir(d))) {
        char path[300], comm[32] = {0};
        snprintf(path, sizeof path, "/proc/self/task/%s/comm", de->d_name);
        FILE *f = fopen(path, "r");
        if (!f)
            continue;
        bool helper = fgets(comm, sizeof comm, f) && strncmp(comm, "km-index", 8) == 0;
        fclose(f);
        cpu_set_t set;
        if (helper && sched_getaffinity((pid_t)atoi(de->d_name), sizeof set, &set) == 0) {
            CPU_OR(out, out, &set);
            found = true;
        }
    }
    closedir(d);
    return found;
}

/* A helper woken on its caller's CPU moves to the others the creating thread could use: whatever
 * the batches, its CPUs stay within those (here one CPU, where it cannot move, then all that this
 * process may use), and the answers stay exact. */
static void helpers_stay_within(const cpu_set_t *allowed)
{
    cpu_set_t saved;
    cr_assert_eq(pthread_getaffinity_np(pthread_self(), sizeof saved, &saved), 0);
    cr_assert_eq(pthread_setaffinity_np(pthread_self(), sizeof *allowed, allowed), 0);
    scoring_fixture f;
    fixture_init(&f, 64, 4, 3, 0xAFF1);
    char why[512];
    for (int step = 0; step < 4; step++) {
        fixture_step(&f);
        for (int b = 0; b < 20; b++) {
            km_request_set_generate(&f.rs, &f.r, &f.corpus, 200);
            int rc = km_index_match_batch(f.index, f.rs.requests, f.rs.n, &f.res);
            KM_CHECK(rc == KM_OK, "step %d: %s", step, km_error_name(rc));
            KM_CHECK(km_check_results(&f.o, f.rs.requests, f.rs.n, &f.res, 4, why, sizeof why),
                     "step %d: %s", step, why);
        }
    }
    cpu_set_t used;
    cr_assert(helpers_affinity(&used), "the index runs scoring helpers");
    cpu_set_t outside;
    CPU_OR(&outside, &used, allowed);
    cr_assert(CPU_EQUAL(&outside, allowed), "a helper may run on a CPU its creator could not use");
    fixture_free(&f);
    cr_assert_eq(pthread_setaffinity_np(pthread_self(), sizeof saved, &saved), 0);
}

Test(match, helpers_run_only_where_their_creator_could, .timeout = 60)
{
    cpu_set_t all;
    cr_assert_eq(pthread_getaffinity_np(pthread_self(), sizeof all, &all), 0);
    int first = -1;
    for (int c = 0; c < CPU_SETSIZE && first < 0; c++)
        if (CPU_ISSET(c, &all))
            first = c;
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(first, &one);
    helpers_stay_within(&one);
    helpers_stay_within(&all);
}

/* ---- the Mooncake trace -------------------------------------------------------------------- */

typedef struct trace_ctx {
    km_index *index;
    size_t batches;
} trace_ctx;

static void trace_apply(void *p, const km_update *u, size_t n, const km_update_stats *expect)
{
    trace_ctx *t = p;
    km_update_stats got;
    int rc = km_index_apply(t->index, u, n, &got);
    KM_CHECK(rc == KM_OK, "trace batch %zu: %s (%s)", t->batches, km_error_name(rc),
             km_index_last_error(t->index));
    char why[512];
    KM_CHECK(km_update_stats_equal(&got, expect, why, sizeof why), "trace batch %zu: %s",
             t->batches, why);
    t->batches++;
}

static void trace_property(uint32_t W, int affinity)
{
    km_trace_case tc;
    char why[512];
    int rc = km_trace_case_load(&tc, 64, 7000, why, sizeof why);
    if (rc == KM_ERR_IO)
        cr_skip_test("Mooncake trace not available: %s", why);
    cr_assert_eq(rc, KM_OK, "loading the trace: %s", why);
    cr_assert_geq(tc.n, 5000, "the trace has only %zu requests", tc.n);

    km_rng r;
    km_rng_init(&r, km_test_seed() ^ W);
    const uint32_t S = 32;
    km_index *index = make_index(W, S, 2);
    km_oracle o;
    km_oracle_init(&o, W);
    trace_ctx t = {index, 0};
    km_trace_scenario(&tc, 4000, W, affinity, &r, &o, trace_apply, &t);
    KM_CHECK(km_check_counters(&o, index, why, sizeof why), "W=%u after the trace: %s", W, why);

    /* Score the state with requests it has seen (first 1000) and the next 3000 it has not. */
    size_t n = 4000;
    km_request *q = malloc(n * sizeof *q);
    for (size_t i = 0; i < n; i++) {
        size_t j = i < 1000 ? i : 4000 + (i - 1000);
        q[i] = (km_request){tc.hashes + tc.offset[j], tc.n_blocks[j]};
    }
    km_match_results res;
    km_match_results_init(&res);
    rc = km_index_match_batch(index, q, n, &res);
    KM_CHECK(rc == KM_OK, "W=%u: match: %s", W, km_error_name(rc));
    KM_CHECK(km_check_results(&o, q, n, &res, S, why, sizeof why), "W=%u trace: %s", W, why);
    /* The trace shares prefixes: a state that matches nothing would make this test vacuous. */
    uint64_t matched = 0;
    for (size_t i = 0; i < n; i++)
        matched += res.requests[i].owner_depth > 1;
    KM_CHECK(matched > n / 4, "W=%u: only %" PRIu64 " requests matched more than one block", W,
             matched);
    km_index_stats st;
    cr_assert_eq(km_index_get_stats(index, &st), KM_OK);
    KM_CHECK(st.segment_keys > 0 && st.shared_sets > 0,
             "W=%u: %" PRIu64 " segment keys, %" PRIu64 " shared sets", W, st.segment_keys,
             st.shared_sets);
    free(q);
    km_match_results_free(&res);
    km_oracle_free(&o);
    km_index_destroy(index);
    km_trace_case_free(&tc);
}

Test(match_trace, mooncake_64_workers_by_conversation, .timeout = 90) { trace_property(64, 1); }
Test(match_trace, mooncake_1024_workers_round_robin, .timeout = 90) { trace_property(1024, 0); }

/* The walk's prefetches are what keep several DRAM misses in flight; GCC can delete a
 * prefetch-only helper's calls without a warning (src/index/slot_walk.h, KM_PREFETCHER). Check in the
 * objects of this build that every marked prefetch line produced an instruction. */
Test(build, prefetches_are_emitted, .timeout = 60)
{
    if (system("command -v python3 >/dev/null 2>&1 && command -v objdump >/dev/null 2>&1") != 0)
        cr_skip_test("python3 or objdump not available: prefetch instructions not checked");
    const char *bin = getenv("KM_BIN") ? getenv("KM_BIN") : "build/kvmatch";
    char dir[512];
    snprintf(dir, sizeof dir, "%s", bin);
    char *slash = strrchr(dir, '/');
    if (slash)
        *slash = '\0';
    else
        snprintf(dir, sizeof dir, ".");
    char cmd[700], out[4096];
    snprintf(cmd, sizeof cmd, "python3 tests/check_prefetch.py '%s'", dir);
    int status = km_test_run_capture(cmd, out, sizeof out);
    if (status == 2)
        cr_skip_test("%s", out);
    cr_assert_eq(status, 0, "%s", out);
}
