/* SPDX-License-Identifier: Apache-2.0 */
/* Index operations through the public API (include/kvmatch/index.h): lifecycle and config
 * validation, store / remove / holders / counters, error paths that must leave the content
 * unchanged (worker range, NULL pointers, the memory cap, mixed batches: all or nothing), clears,
 * widely held blocks (bitmap sets that grow and shrink), growth from a tiny table to millions of
 * pairs under interleaved updates and scoring, and segment-key soundness cases. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

static km_index *make_index(uint32_t max_workers, uint32_t segment_blocks, uint64_t initial_blocks,
                            uint64_t cap)
{
    km_index_config cfg;
    km_test_config(&cfg, NULL);
    cfg.backend = KM_BACKEND_CPU;
    cfg.max_workers = max_workers;
    cfg.segment_blocks = segment_blocks;
    cfg.initial_blocks = initial_blocks;
    cfg.memory_cap_bytes = cap;
    cfg.threads = 2;
    km_index *index = NULL;
    int rc = km_index_create(&cfg, &index);
    cr_assert_eq(rc, KM_OK, "km_index_create: %s", km_error_name(rc));
    cr_assert(index != NULL);
    return index;
}

/* A synthetic chain: block i of chain c. Any distinct non-reserved values work as chain hashes. */
static uint64_t chain_hash(uint64_t c, uint64_t i)
{
    uint64_t z = c * UINT64_C(0x100000001B3) + i + UINT64_C(0x632BE59BD9B4E019);
    z = (z ^ (z >> 30)) * UINT64_C(0xBF58476D1CE4E5B9);
    z = (z ^ (z >> 27)) * UINT64_C(0x94D049BB133111EB);
    z ^= z >> 31;
    return z < 2 ? z + 2 : z;
}

static void fill_chain(uint64_t *h, uint64_t c, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        h[i] = chain_hash(c, i);
}

static uint32_t holders(const km_index *index, uint64_t hash, uint32_t *buf, uint32_t cap)
{
    uint32_t n = UINT32_MAX;
    int rc = km_index_holders(index, hash, buf, cap, &n);
    cr_assert_eq(rc, KM_OK, "km_index_holders: %s", km_error_name(rc));
    return n;
}

static km_index_stats stats_of(const km_index *index)
{
    km_index_stats st;
    cr_assert_eq(km_index_get_stats(index, &st), KM_OK);
    return st;
}

static km_worker_stats worker_of(const km_index *index, uint32_t w)
{
    km_worker_stats ws;
    int rc = km_index_worker_stats(index, w, &ws);
    cr_assert_eq(rc, KM_OK, "km_index_worker_stats(%u): %s", w, km_error_name(rc));
    return ws;
}

/* Score one request and return its result (entries copied into out when non-NULL). */
static km_request_result match_one(km_index *index, const uint64_t *h, uint32_t n,
                                   km_worker_match *out)
{
    km_match_results res;
    km_match_results_init(&res);
    km_request q = {h, n};
    int rc = km_index_match_batch(index, &q, 1, &res);
    cr_assert_eq(rc, KM_OK, "km_index_match_batch: %s (%s)", km_error_name(rc),
                 km_index_last_error(index));
    cr_assert_eq(res.n_requests, 1);
    km_request_result rr = res.requests[0];
    if (out)
        memcpy(out, res.matches + rr.first, rr.count * sizeof *out);
    km_match_results_free(&res);
    return rr;
}

/* Apply through the API and the oracle alike, checking the update stats. */
static void apply_both(km_index *index, km_oracle *o, const km_update *u, size_t n)
{
    km_update_stats got, expect;
    memset(&got, 0xAB, sizeof got);
    int rc = km_index_apply(index, u, n, &got);
    KM_CHECK(rc == KM_OK, "km_index_apply: %s (%s)", km_error_name(rc), km_index_last_error(index));
    km_oracle_apply(o, u, n, &expect);
    char why[512];
    KM_CHECK(km_update_stats_equal(&got, &expect, why, sizeof why), "%s", why);
}

/* ---- lifecycle and config ------------------------------------------------------------------ */

Test(index, config_defaults_create_destroy, .timeout = 30)
{
    km_index_config cfg;
    memset(&cfg, 0x5A, sizeof cfg);
    km_index_config_init(&cfg);
    cr_assert_eq(cfg.max_workers, 1024);
    cr_assert_eq(cfg.segment_blocks, 32);
    cr_assert_eq(cfg.initial_blocks, UINT64_C(1) << 16);
    cr_assert_eq(cfg.memory_cap_bytes, 0);
    cr_assert_eq(cfg.max_request_blocks, 1u << 20);
    cr_assert_eq(cfg.threads, 0);
    cr_assert_eq(cfg.backend, KM_BACKEND_AUTO);
    cr_assert_eq(cfg.cuda_device, 0);
    cr_assert(cfg.log == NULL);

    km_index_destroy(NULL); /* no-op */
    km_index *index = make_index(1024, 32, 1 << 16, 0);
    cr_assert_str_eq(km_index_backend_name(index), "cpu");
    cr_assert_str_eq(km_index_last_error(index), "", "no failure yet");
    km_index_stats st = stats_of(index);
    cr_assert_eq(st.blocks, 0);
    cr_assert_eq(st.pairs, 0);
    cr_assert_eq(st.segment_keys, 0);
    cr_assert_geq(st.block_capacity, 1 << 16, "initial_blocks is a capacity hint for blocks");
    cr_assert_gt(st.memory_bytes, 0);
    km_index_destroy(index);
}

static int create_status(void (*edit)(km_index_config *))
{
    km_index_config cfg;
    km_test_config(&cfg, NULL);
    cfg.backend = KM_BACKEND_CPU;
    cfg.initial_blocks = 1024;
    edit(&cfg);
    km_index *index = NULL;
    int rc = km_index_create(&cfg, &index);
    if (rc == KM_OK)
        km_index_destroy(index);
    else
        cr_assert(index == NULL, "a failed create must not hand out a handle");
    return rc;
}

static void workers_zero(km_index_config *c) { c->max_workers = 0; }
static void workers_over(km_index_config *c) { c->max_workers = KM_MAX_WORKERS_LIMIT + 1; }
static void workers_max(km_index_config *c) { c->max_workers = KM_MAX_WORKERS_LIMIT; }
static void workers_one(km_index_config *c) { c->max_workers = 1; }
static void segment_over(km_index_config *c) { c->segment_blocks = KM_MAX_SEGMENT_BLOCKS + 1; }
static void segment_max(km_index_config *c) { c->segment_blocks = KM_MAX_SEGMENT_BLOCKS; }
static void segment_zero(km_index_config *c) { c->segment_blocks = 0; }
static void backend_bogus(km_index_config *c) { c->backend = (km_backend_kind)7; }
static void request_zero(km_index_config *c) { c->max_request_blocks = 0; }
static void request_max(km_index_config *c) { c->max_request_blocks = KM_MAX_REQUEST_BLOCKS_LIMIT; }
static void request_over(km_index_config *c)
{
    c->max_request_blocks = KM_MAX_REQUEST_BLOCKS_LIMIT + 1;
}

Test(index, config_validation, .timeout = 30)
{
    cr_assert_eq(create_status(workers_zero), KM_ERR_INVALID_ARGUMENT);
    cr_assert_eq(create_status(workers_over), KM_ERR_INVALID_ARGUMENT);
    cr_assert_eq(create_status(segment_over), KM_ERR_INVALID_ARGUMENT);
    cr_assert_eq(create_status(backend_bogus), KM_ERR_INVALID_ARGUMENT);
    cr_assert_eq(create_status(workers_max), KM_OK);
    cr_assert_eq(create_status(workers_one), KM_OK);
    cr_assert_eq(create_status(segment_max), KM_OK);
    cr_assert_eq(create_status(segment_zero), KM_OK);
    /* A request near 2^32 blocks would take the walk's positions past 32 bits. */
    cr_assert_eq(create_status(request_zero), KM_ERR_INVALID_ARGUMENT);
    cr_assert_eq(create_status(request_over), KM_ERR_INVALID_ARGUMENT);
    cr_assert_eq(create_status(request_max), KM_OK);

    km_index_config cfg;
    km_index_config_init(&cfg);
    cr_assert_eq(km_index_create(&cfg, NULL), KM_ERR_NULL_POINTER);
}

/* An initial_blocks no host could hold is refused as out of memory (or over the cap), whatever
 * its value: a hint whose table sizes wrap around 2^64 (0xCCCCCCCCCCCCCCC0 makes about 2^64 - 16
 * slots, whose slot array size wraps to a few bytes) must not make an index of a tiny array. */
Test(index, an_initial_blocks_no_host_holds_fails_cleanly, .timeout = 60)
{
    km_rng r;
    km_rng_init(&r, km_test_seed());
    const uint64_t fixed[] = {UINT64_C(0xCCCCCCCCCCCCCCC0), UINT64_MAX, UINT64_C(1) << 62,
                              UINT64_C(0x0CCCCCCCCCCCCCD0), UINT64_C(0x3333333333333340)};
    for (int i = 0; i < 400; i++) {
        /* Fixed values first, then random ones from 2^44 up, at every scale. */
        uint64_t v = i < 5 ? fixed[i]
                           : (km_rng_next(&r) | UINT64_C(1) << 63) >> km_rng_below(&r, 20);
        km_index_config cfg;
        km_test_config(&cfg, NULL);
        cfg.backend = KM_BACKEND_CPU;
        cfg.max_workers = 8;
        cfg.threads = 1;
        cfg.initial_blocks = v;
        cfg.memory_cap_bytes = i % 2 ? UINT64_C(1) << 30 : 0;
        km_index *index = (km_index *)&r; /* not NULL: a failed create must clear it */
        int rc = km_index_create(&cfg, &index);
        KM_CHECK(rc == KM_ERR_OUT_OF_MEMORY || rc == KM_ERR_MEMORY_CAP,
                 "initial_blocks %#llx (cap %llu): %s", (unsigned long long)v,
                 (unsigned long long)cfg.memory_cap_bytes, km_error_name(rc));
        KM_CHECK(index == NULL, "initial_blocks %#llx: a failed create handed out a handle",
                 (unsigned long long)v);
    }
}

/* ---- basic operations ---------------------------------------------------------------------- */

Test(index, store_remove_holders_stats, .timeout = 30)
{
    km_index *index = make_index(16, 4, 64, 0);
    cr_assert_eq(km_index_max_workers(index), 16);
    cr_assert_eq(km_index_max_workers(NULL), 0);
    km_worker_stats ws;
    cr_assert_eq(km_index_worker_stats(index, 15, &ws), KM_OK);
    cr_assert_eq(km_index_worker_stats(index, 16, &ws), KM_ERR_WORKER_RANGE);
    uint64_t h[10];
    fill_chain(h, 1, 10);
    uint32_t buf[16];

    cr_assert_eq(km_index_store(index, 3, KM_NO_PARENT, h, 10), KM_OK);
    cr_assert_eq(km_index_store(index, 1, KM_NO_PARENT, h, 6), KM_OK);
    cr_assert_eq(km_index_store(index, 9, h[5], h + 6, 2), KM_OK); /* holds blocks 6, 7 only */

    cr_assert_eq(holders(index, h[0], buf, 16), 2);
    cr_assert(buf[0] == 1 && buf[1] == 3, "holders ascending: %u %u", buf[0], buf[1]);
    cr_assert_eq(holders(index, h[6], buf, 16), 2);
    cr_assert(buf[0] == 3 && buf[1] == 9);
    cr_assert_eq(holders(index, h[9], buf, 16), 1);
    cr_assert_eq(buf[0], 3);
    /* Short capacity: the full count still comes back, the prefix is filled. */
    buf[0] = buf[1] = 777;
    cr_assert_eq(holders(index, h[6], buf, 1), 2);
    cr_assert_eq(buf[0], 3);
    cr_assert_eq(buf[1], 777, "holders wrote past the capacity");
    cr_assert_eq(holders(index, h[0], NULL, 0), 2);
    cr_assert_eq(holders(index, chain_hash(99, 0), buf, 16), 0, "unknown block");

    km_index_stats st = stats_of(index);
    cr_assert_eq(st.blocks, 10);
    cr_assert_eq(st.pairs, 18);
    cr_assert_eq(worker_of(index, 3).blocks, 10);
    cr_assert_eq(worker_of(index, 3).stores, 10);
    cr_assert_eq(worker_of(index, 1).blocks, 6);
    cr_assert_eq(worker_of(index, 9).blocks, 2);
    cr_assert_eq(worker_of(index, 0).blocks, 0);

    km_worker_match m[16];
    km_request_result rr = match_one(index, h, 10, m);
    cr_assert_eq(rr.count, 2, "worker 9 lacks block 0, so it is not a match");
    cr_assert(m[0].worker == 1 && m[0].depth == 6 && m[1].worker == 3 && m[1].depth == 10);
    cr_assert(rr.owner == 3 && rr.owner_depth == 10);

    /* Remove a middle block from worker 3: its depth stops there. */
    cr_assert_eq(km_index_remove(index, 3, &h[4], 1), KM_OK);
    rr = match_one(index, h, 10, m);
    cr_assert(rr.count == 2 && m[0].depth == 6 && m[1].depth == 4);
    cr_assert(rr.owner == 1 && rr.owner_depth == 6);
    cr_assert_eq(holders(index, h[4], buf, 16), 1);
    cr_assert_eq(worker_of(index, 3).blocks, 9);
    cr_assert_eq(worker_of(index, 3).removes, 1);

    /* Tie: both at depth 4 -> lowest id owns. */
    cr_assert_eq(km_index_remove(index, 1, &h[4], 1), KM_OK);
    rr = match_one(index, h, 10, m);
    cr_assert(rr.owner == 1 && rr.owner_depth == 4, "ties go to the lowest worker id");
    cr_assert_eq(holders(index, h[4], buf, 16), 0, "block 4 is held by nobody now");
    cr_assert_eq(stats_of(index).blocks, 9);

    /* Remove the head: no match at all, owner KM_NO_WORKER. */
    uint64_t head[1] = {h[0]};
    cr_assert_eq(km_index_remove(index, 1, head, 1), KM_OK);
    cr_assert_eq(km_index_remove(index, 3, head, 1), KM_OK);
    rr = match_one(index, h, 10, NULL);
    cr_assert(rr.count == 0 && rr.owner == KM_NO_WORKER && rr.owner_depth == 0);
    cr_assert_eq(stats_of(index).pairs, 18 - 4);
    km_index_destroy(index);
}

Test(index, duplicate_stores_and_absent_removes_are_counted, .timeout = 30)
{
    km_index *index = make_index(8, 32, 64, 0);
    uint64_t h[5];
    fill_chain(h, 7, 5);
    km_update_stats st;
    km_update u = {KM_UPDATE_STORE, 2, KM_NO_PARENT, h, 5, KM_TIER_DEVICE};
    cr_assert_eq(km_index_apply(index, &u, 1, &st), KM_OK);
    cr_assert(st.stored == 5 && st.duplicate_stores == 0 && st.orphan_runs == 0);
    u.n_hashes = 3;
    cr_assert_eq(km_index_apply(index, &u, 1, &st), KM_OK);
    cr_assert(st.stored == 0 && st.duplicate_stores == 3, "stored %" PRIu64 " dup %" PRIu64,
              st.stored, st.duplicate_stores);
    uint64_t gone[3] = {h[4], chain_hash(8, 0), h[4]};
    km_update r = {KM_UPDATE_REMOVE, 2, 0, gone, 3, KM_TIER_DEVICE};
    cr_assert_eq(km_index_apply(index, &r, 1, &st), KM_OK);
    cr_assert(st.removed == 1 && st.absent_removes == 2, "removed %" PRIu64 " absent %" PRIu64,
              st.removed, st.absent_removes);
    km_worker_stats ws = worker_of(index, 2);
    cr_assert_eq(ws.blocks, 4);
    cr_assert_eq(ws.stores, 5);
    cr_assert_eq(ws.duplicate_stores, 3);
    cr_assert_eq(ws.removes, 1);
    cr_assert_eq(ws.absent_removes, 2);
    cr_assert_eq(ws.clears, 0);
    /* Removing from a worker that holds nothing is harmless. */
    cr_assert_eq(km_index_remove(index, 5, h, 5), KM_OK);
    cr_assert_eq(worker_of(index, 5).absent_removes, 5);
    cr_assert_eq(stats_of(index).pairs, 4);
    /* An orphan run (parent unknown) is stored and found, and counted. */
    uint64_t o[3];
    fill_chain(o, 50, 3);
    km_update orphan = {KM_UPDATE_STORE, 1, chain_hash(49, 0), o, 3, KM_TIER_DEVICE};
    cr_assert_eq(km_index_apply(index, &orphan, 1, &st), KM_OK);
    cr_assert(st.orphan_runs == 1 && st.stored == 3);
    km_request_result rr = match_one(index, o, 3, NULL);
    cr_assert(rr.owner == 1 && rr.owner_depth == 3);
    km_index_destroy(index);
}

Test(index, clear_and_remove_worker, .timeout = 30)
{
    km_index *index = make_index(8, 4, 64, 0);
    uint64_t h[20];
    fill_chain(h, 3, 20);
    for (uint32_t w = 0; w < 8; w++)
        cr_assert_eq(km_index_store(index, w, KM_NO_PARENT, h, 4 + 2 * w), KM_OK);
    cr_assert_eq(km_index_remove(index, 5, h + 10, 2), KM_OK);
    km_update_stats st;
    km_update c = {KM_UPDATE_CLEAR_WORKER, 5, 0, NULL, 0, KM_TIER_DEVICE};
    cr_assert_eq(km_index_apply(index, &c, 1, &st), KM_OK);
    cr_assert_eq(st.cleared, 12, "worker 5 held 14 - 2 blocks, cleared %" PRIu64, st.cleared);
    km_worker_stats ws = worker_of(index, 5);
    cr_assert(ws.blocks == 0 && ws.clears == 1 && ws.stores == 14 && ws.removes == 2,
              "clear keeps the worker's history counters");
    km_worker_match m[8];
    km_request_result rr = match_one(index, h, 20, m);
    cr_assert_eq(rr.count, 7);
    for (uint32_t j = 0; j < 7; j++) {
        uint32_t w = j < 5 ? j : j + 1;
        cr_assert(m[j].worker == w && m[j].depth == 4 + 2 * w, "entry %u: worker %u depth %u", j,
                  m[j].worker, m[j].depth);
    }
    cr_assert(rr.owner == 7 && rr.owner_depth == 18);

    km_update rw = {KM_UPDATE_REMOVE_WORKER, 7, 0, NULL, 0, KM_TIER_DEVICE};
    cr_assert_eq(km_index_apply(index, &rw, 1, &st), KM_OK);
    cr_assert_eq(st.cleared, 18);
    ws = worker_of(index, 7);
    cr_assert(ws.blocks == 0 && ws.stores == 0 && ws.removes == 0 && ws.duplicate_stores == 0 &&
              ws.absent_removes == 0, "REMOVE_WORKER resets the counters");
    rr = match_one(index, h, 20, NULL);
    cr_assert(rr.count == 6 && rr.owner == 6 && rr.owner_depth == 16);
    /* A worker that was cleared can store again. */
    cr_assert_eq(km_index_store(index, 7, KM_NO_PARENT, h, 20), KM_OK);
    rr = match_one(index, h, 20, NULL);
    cr_assert(rr.count == 7 && rr.owner == 7 && rr.owner_depth == 20);
    cr_assert_eq(km_index_clear_worker(index, 0), KM_OK);
    cr_assert_eq(km_index_remove_worker(index, 1), KM_OK);
    cr_assert_eq(stats_of(index).pairs, (uint64_t)(8 + 10 + 12 + 16 + 20));
    /* Clearing an empty worker is fine. */
    cr_assert_eq(km_index_clear_worker(index, 0), KM_OK);
    cr_assert_eq(worker_of(index, 0).clears, 2);
    km_index_destroy(index);
}

/* ---- error paths leave the content unchanged ----------------------------------------------- */

typedef struct fixture {
    km_index *index;
    km_oracle oracle;
    km_corpus corpus;
    km_request_set requests;
    km_match_results res;
    km_rng rng;
    uint32_t segment_blocks;
} fixture;

static void fixture_init(fixture *f, uint32_t max_workers, uint32_t S, uint64_t initial,
                         uint64_t cap, int steps)
{
    memset(f, 0, sizeof *f);
    km_rng_init(&f->rng, km_test_seed());
    f->index = make_index(max_workers, S, initial, cap);
    f->segment_blocks = S;
    km_oracle_init(&f->oracle, max_workers);
    km_corpus_generate(&f->corpus, &f->rng, 120, 4, 160);
    km_request_set_generate(&f->requests, &f->rng, &f->corpus, 600);
    km_match_results_init(&f->res);
    km_workload w;
    km_workload_init(&w, &f->corpus, max_workers);
    for (int i = 0; i < steps; i++) {
        km_workload_step(&w, &f->rng, &f->oracle, 4);
        apply_both(f->index, &f->oracle, w.updates, w.n_updates);
    }
    km_workload_free(&w);
}

static void fixture_verify(fixture *f, const char *when)
{
    char why[512];
    KM_CHECK(km_check_index(&f->oracle, f->index, f->segment_blocks, f->requests.requests,
                            f->requests.n, &f->res, why, sizeof why),
             "%s: %s", when, why);
}

static void fixture_free(fixture *f)
{
    km_index_destroy(f->index);
    km_oracle_free(&f->oracle);
    km_corpus_free(&f->corpus);
    km_request_set_free(&f->requests);
    km_match_results_free(&f->res);
}

/* Expect `rc_expected` from applying the batch and no change at all (checked against the oracle,
 * which does not see the batch, and against the segment counts from before). */
static void expect_rejected(fixture *f, const km_update *u, size_t n, int rc_expected,
                            const char *what)
{
    km_index_stats before = stats_of(f->index);
    km_update_stats st;
    int rc = km_index_apply(f->index, u, n, &st);
    KM_CHECK(rc == rc_expected, "%s: %s, expected %s", what, km_error_name(rc),
             km_error_name(rc_expected));
    KM_CHECK(km_index_last_error(f->index)[0] != 0, "%s: km_index_last_error is empty", what);
    km_index_stats after = stats_of(f->index);
    KM_CHECK(after.segment_keys == before.segment_keys &&
             after.segment_pairs == before.segment_pairs &&
             after.shared_sets == before.shared_sets,
             "%s: segment keys %" PRIu64 "->%" PRIu64 ", segment pairs %" PRIu64 "->%" PRIu64
             ", shared sets %" PRIu64 "->%" PRIu64, what, before.segment_keys, after.segment_keys,
             before.segment_pairs, after.segment_pairs, before.shared_sets, after.shared_sets);
    fixture_verify(f, what);
}

/* A clear's names are checked like a remove's: a reserved value, or a NULL array with a count, is
 * refused with its own error and the batch changes nothing (the worker keeps every block). */
Test(index, a_clear_naming_bad_hashes_is_refused_and_changes_nothing, .timeout = 30)
{
    km_index *index = make_index(8, 4, 64, 0);
    uint64_t h[12];
    fill_chain(h, 5, 12);
    cr_assert_eq(km_index_store(index, 2, KM_NO_PARENT, h, 12), KM_OK);
    uint64_t named[3] = {h[0], KM_HASH_RESERVED_TOMBSTONE, h[1]};
    km_update c = {KM_UPDATE_CLEAR_WORKER, 2, 0, named, 3, KM_TIER_DEVICE};
    cr_assert_eq(km_index_apply(index, &c, 1, NULL), KM_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(km_index_last_error(index), "reserved value") != NULL, "%s",
              km_index_last_error(index));
    km_update r = {KM_UPDATE_REMOVE_WORKER, 2, 0, NULL, 4, KM_TIER_DEVICE};
    cr_assert_eq(km_index_apply(index, &r, 1, NULL), KM_ERR_NULL_POINTER);
    cr_assert(strstr(km_index_last_error(index), "hashes is NULL") != NULL, "%s",
              km_index_last_error(index));
    km_worker_stats ws = worker_of(index, 2);
    cr_assert(ws.blocks == 12 && ws.clears == 0, "the worker keeps its blocks and counters");
    km_request_result rr = match_one(index, h, 12, NULL);
    cr_assert(rr.count == 1 && rr.owner == 2 && rr.owner_depth == 12);
    /* The same clear with good names goes through, naming all it needs. */
    km_update_stats st;
    c.hashes = h;
    c.n_hashes = 12;
    cr_assert_eq(km_index_apply(index, &c, 1, &st), KM_OK);
    cr_assert(st.cleared == 12 && st.clear_scans == 0);
    cr_assert_eq(worker_of(index, 2).blocks, 0);
    km_index_destroy(index);
}

Test(index, worker_out_of_range_changes_nothing, .timeout = 60)
{
    fixture f;
    fixture_init(&f, 8, 4, 256, 0, 40);
    fixture_verify(&f, "setup");
    const km_seq *s = &f.corpus.seqs[0];
    uint64_t fresh[3] = {km_rng_hash(&f.rng), km_rng_hash(&f.rng), km_rng_hash(&f.rng)};
    const uint32_t bad[] = {8, 9, 1000, KM_NO_WORKER};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        uint32_t w = bad[i];
        KM_CHECK(km_index_store(f.index, w, KM_NO_PARENT, fresh, 3) == KM_ERR_WORKER_RANGE,
                 "store for worker %u", w);
        KM_CHECK(km_index_remove(f.index, w, s->chain, s->n_blocks) == KM_ERR_WORKER_RANGE,
                 "remove for worker %u", w);
        KM_CHECK(km_index_clear_worker(f.index, w) == KM_ERR_WORKER_RANGE, "clear worker %u", w);
        KM_CHECK(km_index_remove_worker(f.index, w) == KM_ERR_WORKER_RANGE, "remove worker %u", w);
        km_worker_stats ws;
        KM_CHECK(km_index_worker_stats(f.index, w, &ws) == KM_ERR_WORKER_RANGE,
                 "worker_stats for %u", w);
        KM_CHECK(km_index_last_error(f.index)[0] != 0, "no detail after a failure");
    }
    fixture_verify(&f, "after out-of-range updates");
    fixture_free(&f);
}

Test(index, mixed_batches_are_all_or_nothing, .timeout = 60)
{
    fixture f;
    fixture_init(&f, 8, 4, 256, 0, 40);
    /* Valid updates of every kind around one invalid update, in every position. */
    uint64_t fresh[40];
    for (int i = 0; i < 40; i++)
        fresh[i] = km_rng_hash(&f.rng);
    const km_seq *s = &f.corpus.seqs[1];
    uint64_t rm[8];
    size_t n_rm = 0;
    for (uint32_t i = 0; i < s->n_blocks && n_rm < 8; i += 2)
        rm[n_rm++] = s->chain[i];
    km_update good[5] = {
        {KM_UPDATE_STORE, 1, KM_NO_PARENT, fresh, 40, KM_TIER_DEVICE},
        {KM_UPDATE_REMOVE, 0, 0, rm, n_rm, KM_TIER_DEVICE},
        {KM_UPDATE_STORE, 2, KM_NO_PARENT, s->chain, s->n_blocks, KM_TIER_DEVICE},
        {KM_UPDATE_CLEAR_WORKER, 3, 0, NULL, 0, KM_TIER_DEVICE},
        {KM_UPDATE_REMOVE_WORKER, 4, 0, NULL, 0, KM_TIER_DEVICE},
    };
    km_update bad_worker = {KM_UPDATE_STORE, 8, KM_NO_PARENT, fresh, 40, KM_TIER_DEVICE};
    km_update bad_remove = {KM_UPDATE_REMOVE, 100, 0, rm, n_rm, KM_TIER_DEVICE};
    km_update null_hashes = {KM_UPDATE_STORE, 1, KM_NO_PARENT, NULL, 5, KM_TIER_DEVICE};
    km_update null_remove = {KM_UPDATE_REMOVE, 1, 0, NULL, 2, KM_TIER_DEVICE};
    /* Chain hashes never take the reserved values 0 and 1 (they are remapped). */
    uint64_t reserved0[3] = {fresh[0], 0, fresh[1]}, reserved1[2] = {1, fresh[2]};
    km_update store_reserved0 = {KM_UPDATE_STORE, 1, KM_NO_PARENT, reserved0, 3, KM_TIER_DEVICE};
    km_update store_reserved1 = {KM_UPDATE_STORE, 2, KM_NO_PARENT, reserved1, 2, KM_TIER_DEVICE};
    km_update bad_kind = {(km_update_kind)9, 1, 0, fresh, 2, KM_TIER_DEVICE};
    struct {
        const km_update *u;
        int rc;
        const char *what;
    } bads[] = {{&bad_worker, KM_ERR_WORKER_RANGE, "store for worker 8"},
                {&bad_remove, KM_ERR_WORKER_RANGE, "remove for worker 100"},
                {&null_hashes, KM_ERR_NULL_POINTER, "store with NULL hashes"},
                {&null_remove, KM_ERR_NULL_POINTER, "remove with NULL hashes"},
                {&store_reserved0, KM_ERR_INVALID_ARGUMENT, "store of reserved hash 0"},
                {&store_reserved1, KM_ERR_INVALID_ARGUMENT, "store of reserved hash 1"},
                {&bad_kind, KM_ERR_INVALID_ARGUMENT, "unknown update kind"}};
    for (size_t b = 0; b < sizeof bads / sizeof bads[0]; b++) {
        for (size_t at = 0; at <= 5; at++) {
            km_update batch[6];
            size_t n = 0;
            for (size_t i = 0; i < 5; i++) {
                if (i == at)
                    batch[n++] = *bads[b].u;
                batch[n++] = good[i];
            }
            if (at == 5)
                batch[n++] = *bads[b].u;
            char what[128];
            snprintf(what, sizeof what, "%s at position %zu of 6", bads[b].what, at);
            expect_rejected(&f, batch, n, bads[b].rc, what);
        }
    }
    /* The same valid updates alone go through. */
    apply_both(f.index, &f.oracle, good, 5);
    fixture_verify(&f, "after the valid batch");
    fixture_free(&f);
}

Test(index, null_pointers, .timeout = 30)
{
    km_index *index = make_index(8, 32, 64, 0);
    uint64_t h[2] = {chain_hash(1, 0), chain_hash(1, 1)};
    km_update_stats st;
    cr_assert_eq(km_index_store(index, 0, KM_NO_PARENT, NULL, 2), KM_ERR_NULL_POINTER);
    cr_assert_eq(km_index_remove(index, 0, NULL, 1), KM_ERR_NULL_POINTER);
    cr_assert_eq(km_index_apply(index, NULL, 1, &st), KM_ERR_NULL_POINTER);
    cr_assert_neq(km_index_last_error(index)[0], 0);
    cr_assert_eq(km_index_apply(index, NULL, 0, NULL), KM_OK, "an empty batch is fine");
    cr_assert_eq(km_index_store(index, 0, KM_NO_PARENT, h, 0), KM_OK, "an empty run is fine");
    cr_assert_eq(stats_of(index).pairs, 0);
    cr_assert_eq(km_index_store(index, 0, KM_NO_PARENT, h, 2), KM_OK);
    km_update u = {KM_UPDATE_STORE, 1, KM_NO_PARENT, h, 2, KM_TIER_DEVICE};
    cr_assert_eq(km_index_apply(index, &u, 1, NULL), KM_OK, "stats may be NULL");
    cr_assert_eq(stats_of(index).pairs, 4);

    km_index_stats is;
    km_worker_stats ws;
    uint32_t n;
    cr_assert_eq(km_index_get_stats(index, NULL), KM_ERR_NULL_POINTER);
    cr_assert_eq(km_index_get_stats(NULL, &is), KM_ERR_NULL_POINTER);
    cr_assert_eq(km_index_worker_stats(index, 0, NULL), KM_ERR_NULL_POINTER);
    cr_assert_eq(km_index_worker_stats(NULL, 0, &ws), KM_ERR_NULL_POINTER);
    cr_assert_eq(km_index_holders(index, h[0], NULL, 0, NULL), KM_ERR_NULL_POINTER);
    cr_assert_eq(km_index_holders(index, h[0], NULL, 4, &n), KM_ERR_NULL_POINTER,
                 "capacity without a buffer");
    cr_assert_eq(km_index_apply(NULL, &u, 1, NULL), KM_ERR_NULL_POINTER);

    km_match_results res;
    km_match_results_init(&res);
    km_request q = {h, 2}, qnull = {NULL, 2};
    cr_assert_eq(km_index_match_batch(index, &q, 1, NULL), KM_ERR_NULL_POINTER);
    cr_assert_eq(km_index_match_batch(index, NULL, 1, &res), KM_ERR_NULL_POINTER);
    cr_assert_eq(km_index_match_batch(index, &qnull, 1, &res), KM_ERR_NULL_POINTER);
    cr_assert_eq(km_index_match_batch(NULL, &q, 1, &res), KM_ERR_NULL_POINTER);
    cr_assert_eq(km_index_match_batch(index, NULL, 0, &res), KM_OK);
    cr_assert_eq(res.n_requests, 0);
    cr_assert_eq(km_index_match_batch(index, &q, 1, &res), KM_OK);
    cr_assert(res.n_requests == 1 && res.requests[0].count == 2 && res.requests[0].owner == 0);
    /* A refused batch leaves no request in the results: the last batch's scores are not its own. */
    km_request too_long = {h, UINT32_MAX};
    const km_request *refused[] = {NULL, &qnull, &too_long};
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(km_index_match_batch(index, &q, 1, &res), KM_OK);
        cr_assert_eq(res.n_requests, 1);
        int rc = km_index_match_batch(index, refused[i], 1, &res);
        cr_assert(rc == KM_ERR_NULL_POINTER || rc == KM_ERR_TOO_LARGE, "%s", km_error_name(rc));
        cr_assert_eq(res.n_requests, 0, "refused batch %d left the last batch's results", i);
        cr_assert_eq(res.n_matches, 0);
    }
    km_match_results_free(&res);
    km_index_destroy(index);
}

Test(index, largest_worker_range, .timeout = 30)
{
    const uint32_t W = KM_MAX_WORKERS_LIMIT;
    km_index *index = make_index(W, 2, 64, 0);
    uint64_t h[4];
    fill_chain(h, 9, 4);
    for (uint32_t w = W - 6; w < W; w++)
        cr_assert_eq(km_index_store(index, w, KM_NO_PARENT, h, 4), KM_OK, "worker %u", w);
    for (uint32_t w = 0; w < 3; w++)
        cr_assert_eq(km_index_store(index, w, KM_NO_PARENT, h, 1 + w), KM_OK);
    cr_assert_eq(km_index_store(index, W, KM_NO_PARENT, h, 4), KM_ERR_WORKER_RANGE);
    uint32_t buf[16];
    cr_assert_eq(holders(index, h[0], buf, 16), 9);
    cr_assert(buf[0] == 0 && buf[3] == W - 6 && buf[8] == W - 1, "holders %u %u %u", buf[0],
              buf[3], buf[8]);
    km_worker_match m[16];
    km_request_result rr = match_one(index, h, 4, m);
    cr_assert(rr.count == 9 && rr.owner == W - 6 && rr.owner_depth == 4);
    cr_assert(m[0].worker == 0 && m[0].depth == 1 && m[2].depth == 3 && m[8].worker == W - 1);
    km_index_destroy(index);
}

/* Applies `first` followed by a store of 300,000 fresh blocks (worker 3, chains from
 * `big_chain_seed`) that cannot fit a 4 MiB cap, and asserts the batch is refused: the batch is
 * undone, `first` included. */
static void apply_then_exceed_cap(km_index *index, km_update first, uint64_t big_chain_seed)
{
    size_t n_big = 300000;
    uint64_t *big = malloc(n_big * sizeof *big);
    cr_assert(big);
    for (size_t i = 0; i < n_big; i++)
        big[i] = chain_hash(big_chain_seed + i / 1000, i % 1000);
    km_update batch[2] = {first, {KM_UPDATE_STORE, 3, KM_NO_PARENT, big, n_big, KM_TIER_DEVICE}};
    cr_assert_eq(km_index_apply(index, batch, 2, NULL), KM_ERR_MEMORY_CAP);
    free(big);
}

/* A batch that removes a block (dropping the only holder's segment key) and then fails on the
 * memory cap is undone: the segment key comes back, and it must still know its chain, so that a
 * later remove of another of its blocks drops the worker again (segment fingerprints are rebuilt
 * by the undo). Checked through scoring, where a stale segment key would claim the whole segment. */
Test(index, undone_segment_key_still_invalidates, .timeout = 60)
{
    km_index *index = make_index(8, 4, 1024, UINT64_C(4) << 20);
    uint64_t h[8];
    fill_chain(h, 77, 8);
    cr_assert_eq(km_index_store(index, 2, KM_NO_PARENT, h, 8), KM_OK);
    cr_assert_eq(match_one(index, h, 8, NULL).owner_depth, 8);
    /* Remove block 1 (worker 2 leaves segment [0..3]), then a store far over the cap. */
    apply_then_exceed_cap(index, (km_update){KM_UPDATE_REMOVE, 2, KM_NO_PARENT, h + 1, 1,
                                             KM_TIER_DEVICE}, 500000);
    km_index_stats st = stats_of(index);
    cr_assert_eq(st.segment_keys, 2, "both segment keys are back after the rollback");
    cr_assert_eq(match_one(index, h, 8, NULL).owner_depth, 8);
    /* Now lose block 2 for real: the restored key [0..3] must let worker 2 go. */
    cr_assert_eq(km_index_remove(index, 2, h + 2, 1), KM_OK);
    km_worker_match m[4];
    km_request_result rr = match_one(index, h, 8, m);
    cr_assert_eq(rr.count, 1);
    cr_assert_eq(m[0].worker, 2);
    cr_assert_eq(m[0].depth, 2, "blocks 0 and 1 are held, block 2 is not (got depth %u)", m[0].depth);
    km_index_destroy(index);
}

/* ---- memory cap ---------------------------------------------------------------------------- */

Test(index, memory_cap_rejects_a_big_batch_and_keeps_content, .timeout = 90)
{
    const uint64_t cap = UINT64_C(8) << 20;
    fixture f;
    fixture_init(&f, 64, 8, 1024, cap, 30);
    fixture_verify(&f, "setup");
    /* One batch far over the cap: a small valid store followed by 400k fresh blocks. */
    size_t n_big = 400000;
    uint64_t *big = malloc(n_big * sizeof *big);
    cr_assert(big);
    for (size_t i = 0; i < n_big; i++)
        big[i] = chain_hash(1000000 + i / 1000, i % 1000);
    uint64_t small[4] = {chain_hash(5, 0), chain_hash(5, 1), chain_hash(5, 2), chain_hash(5, 3)};
    km_update batch[2] = {{KM_UPDATE_STORE, 3, KM_NO_PARENT, small, 4, KM_TIER_DEVICE},
                          {KM_UPDATE_STORE, 7, KM_NO_PARENT, big, n_big, KM_TIER_DEVICE}};
    expect_rejected(&f, batch, 2, KM_ERR_MEMORY_CAP, "400k blocks under an 8 MiB cap");
    km_index_stats st = stats_of(f.index);
    KM_CHECK(st.memory_cap_bytes == cap, "memory_cap_bytes %" PRIu64, st.memory_cap_bytes);
    KM_CHECK(st.memory_bytes <= cap, "memory %" PRIu64 " over the cap", st.memory_bytes);
    uint32_t n;
    for (size_t i = 0; i < n_big; i += 997) {
        KM_CHECK(km_index_holders(f.index, big[i], NULL, 0, &n) == KM_OK && n == 0,
                 "block %zu of the rejected batch is present", i);
    }

    /* Fill up step by step (chains and broadcasts, so bitmaps and segment keys are allocated
     * too): each batch either applies fully or fails with KM_ERR_MEMORY_CAP leaving no trace. */
    int failures = 0;
    for (uint64_t c = 0; c < 4000 && failures < 3; c++) {
        uint64_t h[100];
        fill_chain(h, 2000000 + c, 100);
        km_update u[6];
        size_t nu = 0;
        u[nu++] = (km_update){KM_UPDATE_STORE, (uint32_t)(c % 64), KM_NO_PARENT, h, 100, KM_TIER_DEVICE};
        if (c % 4 == 0)
            for (uint32_t k = 1; k <= 5; k++)
                u[nu++] = (km_update){KM_UPDATE_STORE, (uint32_t)((c + 9 * k) % 64), KM_NO_PARENT,
                                      h, 50, KM_TIER_DEVICE};
        km_update_stats got;
        int rc = km_index_apply(f.index, u, nu, &got);
        if (rc == KM_OK) {
            km_update_stats expect;
            km_oracle_apply(&f.oracle, u, nu, &expect);
            char why[512];
            KM_CHECK(km_update_stats_equal(&got, &expect, why, sizeof why), "%s", why);
        } else {
            KM_CHECK(rc == KM_ERR_MEMORY_CAP, "batch %" PRIu64 ": %s", c, km_error_name(rc));
            failures++;
            fixture_verify(&f, "after a batch that hit the cap");
        }
        st = stats_of(f.index);
        KM_CHECK(st.memory_bytes <= cap, "memory %" PRIu64 " over the cap after batch %" PRIu64,
                 st.memory_bytes, c);
    }
    KM_CHECK(failures > 0, "never reached an 8 MiB cap with 400k blocks");
    fixture_verify(&f, "at the cap");
    /* Still usable: removing makes room, scoring works. */
    const km_seq *s = &f.corpus.seqs[0];
    if (s->n_blocks > 0) {
        km_update r = {KM_UPDATE_REMOVE, 0, 0, s->chain, s->n_blocks, KM_TIER_DEVICE};
        apply_both(f.index, &f.oracle, &r, 1);
    }
    fixture_verify(&f, "after a remove at the cap");
    free(big);
    fixture_free(&f);
}

/* A batch that fails on the memory cap half way leaves no trace, whatever its earlier updates did
 * to the worker sets' form (inline ids or a bitmap). Each round starts from a fresh index whose
 * cap is exactly the memory of its starting state, with every bitmap of the pool in use, so a
 * rollback that needed a fresh bitmap would find none; then a few random batches (applied, or
 * refused at the cap) and one that must fail: random updates over chains held by 3-5 workers, so
 * sets cross the promotion (a fifth holder) and demotion (down to 3) lines both ways, then a store
 * the block table cannot take without growing. Checked against the oracle and against the index's
 * own form counts (shared_sets). */
enum { CAP_W = 8, CAP_S = 4, CAP_LEN = 32, CAP_CHAINS = 4, CAP_FRESH = 4096 };
static const uint32_t cap_holders[CAP_CHAINS] = {5, 5, 4, 3};

static km_index *cap_index(uint64_t chains[CAP_CHAINS][CAP_LEN], uint64_t cap, km_oracle *o)
{
    km_index *index = make_index(CAP_W, CAP_S, 256, cap);
    for (uint32_t c = 0; c < CAP_CHAINS; c++)
        for (uint32_t w = 0; w < cap_holders[c]; w++) {
            km_update u = {KM_UPDATE_STORE, w, KM_NO_PARENT, chains[c], CAP_LEN, KM_TIER_DEVICE};
            cr_assert_eq(km_index_apply(index, &u, 1, NULL), KM_OK, "setup: %s",
                         km_index_last_error(index));
            km_update_stats ignored;
            if (o)
                km_oracle_apply(o, &u, 1, &ignored);
        }
    return index;
}

/* Up to 8 random updates over the chains (removes of random subsets, mostly by their holders;
 * runs stored with their true parents; clears) into batch; subsets holds 8 * CAP_LEN hashes. */
static size_t cap_random_updates(km_rng *r, uint64_t chains[CAP_CHAINS][CAP_LEN], km_update *batch,
                                 uint64_t *subsets)
{
    size_t n = 1 + km_rng_below(r, 8);
    for (size_t k = 0; k < n; k++) {
        uint32_t c = km_rng_below(r, CAP_CHAINS);
        uint32_t w = km_rng_below(r, CAP_W);
        uint32_t pick = km_rng_below(r, 10);
        if (pick < 4) { /* mostly by a worker that holds the chain */
            w = km_rng_below(r, cap_holders[c] + 1);
            uint64_t *sub = subsets + k * CAP_LEN;
            uint32_t m = 0;
            for (uint32_t i = 0; i < CAP_LEN; i++)
                if (km_rng_percent(r, 60))
                    sub[m++] = chains[c][i];
            batch[k] = (km_update){KM_UPDATE_REMOVE, w, 0, sub, m, KM_TIER_DEVICE};
        } else if (pick < 9) {
            uint32_t a = km_rng_below(r, CAP_LEN);
            uint32_t b = a + 1 + km_rng_below(r, CAP_LEN - a);
            batch[k] = (km_update){KM_UPDATE_STORE, w, a ? chains[c][a - 1] : KM_NO_PARENT,
                                   chains[c] + a, b - a, KM_TIER_DEVICE};
        } else {
            batch[k] = (km_update){KM_UPDATE_CLEAR_WORKER, w, 0, NULL, 0, KM_TIER_DEVICE};
        }
    }
    return n;
}

Test(index, rollback_at_the_cap_restores_set_forms, .timeout = 120)
{
    km_rng rng;
    km_rng_init(&rng, km_test_seed());
    uint64_t chains[CAP_CHAINS][CAP_LEN];
    for (uint32_t c = 0; c < CAP_CHAINS; c++)
        for (uint32_t i = 0; i < CAP_LEN; i++)
            chains[c][i] = km_rng_hash(&rng);
    km_index *probe = cap_index(chains, 0, NULL);
    uint64_t cap = stats_of(probe).memory_bytes;
    KM_CHECK(stats_of(probe).shared_sets == 2 * CAP_LEN, "setup: %" PRIu64 " shared sets",
             stats_of(probe).shared_sets);
    km_index_destroy(probe);

    km_request q[CAP_CHAINS];
    for (uint32_t c = 0; c < CAP_CHAINS; c++)
        q[c] = (km_request){chains[c], CAP_LEN};
    km_match_results res;
    km_match_results_init(&res);
    uint64_t *fresh = malloc(CAP_FRESH * sizeof *fresh);
    uint64_t *subsets = malloc(8 * CAP_LEN * sizeof *subsets);
    cr_assert(fresh && subsets);
    char why[512];
    for (int round = 0; round < 400; round++) {
        km_oracle o;
        km_oracle_init(&o, CAP_W);
        km_index *index = cap_index(chains, cap, &o);
        uint32_t n_batches = 1 + km_rng_below(&rng, 3);
        for (uint32_t k = 0; k < n_batches; k++) {
            int fail = k + 1 == n_batches;
            km_update batch[9];
            size_t n = cap_random_updates(&rng, chains, batch, subsets);
            if (fail) {
                for (uint32_t i = 0; i < CAP_FRESH; i++)
                    fresh[i] = km_rng_hash(&rng);
                batch[n++] = (km_update){KM_UPDATE_STORE, km_rng_below(&rng, CAP_W),
                                         KM_NO_PARENT, fresh, CAP_FRESH, KM_TIER_DEVICE};
            }
            km_index_stats before = stats_of(index);
            km_update_stats got;
            int rc = km_index_apply(index, batch, n, &got);
            if (rc == KM_OK) {
                KM_CHECK(!fail, "round %d: %u fresh blocks fit under the cap", round, CAP_FRESH);
                km_update_stats expect;
                km_oracle_apply(&o, batch, n, &expect);
                KM_CHECK(km_update_stats_equal(&got, &expect, why, sizeof why), "round %d: %s",
                         round, why);
            } else {
                KM_CHECK(rc == KM_ERR_MEMORY_CAP, "round %d: %s", round, km_error_name(rc));
                km_index_stats after = stats_of(index);
                KM_CHECK(after.shared_sets == before.shared_sets &&
                             after.segment_keys == before.segment_keys &&
                             after.segment_pairs == before.segment_pairs,
                         "round %d batch %u (%zu updates): shared sets %" PRIu64 "->%" PRIu64
                         ", segment keys %" PRIu64 "->%" PRIu64 ", segment pairs %" PRIu64
                         "->%" PRIu64, round, k, n, before.shared_sets, after.shared_sets,
                         before.segment_keys, after.segment_keys, before.segment_pairs,
                         after.segment_pairs);
            }
            KM_CHECK(km_check_index(&o, index, CAP_S, q, CAP_CHAINS, &res, why, sizeof why),
                     "round %d batch %u (%s, %zu updates): %s", round, k,
                     rc ? "rolled back" : "applied", n, why);
        }
        km_index_destroy(index);
        km_oracle_free(&o);
    }
    free(fresh);
    free(subsets);
    km_match_results_free(&res);
}

/* ---- widely held blocks -------------------------------------------------------------------- */

Test(index, widely_held_blocks_grow_and_shrink, .timeout = 60)
{
    const uint32_t W = 1024;
    km_index *index = make_index(W, 4, 256, 0);
    uint64_t h[8];
    fill_chain(h, 42, 8);
    uint32_t *buf = malloc(W * sizeof *buf);
    km_worker_match *m = malloc(W * sizeof *m);
    km_update *u = malloc(W * sizeof *u);
    uint64_t memory_after_first = 0;
    for (int cycle = 0; cycle < 4; cycle++) {
        for (uint32_t w = 0; w < W; w++)
            u[w] = (km_update){KM_UPDATE_STORE, w, KM_NO_PARENT, h, 8, KM_TIER_DEVICE};
        km_update_stats st;
        cr_assert_eq(km_index_apply(index, u, W, &st), KM_OK);
        cr_assert_eq(st.stored, 8 * W);
        for (int i = 0; i < 8; i++) {
            cr_assert_eq(holders(index, h[i], buf, W), W);
            for (uint32_t w = 0; w < W; w++)
                cr_assert_eq(buf[w], w, "holders of a widely held block must be ascending");
        }
        km_index_stats is = stats_of(index);
        cr_assert_eq(is.pairs, 8 * W);
        cr_assert_eq(is.shared_sets, 8, "every block is widely held");
        km_request_result rr = match_one(index, h, 8, m);
        cr_assert(rr.count == W && rr.owner == 0 && rr.owner_depth == 8);
        for (uint32_t w = 0; w < W; w++)
            cr_assert(m[w].worker == w && m[w].depth == 8);

        /* Odd workers lose block 5: depth 5 for them. */
        uint64_t b5 = h[5];
        for (uint32_t w = 0; w < W; w++)
            u[w] = (km_update){KM_UPDATE_REMOVE, w, 0, &b5, (w & 1) ? 1 : 0, KM_TIER_DEVICE};
        cr_assert_eq(km_index_apply(index, u, W, &st), KM_OK);
        cr_assert_eq(st.removed, W / 2);
        rr = match_one(index, h, 8, m);
        cr_assert(rr.count == W && rr.owner == 0 && rr.owner_depth == 8);
        for (uint32_t w = 0; w < W; w++)
            cr_assert(m[w].depth == ((w & 1) ? 5u : 8u), "worker %u depth %u", w, m[w].depth);

        /* Most leave again: workers 3.. clear. The sets shrink back to {0, 1, 2}. */
        for (uint32_t w = 3; w < W; w++)
            u[w - 3] = (km_update){KM_UPDATE_CLEAR_WORKER, w, 0, NULL, 0, KM_TIER_DEVICE};
        cr_assert_eq(km_index_apply(index, u, W - 3, &st), KM_OK);
        for (int i = 0; i < 8; i++) {
            uint32_t n = holders(index, h[i], buf, W);
            if (i == 5)
                cr_assert(n == 2 && buf[0] == 0 && buf[1] == 2, "block 5: %u holders", n);
            else
                cr_assert(n == 3 && buf[0] == 0 && buf[1] == 1 && buf[2] == 2, "block %d", i);
        }
        is = stats_of(index);
        cr_assert_eq(is.pairs, 8 * 3 - 1);
        cr_assert_eq(is.shared_sets, 0, "sets of 3 or fewer holders shrink back to inline form");
        rr = match_one(index, h, 8, m);
        cr_assert(rr.count == 3 && m[1].worker == 1 && m[1].depth == 5 && m[2].depth == 8);
        /* And the first three leave too: nothing left. */
        for (uint32_t w = 0; w < 3; w++)
            cr_assert_eq(km_index_clear_worker(index, w), KM_OK);
        is = stats_of(index);
        cr_assert(is.pairs == 0 && is.blocks == 0 && is.shared_sets == 0);
        /* Memory does not creep up cycle after cycle (bitmaps are reused). */
        if (cycle == 0)
            memory_after_first = is.memory_bytes;
        else
            cr_assert_leq(is.memory_bytes, memory_after_first, "cycle %d: memory %" PRIu64
                          " > %" PRIu64, cycle, is.memory_bytes, memory_after_first);
    }
    free(buf);
    free(m);
    free(u);
    km_index_destroy(index);
}

/* ---- growth -------------------------------------------------------------------------------- */

/* Chain c is stored by worker A(c) (in two runs) and by B(c); later some chains lose blocks:
 * A(c) loses block 10 when c % 7 == 0, B(c) loses the tail [32, 64) when c % 5 == 0 once chain
 * c + LAG has been stored. Expected depths follow from that. */
#define G_LEN 64u
#define G_LAG 100u
static uint32_t g_a(uint64_t c, uint32_t W) { return (uint32_t)(c % W); }
static uint32_t g_b(uint64_t c, uint32_t W)
{
    return (uint32_t)((c % W + 1 + c / W % (W - 1)) % W);
}

static void growth_expect(uint64_t c, uint64_t stored_upto, uint32_t W, km_worker_match *e,
                          uint32_t *count, uint32_t *owner, uint32_t *owner_depth)
{
    uint32_t a = g_a(c, W), b = g_b(c, W);
    uint32_t da = c % 7 == 0 ? 10 : G_LEN;
    uint32_t db = c % 5 == 0 && c + G_LAG <= stored_upto ? 32 : G_LEN;
    km_worker_match x = {a, da}, y = {b, db};
    if (b < a) {
        km_worker_match t = x;
        x = y;
        y = t;
    }
    e[0] = x, e[1] = y;
    *count = 2;
    *owner = x.depth >= y.depth ? x.worker : y.worker;
    *owner_depth = x.depth >= y.depth ? x.depth : y.depth;
}

Test(index, growth_to_millions_of_pairs_under_load, .timeout = 180)
{
    const uint32_t W = 64;
    const uint64_t N = 17000; /* chains: 1.09M blocks, 2.07M pairs */
    km_index *index = make_index(W, 32, 16, 0);
    uint64_t first_capacity = stats_of(index).block_capacity;
    km_rng r;
    km_rng_init(&r, km_test_seed());
    uint64_t h[G_LEN];
    uint64_t removed = 0;
    km_match_results res;
    km_match_results_init(&res);
    enum { NQ = 256 };
    km_request q[NQ];
    uint64_t *qh = malloc(NQ * G_LEN * sizeof *qh);
    uint64_t qc[NQ];
    for (uint64_t c = 0; c < N; c++) {
        fill_chain(h, c, G_LEN);
        km_update u[3] = {{KM_UPDATE_STORE, g_a(c, W), KM_NO_PARENT, h, 40, KM_TIER_DEVICE},
                          {KM_UPDATE_STORE, g_a(c, W), h[39], h + 40, G_LEN - 40, KM_TIER_DEVICE},
                          {KM_UPDATE_STORE, g_b(c, W), KM_NO_PARENT, h, G_LEN, KM_TIER_DEVICE}};
        km_update_stats st;
        int rc = km_index_apply(index, u, 3, &st);
        KM_CHECK(rc == KM_OK, "chain %" PRIu64 ": %s (%s)", c, km_error_name(rc),
                 km_index_last_error(index));
        KM_CHECK(st.stored == 2 * G_LEN && st.duplicate_stores == 0 && st.orphan_runs == 0,
                 "chain %" PRIu64 ": stored %" PRIu64, c, st.stored);
        if (c % 7 == 0) {
            cr_assert_eq(km_index_remove(index, g_a(c, W), &h[10], 1), KM_OK);
            removed++;
        }
        if (c >= G_LAG && (c - G_LAG) % 5 == 0) {
            uint64_t t[G_LEN];
            fill_chain(t, c - G_LAG, G_LEN);
            cr_assert_eq(km_index_remove(index, g_b(c - G_LAG, W), t + 32, 32), KM_OK);
            removed += 32;
        }
        if (c % 1024 == 1023) {
            /* Score a batch over everything stored so far. */
            for (int i = 0; i < NQ; i++) {
                qc[i] = km_rng_next(&r) % (c + 1);
                fill_chain(qh + i * G_LEN, qc[i], G_LEN);
                q[i] = (km_request){qh + i * G_LEN, G_LEN};
            }
            rc = km_index_match_batch(index, q, NQ, &res);
            KM_CHECK(rc == KM_OK, "match at chain %" PRIu64 ": %s", c, km_error_name(rc));
            for (int i = 0; i < NQ; i++) {
                km_worker_match e[2];
                uint32_t count, owner, od;
                growth_expect(qc[i], c, W, e, &count, &owner, &od);
                const km_request_result *rr = &res.requests[i];
                KM_CHECK(rr->count == count && rr->owner == owner && rr->owner_depth == od,
                         "at %" PRIu64 " chains, chain %" PRIu64 ": count %u owner %u/%u, "
                         "expected %u owner %u/%u", c + 1, qc[i], rr->count, rr->owner,
                         rr->owner_depth, count, owner, od);
                const km_worker_match *g = res.matches + rr->first;
                KM_CHECK(g[0].worker == e[0].worker && g[0].depth == e[0].depth &&
                         g[1].worker == e[1].worker && g[1].depth == e[1].depth,
                         "chain %" PRIu64 ": entries (%u,%u)(%u,%u), expected (%u,%u)(%u,%u)",
                         qc[i], g[0].worker, g[0].depth, g[1].worker, g[1].depth, e[0].worker,
                         e[0].depth, e[1].worker, e[1].depth);
            }
        }
    }
    km_index_stats st = stats_of(index);
    uint64_t pairs = 2 * N * G_LEN - removed;
    KM_CHECK(st.pairs == pairs, "pairs %" PRIu64 ", expected %" PRIu64, st.pairs, pairs);
    KM_CHECK(st.blocks == N * G_LEN, "blocks %" PRIu64, st.blocks);
    KM_CHECK(st.block_capacity > first_capacity && st.block_capacity >= st.blocks,
             "capacity %" PRIu64 " (first %" PRIu64 ")", st.block_capacity, first_capacity);
    KM_CHECK(st.pairs >= 2000000, "only %" PRIu64 " pairs", st.pairs);
    /* Every entry is still there, with exactly its holders. */
    uint32_t buf[4];
    for (uint64_t c = 0; c < N; c++) {
        fill_chain(h, c, G_LEN);
        uint32_t a = g_a(c, W), b = g_b(c, W);
        for (uint32_t i = 0; i < G_LEN; i++) {
            int has_a = !(c % 7 == 0 && i == 10);
            int has_b = !(c % 5 == 0 && c + G_LAG < N && i >= 32);
            uint32_t n = holders(index, h[i], buf, 4);
            uint32_t lo = a < b ? a : b, hi = a < b ? b : a;
            uint32_t en = (uint32_t)(has_a + has_b);
            int ok = n == en;
            if (ok && en == 2)
                ok = buf[0] == lo && buf[1] == hi;
            else if (ok && en == 1)
                ok = buf[0] == (has_a ? a : b);
            KM_CHECK(ok, "chain %" PRIu64 " block %u: %u holders, expected %u", c, i, n, en);
        }
    }
    free(qh);
    km_match_results_free(&res);
    km_index_destroy(index);
}

/* ---- segment keys are sound ---------------------------------------------------------------- */

/* Cases where a naive segment key would claim a worker holds a whole segment it does not. */
static void segment_soundness(uint32_t S)
{
    km_index *index = make_index(8, S, 64, 0);
    const uint32_t P = S >= 4 ? S : 8; /* positions of the cases scale with the segment size */
    enum { L = 96 };
    uint64_t h[L];
    fill_chain(h, 77, L);
    km_worker_match m[8];

    /* Worker 0 holds everything; worker 1 holds all but block 21, stored around the hole with the
     * true parents (known to the index through worker 0). */
    cr_assert_eq(km_index_store(index, 0, KM_NO_PARENT, h, L), KM_OK);
    cr_assert_eq(km_index_store(index, 1, KM_NO_PARENT, h, 21), KM_OK);
    cr_assert_eq(km_index_store(index, 1, h[21], h + 22, L - 22), KM_OK);
    /* Worker 2 holds everything, then loses a middle block of the second segment. */
    cr_assert_eq(km_index_store(index, 2, KM_NO_PARENT, h, L), KM_OK);
    cr_assert_eq(km_index_remove(index, 2, &h[P + P / 2], 1), KM_OK);
    /* Worker 3 stores the tail first (out of order), then the head. */
    cr_assert_eq(km_index_store(index, 3, h[39], h + 40, L - 40), KM_OK);
    cr_assert_eq(km_index_store(index, 3, KM_NO_PARENT, h, 40), KM_OK);
    /* Worker 4 holds everything, then block 0 goes: no match at all. */
    cr_assert_eq(km_index_store(index, 4, KM_NO_PARENT, h, L), KM_OK);
    cr_assert_eq(km_index_remove(index, 4, h, 1), KM_OK);
    /* Worker 5 holds everything but its last block, removed and re-added twice. */
    cr_assert_eq(km_index_store(index, 5, KM_NO_PARENT, h, L), KM_OK);
    for (int k = 0; k < 2; k++) {
        cr_assert_eq(km_index_remove(index, 5, &h[P - 1], 1), KM_OK);
        cr_assert_eq(km_index_store(index, 5, h[P - 2], &h[P - 1], 1), KM_OK);
    }
    cr_assert_eq(km_index_remove(index, 5, &h[L - 1], 1), KM_OK);
    /* Worker 6 was cleared and then stored only the first segment again. */
    cr_assert_eq(km_index_store(index, 6, KM_NO_PARENT, h, L), KM_OK);
    cr_assert_eq(km_index_clear_worker(index, 6), KM_OK);
    cr_assert_eq(km_index_store(index, 6, KM_NO_PARENT, h, P), KM_OK);

    km_request_result rr = match_one(index, h, L, m);
    const uint32_t ew[] = {0, 1, 2, 3, 5, 6};
    const uint32_t ed[] = {L, 21, P + P / 2, L, L - 1, P};
    cr_assert_eq(rr.count, 6, "S=%u: %u workers matched", S, rr.count);
    for (uint32_t j = 0; j < 6; j++)
        cr_assert(m[j].worker == ew[j] && m[j].depth == ed[j],
                  "S=%u entry %u: worker %u depth %u, expected worker %u depth %u", S, j,
                  m[j].worker, m[j].depth, ew[j], ed[j]);
    cr_assert(rr.owner == 0 && rr.owner_depth == L);
    /* Prefixes of every length agree too. */
    for (uint32_t n = 1; n <= L; n++) {
        rr = match_one(index, h, n, m);
        for (uint32_t j = 0; j < rr.count; j++) {
            uint32_t want = ed[j] < n ? ed[j] : n;
            cr_assert(m[j].worker == ew[j] && m[j].depth == want,
                      "S=%u prefix %u entry %u: worker %u depth %u, expected %u", S, n, j,
                      m[j].worker, m[j].depth, want);
        }
    }
    km_index_destroy(index);
}

Test(index, segment_keys_are_sound_s32, .timeout = 30) { segment_soundness(32); }
Test(index, segment_keys_are_sound_s4, .timeout = 30) { segment_soundness(4); }
Test(index, segment_keys_are_sound_s1, .timeout = 30) { segment_soundness(1); }
Test(index, segment_keys_are_sound_s0, .timeout = 30) { segment_soundness(0); }

Test(index, segment_keys_make_long_requests_cheap, .timeout = 30)
{
    /* One worker storing a long chain from position 0 (in chunks, as engines report) earns
     * segment keys, so scoring the chain costs about n/S + S lookups, not n. */
    const uint32_t S = 32, L = 640;
    km_index *index = make_index(8, S, 1024, 0);
    uint64_t h[640];
    fill_chain(h, 5, L);
    for (uint32_t a = 0; a < L; a += 16)
        cr_assert_eq(km_index_store(index, 2, a ? h[a - 1] : KM_NO_PARENT, h + a, 16), KM_OK);
    km_index_stats st = stats_of(index);
    cr_assert_eq(st.segment_keys, L / S, "segment keys %" PRIu64, st.segment_keys);
    cr_assert_eq(st.segment_pairs, L / S);
    km_request_result rr = match_one(index, h, L, NULL);
    cr_assert(rr.owner == 2 && rr.owner_depth == L);
    cr_assert_leq(rr.probes, L / S + S + 1, "%u probes for %u blocks", rr.probes, L);
    /* An orphan run earns none. */
    uint64_t o[64];
    fill_chain(o, 6, 64);
    cr_assert_eq(km_index_store(index, 3, chain_hash(6, 1000), o, 64), KM_OK);
    cr_assert_eq(stats_of(index).segment_keys, L / S, "an orphan run earned segment keys");
    /* A hole invalidates the segment key of its segment. */
    cr_assert_eq(km_index_remove(index, 2, &h[100], 1), KM_OK);
    rr = match_one(index, h, L, NULL);
    cr_assert(rr.owner == 2 && rr.owner_depth == 100);
    cr_assert_leq(stats_of(index).segment_keys, L / S - 1);
    km_index_destroy(index);
}

/* A segment finished by a later store than the one that began it is found held by walking back
 * through the blocks' parents (kept as tags in their metadata): runs of a few blocks as engines
 * report them, a branch whose first block's parent sits in the middle of an earlier run, and a
 * branch under a prefix with a hole, which must not earn the segment key it crosses. */
Test(index, segments_finished_across_stores_and_branches_earn_keys, .timeout = 30)
{
    const uint32_t S = 32, L = 256;
    km_index *index = make_index(8, S, 1024, 0);
    uint64_t h[256], b[44];
    fill_chain(h, 21, L);
    fill_chain(b, 22, 44); /* positions 20 .. 63 of a branch after h[19] */
    km_rng r;
    km_rng_init(&r, km_test_seed() ^ 0xB2A7C4);
    for (uint32_t a = 0, n; a < L; a += n) {
        n = 1 + km_rng_below(&r, 7);
        if (n > L - a)
            n = L - a;
        cr_assert_eq(km_index_store(index, 1, a ? h[a - 1] : KM_NO_PARENT, h + a, n), KM_OK);
    }
    km_index_stats st = stats_of(index);
    cr_assert(st.segment_keys == L / S && st.segment_pairs == L / S, "runs of 1-7 blocks: %" PRIu64
              " segment keys, %" PRIu64 " pairs", st.segment_keys, st.segment_pairs);
    /* Worker 2: the prefix in one run, then the branch from its middle, five blocks a run. */
    cr_assert_eq(km_index_store(index, 2, KM_NO_PARENT, h, 20), KM_OK);
    for (uint32_t a = 0; a < 44; a += 5)
        cr_assert_eq(km_index_store(index, 2, a ? b[a - 1] : h[19], b + a, a + 5 <= 44 ? 5 : 44 - a),
                     KM_OK);
    st = stats_of(index);
    cr_assert(st.segment_keys == L / S + 2 && st.segment_pairs == L / S + 2,
              "the branch's two segments: %" PRIu64 " keys, %" PRIu64 " pairs", st.segment_keys,
              st.segment_pairs);
    /* Worker 3: the prefix without block 5, then the branch: its first segment is not held whole,
     * its second is. */
    cr_assert_eq(km_index_store(index, 3, KM_NO_PARENT, h, 20), KM_OK);
    cr_assert_eq(km_index_remove(index, 3, &h[5], 1), KM_OK);
    cr_assert_eq(km_index_store(index, 3, h[19], b, 44), KM_OK);
    st = stats_of(index);
    cr_assert(st.segment_keys == L / S + 2 && st.segment_pairs == L / S + 3,
              "worker 3 with a hole: %" PRIu64 " keys, %" PRIu64 " pairs", st.segment_keys,
              st.segment_pairs);
    uint64_t q[64];
    memcpy(q, h, 20 * sizeof *q);
    memcpy(q + 20, b, 44 * sizeof *q);
    km_request_result rr = match_one(index, q, 64, NULL);
    cr_assert(rr.owner == 2 && rr.owner_depth == 64, "owner %u depth %u", rr.owner, rr.owner_depth);
    km_index_destroy(index);
}

/* A segment completed by short runs is held without walking back only while the worker still
 * holds its earlier blocks: a remove of one of them or a clear of the worker between the runs
 * must leave the worker out of the segment key. */
Test(index, segments_finished_by_short_runs_after_a_loss_earn_no_key, .timeout = 30)
{
    const uint32_t S = 4;
    km_index *index = make_index(8, S, 1024, 0);
    uint64_t h[12];
    fill_chain(h, 31, 12);
    /* Worker 0: block by block; segments 0 and 1 held. */
    for (uint32_t a = 0; a < 8; a++)
        cr_assert_eq(km_index_store(index, 0, a ? h[a - 1] : KM_NO_PARENT, h + a, 1), KM_OK);
    km_index_stats st = stats_of(index);
    cr_assert(st.segment_keys == 2 && st.segment_pairs == 2, "block by block: %" PRIu64 " keys, %"
              PRIu64 " pairs", st.segment_keys, st.segment_pairs);
    /* Worker 1: blocks 0 and 1, loses block 0, then 2 and 3: segment 0 is not held. */
    cr_assert_eq(km_index_store(index, 1, KM_NO_PARENT, h, 1), KM_OK);
    cr_assert_eq(km_index_store(index, 1, h[0], h + 1, 1), KM_OK);
    cr_assert_eq(km_index_remove(index, 1, h, 1), KM_OK);
    cr_assert_eq(km_index_store(index, 1, h[1], h + 2, 1), KM_OK);
    cr_assert_eq(km_index_store(index, 1, h[2], h + 3, 1), KM_OK);
    st = stats_of(index);
    cr_assert(st.segment_pairs == 2, "a hole at block 0: %" PRIu64 " segment pairs", st.segment_pairs);
    /* Worker 2: blocks 4 and 5 of segment 1, a clear, then 6 and 7 (4 and 5 stay known through
     * worker 0): segment 1 is not held. */
    cr_assert_eq(km_index_store(index, 2, h[3], h + 4, 1), KM_OK);
    cr_assert_eq(km_index_store(index, 2, h[4], h + 5, 1), KM_OK);
    cr_assert_eq(km_index_clear_worker(index, 2), KM_OK);
    cr_assert_eq(km_index_store(index, 2, h[5], h + 6, 1), KM_OK);
    cr_assert_eq(km_index_store(index, 2, h[6], h + 7, 1), KM_OK);
    st = stats_of(index);
    cr_assert(st.segment_pairs == 2, "a clear between the runs: %" PRIu64 " segment pairs",
              st.segment_pairs);
    /* Worker 1 stores block 0 again, then 1 to 3 one by one: now it holds segment 0. */
    cr_assert_eq(km_index_store(index, 1, KM_NO_PARENT, h, 1), KM_OK);
    for (uint32_t a = 1; a < 4; a++)
        cr_assert_eq(km_index_store(index, 1, h[a - 1], h + a, 1), KM_OK);
    st = stats_of(index);
    cr_assert(st.segment_pairs == 3, "worker 1 whole again: %" PRIu64 " segment pairs",
              st.segment_pairs);
    km_index_destroy(index);
}

/* More sequences in flight than a worker has open segments, most of them abandoned after a block
 * or two, while others grow a block at a time: the entries are replaced over and over, and every
 * segment a growing sequence completes is held (with or without its entry), none other. */
Test(index, open_segments_replaced_under_many_sequences_stay_exact, .timeout = 30)
{
    const uint32_t S = 4, GROWING = 6, BLOCKS = 3 * S, ABANDONED = GROWING * BLOCKS / 2;
    km_index *index = make_index(4, S, 4096, 0);
    uint64_t grow[6][12], left[36][2];
    for (uint32_t g = 0; g < GROWING; g++)
        fill_chain(grow[g], 500 + g, BLOCKS);
    for (uint32_t a = 0; a < ABANDONED; a++)
        fill_chain(left[a], 900 + a, 2);
    uint32_t next_abandoned = 0;
    for (uint32_t b = 0; b < BLOCKS; b++) {
        for (uint32_t g = 0; g < GROWING; g++) {
            uint64_t parent = b ? grow[g][b - 1] : KM_NO_PARENT;
            cr_assert_eq(km_index_store(index, 1, parent, &grow[g][b], 1), KM_OK);
            if (next_abandoned < ABANDONED && (b + g) % 2 == 0) {
                uint64_t *l = left[next_abandoned++];
                cr_assert_eq(km_index_store(index, 1, KM_NO_PARENT, l, 1), KM_OK);
                cr_assert_eq(km_index_store(index, 1, l[0], l + 1, 1), KM_OK);
            }
        }
    }
    cr_assert_eq(next_abandoned, ABANDONED);
    km_index_stats st = stats_of(index);
    cr_assert(st.segment_pairs == GROWING * (BLOCKS / S) && st.segment_keys == st.segment_pairs,
              "%" PRIu64 " segment keys, %" PRIu64 " pairs, expected %u", st.segment_keys,
              st.segment_pairs, GROWING * (BLOCKS / S));
    /* Each growing sequence matches whole on the worker. */
    for (uint32_t g = 0; g < GROWING; g++) {
        km_request_result rr = match_one(index, grow[g], BLOCKS, NULL);
        cr_assert(rr.owner == 1 && rr.owner_depth == BLOCKS, "sequence %u: owner %u depth %u", g,
                  rr.owner, rr.owner_depth);
    }
    km_index_destroy(index);
}

/* A batch that extends a worker's open segment and then fails on the memory cap is undone: the
 * extension must be forgotten with it. Here worker 1's block 2 is rolled back, comes back through
 * worker 0 alone, and worker 1 then stores block 3 on it: worker 1 holds blocks 0, 1 and 3, not
 * segment [0..3], so its depth is 2 (a remembered extension would claim 4). */
Test(index, rolled_back_store_leaves_no_open_segment_behind, .timeout = 60)
{
    km_index *index = make_index(8, 4, 1024, UINT64_C(4) << 20);
    uint64_t h[4];
    fill_chain(h, 91, 4);
    cr_assert_eq(km_index_store(index, 1, KM_NO_PARENT, h, 1), KM_OK);
    cr_assert_eq(km_index_store(index, 1, h[0], h + 1, 1), KM_OK);
    apply_then_exceed_cap(index, (km_update){KM_UPDATE_STORE, 1, h[1], h + 2, 1, KM_TIER_DEVICE},
                          700000);
    cr_assert_eq(km_index_store(index, 0, KM_NO_PARENT, h, 3), KM_OK);
    cr_assert_eq(km_index_store(index, 1, h[2], h + 3, 1), KM_OK);
    km_worker_match m[4];
    km_request_result rr = match_one(index, h, 4, m);
    uint32_t depth1 = 0;
    for (uint32_t i = 0; i < rr.count; i++)
        if (m[i].worker == 1)
            depth1 = m[i].depth;
    cr_assert_eq(depth1, 2, "worker 1 holds blocks 0, 1 and 3 (got depth %u)", depth1);
    km_index_destroy(index);
}

/* ---- requests carrying reserved values ----------------------------------------------------- */

static void reserved_values(uint32_t S)
{
    km_index *index = make_index(8, S, 64, 0);
    uint64_t h[12];
    fill_chain(h, 11, 12);
    cr_assert_eq(km_index_store(index, 0, KM_NO_PARENT, h, 12), KM_OK);
    cr_assert_eq(km_index_store(index, 1, KM_NO_PARENT, h, 12), KM_OK);
    /* Make tombstones: store and remove other blocks. */
    uint64_t t[40];
    fill_chain(t, 12, 40);
    cr_assert_eq(km_index_store(index, 2, KM_NO_PARENT, t, 40), KM_OK);
    cr_assert_eq(km_index_remove(index, 2, t, 40), KM_OK);
    uint64_t q[6];
    memcpy(q, h, sizeof q);
    for (uint64_t reserved = 0; reserved <= 1; reserved++) {
        /* A client that sends a reserved value as the last block of a request: no worker holds
         * it (0 = empty slot, 1 = tombstone in the table must not read as a block). */
        q[5] = reserved;
        km_request_result rr = match_one(index, q, 6, NULL);
        cr_assert(rr.count == 2 && rr.owner == 0 && rr.owner_depth == 5,
                  "S=%u: a request ending in %" PRIu64 ": owner %u depth %u, expected 0 depth 5", S,
                  reserved, rr.owner, rr.owner_depth);
        uint64_t only[1] = {reserved};
        rr = match_one(index, only, 1, NULL);
        cr_assert(rr.count == 0 && rr.owner == KM_NO_WORKER,
                  "S=%u: a request [%" PRIu64 "] matched %u workers", S, reserved, rr.count);
        uint32_t n;
        cr_assert_eq(km_index_holders(index, reserved, NULL, 0, &n), KM_OK);
        cr_assert_eq(n, 0, "holders of reserved value %" PRIu64, reserved);
    }
    km_index_destroy(index);
}

Test(index, reserved_values_in_requests_match_nothing_s4, .timeout = 30) { reserved_values(4); }
Test(index, reserved_values_in_requests_match_nothing_s0, .timeout = 30) { reserved_values(0); }

/* Lines the index logged that contain "<table> table grew from", per table kind; a growth line
 * states the info level (kvmatch/log.h), or it is not counted. */
typedef struct growth_log {
    uint32_t block_lines, other_lines, lines;
    uint64_t last_to; /* the block table's capacity the last block line named */
} growth_log;

static void capture_growth(void *user, const char *line)
{
    growth_log *g = user;
    g->lines++;
    unsigned long long from, to;
    bool info = strncmp(line, KM_LOG_INFO, strlen(KM_LOG_INFO)) == 0;
    if (info && sscanf(line + strlen(KM_LOG_INFO), "block table grew from %llu to %llu slots", &from,
                       &to) == 2) {
        g->block_lines++;
        g->last_to = to;
    } else if (info && strstr(line, " table grew from ")) {
        g->other_lines++;
    }
}

/* Every growth of a table pauses every caller; each is counted in the stats and logged with the
 * sizes, so an operator learns that initial_blocks was too small. */
Test(index, table_growth_is_counted_and_logged, .timeout = 60)
{
    km_index_config cfg;
    km_index_config_init(&cfg);
    growth_log g = {0};
    cfg.log = capture_growth;
    cfg.log_user = &g;
    cfg.backend = KM_BACKEND_CPU;
    cfg.max_workers = 8;
    cfg.initial_blocks = 16;
    km_index *index = NULL;
    cr_assert_eq(km_index_create(&cfg, &index), KM_OK);
    uint64_t first = stats_of(index).block_capacity;
    uint32_t lines_before = g.lines; /* the backend line */
    uint64_t h[64];
    for (uint64_t c = 0; c < 200; c++) {
        for (uint32_t i = 0; i < 64; i++)
            h[i] = chain_hash(c, i);
        cr_assert_eq(km_index_store(index, (uint32_t)(c % 8), KM_NO_PARENT, h, 64), KM_OK);
    }
    km_index_stats st = stats_of(index);
    /* One key at a time, each growth adds half the capacity (src/index/host_table.c). */
    uint32_t growths = 0;
    uint64_t cap = first;
    for (; cap < st.block_capacity; cap = cap / 2 * 3)
        growths++;
    cr_assert_eq(cap, st.block_capacity, "capacity %" PRIu64 " is not %" PRIu64 " grown by halves",
                 st.block_capacity, first);
    cr_assert_gt(growths, 5, "the block table grew only %u times", growths);
    cr_assert_eq(g.block_lines, growths, "%u block-table lines for %u growths", g.block_lines,
                 growths);
    cr_assert_eq(g.last_to, st.block_capacity);
    cr_assert_eq(st.table_growths, (uint64_t)g.block_lines + g.other_lines);
    cr_assert_eq(g.lines - lines_before, g.block_lines + g.other_lines, "other lines were logged");
    cr_assert(st.table_growth_ms_max > 0 && st.table_growth_ms_total >= st.table_growth_ms_max,
              "pause max %.3f ms, total %.3f ms", st.table_growth_ms_max,
              st.table_growth_ms_total);
    km_index_destroy(index);
}
