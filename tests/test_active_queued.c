/* SPDX-License-Identifier: Apache-2.0 */
/* Queued prefixes of active work (km_active_queue_blocks, km_active_queued_depth in
 * include/kvmatch/active.h).
 *
 * Suite `active_queued`: a promise extends a worker's depth until the entry's FIRST_TOKEN, end,
 * expiry, eviction, worker removal or move; promises on one worker never extend another's; two
 * entries promising one block keep it until both are done; the table's bound cuts promises short
 * and counts what it left out; bad calls change nothing. Then random lifecycles against a
 * brute-force model (a plain list of live entries and the blocks each promised): after every step
 * every worker's queued depth of random requests, from random starting depths, equals the
 * model's, and the promised-block count equals the model's sum. Progress (km_active_blocks_stored):
 * stores of promised blocks lower the promiser's pending prefill and pairs to what is left past the
 * furthest one stored, on the promiser's worker only, once per block, never below 0; the random
 * lifecycles store random runs too, and every worker's pending prefill and pairs equal the
 * model's after every step. Randomized tests print their seed (KM_TEST_SEED). */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvmatch/active.h"
#include "kvmatch/engine_model.h"
#include "test_util.h"

static km_active *make_active(uint32_t max_workers, uint32_t max_queued_blocks)
{
    km_active_config cfg;
    km_active_config_init(&cfg);
    cfg.max_workers = max_workers;
    cfg.ttl_ns = 1000;
    cfg.max_queued_blocks = max_queued_blocks;
    km_active *a = NULL;
    cr_assert_eq(km_active_create(&cfg, &a), KM_OK);
    return a;
}

static uint64_t queued_blocks(const km_active *a)
{
    km_active_stats s;
    cr_assert_eq(km_active_get_stats(a, &s), KM_OK);
    return s.queued_blocks;
}

static void begin(km_active *a, uint32_t worker, const char *id, uint64_t now)
{
    km_active_key k = km_active_key_of(id, "0");
    cr_assert_eq(km_active_begin(a, worker, &k, 1600, 0, 10, 16, now), KM_OK, "%s",
                 km_active_last_error(a));
}

static void promise(km_active *a, const char *id, const uint64_t *hashes, uint32_t n)
{
    km_active_key k = km_active_key_of(id, "0");
    cr_assert_eq(km_active_queue_blocks(a, &k, hashes, n), KM_OK, "%s", km_active_last_error(a));
}

Test(active_queued, a_promise_lasts_until_first_token, .timeout = 10)
{
    km_active *a = make_active(4, 1u << 20);
    uint64_t h[8] = {11, 12, 13, 14, 15, 16, 17, 18};
    cr_assert_eq(km_active_queued_depth(a, 1, h, 8, 0), 0);
    cr_assert_eq(km_active_queued_depth(a, 1, h, 8, 3), 3, "from is kept without a promise");
    begin(a, 1, "r1", 1);
    promise(a, "r1", h + 2, 4); /* blocks 2..5: the worker holds 0..1 already */
    cr_assert_eq(queued_blocks(a), 4);
    cr_assert_eq(km_active_queued_depth(a, 1, h, 8, 2), 6, "2 held + 4 promised");
    cr_assert_eq(km_active_queued_depth(a, 1, h, 8, 0), 0, "block 0 is neither held nor promised");
    cr_assert_eq(km_active_queued_depth(a, 0, h, 8, 2), 2, "another worker has no promise");
    cr_assert_eq(km_active_queued_depth(a, 1, h, 4, 2), 4, "never past n");
    uint64_t other[3] = {11, 12, 99};
    cr_assert_eq(km_active_queued_depth(a, 1, other, 3, 2), 2, "a different block 2");

    km_active_key k = km_active_key_of("r1", "0");
    cr_assert_eq(km_active_first_token(a, &k, KM_ACTIVE_CACHED_UNKNOWN, 2), KM_OK);
    cr_assert_eq(queued_blocks(a), 0);
    cr_assert_eq(km_active_queued_depth(a, 1, h, 8, 2), 2, "the prefill ran: nothing queued");
    int rc = km_active_queue_blocks(a, &k, h, 8);
    cr_assert_eq(rc, KM_ERR_PROTOCOL, "a promise after FIRST_TOKEN is refused");
    cr_assert(strstr(km_active_last_error(a), "after FIRST_TOKEN"), "%s", km_active_last_error(a));
    cr_assert_eq(queued_blocks(a), 0);
    km_active_destroy(a);
}

Test(active_queued, every_way_an_entry_ends_releases_its_promise, .timeout = 10)
{
    uint64_t h[4] = {21, 22, 23, 24};
    for (int way = 0; way < 5; way++) {
        km_active *a = make_active(4, 1u << 20);
        begin(a, 2, "r", 10);
        promise(a, "r", h, 4);
        cr_assert_eq(km_active_queued_depth(a, 2, h, 4, 0), 4);
        km_active_key k = km_active_key_of("r", "0");
        size_t n = 0;
        switch (way) {
        case 0:
            cr_assert_eq(km_active_finish(a, &k, KM_ACTIVE_END_CANCELLED, 11, NULL), KM_OK);
            break;
        case 1:
            cr_assert_eq(km_active_expire(a, 10 + 1000, NULL, NULL, &n), KM_OK);
            cr_assert_eq(n, 1);
            break;
        case 2:
            cr_assert_eq(km_active_evict_oldest(a, 11, NULL, NULL), KM_OK);
            break;
        case 3:
            cr_assert_eq(km_active_remove_worker(a, 2, 11, NULL, NULL, &n), KM_OK);
            cr_assert_eq(n, 1);
            break;
        case 4: /* a move forgets it: the blocks were promised on the first worker */
            cr_assert_eq(km_active_move(a, &k, 3, 11), KM_OK);
            cr_assert_eq(km_active_queued_depth(a, 3, h, 4, 0), 0);
            break;
        }
        cr_assert_eq(km_active_queued_depth(a, 2, h, 4, 0), 0, "way %d keeps the promise", way);
        cr_assert_eq(queued_blocks(a), 0, "way %d", way);
        km_active_destroy(a);
    }
}

Test(active_queued, shared_blocks_stay_until_every_promiser_is_done, .timeout = 10)
{
    km_active *a = make_active(2, 1u << 20);
    uint64_t h[6] = {31, 32, 33, 34, 35, 36};
    begin(a, 0, "a", 1);
    begin(a, 0, "b", 1);
    promise(a, "a", h, 4);
    promise(a, "b", h + 2, 4); /* blocks 2, 3 promised twice */
    cr_assert_eq(queued_blocks(a), 8);
    cr_assert_eq(km_active_queued_depth(a, 0, h, 6, 0), 6);
    km_active_key ka = km_active_key_of("a", "0");
    cr_assert_eq(km_active_finish(a, &ka, KM_ACTIVE_END_COMPLETE, 2, NULL), KM_OK);
    cr_assert_eq(km_active_queued_depth(a, 0, h, 6, 0), 0, "block 0 was a's alone");
    cr_assert_eq(km_active_queued_depth(a, 0, h, 6, 2), 6, "b still promises 2..5");
    cr_assert_eq(queued_blocks(a), 4);
    km_active_destroy(a);
}

Test(active_queued, the_bound_cuts_promises_short_and_counts, .timeout = 10)
{
    km_active *a = make_active(2, 5);
    uint64_t h[8] = {41, 42, 43, 44, 45, 46, 47, 48};
    begin(a, 0, "a", 1);
    begin(a, 1, "b", 1);
    promise(a, "a", h, 3);
    promise(a, "b", h, 8); /* room for 2 more */
    km_active_stats s;
    cr_assert_eq(km_active_get_stats(a, &s), KM_OK);
    cr_assert_eq(s.queued_blocks, 5);
    cr_assert_eq(s.queued_truncated, 6);
    cr_assert_eq(km_active_queued_depth(a, 1, h, 8, 0), 2, "b keeps its leading blocks only");
    cr_assert_eq(km_active_queued_depth(a, 0, h, 8, 0), 3);
    km_active_destroy(a);

    a = make_active(2, 0); /* none kept */
    begin(a, 0, "a", 1);
    promise(a, "a", h, 8);
    cr_assert_eq(queued_blocks(a), 0);
    cr_assert_eq(km_active_queued_depth(a, 0, h, 8, 1), 1);
    km_active_destroy(a);
}

Test(active_queued, bad_calls_change_nothing, .timeout = 10)
{
    km_active *a = make_active(2, 1u << 20);
    uint64_t h[2] = {51, 52};
    km_active_key k = km_active_key_of("r", "0");
    cr_assert_eq(km_active_queue_blocks(NULL, &k, h, 2), KM_ERR_NULL_POINTER);
    cr_assert_eq(km_active_queue_blocks(a, &k, h, 2), KM_ERR_NOT_FOUND);
    cr_assert(strstr(km_active_last_error(a), "no such active request"), "%s",
              km_active_last_error(a));
    begin(a, 0, "r", 1);
    cr_assert_eq(km_active_queue_blocks(a, &k, NULL, 2), KM_ERR_NULL_POINTER);
    promise(a, "r", h, 2);
    cr_assert_eq(km_active_queue_blocks(a, &k, h, 1), KM_ERR_PROTOCOL);
    cr_assert(strstr(km_active_last_error(a), "second queued prefix"), "%s",
              km_active_last_error(a));
    cr_assert_eq(queued_blocks(a), 2);
    cr_assert_eq(km_active_queued_depth(a, 0, h, 2, 0), 2);
    cr_assert_eq(km_active_queued_depth(a, 0, h, 2, 3), 0, "from past n");
    cr_assert_eq(km_active_queued_depth(a, 9, h, 2, 0), 0, "worker out of range");
    cr_assert_eq(km_active_queued_depth(a, 0, NULL, 2, 0), 0);
    cr_assert_eq(km_active_queued_depth(NULL, 0, h, 2, 1), 0);
    km_active_destroy(a);
}

static km_active_load load_of_worker(const km_active *a, uint32_t worker)
{
    km_active_load l;
    cr_assert_eq(km_active_worker_load(a, worker, &l), KM_OK);
    return l;
}

static uint64_t stored(km_active *a, uint32_t worker, const uint64_t *h, size_t n)
{
    uint64_t progressed = 99;
    cr_assert_eq(km_active_blocks_stored(a, worker, h, n, &progressed), KM_OK, "%s",
                 km_active_last_error(a));
    return progressed;
}

Test(active_queued, stores_of_promised_blocks_lower_the_pending_prefill, .timeout = 10)
{
    km_active *a = make_active(4, 1u << 20);
    uint64_t h[10] = {61, 62, 63, 64, 65, 66, 67, 68, 69, 70};
    begin(a, 1, "r", 1); /* 1600 tokens, none cached, blocks of 16 */
    promise(a, "r", h + 2, 4); /* blocks 2..5: the worker holds 0..1 */
    cr_assert_eq(load_of_worker(a, 1).pending_prefill_tokens, 1600);
    cr_assert_eq(stored(a, 0, h + 2, 2), 0, "another worker's stores are not its progress");
    cr_assert_eq(stored(a, 1, h, 2), 0, "blocks it did not promise");
    cr_assert_eq(load_of_worker(a, 1).pending_prefill_tokens, 1600);
    cr_assert_eq(stored(a, 1, h + 2, 2), 2);
    cr_assert_eq(load_of_worker(a, 1).pending_prefill_tokens, 1600 - 2 * 16);
    cr_assert_eq(load_of_worker(a, 1).pending_prefill_pairs,
                 km_engine_model_chunk_pairs(2 * 16, 1600 - 2 * 16));
    cr_assert_eq(stored(a, 1, h + 5, 1), 2, "block 4 was computed (or hit) before block 5");
    cr_assert_eq(load_of_worker(a, 1).pending_prefill_tokens, 1600 - 4 * 16);
    cr_assert_eq(stored(a, 1, h + 3, 3), 0, "blocks counted once");
    km_active_stats st;
    cr_assert_eq(km_active_get_stats(a, &st), KM_OK);
    cr_assert_eq(st.progressed_blocks, 4);
    cr_assert_eq(st.queued_blocks, 4, "the promise lasts until FIRST_TOKEN");

    /* A report of cached tokens keeps the smaller remainder: more cached than predicted leaves
     * what the report says; less leaves what the stores say. */
    km_active_key k = km_active_key_of("r", "0");
    cr_assert_eq(km_active_report_cached(a, &k, 0, 2), KM_OK);
    cr_assert_eq(load_of_worker(a, 1).pending_prefill_tokens, 1600 - 4 * 16);
    cr_assert_eq(km_active_report_cached(a, &k, 400, 3), KM_OK);
    cr_assert_eq(load_of_worker(a, 1).pending_prefill_tokens, 1200);
    cr_assert_eq(load_of_worker(a, 1).pending_prefill_pairs,
                 km_engine_model_chunk_pairs(400, 1200));
    cr_assert_eq(km_active_first_token(a, &k, 400, 4), KM_OK);
    cr_assert_eq(load_of_worker(a, 1).pending_prefill_tokens, 0);
    cr_assert_eq(load_of_worker(a, 1).pending_prefill_pairs, 0);
    cr_assert_eq(stored(a, 1, h + 2, 4), 0, "after FIRST_TOKEN nothing is pending");

    /* Never below 0: a 40-token prompt promised 4 blocks. */
    km_active_key small = km_active_key_of("small", "0");
    cr_assert_eq(km_active_begin(a, 2, &small, 40, 0, 1, 16, 5), KM_OK);
    cr_assert_eq(km_active_queue_blocks(a, &small, h, 4), KM_OK);
    cr_assert_eq(stored(a, 2, h + 3, 1), 4);
    cr_assert_eq(load_of_worker(a, 2).pending_prefill_tokens, 0);
    cr_assert_eq(km_active_get_stats(a, &st), KM_OK);
    cr_assert_eq(st.saturations, 0);

    cr_assert_eq(km_active_blocks_stored(a, 9, h, 1, NULL), KM_ERR_WORKER_RANGE);
    cr_assert_eq(km_active_blocks_stored(a, 1, NULL, 1, NULL), KM_ERR_NULL_POINTER);
    cr_assert_eq(km_active_blocks_stored(NULL, 1, h, 1, NULL), KM_ERR_NULL_POINTER);
    cr_assert_eq(km_active_blocks_stored(a, 1, NULL, 0, NULL), KM_OK);
    km_active_destroy(a);
}

/* A cached-tokens report before the stores: what is pending stays the smaller of what the report
 * leaves and what the stores leave of the charge at the decision, so blocks the report already
 * counted cached are not taken off again when they are stored, and a report of less than
 * predicted leaves the stores' view once blocks are stored. */
Test(active_queued, a_report_before_the_stores_counts_no_block_twice, .timeout = 10)
{
    km_active *a = make_active(2, 1u << 20);
    uint64_t h[10] = {81, 82, 83, 84, 85, 86, 87, 88, 89, 90};
    km_active_key more = km_active_key_of("more", "0"), less = km_active_key_of("less", "0");
    /* 160 tokens, none predicted cached; the engine says 80 (blocks 0..4) were. */
    cr_assert_eq(km_active_begin(a, 0, &more, 160, 0, 1, 16, 1), KM_OK);
    promise(a, "more", h, 10);
    cr_assert_eq(km_active_report_cached(a, &more, 80, 2), KM_OK);
    cr_assert_eq(load_of_worker(a, 0).pending_prefill_tokens, 80);
    cr_assert_eq(stored(a, 0, h, 5), 5, "blocks 0..4 are stored (loaded, say)");
    cr_assert_eq(load_of_worker(a, 0).pending_prefill_tokens, 80,
                 "the report counted them cached already: %" PRIu64 " pending",
                 load_of_worker(a, 0).pending_prefill_tokens);
    cr_assert_eq(stored(a, 0, h + 5, 1), 1);
    cr_assert_eq(load_of_worker(a, 0).pending_prefill_tokens, 64);
    cr_assert_eq(load_of_worker(a, 0).pending_prefill_pairs, km_engine_model_chunk_pairs(96, 64));

    /* 160 tokens, 32 predicted cached (blocks 0..1, promise 2..9); the engine says none were. */
    cr_assert_eq(km_active_begin(a, 1, &less, 160, 32, 1, 16, 3), KM_OK);
    promise(a, "less", h + 2, 8);
    cr_assert_eq(km_active_report_cached(a, &less, 0, 4), KM_OK);
    cr_assert_eq(load_of_worker(a, 1).pending_prefill_tokens, 160);
    cr_assert_eq(stored(a, 1, h + 2, 1), 1);
    cr_assert_eq(load_of_worker(a, 1).pending_prefill_tokens, 160 - 3 * 16,
                 "computed up to block 2: %" PRIu64 " pending",
                 load_of_worker(a, 1).pending_prefill_tokens);
    cr_assert_eq(load_of_worker(a, 1).pending_prefill_pairs,
                 km_engine_model_chunk_pairs(3 * 16, 160 - 3 * 16));
    /* A later report is the report's view now: the earlier one is replaced, not kept. */
    cr_assert_eq(km_active_report_cached(a, &less, 128, 5), KM_OK);
    cr_assert_eq(load_of_worker(a, 1).pending_prefill_tokens, 32);
    cr_assert_eq(km_active_report_cached(a, &less, 16, 6), KM_OK);
    cr_assert_eq(load_of_worker(a, 1).pending_prefill_tokens, 160 - 3 * 16);
    km_active_stats st;
    cr_assert_eq(km_active_get_stats(a, &st), KM_OK);
    cr_assert_eq(st.saturations, 0);
    km_active_destroy(a);
}

/* A store is progress only for the promisers on its worker, even where (worker, hash) pairs of two
 * workers share a slot of the queued map: h1 on worker 1 and h2 on worker 0 are made to, from the
 * slot's mix (hash ^ (worker + 1) * 0x9E3779B97F4A7C15). */
Test(active_queued, a_store_is_never_progress_on_another_worker, .timeout = 10)
{
    km_active *a = make_active(4, 1u << 20);
    const uint64_t mix = UINT64_C(0x9E3779B97F4A7C15);
    uint64_t h1 = 12345, h2 = h1 ^ (2 * mix) ^ (1 * mix);
    uint64_t p[2] = {h2, h1};
    begin(a, 0, "e", 1);
    promise(a, "e", p, 2);
    cr_assert_eq(stored(a, 1, &h1, 1), 0, "worker 1 holds no promise");
    cr_assert_eq(load_of_worker(a, 0).pending_prefill_tokens, 1600);
    cr_assert_eq(stored(a, 0, &h1, 1), 2);
    cr_assert_eq(load_of_worker(a, 0).pending_prefill_tokens, 1600 - 2 * 16);
    km_active_destroy(a);
}

Test(active_queued, a_block_two_entries_promised_is_progress_for_both, .timeout = 10)
{
    km_active *a = make_active(2, 1u << 20);
    uint64_t h[6] = {71, 72, 73, 74, 75, 76};
    begin(a, 0, "a", 1);
    begin(a, 0, "b", 1);
    begin(a, 0, "c", 1);
    promise(a, "a", h, 4);
    promise(a, "b", h + 2, 4); /* blocks 2, 3 promised by a and b */
    promise(a, "c", h + 5, 1);
    km_active_key kb = km_active_key_of("b", "0");
    cr_assert_eq(km_active_finish(a, &kb, KM_ACTIVE_END_COMPLETE, 2, NULL), KM_OK);
    /* b, the latest to promise blocks 2 and 3, is gone: a still gets their progress. */
    cr_assert_eq(stored(a, 0, h + 2, 1), 3);
    cr_assert_eq(load_of_worker(a, 0).pending_prefill_tokens, 2 * 1600 - 3 * 16);
    begin(a, 0, "d", 3);
    promise(a, "d", h + 3, 2); /* blocks 3, 4: block 3 promised by a and d */
    cr_assert_eq(stored(a, 0, h + 3, 2), 1 + 2, "a's block 3, d's blocks 3 and 4");
    cr_assert_eq(load_of_worker(a, 0).pending_prefill_tokens, 3 * 1600 - 4 * 16 - 2 * 16);
    km_active_destroy(a);
}

/* ---- random lifecycles against a model ------------------------------------------------------ */

enum { MODEL_ENTRIES = 48, MODEL_WORKERS = 5, MODEL_BLOCKS = 24, MODEL_CHAINS = 6 };

typedef struct model_entry {
    bool live, promised, first_token;
    uint32_t worker;
    uint64_t blocks[MODEL_BLOCKS];
    uint32_t n, computed; /* blocks[0..computed) were seen stored */
    uint64_t pending;     /* prefill tokens left */
} model_entry;

/* Every entry's prompt in the model, in tokens: 24 blocks of 16 are more, so a pending prefill
 * also reaches 0. */
enum { MODEL_PROMPT = 200 };

/* Chains share leading blocks: chain c's block k is `k < fork(c) ? base[k] : own[c][k]`. */
typedef struct chains {
    uint64_t h[MODEL_CHAINS][MODEL_BLOCKS];
} chains;

static bool model_promised(const model_entry *m, uint32_t worker, uint64_t hash)
{
    for (int i = 0; i < MODEL_ENTRIES; i++)
        if (m[i].live && m[i].promised && !m[i].first_token && m[i].worker == worker)
            for (uint32_t k = 0; k < m[i].n; k++)
                if (m[i].blocks[k] == hash)
                    return true;
    return false;
}

static uint32_t model_depth(const model_entry *m, uint32_t worker, const uint64_t *h, uint32_t n,
                            uint32_t from)
{
    uint32_t d = from;
    while (d < n && model_promised(m, worker, h[d]))
        d++;
    return d;
}

Test(active_queued, random_lifecycles_match_a_model, .timeout = 60)
{
    km_rng rng;
    km_rng_init(&rng, km_test_seed());
    chains c;
    for (int k = 0; k < MODEL_BLOCKS; k++)
        c.h[0][k] = km_rng_hash(&rng);
    for (int ch = 1; ch < MODEL_CHAINS; ch++) {
        uint32_t fork = km_rng_below(&rng, MODEL_BLOCKS);
        for (int k = 0; k < MODEL_BLOCKS; k++)
            c.h[ch][k] = k < (int)fork ? c.h[0][k] : km_rng_hash(&rng);
    }
    km_active *a = make_active(MODEL_WORKERS, 1u << 20);
    model_entry m[MODEL_ENTRIES];
    memset(m, 0, sizeof m);
    uint64_t now = 1;
    for (int step = 0; step < 4000; step++) {
        int i = (int)km_rng_below(&rng, MODEL_ENTRIES);
        char id[16];
        snprintf(id, sizeof id, "e%d", i);
        km_active_key k = km_active_key_of(id, "0");
        uint32_t op = km_rng_below(&rng, 6);
        if (!m[i].live) {
            uint32_t w = km_rng_below(&rng, MODEL_WORKERS);
            cr_assert_eq(km_active_begin(a, w, &k, MODEL_PROMPT, 0, 1, 16, now), KM_OK);
            m[i] = (model_entry){.live = true, .worker = w, .pending = MODEL_PROMPT};
        } else if (op == 0 && !m[i].promised && !m[i].first_token) {
            const uint64_t *chain = c.h[km_rng_below(&rng, MODEL_CHAINS)];
            uint32_t from = km_rng_below(&rng, MODEL_BLOCKS);
            uint32_t n = km_rng_below(&rng, MODEL_BLOCKS - from + 1);
            cr_assert_eq(km_active_queue_blocks(a, &k, chain + from, n), KM_OK);
            m[i].promised = true;
            memcpy(m[i].blocks, chain + from, n * sizeof *chain);
            m[i].n = n;
        } else if (op == 1 && !m[i].first_token) {
            cr_assert_eq(km_active_first_token(a, &k, KM_ACTIVE_CACHED_UNKNOWN, now), KM_OK);
            m[i].first_token = true;
            m[i].pending = 0;
        } else if (op == 2) {
            cr_assert_eq(km_active_finish(a, &k, KM_ACTIVE_END_COMPLETE, now, NULL), KM_OK);
            m[i].live = false;
        } else if (op == 3) {
            uint32_t w = km_rng_below(&rng, MODEL_WORKERS);
            cr_assert_eq(km_active_move(a, &k, w, now), KM_OK);
            if (w != m[i].worker) {
                m[i].worker = w;
                m[i].n = m[i].computed = 0; /* forgotten; the entry still may not promise again */
            }
        } else if (op == 4 && km_rng_percent(&rng, 5)) {
            uint32_t w = km_rng_below(&rng, MODEL_WORKERS);
            cr_assert_eq(km_active_remove_worker(a, w, now, NULL, NULL, NULL), KM_OK);
            for (int j = 0; j < MODEL_ENTRIES; j++)
                if (m[j].live && m[j].worker == w)
                    m[j].live = false;
        }
        if (op == 5) { /* a run of some chain's blocks stored on some worker */
            uint32_t w = km_rng_below(&rng, MODEL_WORKERS);
            const uint64_t *chain = c.h[km_rng_below(&rng, MODEL_CHAINS)];
            uint32_t from = km_rng_below(&rng, MODEL_BLOCKS);
            uint32_t n = km_rng_below(&rng, MODEL_BLOCKS - from + 1);
            uint64_t want = 0;
            for (uint32_t b = from; b < from + n; b++)
                for (int j = 0; j < MODEL_ENTRIES; j++) {
                    model_entry *e = &m[j];
                    if (!e->live || e->first_token || e->worker != w)
                        continue;
                    for (uint32_t q = e->computed; q < e->n; q++)
                        if (e->blocks[q] == chain[b]) {
                            uint64_t tokens = (uint64_t)(q + 1 - e->computed) * 16;
                            want += q + 1 - e->computed;
                            e->pending = e->pending > tokens ? e->pending - tokens : 0;
                            e->computed = q + 1;
                            break;
                        }
                }
            uint64_t got = stored(a, w, chain + from, n);
            KM_CHECK(got == want, "step %d: %" PRIu64 " blocks progressed, model %" PRIu64, step,
                     got, want);
        }
        uint64_t total = 0;
        for (int j = 0; j < MODEL_ENTRIES; j++)
            if (m[j].live && !m[j].first_token)
                total += m[j].n;
        for (uint32_t w = 0; w < MODEL_WORKERS; w++) {
            uint64_t pending = 0, pairs = 0;
            for (int j = 0; j < MODEL_ENTRIES; j++)
                if (m[j].live && m[j].worker == w) {
                    pending += m[j].pending;
                    pairs += km_engine_model_chunk_pairs(MODEL_PROMPT - m[j].pending, m[j].pending);
                }
            km_active_load l = load_of_worker(a, w);
            KM_CHECK(l.pending_prefill_tokens == pending && l.pending_prefill_pairs == pairs,
                     "step %d: worker %u pending %" PRIu64 " tokens %" PRIu64 " pairs, model %"
                     PRIu64 " and %" PRIu64, step, w, l.pending_prefill_tokens,
                     l.pending_prefill_pairs, pending, pairs);
        }
        KM_CHECK(queued_blocks(a) == total, "step %d: %" PRIu64 " promised blocks, model %" PRIu64,
                 step, queued_blocks(a), total);
        for (int probe = 0; probe < 4; probe++) {
            uint32_t w = km_rng_below(&rng, MODEL_WORKERS);
            const uint64_t *chain = c.h[km_rng_below(&rng, MODEL_CHAINS)];
            uint32_t n = km_rng_below(&rng, MODEL_BLOCKS + 1);
            uint32_t from = km_rng_below(&rng, n + 1);
            uint32_t got = km_active_queued_depth(a, w, chain, n, from);
            uint32_t want = model_depth(m, w, chain, n, from);
            KM_CHECK(got == want, "step %d: worker %u depth %u from %u of %u, model %u", step, w,
                     got, from, n, want);
        }
        now++;
    }
    km_active_destroy(a);
}
