/* SPDX-License-Identifier: Apache-2.0 */
/* The CUDA scoring kernel's per-lane logic (src/index/warp_walk.h), run on the host by the warp
 * emulator (tests/warp_emulator.h: 32 lanes stepped together, ballot and shuffle emulated), against
 * the CPU backend: for every request, the entry list, owner, owner depth and lookup count must be
 * identical bit for bit, and all 32 lanes must return the same count and owner. Random workloads
 * (worker counts 8, 100 and 1000: not multiples of 64, one bitmap word or several; every segment
 * size; requests shorter than a warp and longer than many), sets wide enough for bitmaps spread
 * over every word, and the Mooncake trace. Fresh random inputs each run; replay with KM_TEST_SEED. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "index/index_internal.h"
#include "test_util.h"
#include "warp_emulator.h"

/* One request walked by the emulated warp. */
typedef struct warp_job {
    const km_table_view *blocks, *segments;
    uint32_t segment_blocks;
    const km_request *request;
    km_walk_entry *entries; /* max_workers */
    uint64_t *scratch;      /* KM_WALK_SCRATCH_WORDS(max_workers) */
    uint32_t count[KM_WARP_LANES], owner[KM_WARP_LANES], owner_depth[KM_WARP_LANES];
    uint32_t probes[KM_WARP_LANES];
} warp_job;

static void walk_lane(const km_lane *lane, void *arg)
{
    warp_job *j = arg;
    uint32_t i = lane->id;
    j->count[i] = km_warp_walk_request(lane, j->blocks, j->segments, j->segment_blocks,
                                       j->request->hashes, j->request->n_hashes, j->entries,
                                       j->scratch, &j->owner[i], &j->owner_depth[i], &j->probes[i]);
}

typedef struct warp_check {
    km_warp_emulator *warp;
    km_walk_entry *entries;
    uint64_t *scratch;
    km_match_results res;
    uint64_t requests, wide, multi_group; /* what the checks covered */
} warp_check;

static void warp_check_init(warp_check *c, uint32_t max_workers)
{
    memset(c, 0, sizeof *c);
    c->warp = km_warp_emulator_create();
    c->entries = calloc(max_workers, sizeof *c->entries);
    c->scratch = calloc(KM_WALK_SCRATCH_WORDS((size_t)max_workers), sizeof *c->scratch);
    cr_assert(c->warp && c->entries && c->scratch);
    km_match_results_init(&c->res);
}

static void warp_check_free(warp_check *c)
{
    km_warp_emulator_destroy(c->warp);
    free(c->entries);
    free(c->scratch);
    km_match_results_free(&c->res);
}

/* Score q[0..n) with the CPU backend and with the emulated warp; identical, or fail naming the
 * request and what differs. */
static void warp_compare(warp_check *c, km_index *index, const km_request *q, size_t n,
                         const char *when)
{
    int rc = km_index_match_batch(index, q, n, &c->res);
    cr_assert_eq(rc, KM_OK, "%s: cpu match: %s", when, km_error_name(rc));
    cr_assert_str_eq(km_index_backend_name(index), "cpu");
    km_table_view blocks = km_table_get_view(&index->blocks);
    km_table_view segments = km_table_get_view(&index->segments);
    uint32_t S = index->config.segment_blocks;
    for (size_t r = 0; r < n; r++) {
        warp_job j = {.blocks = &blocks, .segments = &segments, .segment_blocks = S,
                      .request = &q[r], .entries = c->entries, .scratch = c->scratch};
        /* Stale scratch and entries must not matter: fill them with garbage. */
        memset(c->entries, 0xA5, index->config.max_workers * sizeof *c->entries);
        memset(c->scratch, 0x5A, KM_WALK_SCRATCH_WORDS((size_t)index->config.max_workers) *
                                     sizeof *c->scratch);
        char why[256] = "";
        KM_CHECK(km_warp_run(c->warp, walk_lane, &j, why, sizeof why) == 0, "%s: request %zu: %s",
                 when, r, why);
        for (uint32_t l = 1; l < KM_WARP_LANES; l++)
            KM_CHECK(j.count[l] == j.count[0] && j.owner[l] == j.owner[0] &&
                         j.owner_depth[l] == j.owner_depth[0] && j.probes[l] == j.probes[0],
                     "%s: request %zu: lane %u returned %u/%u/%u/%u, lane 0 %u/%u/%u/%u", when, r,
                     l, j.count[l], j.owner[l], j.owner_depth[l], j.probes[l], j.count[0],
                     j.owner[0], j.owner_depth[0], j.probes[0]);
        const km_request_result *want = &c->res.requests[r];
        KM_CHECK(j.count[0] == want->count && j.owner[0] == want->owner &&
                     j.owner_depth[0] == want->owner_depth && j.probes[0] == want->probes,
                 "%s (S=%u): request %zu of %u blocks: warp count %u owner %u depth %u probes %u, "
                 "cpu %u %u %u %u", when, S, r, q[r].n_hashes, j.count[0], j.owner[0],
                 j.owner_depth[0], j.probes[0], want->count, want->owner, want->owner_depth,
                 want->probes);
        for (uint32_t e = 0; e < want->count; e++) {
            const km_worker_match *m = &c->res.matches[want->first + e];
            KM_CHECK(c->entries[e].worker == m->worker && c->entries[e].depth == m->depth,
                     "%s (S=%u): request %zu entry %u: warp worker %u depth %u, cpu %u %u", when,
                     S, r, e, c->entries[e].worker, c->entries[e].depth, m->worker, m->depth);
        }
        c->requests++;
        if (want->count > KM_SLOT_INLINE)
            c->wide++;
        if (q[r].n_hashes > KM_WARP_LANES)
            c->multi_group++;
    }
}

static km_index *cpu_index(uint32_t W, uint32_t S)
{
    km_index_config cfg;
    km_test_config(&cfg, NULL);
    cfg.backend = KM_BACKEND_CPU;
    cfg.max_workers = W;
    cfg.segment_blocks = S;
    cfg.threads = 1;
    cfg.initial_blocks = 256; /* some batches find a table growing: two arrays to look in */
    km_index *index = NULL;
    int rc = km_index_create(&cfg, &index);
    cr_assert_eq(rc, KM_OK, "km_index_create: %s", km_error_name(rc));
    return index;
}

static void warp_random(uint32_t S)
{
    const uint32_t workers[] = {8, 100, 1000};
    for (int k = 0; k < 3; k++) {
        uint32_t W = workers[k];
        km_index *index = cpu_index(W, S);
        km_rng r;
        km_rng_init(&r, km_test_seed() ^ ((uint64_t)S << 40) ^ W ^ 0x3A9);
        km_oracle o;
        km_oracle_init(&o, W);
        km_corpus corpus;
        km_corpus_generate(&corpus, &r, 120, 1 + km_rng_below(&r, 4), 300);
        km_workload wl;
        km_workload_init(&wl, &corpus, W);
        km_request_set rs = {0};
        warp_check c;
        warp_check_init(&c, W);
        char when[96];
        for (int step = 0; step < 8; step++) {
            km_workload_step(&wl, &r, &o, 6);
            km_update_stats got, expect;
            cr_assert_eq(km_index_apply(index, wl.updates, wl.n_updates, &got), KM_OK);
            km_oracle_apply(&o, wl.updates, wl.n_updates, &expect);
            km_request_set_generate(&rs, &r, &corpus, 60);
            snprintf(when, sizeof when, "S=%u W=%u step %d", S, W, step);
            warp_compare(&c, index, rs.requests, rs.n, when);
        }
        cr_assert_gt(c.multi_group, 0, "W=%u: no request longer than a warp", W);
        warp_check_free(&c);
        km_request_set_free(&rs);
        km_workload_free(&wl);
        km_corpus_free(&corpus);
        km_oracle_free(&o);
        km_index_destroy(index);
    }
}

Test(warp_walk, matches_cpu_random_s32, .timeout = 120) { warp_random(32); }
Test(warp_walk, matches_cpu_random_s4, .timeout = 120) { warp_random(4); }
Test(warp_walk, matches_cpu_random_s1, .timeout = 120) { warp_random(1); }
Test(warp_walk, matches_cpu_random_s0, .timeout = 120) { warp_random(0); }

/* Bitmaps over every word: W workers (not a multiple of 64) where each of C chains of N blocks is
 * held by 5 to 40 workers spread over the words, who then drop random tails, so that depths differ
 * and walks end at every position of a group of 32 keys; segment keys (S = 3) give more than 32
 * segments per request, several lookup groups. Requests are random prefixes, some whole. */
static void warp_wide(uint32_t W, uint32_t S)
{
    const uint32_t C = 6, N = 400;
    km_index *index = cpu_index(W, S);
    km_rng r;
    km_rng_init(&r, km_test_seed() ^ 0x71DE ^ W ^ ((uint64_t)S << 32));
    uint64_t *chains = malloc((size_t)C * N * sizeof *chains);
    cr_assert_not_null(chains);
    for (size_t i = 0; i < (size_t)C * N; i++)
        chains[i] = km_rng_hash(&r);
    for (uint32_t c = 0; c < C; c++) {
        uint32_t holders = 5 + km_rng_below(&r, 36);
        for (uint32_t h = 0; h < holders; h++) {
            uint32_t w = h == 0 ? W - 1 : km_rng_below(&r, W);
            km_update u = {KM_UPDATE_STORE, w, KM_NO_PARENT, chains + (size_t)c * N, N,
                           KM_TIER_DEVICE};
            cr_assert_eq(km_index_apply(index, &u, 1, NULL), KM_OK);
            uint32_t keep = 1 + km_rng_below(&r, N);
            if (keep < N && km_rng_percent(&r, 70)) {
                u = (km_update){KM_UPDATE_REMOVE, w, KM_NO_PARENT, chains + (size_t)c * N + keep,
                                N - keep, KM_TIER_DEVICE};
                cr_assert_eq(km_index_apply(index, &u, 1, NULL), KM_OK);
            }
        }
    }
    const size_t NQ = 120;
    km_request *q = malloc(NQ * sizeof *q);
    cr_assert_not_null(q);
    for (size_t i = 0; i < NQ; i++) {
        uint32_t c = km_rng_below(&r, C);
        uint32_t len = km_rng_percent(&r, 20) ? N : 1 + km_rng_below(&r, N);
        q[i] = (km_request){chains + (size_t)c * N, len};
    }
    warp_check c;
    warp_check_init(&c, W);
    char when[64];
    snprintf(when, sizeof when, "wide W=%u", W);
    warp_compare(&c, index, q, NQ, when);
    cr_assert_gt(c.wide, NQ / 2, "W=%u: only %" PRIu64 " of %zu requests had bitmaps", W, c.wide, NQ);
    warp_check_free(&c);
    free(q);
    free(chains);
    km_index_destroy(index);
}

Test(warp_walk, matches_cpu_wide_sets_1000_workers_s3, .timeout = 120) { warp_wide(1000, 3); }
Test(warp_walk, matches_cpu_wide_sets_100_workers_s0, .timeout = 120) { warp_wide(100, 0); }
Test(warp_walk, matches_cpu_wide_sets_2050_workers_s32, .timeout = 120) { warp_wide(2050, 32); }

/* Churn at the edges of the bitmap words (64, 65 and 1,025 workers): hot chains that many workers
 * store and give up again, so sets are promoted to bitmaps and demoted back to inline ids; holes
 * in the middle of held prefixes; runs stored after a parent, so segment keys start mid-chain;
 * workers removed; and enough blocks that the block table grows past KM_TABLE_INCREMENTAL_SLOTS,
 * so batches find it moving between two arrays and erases leave key 1 in the old one. After every
 * batch the warp walks requests that are chain prefixes, runs from the middle of a chain, and
 * prefixes with a foreign hash or a reserved value (0, 1) in them. */
static void warp_churn(uint32_t W, uint32_t S)
{
    const uint32_t C = 240, L = 100, HOT = 8, STEPS = 110, NQ = 24;
    km_index *index = cpu_index(W, S);
    km_rng r;
    km_rng_init(&r, km_test_seed() ^ 0xC4E7 ^ W ^ ((uint64_t)S << 32));
    uint64_t *chains = malloc((size_t)C * L * sizeof *chains);
    uint32_t *first_holder = calloc(C, sizeof *first_holder);
    uint64_t *edited = malloc((size_t)NQ * L * sizeof *edited);
    km_request *q = malloc(NQ * sizeof *q);
    cr_assert(chains && first_holder && edited && q);
    for (size_t i = 0; i < (size_t)C * L; i++)
        chains[i] = km_rng_hash(&r);
    warp_check c;
    warp_check_init(&c, W);
    uint64_t moving = 0, promoted = 0;
    uint32_t stored = 0; /* chains [0, stored) have been handed out so far */
    char when[96];
    for (uint32_t step = 0; step < STEPS; step++) {
        km_update u[8];
        size_t n = 0;
        /* Three new chains a step, most of each, so the table keeps growing. */
        while (n < 3 && stored < C) {
            first_holder[stored] = km_rng_below(&r, W);
            u[n++] = (km_update){KM_UPDATE_STORE, first_holder[stored], KM_NO_PARENT,
                                 chains + (size_t)stored * L, L - km_rng_below(&r, 10),
                                 KM_TIER_DEVICE};
            stored++;
        }
        while (n < 8) {
            uint32_t ch = km_rng_percent(&r, 60) ? km_rng_below(&r, HOT) : km_rng_below(&r, stored);
            const uint64_t *chain = chains + (size_t)ch * L;
            uint32_t w = km_rng_percent(&r, 30) ? W - 1 - km_rng_below(&r, 3) : km_rng_below(&r, W);
            if (ch >= HOT && km_rng_percent(&r, 60)) /* often its only holder: keys are erased */
                w = first_holder[ch];
            uint32_t at = km_rng_below(&r, L), len = 1 + km_rng_below(&r, L - at);
            uint32_t pick = km_rng_below(&r, 100);
            if (pick < 45) /* a prefix */
                u[n++] = (km_update){KM_UPDATE_STORE, w, KM_NO_PARENT, chain, 1 + at,
                                     KM_TIER_DEVICE};
            else if (pick < 55 && at > 0) /* a run after its parent */
                u[n++] = (km_update){KM_UPDATE_STORE, w, chain[at - 1], chain + at, len,
                                     KM_TIER_DEVICE};
            else if (pick < 75) /* a tail */
                u[n++] = (km_update){KM_UPDATE_REMOVE, w, KM_NO_PARENT, chain + at, L - at,
                                     KM_TIER_DEVICE};
            else if (pick < 92) /* a hole */
                u[n++] = (km_update){KM_UPDATE_REMOVE, w, KM_NO_PARENT, chain + at,
                                     len < 3 ? len : 3, KM_TIER_DEVICE};
            else
                u[n++] = (km_update){KM_UPDATE_REMOVE_WORKER, w, KM_NO_PARENT, NULL, 0,
                                     KM_TIER_DEVICE};
        }
        for (uint32_t i = 0; i < NQ; i++) {
            uint32_t ch = km_rng_percent(&r, 50) ? km_rng_below(&r, HOT) : km_rng_below(&r, stored);
            const uint64_t *chain = chains + (size_t)ch * L;
            uint32_t from = km_rng_percent(&r, 20) ? km_rng_below(&r, L) : 0;
            uint32_t len = 1 + km_rng_below(&r, L - from);
            q[i] = (km_request){chain + from, len};
            if (km_rng_percent(&r, 25)) {
                uint64_t *e = edited + (size_t)i * L;
                memcpy(e, chain + from, len * sizeof *e);
                uint64_t odd[3] = {km_rng_hash(&r), 0, 1};
                e[km_rng_below(&r, len)] = odd[km_rng_below(&r, 3)];
                q[i].hashes = e;
            }
        }
        /* One update at a time: a move lasts a few batches, and every one of them is walked. */
        for (size_t k = 0; k < n; k++) {
            int rc = km_index_apply(index, &u[k], 1, NULL);
            cr_assert_eq(rc, KM_OK, "step %u: apply: %s (%s)", step, km_error_name(rc),
                         km_index_last_error(index));
            if (index->blocks.old_slots) {
                moving++;
                snprintf(when, sizeof when, "churn W=%u S=%u step %u, moving", W, S, step);
                warp_compare(&c, index, q, NQ, when);
            }
        }
        for (uint32_t ch = 0; ch < HOT; ch++) {
            uint64_t slot = km_table_find(&index->blocks, chains[(size_t)ch * L]);
            promoted += slot != KM_SLOT_NONE &&
                        km_slot_is_shared(km_table_slot(&index->blocks, slot));
        }
        snprintf(when, sizeof when, "churn W=%u S=%u step %u", W, S, step);
        warp_compare(&c, index, q, NQ, when);
    }
    cr_assert_gt(moving, 0, "W=%u S=%u: no update left the block table moving", W, S);
    cr_assert_gt(promoted, 0, "W=%u S=%u: no hot chain's first block had a bitmap", W, S);
    cr_assert_gt(c.wide, 0, "W=%u S=%u: no request had more than %u entries", W, S,
                 KM_SLOT_INLINE);
    warp_check_free(&c);
    free(q);
    free(edited);
    free(first_holder);
    free(chains);
    km_index_destroy(index);
}

Test(warp_walk, matches_cpu_churn_64_workers_s2, .timeout = 120) { warp_churn(64, 2); }
Test(warp_walk, matches_cpu_churn_65_workers_s0, .timeout = 120) { warp_churn(65, 0); }
Test(warp_walk, matches_cpu_churn_1025_workers_s5, .timeout = 120) { warp_churn(1025, 5); }

static km_index *trace_index;

static void trace_apply(void *ctx, const km_update *u, size_t n, const km_update_stats *expect)
{
    (void)ctx;
    km_update_stats got;
    char why[256];
    int rc = km_index_apply(trace_index, u, n, &got);
    KM_CHECK(rc == KM_OK, "trace apply: %s", km_error_name(rc));
    KM_CHECK(km_update_stats_equal(&got, expect, why, sizeof why), "trace apply: %s", why);
}

static void warp_trace(uint32_t W, int affinity)
{
    km_trace_case tc;
    char why[512];
    int rc = km_trace_case_load(&tc, 64, 3000, why, sizeof why);
    if (rc == KM_ERR_IO)
        cr_skip_test("Mooncake trace not available: %s", why);
    cr_assert_eq(rc, KM_OK, "loading the trace: %s", why);
    trace_index = cpu_index(W, 32);
    km_oracle o;
    km_oracle_init(&o, W);
    km_rng r;
    km_rng_init(&r, km_test_seed() ^ W ^ 0x7ACE);
    km_trace_scenario(&tc, 2000, W, affinity, &r, &o, trace_apply, NULL);
    size_t n = tc.n < 800 ? tc.n : 800;
    km_request *q = malloc(n * sizeof *q);
    cr_assert_not_null(q);
    for (size_t i = 0; i < n; i++)
        q[i] = (km_request){tc.hashes + tc.offset[tc.n - n + i], tc.n_blocks[tc.n - n + i]};
    warp_check c;
    warp_check_init(&c, W);
    char when[64];
    snprintf(when, sizeof when, "trace W=%u", W);
    warp_compare(&c, trace_index, q, n, when);
    warp_check_free(&c);
    free(q);
    km_oracle_free(&o);
    km_index_destroy(trace_index);
    km_trace_case_free(&tc);
}

Test(warp_walk, matches_cpu_mooncake_64_workers, .timeout = 120) { warp_trace(64, 1); }
Test(warp_walk, matches_cpu_mooncake_1000_workers, .timeout = 120) { warp_trace(1000, 0); }

/* The emulator itself: a lane that leaves early while the others wait at a ballot is reported. */
static void diverging_lane(const km_lane *lane, void *arg)
{
    (void)arg;
    if (lane->id == 7)
        return;
    km_lane_ballot(lane, 1);
}

/* Sum of v over lanes below this one, by shuffles; *total gets the sum over all 32. */
static uint32_t exclusive_sum(const km_lane *L, uint32_t v, uint32_t *total)
{
    uint32_t inclusive = v;
    for (uint32_t d = 1; d < KM_WARP_LANES; d <<= 1) {
        uint32_t other = (uint32_t)km_lane_shfl(L, inclusive, L->id >= d ? L->id - d : L->id);
        if (L->id >= d)
            inclusive += other;
    }
    *total = (uint32_t)km_lane_shfl(L, inclusive, KM_WARP_LANES - 1);
    return inclusive - v;
}

static void shuffling_lane(const km_lane *lane, void *arg)
{
    uint32_t *out = arg;
    uint32_t total;
    out[lane->id] = exclusive_sum(lane, lane->id + 1, &total);
    out[KM_WARP_LANES + lane->id] = total;
    out[2 * KM_WARP_LANES + lane->id] = (uint32_t)km_lane_max(lane, (lane->id * 37u) % 32u);
    out[3 * KM_WARP_LANES + lane->id] = km_lane_ballot(lane, lane->id % 3 == 0);
}

Test(warp_walk, the_emulator_steps_lanes_together_and_reports_divergence, .timeout = 30)
{
    km_warp_emulator *e = km_warp_emulator_create();
    cr_assert_not_null(e);
    uint32_t out[4 * KM_WARP_LANES];
    char why[256] = "";
    cr_assert_eq(km_warp_run(e, shuffling_lane, out, why, sizeof why), 0, "%s", why);
    uint32_t ballot = 0;
    for (uint32_t l = 0; l < KM_WARP_LANES; l += 3)
        ballot |= 1u << l;
    for (uint32_t l = 0; l < KM_WARP_LANES; l++) {
        cr_assert_eq(out[l], l * (l + 1) / 2, "lane %u: exclusive sum %u", l, out[l]);
        cr_assert_eq(out[KM_WARP_LANES + l], 32u * 33u / 2u);
        cr_assert_eq(out[2 * KM_WARP_LANES + l], 31u);
        cr_assert_eq(out[3 * KM_WARP_LANES + l], ballot);
    }
    cr_assert_eq(km_warp_run(e, diverging_lane, NULL, why, sizeof why), -1);
    cr_assert(strstr(why, "diverged") && strstr(why, " 7"), "%s", why);
    km_warp_emulator_destroy(e);
}
