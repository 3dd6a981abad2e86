/* SPDX-License-Identifier: Apache-2.0 */
/* Scoring's edges against a brute-force oracle of its own: a plain map of (block, worker) pairs
 * with their tiers, each request walked block by block. Fresh random inputs every run (seed
 * printed on failure; replay with KM_TEST_SEED=...): requests of 0 and 1 block and of exactly
 * max_request_blocks, hashes repeated inside a request, blocks no worker holds, worker counts
 * around the bitmap words (1, 63, 64, 65, 1023, 1024, the maximum), segment keys of 4, 16, 32
 * blocks and none, lower tiers, tables that grow (scored mid-move too) and are cleared. The same
 * updates go to indexes of 1, 2 and 3 lanes, whose results must be identical, bit for bit. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "index/index_internal.h"
#include "test_util.h"

/* ---- the oracle: (block, worker) -> tier ---------------------------------------------------- */

typedef struct pair_slot {
    uint64_t hash; /* 0 = empty */
    uint32_t worker;
    int32_t tier; /* -1 = not held (pairs are never erased, only released) */
} pair_slot;

typedef struct pair_map {
    pair_slot *slots;
    size_t capacity; /* power of two */
    size_t used;
} pair_map;

static size_t pair_home(const pair_map *m, uint64_t hash, uint32_t worker)
{
    uint64_t k = (hash ^ ((uint64_t)worker * UINT64_C(0xD6E8FEB86659FD93))) *
                 UINT64_C(0x9E3779B97F4A7C15);
    return (size_t)(k >> 20) & (m->capacity - 1);
}

static pair_slot *pair_find(pair_map *m, uint64_t hash, uint32_t worker, int insert)
{
    for (size_t i = pair_home(m, hash, worker);; i = (i + 1) & (m->capacity - 1)) {
        pair_slot *s = &m->slots[i];
        if (s->hash == hash && s->worker == worker)
            return s;
        if (s->hash == 0) {
            if (!insert)
                return NULL;
            cr_assert_lt(m->used * 2, m->capacity, "oracle map full");
            m->used++;
            *s = (pair_slot){hash, worker, -1};
            return s;
        }
    }
}

static int pair_tier(pair_map *m, uint64_t hash, uint32_t worker)
{
    pair_slot *s = pair_find(m, hash, worker, 0);
    return s ? s->tier : -1;
}

/* ---- a scenario: several indexes (one per thread count) fed the same updates ---------------- */

#define LANE_CONFIGS 3
static const uint32_t lane_counts[LANE_CONFIGS] = {1, 2, 3};

typedef struct scenario {
    km_rng r;
    uint32_t W, S, max_blocks;
    km_index *index[LANE_CONFIGS];
    km_match_results res[LANE_CONFIGS];
    pair_map pairs;
    /* Chains: chain c is seqs[c * max_blocks ..][0 .. len[c]) (a branch of an earlier one). */
    uint64_t *seqs;
    uint32_t *len;
    uint32_t n_chains;
    /* Workers the updates use: all of them when few, else a spread including both ends. */
    uint32_t *workers;
    uint32_t n_workers;
} scenario;

static void scenario_init(scenario *s, uint32_t W, uint32_t S, uint32_t max_blocks,
                          uint32_t n_chains, uint64_t mix)
{
    memset(s, 0, sizeof *s);
    km_rng_init(&s->r, km_test_seed() ^ mix ^ ((uint64_t)W << 24) ^ ((uint64_t)S << 8));
    s->W = W;
    s->S = S;
    s->max_blocks = max_blocks;
    for (int l = 0; l < LANE_CONFIGS; l++) {
        km_index_config cfg;
        km_test_config(&cfg, NULL);
        cfg.backend = KM_BACKEND_CPU;
        cfg.max_workers = W;
        cfg.segment_blocks = S;
        cfg.threads = lane_counts[l];
        cfg.initial_blocks = 256; /* small, so the tables grow (incrementally past 16 K slots) */
        cfg.max_request_blocks = max_blocks;
        int rc = km_index_create(&cfg, &s->index[l]);
        cr_assert_eq(rc, KM_OK, "km_index_create W=%u S=%u: %s", W, S, km_error_name(rc));
        km_match_results_init(&s->res[l]);
    }
    s->pairs.capacity = (size_t)1 << 21;
    s->pairs.slots = calloc(s->pairs.capacity, sizeof *s->pairs.slots);
    cr_assert_not_null(s->pairs.slots);
    s->n_chains = n_chains;
    s->seqs = malloc((size_t)n_chains * max_blocks * sizeof *s->seqs);
    s->len = malloc(n_chains * sizeof *s->len);
    cr_assert(s->seqs && s->len);
    for (uint32_t c = 0; c < n_chains; c++) {
        uint64_t *q = s->seqs + (size_t)c * max_blocks;
        uint32_t shared = 0;
        if (c > 0 && km_rng_percent(&s->r, 70)) { /* a branch of an earlier chain */
            uint32_t p = km_rng_below(&s->r, c);
            shared = km_rng_below(&s->r, s->len[p] + 1);
            memcpy(q, s->seqs + (size_t)p * max_blocks, shared * sizeof *q);
        }
        uint32_t len = km_rng_percent(&s->r, 30) ? max_blocks : 1 + km_rng_below(&s->r, max_blocks);
        len = len < shared ? shared : len;
        for (uint32_t i = shared; i < len; i++)
            q[i] = km_rng_hash(&s->r);
        s->len[c] = len;
    }
    uint32_t spread = W < 40 ? W : 40;
    s->workers = malloc(spread * sizeof *s->workers);
    cr_assert_not_null(s->workers);
    for (uint32_t i = 0; i < spread; i++) {
        if (W <= 40)
            s->workers[i] = i;
        else if (i < 4)
            s->workers[i] = i; /* low ids */
        else if (i < 8)
            s->workers[i] = W - 1 - (i - 4); /* the highest ids */
        else if (i < 12)
            s->workers[i] = 62 + (i - 8) < W ? 62 + (i - 8) : i; /* around the first word end */
        else
            s->workers[i] = km_rng_below(&s->r, W);
    }
    s->n_workers = spread;
}

static void scenario_free(scenario *s)
{
    for (int l = 0; l < LANE_CONFIGS; l++) {
        km_match_results_free(&s->res[l]);
        km_index_destroy(s->index[l]);
    }
    free(s->pairs.slots);
    free(s->seqs);
    free(s->len);
    free(s->workers);
}

static const uint64_t *chain(const scenario *s, uint32_t c)
{
    return s->seqs + (size_t)c * s->max_blocks;
}

static void apply_all(scenario *s, const km_update *u)
{
    for (int l = 0; l < LANE_CONFIGS; l++) {
        int rc = km_index_apply(s->index[l], u, 1, NULL);
        KM_CHECK(rc == KM_OK, "apply kind %d: %s (%s)", (int)u->kind, km_error_name(rc),
                 km_index_last_error(s->index[l]));
    }
    switch (u->kind) {
    case KM_UPDATE_STORE:
    case KM_UPDATE_SET_TIER:
        for (size_t i = 0; i < u->n_hashes; i++) {
            pair_slot *p = pair_find(&s->pairs, u->hashes[i], u->worker,
                                     u->kind == KM_UPDATE_STORE);
            if (p && (u->kind == KM_UPDATE_STORE || p->tier >= 0))
                p->tier = (int32_t)u->tier;
        }
        break;
    case KM_UPDATE_REMOVE:
        for (size_t i = 0; i < u->n_hashes; i++) {
            pair_slot *p = pair_find(&s->pairs, u->hashes[i], u->worker, 0);
            if (p)
                p->tier = -1;
        }
        break;
    default: /* clears: every pair of the worker */
        for (size_t i = 0; i < s->pairs.capacity; i++)
            if (s->pairs.slots[i].hash && s->pairs.slots[i].worker == u->worker)
                s->pairs.slots[i].tier = -1;
        break;
    }
}

/* One random update: stores of chain runs (rooted, continuations, whole chains), removes of
 * subsets, tier changes, and an occasional clear. */
static void random_update(scenario *s)
{
    km_rng *r = &s->r;
    uint32_t c = km_rng_below(r, s->n_chains);
    const uint64_t *q = chain(s, c);
    uint32_t n = s->len[c];
    uint32_t w = s->workers[km_rng_below(r, s->n_workers)];
    km_tier tier = km_rng_percent(r, 75) ? KM_TIER_DEVICE
                   : km_rng_percent(r, 50) ? KM_TIER_HOST : KM_TIER_DISK;
    uint32_t a = km_rng_percent(r, 60) ? 0 : km_rng_below(r, n);
    uint32_t b = a + 1 + km_rng_below(r, n - a);
    uint32_t roll = km_rng_below(r, 100);
    km_update u = {KM_UPDATE_STORE, w, a ? q[a - 1] : KM_NO_PARENT, q + a, b - a, tier};
    if (roll < 15) {
        u.kind = KM_UPDATE_REMOVE;
        u.parent = KM_NO_PARENT;
    } else if (roll < 22) {
        u.kind = KM_UPDATE_SET_TIER;
        u.parent = KM_NO_PARENT;
    } else if (roll < 24) {
        u = (km_update){KM_UPDATE_CLEAR_WORKER, w, KM_NO_PARENT, NULL, 0, KM_TIER_DEVICE};
    }
    apply_all(s, &u);
}

/* A request: a prefix of a chain (0, 1, max blocks, any), an extension past what anyone stored,
 * blocks nobody holds, or a chain prefix with a copy of it (or of its last block) after it. */
static uint32_t random_request(scenario *s, uint64_t *out)
{
    km_rng *r = &s->r;
    uint32_t c = km_rng_below(r, s->n_chains);
    const uint64_t *q = chain(s, c);
    uint32_t n = s->len[c], max = s->max_blocks, len;
    switch (km_rng_below(r, 8)) {
    case 0:
        return 0;
    case 1:
        len = 1;
        break;
    case 2: /* the longest accepted, the chain's own blocks first */
        for (uint32_t i = 0; i < max; i++)
            out[i] = i < n ? q[i] : km_rng_hash(r);
        return max;
    case 3: /* nobody's blocks */
        len = 1 + km_rng_below(r, max);
        for (uint32_t i = 0; i < len; i++)
            out[i] = km_rng_hash(r);
        return len;
    case 4: { /* a prefix, then that prefix again (or its last block repeated) */
        uint32_t p = 1 + km_rng_below(r, n < max / 2 ? n : max / 2);
        memcpy(out, q, p * sizeof *out);
        uint32_t extra = km_rng_below(r, max - p + 1);
        int same = km_rng_percent(r, 50);
        for (uint32_t i = 0; i < extra; i++)
            out[p + i] = same ? q[p - 1] : q[i % p];
        return p + extra;
    }
    default:
        len = 1 + km_rng_below(r, n);
        break;
    }
    memcpy(out, q, len * sizeof *out);
    return len;
}

/* The oracle's answer for one request and its comparison with results entry i. */
static void check_request(scenario *s, const km_request *q, const km_match_results *res,
                          size_t i, uint32_t *candidates, const char *when)
{
    const km_request_result *rr = &res->requests[i];
    uint32_t n = q->n_hashes, m = 0, owner = KM_NO_WORKER, owner_depth = 0;
    if (n > 0)
        for (uint32_t w = 0; w < s->W; w++)
            if (pair_tier(&s->pairs, q->hashes[0], w) >= 0)
                candidates[m++] = w;
    KM_CHECK(rr->count == m, "%s: W=%u S=%u request %zu (%u blocks): %u entries, expected %u",
             when, s->W, s->S, i, n, rr->count, m);
    KM_CHECK(rr->first + rr->count <= res->n_matches, "%s: request %zu past n_matches", when, i);
    for (uint32_t j = 0; j < m; j++) {
        uint32_t w = candidates[j], depth = 0, host = 0, disk = 0;
        for (; depth < n; depth++) {
            int t = pair_tier(&s->pairs, q->hashes[depth], w);
            if (t < 0)
                break;
            host += t == KM_TIER_HOST;
            disk += t == KM_TIER_DISK;
        }
        const km_worker_match *got = &res->matches[rr->first + j];
        const km_match_tiers *tiers = &res->tiers[rr->first + j];
        KM_CHECK(got->worker == w && got->depth == depth,
                 "%s: W=%u S=%u request %zu (%u blocks) entry %u: worker %u depth %u, expected "
                 "worker %u depth %u", when, s->W, s->S, i, n, j, got->worker, got->depth, w,
                 depth);
        KM_CHECK(tiers->host_blocks == host && tiers->disk_blocks == disk,
                 "%s: W=%u S=%u request %zu worker %u: host %u disk %u, expected %u %u", when,
                 s->W, s->S, i, w, tiers->host_blocks, tiers->disk_blocks, host, disk);
        if (depth > owner_depth) {
            owner = w;
            owner_depth = depth;
        }
    }
    KM_CHECK(rr->owner == owner && rr->owner_depth == owner_depth,
             "%s: W=%u S=%u request %zu (%u blocks): owner %u depth %u, expected %u depth %u",
             when, s->W, s->S, i, n, rr->owner, rr->owner_depth, owner, owner_depth);
    KM_CHECK((n == 0) == (rr->probes == 0), "%s: request %zu of %u blocks made %u probes", when,
             i, n, rr->probes);
}

/* Score n_requests random requests on every index; each against the oracle, the lane counts'
 * results against each other bit for bit. */
static void score_and_check(scenario *s, size_t n_requests, const char *when)
{
    uint64_t *storage = malloc(n_requests * s->max_blocks * sizeof *storage);
    km_request *q = malloc((n_requests ? n_requests : 1) * sizeof *q);
    uint32_t *candidates = malloc(s->W * sizeof *candidates);
    cr_assert(storage && q && candidates);
    for (size_t i = 0; i < n_requests; i++) {
        uint64_t *h = storage + i * s->max_blocks;
        q[i] = (km_request){h, random_request(s, h)};
    }
    for (int l = 0; l < LANE_CONFIGS; l++) {
        int rc = km_index_match_batch(s->index[l], q, n_requests, &s->res[l]);
        KM_CHECK(rc == KM_OK, "%s: match on %u lanes: %s (%s)", when, lane_counts[l],
                 km_error_name(rc), km_index_last_error(s->index[l]));
        KM_CHECK(s->res[l].n_requests == n_requests, "%s: %zu requests answered of %zu", when,
                 s->res[l].n_requests, n_requests);
    }
    uint64_t probes = 0;
    for (size_t i = 0; i < n_requests; i++) {
        check_request(s, &q[i], &s->res[0], i, candidates, when);
        probes += s->res[0].requests[i].probes;
    }
    KM_CHECK(probes == s->res[0].probes, "%s: probes %" PRIu64 ", sum of requests' %" PRIu64,
             when, s->res[0].probes, probes);
    for (int l = 1; l < LANE_CONFIGS; l++) {
        char why[512];
        KM_CHECK(km_results_identical(&s->res[0], &s->res[l], why, sizeof why),
                 "%s: W=%u S=%u, 1 lane against %u: %s", when, s->W, s->S, lane_counts[l], why);
        KM_CHECK(memcmp(s->res[0].tiers, s->res[l].tiers,
                        s->res[0].n_matches * sizeof *s->res[0].tiers) == 0,
                 "%s: tier splits differ between 1 and %u lanes", when, lane_counts[l]);
    }
    free(storage);
    free(q);
    free(candidates);
}

static void edges_property(uint32_t W, uint32_t S, uint32_t max_blocks, uint32_t n_chains,
                           int rounds, int updates_per_round)
{
    scenario s;
    scenario_init(&s, W, S, max_blocks, n_chains, 0x5C0E);
    const size_t batch_sizes[] = {1, 2, 15, 16, 47, 48, 300};
    int mid_growth = 0;
    uint64_t deep = 0, lower = 0, segment_keys = 0;
    km_index_stats st;
    for (int round = 0; round < rounds; round++) {
        char when[64];
        for (int k = 0; k < updates_per_round; k++) {
            random_update(&s);
            if (s.index[0]->blocks.old_slots && mid_growth < 20) {
                mid_growth++;
                snprintf(when, sizeof when, "round %d, mid-growth", round);
                score_and_check(&s, 100, when);
            }
        }
        snprintf(when, sizeof when, "round %d", round);
        score_and_check(&s, batch_sizes[km_rng_below(&s.r, 7)], when);
        cr_assert_eq(km_index_get_stats(s.index[0], &st), KM_OK);
        segment_keys = st.segment_keys > segment_keys ? st.segment_keys : segment_keys;
        for (size_t i = 0; i < s.res[0].n_requests; i++)
            deep += s.res[0].requests[i].owner_depth > 1;
        for (size_t j = 0; j < s.res[0].n_matches; j++)
            lower += s.res[0].tiers[j].host_blocks + s.res[0].tiers[j].disk_blocks;
    }
    KM_CHECK(deep > 0 && lower > 0, "vacuous: %" PRIu64 " deep answers, %" PRIu64
             " lower-tier blocks", deep, lower);
    KM_CHECK(S == 0 || segment_keys > 0, "S=%u: no segment keys", S);
    cr_log_info("W=%u S=%u: %d batches mid-growth, %" PRIu64 " growths, %" PRIu64 " blocks, %"
                PRIu64 " slots", W, S, mid_growth, st.table_growths, st.blocks, st.block_capacity);
    /* Every worker the updates used cleared: nothing matches any more, then stores again. */
    for (uint32_t i = 0; i < s.n_workers; i++) {
        km_update u = {KM_UPDATE_CLEAR_WORKER, s.workers[i], KM_NO_PARENT, NULL, 0,
                       KM_TIER_DEVICE};
        apply_all(&s, &u);
    }
    score_and_check(&s, 200, "after clearing every worker");
    for (int k = 0; k < updates_per_round; k++)
        random_update(&s);
    score_and_check(&s, 200, "after clearing and storing again");
    scenario_free(&s);
}

#define EDGES(W, S, MAXB, CHAINS, ROUNDS, UPDATES)                                                \
    Test(scoring_edges, w##W##_s##S, .timeout = 30)                                               \
    {                                                                                             \
        edges_property(W, S, MAXB, CHAINS, ROUNDS, UPDATES);                                      \
    }

EDGES(1, 0, 40, 60, 60, 30)
EDGES(1, 4, 40, 60, 60, 30)
EDGES(63, 16, 70, 1000, 60, 300)
EDGES(64, 32, 100, 1000, 60, 300)
EDGES(64, 0, 100, 100, 60, 60)
EDGES(65, 4, 70, 1000, 60, 300)
EDGES(1023, 32, 100, 1000, 40, 300)
EDGES(1024, 16, 100, 100, 30, 80)
EDGES(1024, 0, 64, 100, 30, 80)
EDGES(65534, 32, 64, 60, 6, 60)
