/* SPDX-License-Identifier: Apache-2.0 */
/* Restart of kvmatch (docs/EVENTS.md, "Restart of kvmatch"): the feed state in the snapshot
 * (km_feed_export_state / import / save / restore) and the subscriber's restore_path, against the
 * C test publisher (tests/kv_test_publisher.c), loopback only, every test bounded in time.
 * Scenarios: feed-state round trip (no sockets); kvmatch restarted while the publisher keeps
 * publishing within its replay buffer (index equals the gap-free run, LIVE); beyond the buffer
 * (DEGRADED, lost counted exactly); engine restarted while kvmatch was down (old blocks gone);
 * corrupt, truncated and version-mismatched snapshots (clear error, empty start, normal bootstrap
 * afterwards; the file moved aside, never overwritten, before the first save); periodic snapshots, in place and in the background (a save waiting for a background
 * writer leaves event intake running); `kvmatch follow` writing a snapshot on SIGTERM and resuming
 * from it. */
#include <glob.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#include "kv_test_publisher.h"
#include "kvmatch/subscriber.h"
#include "test_util.h"

#define BS 4u

typedef struct rx {
    km_index *index;
    km_subscriber_config cfg;
    km_subscriber *sub;
    km_rng rng;
    km_test_publisher *pub;
    km_test_engine engine;
    km_test_batch batch;
    uint32_t worker;
    uint32_t subscriptions; /* SUB connections the publisher has seen in total */
    char dir[64];
    char path[128];
} rx;

static void rx_start_sub(rx *s, const char *restore_path)
{
    s->index = km_test_make_index(16);
    km_subscriber_config_init(&s->cfg);
    km_test_feed_config(&s->cfg.feed, BS);
    s->cfg.replay_timeout_ms = 2000;
    if (!getenv("KM_TEST_FEED_LOG"))
        s->cfg.log = s->cfg.feed.log;
    s->cfg.restore_path = restore_path;
    int rc = km_subscriber_create(s->index, &s->cfg, &s->sub);
    cr_assert_eq(rc, KM_OK, "km_subscriber_create: %s", km_error_name(rc));
}

static void rx_stop_sub(rx *s)
{
    km_subscriber_destroy(s->sub);
    km_index_destroy(s->index);
    s->sub = NULL;
    s->index = NULL;
}

static void rx_init(rx *s, uint32_t buffer_steps)
{
    memset(s, 0, sizeof *s);
    km_rng_init(&s->rng, km_test_seed());
    km_test_publisher_config pc;
    km_test_publisher_config_init(&pc);
    pc.buffer_steps = buffer_steps;
    cr_assert_eq(km_test_publisher_start(&pc, &s->pub), KM_OK, "publisher start");
    s->worker = 3;
    km_test_engine_init(&s->engine, BS, 0x5eed);
    km_test_batch_init(&s->batch, KM_TEST_ENCODING_POSITIONAL, KM_TEST_HASH_INT, 0);
    snprintf(s->dir, sizeof s->dir, "/tmp/kvmatch-restart-XXXXXX");
    cr_assert(mkdtemp(s->dir) != NULL);
    snprintf(s->path, sizeof s->path, "%s/kvmatch.snap", s->dir);
    rx_start_sub(s, NULL);
}

static void rx_free(rx *s)
{
    rx_stop_sub(s);
    km_test_publisher_stop(s->pub);
    km_test_engine_free(&s->engine);
    km_test_batch_free(&s->batch);
    unlink(s->path);
    rmdir(s->dir);
}

static void rx_publish(rx *s, int n)
{
    for (int i = 0; i < n; i++) {
        km_test_engine_step(&s->engine, &s->rng, &s->batch, 3, 0);
        km_test_publisher_publish_batch(s->pub, &s->batch);
        km_test_batch_reset(&s->batch);
    }
}

/* The engine's cached blocks now (the oracle for the index's pairs of this one worker). */
static size_t rx_engine_cached(const rx *s)
{
    size_t n = 0;
    free(km_test_engine_chains(&s->engine, false, &n));
    return n;
}

/* rx_publish(n), then one step at a time until the engine holds some block (random steps can
 * remove all it stored); returns the steps published. */
static int rx_publish_holding(rx *s, int n)
{
    rx_publish(s, n);
    while (rx_engine_cached(s) == 0 && n < 1000) {
        rx_publish(s, 1);
        n++;
    }
    cr_assert_gt(rx_engine_cached(s), 0, "no block cached after %d steps", n);
    return n;
}

static km_feed_worker_info rx_info(rx *s)
{
    km_feed_worker_info info;
    cr_assert_eq(km_subscriber_get_worker_info(s->sub, s->worker, &info), KM_OK);
    return info;
}

#define RX_WAIT(s, info, cond, ms)                                                               \
    do {                                                                                         \
        double end_ = km_test_now() + (ms) / 1000.0;                                             \
        for (;;) {                                                                               \
            info = rx_info(s);                                                                   \
            if (cond)                                                                            \
                break;                                                                           \
            cr_assert(km_test_now() < end_,                                                      \
                      "timed out waiting for %s (state %s, expected %" PRIu64 ", lost %" PRIu64 \
                      ")",                                                                       \
                      #cond, km_feed_state_name(info.state), info.expected_seq,                  \
                      info.counters.lost);                                                       \
            km_test_sleep_ms(1);                                                                 \
        }                                                                                        \
    } while (0)

/* Follow the publisher (same endpoints every time: the producer identity) and wait for the SUB. */
static void rx_follow(rx *s)
{
    km_subscriber_worker w = {s->worker, NULL, km_test_publisher_endpoint(s->pub),
                              km_test_publisher_replay_endpoint(s->pub)};
    int rc = km_subscriber_add_worker(s->sub, &w);
    cr_assert_eq(rc, KM_OK, "add_worker: %s", km_subscriber_last_error(s->sub));
    s->subscriptions++;
    cr_assert(km_test_publisher_wait_subscribers(s->pub, s->subscriptions, 3000),
              "the subscriber never connected");
}

static km_feed_worker_info rx_wait_applied(rx *s)
{
    uint64_t next = km_test_publisher_next_seq(s->pub);
    km_feed_worker_info info;
    RX_WAIT(s, info,
            info.has_expected_seq && info.expected_seq == next && !info.replay_in_flight &&
                info.buffered_messages == 0 && info.state != KM_FEED_STATE_SYNCING,
            5000);
    return info;
}

static void rx_flush(rx *s)
{
    int rc = km_subscriber_flush(s->sub, NULL);
    cr_assert_eq(rc, KM_OK, "flush: %s", km_subscriber_last_error(s->sub));
}

static void rx_check_reference(rx *s)
{
    rx_flush(s);
    km_index *ref = km_test_reference_index(s->pub, 16, s->worker, &s->cfg.feed);
    size_t n;
    uint64_t *universe = km_test_engine_chains(&s->engine, true, &n);
    char why[256];
    int ok = km_test_index_same(s->index, s->worker, ref, s->worker, universe, n, why, sizeof why);
    free(universe);
    km_index_destroy(ref);
    KM_CHECK(ok, "vs gap-free run: %s", why);
}

static void rx_check_truth(rx *s)
{
    rx_flush(s);
    size_t n;
    uint64_t *chains = km_test_engine_chains(&s->engine, false, &n);
    char why[256];
    int ok = km_test_index_holds_exactly(s->index, s->worker, chains, n, why, sizeof why);
    free(chains);
    KM_CHECK(ok, "vs engine: %s", why);
}

/* Run until the first snapshot: follow, publish n, apply, save. */
static void rx_run_and_save(rx *s, int n)
{
    rx_follow(s);
    km_feed_worker_info info;
    RX_WAIT(s, info, info.state == KM_FEED_STATE_LIVE, 3000);
    rx_publish(s, n);
    rx_wait_applied(s);
    int rc = km_subscriber_save(s->sub, s->path);
    cr_assert_eq(rc, KM_OK, "save: %s", km_subscriber_last_error(s->sub));
    km_subscriber_stats st;
    cr_assert_eq(km_subscriber_get_stats(s->sub, &st), KM_OK);
    cr_assert_eq(st.snapshots, 1);
}

/* ---- the feed state, no sockets -------------------------------------------------------------------- */

static km_feed *make_feed(km_index *index)
{
    km_feed_config cfg;
    km_test_feed_config(&cfg, BS);
    km_feed *feed;
    cr_assert_eq(km_feed_create(index, &cfg, &feed), KM_OK);
    return feed;
}

/* Feed n messages of a simulated engine to worker w, seqs from *seq. */
static void feed_engine(km_feed *feed, km_kv_decoder *dec, km_test_engine *e, km_rng *r,
                        uint32_t w, uint64_t *seq, int n)
{
    km_test_batch b;
    km_test_batch_init(&b, KM_TEST_ENCODING_POSITIONAL, KM_TEST_HASH_INT, 0);
    for (int i = 0; i < n; i++) {
        km_test_engine_step(e, r, &b, 3, 0);
        size_t size;
        const void *payload = km_test_batch_payload(&b, &size);
        km_kv_batch batch;
        cr_assert_eq(km_kv_decode_payload(dec, payload, size, &batch), KM_OK);
        cr_assert_eq(km_feed_live(feed, w, (*seq)++, &batch, 10), KM_OK);
        km_test_batch_reset(&b);
    }
    km_test_batch_free(&b);
}

Test(restart, feed_state_round_trip, .timeout = 20)
{
    km_rng r;
    km_rng_init(&r, km_test_seed());
    km_index *a = km_test_make_index(16);
    km_feed *fa = make_feed(a);
    km_kv_decoder *dec;
    cr_assert_eq(km_kv_decoder_create(NULL, &dec), KM_OK);
    km_test_engine e1, e2;
    km_test_engine_init(&e1, BS, 11);
    km_test_engine_init(&e2, BS, 22);
    km_feed_worker_config w1 = {1, "one", false};
    km_feed_worker_config w2 = {5, "five", false};
    cr_assert_eq(km_feed_add_worker(fa, &w1, 1), KM_OK);
    cr_assert_eq(km_feed_add_worker(fa, &w2, 1), KM_OK);
    uint64_t s1 = 100, s2 = 0;
    feed_engine(fa, dec, &e1, &r, 1, &s1, 60);
    feed_engine(fa, dec, &e2, &r, 5, &s2, 40);
    /* Export refuses queued updates: the state must match the index. */
    void *state;
    size_t size;
    cr_assert_eq(km_feed_export_state(fa, &state, &size), KM_ERR_INVALID_ARGUMENT);
    cr_assert_eq(km_feed_flush(fa, 20, NULL), KM_OK);
    cr_assert_eq(km_feed_export_state(fa, &state, &size), KM_OK);

    km_index *b = km_test_make_index(16);
    km_feed *fb = make_feed(b);
    cr_assert_eq(km_feed_import_state(fb, state, size, 30), KM_OK, "%s", km_feed_last_error(fb));
    uint32_t ids[4], n;
    cr_assert_eq(km_feed_get_workers(fb, ids, 4, &n), KM_OK);
    cr_assert_eq(n, 2);
    cr_assert_eq(ids[0], 1);
    cr_assert_eq(ids[1], 5);
    km_feed_worker_info ia, ib;
    cr_assert_eq(km_feed_get_worker_info(fa, 1, &ia), KM_OK);
    cr_assert_eq(km_feed_get_worker_info(fb, 1, &ib), KM_OK);
    cr_assert_eq(ib.expected_seq, 160);
    cr_assert_eq(ib.map_entries, ia.map_entries);
    cr_assert_str_eq(ib.name, "one");
    cr_assert(ib.restored && ib.awaiting_claim);
    cr_assert_eq(ib.state, KM_FEED_STATE_GAP); /* RESUME window open until confirmed */
    /* Re-exporting the imported state gives the same size (map order may differ). */
    void *again;
    size_t again_size;
    cr_assert_eq(km_feed_export_state(fb, &again, &again_size), KM_OK);
    cr_assert_eq(again_size, size);
    free(again);

    /* Validation: every truncation is refused, a bad version is incompatible, nothing installed. */
    km_index *c = km_test_make_index(16);
    km_feed *fc = make_feed(c);
    for (size_t cut = 0; cut < size; cut += 1 + cut / 8) {
        int rc = km_feed_import_state(fc, state, cut, 1);
        KM_CHECK(rc == KM_ERR_CORRUPT, "cut at %zu: %s", cut, km_error_name(rc));
        cr_assert_eq(km_feed_get_workers(fc, NULL, 0, &n), KM_OK);
        cr_assert_eq(n, 0);
    }
    unsigned char *bad = malloc(size);
    memcpy(bad, state, size);
    cr_assert_eq(bad[8], KM_FEED_STATE_VERSION);
    bad[8] = 1; /* chain hashes under the earlier LoRA / salt seed rules (HASHING.md) */
    cr_assert_eq(km_feed_import_state(fc, bad, size, 1), KM_ERR_INCOMPATIBLE);
    cr_assert(strstr(km_feed_last_error(fc), "version") != NULL, "%s", km_feed_last_error(fc));
    memcpy(bad, state, size);
    bad[0] ^= 0xff; /* magic */
    cr_assert_eq(km_feed_import_state(fc, bad, size, 1), KM_ERR_CORRUPT);
    memcpy(bad, state, size);
    /* The last map entry ends with its copies (3 bytes), media (1) and groups (4); its worker's
     * count of announcement records (8: none, the workers hold GPU blocks only) follows. */
    bad[size - 13] = 0; /* last map entry's medium mask */
    cr_assert_eq(km_feed_import_state(fc, bad, size, 1), KM_ERR_CORRUPT);
    memcpy(bad, state, size);
    bad[size - 9] = 0x80; /* last map entry's groups: the bit no block gets */
    cr_assert_eq(km_feed_import_state(fc, bad, size, 1), KM_ERR_CORRUPT);
    bad[size - 9] = ((const unsigned char *)state)[size - 9];
    bad[size - 14] = 1; /* last map entry: a copy in group 2, which does not hold the block */
    cr_assert_eq(km_feed_import_state(fc, bad, size, 1), KM_ERR_CORRUPT);
    cr_assert(strstr(km_feed_last_error(fc), "copies") != NULL, "%s", km_feed_last_error(fc));
    bad[size - 14] = 0;
    bad[size - 8] = 1; /* an announcement record the section does not hold */
    cr_assert_eq(km_feed_import_state(fc, bad, size, 1), KM_ERR_CORRUPT);
    cr_assert(strstr(km_feed_last_error(fc), "announcement") != NULL, "%s",
              km_feed_last_error(fc));
    bad[size - 8] = 0;
    bad[8] = 4; /* without the copies: a block cached twice would leave with its first copy */
    cr_assert_eq(km_feed_import_state(fc, bad, size, 1), KM_ERR_INCOMPATIBLE);
    cr_assert(strstr(km_feed_last_error(fc), "version 4") != NULL, "%s", km_feed_last_error(fc));
    /* Without the parents and announcements: a block in two offloaded chunks would leave the
     * host tier with the first chunk's removal. */
    bad[8] = 5;
    cr_assert_eq(km_feed_import_state(fc, bad, size, 1), KM_ERR_INCOMPATIBLE);
    cr_assert(strstr(km_feed_last_error(fc), "version 5") != NULL, "%s", km_feed_last_error(fc));
    bad[8] = 2; /* without the KV-cache groups */
    cr_assert_eq(km_feed_import_state(fc, bad, size, 1), KM_ERR_INCOMPATIBLE);
    cr_assert_eq(km_feed_get_workers(fc, NULL, 0, &n), KM_OK);
    cr_assert_eq(n, 0);
    free(bad);

    /* Claimed with the same identity: resumes (no replay endpoint: waits for the next live seq);
     * BlockRemoved after the restart finds its chain hashes through the restored map. */
    cr_assert_eq(km_feed_add_worker(fb, &w1, 40), KM_OK);
    cr_assert_eq(km_feed_get_worker_info(fb, 1, &ib), KM_OK);
    cr_assert(!ib.awaiting_claim);
    /* Another identity under id 5: starts afresh. */
    cr_assert_eq(km_feed_add_worker_identity(fb, &w2, "tcp://other:2 -", 40), KM_OK);
    cr_assert_eq(km_feed_get_worker_info(fb, 5, &ib), KM_OK);
    cr_assert(!ib.restored);
    cr_assert(!ib.has_expected_seq);
    cr_assert_eq(ib.map_entries, 0);

    /* Both feeds continue with the same messages for worker 1: same index for it. */
    km_test_batch bt;
    km_test_batch_init(&bt, KM_TEST_ENCODING_POSITIONAL, KM_TEST_HASH_INT, 0);
    for (int i = 0; i < 40; i++) {
        km_test_engine_step(&e1, &r, &bt, 3, 0);
        size_t ps;
        const void *payload = km_test_batch_payload(&bt, &ps);
        km_kv_batch batch;
        cr_assert_eq(km_kv_decode_payload(dec, payload, ps, &batch), KM_OK);
        cr_assert_eq(km_feed_live(fa, 1, s1, &batch, 50), KM_OK);
        cr_assert_eq(km_feed_live(fb, 1, s1, &batch, 50), KM_OK);
        s1++;
        km_test_batch_reset(&bt);
    }
    km_test_batch_free(&bt);
    cr_assert_eq(km_feed_flush(fa, 60, NULL), KM_OK);
    cr_assert_eq(km_feed_flush(fb, 60, NULL), KM_OK);
    cr_assert_eq(km_feed_get_worker_info(fb, 1, &ib), KM_OK);
    cr_assert_eq(ib.state, KM_FEED_STATE_LIVE);
    cr_assert_eq(ib.counters.unknown_removes, 0);
    cr_assert_eq(ib.counters.unknown_parent_blocks, 0);
    km_feed_window win[8];
    cr_assert_eq(km_feed_get_worker_windows(fb, 1, win, 8, &n), KM_OK);
    cr_assert_eq(n, 1);
    cr_assert_eq(win[0].cause, KM_FEED_WINDOW_RESUME);
    cr_assert_eq(win[0].end, KM_FEED_END_RECOVERED);
    cr_assert_str_eq(km_feed_window_cause_name(KM_FEED_WINDOW_RESUME), "resume");

    free(state);
    km_feed_destroy(fa);
    km_feed_destroy(fb);
    km_feed_destroy(fc);
    km_index_destroy(a);
    km_index_destroy(b);
    km_index_destroy(c);
    km_kv_decoder_destroy(dec);
    km_test_engine_free(&e1);
    km_test_engine_free(&e2);
}

/* A feed following worker 2 (with a replay endpoint, its bootstrap answered "nothing yet"), a
 * simulated engine and a snapshot path: what the save-and-restore tests start from. */
typedef struct saved_worker {
    km_rng r;
    char dir[64], path[128];
    km_index *a;
    km_feed *fa;
    km_kv_decoder *dec;
    km_test_engine e;
    km_feed_worker_config w;
} saved_worker;

static void saved_worker_init(saved_worker *t)
{
    km_rng_init(&t->r, km_test_seed());
    snprintf(t->dir, sizeof t->dir, "/tmp/kvmatch-restart-XXXXXX");
    cr_assert(mkdtemp(t->dir) != NULL);
    snprintf(t->path, sizeof t->path, "%s/feed.snap", t->dir);
    t->a = km_test_make_index(16);
    t->fa = make_feed(t->a);
    cr_assert_eq(km_kv_decoder_create(NULL, &t->dec), KM_OK);
    km_test_engine_init(&t->e, BS, 7);
    t->w = (km_feed_worker_config){2, "two", true};
    cr_assert_eq(km_feed_add_worker(t->fa, &t->w, 1), KM_OK);
    km_feed_action act;
    while (km_feed_next_action(t->fa, &act))
        cr_assert_eq(km_feed_replay_end(t->fa, 2, act.request_id, 1), KM_OK);
}

/* Answer fb's replay request for worker 2 with one engine step at seq, then its end. */
static void answer_with_one_step(saved_worker *t, km_feed *fb, uint64_t request_id, uint64_t seq)
{
    km_test_batch bt;
    km_test_batch_init(&bt, KM_TEST_ENCODING_POSITIONAL, KM_TEST_HASH_INT, 0);
    km_test_engine_step(&t->e, &t->r, &bt, 3, 0);
    size_t ps;
    const void *payload = km_test_batch_payload(&bt, &ps);
    km_kv_batch batch;
    cr_assert_eq(km_kv_decode_payload(t->dec, payload, ps, &batch), KM_OK);
    cr_assert_eq(km_feed_replay_item(fb, 2, request_id, seq, &batch, 102), KM_OK);
    cr_assert_eq(km_feed_replay_end(fb, 2, request_id, 103), KM_OK);
    km_test_batch_free(&bt);
}

static void saved_worker_free(saved_worker *t)
{
    km_feed_destroy(t->fa);
    km_index_destroy(t->a);
    km_kv_decoder_destroy(t->dec);
    km_test_engine_free(&t->e);
    unlink(t->path);
    rmdir(t->dir);
}

/* The error's name once, at the start: a message that words another handle's failure does not
 * name it twice ("KM_ERR_IO: KM_ERR_IO: ..."). */
static void expect_named_once(const char *message, int status)
{
    const char *name = km_error_name(status);
    cr_assert(strncmp(message, name, strlen(name)) == 0, "%s", message);
    cr_assert_null(strstr(message + strlen(name), "KM_ERR_"), "named twice: %s", message);
}

Test(restart, feed_save_and_restore_file, .timeout = 20)
{
    saved_worker t;
    saved_worker_init(&t);
    km_feed *fa = t.fa;
    km_kv_decoder *dec = t.dec;
    km_feed_action act;
    uint64_t seq = 0;
    feed_engine(fa, dec, &t.e, &t.r, 2, &seq, 50);
    /* A path it cannot write: KM_ERR_IO, named once. */
    cr_assert_eq(km_feed_save(fa, "/nonexistent-kvmatch-dir/x.snap", 5), KM_ERR_IO);
    expect_named_once(km_feed_last_error(fa), KM_ERR_IO);
    cr_assert_eq(km_feed_save(fa, t.path, 5), KM_OK, "%s", km_feed_last_error(fa));

    km_index *b = km_test_make_index(16);
    km_feed *fb = make_feed(b);
    cr_assert_eq(km_feed_restore(fb, t.path, 100), KM_OK, "%s", km_feed_last_error(fb));
    size_t nc;
    uint64_t *chains = km_test_engine_chains(&t.e, false, &nc);
    char why[256];
    KM_CHECK(km_test_index_holds_exactly(b, 2, chains, nc, why, sizeof why), "%s", why);
    free(chains);
    /* Claim: a replay from the saved seq + 1 is asked for at once. */
    cr_assert_eq(km_feed_add_worker(fb, &t.w, 101), KM_OK);
    cr_assert_eq(km_feed_next_action(fb, &act), 1);
    cr_assert_eq(act.kind, KM_FEED_ACTION_REPLAY_REQUEST);
    cr_assert_eq(act.start_seq, 50);
    km_feed_worker_info info;
    cr_assert_eq(km_feed_get_worker_info(fb, 2, &info), KM_OK);
    cr_assert_eq(info.state, KM_FEED_STATE_GAP);
    /* The replay starts at 53: 50..52 are lost. */
    answer_with_one_step(&t, fb, act.request_id, 53);
    cr_assert_eq(km_feed_get_worker_info(fb, 2, &info), KM_OK);
    cr_assert_eq(info.state, KM_FEED_STATE_DEGRADED);
    cr_assert_eq(info.counters.lost, 3);
    cr_assert_eq(info.expected_seq, 54);

    km_feed_destroy(fb);
    km_index_destroy(b);
    saved_worker_free(&t);
}

/* A snapshot taken while a gap replay was in flight holds a last live seq past the next one to
 * apply. Restored and claimed after the engine's buffer moved on, the resume replay starts past
 * that old live seq: its first item is taken and what the engine no longer has is declared lost,
 * not refused as a skip past the live stream (which the restored seq no longer describes). */
Test(restart, a_resume_past_a_restored_live_seq_declares_the_evicted_history_lost, .timeout = 20)
{
    saved_worker t;
    saved_worker_init(&t);
    km_feed *fa = t.fa;
    km_kv_decoder *dec = t.dec;
    km_feed_action act;
    uint64_t seq = 0;
    feed_engine(fa, dec, &t.e, &t.r, 2, &seq, 10); /* 0..9 */
    seq = 15;
    feed_engine(fa, dec, &t.e, &t.r, 2, &seq, 1); /* 15: a gap, a replay from 10 is asked for */
    cr_assert_eq(km_feed_next_action(fa, &act), 1);
    cr_assert_eq(act.kind, KM_FEED_ACTION_REPLAY_REQUEST);
    cr_assert_eq(km_feed_save(fa, t.path, 5), KM_OK, "%s", km_feed_last_error(fa));

    km_index *b = km_test_make_index(16);
    km_feed *fb = make_feed(b);
    cr_assert_eq(km_feed_restore(fb, t.path, 100), KM_OK, "%s", km_feed_last_error(fb));
    cr_assert_eq(km_feed_add_worker(fb, &t.w, 101), KM_OK);
    cr_assert_eq(km_feed_next_action(fb, &act), 1);
    cr_assert_eq(act.kind, KM_FEED_ACTION_REPLAY_REQUEST);
    cr_assert_eq(act.start_seq, 10);
    /* The engine's buffer now starts at 20,001. */
    answer_with_one_step(&t, fb, act.request_id, 20001);
    km_feed_worker_info info;
    cr_assert_eq(km_feed_get_worker_info(fb, 2, &info), KM_OK);
    cr_assert_eq(info.counters.lost, 20001 - 10, "lost %" PRIu64, info.counters.lost);
    cr_assert_eq(info.expected_seq, 20002);
    cr_assert_eq(info.state, KM_FEED_STATE_DEGRADED);
    km_feed_window win[4];
    uint32_t n = 0;
    cr_assert_eq(km_feed_get_worker_windows(fb, 2, win, 4, &n), KM_OK);
    cr_assert(n >= 1);
    cr_assert_eq(win[0].cause, KM_FEED_WINDOW_RESUME);
    cr_assert_eq(win[0].end, KM_FEED_END_LOST);

    km_feed_destroy(fb);
    km_index_destroy(b);
    saved_worker_free(&t);
}

/* ---- restart of kvmatch against a live publisher -------------------------------------------------- */

Test(restart, resume_within_the_replay_buffer, .timeout = 30)
{
    rx s;
    rx_init(&s, 0);
    rx_run_and_save(&s, 30);
    rx_stop_sub(&s); /* kvmatch goes down; the engine keeps publishing */
    rx_publish(&s, 25);
    rx_start_sub(&s, s.path);
    km_subscriber_stats st;
    cr_assert_eq(km_subscriber_get_stats(s.sub, &st), KM_OK);
    cr_assert(st.restored);
    cr_assert_eq(st.restore_status, KM_OK);
    km_feed_worker_info info = rx_info(&s);
    cr_assert(info.restored && info.awaiting_claim);
    cr_assert_eq(info.expected_seq, 30);
    rx_follow(&s);
    rx_publish(&s, 10); /* live continues meanwhile */
    info = rx_wait_applied(&s);
    rx_check_reference(&s);
    rx_check_truth(&s);
    cr_assert_eq(info.state, KM_FEED_STATE_LIVE);
    cr_assert_eq(info.counters.lost, 0);
    cr_assert_eq(info.counters.restarts, 0);
    cr_assert(info.counters.replayed >= 25);
    km_feed_window win[4];
    uint32_t n = 0;
    cr_assert_eq(km_subscriber_get_worker_windows(s.sub, s.worker, win, 4, &n), KM_OK);
    cr_assert_eq(n, 1);
    cr_assert_eq(win[0].cause, KM_FEED_WINDOW_RESUME);
    cr_assert_eq(win[0].end, KM_FEED_END_RECOVERED);
    cr_assert_eq(win[0].from_seq, 30);
    rx_free(&s);
}

Test(restart, resume_beyond_the_replay_buffer_degrades, .timeout = 30)
{
    rx s;
    rx_init(&s, 8);
    rx_run_and_save(&s, 10);
    rx_stop_sub(&s);
    rx_publish(&s, 20); /* 10..29; the buffer keeps 22..29 */
    rx_start_sub(&s, s.path);
    rx_follow(&s);
    km_feed_worker_info info;
    RX_WAIT(&s, info, info.expected_seq == 30 && !info.replay_in_flight, 5000);
    cr_assert_eq(info.state, KM_FEED_STATE_DEGRADED);
    cr_assert_eq(info.counters.lost, 12);
    cr_assert_eq(info.counters.replayed, 8);
    km_feed_window win[4];
    uint32_t n = 0;
    cr_assert_eq(km_subscriber_get_worker_windows(s.sub, s.worker, win, 4, &n), KM_OK);
    cr_assert_eq(n, 2);
    cr_assert_eq(win[0].cause, KM_FEED_WINDOW_RESUME);
    cr_assert_eq(win[0].end, KM_FEED_END_LOST);
    cr_assert_eq(win[0].lost, 12);
    cr_assert_eq(win[1].cause, KM_FEED_WINDOW_DEGRADED);
    rx_publish(&s, 5);
    info = rx_wait_applied(&s);
    cr_assert_eq(info.state, KM_FEED_STATE_DEGRADED);
    cr_assert_eq(info.counters.lost, 12);
    /* Saved DEGRADED, restored DEGRADED (nothing dropped by restoring). */
    cr_assert_eq(km_subscriber_save(s.sub, s.path), KM_OK);
    km_index_stats before, after;
    cr_assert_eq(km_index_get_stats(s.index, &before), KM_OK);
    rx_stop_sub(&s);
    rx_start_sub(&s, s.path);
    info = rx_info(&s);
    cr_assert_eq(info.state, KM_FEED_STATE_DEGRADED);
    cr_assert_eq(info.expected_seq, 35);
    rx_flush(&s);
    cr_assert_eq(km_index_get_stats(s.index, &after), KM_OK);
    cr_assert_eq(after.pairs, before.pairs);
    rx_free(&s);
}

static void periodic(km_subscriber_config *cfg, const char *path)
{
    cfg->snapshot_path = path;
    cfg->snapshot_interval_ms = 1;
}

Test(restart, periodic_snapshots_and_unclaimed_workers, .timeout = 30)
{
    rx s;
    rx_init(&s, 0);
    /* Recreate the subscriber with periodic snapshots. */
    rx_stop_sub(&s);
    s.index = km_test_make_index(16);
    km_subscriber_config_init(&s.cfg);
    km_test_feed_config(&s.cfg.feed, BS);
    s.cfg.log = s.cfg.feed.log;
    periodic(&s.cfg, s.path);
    cr_assert_eq(km_subscriber_create(s.index, &s.cfg, &s.sub), KM_OK);
    rx_follow(&s);
    km_feed_worker_info info;
    RX_WAIT(&s, info, info.state == KM_FEED_STATE_LIVE, 3000);
    int published = rx_publish_holding(&s, 15);
    rx_wait_applied(&s);
    km_test_sleep_ms(3);
    rx_flush(&s); /* the interval has passed: this flush writes a snapshot */
    km_subscriber_stats st;
    cr_assert_eq(km_subscriber_get_stats(s.sub, &st), KM_OK);
    cr_assert(st.snapshots >= 1);
    cr_assert_eq(st.snapshot_failures, 0);
    km_index_stats before;
    cr_assert_eq(km_index_get_stats(s.index, &before), KM_OK);
    cr_assert_eq(before.pairs, rx_engine_cached(&s));
    rx_stop_sub(&s);
    /* Restored but never added again: it can still be removed. */
    rx_start_sub(&s, s.path);
    info = rx_info(&s);
    cr_assert(info.awaiting_claim);
    cr_assert_eq(info.expected_seq, (uint64_t)published);
    km_index_stats is;
    cr_assert_eq(km_index_get_stats(s.index, &is), KM_OK);
    cr_assert_eq(is.pairs, before.pairs);
    cr_assert_eq(km_subscriber_remove_worker(s.sub, s.worker), KM_OK,
                 "%s", km_subscriber_last_error(s.sub));
    rx_flush(&s);
    cr_assert_eq(km_index_get_stats(s.index, &is), KM_OK);
    cr_assert_eq(is.pairs, 0);
    /* A failing periodic snapshot is counted, not fatal. */
    rx_stop_sub(&s);
    s.index = km_test_make_index(16);
    periodic(&s.cfg, "/nonexistent-dir/kvmatch.snap");
    s.cfg.restore_path = NULL;
    cr_assert_eq(km_subscriber_create(s.index, &s.cfg, &s.sub), KM_OK);
    km_test_sleep_ms(3);
    rx_flush(&s);
    cr_assert_eq(km_subscriber_get_stats(s.sub, &st), KM_OK);
    cr_assert_eq(st.snapshot_failures, 1);
    cr_assert(st.last_snapshot_error[0] != '\0');
    rx_free(&s);
}

/* Background periodic snapshots (snapshot_background): a forked child writes the file while the
 * flushing thread goes on; the result is counted when reaped, the file restores to the same index,
 * and a failing child is counted with its reason. */
Test(restart, background_snapshots, .timeout = 30)
{
    rx s;
    rx_init(&s, 0);
    rx_stop_sub(&s);
    s.index = km_test_make_index(16);
    km_subscriber_config_init(&s.cfg);
    km_test_feed_config(&s.cfg.feed, BS);
    s.cfg.log = s.cfg.feed.log;
    periodic(&s.cfg, s.path);
    s.cfg.snapshot_background = true;
    cr_assert_eq(km_subscriber_create(s.index, &s.cfg, &s.sub), KM_OK);
    rx_follow(&s);
    km_feed_worker_info info;
    RX_WAIT(&s, info, info.state == KM_FEED_STATE_LIVE, 3000);
    int published = rx_publish_holding(&s, 15);
    rx_wait_applied(&s);
    km_test_sleep_ms(3);
    rx_flush(&s); /* forks the writer */
    km_subscriber_stats st;
    for (int i = 0; i < 500; i++) {
        cr_assert_eq(km_subscriber_get_stats(s.sub, &st), KM_OK);
        if (st.snapshots || st.snapshot_failures)
            break;
        km_test_sleep_ms(10);
    }
    cr_assert_eq(st.snapshot_failures, 0, "%s", st.last_snapshot_error);
    cr_assert_geq(st.snapshots, 1);
    /* The newest state wins at shutdown: km_subscriber_save waits for any child first. */
    cr_assert_eq(km_subscriber_save(s.sub, NULL), KM_OK);
    km_index_stats before;
    cr_assert_eq(km_index_get_stats(s.index, &before), KM_OK);
    cr_assert_eq(before.pairs, rx_engine_cached(&s));
    rx_stop_sub(&s);
    rx_start_sub(&s, s.path);
    info = rx_info(&s);
    cr_assert_eq(info.expected_seq, (uint64_t)published);
    km_index_stats after;
    cr_assert_eq(km_index_get_stats(s.index, &after), KM_OK);
    cr_assert_eq(after.pairs, before.pairs);
    /* A child that cannot write is counted with its reason, and the subscriber goes on. */
    rx_stop_sub(&s);
    s.index = km_test_make_index(16);
    periodic(&s.cfg, "/nonexistent-dir/kvmatch.snap");
    s.cfg.restore_path = NULL;
    s.cfg.snapshot_background = true;
    cr_assert_eq(km_subscriber_create(s.index, &s.cfg, &s.sub), KM_OK);
    km_test_sleep_ms(3);
    rx_flush(&s);
    for (int i = 0; i < 500; i++) {
        cr_assert_eq(km_subscriber_get_stats(s.sub, &st), KM_OK);
        if (st.snapshots || st.snapshot_failures)
            break;
        km_test_sleep_ms(10);
    }
    cr_assert_eq(st.snapshot_failures, 1);
    cr_assert(strstr(st.last_snapshot_error, "background snapshot failed"), "%s",
              st.last_snapshot_error);
    cr_assert(strstr(st.last_snapshot_error, "nonexistent-dir"), "%s", st.last_snapshot_error);
    rx_free(&s);
}

/* The children of the calling thread (Linux: /proc/self/task/<tid>/children). */
static size_t my_children(pid_t *out, size_t cap)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/self/task/%ld/children", (long)syscall(SYS_gettid));
    FILE *f = fopen(path, "r");
    size_t n = 0;
    long pid;
    while (f && n < cap && fscanf(f, "%ld", &pid) == 1)
        out[n++] = (pid_t)pid;
    if (f)
        fclose(f);
    return n;
}

/* A background snapshot writer killed before its rename (the OOM killer: the fork can double a
 * large index's memory) is counted as failed, the previous snapshot is untouched, and its
 * temporary file (<path>.tmp.<pid>) is removed when it is reaped: no such death leaves an
 * index-sized file behind. */
Test(restart, a_killed_background_snapshot_leaves_no_temporary_file, .timeout = 60)
{
    rx s;
    rx_init(&s, 0);
    rx_stop_sub(&s);
    km_index_config ic;
    km_test_config(&ic, NULL);
    ic.backend = KM_BACKEND_CPU;
    ic.max_workers = 16;
    ic.initial_blocks = UINT64_C(1) << 21; /* tables of tens of MB: the write takes a while */
    cr_assert_eq(km_index_create(&ic, &s.index), KM_OK);
    km_subscriber_config_init(&s.cfg);
    km_test_feed_config(&s.cfg.feed, BS);
    s.cfg.log = s.cfg.feed.log;
    periodic(&s.cfg, s.path);
    s.cfg.snapshot_background = true;
    cr_assert_eq(km_subscriber_create(s.index, &s.cfg, &s.sub), KM_OK);
    km_subscriber_stats st;
    bool killed = false;
    for (int attempt = 0; attempt < 5 && !killed; attempt++) {
        km_test_sleep_ms(3);
        rx_flush(&s); /* forks the writer */
        pid_t kids[16];
        size_t n = my_children(kids, 16);
        /* Killed once it has created its temporary file (and is writing the tables). */
        char tmp[192];
        bool created = false;
        for (int i = 0; n == 1 && i < 2000 && !created; i++) {
            snprintf(tmp, sizeof tmp, "%s.tmp.%ld", s.path, (long)kids[0]);
            created = access(tmp, F_OK) == 0;
            if (!created)
                usleep(100);
        }
        for (size_t i = 0; created && i < n; i++)
            killed |= kill(kids[i], SIGKILL) == 0;
        /* Reaps the writer (waiting for it), then writes a snapshot in place: a flush would fork
         * the next writer at once (interval 1 ms), whose own temporary file is in progress. */
        cr_assert_eq(km_subscriber_save(s.sub, NULL), KM_OK, "%s", km_subscriber_last_error(s.sub));
        cr_assert_eq(km_subscriber_get_stats(s.sub, &st), KM_OK);
        killed = killed && st.snapshot_failures > 0; /* else it had finished: try again */
    }
    if (!killed)
        cr_skip_test("no background writer could be killed before it finished");
    cr_assert(strstr(st.last_snapshot_error, "killed by a signal"), "%s", st.last_snapshot_error);
    /* Nothing named <path>.tmp.* is left in the directory. */
    char cmd[256], out[256] = "";
    snprintf(cmd, sizeof cmd, "ls %s | grep -c '\\.tmp\\.' || true", s.dir);
    FILE *p = popen(cmd, "r");
    cr_assert_not_null(p);
    cr_assert_not_null(fgets(out, sizeof out, p));
    pclose(p);
    cr_assert_eq(atoi(out), 0, "%d temporary snapshot file(s) left in %s", atoi(out), s.dir);
    rx_free(&s);
}

/* Children of every thread of this process (a flush forks from the thread that calls it). */
static size_t all_children(void)
{
    glob_t g;
    size_t n = 0;
    if (glob("/proc/self/task/*/children", 0, NULL, &g) != 0)
        return 0;
    for (size_t i = 0; i < g.gl_pathc; i++) {
        FILE *f = fopen(g.gl_pathv[i], "r");
        long pid;
        while (f && fscanf(f, "%ld", &pid) == 1)
            n++;
        if (f)
            fclose(f);
    }
    globfree(&g);
    return n;
}

/* Wait (up to 1 s) until a child we sent SIGSTOP is stopped; false when it ended first. */
static bool child_stopped(pid_t pid)
{
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/%ld/stat", (long)pid);
    for (int i = 0; i < 1000; i++) {
        FILE *f = fopen(path, "r");
        char *close_paren = NULL;
        if (f && fgets(line, sizeof line, f))
            close_paren = strrchr(line, ')');
        if (f)
            fclose(f);
        if (!close_paren || close_paren[1] != ' ' || close_paren[2] == 'Z')
            return false;
        if (close_paren[2] == 'T' || close_paren[2] == 't')
            return true;
        usleep(1000);
    }
    return false;
}

/* km_subscriber_save on a thread of its own (the daemon's shutdown save). */
typedef struct saver {
    km_subscriber *sub;
    pthread_t thread;
    atomic_int done;
    int rc;
} saver;

static void *saver_main(void *arg)
{
    saver *sv = arg;
    sv->rc = km_subscriber_save(sv->sub, NULL);
    atomic_store(&sv->done, 1);
    return NULL;
}

/* Event intake and a flush, watched from a thread of their own: a subscriber that stalls would
 * hold up the watcher too. `applied`: the worker reached seq `next` within 10 s. */
typedef struct intake_probe {
    rx *s;
    uint64_t next;
    pthread_t thread;
    atomic_int done;
    bool applied;
} intake_probe;

static void *intake_probe_main(void *arg)
{
    intake_probe *p = arg;
    double end = km_test_now() + 10;
    km_feed_worker_info info = {0};
    while (km_subscriber_get_worker_info(p->s->sub, p->s->worker, &info) == KM_OK &&
           info.expected_seq != p->next && km_test_now() < end)
        km_test_sleep_ms(1);
    p->applied = info.expected_seq == p->next;
    km_subscriber_flush(p->s->sub, NULL); /* due (1 ms interval), but no child while a save waits */
    atomic_store(&p->done, 1);
    return NULL;
}

/* km_subscriber_save called while a background snapshot child writes (stopped here, so it writes
 * for as long as the test wants) waits for it, since the shutdown snapshot must be the newest. It
 * waits without the subscriber's lock held (held, the I/O thread could not hand a message to the
 * feed, and every flush and inspection call would block, for the child's whole run): events keep
 * arriving and flushes return (forking no other child) while it waits, and the snapshot it then
 * writes holds them. */
Test(restart, a_save_waiting_for_a_background_snapshot_leaves_intake_running, .timeout = 60)
{
    rx s;
    rx_init(&s, 0);
    rx_stop_sub(&s);
    km_index_config ic;
    km_test_config(&ic, NULL);
    ic.backend = KM_BACKEND_CPU;
    ic.max_workers = 16;
    ic.initial_blocks = UINT64_C(1) << 21; /* tables of tens of MB: the write takes a while */
    cr_assert_eq(km_index_create(&ic, &s.index), KM_OK);
    km_subscriber_config_init(&s.cfg);
    km_test_feed_config(&s.cfg.feed, BS);
    s.cfg.log = s.cfg.feed.log;
    periodic(&s.cfg, s.path);
    s.cfg.snapshot_background = true;
    cr_assert_eq(km_subscriber_create(s.index, &s.cfg, &s.sub), KM_OK);
    rx_follow(&s);
    km_feed_worker_info info;
    RX_WAIT(&s, info, info.state == KM_FEED_STATE_LIVE, 3000);
    rx_publish(&s, 10);
    rx_wait_applied(&s);
    pid_t child = 0;
    for (int attempt = 0; attempt < 10 && !child; attempt++) {
        km_test_sleep_ms(3);
        rx_flush(&s); /* reaps the previous writer, forks the next */
        pid_t kids[16];
        if (my_children(kids, 16) == 1 && kill(kids[0], SIGSTOP) == 0 && child_stopped(kids[0]))
            child = kids[0];
    }
    if (!child)
        cr_skip_test("no background writer could be stopped before it finished");
    km_subscriber_stats st;
    cr_assert_eq(km_subscriber_get_stats(s.sub, &st), KM_OK);
    uint64_t snapshots = st.snapshots;

    saver sv = {.sub = s.sub};
    cr_assert_eq(pthread_create(&sv.thread, NULL, saver_main, &sv), 0);
    km_test_sleep_ms(100); /* the save reaches its wait for the child */
    rx_publish(&s, 5);
    intake_probe probe = {.s = &s, .next = km_test_publisher_next_seq(s.pub)};
    cr_assert_eq(pthread_create(&probe.thread, NULL, intake_probe_main, &probe), 0);
    double end = km_test_now() + 5;
    while (!atomic_load(&probe.done) && km_test_now() < end)
        km_test_sleep_ms(1);
    bool probe_done = atomic_load(&probe.done), save_waited = !atomic_load(&sv.done);
    size_t children = all_children();
    kill(child, SIGCONT); /* whatever happened, let everything finish */
    pthread_join(probe.thread, NULL);
    pthread_join(sv.thread, NULL);
    cr_assert(probe_done && probe.applied,
              "while the save waited for the child, events were not applied or a flush blocked "
              "(probe %s, applied %d)", probe_done ? "done" : "stuck for 5 s", probe.applied);
    cr_assert(save_waited, "the save did not wait for the background writer");
    cr_assert_eq(children, 1, "a flush forked another writer while a save waited");
    cr_assert_eq(sv.rc, KM_OK, "%s", km_subscriber_last_error(s.sub));
    cr_assert_eq(km_subscriber_get_stats(s.sub, &st), KM_OK);
    cr_assert_eq(st.snapshot_failures, 0, "%s", st.last_snapshot_error);
    cr_assert_eq(st.snapshots, snapshots + 2, "the child's snapshot and the save's");
    /* The save's file is the newest: it holds the events that arrived while it waited. */
    rx_stop_sub(&s);
    rx_start_sub(&s, s.path);
    cr_assert_eq(rx_info(&s).expected_seq, 15);
    rx_free(&s);
}

Test(restart, engine_restarted_while_kvmatch_was_down, .timeout = 30)
{
    rx s;
    rx_init(&s, 0);
    rx_run_and_save(&s, 30);
    rx_stop_sub(&s);
    km_test_publisher_restart(s.pub); /* a new engine process, seq from 0 */
    km_test_engine_restart(&s.engine, 0xabc);
    rx_publish(&s, 10);
    rx_start_sub(&s, s.path);
    rx_follow(&s);
    rx_publish(&s, 10); /* seq 10: at or below the last seq seen (29): a new process */
    km_feed_worker_info info;
    RX_WAIT(&s, info, info.counters.restarts == 1 && info.expected_seq == 20 &&
                          !info.replay_in_flight && info.buffered_messages == 0, 5000);
    rx_check_truth(&s); /* the old process's blocks are gone */
    cr_assert_eq(info.state, KM_FEED_STATE_LIVE);
    cr_assert_eq(info.counters.lost, 0);
    rx_free(&s);
}

/* ---- bad snapshots: clear error, start empty, normal bootstrap --------------------------------- */

typedef enum damage { DAMAGE_FLIP, DAMAGE_TRUNCATE, DAMAGE_VERSION, DAMAGE_MISSING } damage;

static void damage_file(const char *path, damage d)
{
    FILE *f = fopen(path, "r+b");
    cr_assert(f);
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    if (d == DAMAGE_FLIP) {
        fseek(f, size - 5, SEEK_SET); /* inside the feed section: payload checksum catches it */
        int c = fgetc(f);
        fseek(f, size - 5, SEEK_SET);
        fputc(c ^ 0x5a, f);
    } else if (d == DAMAGE_VERSION) {
        unsigned char h[64];
        fseek(f, 0, SEEK_SET);
        cr_assert_eq(fread(h, 1, 64, f), 64);
        h[8] = 99; /* format version 99 (a future one), header checksum recomputed */
        uint64_t sum = XXH3_64bits(h, 56);
        for (int i = 0; i < 8; i++)
            h[56 + i] = (unsigned char)(sum >> (8 * i));
        fseek(f, 0, SEEK_SET);
        cr_assert_eq(fwrite(h, 1, 64, f), 64);
    }
    fclose(f);
    if (d == DAMAGE_TRUNCATE)
        cr_assert_eq(truncate(path, size / 2), 0);
    if (d == DAMAGE_MISSING)
        cr_assert_eq(unlink(path), 0);
}

static void bad_snapshot(damage d, int status, const char *words)
{
    rx s;
    rx_init(&s, 0);
    rx_run_and_save(&s, 20);
    rx_stop_sub(&s);
    damage_file(s.path, d);
    rx_start_sub(&s, s.path);
    km_subscriber_stats st;
    cr_assert_eq(km_subscriber_get_stats(s.sub, &st), KM_OK);
    cr_assert(!st.restored);
    cr_assert_eq(st.restore_status, status, "restore gave %s", km_error_name(st.restore_status));
    cr_assert(strstr(km_error_name(st.restore_status), words) != NULL);
    uint32_t n = 99;
    cr_assert_eq(km_subscriber_get_workers(s.sub, NULL, 0, &n), KM_OK);
    cr_assert_eq(n, 0);
    km_index_stats is;
    cr_assert_eq(km_index_get_stats(s.index, &is), KM_OK);
    cr_assert_eq(is.pairs, 0);
    /* Normal bootstrap: the replay buffer still holds everything, so the index is complete. */
    rx_follow(&s);
    rx_publish(&s, 5);
    km_feed_worker_info info = rx_wait_applied(&s);
    cr_assert(!info.restored);
    cr_assert_eq(info.state, KM_FEED_STATE_LIVE);
    rx_check_reference(&s);
    rx_free(&s);
}

Test(restart, corrupt_snapshot_starts_empty, .timeout = 30)
{
    bad_snapshot(DAMAGE_FLIP, KM_ERR_CORRUPT, "CORRUPT");
}

Test(restart, truncated_snapshot_starts_empty, .timeout = 30)
{
    bad_snapshot(DAMAGE_TRUNCATE, KM_ERR_CORRUPT, "CORRUPT");
}

Test(restart, version_mismatch_starts_empty, .timeout = 30)
{
    bad_snapshot(DAMAGE_VERSION, KM_ERR_INCOMPATIBLE, "INCOMPATIBLE");
}

Test(restart, missing_snapshot_starts_empty, .timeout = 30)
{
    bad_snapshot(DAMAGE_MISSING, KM_ERR_IO, "IO");
}

/* The whole file (the caller frees it); NULL when it cannot be read. */
static unsigned char *slurp(const char *path, size_t *size)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *data = malloc(n > 0 ? (size_t)n : 1);
    cr_assert_not_null(data);
    *size = fread(data, 1, n > 0 ? (size_t)n : 0, f);
    fclose(f);
    return data;
}

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

/* "<path>.unrestorable-<UTC time>" for the time t. */
static void unrestorable_name(const char *path, time_t t, char *out, size_t size)
{
    struct tm utc;
    gmtime_r(&t, &utc);
    char stamp[32];
    strftime(stamp, sizeof stamp, "%Y%m%dT%H%M%SZ", &utc);
    snprintf(out, size, "%s.unrestorable-%s", path, stamp);
}

/* A snapshot that does not restore (another format version here) is the only copy of what it
 * held: the subscriber starts empty, keeps the file at its path until it would save there, then
 * moves it to "<path>.unrestorable-<UTC time>" (with ".1" when that name is taken: a file already
 * there is never replaced), logs the new name at error level and shows it in its stats; the new
 * snapshot takes the path, and later saves move nothing more. */
Test(restart, a_snapshot_that_did_not_restore_is_kept_not_overwritten, .timeout = 30)
{
    rx s;
    rx_init(&s, 0);
    rx_run_and_save(&s, 20);
    rx_stop_sub(&s);
    damage_file(s.path, DAMAGE_VERSION);
    size_t damaged_size = 0;
    unsigned char *damaged = slurp(s.path, &damaged_size);
    cr_assert_not_null(damaged);
    /* Files already holding the names the next seconds would give. */
    char decoys[6][256];
    time_t t0 = time(NULL);
    for (int i = 0; i < 6; i++) {
        unrestorable_name(s.path, t0 - 1 + i, decoys[i], sizeof decoys[i]);
        FILE *f = fopen(decoys[i], "w");
        cr_assert_not_null(f);
        fputs("decoy", f);
        fclose(f);
    }

    s.index = km_test_make_index(16);
    km_subscriber_config_init(&s.cfg);
    km_test_feed_config(&s.cfg.feed, BS);
    s.cfg.replay_timeout_ms = 2000;
    g_log[0] = '\0';
    s.cfg.log = keep_log;
    s.cfg.restore_path = s.path;
    s.cfg.snapshot_path = s.path;
    cr_assert_eq(km_subscriber_create(s.index, &s.cfg, &s.sub), KM_OK);
    km_subscriber_stats st;
    cr_assert_eq(km_subscriber_get_stats(s.sub, &st), KM_OK);
    cr_assert(!st.restored);
    cr_assert_eq(st.restore_status, KM_ERR_INCOMPATIBLE);
    cr_assert(strstr(st.restore_error, s.path), "restore error: %s", st.restore_error);
    cr_assert_str_eq(st.unrestorable_kept_as, "", "nothing saved yet: the file stays");
    size_t size = 0;
    unsigned char *now = slurp(s.path, &size);
    cr_assert(now && size == damaged_size && !memcmp(now, damaged, size));
    free(now);

    rx_follow(&s);
    rx_publish(&s, 5);
    rx_wait_applied(&s);
    int rc = km_subscriber_save(s.sub, NULL);
    cr_assert_eq(rc, KM_OK, "save: %s", km_subscriber_last_error(s.sub));
    cr_assert_eq(km_subscriber_get_stats(s.sub, &st), KM_OK);
    cr_assert(strstr(st.unrestorable_kept_as, ".unrestorable-") &&
                  !strcmp(st.unrestorable_kept_as + strlen(st.unrestorable_kept_as) - 2, ".1"),
              "kept as %s", st.unrestorable_kept_as);
    now = slurp(st.unrestorable_kept_as, &size);
    cr_assert(now && size == damaged_size && !memcmp(now, damaged, size),
              "the kept file is the one that did not restore");
    free(now);
    for (int i = 0; i < 6; i++) {
        now = slurp(decoys[i], &size);
        cr_assert(now && size == 5 && !memcmp(now, "decoy", 5), "%s was replaced", decoys[i]);
        free(now);
    }
    pthread_mutex_lock(&g_log_lock);
    char expected[512];
    snprintf(expected, sizeof expected, "was moved to %s", st.unrestorable_kept_as);
    cr_assert(strstr(g_log, KM_LOG_ERROR "subscriber: restore failed") &&
                  strstr(g_log, KM_LOG_ERROR "subscriber: the snapshot") &&
                  strstr(g_log, expected),
              "log: %s", g_log);
    pthread_mutex_unlock(&g_log_lock);
    char kept[sizeof st.unrestorable_kept_as];
    snprintf(kept, sizeof kept, "%s", st.unrestorable_kept_as);
    /* The new snapshot took the path; another save moves nothing. */
    cr_assert_eq(km_subscriber_save(s.sub, NULL), KM_OK);
    cr_assert_eq(km_subscriber_get_stats(s.sub, &st), KM_OK);
    cr_assert_str_eq(st.unrestorable_kept_as, kept);
    cr_assert_eq(st.snapshots, 2);
    km_index *index = km_test_make_index(16);
    km_feed *feed = make_feed(index);
    cr_assert_eq(km_feed_restore(feed, s.path, 1), KM_OK, "%s", km_feed_last_error(feed));
    km_feed_destroy(feed);
    km_index_destroy(index);
    unlink(kept);
    for (int i = 0; i < 6; i++)
        unlink(decoys[i]);
    free(damaged);
    rx_free(&s);
}

/* The index of max_workers 8 and segment_blocks 4 that the snapshot fuzz harness's inputs were
 * written for (tests/fuzz/fuzz_snapshot.c). */
static km_index *fuzz_shaped_index(void)
{
    km_index_config cfg;
    km_index_config_init(&cfg);
    cfg.max_workers = 8;
    cfg.segment_blocks = 4;
    cfg.initial_blocks = 16;
    cfg.threads = 1;
    cfg.backend = KM_BACKEND_CPU;
    km_index *index = NULL;
    cr_assert_eq(km_index_create(&cfg, &index), KM_OK);
    return index;
}

static uint32_t depth_on(km_index *index, uint32_t worker, const uint64_t *hashes, uint32_t n)
{
    km_match_results res;
    km_match_results_init(&res);
    km_request req = {hashes, n};
    cr_assert_eq(km_index_match_batch(index, &req, 1, &res), KM_OK);
    uint32_t depth = 0;
    for (uint32_t i = 0; i < res.requests[0].count; i++)
        if (res.matches[res.requests[0].first + i].worker == worker)
            depth = res.matches[res.requests[0].first + i].depth;
    km_match_results_free(&res);
    return depth;
}

/* A restore that fails leaves the index holding what it held and the feed following nobody. */
static void expect_restore_refused(km_index *index, km_feed *feed, const char *path, int want,
                                   const uint64_t *known, uint32_t n_known, uint32_t known_worker)
{
    km_index_stats before, after;
    cr_assert_eq(km_index_get_stats(index, &before), KM_OK);
    int rc = km_feed_restore(feed, path, 1);
    cr_assert_eq(rc, want, "restore gave %s: %s", km_error_name(rc), km_feed_last_error(feed));
    expect_named_once(km_feed_last_error(feed), want);
    cr_assert_eq(km_index_get_stats(index, &after), KM_OK);
    cr_assert_eq(after.pairs, before.pairs);
    cr_assert_eq(after.blocks, before.blocks);
    cr_assert_eq(after.segment_pairs, before.segment_pairs);
    cr_assert_eq(depth_on(index, known_worker, known, n_known), n_known);
    uint32_t n_workers = 99;
    cr_assert_eq(km_feed_get_workers(feed, NULL, 0, &n_workers), KM_OK);
    cr_assert_eq(n_workers, 0);
}

/* A bad feed section inside a valid index file: the index part is not installed, the index keeps
 * its content. */
Test(restart, bad_feed_section_leaves_the_index_as_it_was, .timeout = 20)
{
    char dir[64], path[128];
    snprintf(dir, sizeof dir, "/tmp/kvmatch-restart-XXXXXX");
    cr_assert(mkdtemp(dir) != NULL);
    snprintf(path, sizeof path, "%s/x.snap", dir);
    km_index *a = km_test_make_index(16);
    uint64_t hashes[3] = {11, 12, 13};
    km_update u = {KM_UPDATE_STORE, 4, KM_NO_PARENT, hashes, 3, KM_TIER_DEVICE};
    cr_assert_eq(km_index_apply(a, &u, 1, NULL), KM_OK);
    const char junk[] = "not a feed state";
    cr_assert_eq(km_index_save(a, path, junk, sizeof junk), KM_OK);
    km_index *b = km_test_make_index(16);
    uint64_t held[4] = {21, 22, 23, 24};
    km_update hu = {KM_UPDATE_STORE, 2, KM_NO_PARENT, held, 4, KM_TIER_DEVICE};
    cr_assert_eq(km_index_apply(b, &hu, 1, NULL), KM_OK);
    km_feed *fb = make_feed(b);
    expect_restore_refused(b, fb, path, KM_ERR_CORRUPT, held, 4, 2);
    cr_assert(strstr(km_feed_last_error(fb), "feed state") != NULL, "%s", km_feed_last_error(fb));
    cr_assert_eq(depth_on(b, 4, hashes, 3), 0, "the snapshot's pairs were installed");
    km_feed_destroy(fb);
    km_index_destroy(a);
    km_index_destroy(b);
    unlink(path);
    rmdir(dir);
}

/* A snapshot whose feed section is of format version 1 (its chain hashes follow the earlier LoRA
 * and salt seed rules) is refused, never misread: the index it carries is not kept. */
Test(restart, snapshot_of_the_earlier_hash_rules_is_refused, .timeout = 20)
{
    char dir[64], path[128];
    snprintf(dir, sizeof dir, "/tmp/kvmatch-restart-XXXXXX");
    cr_assert(mkdtemp(dir) != NULL);
    snprintf(path, sizeof path, "%s/x.snap", dir);
    km_index *a = km_test_make_index(16);
    km_feed *fa = make_feed(a);
    km_feed_worker_config wc = {4, "w4", false};
    cr_assert_eq(km_feed_add_worker(fa, &wc, 1), KM_OK);
    cr_assert_eq(km_feed_flush(fa, 2, NULL), KM_OK);
    uint64_t hashes[3] = {11, 12, 13};
    km_update u = {KM_UPDATE_STORE, 4, KM_NO_PARENT, hashes, 3, KM_TIER_DEVICE};
    cr_assert_eq(km_index_apply(a, &u, 1, NULL), KM_OK);
    void *state;
    size_t size;
    cr_assert_eq(km_feed_export_state(fa, &state, &size), KM_OK);
    unsigned char *bytes = state;
    cr_assert_eq(bytes[8], KM_FEED_STATE_VERSION);
    bytes[8] = 1;
    cr_assert_eq(km_index_save(a, path, state, size), KM_OK);
    free(state);
    km_index *b = km_test_make_index(16);
    km_feed *fb = make_feed(b);
    cr_assert_eq(km_feed_restore(fb, path, 3), KM_ERR_INCOMPATIBLE, "%s", km_feed_last_error(fb));
    cr_assert(strstr(km_feed_last_error(fb), "version") != NULL, "%s", km_feed_last_error(fb));
    km_index_stats is;
    cr_assert_eq(km_index_get_stats(b, &is), KM_OK);
    cr_assert_eq(is.pairs, 0);
    uint32_t n;
    cr_assert_eq(km_feed_get_workers(fb, NULL, 0, &n), KM_OK);
    cr_assert_eq(n, 0);
    km_feed_destroy(fa);
    km_feed_destroy(fb);
    km_index_destroy(a);
    km_index_destroy(b);
    unlink(path);
    rmdir(dir);
}

/* A snapshot the fuzzer found (tests/fuzz/corpus/snapshot/failed-restore-leaves-pairs): its index
 * part's per-worker block counts add up to its table's pairs but disagree worker by worker, and its
 * feed section is invalid. The index refuses it on its own, and a restore leaves nothing of it
 * behind, in an empty index or a full one. Sealed as the harness seals its input. */
Test(restart, fuzzed_snapshot_refused_leaves_nothing_behind, .timeout = 20)
{
    const char *input = "tests/fuzz/corpus/snapshot/failed-restore-leaves-pairs";
    FILE *f = fopen(input, "rb");
    cr_assert(f, "%s missing (tests run from the repository root)", input);
    unsigned char buf[1 << 16];
    size_t size = fread(buf, 1, sizeof buf, f);
    fclose(f);
    cr_assert(size >= 64 && size < sizeof buf && memcmp(buf, "KVMSNAP1", 8) == 0);
    uint64_t payload_hash = XXH3_64bits(buf + 64, size - 64);
    memcpy(buf + 40, &payload_hash, 8);
    uint64_t header_hash = XXH3_64bits(buf, 56);
    memcpy(buf + 56, &header_hash, 8);
    char dir[64], path[128];
    snprintf(dir, sizeof dir, "/tmp/kvmatch-restart-XXXXXX");
    cr_assert(mkdtemp(dir) != NULL);
    snprintf(path, sizeof path, "%s/fuzzed.snap", dir);
    f = fopen(path, "wb");
    cr_assert(f && fwrite(buf, 1, size, f) == size);
    fclose(f);

    /* The index part alone is refused: a clear trusts a worker's count of 0 to mean it holds
     * nothing. */
    km_index *probe = fuzz_shaped_index();
    cr_assert_eq(km_index_load(probe, path, NULL, NULL), KM_ERR_CORRUPT);
    cr_assert(strstr(km_index_last_error(probe), "block count") != NULL, "%s",
              km_index_last_error(probe));
    km_index_stats ps;
    cr_assert_eq(km_index_get_stats(probe, &ps), KM_OK);
    cr_assert_eq(ps.pairs, 0, "nothing of the refused snapshot is loaded");
    km_index_destroy(probe);

    /* Restored with the feed: refused, and nothing of it stays, in an empty index or a full one. */
    for (int holding = 0; holding < 2; holding++) {
        km_index *index = fuzz_shaped_index();
        static const uint64_t known[5] = {0x1111, 0x2222, 0x3333, 0x4444, 0x5555};
        if (holding)
            cr_assert_eq(km_index_store(index, 1, KM_NO_PARENT, known, 5), KM_OK);
        km_feed_config fcfg;
        km_feed_config_init(&fcfg);
        km_feed *feed = NULL;
        cr_assert_eq(km_feed_create(index, &fcfg, &feed), KM_OK);
        km_index_stats before, after;
        cr_assert_eq(km_index_get_stats(index, &before), KM_OK);
        int rc = km_feed_restore(feed, path, 1000);
        cr_assert_lt(rc, 0);
        cr_assert(km_feed_last_error(feed)[0] != '\0');
        cr_assert_eq(km_index_get_stats(index, &after), KM_OK);
        cr_assert_eq(after.pairs, before.pairs, "pairs %" PRIu64 " after, %" PRIu64 " before",
                     after.pairs, before.pairs);
        cr_assert_eq(after.blocks, before.blocks);
        if (holding)
            cr_assert_eq(depth_on(index, 1, known, 5), 5);
        uint32_t n_workers = 99;
        cr_assert_eq(km_feed_get_workers(feed, NULL, 0, &n_workers), KM_OK);
        cr_assert_eq(n_workers, 0);
        /* and the feed bootstraps a worker normally afterwards */
        km_feed_worker_config wc = {2, "w2", false};
        cr_assert_eq(km_feed_add_worker(feed, &wc, 2000), KM_OK, "%s", km_feed_last_error(feed));
        cr_assert_eq(km_feed_flush(feed, 3000, NULL), KM_OK);
        km_feed_destroy(feed);
        km_index_destroy(index);
    }
    unlink(path);
    rmdir(dir);
}

/* ---- `kvmatch follow`: snapshot on SIGTERM, restore at start ------------------------------------ */

static const char *follow_bin(void)
{
    const char *b = getenv("KM_BIN");
    return b && *b ? b : "build/kvmatch";
}

/* Start `kvmatch follow` with stdout on a pipe (stderr too when `with_stderr`). */
static pid_t follow_start_with(const char *endpoint_arg, const char *snapshot,
                              const char *block_size, bool with_stderr, FILE **out)
{
    int fds[2];
    cr_assert_eq(pipe(fds), 0);
    int parent = getpid();
    pid_t pid = fork();
    cr_assert(pid >= 0);
    if (pid == 0) {
        km_test_die_with_parent(parent);
        dup2(fds[1], 1);
        if (with_stderr) {
            dup2(fds[1], 2);
        } else if (!getenv("KM_TEST_FEED_LOG")) {
            FILE *null = fopen("/dev/null", "w");
            if (null)
                dup2(fileno(null), 2);
        }
        close(fds[0]);
        close(fds[1]);
        execl(follow_bin(), follow_bin(), "follow", "--endpoint", endpoint_arg, "--snapshot",
              snapshot, "--status-s", "1", "--block-size", block_size, (char *)NULL);
        _exit(127);
    }
    close(fds[1]);
    *out = fdopen(fds[0], "r");
    cr_assert(*out);
    return pid;
}

static pid_t follow_start(const char *endpoint_arg, const char *snapshot, FILE **out)
{
    return follow_start_with(endpoint_arg, snapshot, "4", false, out);
}

/* Read lines until one contains `what`; false at end of output. */
static bool follow_wait_line(FILE *f, const char *what)
{
    char line[1024];
    while (fgets(line, sizeof line, f))
        if (strstr(line, what))
            return true;
    return false;
}

static int follow_stop(pid_t pid, FILE *f)
{
    kill(pid, SIGTERM);
    int status = 0;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    fclose(f);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* Publish 20 messages on s's engine, run `kvmatch follow` of its worker (the argument naming its
 * endpoints written into arg) until it has applied them, and stop it: SIGTERM, its snapshot
 * written to s's path, exit 0. */
static void follow_twenty_and_stop(rx *s, char *arg, size_t arg_size)
{
    rx_publish(s, 20);
    snprintf(arg, arg_size, "%u=%s,%s", s->worker, km_test_publisher_endpoint(s->pub),
             km_test_publisher_replay_endpoint(s->pub));
    FILE *out;
    pid_t pid = follow_start(arg, s->path, &out);
    cr_assert(follow_wait_line(out, "LIVE, next seq 20"), "follow never applied the history");
    cr_assert_eq(follow_stop(pid, out), 0);
}

Test(restart, follow_snapshots_on_sigterm_and_restores, .timeout = 40)
{
    if (access(follow_bin(), X_OK) != 0)
        cr_skip_test("%s not built", follow_bin());
    rx s;
    rx_init(&s, 0);
    char arg[600];
    follow_twenty_and_stop(&s, arg, sizeof arg);

    /* The snapshot restores: same worker, same position, the index of a gap-free run. */
    km_index *index = km_test_make_index(1024);
    km_feed *feed = make_feed(index);
    int rc = km_feed_restore(feed, s.path, 1);
    cr_assert_eq(rc, KM_OK, "%s", km_feed_last_error(feed));
    km_feed_worker_info info;
    cr_assert_eq(km_feed_get_worker_info(feed, s.worker, &info), KM_OK);
    cr_assert_eq(info.expected_seq, 20);
    km_index *ref = km_test_reference_index(s.pub, 1024, s.worker, &s.cfg.feed);
    size_t n;
    uint64_t *universe = km_test_engine_chains(&s.engine, true, &n);
    char why[256];
    int ok = km_test_index_same(index, s.worker, ref, s.worker, universe, n, why, sizeof why);
    free(universe);
    km_index_destroy(ref);
    KM_CHECK(ok, "follow's snapshot vs gap-free run: %s", why);
    km_feed_destroy(feed);
    km_index_destroy(index);

    /* Started again: it restores and resumes from seq 20. */
    rx_publish(&s, 5);
    FILE *out;
    pid_t pid = follow_start(arg, s.path, &out);
    cr_assert(follow_wait_line(out, "restore"), "no restore line");
    cr_assert(follow_wait_line(out, "LIVE, next seq 25"), "follow never resumed");
    cr_assert_eq(follow_stop(pid, out), 0);
    rx_free(&s);
}

/* `kvmatch follow` restarted with another block size: its snapshot does not restore
 * (KM_ERR_INCOMPATIBLE), which it says at start and in its status lines; its shutdown snapshot
 * does not overwrite the file, which it moves aside and names in its exit note; the kept file
 * still restores under the block size it was written with. */
Test(restart, follow_keeps_a_snapshot_of_another_block_size, .timeout = 40)
{
    if (access(follow_bin(), X_OK) != 0)
        cr_skip_test("%s not built", follow_bin());
    rx s;
    rx_init(&s, 0);
    char arg[600];
    follow_twenty_and_stop(&s, arg, sizeof arg);

    FILE *out;
    pid_t pid = follow_start_with(arg, s.path, "16", true, &out);
    char restore_line[256];
    snprintf(restore_line, sizeof restore_line, "restore %s: KM_ERR_INCOMPATIBLE", s.path);
    cr_assert(follow_wait_line(out, restore_line), "no restore line naming the failure");
    cr_assert(follow_wait_line(out, "the snapshot did not restore at start (KM_ERR_INCOMPATIBLE)"),
              "no status line says it");
    kill(pid, SIGTERM);
    char line[1024], kept[512] = "";
    snprintf(restore_line, sizeof restore_line, "it is kept as %s.unrestorable-", s.path);
    while (fgets(line, sizeof line, out))
        if (strstr(line, restore_line))
            sscanf(strstr(line, "it is kept as ") + strlen("it is kept as "), "%511s", kept);
    cr_assert(kept[0], "no exit note names where the snapshot was kept");
    cr_assert_eq(follow_stop(pid, out), 0);

    km_index *index = km_test_make_index(1024);
    km_feed *feed = make_feed(index); /* block size 4, as it was written */
    int rc = km_feed_restore(feed, kept, 1);
    cr_assert_eq(rc, KM_OK, "the kept snapshot: %s", km_feed_last_error(feed));
    km_feed_worker_info info;
    cr_assert_eq(km_feed_get_worker_info(feed, s.worker, &info), KM_OK);
    cr_assert_eq(info.expected_seq, 20);
    km_feed_destroy(feed);
    km_index_destroy(index);
    unlink(kept);
    rx_free(&s);
}
