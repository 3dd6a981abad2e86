/* SPDX-License-Identifier: Apache-2.0 */
/* The simulated engine (src/sim/engine.h): LRU order (a request's tail before its head, oldest
 * first), capacity and admission errors, hit accounting with vLLM's full-prompt rule, reference
 * counts, concurrent prefills of equal content, restart, the time model and the step scheduler,
 * known answers cached as they are generated, determinism; a property test of random admits / prefill completions / finishes against a
 * brute-force model of the cache (plain arrays, linear scans), checking admissions, every emitted
 * event and the cache after each operation; and the decode test: every payload decodes with
 * km_kv_decode_payload and, fed to a real km_feed, gives an index equal to the engine's cache
 * after every step (restarts, answers and next turns that hit them included). Randomized tests print their seed (KM_TEST_SEED). */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <xxhash.h>

#include "kv_test_publisher.h"
#include "kvmatch/feed.h"
#include "kvmatch/hash.h"
#include "kvmatch/kv_events.h"
#include "sim/engine.h"
#include "test_util.h"

#define BS 4u /* block size of most tests */

/* ---- helpers ---------------------------------------------------------------------------------- */

static km_sim_engine *make_engine(uint32_t capacity, uint64_t seed)
{
    km_sim_engine_config cfg;
    km_sim_engine_config_init(&cfg);
    cfg.model.block_size = BS;
    cfg.model.capacity_blocks = capacity;
    cfg.process_seed = seed;
    km_sim_engine *e = NULL;
    cr_assert_eq(km_sim_engine_create(&cfg, &e), KM_OK);
    return e;
}

/* n tokens: `shared` tokens of prefix `family`, then tokens unique to `unique`. */
static void make_tokens(uint32_t *out, uint32_t n, uint32_t family, uint32_t shared, uint32_t unique)
{
    for (uint32_t i = 0; i < n; i++)
        out[i] = i < shared ? family * 100000u + i : 0x40000000u + unique * 100000u + i;
}

static void chains_of(const uint32_t *tokens, uint32_t n, uint64_t *out)
{
    km_hash_config hc = {BS, NULL, NULL};
    size_t nb;
    cr_assert_eq(km_hash_sequence(&hc, tokens, n, 0, 0, NULL, out, &nb), KM_OK);
}

/* Decode the next message; it must exist. */
static km_kv_batch take_batch(km_sim_engine *e, km_kv_decoder *dec, km_sim_message *m)
{
    cr_assert_eq(km_sim_engine_take_message(e, m), 1, "expected a message");
    km_kv_batch b;
    int rc = km_kv_decode_payload(dec, m->payload, m->payload_size, &b);
    cr_assert_eq(rc, KM_OK, "decode: %s", km_kv_decoder_last_error(dec));
    cr_assert_eq(b.n_rejected, 0);
    cr_assert_eq(b.n_unknown_events, 0);
    return b;
}

static void admit_ok(km_sim_engine *e, uint64_t id, const uint32_t *t, uint32_t n, uint32_t reserve,
                     km_sim_admission *a)
{
    int rc = km_sim_engine_admit(e, id, t, n, reserve, a);
    cr_assert_eq(rc, KM_OK, "admit %" PRIu64 ": %s", id, km_sim_engine_last_error(e));
}

/* admit + complete + finish, then close the step. */
static void run_request(km_sim_engine *e, uint64_t id, const uint32_t *t, uint32_t n)
{
    admit_ok(e, id, t, n, 0, NULL);
    cr_assert_eq(km_sim_engine_complete_prefill(e, id, NULL), KM_OK);
    cr_assert_eq(km_sim_engine_finish(e, id), KM_OK);
    cr_assert_eq(km_sim_engine_end_step(e, 1, NULL), KM_OK);
}

/* ---- named cases ------------------------------------------------------------------------------ */

Test(sim_engine, config_and_errors, .timeout = 10)
{
    km_sim_engine_config cfg;
    km_sim_engine_config_init(&cfg);
    cr_assert_eq(cfg.model.block_size, 16);
    km_sim_engine *e = NULL;
    cfg.model.block_size = 0;
    cr_assert_eq(km_sim_engine_create(&cfg, &e), KM_ERR_BLOCK_SIZE);
    km_sim_engine_config_init(&cfg);
    cfg.model.capacity_blocks = 0;
    cr_assert_eq(km_sim_engine_create(&cfg, &e), KM_ERR_INVALID_ARGUMENT);
    km_sim_engine_config_init(&cfg);
    cfg.model.token_us = -1;
    cr_assert_eq(km_sim_engine_create(&cfg, &e), KM_ERR_INVALID_ARGUMENT);
    cr_assert_eq(km_sim_engine_create(NULL, NULL), KM_ERR_NULL_POINTER);
    km_sim_engine_destroy(NULL);

    e = make_engine(8, 1);
    uint32_t t[8];
    make_tokens(t, 8, 1, 8, 0);
    cr_assert_eq(km_sim_engine_admit(e, 1, t, 0, 0, NULL), KM_ERR_INVALID_ARGUMENT);
    cr_assert_neq(strstr(km_sim_engine_last_error(e), "no prompt tokens"), NULL);
    cr_assert_eq(km_sim_engine_admit(e, 1, NULL, 8, 0, NULL), KM_ERR_NULL_POINTER);
    cr_assert_eq(km_sim_engine_admit(e, UINT64_MAX, t, 8, 0, NULL), KM_ERR_INVALID_ARGUMENT);
    admit_ok(e, 1, t, 8, 0, NULL);
    cr_assert_eq(km_sim_engine_admit(e, 1, t, 8, 0, NULL), KM_ERR_INVALID_ARGUMENT);
    cr_assert_neq(strstr(km_sim_engine_last_error(e), "already"), NULL);
    cr_assert_eq(km_sim_engine_complete_prefill(e, 2, NULL), KM_ERR_NOT_FOUND);
    cr_assert_eq(km_sim_engine_finish(e, 2), KM_ERR_NOT_FOUND);
    cr_assert_eq(km_sim_engine_complete_prefill(e, 1, NULL), KM_OK);
    cr_assert_eq(km_sim_engine_complete_prefill(e, 1, NULL), KM_ERR_INVALID_ARGUMENT);
    /* The two ways of driving do not mix. */
    cr_assert_eq(km_sim_engine_submit(e, 5, t, 8, 1, 0), KM_ERR_INVALID_ARGUMENT);
    cr_assert_eq(km_sim_engine_advance(e, 0), KM_ERR_INVALID_ARGUMENT);
    cr_assert_eq(km_sim_engine_finish(e, 1), KM_OK);
    km_sim_engine_destroy(e);
}

Test(sim_engine, lru_evicts_tail_before_head_and_oldest_first, .timeout = 10)
{
    km_sim_engine *e = make_engine(8, 7);
    km_kv_decoder *dec;
    cr_assert_eq(km_kv_decoder_create(NULL, &dec), KM_OK);
    uint32_t a[12], b[8];
    uint64_t ca[3], cb[2];
    make_tokens(a, 12, 1, 0, 1);
    make_tokens(b, 8, 2, 0, 2);
    chains_of(a, 12, ca);
    chains_of(b, 8, cb);
    run_request(e, 1, a, 12); /* blocks 0..2, freed as 2,1,0 at the tail */
    run_request(e, 2, b, 8);  /* blocks 3..4, freed as 4,3 */
    km_sim_message m;
    km_kv_batch batch = take_batch(e, dec, &m);
    cr_assert_eq(m.seq, 0);
    cr_assert_eq(batch.n_events, 1);
    cr_assert_eq(batch.events[0].kind, KM_KV_EVENT_BLOCK_STORED);
    cr_assert_eq(batch.events[0].n_block_hashes, 3);
    cr_assert_not(batch.events[0].has_parent_block_hash);
    cr_assert_eq(batch.events[0].block_hashes[2], km_sim_engine_engine_hash(e, ca[2]));
    cr_assert_eq(batch.events[0].n_token_ids, 12);
    cr_assert_eq(batch.events[0].token_ids[5], a[5]);
    cr_assert_eq(batch.events[0].block_size, BS);
    cr_assert_eq(batch.events[0].medium, KM_KV_MEDIUM_GPU);
    batch = take_batch(e, dec, &m);
    cr_assert_eq(m.seq, 1);

    /* Free queue now: empty 5,6,7, then a's 2,1,0, then b's 4,3. A request of 5 blocks of new
     * content takes the three empty blocks, then evicts a's tail (2) and then a's middle (1). */
    uint32_t c[20];
    make_tokens(c, 20, 3, 0, 3);
    km_sim_admission adm;
    admit_ok(e, 3, c, 20, 0, &adm);
    cr_assert_eq(adm.evicted_blocks, 2);
    cr_assert_eq(adm.held_blocks, 0);
    cr_assert_eq(km_sim_engine_end_step(e, 2, NULL), KM_OK);
    batch = take_batch(e, dec, &m);
    cr_assert_eq(batch.n_events, 2);
    cr_assert_eq(batch.events[0].kind, KM_KV_EVENT_BLOCK_REMOVED);
    cr_assert_eq(batch.events[0].block_hashes[0], km_sim_engine_engine_hash(e, ca[2]));
    cr_assert_eq(batch.events[1].block_hashes[0], km_sim_engine_engine_hash(e, ca[1]));
    cr_assert(km_sim_engine_holds(e, ca[0]));
    cr_assert_not(km_sim_engine_holds(e, ca[1]));
    cr_assert_eq(km_sim_engine_cached_depth(e, ca, 3), 1);
    cr_assert_eq(km_sim_engine_cached_depth(e, cb, 2), 2);
    /* One block more: a's head goes before b (finished later), b's tail before b's head. */
    uint32_t d[8];
    make_tokens(d, 8, 4, 0, 4);
    admit_ok(e, 4, d, 8, 0, &adm);
    cr_assert_eq(adm.evicted_blocks, 2);
    cr_assert_eq(km_sim_engine_end_step(e, 3, NULL), KM_OK);
    batch = take_batch(e, dec, &m);
    cr_assert_eq(batch.events[0].block_hashes[0], km_sim_engine_engine_hash(e, ca[0]));
    cr_assert_eq(batch.events[1].block_hashes[0], km_sim_engine_engine_hash(e, cb[1]));
    cr_assert(km_sim_engine_holds(e, cb[0]));
    km_sim_engine_stats st;
    km_sim_engine_get_stats(e, &st);
    cr_assert_eq(st.blocks_evicted, 4);
    cr_assert_eq(st.blocks_in_use, 7);
    cr_assert_eq(st.blocks_free, 1);
    cr_assert_eq(st.blocks_cached, 1);
    km_kv_decoder_destroy(dec);
    km_sim_engine_destroy(e);
}

Test(sim_engine, capacity_is_never_exceeded, .timeout = 10)
{
    km_sim_engine *e = make_engine(6, 1);
    uint32_t t[40];
    make_tokens(t, 40, 1, 0, 1);
    /* 25 tokens + 0 reserve = 7 blocks > 6: can never run. */
    cr_assert_eq(km_sim_engine_admit(e, 1, t, 25, 0, NULL), KM_ERR_TOO_LARGE);
    cr_assert_neq(strstr(km_sim_engine_last_error(e), "needs 7 blocks"), NULL);
    cr_assert_eq(km_sim_engine_admit(e, 1, t, 8, 17, NULL), KM_ERR_TOO_LARGE);
    km_sim_admission a;
    admit_ok(e, 1, t, 12, 4, &a); /* 4 blocks */
    cr_assert_eq(a.new_blocks, 4);
    uint32_t u[12];
    make_tokens(u, 12, 2, 0, 2);
    cr_assert_eq(km_sim_engine_admit(e, 2, u, 12, 0, NULL), KM_ERR_OVERLOADED);
    km_sim_engine_stats st;
    km_sim_engine_get_stats(e, &st);
    cr_assert_eq(st.blocks_free, 2);
    cr_assert_eq(st.blocks_in_use, 4);
    cr_assert_eq(st.admission_waits, 1);
    cr_assert_eq(st.admissions, 1);
    int published = 1;
    cr_assert_eq(km_sim_engine_end_step(e, 5, &published), KM_OK);
    cr_assert_eq(published, 0, "a refused admission emits nothing");
    cr_assert_eq(km_sim_engine_finish(e, 1), KM_OK);
    admit_ok(e, 2, u, 12, 0, NULL);
    km_sim_engine_destroy(e);
}

Test(sim_engine, hits_follow_vllm_full_prompt_rule, .timeout = 10)
{
    km_sim_engine *e = make_engine(32, 1);
    uint32_t t[13];
    make_tokens(t, 13, 1, 13, 0);
    run_request(e, 1, t, 8); /* caches 2 blocks */
    km_sim_admission a;
    /* The whole prompt (8 tokens, 2 blocks) is cached: vLLM recomputes the last block. */
    admit_ok(e, 2, t, 8, 0, &a);
    cr_assert_eq(a.held_blocks, 2);
    cr_assert_eq(a.hit_blocks, 1);
    cr_assert_eq(a.cached_tokens, 4);
    cr_assert_eq(a.uncached_tokens, 4);
    cr_assert_eq(a.new_blocks, 0, "the held block is reused, not duplicated");
    /* One more token: both blocks count. */
    admit_ok(e, 3, t, 9, 0, &a);
    cr_assert_eq(a.hit_blocks, 2);
    cr_assert_eq(a.cached_tokens, 8);
    cr_assert_eq(a.uncached_tokens, 1);
    cr_assert_eq(a.new_blocks, 1);
    /* Shorter than a block: never a hit. */
    admit_ok(e, 4, t, 3, 0, &a);
    cr_assert_eq(a.full_blocks, 0);
    cr_assert_eq(a.cached_tokens, 0);
    /* 12 tokens: 2 of 3 blocks held. */
    admit_ok(e, 5, t, 12, 0, &a);
    cr_assert_eq(a.held_blocks, 2);
    cr_assert_eq(a.hit_blocks, 2);
    uint32_t stored = 9;
    cr_assert_eq(km_sim_engine_complete_prefill(e, 5, &stored), KM_OK);
    cr_assert_eq(stored, 1);
    km_sim_engine_stats st;
    km_sim_engine_get_stats(e, &st);
    cr_assert_eq(st.cached_tokens, 0 + 4 + 8 + 0 + 8);
    cr_assert_eq(st.hit_blocks, 1 + 2 + 2);
    km_sim_engine_destroy(e);
}

Test(sim_engine, blocks_in_use_are_never_evicted, .timeout = 10)
{
    km_sim_engine *e = make_engine(6, 1);
    uint32_t a[12], c[16], x[16];
    make_tokens(a, 12, 1, 8, 1);
    make_tokens(c, 16, 1, 8, 2); /* shares 2 blocks with a */
    uint64_t ca[3], cc[4];
    chains_of(a, 12, ca);
    chains_of(c, 16, cc);
    admit_ok(e, 1, a, 12, 0, NULL);
    cr_assert_eq(km_sim_engine_complete_prefill(e, 1, NULL), KM_OK);
    km_sim_admission adm;
    admit_ok(e, 2, c, 16, 0, &adm); /* 2 shared + 2 new: 5 of 6 blocks in use */
    cr_assert_eq(adm.held_blocks, 2);
    cr_assert_eq(km_sim_engine_complete_prefill(e, 2, NULL), KM_OK);
    cr_assert_eq(km_sim_engine_finish(e, 1), KM_OK); /* only a's third block becomes free */
    make_tokens(x, 16, 9, 0, 9);
    cr_assert_eq(km_sim_engine_admit(e, 3, x, 12, 0, NULL), KM_ERR_OVERLOADED);
    admit_ok(e, 3, x, 8, 0, &adm); /* the empty block, then a's private tail */
    cr_assert_eq(adm.evicted_blocks, 1);
    cr_assert_not(km_sim_engine_holds(e, ca[2]));
    cr_assert_eq(km_sim_engine_cached_depth(e, cc, 4), 4, "c's blocks, shared ones included");
    km_sim_engine_stats st;
    km_sim_engine_get_stats(e, &st);
    cr_assert_eq(st.blocks_in_use, 6);
    cr_assert_eq(st.blocks_free, 0);
    km_sim_engine_destroy(e);
}

Test(sim_engine, concurrent_prefills_of_equal_content_cache_once, .timeout = 10)
{
    km_sim_engine *e = make_engine(16, 3);
    km_kv_decoder *dec;
    cr_assert_eq(km_kv_decoder_create(NULL, &dec), KM_OK);
    uint32_t t[12], u[16];
    make_tokens(t, 12, 1, 12, 0);
    make_tokens(u, 16, 1, 12, 5); /* t's 3 blocks + 1 */
    uint64_t cu[4];
    chains_of(u, 16, cu);
    admit_ok(e, 1, t, 12, 0, NULL);
    admit_ok(e, 2, u, 16, 0, NULL); /* nothing cached yet: computes all 4 itself */
    uint32_t stored;
    cr_assert_eq(km_sim_engine_complete_prefill(e, 1, &stored), KM_OK);
    cr_assert_eq(stored, 3);
    cr_assert_eq(km_sim_engine_complete_prefill(e, 2, &stored), KM_OK);
    cr_assert_eq(stored, 1);
    cr_assert_eq(km_sim_engine_end_step(e, 10, NULL), KM_OK);
    km_sim_message m;
    km_kv_batch b = take_batch(e, dec, &m);
    cr_assert_eq(b.n_events, 2);
    cr_assert_eq(b.events[1].n_block_hashes, 1);
    cr_assert(b.events[1].has_parent_block_hash);
    cr_assert_eq(b.events[1].parent_block_hash, km_sim_engine_engine_hash(e, cu[2]));
    cr_assert_eq(b.events[1].token_ids[0], u[12]);
    km_sim_engine_stats st;
    km_sim_engine_get_stats(e, &st);
    cr_assert_eq(st.duplicate_blocks, 3);
    cr_assert_eq(st.blocks_cached, 4);
    /* Request 2's private copies go back empty: 16 - 4 cached blocks stay empty or free. */
    cr_assert_eq(km_sim_engine_finish(e, 2), KM_OK);
    cr_assert_eq(km_sim_engine_finish(e, 1), KM_OK);
    km_sim_engine_get_stats(e, &st);
    cr_assert_eq(st.blocks_free, 16);
    cr_assert_eq(st.blocks_cached, 4);
    km_kv_decoder_destroy(dec);
    km_sim_engine_destroy(e);
}

Test(sim_engine, restart_drops_everything_and_restarts_seq, .timeout = 10)
{
    km_sim_engine_config cfg;
    km_sim_engine_config_init(&cfg);
    cfg.model.block_size = BS;
    cfg.model.capacity_blocks = 16;
    cfg.process_seed = 11;
    km_sim_engine *e;
    cr_assert_eq(km_sim_engine_create(&cfg, &e), KM_OK);
    km_kv_decoder *dec;
    cr_assert_eq(km_kv_decoder_create(NULL, &dec), KM_OK);
    uint32_t t[8];
    uint64_t ct[2];
    make_tokens(t, 8, 1, 8, 0);
    chains_of(t, 8, ct);
    run_request(e, 1, t, 8);
    run_request(e, 2, t, 8); /* nothing new: no message */
    uint64_t old_hash = km_sim_engine_engine_hash(e, ct[0]);
    admit_ok(e, 3, t, 8, 0, NULL); /* in flight at the crash */
    cr_assert_eq(km_sim_engine_restart(e, 12, 100), KM_OK);
    km_sim_engine_stats st;
    km_sim_engine_get_stats(e, &st);
    cr_assert_eq(st.blocks_cached, 0);
    cr_assert_eq(st.blocks_free, 16);
    cr_assert_eq(st.running, 0);
    cr_assert_eq(st.seq_next, 0);
    cr_assert_eq(st.restarts, 1);
    cr_assert_eq(km_sim_engine_finish(e, 3), KM_ERR_NOT_FOUND);
    cr_assert_neq(km_sim_engine_engine_hash(e, ct[0]), old_hash);
    km_sim_message m;
    km_kv_batch b = take_batch(e, dec, &m); /* the old process's message is still there */
    cr_assert_eq(m.seq, 0);
    cr_assert_eq(b.events[0].block_hashes[0], old_hash);
    cr_assert_eq(km_sim_engine_take_message(e, &m), 0, "vLLM emits nothing on a restart");
    run_request(e, 4, t, 8);
    b = take_batch(e, dec, &m);
    cr_assert_eq(m.seq, 0);
    cr_assert_eq(b.events[0].block_hashes[0], km_sim_engine_engine_hash(e, ct[0]));
    km_sim_engine_destroy(e);

    cfg.clear_on_restart = true;
    cr_assert_eq(km_sim_engine_create(&cfg, &e), KM_OK);
    run_request(e, 1, t, 8);
    cr_assert_eq(km_sim_engine_restart(e, 13, 50), KM_OK);
    take_batch(e, dec, &m);
    b = take_batch(e, dec, &m);
    cr_assert_eq(m.seq, 0);
    cr_assert_eq(m.time_us, 50);
    cr_assert_eq(b.n_events, 1);
    cr_assert_eq(b.events[0].kind, KM_KV_EVENT_ALL_BLOCKS_CLEARED);
    km_sim_engine_destroy(e);
    km_kv_decoder_destroy(dec);
}

/* ---- time model and scheduler ----------------------------------------------------------------- */

static km_sim_completion next_completion(km_sim_engine *e)
{
    km_sim_completion c;
    cr_assert_eq(km_sim_engine_next_completion(e, &c), 1, "expected a completion");
    return c;
}

/* Round time constants, so the known answers below read as arithmetic (no preset's figures). */
static void fixed_time_model(km_sim_engine_config *cfg)
{
    cfg->model.step_floor_us = 1000.0;
    cfg->model.token_us = 100.0;
    cfg->model.prefill_us_per_pair = 0.0;
    cfg->model.decode_us_per_request = 50.0;
    cfg->model.decode_us_per_context_token = 0.064;
    cfg->model.max_num_batched_tokens = 8192;
    cfg->model.max_num_seqs = 256;
}

Test(sim_engine, time_model_and_single_request_timeline, .timeout = 10)
{
    km_sim_engine_config cfg;
    km_sim_engine_config_init(&cfg);
    fixed_time_model(&cfg);
    km_engine_step prefill = {1000, 0, 0, 0}, decode = {0, 0, 4, 10000}, mixed = {10, 0, 2, 100};
    /* The linear layers take the longer of the floor (weights read once) and the tokens' compute. */
    cr_assert_float_eq(km_engine_model_step_us(&cfg.model, &prefill), 100.0 * 1000, 1e-6);
    cr_assert_float_eq(km_engine_model_step_us(&cfg.model, &decode), 1000.0 + 200 + 640, 1e-6);
    cr_assert_float_eq(km_engine_model_step_us(&cfg.model, &mixed), 100.0 * 12 + 100 + 6.4, 1e-6);
    km_engine_step small = {5, 0, 0, 0};
    cr_assert_float_eq(km_engine_model_step_us(&cfg.model, &small), 1000.0, 1e-6);
    km_engine_step pairs = {0, 1000, 0, 0};
    cfg.model.prefill_us_per_pair = 0.5;
    cr_assert_float_eq(km_engine_model_step_us(&cfg.model, &pairs), 1000.0 + 500, 1e-6);
    cfg.model.prefill_us_per_pair = 0.0;
    /* A chunk of c tokens after k attends to c * k + c * (c + 1) / 2 pairs; chunking a prompt
     * does not change its total. */
    cr_assert_eq(km_engine_model_chunk_pairs(0, 4), 10);
    cr_assert_eq(km_engine_model_chunk_pairs(6, 4), 34);
    cr_assert_eq(km_engine_model_chunk_pairs(0, 6) + km_engine_model_chunk_pairs(6, 4),
                 km_engine_model_chunk_pairs(0, 10));

    cfg.model.block_size = BS;
    cfg.model.capacity_blocks = 64;
    km_sim_engine *e;
    cr_assert_eq(km_sim_engine_create(&cfg, &e), KM_OK);
    cr_assert_eq(km_sim_engine_next_event_us(e), UINT64_MAX);
    uint32_t t[20];
    make_tokens(t, 20, 1, 20, 0);
    cr_assert_eq(km_sim_engine_submit(e, 7, t, 20, 3, 1000), KM_OK);
    cr_assert_eq(km_sim_engine_next_event_us(e), 1000);
    cr_assert_eq(km_sim_engine_advance(e, 1000), KM_OK);
    km_sim_completion c = next_completion(e);
    cr_assert_eq(c.kind, KM_SIM_ADMITTED);
    cr_assert_eq(c.time_us, 1000);
    cr_assert_eq(c.cached_tokens, 0);
    uint64_t t1 = 1000 + 100 * 20;
    cr_assert_eq(km_sim_engine_next_event_us(e), t1);
    cr_assert_eq(km_sim_engine_advance(e, UINT64_MAX - 1), KM_OK);
    c = next_completion(e);
    cr_assert_eq(c.kind, KM_SIM_FIRST_TOKEN);
    cr_assert_eq(c.time_us, t1);
    /* Two decode steps of one request with 21, then 22 tokens of context. */
    uint64_t t2 = t1 + (uint64_t)ceil(1000 + 50 + 0.064 * 21);
    uint64_t t3 = t2 + (uint64_t)ceil(1000 + 50 + 0.064 * 22);
    c = next_completion(e);
    cr_assert_eq(c.kind, KM_SIM_FINISHED);
    cr_assert_eq(c.time_us, t3, "finished at %" PRIu64 ", expected %" PRIu64, c.time_us, t3);
    cr_assert_eq(c.output_tokens, 3);
    cr_assert_eq(km_sim_engine_next_completion(e, &c), 0);
    cr_assert_eq(km_sim_engine_next_event_us(e), UINT64_MAX);
    /* The same prompt again hits the 4 cached blocks (20 tokens: 5 full blocks, 4 count). */
    cr_assert_eq(km_sim_engine_submit(e, 8, t, 20, 1, t3 + 5), KM_OK);
    cr_assert_eq(km_sim_engine_advance(e, t3 + 5), KM_OK);
    c = next_completion(e);
    cr_assert_eq(c.kind, KM_SIM_ADMITTED);
    cr_assert_eq(c.time_us, t3 + 5);
    cr_assert_eq(c.cached_tokens, 16);
    cr_assert_eq(c.held_blocks, 5);
    cr_assert_eq(km_sim_engine_advance(e, UINT64_MAX - 1), KM_OK);
    c = next_completion(e);
    cr_assert_eq(c.kind, KM_SIM_FIRST_TOKEN);
    cr_assert_eq(c.time_us, t3 + 5 + 1000);
    c = next_completion(e);
    cr_assert_eq(c.kind, KM_SIM_FINISHED);
    cr_assert_eq(c.time_us, t3 + 5 + 1000);
    cr_assert_eq(km_sim_engine_submit(e, 9, t, 20, 1, 0), KM_ERR_INVALID_ARGUMENT);
    km_sim_engine_destroy(e);
}

/* A known answer is cached as vLLM v1 caches generated tokens: each block it fills (the prompt's
 * partial last block first) when the decode step completing it is scheduled, its BlockStored when
 * that step ends, chained after the prompt; the tokens past the known answer are never cached; and
 * the next turn, which re-sends prompt and answer, hits them. */
Test(sim_engine, a_known_answer_is_cached_as_it_is_generated, .timeout = 10)
{
    km_sim_engine_config cfg;
    km_sim_engine_config_init(&cfg);
    fixed_time_model(&cfg);
    cfg.model.block_size = BS;
    cfg.model.capacity_blocks = 64;
    km_sim_engine *e;
    cr_assert_eq(km_sim_engine_create(&cfg, &e), KM_OK);
    /* 10 prompt tokens (2 full blocks and 2 tokens), 7 of the 9 output tokens known: blocks 2
     * (prompt 8-9, answer 0-1) and 3 (answer 2-5) fill; block 4 would need answer 6-9. */
    uint32_t t[24];
    make_tokens(t, 10, 1, 10, 0);
    for (uint32_t i = 0; i < 14; i++)
        t[10 + i] = 0x20000000u + i;
    uint64_t chains[6];
    chains_of(t, 24, chains);
    cr_assert_eq(km_sim_engine_submit_answered(e, 1, t, 10, 10, 9, 0), KM_ERR_INVALID_ARGUMENT);
    cr_assert_not_null(strstr(km_sim_engine_last_error(e), "answer"), "%s",
                       km_sim_engine_last_error(e));
    km_sim_engine_config one;
    km_sim_engine_config_init(&one);
    one.model.block_size = 1;
    km_sim_engine *e1;
    cr_assert_eq(km_sim_engine_create(&one, &e1), KM_OK);
    /* 2^32 + 1 one-token blocks: refused before the tokens (a short buffer here) are read. */
    cr_assert_eq(km_sim_engine_submit_answered(e1, 1, t, UINT32_MAX, 2, 2, 0), KM_ERR_TOO_LARGE);
    cr_assert_not_null(strstr(km_sim_engine_last_error(e1), "2^32 - 1 blocks"), "%s",
                       km_sim_engine_last_error(e1));
    km_sim_engine_destroy(e1);
    cr_assert_eq(km_sim_engine_submit_answered(e, 1, t, 10, 7, 9, 0), KM_OK);
    km_kv_decoder *dec = NULL;
    cr_assert_eq(km_kv_decoder_create(NULL, &dec), KM_OK);
    /* One step at a time. Step 1 is the prefill (blocks 0-1; its end gives the first token);
     * decode step j + 1 is scheduled with j tokens generated, 10 + j computed when it ends: block
     * 2 fills at j = 2 (step 3), block 3 at j = 6 (step 7); 9 steps in all. */
    uint32_t stored_at[6] = {0};
    km_sim_completion c;
    bool finished = false;
    uint32_t generated = 0;
    cr_assert_eq(km_sim_engine_advance(e, 0), KM_OK); /* starts step 1 */
    cr_assert_eq(next_completion(e).kind, KM_SIM_ADMITTED);
    for (uint32_t step = 1; !finished; step++) {
        uint64_t next = km_sim_engine_next_event_us(e);
        cr_assert_neq(next, UINT64_MAX, "step %u", step);
        cr_assert_eq(km_sim_engine_advance(e, next), KM_OK, "%s", km_sim_engine_last_error(e));
        km_sim_message m;
        while (km_sim_engine_take_message(e, &m)) {
            km_kv_batch b;
            cr_assert_eq(km_kv_decode_payload(dec, m.payload, m.payload_size, &b), KM_OK);
            for (uint32_t i = 0; i < b.n_events; i++) {
                const km_kv_event *ev = &b.events[i];
                for (uint32_t h = 0; ev->kind == KM_KV_EVENT_BLOCK_STORED &&
                                     h < ev->n_block_hashes; h++)
                    for (uint32_t k = 0; k < 6; k++)
                        if (ev->block_hashes[h] == km_sim_engine_engine_hash(e, chains[k]))
                            stored_at[k] = step;
            }
        }
        while (km_sim_engine_next_completion(e, &c)) {
            generated = c.output_tokens;
            finished |= c.kind == KM_SIM_FINISHED;
        }
        cr_assert(finished || step < 9, "finished after 9 steps");
    }
    cr_assert_eq(generated, 9);
    for (uint32_t k = 0; k < 4; k++)
        cr_assert(km_sim_engine_holds(e, chains[k]), "block %u cached", k);
    cr_assert_not(km_sim_engine_holds(e, chains[4]), "block 4's last tokens were never known");
    static const uint32_t want_step[6] = {1, 1, 3, 7, 0, 0};
    for (uint32_t k = 0; k < 6; k++)
        cr_assert_eq(stored_at[k], want_step[k], "block %u stored at step %u, expected %u", k,
                     stored_at[k], want_step[k]);
    km_sim_engine_stats st;
    km_sim_engine_get_stats(e, &st);
    cr_assert_eq(st.blocks_stored, 4);
    cr_assert_eq(st.duplicate_blocks, 0);
    /* The next turn: the prompt, the 7 answer tokens and 5 new ones hit the 4 blocks. */
    uint32_t next_turn[22];
    memcpy(next_turn, t, 17 * sizeof *next_turn);
    make_tokens(next_turn + 17, 5, 9, 0, 3);
    cr_assert_eq(km_sim_engine_submit(e, 2, next_turn, 22, 1, 1000000), KM_OK, "%s",
                 km_sim_engine_last_error(e));
    cr_assert_eq(km_sim_engine_advance(e, 1000000), KM_OK);
    c = next_completion(e);
    cr_assert_eq(c.kind, KM_SIM_ADMITTED);
    cr_assert_eq(c.held_blocks, 4);
    cr_assert_eq(c.cached_tokens, 16);
    km_kv_decoder_destroy(dec);
    km_sim_engine_destroy(e);
}

/* vLLM v1 registers a chunk's full blocks in its prefix cache when it allocates the chunk's slots,
 * before the forward pass: a request scheduled after it, in the same step or the next, hits them. */
Test(sim_engine, a_request_scheduled_after_another_hits_the_blocks_it_is_computing, .timeout = 10)
{
    for (int chunked = 0; chunked < 2; chunked++) {
        km_sim_engine_config cfg;
        km_sim_engine_config_init(&cfg);
        fixed_time_model(&cfg);
        cfg.model.block_size = BS;
        cfg.model.capacity_blocks = 64;
        cfg.model.max_num_batched_tokens = chunked ? 10 : 30;
        km_sim_engine *e;
        cr_assert_eq(km_sim_engine_create(&cfg, &e), KM_OK);
        uint32_t a[17], b[20];
        make_tokens(a, 17, 1, 16, 1);
        make_tokens(b, 20, 1, 16, 2);
        cr_assert_eq(km_sim_engine_submit(e, 1, a, 17, 1, 0), KM_OK);
        cr_assert_eq(km_sim_engine_submit(e, 2, b, 20, 1, 0), KM_OK);
        cr_assert_eq(km_sim_engine_advance(e, 0), KM_OK);
        km_sim_completion c = next_completion(e);
        cr_assert_eq(c.request_id, 1);
        cr_assert_eq(c.kind, KM_SIM_ADMITTED);
        cr_assert_eq(c.cached_tokens, 0);
        if (chunked) {
            /* Step 1 is request 1's first 10 tokens alone (the budget); step 2 its last 7, which
             * complete blocks 2 and 3, then request 2 with what is left of the budget. */
            cr_assert_eq(km_sim_engine_next_completion(e, &c), 0);
            cr_assert_eq(km_sim_engine_advance(e, km_sim_engine_next_event_us(e)), KM_OK);
        }
        c = next_completion(e);
        cr_assert_eq(c.request_id, 2);
        cr_assert_eq(c.kind, KM_SIM_ADMITTED);
        cr_assert_eq(c.cached_tokens, 16, "%s: request 2 hits all four shared blocks, not %u",
                     chunked ? "chunked" : "one step", c.cached_tokens);
        /* The ground truth is what has been computed and published: the step computing the
         * last shared blocks has not ended. */
        uint64_t chains[4];
        chains_of(a, 16, chains);
        cr_assert_eq(km_sim_engine_cached_depth(e, chains, 4), chunked ? 2 : 0);
        cr_assert_eq(km_sim_engine_advance(e, km_sim_engine_next_event_us(e)), KM_OK);
        cr_assert_eq(km_sim_engine_cached_depth(e, chains, 4), 4);
        cr_assert_eq(km_sim_engine_advance(e, UINT64_MAX - 1), KM_OK);
        km_sim_engine_stats st;
        km_sim_engine_get_stats(e, &st);
        cr_assert_eq(st.duplicate_blocks, 0, "nothing was computed twice");
        cr_assert_eq(st.blocks_stored, 4 + 1, "the shared four once, request 2's own block");
        cr_assert_eq(st.finished, 2);
        km_sim_engine_destroy(e);
    }
}

Test(sim_engine, scheduler_batches_and_queues, .timeout = 10)
{
    km_sim_engine_config cfg;
    km_sim_engine_config_init(&cfg);
    fixed_time_model(&cfg);
    cfg.model.block_size = BS;
    cfg.model.capacity_blocks = 12;
    cfg.model.max_num_seqs = 2;
    cfg.model.max_num_batched_tokens = 30;
    km_sim_engine *e;
    cr_assert_eq(km_sim_engine_create(&cfg, &e), KM_OK);
    uint32_t t[4][16];
    for (int i = 0; i < 4; i++)
        make_tokens(t[i], 16, (uint32_t)i + 1, 0, (uint32_t)i + 1);
    /* Each needs (16 + 4) / 4 = 5 blocks: two fit in 12, a third waits. */
    for (int i = 0; i < 3; i++)
        cr_assert_eq(km_sim_engine_submit(e, (uint64_t)i, t[i], 16, 4, 0), KM_OK);
    /* A request that can never fit is rejected when it reaches the head, not stuck. */
    uint32_t big[64] = {0};
    cr_assert_eq(km_sim_engine_submit(e, 99, big, 64, 1, 0), KM_OK);
    cr_assert_eq(km_sim_engine_advance(e, 0), KM_OK);
    /* The budget (30 tokens) takes request 0 whole and the first 14 tokens of request 1 (chunked
     * prefill); max_num_seqs (2) keeps request 2 waiting. */
    km_sim_completion c = next_completion(e);
    cr_assert_eq(c.request_id, 0);
    cr_assert_eq(c.kind, KM_SIM_ADMITTED);
    c = next_completion(e);
    cr_assert_eq(c.request_id, 1);
    cr_assert_eq(c.kind, KM_SIM_ADMITTED);
    cr_assert_eq(km_sim_engine_next_completion(e, &c), 0);
    uint64_t end1 = km_sim_engine_next_event_us(e);
    cr_assert_eq(end1, 100 * 30);
    cr_assert_eq(km_sim_engine_advance(e, end1), KM_OK);
    c = next_completion(e);
    cr_assert_eq(c.request_id, 0);
    cr_assert_eq(c.kind, KM_SIM_FIRST_TOKEN);
    cr_assert_eq(km_sim_engine_next_completion(e, &c), 0, "request 1 is still prefilling");
    km_sim_engine_stats st;
    km_sim_engine_get_stats(e, &st);
    /* Step 2 has started with request 1's last 2 tokens, so its fourth block is cached with its
     * first three (blocks are cached when the chunk completing them is scheduled), but only the
     * first three are published: the fourth's BlockStored goes out when step 2 ends. */
    cr_assert_eq(st.blocks_cached, 4 + 4);
    cr_assert_eq(st.blocks_stored, 4 + 3);
    cr_assert_eq(st.waiting, 2);
    cr_assert_eq(st.running, 2);
    /* Step 2: request 0 decodes (context 17), request 1 prefills its last 2 tokens. */
    uint64_t end2 = end1 + (uint64_t)ceil(1000 + 50 + 0.064 * 17);
    cr_assert_eq(km_sim_engine_next_event_us(e), end2);
    cr_assert_eq(km_sim_engine_advance(e, end2), KM_OK);
    c = next_completion(e);
    cr_assert_eq(c.request_id, 1);
    cr_assert_eq(c.kind, KM_SIM_FIRST_TOKEN);
    cr_assert_eq(c.time_us, end2);
    cr_assert(st.blocks_in_use <= cfg.model.capacity_blocks);
    /* Run everything. */
    cr_assert_eq(km_sim_engine_advance(e, UINT64_MAX - 1), KM_OK);
    int finished = 0, rejected = 0, admitted = 0;
    uint64_t last = 0;
    while (km_sim_engine_next_completion(e, &c)) {
        cr_assert(c.time_us >= last, "completions come in time order");
        last = c.time_us;
        finished += c.kind == KM_SIM_FINISHED;
        admitted += c.kind == KM_SIM_ADMITTED;
        if (c.kind == KM_SIM_REJECTED) {
            rejected++;
            cr_assert_eq(c.request_id, 99);
            cr_assert_eq(c.status, KM_ERR_TOO_LARGE);
        }
    }
    cr_assert_eq(finished, 3);
    cr_assert_eq(admitted, 1);
    cr_assert_eq(rejected, 1);
    km_sim_engine_get_stats(e, &st);
    cr_assert_eq(st.finished, 3);
    cr_assert_eq(st.blocks_in_use, 0);
    cr_assert_eq(st.waiting + st.running, 0);
    cr_assert(st.busy_us > 0 && st.steps >= 5);
    km_sim_engine_destroy(e);
}

/* ---- a random workload with prefix sharing ---------------------------------------------------- */

#define MAX_TOKENS 64u

typedef struct workload {
    uint32_t tokens[MAX_TOKENS];
    uint32_t n;
} workload;

/* A prompt from a few families (shared system prompts), with a random tail; lengths cross block
 * boundaries, and exact block multiples (the full-prompt rule) are frequent. */
static void random_prompt(km_rng *r, workload *w)
{
    uint32_t family = km_rng_below(r, 4);
    uint32_t shared = km_rng_below(r, 6) * BS + (km_rng_percent(r, 20) ? km_rng_below(r, BS) : 0);
    uint32_t n = shared + km_rng_below(r, 5) * BS + (km_rng_percent(r, 50) ? 0 : km_rng_below(r, BS));
    if (n == 0)
        n = 1 + km_rng_below(r, 2 * BS);
    if (n > MAX_TOKENS)
        n = MAX_TOKENS;
    /* the tail is drawn from a small alphabet so different requests repeat it sometimes */
    uint32_t tail_family = km_rng_below(r, 6);
    for (uint32_t i = 0; i < n; i++)
        w->tokens[i] = i < shared ? family * 1000u + i : 50000u + tail_family * 1000u + i;
    w->n = n;
}

/* ---- the brute-force model ---------------------------------------------------------------------- */

typedef struct model_block {
    uint64_t chain;
    int cached;
    uint32_t ref;
} model_block;

typedef struct model_req {
    uint64_t id;
    workload w;
    uint64_t chains[MAX_TOKENS];
    uint32_t n_full, held, n_blocks;
    uint32_t blocks[MAX_TOKENS + 8];
    int prefilled;
} model_req;

typedef struct model_event {
    km_kv_event_kind kind;
    uint64_t hashes[MAX_TOKENS];
    uint32_t n;
    int has_parent;
    uint64_t parent;
    uint32_t tokens[MAX_TOKENS]; /* stored: the run's tokens */
} model_event;

typedef struct model {
    uint32_t cap;
    uint64_t seed;
    model_block *blocks;
    uint32_t *fq; /* free queue, head first */
    uint32_t n_fq;
    model_req reqs[64];
    uint32_t n_reqs;
    model_event events[256];
    uint32_t n_events;
} model;

static uint64_t model_eh(const model *m, uint64_t chain)
{
    return XXH3_64bits_withSeed(&chain, sizeof chain, m->seed);
}

static void model_init(model *m, uint32_t cap, uint64_t seed)
{
    memset(m, 0, sizeof *m);
    m->cap = cap;
    m->seed = seed;
    m->blocks = calloc(cap, sizeof *m->blocks);
    m->fq = calloc(cap, sizeof *m->fq);
    for (uint32_t b = 0; b < cap; b++)
        m->fq[m->n_fq++] = b;
}

static void model_free(model *m)
{
    free(m->blocks);
    free(m->fq);
}

static int model_find(const model *m, uint64_t chain)
{
    for (uint32_t b = 0; b < m->cap; b++)
        if (m->blocks[b].cached && m->blocks[b].chain == chain)
            return (int)b;
    return -1;
}

static void model_fq_remove(model *m, uint32_t b)
{
    for (uint32_t i = 0; i < m->n_fq; i++)
        if (m->fq[i] == b) {
            memmove(&m->fq[i], &m->fq[i + 1], (m->n_fq - i - 1) * sizeof *m->fq);
            m->n_fq--;
            return;
        }
    cr_assert_fail("block %u not in the model's free queue", b);
}

static int model_admit(model *m, uint64_t id, const workload *w, uint32_t reserve,
                       km_sim_admission *a)
{
    model_req *r = &m->reqs[m->n_reqs];
    memset(r, 0, sizeof *r);
    r->id = id;
    r->w = *w;
    r->n_full = w->n / BS;
    chains_of(w->tokens, w->n, r->chains);
    uint32_t held = 0;
    while (held < r->n_full && model_find(m, r->chains[held]) >= 0)
        held++;
    memset(a, 0, sizeof *a);
    a->prompt_tokens = w->n;
    a->full_blocks = r->n_full;
    a->held_blocks = held;
    a->hit_blocks = held < (w->n - 1) / BS ? held : (w->n - 1) / BS;
    a->cached_tokens = a->hit_blocks * BS;
    a->uncached_tokens = w->n - a->cached_tokens;
    uint32_t total = (w->n + reserve + BS - 1) / BS;
    if (total > m->cap)
        return KM_ERR_TOO_LARGE;
    uint32_t held_free = 0;
    for (uint32_t k = 0; k < held; k++)
        held_free += m->blocks[model_find(m, r->chains[k])].ref == 0;
    if (total - held > m->n_fq - held_free)
        return KM_ERR_OVERLOADED;
    for (uint32_t k = 0; k < held; k++) {
        uint32_t b = (uint32_t)model_find(m, r->chains[k]);
        if (m->blocks[b].ref++ == 0)
            model_fq_remove(m, b);
        r->blocks[k] = b;
    }
    for (uint32_t k = held; k < total; k++) {
        uint32_t b = m->fq[0];
        model_fq_remove(m, b);
        if (m->blocks[b].cached) {
            model_event *ev = &m->events[m->n_events++];
            memset(ev, 0, sizeof *ev);
            ev->kind = KM_KV_EVENT_BLOCK_REMOVED;
            ev->hashes[0] = model_eh(m, m->blocks[b].chain);
            ev->n = 1;
            m->blocks[b].cached = 0;
            a->evicted_blocks++;
        }
        m->blocks[b].ref = 1;
        r->blocks[k] = b;
    }
    a->new_blocks = total - held;
    r->held = held;
    r->n_blocks = total;
    m->n_reqs++;
    return KM_OK;
}

static void model_complete(model *m, model_req *r)
{
    model_event *run = NULL;
    for (uint32_t k = r->held; k < r->n_full; k++) {
        if (model_find(m, r->chains[k]) >= 0) {
            run = NULL;
            continue;
        }
        m->blocks[r->blocks[k]].cached = 1;
        m->blocks[r->blocks[k]].chain = r->chains[k];
        if (!run) {
            run = &m->events[m->n_events++];
            memset(run, 0, sizeof *run);
            run->kind = KM_KV_EVENT_BLOCK_STORED;
            run->has_parent = k > 0;
            run->parent = k > 0 ? model_eh(m, r->chains[k - 1]) : 0;
        }
        memcpy(run->tokens + run->n * BS, r->w.tokens + k * BS, BS * sizeof(uint32_t));
        run->hashes[run->n++] = model_eh(m, r->chains[k]);
    }
    r->prefilled = 1;
}

static void model_finish(model *m, uint32_t i)
{
    model_req *r = &m->reqs[i];
    for (uint32_t k = r->n_blocks; k-- > 0;)
        if (--m->blocks[r->blocks[k]].ref == 0)
            m->fq[m->n_fq++] = r->blocks[k];
    m->reqs[i] = m->reqs[--m->n_reqs];
}

/* The engine's message for this step must be exactly the model's events. */
static void check_events(model *m, km_sim_engine *e, km_kv_decoder *dec, uint64_t *seq)
{
    km_sim_message msg;
    if (m->n_events == 0) {
        KM_CHECK(km_sim_engine_take_message(e, &msg) == 0, "unexpected message");
        return;
    }
    km_kv_batch b = take_batch(e, dec, &msg);
    KM_CHECK(msg.seq == *seq, "seq %" PRIu64 ", expected %" PRIu64, msg.seq, *seq);
    (*seq)++;
    KM_CHECK(b.n_events == m->n_events, "%u events, model %u", b.n_events, m->n_events);
    cr_assert(b.has_data_parallel_rank && b.data_parallel_rank == 0);
    for (uint32_t i = 0; i < m->n_events; i++) {
        const km_kv_event *ev = &b.events[i];
        const model_event *me = &m->events[i];
        KM_CHECK(ev->kind == me->kind, "event %u kind %d, model %d", i, ev->kind, me->kind);
        KM_CHECK(ev->n_block_hashes == me->n, "event %u: %u hashes, model %u", i,
                 ev->n_block_hashes, me->n);
        for (uint32_t j = 0; j < me->n; j++)
            KM_CHECK(ev->block_hashes[j] == me->hashes[j], "event %u hash %u differs", i, j);
        if (me->kind == KM_KV_EVENT_BLOCK_STORED) {
            KM_CHECK(ev->has_parent_block_hash == (bool)me->has_parent, "event %u parent", i);
            if (me->has_parent)
                KM_CHECK(ev->parent_block_hash == me->parent, "event %u parent hash", i);
            KM_CHECK(ev->n_token_ids == me->n * BS, "event %u tokens", i);
            KM_CHECK(memcmp(ev->token_ids, me->tokens, me->n * BS * sizeof(uint32_t)) == 0,
                     "event %u token ids", i);
        }
    }
    m->n_events = 0;
}

static void check_state(const model *m, const km_sim_engine *e, const uint64_t *universe,
                        size_t n_universe, int full)
{
    km_sim_engine_stats st;
    km_sim_engine_get_stats(e, &st);
    uint32_t cached = 0, in_use = 0;
    for (uint32_t b = 0; b < m->cap; b++) {
        cached += m->blocks[b].cached != 0;
        in_use += m->blocks[b].ref > 0;
    }
    KM_CHECK(st.blocks_free == m->n_fq, "free %u, model %u", st.blocks_free, m->n_fq);
    KM_CHECK(st.blocks_cached == cached, "cached %u, model %u", st.blocks_cached, cached);
    KM_CHECK(st.blocks_in_use == in_use, "in use %u, model %u", st.blocks_in_use, in_use);
    KM_CHECK(st.blocks_free + st.blocks_in_use == m->cap, "capacity accounting");
    /* The same set of cached chains (the engine caches a chain at most once). */
    for (uint32_t b = 0; b < m->cap; b++)
        if (m->blocks[b].cached)
            KM_CHECK(km_sim_engine_holds(e, m->blocks[b].chain), "the engine lacks %016" PRIx64,
                     m->blocks[b].chain);
    /* And, now and then, every chain ever seen, through the depth query too. */
    if (!full)
        return;
    for (size_t i = 0; i < n_universe; i++)
        KM_CHECK(km_sim_engine_holds(e, universe[i]) == (model_find(m, universe[i]) >= 0),
                 "holds(%016" PRIx64 ") differs from the model", universe[i]);
    for (uint32_t i = 0; i < m->n_reqs; i++) {
        const model_req *r = &m->reqs[i];
        uint32_t depth = 0;
        while (depth < r->n_full && model_find(m, r->chains[depth]) >= 0)
            depth++;
        KM_CHECK(km_sim_engine_cached_depth(e, r->chains, r->n_full) == depth, "depth differs");
    }
}

Test(sim_engine, property_random_ops_match_brute_force_model, .timeout = 60)
{
    km_rng r;
    km_rng_init(&r, km_test_seed());
    km_kv_decoder *dec;
    cr_assert_eq(km_kv_decoder_create(NULL, &dec), KM_OK);
    for (int round = 0; round < 12; round++) {
        uint32_t cap = 8 + km_rng_below(&r, 40);
        uint64_t seed = km_rng_next(&r);
        km_sim_engine_config cfg;
        km_sim_engine_config_init(&cfg);
        cfg.model.block_size = BS;
        cfg.model.capacity_blocks = cap;
        cfg.process_seed = seed;
        km_sim_engine *e;
        cr_assert_eq(km_sim_engine_create(&cfg, &e), KM_OK);
        model m;
        model_init(&m, cap, seed);
        uint64_t *universe = malloc(4000 * MAX_TOKENS * sizeof *universe);
        size_t n_universe = 0;
        uint64_t next_id = 1, seq = 0;
        for (int op = 0; op < 300; op++) {
            uint32_t roll = km_rng_below(&r, 100);
            if (roll < 45 && m.n_reqs < 60) {
                workload w;
                random_prompt(&r, &w);
                uint32_t reserve = km_rng_percent(&r, 50) ? km_rng_below(&r, 3 * BS) : 0;
                km_sim_admission want, got;
                int want_rc = model_admit(&m, next_id, &w, reserve, &want);
                memset(&got, 0, sizeof got);
                int rc = km_sim_engine_admit(e, next_id, w.tokens, w.n, reserve, &got);
                KM_CHECK(rc == want_rc, "admit rc %d, model %d (%s)", rc, want_rc,
                         km_sim_engine_last_error(e));
                if (rc == KM_OK) {
                    KM_CHECK(memcmp(&got, &want, sizeof got) == 0,
                             "admission differs: held %u/%u hit %u/%u new %u/%u evicted %u/%u",
                             got.held_blocks, want.held_blocks, got.hit_blocks, want.hit_blocks,
                             got.new_blocks, want.new_blocks, got.evicted_blocks,
                             want.evicted_blocks);
                    for (uint32_t k = 0; k < w.n / BS; k++)
                        universe[n_universe++] = m.reqs[m.n_reqs - 1].chains[k];
                }
                next_id++;
            } else if (roll < 75 && m.n_reqs) {
                /* complete a random request that has not prefilled yet (if any) */
                uint32_t i = km_rng_below(&r, m.n_reqs);
                if (!m.reqs[i].prefilled) {
                    model_complete(&m, &m.reqs[i]);
                    KM_CHECK(km_sim_engine_complete_prefill(e, m.reqs[i].id, NULL) == KM_OK,
                             "%s", km_sim_engine_last_error(e));
                }
            } else if (m.n_reqs) {
                /* finish (or abort before its prefill) a random request */
                uint32_t i = km_rng_below(&r, m.n_reqs);
                uint64_t id = m.reqs[i].id;
                model_finish(&m, i);
                KM_CHECK(km_sim_engine_finish(e, id) == KM_OK, "%s", km_sim_engine_last_error(e));
            }
            if (km_rng_percent(&r, 40)) {
                cr_assert_eq(km_sim_engine_end_step(e, (uint64_t)op, NULL), KM_OK);
                check_events(&m, e, dec, &seq);
            }
            check_state(&m, e, universe, n_universe, op % 50 == 49);
        }
        cr_assert_eq(km_sim_engine_end_step(e, 1000, NULL), KM_OK);
        check_events(&m, e, dec, &seq);
        free(universe);
        model_free(&m);
        km_sim_engine_destroy(e);
    }
    km_kv_decoder_destroy(dec);
}

/* ---- the events, decoded and fed to a real feed ------------------------------------------------- */

typedef struct feed_fx {
    km_index *index;
    km_feed *feed;
    km_kv_decoder *dec;
    uint64_t now;
    uint64_t restarts_seen; /* the feed's restart count at the last exact check */
} feed_fx;

static void feed_fx_init(feed_fx *f)
{
    memset(f, 0, sizeof *f);
    f->index = km_test_make_index(4);
    km_feed_config cfg;
    km_test_feed_config(&cfg, BS);
    cfg.bootstrap_replay = false;
    cr_assert_eq(km_feed_create(f->index, &cfg, &f->feed), KM_OK);
    km_feed_worker_config wc = {0, "sim", false};
    cr_assert_eq(km_feed_add_worker(f->feed, &wc, 1), KM_OK);
    cr_assert_eq(km_kv_decoder_create(NULL, &f->dec), KM_OK);
    f->now = 10;
}

static void feed_fx_free(feed_fx *f)
{
    km_kv_decoder_destroy(f->dec);
    km_feed_destroy(f->feed);
    km_index_destroy(f->index);
}

/* Deliver every published message, then check the index holds exactly the engine's cache (the
 * caller makes sure no event is pending). */
static void feed_sync_and_check(feed_fx *f, km_sim_engine *e)
{
    km_sim_message m;
    while (km_sim_engine_take_message(e, &m)) {
        km_kv_batch b;
        int rc = km_kv_decode_payload(f->dec, m.payload, m.payload_size, &b);
        KM_CHECK(rc == KM_OK, "decode: %s", km_kv_decoder_last_error(f->dec));
        KM_CHECK(b.n_rejected == 0 && b.n_unknown_events == 0, "rejected events");
        rc = km_feed_live(f->feed, 0, m.seq, &b, f->now++);
        KM_CHECK(rc == KM_OK, "feed: %s", km_feed_last_error(f->feed));
    }
    KM_CHECK(km_feed_flush(f->feed, f->now++, NULL) == KM_OK, "flush: %s",
             km_feed_last_error(f->feed));
    km_sim_engine_stats es;
    km_sim_engine_get_stats(e, &es);
    if (es.restarts > 0 && es.messages == 0) {
        /* The engine restarted and its new process has published nothing yet (a step can store
         * no full block): nothing on the wire says so, and the index still holds the old
         * process's blocks until the new process's first message (seq 0) reaches the feed. The
         * feed must not have invented a restart meanwhile. (A seed that left a restart silent
         * through a check failed this test once, before this branch.) */
        km_feed_worker_info info;
        cr_assert_eq(km_feed_get_worker_info(f->feed, 0, &info), KM_OK);
        KM_CHECK(info.counters.restarts == f->restarts_seen, "a restart nobody published");
        return;
    }
    km_feed_worker_info before;
    cr_assert_eq(km_feed_get_worker_info(f->feed, 0, &before), KM_OK);
    f->restarts_seen = before.counters.restarts;
    size_t n;
    km_sim_engine_cached_chains(e, NULL, 0, &n);
    uint64_t *chains = malloc((n + 1) * sizeof *chains);
    km_sim_engine_cached_chains(e, chains, n, &n);
    char why[256];
    int ok = km_test_index_holds_exactly(f->index, 0, chains, n, why, sizeof why);
    free(chains);
    KM_CHECK(ok, "%s", why);
    km_feed_worker_info info;
    cr_assert_eq(km_feed_get_worker_info(f->feed, 0, &info), KM_OK);
    KM_CHECK(info.counters.unknown_parent_blocks == 0, "unknown parents");
    KM_CHECK(info.counters.unknown_removes == 0, "unknown removes");
    KM_CHECK(info.counters.lost == 0 && info.counters.gaps == 0, "gaps");
}

/* A request of the scheduler property test: its prompt, then its known answer. */
#define MAX_TURN_TOKENS 192u
typedef struct turn {
    uint32_t tokens[MAX_TURN_TOKENS];
    uint32_t n_prompt, n_answer;
    uint32_t answer_from; /* a next turn: where the answer it re-sends starts; 0 otherwise */
} turn;

static void scheduler_events_feed_an_exact_index_from(uint64_t seed)
{
    km_rng r;
    km_rng_init(&r, seed);
    uint32_t answer_hits = 0;
    for (int round = 0; round < 3; round++) {
        km_sim_engine_config cfg;
        km_sim_engine_config_init(&cfg);
        cfg.model.block_size = BS;
        cfg.model.capacity_blocks = 24 + km_rng_below(&r, 64);
        cfg.model.max_num_seqs = 1 + km_rng_below(&r, 8);
        cfg.model.max_num_batched_tokens = 16 + km_rng_below(&r, 64);
        cfg.process_seed = km_rng_next(&r);
        cfg.clear_on_restart = round == 2;
        km_sim_engine *e;
        cr_assert_eq(km_sim_engine_create(&cfg, &e), KM_OK);
        feed_fx f;
        feed_fx_init(&f);
        uint64_t now = 0;
        uint64_t id = 1;
        int steps_checked = 0;
        /* Requests with a known answer, kept by id once they finish: a later turn re-sends one
         * (its prompt, its answer, new tokens) and may hit the answer's blocks. */
        static turn turns[1 + 400 * 3];
        uint64_t finished_ids[64];
        uint32_t n_finished = 0;
        for (int i = 0; i < 400; i++) {
            /* arrivals: a few at a time, at random gaps */
            now += km_rng_below(&r, 20000);
            uint32_t arrivals = km_rng_below(&r, 3);
            for (uint32_t a = 0; a < arrivals; a++) {
                turn *q = &turns[id];
                q->n_prompt = q->answer_from = 0;
                uint32_t output = 1 + km_rng_below(&r, 3 * BS);
                if (n_finished && km_rng_percent(&r, 50)) {
                    /* the next turn of a finished one: what it sent and got, then new tokens */
                    const turn *before = &turns[finished_ids[km_rng_below(&r, n_finished)]];
                    q->answer_from = before->n_prompt;
                    q->n_prompt = before->n_prompt + before->n_answer;
                    memcpy(q->tokens, before->tokens, q->n_prompt * sizeof *q->tokens);
                    uint32_t add = 1 + km_rng_below(&r, 2 * BS);
                    if (q->n_prompt + add > MAX_TURN_TOKENS / 2)
                        q->n_prompt = q->answer_from = 0; /* too long: a fresh prompt */
                    for (uint32_t k = 0; q->n_prompt && k < add; k++)
                        q->tokens[q->n_prompt++] = 0x30000000u + (uint32_t)id * 64u + k;
                }
                if (q->n_prompt == 0) {
                    workload w;
                    random_prompt(&r, &w);
                    memcpy(q->tokens, w.tokens, w.n * sizeof *q->tokens);
                    q->n_prompt = w.n;
                }
                /* answers are unique to their request: no two requests compute the same one */
                q->n_answer = km_rng_percent(&r, 70) ? km_rng_below(&r, output + 1) : 0;
                for (uint32_t k = 0; k < q->n_answer; k++)
                    q->tokens[q->n_prompt + k] = 0x20000000u + (uint32_t)id * 64u + k;
                cr_assert_eq(km_sim_engine_submit_answered(e, id, q->tokens, q->n_prompt,
                                                           q->n_answer, output, now),
                             KM_OK, "%s", km_sim_engine_last_error(e));
                id++;
            }
            /* advance one engine step at a time, checking the index after each */
            for (;;) {
                uint64_t next = km_sim_engine_next_event_us(e);
                if (next > now)
                    break;
                uint64_t before;
                km_sim_engine_stats st;
                km_sim_engine_get_stats(e, &st);
                before = st.steps;
                cr_assert_eq(km_sim_engine_advance(e, next), KM_OK, "%s",
                             km_sim_engine_last_error(e));
                km_sim_engine_get_stats(e, &st);
                KM_CHECK(st.blocks_in_use <= cfg.model.capacity_blocks, "capacity");
                /* Evictions of a step that has just started are published when it ends (as in
                 * vLLM): compare when what was published describes the cache. */
                if (st.steps != before && km_sim_engine_pending_events(e) == 0) {
                    feed_sync_and_check(&f, e);
                    steps_checked++;
                }
            }
            if (i == 200 && round >= 1) {
                /* a restart: the new process's first message (seq 0) tells the feed */
                km_sim_completion c;
                while (km_sim_engine_next_completion(e, &c))
                    ;
                if (km_sim_engine_pending_events(e) == 0)
                    feed_sync_and_check(&f, e);
                cr_assert_eq(km_sim_engine_restart(e, km_rng_next(&r), now), KM_OK);
                if (cfg.clear_on_restart)
                    feed_sync_and_check(&f, e);
            }
            km_sim_completion c;
            while (km_sim_engine_next_completion(e, &c)) {
                KM_CHECK(c.kind != KM_SIM_REJECTED, "nothing here is too large");
                const turn *q = &turns[c.request_id];
                answer_hits += c.kind == KM_SIM_ADMITTED && q->answer_from &&
                               c.held_blocks * BS > q->answer_from;
                if (c.kind == KM_SIM_FINISHED && q->n_answer)
                    finished_ids[n_finished < 64 ? n_finished++ : km_rng_below(&r, 64)] =
                        c.request_id;
            }
        }
        cr_assert_eq(km_sim_engine_advance(e, UINT64_MAX - 1), KM_OK);
        feed_sync_and_check(&f, e);
        if (getenv("KM_SIM_DEBUG"))
            fprintf(stderr, "round %d: %d steps checked\n", round, steps_checked);
        cr_assert_gt(steps_checked, 50);
        km_sim_engine_stats st;
        km_sim_engine_get_stats(e, &st);
        cr_assert_gt(st.blocks_evicted, 0, "the run should exercise eviction");
        cr_assert_gt(st.hit_blocks, 0, "the run should exercise hits");
        /* A request gets budget only after every earlier request's whole prompt is scheduled,
         * whose blocks are cached then: it hits them rather than computing them again. */
        cr_assert_eq(st.duplicate_blocks, 0, "the step scheduler computed a cached block again");
        feed_fx_free(&f);
        km_sim_engine_destroy(e);
    }
    if (getenv("KM_SIM_DEBUG"))
        fprintf(stderr, "%u admissions hit an answer\n", answer_hits);
    cr_assert_gt(answer_hits, 0, "the run should exercise hits on answers");
}

Test(sim_engine, scheduler_events_feed_an_exact_index, .timeout = 60)
{
    scheduler_events_feed_an_exact_index_from(km_test_seed());
}

/* Through the cache operations alone (no step scheduler) requests admitted together compute the
 * same content twice, the later one keeping its copies private as duplicates, and the run it
 * stores after them names the cached copy as its parent. Random admissions, completions and
 * finishes on small caches, every step's events fed to a real feed: the index is the engine's
 * cache after each step, duplicates and evictions included. */
Test(sim_engine, cache_operations_with_duplicates_feed_an_exact_index, .timeout = 60)
{
    km_rng r;
    km_rng_init(&r, km_test_seed());
    uint64_t duplicates = 0, evicted = 0;
    for (int round = 0; round < 20; round++) {
        km_sim_engine *e = make_engine(12 + km_rng_below(&r, 24), km_rng_next(&r));
        feed_fx f;
        feed_fx_init(&f);
        uint64_t live[64], next_id = 1;
        uint32_t n_live = 0;
        for (int op = 0; op < 300; op++) {
            uint32_t roll = km_rng_below(&r, 100);
            if (roll < 50 && n_live < 64) {
                workload w;
                random_prompt(&r, &w);
                int rc = km_sim_engine_admit(e, next_id, w.tokens, w.n, 0, NULL);
                KM_CHECK(rc == KM_OK || rc == KM_ERR_OVERLOADED || rc == KM_ERR_TOO_LARGE, "%s",
                         km_sim_engine_last_error(e));
                if (rc == KM_OK)
                    live[n_live++] = next_id;
                next_id++;
            } else if (roll < 80 && n_live) {
                /* a prefill ends (an error for one that already ended: ignored) */
                (void)km_sim_engine_complete_prefill(e, live[km_rng_below(&r, n_live)], NULL);
            } else if (n_live) {
                uint32_t i = km_rng_below(&r, n_live);
                KM_CHECK(km_sim_engine_finish(e, live[i]) == KM_OK, "%s",
                         km_sim_engine_last_error(e));
                live[i] = live[--n_live];
            }
            if (km_rng_percent(&r, 40)) {
                cr_assert_eq(km_sim_engine_end_step(e, (uint64_t)op, NULL), KM_OK);
                feed_sync_and_check(&f, e);
            }
        }
        cr_assert_eq(km_sim_engine_end_step(e, 1000, NULL), KM_OK);
        feed_sync_and_check(&f, e);
        km_sim_engine_stats st;
        km_sim_engine_get_stats(e, &st);
        duplicates += st.duplicate_blocks;
        evicted += st.blocks_evicted;
        feed_fx_free(&f);
        km_sim_engine_destroy(e);
    }
    cr_assert_gt(duplicates, 0, "the runs should compute cached content again");
    cr_assert_gt(evicted, 0, "the runs should evict");
}

/* ---- determinism ------------------------------------------------------------------------------ */

typedef struct run_digest {
    uint64_t messages_hash, completions_hash;
    uint64_t n_messages, n_completions;
} run_digest;

static run_digest run_fixed_workload(uint64_t seed)
{
    km_rng r;
    km_rng_init(&r, seed);
    km_sim_engine_config cfg;
    km_sim_engine_config_init(&cfg);
    cfg.model.block_size = BS;
    cfg.model.capacity_blocks = 40;
    cfg.model.max_num_seqs = 4;
    km_sim_engine *e;
    cr_assert_eq(km_sim_engine_create(&cfg, &e), KM_OK);
    run_digest d = {0, 0, 0, 0};
    uint64_t now = 0;
    for (uint64_t id = 1; id <= 200; id++) {
        now += km_rng_below(&r, 15000);
        workload w;
        random_prompt(&r, &w);
        cr_assert_eq(km_sim_engine_submit(e, id, w.tokens, w.n, 1 + km_rng_below(&r, 8), now),
                     KM_OK);
        cr_assert_eq(km_sim_engine_advance(e, now), KM_OK);
        km_sim_message m;
        while (km_sim_engine_take_message(e, &m)) {
            d.messages_hash = XXH3_64bits_withSeed(m.payload, m.payload_size, d.messages_hash);
            d.messages_hash ^= m.seq * 31 + m.time_us;
            d.n_messages++;
        }
        km_sim_completion c;
        while (km_sim_engine_next_completion(e, &c)) {
            d.completions_hash = XXH3_64bits_withSeed(&c, sizeof c, d.completions_hash);
            d.n_completions++;
        }
    }
    km_sim_engine_destroy(e);
    return d;
}

Test(sim_engine, same_inputs_give_same_bytes, .timeout = 20)
{
    uint64_t seed = km_test_seed();
    run_digest a = run_fixed_workload(seed), b = run_fixed_workload(seed);
    KM_CHECK(a.n_messages > 10 && a.n_completions > 100, "workload too small");
    KM_CHECK(a.messages_hash == b.messages_hash && a.n_messages == b.n_messages,
             "messages differ between identical runs");
    KM_CHECK(a.completions_hash == b.completions_hash && a.n_completions == b.n_completions,
             "completions differ between identical runs");
}

/* ---- the step scheduler's invariants --------------------------------------------------------- */

/* One submitted request as the test tracks it from the completions. */
typedef struct sched_req {
    workload w;
    uint32_t output;
    uint64_t submit_us, admit_us;
    uint32_t cached;
    int state; /* 0 waiting, 1 admitted, 2 first token, 3 finished, 4 rejected */
} sched_req;

/* Random submissions at random times, the engine advanced from one event to the next as the
 * simulator does, with a step time of exactly one microsecond per scheduled token (P + D). After
 * every call: the blocks in use never exceed the capacity, fewer than max_num_seqs + 1 requests
 * run, every step's duration (its token count) is within the budget, completions come in time
 * order with each request's lifecycle in order, a running request's hit is held and published
 * once the step that admitted it ends, and its first token comes no sooner than its uncached
 * tokens take to compute. At the end the engine was busy exactly the uncached prompt tokens
 * plus one microsecond per decode step: each prompt token not hit is computed once. */
Test(sim_engine, scheduler_invariants_on_random_submissions, .timeout = 60)
{
    km_rng r;
    km_rng_init(&r, km_test_seed());
    enum { N = 300 };
    sched_req *reqs = calloc(N, sizeof *reqs);
    for (int round = 0; round < 6; round++) {
        km_sim_engine_config cfg;
        km_sim_engine_config_init(&cfg);
        cfg.model.block_size = BS;
        cfg.model.capacity_blocks = 24 + km_rng_below(&r, 40);
        cfg.model.max_num_seqs = 1 + km_rng_below(&r, 6);
        cfg.model.max_num_batched_tokens = 1 + km_rng_below(&r, 48);
        cfg.model.step_floor_us = 0;
        cfg.model.token_us = 1;
        cfg.model.prefill_us_per_pair = 0;
        cfg.model.decode_us_per_request = 0;
        cfg.model.decode_us_per_context_token = 0;
        cfg.process_seed = km_rng_next(&r);
        km_sim_engine *e;
        cr_assert_eq(km_sim_engine_create(&cfg, &e), KM_OK);
        memset(reqs, 0, N * sizeof *reqs);
        uint64_t now = 0, last_completion = 0, expected_busy = 0, arrival = 0;
        uint32_t mean_gap = 1 + km_rng_below(&r, 40);
        uint32_t next = 0, running = 0;
        uint32_t admitted_now[N];
        while (next < N || km_sim_engine_next_event_us(e) != UINT64_MAX) {
            uint64_t t_engine = km_sim_engine_next_event_us(e);
            if (next < N && arrival < t_engine) {
                /* the next arrival comes before the engine's next event (as the simulator
                 * orders them) */
                now = arrival;
                sched_req *q = &reqs[next];
                random_prompt(&r, &q->w);
                q->output = 1 + km_rng_below(&r, 6);
                q->submit_us = now;
                cr_assert_eq(km_sim_engine_submit(e, next, q->w.tokens, q->w.n, q->output, now),
                             KM_OK, "%s", km_sim_engine_last_error(e));
                next++;
                /* bursts, and gaps long enough for the engine to drain now and then */
                arrival += km_rng_percent(&r, 5) ? 300 + km_rng_below(&r, 300)
                                                 : km_rng_below(&r, mean_gap);
                continue;
            }
            now = t_engine;
            cr_assert_eq(km_sim_engine_advance(e, now), KM_OK, "%s", km_sim_engine_last_error(e));
            uint32_t n_admitted = 0;
            km_sim_completion c;
            while (km_sim_engine_next_completion(e, &c)) {
                KM_CHECK(c.time_us >= last_completion && c.time_us == now,
                         "completion at %" PRIu64 " after %" PRIu64 ", advanced to %" PRIu64,
                         c.time_us, last_completion, now);
                last_completion = c.time_us;
                cr_assert_lt(c.request_id, next);
                sched_req *q = &reqs[c.request_id];
                switch (c.kind) {
                case KM_SIM_ADMITTED:
                    KM_CHECK(q->state == 0 && c.time_us >= q->submit_us, "admitted twice or early");
                    KM_CHECK(c.cached_tokens % BS == 0 && c.cached_tokens < q->w.n,
                             "hit %u of a %u-token prompt", c.cached_tokens, q->w.n);
                    KM_CHECK(c.cached_tokens / BS <= c.held_blocks, "hit beyond what was held");
                    q->state = 1;
                    q->admit_us = c.time_us;
                    q->cached = c.cached_tokens;
                    admitted_now[n_admitted++] = (uint32_t)c.request_id;
                    running++;
                    expected_busy += q->w.n - q->cached + (q->output - 1);
                    break;
                case KM_SIM_FIRST_TOKEN:
                    KM_CHECK(q->state == 1, "first token of request %" PRIu64 " in state %d",
                             c.request_id, q->state);
                    /* Each step that prefills c of its tokens lasts at least c microseconds. */
                    KM_CHECK(c.time_us - q->admit_us >= q->w.n - q->cached,
                             "request %" PRIu64 ": first token %" PRIu64 " us after admission, "
                             "%u tokens to compute",
                             c.request_id, c.time_us - q->admit_us, q->w.n - q->cached);
                    q->state = 2;
                    break;
                case KM_SIM_FINISHED:
                    KM_CHECK(q->state == 2, "finished before its first token");
                    KM_CHECK(c.output_tokens == q->output, "%u tokens, asked %u",
                             c.output_tokens, q->output);
                    q->state = 3;
                    running--;
                    break;
                case KM_SIM_REJECTED:
                    KM_CHECK(q->state == 0, "rejected after admission");
                    KM_CHECK((q->w.n + q->output + BS - 1) / BS > cfg.model.capacity_blocks,
                             "a request that fits was rejected");
                    q->state = 4;
                    break;
                }
            }
            km_sim_engine_stats st;
            km_sim_engine_get_stats(e, &st);
            KM_CHECK(st.blocks_in_use <= cfg.model.capacity_blocks, "capacity exceeded");
            KM_CHECK(st.blocks_in_use + st.blocks_free == cfg.model.capacity_blocks,
                     "block accounting: %u in use, %u free", st.blocks_in_use, st.blocks_free);
            KM_CHECK(st.running == running && running <= cfg.model.max_num_seqs,
                     "%u running (completions say %u), max_num_seqs %u", st.running, running,
                     cfg.model.max_num_seqs);
            uint64_t end = km_sim_engine_next_event_us(e);
            if (end != UINT64_MAX && end > now)
                KM_CHECK(end - now <= cfg.model.max_num_batched_tokens,
                         "a step of %" PRIu64 " tokens, budget %u", end - now,
                         cfg.model.max_num_batched_tokens);
            /* The hits of the requests admitted in the step that has just started are held and
             * published once it ends, by those still running (a running request's blocks cannot
             * be evicted; the next step, started at once, may evict a finished one's). */
            if (n_admitted && end != UINT64_MAX) {
                cr_assert_eq(km_sim_engine_advance(e, end), KM_OK);
                now = end;
                while (km_sim_engine_next_completion(e, &c)) {
                    sched_req *q = &reqs[c.request_id];
                    last_completion = c.time_us;
                    if (c.kind == KM_SIM_ADMITTED) {
                        KM_CHECK(q->state == 0, "admitted twice");
                        q->state = 1;
                        q->admit_us = c.time_us;
                        q->cached = c.cached_tokens;
                        running++;
                        expected_busy += q->w.n - q->cached + (q->output - 1);
                    } else if (c.kind == KM_SIM_FIRST_TOKEN) {
                        KM_CHECK(q->state == 1 && c.time_us - q->admit_us >= q->w.n - q->cached,
                                 "first token too early");
                        q->state = 2;
                    } else if (c.kind == KM_SIM_FINISHED) {
                        KM_CHECK(q->state == 2, "finished before its first token");
                        q->state = 3;
                        running--;
                    } else {
                        q->state = 4;
                    }
                }
                for (uint32_t i = 0; i < n_admitted; i++) {
                    const sched_req *q = &reqs[admitted_now[i]];
                    if (q->state == 3)
                        continue;
                    uint64_t chains[MAX_TOKENS];
                    chains_of(q->w.tokens, q->w.n, chains);
                    KM_CHECK(km_sim_engine_cached_depth(e, chains, q->cached / BS) ==
                                 q->cached / BS,
                             "request %u hit %u blocks the engine does not hold",
                             admitted_now[i], q->cached / BS);
                }
            }
        }
        km_sim_engine_stats st;
        km_sim_engine_get_stats(e, &st);
        uint32_t finished = 0;
        for (uint32_t i = 0; i < N; i++) {
            KM_CHECK(reqs[i].state == 3 || reqs[i].state == 4, "request %u left in state %d", i,
                     reqs[i].state);
            finished += reqs[i].state == 3;
        }
        KM_CHECK(st.finished == finished && st.blocks_in_use == 0, "the engine is not drained");
        KM_CHECK(st.busy_us == expected_busy,
                 "busy %" PRIu64 " us, expected %" PRIu64 " (uncached prompts and decodes)",
                 st.busy_us, expected_busy);
        cr_assert_gt(st.hit_blocks, 0, "the run should exercise hits");
        km_sim_engine_destroy(e);
    }
    free(reqs);
}
