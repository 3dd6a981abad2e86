/* SPDX-License-Identifier: Apache-2.0 */
/* The ZMQ subscriber (include/kvmatch/subscriber.h) against the C test publisher
 * (tests/kv_test_publisher.c), loopback only, ephemeral ports, every test bounded in time.
 * Scenarios: normal flow; both event encodings; int and bytes hashes; both replay reply forms;
 * LoRA; data-parallel ranks; a short gap inside the replay buffer (the index then equals a
 * gap-free run's); a gap longer than the buffer (DEGRADED, lost counted exactly); an engine
 * restart (seq back to 0, old blocks gone); a replay that arrives while live messages keep coming;
 * malformed input of every kind (counted, skipped, nothing else lost, the thread keeps running);
 * live frames whose seq cannot be trusted (no wrap, gap or restart); replay timeout; workers added
 * and removed at run time; a prompt stop; a long replay, and one answered before its deadline,
 * while the I/O thread is held up; a replay answered twice. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/stat.h>
#include <unistd.h>

#include <zmq.h>

#include "kv_test_publisher.h"
#include "kvmatch/publisher.h"
#include "kvmatch/subscriber.h"
#include "test_util.h"

#define BS 4u
#define MAX_LANES 4

/* One simulated engine behind one publisher, followed as one worker. */
typedef struct lane {
    km_test_publisher *pub;
    km_test_engine engine;
    km_test_batch batch;
    uint32_t worker;
    uint32_t clear_percent; /* chance of an AllBlocksCleared per event (it ends DEGRADED) */
} lane;

typedef struct sx {
    km_index *index;
    km_subscriber_config cfg;
    km_subscriber *sub;
    km_rng rng;
    lane lanes[MAX_LANES];
    int n_lanes;
} sx;

static void sx_init(sx *s, void (*tweak)(km_subscriber_config *))
{
    memset(s, 0, sizeof *s);
    s->index = km_test_make_index(16);
    km_subscriber_config_init(&s->cfg);
    km_test_feed_config(&s->cfg.feed, BS);
    s->cfg.replay_timeout_ms = 2000;
    if (!getenv("KM_TEST_FEED_LOG"))
        s->cfg.log = s->cfg.feed.log;
    if (tweak)
        tweak(&s->cfg);
    int rc = km_subscriber_create(s->index, &s->cfg, &s->sub);
    cr_assert_eq(rc, KM_OK, "km_subscriber_create: %s", km_error_name(rc));
    km_rng_init(&s->rng, km_test_seed());
}

static lane *sx_lane(sx *s, const km_test_publisher_config *pc, km_test_encoding enc,
                     km_test_hash_form form, int64_t dp_rank, uint32_t worker)
{
    cr_assert(s->n_lanes < MAX_LANES);
    lane *l = &s->lanes[s->n_lanes++];
    int rc = km_test_publisher_start(pc, &l->pub);
    cr_assert_eq(rc, KM_OK, "publisher start");
    km_test_engine_init(&l->engine, BS, 0x5eed + worker);
    km_test_batch_init(&l->batch, enc, form, dp_rank);
    l->worker = worker;
    l->clear_percent = 1;
    return l;
}

static void sx_free(sx *s)
{
    km_subscriber_destroy(s->sub);
    for (int i = 0; i < s->n_lanes; i++) {
        km_test_publisher_stop(s->lanes[i].pub);
        km_test_engine_free(&s->lanes[i].engine);
        km_test_batch_free(&s->lanes[i].batch);
    }
    km_index_destroy(s->index);
}

static void sx_follow(sx *s, lane *l, bool with_replay)
{
    km_subscriber_worker w = {l->worker, NULL, km_test_publisher_endpoint(l->pub),
                              with_replay ? km_test_publisher_replay_endpoint(l->pub) : NULL};
    int rc = km_subscriber_add_worker(s->sub, &w);
    cr_assert_eq(rc, KM_OK, "add_worker: %s", km_subscriber_last_error(s->sub));
}

/* Publish n random messages from the lane's engine. */
static void sx_publish(sx *s, lane *l, int n)
{
    for (int i = 0; i < n; i++) {
        km_test_engine_step(&l->engine, &s->rng, &l->batch, 3, l->clear_percent);
        km_test_publisher_publish_batch(l->pub, &l->batch);
        km_test_batch_reset(&l->batch);
    }
}

static km_feed_worker_info sx_info(sx *s, uint32_t w)
{
    km_feed_worker_info info;
    cr_assert_eq(km_subscriber_get_worker_info(s->sub, w, &info), KM_OK);
    return info;
}

#define WAIT_FOR(s, w, info, cond, ms)                                                           \
    do {                                                                                         \
        double end_ = km_test_now() + (ms) / 1000.0;                                             \
        for (;;) {                                                                               \
            info = sx_info((s), (w));                                                            \
            if (cond)                                                                            \
                break;                                                                           \
            cr_assert(km_test_now() < end_,                                                      \
                      "timed out waiting for %s (state %s, expected %" PRIu64 ", gaps %" PRIu64 \
                      ", lost %" PRIu64 ")",                                                     \
                      #cond, km_feed_state_name(info.state), info.expected_seq,                  \
                      info.counters.gaps, info.counters.lost);                                   \
            km_test_sleep_ms(1);                                                                 \
        }                                                                                        \
    } while (0)

/* Follow the lane and wait until its (bootstrap) sync is done and the SUB is connected. */
static void sx_follow_ready(sx *s, lane *l, bool with_replay, uint32_t subscribers)
{
    sx_follow(s, l, with_replay);
    cr_assert(km_test_publisher_wait_subscribers(l->pub, subscribers, 3000),
              "the subscriber never connected");
    if (with_replay) {
        km_feed_worker_info info;
        WAIT_FOR(s, l->worker, info, info.state == KM_FEED_STATE_LIVE, 3000);
    }
}

/* Wait until everything published so far is applied (nothing buffered or in flight). */
static km_feed_worker_info sx_wait_applied(sx *s, lane *l)
{
    uint64_t next = km_test_publisher_next_seq(l->pub);
    km_feed_worker_info info;
    WAIT_FOR(s, l->worker, info,
             info.has_expected_seq && info.expected_seq == next && !info.replay_in_flight &&
                 info.buffered_messages == 0,
             5000);
    return info;
}

static void sx_flush(sx *s)
{
    km_feed_flush_stats fs;
    int rc = km_subscriber_flush(s->sub, &fs);
    cr_assert_eq(rc, KM_OK, "flush: %s", km_subscriber_last_error(s->sub));
}

/* The index equals the one a gap-free run of the same published messages builds. */
static void sx_check_reference(sx *s, lane *l)
{
    sx_flush(s);
    km_index *ref = km_test_reference_index(l->pub, 16, l->worker, &s->cfg.feed);
    size_t n;
    uint64_t *universe = km_test_engine_chains(&l->engine, true, &n);
    char why[256];
    int ok = km_test_index_same(s->index, l->worker, ref, l->worker, universe, n, why, sizeof why);
    free(universe);
    km_index_destroy(ref);
    KM_CHECK(ok, "worker %u vs gap-free run: %s", l->worker, why);
}

/* The index holds exactly what the lane's engine caches. */
static void sx_check_truth(sx *s, lane *l)
{
    sx_flush(s);
    size_t n;
    uint64_t *chains = km_test_engine_chains(&l->engine, false, &n);
    char why[256];
    int ok = km_test_index_holds_exactly(s->index, l->worker, chains, n, why, sizeof why);
    free(chains);
    KM_CHECK(ok, "worker %u vs engine: %s", l->worker, why);
}

static uint32_t sx_windows(sx *s, uint32_t w, km_feed_window *out, uint32_t cap)
{
    uint32_t n = 0;
    cr_assert_eq(km_subscriber_get_worker_windows(s->sub, w, out, cap, &n), KM_OK);
    return n;
}

/* ---- scenarios ---------------------------------------------------------------------------------- */

Test(subscriber, normal_flow, .timeout = 20)
{
    sx s;
    sx_init(&s, NULL);
    lane *l = sx_lane(&s, NULL, KM_TEST_ENCODING_POSITIONAL, KM_TEST_HASH_INT, 0, 0);
    sx_follow_ready(&s, l, true, 1);
    sx_publish(&s, l, 200);
    km_feed_worker_info info = sx_wait_applied(&s, l);
    sx_check_reference(&s, l);
    sx_check_truth(&s, l);
    cr_assert_eq(info.state, KM_FEED_STATE_LIVE);
    cr_assert_eq(info.counters.messages, 200);
    cr_assert_eq(info.counters.gaps, 0);
    cr_assert_eq(info.counters.lost, 0);
    cr_assert_eq(info.counters.restarts, 0);
    cr_assert_eq(info.counters.malformed, 0);
    cr_assert(info.has_last_receive);
    cr_assert(info.last_engine_timestamp > 1e9, "the engine's wall-clock ts is reported as sent");
    km_subscriber_stats st;
    cr_assert_eq(km_subscriber_get_stats(s.sub, &st), KM_OK);
    cr_assert_eq(st.live_messages, 200);
    cr_assert_eq(st.replay_requests, 1, "the bootstrap request");
    cr_assert_eq(st.malformed, 0);
    cr_assert_eq(st.decoder.messages_decoded, 201);
    km_feed_window win[4];
    cr_assert_eq(sx_windows(&s, 0, win, 4), 1);
    cr_assert_eq(win[0].cause, KM_FEED_WINDOW_STARTUP);
    cr_assert_eq(win[0].end, KM_FEED_END_RECOVERED);
    sx_free(&s);
}

Test(subscriber, encodings_hash_forms_and_replay_forms, .timeout = 20)
{
    sx s;
    sx_init(&s, NULL);
    km_test_encoding encs[4] = {KM_TEST_ENCODING_POSITIONAL, KM_TEST_ENCODING_MAP,
                                KM_TEST_ENCODING_POSITIONAL, KM_TEST_ENCODING_MAP};
    km_test_hash_form forms[4] = {KM_TEST_HASH_BYTES32, KM_TEST_HASH_INT, KM_TEST_HASH_BYTES16,
                                  KM_TEST_HASH_BYTES32};
    lane *lanes[4];
    for (int i = 0; i < 4; i++) {
        km_test_publisher_config pc;
        km_test_publisher_config_init(&pc);
        pc.replay_form = i % 2 ? KM_TEST_REPLAY_NO_TOPIC : KM_TEST_REPLAY_WITH_TOPIC;
        pc.topic = i == 3 ? "kv@pod-3@model" : NULL;
        lanes[i] = sx_lane(&s, &pc, encs[i], forms[i], i == 2 ? -1 : 0, (uint32_t)i);
        sx_follow_ready(&s, lanes[i], true, 1);
    }
    for (int i = 0; i < 4; i++) {
        sx_publish(&s, lanes[i], 30);
        km_test_publisher_drop_live(lanes[i]->pub, true); /* and a gap, replayed in that form */
        sx_publish(&s, lanes[i], 3);
        km_test_publisher_drop_live(lanes[i]->pub, false);
        sx_publish(&s, lanes[i], 30);
    }
    for (int i = 0; i < 4; i++) {
        km_feed_worker_info info = sx_wait_applied(&s, lanes[i]);
        cr_assert_eq(info.counters.gaps, 1, "lane %d", i);
        cr_assert_eq(info.counters.lost, 0, "lane %d", i);
        cr_assert_eq(info.state, KM_FEED_STATE_LIVE, "lane %d", i);
        sx_check_reference(&s, lanes[i]);
        sx_check_truth(&s, lanes[i]);
    }
    sx_free(&s);
}

Test(subscriber, lora_blocks_hash_with_the_adapter, .timeout = 20)
{
    sx s;
    sx_init(&s, NULL);
    lane *l = sx_lane(&s, NULL, KM_TEST_ENCODING_MAP, KM_TEST_HASH_INT, 0, 1);
    l->engine.lora_name = "sql-adapter";
    sx_follow_ready(&s, l, true, 1);
    uint64_t first = km_test_engine_store(&l->engine, &s.rng, &l->batch, -1, 3);
    km_test_publisher_publish_batch(l->pub, &l->batch);
    km_test_batch_reset(&l->batch);
    sx_publish(&s, l, 40);
    sx_wait_applied(&s, l);
    sx_check_truth(&s, l);
    /* The first run's chain hashes are the LoRA ones of HASHING.md. */
    uint32_t tokens[3 * BS];
    for (int b = 0; b < 3; b++)
        memcpy(tokens + b * BS, l->engine.blocks[first + b].tokens, BS * sizeof *tokens);
    uint64_t lora[3], base[3];
    size_t nb;
    km_hash_config hl = {BS, "sql-adapter", NULL}, hb = {BS, NULL, NULL};
    km_hash_sequence(&hl, tokens, 3 * BS, 0, 0, NULL, lora, &nb);
    km_hash_sequence(&hb, tokens, 3 * BS, 0, 0, NULL, base, &nb);
    for (int b = 0; b < 3; b++) {
        cr_assert_eq(l->engine.blocks[first + b].chain, lora[b]);
        uint32_t ws[4], n;
        km_index_holders(s.index, base[b], ws, 4, &n);
        cr_assert_eq(n, 0, "a LoRA block must not pass for a base-model block");
    }
    sx_free(&s);
}

Test(subscriber, data_parallel_ranks_are_separate_workers, .timeout = 20)
{
    sx s;
    sx_init(&s, NULL);
    /* Rank r publishes on port P + r and replays on R + r, as vLLM does. */
    lane *ranks[2] = {NULL, NULL};
    for (int attempt = 0; attempt < 20 && !ranks[1]; attempt++) {
        km_test_publisher_config pc;
        km_test_publisher_config_init(&pc);
        km_test_publisher *p0 = NULL, *p1 = NULL;
        cr_assert_eq(km_test_publisher_start(&pc, &p0), KM_OK);
        pc.port = (uint16_t)(km_test_publisher_port(p0) + 1);
        pc.replay_port = (uint16_t)(km_test_publisher_replay_port(p0) + 1);
        if (km_test_publisher_start(&pc, &p1) != KM_OK) {
            km_test_publisher_stop(p0);
            continue;
        }
        for (int r = 0; r < 2; r++) {
            lane *l = &s.lanes[s.n_lanes++];
            l->pub = r ? p1 : p0;
            km_test_engine_init(&l->engine, BS, 0x100 + (uint64_t)r);
            km_test_batch_init(&l->batch, KM_TEST_ENCODING_POSITIONAL, KM_TEST_HASH_INT, r);
            l->worker = 6 + (uint32_t)r;
            ranks[r] = l;
        }
    }
    cr_assert(ranks[1] != NULL, "no pair of consecutive free ports");
    km_subscriber_worker rank0 = {6, "engine-a", km_test_publisher_endpoint(ranks[0]->pub),
                                  km_test_publisher_replay_endpoint(ranks[0]->pub)};
    cr_assert_eq(km_subscriber_add_engine(s.sub, &rank0, 2), KM_OK, "%s",
                 km_subscriber_last_error(s.sub));
    for (int r = 0; r < 2; r++) {
        cr_assert(km_test_publisher_wait_subscribers(ranks[r]->pub, 1, 3000));
        km_feed_worker_info info;
        WAIT_FOR(&s, ranks[r]->worker, info, info.state == KM_FEED_STATE_LIVE, 3000);
        char want[64];
        snprintf(want, sizeof want, "engine-a/dp%d", r);
        cr_assert_str_eq(info.name, want);
    }
    sx_publish(&s, ranks[0], 40);
    sx_publish(&s, ranks[1], 25);
    for (int r = 0; r < 2; r++) {
        sx_wait_applied(&s, ranks[r]);
        sx_check_truth(&s, ranks[r]);
        sx_check_reference(&s, ranks[r]);
    }
    uint32_t ids[4], n;
    cr_assert_eq(km_subscriber_get_workers(s.sub, ids, 4, &n), KM_OK);
    cr_assert_eq(n, 2);
    cr_assert_eq(ids[0], 6);
    cr_assert_eq(ids[1], 7);
    sx_free(&s);
}

Test(subscriber, short_gap_inside_the_replay_buffer, .timeout = 20)
{
    sx s;
    sx_init(&s, NULL);
    lane *l = sx_lane(&s, NULL, KM_TEST_ENCODING_POSITIONAL, KM_TEST_HASH_INT, 0, 0);
    sx_follow_ready(&s, l, true, 1);
    sx_publish(&s, l, 20);
    km_test_publisher_drop_live(l->pub, true);
    sx_publish(&s, l, 5); /* seqs 20..24 never reach the subscriber */
    km_test_publisher_drop_live(l->pub, false);
    sx_publish(&s, l, 20);
    km_feed_worker_info info = sx_wait_applied(&s, l);
    sx_check_reference(&s, l);
    sx_check_truth(&s, l);
    cr_assert_eq(info.state, KM_FEED_STATE_LIVE);
    cr_assert_eq(info.counters.gaps, 1);
    cr_assert_eq(info.counters.lost, 0);
    cr_assert(info.counters.replayed >= 5);
    cr_assert_eq(info.counters.messages, 40);
    km_feed_window win[4];
    cr_assert_eq(sx_windows(&s, 0, win, 4), 2);
    cr_assert_eq(win[1].cause, KM_FEED_WINDOW_GAP);
    cr_assert_eq(win[1].end, KM_FEED_END_RECOVERED);
    cr_assert_eq(win[1].from_seq, 20);
    cr_assert(win[1].end_ns >= win[1].start_ns);
    sx_free(&s);
}

/* Replay answers that lose items on the way (a ROUTER drops what its peer's pipe cannot take),
 * at bootstrap and in a gap replay: each hole is asked for again, nothing is lost. */
Test(subscriber, replay_items_lost_on_the_way_are_asked_for_again, .timeout = 20)
{
    sx s;
    sx_init(&s, NULL);
    lane *l = sx_lane(&s, NULL, KM_TEST_ENCODING_POSITIONAL, KM_TEST_HASH_INT, 0, 0);
    sx_publish(&s, l, 40);
    km_test_publisher_drop_replay_items(l->pub, 10, 5); /* the bootstrap loses 10..14 */
    sx_follow_ready(&s, l, true, 1);
    km_feed_worker_info info = sx_wait_applied(&s, l);
    cr_assert_eq(info.counters.lost, 0);
    cr_assert_eq(info.counters.replay_holes, 1);
    cr_assert_eq(info.counters.replay_requests, 2);
    cr_assert_eq(info.counters.replayed, 40);
    km_test_publisher_drop_live(l->pub, true);
    sx_publish(&s, l, 20); /* seqs 40..59 never reach the subscriber live */
    km_test_publisher_drop_live(l->pub, false);
    km_test_publisher_drop_replay_items(l->pub, 3, 4); /* the gap replay loses 43..46 */
    sx_publish(&s, l, 10);
    info = sx_wait_applied(&s, l);
    sx_check_reference(&s, l);
    sx_check_truth(&s, l);
    cr_assert_eq(info.state, KM_FEED_STATE_LIVE);
    cr_assert_eq(info.counters.lost, 0);
    cr_assert_eq(info.counters.gaps, 1);
    cr_assert_eq(info.counters.replay_holes, 2);
    sx_free(&s);
}

Test(subscriber, gap_longer_than_the_replay_buffer, .timeout = 20)
{
    sx s;
    sx_init(&s, NULL);
    km_test_publisher_config pc;
    km_test_publisher_config_init(&pc);
    pc.buffer_steps = 8;
    lane *l = sx_lane(&s, &pc, KM_TEST_ENCODING_MAP, KM_TEST_HASH_BYTES32, 0, 0);
    l->clear_percent = 0;
    sx_follow_ready(&s, l, true, 1);
    sx_publish(&s, l, 10);
    sx_wait_applied(&s, l);
    km_test_publisher_drop_live(l->pub, true);
    sx_publish(&s, l, 20); /* 10..29 dropped */
    km_test_publisher_drop_live(l->pub, false);
    sx_publish(&s, l, 1); /* 30: the buffer now holds 23..30 */
    km_feed_worker_info info;
    WAIT_FOR(&s, 0, info, info.expected_seq == 31 && !info.replay_in_flight, 5000);
    cr_assert_eq(info.state, KM_FEED_STATE_DEGRADED);
    cr_assert_eq(info.counters.lost, 13);
    cr_assert_eq(info.counters.gaps, 1);
    cr_assert_eq(info.counters.replayed, 8);
    km_feed_window win[4];
    cr_assert_eq(sx_windows(&s, 0, win, 4), 3);
    cr_assert_eq(win[1].cause, KM_FEED_WINDOW_GAP);
    cr_assert_eq(win[1].end, KM_FEED_END_LOST);
    cr_assert_eq(win[1].lost, 13);
    cr_assert_eq(win[2].cause, KM_FEED_WINDOW_DEGRADED);
    cr_assert_eq(win[2].end, KM_FEED_END_OPEN);
    /* Live traffic continues; the worker stays flagged. */
    sx_publish(&s, l, 10);
    info = sx_wait_applied(&s, l);
    cr_assert_eq(info.state, KM_FEED_STATE_DEGRADED);
    cr_assert_eq(info.counters.lost, 13);
    sx_free(&s);
}

Test(subscriber, engine_restart_drops_old_blocks, .timeout = 20)
{
    sx s;
    sx_init(&s, NULL);
    lane *l = sx_lane(&s, NULL, KM_TEST_ENCODING_POSITIONAL, KM_TEST_HASH_INT, 0, 2);
    sx_follow_ready(&s, l, true, 1);
    sx_publish(&s, l, 30);
    sx_wait_applied(&s, l);
    sx_check_truth(&s, l);
    /* The engine process dies and a new one starts on the same endpoints. */
    km_test_publisher_restart(l->pub);
    km_test_engine_restart(&l->engine, 0xabc);
    sx_publish(&s, l, 20);
    km_feed_worker_info info;
    WAIT_FOR(&s, 2, info, info.counters.restarts == 1 && info.expected_seq == 20, 5000);
    sx_check_truth(&s, l);
    sx_check_reference(&s, l);
    cr_assert_eq(info.state, KM_FEED_STATE_LIVE);
    cr_assert_eq(info.counters.lost, 0);
    km_feed_window win[4];
    cr_assert_eq(sx_windows(&s, 2, win, 4), 2);
    cr_assert_eq(win[1].cause, KM_FEED_WINDOW_RESTART);
    cr_assert_eq(win[1].end, KM_FEED_END_RECOVERED);
    sx_free(&s);
}

Test(subscriber, replay_arrives_while_live_messages_continue, .timeout = 20)
{
    sx s;
    sx_init(&s, NULL);
    lane *l = sx_lane(&s, NULL, KM_TEST_ENCODING_POSITIONAL, KM_TEST_HASH_BYTES16, 0, 0);
    sx_follow_ready(&s, l, true, 1);
    sx_publish(&s, l, 10);
    sx_wait_applied(&s, l);
    km_test_publisher_hold_replay(l->pub, true);
    km_test_publisher_drop_live(l->pub, true);
    sx_publish(&s, l, 4);
    km_test_publisher_drop_live(l->pub, false);
    sx_publish(&s, l, 1); /* reveals the gap; the request is held */
    double end = km_test_now() + 3;
    while (km_test_publisher_replay_requests(l->pub) < 2)
        cr_assert(km_test_now() < end, "no replay request");
    sx_publish(&s, l, 30); /* live keeps coming while the replay is pending */
    km_feed_worker_info info;
    WAIT_FOR(&s, 0, info, info.buffered_messages == 31, 3000);
    cr_assert_eq(info.state, KM_FEED_STATE_GAP);
    km_test_publisher_replay_delay_us(l->pub, 300);
    km_test_publisher_hold_replay(l->pub, false);
    sx_publish(&s, l, 30); /* and while it streams */
    info = sx_wait_applied(&s, l);
    sx_check_reference(&s, l);
    sx_check_truth(&s, l);
    cr_assert_eq(info.state, KM_FEED_STATE_LIVE);
    cr_assert_eq(info.counters.gaps, 1);
    cr_assert_eq(info.counters.lost, 0);
    cr_assert_eq(info.counters.restarts, 0);
    cr_assert(info.counters.duplicates >= 31, "buffered messages covered by the replay");
    sx_free(&s);
}

Test(subscriber, malformed_input_is_counted_and_skipped, .timeout = 20)
{
    sx s;
    sx_init(&s, NULL);
    lane *l = sx_lane(&s, NULL, KM_TEST_ENCODING_POSITIONAL, KM_TEST_HASH_INT, 0, 0);
    sx_follow_ready(&s, l, true, 1);
    sx_publish(&s, l, 5);
    /* Bad payloads the engine "published" (they take a seq). The truncated one carried a real
     * step of the engine, so from here on the index is compared with the gap-free run of the same
     * messages (which cannot read it either), not with the engine. */
    size_t size;
    km_test_engine_step(&l->engine, &s.rng, &l->batch, 2, 0);
    const unsigned char *good = km_test_batch_payload(&l->batch, &size);
    unsigned char *truncated = malloc(size);
    memcpy(truncated, good, size);
    km_test_batch_reset(&l->batch);
    km_test_publisher_publish(l->pub, truncated, size / 2);
    const unsigned char wrong_types[] = {0x93, 0xa1, 'x', 0x05, 0xc0}; /* ["x", 5, nil] */
    km_test_publisher_publish(l->pub, wrong_types, sizeof wrong_types);
    const unsigned char huge[] = {0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd, 0xff, 0xff, 0xff, 0xff};
    km_test_publisher_publish(l->pub, huge, sizeof huge); /* events: 2^32-1 declared */
    /* Frames that carry no usable seq (nothing consumed). */
    unsigned char seq8[8] = {0, 0, 0, 0, 0, 0, 0, 9}, seq7[7] = {0};
    const char *topic = "";
    km_kv_frame two[2] = {{topic, 0}, {seq8, 8}};
    km_kv_frame four[4] = {{topic, 0}, {seq8, 8}, {wrong_types, sizeof wrong_types}, {seq8, 8}};
    km_kv_frame short_seq[3] = {{topic, 0}, {seq7, 7}, {wrong_types, sizeof wrong_types}};
    cr_assert_eq(km_test_publisher_send_frames(l->pub, two, 2), 0);
    cr_assert_eq(km_test_publisher_send_frames(l->pub, four, 4), 0);
    cr_assert_eq(km_test_publisher_send_frames(l->pub, short_seq, 3), 0);
    sx_publish(&s, l, 10);
    km_feed_worker_info info = sx_wait_applied(&s, l);
    km_feed_worker_info settled;
    WAIT_FOR(&s, 0, settled, settled.counters.malformed == 6, 3000);
    cr_assert_eq(info.counters.gaps, 0);
    cr_assert_eq(info.counters.lost, 0);
    cr_assert_eq(info.counters.restarts, 0);
    cr_assert_eq(info.state, KM_FEED_STATE_LIVE);
    cr_assert_eq(info.expected_seq, 18);
    sx_check_reference(&s, l);
    km_subscriber_stats st;
    km_subscriber_get_stats(s.sub, &st);
    cr_assert_eq(st.malformed, 6);
    cr_assert_eq(st.live_messages, 21);
    /* The worker counts every live message, those without a readable seq included. */
    cr_assert_eq(settled.counters.messages, 21);
    /* The thread is alive and keeps applying. */
    sx_publish(&s, l, 5);
    info = sx_wait_applied(&s, l);
    cr_assert_eq(info.expected_seq, 23);
    free(truncated);
    sx_free(&s);
}

/* Log lines of the subscriber and its feed (written on the I/O thread). */
static pthread_mutex_t g_log_lock = PTHREAD_MUTEX_INITIALIZER;
static char g_log[1 << 14];

static void keep_log(void *user, const char *line)
{
    (void)user;
    pthread_mutex_lock(&g_log_lock);
    size_t used = strlen(g_log);
    snprintf(g_log + used, sizeof g_log - used, "%s\n", line);
    pthread_mutex_unlock(&g_log_lock);
}

static bool log_has(const char *what)
{
    pthread_mutex_lock(&g_log_lock);
    bool has = strstr(g_log, what) != NULL;
    pthread_mutex_unlock(&g_log_lock);
    return has;
}

static void logged(km_subscriber_config *cfg)
{
    g_log[0] = '\0';
    cfg->log = keep_log;
    cfg->feed.log = keep_log;
}

static void logged_with_room_for_big_batches(km_subscriber_config *cfg)
{
    logged(cfg);
    cfg->decoder.max_events_per_batch = 70000;
}

/* One engine step over max_events_per_batch (70,000 AllBlocksCleared events). */
static const void *oversized_batch(km_test_batch *b, size_t *size)
{
    km_test_batch_init(b, KM_TEST_ENCODING_POSITIONAL, KM_TEST_HASH_INT, 0);
    for (int i = 0; i < 70000; i++)
        km_test_batch_cleared(b);
    return km_test_batch_payload(b, size);
}

/* A message the decoder refuses says why wherever the operator looks: the worker's latest
 * refusal, the refusal log line and the subscriber's latest malformed message name the limit
 * exceeded (a batch over max_events_per_batch) or the frames (more than 8); a subscriber whose
 * decoder limit is raised applies the same message. */
Test(subscriber, undecodable_messages_say_why_and_the_limits_can_be_raised, .timeout = 60)
{
    sx s;
    sx_init(&s, logged);
    lane *l = sx_lane(&s, NULL, KM_TEST_ENCODING_POSITIONAL, KM_TEST_HASH_INT, 0, 0);
    l->clear_percent = 0;
    sx_follow_ready(&s, l, true, 1);
    sx_publish(&s, l, 2);
    km_test_batch big;
    size_t size;
    const void *payload = oversized_batch(&big, &size);
    km_test_publisher_publish(l->pub, payload, size);
    sx_publish(&s, l, 2);
    km_feed_worker_info info = sx_wait_applied(&s, l);
    cr_assert_eq(info.counters.refused[KM_FEED_REFUSED_UNDECODABLE], 1);
    cr_assert(strstr(info.latest_refusal, "did not decode") &&
                  strstr(info.latest_refusal, "KM_ERR_TOO_LARGE") &&
                  strstr(info.latest_refusal, "70000 events") &&
                  strstr(info.latest_refusal, "max_events_per_batch = 65536"),
              "latest refusal: %s", info.latest_refusal);
    km_subscriber_stats st;
    km_subscriber_get_stats(s.sub, &st);
    cr_assert_eq(st.malformed, 1);
    /* The engine's seq of the message too, to find it in the engine's own logs. */
    cr_assert(strstr(st.last_malformed, "worker 0, live, seq 2: KM_ERR_TOO_LARGE") &&
                  strstr(st.last_malformed, "max_events_per_batch"),
              "last malformed: %s", st.last_malformed);
    cr_assert(log_has("undecodable 1 (latest: a message that did not decode: KM_ERR_TOO_LARGE"),
              "log: %s", g_log);
    cr_assert(log_has("max_events_per_batch = 65536"), "log: %s", g_log);

    /* Ten frames: the frames are named. */
    unsigned char seq8[8] = {0};
    km_kv_frame ten[10];
    for (int i = 0; i < 10; i++)
        ten[i] = (km_kv_frame){seq8, 8};
    cr_assert_eq(km_test_publisher_send_frames(l->pub, ten, 10), 0);
    WAIT_FOR(&s, 0, info, info.counters.malformed == 2, 3000);
    cr_assert(strstr(info.latest_refusal, "more than 8 frames"), "%s", info.latest_refusal);
    km_subscriber_get_stats(s.sub, &st);
    cr_assert(strstr(st.last_malformed, "worker 0, live: KM_ERR_PARSE: more than 8 frames"),
              "last malformed: %s", st.last_malformed);
    sx_free(&s);

    /* The same step under a raised limit: applied. */
    sx_init(&s, logged_with_room_for_big_batches);
    l = sx_lane(&s, NULL, KM_TEST_ENCODING_POSITIONAL, KM_TEST_HASH_INT, 0, 0);
    l->clear_percent = 0;
    sx_follow_ready(&s, l, true, 1);
    km_test_publisher_publish(l->pub, payload, size);
    info = sx_wait_applied(&s, l);
    cr_assert_eq(info.counters.malformed, 0);
    cr_assert_eq(info.counters.clears, 70000);
    cr_assert_str_eq(info.latest_refusal, "");
    km_test_batch_free(&big);
    sx_free(&s);
}

/* Live frames whose seq the feed cannot trust: a replay end marker on the SUB socket (seq 2^64-1,
 * empty payload), the same seq on a decodable payload that stores a block the engine never
 * cached, and a rejected payload whose seq frame reads 2^40. Each is counted as malformed; the
 * engine's following messages apply as usual: no wrap, no gap, no replay, no restart, and the
 * index equals the engine's cache. */
Test(subscriber, live_frames_with_an_untrusted_seq_move_nothing, .timeout = 20)
{
    sx s;
    sx_init(&s, NULL);
    lane *l = sx_lane(&s, NULL, KM_TEST_ENCODING_POSITIONAL, KM_TEST_HASH_INT, 0, 0);
    l->clear_percent = 0;
    sx_follow_ready(&s, l, true, 1);
    sx_publish(&s, l, 5);
    sx_wait_applied(&s, l);

    km_test_batch stray;
    km_test_batch_init(&stray, KM_TEST_ENCODING_POSITIONAL, KM_TEST_HASH_INT, 0);
    uint64_t stray_hash = 0xdead;
    uint32_t stray_tokens[BS] = {1, 2, 3, 4};
    km_test_batch_stored(&stray, &stray_hash, 1, false, 0, stray_tokens, BS, NULL, NULL);
    size_t stray_size;
    const void *stray_payload = km_test_batch_payload(&stray, &stray_size);
    const unsigned char end_seq[8] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff};
    const unsigned char far_seq[8] = {0, 0, 1, 0, 0, 0, 0, 0}; /* 2^40 */
    const unsigned char wrong_types[] = {0x93, 0xa1, 'x', 0x05, 0xc0};
    km_kv_frame end_marker[3] = {{"", 0}, {end_seq, 8}, {"", 0}};
    km_kv_frame end_seq_payload[3] = {{"", 0}, {end_seq, 8}, {stray_payload, stray_size}};
    km_kv_frame far[3] = {{"", 0}, {far_seq, 8}, {wrong_types, sizeof wrong_types}};
    cr_assert_eq(km_test_publisher_send_frames(l->pub, end_marker, 3), 0);
    cr_assert_eq(km_test_publisher_send_frames(l->pub, end_seq_payload, 3), 0);
    cr_assert_eq(km_test_publisher_send_frames(l->pub, far, 3), 0);
    km_feed_worker_info info;
    WAIT_FOR(&s, 0, info, info.counters.malformed == 3, 3000);
    sx_publish(&s, l, 10);
    info = sx_wait_applied(&s, l);
    cr_assert_eq(info.state, KM_FEED_STATE_LIVE);
    cr_assert_eq(info.expected_seq, 15);
    cr_assert_eq(info.counters.malformed, 3);
    cr_assert_eq(info.counters.restarts, 0);
    cr_assert_eq(info.counters.gaps, 0);
    cr_assert_eq(info.counters.lost, 0);
    cr_assert_eq(info.counters.replay_requests, 1, "the bootstrap replay only");
    sx_check_truth(&s, l);
    km_test_batch_free(&stray);
    sx_free(&s);
}

static void short_timeout(km_subscriber_config *cfg)
{
    cfg->replay_timeout_ms = 150;
}

Test(subscriber, replay_timeout_degrades_then_resync_recovers, .timeout = 20)
{
    sx s;
    sx_init(&s, short_timeout);
    lane *l = sx_lane(&s, NULL, KM_TEST_ENCODING_POSITIONAL, KM_TEST_HASH_INT, 0, 0);
    l->clear_percent = 0;
    sx_follow_ready(&s, l, true, 1);
    sx_publish(&s, l, 10);
    sx_wait_applied(&s, l);
    km_test_publisher_mute_replay(l->pub, true);
    km_test_publisher_drop_live(l->pub, true);
    sx_publish(&s, l, 3);
    km_test_publisher_drop_live(l->pub, false);
    sx_publish(&s, l, 2);
    km_feed_worker_info info;
    WAIT_FOR(&s, 0, info, info.counters.replay_failures == 1 && !info.replay_in_flight, 3000);
    cr_assert_eq(info.state, KM_FEED_STATE_DEGRADED);
    cr_assert_eq(info.counters.lost, 3);
    cr_assert_eq(info.expected_seq, 15);
    km_subscriber_stats st;
    km_subscriber_get_stats(s.sub, &st);
    cr_assert_eq(st.replay_timeouts, 1);
    /* The publisher answers again: a full resync from its buffer makes the worker LIVE. */
    km_test_publisher_mute_replay(l->pub, false);
    cr_assert_eq(km_subscriber_resync_worker(s.sub, 0), KM_OK);
    WAIT_FOR(&s, 0, info, info.state == KM_FEED_STATE_LIVE, 3000);
    sx_publish(&s, l, 5);
    info = sx_wait_applied(&s, l);
    sx_check_truth(&s, l);
    km_feed_window win[8];
    uint32_t n = sx_windows(&s, 0, win, 8);
    cr_assert_eq(n, 4);
    cr_assert_eq(win[2].cause, KM_FEED_WINDOW_DEGRADED);
    cr_assert_eq(win[2].end, KM_FEED_END_RESYNC);
    cr_assert_eq(win[3].cause, KM_FEED_WINDOW_RESYNC);
    cr_assert_eq(win[3].end, KM_FEED_END_RECOVERED);
    sx_free(&s);
}

Test(subscriber, workers_added_and_removed_at_run_time, .timeout = 20)
{
    sx s;
    sx_init(&s, NULL);
    lane *a = sx_lane(&s, NULL, KM_TEST_ENCODING_POSITIONAL, KM_TEST_HASH_INT, 0, 0);
    lane *b = sx_lane(&s, NULL, KM_TEST_ENCODING_MAP, KM_TEST_HASH_INT, 0, 1);
    sx_follow_ready(&s, a, true, 1);
    sx_follow_ready(&s, b, true, 1);
    sx_publish(&s, a, 20);
    sx_publish(&s, b, 20);
    sx_wait_applied(&s, a);
    sx_wait_applied(&s, b);
    sx_check_truth(&s, b);
    cr_assert_eq(km_subscriber_remove_worker(s.sub, 1), KM_OK);
    sx_flush(&s);
    km_worker_stats ws;
    km_index_worker_stats(s.index, 1, &ws);
    cr_assert_eq(ws.blocks, 0, "a removed worker's blocks leave the index");
    cr_assert_eq(km_subscriber_remove_worker(s.sub, 1), KM_ERR_INVALID_ARGUMENT);
    sx_publish(&s, b, 10); /* nobody listens */
    sx_publish(&s, a, 10);
    sx_wait_applied(&s, a);
    sx_check_truth(&s, a);
    /* Following it again bootstraps from its replay buffer: the index is rebuilt. */
    sx_follow_ready(&s, b, true, 2);
    sx_publish(&s, b, 5);
    km_feed_worker_info info = sx_wait_applied(&s, b);
    sx_check_truth(&s, b);
    cr_assert_eq(info.counters.history_unavailable, 0);
    cr_assert_eq(info.counters.replayed, 30);
    /* Errors */
    km_subscriber_worker bad = {3, NULL, "bogus://nowhere", NULL};
    cr_assert_eq(km_subscriber_add_worker(s.sub, &bad), KM_ERR_INVALID_ARGUMENT);
    cr_assert(strlen(km_subscriber_last_error(s.sub)) > 0);
    km_subscriber_worker dup = {0, NULL, km_test_publisher_endpoint(a->pub), NULL};
    cr_assert_eq(km_subscriber_add_worker(s.sub, &dup), KM_ERR_INVALID_ARGUMENT);
    km_subscriber_worker range = {99, NULL, km_test_publisher_endpoint(a->pub), NULL};
    cr_assert_eq(km_subscriber_add_worker(s.sub, &range), KM_ERR_WORKER_RANGE);
    sx_free(&s);
}

/* km_subscriber_last_error from one thread while another thread's calls fail with two different
 * messages: every read is one of the two whole messages, never a mix of them. */
typedef struct last_error_reader {
    km_subscriber *sub;
    const char *a, *b;
    atomic_bool stop;
    atomic_ulong reads;
    unsigned long torn;
    char torn_seen[256];
} last_error_reader;

static void *read_last_errors(void *arg)
{
    last_error_reader *r = arg;
    while (!atomic_load(&r->stop)) {
        char copy[256];
        snprintf(copy, sizeof copy, "%s", km_subscriber_last_error(r->sub));
        atomic_fetch_add(&r->reads, 1);
        if (strcmp(copy, r->a) && strcmp(copy, r->b)) {
            r->torn++;
            memcpy(r->torn_seen, copy, sizeof copy);
        }
    }
    return NULL;
}

Test(subscriber, the_last_error_is_read_whole_while_another_thread_fails, .timeout = 60)
{
    sx s;
    sx_init(&s, NULL);
    char a[256], b[256], long_endpoint[KM_SUBSCRIBER_ENDPOINT_MAX + 40];
    memset(long_endpoint, 'x', sizeof long_endpoint - 1);
    long_endpoint[sizeof long_endpoint - 1] = '\0';
    km_subscriber_worker too_long = {3, NULL, long_endpoint, NULL};
    km_subscriber_worker rank0 = {4, NULL, "tcp://127.0.0.1:5557", NULL};
    cr_assert_eq(km_subscriber_add_engine(s.sub, &rank0, 0), KM_ERR_INVALID_ARGUMENT);
    snprintf(a, sizeof a, "%s", km_subscriber_last_error(s.sub));
    cr_assert_eq(km_subscriber_add_worker(s.sub, &too_long), KM_ERR_TOO_LARGE);
    snprintf(b, sizeof b, "%s", km_subscriber_last_error(s.sub));
    cr_assert(strlen(a) > 0 && strlen(b) > 0 && strcmp(a, b), "'%s' / '%s'", a, b);
    last_error_reader r = {.sub = s.sub, .a = a, .b = b};
    atomic_init(&r.stop, false);
    atomic_init(&r.reads, 0);
    pthread_t reader;
    cr_assert_eq(pthread_create(&reader, NULL, read_last_errors, &r), 0);
    /* Failing calls go on until the reader has read 20,000 times while they ran, and for at least
     * 20,000 calls: counts, not time (the test's timeout bounds a reader that never runs). */
    enum { READS = 20000, CALLS = 20000 };
    for (unsigned long i = 0; i < CALLS || atomic_load(&r.reads) < READS; i++) {
        if (i & 1)
            km_subscriber_add_engine(s.sub, &rank0, 0);
        else
            km_subscriber_add_worker(s.sub, &too_long);
    }
    atomic_store(&r.stop, true);
    pthread_join(reader, NULL);
    unsigned long reads = atomic_load(&r.reads);
    cr_assert_geq(reads, READS);
    cr_assert_eq(r.torn, 0, "%lu of %lu reads were neither message, e.g. '%s'", r.torn, reads,
                 r.torn_seen);
    sx_free(&s);
}

Test(subscriber, no_replay_endpoint_starts_at_the_first_message, .timeout = 20)
{
    sx s;
    sx_init(&s, NULL);
    km_test_publisher_config pc;
    km_test_publisher_config_init(&pc);
    pc.replay = false;
    lane *l = sx_lane(&s, &pc, KM_TEST_ENCODING_POSITIONAL, KM_TEST_HASH_INT, -1, 0);
    sx_publish(&s, l, 5); /* before we subscribe: never seen */
    sx_follow_ready(&s, l, false, 1);
    sx_publish(&s, l, 20);
    km_feed_worker_info info = sx_wait_applied(&s, l);
    cr_assert_eq(info.state, KM_FEED_STATE_LIVE);
    cr_assert_eq(info.counters.history_unavailable, 5);
    cr_assert_eq(info.counters.replay_requests, 0);
    sx_free(&s);
}

static void minute_timeout(km_subscriber_config *cfg)
{
    cfg->replay_timeout_ms = 60000;
}

/* Destroy with a replay in flight (its answer muted, its timeout 60 s) and messages queued returns
 * without waiting for the replay: a destroy that waited out the replay's timeout would run past
 * the test's timeout (30 s). The 10 s bound is far above a prompt destroy (milliseconds) and far
 * below the replay's timeout. */
Test(subscriber, stop_is_prompt, .timeout = 30)
{
    sx s;
    sx_init(&s, minute_timeout);
    lane *l = sx_lane(&s, NULL, KM_TEST_ENCODING_POSITIONAL, KM_TEST_HASH_INT, 0, 0);
    sx_follow_ready(&s, l, true, 1);
    km_test_publisher_mute_replay(l->pub, true);
    km_test_publisher_drop_live(l->pub, true);
    sx_publish(&s, l, 2);
    km_test_publisher_drop_live(l->pub, false);
    sx_publish(&s, l, 300); /* a replay in flight and messages queued */
    double t0 = km_test_now();
    km_subscriber_destroy(s.sub);
    s.sub = NULL;
    double took = km_test_now() - t0;
    cr_assert(took < 10.0, "destroy took %.3f s: it waited for the replay", took);
    sx_free(&s);
}

Test(subscriber, endpoint_for_rank, .timeout = 5)
{
    char out[64];
    cr_assert_eq(km_endpoint_for_rank("tcp://10.0.0.5:5557", 0, out, sizeof out), KM_OK);
    cr_assert_str_eq(out, "tcp://10.0.0.5:5557");
    cr_assert_eq(km_endpoint_for_rank("tcp://10.0.0.5:5557", 3, out, sizeof out), KM_OK);
    cr_assert_str_eq(out, "tcp://10.0.0.5:5560");
    cr_assert_eq(km_endpoint_for_rank("tcp://[::1]:5557", 1, out, sizeof out), KM_OK);
    cr_assert_str_eq(out, "tcp://[::1]:5558");
    cr_assert_eq(km_endpoint_for_rank("tcp://*:5558", 2, out, sizeof out), KM_OK);
    cr_assert_str_eq(out, "tcp://*:5560");
    cr_assert_eq(km_endpoint_for_rank("inproc://kv", 2, out, sizeof out), KM_OK);
    cr_assert_str_eq(out, "inproc://kv_dp2");
    cr_assert_eq(km_endpoint_for_rank("ipc:///tmp/kv", 1, out, sizeof out), KM_ERR_INVALID_ARGUMENT);
    cr_assert_eq(km_endpoint_for_rank("tcp://host", 1, out, sizeof out), KM_ERR_INVALID_ARGUMENT);
    cr_assert_eq(km_endpoint_for_rank("tcp://host:65535", 1, out, sizeof out),
                 KM_ERR_INVALID_ARGUMENT);
    cr_assert_eq(km_endpoint_for_rank("tcp://host:55x", 1, out, sizeof out),
                 KM_ERR_INVALID_ARGUMENT);
    cr_assert_eq(km_endpoint_for_rank("tcp://10.0.0.5:5557", 1, out, 8), KM_ERR_TOO_LARGE);
    cr_assert_eq(km_endpoint_for_rank(NULL, 1, out, 8), KM_ERR_NULL_POINTER);
}

/* The library publisher's own contract: bad configurations are refused with a reason; seqs count
 * from 0 and restart at 0; the log is kept only when asked. */
Test(subscriber, publisher_config_and_seq, .timeout = 20)
{
    km_publisher_config pc;
    km_publisher_config_init(&pc);
    km_publisher *p = NULL;
    char why[256] = "";
    pc.endpoint = "tcp://256.0.0.1:1";
    cr_assert_eq(km_publisher_start(&pc, &p, why, sizeof why), KM_ERR_IO);
    cr_assert_null(p);
    cr_assert(strstr(why, "256.0.0.1"), "%s", why);
    km_publisher_config_init(&pc);
    pc.buffer_steps = 0;
    cr_assert_eq(km_publisher_start(&pc, &p, why, sizeof why), KM_ERR_INVALID_ARGUMENT);
    km_publisher_config_init(&pc);
    char topic[400];
    memset(topic, 't', sizeof topic - 1);
    topic[sizeof topic - 1] = '\0';
    pc.topic = topic;
    cr_assert_eq(km_publisher_start(&pc, &p, why, sizeof why), KM_ERR_TOO_LARGE);
    km_publisher_config_init(&pc);
    pc.replay = false;
    cr_assert_eq(km_publisher_start(&pc, &p, why, sizeof why), KM_OK, "%s", why);
    cr_assert_null(km_publisher_replay_endpoint(p));
    cr_assert(strncmp(km_publisher_endpoint(p), "tcp://127.0.0.1:", 16) == 0);
    uint64_t seq = 99;
    for (uint64_t i = 0; i < 5; i++) {
        cr_assert_eq(km_publisher_publish(p, "x", 1, &seq), KM_OK);
        cr_assert_eq(seq, i);
    }
    cr_assert_eq(km_publisher_log_count(p), 0);
    km_publisher_restart(p);
    cr_assert_eq(km_publisher_next_seq(p), 0);
    cr_assert_eq(km_publisher_publish(p, "y", 1, &seq), KM_OK);
    cr_assert_eq(seq, 0);
    km_publisher_stop(p);
}

/* Holds the subscriber's lock the way a slow in-place snapshot does: km_subscriber_save writes
 * to a FIFO planted at its temporary path, so it blocks (lock held) until the test reads it. */
typedef struct stall {
    km_subscriber *sub;
    char path[256], fifo[300];
    pthread_t thread;
} stall;

static void *stall_main(void *arg)
{
    stall *st = arg;
    km_subscriber_save(st->sub, st->path); /* fails at fsync on the FIFO; only the stall matters */
    return NULL;
}

static void stall_begin(stall *st, km_subscriber *sub)
{
    st->sub = sub;
    snprintf(st->path, sizeof st->path, "/tmp/km-test-stall-%ld.snap", (long)getpid());
    snprintf(st->fifo, sizeof st->fifo, "%s.tmp.%ld", st->path, (long)getpid());
    unlink(st->fifo);
    cr_assert_eq(mkfifo(st->fifo, 0600), 0, "mkfifo %s", st->fifo);
    cr_assert_eq(pthread_create(&st->thread, NULL, stall_main, st), 0);
    km_test_sleep_ms(200); /* the saver takes the lock, then blocks opening the FIFO */
}

static void stall_end(stall *st)
{
    int fd = open(st->fifo, O_RDONLY);
    cr_assert(fd >= 0);
    char buf[65536];
    while (read(fd, buf, sizeof buf) > 0) {
    }
    close(fd);
    pthread_join(st->thread, NULL);
    unlink(st->fifo);
    unlink(st->path);
}

static void long_timeout(km_subscriber_config *cfg)
{
    cfg->replay_timeout_ms = 8000; /* longer than the stall */
}

/* A bootstrap replay of thousands of messages, as a busy engine's buffer holds (vLLM keeps
 * 10,000), answered while the I/O thread is held up (here by a slow snapshot holding the lock).
 * The publisher's ROUTER writes a replay in one loop and silently drops whatever its peer pipe
 * (SNDHWM 1000) cannot take, so the subscriber must keep taking answers off the wire while its
 * I/O thread cannot decode them. Every message is replayed, nothing is lost, the worker is LIVE. */
Test(subscriber, a_long_replay_survives_a_stalled_io_thread, .timeout = 60)
{
    sx s;
    sx_init(&s, long_timeout);
    lane *l = sx_lane(&s, NULL, KM_TEST_ENCODING_POSITIONAL, KM_TEST_HASH_INT, 0, 0);
    enum { MESSAGES = 9000, BLOCKS = 64 };
    uint64_t hashes[BLOCKS];
    uint32_t tokens[BLOCKS * BS];
    for (uint32_t m = 0; m < MESSAGES; m++) {
        for (uint32_t b = 0; b < BLOCKS; b++)
            hashes[b] = (uint64_t)m * BLOCKS + b + 1;
        for (uint32_t t = 0; t < BLOCKS * BS; t++)
            tokens[t] = (uint32_t)km_rng_next(&s.rng) | 0x80000000u; /* 5 bytes each */
        km_test_batch_stored(&l->batch, hashes, BLOCKS, false, 0, tokens, BS, NULL, NULL);
        km_test_publisher_publish_batch(l->pub, &l->batch);
        km_test_batch_reset(&l->batch);
    }
    km_test_publisher_hold_replay(l->pub, true);
    sx_follow(&s, l, true);
    double end = km_test_now() + 5;
    while (km_test_publisher_replay_requests(l->pub) < 1) {
        cr_assert(km_test_now() < end, "no bootstrap request");
        km_test_sleep_ms(1);
    }
    stall st;
    stall_begin(&st, s.sub);
    /* Paced so that the publisher's own sending keeps up: only the subscriber side is tested. */
    km_test_publisher_replay_delay_us(l->pub, 20);
    km_test_publisher_hold_replay(l->pub, false);
    km_test_sleep_ms(3000); /* the whole replay is sent meanwhile */
    stall_end(&st);
    km_feed_worker_info info;
    WAIT_FOR(&s, 0, info, info.has_expected_seq && !info.replay_in_flight, 30000);
    cr_assert_eq(info.counters.lost, 0, "lost %" PRIu64 " (replayed %" PRIu64 ")",
                 info.counters.lost, info.counters.replayed);
    cr_assert_eq(info.counters.replayed, MESSAGES, "replayed %" PRIu64, info.counters.replayed);
    cr_assert_eq(info.counters.replay_failures, 0);
    cr_assert_eq(info.state, KM_FEED_STATE_LIVE, "state %s", km_feed_state_name(info.state));
    cr_assert_eq(info.expected_seq, MESSAGES);
    sx_free(&s);
}

static void five_second_timeout(km_subscriber_config *cfg)
{
    cfg->replay_timeout_ms = 5000;
}

/* A replay answered in time, while the I/O thread is held up (a snapshot holding the lock) until
 * after the deadline: the answer is there when the thread looks again, so the replay is not a
 * timeout; it is applied, nothing is lost. The answer is released about 0.5 s after the request,
 * with a 5 s deadline; a machine too loaded to get that far within 2.5 s skips the test (the
 * answer might then come after the deadline). */
Test(subscriber, an_answer_received_before_the_deadline_is_not_a_timeout, .timeout = 30)
{
    sx s;
    sx_init(&s, five_second_timeout);
    lane *l = sx_lane(&s, NULL, KM_TEST_ENCODING_POSITIONAL, KM_TEST_HASH_INT, 0, 0);
    l->clear_percent = 0;
    sx_follow_ready(&s, l, true, 1);
    sx_publish(&s, l, 10);
    sx_wait_applied(&s, l);
    km_test_publisher_hold_replay(l->pub, true);
    km_test_publisher_drop_live(l->pub, true);
    sx_publish(&s, l, 3);
    km_test_publisher_drop_live(l->pub, false);
    sx_publish(&s, l, 1); /* reveals the gap: a request from 10, held */
    double end = km_test_now() + 5;
    while (km_test_publisher_replay_requests(l->pub) < 2) {
        cr_assert(km_test_now() < end, "no replay request");
        km_test_sleep_ms(1);
    }
    double sent = km_test_now();
    stall st;
    stall_begin(&st, s.sub);
    sx_publish(&s, l, 1); /* wakes the I/O thread, which then waits for the lock */
    km_test_sleep_ms(100);
    km_test_publisher_hold_replay(l->pub, false); /* answered well before the deadline */
    km_test_sleep_ms(200);
    double answered = km_test_now() - sent;
    if (answered >= 2.5) {
        stall_end(&st);
        sx_free(&s);
        cr_skip_test("the machine took %.1f s to release the answer: it might miss the 5 s "
                     "deadline, which the test needs it to meet", answered);
    }
    /* the request was sent before `sent`: its deadline is at most 5 s after it */
    while (km_test_now() - sent < 6.0)
        km_test_sleep_ms(50);
    stall_end(&st); /* the lock is released after the deadline */
    km_feed_worker_info info = sx_wait_applied(&s, l);
    cr_assert_eq(info.counters.replay_failures, 0);
    cr_assert_eq(info.counters.lost, 0, "lost %" PRIu64, info.counters.lost);
    cr_assert_eq(info.state, KM_FEED_STATE_LIVE, "state %s", km_feed_state_name(info.state));
    km_subscriber_stats stats;
    km_subscriber_get_stats(s.sub, &stats);
    cr_assert_eq(stats.replay_timeouts, 0);
    sx_check_truth(&s, l);
    sx_free(&s);
}

/* ---- a hand-driven replay endpoint (a ROUTER the test answers itself) ---------------------------- */

typedef struct fake_replay {
    void *ctx, *router;
    char endpoint[128];
} fake_replay;

static void fake_replay_start(fake_replay *f)
{
    f->ctx = zmq_ctx_new();
    f->router = zmq_socket(f->ctx, ZMQ_ROUTER);
    int zero = 0;
    zmq_setsockopt(f->router, ZMQ_LINGER, &zero, sizeof zero);
    cr_assert_eq(zmq_bind(f->router, "tcp://127.0.0.1:*"), 0);
    size_t len = sizeof f->endpoint;
    zmq_getsockopt(f->router, ZMQ_LAST_ENDPOINT, f->endpoint, &len);
}

static void fake_replay_stop(fake_replay *f)
{
    zmq_close(f->router);
    zmq_ctx_term(f->ctx);
}

/* Wait for one request [identity, "", start]; returns its start, the identity in id. */
static uint64_t fake_replay_request(fake_replay *f, zmq_msg_t *id)
{
    zmq_pollitem_t item = {f->router, 0, ZMQ_POLLIN, 0};
    cr_assert(zmq_poll(&item, 1, 5000) == 1, "no replay request");
    zmq_msg_init(id);
    cr_assert(zmq_msg_recv(id, f->router, 0) >= 0);
    char delim[8], start[8];
    cr_assert_eq(zmq_recv(f->router, delim, sizeof delim, 0), 0);
    cr_assert_eq(zmq_recv(f->router, start, sizeof start, 0), 8);
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v = v << 8 | (unsigned char)start[i];
    return v;
}

/* v0.26 reply form [identity, "", topic, seq, payload]; the end marker when payload is NULL. */
static void fake_replay_send(fake_replay *f, zmq_msg_t *id, uint64_t seq, const void *payload,
                             size_t size)
{
    unsigned char s8[8];
    for (int i = 0; i < 8; i++)
        s8[i] = payload ? (unsigned char)(seq >> (56 - 8 * i)) : 0xff;
    zmq_send(f->router, zmq_msg_data(id), zmq_msg_size(id), ZMQ_SNDMORE);
    zmq_send(f->router, "", 0, ZMQ_SNDMORE);
    zmq_send(f->router, "", 0, ZMQ_SNDMORE);
    zmq_send(f->router, s8, 8, ZMQ_SNDMORE);
    zmq_send(f->router, payload ? payload : "", payload ? size : 0, 0);
}

/* Every logged message with seq in [from, to), then the end marker. */
static void fake_replay_answer(fake_replay *f, zmq_msg_t *id, km_test_publisher *p, uint64_t from,
                               uint64_t to)
{
    for (size_t i = 0; i < km_test_publisher_log_count(p); i++) {
        uint64_t seq;
        size_t size;
        const void *payload = km_test_publisher_log_entry(p, i, &seq, &size);
        if (seq >= from && seq < to)
            fake_replay_send(f, id, seq, payload, size);
    }
    fake_replay_send(f, id, 0, NULL, 0);
}

/* A replay endpoint that answers a request twice (the second copy late, after the subscriber has
 * sent its next request): the copy belongs to the finished request and must not be taken for the
 * next one's answer (its end marker would end that replay before it gave anything: a false loss). */
Test(subscriber, a_late_second_answer_is_not_the_next_requests, .timeout = 20)
{
    sx s;
    sx_init(&s, NULL);
    km_test_publisher_config pc;
    km_test_publisher_config_init(&pc);
    pc.replay = false;
    lane *l = sx_lane(&s, &pc, KM_TEST_ENCODING_POSITIONAL, KM_TEST_HASH_INT, 0, 0);
    l->clear_percent = 0;
    fake_replay f;
    fake_replay_start(&f);
    sx_publish(&s, l, 5); /* 0..4, before we join */
    km_subscriber_worker w = {0, NULL, km_test_publisher_endpoint(l->pub), f.endpoint};
    cr_assert_eq(km_subscriber_add_worker(s.sub, &w), KM_OK);
    cr_assert(km_test_publisher_wait_subscribers(l->pub, 1, 3000));
    zmq_msg_t first;
    cr_assert_eq(fake_replay_request(&f, &first), 0, "the bootstrap request");
    fake_replay_answer(&f, &first, l->pub, 0, 5);
    km_feed_worker_info info;
    WAIT_FOR(&s, 0, info, info.state == KM_FEED_STATE_LIVE && info.expected_seq == 5, 3000);
    km_test_publisher_drop_live(l->pub, true);
    sx_publish(&s, l, 3); /* 5..7 dropped */
    km_test_publisher_drop_live(l->pub, false);
    sx_publish(&s, l, 1); /* 8 reveals the gap */
    zmq_msg_t second;
    cr_assert_eq(fake_replay_request(&f, &second), 5, "the gap request");
    fake_replay_answer(&f, &first, l->pub, 0, 5); /* the first request's answer, again */
    km_test_sleep_ms(200);
    fake_replay_answer(&f, &second, l->pub, 5, 9);
    info = sx_wait_applied(&s, l);
    cr_assert_eq(info.counters.lost, 0, "lost %" PRIu64, info.counters.lost);
    cr_assert_eq(info.counters.replay_failures, 0);
    cr_assert_eq(info.state, KM_FEED_STATE_LIVE, "state %s", km_feed_state_name(info.state));
    sx_check_truth(&s, l);
    zmq_msg_close(&first);
    zmq_msg_close(&second);
    sx_free(&s);
    fake_replay_stop(&f);
}

static void short_replay_timeout(km_subscriber_config *cfg)
{
    cfg->replay_timeout_ms = 400;
}

/* A replay endpoint that keeps answering with items the request cannot use (below its start:
 * refused) and never sends the end marker: only answers that move the stream earn more time, so
 * the request times out like one to a silent endpoint. Not every answer resets the deadline, so
 * such an endpoint cannot keep the worker in GAP for as long as it goes on. */
Test(subscriber, refused_replay_items_do_not_keep_a_request_alive, .timeout = 30)
{
    sx s;
    sx_init(&s, short_replay_timeout);
    km_test_publisher_config pc;
    km_test_publisher_config_init(&pc);
    pc.replay = false;
    lane *l = sx_lane(&s, &pc, KM_TEST_ENCODING_POSITIONAL, KM_TEST_HASH_INT, 0, 0);
    l->clear_percent = 0;
    fake_replay f;
    fake_replay_start(&f);
    sx_publish(&s, l, 5);
    km_subscriber_worker w = {0, NULL, km_test_publisher_endpoint(l->pub), f.endpoint};
    cr_assert_eq(km_subscriber_add_worker(s.sub, &w), KM_OK);
    cr_assert(km_test_publisher_wait_subscribers(l->pub, 1, 3000));
    zmq_msg_t first;
    cr_assert_eq(fake_replay_request(&f, &first), 0, "the bootstrap request");
    fake_replay_answer(&f, &first, l->pub, 0, 5);
    km_feed_worker_info info;
    WAIT_FOR(&s, 0, info, info.state == KM_FEED_STATE_LIVE && info.expected_seq == 5, 3000);
    km_test_publisher_drop_live(l->pub, true);
    sx_publish(&s, l, 3); /* 5..7 dropped */
    km_test_publisher_drop_live(l->pub, false);
    sx_publish(&s, l, 1); /* 8 reveals the gap */
    zmq_msg_t second;
    cr_assert_eq(fake_replay_request(&f, &second), 5, "the gap request");
    /* An item below the request's start every 50 ms for 2 s (five timeouts' worth). */
    size_t size;
    uint64_t seq;
    const void *payload = km_test_publisher_log_entry(l->pub, 0, &seq, &size);
    bool failed = false;
    for (int i = 0; i < 40 && !failed; i++) {
        fake_replay_send(&f, &second, 2, payload, size);
        km_test_sleep_ms(50);
        cr_assert_eq(km_subscriber_get_worker_info(s.sub, 0, &info), KM_OK);
        failed = info.counters.replay_failures > 0;
    }
    cr_assert(failed, "refused items kept the replay request alive for 2 s (timeout 0.4 s): %" PRIu64
              " refused", info.counters.refused_replay_items);
    cr_assert_gt(info.counters.refused_replay_items, 0);
    zmq_msg_close(&first);
    zmq_msg_close(&second);
    sx_free(&s);
    fake_replay_stop(&f);
}

/* ---- commands interrupted by signals ------------------------------------------------------- */

typedef struct signaller {
    pthread_t target;
    atomic_int stop;
    unsigned long sent; /* the signalling thread's; read after it is joined */
} signaller;

static void ignore_signal(int sig)
{
    (void)sig;
}

static void *send_signals(void *arg)
{
    signaller *g = arg;
    while (!atomic_load(&g->stop)) {
        pthread_kill(g->target, SIGUSR1);
        g->sent++;
        usleep(20);
    }
    return NULL;
}

/* A signal handled on the calling thread interrupts libzmq's wait for the I/O thread's answer
 * (EINTR even with SA_RESTART, as libuv installs its handlers). Every command must still get its
 * own answer: removing a worker that was never followed is refused each time, never answered by an
 * earlier command's reply and never given up on while the I/O thread still works on it. */
Test(subscriber, commands_interrupted_by_signals_get_their_own_answers, .timeout = 60)
{
    struct sigaction sa, old;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = ignore_signal;
    sa.sa_flags = SA_RESTART;
    sigemptyset(&sa.sa_mask);
    cr_assert_eq(sigaction(SIGUSR1, &sa, &old), 0);
    km_index_config ic;
    km_test_config(&ic, NULL);
    km_index *index = NULL;
    cr_assert_eq(km_index_create(&ic, &index), KM_OK);
    km_subscriber_config cfg;
    km_subscriber_config_init(&cfg);
    km_subscriber *sub = NULL;
    cr_assert_eq(km_subscriber_create(index, &cfg, &sub), KM_OK);
    signaller g = {pthread_self(), 0, 0};
    pthread_t t;
    cr_assert_eq(pthread_create(&t, NULL, send_signals, &g), 0);
    int refused = 0, wrong = 0, first_wrong = KM_OK;
    const int calls = 3000;
    for (int i = 0; i < calls; i++) {
        int rc = km_subscriber_remove_worker(sub, 4000 + (uint32_t)(i % 7));
        if (rc == KM_ERR_INVALID_ARGUMENT) {
            refused++;
        } else if (wrong++ == 0) {
            first_wrong = rc;
        }
    }
    atomic_store(&g.stop, 1);
    pthread_join(t, NULL);
    cr_assert_gt(g.sent, 100, "too few signals (%lu) to interrupt anything", g.sent);
    cr_assert_eq(wrong, 0,
                 "%d of %d removals of an unknown worker were not refused (first: %s: %s)", wrong,
                 calls, km_error_name(first_wrong), km_subscriber_last_error(sub));
    cr_assert_eq(refused, calls);
    km_subscriber_destroy(sub);
    km_index_destroy(index);
    sigaction(SIGUSR1, &old, NULL);
}

/* ---- a save against a flush in flight ------------------------------------------------------ */

/* An index log callback that holds the flushing thread inside km_index_apply at the first table
 * growth after it is armed, until released: a flush in flight, for as long as a test needs. */
static struct {
    pthread_mutex_t m;
    pthread_cond_t c;
    int armed, held, released;
} g_hold = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0};

static void hold_at_growth(void *user, const char *line)
{
    (void)user;
    if (!strstr(line, "table grew"))
        return;
    pthread_mutex_lock(&g_hold.m);
    if (g_hold.armed) {
        g_hold.armed = 0;
        g_hold.held = 1;
        pthread_cond_broadcast(&g_hold.c);
        while (!g_hold.released)
            pthread_cond_wait(&g_hold.c, &g_hold.m);
    }
    pthread_mutex_unlock(&g_hold.m);
}

/* A subscriber to `path` with periodic background snapshots due at every flush (1 ms), over an
 * index that holds the flushing thread at its first table growth once g_hold is armed, following
 * one lane that has published far more new blocks than the index was sized for (its block table
 * grows in the next flush), all of them received and queued. */
static lane *sx_start_held(sx *s, const char *path)
{
    memset(s, 0, sizeof *s);
    km_index_config ic;
    km_test_config(&ic, NULL);
    ic.max_workers = 16;
    ic.initial_blocks = 256;
    ic.log = hold_at_growth;
    cr_assert_eq(km_index_create(&ic, &s->index), KM_OK);
    km_subscriber_config_init(&s->cfg);
    km_test_feed_config(&s->cfg.feed, BS);
    s->cfg.log = s->cfg.feed.log;
    s->cfg.snapshot_path = path;
    s->cfg.snapshot_interval_ms = 1;
    s->cfg.snapshot_background = true;
    cr_assert_eq(km_subscriber_create(s->index, &s->cfg, &s->sub), KM_OK);
    km_rng_init(&s->rng, km_test_seed());
    lane *l = sx_lane(s, NULL, KM_TEST_ENCODING_POSITIONAL, KM_TEST_HASH_INT, 0, 0);
    l->clear_percent = 0;
    sx_follow_ready(s, l, false, 1);
    for (int m = 0; m < 40; m++) {
        km_test_engine_store(&l->engine, &s->rng, &l->batch, -1, 64);
        km_test_publisher_publish_batch(l->pub, &l->batch);
        km_test_batch_reset(&l->batch);
    }
    km_feed_worker_info info;
    WAIT_FOR(s, l->worker, info, info.has_expected_seq &&
             info.expected_seq == km_test_publisher_next_seq(l->pub), 5000);
    return l;
}

static void *flush_once(void *arg)
{
    sx *s = arg;
    km_subscriber_flush(s->sub, NULL);
    return NULL;
}

static void *save_once(void *arg)
{
    sx *s = arg;
    intptr_t rc = km_subscriber_save(s->sub, NULL);
    return (void *)rc;
}

/* A save that arrives while a flush applies waits for it, and no periodic background snapshot
 * starts meanwhile: one forked at the end of that flush would finish after the save and put an
 * older snapshot in its place. Periodic snapshots are due at every flush here (1 ms, in the
 * background), so only the save's own wait can keep one from starting. */
Test(subscriber, a_save_waiting_for_a_flush_starts_no_background_snapshot, .timeout = 30)
{
    char dir[] = "/tmp/kvmatch-save-wait-XXXXXX", path[128];
    cr_assert_not_null(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/feed.kvm", dir);
    sx s;
    sx_start_held(&s, path);
    km_subscriber_stats st;

    pthread_mutex_lock(&g_hold.m);
    g_hold.armed = 1;
    pthread_mutex_unlock(&g_hold.m);
    pthread_t flusher, saver;
    cr_assert_eq(pthread_create(&flusher, NULL, flush_once, &s), 0);
    pthread_mutex_lock(&g_hold.m);
    while (!g_hold.held)
        pthread_cond_wait(&g_hold.c, &g_hold.m);
    pthread_mutex_unlock(&g_hold.m);
    /* The flush is inside km_index_apply; the save starts and waits for it. */
    cr_assert_eq(pthread_create(&saver, NULL, save_once, &s), 0);
    km_test_sleep_ms(200);
    pthread_mutex_lock(&g_hold.m);
    g_hold.released = 1;
    pthread_cond_broadcast(&g_hold.c);
    pthread_mutex_unlock(&g_hold.m);
    void *save_rc;
    pthread_join(flusher, NULL);
    pthread_join(saver, &save_rc);
    cr_assert_eq((intptr_t)save_rc, KM_OK, "save: %s", km_subscriber_last_error(s.sub));
    /* A background snapshot started meanwhile would end (and be counted when the stats reap
     * it) within these 3 s: the state is a few MB. */
    double end = km_test_now() + 3;
    do {
        km_test_sleep_ms(10);
        km_subscriber_get_stats(s.sub, &st);
    } while (st.snapshots < 2 && km_test_now() < end);
    cr_assert_eq(st.snapshots, 1, "%" PRIu64 " snapshots: a background one started while the save "
                 "waited for the flush", st.snapshots);
    sx_free(&s);
    unlink(path);
    rmdir(dir);
}

/* A periodic background snapshot forks only once nothing is queued: what arrived while the index
 * applied is applied first, under the lock, so the child has nothing to apply (applying, it could
 * log through a callback whose lock another thread held at the fork, and never end). Seen from
 * outside: after that flush the index holds every message received, not only those taken. */
Test(subscriber, a_periodic_snapshot_forks_with_nothing_left_to_apply, .timeout = 30)
{
    char dir[] = "/tmp/kvmatch-fork-flush-XXXXXX", path[128];
    cr_assert_not_null(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/feed.kvm", dir);
    sx s;
    lane *l = sx_start_held(&s, path);
    km_feed_worker_info info;

    pthread_mutex_lock(&g_hold.m);
    g_hold.armed = 1;
    pthread_mutex_unlock(&g_hold.m);
    pthread_t flusher;
    cr_assert_eq(pthread_create(&flusher, NULL, flush_once, &s), 0);
    pthread_mutex_lock(&g_hold.m);
    while (!g_hold.held)
        pthread_cond_wait(&g_hold.c, &g_hold.m);
    pthread_mutex_unlock(&g_hold.m);
    /* While the index applies, more messages arrive and are queued. */
    sx_publish(&s, l, 20);
    uint64_t last = km_test_publisher_next_seq(l->pub);
    WAIT_FOR(&s, l->worker, info, info.expected_seq == last, 5000);
    pthread_mutex_lock(&g_hold.m);
    g_hold.released = 1;
    pthread_cond_broadcast(&g_hold.c);
    pthread_mutex_unlock(&g_hold.m);
    pthread_join(flusher, NULL);

    info = sx_info(&s, l->worker);
    cr_assert(info.has_indexed_seq && info.indexed_seq == last,
              "after the flush that forked the snapshot the index holds messages before %" PRIu64
              ", not all %" PRIu64 " received", info.indexed_seq, last);
    km_subscriber_stats st;
    double end = km_test_now() + 5;
    do {
        km_test_sleep_ms(10);
        km_subscriber_get_stats(s.sub, &st);
    } while (st.snapshots < 1 && km_test_now() < end);
    cr_assert_eq(st.snapshots, 1, "the background snapshot was not written (%" PRIu64
                 " failures: %s)", st.snapshot_failures, st.last_snapshot_error);
    sx_free(&s);
    unlink(path);
    rmdir(dir);
}
