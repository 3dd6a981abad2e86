/* SPDX-License-Identifier: Apache-2.0 */
/* Active work (include/kvmatch/active.h) and approximate mode (include/kvmatch/approx.h).
 *
 * Suite `active`: each lifecycle step's exact load numbers, corrections by engine-reported cached
 * tokens, TTL expiry (recently touched entries survive, old ones expire oldest first, callbacks get
 * the right summaries), unknown / late / duplicate / out-of-order events and bad arguments (each a
 * code, a message and no load change), worker removal, the entry bound, a random run against a
 * brute-force model of the in-flight entries, and one with a ring of 3 ended ids against a model of
 * every counter, drained to zero at its end.
 *
 * Suite `approx`: the updates a record / expire / clear / capacity change produces, TTL refresh,
 * eviction order, the buffer's pointer contract, bad arguments, and the invariant "what km_approx
 * believes == what its updates put in a real km_index" on random sequences against a plain list of
 * (worker, hash, last touch), with every counter, the next expiry, and a final expiry to nothing.
 * Randomized tests print their seed (KM_TEST_SEED). Clocks are synthetic, so every test is
 * deterministic given its seed. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvmatch/active.h"
#include "kvmatch/approx.h"
#include "kvmatch/engine_model.h"
#include "test_util.h"

/* ================================ active ================================================= */

static km_active *make_active(uint32_t max_workers, uint64_t ttl_ns, uint32_t max_entries,
                              uint32_t remember_ended)
{
    km_active_config cfg;
    km_active_config_init(&cfg);
    cfg.max_workers = max_workers;
    cfg.ttl_ns = ttl_ns;
    cfg.max_entries = max_entries;
    cfg.remember_ended = remember_ended;
    km_active *a = NULL;
    cr_assert_eq(km_active_create(&cfg, &a), KM_OK);
    cr_assert_not_null(a);
    return a;
}

static km_active_load load_of(const km_active *a, uint32_t worker)
{
    km_active_load l;
    cr_assert_eq(km_active_worker_load(a, worker, &l), KM_OK);
    return l;
}

#define ASSERT_LOAD(a, w, inflight, prefill, decode)                                           \
    do {                                                                                       \
        km_active_load l_ = load_of((a), (w));                                                 \
        cr_assert_eq(l_.in_flight, (uint64_t)(inflight), "worker %u in_flight %" PRIu64       \
                     " != %" PRIu64, (unsigned)(w), l_.in_flight, (uint64_t)(inflight));      \
        cr_assert_eq(l_.pending_prefill_tokens, (uint64_t)(prefill),                           \
                     "worker %u prefill %" PRIu64 " != %" PRIu64, (unsigned)(w),               \
                     l_.pending_prefill_tokens, (uint64_t)(prefill));                          \
        cr_assert_eq(l_.active_decode_blocks, (uint64_t)(decode),                              \
                     "worker %u decode %" PRIu64 " != %" PRIu64, (unsigned)(w),                \
                     l_.active_decode_blocks, (uint64_t)(decode));                             \
    } while (0)

static km_active_stats stats_of(const km_active *a)
{
    km_active_stats s;
    cr_assert_eq(km_active_get_stats(a, &s), KM_OK);
    return s;
}

/* An error must come with a sentence that starts with the code's name. */
static void assert_error(const km_active *a, int rc, int expected)
{
    cr_assert_eq(rc, expected, "got %s (%s), expected %s", km_error_name(rc),
                 km_active_last_error(a), km_error_name(expected));
    const char *msg = km_active_last_error(a);
    cr_assert(strncmp(msg, km_error_name(expected), strlen(km_error_name(expected))) == 0 &&
                  strlen(msg) > strlen(km_error_name(expected)) + 4,
              "message '%s' does not explain %s", msg, km_error_name(expected));
}

Test(active, lifecycle_exact_load_numbers, .timeout = 10)
{
    km_active *a = make_active(4, 1000000, 100, 16);
    km_active_key k1 = km_active_key_of("req-1", "att-1");
    km_active_key k2 = km_active_key_of("req-2", "att-1");

    /* prompt 100, 32 predicted cached, 50 expected output, 16-token blocks:
     * prefill 68, decode ceil(150 / 16) = 10. */
    cr_assert_eq(km_active_begin(a, 1, &k1, 100, 32, 50, 16, 1000), KM_OK);
    ASSERT_LOAD(a, 1, 1, 68, 10);
    ASSERT_LOAD(a, 0, 0, 0, 0);
    /* prediction above the prompt: nothing to prefill; decode ceil(64 / 16) = 4 exactly. */
    cr_assert_eq(km_active_begin(a, 1, &k2, 48, 500, 16, 16, 1100), KM_OK);
    ASSERT_LOAD(a, 1, 2, 68, 14);
    cr_assert(km_active_contains(a, &k1));

    cr_assert_eq(km_active_dispatched(a, &k1, 1200), KM_OK);
    ASSERT_LOAD(a, 1, 2, 68, 14);
    cr_assert_eq(km_active_dispatched(a, &k1, 1250), KM_OK); /* idempotent */
    ASSERT_LOAD(a, 1, 2, 68, 14);

    cr_assert_eq(km_active_first_token(a, &k1, 40, 1300), KM_OK);
    ASSERT_LOAD(a, 1, 2, 0, 14);

    km_active_summary s;
    cr_assert_eq(km_active_finish(a, &k1, KM_ACTIVE_END_COMPLETE, 1400, &s), KM_OK);
    ASSERT_LOAD(a, 1, 1, 0, 4);
    cr_assert_str_eq(s.request_id, "req-1");
    cr_assert_eq(s.request_id_len, 5);
    cr_assert_str_eq(s.attempt_id, "att-1");
    cr_assert_eq(s.worker, 1);
    cr_assert_eq(s.end, KM_ACTIVE_END_COMPLETE);
    cr_assert_eq(s.prompt_tokens, 100);
    cr_assert_eq(s.predicted_cached_tokens, 32);
    cr_assert_eq(s.expected_output_tokens, 50);
    cr_assert_eq(s.block_size, 16);
    cr_assert_eq(s.prefill_tokens_charged, 68);
    cr_assert_eq(s.decode_blocks_charged, 10);
    cr_assert_eq(s.engine_cached_tokens, 40);
    cr_assert(s.dispatched && s.first_token);
    cr_assert_eq(s.begin_ns, 1000);
    cr_assert_eq(s.dispatched_ns, 1200); /* the first DISPATCHED */
    cr_assert_eq(s.first_token_ns, 1300);
    cr_assert_eq(s.last_event_ns, 1300);
    cr_assert_eq(s.end_ns, 1400);
    cr_assert(!km_active_contains(a, &k1));

    /* FINISHED before FIRST_TOKEN releases the pending prefill too. */
    km_active_key k3 = km_active_key_of("req-3", "");
    cr_assert_eq(km_active_begin(a, 2, &k3, 17, 0, 0, 16, 1500), KM_OK);
    ASSERT_LOAD(a, 2, 1, 17, 2);
    cr_assert_eq(km_active_finish(a, &k3, KM_ACTIVE_END_CANCELLED, 1600, &s), KM_OK);
    ASSERT_LOAD(a, 2, 0, 0, 0);
    cr_assert(!s.dispatched && !s.first_token);
    cr_assert_eq(s.engine_cached_tokens, KM_ACTIVE_CACHED_UNKNOWN);
    cr_assert_str_eq(s.attempt_id, "");

    /* Empty request: nothing to prefill or decode, still in flight. */
    km_active_key k4 = km_active_key_of("req-4", "x");
    cr_assert_eq(km_active_begin(a, 3, &k4, 0, 0, 0, 16, 1700), KM_OK);
    ASSERT_LOAD(a, 3, 1, 0, 0);

    km_active_stats st = stats_of(a);
    cr_assert_eq(st.begun, 4);
    cr_assert_eq(st.ended[KM_ACTIVE_END_COMPLETE], 1);
    cr_assert_eq(st.ended[KM_ACTIVE_END_CANCELLED], 1);
    cr_assert_eq(st.entries, 2);
    cr_assert_eq(st.total.in_flight, 2);
    cr_assert_eq(st.total.active_decode_blocks, 4);
    cr_assert_eq(st.saturations, 0);
    km_active_destroy(a);
}

/* Requests sharing a cached prefix on one worker count its blocks once, for as long as any of
 * them is in flight: not twice while two hold it, and not zero times once the first has ended. */
Test(active, a_shared_prefix_counts_once_while_any_holder_is_live, .timeout = 10)
{
    km_active *a = make_active(4, 1000000, 100, 16);
    km_active_key ka = km_active_key_of("a", "0"), kb = km_active_key_of("b", "0"),
                  kc = km_active_key_of("c", "0");
    const uint64_t prefix = 77;
    /* Each: 1,600 prompt tokens (the first 1,600 a shared 100-block prefix) + 800 output = 150
     * blocks of 16 tokens. */
    cr_assert_eq(km_active_begin(a, 1, &ka, 1600, 0, 800, 16, 1000), KM_OK);
    cr_assert_eq(km_active_share_prefix(a, &ka, prefix, 1600), KM_OK);
    cr_assert_eq(load_of(a, 1).allocated_blocks, 150);
    cr_assert_eq(km_active_begin(a, 1, &kb, 1600, 1600, 800, 16, 1100), KM_OK);
    cr_assert_eq(km_active_share_prefix(a, &kb, prefix, 1600), KM_OK);
    cr_assert_eq(load_of(a, 1).allocated_blocks, 200, "the prefix once, each one's own 50");
    cr_assert_eq(km_active_prefix_sharers(a, 1, prefix), 2);
    km_active_summary s;
    cr_assert_eq(km_active_finish(a, &ka, KM_ACTIVE_END_COMPLETE, 1200, &s), KM_OK);
    cr_assert_eq(load_of(a, 1).allocated_blocks, 150, "b still holds the prefix");
    cr_assert_eq(km_active_prefix_sharers(a, 1, prefix), 1);
    cr_assert_eq(km_active_begin(a, 1, &kc, 1600, 1600, 800, 16, 1300), KM_OK);
    cr_assert_eq(km_active_share_prefix(a, &kc, prefix, 1600), KM_OK);
    cr_assert_eq(load_of(a, 1).allocated_blocks, 200);
    /* A move takes c's own blocks and, with nothing known shared there, the prefix's too. */
    cr_assert_eq(km_active_move(a, &kc, 2, 1400), KM_OK);
    cr_assert_eq(load_of(a, 1).allocated_blocks, 150);
    cr_assert_eq(load_of(a, 2).allocated_blocks, 150);
    cr_assert_eq(km_active_finish(a, &kb, KM_ACTIVE_END_COMPLETE, 1500, &s), KM_OK);
    cr_assert_eq(load_of(a, 1).allocated_blocks, 0, "the last holder takes the prefix with it");
    cr_assert_eq(km_active_prefix_sharers(a, 1, prefix), 0);
    km_active_destroy(a);
}

Test(active, engine_cached_tokens_correct_pending_prefill, .timeout = 10)
{
    km_active *a = make_active(2, 1000000, 100, 16);
    km_active_key k = km_active_key_of("r", "a");
    cr_assert_eq(km_active_begin(a, 0, &k, 200, 64, 0, 16, 10), KM_OK);
    ASSERT_LOAD(a, 0, 1, 136, 13);
    /* The engine found more cached than predicted. */
    cr_assert_eq(km_active_report_cached(a, &k, 160, 20), KM_OK);
    ASSERT_LOAD(a, 0, 1, 40, 13);
    /* ... or less; and more than the prompt clamps to 0. */
    cr_assert_eq(km_active_report_cached(a, &k, 0, 30), KM_OK);
    ASSERT_LOAD(a, 0, 1, 200, 13);
    cr_assert_eq(km_active_report_cached(a, &k, 999, 40), KM_OK);
    ASSERT_LOAD(a, 0, 1, 0, 13);
    cr_assert_eq(km_active_report_cached(a, &k, 100, 50), KM_OK);
    ASSERT_LOAD(a, 0, 1, 100, 13);
    assert_error(a, km_active_report_cached(a, &k, -5, 55), KM_ERR_INVALID_ARGUMENT);
    ASSERT_LOAD(a, 0, 1, 100, 13);
    cr_assert_eq(km_active_first_token(a, &k, KM_ACTIVE_CACHED_UNKNOWN, 60), KM_OK);
    ASSERT_LOAD(a, 0, 1, 0, 13);
    /* After FIRST_TOKEN a report is only kept for the record. */
    cr_assert_eq(km_active_report_cached(a, &k, 7, 70), KM_OK);
    ASSERT_LOAD(a, 0, 1, 0, 13);
    km_active_summary s;
    cr_assert_eq(km_active_finish(a, &k, KM_ACTIVE_END_INCOMPLETE, 80, &s), KM_OK);
    cr_assert_eq(s.engine_cached_tokens, 7);
    cr_assert_eq(s.prefill_tokens_charged, 100);
    cr_assert_eq(s.end, KM_ACTIVE_END_INCOMPLETE);
    ASSERT_LOAD(a, 0, 0, 0, 0);
    km_active_stats st = stats_of(a);
    cr_assert_eq(st.corrections, 4);
    cr_assert_eq(st.saturations, 0);
    km_active_destroy(a);
}

typedef struct collected {
    char request[8][64];
    char attempt[8][64];
    km_active_summary s[8];
    size_t n;
} collected;

static void collect(void *user, const km_active_summary *s)
{
    collected *c = user;
    cr_assert_lt(c->n, 8);
    cr_assert_eq(strlen(s->request_id), s->request_id_len);
    cr_assert_eq(strlen(s->attempt_id), s->attempt_id_len);
    snprintf(c->request[c->n], 64, "%s", s->request_id);
    snprintf(c->attempt[c->n], 64, "%s", s->attempt_id);
    c->s[c->n] = *s;
    c->n++;
}

Test(active, ttl_expiry_keeps_recently_touched_entries, .timeout = 10)
{
    const uint64_t ttl = 1000;
    km_active *a = make_active(4, ttl, 100, 16);
    km_active_key ka = km_active_key_of("A", "1"), kb = km_active_key_of("B", "1"),
                  kc = km_active_key_of("C", "1");
    cr_assert_eq(km_active_begin(a, 0, &ka, 32, 0, 32, 16, 0), KM_OK);   /* 32 prefill, 4 decode */
    cr_assert_eq(km_active_begin(a, 1, &kb, 16, 0, 0, 16, 100), KM_OK);  /* 16 prefill, 1 decode */
    cr_assert_eq(km_active_begin(a, 0, &kc, 16, 16, 16, 16, 200), KM_OK); /* 0 prefill, 2 decode */
    cr_assert_eq(km_active_dispatched(a, &ka, 500), KM_OK);               /* A touched at 500 */
    cr_assert_eq(km_active_first_token(a, &kc, 0, 600), KM_OK);           /* C touched at 600 */

    collected c = {0};
    size_t n = 99;
    cr_assert_eq(km_active_expire(a, 1099, collect, &c, &n), KM_OK);
    cr_assert_eq(n, 0); /* B is 999 ns old: not yet */
    cr_assert_eq(km_active_expire(a, 1100, collect, &c, &n), KM_OK);
    cr_assert_eq(n, 1); /* exactly ttl old: expired */
    cr_assert_str_eq(c.request[0], "B");
    cr_assert_eq(c.s[0].end, KM_ACTIVE_END_EXPIRED);
    cr_assert_eq(c.s[0].worker, 1);
    cr_assert_eq(c.s[0].last_event_ns, 100);
    cr_assert_eq(c.s[0].end_ns, 1100);
    cr_assert_eq(c.s[0].prefill_tokens_charged, 16);
    ASSERT_LOAD(a, 1, 0, 0, 0);
    ASSERT_LOAD(a, 0, 2, 32, 6);

    /* Both remaining expire in last-touch order: A (500) then C (600). */
    cr_assert_eq(km_active_expire(a, 5000, collect, &c, &n), KM_OK);
    cr_assert_eq(n, 2);
    cr_assert_str_eq(c.request[1], "A");
    cr_assert(c.s[1].dispatched && c.s[1].dispatched_ns == 500);
    cr_assert_str_eq(c.request[2], "C");
    cr_assert(c.s[2].first_token && c.s[2].engine_cached_tokens == 0);
    ASSERT_LOAD(a, 0, 0, 0, 0);

    km_active_stats st = stats_of(a);
    cr_assert_eq(st.ended[KM_ACTIVE_END_EXPIRED], 3);
    cr_assert_eq(st.entries, 0);

    /* A late FINISHED for an expired entry is "late", not a protocol error, and changes nothing. */
    assert_error(a, km_active_finish(a, &ka, KM_ACTIVE_END_COMPLETE, 5100, NULL), KM_ERR_NOT_FOUND);
    cr_assert(strstr(km_active_last_error(a), "expired") != NULL);
    cr_assert_eq(stats_of(a).late, 1);

    /* A clock that goes back counts as no time passing: nothing expires early. */
    cr_assert_eq(km_active_begin(a, 2, &ka, 1, 0, 0, 1, 6000), KM_OK);
    cr_assert_eq(km_active_dispatched(a, &ka, 10), KM_OK); /* touch at 6000, not 10 */
    cr_assert_eq(km_active_expire(a, 6999, NULL, NULL, &n), KM_OK);
    cr_assert_eq(n, 0);
    cr_assert_eq(km_active_expire(a, 7000, NULL, NULL, &n), KM_OK);
    cr_assert_eq(n, 1);
    km_active_destroy(a);
}

Test(active, unknown_duplicate_and_out_of_order_events, .timeout = 10)
{
    km_active *a = make_active(4, 1000000, 100, 16);
    km_active_key k = km_active_key_of("req", "0"), other = km_active_key_of("nobody", "0");

    assert_error(a, km_active_dispatched(a, &other, 1), KM_ERR_NOT_FOUND);
    assert_error(a, km_active_first_token(a, &other, 0, 1), KM_ERR_NOT_FOUND);
    assert_error(a, km_active_report_cached(a, &other, 0, 1), KM_ERR_NOT_FOUND);
    assert_error(a, km_active_finish(a, &other, KM_ACTIVE_END_ERROR, 1, NULL), KM_ERR_NOT_FOUND);
    cr_assert(strstr(km_active_last_error(a), "nobody") != NULL);
    cr_assert_eq(stats_of(a).unknown, 4);

    cr_assert_eq(km_active_begin(a, 0, &k, 64, 0, 64, 16, 10), KM_OK);
    assert_error(a, km_active_begin(a, 1, &k, 64, 0, 64, 16, 11), KM_ERR_PROTOCOL);
    ASSERT_LOAD(a, 0, 1, 64, 8);
    ASSERT_LOAD(a, 1, 0, 0, 0);
    cr_assert_eq(km_active_first_token(a, &k, 0, 12), KM_OK);
    assert_error(a, km_active_first_token(a, &k, 0, 13), KM_ERR_PROTOCOL);
    assert_error(a, km_active_dispatched(a, &k, 14), KM_ERR_PROTOCOL);
    cr_assert_eq(stats_of(a).out_of_order, 1);
    ASSERT_LOAD(a, 0, 1, 0, 8);
    cr_assert_eq(km_active_finish(a, &k, KM_ACTIVE_END_ERROR, 15, NULL), KM_OK);
    ASSERT_LOAD(a, 0, 0, 0, 0);
    /* Everything after FINISHED is a duplicate with the outcome named; no load goes negative. */
    assert_error(a, km_active_finish(a, &k, KM_ACTIVE_END_COMPLETE, 16, NULL), KM_ERR_PROTOCOL);
    cr_assert(strstr(km_active_last_error(a), "after FINISHED") != NULL);
    cr_assert(strstr(km_active_last_error(a), "error") != NULL);
    assert_error(a, km_active_first_token(a, &k, 0, 17), KM_ERR_PROTOCOL);
    assert_error(a, km_active_dispatched(a, &k, 18), KM_ERR_PROTOCOL);
    ASSERT_LOAD(a, 0, 0, 0, 0);

    km_active_stats st = stats_of(a);
    cr_assert_eq(st.duplicates, 5); /* begin twice, FIRST_TOKEN twice, three after FINISHED */
    cr_assert_eq(st.ended[KM_ACTIVE_END_ERROR], 1);
    cr_assert_eq(st.saturations, 0);

    /* The same key may begin again (a new life); events then reach the live entry. */
    cr_assert_eq(km_active_begin(a, 2, &k, 16, 0, 0, 16, 20), KM_OK);
    cr_assert_eq(km_active_dispatched(a, &k, 21), KM_OK);
    ASSERT_LOAD(a, 2, 1, 16, 1);
    km_active_destroy(a);

    /* Without the ended ring, an id that finished reads as unknown. */
    a = make_active(4, 1000000, 100, 0);
    cr_assert_eq(km_active_begin(a, 0, &k, 64, 0, 64, 16, 10), KM_OK);
    km_active_summary s;
    cr_assert_eq(km_active_finish(a, &k, KM_ACTIVE_END_COMPLETE, 15, &s), KM_OK);
    cr_assert_str_eq(s.request_id, "req"); /* summary storage without the ring */
    assert_error(a, km_active_finish(a, &k, KM_ACTIVE_END_COMPLETE, 16, NULL), KM_ERR_NOT_FOUND);
    cr_assert_eq(stats_of(a).unknown, 1);
    km_active_destroy(a);
}

Test(active, bad_arguments_are_refused_without_change, .timeout = 10)
{
    km_active *a = make_active(4, 1000000, 2, 16);
    km_active_key good = km_active_key_of("r", "a");
    cr_assert_eq(km_active_begin(NULL, 0, &good, 1, 0, 1, 16, 0), KM_ERR_NULL_POINTER);
    cr_assert_eq(km_active_last_arrival(NULL, 0), 0);
    cr_assert_eq(km_active_last_arrival(a, 4), 0, "past max_workers");
    assert_error(a, km_active_begin(a, 0, NULL, 1, 0, 1, 16, 0), KM_ERR_NULL_POINTER);
    km_active_key empty = km_active_key_of("", "a");
    assert_error(a, km_active_begin(a, 0, &empty, 1, 0, 1, 16, 0), KM_ERR_INVALID_ARGUMENT);
    km_active_key null_id = {NULL, 0, "a", 1};
    assert_error(a, km_active_begin(a, 0, &null_id, 1, 0, 1, 16, 0), KM_ERR_NULL_POINTER);
    char long_id[KM_ACTIVE_ID_MAX + 2];
    memset(long_id, 'x', sizeof long_id - 1);
    long_id[sizeof long_id - 1] = '\0';
    km_active_key too_long = km_active_key_of(long_id, "a");
    assert_error(a, km_active_begin(a, 0, &too_long, 1, 0, 1, 16, 0), KM_ERR_TOO_LARGE);
    too_long.request_id_len = KM_ACTIVE_ID_MAX; /* exactly the limit is fine */
    cr_assert_eq(km_active_begin(a, 0, &too_long, 1, 0, 1, 16, 0), KM_OK);
    cr_assert_eq(km_active_finish(a, &too_long, KM_ACTIVE_END_COMPLETE, 1, NULL), KM_OK);
    km_active_key with_nul = {"ab\0c", 4, "a", 1};
    assert_error(a, km_active_begin(a, 0, &with_nul, 1, 0, 1, 16, 0), KM_ERR_INVALID_ARGUMENT);
    assert_error(a, km_active_begin(a, 4, &good, 1, 0, 1, 16, 0), KM_ERR_WORKER_RANGE);
    assert_error(a, km_active_begin(a, 0, &good, 1, 0, 1, 0, 0), KM_ERR_BLOCK_SIZE);
    cr_assert_eq(stats_of(a).begun, 1);
    cr_assert_eq(stats_of(a).entries, 0);

    cr_assert_eq(km_active_begin(a, 0, &good, 10, 0, 6, 16, 0), KM_OK);
    assert_error(a, km_active_finish(a, &good, KM_ACTIVE_END_EXPIRED, 1, NULL),
                 KM_ERR_INVALID_ARGUMENT);
    assert_error(a, km_active_finish(a, &good, (km_active_end)42, 1, NULL), KM_ERR_INVALID_ARGUMENT);
    assert_error(a, km_active_first_token(a, &good, -2, 1), KM_ERR_INVALID_ARGUMENT);
    ASSERT_LOAD(a, 0, 1, 10, 1);
    cr_assert(km_active_contains(a, &good));

    /* The entry bound. */
    km_active_key k2 = km_active_key_of("r2", "a"), k3 = km_active_key_of("r3", "a");
    cr_assert_eq(km_active_begin(a, 1, &k2, 1, 0, 1, 16, 0), KM_OK);
    assert_error(a, km_active_begin(a, 1, &k3, 1, 0, 1, 16, 0), KM_ERR_OVERLOADED);
    ASSERT_LOAD(a, 1, 1, 1, 1);

    km_active_load l;
    cr_assert_eq(km_active_worker_load(a, 4, &l), KM_ERR_WORKER_RANGE);
    cr_assert_eq(km_active_worker_load(a, 0, NULL), KM_ERR_NULL_POINTER);
    cr_assert_eq(km_active_remove_worker(a, 4, 0, NULL, NULL, NULL), KM_ERR_WORKER_RANGE);
    cr_assert_eq(km_active_expire(NULL, 0, NULL, NULL, NULL), KM_ERR_NULL_POINTER);
    km_active_destroy(NULL);

    km_active_config cfg;
    km_active_config_init(&cfg);
    cfg.ttl_ns = 0;
    km_active *bad = (km_active *)1;
    cr_assert_eq(km_active_create(&cfg, &bad), KM_ERR_INVALID_ARGUMENT);
    cr_assert_null(bad);
    km_active_config_init(&cfg);
    cfg.max_workers = 0;
    cr_assert_eq(km_active_create(&cfg, &bad), KM_ERR_INVALID_ARGUMENT);
    cr_assert_eq(km_active_create(NULL, NULL), KM_ERR_NULL_POINTER);
    cr_assert_eq(km_active_create(NULL, &bad), KM_OK); /* defaults */
    km_active_destroy(bad);
    cr_assert_str_eq(km_active_end_name(KM_ACTIVE_END_WORKER_REMOVED), "worker_removed");
    cr_assert_str_eq(km_active_end_name((km_active_end)99), "unknown");
    km_active_destroy(a);
}

Test(active, attempts_and_split_ids_are_separate_entries, .timeout = 10)
{
    km_active *a = make_active(4, 1000000, 100, 16);
    km_active_key a1 = km_active_key_of("req", "1"), a2 = km_active_key_of("req", "2");
    km_active_key split1 = km_active_key_of("ab", "c"), split2 = km_active_key_of("a", "bc");
    /* Same bytes, different split: the attempt id is not just a suffix. */
    cr_assert_eq(km_active_begin(a, 0, &a1, 16, 0, 0, 16, 0), KM_OK);
    cr_assert_eq(km_active_begin(a, 1, &a2, 32, 0, 0, 16, 0), KM_OK);
    cr_assert_eq(km_active_begin(a, 2, &split1, 48, 0, 0, 16, 0), KM_OK);
    cr_assert_eq(km_active_begin(a, 3, &split2, 64, 0, 0, 16, 0), KM_OK);
    km_active_summary s;
    cr_assert_eq(km_active_finish(a, &a2, KM_ACTIVE_END_COMPLETE, 1, &s), KM_OK);
    cr_assert_eq(s.worker, 1);
    ASSERT_LOAD(a, 0, 1, 16, 1);
    cr_assert_eq(km_active_finish(a, &split2, KM_ACTIVE_END_COMPLETE, 1, &s), KM_OK);
    cr_assert_eq(s.worker, 3);
    cr_assert_str_eq(s.request_id, "a");
    cr_assert_str_eq(s.attempt_id, "bc");
    ASSERT_LOAD(a, 2, 1, 48, 3);
    cr_assert(km_active_contains(a, &a1) && km_active_contains(a, &split1));
    /* Non-NUL-terminated input (a msgpack string inside a larger buffer). */
    const char frame[] = "reqXXX1YYY";
    km_active_key raw = {frame, 3, frame + 6, 1};
    cr_assert(km_active_contains(a, &raw));
    cr_assert_eq(km_active_finish(a, &raw, KM_ACTIVE_END_COMPLETE, 2, &s), KM_OK);
    cr_assert_str_eq(s.request_id, "req");
    cr_assert_str_eq(s.attempt_id, "1");
    km_active_destroy(a);
}

/* Prompts of 2^32 - 1 tokens hold about 2^63 attention pairs each: the worker's sum is exact
 * while it fits, reads UINT64_MAX (never a wrapped, smaller count) past it, and comes back exactly
 * as the entries release theirs, in any way, without a saturation. */
Test(active, pending_pairs_of_huge_prompts_never_wrap, .timeout = 10)
{
    km_active *a = make_active(4, 1000000, 100, 16);
    const uint32_t huge = UINT32_MAX;
    const uint64_t one = km_engine_model_chunk_pairs(0, huge);
    cr_assert_eq(one, (UINT64_C(1) << 63) - (UINT64_C(1) << 31));
    km_active_key k[4];
    char names[4][8];
    const uint64_t expect[4] = {one, 2 * one, UINT64_MAX, UINT64_MAX};
    for (int i = 0; i < 4; i++) {
        snprintf(names[i], sizeof names[i], "h%d", i);
        k[i] = km_active_key_of(names[i], NULL);
        cr_assert_eq(km_active_begin(a, 1, &k[i], huge, 0, 0, 16, 1 + (uint64_t)i), KM_OK);
        cr_assert_eq(load_of(a, 1).pending_prefill_pairs, expect[i], "after %d begins", i + 1);
    }
    cr_assert_eq(stats_of(a).total.pending_prefill_pairs, UINT64_MAX);
    /* Back down exactly: a move, a first token, a correction, finishes. */
    cr_assert_eq(km_active_move(a, &k[3], 2, 10), KM_OK);
    cr_assert_eq(load_of(a, 1).pending_prefill_pairs, UINT64_MAX, "3 x 2^63 still past 2^64");
    cr_assert_eq(load_of(a, 2).pending_prefill_pairs, one);
    cr_assert_eq(km_active_first_token(a, &k[0], KM_ACTIVE_CACHED_UNKNOWN, 11), KM_OK);
    cr_assert_eq(load_of(a, 1).pending_prefill_pairs, 2 * one);
    cr_assert_eq(km_active_report_cached(a, &k[2], (int64_t)huge - 1000, 12), KM_OK);
    cr_assert_eq(load_of(a, 1).pending_prefill_pairs,
                 one + km_engine_model_chunk_pairs((uint64_t)huge - 1000, 1000));
    cr_assert_eq(km_active_finish(a, &k[1], KM_ACTIVE_END_COMPLETE, 13, NULL), KM_OK);
    cr_assert_eq(km_active_finish(a, &k[2], KM_ACTIVE_END_COMPLETE, 14, NULL), KM_OK);
    cr_assert_eq(km_active_finish(a, &k[3], KM_ACTIVE_END_COMPLETE, 15, NULL), KM_OK);
    cr_assert_eq(load_of(a, 1).pending_prefill_pairs, 0);
    cr_assert_eq(load_of(a, 2).pending_prefill_pairs, 0);
    cr_assert_eq(stats_of(a).saturations, 0);
    km_active_destroy(a);
}

Test(active, remove_worker_drops_its_entries, .timeout = 10)
{
    km_active *a = make_active(4, 1000000, 100, 16);
    km_active_key k[5];
    char names[5][8];
    for (int i = 0; i < 5; i++) {
        snprintf(names[i], sizeof names[i], "r%d", i);
        k[i] = km_active_key_of(names[i], "a");
        cr_assert_eq(km_active_begin(a, i < 3 ? 1 : 2, &k[i], 16, 0, 16, 16, (uint64_t)i), KM_OK);
    }
    cr_assert_eq(km_active_first_token(a, &k[1], 0, 10), KM_OK);
    ASSERT_LOAD(a, 1, 3, 32, 6);
    collected c = {0};
    size_t n = 0;
    cr_assert_eq(km_active_remove_worker(a, 1, 20, collect, &c, &n), KM_OK);
    cr_assert_eq(n, 3);
    cr_assert_eq(c.n, 3);
    int seen = 0;
    for (size_t i = 0; i < c.n; i++) {
        cr_assert_eq(c.s[i].end, KM_ACTIVE_END_WORKER_REMOVED);
        cr_assert_eq(c.s[i].worker, 1);
        cr_assert_eq(c.s[i].end_ns, 20);
        seen |= 1 << (c.request[i][1] - '0');
    }
    cr_assert_eq(seen, 7);
    ASSERT_LOAD(a, 1, 0, 0, 0);
    ASSERT_LOAD(a, 2, 2, 32, 4);
    assert_error(a, km_active_dispatched(a, &k[0], 30), KM_ERR_NOT_FOUND);
    cr_assert(strstr(km_active_last_error(a), "worker_removed") != NULL);
    km_active_stats st = stats_of(a);
    cr_assert_eq(st.late, 1);
    cr_assert_eq(st.ended[KM_ACTIVE_END_WORKER_REMOVED], 3);
    cr_assert_eq(st.saturations, 0);
    /* Expiry after removal only sees the other worker's entries. */
    cr_assert_eq(km_active_expire(a, 2000000, NULL, NULL, &n), KM_OK);
    cr_assert_eq(n, 2);
    ASSERT_LOAD(a, 2, 0, 0, 0);
    km_active_destroy(a);
}

/* ---- random run against a brute-force model --------------------------------------------------- */

#define PM_KEYS 48
#define PM_WORKERS 5

typedef struct model_entry {
    int live;
    int ended; /* -1 never, else km_active_end of the latest end */
    uint32_t worker;
    int dispatched, first_token;
    uint32_t prompt, predicted, output, block_size;
    uint64_t prefill_pending, prefill_charged, decode;
    uint64_t pairs_pending; /* attention pairs of the pending prefill, counted one token at a time */
    /* The shared-prefix charge: its own (allocated), and the prefix's, charged to the worker once
     * by the first holder for as long as any holder is live (charged, the same in every holder) */
    uint64_t prefix_key, prefix_blocks, allocated, charged;
    int64_t engine_cached;
    uint64_t begin, dispatched_at, first_token_at, last_touch;
} model_entry;

typedef struct model {
    model_entry e[PM_KEYS];
    char req[PM_KEYS][16], att[PM_KEYS][8];
    uint64_t clock;
    uint64_t ttl;
    /* expire callback bookkeeping */
    int expired_seen[PM_KEYS];
    uint64_t last_expired_touch;
    int order_ok;
    /* Arrivals counted (begins, moves to another worker) and each worker's latest (0: none since
     * the start or its removal). */
    uint64_t arrivals, last_arrival[PM_WORKERS];
} model;

static int model_key_index(const model *m, const km_active_summary *s)
{
    for (int i = 0; i < PM_KEYS; i++)
        if (strcmp(m->req[i], s->request_id) == 0 && strcmp(m->att[i], s->attempt_id) == 0)
            return i;
    return -1;
}

static void model_check_summary(const model *m, int i, const km_active_summary *s)
{
    const model_entry *e = &m->e[i];
    KM_CHECK(s->worker == e->worker, "key %d worker %u != %u", i, s->worker, e->worker);
    KM_CHECK(s->prompt_tokens == e->prompt && s->predicted_cached_tokens == e->predicted &&
                 s->expected_output_tokens == e->output && s->block_size == e->block_size,
             "key %d request sizes differ", i);
    KM_CHECK(s->prefill_tokens_charged == e->prefill_charged, "key %d prefill charged %" PRIu64
             " != %" PRIu64, i, s->prefill_tokens_charged, e->prefill_charged);
    KM_CHECK(s->decode_blocks_charged == e->decode, "key %d decode", i);
    KM_CHECK(s->engine_cached_tokens == e->engine_cached, "key %d engine cached", i);
    KM_CHECK(s->dispatched == (bool)e->dispatched && s->first_token == (bool)e->first_token,
             "key %d flags", i);
    KM_CHECK(s->begin_ns == e->begin && s->last_event_ns == e->last_touch, "key %d times: begin %" PRIu64 "/%" PRIu64 " last %" PRIu64 "/%" PRIu64, i, s->begin_ns, e->begin, s->last_event_ns, e->last_touch);
    KM_CHECK(!e->dispatched || s->dispatched_ns == e->dispatched_at, "key %d dispatched_ns", i);
    KM_CHECK(!e->first_token || s->first_token_ns == e->first_token_at, "key %d first_token_ns", i);
}

static void model_on_expired(void *user, const km_active_summary *s)
{
    model *m = user;
    int i = model_key_index(m, s);
    KM_CHECK(i >= 0 && m->e[i].live, "expired an unknown or dead key");
    KM_CHECK(s->end == KM_ACTIVE_END_EXPIRED, "end %d", (int)s->end);
    model_check_summary(m, i, s);
    if (s->last_event_ns < m->last_expired_touch)
        m->order_ok = 0;
    m->last_expired_touch = s->last_event_ns;
    m->expired_seen[i]++;
}

static void model_on_removed(void *user, const km_active_summary *s)
{
    model *m = user;
    int i = model_key_index(m, s);
    KM_CHECK(i >= 0 && m->e[i].live, "removed an unknown or dead key");
    KM_CHECK(s->end == KM_ACTIVE_END_WORKER_REMOVED, "end %d", (int)s->end);
    model_check_summary(m, i, s);
    m->expired_seen[i]++;
}

/* Expected status of an event on key i that is not live. */
static int model_miss(const model *m, int i)
{
    if (m->e[i].ended < 0)
        return KM_ERR_NOT_FOUND;
    if (m->e[i].ended == KM_ACTIVE_END_EXPIRED || m->e[i].ended == KM_ACTIVE_END_WORKER_REMOVED)
        return KM_ERR_NOT_FOUND;
    return KM_ERR_PROTOCOL;
}

static void model_end(model *m, int i, int end)
{
    m->e[i].live = 0;
    m->e[i].ended = end;
}

/* The attention pairs of `pending` tokens prefilled after `cached` ones: token k (1-based) of the
 * prefill attends to cached + k tokens. */
static uint64_t pairs_by_counting(uint64_t cached, uint64_t pending)
{
    uint64_t pairs = 0;
    for (uint64_t k = 1; k <= pending; k++)
        pairs += cached + k;
    return pairs;
}

static void model_compare_loads(const model *m, const km_active *a, int step)
{
    km_active_stats st = stats_of(a);
    uint64_t total_live = 0;
    for (uint32_t w = 0; w < PM_WORKERS; w++) {
        uint64_t inflight = 0, prefill = 0, decode = 0, prefilling = 0, allocated = 0, pairs = 0;
        for (int i = 0; i < PM_KEYS; i++)
            if (m->e[i].live && m->e[i].worker == w) {
                inflight++;
                prefill += m->e[i].prefill_pending;
                pairs += m->e[i].pairs_pending;
                decode += m->e[i].decode;
                prefilling += !m->e[i].first_token;
                allocated += m->e[i].allocated;
                int first = m->e[i].prefix_key != 0;
                for (int j = 0; j < i && first; j++)
                    if (m->e[j].live && m->e[j].worker == w &&
                        m->e[j].prefix_key == m->e[i].prefix_key)
                        first = 0;
                if (first)
                    allocated += m->e[i].charged;
            }
        total_live += inflight;
        km_active_load l = load_of(a, w);
        KM_CHECK(l.in_flight == inflight && l.pending_prefill_tokens == prefill &&
                     l.active_decode_blocks == decode,
                 "step %d worker %u: load (%" PRIu64 ", %" PRIu64 ", %" PRIu64
                 ") != model (%" PRIu64 ", %" PRIu64 ", %" PRIu64 ")",
                 step, w, l.in_flight, l.pending_prefill_tokens, l.active_decode_blocks, inflight,
                 prefill, decode);
        KM_CHECK(l.pending_prefill_pairs == pairs,
                 "step %d worker %u: pending pairs %" PRIu64 " != model %" PRIu64, step, w,
                 l.pending_prefill_pairs, pairs);
        KM_CHECK(l.prefilling == prefilling && l.allocated_blocks == allocated,
                 "step %d worker %u: prefilling %" PRIu64 " allocated %" PRIu64 " != model %" PRIu64
                 " %" PRIu64, step, w, l.prefilling, l.allocated_blocks, prefilling, allocated);
        KM_CHECK(km_active_last_arrival(a, w) == m->last_arrival[w],
                 "step %d worker %u: last arrival %" PRIu64 " != model %" PRIu64, step, w,
                 km_active_last_arrival(a, w), m->last_arrival[w]);
    }
    KM_CHECK(st.entries == total_live, "step %d entries %" PRIu64 " != %" PRIu64, step, st.entries,
             total_live);
    KM_CHECK(st.saturations == 0, "step %d saturations", step);
    for (int i = 0; i < PM_KEYS; i++) {
        km_active_key k = km_active_key_of(m->req[i], m->att[i]);
        KM_CHECK(km_active_contains(a, &k) == m->e[i].live, "step %d key %d liveness", step, i);
    }
}

Test(active, random_lifecycles_match_a_model, .timeout = 30)
{
    km_rng r;
    km_rng_init(&r, km_test_seed());
    static model m;
    memset(&m, 0, sizeof m);
    m.ttl = 5000;
    for (int i = 0; i < PM_KEYS; i++) {
        snprintf(m.req[i], sizeof m.req[i], "req-%d", i / 3);
        snprintf(m.att[i], sizeof m.att[i], "%d", i % 3);
        m.e[i].ended = -1;
    }
    /* remember_ended large enough that no end is forgotten: the model classifies every miss. */
    km_active *a = make_active(PM_WORKERS, m.ttl, 1000, 1u << 16);
    uint64_t expect_unknown = 0, expect_late = 0, expect_dup = 0, expect_ooo = 0, expect_moves = 0;
    uint64_t seen_clock = 0;
    for (int step = 0; step < 20000; step++) {
        if (km_rng_percent(&r, 3) && m.clock > 10)
            m.clock -= km_rng_below(&r, 10); /* a clock going back is clamped */
        else
            m.clock += km_rng_below(&r, 200);
        uint64_t now_model = m.clock;
        /* What the handle uses: the latest time of a call that succeeded (a failed call changes
         * nothing, its clock included). */
        uint64_t now = now_model > seen_clock ? now_model : seen_clock;
        int i = (int)km_rng_below(&r, PM_KEYS);
        model_entry *e = &m.e[i];
        km_active_key k = km_active_key_of(m.req[i], m.att[i]);
        uint32_t op = km_rng_below(&r, 100);
        int rc;
        if (op < 30) {
            uint32_t w = km_rng_below(&r, PM_WORKERS);
            uint32_t prompt = km_rng_below(&r, 3000), predicted = km_rng_below(&r, 3500);
            uint32_t output = km_rng_below(&r, 1000), bs = 1 + km_rng_below(&r, 64);
            rc = km_active_begin(a, w, &k, prompt, predicted, output, bs, now_model);
            if (e->live) {
                KM_CHECK(rc == KM_ERR_PROTOCOL, "step %d begin of live key: %d", step, rc);
                expect_dup++;
            } else {
                KM_CHECK(rc == KM_OK, "step %d begin: %d %s", step, rc, km_active_last_error(a));
                memset(e, 0, sizeof *e);
                m.last_arrival[w] = ++m.arrivals;
                e->live = 1;
                e->ended = -1;
                e->worker = w;
                e->prompt = prompt;
                e->predicted = predicted;
                e->output = output;
                e->block_size = bs;
                e->prefill_pending = e->prefill_charged = prompt - (predicted < prompt ? predicted : prompt);
                e->pairs_pending = pairs_by_counting(prompt - e->prefill_pending, e->prefill_pending);
                e->decode = ((uint64_t)prompt + output + bs - 1) / bs;
                e->allocated = e->decode;
                e->engine_cached = KM_ACTIVE_CACHED_UNKNOWN;
                e->begin = e->last_touch = now;
                /* Half the time a cached prefix, from a few names: requests on one worker that
                 * name the same one share its blocks, all but the first holder. */
                if (km_rng_percent(&r, 50)) {
                    uint64_t key = 1 + km_rng_below(&r, 3);
                    uint32_t tokens = km_rng_below(&r, prompt + 1);
                    KM_CHECK(km_active_share_prefix(a, &k, key, tokens) == KM_OK, "step %d share", step);
                    if (key && tokens) {
                        e->prefix_key = key;
                        e->prefix_blocks = tokens / bs;
                        e->charged = e->prefix_blocks < e->decode ? e->prefix_blocks : e->decode;
                        for (int j = 0; j < PM_KEYS; j++)
                            if (j != i && m.e[j].live && m.e[j].worker == w &&
                                m.e[j].prefix_key == key) {
                                e->charged = m.e[j].charged; /* the first holder's */
                                break;
                            }
                        e->allocated = e->decode > e->charged ? e->decode - e->charged : 0;
                    }
                    KM_CHECK(km_active_share_prefix(a, &k, key, tokens) ==
                                 (e->prefix_key ? KM_ERR_PROTOCOL : KM_OK),
                             "step %d: a second prefix for one entry", step);
                }
            }
        } else if (op < 45) {
            rc = km_active_dispatched(a, &k, now_model);
            if (!e->live) {
                KM_CHECK(rc == model_miss(&m, i), "step %d dispatched miss: %d", step, rc);
                if (e->ended < 0) expect_unknown++;
                else if (rc == KM_ERR_NOT_FOUND) expect_late++;
                else expect_dup++;
            } else if (e->first_token) {
                KM_CHECK(rc == KM_ERR_PROTOCOL, "step %d dispatched after first token: %d", step, rc);
                expect_ooo++;
            } else {
                KM_CHECK(rc == KM_OK, "step %d dispatched: %d", step, rc);
                if (!e->dispatched) {
                    e->dispatched = 1;
                    e->dispatched_at = now;
                }
                e->last_touch = now;
            }
        } else if (op < 60) {
            int64_t cached = km_rng_percent(&r, 30) ? KM_ACTIVE_CACHED_UNKNOWN : km_rng_below(&r, 4000);
            rc = km_active_first_token(a, &k, cached, now_model);
            if (!e->live) {
                KM_CHECK(rc == model_miss(&m, i), "step %d first token miss: %d", step, rc);
                if (e->ended < 0) expect_unknown++;
                else if (rc == KM_ERR_NOT_FOUND) expect_late++;
                else expect_dup++;
            } else if (e->first_token) {
                KM_CHECK(rc == KM_ERR_PROTOCOL, "step %d first token twice: %d", step, rc);
                expect_dup++;
            } else {
                KM_CHECK(rc == KM_OK, "step %d first token: %d", step, rc);
                e->first_token = 1;
                e->first_token_at = now;
                e->prefill_pending = e->pairs_pending = 0;
                if (cached != KM_ACTIVE_CACHED_UNKNOWN)
                    e->engine_cached = cached;
                e->last_touch = now;
            }
        } else if (op < 63) { /* the router sent it elsewhere: its charges follow it */
            uint32_t w = km_rng_below(&r, PM_WORKERS);
            rc = km_active_move(a, &k, w, now_model);
            if (!e->live) {
                KM_CHECK(rc == model_miss(&m, i), "step %d move miss: %d", step, rc);
                if (e->ended < 0) expect_unknown++;
                else if (rc == KM_ERR_NOT_FOUND) expect_late++;
                else expect_dup++;
            } else {
                KM_CHECK(rc == KM_OK, "step %d move: %d %s", step, rc, km_active_last_error(a));
                expect_moves += e->worker != w;
                if (e->worker != w) { /* on another worker, nothing is known shared */
                    m.last_arrival[w] = ++m.arrivals;
                    e->prefix_key = e->prefix_blocks = e->charged = 0;
                    e->allocated = e->decode;
                }
                e->worker = w;
                e->last_touch = now;
            }
        } else if (op < 68) {
            int64_t cached = km_rng_below(&r, 4000);
            rc = km_active_report_cached(a, &k, cached, now_model);
            if (!e->live) {
                KM_CHECK(rc == model_miss(&m, i), "step %d report miss: %d", step, rc);
                if (e->ended < 0) expect_unknown++;
                else if (rc == KM_ERR_NOT_FOUND) expect_late++;
                else expect_dup++;
            } else {
                KM_CHECK(rc == KM_OK, "step %d report: %d", step, rc);
                e->engine_cached = cached;
                if (!e->first_token) {
                    uint64_t c = (uint64_t)cached < e->prompt ? (uint64_t)cached : e->prompt;
                    e->prefill_pending = e->prefill_charged = e->prompt - c;
                    e->pairs_pending = pairs_by_counting(c, e->prefill_pending);
                }
                e->last_touch = now;
            }
        } else if (op < 90) {
            km_active_end outcome = (km_active_end)km_rng_below(&r, 4);
            km_active_summary s;
            rc = km_active_finish(a, &k, outcome, now_model, &s);
            if (!e->live) {
                KM_CHECK(rc == model_miss(&m, i), "step %d finish miss: %d", step, rc);
                if (e->ended < 0) expect_unknown++;
                else if (rc == KM_ERR_NOT_FOUND) expect_late++;
                else expect_dup++;
            } else {
                KM_CHECK(rc == KM_OK, "step %d finish: %d", step, rc);
                model_check_summary(&m, i, &s);
                KM_CHECK(s.end == outcome && s.end_ns == now, "step %d finish summary", step);
                model_end(&m, i, (int)outcome);
            }
        } else if (op < 98) {
            memset(m.expired_seen, 0, sizeof m.expired_seen);
            m.last_expired_touch = 0;
            m.order_ok = 1;
            size_t n = 0;
            if (km_rng_percent(&r, 50)) {
                rc = km_active_expire(a, now_model, model_on_expired, &m, &n);
            } else { /* in slices, as the service does: the same entries, the same order */
                size_t max = 1 + km_rng_below(&r, 4), got;
                do {
                    rc = km_active_expire_some(a, now_model, max, model_on_expired, &m, &got);
                    n += got;
                    KM_CHECK(got <= max, "step %d: a slice of %zu expired %zu", step, max, got);
                } while (rc == KM_OK && got == max);
            }
            cr_assert_eq(rc, KM_OK);
            size_t expected = 0;
            for (int j = 0; j < PM_KEYS; j++) {
                int due = m.e[j].live && now - m.e[j].last_touch >= m.ttl;
                KM_CHECK(m.expired_seen[j] == due, "step %d key %d expired %d times, due %d", step,
                         j, m.expired_seen[j], due);
                if (due) {
                    expected++;
                    model_end(&m, j, KM_ACTIVE_END_EXPIRED);
                }
            }
            KM_CHECK(n == expected && m.order_ok, "step %d expired %zu, expected %zu, order %d",
                     step, n, expected, m.order_ok);
        } else {
            uint32_t w = km_rng_below(&r, PM_WORKERS);
            memset(m.expired_seen, 0, sizeof m.expired_seen);
            size_t n = 0;
            rc = km_active_remove_worker(a, w, now_model, model_on_removed, &m, &n);
            cr_assert_eq(rc, KM_OK);
            size_t expected = 0;
            for (int j = 0; j < PM_KEYS; j++) {
                int hit = m.e[j].live && m.e[j].worker == w;
                KM_CHECK(m.expired_seen[j] == hit, "step %d key %d removal", step, j);
                if (hit) {
                    expected++;
                    model_end(&m, j, KM_ACTIVE_END_WORKER_REMOVED);
                }
            }
            KM_CHECK(n == expected, "step %d removed %zu, expected %zu", step, n, expected);
            m.last_arrival[w] = 0;
        }
        if (rc == KM_OK)
            seen_clock = now;
        model_compare_loads(&m, a, step);
    }
    km_active_stats st = stats_of(a);
    KM_CHECK(st.unknown == expect_unknown && st.late == expect_late && st.duplicates == expect_dup &&
                 st.out_of_order == expect_ooo,
             "counters unknown %" PRIu64 "/%" PRIu64 " late %" PRIu64 "/%" PRIu64 " dup %" PRIu64
             "/%" PRIu64 " ooo %" PRIu64 "/%" PRIu64,
             st.unknown, expect_unknown, st.late, expect_late, st.duplicates, expect_dup,
             st.out_of_order, expect_ooo);
    KM_CHECK(st.ended[KM_ACTIVE_END_EXPIRED] > 0 && st.ended[KM_ACTIVE_END_COMPLETE] > 0 &&
                 st.ended[KM_ACTIVE_END_WORKER_REMOVED] > 0 && expect_unknown > 0 &&
                 expect_late > 0 && expect_dup > 0 && expect_ooo > 0 && st.corrections > 0,
             "the run exercised every path: expired %" PRIu64 " complete %" PRIu64
             " removed %" PRIu64 " unknown %" PRIu64 " late %" PRIu64 " dup %" PRIu64
             " ooo %" PRIu64 " corrections %" PRIu64,
             st.ended[KM_ACTIVE_END_EXPIRED], st.ended[KM_ACTIVE_END_COMPLETE],
             st.ended[KM_ACTIVE_END_WORKER_REMOVED], expect_unknown, expect_late, expect_dup,
             expect_ooo, st.corrections);
    KM_CHECK(st.moved == expect_moves && expect_moves > 0, "moves %" PRIu64 " (model %" PRIu64 ")",
             st.moved, expect_moves);
    km_active_destroy(a);
}

/* ================================ approx ================================================= */

static km_approx *make_approx(uint32_t max_workers, uint64_t ttl_ns, uint64_t capacity)
{
    km_approx_config cfg;
    km_approx_config_init(&cfg);
    cfg.max_workers = max_workers;
    cfg.ttl_ns = ttl_ns;
    cfg.worker_capacity_blocks = capacity;
    km_approx *a = NULL;
    cr_assert_eq(km_approx_create(&cfg, &a), KM_OK);
    return a;
}

static km_index *make_index(uint32_t max_workers, uint32_t segment_blocks)
{
    km_index_config cfg;
    km_test_config(&cfg, NULL);
    cfg.backend = KM_BACKEND_CPU;
    cfg.max_workers = max_workers;
    cfg.segment_blocks = segment_blocks;
    cfg.threads = 1;
    cfg.initial_blocks = 256;
    km_index *index = NULL;
    cr_assert_eq(km_index_create(&cfg, &index), KM_OK);
    return index;
}

/* Apply the handle's updates; the index holds exactly the pairs the handle assumed, so its clears
 * name every one of them and never scan the tables. */
static void apply_updates(km_index *index, km_approx_updates *buf)
{
    km_update_stats st;
    cr_assert_eq(km_index_apply(index, buf->updates, buf->n_updates, &st), KM_OK, "%s",
                 km_index_last_error(index));
    cr_assert_eq(st.clear_scans, 0, "a clear left pairs its names missed");
    km_approx_updates_clear(buf);
}

static void assert_update(const km_update *u, km_update_kind kind, uint32_t worker,
                          const uint64_t *hashes, size_t n)
{
    cr_assert_eq(u->kind, kind, "kind %d != %d", (int)u->kind, (int)kind);
    cr_assert_eq(u->worker, worker);
    cr_assert_eq(u->parent, KM_NO_PARENT);
    cr_assert_eq(u->tier, KM_TIER_DEVICE);
    cr_assert_eq(u->n_hashes, n, "n_hashes %zu != %zu", u->n_hashes, n);
    for (size_t i = 0; i < n; i++)
        cr_assert_eq(u->hashes[i], hashes[i], "hash %zu", i);
}

static void assert_approx_error(const km_approx *a, int rc, int expected)
{
    cr_assert_eq(rc, expected, "got %s (%s), expected %s", km_error_name(rc),
                 km_approx_last_error(a), km_error_name(expected));
    const char *msg = km_approx_last_error(a);
    cr_assert(strncmp(msg, km_error_name(expected), strlen(km_error_name(expected))) == 0 &&
                  strlen(msg) > strlen(km_error_name(expected)) + 4,
              "message '%s' does not explain %s", msg, km_error_name(expected));
}

Test(approx, record_stores_refreshes_and_expires, .timeout = 10)
{
    km_approx *a = make_approx(4, 1000, 0);
    km_index *index = make_index(4, 2);
    km_approx_updates buf;
    km_approx_updates_init(&buf);
    const uint64_t req1[] = {101, 102, 103, 104}, req2[] = {101, 102, 205};

    cr_assert_eq(km_approx_record(a, 1, req1, 4, 0, &buf), KM_OK);
    cr_assert_eq(buf.n_updates, 1);
    assert_update(&buf.updates[0], KM_UPDATE_STORE, 1, req1, 4);
    apply_updates(index, &buf);

    km_request rq = {req1, 4};
    km_match_results res;
    km_match_results_init(&res);
    cr_assert_eq(km_index_match_batch(index, &rq, 1, &res), KM_OK);
    cr_assert_eq(res.requests[0].owner, 1);
    cr_assert_eq(res.requests[0].owner_depth, 4);

    /* A pure refresh produces no update. */
    cr_assert_eq(km_approx_record(a, 1, req1, 2, 500, &buf), KM_OK);
    cr_assert_eq(buf.n_updates, 0);
    /* A partly new request stores its whole run from block 0. */
    cr_assert_eq(km_approx_record(a, 1, req2, 3, 600, &buf), KM_OK);
    cr_assert_eq(buf.n_updates, 1);
    assert_update(&buf.updates[0], KM_UPDATE_STORE, 1, req2, 3);
    /* Another worker, same prefix, appended to the same buffer. */
    cr_assert_eq(km_approx_record(a, 2, req1, 1, 700, &buf), KM_OK);
    cr_assert_eq(buf.n_updates, 2);
    assert_update(&buf.updates[0], KM_UPDATE_STORE, 1, req2, 3);
    assert_update(&buf.updates[1], KM_UPDATE_STORE, 2, req1, 1);
    apply_updates(index, &buf);
    cr_assert_eq(km_approx_worker_blocks(a, 1), 5);
    cr_assert_eq(km_approx_worker_blocks(a, 2), 1);
    cr_assert_eq(km_approx_next_expiry(a), 1000); /* 103, 104 touched at 0 */

    /* At 1000: 103 and 104 (touched at 0) expire; 101, 102 were refreshed at 600. */
    size_t n = 0;
    cr_assert_eq(km_approx_expire(a, 999, &buf, &n), KM_OK);
    cr_assert_eq(n, 0);
    cr_assert_eq(buf.n_updates, 0);
    cr_assert_eq(km_approx_expire(a, 1000, &buf, &n), KM_OK);
    cr_assert_eq(n, 2);
    cr_assert_eq(buf.n_updates, 1);
    const uint64_t gone[] = {103, 104};
    assert_update(&buf.updates[0], KM_UPDATE_REMOVE, 1, gone, 2);
    apply_updates(index, &buf);
    cr_assert_eq(km_index_match_batch(index, &rq, 1, &res), KM_OK);
    cr_assert_eq(res.requests[0].owner_depth, 2);
    cr_assert(!km_approx_holds(a, 1, 103) && km_approx_holds(a, 1, 101));

    /* At 1700 everything expires; one REMOVE per worker, workers ascending. */
    cr_assert_eq(km_approx_expire(a, 1700, &buf, &n), KM_OK);
    cr_assert_eq(n, 4);
    cr_assert_eq(buf.n_updates, 2);
    cr_assert_eq(buf.updates[0].worker, 1);
    cr_assert_eq(buf.updates[0].n_hashes, 3);
    const uint64_t w2[] = {101};
    assert_update(&buf.updates[1], KM_UPDATE_REMOVE, 2, w2, 1);
    apply_updates(index, &buf);
    km_index_stats is;
    cr_assert_eq(km_index_get_stats(index, &is), KM_OK);
    cr_assert_eq(is.pairs, 0);
    cr_assert_eq(km_approx_next_expiry(a), UINT64_MAX);

    km_approx_stats st;
    cr_assert_eq(km_approx_get_stats(a, &st), KM_OK);
    cr_assert_eq(st.pairs, 0);
    cr_assert_eq(st.records, 4);
    cr_assert_eq(st.stored_pairs, 6);
    cr_assert_eq(st.refreshed_pairs, 4); /* 101, 102 twice */
    cr_assert_eq(st.expired_pairs, 6);
    km_match_results_free(&res);
    km_approx_updates_free(&buf);
    km_index_destroy(index);
    km_approx_destroy(a);
}

Test(approx, capacity_evicts_least_recently_touched_deepest_first, .timeout = 10)
{
    km_approx *a = make_approx(2, 1000000, 4);
    km_approx_updates buf;
    km_approx_updates_init(&buf);
    const uint64_t ra[] = {11, 12, 13}, rb[] = {21, 22, 23};
    cr_assert_eq(km_approx_record(a, 0, ra, 3, 0, &buf), KM_OK);
    cr_assert_eq(km_approx_record(a, 0, rb, 3, 10, &buf), KM_OK);
    /* 6 > 4: the two oldest go: A's deepest blocks 13 then 12; block 0 of A survives. */
    cr_assert_eq(buf.n_updates, 3);
    assert_update(&buf.updates[0], KM_UPDATE_STORE, 0, ra, 3);
    assert_update(&buf.updates[1], KM_UPDATE_STORE, 0, rb, 3);
    const uint64_t evicted[] = {13, 12};
    assert_update(&buf.updates[2], KM_UPDATE_REMOVE, 0, evicted, 2);
    cr_assert(km_approx_holds(a, 0, 11) && !km_approx_holds(a, 0, 12));
    km_approx_updates_clear(&buf);

    /* A request longer than the capacity keeps its first `capacity` blocks. */
    const uint64_t longreq[] = {31, 32, 33, 34, 35, 36};
    cr_assert_eq(km_approx_record(a, 1, longreq, 6, 20, &buf), KM_OK);
    cr_assert_eq(buf.n_updates, 1);
    assert_update(&buf.updates[0], KM_UPDATE_STORE, 1, longreq, 4);
    cr_assert_eq(km_approx_worker_blocks(a, 1), 4);
    km_approx_updates_clear(&buf);

    /* Shrinking a worker's capacity evicts at once, oldest first; 0 = unlimited. */
    cr_assert_eq(km_approx_set_worker_capacity(a, 0, 2, &buf), KM_OK);
    const uint64_t shrink[] = {11, 23};
    cr_assert_eq(buf.n_updates, 1);
    assert_update(&buf.updates[0], KM_UPDATE_REMOVE, 0, shrink, 2);
    km_approx_updates_clear(&buf);
    cr_assert_eq(km_approx_set_worker_capacity(a, 0, 0, &buf), KM_OK);
    cr_assert_eq(buf.n_updates, 0);
    const uint64_t big[] = {41, 42, 43, 44, 45, 46, 47, 48};
    cr_assert_eq(km_approx_record(a, 0, big, 8, 30, &buf), KM_OK);
    cr_assert_eq(km_approx_worker_blocks(a, 0), 10);

    km_approx_stats st;
    cr_assert_eq(km_approx_get_stats(a, &st), KM_OK);
    cr_assert_eq(st.evicted_pairs, 4);
    cr_assert_eq(st.truncated_records, 1);
    km_approx_updates_clear(&buf);

    /* Clearing a worker: one CLEAR_WORKER naming the pairs assumed, even when there are none. */
    cr_assert_eq(km_approx_clear_worker(a, 0, &buf), KM_OK);
    cr_assert_eq(km_approx_clear_worker(a, 0, &buf), KM_OK);
    cr_assert_eq(buf.n_updates, 2);
    cr_assert_eq(buf.updates[0].kind, KM_UPDATE_CLEAR_WORKER);
    cr_assert_eq(buf.updates[0].n_hashes, 10);
    for (size_t i = 0; i < 10; i++)
        for (size_t j = 0; j < i; j++)
            cr_assert_neq(buf.updates[0].hashes[i], buf.updates[0].hashes[j]);
    cr_assert_eq(buf.updates[1].kind, KM_UPDATE_CLEAR_WORKER);
    cr_assert_eq(buf.updates[1].n_hashes, 0);
    cr_assert_eq(km_approx_worker_blocks(a, 0), 0);
    cr_assert_eq(km_approx_get_stats(a, &st), KM_OK);
    cr_assert_eq(st.cleared_pairs, 10);
    cr_assert_eq(st.pairs, 4);
    /* The cleared worker learns again. */
    km_approx_updates_clear(&buf);
    cr_assert_eq(km_approx_record(a, 0, ra, 3, 40, &buf), KM_OK);
    cr_assert_eq(km_approx_worker_blocks(a, 0), 3);
    km_approx_updates_free(&buf);
    km_approx_destroy(a);
}

/* A record that evicts applies its touches first, even those within refresh_ns: its own eviction
 * never takes a block it touched while deeper blocks it touched stay (block 0 would go and the
 * whole prefix with it). */
Test(approx, a_record_that_evicts_keeps_the_blocks_it_touches, .timeout = 10)
{
    km_approx_config cfg;
    km_approx_config_init(&cfg);
    cfg.max_workers = 1;
    cfg.ttl_ns = 1000;
    cfg.refresh_ns = 100;
    cfg.worker_capacity_blocks = 3;
    km_approx *a = NULL;
    cr_assert_eq(km_approx_create(&cfg, &a), KM_OK);
    km_approx_updates buf;
    km_approx_updates_init(&buf);
    const uint64_t first[] = {10}, other[] = {20, 21}, again[] = {10, 11};
    cr_assert_eq(km_approx_record(a, 0, first, 1, 0, &buf), KM_OK);
    cr_assert_eq(km_approx_record(a, 0, other, 2, 1, &buf), KM_OK);
    km_approx_updates_clear(&buf);
    /* 10 was touched 2 ns ago (within refresh_ns) and heads the eviction order; 11 is new, so one
     * pair goes: the oldest of the others, 21. */
    cr_assert_eq(km_approx_record(a, 0, again, 2, 2, &buf), KM_OK);
    cr_assert(km_approx_holds(a, 0, 10), "the record evicted block 0 it had just touched");
    cr_assert(km_approx_holds(a, 0, 11));
    cr_assert(km_approx_holds(a, 0, 20));
    cr_assert(!km_approx_holds(a, 0, 21));
    cr_assert_eq(km_approx_worker_blocks(a, 0), 3);
    km_approx_updates_free(&buf);
    km_approx_destroy(a);
}

/* The touch resolution at its edge, wherever the first touch falls against the handle's coarse
 * time units: a touch refresh_ns - 1 after the recorded one is skipped, one refresh_ns after is
 * recorded (and becomes the new reference). */
Test(approx, refresh_resolution_edges_at_any_alignment, .timeout = 10)
{
    const uint64_t unit = UINT64_C(1) << 24, refresh = UINT64_C(200000000);
    const uint64_t starts[] = {0, 1, unit - 1, unit, unit / 2, 5 * unit + 3, 123456789, refresh};
    for (size_t s = 0; s < sizeof starts / sizeof starts[0]; s++) {
        km_approx_config cfg;
        km_approx_config_init(&cfg);
        cfg.max_workers = 1;
        cfg.ttl_ns = UINT64_C(120) * 1000000000u;
        cfg.refresh_ns = refresh;
        km_approx *a = NULL;
        cr_assert_eq(km_approx_create(&cfg, &a), KM_OK);
        km_approx_updates buf;
        km_approx_updates_init(&buf);
        const uint64_t h[3] = {11, 12, 13};
        uint64_t t0 = UINT64_C(1000000000) + starts[s];
        cr_assert_eq(km_approx_record(a, 0, h, 3, t0, &buf), KM_OK);
        for (int round = 0; round < 3; round++) {
            uint64_t ref = t0 + (uint64_t)round * refresh;
            km_approx_stats before, after;
            km_approx_get_stats(a, &before);
            cr_assert_eq(km_approx_record(a, 0, h, 3, ref + refresh - 1, &buf), KM_OK);
            km_approx_get_stats(a, &after);
            cr_assert_eq(after.recent_pairs - before.recent_pairs, 3,
                         "start %zu round %d: a touch refresh_ns - 1 later must be skipped", s, round);
            cr_assert_eq(km_approx_record(a, 0, h, 3, ref + refresh, &buf), KM_OK);
            km_approx_get_stats(a, &before);
            cr_assert_eq(before.refreshed_pairs - after.refreshed_pairs, 3,
                         "start %zu round %d: a touch refresh_ns later must be recorded", s, round);
        }
        km_approx_updates_free(&buf);
        km_approx_destroy(a);
    }
}

Test(approx, bad_arguments_change_nothing, .timeout = 10)
{
    /* A touch resolution that is not below the TTL would let pairs expire however often they
     * are used. */
    km_approx_config coarse;
    km_approx_config_init(&coarse);
    coarse.ttl_ns = 1000;
    coarse.refresh_ns = 1000;
    km_approx *none = NULL;
    cr_assert_eq(km_approx_create(&coarse, &none), KM_ERR_INVALID_ARGUMENT);
    cr_assert_null(none);
    coarse.refresh_ns = 999;
    cr_assert_eq(km_approx_create(&coarse, &none), KM_OK);
    km_approx_destroy(none);
    km_approx *a = make_approx(2, 1000, 0);
    km_approx_updates buf;
    km_approx_updates_init(&buf);
    const uint64_t ok[] = {5, 6}, reserved0[] = {5, 0}, reserved1[] = {1};
    cr_assert_eq(km_approx_record(NULL, 0, ok, 2, 0, &buf), KM_ERR_NULL_POINTER);
    assert_approx_error(a, km_approx_record(a, 0, ok, 2, 0, NULL), KM_ERR_NULL_POINTER);
    assert_approx_error(a, km_approx_record(a, 0, NULL, 2, 0, &buf), KM_ERR_NULL_POINTER);
    assert_approx_error(a, km_approx_record(a, 2, ok, 2, 0, &buf), KM_ERR_WORKER_RANGE);
    assert_approx_error(a, km_approx_record(a, 0, reserved0, 2, 0, &buf), KM_ERR_INVALID_ARGUMENT);
    assert_approx_error(a, km_approx_record(a, 0, reserved1, 1, 0, &buf), KM_ERR_INVALID_ARGUMENT);
    cr_assert_eq(buf.n_updates, 0);
    cr_assert_eq(km_approx_worker_blocks(a, 0), 0);
    cr_assert_eq(km_approx_record(a, 0, NULL, 0, 0, &buf), KM_OK); /* empty request */
    cr_assert_eq(buf.n_updates, 0);
    assert_approx_error(a, km_approx_expire(a, 0, NULL, NULL), KM_ERR_NULL_POINTER);
    assert_approx_error(a, km_approx_clear_worker(a, 9, &buf), KM_ERR_WORKER_RANGE);
    assert_approx_error(a, km_approx_set_worker_capacity(a, 9, 1, &buf), KM_ERR_WORKER_RANGE);
    cr_assert(!km_approx_holds(a, 9, 5));
    cr_assert_eq(km_approx_worker_blocks(a, 9), 0);
    km_approx_stats st;
    cr_assert_eq(km_approx_get_stats(a, NULL), KM_ERR_NULL_POINTER);
    cr_assert_eq(km_approx_get_stats(a, &st), KM_OK);
    cr_assert_eq(st.records, 0);

    km_approx_config cfg;
    km_approx_config_init(&cfg);
    cfg.ttl_ns = 0;
    km_approx *bad = (km_approx *)1;
    cr_assert_eq(km_approx_create(&cfg, &bad), KM_ERR_INVALID_ARGUMENT);
    cr_assert_null(bad);
    km_approx_config_init(&cfg);
    cfg.max_workers = KM_MAX_WORKERS_LIMIT + 1;
    cr_assert_eq(km_approx_create(&cfg, &bad), KM_ERR_INVALID_ARGUMENT);
    cr_assert_eq(km_approx_create(NULL, &bad), KM_OK);
    km_approx_destroy(bad);
    km_approx_destroy(NULL);
    km_approx_updates_free(&buf);
    km_approx_destroy(a);
}

Test(approx, buffer_pointers_survive_appends, .timeout = 10)
{
    km_approx *a = make_approx(8, 1000000, 0);
    km_approx_updates buf;
    km_approx_updates_init(&buf);
    /* Enough appends to move both the update array and the hash storage several times. */
    enum { RECORDS = 200, LEN = 37 };
    static uint64_t reqs[RECORDS][LEN];
    for (int i = 0; i < RECORDS; i++) {
        for (int j = 0; j < LEN; j++)
            reqs[i][j] = 1000 + (uint64_t)i * LEN + (uint64_t)j;
        cr_assert_eq(km_approx_record(a, (uint32_t)i % 8, reqs[i], LEN, (uint64_t)i, &buf), KM_OK);
    }
    cr_assert_eq(buf.n_updates, RECORDS);
    for (int i = 0; i < RECORDS; i++)
        assert_update(&buf.updates[i], KM_UPDATE_STORE, (uint32_t)i % 8, reqs[i], LEN);
    km_approx_updates_free(&buf);
    km_approx_destroy(a);
}

/* ---- the invariant against a brute-force model and a real index ----------------------------- */

#define AP_WORKERS 6
#define AP_NODES 160
#define AP_MAX_PAIRS (AP_WORKERS * AP_NODES)

typedef struct ap_pair {
    uint32_t worker;
    uint64_t hash;
    uint64_t last_touch;
    uint64_t seq; /* touch order, for capacity eviction */
} ap_pair;

typedef struct ap_model {
    ap_pair pairs[AP_MAX_PAIRS];
    size_t n;
    uint64_t seq, clock, ttl, refresh;
    uint64_t capacity[AP_WORKERS];
    km_approx_stats stats; /* every counter but pairs, as the header defines it */
} ap_model;

static int ap_find(const ap_model *m, uint32_t w, uint64_t h)
{
    for (size_t i = 0; i < m->n; i++)
        if (m->pairs[i].worker == w && m->pairs[i].hash == h)
            return (int)i;
    return -1;
}

static void ap_drop(ap_model *m, size_t i)
{
    m->pairs[i] = m->pairs[--m->n];
}

static uint64_t ap_count(const ap_model *m, uint32_t w)
{
    uint64_t c = 0;
    for (size_t i = 0; i < m->n; i++)
        c += m->pairs[i].worker == w;
    return c;
}

static void ap_evict(ap_model *m, uint32_t w)
{
    while (m->capacity[w] && ap_count(m, w) > m->capacity[w]) {
        size_t oldest = SIZE_MAX;
        for (size_t i = 0; i < m->n; i++)
            if (m->pairs[i].worker == w && (oldest == SIZE_MAX || m->pairs[i].seq < m->pairs[oldest].seq))
                oldest = i;
        ap_drop(m, oldest);
        m->stats.evicted_pairs++;
    }
}

static void ap_record(ap_model *m, uint32_t w, const uint64_t *h, size_t n, uint64_t now)
{
    if (now > m->clock)
        m->clock = now;
    size_t keep = n;
    if (m->capacity[w] && keep > m->capacity[w])
        keep = (size_t)m->capacity[w];
    m->stats.records += n > 0;
    m->stats.truncated_records += keep < n;
    bool may_evict = m->capacity[w] && ap_count(m, w) + keep > m->capacity[w];
    for (size_t k = keep; k-- > 0;) {
        int i = ap_find(m, w, h[k]);
        if (i >= 0 && !may_evict && m->clock - m->pairs[i].last_touch < m->refresh) {
            m->stats.recent_pairs++;
            continue; /* touched within refresh_ns, and nothing evicted: not recorded */
        }
        m->stats.refreshed_pairs += i >= 0;
        m->stats.stored_pairs += i < 0;
        if (i < 0) {
            i = (int)m->n++;
            m->pairs[i].worker = w;
            m->pairs[i].hash = h[k];
        }
        m->pairs[i].last_touch = m->clock;
        m->pairs[i].seq = ++m->seq;
    }
    ap_evict(m, w);
}

static size_t ap_expire(ap_model *m, uint64_t now)
{
    if (now > m->clock)
        m->clock = now;
    size_t dropped = 0;
    for (size_t i = m->n; i-- > 0;)
        if (m->clock - m->pairs[i].last_touch >= m->ttl) {
            ap_drop(m, i);
            dropped++;
        }
    m->stats.expired_pairs += dropped;
    return dropped;
}

/* A prefix tree of chain hashes: node i's chain is its parent's chain plus its own hash, so each
 * request below is a valid chain (a hash names its whole prefix). */
typedef struct ap_tree {
    uint64_t hash[AP_NODES];
    int parent[AP_NODES];
    uint32_t depth[AP_NODES];
} ap_tree;

static uint32_t ap_chain(const ap_tree *t, int node, uint64_t *out)
{
    uint32_t d = t->depth[node];
    for (int i = node; i >= 0; i = t->parent[i])
        out[t->depth[i] - 1] = t->hash[i];
    return d;
}

static void ap_compare(const ap_model *m, const km_approx *a, km_index *index, const ap_tree *t,
                       km_match_results *res, int step)
{
    km_index_stats is;
    cr_assert_eq(km_index_get_stats(index, &is), KM_OK);
    KM_CHECK(is.pairs == m->n, "step %d: index pairs %" PRIu64 " != model %zu", step, is.pairs, m->n);
    km_approx_stats st;
    cr_assert_eq(km_approx_get_stats(a, &st), KM_OK);
    KM_CHECK(st.pairs == m->n, "step %d: approx pairs %" PRIu64 " != model %zu", step, st.pairs, m->n);
    const km_approx_stats *ms = &m->stats;
    KM_CHECK(st.records == ms->records && st.stored_pairs == ms->stored_pairs &&
                 st.refreshed_pairs == ms->refreshed_pairs && st.recent_pairs == ms->recent_pairs &&
                 st.truncated_records == ms->truncated_records &&
                 st.expired_pairs == ms->expired_pairs && st.evicted_pairs == ms->evicted_pairs &&
                 st.cleared_pairs == ms->cleared_pairs,
             "step %d: stats (records %" PRIu64 " stored %" PRIu64 " refreshed %" PRIu64
             " recent %" PRIu64 " truncated %" PRIu64 " expired %" PRIu64 " evicted %" PRIu64
             " cleared %" PRIu64 ") != model (%" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64
             " %" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64 ")",
             step, st.records, st.stored_pairs, st.refreshed_pairs, st.recent_pairs,
             st.truncated_records, st.expired_pairs, st.evicted_pairs, st.cleared_pairs,
             ms->records, ms->stored_pairs, ms->refreshed_pairs, ms->recent_pairs,
             ms->truncated_records, ms->expired_pairs, ms->evicted_pairs, ms->cleared_pairs);
    uint64_t next = UINT64_MAX;
    for (size_t i = 0; i < m->n; i++)
        if (m->pairs[i].last_touch + m->ttl < next)
            next = m->pairs[i].last_touch + m->ttl;
    KM_CHECK(km_approx_next_expiry(a) == next, "step %d: next expiry %" PRIu64 ", model %" PRIu64,
             step, km_approx_next_expiry(a), next);
    for (uint32_t w = 0; w < AP_WORKERS; w++) {
        km_worker_stats ws;
        cr_assert_eq(km_index_worker_stats(index, w, &ws), KM_OK);
        uint64_t c = ap_count(m, w);
        KM_CHECK(ws.blocks == c && km_approx_worker_blocks(a, w) == c,
                 "step %d worker %u: index %" PRIu64 ", approx %" PRIu64 ", model %" PRIu64, step,
                 w, ws.blocks, km_approx_worker_blocks(a, w), c);
    }
    for (int node = 0; node < AP_NODES; node++) {
        uint32_t holders[AP_WORKERS], n = 0;
        cr_assert_eq(km_index_holders(index, t->hash[node], holders, AP_WORKERS, &n), KM_OK);
        uint32_t expect[AP_WORKERS], ne = 0;
        for (uint32_t w = 0; w < AP_WORKERS; w++)
            if (ap_find(m, w, t->hash[node]) >= 0)
                expect[ne++] = w;
        KM_CHECK(n == ne, "step %d node %d: %u holders, model %u", step, node, n, ne);
        for (uint32_t j = 0; j < n; j++) {
            KM_CHECK(holders[j] == expect[j], "step %d node %d holder %u", step, node, j);
            KM_CHECK(km_approx_holds(a, holders[j], t->hash[node]), "step %d node %d approx", step,
                     node);
        }
    }
    /* Scoring: every node's chain, depth per worker = leading blocks the model holds. */
    static uint64_t chains[AP_NODES][AP_NODES];
    static km_request reqs[AP_NODES];
    for (int node = 0; node < AP_NODES; node++) {
        reqs[node].n_hashes = ap_chain(t, node, chains[node]);
        reqs[node].hashes = chains[node];
    }
    cr_assert_eq(km_index_match_batch(index, reqs, AP_NODES, res), KM_OK);
    for (int node = 0; node < AP_NODES; node++) {
        const km_request_result *rr = &res->requests[node];
        uint32_t entry = 0;
        for (uint32_t w = 0; w < AP_WORKERS; w++) {
            uint32_t d = 0;
            while (d < reqs[node].n_hashes && ap_find(m, w, chains[node][d]) >= 0)
                d++;
            if (d == 0)
                continue;
            KM_CHECK(entry < rr->count, "step %d node %d: worker %u missing", step, node, w);
            const km_worker_match *wm = &res->matches[rr->first + entry];
            KM_CHECK(wm->worker == w && wm->depth == d, "step %d node %d: worker %u depth %u, model %u",
                     step, node, wm->worker, wm->depth, d);
            entry++;
        }
        KM_CHECK(entry == rr->count, "step %d node %d: %u entries, model %u", step, node, rr->count,
                 entry);
    }
}

static void random_sequences(uint64_t refresh, uint64_t ns_per_tick)
{
    km_rng r;
    km_rng_init(&r, km_test_seed());
    static ap_tree t;
    for (int i = 0; i < AP_NODES; i++) {
        t.hash[i] = km_rng_hash(&r);
        t.parent[i] = (i == 0 || km_rng_percent(&r, 10)) ? -1 : (int)km_rng_below(&r, (uint32_t)i);
        t.depth[i] = t.parent[i] < 0 ? 1 : t.depth[t.parent[i]] + 1;
    }
    static ap_model m;
    memset(&m, 0, sizeof m);
    m.ttl = 3000 * ns_per_tick;
    m.refresh = refresh * ns_per_tick;
    for (uint32_t w = 0; w < AP_WORKERS; w++)
        m.capacity[w] = w == 0 ? 0 : 8 + 6 * w; /* worker 0 unlimited */
    km_approx_config cfg;
    km_approx_config_init(&cfg);
    cfg.max_workers = AP_WORKERS;
    cfg.ttl_ns = m.ttl;
    cfg.refresh_ns = m.refresh;
    cfg.worker_capacity_blocks = 20;
    km_approx *a = NULL;
    cr_assert_eq(km_approx_create(&cfg, &a), KM_OK);
    km_approx_updates buf;
    km_approx_updates_init(&buf);
    for (uint32_t w = 0; w < AP_WORKERS; w++)
        cr_assert_eq(km_approx_set_worker_capacity(a, w, m.capacity[w], &buf), KM_OK);
    km_index *index = make_index(AP_WORKERS, 4);
    km_match_results res;
    km_match_results_init(&res);
    static uint64_t chain[AP_NODES];
    uint64_t now = 0;
    for (int step = 0; step < 1500; step++) {
        /* Times at any alignment: with ticks of a millisecond they cross the handle's coarse
         * touch-time units (16.8 ms) anywhere. */
        uint64_t back = km_rng_below(&r, 50 * (uint32_t)ns_per_tick);
        now = km_rng_percent(&r, 3) && now > back ? now - back
                                                  : now + km_rng_below(&r, 120 * (uint32_t)ns_per_tick);
        uint32_t op = km_rng_below(&r, 100);
        if (step == 1498) {
            /* Whatever the seed drew, one record longer than its worker's capacity: the deepest
             * node's chain on worker 1, cut to one block. */
            int deepest = 0;
            for (int i = 1; i < AP_NODES; i++)
                deepest = t.depth[i] > t.depth[deepest] ? i : deepest;
            cr_assert_gt(t.depth[deepest], 1, "the tree has a chain of two blocks");
            cr_assert_eq(km_approx_set_worker_capacity(a, 1, 1, &buf), KM_OK);
            m.capacity[1] = 1;
            ap_evict(&m, 1);
            uint32_t n = ap_chain(&t, deepest, chain);
            cr_assert_eq(km_approx_record(a, 1, chain, n, now, &buf), KM_OK, "%s",
                         km_approx_last_error(a));
            ap_record(&m, 1, chain, n, now);
        } else if (op < 75) {
            uint32_t w = km_rng_below(&r, AP_WORKERS);
            int node = (int)km_rng_below(&r, AP_NODES);
            uint32_t n = ap_chain(&t, node, chain);
            cr_assert_eq(km_approx_record(a, w, chain, n, now, &buf), KM_OK, "%s",
                         km_approx_last_error(a));
            ap_record(&m, w, chain, n, now);
        } else if (op < 92) {
            size_t n = 0;
            cr_assert_eq(km_approx_expire(a, now, &buf, &n), KM_OK);
            size_t expected = ap_expire(&m, now);
            KM_CHECK(n == expected, "step %d expired %zu, model %zu", step, n, expected);
        } else if (op < 96) {
            uint32_t w = km_rng_below(&r, AP_WORKERS);
            cr_assert_eq(km_approx_clear_worker(a, w, &buf), KM_OK);
            for (size_t i = m.n; i-- > 0;)
                if (m.pairs[i].worker == w) {
                    ap_drop(&m, i);
                    m.stats.cleared_pairs++;
                }
        } else {
            uint32_t w = km_rng_below(&r, AP_WORKERS);
            uint64_t c = km_rng_percent(&r, 20) ? 0 : 1 + km_rng_below(&r, 40);
            cr_assert_eq(km_approx_set_worker_capacity(a, w, c, &buf), KM_OK);
            m.capacity[w] = c;
            ap_evict(&m, w);
        }
        /* Apply sometimes after one call, sometimes after several (one batch, many calls). */
        if (km_rng_percent(&r, 40) || step == 1499) {
            apply_updates(index, &buf);
            ap_compare(&m, a, index, &t, &res, step);
        }
    }
    /* a TTL after the latest touch everything is forgotten: nothing assumed, nothing due */
    now = m.clock + m.ttl;
    size_t forgotten = 0;
    cr_assert_eq(km_approx_expire(a, now, &buf, &forgotten), KM_OK);
    KM_CHECK(forgotten == ap_expire(&m, now) && m.n == 0, "expired %zu, model left %zu", forgotten,
             m.n);
    apply_updates(index, &buf);
    ap_compare(&m, a, index, &t, &res, 1500);
    KM_CHECK(km_approx_next_expiry(a) == UINT64_MAX, "something is still due");
    km_approx_stats st;
    cr_assert_eq(km_approx_get_stats(a, &st), KM_OK);
    KM_CHECK(refresh == 0 ? st.recent_pairs == 0 : st.recent_pairs > 0,
             "refresh %" PRIu64 ": %" PRIu64 " touches left unrecorded", refresh, st.recent_pairs);
    KM_CHECK(st.expired_pairs > 0 && st.evicted_pairs > 0 && st.refreshed_pairs > 0 &&
                 st.truncated_records > 0,
             "the run exercised expiry (%" PRIu64 "), eviction (%" PRIu64 "), refresh (%" PRIu64
             ") and truncation (%" PRIu64 ")",
             st.expired_pairs, st.evicted_pairs, st.refreshed_pairs, st.truncated_records);
    km_match_results_free(&res);
    km_approx_updates_free(&buf);
    km_index_destroy(index);
    km_approx_destroy(a);
}

/* Exact touches, and touches recorded at a resolution of 200 ticks (of a TTL of 3000, while a
 * step advances the clock by up to 120): the same model, which skips a touch within `refresh` of
 * the pair's recorded one, must still match the handle and the index exactly. With ticks of 1 ms
 * (TTL 3 s, resolution 200 ms) the handle decides most touches from the coarse times in its maps,
 * and must still agree with the exact rule at every step. */
Test(approx, random_sequences_keep_index_equal_to_model, .timeout = 60) { random_sequences(0, 1); }
Test(approx, random_sequences_with_refresh_resolution, .timeout = 60) { random_sequences(200, 1); }
Test(approx, random_sequences_with_coarse_touch_times, .timeout = 60)
{
    random_sequences(200, 1000000);
}

/* Id buffers up to 64 bytes are reused from a free list, longer ones are malloc'd: ids of every
 * length around that size, begun, ended and pushed out of a small ended ring many times over, keep
 * their exact bytes (the summary's ids, and a second FINISHED telling "after FINISHED" from
 * "unknown" by the ring's copies). A buffer handed out twice or reused while the ring still holds
 * it fails here; under ASan, one reused with the wrong size does too. */
Test(active, id_buffers_of_any_length_survive_reuse, .timeout = 30)
{
    enum { RING = 8, ROUNDS = 4000, KEPT = RING + 1 };
    km_active *a = make_active(4, UINT64_C(1) << 40, 1000, RING);
    km_rng r;
    km_rng_init(&r, km_test_seed());
    static char req[KEPT][KM_ACTIVE_ID_MAX + 1], att[KEPT][KM_ACTIVE_ID_MAX + 1];
    for (int round = 0; round < ROUNDS; round++) {
        char *rq = req[round % KEPT], *at = att[round % KEPT];
        /* A unique prefix, then letters: buffers (both ids + 2 NULs) mostly 8..90 bytes, around
         * the 64 kept on the free list, and some up to the 256-byte id limit. */
        size_t rl = (size_t)snprintf(rq, KM_ACTIVE_ID_MAX + 1, "%d-", round);
        rl += km_rng_below(&r, km_rng_percent(&r, 5) ? (uint32_t)(KM_ACTIVE_ID_MAX - rl) : 70);
        for (size_t i = strlen(rq); i < rl; i++)
            rq[i] = (char)('a' + (round + (int)i) % 26);
        rq[rl] = '\0';
        size_t al = km_rng_below(&r, 20);
        for (size_t i = 0; i < al; i++)
            at[i] = (char)('A' + (round * 7 + (int)i) % 26);
        at[al] = '\0';
        km_active_key k = km_active_key_of(rq, at);
        cr_assert_eq(km_active_begin(a, (uint32_t)round % 4, &k, 100, 0, 10, 16, (uint64_t)round + 1),
                     KM_OK, "round %d: %s", round, km_active_last_error(a));
        km_active_summary s;
        cr_assert_eq(km_active_finish(a, &k, KM_ACTIVE_END_COMPLETE, (uint64_t)round + 1, &s), KM_OK);
        cr_assert_eq(s.request_id_len, rl);
        cr_assert_eq(s.attempt_id_len, al);
        cr_assert(memcmp(s.request_id, rq, rl + 1) == 0, "round %d", round);
        cr_assert(memcmp(s.attempt_id, at, al + 1) == 0, "round %d", round);
        /* Every id still in the ring reads as finished, the one just pushed out as unknown. */
        for (int back = 0; back < KEPT && back <= round; back++) {
            int j = (round - back) % KEPT;
            km_active_key old = km_active_key_of(req[j], att[j]);
            int expect = back < RING ? KM_ERR_PROTOCOL : KM_ERR_NOT_FOUND;
            cr_assert_eq(km_active_finish(a, &old, KM_ACTIVE_END_COMPLETE, (uint64_t)round + 1, NULL),
                         expect, "round %d, %d back: %s", round, back, km_active_last_error(a));
        }
    }
    km_active_stats st;
    cr_assert_eq(km_active_get_stats(a, &st), KM_OK);
    cr_assert_eq(st.entries, 0);
    km_active_destroy(a);
}

/* A full table makes room by ending its least recently touched entry: a lifecycle event touches
 * an entry, so the eviction order follows the last event, not the begin; the evicted load is
 * released and later events for that id are late, as for an expired one. */
Test(active, evict_oldest_ends_the_least_recently_touched, .timeout = 10)
{
    km_active *a = make_active(4, UINT64_C(1) << 40, 3, 64);
    const char *ids[3] = {"r0", "r1", "r2"};
    for (uint32_t i = 0; i < 3; i++) {
        km_active_key k = km_active_key_of(ids[i], NULL);
        cr_assert_eq(km_active_begin(a, i, &k, 100, 0, 10, 16, 10 + i), KM_OK);
    }
    km_active_key k3 = km_active_key_of("r3", NULL);
    cr_assert_eq(km_active_begin(a, 3, &k3, 100, 0, 10, 16, 20), KM_ERR_OVERLOADED, "3 at most");
    km_active_key k0 = km_active_key_of("r0", NULL);
    cr_assert_eq(km_active_dispatched(a, &k0, 30), KM_OK); /* r0: now the most recently touched */

    collected c;
    memset(&c, 0, sizeof c);
    cr_assert_eq(km_active_evict_oldest(a, 40, collect, &c), KM_OK);
    cr_assert_str_eq(c.request[0], "r1");
    cr_assert_eq(c.s[0].end, KM_ACTIVE_END_EVICTED);
    cr_assert_eq(load_of(a, 1).in_flight, 0, "the evicted entry's load is released");
    cr_assert_eq(km_active_begin(a, 3, &k3, 100, 0, 10, 16, 41), KM_OK, "room made");
    cr_assert_eq(load_of(a, 3).in_flight, 1);
    for (int i = 0; i < 3; i++)
        cr_assert_eq(km_active_evict_oldest(a, 50, collect, &c), KM_OK);
    cr_assert_eq(c.n, 4);
    cr_assert_str_eq(c.request[1], "r2");
    cr_assert_str_eq(c.request[2], "r0");
    cr_assert_str_eq(c.request[3], "r3");
    for (uint32_t w = 0; w < 4; w++)
        cr_assert_eq(load_of(a, w).in_flight, 0, "worker %u", w);

    km_active_key k1 = km_active_key_of("r1", NULL);
    cr_assert_eq(km_active_dispatched(a, &k1, 60), KM_ERR_NOT_FOUND, "late, as for an expired one");
    km_active_stats st = stats_of(a);
    cr_assert_eq(st.ended[KM_ACTIVE_END_EVICTED], 4);
    cr_assert_eq(st.late, 1);
    cr_assert_eq(st.unknown, 0);
    cr_assert_eq(st.entries, 0);
    cr_assert_eq(km_active_evict_oldest(a, 70, NULL, NULL), KM_ERR_NOT_FOUND, "nothing to evict");
    cr_assert_str_eq(km_active_end_name(KM_ACTIVE_END_EVICTED), "evicted");
    km_active_destroy(a);
}

/* After a drain the memory a burst made goes back (km_active_release_idle), and nothing
 * observable changes: late reports still read as late, ids still end in the ring, new work
 * begins as before. */
Test(active, release_idle_gives_memory_back_and_changes_nothing, .timeout = 20)
{
    km_active *a = make_active(4, 1000, 100000, 16);
    char rid[32];
    for (uint32_t i = 0; i < 20000; i++) {
        snprintf(rid, sizeof rid, "burst-%u", i);
        km_active_key k = km_active_key_of(rid, "0");
        cr_assert_eq(km_active_begin(a, i % 4, &k, 64, 0, 16, 16, 10), KM_OK);
    }
    /* some still in flight: only the id cache goes */
    km_active_key last = km_active_key_of("burst-19999", "0");
    km_active_key first = km_active_key_of("burst-0", "0");
    cr_assert_eq(km_active_finish(a, &first, KM_ACTIVE_END_COMPLETE, 20, NULL), KM_OK);
    km_active_release_idle(a);
    cr_assert_eq(km_active_contains(a, &last), 1);
    cr_assert_eq(stats_of(a).entries, 19999);
    /* everything expires: the slab and the maps go too */
    size_t n = 0;
    cr_assert_eq(km_active_expire(a, 10 + 1000 + 1, NULL, NULL, &n), KM_OK);
    cr_assert_eq(n, 19999);
    cr_assert_eq(stats_of(a).entries, 0);
    cr_assert_gt(km_active_release_idle(a), (uint64_t)20000 * 64, "too little given back");
    cr_assert_eq(km_active_release_idle(a), 0, "a second release finds nothing");
    km_active_stats st = stats_of(a);
    cr_assert_eq(st.total.in_flight, 0);
    cr_assert_eq(st.total.pending_prefill_tokens, 0);
    /* the latest ends are still remembered: a late report is late, not unknown */
    cr_assert_eq(km_active_dispatched(a, &last, 3000), KM_ERR_NOT_FOUND);
    cr_assert_eq(stats_of(a).late, st.late + 1);
    /* and work begins again */
    km_active_key again = km_active_key_of("again", "0");
    cr_assert_eq(km_active_begin(a, 2, &again, 64, 0, 16, 16, 4000), KM_OK);
    km_active_load load;
    cr_assert_eq(km_active_worker_load(a, 2, &load), KM_OK);
    cr_assert_eq(load.in_flight, 1);
    cr_assert_eq(km_active_finish(a, &again, KM_ACTIVE_END_COMPLETE, 4100, NULL), KM_OK);
    km_active_destroy(a);
}

/* The bytes bound (max_bytes): what each entry counts is its slot, its id buffer as allocated (at
 * least 64 bytes) and its map share, so ids up to 62 bytes together count alike and longer ones
 * count their length, plus the user bytes its caller keeps beside it. On random begins (half
 * with random user bytes) and finishes with ids of any length, the counted bytes equal the sum
 * over a brute-force list of the live entries, a begin is refused with KM_ERR_MEMORY_CAP exactly
 * when its entry would pass the bound (counted, no load, no entry, no eviction), and one that fits
 * after a finish is taken. */
#define BB_KEYS 64
Test(active, bytes_bound_refuses_exactly_what_would_pass_it, .timeout = 30)
{
    km_active_config def;
    km_active_config_init(&def);
    cr_assert_eq(def.max_bytes, UINT64_C(1) << 30, "default 1 GiB");
    uint64_t small = km_active_entry_bytes(1, 0);
    cr_assert_eq(km_active_entry_bytes(30, 32), small, "ids within the cached buffer count alike");
    cr_assert_eq(km_active_entry_bytes(100, 0), small + (100 + 2 - 64), "longer ids count their length");
    cr_assert_eq(km_active_entry_bytes(256, 256), small + (514 - 64));

    km_rng r;
    km_rng_init(&r, km_test_seed());
    km_active_config cfg;
    km_active_config_init(&cfg);
    cfg.max_workers = 4;
    cfg.ttl_ns = UINT64_C(1) << 50;
    cfg.max_entries = 100000;
    cfg.max_bytes = 20 * km_active_entry_bytes(128, 0);
    km_active *a = NULL;
    cr_assert_eq(km_active_create(&cfg, &a), KM_OK);
    static char ids[BB_KEYS][300];
    bool live[BB_KEYS] = {false};
    uint32_t user_bytes[BB_KEYS] = {0};
    uint64_t model_bytes = 0, refused = 0, taken = 0;
    for (int step = 0; step < 20000; step++) {
        int i = (int)km_rng_below(&r, BB_KEYS);
        if (!live[i]) {
            /* A fresh request id of a random length, unique by its prefix. */
            size_t len = 1 + km_rng_below(&r, 256);
            int n = snprintf(ids[i], sizeof ids[i], "k%d-%d-", i, step);
            for (size_t j = (size_t)n; j < len; j++)
                ids[i][j] = (char)('a' + km_rng_below(&r, 26));
            ids[i][len > (size_t)n ? len : (size_t)n] = '\0';
            km_active_key k = km_active_key_of(ids[i], "0");
            uint32_t user = km_rng_below(&r, 2) ? (uint32_t)km_rng_below(&r, 2000) : 0;
            uint64_t need = km_active_entry_bytes(k.request_id_len, 1) + user;
            uint64_t in_flight = stats_of(a).total.in_flight;
            int rc = user ? km_active_begin_with_user_bytes(a, (uint32_t)i % 4, &k, 100, 0, 10, 16,
                                                            user, (uint64_t)step)
                          : km_active_begin(a, (uint32_t)i % 4, &k, 100, 0, 10, 16, (uint64_t)step);
            if (model_bytes + need > cfg.max_bytes) {
                KM_CHECK(rc == KM_ERR_MEMORY_CAP, "step %d: %s over the bound: %s", step,
                                 ids[i], km_strerror(rc));
                KM_CHECK(strstr(km_active_last_error(a), "bound"), "%s", km_active_last_error(a));
                KM_CHECK(stats_of(a).total.in_flight == in_flight, "no load added");
                KM_CHECK(!km_active_contains(a, &k), "no entry");
                refused++;
            } else {
                KM_CHECK(rc == KM_OK, "step %d: %s fits: %s (%s)", step, ids[i],
                                 km_strerror(rc), km_active_last_error(a));
                live[i] = true;
                user_bytes[i] = user;
                model_bytes += need;
                taken++;
            }
        } else {
            km_active_key k = km_active_key_of(ids[i], "0");
            KM_CHECK(km_active_finish(a, &k, KM_ACTIVE_END_COMPLETE, (uint64_t)step, NULL) == KM_OK,
                             "step %d: finish %s", step, ids[i]);
            live[i] = false;
            model_bytes -= km_active_entry_bytes(k.request_id_len, 1) + user_bytes[i];
        }
        km_active_stats st = stats_of(a);
        KM_CHECK(st.bytes == model_bytes, "step %d: counted %" PRIu64 ", model %" PRIu64,
                         step, st.bytes, model_bytes);
        KM_CHECK(st.bytes <= cfg.max_bytes, "never past the bound");
        KM_CHECK(st.refused_bytes == refused, "refusals counted");
        KM_CHECK(st.ended[KM_ACTIVE_END_EVICTED] == 0, "nothing evicted to make room");
    }
    cr_assert(refused > 100 && taken > 100, "both sides exercised: %" PRIu64 " refused, %" PRIu64
              " taken", refused, taken);
    km_active_destroy(a);
}

/* ---- every call in any order against a model of the charges --------------------------------- */

/* Random runs of every call of the table, each at any point of an entry's life: shared prefixes
 * declared before or after FIRST_TOKEN or a move, queued prefixes, the entry bound with eviction,
 * the bytes bound with callers' user bytes, expiry, worker removal and release_idle. After every
 * step, each worker's load values, the prefix sharers, the queued depths, stats.bytes and
 * stats.queued_blocks equal what a model recomputes from its plain list of live entries and
 * prefix slots, and no subtraction saturated. */
#define XM_KEYS 40
#define XM_WORKERS 4
#define XM_PREFIXES 3
#define XM_HASHES 6
#define XM_MAX_ENTRIES 14
#define XM_MAX_QUEUED 24

typedef struct xm_entry {
    int live, ended; /* ended: -1 never, else the km_active_end of the latest end */
    uint32_t worker, prompt, block_size, user_bytes;
    int first_token;
    uint64_t prefill_pending, pairs_pending, decode, new_blocks;
    uint64_t prefix_key; /* 0 none */
    uint64_t queued[XM_HASHES];
    uint32_t n_queued;
    uint64_t last_touch;
} xm_entry;

typedef struct xm_model {
    xm_entry e[XM_KEYS];
    char req[XM_KEYS][16];
    /* A declared prefix on a worker: its live holders and the blocks charged for it once. */
    uint32_t holders[XM_WORKERS][XM_PREFIXES + 1];
    uint64_t charged[XM_WORKERS][XM_PREFIXES + 1];
    uint64_t queued_total;
} xm_model;

static void xm_release_charges(xm_model *m, xm_entry *e)
{
    if (e->prefix_key && --m->holders[e->worker][e->prefix_key] == 0)
        m->charged[e->worker][e->prefix_key] = 0;
    e->prefix_key = 0;
    m->queued_total -= e->n_queued;
    e->n_queued = 0;
}

static void xm_end(xm_model *m, int i, int end)
{
    xm_release_charges(m, &m->e[i]);
    m->e[i].live = 0;
    m->e[i].ended = end;
}

/* Summaries handed to callbacks: the key they name ends in the model. */
typedef struct xm_ctx {
    xm_model *m;
    km_active_end end;
    int ended[XM_KEYS];
} xm_ctx;

static void xm_on_end(void *user, const km_active_summary *s)
{
    xm_ctx *c = user;
    int i = atoi(s->request_id + 1);
    KM_CHECK(i >= 0 && i < XM_KEYS && c->m->e[i].live, "ended a dead key %s", s->request_id);
    KM_CHECK(s->end == c->end && s->worker == c->m->e[i].worker, "end %d worker %u", (int)s->end,
             s->worker);
    c->ended[i]++;
    xm_end(c->m, i, (int)c->end);
}

static void xm_compare(const xm_model *m, const km_active *a, int step)
{
    uint64_t bytes = 0, live = 0;
    for (uint32_t w = 0; w < XM_WORKERS; w++) {
        km_active_load want = {0};
        for (int i = 0; i < XM_KEYS; i++) {
            const xm_entry *e = &m->e[i];
            if (!e->live || e->worker != w)
                continue;
            want.in_flight++;
            want.prefilling += !e->first_token;
            want.pending_prefill_tokens += e->prefill_pending;
            want.pending_prefill_pairs += e->pairs_pending;
            want.active_decode_blocks += e->decode;
            want.allocated_blocks += e->new_blocks;
        }
        for (uint64_t k = 1; k <= XM_PREFIXES; k++) {
            if (m->holders[w][k])
                want.allocated_blocks += m->charged[w][k];
            KM_CHECK(km_active_prefix_sharers(a, w, k) == m->holders[w][k],
                     "step %d worker %u prefix %" PRIu64 ": %u sharers, model %u", step, w, k,
                     km_active_prefix_sharers(a, w, k), m->holders[w][k]);
        }
        for (uint64_t h = 2; h < 2 + XM_HASHES; h++) {
            uint32_t promised = 0;
            for (int i = 0; i < XM_KEYS; i++)
                for (uint32_t q = 0; q < m->e[i].n_queued; q++)
                    promised |= m->e[i].live && m->e[i].worker == w && m->e[i].queued[q] == h;
            KM_CHECK(km_active_queued_depth(a, w, &h, 1, 0) == promised,
                     "step %d worker %u hash %" PRIu64 ": queued depth %u, model %u", step, w, h,
                     km_active_queued_depth(a, w, &h, 1, 0), promised);
        }
        km_active_load l = load_of(a, w);
        KM_CHECK(l.in_flight == want.in_flight && l.prefilling == want.prefilling &&
                     l.pending_prefill_tokens == want.pending_prefill_tokens &&
                     l.pending_prefill_pairs == want.pending_prefill_pairs &&
                     l.active_decode_blocks == want.active_decode_blocks &&
                     l.allocated_blocks == want.allocated_blocks,
                 "step %d worker %u: load (%" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64
                 " %" PRIu64 " %" PRIu64 ") != model (%" PRIu64 " %" PRIu64 " %" PRIu64
                 " %" PRIu64 " %" PRIu64 " %" PRIu64 ")",
                 step, w, l.in_flight, l.prefilling, l.pending_prefill_tokens,
                 l.pending_prefill_pairs, l.active_decode_blocks, l.allocated_blocks,
                 want.in_flight, want.prefilling, want.pending_prefill_tokens,
                 want.pending_prefill_pairs, want.active_decode_blocks, want.allocated_blocks);
    }
    for (int i = 0; i < XM_KEYS; i++)
        if (m->e[i].live) {
            live++;
            bytes += km_active_entry_bytes(strlen(m->req[i]), 1) + m->e[i].user_bytes;
        }
    km_active_stats st = stats_of(a);
    KM_CHECK(st.entries == live && st.bytes == bytes && st.queued_blocks == m->queued_total,
             "step %d: entries %" PRIu64 "/%" PRIu64 " bytes %" PRIu64 "/%" PRIu64
             " queued %" PRIu64 "/%" PRIu64, step, st.entries, live, st.bytes, bytes,
             st.queued_blocks, m->queued_total);
    KM_CHECK(st.saturations == 0, "step %d: %" PRIu64 " saturations", step, st.saturations);
}

Test(active, every_call_in_any_order_keeps_exact_sums, .timeout = 60)
{
    km_rng r;
    km_rng_init(&r, km_test_seed());
    static xm_model m;
    memset(&m, 0, sizeof m);
    for (int i = 0; i < XM_KEYS; i++) {
        snprintf(m.req[i], sizeof m.req[i], "k%d", i);
        m.e[i].ended = -1;
    }
    const uint64_t ttl = 4000;
    const uint64_t max_bytes = 10 * (km_active_entry_bytes(3, 1) + 300);
    km_active_config cfg;
    km_active_config_init(&cfg);
    cfg.max_workers = XM_WORKERS;
    cfg.ttl_ns = ttl;
    cfg.max_entries = XM_MAX_ENTRIES;
    cfg.remember_ended = 1u << 16; /* no end forgotten: every miss is classified */
    cfg.max_queued_blocks = XM_MAX_QUEUED;
    cfg.max_bytes = max_bytes;
    km_active *a = NULL;
    cr_assert_eq(km_active_create(&cfg, &a), KM_OK);
    uint64_t clock = 0, seen = 0;
    uint64_t evictions = 0, refusals = 0, late_shares = 0;
    for (int step = 0; step < 30000; step++) {
        clock = km_rng_percent(&r, 3) && clock > 20 ? clock - km_rng_below(&r, 20)
                                                    : clock + km_rng_below(&r, 150);
        uint64_t now = clock > seen ? clock : seen;
        int i = (int)km_rng_below(&r, XM_KEYS);
        xm_entry *e = &m.e[i];
        km_active_key k = km_active_key_of(m.req[i], "a");
        int miss = e->ended >= 0 && e->ended != KM_ACTIVE_END_EXPIRED &&
                           e->ended != KM_ACTIVE_END_WORKER_REMOVED &&
                           e->ended != KM_ACTIVE_END_EVICTED
                       ? KM_ERR_PROTOCOL
                       : KM_ERR_NOT_FOUND;
        uint32_t op = km_rng_below(&r, 100);
        int rc = KM_OK;
        if (op < 22) {
            uint32_t w = km_rng_below(&r, XM_WORKERS), prompt = km_rng_below(&r, 2000);
            uint32_t predicted = km_rng_below(&r, 2500), output = km_rng_below(&r, 500);
            uint32_t bs = 1 + km_rng_below(&r, 32), user = km_rng_below(&r, 300);
            uint64_t live = 0, bytes = 0;
            for (int j = 0; j < XM_KEYS; j++)
                if (m.e[j].live) {
                    live++;
                    bytes += km_active_entry_bytes(strlen(m.req[j]), 1) + m.e[j].user_bytes;
                }
            rc = km_active_begin_with_user_bytes(a, w, &k, prompt, predicted, output, bs, user,
                                                 clock);
            uint64_t need = km_active_entry_bytes(strlen(m.req[i]), 1) + user;
            if (e->live) {
                KM_CHECK(rc == KM_ERR_PROTOCOL, "step %d begin of a live key: %d", step, rc);
            } else if (live >= XM_MAX_ENTRIES) {
                KM_CHECK(rc == KM_ERR_OVERLOADED, "step %d begin when full: %d", step, rc);
                xm_ctx c = {&m, KM_ACTIVE_END_EVICTED, {0}};
                int rc2 = km_active_evict_oldest(a, clock, xm_on_end, &c);
                KM_CHECK(rc2 == KM_OK, "step %d evict: %d", step, rc2);
                int n = 0;
                for (int j = 0; j < XM_KEYS; j++)
                    n += c.ended[j];
                KM_CHECK(n == 1, "step %d: evicted %d", step, n);
                evictions++;
                rc = rc2;
            } else if (bytes + need > max_bytes) {
                KM_CHECK(rc == KM_ERR_MEMORY_CAP, "step %d begin past the bytes bound: %d", step,
                         rc);
                refusals++;
            } else {
                KM_CHECK(rc == KM_OK, "step %d begin: %d %s", step, rc, km_active_last_error(a));
                memset(e, 0, sizeof *e);
                e->live = 1;
                e->ended = -1;
                e->worker = w;
                e->prompt = prompt;
                e->block_size = bs;
                e->user_bytes = user;
                uint32_t cached = predicted < prompt ? predicted : prompt;
                e->prefill_pending = prompt - cached;
                e->pairs_pending = km_engine_model_chunk_pairs(cached, e->prefill_pending);
                e->decode = e->new_blocks = ((uint64_t)prompt + output + bs - 1) / bs;
                e->last_touch = now;
            }
        } else if (op < 32) { /* a shared prefix, at any point of the entry's life */
            uint64_t key = 1 + km_rng_below(&r, XM_PREFIXES);
            uint32_t tokens = 1 + km_rng_below(&r, 2000);
            rc = km_active_share_prefix(a, &k, key, tokens);
            if (!e->live) {
                KM_CHECK(rc == miss, "step %d share miss: %d", step, rc);
            } else if (e->prefix_key) {
                KM_CHECK(rc == KM_ERR_PROTOCOL, "step %d second prefix: %d", step, rc);
            } else {
                KM_CHECK(rc == KM_OK, "step %d share: %d %s", step, rc, km_active_last_error(a));
                late_shares += e->first_token;
                uint64_t blocks = tokens / e->block_size;
                if (m.holders[e->worker][key]++ == 0)
                    m.charged[e->worker][key] = blocks < e->decode ? blocks : e->decode;
                uint64_t c = m.charged[e->worker][key];
                e->prefix_key = key;
                e->new_blocks = e->decode > c ? e->decode - c : 0;
            }
        } else if (op < 40) { /* queued prefixes */
            uint64_t h[XM_HASHES];
            uint32_t n = km_rng_below(&r, XM_HASHES + 1);
            for (uint32_t q = 0; q < n; q++)
                h[q] = 2 + km_rng_below(&r, XM_HASHES);
            rc = km_active_queue_blocks(a, &k, h, n);
            if (!e->live) {
                KM_CHECK(rc == miss, "step %d queue miss: %d", step, rc);
            } else if (e->n_queued || e->first_token) {
                KM_CHECK(rc == KM_ERR_PROTOCOL, "step %d second promise: %d", step, rc);
            } else {
                KM_CHECK(rc == KM_OK, "step %d queue: %d %s", step, rc, km_active_last_error(a));
                uint64_t room = XM_MAX_QUEUED - m.queued_total;
                uint32_t keep = n < room ? n : (uint32_t)room;
                memcpy(e->queued, h, keep * sizeof *h);
                e->n_queued = keep;
                m.queued_total += keep;
            }
        } else if (op < 48) {
            rc = km_active_dispatched(a, &k, clock);
            if (!e->live)
                KM_CHECK(rc == miss, "step %d dispatched miss: %d", step, rc);
            else if (e->first_token)
                KM_CHECK(rc == KM_ERR_PROTOCOL, "step %d dispatched late: %d", step, rc);
            else
                e->last_touch = now;
        } else if (op < 58) {
            rc = km_active_first_token(a, &k, KM_ACTIVE_CACHED_UNKNOWN, clock);
            if (!e->live) {
                KM_CHECK(rc == miss, "step %d first token miss: %d", step, rc);
            } else if (e->first_token) {
                KM_CHECK(rc == KM_ERR_PROTOCOL, "step %d first token twice: %d", step, rc);
            } else {
                KM_CHECK(rc == KM_OK, "step %d first token: %d", step, rc);
                e->first_token = 1;
                e->prefill_pending = e->pairs_pending = 0;
                m.queued_total -= e->n_queued;
                e->n_queued = 0;
                e->last_touch = now;
            }
        } else if (op < 64) {
            uint32_t w = km_rng_below(&r, XM_WORKERS);
            rc = km_active_move(a, &k, w, clock);
            if (!e->live) {
                KM_CHECK(rc == miss, "step %d move miss: %d", step, rc);
            } else {
                KM_CHECK(rc == KM_OK, "step %d move: %d", step, rc);
                if (w != e->worker) {
                    xm_release_charges(&m, e);
                    e->new_blocks = e->decode;
                    e->worker = w;
                }
                e->last_touch = now;
            }
        } else if (op < 70) {
            int64_t cached = km_rng_below(&r, 2500);
            rc = km_active_report_cached(a, &k, cached, clock);
            if (!e->live) {
                KM_CHECK(rc == miss, "step %d report miss: %d", step, rc);
            } else {
                KM_CHECK(rc == KM_OK, "step %d report: %d", step, rc);
                if (!e->first_token) {
                    uint64_t c = (uint64_t)cached < e->prompt ? (uint64_t)cached : e->prompt;
                    e->prefill_pending = e->prompt - c;
                    e->pairs_pending = km_engine_model_chunk_pairs(c, e->prefill_pending);
                }
                e->last_touch = now;
            }
        } else if (op < 86) {
            km_active_end outcome = (km_active_end)km_rng_below(&r, 4);
            rc = km_active_finish(a, &k, outcome, clock, NULL);
            if (!e->live) {
                KM_CHECK(rc == miss, "step %d finish miss: %d", step, rc);
            } else {
                KM_CHECK(rc == KM_OK, "step %d finish: %d", step, rc);
                xm_end(&m, i, (int)outcome);
            }
        } else if (op < 94) {
            xm_ctx c = {&m, KM_ACTIVE_END_EXPIRED, {0}};
            int due[XM_KEYS];
            for (int j = 0; j < XM_KEYS; j++)
                due[j] = m.e[j].live && now - m.e[j].last_touch >= ttl;
            size_t n = 0;
            rc = km_active_expire(a, clock, xm_on_end, &c, &n);
            cr_assert_eq(rc, KM_OK);
            for (int j = 0; j < XM_KEYS; j++)
                KM_CHECK(c.ended[j] == due[j], "step %d key %d expired %d, due %d", step, j,
                         c.ended[j], due[j]);
        } else if (op < 97) {
            uint32_t w = km_rng_below(&r, XM_WORKERS);
            xm_ctx c = {&m, KM_ACTIVE_END_WORKER_REMOVED, {0}};
            int hit[XM_KEYS];
            for (int j = 0; j < XM_KEYS; j++)
                hit[j] = m.e[j].live && m.e[j].worker == w;
            rc = km_active_remove_worker(a, w, clock, xm_on_end, &c, NULL);
            cr_assert_eq(rc, KM_OK);
            for (int j = 0; j < XM_KEYS; j++)
                KM_CHECK(c.ended[j] == hit[j], "step %d key %d removed %d", step, j, c.ended[j]);
        } else {
            (void)km_active_release_idle(a);
            rc = KM_ERR_NOT_FOUND; /* takes no time */
        }
        if (rc == KM_OK && (op < 22 || op >= 40)) /* a prefix or a promise takes no time */
            seen = now;
        xm_compare(&m, a, step);
    }
    KM_CHECK(evictions > 0 && refusals > 0 && late_shares > 0,
             "the run exercised eviction (%" PRIu64 "), the bytes bound (%" PRIu64
             ") and prefixes declared after FIRST_TOKEN (%" PRIu64 ")",
             evictions, refusals, late_shares);
    km_active_destroy(a);
}

/* ---- a small ring of ended ids, every counter, and a drain to zero -------------------------- */

/* Random runs of the lifecycle calls (begin, DISPATCHED, FIRST_TOKEN, cached-token reports, moves,
 * FINISHED, expiry, eviction, worker removal) with a ring of 3 ended ids: a miss on a key is late
 * when the latest of the last 3 ends is that key's by expiry, eviction or removal, a duplicate when
 * it is by FINISHED, and unknown when the key is not among them (never begun, or pushed out).
 * After every step each counter of km_active_stats (begun, ended by kind, unknown, late,
 * duplicates, out_of_order, moved, corrections) equals the model's, and the loads equal the
 * live entries'; at the end every live entry finishes and every load value, the entries, the
 * bytes and the queued blocks are 0, with no subtraction saturated. */
#define RR_KEYS 12
#define RR_WORKERS 3
#define RR_RING 3

typedef struct rr_key {
    int live, first_token;
    uint32_t worker, prompt;
    uint64_t pending, decode, last_touch;
} rr_key;

typedef struct rr_model {
    rr_key k[RR_KEYS];
    int ring_key[RR_RING], ring_end[RR_RING];
    uint32_t ring_next, ring_n;
    km_active_stats st;
} rr_model;

static void rr_end(rr_model *m, int i, int end)
{
    m->k[i].live = 0;
    m->st.ended[end]++;
    m->ring_key[m->ring_next] = i;
    m->ring_end[m->ring_next] = end;
    m->ring_next = (m->ring_next + 1) % RR_RING;
    m->ring_n += m->ring_n < RR_RING;
}

/* The status of an event on key i that is not live, counted as the header says. */
static int rr_miss(rr_model *m, int i)
{
    for (uint32_t back = 1; back <= m->ring_n; back++) {
        uint32_t slot = (m->ring_next + RR_RING - back) % RR_RING;
        if (m->ring_key[slot] != i)
            continue;
        int end = m->ring_end[slot];
        if (end == KM_ACTIVE_END_EXPIRED || end == KM_ACTIVE_END_WORKER_REMOVED ||
            end == KM_ACTIVE_END_EVICTED) {
            m->st.late++;
            return KM_ERR_NOT_FOUND;
        }
        m->st.duplicates++;
        return KM_ERR_PROTOCOL;
    }
    m->st.unknown++;
    return KM_ERR_NOT_FOUND;
}

typedef struct rr_ctx {
    rr_model *m;
    km_active_end end;
    int calls;
} rr_ctx;

static void rr_on_end(void *user, const km_active_summary *s)
{
    rr_ctx *c = user;
    int i = atoi(s->request_id + 1);
    KM_CHECK(i >= 0 && i < RR_KEYS && c->m->k[i].live && s->end == c->end &&
                 s->worker == c->m->k[i].worker,
             "ended %s (end %d, worker %u)", s->request_id, (int)s->end, s->worker);
    rr_end(c->m, i, (int)c->end);
    c->calls++;
}

static void rr_compare(const rr_model *m, const km_active *a, int step)
{
    km_active_stats st = stats_of(a);
    for (unsigned e = 0; e < KM_ACTIVE_END_COUNT; e++)
        KM_CHECK(st.ended[e] == m->st.ended[e], "step %d: ended[%s] %" PRIu64 ", model %" PRIu64,
                 step, km_active_end_name((km_active_end)e), st.ended[e], m->st.ended[e]);
    KM_CHECK(st.begun == m->st.begun && st.unknown == m->st.unknown && st.late == m->st.late &&
                 st.duplicates == m->st.duplicates && st.out_of_order == m->st.out_of_order &&
                 st.moved == m->st.moved && st.corrections == m->st.corrections &&
                 st.saturations == 0,
             "step %d: begun %" PRIu64 " unknown %" PRIu64 " late %" PRIu64 " duplicates %" PRIu64
             " out_of_order %" PRIu64 " moved %" PRIu64 " corrections %" PRIu64
             " saturations %" PRIu64 "; model %" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64
             " %" PRIu64 " %" PRIu64 " %" PRIu64,
             step, st.begun, st.unknown, st.late, st.duplicates, st.out_of_order, st.moved,
             st.corrections, st.saturations, m->st.begun, m->st.unknown, m->st.late,
             m->st.duplicates, m->st.out_of_order, m->st.moved, m->st.corrections);
    uint64_t live = 0;
    for (uint32_t w = 0; w < RR_WORKERS; w++) {
        km_active_load want = {0};
        for (int i = 0; i < RR_KEYS; i++) {
            const rr_key *k = &m->k[i];
            if (!k->live || k->worker != w)
                continue;
            want.in_flight++;
            want.prefilling += !k->first_token;
            want.pending_prefill_tokens += k->pending;
            want.active_decode_blocks += k->decode;
        }
        live += want.in_flight;
        km_active_load l = load_of(a, w);
        KM_CHECK(l.in_flight == want.in_flight && l.prefilling == want.prefilling &&
                     l.pending_prefill_tokens == want.pending_prefill_tokens &&
                     l.active_decode_blocks == want.active_decode_blocks &&
                     l.allocated_blocks == want.active_decode_blocks,
                 "step %d worker %u: load (%" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64
                 " %" PRIu64 ") != model (%" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64 ")",
                 step, w, l.in_flight, l.prefilling, l.pending_prefill_tokens,
                 l.active_decode_blocks, l.allocated_blocks, want.in_flight, want.prefilling,
                 want.pending_prefill_tokens, want.active_decode_blocks);
    }
    KM_CHECK(st.entries == live, "step %d: entries %" PRIu64 ", model %" PRIu64, step, st.entries,
             live);
}

Test(active, a_small_ended_ring_classifies_every_miss_and_the_loads_drain_to_zero, .timeout = 30)
{
    km_rng r;
    km_rng_init(&r, km_test_seed());
    static rr_model m;
    memset(&m, 0, sizeof m);
    char req[RR_KEYS][8];
    for (int i = 0; i < RR_KEYS; i++)
        snprintf(req[i], sizeof req[i], "k%d", i);
    const uint64_t ttl = 3000;
    km_active *a = make_active(RR_WORKERS, ttl, 8, RR_RING);
    uint64_t clock = 0, seen = 0;
    for (int step = 0; step < 20000; step++) {
        clock = km_rng_percent(&r, 3) && clock > 20 ? clock - km_rng_below(&r, 20)
                                                    : clock + km_rng_below(&r, 120);
        uint64_t now = clock > seen ? clock : seen;
        int i = (int)km_rng_below(&r, RR_KEYS);
        rr_key *k = &m.k[i];
        km_active_key key = km_active_key_of(req[i], "a");
        uint32_t op = km_rng_below(&r, 100);
        int rc, want = KM_OK, touched = 0;
        if (op < 25) {
            uint32_t w = km_rng_below(&r, RR_WORKERS), prompt = km_rng_below(&r, 3000);
            uint32_t predicted = km_rng_below(&r, 3000), output = km_rng_below(&r, 400);
            uint64_t live = 0;
            for (int j = 0; j < RR_KEYS; j++)
                live += m.k[j].live;
            rc = km_active_begin(a, w, &key, prompt, predicted, output, 16, clock);
            if (k->live) {
                m.st.duplicates++;
                want = KM_ERR_PROTOCOL;
            } else if (live >= 8) {
                want = KM_ERR_OVERLOADED;
            } else {
                *k = (rr_key){.live = 1, .worker = w, .prompt = prompt,
                              .pending = prompt - (predicted < prompt ? predicted : prompt),
                              .decode = ((uint64_t)prompt + output + 15) / 16};
                m.st.begun++;
                touched = 1;
            }
        } else if (op < 35) {
            rc = km_active_dispatched(a, &key, clock);
            if (!k->live)
                want = rr_miss(&m, i);
            else if (k->first_token)
                m.st.out_of_order++, want = KM_ERR_PROTOCOL;
            else
                touched = 1;
        } else if (op < 47) {
            rc = km_active_first_token(a, &key, KM_ACTIVE_CACHED_UNKNOWN, clock);
            if (!k->live) {
                want = rr_miss(&m, i);
            } else if (k->first_token) {
                m.st.duplicates++;
                want = KM_ERR_PROTOCOL;
            } else {
                k->first_token = 1;
                k->pending = 0;
                touched = 1;
            }
        } else if (op < 55) {
            int64_t cached = km_rng_below(&r, 3000);
            rc = km_active_report_cached(a, &key, cached, clock);
            if (!k->live) {
                want = rr_miss(&m, i);
            } else {
                if (!k->first_token) {
                    uint64_t c = (uint64_t)cached < k->prompt ? (uint64_t)cached : k->prompt;
                    m.st.corrections += k->prompt - c != k->pending;
                    k->pending = k->prompt - c;
                }
                touched = 1;
            }
        } else if (op < 62) {
            uint32_t w = km_rng_below(&r, RR_WORKERS);
            rc = km_active_move(a, &key, w, clock);
            if (!k->live) {
                want = rr_miss(&m, i);
            } else {
                m.st.moved += w != k->worker;
                k->worker = w;
                touched = 1;
            }
        } else if (op < 80) {
            km_active_end outcome = (km_active_end)km_rng_below(&r, 4);
            rc = km_active_finish(a, &key, outcome, clock, NULL);
            if (!k->live)
                want = rr_miss(&m, i);
            else
                rr_end(&m, i, (int)outcome);
        } else if (op < 90) {
            rr_ctx c = {&m, KM_ACTIVE_END_EXPIRED, 0};
            int due = 0;
            for (int j = 0; j < RR_KEYS; j++)
                due += m.k[j].live && now - m.k[j].last_touch >= ttl;
            size_t n = 0;
            rc = km_active_expire(a, clock, rr_on_end, &c, &n);
            KM_CHECK(n == (size_t)due && c.calls == due, "step %d: expired %zu, due %d", step, n,
                     due);
        } else if (op < 95) {
            rr_ctx c = {&m, KM_ACTIVE_END_EVICTED, 0};
            int any = 0;
            for (int j = 0; j < RR_KEYS; j++)
                any |= m.k[j].live;
            rc = km_active_evict_oldest(a, clock, rr_on_end, &c);
            want = any ? KM_OK : KM_ERR_NOT_FOUND;
            KM_CHECK(c.calls == any, "step %d: evicted %d", step, c.calls);
        } else {
            rr_ctx c = {&m, KM_ACTIVE_END_WORKER_REMOVED, 0};
            rc = km_active_remove_worker(a, km_rng_below(&r, RR_WORKERS), clock, rr_on_end, &c,
                                         NULL);
        }
        KM_CHECK(rc == want, "step %d op %u key %d: %d, model %d (%s)", step, op, i, rc, want,
                 km_active_last_error(a));
        if (touched)
            k->last_touch = now;
        if (rc == KM_OK) /* a failed call changes nothing, its clock included */
            seen = now;
        rr_compare(&m, a, step);
    }
    /* every live entry finishes: nothing is left anywhere */
    for (int i = 0; i < RR_KEYS; i++) {
        if (!m.k[i].live)
            continue;
        km_active_key key = km_active_key_of(req[i], "a");
        cr_assert_eq(km_active_finish(a, &key, KM_ACTIVE_END_COMPLETE, clock, NULL), KM_OK);
        rr_end(&m, i, KM_ACTIVE_END_COMPLETE);
    }
    rr_compare(&m, a, -1);
    km_active_stats st = stats_of(a);
    KM_CHECK(st.entries == 0 && st.bytes == 0 && st.queued_blocks == 0 &&
                 st.total.in_flight == 0 && st.total.prefilling == 0 &&
                 st.total.pending_prefill_tokens == 0 && st.total.pending_prefill_pairs == 0 &&
                 st.total.active_decode_blocks == 0 && st.total.allocated_blocks == 0,
             "drained: entries %" PRIu64 " bytes %" PRIu64 " total in_flight %" PRIu64, st.entries,
             st.bytes, st.total.in_flight);
    KM_CHECK(st.late > 0 && st.duplicates > 0 && st.unknown > 0 && st.out_of_order > 0,
             "the run exercised every kind of miss");
    km_active_destroy(a);
}
