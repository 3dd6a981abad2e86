/* SPDX-License-Identifier: Apache-2.0 */
/* The index's side of the device-replica protocol, without a GPU. `mirror` below is a backend that
 * keeps the CUDA backend's contract (kernels/cuda_backend.c, kernels/) on the host: one array per
 * table, uploaded whole at create and whenever a table's layout_changed, else patched from the
 * tables' dirty-slot and dirty-bitmap lists; scoring runs km_walk_request over its own copy, as the
 * device does. So what these tests check is what a device replica would be given: whether the
 * dirty lists cover every write (a missed one leaves the copy differing from the host table), and
 * that while a table grows the replica is never synced (it would mirror half the keys) and the
 * host scores instead, with the replica back in use once the move ends. test_cuda.c runs the real
 * device backend where a GPU exists. Fresh random inputs each run; replay with KM_TEST_SEED. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "index/index_internal.h"
#include "test_util.h"

/* ---- the host replica ------------------------------------------------------------------------ */

typedef struct mirror_table {
    km_slot *slots;
    uint64_t capacity;
    uint32_t words_per_set;
    uint64_t *pool;
    uint32_t pool_used;
} mirror_table;

typedef struct mirror {
    mirror_table blocks, segments;
    uint64_t *scratch;
    km_walk_entry *entries;
    uint64_t syncs, full_uploads, patched_slots, patched_sets, matches;
    uint64_t synced_mid_growth; /* syncs that found a table with an old array: a contract breach */
    uint32_t fail_syncs; /* the next this many syncs fail (fail_status) after patching half */
    uint32_t fail_matches; /* the next this many matches fail (fail_status) half way */
    int fail_status; /* what those failures return; 0: KM_ERR_OUT_OF_MEMORY */
    uint64_t patch_out_of_range; /* a dirty slot or bitmap outside the replica's arrays */
    int fail_cuda; /* every sync and match fails with KM_ERR_CUDA, as after a sticky device error */
} mirror;

static void mirror_table_free(mirror_table *m)
{
    free(m->slots);
    free(m->pool);
    memset(m, 0, sizeof *m);
}

static int mirror_sync_table(mirror *mr, mirror_table *m, const km_table *t, int full)
{
    if (t->old_slots)
        mr->synced_mid_growth++;
    if (full || t->layout_changed) {
        mirror_table_free(m);
        m->capacity = t->capacity;
        m->words_per_set = t->words_per_set;
        m->pool_used = t->pool_high;
        m->slots = malloc(t->capacity * sizeof *m->slots);
        size_t pool_words = (size_t)t->pool_high * t->words_per_set;
        m->pool = malloc((pool_words ? pool_words : 1) * sizeof *m->pool);
        if (!m->slots || !m->pool)
            return KM_ERR_OUT_OF_MEMORY;
        memcpy(m->slots, t->slots, t->capacity * sizeof *m->slots);
        if (pool_words)
            memcpy(m->pool, t->pool, pool_words * sizeof *m->pool);
        mr->full_uploads++;
        return KM_OK;
    }
    for (size_t i = 0; i < t->n_dirty_slots; i++) {
        uint64_t s = t->dirty_slots[i];
        if (s >= m->capacity) {
            mr->patch_out_of_range++;
            continue;
        }
        m->slots[s] = t->slots[s];
        mr->patched_slots++;
    }
    for (size_t i = 0; i < t->n_dirty_sets; i++) {
        uint32_t b = t->dirty_sets[i];
        if (b >= m->pool_used) { /* a bitmap handed out since the last upload */
            if (b >= t->pool_high) {
                mr->patch_out_of_range++;
                continue;
            }
            uint64_t *grown = realloc(m->pool, (size_t)t->pool_high * t->words_per_set * sizeof *grown);
            if (!grown)
                return KM_ERR_OUT_OF_MEMORY;
            m->pool = grown;
            m->pool_used = t->pool_high;
        }
        memcpy(m->pool + (size_t)b * t->words_per_set, t->pool + (size_t)b * t->words_per_set,
               t->words_per_set * sizeof *m->pool);
        mr->patched_sets++;
    }
    return KM_OK;
}

static int mirror_sync(void *state, km_index *index)
{
    mirror *mr = state;
    mr->syncs++;
    if (mr->fail_cuda)
        return km_index_fail(index, KM_ERR_CUDA, "mirror: sync: a sticky device error");
    if (mr->fail_syncs) { /* a staging allocation failing part way: the blocks are patched */
        mr->fail_syncs--;
        int rc = mirror_sync_table(mr, &mr->blocks, &index->blocks, 0);
        int status = mr->fail_status ? mr->fail_status : KM_ERR_OUT_OF_MEMORY;
        return rc ? rc : km_index_fail(index, status, "mirror: sync: failing on purpose");
    }
    int rc = mirror_sync_table(mr, &mr->blocks, &index->blocks, 0);
    return rc ? rc : mirror_sync_table(mr, &mr->segments, &index->segments, 0);
}

static void mirror_destroy(void *state)
{
    mirror *mr = state;
    if (!mr)
        return;
    mirror_table_free(&mr->blocks);
    mirror_table_free(&mr->segments);
    free(mr->scratch);
    free(mr->entries);
    free(mr);
}

static int mirror_create(km_index *index, void **state, char *why, size_t why_size)
{
    mirror *mr = calloc(1, sizeof *mr);
    uint32_t W = index->config.max_workers;
    if (mr) {
        mr->scratch = malloc(KM_WALK_SCRATCH_WORDS((size_t)W) * sizeof *mr->scratch);
        mr->entries = malloc(W * sizeof *mr->entries);
    }
    int rc = mr && mr->scratch && mr->entries ? KM_OK : KM_ERR_OUT_OF_MEMORY;
    if (!rc)
        rc = mirror_sync_table(mr, &mr->blocks, &index->blocks, 1);
    if (!rc)
        rc = mirror_sync_table(mr, &mr->segments, &index->segments, 1);
    if (rc) {
        snprintf(why, why_size, "mirror: %s", km_strerror(rc));
        mirror_destroy(mr);
        return rc;
    }
    *state = mr;
    return KM_OK;
}

static km_table_view mirror_view(const mirror_table *m)
{
    km_table_view v = {m->slots, m->pool, m->capacity, m->words_per_set, NULL, 0, 0};
    return v;
}

static int mirror_match(void *state, km_index *index, const km_request *requests, size_t n,
                        km_match_results *results)
{
    mirror *mr = state;
    mr->matches++;
    if (mr->fail_cuda)
        return km_index_fail(index, KM_ERR_CUDA, "mirror: match: a sticky device error");
    if (mr->fail_matches) { /* results half filled, then a staging allocation fails */
        mr->fail_matches--;
        results->n_requests = n;
        results->n_matches = 0;
        return km_index_fail(index, mr->fail_status ? mr->fail_status : KM_ERR_OUT_OF_MEMORY,
                             "mirror: match: failing on purpose");
    }
    km_table_view blocks = mirror_view(&mr->blocks), segments = mirror_view(&mr->segments);
    size_t total = 0;
    uint64_t probes_sum = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t owner, owner_depth, probes;
        uint32_t m = km_walk_request(&blocks, &segments, index->config.segment_blocks,
                                     requests[i].hashes, requests[i].n_hashes, mr->entries,
                                     mr->scratch, index->config.max_workers, &owner, &owner_depth,
                                     &probes);
        if (km_match_results_reserve(results, n, total + m))
            return KM_ERR_OUT_OF_MEMORY;
        if (m)
            memcpy(results->matches + total, mr->entries, m * sizeof *results->matches);
        results->requests[i] = (km_request_result){total, m, owner, owner_depth, probes};
        total += m;
        probes_sum += probes;
    }
    results->n_matches = total;
    results->probes = probes_sum;
    return KM_OK;
}

static const km_backend_ops mirror_backend = {
    .name = "mirror",
    .create = mirror_create,
    .destroy = mirror_destroy,
    .sync = mirror_sync,
    .match = mirror_match,
    .needs_dirty_tracking = 1,
};

static mirror *mirror_of(km_index *index)
{
    cr_assert_eq(index->backend, &mirror_backend, "the index left the mirror backend for %s",
                 index->backend->name);
    return index->backend_state;
}

static km_index *make_mirrored_index(uint32_t W, uint32_t S, uint32_t threads)
{
    km_index *index = km_test_growing_index(W, S, threads);
    char why[256] = "";
    int rc = km_index_use_backend(index, &mirror_backend, why, sizeof why);
    cr_assert_eq(rc, KM_OK, "km_index_use_backend: %s (%s)", km_error_name(rc), why);
    /* The default step moves a table of 16 K old slots in two batches; watch longer moves. */
    index->replica_growth_step = 2048;
    index->replica_growth_budget_ms = 0; /* steps of exactly 2048 slots, however slow the machine */
    return index;
}

/* The replica equals the host table: every slot, and every bitmap a slot refers to. */
static int mirror_equals(const mirror_table *m, const km_table *t, const char *name, char *why,
                         size_t why_size)
{
    if (m->capacity != t->capacity) {
        snprintf(why, why_size, "%s replica has %" PRIu64 " slots, the host %" PRIu64, name,
                 m->capacity, t->capacity);
        return 0;
    }
    for (uint64_t s = 0; s < t->capacity; s++) {
        const km_slot *a = &m->slots[s], *b = &t->slots[s];
        if (memcmp(a, b, sizeof *a) != 0) {
            snprintf(why, why_size, "%s slot %" PRIu64 ": replica key %016" PRIx64 " ids %04x %04x "
                     "%04x %04x, host key %016" PRIx64 " ids %04x %04x %04x %04x (a write the "
                     "dirty list missed)", name, s, a->key, a->ids[0], a->ids[1], a->ids[2],
                     a->ids[3], b->key, b->ids[0], b->ids[1], b->ids[2], b->ids[3]);
            return 0;
        }
        if (b->key > KM_KEY_TOMBSTONE && km_slot_is_shared(b)) {
            uint32_t p = km_slot_pool_index(b);
            if (p >= m->pool_used ||
                memcmp(m->pool + (size_t)p * t->words_per_set, t->pool + (size_t)p * t->words_per_set,
                       t->words_per_set * sizeof *t->pool) != 0) {
                snprintf(why, why_size, "%s slot %" PRIu64 ": bitmap %u differs from the host's (a "
                         "bitmap write the dirty list missed)", name, s, p);
                return 0;
            }
        }
    }
    return 1;
}

/* ---- tests ------------------------------------------------------------------------------------ */

/* Random stores, removes, clears and broadcasts (tests/test_util.c's workload) while the tables
 * grow from 256 keys (each growth below KM_TABLE_INCREMENTAL_SLOTS rehashes at once and is uploaded
 * whole): after every batch the replica equals the host tables and scores like the oracle. */
static void patches_cover_every_write(uint32_t S, uint32_t W)
{
    km_rng r;
    km_rng_init(&r, km_test_seed() ^ ((uint64_t)S << 40) ^ ((uint64_t)W << 20) ^ 0x3E91);
    km_index *index = make_mirrored_index(W, S, 1);
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
    for (int step = 0; step < 60; step++) {
        km_workload_step(&wl, &r, &o, 6);
        km_update_stats got, expect;
        int rc = km_index_apply(index, wl.updates, wl.n_updates, &got);
        KM_CHECK(rc == KM_OK, "step %d: apply: %s (%s)", step, km_error_name(rc),
                 km_index_last_error(index));
        km_oracle_apply(&o, wl.updates, wl.n_updates, &expect);
        mirror *mr = mirror_of(index);
        KM_CHECK(mirror_equals(&mr->blocks, &index->blocks, "block", why, sizeof why) &&
                     mirror_equals(&mr->segments, &index->segments, "segment", why, sizeof why),
                 "S=%u W=%u step %d: %s", S, W, step, why);
        km_request_set_generate(&rs, &r, &corpus, 1000);
        rc = km_index_match_batch(index, rs.requests, rs.n, &res);
        KM_CHECK(rc == KM_OK, "step %d: match: %s", step, km_error_name(rc));
        KM_CHECK(km_check_results(&o, rs.requests, rs.n, &res, S, why, sizeof why),
                 "S=%u W=%u step %d, scored by the replica: %s", S, W, step, why);
    }
    mirror *mr = mirror_of(index);
    cr_assert_eq(mr->patch_out_of_range, 0, "%" PRIu64 " dirty entries outside the replica",
                 mr->patch_out_of_range);
    cr_assert_gt(mr->patched_slots, 0, "no batch was patched: the patch path went untested");
    cr_assert_gt(mr->full_uploads, 2, "no table grew: the upload path went untested");
    cr_assert_eq(mr->matches, 60, "the replica scored %" PRIu64 " of 60 batches", mr->matches);
    km_match_results_free(&res);
    km_request_set_free(&rs);
    km_workload_free(&wl);
    km_corpus_free(&corpus);
    km_oracle_free(&o);
    km_index_destroy(index);
}

Test(replica, patches_cover_every_write_s4_w64, .timeout = 60) { patches_cover_every_write(4, 64); }
Test(replica, patches_cover_every_write_s0_w1024, .timeout = 60) { patches_cover_every_write(0, 1024); }
/* The widest bitmaps (1,024 words), and one bit past a full word. */
Test(replica, patches_cover_every_write_s5_w65534, .timeout = 60)
{
    patches_cover_every_write(5, KM_MAX_WORKERS_LIMIT);
}
Test(replica, patches_cover_every_write_s1_w65, .timeout = 60) { patches_cover_every_write(1, 65); }

/* Whole corpus chains stored (and now and then a chain's tail removed) one update at a time until
 * the block table has grown incrementally twice. The batch that starts a growth must not finish it
 * (that was a pause as long as rehashing the table); while the move lasts the replica is never
 * synced and every batch is scored on the host, exactly; once the move ends the replica is
 * uploaded whole and scores again. */
Test(replica, a_growing_table_is_scored_on_the_host_until_its_move_ends, .timeout = 120)
{
    const uint32_t S = 4, W = 64;
    km_rng r;
    km_rng_init(&r, km_test_seed() ^ 0x9A0E);
    km_index *index = make_mirrored_index(W, S, 2);
    km_oracle o;
    km_oracle_init(&o, W);
    km_corpus corpus;
    km_corpus_generate(&corpus, &r, 1500, 4, 200);
    km_request_set rs = {0};
    km_match_results res;
    km_match_results_init(&res);
    char why[512];
    int incremental_growths = 0, host_batches = 0, replica_batches_after_growth = 0;
    uint64_t capacity = index->blocks.capacity;
    for (int step = 0; step < 20000 && (incremental_growths < 2 || index->replica_stale); step++) {
        km_update u;
        uint64_t tail[8];
        if (!km_growth_update(&r, &corpus, W, &u, tail))
            continue;
        mirror *mr = mirror_of(index);
        uint64_t syncs_before = mr->syncs, matches_before = mr->matches;
        km_update_stats got, expect;
        int rc = km_index_apply(index, &u, 1, &got);
        KM_CHECK(rc == KM_OK, "step %d: apply: %s (%s)", step, km_error_name(rc),
                 km_index_last_error(index));
        km_oracle_apply(&o, &u, 1, &expect);
        int started = 0;
        if (index->blocks.capacity != capacity) {
            /* Tables below KM_TABLE_INCREMENTAL_SLOTS rehash at once when they grow. */
            started = capacity >= KM_TABLE_INCREMENTAL_SLOTS;
            capacity = index->blocks.capacity;
            incremental_growths += started;
        }
        if (started)
            cr_assert(index->blocks.old_slots && index->replica_stale,
                      "step %d: the batch that grew the block table to %" PRIu64 " slots also "
                      "finished its move", step, capacity);
        if (index->replica_stale)
            cr_assert_eq(mr->syncs, syncs_before, "step %d: the replica was synced mid-growth", step);
        else
            cr_assert_eq(mr->syncs, syncs_before + 1, "step %d: a batch went unsynced", step);
        int stale = index->replica_stale;
        km_request_set_generate(&rs, &r, &corpus, stale ? 300 : 50);
        rc = km_index_match_batch(index, rs.requests, rs.n, &res);
        KM_CHECK(rc == KM_OK, "step %d: match: %s", step, km_error_name(rc));
        KM_CHECK(km_check_results(&o, rs.requests, rs.n, &res, S, why, sizeof why),
                 "step %d, scored %s (%" PRIu64 " of %" PRIu64 " old slots moved): %s", step,
                 stale ? "on the host" : "by the replica", index->blocks.migrated,
                 index->blocks.old_capacity, why);
        cr_assert_eq(mr->matches, matches_before + !stale, "step %d: scored by the wrong side", step);
        host_batches += stale;
        if (!stale && incremental_growths > 0) {
            replica_batches_after_growth++;
            KM_CHECK(mirror_equals(&mr->blocks, &index->blocks, "block", why, sizeof why) &&
                         mirror_equals(&mr->segments, &index->segments, "segment", why, sizeof why),
                     "step %d, after a move: %s", step, why);
        }
    }
    cr_assert_eq(incremental_growths, 2, "the block table grew incrementally %d times",
                 incremental_growths);
    cr_assert(!index->replica_stale, "the last move never ended");
    cr_assert_gt(host_batches, 10, "only %d batches were scored on the host", host_batches);
    cr_assert_gt(replica_batches_after_growth, 0, "the replica never scored after a move");
    km_index_stats st;
    cr_assert_eq(km_index_get_stats(index, &st), KM_OK);
    cr_assert_eq(st.host_scored_batches, (uint64_t)host_batches);
    mirror *mr = mirror_of(index);
    cr_assert_eq(mr->synced_mid_growth, 0);
    cr_assert_eq(mr->patch_out_of_range, 0);
    km_match_results_free(&res);
    km_request_set_free(&rs);
    km_corpus_free(&corpus);
    km_oracle_free(&o);
    km_index_destroy(index);
}

/* A move must end even when nothing more is inserted: each update batch (here one that changes
 * nothing) moves a bounded step of the old array, so the replica is back within old_capacity /
 * step batches. */
Test(replica, a_move_ends_without_more_inserts, .timeout = 60)
{
    km_rng r;
    km_rng_init(&r, km_test_seed() ^ 0x51E9);
    km_index *index = make_mirrored_index(8, 0, 1);
    uint64_t capacity = index->blocks.capacity, hashes[64];
    uint64_t next = 2 + km_rng_next(&r) % 1000;
    while (!index->replica_stale) { /* store until a growth of 16 K slots or more starts */
        for (int i = 0; i < 64; i++)
            hashes[i] = next++;
        km_update u = {KM_UPDATE_STORE, km_rng_below(&r, 8), KM_NO_PARENT, hashes, 64, KM_TIER_DEVICE};
        cr_assert_eq(km_index_apply(index, &u, 1, NULL), KM_OK, "%s", km_index_last_error(index));
        cr_assert_lt(next, 1u << 22, "no incremental growth started");
    }
    capacity = index->blocks.capacity;
    uint64_t old_capacity = index->blocks.old_capacity;
    cr_assert_gt(old_capacity - index->blocks.migrated, 2 * index->replica_growth_step,
                 "the move is too short to watch");
    uint64_t absent = 1u << 23; /* a remove of a block nobody holds changes nothing */
    km_update nothing = {KM_UPDATE_REMOVE, 0, KM_NO_PARENT, &absent, 1, KM_TIER_DEVICE};
    uint64_t batches = 0, bound = old_capacity / index->replica_growth_step + 1;
    uint64_t syncs_before = mirror_of(index)->syncs;
    while (index->replica_stale && batches <= bound) {
        cr_assert_eq(km_index_apply(index, &nothing, 1, NULL), KM_OK);
        batches++;
    }
    cr_assert(!index->replica_stale, "still stale after %" PRIu64 " empty batches (%" PRIu64
              " of %" PRIu64 " old slots moved)", batches, index->blocks.migrated, old_capacity);
    cr_assert_eq(index->blocks.capacity, capacity);
    cr_assert_null(index->blocks.old_slots);
    mirror *mr = mirror_of(index);
    cr_assert_eq(mr->syncs, syncs_before + 1, "the replica was synced %" PRIu64 " times",
                 mr->syncs - syncs_before);
    char why[512];
    cr_assert(mirror_equals(&mr->blocks, &index->blocks, "block", why, sizeof why), "%s", why);
    /* Every stored block is found by the replica now. */
    km_request q = {hashes, 64};
    km_match_results res;
    km_match_results_init(&res);
    cr_assert_eq(km_index_match_batch(index, &q, 1, &res), KM_OK);
    cr_assert_eq(mr->matches, 1);
    cr_assert_eq(res.requests[0].owner_depth, 64, "the last chain stored is %u blocks deep",
                 res.requests[0].owner_depth);
    km_match_results_free(&res);
    km_index_destroy(index);
}

/* A backend that can never be created: km_index_use_backend must then leave the index as it was. */
static int unusable_create(km_index *index, void **state, char *why, size_t why_size)
{
    (void)index;
    *state = NULL;
    snprintf(why, why_size, "unusable: by design");
    return KM_ERR_BACKEND_UNAVAILABLE;
}

static void unusable_destroy(void *state)
{
    (void)state;
}

static const km_backend_ops unusable_backend = {
    .name = "unusable",
    .create = unusable_create,
    .destroy = unusable_destroy,
    .sync = NULL,
    .match = NULL,
    .needs_dirty_tracking = 0,
};

/* A failed switch keeps the replica it had, so it must also keep what that replica has not been
 * given yet: here the block table's move (it ends in km_index_use_backend, and only the growth's
 * layout_changed says to upload it whole) and the segment table's writes made while the replica
 * waited for the move. The next sync must make the replica equal to the host tables again. */
Test(replica, a_failed_backend_switch_keeps_the_pending_sync, .timeout = 30)
{
    const uint32_t S = 4, W = 64;
    km_rng r;
    km_rng_init(&r, km_test_seed() ^ 0xBAC5);
    km_index *index = make_mirrored_index(W, S, 1);
    km_oracle o;
    km_oracle_init(&o, W);
    km_corpus corpus;
    km_corpus_generate(&corpus, &r, 1500, 4, 200);
    km_update_stats expect;
    int stale_batches = 0;
    /* Until a move has lasted 3 batches and segment writes wait for the replica, as dirty slots or,
     * when the segment table grew meanwhile, as its whole new layout (on some seeds a move ends
     * before any batch writes a segment: then the next move is waited for; how many slots a batch
     * moves depends on time, KM_REPLICA_GROWTH_BUDGET_MS, so a slow run can see the segment
     * table's own growth cover a block move). */
    for (int step = 0; step < 20000 && !(stale_batches >= 3 && index->replica_stale &&
                                         (index->segments.n_dirty_slots > 0 ||
                                          index->segments.layout_changed));
         step++) {
        km_update u;
        uint64_t tail[8];
        if (!km_growth_update(&r, &corpus, W, &u, tail))
            continue;
        cr_assert_eq(km_index_apply(index, &u, 1, NULL), KM_OK, "step %d: %s", step,
                     km_index_last_error(index));
        km_oracle_apply(&o, &u, 1, &expect);
        stale_batches += index->replica_stale;
    }
    cr_assert_geq(stale_batches, 3, "the block table never grew incrementally (KM_TEST_SEED=%" PRIu64 ")",
                  km_test_seed());
    cr_assert(index->replica_stale, "no move lasted long enough (KM_TEST_SEED=%" PRIu64 ")",
              km_test_seed());
    cr_assert(index->segments.n_dirty_slots > 0 || index->segments.layout_changed,
              "no segment writes waited for the replica (KM_TEST_SEED=%" PRIu64 ")", km_test_seed());

    char why[256] = "";
    cr_assert_eq(km_index_use_backend(index, &unusable_backend, why, sizeof why),
                 KM_ERR_BACKEND_UNAVAILABLE);
    mirror *mr = mirror_of(index);

    /* One more batch, synced to the replica it kept. */
    km_update u;
    uint64_t tail[8];
    while (!km_growth_update(&r, &corpus, W, &u, tail))
        ;
    cr_assert_eq(km_index_apply(index, &u, 1, NULL), KM_OK, "%s", km_index_last_error(index));
    km_oracle_apply(&o, &u, 1, &expect);
    cr_assert(!index->replica_stale);
    char detail[512];
    cr_assert(mirror_equals(&mr->blocks, &index->blocks, "block", detail, sizeof detail) &&
                  mirror_equals(&mr->segments, &index->segments, "segment", detail, sizeof detail),
              "after a failed switch: %s", detail);
    km_request_set rs = {0};
    km_match_results res;
    km_match_results_init(&res);
    km_request_set_generate(&rs, &r, &corpus, 300);
    cr_assert_eq(km_index_match_batch(index, rs.requests, rs.n, &res), KM_OK);
    cr_assert_eq(mr->patch_out_of_range, 0);
    cr_assert(km_check_results(&o, rs.requests, rs.n, &res, S, detail, sizeof detail),
              "scored by the replica after a failed switch: %s", detail);
    km_match_results_free(&res);
    km_request_set_free(&rs);
    km_corpus_free(&corpus);
    km_oracle_free(&o);
    km_index_destroy(index);
}

/* A sync that runs out of memory (a staging allocation) leaves the replica behind
 * the host tables, which took the batch. The batch is not reported as failed, the replica is not
 * trusted: batches are scored on the host until a sync succeeds, and that sync, which still has
 * every dirty entry since the last good one (or uploads a table whole whose list reached its
 * size), makes the replica equal again. The batch does not return the sync's error, since its
 * updates are in, and the next batches are not scored on the stale replica. */
Test(replica, a_failed_sync_is_scored_around_until_one_succeeds, .timeout = 60)
{
    const uint32_t S = 4, W = 64;
    km_rng r;
    km_rng_init(&r, km_test_seed() ^ 0x5F1C);
    km_index *index = make_mirrored_index(W, S, 1);
    km_oracle o;
    km_oracle_init(&o, W);
    km_corpus corpus;
    km_corpus_generate(&corpus, &r, 150, 4, 200);
    km_workload wl;
    km_workload_init(&wl, &corpus, W);
    km_request_set rs = {0};
    km_match_results res;
    km_match_results_init(&res);
    char why[512];
    mirror *mr = mirror_of(index);
    for (int step = 0; step < 30; step++) {
        int failing = step >= 10 && step < 13; /* three failed syncs in a row */
        mr->fail_syncs = failing;
        km_workload_step(&wl, &r, &o, 6);
        km_update_stats got, expect;
        int rc = km_index_apply(index, wl.updates, wl.n_updates, &got);
        KM_CHECK(rc == KM_OK, "step %d: a failed sync failed the batch: %s (%s)", step,
                 km_error_name(rc), km_index_last_error(index));
        km_oracle_apply(&o, wl.updates, wl.n_updates, &expect);
        mr = mirror_of(index);
        KM_CHECK(index->replica_stale == failing, "step %d: replica_stale %d", step,
                 index->replica_stale);
        if (!failing)
            KM_CHECK(mirror_equals(&mr->blocks, &index->blocks, "block", why, sizeof why) &&
                         mirror_equals(&mr->segments, &index->segments, "segment", why, sizeof why),
                     "step %d, after a good sync: %s", step, why);
        uint64_t matches = mr->matches, host = index->host_scored_batches;
        km_request_set_generate(&rs, &r, &corpus, 500);
        rc = km_index_match_batch(index, rs.requests, rs.n, &res);
        KM_CHECK(rc == KM_OK, "step %d: match: %s", step, km_error_name(rc));
        KM_CHECK(km_check_results(&o, rs.requests, rs.n, &res, S, why, sizeof why),
                 "step %d (%s): %s", step, failing ? "sync failed" : "synced", why);
        KM_CHECK(mr->matches == matches + !failing && index->host_scored_batches == host + failing,
                 "step %d: scored by the %s", step, failing ? "stale replica" : "host");
    }
    km_match_results_free(&res);
    km_request_set_free(&rs);
    km_workload_free(&wl);
    km_corpus_free(&corpus);
    km_oracle_free(&o);
    km_index_destroy(index);
}

/* A replica's scoring that runs out of memory (a staging allocation) does not fail the batch: the
 * host tables are current, so the batch is scored there, exactly, and the replica scores the next
 * one; no route in it is answered with an error. */
Test(replica, a_failed_replica_match_is_scored_on_the_host, .timeout = 60)
{
    const uint32_t S = 4, W = 64;
    km_rng r;
    km_rng_init(&r, km_test_seed() ^ 0x3A7C);
    km_index *index = make_mirrored_index(W, S, 1);
    km_oracle o;
    km_oracle_init(&o, W);
    km_corpus corpus;
    km_corpus_generate(&corpus, &r, 150, 4, 200);
    km_workload wl;
    km_workload_init(&wl, &corpus, W);
    km_request_set rs = {0};
    km_match_results res;
    km_match_results_init(&res);
    char why[512];
    for (int step = 0; step < 12; step++) {
        km_workload_step(&wl, &r, &o, 6);
        km_update_stats got, expect;
        cr_assert_eq(km_index_apply(index, wl.updates, wl.n_updates, &got), KM_OK);
        km_oracle_apply(&o, wl.updates, wl.n_updates, &expect);
        mirror *mr = mirror_of(index);
        int failing = step % 3 == 1;
        mr->fail_matches = failing;
        uint64_t host = index->host_scored_batches;
        km_request_set_generate(&rs, &r, &corpus, 400);
        int rc = km_index_match_batch(index, rs.requests, rs.n, &res);
        KM_CHECK(rc == KM_OK, "step %d: a failed replica match failed the batch: %s (%s)", step,
                 km_error_name(rc), km_index_last_error(index));
        KM_CHECK(km_check_results(&o, rs.requests, rs.n, &res, S, why, sizeof why), "step %d: %s",
                 step, why);
        KM_CHECK(index->host_scored_batches == host + failing, "step %d: host-scored %" PRIu64
                 " -> %" PRIu64, step, host, index->host_scored_batches);
        cr_assert_eq(mirror_of(index), mr, "the replica was dropped");
    }
    km_match_results_free(&res);
    km_request_set_free(&rs);
    km_workload_free(&wl);
    km_corpus_free(&corpus);
    km_oracle_free(&o);
    km_index_destroy(index);
}

/* A replica failing with anything but KM_ERR_OUT_OF_MEMORY (here KM_ERR_INTERNAL, as a broken
 * invariant on the device is reported) is not trusted again: the index moves to the CPU backend
 * for good, the batch whose match failed is scored there, a batch whose sync failed is in the
 * host tables, and every later batch scores exactly. `in_sync` picks which call fails. */
static void a_replica_failing_otherwise_moves_to_the_cpu(int in_sync)
{
    const uint32_t S = 4, W = 64;
    km_rng r;
    km_rng_init(&r, km_test_seed() ^ 0x1E7A ^ (uint64_t)in_sync);
    km_index *index = make_mirrored_index(W, S, 1);
    km_oracle o;
    km_oracle_init(&o, W);
    km_corpus corpus;
    km_corpus_generate(&corpus, &r, 150, 4, 200);
    km_workload wl;
    km_workload_init(&wl, &corpus, W);
    km_request_set rs = {0};
    km_match_results res;
    km_match_results_init(&res);
    char why[512];
    for (int step = 0; step < 8; step++) {
        int failing = step == 3;
        if (failing) {
            mirror *mr = mirror_of(index);
            mr->fail_status = KM_ERR_INTERNAL;
            if (in_sync)
                mr->fail_syncs = 1;
            else
                mr->fail_matches = 1;
        }
        km_workload_step(&wl, &r, &o, 6);
        km_update_stats got, expect;
        int rc = km_index_apply(index, wl.updates, wl.n_updates, &got);
        KM_CHECK(rc == KM_OK, "step %d: apply: %s (%s)", step, km_error_name(rc),
                 km_index_last_error(index));
        km_oracle_apply(&o, wl.updates, wl.n_updates, &expect);
        uint64_t host = index->host_scored_batches;
        km_request_set_generate(&rs, &r, &corpus, 400);
        rc = km_index_match_batch(index, rs.requests, rs.n, &res);
        KM_CHECK(rc == KM_OK, "step %d: match: %s (%s)", step, km_error_name(rc),
                 km_index_last_error(index));
        KM_CHECK(km_check_results(&o, rs.requests, rs.n, &res, S, why, sizeof why), "step %d: %s",
                 step, why);
        KM_CHECK(strcmp(km_index_backend_name(index), step < 3 ? "mirror" : "cpu") == 0,
                 "step %d: backend %s", step, km_index_backend_name(index));
        KM_CHECK(index->host_scored_batches == host, "step %d: a batch was host-scored, the "
                 "replica kept", step);
    }
    km_match_results_free(&res);
    km_request_set_free(&rs);
    km_workload_free(&wl);
    km_corpus_free(&corpus);
    km_oracle_free(&o);
    km_index_destroy(index);
}

Test(replica, a_replica_match_failing_otherwise_moves_to_the_cpu, .timeout = 60)
{
    a_replica_failing_otherwise_moves_to_the_cpu(0);
}

Test(replica, a_replica_sync_failing_otherwise_moves_to_the_cpu, .timeout = 60)
{
    a_replica_failing_otherwise_moves_to_the_cpu(1);
}

/* Dirty lists stay within their table while the replica is not synced: here the block table
 * moves to larger arrays in steps of 512 slots a batch, and meanwhile every batch adds workers to
 * and removes them from blocks and segment keys already stored (no key inserted or erased, so
 * nothing moves but the step; worker 0 keeps every chain). The block table's writes are not
 * listed (the growth set layout_changed); the segment table's would be listed, repeats and all,
 * until the move ends. A list that reaches its table's size is dropped for a whole upload; after
 * the move the replica equals the host tables and scores exactly. */
Test(replica, dirty_lists_stay_within_their_table_while_a_sync_waits, .timeout = 60)
{
    const uint32_t S = 4, W = 64, LEN = 64, CHURN = 60;
    km_rng r;
    km_rng_init(&r, km_test_seed() ^ 0xD1B7);
    km_index *index = make_mirrored_index(W, S, 1);
    index->replica_growth_step = 512;
    km_oracle o;
    km_oracle_init(&o, W);
    size_t max_chains = 1024;
    uint64_t *chains = malloc(max_chains * LEN * sizeof *chains);
    km_update *u = malloc(2 * CHURN * sizeof *u);
    cr_assert(chains && u);
    km_update_stats expect;
    size_t n_chains = 0;
    while (!index->blocks.old_slots || index->blocks.old_capacity < KM_TABLE_INCREMENTAL_SLOTS) {
        cr_assert_lt(n_chains, max_chains, "the block table never grew incrementally");
        uint64_t *c = chains + n_chains * LEN;
        for (uint32_t i = 0; i < LEN; i++)
            c[i] = km_rng_hash(&r);
        km_update st = {KM_UPDATE_STORE, 0, KM_NO_PARENT, c, LEN, KM_TIER_DEVICE};
        cr_assert_eq(km_index_apply(index, &st, 1, NULL), KM_OK, "%s", km_index_last_error(index));
        km_oracle_apply(&o, &st, 1, &expect);
        n_chains++;
    }
    cr_assert(index->replica_stale);
    int batches = 0, dropped = 0;
    uint64_t uploads_before = mirror_of(index)->full_uploads;
    char why[512];
    while (index->replica_stale) {
        cr_assert_lt(batches, 10000, "the move never ended");
        /* Worker w joins CHURN chains, worker w' leaves CHURN others (it may hold none of them);
         * workers 0 to 3 only, so every set stays inline and no bitmap pool grows (a pool growth
         * sets layout_changed too). */
        uint32_t w = 1 + km_rng_below(&r, 3), w2 = 1 + km_rng_below(&r, 3);
        for (uint32_t k = 0; k < CHURN; k++) {
            const uint64_t *c = chains + km_rng_below(&r, (uint32_t)n_chains) * LEN;
            u[k] = (km_update){KM_UPDATE_STORE, w, KM_NO_PARENT, c, LEN, KM_TIER_DEVICE};
            c = chains + km_rng_below(&r, (uint32_t)n_chains) * LEN;
            u[CHURN + k] = (km_update){KM_UPDATE_REMOVE, w2, KM_NO_PARENT, c, LEN, KM_TIER_DEVICE};
        }
        uint64_t capacity = index->segments.capacity;
        cr_assert_eq(km_index_apply(index, u, 2 * CHURN, NULL), KM_OK, "%s",
                     km_index_last_error(index));
        km_oracle_apply(&o, u, 2 * CHURN, &expect);
        cr_assert_eq(index->segments.capacity, capacity, "the segment table grew");
        const km_table *tables[2] = {&index->blocks, &index->segments};
        for (int t = 0; t < 2; t++) {
            KM_CHECK(tables[t]->n_dirty_slots <= tables[t]->capacity &&
                         tables[t]->n_dirty_sets <= tables[t]->pool_capacity,
                     "batch %d: %s table lists %zu dirty slots of %" PRIu64 ", %zu dirty bitmaps "
                     "of %u", batches, t ? "segment" : "block", tables[t]->n_dirty_slots,
                     tables[t]->capacity, tables[t]->n_dirty_sets, tables[t]->pool_capacity);
        }
        dropped |= index->replica_stale && index->segments.layout_changed;
            batches++;
    }
    cr_assert(dropped, "the segment table's list never reached its size in %d batches "
              "(KM_TEST_SEED=%" PRIu64 ")", batches, km_test_seed());
    mirror *mr = mirror_of(index);
    cr_assert_geq(mr->full_uploads, uploads_before + 2, "both tables were meant to be uploaded "
                  "whole after the move");
    cr_assert(mirror_equals(&mr->blocks, &index->blocks, "block", why, sizeof why) &&
                  mirror_equals(&mr->segments, &index->segments, "segment", why, sizeof why),
              "after the move: %s", why);
    km_request *q = malloc(500 * sizeof *q);
    cr_assert_not_null(q);
    for (int i = 0; i < 500; i++)
        q[i] = (km_request){chains + km_rng_below(&r, (uint32_t)n_chains) * LEN,
                            1 + km_rng_below(&r, LEN)};
    km_match_results res;
    km_match_results_init(&res);
    uint64_t matches = mr->matches;
    cr_assert_eq(km_index_match_batch(index, q, 500, &res), KM_OK);
    cr_assert_eq(mr->matches, matches + 1, "the replica did not score");
    cr_assert(km_check_results(&o, q, 500, &res, S, why, sizeof why), "%s", why);
    km_match_results_free(&res);
    free(q);
    free(u);
    free(chains);
    km_oracle_free(&o);
    km_index_destroy(index);
}

/* ---- a CUDA failure when no CPU backend can be made ------------------------------------------ */

/* The CPU backend with a create that fails (out of host memory) while cpu_create_fails is set. */
static int cpu_create_fails;

static int scarce_cpu_create(km_index *index, void **state, char *why, size_t why_size)
{
    if (cpu_create_fails) {
        snprintf(why, why_size, "scratch for the scoring lanes");
        return KM_ERR_OUT_OF_MEMORY;
    }
    return km_backend_cpu.create(index, state, why, why_size);
}

static void scarce_cpu_destroy(void *state)
{
    km_backend_cpu.destroy(state);
}

static const km_backend_ops scarce_cpu_backend = {
    .name = "cpu",
    .create = scarce_cpu_create,
    .destroy = scarce_cpu_destroy,
    .sync = NULL,
    .match = NULL, /* the index scores host states with km_backend_cpu.match */
    .needs_dirty_tracking = 0,
};

typedef struct log_lines {
    int n;
    char last[512];
} log_lines;

static void keep_log_line(void *user, const char *line)
{
    log_lines *l = user;
    l->n++;
    snprintf(l->last, sizeof l->last, "%s", line);
}

/* A sticky CUDA error while no CPU backend can be created (host memory exhausted): the index
 * keeps its failed backend (never none), the batch's updates stay in the host tables, the match
 * does not score on the replica the sync failed to update but fails with KM_ERR_OUT_OF_MEMORY
 * naming both failures, and the log says so. Once memory is
 * back, the next call falls back to the CPU and scores exactly. The failed backend is destroyed
 * only once its replacement exists: an index left without one would dereference it at once. */
Test(replica, a_cuda_failure_without_memory_for_the_cpu_keeps_a_backend, .timeout = 60)
{
    const uint32_t S = 4, W = 64;
    char why[512] = "";
    km_rng r;
    km_rng_init(&r, km_test_seed() ^ 0xF411);
    /* Tables that never grow here: a growth would create the host scorer the fallback reuses. */
    log_lines log = {0};
    km_index_config cfg;
    km_test_config(&cfg, NULL);
    cfg.backend = KM_BACKEND_CPU;
    cfg.max_workers = W;
    cfg.segment_blocks = S;
    cfg.threads = 2;
    cfg.initial_blocks = 1u << 17;
    cfg.log = keep_log_line;
    cfg.log_user = &log;
    km_index *index = NULL;
    cr_assert_eq(km_index_create(&cfg, &index), KM_OK);
    cr_assert_eq(km_index_use_backend(index, &mirror_backend, why, sizeof why), KM_OK, "%s", why);
    index->host_ops = &scarce_cpu_backend;
    km_oracle o;
    km_oracle_init(&o, W);
    km_corpus corpus;
    km_corpus_generate(&corpus, &r, 150, 4, 200);
    km_workload wl;
    km_workload_init(&wl, &corpus, W);
    km_request_set rs = {0};
    km_match_results res;
    km_match_results_init(&res);
    km_update_stats got, expect;

    km_workload_step(&wl, &r, &o, 6);
    cr_assert_eq(km_index_apply(index, wl.updates, wl.n_updates, &got), KM_OK);
    km_oracle_apply(&o, wl.updates, wl.n_updates, &expect);
    mirror *mr = mirror_of(index);
    cr_assert_null(index->host_scorer, "a host scorer exists: the fallback would not create one");
    mr->fail_cuda = 1;
    cpu_create_fails = 1;

    /* The sync fails; the batch does not (its updates are in the host tables). */
    km_workload_step(&wl, &r, &o, 6);
    int rc = km_index_apply(index, wl.updates, wl.n_updates, &got);
    cr_assert_eq(rc, KM_OK, "the batch failed with its sync: %s (%s)", km_error_name(rc),
                 km_index_last_error(index));
    km_oracle_apply(&o, wl.updates, wl.n_updates, &expect);
    cr_assert_eq(mirror_of(index), mr, "the failed backend was replaced by nothing");
    cr_assert(strstr(log.last, "no cpu backend") && strstr(log.last, "KM_ERR_CUDA"),
              "the log does not say what failed: %s", log.last);

    km_request_set_generate(&rs, &r, &corpus, 300);
    uint64_t matches = mr->matches;
    rc = km_index_match_batch(index, rs.requests, rs.n, &res);
    cr_assert_eq(rc, KM_ERR_OUT_OF_MEMORY, "match: %s", km_error_name(rc));
    cr_assert_eq(mr->matches, matches, "the replica whose sync failed scored a batch");
    cr_assert_eq(res.n_requests, 0, "a failed match left results");
    cr_assert_eq(mirror_of(index), mr);
    cr_assert(strstr(km_index_last_error(index), "sticky device error") &&
                  strstr(km_index_last_error(index), "scratch for the scoring lanes"),
              "last error does not name both failures: %s", km_index_last_error(index));

    /* Memory is back: the next match falls back, and the CPU backend has every update. */
    cpu_create_fails = 0;
    rc = km_index_match_batch(index, rs.requests, rs.n, &res);
    cr_assert_eq(rc, KM_OK, "match after memory came back: %s (%s)", km_error_name(rc),
                 km_index_last_error(index));
    cr_assert_str_eq(km_index_backend_name(index), "cpu");
    cr_assert(strstr(log.last, "fallback: sync failed with KM_ERR_CUDA"), "log: %s", log.last);
    cr_assert(km_check_results(&o, rs.requests, rs.n, &res, S, why, sizeof why), "%s", why);
    km_match_results_free(&res);
    km_request_set_free(&rs);
    km_workload_free(&wl);
    km_corpus_free(&corpus);
    km_oracle_free(&o);
    km_index_destroy(index);
}
