/* SPDX-License-Identifier: Apache-2.0 */
/* The event feed (include/kvmatch/feed.h) without sockets: payloads built by the test helper in
 * every encoding, decoded by the real decoder, handed to the feed with a synthetic clock. Covers
 * chain hashing (HASHING.md, LoRA, bytes vs int hashes, parents), removals and tiers, the
 * unknown-parent / block-size / extra-keys rules, an engine hash stored again in another medium
 * (its chain kept), and the stream checks: gaps filled by replay, replays that start late
 * (history lost, DEGRADED, both policies), restarts, restarts and late duplicates during replays,
 * buffer overflow, replay failure, live messages whose seq cannot be trusted, bootstrap and
 * resync, flush atomicity under the index's memory cap (and what a refused message still changes,
 * checked on random steps against the engines' truth), windows, and a randomized run against
 * the simulated engine's truth. Randomized tests print their seed (KM_TEST_SEED). */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <msgpack.h>

#include "events/feed_internal.h"
#include "kv_test_publisher.h"
#include "kvmatch/feed.h"
#include "kvmatch/hash.h"
#include "events/feed_internal.h"
#include "events/feed_flush_internal.h"
#include "test_util.h"

#define BS 4u /* block size of these tests */

/* ---- fixture --------------------------------------------------------------------------------- */

typedef struct fx {
    km_index *index;
    km_feed *feed;
    km_feed_config cfg;
    km_kv_decoder *dec;
    uint64_t now;
    km_test_engine engine;
    km_rng rng;
    km_test_batch batch;
    void **payloads; /* every message made, in order; seq = index - seq_base */
    size_t *sizes;
    size_t n, cap;
    size_t seq_base;
    km_update_stats applied; /* summed over fx_flush */
} fx;

static void fx_init_cfg(fx *f, const km_feed_config *cfg, km_test_encoding enc,
                        km_test_hash_form form)
{
    memset(f, 0, sizeof *f);
    f->index = km_test_make_index(16);
    if (cfg)
        f->cfg = *cfg;
    else
        km_test_feed_config(&f->cfg, BS);
    cr_assert_eq(km_feed_create(f->index, &f->cfg, &f->feed), KM_OK);
    cr_assert_eq(km_kv_decoder_create(NULL, &f->dec), KM_OK);
    f->now = 1000;
    km_test_engine_init(&f->engine, BS, 0x1234);
    km_rng_init(&f->rng, km_test_seed());
    km_test_batch_init(&f->batch, enc, form, 0);
}

static void fx_init(fx *f)
{
    fx_init_cfg(f, NULL, KM_TEST_ENCODING_POSITIONAL, KM_TEST_HASH_INT);
}

static void fx_free(fx *f)
{
    /* Every clear the feed queued named all the blocks the index held for its worker (the
     * engine-hash map's keys), so none had to scan the index's tables. */
    cr_assert_eq(f->applied.clear_scans, 0, "%llu clears scanned the tables (%llu pairs cleared)",
                 (unsigned long long)f->applied.clear_scans,
                 (unsigned long long)f->applied.cleared);
    for (size_t i = 0; i < f->n; i++)
        free(f->payloads[i]);
    free(f->payloads);
    free(f->sizes);
    km_test_batch_free(&f->batch);
    km_test_engine_free(&f->engine);
    km_kv_decoder_destroy(f->dec);
    km_feed_destroy(f->feed);
    km_index_destroy(f->index);
}

static void fx_add(fx *f, uint32_t w, bool has_replay)
{
    km_feed_worker_config wc = {w, "w", has_replay};
    int rc = km_feed_add_worker(f->feed, &wc, f->now++);
    cr_assert_eq(rc, KM_OK, "add_worker: %s", km_feed_last_error(f->feed));
}

/* Keep the current batch as the next message; returns its seq. */
static uint64_t fx_keep(fx *f)
{
    size_t size;
    const void *p = km_test_batch_payload(&f->batch, &size);
    if (f->n == f->cap) {
        f->cap = f->cap ? f->cap * 2 : 64;
        f->payloads = realloc(f->payloads, f->cap * sizeof *f->payloads);
        f->sizes = realloc(f->sizes, f->cap * sizeof *f->sizes);
    }
    f->payloads[f->n] = malloc(size);
    memcpy(f->payloads[f->n], p, size);
    f->sizes[f->n] = size;
    f->n++;
    km_test_batch_reset(&f->batch);
    return f->n - 1 - f->seq_base;
}

/* Make n random messages; returns the seq of the first. */
static uint64_t fx_make(fx *f, size_t n, uint32_t clear_percent)
{
    uint64_t first = f->n - f->seq_base;
    for (size_t i = 0; i < n; i++) {
        km_test_engine_step(&f->engine, &f->rng, &f->batch, 3, clear_percent);
        fx_keep(f);
    }
    return first;
}

static km_kv_batch fx_decode(fx *f, uint64_t seq)
{
    size_t i = f->seq_base + seq;
    cr_assert(i < f->n);
    km_kv_batch b;
    int rc = km_kv_decode_payload(f->dec, f->payloads[i], f->sizes[i], &b);
    cr_assert_eq(rc, KM_OK, "decode: %s", km_kv_decoder_last_error(f->dec));
    return b;
}

static void fx_live(fx *f, uint32_t w, uint64_t seq)
{
    km_kv_batch b = fx_decode(f, seq);
    cr_assert_eq(km_feed_live(f->feed, w, seq, &b, f->now++), KM_OK);
}

static void fx_live_range(fx *f, uint32_t w, uint64_t from, uint64_t to)
{
    for (uint64_t s = from; s < to; s++)
        fx_live(f, w, s);
}

static void fx_item(fx *f, uint32_t w, uint64_t req, uint64_t seq)
{
    km_kv_batch b = fx_decode(f, seq);
    cr_assert_eq(km_feed_replay_item(f->feed, w, req, seq, &b, f->now++), KM_OK);
}

static void fx_items(fx *f, uint32_t w, uint64_t req, uint64_t from, uint64_t to)
{
    for (uint64_t s = from; s < to; s++)
        fx_item(f, w, req, s);
}

static void fx_end(fx *f, uint32_t w, uint64_t req)
{
    cr_assert_eq(km_feed_replay_end(f->feed, w, req, f->now++), KM_OK);
}

static km_feed_action fx_action(fx *f, km_feed_action_kind kind)
{
    km_feed_action a;
    cr_assert_eq(km_feed_next_action(f->feed, &a), 1, "expected an action");
    cr_assert_eq(a.kind, kind, "action kind %d, expected %d", a.kind, kind);
    return a;
}

static void fx_no_action(fx *f)
{
    km_feed_action a;
    cr_assert_eq(km_feed_next_action(f->feed, &a), 0, "unexpected action kind %d start %" PRIu64,
                 a.kind, a.start_seq);
}

static km_feed_worker_info fx_info(fx *f, uint32_t w)
{
    km_feed_worker_info info;
    cr_assert_eq(km_feed_get_worker_info(f->feed, w, &info), KM_OK);
    return info;
}

static void fx_flush(fx *f)
{
    km_feed_flush_stats st;
    int rc = km_feed_flush(f->feed, f->now++, &st);
    cr_assert_eq(rc, KM_OK, "flush: %s", km_feed_last_error(f->feed));
    f->applied.cleared += st.index.cleared;
    f->applied.clear_scans += st.index.clear_scans;
}

/* The index holds exactly what the simulated engine caches. */
static void fx_check_truth(fx *f, uint32_t w)
{
    fx_flush(f);
    size_t n;
    uint64_t *chains = km_test_engine_chains(&f->engine, false, &n);
    char why[256];
    int ok = km_test_index_holds_exactly(f->index, w, chains, n, why, sizeof why);
    free(chains);
    KM_CHECK(ok, "%s", why);
}

static uint32_t fx_windows(fx *f, uint32_t w, km_feed_window *out, uint32_t cap)
{
    uint32_t n = 0;
    cr_assert_eq(km_feed_get_worker_windows(f->feed, w, out, cap, &n), KM_OK);
    return n;
}

/* ---- hashing --------------------------------------------------------------------------------- */

Test(feed, chain_hashes_follow_hashing_md, .timeout = 10)
{
    /* The same two stores in each encoding and hash form, each to its own worker. */
    km_test_encoding encs[2] = {KM_TEST_ENCODING_POSITIONAL, KM_TEST_ENCODING_MAP};
    km_test_hash_form forms[3] = {KM_TEST_HASH_INT, KM_TEST_HASH_BYTES32, KM_TEST_HASH_BYTES16};
    uint32_t tokens[5 * BS];
    for (uint32_t i = 0; i < 5 * BS; i++)
        tokens[i] = 1000 + i * 7;
    /* engine hashes: above 2^63 included */
    uint64_t ehash[5] = {UINT64_C(0xfedcba9876543210), 11, 12, UINT64_C(0x8000000000000001), 14};
    km_hash_config hc = {BS, NULL, NULL};
    uint64_t want[5];
    size_t nb;
    cr_assert_eq(km_hash_sequence(&hc, tokens, 5 * BS, 0, 0, NULL, want, &nb), KM_OK);

    fx f;
    fx_init(&f);
    uint32_t w = 0;
    for (int e = 0; e < 2; e++)
        for (int h = 0; h < 3; h++, w++) {
            km_test_batch b;
            km_test_batch_init(&b, encs[e], forms[h], 0);
            km_test_batch_stored(&b, ehash, 3, false, 0, tokens, BS, NULL, NULL);
            km_test_batch_stored(&b, ehash + 3, 2, true, ehash[2], tokens + 3 * BS, BS, NULL, NULL);
            size_t size;
            const void *p = km_test_batch_payload(&b, &size);
            km_kv_batch kb;
            cr_assert_eq(km_kv_decode_payload(f.dec, p, size, &kb), KM_OK);
            fx_add(&f, w, false);
            cr_assert_eq(km_feed_live(f.feed, w, 0, &kb, f.now++), KM_OK);
            km_test_batch_free(&b);
            fx_flush(&f);
            char why[256];
            cr_assert(km_test_index_holds_exactly(f.index, w, want, 5, why, sizeof why),
                      "encoding %d form %d: %s", e, h, why);
            km_feed_worker_info info = fx_info(&f, w);
            cr_assert_eq(info.state, KM_FEED_STATE_LIVE);
            cr_assert_eq(info.counters.blocks_stored, 5);
            cr_assert_eq(info.map_entries, 5);
            cr_assert_eq(info.counters.stored_by_medium[KM_KV_MEDIUM_GPU], 5);
        }
    /* Segment-key bookkeeping saw real parents: no orphan runs. A request of the 5 blocks scores
     * depth 5 on every worker. */
    km_match_results res;
    km_match_results_init(&res);
    km_request q = {want, 5};
    cr_assert_eq(km_index_match_batch(f.index, &q, 1, &res), KM_OK);
    cr_assert_eq(res.requests[0].count, 6);
    for (uint32_t i = 0; i < 6; i++)
        cr_assert_eq(res.matches[i].depth, 5);
    km_match_results_free(&res);
    fx_free(&f);
}

Test(feed, lora_name_and_lora_id_change_hashes, .timeout = 10)
{
    fx f;
    fx_init(&f);
    uint32_t tokens[2 * BS];
    for (uint32_t i = 0; i < 2 * BS; i++)
        tokens[i] = i + 1;
    uint64_t eh[2] = {100, 101};
    fx_add(&f, 0, false);
    fx_add(&f, 1, false);
    fx_add(&f, 2, false);
    km_test_batch_stored(&f.batch, eh, 2, false, 0, tokens, BS, "sql-adapter", NULL);
    uint64_t s = fx_keep(&f);
    fx_live(&f, 0, s);
    km_test_batch_stored(&f.batch, eh, 2, false, 0, tokens, BS, NULL, NULL);
    s = fx_keep(&f);
    fx_live(&f, 1, s);
    fx_flush(&f);

    uint64_t lora[2], base[2];
    size_t nb;
    km_hash_config hl = {BS, "sql-adapter", NULL}, hb = {BS, NULL, NULL};
    km_hash_sequence(&hl, tokens, 2 * BS, 0, 0, NULL, lora, &nb);
    km_hash_sequence(&hb, tokens, 2 * BS, 0, 0, NULL, base, &nb);
    char why[256];
    cr_assert(km_test_index_holds_exactly(f.index, 0, lora, 2, why, sizeof why), "%s", why);
    cr_assert(km_test_index_holds_exactly(f.index, 1, base, 2, why, sizeof why), "%s", why);
    cr_assert_neq(lora[0], base[0]);

    /* Only the deprecated lora_id: named "#lora_id=<n>", never the base model's hashes. */
    km_kv_event ev;
    memset(&ev, 0, sizeof ev);
    ev.kind = KM_KV_EVENT_BLOCK_STORED;
    ev.block_hashes = eh;
    ev.n_block_hashes = 2;
    ev.token_ids = tokens;
    ev.n_token_ids = 2 * BS;
    ev.block_size = BS;
    ev.has_lora_id = true;
    ev.lora_id = 7;
    km_kv_batch kb;
    memset(&kb, 0, sizeof kb);
    kb.events = &ev;
    kb.n_events = 1;
    kb.n_payload_events = 1;
    cr_assert_eq(km_feed_live(f.feed, 2, 0, &kb, f.now++), KM_OK);
    fx_flush(&f);
    uint64_t by_id[2];
    km_hash_config hi = {BS, "#lora_id=7", NULL};
    km_hash_sequence(&hi, tokens, 2 * BS, 0, 0, NULL, by_id, &nb);
    cr_assert(km_test_index_holds_exactly(f.index, 2, by_id, 2, why, sizeof why), "%s", why);
    fx_free(&f);
}

Test(feed, removes_clears_and_tiers, .timeout = 10)
{
    fx f;
    fx_init(&f);
    fx_add(&f, 3, false);
    uint32_t tokens[3 * BS];
    for (uint32_t i = 0; i < 3 * BS; i++)
        tokens[i] = 50 + i;
    uint64_t eh[3] = {7, 8, 9};
    uint64_t chain[3];
    size_t nb;
    km_hash_config hc = {BS, NULL, NULL};
    km_hash_sequence(&hc, tokens, 3 * BS, 0, 0, NULL, chain, &nb);

    /* Stored on GPU, then offloaded to CPU: removing the GPU copy keeps the block (held on CPU). */
    km_test_batch_stored(&f.batch, eh, 3, false, 0, tokens, BS, NULL, NULL);
    km_test_batch_stored(&f.batch, eh, 2, false, 0, tokens, BS, NULL, "CPU");
    km_test_batch_removed(&f.batch, eh, 3, NULL); /* GPU evicts all three */
    fx_live(&f, 3, fx_keep(&f));
    fx_flush(&f);
    char why[256];
    cr_assert(km_test_index_holds_exactly(f.index, 3, chain, 2, why, sizeof why), "%s", why);
    km_feed_worker_info info = fx_info(&f, 3);
    cr_assert_eq(info.counters.stored_by_medium[KM_KV_MEDIUM_CPU], 2);
    cr_assert_eq(info.counters.removed_by_medium[KM_KV_MEDIUM_GPU], 3);
    cr_assert_eq(info.counters.blocks_removed, 1);
    cr_assert_eq(info.map_entries, 2);

    /* CPU eviction of one; a remove of unknown hashes is counted. */
    uint64_t unknown[2] = {9999, 8};
    km_test_batch_removed(&f.batch, unknown, 2, "cpu");
    fx_live(&f, 3, fx_keep(&f));
    fx_flush(&f);
    cr_assert(km_test_index_holds_exactly(f.index, 3, chain, 1, why, sizeof why), "%s", why);
    info = fx_info(&f, 3);
    cr_assert_eq(info.counters.unknown_removes, 1);

    /* AllBlocksCleared drops everything, map included. */
    km_test_batch_cleared(&f.batch);
    fx_live(&f, 3, fx_keep(&f));
    fx_flush(&f);
    cr_assert(km_test_index_holds_exactly(f.index, 3, chain, 0, why, sizeof why), "%s", why);
    info = fx_info(&f, 3);
    cr_assert_eq(info.map_entries, 0);
    cr_assert_eq(info.counters.clears, 1);
    cr_assert_eq(info.counters.events, 5);
    cr_assert_eq(info.counters.messages, 3);
    fx_free(&f);
}

Test(feed, unknown_parent_and_block_size_mismatch_are_counted, .timeout = 10)
{
    fx f;
    fx_init(&f);
    fx_add(&f, 0, false);
    uint32_t tokens[4 * 8];
    for (uint32_t i = 0; i < 32; i++)
        tokens[i] = i;
    uint64_t eh[2] = {40, 41};
    km_test_batch_stored(&f.batch, eh, 2, true, 12345, tokens, BS, NULL, NULL); /* parent unknown */
    km_test_batch_stored(&f.batch, eh, 2, false, 0, tokens, 8, NULL, NULL);     /* wrong size */
    km_test_batch_stored(&f.batch, eh, 1, true, 41, tokens, BS, NULL, NULL);    /* 41 never stored */
    fx_live(&f, 0, fx_keep(&f));
    fx_flush(&f);
    km_feed_worker_info info = fx_info(&f, 0);
    cr_assert_eq(info.counters.unknown_parent_blocks, 3);
    cr_assert_eq(info.counters.block_size_mismatch, 1);
    cr_assert_eq(info.counters.blocks_stored, 0);
    cr_assert_eq(info.state, KM_FEED_STATE_LIVE, "an unknown parent does not degrade the worker");
    km_worker_stats ws;
    km_index_worker_stats(f.index, 0, &ws);
    cr_assert_eq(ws.blocks, 0);
    fx_free(&f);
}

/* Log lines the feed wrote, for the refusal tests. */
typedef struct log_capture {
    char lines[8][600];
    int n;
} log_capture;

static void capture_log(void *user, const char *line)
{
    log_capture *c = user;
    if (c->n < 8)
        snprintf(c->lines[c->n], sizeof c->lines[c->n], "%s", line);
    c->n++;
}

/* [ts, [["BlockStored", [1], null, <tokens> tokens, 4], ["FutureEvent", 1]], null]: a store whose
 * token count does not fit, and an unknown event type. */
static void pack_token_count_and_unknown_type(msgpack_sbuffer *sb, uint32_t tokens)
{
    msgpack_packer pk;
    msgpack_sbuffer_init(sb);
    msgpack_packer_init(&pk, sb, msgpack_sbuffer_write);
    msgpack_pack_array(&pk, 3);
    msgpack_pack_double(&pk, 1.0);
    msgpack_pack_array(&pk, 2);
    msgpack_pack_array(&pk, 5);
    msgpack_pack_str_with_body(&pk, "BlockStored", 11);
    msgpack_pack_array(&pk, 1);
    msgpack_pack_uint64(&pk, 1);
    msgpack_pack_nil(&pk);
    msgpack_pack_array(&pk, tokens);
    for (uint32_t i = 0; i < tokens; i++)
        msgpack_pack_uint32(&pk, i);
    msgpack_pack_uint32(&pk, BS);
    msgpack_pack_array(&pk, 2);
    msgpack_pack_str_with_body(&pk, "FutureEvent", 11);
    msgpack_pack_int(&pk, 1);
    msgpack_pack_nil(&pk);
}

Test(feed, refused_events_counted_by_reason_flagged_and_logged_at_a_bounded_rate, .timeout = 10)
{
    km_feed_config cfg;
    km_test_feed_config(&cfg, BS);
    log_capture logs = {.n = 0};
    cfg.log = capture_log;
    cfg.log_user = &logs;
    fx f;
    fx_init_cfg(&f, &cfg, KM_TEST_ENCODING_POSITIONAL, KM_TEST_HASH_INT);
    fx_add(&f, 0, false);
    fx_add(&f, 1, false);
    int base_lines = logs.n;
    uint32_t tokens[4 * 8];
    for (uint32_t i = 0; i < 32; i++)
        tokens[i] = i;
    uint64_t eh[2] = {40, 41};

    /* Worker 0 runs with block size 8: every store refused, the worker flagged. */
    for (int i = 0; i < 5; i++) {
        km_test_batch_stored(&f.batch, eh, 2, false, 0, tokens, 8, NULL, NULL);
        fx_live(&f, 0, fx_keep(&f));
    }
    km_feed_worker_info info = fx_info(&f, 0);
    cr_assert_eq(info.counters.refused[KM_FEED_REFUSED_BLOCK_SIZE], 5);
    cr_assert(info.config_refused);
    cr_assert_eq(info.state, KM_FEED_STATE_LIVE);
    /* One line for the first refusal, none for the next four (within the interval). */
    cr_assert_eq(logs.n, base_lines + 1, "%d lines", logs.n - base_lines);
    cr_assert(strstr(logs.lines[base_lines], "worker 0") &&
                  strstr(logs.lines[base_lines], "block_size_mismatch 1") &&
                  strstr(logs.lines[base_lines], "block_size 8, the pool's is 4"),
              "%s", logs.lines[base_lines]);
    /* After the interval the next refusal logs the ones counted meanwhile. */
    f.now += UINT64_C(11000000000);
    km_test_batch_stored(&f.batch, eh, 2, false, 0, tokens, 8, NULL, NULL);
    fx_live(&f, 0, fx_keep(&f));
    cr_assert_eq(logs.n, base_lines + 2);
    cr_assert(strstr(logs.lines[base_lines + 1], "block_size_mismatch 5"), "%s",
              logs.lines[base_lines + 1]);
    /* A store of the right size clears the flag. */
    km_test_batch_stored(&f.batch, eh, 1, false, 0, tokens, BS, NULL, NULL);
    fx_live(&f, 0, fx_keep(&f));
    info = fx_info(&f, 0);
    cr_assert_not(info.config_refused);
    cr_assert_eq(info.counters.blocks_stored, 1);

    /* Worker 1: one of each other reason; nothing reaches the index but the good store. */
    f.seq_base = f.n; /* worker 1's own stream from seq 0 */
    km_test_batch_stored(&f.batch, eh, 1, true, 999, tokens, BS, NULL, NULL);       /* parent */
    km_test_batch_stored(&f.batch, eh + 1, 1, false, 0, tokens, BS, NULL, "HBM3"); /* medium */
    fx_live(&f, 1, fx_keep(&f));
    msgpack_sbuffer sb;
    pack_token_count_and_unknown_type(&sb, BS + 1);
    km_kv_batch b;
    cr_assert_eq(km_kv_decode_payload(f.dec, sb.data, sb.size, &b), KM_OK);
    cr_assert_eq(b.n_rejected, 1);
    cr_assert_eq(b.rejected[0].reason, KM_KV_REJECTED_TOKEN_COUNT);
    cr_assert_eq(km_feed_live(f.feed, 1, 1, &b, f.now++), KM_OK);
    msgpack_sbuffer_destroy(&sb);
    cr_assert_eq(km_feed_live(f.feed, 1, 2, NULL, f.now++), KM_OK); /* undecodable */
    fx_flush(&f);
    info = fx_info(&f, 1);
    cr_assert_eq(info.counters.refused[KM_FEED_REFUSED_UNKNOWN_PARENT], 1);
    cr_assert_eq(info.counters.refused[KM_FEED_REFUSED_UNKNOWN_MEDIUM], 1);
    cr_assert_eq(info.counters.refused[KM_FEED_REFUSED_TOKEN_COUNT], 1);
    cr_assert_eq(info.counters.refused[KM_FEED_REFUSED_UNKNOWN_TYPE], 1);
    cr_assert_eq(info.counters.refused[KM_FEED_REFUSED_UNDECODABLE], 1);
    cr_assert_eq(info.counters.refused[KM_FEED_REFUSED_BLOCK_SIZE], 0);
    cr_assert_not(info.config_refused, "no store was refused for its configuration");
    cr_assert_eq(info.counters.blocks_stored, 1, "the unknown medium's store is applied");
    km_worker_stats ws;
    km_index_worker_stats(f.index, 1, &ws);
    cr_assert_eq(ws.blocks, 1);
    cr_assert_eq(info.counters.stored_by_medium[KM_KV_MEDIUM_OTHER], 1);
    /* Worker 1's first line named its first refusals; the rest wait for the interval. */
    cr_assert_eq(logs.n, base_lines + 3);
    cr_assert(strstr(logs.lines[base_lines + 2], "worker 1") &&
                  strstr(logs.lines[base_lines + 2], "unknown_parent 1") &&
                  strstr(logs.lines[base_lines + 2], "unknown_medium 1"),
              "%s", logs.lines[base_lines + 2]);
    cr_assert_str_eq(km_feed_refusal_name(KM_FEED_REFUSED_UNDECODABLE), "undecodable");
    cr_assert_str_eq(km_feed_refusal_name((km_feed_refusal)99), "unknown");
    fx_free(&f);
}

/* A batch holding one BlockStored as SGLang 0.5.23's encoder writes it: a tagged map with
 * parent_block_hash and lora_id always present, medium / cache_salt / session_id only when set,
 * no extra_keys. */
static void pack_sglang_stored(msgpack_sbuffer *sb, const uint64_t *hashes, uint32_t n,
                               bool has_parent, uint64_t parent, const uint32_t *tokens,
                               const char *medium, const char *salt)
{
    msgpack_packer pk;
    msgpack_sbuffer_init(sb);
    msgpack_packer_init(&pk, sb, msgpack_sbuffer_write);
    msgpack_pack_array(&pk, 3);
    msgpack_pack_double(&pk, 1.0);
    msgpack_pack_array(&pk, 1);
    msgpack_pack_map(&pk, 6 + (medium ? 1 : 0) + (salt ? 2 : 0));
    msgpack_pack_str_with_body(&pk, "type", 4);
    msgpack_pack_str_with_body(&pk, "BlockStored", 11);
    msgpack_pack_str_with_body(&pk, "block_hashes", 12);
    msgpack_pack_array(&pk, n);
    for (uint32_t i = 0; i < n; i++)
        msgpack_pack_uint64(&pk, hashes[i]);
    msgpack_pack_str_with_body(&pk, "parent_block_hash", 17);
    if (has_parent)
        msgpack_pack_uint64(&pk, parent);
    else
        msgpack_pack_nil(&pk);
    msgpack_pack_str_with_body(&pk, "token_ids", 9);
    msgpack_pack_array(&pk, n * BS);
    for (uint32_t i = 0; i < n * BS; i++)
        msgpack_pack_uint32(&pk, tokens[i]);
    msgpack_pack_str_with_body(&pk, "block_size", 10);
    msgpack_pack_uint32(&pk, BS);
    msgpack_pack_str_with_body(&pk, "lora_id", 7);
    msgpack_pack_nil(&pk);
    if (medium) {
        msgpack_pack_str_with_body(&pk, "medium", 6);
        msgpack_pack_str_with_body(&pk, medium, strlen(medium));
    }
    if (salt) {
        msgpack_pack_str_with_body(&pk, "cache_salt", 10);
        msgpack_pack_str_with_body(&pk, salt, strlen(salt));
        msgpack_pack_str_with_body(&pk, "session_id", 10);
        msgpack_pack_str_with_body(&pk, "sess-1", 6);
    }
    msgpack_pack_nil(&pk);
}

static void live_payload(fx *f, uint32_t w, uint64_t seq, msgpack_sbuffer *sb)
{
    km_kv_batch b;
    int rc = km_kv_decode_payload(f->dec, sb->data, sb->size, &b);
    cr_assert_eq(rc, KM_OK, "decode: %s", km_kv_decoder_last_error(f->dec));
    cr_assert_eq(b.n_rejected, 0, "%s", b.n_rejected ? b.rejected[0].message : "");
    cr_assert_eq(km_feed_live(f->feed, w, seq, &b, f->now++), KM_OK);
    msgpack_sbuffer_destroy(sb);
}

/* Deliver the test batch built so far as the message at seq. */
static void live_batch(fx *f, uint32_t w, uint64_t seq)
{
    size_t size;
    const void *p = km_test_batch_payload(&f->batch, &size);
    km_kv_batch b;
    cr_assert_eq(km_kv_decode_payload(f->dec, p, size, &b), KM_OK);
    cr_assert_eq(km_feed_live(f->feed, w, seq, &b, f->now++), KM_OK);
    km_test_batch_reset(&f->batch);
}

/* SGLang sends the salt as BlockStored's own cache_salt field, on every event of the request:
 * its blocks are indexed under the salted chain (a route without the salt does not match them),
 * and a continuation chains from the salted parent. */
Test(feed, sglang_cache_salt_field_names_the_salted_chain, .timeout = 10)
{
    fx f;
    fx_init(&f);
    fx_add(&f, 0, false);
    uint32_t tokens[4 * BS];
    for (uint32_t i = 0; i < 4 * BS; i++)
        tokens[i] = 500 + i;
    uint64_t eh[4] = {-5LL, 6, 7, 8}; /* SGLang's namespaced hashes are signed int64 */
    msgpack_sbuffer sb;
    pack_sglang_stored(&sb, eh, 2, false, 0, tokens, NULL, "tenant-a");
    live_payload(&f, 0, 0, &sb);
    pack_sglang_stored(&sb, eh + 2, 2, true, eh[1], tokens + 2 * BS, "GPU", "tenant-a");
    live_payload(&f, 0, 1, &sb);
    fx_flush(&f);
    km_hash_config salted = {BS, NULL, "tenant-a"}, plain = {BS, NULL, NULL};
    uint64_t want[4], unsalted[4];
    size_t nb;
    cr_assert_eq(km_hash_sequence(&salted, tokens, 4 * BS, 0, KM_NO_PARENT, NULL, want, &nb), KM_OK);
    cr_assert_eq(km_hash_sequence(&plain, tokens, 4 * BS, 0, KM_NO_PARENT, NULL, unsalted, &nb),
                 KM_OK);
    char why[256];
    cr_assert(km_test_index_holds_exactly(f.index, 0, want, 4, why, sizeof why), "%s", why);
    for (int i = 0; i < 4; i++)
        cr_assert_neq(want[i], unsalted[i], "a route without the salt must not match");
    fx_free(&f);
}

/* Media of SGLang's tiers and of vLLM's connectors map to tiers; EXTERNAL is a medium of its own,
 * so removing the DISK copy leaves the EXTERNAL one. */
Test(feed, engine_media_strings_map_to_media_and_tiers, .timeout = 10)
{
    fx f;
    fx_init(&f);
    fx_add(&f, 0, false);
    uint32_t tokens[2 * BS];
    for (uint32_t i = 0; i < 2 * BS; i++)
        tokens[i] = 70 + i;
    uint64_t eh[2] = {11, 12};
    km_hash_config plain = {BS, NULL, NULL};
    uint64_t chains[2];
    size_t nb;
    km_hash_sequence(&plain, tokens, 2 * BS, 0, KM_NO_PARENT, NULL, chains, &nb);
    msgpack_sbuffer sb;
    pack_sglang_stored(&sb, eh, 2, false, 0, tokens, "CPU_PINNED", NULL);
    live_payload(&f, 0, 0, &sb);
    pack_sglang_stored(&sb, eh, 2, false, 0, tokens, "EXTERNAL", NULL);
    live_payload(&f, 0, 1, &sb);
    pack_sglang_stored(&sb, eh, 2, false, 0, tokens, "STORAGE", NULL);
    live_payload(&f, 0, 2, &sb);
    fx_flush(&f);
    km_feed_worker_info info = fx_info(&f, 0);
    cr_assert_eq(info.counters.stored_by_medium[KM_KV_MEDIUM_CPU], 2);
    cr_assert_eq(info.counters.stored_by_medium[KM_KV_MEDIUM_EXTERNAL], 2);
    cr_assert_eq(info.counters.stored_by_medium[KM_KV_MEDIUM_DISK], 2);
    cr_assert_eq(info.counters.refused[KM_FEED_REFUSED_UNKNOWN_MEDIUM], 0);
    /* Host tier while the pinned copy is there. */
    km_match_results res;
    km_match_results_init(&res);
    km_request q = {chains, 2};
    cr_assert_eq(km_index_match_batch(f.index, &q, 1, &res), KM_OK);
    cr_assert_eq(res.matches[0].depth, 2);
    cr_assert_eq(res.tiers[0].host_blocks, 2);
    /* The host copy and the disk copy go; the external one still holds the blocks (disk tier). */
    km_test_batch_removed(&f.batch, eh, 2, "cpu_pinned");
    live_batch(&f, 0, 3);
    km_test_batch_removed(&f.batch, eh, 2, "DISK");
    live_batch(&f, 0, 4);
    fx_flush(&f);
    char why[256];
    cr_assert(km_test_index_holds_exactly(f.index, 0, chains, 2, why, sizeof why), "%s", why);
    cr_assert_eq(km_index_match_batch(f.index, &q, 1, &res), KM_OK);
    cr_assert_eq(res.tiers[0].disk_blocks, 2);
    km_test_batch_removed(&f.batch, eh, 2, "external");
    live_batch(&f, 0, 5);
    fx_flush(&f);
    cr_assert(km_test_index_holds_exactly(f.index, 0, chains, 0, why, sizeof why), "%s", why);
    km_match_results_free(&res);
    fx_free(&f);
}

/* A batch with one BlockStored as vLLM 0.33 encodes it under lookahead hashing (a tagged map with
 * lookahead_token_ids, L per block; lookahead NULL: the field is absent). */
static void pack_lookahead_stored(msgpack_sbuffer *sb, const uint64_t *hashes, uint32_t n,
                                  bool has_parent, uint64_t parent, const uint32_t *tokens,
                                  const uint32_t *lookahead, uint32_t l)
{
    msgpack_packer pk;
    msgpack_sbuffer_init(sb);
    msgpack_packer_init(&pk, sb, msgpack_sbuffer_write);
    msgpack_pack_array(&pk, 3);
    msgpack_pack_double(&pk, 1.0);
    msgpack_pack_array(&pk, 1);
    msgpack_pack_map(&pk, 8 + (lookahead ? 1 : 0));
    msgpack_pack_str_with_body(&pk, "type", 4);
    msgpack_pack_str_with_body(&pk, "BlockStored", 11);
    msgpack_pack_str_with_body(&pk, "block_hashes", 12);
    msgpack_pack_array(&pk, n);
    for (uint32_t i = 0; i < n; i++)
        msgpack_pack_uint64(&pk, hashes[i]);
    msgpack_pack_str_with_body(&pk, "parent_block_hash", 17);
    if (has_parent)
        msgpack_pack_uint64(&pk, parent);
    else
        msgpack_pack_nil(&pk);
    msgpack_pack_str_with_body(&pk, "token_ids", 9);
    msgpack_pack_array(&pk, n * BS);
    for (uint32_t i = 0; i < n * BS; i++)
        msgpack_pack_uint32(&pk, tokens[i]);
    msgpack_pack_str_with_body(&pk, "block_size", 10);
    msgpack_pack_uint32(&pk, BS);
    msgpack_pack_str_with_body(&pk, "lora_id", 7);
    msgpack_pack_nil(&pk);
    msgpack_pack_str_with_body(&pk, "medium", 6);
    msgpack_pack_str_with_body(&pk, "GPU", 3);
    msgpack_pack_str_with_body(&pk, "lora_name", 9);
    msgpack_pack_nil(&pk);
    if (lookahead) {
        msgpack_pack_str_with_body(&pk, "lookahead_token_ids", 19);
        msgpack_pack_array(&pk, n);
        for (uint32_t i = 0; i < n; i++) {
            msgpack_pack_array(&pk, l);
            for (uint32_t k = 0; k < l; k++)
                msgpack_pack_uint32(&pk, lookahead[i * l + k]);
        }
    }
    msgpack_pack_nil(&pk);
}

/* Depth of the leading chains of `chains` that worker w holds (a scan of the index). */
static uint32_t held_depth(km_index *index, uint32_t w, const uint64_t *chains, uint32_t n)
{
    km_match_results res;
    km_match_results_init(&res);
    km_request q = {chains, n};
    cr_assert_eq(km_index_match_batch(index, &q, 1, &res), KM_OK);
    uint32_t depth = 0;
    for (uint32_t j = 0; j < res.requests[0].count; j++)
        if (res.matches[res.requests[0].first + j].worker == w)
            depth = res.matches[res.requests[0].first + j].depth;
    km_match_results_free(&res);
    return depth;
}

/* vLLM's hit rule under lookahead hashing (EAGLE / MTP): a block counts for a request only when
 * its following L tokens match too; the same content stored under two lookahead variants is two
 * chains, so removing one leaves the other; stores without the pool's lookahead are refused. */
Test(feed, lookahead_hashing_follows_the_engines_hit_rule, .timeout = 10)
{
    km_feed_config cfg;
    km_test_feed_config(&cfg, BS);
    cfg.hash_lookahead_tokens = 1;
    fx f;
    fx_init_cfg(&f, &cfg, KM_TEST_ENCODING_POSITIONAL, KM_TEST_HASH_INT);
    fx_add(&f, 0, false);
    uint32_t t[3 * BS + 1];
    for (uint32_t i = 0; i < 3 * BS + 1; i++)
        t[i] = 40 + i;
    uint64_t eh[3] = {501, 502, 503};
    uint32_t la[3] = {t[BS], t[2 * BS], t[3 * BS]};
    msgpack_sbuffer sb;
    pack_lookahead_stored(&sb, eh, 3, false, 0, t, la, 1);
    live_payload(&f, 0, 0, &sb);
    fx_flush(&f);
    km_hash_config route = {BS, NULL, NULL};
    uint64_t want[3];
    size_t nb;
    cr_assert_eq(km_hash_sequence_lookahead(&route, 1, t, 3 * BS + 1, 0, KM_NO_PARENT, NULL, want,
                                            &nb),
                 KM_OK);
    cr_assert_eq(nb, 3);
    char why[256];
    cr_assert(km_test_index_holds_exactly(f.index, 0, want, 3, why, sizeof why), "%s", why);
    /* A prompt that diverges right after block 1's boundary: block 1's lookahead differs, so the
     * engine hits block 0 only, and so does the index. */
    uint32_t other[2 * BS + 1];
    memcpy(other, t, sizeof other);
    other[2 * BS] = 9999;
    uint64_t diverged[2];
    cr_assert_eq(km_hash_sequence_lookahead(&route, 1, other, 2 * BS + 1, 0, KM_NO_PARENT, NULL,
                                            diverged, &nb),
                 KM_OK);
    cr_assert_eq(held_depth(f.index, 0, diverged, 2), 1);
    /* The engine stores that variant of block 1 too (same tokens, another engine hash). */
    uint32_t la_other = 9999;
    pack_lookahead_stored(&sb, (uint64_t[]){602}, 1, true, eh[0], t + BS, &la_other, 1);
    live_payload(&f, 0, 1, &sb);
    fx_flush(&f);
    cr_assert_eq(held_depth(f.index, 0, diverged, 2), 2);
    /* Evicting the first variant leaves the second. */
    km_test_batch_removed(&f.batch, eh + 1, 2, NULL);
    live_batch(&f, 0, 2);
    fx_flush(&f);
    cr_assert_eq(held_depth(f.index, 0, diverged, 2), 2);
    cr_assert_eq(held_depth(f.index, 0, want, 3), 1);
    /* A store without lookahead tokens in this pool: refused, the worker flagged. */
    km_feed_worker_info info = fx_info(&f, 0);
    cr_assert_not(info.config_refused);
    pack_lookahead_stored(&sb, (uint64_t[]){700}, 1, false, 0, t, NULL, 0);
    live_payload(&f, 0, 3, &sb);
    info = fx_info(&f, 0);
    cr_assert_eq(info.counters.refused[KM_FEED_REFUSED_LOOKAHEAD], 1);
    cr_assert_not(info.config_refused, "earlier stores were applied");
    fx_free(&f);
}

/* One event of a hybrid model's KV-cache group, as vLLM 0.33 sends it (a map with group_idx). */
typedef struct group_event {
    bool removed;
    const uint64_t *hashes;
    uint32_t n_hashes;
    bool has_parent;
    uint64_t parent;
    const uint32_t *tokens; /* BlockStored: n_tokens of them */
    uint32_t n_tokens;
    uint32_t group;
    const char *medium;
    uint32_t window; /* BlockStored: > 0 adds kind "sliding_window" with this window in tokens,
                      * GROUP_MAMBA kind "mamba" */
} group_event;
#define GROUP_MAMBA UINT32_MAX

static void pack_group_batch(msgpack_sbuffer *sb, const group_event *ev, uint32_t n_events)
{
    msgpack_packer pk;
    msgpack_sbuffer_init(sb);
    msgpack_packer_init(&pk, sb, msgpack_sbuffer_write);
    msgpack_pack_array(&pk, 3);
    msgpack_pack_double(&pk, 1.0);
    msgpack_pack_array(&pk, n_events);
    for (uint32_t k = 0; k < n_events; k++) {
        const group_event *e = &ev[k];
        msgpack_pack_map(&pk, e->removed                  ? 4
                              : e->window == GROUP_MAMBA ? 8
                              : e->window                ? 9
                                                         : 7);
        msgpack_pack_str_with_body(&pk, "type", 4);
        if (e->removed)
            msgpack_pack_str_with_body(&pk, "BlockRemoved", 12);
        else
            msgpack_pack_str_with_body(&pk, "BlockStored", 11);
        msgpack_pack_str_with_body(&pk, "block_hashes", 12);
        msgpack_pack_array(&pk, e->n_hashes);
        for (uint32_t i = 0; i < e->n_hashes; i++)
            msgpack_pack_uint64(&pk, e->hashes[i]);
        msgpack_pack_str_with_body(&pk, "medium", 6);
        msgpack_pack_str_with_body(&pk, e->medium ? e->medium : "GPU",
                                   strlen(e->medium ? e->medium : "GPU"));
        msgpack_pack_str_with_body(&pk, "group_idx", 9);
        msgpack_pack_uint32(&pk, e->group);
        if (e->removed)
            continue;
        msgpack_pack_str_with_body(&pk, "parent_block_hash", 17);
        if (e->has_parent)
            msgpack_pack_uint64(&pk, e->parent);
        else
            msgpack_pack_nil(&pk);
        msgpack_pack_str_with_body(&pk, "token_ids", 9);
        msgpack_pack_array(&pk, e->n_tokens);
        for (uint32_t i = 0; i < e->n_tokens; i++)
            msgpack_pack_uint32(&pk, e->tokens[i]);
        msgpack_pack_str_with_body(&pk, "block_size", 10);
        msgpack_pack_uint32(&pk, BS);
        if (e->window == GROUP_MAMBA) {
            msgpack_pack_str_with_body(&pk, "kv_cache_spec_kind", 18);
            msgpack_pack_str_with_body(&pk, "mamba", 5);
        } else if (e->window) {
            msgpack_pack_str_with_body(&pk, "kv_cache_spec_kind", 18);
            msgpack_pack_str_with_body(&pk, "sliding_window", 14);
            msgpack_pack_str_with_body(&pk, "kv_cache_spec_sliding_window", 28);
            msgpack_pack_uint32(&pk, e->window);
        }
    }
    msgpack_pack_nil(&pk);
}

/* Hybrid models: a block counts (is in the index) only while every KV-cache group of the engine
 * holds it, so the predicted depth never exceeds the engine's hit (vLLM's HybridKVCacheCoordinator
 * needs every group to serve the prefix) and equals it while the groups hold the same blocks. A
 * group's removal takes the block out although another group keeps it; a group seen for the
 * first time (here Mamba, whose store names some blocks of a range) stops every block it does not
 * hold from counting; a group index from 31 up is refused and no GPU block counts any more. */
Test(feed, hybrid_model_blocks_count_only_while_every_group_holds_them, .timeout = 10)
{
    fx f;
    fx_init(&f);
    fx_add(&f, 0, false);
    uint32_t t[4 * BS];
    for (uint32_t i = 0; i < 4 * BS; i++)
        t[i] = 70 + i;
    uint64_t eh[4] = {801, 802, 803, 804}, want[4];
    km_hash_config route = {BS, NULL, NULL};
    size_t nb;
    cr_assert_eq(km_hash_sequence(&route, t, 4 * BS, 0, KM_NO_PARENT, NULL, want, &nb), KM_OK);
    char why[256];
    msgpack_sbuffer sb;

    /* Full attention (group 0) stores 4 blocks: alone, they count. */
    group_event fa = {false, eh, 4, false, 0, t, 4 * BS, 0, NULL, 0};
    pack_group_batch(&sb, &fa, 1);
    live_payload(&f, 0, 0, &sb);
    fx_flush(&f);
    cr_assert_eq(held_depth(f.index, 0, want, 4), 4);
    /* A sliding-window group (1) appears and stores blocks 2..3 only: 0..1 stop counting. */
    group_event swa = {false, eh + 2, 2, true, eh[1], t + 2 * BS, 2 * BS, 1, NULL, 0};
    pack_group_batch(&sb, &swa, 1);
    live_payload(&f, 0, 1, &sb);
    fx_flush(&f);
    cr_assert_eq(held_depth(f.index, 0, want, 4), 0);
    cr_assert(km_test_index_holds_exactly(f.index, 0, want + 2, 2, why, sizeof why), "%s", why);
    /* It stores blocks 0..1 too: every group holds all four. */
    group_event swa01 = {false, eh, 2, false, 0, t, 2 * BS, 1, NULL, 0};
    pack_group_batch(&sb, &swa01, 1);
    live_payload(&f, 0, 2, &sb);
    fx_flush(&f);
    cr_assert_eq(held_depth(f.index, 0, want, 4), 4);
    /* The window's group lets block 1 go: the prefix stops before it, full attention keeps it. */
    group_event swa_rm = {true, eh + 1, 1, false, 0, NULL, 0, 1, NULL, 0};
    pack_group_batch(&sb, &swa_rm, 1);
    live_payload(&f, 0, 3, &sb);
    fx_flush(&f);
    cr_assert_eq(held_depth(f.index, 0, want, 4), 1);
    cr_assert_eq(fx_info(&f, 0).map_entries, 4);
    /* Stored again by that group: all four count again. Full attention then lets block 3 go. */
    group_event again[2] = {{false, eh + 1, 1, true, eh[0], t + BS, BS, 1, NULL, 0},
                            {true, eh + 3, 1, false, 0, NULL, 0, 0, NULL, 0}};
    pack_group_batch(&sb, again, 2);
    live_payload(&f, 0, 4, &sb);
    fx_flush(&f);
    cr_assert_eq(held_depth(f.index, 0, want, 4), 3);
    /* A Mamba group (2) appears, keeping the state of block 2 only (token_ids of blocks 0..2):
     * no block is held by all three groups, so none counts; its store is skipped and counted. */
    group_event mamba = {false, eh + 2, 1, false, 0, t, 3 * BS, 2, NULL, 0};
    pack_group_batch(&sb, &mamba, 1);
    live_payload(&f, 0, 5, &sb);
    fx_flush(&f);
    cr_assert_eq(held_depth(f.index, 0, want, 4), 0);
    cr_assert(km_test_index_holds_exactly(f.index, 0, NULL, 0, why, sizeof why), "%s", why);
    km_feed_worker_info info = fx_info(&f, 0);
    cr_assert_eq(info.counters.refused[KM_FEED_REFUSED_PARTIAL_BLOCK], 1);
    /* A CPU copy (offloaded by a KV connector) counts as the whole block. */
    group_event cpu = {false, eh, 1, false, 0, t, BS, 0, "CPU", 0};
    pack_group_batch(&sb, &cpu, 1);
    live_payload(&f, 0, 6, &sb);
    fx_flush(&f);
    cr_assert_eq(held_depth(f.index, 0, want, 4), 1);
    /* A group index from 31 up: refused; GPU blocks never count again, the CPU copy still does. */
    uint64_t other = 901;
    group_event high = {false, &other, 1, false, 0, t, BS, 40, NULL, 0};
    pack_group_batch(&sb, &high, 1);
    live_payload(&f, 0, 7, &sb);
    fx_flush(&f);
    info = fx_info(&f, 0);
    cr_assert_eq(info.counters.refused[KM_FEED_REFUSED_INVALID_EVENT], 1);
    cr_assert(km_test_index_holds_exactly(f.index, 0, want, 1, why, sizeof why), "%s", why);
    fx_free(&f);
}

/* Second copies: a GPU store of a block a group holds is another copy (vLLM caches a recomputed
 * block again), and the block leaves the group with its last copy's removal, whether the copies
 * go in separate events or one event names the hash twice; the count survives a save and
 * restore. A group from KM_EMAP_COPY_GROUPS up counts no copies (the block leaves with the first
 * removal), and a CPU store again is no copy. */
Test(feed, a_block_leaves_a_group_with_its_last_copy, .timeout = 10)
{
    fx f;
    fx_init(&f);
    fx_add(&f, 0, false);
    uint32_t t[BS];
    for (uint32_t i = 0; i < BS; i++)
        t[i] = 300 + i;
    uint64_t eh = 4242, want;
    km_hash_config route = {BS, NULL, NULL};
    size_t nb;
    cr_assert_eq(km_hash_sequence(&route, t, BS, 0, KM_NO_PARENT, NULL, &want, &nb), KM_OK);
    msgpack_sbuffer sb;
    uint64_t seq = 0;
    /* Three copies in group 0 (one event storing it twice, then a third). */
    group_event store = {false, &eh, 1, false, 0, t, BS, 0, NULL, 0};
    group_event two[2] = {store, store};
    pack_group_batch(&sb, two, 2);
    live_payload(&f, 0, seq++, &sb);
    pack_group_batch(&sb, &store, 1);
    live_payload(&f, 0, seq++, &sb);
    fx_flush(&f);
    cr_assert_eq(held_depth(f.index, 0, &want, 1), 1);
    /* One copy goes: two stay. */
    group_event drop = {true, &eh, 1, false, 0, NULL, 0, 0, NULL, 0};
    pack_group_batch(&sb, &drop, 1);
    live_payload(&f, 0, seq++, &sb);
    fx_flush(&f);
    cr_assert_eq(held_depth(f.index, 0, &want, 1), 1, "two copies stay");
    /* Saved and restored: the count comes back with the feed's state. */
    char dir[64], path[96];
    snprintf(dir, sizeof dir, "/tmp/kvmatch-copies-XXXXXX");
    cr_assert(mkdtemp(dir) != NULL);
    snprintf(path, sizeof path, "%s/snap", dir);
    cr_assert_eq(km_feed_save(f.feed, path, f.now++), KM_OK, "%s", km_feed_last_error(f.feed));
    km_index *index = km_test_make_index(16);
    km_feed *feed = NULL;
    cr_assert_eq(km_feed_create(index, &f.cfg, &feed), KM_OK);
    cr_assert_eq(km_feed_restore(feed, path, f.now++), KM_OK, "%s", km_feed_last_error(feed));
    remove(path);
    rmdir(dir);
    km_feed_worker_config wc = {0, "w", false};
    cr_assert_eq(km_feed_add_worker(feed, &wc, f.now++), KM_OK);
    /* One event names the hash once: one copy stays; then twice more than held: gone. */
    km_kv_decoder *dec;
    cr_assert_eq(km_kv_decoder_create(NULL, &dec), KM_OK);
    km_kv_batch b;
    pack_group_batch(&sb, &drop, 1);
    cr_assert_eq(km_kv_decode_payload(dec, sb.data, sb.size, &b), KM_OK);
    cr_assert_eq(km_feed_live(feed, 0, seq++, &b, f.now++), KM_OK);
    msgpack_sbuffer_destroy(&sb);
    cr_assert_eq(km_feed_flush(feed, f.now++, NULL), KM_OK);
    cr_assert_eq(held_depth(index, 0, &want, 1), 1, "the last copy stays after the restore");
    group_event twice[2] = {drop, drop};
    pack_group_batch(&sb, twice, 2);
    cr_assert_eq(km_kv_decode_payload(dec, sb.data, sb.size, &b), KM_OK);
    cr_assert_eq(km_feed_live(feed, 0, seq++, &b, f.now++), KM_OK);
    msgpack_sbuffer_destroy(&sb);
    cr_assert_eq(km_feed_flush(feed, f.now++, NULL), KM_OK);
    cr_assert_eq(held_depth(index, 0, &want, 1), 0, "the last copy went");
    km_feed_worker_info info;
    cr_assert_eq(km_feed_get_worker_info(feed, 0, &info), KM_OK);
    cr_assert_eq(info.counters.unknown_removes, 1, "the removal beyond the copies is unknown");
    km_kv_decoder_destroy(dec);
    km_feed_destroy(feed);
    km_index_destroy(index);

    /* Group 5 (no copies counted): two stores, one removal, and the block has left it. A CPU
     * store twice is two CPU announcements: the first CPU removal leaves it, the second takes
     * it. */
    uint64_t eh5 = 5151, want5;
    uint32_t t5[BS];
    for (uint32_t i = 0; i < BS; i++)
        t5[i] = 600 + i;
    cr_assert_eq(km_hash_sequence(&route, t5, BS, 0, KM_NO_PARENT, NULL, &want5, &nb), KM_OK);
    group_event g5[2] = {{false, &eh5, 1, false, 0, t5, BS, 5, NULL, 0},
                         {false, &eh5, 1, false, 0, t5, BS, 5, NULL, 0}};
    pack_group_batch(&sb, g5, 2);
    live_payload(&f, 0, seq++, &sb);
    group_event g5_rm = {true, &eh5, 1, false, 0, NULL, 0, 5, NULL, 0};
    pack_group_batch(&sb, &g5_rm, 1);
    live_payload(&f, 0, seq++, &sb);
    group_event cpu[2] = {{false, &eh5, 1, false, 0, t5, BS, 0, "CPU", 0},
                          {false, &eh5, 1, false, 0, t5, BS, 0, "CPU", 0}};
    pack_group_batch(&sb, cpu, 2);
    live_payload(&f, 0, seq++, &sb);
    fx_flush(&f);
    cr_assert_eq(held_depth(f.index, 0, &want5, 1), 1, "held on the CPU");
    group_event cpu_rm = {true, &eh5, 1, false, 0, NULL, 0, 0, "CPU", 0};
    pack_group_batch(&sb, &cpu_rm, 1);
    live_payload(&f, 0, seq++, &sb);
    fx_flush(&f);
    cr_assert_eq(held_depth(f.index, 0, &want5, 1), 1, "one CPU announcement stays");
    pack_group_batch(&sb, &cpu_rm, 1);
    live_payload(&f, 0, seq++, &sb);
    fx_flush(&f);
    cr_assert_eq(held_depth(f.index, 0, &want5, 1), 0, "the CPU's last announcement left");
    /* Only the group-0 block of the first part is left in the map: group 5's copy went with its
     * first removal. */
    cr_assert_eq(fx_info(&f, 0).map_entries, 1);
    fx_free(&f);
}

/* A full-attention group (0) and a sliding-window group (1) of a hybrid model, stored and evicted
 * at random, each on its own, against a multiset model of the engine's copies: a store of a block a
 * group holds is another copy of it there (as vLLM's BlockPool caches a recomputed block again),
 * a removal takes one copy (a BlockRemoved may name the same hash twice), and the group holds the
 * block while a copy is left. After every message the worker's depth for each of two sequences
 * (sharing 4 blocks), cut at every length, must be vLLM's hybrid hit computed by brute force from
 * what each group holds: the full-attention prefix d, then the largest e <= d at which the window
 * group holds the blocks [max(0, e - n), e), n = max(1, ceil((window - 1) / block size)). Then
 * the feed is saved and restored into a new index, whose answers must be the same. */
#define HY_BLOCKS 12u
#define HY_SHARED 4u
#define HY_NODES (HY_BLOCKS + HY_BLOCKS - HY_SHARED)

static uint32_t hy_node(uint32_t seq, uint32_t block)
{
    return seq == 0 || block < HY_SHARED ? block : HY_BLOCKS + block - HY_SHARED;
}

static uint32_t hy_oracle(uint32_t held[2][HY_NODES], uint32_t seq, uint32_t len, uint32_t n)
{
    uint32_t d = 0;
    while (d < len && held[0][hy_node(seq, d)])
        d++;
    for (uint32_t e = d;; e--) {
        bool ok = true;
        for (uint32_t i = e > n ? e - n : 0; i < e && ok; i++)
            ok = held[1][hy_node(seq, i)];
        if (ok) /* always at e == 0 */
            return e;
    }
}

static void hy_check(km_index *index, uint32_t held[2][HY_NODES], uint64_t chains[2][HY_BLOCKS],
                     uint32_t n, const char *when)
{
    for (uint32_t seq = 0; seq < 2; seq++)
        for (uint32_t len = 1; len <= HY_BLOCKS; len++) {
            uint32_t want = hy_oracle(held, seq, len, n);
            uint32_t got = held_depth(index, 0, chains[seq], len);
            cr_assert_eq(got, want, "%s: sequence %u cut at %u blocks (window of %u blocks): "
                         "depth %u, vLLM's rule gives %u", when, seq, len, n, got, want);
        }
}

/* Messages held while a replay is in flight are applied from copies: a hybrid model's copies keep
 * their groups' kinds, so when the bootstrap replay fails and the held messages are applied, a
 * sliding-window group is a window group, exactly as for a worker whose messages applied at once
 * (a window group that let the prefix's first blocks go leaves the whole prefix counting). */
Test(feed, held_hybrid_messages_keep_their_group_kinds, .timeout = 10)
{
    fx f;
    fx_init(&f);
    fx_add(&f, 0, true); /* asks for a bootstrap replay: its live messages are held */
    fx_add(&f, 1, false);
    km_feed_action a = fx_action(&f, KM_FEED_ACTION_REPLAY_REQUEST);
    uint32_t t[8 * BS];
    for (uint32_t i = 0; i < 8 * BS; i++)
        t[i] = 300 + i;
    uint64_t eh[8], want[8];
    for (uint32_t b = 0; b < 8; b++)
        eh[b] = 7000 + b;
    km_hash_config route = {BS, NULL, NULL};
    size_t nb;
    cr_assert_eq(km_hash_sequence(&route, t, 8 * BS, 0, KM_NO_PARENT, NULL, want, &nb), KM_OK);
    /* Full attention (group 0) and a window of two blocks (group 1) store all 8 blocks; then the
     * window's group lets blocks 0..5 go. */
    group_event stores[2] = {{false, eh, 8, false, 0, t, 8 * BS, 0, NULL, 0},
                             {false, eh, 8, false, 0, t, 8 * BS, 1, NULL, 2 * BS}};
    group_event slide = {true, eh, 6, false, 0, NULL, 0, 1, NULL, 0};
    msgpack_sbuffer sb;
    for (uint32_t w = 0; w < 2; w++) {
        pack_group_batch(&sb, stores, 2);
        live_payload(&f, w, 0, &sb);
        pack_group_batch(&sb, &slide, 1);
        live_payload(&f, w, 1, &sb);
    }
    fx_flush(&f);
    cr_assert_eq(held_depth(f.index, 1, want, 8), 8, "applied at once: the window rule");
    cr_assert_eq(held_depth(f.index, 0, want, 8), 0, "held while the replay is in flight");
    cr_assert_eq(km_feed_replay_failed(f.feed, 0, a.request_id, KM_FEED_REPLAY_TIMEOUT, f.now++),
                 KM_OK);
    fx_flush(&f);
    cr_assert_eq(held_depth(f.index, 0, want, 8), 8,
                 "applied from the held copies, the window group must still be one");
    fx_free(&f);
}

Test(feed, hybrid_sliding_window_depth_is_vllms_hit_on_random_group_events, .timeout = 60)
{
    km_rng r;
    km_rng_init(&r, km_test_seed());
    for (uint32_t round = 0; round < 6; round++) {
        fx f;
        fx_init(&f);
        fx_add(&f, 0, false);
        uint32_t window = 1 + km_rng_below(&r, 13); /* tokens */
        uint32_t n = window <= 1 ? 1 : (window - 1 + BS - 1) / BS;
        static uint32_t tokens[2][HY_BLOCKS * BS];
        uint64_t eh[2][HY_BLOCKS], chains[2][HY_BLOCKS];
        for (uint32_t seq = 0; seq < 2; seq++) {
            for (uint32_t i = 0; i < HY_BLOCKS * BS; i++)
                tokens[seq][i] = seq && i >= HY_SHARED * BS ? 5000 + i : 100 + i;
            for (uint32_t b = 0; b < HY_BLOCKS; b++)
                eh[seq][b] = 1000 + hy_node(seq, b);
            km_hash_config hc = {BS, NULL, NULL};
            size_t nb;
            cr_assert_eq(km_hash_sequence(&hc, tokens[seq], HY_BLOCKS * BS, 0, KM_NO_PARENT, NULL,
                                          chains[seq], &nb), KM_OK);
        }
        uint32_t held[2][HY_NODES] = {{0}}; /* copies per group and block */
        msgpack_sbuffer sb;
        /* Both groups store sequence 0 in the first message. */
        group_event first[2] = {
            {false, eh[0], HY_BLOCKS, false, 0, tokens[0], HY_BLOCKS * BS, 0, NULL, 0},
            {false, eh[0], HY_BLOCKS, false, 0, tokens[0], HY_BLOCKS * BS, 1, NULL, window}};
        pack_group_batch(&sb, first, 2);
        live_payload(&f, 0, 0, &sb);
        for (uint32_t b = 0; b < HY_BLOCKS; b++)
            held[0][b] = held[1][b] = 1;
        fx_flush(&f);
        hy_check(f.index, held, chains, n, "after the first message");
        for (uint64_t seq_no = 1; seq_no < 60; seq_no++) {
            group_event ev[3];
            uint64_t removed[3][2 * HY_NODES];
            uint32_t n_ev = 0;
            uint32_t next[2][HY_NODES];
            memcpy(next, held, sizeof next);
            for (uint32_t k = 1 + km_rng_below(&r, 3); k > 0; k--) {
                uint32_t g = km_rng_below(&r, 2), s = km_rng_below(&r, 2);
                if (km_rng_percent(&r, 50)) {
                    uint32_t a = km_rng_below(&r, HY_BLOCKS);
                    uint32_t b = a + 1 + km_rng_below(&r, HY_BLOCKS - a);
                    /* A store's parent is a block the engine holds (in some group). */
                    if (a && !next[0][hy_node(s, a - 1)] && !next[1][hy_node(s, a - 1)])
                        continue;
                    ev[n_ev++] = (group_event){false, eh[s] + a, b - a, a > 0,
                                               a ? eh[s][a - 1] : 0, tokens[s] + a * BS,
                                               (b - a) * BS, g, NULL, g ? window : 0};
                    for (uint32_t i = a; i < b; i++)
                        next[g][hy_node(s, i)]++;
                } else {
                    uint32_t m = 0;
                    for (uint32_t node = 0; node < HY_NODES; node++)
                        for (uint32_t twice = 0; twice < 2; twice++)
                            if (next[g][node] && km_rng_percent(&r, twice ? 20 : 30)) {
                                removed[n_ev][m++] = 1000 + node;
                                next[g][node]--;
                            }
                    if (m) {
                        ev[n_ev] = (group_event){true, removed[n_ev], m, false, 0, NULL, 0, g,
                                                 NULL, 0};
                        n_ev++;
                    }
                }
            }
            if (!n_ev)
                continue;
            pack_group_batch(&sb, ev, n_ev);
            live_payload(&f, 0, seq_no, &sb);
            memcpy(held, next, sizeof next);
            fx_flush(&f);
            char when[48];
            snprintf(when, sizeof when, "round %u, message %" PRIu64, round, seq_no);
            hy_check(f.index, held, chains, n, when);
        }
        /* Saved and restored: the window rule comes back with the feed's state. */
        char dir[64], path[96];
        snprintf(dir, sizeof dir, "/tmp/kvmatch-hybrid-XXXXXX");
        cr_assert(mkdtemp(dir) != NULL);
        snprintf(path, sizeof path, "%s/snap", dir);
        cr_assert_eq(km_feed_save(f.feed, path, f.now++), KM_OK, "%s", km_feed_last_error(f.feed));
        km_index *index = km_test_make_index(16);
        km_feed *feed = NULL;
        cr_assert_eq(km_feed_create(index, &f.cfg, &feed), KM_OK);
        cr_assert_eq(km_feed_restore(feed, path, f.now++), KM_OK, "%s", km_feed_last_error(feed));
        hy_check(index, held, chains, n, "restored");
        km_feed_destroy(feed);
        km_index_destroy(index);
        remove(path);
        rmdir(dir);
        /* Removed, and added again for an engine without groups: its rule went with it, so the
         * plain prefix is its depth. */
        cr_assert_eq(km_feed_remove_worker(f.feed, 0, f.now++), KM_OK);
        fx_flush(&f);
        fx_add(&f, 0, false);
        group_event plain = {false, eh[1], HY_BLOCKS, false, 0, tokens[1], HY_BLOCKS * BS, 0,
                             NULL, 0};
        pack_group_batch(&sb, &plain, 1);
        live_payload(&f, 0, 0, &sb);
        fx_flush(&f);
        cr_assert_eq(held_depth(f.index, 0, chains[1], HY_BLOCKS), HY_BLOCKS,
                     "a worker added again keeps the rule of the one removed");
        fx_free(&f);
    }
}

/* A Mamba group (kind "mamba") in align mode keeps states at some block boundaries and publishes
 * them as some blocks of a range (sparse_blocks). The feed places each by its engine hash where
 * another group stored the block, and the engine's hit is the last state at or below the
 * full-attention prefix (a window of one block); a state whose block is unknown is skipped and
 * counted. */
Test(feed, hybrid_mamba_states_are_placed_by_engine_hash, .timeout = 10)
{
    fx f;
    fx_init(&f);
    fx_add(&f, 0, false);
    uint32_t t[6 * BS];
    for (uint32_t i = 0; i < 6 * BS; i++)
        t[i] = 40 + i;
    uint64_t eh[6] = {701, 702, 703, 704, 705, 706}, want[6];
    km_hash_config route = {BS, NULL, NULL};
    size_t nb;
    cr_assert_eq(km_hash_sequence(&route, t, 6 * BS, 0, KM_NO_PARENT, NULL, want, &nb), KM_OK);
    msgpack_sbuffer sb;
    /* Full attention stores blocks 0..4; the Mamba group keeps the states after blocks 1 and 3
     * (token_ids of blocks 0..3, two hashes). */
    uint64_t kept[2] = {eh[1], eh[3]};
    group_event first[2] = {
        {false, eh, 5, false, 0, t, 5 * BS, 0, NULL, 0},
        {false, kept, 2, false, 0, t, 4 * BS, 1, NULL, GROUP_MAMBA}};
    pack_group_batch(&sb, first, 2);
    live_payload(&f, 0, 0, &sb);
    fx_flush(&f);
    cr_assert_eq(held_depth(f.index, 0, want, 5), 4, "the state after block 3 ends the hit");
    cr_assert_eq(held_depth(f.index, 0, want, 3), 2, "below block 3, the state after block 1");
    cr_assert_eq(held_depth(f.index, 0, want, 1), 0, "no state after block 0");
    cr_assert_eq(fx_info(&f, 0).counters.refused[KM_FEED_REFUSED_PARTIAL_BLOCK], 0);
    /* The state after block 3 is evicted; one after block 5 names a block no group stored. */
    uint64_t gone = eh[3], unknown = eh[5];
    group_event next[2] = {{true, &gone, 1, false, 0, NULL, 0, 1, NULL, 0},
                           {false, &unknown, 1, false, 0, t, 6 * BS, 1, NULL, GROUP_MAMBA}};
    pack_group_batch(&sb, next, 2);
    live_payload(&f, 0, 1, &sb);
    fx_flush(&f);
    cr_assert_eq(held_depth(f.index, 0, want, 6), 2);
    cr_assert_eq(fx_info(&f, 0).counters.refused[KM_FEED_REFUSED_PARTIAL_BLOCK], 1);
    /* Full attention lets block 1 go: the hit stops at its prefix of one block, with no state. */
    gone = eh[1];
    group_event fa_rm = {true, &gone, 1, false, 0, NULL, 0, 0, NULL, 0};
    pack_group_batch(&sb, &fa_rm, 1);
    live_payload(&f, 0, 2, &sb);
    fx_flush(&f);
    cr_assert_eq(held_depth(f.index, 0, want, 6), 0);
    fx_free(&f);
}

/* A feed state whose window groups are not among the engine's groups, or need 0 blocks, or are
 * cut short, is refused as corrupt, with the reason, and installs nothing. */
Test(feed, bad_window_groups_and_chains_in_a_feed_state_are_refused, .timeout = 10)
{
    fx f;
    fx_init(&f);
    fx_add(&f, 0, false);
    uint32_t t[2 * BS];
    for (uint32_t i = 0; i < 2 * BS; i++)
        t[i] = 90 + i;
    uint64_t eh[2] = {601, 602};
    msgpack_sbuffer sb;
    group_event both[2] = {{false, eh, 2, false, 0, t, 2 * BS, 0, NULL, 0},
                           {false, eh, 2, false, 0, t, 2 * BS, 3, NULL, 2 * BS}};
    pack_group_batch(&sb, both, 2);
    live_payload(&f, 0, 0, &sb);
    fx_flush(&f);
    unsigned char *state = NULL;
    size_t size = 0;
    cr_assert_eq(km_feed_export_state(f.feed, (void **)&state, &size), KM_OK);
    /* Worker 0's record: id, flags, two u16 lengths, the strings, three u64, gpu_groups, then
     * window_groups and one u32 block count for its window group (group 3: 2 blocks). */
    size_t at = 24 + 8, name_len = state[at] | state[at + 1] << 8,
           id_len = state[at + 2] | state[at + 3] << 8;
    size_t groups_at = at + 4 + name_len + id_len + 24, windows_at = groups_at + 4;
    cr_assert_eq(state[groups_at], (1u << 0) | (1u << 3), "gpu_groups");
    cr_assert_eq(state[windows_at], 1u << 3, "window_groups");
    cr_assert_eq(state[windows_at + 4], 2, "the window group's blocks");
    /* Each case's damage, below, and the reason the refusal must give. */
    static const char *const why[] = {"window groups outside", "a window group of 0 blocks",
                                      "truncated", "reserved value 1"};
    /* The first map entry follows the block count: u64 key, then u64 chain hash. */
    size_t chain_at = windows_at + 8 + 8;
    for (size_t c = 0; c < 4; c++) {
        unsigned char *bad = malloc(size);
        memcpy(bad, state, size);
        size_t bad_size = size;
        if (c == 0)
            bad[windows_at] |= 1u << 5; /* group 5: not one of the engine's */
        else if (c == 1)
            bad[windows_at + 4] = 0;
        else if (c == 2)
            bad_size = windows_at + 6; /* inside the block count */
        else { /* a chain hash of 1, the index's reserved value, would reach the index in the
                * updates that claiming the restored worker queues */
            memset(bad + chain_at, 0, 8);
            bad[chain_at] = 1;
        }
        km_index *index = km_test_make_index(16);
        km_feed *feed = NULL;
        cr_assert_eq(km_feed_create(index, &f.cfg, &feed), KM_OK);
        cr_assert_eq(km_feed_import_state(feed, bad, bad_size, 1), KM_ERR_CORRUPT, "case %zu", c);
        cr_assert(strstr(km_feed_last_error(feed), why[c]), "case %zu: %s", c,
                  km_feed_last_error(feed));
        uint32_t n_workers = 9;
        cr_assert_eq(km_feed_get_workers(feed, NULL, 0, &n_workers), KM_OK);
        cr_assert_eq(n_workers, 0, "case %zu: a refused state installed workers", c);
        km_feed_destroy(feed);
        km_index_destroy(index);
        free(bad);
    }
    free(state);
    fx_free(&f);
}

/* indexed_seq never runs ahead of the index: while a message's updates wait for the flush, it
 * stays where the last flush left it. */
Test(feed, indexed_seq_waits_for_the_flush, .timeout = 10)
{
    fx f;
    fx_init(&f);
    fx_add(&f, 0, false);
    fx_flush(&f);
    uint32_t tokens[2 * BS];
    for (uint32_t i = 0; i < 2 * BS; i++)
        tokens[i] = 3 + i;
    uint64_t eh[2] = {81, 82};
    km_test_batch_stored(&f.batch, eh, 1, false, 0, tokens, BS, NULL, NULL);
    uint64_t first = fx_keep(&f);
    km_test_batch_stored(&f.batch, eh + 1, 1, true, eh[0], tokens + BS, BS, NULL, NULL);
    fx_keep(&f);
    fx_live(&f, 0, first);
    km_feed_worker_info info = fx_info(&f, 0);
    cr_assert(info.has_expected_seq && info.expected_seq == first + 1);
    cr_assert_not(info.has_indexed_seq, "seq 0's blocks are not in the index yet");
    fx_flush(&f);
    info = fx_info(&f, 0);
    cr_assert(info.has_indexed_seq && info.indexed_seq == first + 1);
    fx_live(&f, 0, first + 1);
    info = fx_info(&f, 0);
    cr_assert_eq(info.expected_seq, first + 2);
    cr_assert_eq(info.indexed_seq, first + 1);
    fx_flush(&f);
    cr_assert_eq(fx_info(&f, 0).indexed_seq, first + 2);
    fx_free(&f);
}

/* A hybrid model's partial block (vLLM's cache_partial_block: one hash, group_idx, fewer tokens
 * than a block) is skipped and counted, and does not flag the worker as misconfigured. */
Test(feed, partial_blocks_of_hybrid_groups_are_skipped, .timeout = 10)
{
    fx f;
    fx_init(&f);
    fx_add(&f, 0, false);
    uint32_t tokens[BS] = {1, 2, 3, 4};
    uint64_t eh[1] = {91};
    km_kv_event ev;
    memset(&ev, 0, sizeof ev);
    ev.kind = KM_KV_EVENT_BLOCK_STORED;
    ev.block_hashes = eh;
    ev.n_block_hashes = 1;
    ev.token_ids = tokens;
    ev.n_token_ids = BS - 1;
    ev.block_size = BS - 1;
    ev.has_group_idx = true;
    ev.group_idx = 1;
    km_kv_batch kb;
    memset(&kb, 0, sizeof kb);
    kb.events = &ev;
    kb.n_events = 1;
    kb.n_payload_events = 1;
    cr_assert_eq(km_feed_live(f.feed, 0, 0, &kb, f.now++), KM_OK);
    fx_flush(&f);
    km_feed_worker_info info = fx_info(&f, 0);
    cr_assert_eq(info.counters.refused[KM_FEED_REFUSED_PARTIAL_BLOCK], 1);
    cr_assert_eq(info.counters.refused[KM_FEED_REFUSED_BLOCK_SIZE], 0);
    cr_assert_not(info.config_refused);
    cr_assert_eq(info.map_entries, 0);
    /* Without group_idx the same event is an engine of another block size. */
    ev.has_group_idx = false;
    cr_assert_eq(km_feed_live(f.feed, 0, 1, &kb, f.now++), KM_OK);
    info = fx_info(&f, 0);
    cr_assert_eq(info.counters.refused[KM_FEED_REFUSED_BLOCK_SIZE], 1);
    cr_assert(info.config_refused);
    fx_free(&f);
}

/* A BlockStored of n blocks (n * BS tokens) with extra_keys flags, built directly (the helper's
 * payloads carry none), and the one-event batch holding it. */
static km_kv_event stored_with_extra_keys(const uint64_t *eh, uint32_t n, const uint32_t *tokens,
                                          const uint8_t *present)
{
    km_kv_event ev;
    memset(&ev, 0, sizeof ev);
    ev.kind = KM_KV_EVENT_BLOCK_STORED;
    ev.block_hashes = eh;
    ev.n_block_hashes = n;
    ev.token_ids = tokens;
    ev.n_token_ids = n * BS;
    ev.block_size = BS;
    ev.extra_keys_present = present;
    return ev;
}

static km_kv_batch batch_of(const km_kv_event *ev)
{
    km_kv_batch kb;
    memset(&kb, 0, sizeof kb);
    kb.events = ev;
    kb.n_events = 1;
    return kb;
}

Test(feed, extra_keys_policy, .timeout = 10)
{
    uint32_t tokens[3 * BS];
    for (uint32_t i = 0; i < 3 * BS; i++)
        tokens[i] = 9 + i;
    uint64_t eh[3] = {70, 71, 72};
    uint8_t present[3] = {0, 1, 0}; /* block 1 carries an (unread) multimodal id or salt */
    km_kv_event ev = stored_with_extra_keys(eh, 3, tokens, present);
    km_kv_batch kb = batch_of(&ev);
    uint64_t chain[3];
    size_t nb;
    km_hash_config hc = {BS, NULL, NULL};
    km_hash_sequence(&hc, tokens, 3 * BS, 0, 0, NULL, chain, &nb);

    for (int policy = 0; policy < 2; policy++) {
        km_feed_config cfg;
        km_test_feed_config(&cfg, BS);
        cfg.extra_keys_policy = policy ? KM_FEED_EXTRA_KEYS_IGNORE : KM_FEED_EXTRA_KEYS_SKIP;
        fx f;
        fx_init_cfg(&f, &cfg, KM_TEST_ENCODING_POSITIONAL, KM_TEST_HASH_INT);
        fx_add(&f, 0, false);
        cr_assert_eq(km_feed_live(f.feed, 0, 0, &kb, f.now++), KM_OK);
        /* A child of the skipped block is skipped too (unhashable, not "unknown parent"). */
        km_kv_event child = ev;
        uint64_t ch[1] = {73};
        child.block_hashes = ch;
        child.n_block_hashes = 1;
        child.n_token_ids = BS;
        child.extra_keys_present = NULL;
        child.has_parent_block_hash = true;
        child.parent_block_hash = 72;
        km_kv_batch kc = kb;
        kc.events = &child;
        cr_assert_eq(km_feed_live(f.feed, 0, 1, &kc, f.now++), KM_OK);
        fx_flush(&f);
        km_feed_worker_info info = fx_info(&f, 0);
        char why[256];
        if (policy == 0) {
            cr_assert(km_test_index_holds_exactly(f.index, 0, chain, 1, why, sizeof why), "%s", why);
            cr_assert_eq(info.counters.unhashable_blocks, 3);
            /* Removing the unhashable blocks touches nothing in the index. */
            km_kv_event rm;
            memset(&rm, 0, sizeof rm);
            rm.kind = KM_KV_EVENT_BLOCK_REMOVED;
            rm.block_hashes = eh + 1;
            rm.n_block_hashes = 2;
            km_kv_batch kr = kb;
            kr.events = &rm;
            cr_assert_eq(km_feed_live(f.feed, 0, 2, &kr, f.now++), KM_OK);
            fx_flush(&f);
            info = fx_info(&f, 0);
            cr_assert_eq(info.map_entries, 2); /* 70 and 73 */
            cr_assert_eq(info.counters.blocks_removed, 0);
        } else {
            cr_assert_eq(info.counters.unhashable_blocks, 0);
            cr_assert_eq(info.counters.blocks_stored, 4);
        }
        fx_free(&f);
    }
}

/* A stream whose messages never reach the index (every block unhashable: an image in each
 * request's first block, skipped) keeps no record of the map entries they add for undoing an
 * index refusal: nothing the index could refuse was queued. */
Test(feed, messages_that_queue_nothing_leave_no_undo_record, .timeout = 10)
{
    km_feed_config cfg;
    km_test_feed_config(&cfg, BS);
    cfg.extra_keys_policy = KM_FEED_EXTRA_KEYS_SKIP;
    fx f;
    fx_init_cfg(&f, &cfg, KM_TEST_ENCODING_POSITIONAL, KM_TEST_HASH_INT);
    fx_add(&f, 0, false);
    uint32_t tokens[2 * BS];
    for (uint32_t i = 0; i < 2 * BS; i++)
        tokens[i] = 40 + i;
    uint8_t present[2] = {1, 0};
    for (uint64_t seq = 0; seq < 400; seq += 2) {
        uint64_t eh[2] = {100000 + seq, 200000 + seq};
        km_kv_event ev = stored_with_extra_keys(eh, 2, tokens, present);
        km_kv_batch kb = batch_of(&ev);
        cr_assert_eq(km_feed_live(f.feed, 0, seq, &kb, f.now++), KM_OK);
        km_kv_event rm;
        memset(&rm, 0, sizeof rm);
        rm.kind = KM_KV_EVENT_BLOCK_REMOVED;
        rm.block_hashes = eh;
        rm.n_block_hashes = 2;
        kb.events = &rm;
        cr_assert_eq(km_feed_live(f.feed, 0, seq + 1, &kb, f.now++), KM_OK);
        fx_flush(&f);
        cr_assert_eq(f.feed->new_key_count, 0, "after message %" PRIu64 ": %zu keys recorded",
                     seq + 1, f.feed->new_key_count);
    }
    km_feed_worker_info info = fx_info(&f, 0);
    cr_assert_eq(info.counters.unhashable_blocks, 400);
    cr_assert_eq(info.map_entries, 0);
    fx_free(&f);
}

/* ---- the same block stored again --------------------------------------------------------------- */

/* Worker w's match of one request: its depth, and how many of those blocks are host-resident. */
static uint32_t fx_match_depth(fx *f, uint32_t w, const uint64_t *chains, uint32_t n,
                               uint32_t *host_blocks)
{
    km_request rq = {chains, n};
    km_match_results res;
    km_match_results_init(&res);
    cr_assert_eq(km_index_match_batch(f->index, &rq, 1, &res), KM_OK);
    uint32_t depth = 0;
    *host_blocks = 0;
    for (uint32_t j = 0; j < res.requests[0].count; j++) {
        uint64_t m = res.requests[0].first + j;
        if (res.matches[m].worker == w) {
            depth = res.matches[m].depth;
            *host_blocks = res.tiers[m].host_blocks;
        }
    }
    km_match_results_free(&res);
    return depth;
}

/* vLLM's GPU BlockStored carries extra_keys (here the cache salt of the request's first block);
 * its CPU offloading connector announces the copy of the same engine hashes with extra_keys nil.
 * The second store is the same block on another medium: it keeps the chain the first store gave
 * it, a new block continuing it is chained from that, and removing the block from both media
 * leaves nothing behind in the index. */
Test(feed, a_block_stored_again_on_another_medium_keeps_its_chain, .timeout = 10)
{
    km_test_encoding encs[2] = {KM_TEST_ENCODING_POSITIONAL, KM_TEST_ENCODING_MAP};
    for (int c = 0; c < 2; c++) {
        fx f;
        fx_init_cfg(&f, NULL, encs[c], KM_TEST_HASH_INT);
        fx_add(&f, 0, false);
        uint32_t tokens[3 * BS];
        for (uint32_t i = 0; i < 3 * BS; i++)
            tokens[i] = 300 + i;
        km_hash_config salted = {BS, NULL, "tenant-42"}, plain = {BS, NULL, NULL};
        uint64_t want[3], unsalted[3];
        size_t nb;
        km_hash_sequence(&salted, tokens, 3 * BS, 0, KM_NO_PARENT, NULL, want, &nb);
        km_hash_sequence(&plain, tokens, 3 * BS, 0, KM_NO_PARENT, NULL, unsalted, &nb);
        uint64_t eh[3] = {0xabc, 0xabd, 0xabe};
        char why[256];
        uint32_t host;

        km_test_batch_stored_extra_keys(&f.batch, eh, 2, false, 0, tokens, BS, "GPU", "tenant-42",
                                        NULL);
        fx_live(&f, 0, fx_keep(&f));
        fx_flush(&f);
        cr_assert(km_test_index_holds_exactly(f.index, 0, want, 2, why, sizeof why), "%s", why);

        /* The CPU copy of both blocks, and a third block stored on CPU only, in one event. */
        km_test_batch_stored_extra_keys(&f.batch, eh, 3, false, 0, tokens, BS, "CPU", NULL, NULL);
        fx_live(&f, 0, fx_keep(&f));
        fx_flush(&f);
        cr_assert(km_test_index_holds_exactly(f.index, 0, want, 3, why, sizeof why),
                  "one pair per engine block, the salted chain continued: %s", why);
        cr_assert_eq(fx_match_depth(&f, 0, want, 3, &host), 3);
        cr_assert_eq(host, 1, "only the third block lives on CPU alone");
        cr_assert_eq(fx_match_depth(&f, 0, unsalted, 3, &host), 0,
                     "the CPU copy must not make the salted block match unsalted requests");
        cr_assert_eq(fx_info(&f, 0).map_entries, 3);

        /* GPU evicts its copies: all three are held on CPU. */
        km_test_batch_removed(&f.batch, eh, 2, "GPU");
        fx_live(&f, 0, fx_keep(&f));
        fx_flush(&f);
        cr_assert(km_test_index_holds_exactly(f.index, 0, want, 3, why, sizeof why), "%s", why);
        cr_assert_eq(fx_match_depth(&f, 0, want, 3, &host), 3);
        cr_assert_eq(host, 3);

        /* CPU evicts them too: the worker holds nothing, and neither does the index. */
        km_test_batch_removed(&f.batch, eh, 3, "CPU");
        fx_live(&f, 0, fx_keep(&f));
        fx_flush(&f);
        cr_assert(km_test_index_holds_exactly(f.index, 0, want, 0, why, sizeof why), "%s", why);
        km_feed_worker_info info = fx_info(&f, 0);
        cr_assert_eq(info.map_entries, 0);
        cr_assert_eq(info.counters.blocks_removed, 3);
        cr_assert_eq(info.counters.unknown_removes, 0);
        cr_assert_eq(info.state, KM_FEED_STATE_LIVE);
        fx_free(&f);
    }
}

/* ---- placeholder stores ---------------------------------------------------------------------- */

/* A placeholder store on CPU (block_size 0, no tokens, no parent: vLLM's OffloadingConnector by
 * default) of n engine hashes. */
static void fx_placeholder(fx *f, uint32_t w, const uint64_t *eh, uint32_t n, const char *medium)
{
    km_test_batch_stored_extra_keys(&f->batch, eh, n, false, 0, NULL, 0, medium, NULL, NULL);
    fx_live(f, w, fx_keep(f));
}

/* Whether the index holds chain for w, and at the host tier. */
static bool fx_held_at(fx *f, uint32_t w, uint64_t chain, bool *host)
{
    uint32_t host_blocks;
    bool held = fx_match_depth(f, w, &chain, 1, &host_blocks) == 1;
    *host = host_blocks == 1;
    return held;
}

/* Placeholders move blocks the map knows into the host tier, keep them resolvable after the GPU
 * copy goes, and are skipped and counted (never an error, the worker stays LIVE) for engine hashes
 * the map does not hold; the refusal log names the reason. */
Test(feed, placeholder_stores_place_known_blocks_and_count_unknown_ones, .timeout = 10)
{
    km_feed_config cfg;
    km_test_feed_config(&cfg, BS);
    log_capture logs = {.n = 0};
    cfg.log = capture_log;
    cfg.log_user = &logs;
    km_test_encoding encs[2] = {KM_TEST_ENCODING_POSITIONAL, KM_TEST_ENCODING_MAP};
    for (int c = 0; c < 2; c++) {
        logs.n = 0;
        fx f;
        fx_init_cfg(&f, &cfg, encs[c], KM_TEST_HASH_INT);
        fx_add(&f, 0, false);
        uint32_t tokens[3 * BS];
        for (uint32_t i = 0; i < 3 * BS; i++)
            tokens[i] = 500 + i;
        km_hash_config hc = {BS, NULL, NULL};
        uint64_t want[3];
        size_t nb;
        km_hash_sequence(&hc, tokens, 3 * BS, 0, KM_NO_PARENT, NULL, want, &nb);
        uint64_t eh[3] = {0x71, 0x72, 0x73}, unknown = 0x99;
        uint32_t host;
        char why[256];

        km_test_batch_stored(&f.batch, eh, 3, false, 0, tokens, BS, NULL, NULL);
        fx_live(&f, 0, fx_keep(&f));
        /* Blocks 0 and 1 offloaded; a placeholder of a hash never stored. */
        fx_placeholder(&f, 0, eh, 2, "CPU");
        fx_placeholder(&f, 0, &unknown, 1, "CPU");
        fx_flush(&f);
        cr_assert(km_test_index_holds_exactly(f.index, 0, want, 3, why, sizeof why), "%s", why);
        cr_assert_eq(fx_match_depth(&f, 0, want, 3, &host), 3);
        cr_assert_eq(host, 0, "the GPU copy is the faster one");
        km_feed_worker_info info = fx_info(&f, 0);
        cr_assert_eq(info.counters.refused[KM_FEED_REFUSED_UNPLACED_PLACEHOLDER], 1);
        cr_assert_eq(info.counters.stored_by_medium[KM_KV_MEDIUM_CPU], 2);
        cr_assert_eq(info.map_entries, 3, "an unplaced placeholder adds no entry");
        cr_assert_eq(info.state, KM_FEED_STATE_LIVE);
        cr_assert(!info.config_refused);
        cr_assert_str_eq(km_feed_refusal_name(KM_FEED_REFUSED_UNPLACED_PLACEHOLDER),
                         "unplaced_placeholder");
        bool logged = false;
        for (int i = 0; i < logs.n && i < 8; i++)
            logged |= strstr(logs.lines[i], "unplaced_placeholder 1") != NULL;
        cr_assert(logged, "the refusal log names the reason");

        /* The GPU evicts all three: the offloaded two stay, at the host tier; the third leaves
         * every medium, so a placeholder of it arriving now cannot be placed. */
        km_test_batch_removed(&f.batch, eh, 3, "GPU");
        fx_live(&f, 0, fx_keep(&f));
        fx_placeholder(&f, 0, eh + 2, 1, "CPU");
        fx_flush(&f);
        cr_assert(km_test_index_holds_exactly(f.index, 0, want, 2, why, sizeof why), "%s", why);
        cr_assert_eq(fx_match_depth(&f, 0, want, 3, &host), 2);
        cr_assert_eq(host, 2);
        info = fx_info(&f, 0);
        cr_assert_eq(info.counters.refused[KM_FEED_REFUSED_UNPLACED_PLACEHOLDER], 2);
        cr_assert_eq(info.map_entries, 2);

        /* The GPU stores block 0 again: device tier; the CPU removal of block 1 (a placeholder's
         * removal names the same hash) takes it out. */
        km_test_batch_stored(&f.batch, eh, 1, false, 0, tokens, BS, NULL, NULL);
        fx_live(&f, 0, fx_keep(&f));
        km_test_batch_removed(&f.batch, eh + 1, 1, "CPU");
        fx_live(&f, 0, fx_keep(&f));
        fx_flush(&f);
        cr_assert(km_test_index_holds_exactly(f.index, 0, want, 1, why, sizeof why), "%s", why);
        cr_assert_eq(fx_match_depth(&f, 0, want, 3, &host), 1);
        cr_assert_eq(host, 0);
        info = fx_info(&f, 0);
        cr_assert_eq(info.counters.unknown_removes, 0);
        cr_assert_eq(info.state, KM_FEED_STATE_LIVE);
        fx_free(&f);
    }
}

/* An engine with two KV-cache groups: a placeholder says nothing about the other group's copy,
 * so it is skipped and counted, and the block's tier does not move. */
Test(feed, placeholder_stores_of_a_multi_group_engine_are_skipped, .timeout = 10)
{
    fx f;
    fx_init(&f);
    fx_add(&f, 0, false);
    uint32_t tokens[BS] = {1, 2, 3, 4};
    uint64_t eh = 0x55;
    msgpack_sbuffer sb;
    group_event ev[2] = {{false, &eh, 1, false, 0, tokens, BS, 0, NULL, 0},
                         {false, &eh, 1, false, 0, tokens, BS, 1, NULL, 0}};
    pack_group_batch(&sb, ev, 2);
    live_payload(&f, 0, 0, &sb);
    km_test_batch_stored_extra_keys(&f.batch, &eh, 1, false, 0, NULL, 0, "CPU", NULL, NULL);
    live_batch(&f, 0, 1);
    fx_flush(&f);
    bool host;
    km_hash_config hc = {BS, NULL, NULL};
    uint64_t chain;
    size_t nb;
    km_hash_sequence(&hc, tokens, BS, 0, KM_NO_PARENT, NULL, &chain, &nb);
    cr_assert(fx_held_at(&f, 0, chain, &host));
    cr_assert(!host);
    km_feed_worker_info info = fx_info(&f, 0);
    cr_assert_eq(info.counters.refused[KM_FEED_REFUSED_UNPLACED_PLACEHOLDER], 1);
    cr_assert_eq(info.counters.stored_by_medium[KM_KV_MEDIUM_CPU], 0);
    fx_free(&f);
}

/* Random GPU stores (with copies) and removals and CPU chunk stores and removals over two
 * sequences that share their first PH_SHARED blocks, against a brute-force model of what the
 * worker holds: per block its GPU copies and the CPU chunks holding it. CPU chunks come either
 * self-describing (a full store of a run of blocks on CPU, removed block by block: a block shared
 * by two runs is announced and removed once per run) or as placeholders of offload_chunk_blocks
 * 1, 2 or 3 (the key of an aligned chunk, removed by its key; the feed finds the chunk's earlier
 * blocks through their parents and places those held, from the key back). After every message the
 * index holds each block exactly while the model does, at the host tier exactly when the model
 * holds it on CPU alone, and the unplaced placeholders counted are the model's. */
#define PH_BLOCKS 12u
#define PH_SHARED 5u
#define PH_NODES (2u * PH_BLOCKS - PH_SHARED)

typedef struct ph_model {
    uint32_t node[2][PH_BLOCKS]; /* sequence, position -> block */
    uint32_t gpu[PH_NODES], cpu[PH_NODES];
} ph_model;

static bool ph_held(const ph_model *m, uint32_t node)
{
    return m->gpu[node] || m->cpu[node];
}

static void ph_run(uint32_t chunk, bool placeholders)
{
    km_feed_config cfg;
    km_test_feed_config(&cfg, BS);
    cfg.offload_chunk_blocks = chunk;
    fx f;
    fx_init_cfg(&f, &cfg, KM_TEST_ENCODING_POSITIONAL, KM_TEST_HASH_INT);
    fx_add(&f, 0, false);
    ph_model md = {0};
    uint32_t tokens[2][PH_BLOCKS * BS];
    uint64_t chains[PH_NODES], eh[PH_NODES], seq_eh[2][PH_BLOCKS];
    km_hash_config hc = {BS, NULL, NULL};
    for (uint32_t s = 0; s < 2; s++) {
        for (uint32_t i = 0; i < PH_BLOCKS * BS; i++)
            tokens[s][i] = i < PH_SHARED * BS ? 7000 + i : 9000 + 1000 * s + i;
        uint64_t c[PH_BLOCKS];
        size_t nb;
        km_hash_sequence(&hc, tokens[s], PH_BLOCKS * BS, 0, KM_NO_PARENT, NULL, c, &nb);
        for (uint32_t i = 0; i < PH_BLOCKS; i++) {
            uint32_t node = s == 0 || i < PH_SHARED ? i : PH_BLOCKS + i - PH_SHARED;
            md.node[s][i] = node;
            chains[node] = c[i];
            eh[node] = 0x1000 + node;
            seq_eh[s][i] = eh[node];
        }
    }
    uint64_t unplaced = 0, host_seen = 0, shared_cpu_seen = 0;
    for (uint32_t step = 0; step < 1500; step++) {
        uint32_t op = km_rng_below(&f.rng, 4);
        uint32_t sq = km_rng_below(&f.rng, 2);
        uint32_t a = km_rng_below(&f.rng, PH_BLOCKS);
        uint32_t n = 1 + km_rng_below(&f.rng, PH_BLOCKS - a);
        const uint32_t *nd = md.node[sq];
        bool parent_held = a == 0 || ph_held(&md, nd[a - 1]);
        if (step % 211 == 210) {
            /* Now and then the engine drops everything: every side entry goes with its block. */
            km_test_batch_cleared(&f.batch);
            memset(md.gpu, 0, sizeof md.gpu);
            memset(md.cpu, 0, sizeof md.cpu);
        } else if (op == 0 || (op == 2 && !placeholders)) {
            /* A store of [a, a + n) on the GPU or, self-describing, on CPU; parent a - 1: skipped
             * while the parent is not held. */
            km_test_batch_stored(&f.batch, seq_eh[sq] + a, n, a > 0, a > 0 ? seq_eh[sq][a - 1] : 0,
                                 tokens[sq] + a * BS, BS, NULL, op == 0 ? "GPU" : "CPU");
            for (uint32_t i = a; parent_held && i < a + n; i++)
                (op == 0 ? md.gpu : md.cpu)[nd[i]]++;
        } else if (op == 1) {
            km_test_batch_removed(&f.batch, seq_eh[sq] + a, n, "GPU");
            for (uint32_t i = a; i < a + n; i++)
                if (md.gpu[nd[i]])
                    md.gpu[nd[i]]--;
        } else if (op == 3 && !placeholders) {
            km_test_batch_removed(&f.batch, seq_eh[sq] + a, n, "CPU");
            for (uint32_t i = a; i < a + n; i++)
                if (md.cpu[nd[i]])
                    md.cpu[nd[i]]--;
        } else {
            /* Placeholders of up to three aligned chunks' keys, or the removal of one. */
            uint32_t n_chunks = PH_BLOCKS / chunk, first = km_rng_below(&f.rng, n_chunks);
            uint32_t n_keys = op == 2 ? 1 + km_rng_below(&f.rng, 3) : 1;
            if (first + n_keys > n_chunks)
                n_keys = n_chunks - first;
            uint64_t keys[3];
            for (uint32_t k = 0; k < n_keys; k++) {
                uint32_t key = (first + k + 1) * chunk - 1;
                keys[k] = seq_eh[sq][key];
                uint32_t walked = 0;
                for (; walked < chunk; walked++) {
                    uint32_t node = nd[key - walked];
                    if (!ph_held(&md, node))
                        break;
                    if (op == 2)
                        md.cpu[node]++;
                    else if (md.cpu[node])
                        md.cpu[node]--;
                }
                if (op == 2)
                    unplaced += walked < chunk;
            }
            if (op == 2)
                km_test_batch_stored_extra_keys(&f.batch, keys, n_keys, false, 0, NULL, 0, "CPU",
                                                NULL, NULL);
            else
                km_test_batch_removed(&f.batch, keys, n_keys, "CPU");
        }
        fx_live(&f, 0, fx_keep(&f));
        fx_flush(&f);
        for (uint32_t node = 0; node < PH_NODES; node++) {
            bool host;
            bool held = fx_held_at(&f, 0, chains[node], &host);
            KM_CHECK(held == ph_held(&md, node),
                     "chunk %u%s step %u block %u held %d, model gpu %u cpu %u", chunk,
                     placeholders ? " placeholders" : "", step, node, held, md.gpu[node],
                     md.cpu[node]);
            if (held)
                KM_CHECK(host == (!md.gpu[node] && md.cpu[node]),
                         "chunk %u%s step %u block %u host %d, model gpu %u cpu %u", chunk,
                         placeholders ? " placeholders" : "", step, node, host, md.gpu[node],
                         md.cpu[node]);
            host_seen += held && host;
            shared_cpu_seen += md.cpu[node] > 1;
        }
        /* The side maps: announcements beyond one exactly as the model counts them, each held
         * block's parent exactly when the feed walks chunks of several blocks, nothing else. */
        char why[256];
        KM_CHECK(km_feed_check_maps(f.feed, why, sizeof why) == KM_OK, "step %u: %s", step, why);
        const km_emap *map = &km_feed_find_worker(f.feed, 0)->map;
        uint64_t counted_beyond_one = 0;
        for (uint32_t sq2 = 0; sq2 < 2; sq2++) {
            for (uint32_t i = 0; i < PH_BLOCKS; i++) {
                uint32_t node = md.node[sq2][i];
                const km_emap_entry *m = km_emap_find(map, eh[node]);
                KM_CHECK((m != NULL) == ph_held(&md, node), "step %u block %u in the map %d",
                         step, node, m != NULL);
                if (!m)
                    continue;
                KM_CHECK(km_emap_holds(map, m, KM_KV_MEDIUM_CPU) == md.cpu[node],
                         "step %u block %u counts %u CPU announcements, model %u", step, node,
                         km_emap_holds(map, m, KM_KV_MEDIUM_CPU), md.cpu[node]);
                uint64_t parent = chunk > 1 && i ? km_u64map_key(seq_eh[sq2][i - 1]) : 0;
                KM_CHECK(km_emap_parent(map, m) == parent, "step %u block %u parent %" PRIx64
                         ", want %" PRIx64, step, node, km_emap_parent(map, m), parent);
                if (sq2 == 0 || i >= PH_SHARED)
                    counted_beyond_one += md.cpu[node] > 1;
            }
        }
        KM_CHECK(map->holds.live == counted_beyond_one, "step %u: %" PRIu64 " side counts, model %"
                 PRIu64, step, (uint64_t)map->holds.live, counted_beyond_one);
        km_feed_worker_info info = fx_info(&f, 0);
        KM_CHECK(info.counters.refused[KM_FEED_REFUSED_UNPLACED_PLACEHOLDER] == unplaced,
                 "chunk %u step %u unplaced %" PRIu64 ", model %" PRIu64, chunk, step,
                 info.counters.refused[KM_FEED_REFUSED_UNPLACED_PLACEHOLDER], unplaced);
        KM_CHECK(info.state == KM_FEED_STATE_LIVE, "step %u", step);
    }
    cr_assert_gt(host_seen, 0, "the random run reached the host tier");
    cr_assert_gt(shared_cpu_seen, 0, "the random run held a block in two CPU chunks");
    if (placeholders)
        cr_assert_gt(unplaced, 0, "the random run sent placeholders it could not place in full");
    fx_free(&f);
}

Test(feed, self_describing_cpu_chunks_match_a_model_on_random_events, .timeout = 30)
{
    /* offload_chunk_blocks applies to placeholders only: self-describing removals name blocks. */
    ph_run(2, false);
}

Test(feed, placeholder_chunks_of_1_match_a_model_on_random_events, .timeout = 30)
{
    ph_run(1, true);
}

Test(feed, placeholder_chunks_of_2_match_a_model_on_random_events, .timeout = 30)
{
    ph_run(2, true);
}

Test(feed, placeholder_chunks_of_3_match_a_model_on_random_events, .timeout = 30)
{
    ph_run(3, true);
}

/* Placeholder chunks of two blocks, one of them announced twice, survive a save and restore: the
 * blocks' parents (to find a chunk again by its key), their announcements and the worker's
 * placeholder mode come back, so each removal after the restore takes exactly its chunk. */
Test(feed, placeholder_chunks_survive_a_snapshot, .timeout = 20)
{
    km_feed_config cfg;
    km_test_feed_config(&cfg, BS);
    cfg.offload_chunk_blocks = 2;
    fx f;
    fx_init_cfg(&f, &cfg, KM_TEST_ENCODING_POSITIONAL, KM_TEST_HASH_INT);
    fx_add(&f, 0, false);
    uint32_t tokens[4 * BS];
    for (uint32_t i = 0; i < 4 * BS; i++)
        tokens[i] = 300 + i;
    km_hash_config hc = {BS, NULL, NULL};
    uint64_t want[4], eh[4] = {0x41, 0x42, 0x43, 0x44};
    size_t nb;
    km_hash_sequence(&hc, tokens, 4 * BS, 0, KM_NO_PARENT, NULL, want, &nb);
    km_test_batch_stored(&f.batch, eh, 4, false, 0, tokens, BS, NULL, NULL);
    fx_live(&f, 0, fx_keep(&f));
    uint64_t keys[3] = {eh[1], eh[3], eh[3]};
    fx_placeholder(&f, 0, keys, 3, "CPU");
    km_test_batch_removed(&f.batch, eh, 4, "GPU");
    fx_live(&f, 0, fx_keep(&f));
    fx_flush(&f);
    uint32_t host;
    cr_assert_eq(fx_match_depth(&f, 0, want, 4, &host), 4, "every block of both chunks on CPU");
    cr_assert_eq(host, 4);
    cr_assert_eq(fx_info(&f, 0).counters.stored_by_medium[KM_KV_MEDIUM_CPU], 6);

    char dir[64], path[96];
    snprintf(dir, sizeof dir, "/tmp/kvmatch-chunks-XXXXXX");
    cr_assert(mkdtemp(dir) != NULL);
    snprintf(path, sizeof path, "%s/snap", dir);
    cr_assert_eq(km_feed_save(f.feed, path, f.now++), KM_OK, "%s", km_feed_last_error(f.feed));
    km_index *index = km_test_make_index(16);
    km_feed *feed = NULL;
    cr_assert_eq(km_feed_create(index, &f.cfg, &feed), KM_OK);
    cr_assert_eq(km_feed_restore(feed, path, f.now++), KM_OK, "%s", km_feed_last_error(feed));
    remove(path);
    rmdir(dir);
    km_feed_worker_config wc = {0, "w", false};
    cr_assert_eq(km_feed_add_worker(feed, &wc, f.now++), KM_OK);
    /* Three removals by key: the second chunk's first, then again, then the first chunk. */
    uint32_t depth_after[3] = {4, 2, 0};
    const uint64_t *removed[3] = {&eh[3], &eh[3], &eh[1]};
    for (int r = 0; r < 3; r++) {
        km_test_batch_removed(&f.batch, removed[r], 1, "CPU");
        uint64_t seq = fx_keep(&f);
        km_kv_batch b = fx_decode(&f, seq);
        cr_assert_eq(km_feed_live(feed, 0, seq, &b, f.now++), KM_OK, "%s",
                     km_feed_last_error(feed));
        cr_assert_eq(km_feed_flush(feed, f.now++, NULL), KM_OK);
        km_request rq = {want, 4};
        km_match_results res;
        km_match_results_init(&res);
        cr_assert_eq(km_index_match_batch(index, &rq, 1, &res), KM_OK);
        uint32_t depth = 0;
        for (uint32_t j = 0; j < res.requests[0].count; j++)
            if (res.matches[res.requests[0].first + j].worker == 0)
                depth = res.matches[res.requests[0].first + j].depth;
        km_match_results_free(&res);
        cr_assert_eq(depth, depth_after[r], "after removal %d", r);
    }
    km_feed_worker_info info;
    cr_assert_eq(km_feed_get_worker_info(feed, 0, &info), KM_OK);
    cr_assert_eq(info.map_entries, 0, "every block left with its chunk's last removal");
    cr_assert_eq(info.counters.unknown_removes, 0);
    km_feed_destroy(feed);
    km_index_destroy(index);
    fx_free(&f);
}

/* Import a copy of state with `len` bytes at `at` replaced by `bytes`: the error and its reason. */
static int import_patched(km_feed *into, const unsigned char *state, size_t size, size_t at,
                          const void *bytes, size_t len)
{
    unsigned char *bad = malloc(size);
    cr_assert_not_null(bad);
    memcpy(bad, state, size);
    memcpy(bad + at, bytes, len);
    int rc = km_feed_import_state(into, bad, size, 1);
    free(bad);
    return rc;
}

/* A feed state's map entries take 24 bytes each; the parents (of a pool whose chunks have several
 * blocks) and the announcement counts beyond one come in sections of their own, validated: a
 * record of a block the map lacks, in a medium the block is not held in, a count below 2, a parent
 * key 0 and a second record of one block are refused, and a state with parents restores into a
 * feed that keeps none. */
Test(feed, snapshot_side_sections_are_validated, .timeout = 20)
{
    km_feed_config cfg;
    km_test_feed_config(&cfg, BS);
    cfg.offload_chunk_blocks = 2;
    fx f;
    fx_init_cfg(&f, &cfg, KM_TEST_ENCODING_POSITIONAL, KM_TEST_HASH_INT);
    fx_add(&f, 0, false);
    fx_flush(&f);
    void *empty_state;
    size_t empty_size;
    cr_assert_eq(km_feed_export_state(f.feed, &empty_state, &empty_size), KM_OK);
    free(empty_state);
    uint32_t tokens[4 * BS];
    for (uint32_t i = 0; i < 4 * BS; i++)
        tokens[i] = 500 + i;
    uint64_t eh[4] = {0x61, 0x62, 0x63, 0x64};
    km_test_batch_stored(&f.batch, eh, 4, false, 0, tokens, BS, NULL, NULL);
    fx_live(&f, 0, fx_keep(&f));
    fx_flush(&f);
    void *gpu_state;
    size_t gpu_size;
    cr_assert_eq(km_feed_export_state(f.feed, &gpu_state, &gpu_size), KM_OK);
    free(gpu_state);
    /* Four GPU blocks: 24 bytes each, and three parents (block 0 has none) of 16 with their
     * count of 8. */
    cr_assert_eq(gpu_size - empty_size, 4 * 24 + 8 + 3 * 16, "%zu bytes", gpu_size - empty_size);

    uint64_t keys[3] = {eh[1], eh[3], eh[3]}; /* blocks 2 and 3 in two CPU chunks */
    fx_placeholder(&f, 0, keys, 3, "CPU");
    fx_live(&f, 0, fx_keep(&f));
    fx_flush(&f);
    char why[256];
    cr_assert_eq(km_feed_check_maps(f.feed, why, sizeof why), KM_OK, "%s", why);
    unsigned char *state;
    size_t size;
    cr_assert_eq(km_feed_export_state(f.feed, (void **)&state, &size), KM_OK);
    cr_assert_eq(size, gpu_size + 2 * 11, "two counts of 2 (blocks 2 and 3 on CPU)");
    /* The worker's end: n_parents, 3 x {key, parent}, n_holds, 2 x {key, medium, count}. */
    size_t holds_at = size - 2 * 11, parents_at = holds_at - 8 - 3 * 16;
    cr_assert_eq(state[holds_at - 8], 2);
    cr_assert_eq(state[parents_at - 8], 3);

    km_index *index = km_test_make_index(16);
    km_feed *into = NULL;
    cr_assert_eq(km_feed_create(index, &cfg, &into), KM_OK);
    cr_assert_eq(km_feed_import_state(into, state, size, 1), KM_OK, "%s",
                 km_feed_last_error(into));
    cr_assert_eq(km_feed_check_maps(into, why, sizeof why), KM_OK, "%s", why);
    const km_emap *map = &km_feed_find_worker(into, 0)->map;
    cr_assert_eq(map->parents.live, 3);
    cr_assert_eq(map->holds.live, 2);
    cr_assert_eq(km_emap_holds(map, km_emap_find(map, eh[3]), KM_KV_MEDIUM_CPU), 2);
    km_feed_destroy(into);
    km_index_destroy(index);

    static const struct {
        size_t at;
        uint64_t value;
        size_t len;
        const char *reason;
    } cases[] = {
        {0, 0x99, 8, "announcements of a block the map does not hold"},
        {8, KM_KV_MEDIUM_DISK, 1, "announcements in a medium not holding the block"},
        {8, 0, 1, "announcements in a medium not holding the block"},
        {9, 1, 2, "an announcement count below 2"},
        {0, 0, 0, "two announcement counts of one block and medium"}, /* record 1 = record 0 */
        {100, 0x99, 8, "a parent of a block the map does not hold"},
        {108, 0, 8, "a parent key of 0 or 1"},
        {100, 0, 0, "two parents of one block"}, /* pair 1 = pair 0 */
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        index = km_test_make_index(16);
        cr_assert_eq(km_feed_create(index, &cfg, &into), KM_OK);
        int rc;
        if (cases[c].len) {
            size_t at = cases[c].at >= 100 ? parents_at + cases[c].at - 100 : holds_at + cases[c].at;
            unsigned char le[8];
            for (int i = 0; i < 8; i++)
                le[i] = (unsigned char)(cases[c].value >> (8 * i));
            rc = import_patched(into, state, size, at, le, cases[c].len);
        } else if (cases[c].at >= 100) {
            rc = import_patched(into, state, size, parents_at + 16, state + parents_at, 16);
        } else {
            rc = import_patched(into, state, size, holds_at + 11, state + holds_at, 11);
        }
        cr_assert_eq(rc, KM_ERR_CORRUPT, "case %zu: %s", c, km_error_name(rc));
        cr_assert(strstr(km_feed_last_error(into), cases[c].reason) != NULL, "case %zu: %s", c,
                  km_feed_last_error(into));
        uint32_t n = 1;
        cr_assert_eq(km_feed_get_workers(into, NULL, 0, &n), KM_OK);
        cr_assert_eq(n, 0, "case %zu: nothing installed", c);
        km_feed_destroy(into);
        km_index_destroy(index);
    }

    /* A pool of one-block chunks walks nothing: the parents are checked, then dropped. */
    km_feed_config one = cfg;
    one.offload_chunk_blocks = 1;
    index = km_test_make_index(16);
    cr_assert_eq(km_feed_create(index, &one, &into), KM_OK);
    cr_assert_eq(km_feed_import_state(into, state, size, 1), KM_OK, "%s",
                 km_feed_last_error(into));
    cr_assert_eq(km_feed_check_maps(into, why, sizeof why), KM_OK, "%s", why);
    cr_assert_eq(km_feed_find_worker(into, 0)->map.parents.live, 0);
    void *again;
    size_t again_size;
    cr_assert_eq(km_feed_export_state(into, &again, &again_size), KM_OK);
    cr_assert_eq(again_size, size - 8 - 3 * 16, "saved again without the parents section");
    free(again);
    km_feed_destroy(into);
    km_index_destroy(index);
    free(state);
    fx_free(&f);
}

/* A block the GPU event marked opaque (an image in block 1) is not indexed, and neither are its
 * descendants; the CPU copy of the same engine hashes, sent without extra_keys, must not turn
 * them into tokens-only chains (which would claim the image blocks for any request with the same
 * placeholder tokens). */
Test(feed, an_opaque_block_stays_unindexed_when_stored_again_without_extra_keys, .timeout = 10)
{
    fx f;
    fx_init(&f);
    fx_add(&f, 0, false);
    uint32_t tokens[3 * BS];
    for (uint32_t i = 0; i < 3 * BS; i++)
        tokens[i] = 700 + i;
    km_hash_config plain = {BS, NULL, NULL};
    uint64_t chain[3];
    size_t nb;
    km_hash_sequence(&plain, tokens, 3 * BS, 0, KM_NO_PARENT, NULL, chain, &nb);
    uint64_t eh[3] = {0x51, 0x52, 0x53};
    const char *images[3] = {NULL, "img-1", NULL};
    char why[256];

    km_test_batch_stored_extra_keys(&f.batch, eh, 3, false, 0, tokens, BS, "GPU", NULL, images);
    km_test_batch_stored_extra_keys(&f.batch, eh, 3, false, 0, tokens, BS, "CPU", NULL, NULL);
    fx_live(&f, 0, fx_keep(&f));
    fx_flush(&f);
    cr_assert(km_test_index_holds_exactly(f.index, 0, chain, 1, why, sizeof why), "%s", why);
    km_feed_worker_info info = fx_info(&f, 0);
    cr_assert_eq(info.map_entries, 3);
    cr_assert_eq(info.counters.unhashable_blocks, 4, "blocks 1 and 2, in each of the two events");

    km_test_batch_removed(&f.batch, eh, 3, "GPU");
    km_test_batch_removed(&f.batch, eh, 3, "CPU");
    fx_live(&f, 0, fx_keep(&f));
    fx_flush(&f);
    cr_assert(km_test_index_holds_exactly(f.index, 0, chain, 0, why, sizeof why), "%s", why);
    info = fx_info(&f, 0);
    cr_assert_eq(info.map_entries, 0);
    cr_assert_eq(info.counters.blocks_removed, 1);
    fx_free(&f);
}

Test(feed, random_stream_matches_engine, .timeout = 20)
{
    km_test_encoding encs[2] = {KM_TEST_ENCODING_POSITIONAL, KM_TEST_ENCODING_MAP};
    km_test_hash_form forms[2] = {KM_TEST_HASH_INT, KM_TEST_HASH_BYTES32};
    for (int c = 0; c < 4; c++) {
        fx f;
        fx_init_cfg(&f, NULL, encs[c & 1], forms[c >> 1]);
        fx_add(&f, 5, false);
        uint64_t first = fx_make(&f, 400, 1);
        for (uint64_t s = first; s < first + 400; s++) {
            fx_live(&f, 5, s);
            if (s % 37 == 0)
                fx_flush(&f);
        }
        fx_check_truth(&f, 5);
        km_feed_worker_info info = fx_info(&f, 5);
        cr_assert_eq(info.counters.unknown_parent_blocks, 0);
        cr_assert_eq(info.counters.unknown_removes, 0);
        cr_assert_eq(info.counters.messages, 400);
        cr_assert_eq(info.expected_seq, 400);
        fx_free(&f);
    }
}

/* A worker with tens of thousands of cached blocks: its engine-hash map grows past
 * KM_EMAP_INCREMENTAL_SLOTS and moves its entries over the following messages. Stores that continue
 * old blocks (parent lookups), removes and re-stores land while entries sit in either array; the
 * index must stay exactly what the engine caches, and no parent or removed hash may go unknown. */
Test(feed, a_large_worker_stays_exact_while_its_map_grows, .timeout = 60)
{
    fx f;
    fx_init(&f);
    fx_add(&f, 5, false);
    for (int msg = 0; msg < 1500; msg++) {
        if (msg % 4 != 3) {
            int64_t parent = -1;
            if (f.engine.n_blocks && km_rng_percent(&f.rng, 80)) {
                size_t i = km_rng_below(&f.rng, (uint32_t)f.engine.n_blocks);
                if (f.engine.blocks[i].cached)
                    parent = (int64_t)i;
            }
            km_test_engine_store(&f.engine, &f.rng, &f.batch, parent, 16);
        } else if (msg % 8 == 3) { /* evict 16 cached blocks anywhere in the map */
            uint64_t hashes[16];
            uint32_t n = 0;
            for (int tries = 0; tries < 200 && n < 16; tries++) {
                km_test_block *blk = &f.engine.blocks[km_rng_below(&f.rng, (uint32_t)f.engine.n_blocks)];
                if (blk->cached) {
                    blk->cached = false;
                    hashes[n++] = blk->engine_hash;
                }
            }
            km_test_batch_removed(&f.batch, hashes, n, f.engine.medium);
        } else {
            km_test_engine_step(&f.engine, &f.rng, &f.batch, 3, 0);
        }
        fx_live(&f, 5, fx_keep(&f));
        if (msg >= 650 && msg % 5 == 0) /* from about 10,000 cached blocks on */
            fx_check_truth(&f, 5);
    }
    fx_check_truth(&f, 5);
    km_feed_worker_info info = fx_info(&f, 5);
    size_t n_cached;
    free(km_test_engine_chains(&f.engine, false, &n_cached));
    cr_assert_gt(n_cached, 13000, "only %zu blocks cached: the map never grew past 16 K slots",
                 n_cached);
    cr_assert_eq(info.counters.unknown_parent_blocks, 0);
    cr_assert_eq(info.counters.unknown_removes, 0);
    fx_free(&f);
}

/* ---- stream checks ----------------------------------------------------------------------------- */

Test(feed, first_message_sets_position_without_bootstrap, .timeout = 10)
{
    fx f;
    fx_init(&f);
    fx_add(&f, 0, false); /* no replay endpoint: nothing to bootstrap from */
    fx_no_action(&f);
    cr_assert_eq(fx_info(&f, 0).state, KM_FEED_STATE_SYNCING);
    fx_make(&f, 10, 0);
    fx_live_range(&f, 0, 7, 10);
    km_feed_worker_info info = fx_info(&f, 0);
    cr_assert_eq(info.state, KM_FEED_STATE_LIVE);
    cr_assert_eq(info.counters.history_unavailable, 7);
    cr_assert_eq(info.counters.gaps, 0);
    km_feed_window win[4];
    cr_assert_eq(fx_windows(&f, 0, win, 4), 1);
    cr_assert_eq(win[0].cause, KM_FEED_WINDOW_STARTUP);
    cr_assert_eq(win[0].end, KM_FEED_END_RECOVERED);
    cr_assert(win[0].end_ns > win[0].start_ns);
    cr_assert_eq(win[0].duration_ns, win[0].end_ns - win[0].start_ns);
    fx_free(&f);
}

Test(feed, bootstrap_replay, .timeout = 10)
{
    fx f;
    fx_init(&f);
    fx_make(&f, 12, 0);
    fx_add(&f, 0, true);
    km_feed_action a = fx_action(&f, KM_FEED_ACTION_REPLAY_REQUEST);
    cr_assert_eq(a.start_seq, 0);
    cr_assert_eq(a.worker, 0);
    /* Live messages before the replay answers wait. */
    fx_live_range(&f, 0, 8, 10);
    km_feed_worker_info info = fx_info(&f, 0);
    cr_assert_eq(info.state, KM_FEED_STATE_SYNCING);
    cr_assert_eq(info.buffered_messages, 2);
    /* The engine kept seqs 3..9 (0..2 evicted): history before we joined, not a loss. */
    fx_items(&f, 0, a.request_id, 3, 10);
    fx_end(&f, 0, a.request_id);
    fx_live_range(&f, 0, 10, 12);
    info = fx_info(&f, 0);
    cr_assert_eq(info.state, KM_FEED_STATE_LIVE);
    cr_assert_eq(info.expected_seq, 12);
    cr_assert_eq(info.counters.history_unavailable, 3);
    cr_assert_eq(info.counters.replayed, 7);
    cr_assert_eq(info.counters.duplicates, 2);
    cr_assert_eq(info.counters.lost, 0);
    cr_assert_eq(info.buffered_messages, 0);
    fx_no_action(&f);
    km_feed_window win[4];
    cr_assert_eq(fx_windows(&f, 0, win, 4), 1);
    cr_assert_eq(win[0].cause, KM_FEED_WINDOW_STARTUP);
    cr_assert_eq(win[0].end, KM_FEED_END_RECOVERED);
    cr_assert_eq(win[0].replayed, 7);
    fx_free(&f);
}

Test(feed, bootstrap_from_a_fresh_engine, .timeout = 10)
{
    fx f;
    fx_init(&f);
    fx_make(&f, 6, 0);
    fx_add(&f, 0, true);
    km_feed_action a = fx_action(&f, KM_FEED_ACTION_REPLAY_REQUEST);
    fx_end(&f, 0, a.request_id); /* nothing published yet */
    km_feed_worker_info info = fx_info(&f, 0);
    cr_assert_eq(info.state, KM_FEED_STATE_LIVE);
    cr_assert_eq(info.expected_seq, 0);
    fx_live_range(&f, 0, 0, 6);
    fx_check_truth(&f, 0);
    cr_assert_eq(fx_info(&f, 0).counters.gaps, 0);
    fx_free(&f);
}

Test(feed, short_gap_is_replayed_in_order, .timeout = 10)
{
    fx f;
    fx_init(&f);
    fx_add(&f, 1, true);
    km_feed_action a = fx_action(&f, KM_FEED_ACTION_REPLAY_REQUEST);
    fx_end(&f, 1, a.request_id);
    fx_make(&f, 40, 2);
    fx_live_range(&f, 1, 0, 10);
    /* 10..14 dropped on the wire */
    fx_live(&f, 1, 15);
    a = fx_action(&f, KM_FEED_ACTION_REPLAY_REQUEST);
    cr_assert_eq(a.start_seq, 10);
    km_feed_worker_info info = fx_info(&f, 1);
    cr_assert_eq(info.state, KM_FEED_STATE_GAP);
    cr_assert_eq(info.counters.gaps, 1);
    fx_live_range(&f, 1, 16, 20); /* live continues while the replay is pending */
    cr_assert_eq(fx_info(&f, 1).buffered_messages, 5);
    fx_flush(&f); /* a flush during the replay applies only what is in order */
    fx_items(&f, 1, a.request_id, 10, 18); /* the replay covered up to 17 */
    fx_end(&f, 1, a.request_id);
    fx_live_range(&f, 1, 20, 40);
    fx_check_truth(&f, 1);
    info = fx_info(&f, 1);
    cr_assert_eq(info.state, KM_FEED_STATE_LIVE);
    cr_assert_eq(info.counters.replayed, 8);
    cr_assert_eq(info.counters.duplicates, 3);
    cr_assert_eq(info.counters.lost, 0);
    cr_assert_eq(info.expected_seq, 40);
    km_feed_window win[4];
    cr_assert_eq(fx_windows(&f, 1, win, 4), 2);
    cr_assert_eq(win[1].cause, KM_FEED_WINDOW_GAP);
    cr_assert_eq(win[1].end, KM_FEED_END_RECOVERED);
    cr_assert_eq(win[1].from_seq, 10);
    cr_assert_eq(win[1].replayed, 8);
    cr_assert_eq(win[1].replay_requests, 1);
    fx_free(&f);
}

static void degrade_by_late_replay(fx *f, uint32_t w)
{
    fx_add(f, w, true);
    km_feed_action a = fx_action(f, KM_FEED_ACTION_REPLAY_REQUEST);
    fx_end(f, w, a.request_id);
    fx_make(f, 60, 0);
    fx_live_range(f, w, 0, 10);
    fx_live(f, w, 30); /* 10..29 dropped */
    a = fx_action(f, KM_FEED_ACTION_REPLAY_REQUEST);
    cr_assert_eq(a.start_seq, 10);
    fx_items(f, w, a.request_id, 22, 31); /* 10..21 evicted: 12 lost */
    fx_end(f, w, a.request_id);
}

Test(feed, replay_starting_late_means_history_lost, .timeout = 10)
{
    fx f;
    fx_init(&f);
    degrade_by_late_replay(&f, 2);
    km_feed_worker_info info = fx_info(&f, 2);
    cr_assert_eq(info.state, KM_FEED_STATE_DEGRADED);
    cr_assert_eq(info.counters.lost, 12);
    cr_assert_eq(info.counters.replayed, 9);
    cr_assert_eq(info.expected_seq, 31);
    km_feed_window win[4];
    cr_assert_eq(fx_windows(&f, 2, win, 4), 3);
    cr_assert_eq(win[1].cause, KM_FEED_WINDOW_GAP);
    cr_assert_eq(win[1].end, KM_FEED_END_LOST);
    cr_assert_eq(win[1].lost, 12);
    cr_assert_eq(win[2].cause, KM_FEED_WINDOW_DEGRADED);
    cr_assert_eq(win[2].end, KM_FEED_END_OPEN);
    cr_assert_eq(win[2].end_ns, 0);
    /* Still DEGRADED after more live traffic; AllBlocksCleared ends it. */
    fx_live_range(&f, 2, 31, 40);
    cr_assert_eq(fx_info(&f, 2).state, KM_FEED_STATE_DEGRADED);
    km_test_batch_cleared(&f.batch);
    for (size_t i = 0; i < f.engine.n_blocks; i++)
        f.engine.blocks[i].cached = false;
    uint64_t s = fx_keep(&f);
    fx_live_range(&f, 2, 40, s);
    fx_live(&f, 2, s);
    cr_assert_eq(fx_info(&f, 2).state, KM_FEED_STATE_LIVE);
    cr_assert_eq(fx_windows(&f, 2, win, 4), 3);
    cr_assert_eq(win[2].cause, KM_FEED_WINDOW_DEGRADED);
    cr_assert_eq(win[2].end, KM_FEED_END_CLEARED);
    fx_check_truth(&f, 2);
    fx_free(&f);
}

Test(feed, degraded_drop_policy_keeps_only_observed_blocks, .timeout = 10)
{
    for (int policy = 0; policy < 2; policy++) {
        km_feed_config cfg;
        km_test_feed_config(&cfg, BS);
        cfg.degraded_policy = policy ? KM_FEED_DEGRADED_DROP : KM_FEED_DEGRADED_KEEP_FLAGGED;
        fx f;
        fx_init_cfg(&f, &cfg, KM_TEST_ENCODING_MAP, KM_TEST_HASH_INT);
        degrade_by_late_replay(&f, 0);
        fx_live_range(&f, 0, 31, 60);
        fx_flush(&f);
        /* DROP: everything the index holds for the worker is really cached (no stale block). */
        size_t n_truth, n_all;
        uint64_t *truth = km_test_engine_chains(&f.engine, false, &n_truth);
        uint64_t *all = km_test_engine_chains(&f.engine, true, &n_all);
        uint64_t held = 0, stale = 0;
        for (size_t i = 0; i < n_all; i++) {
            uint32_t ws[4], n = 0;
            km_index_holders(f.index, all[i], ws, 4, &n);
            if (!n)
                continue;
            held++;
            bool cached = false;
            for (size_t j = 0; j < n_truth && !cached; j++)
                cached = truth[j] == all[i];
            stale += !cached;
        }
        if (policy)
            cr_assert_eq(stale, 0, "DROP policy left %" PRIu64 " stale blocks", stale);
        cr_assert(held > 0);
        cr_assert_eq(fx_info(&f, 0).state, KM_FEED_STATE_DEGRADED);
        free(truth);
        free(all);
        fx_free(&f);
    }
}

/* The DROP policy forgets the worker's engine-hash map with its index. A lost BlockRemoved leaves a
 * media bit stale in the map; kept, it would hold a block on "CPU" after its last real removal, and
 * when the engine stored it again and removed it from GPU, the index would still hold it (as a
 * host-tier block). */
Test(feed, the_drop_policy_forgets_media_a_lost_message_left_stale, .timeout = 10)
{
    for (int policy = 0; policy < 2; policy++) {
        km_feed_config cfg;
        km_test_feed_config(&cfg, BS);
        cfg.degraded_policy = policy ? KM_FEED_DEGRADED_DROP : KM_FEED_DEGRADED_KEEP_FLAGGED;
        fx f;
        fx_init_cfg(&f, &cfg, KM_TEST_ENCODING_MAP, KM_TEST_HASH_INT);
        fx_add(&f, 0, false); /* no replay endpoint: a gap loses history at once */
        uint32_t tokens[BS];
        for (uint32_t i = 0; i < BS; i++)
            tokens[i] = 900 + i;
        km_hash_config plain = {BS, NULL, NULL};
        uint64_t chain[1], eh[1] = {0x77};
        size_t nb;
        km_hash_sequence(&plain, tokens, BS, 0, KM_NO_PARENT, NULL, chain, &nb);
        char why[256];
        km_test_batch_stored_extra_keys(&f.batch, eh, 1, false, 0, tokens, BS, "GPU", NULL, NULL);
        uint64_t s_gpu = fx_keep(&f);
        km_test_batch_stored_extra_keys(&f.batch, eh, 1, false, 0, tokens, BS, "CPU", NULL, NULL);
        uint64_t s_cpu = fx_keep(&f);
        km_test_batch_removed(&f.batch, eh, 1, "CPU");
        uint64_t s_lost = fx_keep(&f); /* never delivered */
        km_test_batch_removed(&f.batch, eh, 1, "GPU");
        uint64_t s_gpu_gone = fx_keep(&f);
        km_test_batch_stored_extra_keys(&f.batch, eh, 1, false, 0, tokens, BS, "GPU", NULL, NULL);
        uint64_t s_again = fx_keep(&f);
        km_test_batch_removed(&f.batch, eh, 1, "GPU");
        uint64_t s_gone = fx_keep(&f);
        fx_live(&f, 0, s_gpu);
        fx_live(&f, 0, s_cpu);
        fx_flush(&f);
        cr_assert(km_test_index_holds_exactly(f.index, 0, chain, 1, why, sizeof why), "%s", why);
        (void)s_lost;
        fx_live(&f, 0, s_gpu_gone); /* seq s_lost missing: DEGRADED */
        fx_live(&f, 0, s_again);
        fx_live(&f, 0, s_gone);
        fx_flush(&f);
        cr_assert_eq(fx_info(&f, 0).state, KM_FEED_STATE_DEGRADED);
        /* The engine holds the block nowhere now. DROP promises no stale block; KEEP_FLAGGED
         * keeps what it believed (the stale CPU copy), flagged. */
        if (policy)
            cr_assert(km_test_index_holds_exactly(f.index, 0, chain, 0, why, sizeof why),
                      "DROP policy: %s", why);
        else
            cr_assert(km_test_index_holds_exactly(f.index, 0, chain, 1, why, sizeof why),
                      "KEEP_FLAGGED: %s", why);
        fx_free(&f);
    }
}

/* A replay answer is consecutive from its first item: a skip after that one is items dropped on
 * the way, not eviction. The live buffer fills what it holds of the hole; the rest is asked for
 * again, and nothing is lost. */
Test(feed, a_replay_that_skips_after_its_first_item_is_asked_again_from_the_hole, .timeout = 10)
{
    fx f;
    fx_init(&f);
    fx_make(&f, 50, 0);
    fx_add(&f, 0, true);
    /* Bootstrap: 0..9, then 15 (10..14 dropped). */
    km_feed_action a = fx_action(&f, KM_FEED_ACTION_REPLAY_REQUEST);
    cr_assert_eq(a.start_seq, 0);
    fx_items(&f, 0, a.request_id, 0, 10);
    fx_item(&f, 0, a.request_id, 15);
    km_feed_action c = fx_action(&f, KM_FEED_ACTION_REPLAY_CANCEL);
    cr_assert_eq(c.request_id, a.request_id);
    km_feed_action b = fx_action(&f, KM_FEED_ACTION_REPLAY_REQUEST);
    cr_assert_eq(b.start_seq, 10, "asked again from the hole");
    fx_no_action(&f);
    km_feed_worker_info info = fx_info(&f, 0);
    cr_assert_eq(info.counters.lost, 0);
    cr_assert_eq(info.counters.replay_holes, 1);
    cr_assert_eq(info.state, KM_FEED_STATE_SYNCING);
    cr_assert_eq(info.expected_seq, 10);
    fx_items(&f, 0, a.request_id, 16, 18); /* the first request's later items are stale */
    fx_end(&f, 0, a.request_id);
    cr_assert_eq(fx_info(&f, 0).counters.stale_replay_items, 3);
    fx_items(&f, 0, b.request_id, 10, 30);
    fx_end(&f, 0, b.request_id);
    info = fx_info(&f, 0);
    cr_assert_eq(info.state, KM_FEED_STATE_LIVE);
    cr_assert_eq(info.expected_seq, 30);
    cr_assert_eq(info.counters.replayed, 30);

    /* A gap replay from 35 (35 and 36 missing, 37 and 38 held): it gives 35, then 37. The
     * buffer does not hold 36: asked again from 36. */
    fx_live_range(&f, 0, 30, 35);
    fx_live_range(&f, 0, 37, 39);
    km_feed_action g = fx_action(&f, KM_FEED_ACTION_REPLAY_REQUEST);
    cr_assert_eq(g.start_seq, 35);
    fx_item(&f, 0, g.request_id, 35);
    fx_item(&f, 0, g.request_id, 37);
    (void)fx_action(&f, KM_FEED_ACTION_REPLAY_CANCEL);
    km_feed_action h = fx_action(&f, KM_FEED_ACTION_REPLAY_REQUEST);
    cr_assert_eq(h.start_seq, 36);
    fx_items(&f, 0, h.request_id, 36, 39);
    fx_end(&f, 0, h.request_id);
    info = fx_info(&f, 0);
    cr_assert_eq(info.state, KM_FEED_STATE_LIVE);
    cr_assert_eq(info.expected_seq, 39);
    cr_assert_eq(info.counters.replay_holes, 2);

    /* A gap replay from 42 (43 and 44 held): it gives 42, then 44. The held 43 fills the hole:
     * no new request. */
    fx_live_range(&f, 0, 39, 42);
    fx_live_range(&f, 0, 43, 45);
    km_feed_action k = fx_action(&f, KM_FEED_ACTION_REPLAY_REQUEST);
    cr_assert_eq(k.start_seq, 42);
    fx_item(&f, 0, k.request_id, 42);
    fx_item(&f, 0, k.request_id, 44);
    fx_no_action(&f);
    fx_end(&f, 0, k.request_id);
    fx_live_range(&f, 0, 45, 50);
    info = fx_info(&f, 0);
    cr_assert_eq(info.state, KM_FEED_STATE_LIVE);
    cr_assert_eq(info.expected_seq, 50);
    cr_assert_eq(info.counters.replay_holes, 2);
    cr_assert_eq(info.counters.lost, 0);
    cr_assert_eq(info.counters.gaps, 2);
    fx_check_truth(&f, 0);

    /* A request that starts later than asked is still eviction: its skip is lost. */
    fx_make(&f, 10, 0);
    fx_live(&f, 0, 52);
    km_feed_action e = fx_action(&f, KM_FEED_ACTION_REPLAY_REQUEST);
    cr_assert_eq(e.start_seq, 50);
    fx_items(&f, 0, e.request_id, 51, 53);
    fx_end(&f, 0, e.request_id);
    info = fx_info(&f, 0);
    cr_assert_eq(info.counters.lost, 1);
    cr_assert_eq(info.state, KM_FEED_STATE_DEGRADED);
    cr_assert_eq(info.counters.replay_holes, 2);
    fx_free(&f);
}

Test(feed, replay_failure_and_no_replay_endpoint_lose_history, .timeout = 10)
{
    fx f;
    fx_init(&f);
    fx_make(&f, 20, 0);
    fx_add(&f, 0, true);
    fx_add(&f, 1, false);
    km_feed_action a = fx_action(&f, KM_FEED_ACTION_REPLAY_REQUEST);
    fx_end(&f, 0, a.request_id);
    fx_live_range(&f, 0, 0, 5);
    fx_live(&f, 0, 8);
    a = fx_action(&f, KM_FEED_ACTION_REPLAY_REQUEST);
    fx_live(&f, 0, 9);
    cr_assert_eq(km_feed_replay_failed(f.feed, 0, a.request_id, KM_FEED_REPLAY_TIMEOUT, f.now++),
                 KM_OK);
    km_feed_worker_info info = fx_info(&f, 0);
    cr_assert_eq(info.state, KM_FEED_STATE_DEGRADED);
    cr_assert_eq(info.counters.lost, 3);
    cr_assert_eq(info.counters.replay_failures, 1);
    cr_assert_eq(info.expected_seq, 10);
    /* A late answer to the failed request is ignored; one the decoder refused is still counted
     * as an undecodable message. */
    fx_item(&f, 0, a.request_id, 5);
    cr_assert_eq(fx_info(&f, 0).counters.stale_replay_items, 1);
    uint64_t undecodable = fx_info(&f, 0).counters.refused[KM_FEED_REFUSED_UNDECODABLE];
    uint64_t malformed = fx_info(&f, 0).counters.malformed;
    cr_assert_eq(km_feed_replay_item_undecodable(f.feed, 0, a.request_id, 6, "bad", f.now++),
                 KM_OK);
    info = fx_info(&f, 0);
    cr_assert_eq(info.counters.stale_replay_items, 2);
    cr_assert_eq(info.counters.refused[KM_FEED_REFUSED_UNDECODABLE], undecodable + 1);
    cr_assert_eq(info.counters.malformed, malformed + 1);
    cr_assert_eq(info.expected_seq, 10, "a stale item moved the stream");

    /* Without a replay endpoint a gap is lost at once. */
    fx_live_range(&f, 1, 0, 3);
    fx_live(&f, 1, 6);
    fx_no_action(&f);
    info = fx_info(&f, 1);
    cr_assert_eq(info.state, KM_FEED_STATE_DEGRADED);
    cr_assert_eq(info.counters.lost, 3);
    cr_assert_eq(info.counters.gaps, 1);
    km_feed_window win[4];
    cr_assert_eq(fx_windows(&f, 1, win, 4), 3);
    cr_assert_eq(win[1].cause, KM_FEED_WINDOW_GAP);
    cr_assert_eq(win[1].end, KM_FEED_END_LOST);
    cr_assert_eq(win[1].from_seq, 3);
    fx_free(&f);
}

Test(feed, buffer_overflow_abandons_the_replay, .timeout = 10)
{
    km_feed_config cfg;
    km_test_feed_config(&cfg, BS);
    cfg.max_buffered_messages = 4;
    fx f;
    fx_init_cfg(&f, &cfg, KM_TEST_ENCODING_POSITIONAL, KM_TEST_HASH_INT);
    fx_add(&f, 0, true);
    km_feed_action a = fx_action(&f, KM_FEED_ACTION_REPLAY_REQUEST);
    fx_end(&f, 0, a.request_id);
    fx_make(&f, 30, 0);
    fx_live_range(&f, 0, 0, 5);
    fx_live_range(&f, 0, 7, 11); /* gap at 5; 7..10 fill the buffer */
    a = fx_action(&f, KM_FEED_ACTION_REPLAY_REQUEST);
    cr_assert_eq(fx_info(&f, 0).buffered_messages, 4);
    fx_live(&f, 0, 11); /* one too many */
    km_feed_action c = fx_action(&f, KM_FEED_ACTION_REPLAY_CANCEL);
    cr_assert_eq(c.request_id, a.request_id);
    km_feed_worker_info info = fx_info(&f, 0);
    cr_assert_eq(info.state, KM_FEED_STATE_DEGRADED);
    cr_assert_eq(info.counters.buffer_overflows, 1);
    cr_assert_eq(info.counters.lost, 2);
    cr_assert_eq(info.expected_seq, 12);
    cr_assert_eq(info.buffered_messages, 0);
    fx_free(&f);
}

Test(feed, restart_drops_old_blocks, .timeout = 10)
{
    fx f;
    fx_init(&f);
    fx_add(&f, 4, false);
    fx_make(&f, 20, 0);
    fx_live_range(&f, 4, 0, 20);
    fx_check_truth(&f, 4);
    /* A new process: its KV is empty, engine hashes change, seq starts at 0. */
    km_test_engine_restart(&f.engine, 0x9999);
    f.seq_base = f.n;
    fx_make(&f, 10, 0);
    fx_live_range(&f, 4, 0, 10);
    fx_check_truth(&f, 4);
    km_feed_worker_info info = fx_info(&f, 4);
    cr_assert_eq(info.counters.restarts, 1);
    cr_assert_eq(info.state, KM_FEED_STATE_LIVE);
    cr_assert_eq(info.expected_seq, 10);
    km_feed_window win[4];
    cr_assert_eq(fx_windows(&f, 4, win, 4), 2);
    cr_assert_eq(win[1].cause, KM_FEED_WINDOW_RESTART);
    cr_assert_eq(win[1].end, KM_FEED_END_RECOVERED);
    cr_assert_eq(win[1].from_seq, 0);
    cr_assert_eq(win[1].duration_ns, 0);
    fx_free(&f);
}

Test(feed, restart_seen_late_replays_the_new_stream, .timeout = 10)
{
    fx f;
    fx_init(&f);
    fx_add(&f, 0, true);
    km_feed_action a = fx_action(&f, KM_FEED_ACTION_REPLAY_REQUEST);
    fx_end(&f, 0, a.request_id);
    fx_make(&f, 30, 0);
    fx_live_range(&f, 0, 0, 30);
    km_test_engine_restart(&f.engine, 0x4242);
    f.seq_base = f.n;
    fx_make(&f, 12, 0);
    fx_live(&f, 0, 4); /* 0..3 of the new process missed */
    a = fx_action(&f, KM_FEED_ACTION_REPLAY_REQUEST);
    cr_assert_eq(a.start_seq, 0);
    km_feed_worker_info info = fx_info(&f, 0);
    cr_assert_eq(info.counters.restarts, 1);
    cr_assert_eq(info.state, KM_FEED_STATE_GAP);
    fx_live(&f, 0, 5);
    fx_items(&f, 0, a.request_id, 0, 6);
    fx_end(&f, 0, a.request_id);
    fx_live_range(&f, 0, 6, 12);
    fx_check_truth(&f, 0);
    info = fx_info(&f, 0);
    cr_assert_eq(info.state, KM_FEED_STATE_LIVE);
    cr_assert_eq(info.counters.lost, 0);
    km_feed_window win[4];
    uint32_t n = fx_windows(&f, 0, win, 4);
    cr_assert_eq(n, 2);
    cr_assert_eq(win[1].cause, KM_FEED_WINDOW_RESTART);
    cr_assert_eq(win[1].end, KM_FEED_END_RECOVERED);
    cr_assert_eq(win[1].from_seq, 4);
    cr_assert_eq(win[1].replayed, 6);
    fx_free(&f);
}

Test(feed, restart_during_a_replay_cancels_it, .timeout = 10)
{
    fx f;
    fx_init(&f);
    fx_add(&f, 0, true);
    km_feed_action a = fx_action(&f, KM_FEED_ACTION_REPLAY_REQUEST);
    fx_end(&f, 0, a.request_id);
    fx_make(&f, 20, 0);
    fx_live_range(&f, 0, 0, 10);
    fx_live(&f, 0, 15);
    a = fx_action(&f, KM_FEED_ACTION_REPLAY_REQUEST);
    km_test_engine_restart(&f.engine, 0x77);
    f.seq_base = f.n;
    fx_make(&f, 5, 0);
    fx_live(&f, 0, 0); /* 0 <= 15: new process */
    km_feed_action c = fx_action(&f, KM_FEED_ACTION_REPLAY_CANCEL);
    cr_assert_eq(c.request_id, a.request_id);
    fx_no_action(&f);
    fx_live_range(&f, 0, 1, 5);
    /* The old request's answers are ignored. */
    cr_assert_eq(km_feed_replay_end(f.feed, 0, a.request_id, f.now++), KM_OK);
    km_feed_worker_info info = fx_info(&f, 0);
    cr_assert_eq(info.counters.stale_replay_items, 1);
    cr_assert_eq(info.counters.restarts, 1);
    cr_assert_eq(info.state, KM_FEED_STATE_LIVE);
    fx_check_truth(&f, 0);
    km_feed_window win[4];
    cr_assert_eq(fx_windows(&f, 0, win, 4), 3);
    cr_assert_eq(win[1].cause, KM_FEED_WINDOW_GAP);
    cr_assert_eq(win[1].end, KM_FEED_END_RESTART);
    cr_assert_eq(win[2].cause, KM_FEED_WINDOW_RESTART);
    fx_free(&f);
}

Test(feed, late_live_copy_of_a_replayed_message_is_a_duplicate, .timeout = 10)
{
    fx f;
    fx_init(&f);
    fx_add(&f, 0, true);
    km_feed_action a = fx_action(&f, KM_FEED_ACTION_REPLAY_REQUEST);
    fx_make(&f, 30, 0);
    fx_items(&f, 0, a.request_id, 0, 20);
    fx_end(&f, 0, a.request_id);
    /* Live copies of 18 and 19 arrive after the replay delivered them (different sockets). */
    fx_live_range(&f, 0, 18, 30);
    km_feed_worker_info info = fx_info(&f, 0);
    cr_assert_eq(info.counters.restarts, 0);
    cr_assert_eq(info.counters.duplicates, 2);
    cr_assert_eq(info.state, KM_FEED_STATE_LIVE);
    fx_check_truth(&f, 0);

    /* Same situation, but what arrives at seq 5 is a different message: a new process. */
    fx g;
    fx_init(&g);
    fx_add(&g, 0, true);
    a = fx_action(&g, KM_FEED_ACTION_REPLAY_REQUEST);
    fx_make(&g, 20, 0);
    fx_items(&g, 0, a.request_id, 0, 20);
    fx_end(&g, 0, a.request_id);
    km_test_engine_restart(&g.engine, 0x31337);
    g.seq_base = g.n;
    fx_make(&g, 8, 0);
    fx_live_range(&g, 0, 0, 8);
    info = fx_info(&g, 0);
    cr_assert_eq(info.counters.restarts, 1);
    fx_check_truth(&g, 0);
    fx_free(&f);
    fx_free(&g);
}

/* A gap replay from seq 5 answers items no request from 5 can return: a rejected payload whose seq
 * frame reads 2^40, a decodable message at 2^40 (past the newest seq the live stream has shown,
 * 6), one at 2^64-1 and one at 3 (below the start), and a rejected payload at 6 (not the next seq
 * to apply, so its seq is not trusted). Each is refused and counted; the real items then fill the
 * gap, nothing is lost, and the engine's later live messages all apply (none skipped as a late
 * copy of a lost seq). */
Test(feed, replay_items_outside_the_request_are_refused, .timeout = 10)
{
    fx f;
    fx_init(&f);
    fx_add(&f, 0, true);
    km_feed_action a = fx_action(&f, KM_FEED_ACTION_REPLAY_REQUEST);
    fx_end(&f, 0, a.request_id);
    fx_make(&f, 20, 0);
    fx_live_range(&f, 0, 0, 5);
    fx_live(&f, 0, 6); /* 5 dropped on the wire */
    a = fx_action(&f, KM_FEED_ACTION_REPLAY_REQUEST);
    cr_assert_eq(a.start_seq, 5);

    const uint64_t far = UINT64_C(1) << 40;
    km_kv_batch real5 = fx_decode(&f, 5);
    struct {
        uint64_t seq;
        const km_kv_batch *batch;
    } bad[5] = {{far, NULL}, {far, &real5}, {UINT64_MAX, &real5}, {3, &real5}, {6, NULL}};
    for (int i = 0; i < 5; i++) {
        cr_assert_eq(km_feed_replay_item(f.feed, 0, a.request_id, bad[i].seq, bad[i].batch,
                                         f.now++),
                     KM_OK);
        km_feed_worker_info info = fx_info(&f, 0);
        cr_assert_eq(info.expected_seq, 5, "item %d (seq %" PRIu64 ") moved the stream", i,
                     bad[i].seq);
        cr_assert_eq(info.counters.lost, 0);
        cr_assert_eq(info.state, KM_FEED_STATE_GAP);
        cr_assert_eq(info.counters.refused_replay_items, (uint64_t)i + 1);
    }
    fx_items(&f, 0, a.request_id, 5, 7);
    fx_end(&f, 0, a.request_id);
    fx_live_range(&f, 0, 7, 20);
    fx_no_action(&f);
    fx_check_truth(&f, 0);
    km_feed_worker_info info = fx_info(&f, 0);
    cr_assert_eq(info.state, KM_FEED_STATE_LIVE);
    cr_assert_eq(info.expected_seq, 20);
    cr_assert_eq(info.counters.refused_replay_items, 5);
    cr_assert_eq(info.counters.malformed, 2);
    cr_assert_eq(info.counters.replayed, 2);
    cr_assert_eq(info.counters.lost, 0);
    cr_assert_eq(info.counters.late_lost, 0);
    cr_assert_eq(info.counters.duplicates, 1, "the buffered live copy of 6");
    km_feed_window win[4];
    cr_assert_eq(fx_windows(&f, 0, win, 4), 2);
    cr_assert_eq(win[1].cause, KM_FEED_WINDOW_GAP);
    cr_assert_eq(win[1].end, KM_FEED_END_RECOVERED);
    fx_free(&f);
}

/* A bootstrap replay whose first item is a rejected payload with a wild seq: that seq does not
 * set the stream position; the first item that decodes does. */
Test(feed, a_rejected_bootstrap_item_does_not_set_the_position, .timeout = 10)
{
    fx f;
    fx_init(&f);
    fx_add(&f, 0, true);
    km_feed_action a = fx_action(&f, KM_FEED_ACTION_REPLAY_REQUEST);
    fx_make(&f, 10, 0);
    cr_assert_eq(km_feed_replay_item(f.feed, 0, a.request_id, UINT64_C(1) << 40, NULL, f.now++),
                 KM_OK);
    cr_assert_eq(fx_info(&f, 0).has_expected_seq, false);
    fx_items(&f, 0, a.request_id, 0, 6);
    fx_end(&f, 0, a.request_id);
    fx_live_range(&f, 0, 6, 10);
    fx_no_action(&f);
    fx_check_truth(&f, 0);
    km_feed_worker_info info = fx_info(&f, 0);
    cr_assert_eq(info.state, KM_FEED_STATE_LIVE);
    cr_assert_eq(info.expected_seq, 10);
    cr_assert_eq(info.counters.refused_replay_items, 1);
    cr_assert_eq(info.counters.history_unavailable, 0);
    cr_assert_eq(info.counters.restarts, 0);
    cr_assert_eq(info.counters.lost, 0);
    fx_free(&f);
}

/* A bootstrap replay whose first item decodes but lies past the live stream: live messages 8 and 9
 * arrived while the request ran, so the engine's oldest buffered message is at most 10 (unless the
 * live socket lagged by more than its whole buffer). Such a first item is not taken as given:
 * it would set the position far ahead, its blocks would be indexed, the held live messages and the
 * real history skipped as duplicates, and the next live message read as an engine restart (the
 * worker cleared and replayed again). Refused, like a gap replay's skip past the live stream; the
 * real history that follows sets the position. */
Test(feed, a_first_bootstrap_item_past_the_live_stream_is_refused, .timeout = 10)
{
    fx f;
    fx_init(&f);
    fx_make(&f, 12, 0);
    fx_add(&f, 0, true);
    km_feed_action a = fx_action(&f, KM_FEED_ACTION_REPLAY_REQUEST);
    fx_live_range(&f, 0, 8, 10);
    km_kv_batch real5 = fx_decode(&f, 5);
    cr_assert_eq(km_feed_replay_item(f.feed, 0, a.request_id, UINT64_C(1) << 40, &real5, f.now++),
                 KM_OK);
    km_feed_worker_info info = fx_info(&f, 0);
    cr_assert_eq(info.counters.refused_replay_items, 1, "the wild first item was taken");
    cr_assert_eq(info.has_expected_seq, false);
    fx_items(&f, 0, a.request_id, 0, 10);
    fx_end(&f, 0, a.request_id);
    fx_live_range(&f, 0, 10, 12);
    fx_no_action(&f);
    fx_check_truth(&f, 0);
    info = fx_info(&f, 0);
    cr_assert_eq(info.state, KM_FEED_STATE_LIVE);
    cr_assert_eq(info.expected_seq, 12);
    cr_assert_eq(info.counters.history_unavailable, 0);
    cr_assert_eq(info.counters.restarts, 0);
    cr_assert_eq(info.counters.lost, 0);
    fx_free(&f);
}

/* A bootstrap answer every item of which lies past the live stream (the live socket lags by more
 * than the engine's whole buffer: it holds 20..29 while live messages 8 and 9 have arrived) is not
 * an empty answer: the engine had published, so its stream does not start at 0. As after a failed
 * bootstrap, the first live message held sets the position; the seqs before it are history from
 * before the worker joined (history_unavailable), not lost, and the refused seqs arrive live. */
Test(feed, a_bootstrap_answer_wholly_past_the_live_stream_is_no_empty_one, .timeout = 10)
{
    fx f;
    fx_init(&f);
    fx_make(&f, 40, 0);
    fx_add(&f, 0, true);
    km_feed_action a = fx_action(&f, KM_FEED_ACTION_REPLAY_REQUEST);
    fx_live_range(&f, 0, 8, 10);
    fx_items(&f, 0, a.request_id, 20, 30);
    fx_end(&f, 0, a.request_id);
    km_feed_worker_info info = fx_info(&f, 0);
    cr_assert_eq(info.counters.refused_replay_items, 10);
    cr_assert_eq(info.expected_seq, 10);
    fx_no_action(&f);
    fx_live_range(&f, 0, 10, 40);
    fx_no_action(&f);
    info = fx_info(&f, 0);
    cr_assert_eq(info.state, KM_FEED_STATE_LIVE);
    cr_assert_eq(info.expected_seq, 40);
    cr_assert_eq(info.counters.history_unavailable, 8);
    cr_assert_eq(info.counters.lost, 0);
    cr_assert_eq(info.counters.gaps, 0);
    km_feed_window win[4];
    cr_assert_eq(fx_windows(&f, 0, win, 4), 1);
    cr_assert_eq(win[0].cause, KM_FEED_WINDOW_STARTUP);
    cr_assert_eq(win[0].end, KM_FEED_END_RECOVERED);
    fx_free(&f);
}

Test(feed, resync_rebuilds_a_degraded_worker, .timeout = 10)
{
    fx f;
    fx_init(&f);
    degrade_by_late_replay(&f, 0);
    fx_live_range(&f, 0, 31, 40);
    cr_assert_eq(km_feed_resync_worker(f.feed, 0, f.now++), KM_OK);
    km_feed_action a = fx_action(&f, KM_FEED_ACTION_REPLAY_REQUEST);
    cr_assert_eq(a.start_seq, 0);
    cr_assert_eq(fx_info(&f, 0).state, KM_FEED_STATE_SYNCING);
    fx_items(&f, 0, a.request_id, 0, 60); /* the engine still has its whole history */
    fx_end(&f, 0, a.request_id);
    fx_check_truth(&f, 0);
    km_feed_worker_info info = fx_info(&f, 0);
    cr_assert_eq(info.state, KM_FEED_STATE_LIVE);
    km_feed_window win[8];
    uint32_t n = fx_windows(&f, 0, win, 8);
    cr_assert_eq(n, 4);
    cr_assert_eq(win[2].cause, KM_FEED_WINDOW_DEGRADED);
    cr_assert_eq(win[2].end, KM_FEED_END_RESYNC);
    cr_assert_eq(win[3].cause, KM_FEED_WINDOW_RESYNC);
    cr_assert_eq(win[3].end, KM_FEED_END_RECOVERED);
    fx_free(&f);
}

Test(feed, malformed_messages_are_counted_and_skipped, .timeout = 10)
{
    fx f;
    fx_init(&f);
    fx_add(&f, 0, false);
    fx_make(&f, 6, 0);
    fx_live_range(&f, 0, 0, 3);
    /* seq 3's payload could not be decoded; then a message with no readable seq at all */
    cr_assert_eq(km_feed_live(f.feed, 0, 3, NULL, f.now++), KM_OK);
    cr_assert_eq(km_feed_malformed(f.feed, 0, KM_KV_SOURCE_SUBSCRIBER, NULL, f.now++), KM_OK);
    fx_live_range(&f, 0, 4, 6);
    km_feed_worker_info info = fx_info(&f, 0);
    cr_assert_eq(info.counters.malformed, 2);
    cr_assert_eq(info.counters.gaps, 0);
    cr_assert_eq(info.state, KM_FEED_STATE_LIVE);
    cr_assert_eq(info.expected_seq, 6);
    cr_assert_eq(info.counters.messages, 7, "live messages, the malformed ones included");
    /* One from the replay socket is no live message. */
    cr_assert_eq(km_feed_malformed(f.feed, 0, KM_KV_SOURCE_REPLAY, NULL, f.now++), KM_OK);
    info = fx_info(&f, 0);
    cr_assert_eq(info.counters.malformed, 3);
    cr_assert_eq(info.counters.messages, 7);
    fx_free(&f);
}

/* A live message whose seq cannot be trusted changes nothing but the malformed counter: seq 2^64-1
 * (the replay end marker's, never a message's, decodable or not) and the readable seq of a
 * rejected payload that is not the next one (far ahead, before any live message, or at or below
 * the last live seq). None of them may wrap or move the stream position, make the worker
 * DEGRADED, or make the engine's next healthy message look like a gap (a replay request) or an
 * engine restart (its blocks dropped). */
Test(feed, a_live_message_with_an_untrusted_seq_moves_nothing, .timeout = 10)
{
    for (int with_replay = 0; with_replay < 2; with_replay++) {
        fx f;
        fx_init(&f);
        fx_add(&f, 0, with_replay);
        if (with_replay) {
            km_feed_action a = fx_action(&f, KM_FEED_ACTION_REPLAY_REQUEST);
            fx_end(&f, 0, a.request_id); /* the engine had published nothing */
        }
        fx_make(&f, 12, 0);
        uint32_t malformed = 0;
        /* Before any live message: a rejected payload far ahead does not set the position. */
        cr_assert_eq(km_feed_live(f.feed, 0, UINT64_C(1) << 40, NULL, f.now++), KM_OK);
        malformed++;
        fx_live_range(&f, 0, 0, 4);
        km_kv_batch next = fx_decode(&f, 4);
        const uint64_t wild[4] = {UINT64_MAX, UINT64_MAX, UINT64_C(1) << 40, 2};
        for (int i = 0; i < 4; i++) {
            /* The second 2^64-1 carries a decodable payload (the engine's seq 4 message). */
            const km_kv_batch *b = i == 1 ? &next : NULL;
            cr_assert_eq(km_feed_live(f.feed, 0, wild[i], b, f.now++), KM_OK);
            malformed++;
            km_feed_worker_info info = fx_info(&f, 0);
            cr_assert_eq(info.state, KM_FEED_STATE_LIVE, "after seq %" PRIu64 ": %s", wild[i],
                         km_feed_state_name(info.state));
            cr_assert_eq(info.expected_seq, 4, "after seq %" PRIu64, wild[i]);
            cr_assert_eq(info.counters.malformed, malformed);
        }
        fx_no_action(&f);
        /* The engine goes on with seq 4: applied as the next message. */
        fx_live_range(&f, 0, 4, 12);
        fx_no_action(&f);
        fx_check_truth(&f, 0);
        km_feed_worker_info info = fx_info(&f, 0);
        cr_assert_eq(info.state, KM_FEED_STATE_LIVE);
        cr_assert_eq(info.expected_seq, 12);
        cr_assert_eq(info.counters.malformed, 5);
        cr_assert_eq(info.counters.messages, 17);
        cr_assert_eq(info.counters.restarts, 0);
        cr_assert_eq(info.counters.gaps, 0);
        cr_assert_eq(info.counters.lost, 0);
        cr_assert_eq(info.counters.history_unavailable, 0);
        cr_assert_eq(info.counters.duplicates, 0);
        cr_assert_eq(info.counters.replay_requests, (uint64_t)with_replay);
        fx_free(&f);
    }
}

Test(feed, windows_history_is_bounded, .timeout = 10)
{
    km_feed_config cfg;
    km_test_feed_config(&cfg, BS);
    cfg.max_windows = 3;
    fx f;
    fx_init_cfg(&f, &cfg, KM_TEST_ENCODING_POSITIONAL, KM_TEST_HASH_INT);
    fx_add(&f, 0, false);
    fx_make(&f, 40, 0);
    for (uint64_t s = 0; s < 40; s += 4)
        fx_live(&f, 0, s); /* a gap every time: 9 gap windows */
    km_feed_worker_info info = fx_info(&f, 0);
    cr_assert_eq(info.windows_total, 11); /* startup + 9 gaps + degraded */
    cr_assert_eq(info.windows_open, 1);
    cr_assert_eq(info.windows_kept, 4);
    km_feed_window win[8];
    cr_assert_eq(fx_windows(&f, 0, win, 8), 4);
    for (int i = 0; i < 3; i++)
        cr_assert_eq(win[i].cause, KM_FEED_WINDOW_GAP);
    cr_assert_eq(win[3].cause, KM_FEED_WINDOW_DEGRADED);
    cr_assert_eq(win[2].from_seq, 33);
    cr_assert_eq(info.counters.lost, 27);
    fx_free(&f);
}

Test(feed, workers_come_and_go, .timeout = 10)
{
    fx f;
    fx_init(&f);
    km_feed_worker_config bad = {16, "x", false};
    cr_assert_eq(km_feed_add_worker(f.feed, &bad, 1), KM_ERR_WORKER_RANGE);
    fx_add(&f, 2, false);
    km_feed_worker_config dup = {2, "again", false};
    cr_assert_eq(km_feed_add_worker(f.feed, &dup, 1), KM_ERR_INVALID_ARGUMENT);
    cr_assert_eq(km_feed_live(f.feed, 9, 0, NULL, 1), KM_ERR_INVALID_ARGUMENT);
    cr_assert_eq(km_feed_remove_worker(f.feed, 9, 1), KM_ERR_INVALID_ARGUMENT);
    fx_add(&f, 0, false);
    uint32_t ids[4], n;
    cr_assert_eq(km_feed_get_workers(f.feed, ids, 4, &n), KM_OK);
    cr_assert_eq(n, 2);
    cr_assert_eq(ids[0], 0);
    cr_assert_eq(ids[1], 2);
    fx_make(&f, 10, 0);
    fx_live_range(&f, 2, 0, 10);
    cr_assert_eq(km_feed_remove_worker(f.feed, 2, f.now++), KM_OK);
    fx_flush(&f);
    km_worker_stats ws;
    km_index_worker_stats(f.index, 2, &ws);
    cr_assert_eq(ws.blocks, 0);
    cr_assert_eq(km_feed_get_worker_info(f.feed, 2, &(km_feed_worker_info){0}),
                 KM_ERR_INVALID_ARGUMENT);
    /* Added again: a fresh start (seq 5 is just a position, not a restart). */
    fx_add(&f, 2, false);
    fx_live_range(&f, 2, 5, 10);
    km_feed_worker_info info = fx_info(&f, 2);
    cr_assert_eq(info.counters.restarts, 0);
    cr_assert_eq(info.counters.history_unavailable, 5);
    fx_free(&f);
}

/* A capped index, a feed over it with workers 0 and 1, and the test engine that makes their
 * messages: an index that cannot grow past its first 64 slots. */
/* Runs told through km_feed_config.on_stored. */
typedef struct told {
    uint64_t runs, hashes;
    uint32_t workers_seen; /* bit per worker */
} told;

static void tell(void *user, uint32_t worker_id, const uint64_t *hashes, size_t n)
{
    told *t = user;
    cr_assert(hashes && n > 0 && worker_id < 32);
    t->runs++;
    t->hashes += n;
    t->workers_seen |= 1u << worker_id;
}

/* The capped fixture's feed tells these (NULL: nobody). */
static told *g_capped_told;

typedef struct capped {
    km_index *index;
    km_feed *feed;
    km_kv_decoder *dec;
    km_test_engine eng;
    km_rng rng;
    km_test_batch b;
} capped;

static void capped_init_with(capped *c, km_feed_degraded_policy policy)
{
    km_index_config ic;
    km_test_config(&ic, NULL);
    ic.backend = KM_BACKEND_CPU;
    ic.max_workers = 4;
    ic.threads = 1;
    ic.initial_blocks = 64;
    ic.segment_blocks = 0;
    km_index *probe = NULL;
    cr_assert_eq(km_index_create(&ic, &probe), KM_OK);
    km_index_stats st;
    km_index_get_stats(probe, &st);
    km_index_destroy(probe);
    ic.memory_cap_bytes = st.memory_bytes;
    cr_assert_eq(km_index_create(&ic, &c->index), KM_OK);
    km_feed_config cfg;
    km_test_feed_config(&cfg, BS);
    cfg.offload_chunk_blocks = 2;
    cfg.degraded_policy = policy;
    cfg.on_stored = g_capped_told ? tell : NULL;
    cfg.on_stored_user = g_capped_told;
    cr_assert_eq(km_feed_create(c->index, &cfg, &c->feed), KM_OK);
    km_feed_worker_config w0 = {0, "small", false}, w1 = {1, "big", false};
    cr_assert_eq(km_feed_add_worker(c->feed, &w0, 1), KM_OK);
    cr_assert_eq(km_feed_add_worker(c->feed, &w1, 1), KM_OK);
    cr_assert_eq(km_kv_decoder_create(NULL, &c->dec), KM_OK);
    km_test_engine_init(&c->eng, BS, 5);
    km_rng_init(&c->rng, 1);
    km_test_batch_init(&c->b, KM_TEST_ENCODING_POSITIONAL, KM_TEST_HASH_INT, -1);
}

static void capped_init(capped *c)
{
    capped_init_with(c, KM_FEED_DEGRADED_KEEP_FLAGGED);
}

/* The message built in c->b, live to worker w at seq. */
static void capped_send(capped *c, uint32_t w, uint64_t seq)
{
    size_t size;
    const void *p = km_test_batch_payload(&c->b, &size);
    km_kv_batch kb;
    cr_assert_eq(km_kv_decode_payload(c->dec, p, size, &kb), KM_OK);
    cr_assert_eq(km_feed_live(c->feed, w, seq, &kb, 10 + seq), KM_OK);
    km_test_batch_reset(&c->b);
}

/* The engine e evicts its blocks [first, first + n) (in `medium`, NULL: the GPU), into b. */
static void engine_evict(km_test_engine *e, km_test_batch *b, size_t first, uint32_t n,
                         const char *medium)
{
    uint64_t hashes[64];
    cr_assert(n <= 64);
    for (uint32_t i = 0; i < n; i++) {
        hashes[i] = e->blocks[first + i].engine_hash;
        e->blocks[first + i].cached = false;
    }
    km_test_batch_removed(b, hashes, n, medium);
}

/* The engine e stores its blocks [first, first + n) again, a run made by one km_test_engine_store
 * (in `medium`, NULL: the GPU), into b. */
static void engine_store_again(km_test_engine *e, km_test_batch *b, size_t first, uint32_t n,
                               const char *medium)
{
    uint64_t hashes[64];
    uint32_t tokens[64 * BS];
    cr_assert(n <= 64);
    for (uint32_t i = 0; i < n; i++) {
        hashes[i] = e->blocks[first + i].engine_hash;
        memcpy(tokens + (size_t)i * BS, e->blocks[first + i].tokens, BS * sizeof *tokens);
        e->blocks[first + i].cached = true;
    }
    int64_t parent = e->blocks[first].parent;
    km_test_batch_stored(b, hashes, n, parent >= 0, parent >= 0 ? e->blocks[parent].engine_hash : 0,
                         tokens, BS, NULL, medium);
}

/* Every pair the index holds for worker w is a block the engine e holds; with `exact`, the index
 * holds all of them too. Returns how many the index holds. */
static uint64_t check_against_engine(const km_index *index, uint32_t w, const km_test_engine *e,
                                     bool exact, const char *when)
{
    size_t n;
    uint64_t *chains = km_test_engine_chains(e, false, &n);
    km_worker_stats ws;
    km_index_worker_stats(index, w, &ws);
    uint64_t held = 0;
    for (size_t i = 0; i < n; i++) {
        km_tier tier;
        held += km_index_pair_tier(index, chains[i], w, &tier) == KM_OK;
    }
    free(chains);
    KM_CHECK(held == ws.blocks,
             "%s: worker %u: %llu of its %llu indexed blocks are not held by the engine", when, w,
             (unsigned long long)(ws.blocks - held), (unsigned long long)ws.blocks);
    if (exact)
        KM_CHECK(held == n, "%s: worker %u: the index lacks %llu of the engine's %zu blocks", when,
                 w, (unsigned long long)(n - held), n);
    return ws.blocks;
}

/* One message of `stores` stores of `blocks` blocks each, live to worker w at seq. */
static void capped_live(capped *c, uint32_t w, uint64_t seq, int stores, uint32_t blocks)
{
    km_test_batch_reset(&c->b);
    for (int i = 0; i < stores; i++)
        km_test_engine_store(&c->eng, &c->rng, &c->b, -1, blocks);
    size_t size;
    const void *p = km_test_batch_payload(&c->b, &size);
    km_kv_batch kb;
    cr_assert_eq(km_kv_decode_payload(c->dec, p, size, &kb), KM_OK);
    cr_assert_eq(km_feed_live(c->feed, w, seq, &kb, 10 + seq), KM_OK);
}

static void capped_free(capped *c)
{
    km_test_batch_free(&c->b);
    km_test_engine_free(&c->eng);
    km_kv_decoder_destroy(c->dec);
    km_feed_destroy(c->feed);
    km_index_destroy(c->index);
}

/* An engine's AllBlocksCleared in a message the index refuses (its stores do not fit under the
 * memory cap) still clears the worker in the index: the map has dropped every block before the
 * clear, so no later removal could take them out. The stores after it are lost: DEGRADED. */
Test(feed, a_clear_in_a_refused_message_still_clears_the_worker, .timeout = 20)
{
    capped c;
    capped_init(&c);
    capped_live(&c, 1, 0, 1, 2);
    km_feed_flush_stats fs;
    cr_assert_eq(km_feed_flush(c.feed, 3, &fs), KM_OK);
    km_worker_stats ws;
    km_index_worker_stats(c.index, 1, &ws);
    cr_assert_eq(ws.blocks, 2);
    km_test_batch_reset(&c.b);
    km_test_batch_cleared(&c.b);
    for (int i = 0; i < 8; i++)
        km_test_engine_store(&c.eng, &c.rng, &c.b, -1, 64); /* 512 blocks: past the cap */
    size_t size;
    const void *p = km_test_batch_payload(&c.b, &size);
    km_kv_batch kb;
    cr_assert_eq(km_kv_decode_payload(c.dec, p, size, &kb), KM_OK);
    cr_assert_eq(km_feed_live(c.feed, 1, 1, &kb, 11), KM_OK);
    cr_assert_eq(km_feed_flush(c.feed, 12, &fs), KM_ERR_MEMORY_CAP);
    cr_assert_eq(fs.groups_failed, 1);
    km_index_worker_stats(c.index, 1, &ws);
    cr_assert_eq(ws.blocks, 0, "the blocks from before the engine's clear are still indexed");
    km_feed_worker_info info;
    km_feed_get_worker_info(c.feed, 1, &info);
    cr_assert_eq(info.state, KM_FEED_STATE_DEGRADED);
    cr_assert_eq(info.map_entries, 0);
    char why[256];
    cr_assert_eq(km_feed_check_maps(c.feed, why, sizeof why), KM_OK, "%s", why);
    capped_free(&c);
}

/* An engine step that evicts old blocks and stores more than the capped index can take: the
 * message is refused, but its evictions still leave the index (the map has forgotten those blocks,
 * so no later removal could name them), and the room they held takes the engine's next stores. */
Test(feed, removals_in_a_refused_message_leave_the_index, .timeout = 20)
{
    capped c;
    capped_init(&c);
    size_t old = km_test_engine_store(&c.eng, &c.rng, &c.b, -1, 30);
    capped_send(&c, 1, 0);
    km_feed_flush_stats fs;
    cr_assert_eq(km_feed_flush(c.feed, 1, &fs), KM_OK);
    cr_assert_eq(check_against_engine(c.index, 1, &c.eng, true, "30 stored"), 30);

    engine_evict(&c.eng, &c.b, old, 30, NULL);
    for (int i = 0; i < 4; i++)
        km_test_engine_store(&c.eng, &c.rng, &c.b, -1, 50); /* 200 blocks: past the cap */
    capped_send(&c, 1, 1);
    cr_assert_eq(km_feed_flush(c.feed, 2, &fs), KM_ERR_MEMORY_CAP);
    cr_assert_eq(fs.groups_failed, 1);
    cr_assert_eq(fs.index.removed, 30, "the refused message's removals: %llu pairs removed",
                 (unsigned long long)fs.index.removed);
    cr_assert_eq(fs.updates, 1, "its REMOVE counts as an applied update");
    cr_assert_eq(check_against_engine(c.index, 1, &c.eng, false, "evicted and refused"), 0);
    km_feed_worker_info info;
    km_feed_get_worker_info(c.feed, 1, &info);
    cr_assert_eq(info.state, KM_FEED_STATE_DEGRADED, "its stores are missing from the index");
    cr_assert_eq(info.map_entries, 0);
    cr_assert_eq(info.counters.refused_messages, 1);
    cr_assert_eq(info.counters.refused_events, 5);
    cr_assert_eq(info.counters.events, 1, "only the first message's event was applied");

    /* 40 blocks fit in the capped index beside nothing, not beside the 30 evicted ones. */
    size_t next = km_test_engine_store(&c.eng, &c.rng, &c.b, -1, 40);
    capped_send(&c, 1, 2);
    cr_assert_eq(km_feed_flush(c.feed, 3, &fs), KM_OK, "the evicted blocks still take room");
    cr_assert_eq(check_against_engine(c.index, 1, &c.eng, false, "40 more"), 40);
    engine_evict(&c.eng, &c.b, next, 40, NULL);
    capped_send(&c, 1, 3);
    cr_assert_eq(km_feed_flush(c.feed, 4, &fs), KM_OK);
    cr_assert_eq(check_against_engine(c.index, 1, &c.eng, false, "all evicted"), 0);
    km_feed_get_worker_info(c.feed, 1, &info);
    cr_assert_eq(info.counters.unknown_removes, 0);
    char why[256];
    cr_assert_eq(km_feed_check_maps(c.feed, why, sizeof why), KM_OK, "%s", why);
    capped_free(&c);
}

/* Two messages of one worker in one flush: the first, refused, stored blocks X and more than the
 * capped index can take; the second, applied, is the engine's AllBlocksCleared and X stored again.
 * The map keeps X (the index holds it, and only the map can name it to the engine's removal), and
 * the clear leaves the refusal nothing missing: the worker is not DEGRADED. */
Test(feed, a_refused_message_does_not_forget_keys_a_later_message_stored, .timeout = 20)
{
    capped c;
    capped_init(&c);
    size_t x = km_test_engine_store(&c.eng, &c.rng, &c.b, -1, 3);
    for (int i = 0; i < 4; i++)
        km_test_engine_store(&c.eng, &c.rng, &c.b, -1, 50);
    capped_send(&c, 1, 0);
    km_test_batch_cleared(&c.b);
    for (size_t i = 0; i < c.eng.n_blocks; i++)
        c.eng.blocks[i].cached = false;
    engine_store_again(&c.eng, &c.b, x, 3, NULL);
    capped_send(&c, 1, 1);
    km_feed_flush_stats fs;
    cr_assert_eq(km_feed_flush(c.feed, 2, &fs), KM_ERR_MEMORY_CAP);
    cr_assert_eq(fs.groups_failed, 1);
    cr_assert_eq(check_against_engine(c.index, 1, &c.eng, true, "cleared and X again"), 3);
    km_feed_worker_info info;
    km_feed_get_worker_info(c.feed, 1, &info);
    cr_assert_eq(info.map_entries, 3, "the map forgot the blocks the later message stored");
    cr_assert_eq(info.state, KM_FEED_STATE_LIVE, "state %s after the engine's clear",
                 km_feed_state_name(info.state));
    cr_assert_eq(info.counters.refused_messages, 1);
    cr_assert_eq(info.counters.dropped_messages, 1);

    engine_evict(&c.eng, &c.b, x, 3, NULL);
    capped_send(&c, 1, 2);
    cr_assert_eq(km_feed_flush(c.feed, 3, &fs), KM_OK);
    cr_assert_eq(check_against_engine(c.index, 1, &c.eng, true, "X evicted"), 0);
    km_feed_get_worker_info(c.feed, 1, &info);
    cr_assert_eq(info.counters.unknown_removes, 0);
    cr_assert_eq(info.map_entries, 0);

    /* Without a clear after it, a refused message leaves its worker DEGRADED. */
    for (int i = 0; i < 4; i++)
        km_test_engine_store(&c.eng, &c.rng, &c.b, -1, 50);
    capped_send(&c, 1, 3);
    km_test_engine_store(&c.eng, &c.rng, &c.b, -1, 2);
    capped_send(&c, 1, 4);
    cr_assert_eq(km_feed_flush(c.feed, 4, &fs), KM_ERR_MEMORY_CAP);
    cr_assert_eq(fs.groups_failed, 1);
    km_feed_get_worker_info(c.feed, 1, &info);
    cr_assert_eq(info.state, KM_FEED_STATE_DEGRADED);
    cr_assert_eq(info.counters.refused_messages, 2);
    cr_assert_eq(info.map_entries, 2);
    cr_assert_eq(check_against_engine(c.index, 1, &c.eng, false, "refused again"), 2);
    char why[256];
    cr_assert_eq(km_feed_check_maps(c.feed, why, sizeof why), KM_OK, "%s", why);
    capped_free(&c);
}

/* A refused message stored blocks X; a later message of the worker, applied in the same flush,
 * stored X again in another medium while the map still held it (so X is not new to that message).
 * The map keeps X, whose chain the index now holds, and the engine's removals of X from both media
 * take it out of the index. */
Test(feed, a_refused_message_does_not_forget_blocks_a_later_message_stored_again, .timeout = 20)
{
    capped c;
    capped_init(&c);
    size_t x = km_test_engine_store(&c.eng, &c.rng, &c.b, -1, 3);
    for (int i = 0; i < 4; i++)
        km_test_engine_store(&c.eng, &c.rng, &c.b, -1, 50);
    capped_send(&c, 1, 0);
    engine_store_again(&c.eng, &c.b, x, 3, "CPU");
    capped_send(&c, 1, 1);
    km_feed_flush_stats fs;
    cr_assert_eq(km_feed_flush(c.feed, 2, &fs), KM_ERR_MEMORY_CAP);
    cr_assert_eq(fs.groups_failed, 1);
    cr_assert_eq(check_against_engine(c.index, 1, &c.eng, false, "X again on the CPU"), 3);
    km_feed_worker_info info;
    km_feed_get_worker_info(c.feed, 1, &info);
    cr_assert_eq(info.map_entries, 3, "the map forgot the blocks the later message stored");
    cr_assert_eq(info.state, KM_FEED_STATE_DEGRADED);

    engine_evict(&c.eng, &c.b, x, 3, NULL);
    engine_evict(&c.eng, &c.b, x, 3, "CPU");
    capped_send(&c, 1, 2);
    cr_assert_eq(km_feed_flush(c.feed, 3, &fs), KM_OK);
    cr_assert_eq(check_against_engine(c.index, 1, &c.eng, false, "X evicted"), 0);
    km_feed_get_worker_info(c.feed, 1, &info);
    cr_assert_eq(info.counters.unknown_removes, 0);
    cr_assert_eq(info.map_entries, 0);
    char why[256];
    cr_assert_eq(km_feed_check_maps(c.feed, why, sizeof why), KM_OK, "%s", why);
    capped_free(&c);
}

/* Worker w of the capped fixture against its engine e after a flush: every block the index holds
 * for it and every engine hash its map holds are the engine's; not DEGRADED, the index and the map
 * hold all of the engine's blocks. Returns whether the worker is DEGRADED. */
static bool capped_check(capped *c, uint32_t w, const km_test_engine *e, const char *when)
{
    km_feed_worker_info info;
    cr_assert_eq(km_feed_get_worker_info(c->feed, w, &info), KM_OK);
    bool degraded = info.state == KM_FEED_STATE_DEGRADED;
    check_against_engine(c->index, w, e, !degraded, when);
    const worker *wk = km_feed_find_worker(c->feed, w);
    uint64_t mapped = 0, cached = 0;
    for (size_t i = 0; i < e->n_blocks; i++) {
        cached += e->blocks[i].cached;
        mapped += e->blocks[i].cached && km_emap_find(&wk->map, e->blocks[i].engine_hash);
    }
    KM_CHECK(mapped == info.map_entries, "%s: worker %u maps %llu engine hashes its engine let go",
             when, w, (unsigned long long)(info.map_entries - mapped));
    if (!degraded)
        KM_CHECK(mapped == cached, "%s: worker %u: the map lacks %llu of the engine's blocks", when,
                 w, (unsigned long long)(cached - mapped));
    char why[256];
    KM_CHECK(km_feed_check_maps(c->feed, why, sizeof why) == KM_OK, "%s: %s", when, why);
    return degraded;
}

/* Two workers' random engine steps against the capped index, some too big for it (refused),
 * flushed every few messages, under both DEGRADED policies: after every flush each worker is
 * checked against its engine (capped_check), so no refused message leaves a block its engine let
 * go in the index or the map, and a worker the engine cleared after a refusal is complete. */
Test(feed, refused_messages_leave_nothing_the_engine_let_go, .timeout = 60)
{
    uint64_t seed = km_test_seed();
    km_feed_degraded_policy policies[2] = {KM_FEED_DEGRADED_KEEP_FLAGGED, KM_FEED_DEGRADED_DROP};
    for (int p = 0; p < 2; p++) {
        capped c;
        capped_init_with(&c, policies[p]);
        km_rng_init(&c.rng, seed + (uint64_t)p);
        km_test_engine other;
        km_test_engine_init(&other, BS, 7);
        km_test_engine *eng[2] = {&other, &c.eng};
        uint64_t seq[2] = {0, 0}, refused = 0, applied = 0, complete_after_refusal = 0;
        char when[96];
        for (int round = 0; round < 1000; round++) {
            uint32_t w = km_rng_below(&c.rng, 2);
            km_test_engine *e = eng[w];
            km_test_engine_step(e, &c.rng, &c.b, 4, 5);
            bool big = km_rng_percent(&c.rng, 15);
            size_t run = 0;
            uint32_t run_blocks = 0;
            if (big) {
                uint32_t stores = 1 + km_rng_below(&c.rng, 3);
                for (uint32_t i = 0; i < stores; i++) {
                    uint32_t n = 20 + km_rng_below(&c.rng, 40);
                    size_t first = km_test_engine_store(e, &c.rng, &c.b, -1, n);
                    if (i == 0)
                        run = first, run_blocks = n;
                }
                km_test_engine_step(e, &c.rng, &c.b, 3, 10);
            }
            capped_send(&c, w, seq[w]++);
            if (big && km_rng_percent(&c.rng, 50)) {
                /* Before the next flush, the engine clears and stores some of those blocks again
                 * (their engine hashes are new to the map again, as after any clear). */
                km_test_batch_cleared(&c.b);
                for (size_t i = 0; i < e->n_blocks; i++)
                    e->blocks[i].cached = false;
                uint32_t again = 1 + km_rng_below(&c.rng, run_blocks < 5 ? run_blocks : 5);
                engine_store_again(e, &c.b, run, again, NULL);
                km_test_engine_step(e, &c.rng, &c.b, 2, 0);
                capped_send(&c, w, seq[w]++);
            }
            if (round < 999 && km_rng_below(&c.rng, 3))
                continue;
            km_feed_flush_stats fs;
            int rc = km_feed_flush(c.feed, 100 + (uint64_t)round, &fs);
            KM_CHECK(rc == KM_OK || rc == KM_ERR_MEMORY_CAP, "flush: %s", km_error_name(rc));
            refused += fs.groups_failed;
            applied += fs.groups;
            for (uint32_t v = 0; v < 2; v++) {
                snprintf(when, sizeof when, "policy %d, round %d", p, round);
                km_feed_worker_info info;
                km_feed_get_worker_info(c.feed, v, &info);
                if (!capped_check(&c, v, eng[v], when) && info.counters.refused_messages)
                    complete_after_refusal++;
            }
        }
        KM_CHECK(refused >= 10 && applied >= 100, "policy %d: %llu refused, %llu applied", p,
                 (unsigned long long)refused, (unsigned long long)applied);
        KM_CHECK(complete_after_refusal > 0, "policy %d: no worker was complete after a refusal",
                 p);
        km_test_engine_free(&other);
        capped_free(&c);
    }
}

/* Every pair a flush had the index store is told once (on_stored), by either way of flushing
 * (km_feed_flush, or take / apply / finish as the subscriber does), and a message the index
 * refused tells nothing. */
Test(feed, the_stores_the_index_took_are_told_once_each, .timeout = 20)
{
    told t = {0};
    km_feed_config cfg;
    km_test_feed_config(&cfg, BS);
    cfg.on_stored = tell;
    cfg.on_stored_user = &t;
    fx f;
    fx_init_cfg(&f, &cfg, KM_TEST_ENCODING_POSITIONAL, KM_TEST_HASH_INT);
    fx_add(&f, 2, false);
    uint64_t seq = 0, stores = 0;
    for (int round = 0; round < 60; round++) {
        uint64_t n = 1 + km_rng_below(&f.rng, 4);
        fx_make(&f, n, 5);
        fx_live_range(&f, 2, seq, seq + n);
        seq += n;
        km_feed_flush_stats st;
        if (round % 2) {
            cr_assert_eq(km_feed_flush(f.feed, f.now++, &st), KM_OK);
        } else {
            bool taken = km_feed_flush_take(f.feed);
            if (taken)
                km_feed_flush_apply(f.feed);
            cr_assert_eq(km_feed_flush_finish(f.feed, f.now++, &st), KM_OK);
        }
        stores += st.index.stored + st.index.duplicate_stores;
        KM_CHECK(t.hashes == stores, "round %d: %" PRIu64 " hashes told, the index stored %" PRIu64,
                 round, t.hashes, stores);
        fx_check_truth(&f, 2);
    }
    cr_assert(t.runs > 0 && t.workers_seen == 1u << 2);
    fx_free(&f);

    told capped_told = {0};
    g_capped_told = &capped_told;
    capped c;
    capped_init(&c);
    g_capped_told = NULL;
    capped_live(&c, 0, 0, 1, 2);
    capped_live(&c, 1, 0, 8, 64); /* 512 blocks: refused at the cap */
    km_feed_flush_stats fs;
    cr_assert_eq(km_feed_flush(c.feed, 4, &fs), KM_ERR_MEMORY_CAP);
    cr_assert_eq(capped_told.hashes, 2, "the refused message's stores were told");
    cr_assert_eq(capped_told.workers_seen, 1u << 0);
    capped_free(&c);
}

Test(feed, flush_is_one_batch_and_survives_the_memory_cap, .timeout = 20)
{
    /* Queued updates reach the index only at flush, all together. */
    fx f;
    fx_init(&f);
    fx_add(&f, 0, false);
    fx_add(&f, 1, false);
    fx_make(&f, 10, 0);
    fx_live_range(&f, 0, 0, 10);
    km_index_stats st;
    km_index_get_stats(f.index, &st);
    cr_assert_eq(st.pairs, 0);
    uint64_t updates, hashes;
    km_feed_pending(f.feed, &updates, &hashes);
    cr_assert(updates > 2 && hashes > 0);
    km_feed_flush_stats fs;
    cr_assert_eq(km_feed_flush(f.feed, f.now++, &fs), KM_OK);
    cr_assert_eq(fs.updates, updates);
    cr_assert_eq(fs.groups_failed, 0);
    km_feed_pending(f.feed, &updates, &hashes);
    cr_assert_eq(updates, 0);
    fx_check_truth(&f, 0);
    fx_free(&f);

    /* An index at its memory cap: the batch is refused, then applied message by message; the
     * message that does not fit is dropped and its worker DEGRADED; the others apply. */
    capped c;
    capped_init(&c);
    capped_live(&c, 0, 0, 1, 2);
    capped_live(&c, 1, 0, 8, 64); /* 512 blocks: cannot fit in 64 slots */
    int rc = km_feed_flush(c.feed, 4, &fs);
    cr_assert_eq(rc, KM_ERR_MEMORY_CAP, "flush: %s", km_error_name(rc));
    cr_assert_eq(fs.groups_failed, 1);
    km_feed_pending(c.feed, &updates, &hashes);
    cr_assert_eq(updates, 0);
    km_worker_stats ws;
    km_index_worker_stats(c.index, 0, &ws);
    cr_assert_eq(ws.blocks, 2);
    km_index_worker_stats(c.index, 1, &ws);
    cr_assert_eq(ws.blocks, 0);
    km_feed_worker_info info;
    km_feed_get_worker_info(c.feed, 1, &info);
    cr_assert_eq(info.state, KM_FEED_STATE_DEGRADED);
    cr_assert_eq(info.counters.dropped_messages, 1);
    /* Refused: counted by cause, its events never counted as applied, and the engine hashes it
     * added to the map forgotten (memory outside the cap stays bounded while the cap holds). */
    cr_assert_eq(info.counters.refused_messages, 1);
    cr_assert_eq(info.counters.memory_cap_refusals, 1);
    cr_assert_eq(info.counters.refused_events, 8);
    cr_assert_eq(info.counters.events, 0, "refused events counted as applied");
    cr_assert_eq(info.map_entries, 0, "the refused message's engine hashes stay mapped");
    char why[256];
    cr_assert_eq(km_feed_check_maps(c.feed, why, sizeof why), KM_OK, "%s", why);
    cr_assert_eq(km_feed_find_worker(c.feed, 1)->map.parents.live, 0, "parents of forgotten blocks");
    cr_assert_eq(km_feed_find_worker(c.feed, 0)->map.parents.live, 1, "block 1's parent is kept");
    km_feed_get_worker_info(c.feed, 0, &info);
    cr_assert_eq(info.state, KM_FEED_STATE_LIVE);
    cr_assert_eq(info.counters.events, 1);
    cr_assert_eq(info.counters.refused_messages, 0);
    cr_assert_eq(info.map_entries, 2);
    /* The cap holding, message after message is refused: the map does not grow. */
    for (uint64_t seq = 1; seq <= 20; seq++) {
        capped_live(&c, 1, seq, 8, 64);
        cr_assert_eq(km_feed_flush(c.feed, 5 + seq, &fs), KM_ERR_MEMORY_CAP);
    }
    km_feed_get_worker_info(c.feed, 1, &info);
    cr_assert_eq(info.counters.refused_messages, 21);
    cr_assert_eq(info.counters.memory_cap_refusals, 21);
    cr_assert_eq(info.counters.refused_events, 168);
    cr_assert_eq(info.map_entries, 0);
    capped_free(&c);
}

/* The subscriber's flush in three steps (events/feed_flush_internal.h): taken under its lock,
 * applied outside it while the I/O thread queues more, finished under it. On random streams
 * the index, the counters and the maps end where a plain flush at the take leaves them, and so
 * does each position reported after the finish; while the taken updates are applied, the indexed
 * position stays that of the flush before and the state cannot be exported. */
Test(feed, a_flush_applied_outside_the_lock_equals_a_flush_at_its_take, .timeout = 30)
{
    uint64_t seed = km_test_seed();
    fx a, b;
    fx_init(&a);
    fx_init(&b);
    km_rng_init(&a.rng, seed);
    km_rng_init(&b.rng, seed);
    km_rng pick;
    km_rng_init(&pick, seed ^ 0x5eed);
    fx_add(&a, 0, false);
    fx_add(&b, 0, false);
    uint64_t next = 0;
    unsigned split_flushes = 0;
    for (int round = 0; round < 300; round++) {
        uint32_t k = 1 + km_rng_below(&pick, 4);
        fx_make(&a, k, 3);
        fx_make(&b, k, 3);
        fx_live_range(&a, 0, next, next + k);
        fx_live_range(&b, 0, next, next + k);
        next += k;
        if (km_rng_below(&pick, 2))
            continue;
        km_feed_worker_info before = fx_info(&b, 0);
        if (!km_feed_flush_take(b.feed)) {
            /* These messages queued no update (their events changed nothing in the index): the
             * finish alone, as the subscriber does then, publishes what a plain flush does. */
            cr_assert_not(km_feed_flush_in_flight(b.feed));
            km_feed_flush_stats fs;
            cr_assert_eq(km_feed_flush_finish(b.feed, b.now++, &fs), KM_OK, "finish: %s",
                         km_feed_last_error(b.feed));
            fx_flush(&a);
            km_feed_worker_info after = fx_info(&b, 0), plain = fx_info(&a, 0);
            cr_assert_eq(after.has_indexed_seq, plain.has_indexed_seq);
            cr_assert_eq(after.indexed_seq, plain.indexed_seq, "an empty take (round %d, seed %"
                         PRIu64 ")", round, seed);
            continue;
        }
        cr_assert(km_feed_flush_in_flight(b.feed));
        fx_flush(&a); /* the plain flush at the take */
        uint32_t m = km_rng_below(&pick, 4); /* queued while the index applies */
        fx_make(&a, m, 3);
        fx_make(&b, m, 3);
        fx_live_range(&a, 0, next, next + m);
        fx_live_range(&b, 0, next, next + m);
        next += m;
        km_feed_worker_info during = fx_info(&b, 0);
        cr_assert_eq(during.has_indexed_seq, before.has_indexed_seq);
        cr_assert_eq(during.indexed_seq, before.indexed_seq,
                     "the indexed position moved before the taken updates were applied");
        void *state = NULL;
        size_t size = 0;
        cr_assert_eq(km_feed_export_state(b.feed, &state, &size), KM_ERR_INVALID_ARGUMENT);
        km_feed_flush_apply(b.feed);
        km_feed_flush_stats fs;
        int rc = km_feed_flush_finish(b.feed, b.now++, &fs);
        cr_assert_eq(rc, KM_OK, "finish: %s", km_feed_last_error(b.feed));
        cr_assert_not(km_feed_flush_in_flight(b.feed));
        km_feed_worker_info after = fx_info(&b, 0), plain = fx_info(&a, 0);
        cr_assert_eq(after.expected_seq, next);
        cr_assert_eq(after.has_indexed_seq, plain.has_indexed_seq);
        cr_assert_eq(after.indexed_seq, plain.indexed_seq, "indexed %" PRIu64 " against %" PRIu64
                     " after a plain flush at the take (round %d)", after.indexed_seq,
                     plain.indexed_seq, round);
        split_flushes++;
    }
    cr_assert_gt(split_flushes, 50);
    fx_check_truth(&a, 0);
    fx_check_truth(&b, 0);
    km_feed_worker_info ia = fx_info(&a, 0), ib = fx_info(&b, 0);
    cr_assert_eq(ia.counters.events, ib.counters.events);
    cr_assert_eq(ia.indexed_seq, ib.indexed_seq);
    cr_assert_eq(ia.map_entries, ib.map_entries);
    km_index_stats sa, sb;
    km_index_get_stats(a.index, &sa);
    km_index_get_stats(b.index, &sb);
    cr_assert_eq(sa.pairs, sb.pairs);
    char why[256];
    cr_assert_eq(km_feed_check_maps(b.feed, why, sizeof why), KM_OK, "%s", why);
    fx_free(&a);
    fx_free(&b);
}

/* Taken, refused by the index at its memory cap, and put back in front of what was queued while
 * it was applied: the whole queue is flushed as one plain flush of the same messages would. */
Test(feed, a_refused_flush_taken_out_is_put_back_in_front, .timeout = 20)
{
    capped plain, split;
    capped_init(&plain);
    capped_init(&split);
    /* The same three messages to both: worker 0's small one, worker 1's too big one, then (while
     * the split feed's first two are being applied) worker 0's second. */
    capped_live(&plain, 0, 0, 1, 2);
    capped_live(&split, 0, 0, 1, 2);
    capped_live(&plain, 1, 0, 8, 64);
    capped_live(&split, 1, 0, 8, 64);
    cr_assert(km_feed_flush_take(split.feed));
    capped_live(&plain, 0, 1, 1, 1);
    capped_live(&split, 0, 1, 1, 1);
    km_feed_flush_apply(split.feed);
    km_feed_flush_stats fp, fs;
    int rp = km_feed_flush(plain.feed, 20, &fp);
    int rs = km_feed_flush_finish(split.feed, 20, &fs);
    cr_assert_eq(rp, KM_ERR_MEMORY_CAP);
    cr_assert_eq(rs, rp);
    cr_assert_eq(fs.groups_failed, fp.groups_failed);
    cr_assert_eq(fs.groups, fp.groups);
    cr_assert_eq(fs.updates, fp.updates);
    uint64_t updates, hashes;
    km_feed_pending(split.feed, &updates, &hashes);
    cr_assert_eq(updates, 0);
    for (uint32_t w = 0; w < 2; w++) {
        km_feed_worker_info ip, is;
        km_feed_get_worker_info(plain.feed, w, &ip);
        km_feed_get_worker_info(split.feed, w, &is);
        cr_assert_eq(is.state, ip.state, "worker %u", w);
        cr_assert_eq(is.counters.events, ip.counters.events, "worker %u", w);
        cr_assert_eq(is.counters.dropped_messages, ip.counters.dropped_messages, "worker %u", w);
        cr_assert_eq(is.counters.refused_events, ip.counters.refused_events, "worker %u", w);
        cr_assert_eq(is.map_entries, ip.map_entries, "worker %u", w);
        cr_assert_eq(is.indexed_seq, ip.indexed_seq, "worker %u", w);
        km_worker_stats wp, ws;
        km_index_worker_stats(plain.index, w, &wp);
        km_index_worker_stats(split.index, w, &ws);
        cr_assert_eq(ws.blocks, wp.blocks, "worker %u", w);
    }
    km_feed_worker_info i1, i0;
    km_feed_get_worker_info(split.feed, 1, &i1);
    cr_assert_eq(i1.state, KM_FEED_STATE_DEGRADED);
    km_feed_get_worker_info(split.feed, 0, &i0);
    cr_assert_eq(i0.counters.events, 2, "both of worker 0's messages applied");
    char why[256];
    cr_assert_eq(km_feed_check_maps(split.feed, why, sizeof why), KM_OK, "%s", why);
    capped_free(&plain);
    capped_free(&split);
}

/* Window rules follow the split flush's take as the updates do: a worker's first window group
 * and a worker's removal, queued while the taken updates are applied, change the index's rules
 * only with their own updates, at the next flush. Until then every worker scores exactly as after
 * a plain flush at the take (otherwise worker 0's new rule, ahead of its window blocks, would cut
 * its match to nothing, and worker 1's rule, cleared ahead of its removal, would let its full
 * attention prefix count past what its window group holds). Worker 2, removed and added again
 * under its id before the take, loses its old rule with the taken updates (else the old rule
 * would cut the new worker's blocks to nothing). */
Test(feed, window_rules_queued_while_a_flush_applies_wait_for_their_updates, .timeout = 10)
{
    km_rng r;
    km_rng_init(&r, km_test_seed());
    enum { N = 12 };
    uint32_t window = 1 + km_rng_below(&r, 3 * BS); /* tokens */
    uint32_t k = 1 + km_rng_below(&r, N - 1);       /* worker 1's window group holds [0, k) */
    uint32_t t[N * BS];
    for (uint32_t i = 0; i < N * BS; i++)
        t[i] = 40 + i;
    uint64_t eh[N], chains[N];
    for (uint32_t i = 0; i < N; i++)
        eh[i] = 700 + i;
    km_hash_config hc = {BS, NULL, NULL};
    size_t nb;
    cr_assert_eq(km_hash_sequence(&hc, t, N * BS, 0, KM_NO_PARENT, NULL, chains, &nb), KM_OK);
    fx plain, split;
    fx *both[2] = {&plain, &split};
    msgpack_sbuffer sb;
    for (int i = 0; i < 2; i++) {
        fx *f = both[i];
        fx_init(f);
        for (uint32_t w = 0; w < 3; w++)
            fx_add(f, w, false);
        /* Workers 1 and 2, hybrid from their first message: full attention holds all N blocks,
         * the window group the first k. Worker 0: full attention alone, all N. */
        group_event hybrid[2] = {{false, eh, N, false, 0, t, N * BS, 0, NULL, 0},
                                 {false, eh, k, false, 0, t, k * BS, 1, NULL, window}};
        for (uint32_t w = 1; w < 3; w++) {
            pack_group_batch(&sb, hybrid, 2);
            live_payload(f, w, 0, &sb);
        }
        fx_flush(f);
        cr_assert_eq(held_depth(f->index, 1, chains, N), k);
        cr_assert_eq(held_depth(f->index, 2, chains, N), k);
        group_event full = {false, eh, N, false, 0, t, N * BS, 0, NULL, 0};
        pack_group_batch(&sb, &full, 1);
        live_payload(f, 0, 0, &sb);
        /* Worker 2 removed and followed again: its new engine stores all N in full attention. */
        cr_assert_eq(km_feed_remove_worker(f->feed, 2, f->now++), KM_OK);
        fx_add(f, 2, false);
        pack_group_batch(&sb, &full, 1);
        live_payload(f, 2, 0, &sb);
    }
    cr_assert(km_feed_flush_take(split.feed));
    fx_flush(&plain); /* the plain flush at the take */
    for (int i = 0; i < 2; i++) {
        fx *f = both[i];
        /* Queued while the split feed applies: worker 0's window group appears holding every
         * block, and worker 1 is removed. */
        group_event w0 = {false, eh, N, false, 0, t, N * BS, 1, NULL, window};
        pack_group_batch(&sb, &w0, 1);
        live_payload(f, 0, 1, &sb);
        cr_assert_eq(km_feed_remove_worker(f->feed, 1, f->now++), KM_OK);
    }
    km_feed_flush_apply(split.feed);
    km_feed_flush_stats fs;
    cr_assert_eq(km_feed_flush_finish(split.feed, split.now++, &fs), KM_OK, "finish: %s",
                 km_feed_last_error(split.feed));
    uint32_t want[3] = {N, k, N};
    for (uint32_t w = 0; w < 3; w++) {
        uint32_t p = held_depth(plain.index, w, chains, N), s = held_depth(split.index, w, chains, N);
        cr_assert_eq(p, want[w], "worker %u after the plain flush: %u, want %u", w, p, want[w]);
        cr_assert_eq(s, p, "worker %u: %u after the split flush, %u after the plain one (window "
                     "of %u tokens, k %u)", w, s, p, window, k);
    }
    /* The next flush applies what was queued, rules included: workers 0 and 2 keep all N
     * (worker 0's groups both hold every block), worker 1 is gone. */
    fx_flush(&plain);
    fx_flush(&split);
    for (uint32_t w = 0; w < 3; w++) {
        uint32_t p = held_depth(plain.index, w, chains, N), s = held_depth(split.index, w, chains, N);
        cr_assert_eq(p, w == 1 ? 0 : N, "worker %u after the second plain flush: %u", w, p);
        cr_assert_eq(s, p, "worker %u after the second flush: %u split, %u plain", w, s, p);
    }
    fx_free(&plain);
    fx_free(&split);
}

Test(feed, queue_limit_drops_and_degrades, .timeout = 10)
{
    km_feed_config cfg;
    km_test_feed_config(&cfg, BS);
    cfg.max_queued_hashes = 6;
    fx f;
    fx_init_cfg(&f, &cfg, KM_TEST_ENCODING_POSITIONAL, KM_TEST_HASH_INT);
    fx_add(&f, 0, false);
    km_test_engine_store(&f.engine, &f.rng, &f.batch, -1, 4);
    fx_live(&f, 0, fx_keep(&f));
    km_test_engine_store(&f.engine, &f.rng, &f.batch, -1, 4);
    fx_live(&f, 0, fx_keep(&f)); /* 8 > 6: dropped */
    km_feed_worker_info info = fx_info(&f, 0);
    cr_assert_eq(info.counters.dropped_messages, 1);
    cr_assert_eq(info.state, KM_FEED_STATE_DEGRADED);
    cr_assert_eq(info.expected_seq, 2);
    fx_flush(&f);
    km_worker_stats ws;
    km_index_worker_stats(f.index, 0, &ws);
    cr_assert_eq(ws.blocks, 4);
    fx_free(&f);
}

/* The bound holds for updates that carry no hashes too: an engine that sends AllBlocksCleared after
 * AllBlocksCleared to a worker whose map is empty queues one CLEAR_WORKER naming nothing per event,
 * and while nobody flushes, those messages are dropped (the worker DEGRADED) once the queue's
 * updates would pass the bound, as messages of hashes are. */
Test(feed, queue_limit_bounds_updates_without_hashes, .timeout = 10)
{
    km_feed_config cfg;
    km_test_feed_config(&cfg, BS);
    cfg.max_queued_hashes = 64;
    fx f;
    fx_init_cfg(&f, &cfg, KM_TEST_ENCODING_POSITIONAL, KM_TEST_HASH_INT);
    fx_add(&f, 0, false);
    for (int k = 0; k < 40; k++)
        km_test_batch_cleared(&f.batch);
    uint64_t made = fx_keep(&f);
    for (uint64_t seq = 0; seq < 20; seq++) {
        km_kv_batch b = fx_decode(&f, made);
        cr_assert_eq(km_feed_live(f.feed, 0, seq, &b, f.now++), KM_OK);
    }
    uint64_t updates, hashes;
    km_feed_pending(f.feed, &updates, &hashes);
    cr_assert_eq(hashes, 0);
    cr_assert_leq(updates, 64 + 40, "%" PRIu64 " updates queued, the bound is 64", updates);
    km_feed_worker_info info = fx_info(&f, 0);
    cr_assert_eq(info.counters.dropped_messages, 19);
    cr_assert_eq(info.state, KM_FEED_STATE_DEGRADED);
    cr_assert_eq(info.expected_seq, 20);
    fx_flush(&f);
    fx_free(&f);
}

/* A clear names its worker's blocks only while they take at most half of the queue's bound, so a
 * worker with a large cache cannot crowd out other messages: beyond that the index scans its
 * tables instead, with the same result. */
Test(feed, a_clear_too_large_to_name_its_blocks_still_clears_them, .timeout = 10)
{
    km_feed_config cfg;
    km_test_feed_config(&cfg, BS);
    cfg.max_queued_hashes = 16;
    fx f;
    fx_init_cfg(&f, &cfg, KM_TEST_ENCODING_POSITIONAL, KM_TEST_HASH_INT);
    fx_add(&f, 0, false);
    fx_add(&f, 1, false);
    for (int k = 0; k < 3; k++) { /* 12 blocks on worker 0: more than 16 / 2 */
        km_test_engine_store(&f.engine, &f.rng, &f.batch, -1, 4);
        fx_live(&f, 0, fx_keep(&f));
        fx_flush(&f);
    }
    km_test_engine_store(&f.engine, &f.rng, &f.batch, -1, 4); /* 4 on worker 1: named */
    fx_live(&f, 1, fx_keep(&f));
    fx_flush(&f);
    km_worker_stats ws;
    km_index_worker_stats(f.index, 0, &ws);
    cr_assert_eq(ws.blocks, 12);
    km_index_worker_stats(f.index, 1, &ws);
    cr_assert_eq(ws.blocks, 4);

    km_test_batch_cleared(&f.batch);
    fx_live(&f, 1, fx_keep(&f));
    fx_flush(&f);
    cr_assert_eq(f.applied.cleared, 4);
    cr_assert_eq(f.applied.clear_scans, 0, "worker 1's four blocks were named");
    km_test_batch_cleared(&f.batch);
    fx_live(&f, 0, fx_keep(&f));
    fx_flush(&f);
    cr_assert_eq(f.applied.cleared, 16);
    cr_assert_eq(f.applied.clear_scans, 1, "worker 0's twelve were not: the index scanned");
    f.applied.clear_scans = 0; /* as intended here (fx_free checks that no other clear scans) */
    for (uint32_t w = 0; w < 2; w++) {
        km_index_worker_stats(f.index, w, &ws);
        cr_assert_eq(ws.blocks, 0, "worker %u", w);
        cr_assert_eq(fx_info(&f, w).state, KM_FEED_STATE_LIVE, "worker %u", w);
    }
    fx_free(&f);
}

Test(feed, config_validation, .timeout = 5)
{
    km_index *index = km_test_make_index(2);
    km_feed *feed = NULL;
    km_feed_config cfg;
    km_feed_config_init(&cfg);
    cr_assert_eq(cfg.block_size, 16);
    cr_assert(cfg.bootstrap_replay);
    cr_assert_eq(km_feed_create(NULL, &cfg, &feed), KM_ERR_NULL_POINTER);
    cr_assert_eq(km_feed_create(index, &cfg, NULL), KM_ERR_NULL_POINTER);
    cfg.block_size = 0;
    cr_assert_eq(km_feed_create(index, &cfg, &feed), KM_ERR_BLOCK_SIZE);
    cr_assert_null(feed);
    km_feed_config_init(&cfg);
    cfg.max_buffered_messages = 0;
    cr_assert_eq(km_feed_create(index, &cfg, &feed), KM_ERR_INVALID_ARGUMENT);
    cr_assert_eq(km_feed_create(index, NULL, &feed), KM_OK);
    km_feed_destroy(feed);
    km_feed_destroy(NULL);
    cr_assert_str_eq(km_feed_state_name(KM_FEED_STATE_DEGRADED), "DEGRADED");
    cr_assert_str_eq(km_feed_window_cause_name(KM_FEED_WINDOW_RESTART), "restart");
    cr_assert_str_eq(km_feed_window_end_name(KM_FEED_END_LOST), "lost");
    /* both ends of each list, and past them */
    cr_assert_str_eq(km_feed_state_name(KM_FEED_STATE_SYNCING), "SYNCING");
    cr_assert_str_eq(km_feed_state_name((km_feed_state)4), "unknown");
    cr_assert_str_eq(km_feed_state_name((km_feed_state)-1), "unknown");
    cr_assert_str_eq(km_feed_window_cause_name((km_feed_window_cause)0), "unknown");
    cr_assert_str_eq(km_feed_window_cause_name(KM_FEED_WINDOW_RESUME), "resume");
    cr_assert_str_eq(km_feed_window_cause_name((km_feed_window_cause)7), "unknown");
    cr_assert_str_eq(km_feed_window_end_name(KM_FEED_END_OPEN), "open");
    cr_assert_str_eq(km_feed_window_end_name(KM_FEED_END_RESYNC), "resync");
    cr_assert_str_eq(km_feed_window_end_name((km_feed_window_end)6), "unknown");
    km_index_destroy(index);
}

/* ---- randomized: drops, delayed live delivery, replays at random moments ----------------------- */

static int wire_cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static size_t wire_sorted_unique(uint64_t *v, size_t n)
{
    qsort(v, n, sizeof *v, wire_cmp_u64);
    size_t m = 0;
    for (size_t i = 0; i < n; i++)
        if (m == 0 || v[m - 1] != v[i])
            v[m++] = v[i];
    return m;
}

/* Every pair the index holds for worker w is a chain the simulated engine ever made (no pair
 * outside it), and, when cached_only, one the engine caches now: the index holds a subset of the
 * gap-free truth. */
static void wire_check_subset_of_truth(fx *f, uint32_t w, bool cached_only, int round)
{
    fx_flush(f);
    size_t n_all, n_cached;
    uint64_t *all = km_test_engine_chains(&f->engine, true, &n_all);
    uint64_t *cached = km_test_engine_chains(&f->engine, false, &n_cached);
    n_all = wire_sorted_unique(all, n_all);
    n_cached = wire_sorted_unique(cached, n_cached);
    km_worker_stats ws;
    cr_assert_eq(km_index_worker_stats(f->index, w, &ws), KM_OK);
    uint64_t held = 0;
    for (size_t i = 0; i < n_all; i++) {
        uint32_t workers[64], n = 0;
        cr_assert_eq(km_index_holders(f->index, all[i], workers, 64, &n), KM_OK);
        bool is_held = false;
        for (uint32_t j = 0; j < n && j < 64; j++)
            is_held |= workers[j] == w;
        if (!is_held)
            continue;
        held++;
        if (cached_only)
            KM_CHECK(bsearch(&all[i], cached, n_cached, sizeof *cached, wire_cmp_u64),
                     "round %d: worker %u holds chain %016" PRIx64 ", which the engine no longer "
                     "caches", round, w, all[i]);
    }
    KM_CHECK(held == ws.blocks, "round %d: worker %u holds %" PRIu64 " blocks, %" PRIu64
             " of them chains the engine made", round, w, ws.blocks, held);
    free(all);
    free(cached);
}

/* A simulated wire: live messages wait in a FIFO (some are dropped), replay requests are answered
 * from a bounded history at a random later moment, item by item, interleaved with live traffic.
 * Three kinds of rounds: history and live buffer large enough that nothing can be lost (the worker
 * must end LIVE with lost 0 and the index equal to the engine's truth), a live buffer that
 * overflows while a replay runs, and a history too short for the replays (both lose messages).
 * Whatever happens, a LIVE worker's index is the truth; a DEGRADED one has a lost count, and its
 * index holds only chains the engine made; under KM_FEED_DEGRADED_DROP only pairs the engine
 * caches now (KEEP_FLAGGED keeps pairs a lost BlockRemoved would have removed). The wire is FIFO,
 * so a seq is declared lost only below a live seq already received: no live copy of a lost seq
 * can follow, and late_lost stays 0. Over all rounds the generator must have reached LIVE rounds
 * with gaps filled by replays, and DEGRADED rounds under both policies. */
Test(feed, random_wire_equals_gap_free_run, .timeout = 60)
{
    int live_with_replays = 0, degraded[2] = {0, 0};
    for (int round = 0; round < 24; round++) {
        int k = round % 12, variant = k / 4; /* 0: nothing lost, 1: overflow, 2: short history */
        bool drop = round >= 12;
        km_feed_config cfg;
        km_test_feed_config(&cfg, BS);
        cfg.max_buffered_messages = variant == 0 ? 4096 : 64;
        cfg.degraded_policy = drop ? KM_FEED_DEGRADED_DROP : KM_FEED_DEGRADED_KEEP_FLAGGED;
        fx f;
        fx_init_cfg(&f, &cfg, k & 1 ? KM_TEST_ENCODING_MAP : KM_TEST_ENCODING_POSITIONAL,
                    k & 2 ? KM_TEST_HASH_BYTES16 : KM_TEST_HASH_INT);
        km_rng_init(&f.rng, km_test_seed() + (uint64_t)round);
        km_rng *r = &f.rng;
        uint32_t history = variant < 2 ? 1000 : 12; /* small history: losses happen */
        fx_add(&f, 0, true);
        uint64_t wire[256];
        size_t wire_head = 0, wire_n = 0;
        uint64_t published = 0;
        bool req_active = false;
        uint64_t req_id = 0, req_next = 0, req_last = 0;
        int req_delay = 0;
        for (int step = 0; step < 600 || wire_n || req_active; step++) {
            km_feed_action a;
            while (km_feed_next_action(f.feed, &a)) {
                if (a.kind == KM_FEED_ACTION_REPLAY_CANCEL) {
                    if (req_active && req_id == a.request_id)
                        req_active = false;
                    continue;
                }
                req_active = true; /* supersedes */
                req_id = a.request_id;
                uint64_t oldest = published > history ? published - history : 0;
                req_next = a.start_seq > oldest ? a.start_seq : oldest;
                req_last = published; /* exclusive */
                req_delay = (int)km_rng_below(r, 6);
            }
            uint32_t roll = km_rng_below(r, 100);
            if (step < 600 && roll < 45) {
                fx_make(&f, 1, k % 3 ? 1 : 0);
                if (!km_rng_percent(r, 8) && wire_n < 256)
                    wire[(wire_head + wire_n++) % 256] = published;
                published++;
            } else if (roll < 75 && wire_n) {
                uint64_t s = wire[wire_head];
                wire_head = (wire_head + 1) % 256;
                wire_n--;
                fx_live(&f, 0, s);
            } else if (req_active) {
                if (req_delay > 0) {
                    req_delay--;
                } else if (req_next < req_last) {
                    fx_item(&f, 0, req_id, req_next++);
                } else {
                    req_active = false;
                    fx_end(&f, 0, req_id);
                }
            }
            if (km_rng_percent(r, 5))
                fx_flush(&f);
        }
        /* Deliver one last message after everything so a trailing drop becomes a gap, and let
         * its replay finish. */
        fx_make(&f, 1, 0);
        fx_live(&f, 0, published++);
        km_feed_action a;
        while (km_feed_next_action(f.feed, &a)) {
            if (a.kind != KM_FEED_ACTION_REPLAY_REQUEST)
                continue;
            uint64_t oldest = published > history ? published - history : 0;
            for (uint64_t s = a.start_seq > oldest ? a.start_seq : oldest; s < published; s++)
                fx_item(&f, 0, a.request_id, s);
            fx_end(&f, 0, a.request_id);
        }
        km_feed_worker_info info = fx_info(&f, 0);
        if (getenv("KM_TEST_VERBOSE"))
            fprintf(stderr,
                    "round %d: gaps %" PRIu64 " replayed %" PRIu64 " dup %" PRIu64 " lost %" PRIu64
                    " late %" PRIu64 " overflow %" PRIu64 " clears %" PRIu64 " state %s\n",
                    round, info.counters.gaps, info.counters.replayed, info.counters.duplicates,
                    info.counters.lost, info.counters.late_lost, info.counters.buffer_overflows,
                    info.counters.clears, km_feed_state_name(info.state));
        KM_CHECK(info.expected_seq == published, "round %d: expected %" PRIu64 ", published %" PRIu64,
                 round, info.expected_seq, published);
        KM_CHECK(info.buffered_messages == 0, "round %d: %u still buffered", round,
                 info.buffered_messages);
        KM_CHECK(!info.replay_in_flight, "round %d: replay still in flight", round);
        KM_CHECK(info.counters.restarts == 0, "round %d: a duplicate was taken for a restart",
                 round);
        KM_CHECK(info.counters.late_lost == 0,
                 "round %d: %" PRIu64 " live copies of seqs declared lost arrived later", round,
                 info.counters.late_lost);
        if (variant == 0)
            KM_CHECK(info.counters.lost == 0 && info.counters.buffer_overflows == 0,
                     "round %d: lost %" PRIu64 ", overflows %" PRIu64 " with history and buffer "
                     "for everything", round, info.counters.lost, info.counters.buffer_overflows);
        /* LIVE (nothing lost, or an AllBlocksCleared after the loss made the index complete
         * again): the index is the truth. Otherwise history was lost and the worker says so. */
        if (info.state == KM_FEED_STATE_LIVE) {
            fx_check_truth(&f, 0);
            live_with_replays += info.counters.gaps > 0 && info.counters.replayed > 0;
        } else {
            KM_CHECK(info.state == KM_FEED_STATE_DEGRADED && info.counters.lost > 0,
                     "round %d: lost %" PRIu64 ", state %s", round, info.counters.lost,
                     km_feed_state_name(info.state));
            wire_check_subset_of_truth(&f, 0, drop, round);
            degraded[drop]++;
        }
        if (info.counters.lost == 0)
            KM_CHECK(info.state == KM_FEED_STATE_LIVE, "round %d: state %s", round,
                     km_feed_state_name(info.state));
        fx_free(&f);
    }
    KM_CHECK(live_with_replays > 0, "no round ended LIVE after gaps filled by replays");
    KM_CHECK(degraded[0] > 0 && degraded[1] > 0,
             "DEGRADED rounds: %d under KEEP_FLAGGED, %d under DROP", degraded[0], degraded[1]);
}

/* ---- randomized: engine restarts on a lossy wire --------------------------------------------- */

/* A message kept by fx_keep, by its index among every message made (all processes). */
static km_kv_batch rs_decode(fx *f, size_t index)
{
    cr_assert(index < f->n);
    km_kv_batch b;
    int rc = km_kv_decode_payload(f->dec, f->payloads[index], f->sizes[index], &b);
    cr_assert_eq(rc, KM_OK, "decode: %s", km_kv_decoder_last_error(f->dec));
    return b;
}

/* The random wire of random_wire_equals_gap_free_run with engine restarts: a new process starts
 * at seq 0 with an empty cache and new engine hashes, its replay buffer empty; the old process's
 * live messages still on the wire arrive first (one SUB socket is FIFO), and a replay request the
 * old process had not answered in full is never answered (the transport times it out). The new
 * process's first message is never dropped, so every restart is visible. Whatever happens, a
 * worker that ends LIVE holds exactly what the current process caches, and one that ends
 * DEGRADED has lost messages. */
Test(feed, random_wire_with_engine_restarts_ends_at_the_engines_cache, .timeout = 60)
{
    int live_after_restart = 0;
    for (int round = 0; round < 32; round++) {
        km_feed_config cfg;
        km_test_feed_config(&cfg, BS);
        cfg.max_buffered_messages = round % 4 == 3 ? 8 : 4096; /* some replays overflow */
        cfg.degraded_policy = round >= 16 ? KM_FEED_DEGRADED_DROP : KM_FEED_DEGRADED_KEEP_FLAGGED;
        fx f;
        fx_init_cfg(&f, &cfg, round & 1 ? KM_TEST_ENCODING_MAP : KM_TEST_ENCODING_POSITIONAL,
                    KM_TEST_HASH_INT);
        km_rng_init(&f.rng, km_test_seed() + 1000u + (uint64_t)round);
        km_rng *r = &f.rng;
        uint32_t history = round % 16 < 8 ? 1000 : 12;
        fx_add(&f, 0, true);
        struct {
            size_t index;
            uint64_t seq;
        } wire[256];
        size_t wire_head = 0, wire_n = 0;
        size_t base = 0; /* index of the current process's seq 0 */
        uint64_t published = 0, generation = 0;
        int restarts = 0;
        bool req_active = false;
        uint64_t req_id = 0, req_next = 0, req_last = 0, req_generation = 0;
        int req_delay = 0;
        for (int step = 0; step < 600 || wire_n || req_active; step++) {
            km_feed_action a;
            while (km_feed_next_action(f.feed, &a)) {
                if (a.kind == KM_FEED_ACTION_REPLAY_CANCEL) {
                    if (req_active && req_id == a.request_id)
                        req_active = false;
                    continue;
                }
                req_active = true;
                req_id = a.request_id;
                req_generation = generation;
                uint64_t oldest = published > history ? published - history : 0;
                req_next = a.start_seq > oldest ? a.start_seq : oldest;
                req_last = published;
                req_delay = (int)km_rng_below(r, 6);
            }
            uint32_t roll = km_rng_below(r, 100);
            if (step < 600 && roll < 2 && published > 0) {
                km_test_engine_restart(&f.engine, 0x5000u + (uint64_t)++restarts);
                base = f.n;
                published = 0;
                generation++;
            } else if (step < 600 && roll < 45) {
                fx_make(&f, 1, round % 3 ? 1 : 0);
                if ((published == 0 || !km_rng_percent(r, 8)) && wire_n < 256) {
                    size_t at = (wire_head + wire_n++) % 256;
                    wire[at].index = base + published;
                    wire[at].seq = published;
                }
                published++;
            } else if (roll < 75 && wire_n) {
                km_kv_batch b = rs_decode(&f, wire[wire_head].index);
                uint64_t s = wire[wire_head].seq;
                wire_head = (wire_head + 1) % 256;
                wire_n--;
                cr_assert_eq(km_feed_live(f.feed, 0, s, &b, f.now++), KM_OK);
            } else if (req_active) {
                if (req_delay > 0) {
                    req_delay--;
                } else if (req_generation != generation) {
                    req_active = false; /* its process is gone: the transport times it out */
                    cr_assert_eq(km_feed_replay_failed(f.feed, 0, req_id, KM_FEED_REPLAY_TIMEOUT,
                                                       f.now++),
                                 KM_OK);
                } else if (req_next < req_last) {
                    km_kv_batch b = rs_decode(&f, base + req_next);
                    cr_assert_eq(km_feed_replay_item(f.feed, 0, req_id, req_next, &b, f.now++),
                                 KM_OK);
                    req_next++;
                } else {
                    req_active = false;
                    fx_end(&f, 0, req_id);
                }
            }
            if (km_rng_percent(r, 5))
                fx_flush(&f);
        }
        /* One last message after everything, and its replays answered in full. */
        fx_make(&f, 1, 0);
        km_kv_batch last = rs_decode(&f, base + published);
        cr_assert_eq(km_feed_live(f.feed, 0, published, &last, f.now++), KM_OK);
        published++;
        km_feed_action a;
        while (km_feed_next_action(f.feed, &a)) {
            if (a.kind != KM_FEED_ACTION_REPLAY_REQUEST)
                continue;
            uint64_t oldest = published > history ? published - history : 0;
            for (uint64_t s = a.start_seq > oldest ? a.start_seq : oldest; s < published; s++) {
                km_kv_batch b = rs_decode(&f, base + s);
                cr_assert_eq(km_feed_replay_item(f.feed, 0, a.request_id, s, &b, f.now++), KM_OK);
            }
            fx_end(&f, 0, a.request_id);
        }
        km_feed_worker_info info = fx_info(&f, 0);
        if (getenv("KM_TEST_VERBOSE"))
            fprintf(stderr,
                    "round %d: restarts %d seen %" PRIu64 " gaps %" PRIu64 " replayed %" PRIu64
                    " lost %" PRIu64 " late %" PRIu64 " failures %" PRIu64 " state %s\n",
                    round, restarts, info.counters.restarts, info.counters.gaps,
                    info.counters.replayed, info.counters.lost, info.counters.late_lost,
                    info.counters.replay_failures, km_feed_state_name(info.state));
        KM_CHECK(info.expected_seq == published, "round %d: expected %" PRIu64 ", published %"
                 PRIu64, round, info.expected_seq, published);
        KM_CHECK(info.buffered_messages == 0 && !info.replay_in_flight,
                 "round %d: %u buffered, replay in flight %d", round, info.buffered_messages,
                 info.replay_in_flight);
        if (info.state == KM_FEED_STATE_LIVE) {
            fx_check_truth(&f, 0);
            live_after_restart += restarts > 0;
        } else {
            KM_CHECK(info.state == KM_FEED_STATE_DEGRADED && info.counters.lost > 0,
                     "round %d: lost %" PRIu64 ", state %s", round, info.counters.lost,
                     km_feed_state_name(info.state));
            wire_check_subset_of_truth(&f, 0, cfg.degraded_policy == KM_FEED_DEGRADED_DROP,
                                       round);
        }
        fx_free(&f);
    }
    KM_CHECK(live_after_restart > 0, "no round ended LIVE after a restart");
}
