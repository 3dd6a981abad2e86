/* In-flight work shared between instances (km_cluster_publish_work): each request's shared-prefix
 * key and its queued prefill's promised blocks reach the other instances with the load, through
 * the codec and through a real nats-server on a loopback port: they leave with the request's
 * FIRST_TOKEN and end, a gap marks the sender stale until its next state repairs them, a restart
 * replaces them, a peer whose pool's workers differ has its work left out until they agree, and
 * malformed work rows are refused and counted without changing anything. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include <nats/nats.h>

#include "cluster/cluster_internal.h"
#include "kvmatch/cluster.h"
#include "kv_test_publisher.h"
#include "nats_test_server.h"
#include "test_util.h"

#define WORKERS 8u

static km_nats_test_server server;

static void start_server(void)
{
    char why[256];
    if (!km_nats_test_server_start(&server, why, sizeof why))
        cr_assert_fail("cannot start nats-server: %s", why);
}

static void stop_server(void)
{
    km_nats_test_server_stop(&server);
}

static km_cluster *instance(const char *id, uint32_t heartbeat_ms)
{
    km_cluster_config cfg;
    km_cluster_config_init(&cfg);
    cfg.url = server.url;
    cfg.instance = id;
    cfg.max_workers = WORKERS;
    cfg.heartbeat_ms = heartbeat_ms;
    cfg.expire_ms = 10000;
    cfg.reconnect_wait_ms = 50;
    km_cluster *c = NULL;
    char why[256] = "";
    cr_assert_eq(km_cluster_create(&cfg, &c, why, sizeof why), KM_OK, "create %s: %s", id, why);
    return c;
}

static km_cluster_stats stats(km_cluster *c)
{
    km_cluster_stats st;
    cr_assert_eq(km_cluster_get_stats(c, &st), KM_OK);
    return st;
}

static uint64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

#define WAIT_UNTIL(cond, ms)                                              \
    do {                                                                  \
        for (int waited_ = 0; !(cond) && waited_ < (ms); waited_ += 5)    \
            km_test_sleep_ms(5);                                          \
    } while (0)

/* ---- the codec ------------------------------------------------------------------------------ */

Test(cluster_work, work_rows_round_trip_every_hash_and_bad_ones_are_refused, .timeout = 30)
{
    km_rng rng;
    km_rng_init(&rng, km_test_seed());
    km_text t;
    km_text_init(&t, 0);
    for (int round = 0; round < 50; round++) {
        uint64_t prefixes[8], queued[40];
        uint32_t np = km_rng_below(&rng, 9), nq = km_rng_below(&rng, 41);
        for (uint32_t i = 0; i < np; i++)
            prefixes[i] = km_rng_next(&rng);
        for (uint32_t i = 0; i < nq; i++)
            queued[i] = km_rng_next(&rng);
        cluster_worker_load rows[2] = {{2, {3, 1, 10, 5, 5, 7}, CLUSTER_NO_WORK_ROW},
                                       {5, {1, 0, 0, 1, 1, 0}, CLUSTER_NO_WORK_ROW}};
        cluster_worker_work work = {5, prefixes, np, queued, nq};
        cluster_message m = {.kind = CLUSTER_CHANGE, .instance = "a", .incarnation = 9,
                             .seq = 3, .workers = rows, .n_workers = 2, .work = &work,
                             .n_work = 1};
        cr_assert_eq(km_cluster_encode(&t, &m, KM_CLUSTER_MESSAGE_MAX), KM_OK);
        cluster_message d;
        km_cluster_refusal r;
        char why[160];
        cr_assert(km_cluster_decode("change.a", t.data, t.length, WORKERS, &d, &r, why,
                                    sizeof why), "%s", why);
        cr_assert_eq(d.n_work, 1);
        cr_assert_eq(d.work[0].worker, 5);
        cr_assert_eq(d.work[0].n_prefixes, np);
        cr_assert_eq(d.work[0].n_queued, nq);
        for (uint32_t i = 0; i < np; i++)
            cr_assert_eq(d.work[0].prefixes[i], prefixes[i]);
        for (uint32_t i = 0; i < nq; i++)
            cr_assert_eq(d.work[0].queued[i], queued[i]);
        km_cluster_message_free(&d);
    }
    static const struct {
        const char *body;
        km_cluster_refusal reason;
    } bad[] = {
        {"{\"v\":1,\"kind\":\"change\",\"instance\":\"a\",\"incarnation\":1,\"seq\":1,"
         "\"workers\":[[1,1,0,0,0,0,0]],\"work\":[[1,[\"xyz\"],[]]]}",
         KM_CLUSTER_REFUSED_MALFORMED},
        {"{\"v\":1,\"kind\":\"change\",\"instance\":\"a\",\"incarnation\":1,\"seq\":1,"
         "\"workers\":[[1,1,0,0,0,0,0]],\"work\":[[2,[],[]]]}",
         KM_CLUSTER_REFUSED_MALFORMED},
        {"{\"v\":1,\"kind\":\"change\",\"instance\":\"a\",\"incarnation\":1,\"seq\":1,"
         "\"workers\":[[1,1,0,0,0,0,0]],\"work\":[[1,[],[]],[1,[],[]]]}",
         KM_CLUSTER_REFUSED_MALFORMED},
        {"{\"v\":1,\"kind\":\"change\",\"instance\":\"a\",\"incarnation\":1,\"seq\":1,"
         "\"workers\":[[1,1,0,0,0,0,0]],\"work\":[[1,[]]]}",
         KM_CLUSTER_REFUSED_MALFORMED},
        {"{\"v\":1,\"kind\":\"change\",\"instance\":\"a\",\"incarnation\":1,\"seq\":1,"
         "\"workers\":[[1,1,0,0,0,0,0]],\"work\":{}}",
         KM_CLUSTER_REFUSED_MALFORMED},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        cluster_message d;
        km_cluster_refusal r = KM_CLUSTER_REFUSED_VERSION;
        char why[160] = "";
        cr_assert_not(km_cluster_decode("change.a", bad[i].body, strlen(bad[i].body), WORKERS,
                                        &d, &r, why, sizeof why), "bad[%zu] accepted", i);
        cr_assert_eq(r, bad[i].reason, "bad[%zu]: %s", i, why);
        cr_assert(why[0], "bad[%zu] has no reason", i);
    }
    /* More queued hashes than a row may carry: too_large. */
    km_text big;
    km_text_init(&big, 0);
    km_text_printf(&big, "{\"v\":1,\"kind\":\"change\",\"instance\":\"a\",\"incarnation\":1,"
                         "\"seq\":1,\"workers\":[[1,1,0,0,0,0,0]],\"work\":[[1,[],[");
    for (uint32_t i = 0; i <= KM_CLUSTER_WORK_MAX_QUEUED; i++)
        km_text_printf(&big, "%s\"%016x\"", i ? "," : "", i + 1);
    km_text_printf(&big, "]]]}");
    cluster_message d;
    km_cluster_refusal r;
    char why[160];
    cr_assert_not(km_cluster_decode("change.a", big.data, big.length, WORKERS, &d, &r, why,
                                    sizeof why));
    cr_assert_eq(r, KM_CLUSTER_REFUSED_TOO_LARGE, "%s", why);
    km_text_free(&big);
    km_text_free(&t);
}

/* A message at the size bound of as many workers as fit, each with a work row (listed in the
 * opposite order): decoding it looks each worker up a bounded number of times, and every worker
 * row names its own work row (what the receiver applies without a search). */
Test(cluster_work, a_message_of_the_most_workers_decodes_in_linear_work, .timeout = 60)
{
    const uint32_t max_workers = 65534;
    km_text t;
    km_text_init(&t, 0);
    km_text_printf(&t, "{\"v\":1,\"kind\":\"state\",\"instance\":\"x\",\"incarnation\":9,"
                       "\"seq\":1,\"workers\":[");
    /* At most 20 bytes a worker row and 33 a work row. */
    const uint32_t n = (KM_CLUSTER_MESSAGE_MAX - 256) / 53;
    for (uint32_t i = 0; i < n; i++)
        km_text_printf(&t, "%s[%u,1,0,0,0,0,0]", i ? "," : "", i);
    km_text_printf(&t, "],\"work\":[");
    for (uint32_t i = 0; i < n; i++)
        km_text_printf(&t, "%s[%u,[],[\"%016x\"]]", i ? "," : "", n - 1 - i, i + 1);
    km_text_printf(&t, "],\"peers\":[]}");
    cr_assert_leq(t.length, KM_CLUSTER_MESSAGE_MAX);
    cluster_message d;
    km_cluster_refusal r;
    char why[160];
    cr_assert(km_cluster_decode("state.x", t.data, t.length, max_workers, &d, &r, why,
                                sizeof why), "%s", why);
    cr_assert_eq(d.n_workers, n);
    cr_assert_eq(d.n_work, n);
    cr_assert_leq(d.work_lookups, 2 * (uint64_t)n, "%llu lookups for %u workers and rows",
                  (unsigned long long)d.work_lookups, n);
    for (uint32_t i = 0; i < n; i++) {
        uint32_t row = d.workers[i].work_row;
        cr_assert_lt(row, d.n_work, "worker %u has no work row", d.workers[i].worker);
        cr_assert_eq(d.work[row].worker, d.workers[i].worker);
        cr_assert_eq(d.work[row].queued[0], (uint64_t)(n - d.workers[i].worker));
    }
    km_cluster_message_free(&d);
    /* A worker listed without a work row has none. */
    const char *none = "{\"v\":1,\"kind\":\"change\",\"instance\":\"x\",\"incarnation\":9,"
                       "\"seq\":2,\"workers\":[[1,1,0,0,0,0,0],[4,1,0,0,0,0,0]],"
                       "\"work\":[[4,[],[]]]}";
    cr_assert(km_cluster_decode("change.x", none, strlen(none), WORKERS, &d, &r, why, sizeof why),
              "%s", why);
    cr_assert_eq(d.workers[0].work_row, CLUSTER_NO_WORK_ROW);
    cr_assert_eq(d.workers[1].work_row, 0);
    km_cluster_message_free(&d);
    km_text_free(&t);
}

/* ---- through a real nats-server ------------------------------------------------------------- */

static const uint64_t PREFIX = 0xfeedfacecafebeefu;
static const uint64_t PROMPT[4] = {0x1111111111111111u, 0x2222222222222222u,
                                   0x3333333333333333u, 0x4444444444444444u};

Test(cluster_work, a_peers_prefix_and_queued_promise_count_until_its_first_token_and_end,
     .init = start_server, .fini = stop_server, .timeout = 60)
{
    km_cluster *a = instance("a", 50), *b = instance("b", 50), *c = instance("c", 50);
    /* A's request on worker 3 declared PREFIX and promises PROMPT[1..3) (it holds PROMPT[0]). */
    km_active_load busy = {1, 1, 32, 4, 4, 100};
    cr_assert_eq(km_cluster_publish_work(a, 3, &busy, &PREFIX, 1, PROMPT + 1, 2), KM_OK);
    WAIT_UNTIL(km_cluster_remote_queued_depth(b, 3, PROMPT, 4, 1) == 3, 2000);
    cr_assert_eq(km_cluster_remote_prefix_sharers(b, 3, PREFIX), 1);
    cr_assert_eq(km_cluster_remote_queued_depth(b, 3, PROMPT, 4, 1), 3,
                 "the promise extends the held block by the two promised ones");
    cr_assert_eq(km_cluster_remote_queued_depth(b, 3, PROMPT, 4, 0), 0,
                 "an unpromised first block stops the extension");
    cr_assert_eq(km_cluster_remote_prefix_sharers(b, 2, PREFIX), 0, "another worker: none");
    cr_assert_eq(km_cluster_remote_queued_depth(b, 2, PROMPT, 4, 1), 1);
    /* C declares the same prefix there too: two sharers from two instances. */
    cr_assert_eq(km_cluster_publish_work(c, 3, &busy, &PREFIX, 1, NULL, 0), KM_OK);
    WAIT_UNTIL(km_cluster_remote_prefix_sharers(b, 3, PREFIX) == 2, 2000);
    cr_assert_eq(km_cluster_remote_prefix_sharers(b, 3, PREFIX), 2);
    /* A's FIRST_TOKEN: the promise is kept by the engine's cache now, not by A's queue. */
    km_active_load decoding = {1, 0, 0, 4, 4, 0};
    cr_assert_eq(km_cluster_publish_work(a, 3, &decoding, &PREFIX, 1, NULL, 0), KM_OK);
    WAIT_UNTIL(km_cluster_remote_queued_depth(b, 3, PROMPT, 4, 1) == 1, 2000);
    cr_assert_eq(km_cluster_remote_queued_depth(b, 3, PROMPT, 4, 1), 1);
    cr_assert_eq(km_cluster_remote_prefix_sharers(b, 3, PREFIX), 2);
    /* A's FINISHED: nothing of A's is left; C's request still shares the prefix. */
    static const km_active_load idle;
    cr_assert_eq(km_cluster_publish_work(a, 3, &idle, NULL, 0, NULL, 0), KM_OK);
    WAIT_UNTIL(km_cluster_remote_prefix_sharers(b, 3, PREFIX) == 1, 2000);
    cr_assert_eq(km_cluster_remote_prefix_sharers(b, 3, PREFIX), 1);
    /* A load-only publish keeps the work last given. */
    cr_assert_eq(km_cluster_publish_load(c, 3, &decoding), KM_OK);
    km_test_sleep_ms(100);
    cr_assert_eq(km_cluster_remote_prefix_sharers(b, 3, PREFIX), 1);
    cr_assert_eq(stats(b).remote_work, 1);
    cr_assert_eq(stats(b).refused[KM_CLUSTER_REFUSED_MALFORMED], 0);
    km_cluster_destroy(a);
    km_cluster_destroy(b);
    km_cluster_destroy(c);
}

Test(cluster_work, a_gap_marks_the_peer_stale_and_its_next_state_repairs_the_work,
     .init = start_server, .fini = stop_server, .timeout = 60)
{
    km_cluster *a = instance("a", 300), *b = instance("b", 300);
    km_active_load busy = {1, 1, 32, 4, 4, 100};
    cr_assert_eq(km_cluster_set_drop_one_in(a, 1), KM_OK); /* every change is lost */
    cr_assert_eq(km_cluster_publish_work(a, 3, &busy, &PREFIX, 1, PROMPT + 1, 2), KM_OK);
    cr_assert_eq(km_cluster_set_drop_one_in(a, 0), KM_OK);
    km_active_load other = {1, 1, 8, 1, 1, 10};
    cr_assert_eq(km_cluster_publish_work(a, 5, &other, NULL, 0, NULL, 0), KM_OK);
    WAIT_UNTIL(stats(b).lost_messages >= 1, 2000);
    km_cluster_view v;
    cr_assert_eq(km_cluster_get_view(b, mono_ns(), &v), KM_OK);
    if (km_cluster_remote_prefix_sharers(b, 3, PREFIX) == 0) {
        /* The change after the gap arrived before A's next heartbeat. */
        cr_assert_eq(v.n_stale, 1, "a gap marks A stale");
        cr_assert_str_eq(v.stale[0], "a");
    }
    WAIT_UNTIL(km_cluster_remote_prefix_sharers(b, 3, PREFIX) == 1, 2000);
    cr_assert_eq(km_cluster_remote_prefix_sharers(b, 3, PREFIX), 1, "A's state repairs the work");
    cr_assert_eq(km_cluster_remote_queued_depth(b, 3, PROMPT, 4, 1), 3);
    cr_assert_eq(km_cluster_get_view(b, mono_ns(), &v), KM_OK);
    cr_assert_eq(v.n_stale, 0);
    cr_assert_eq(stats(b).lost_messages, 1);
    km_cluster_destroy(a);
    km_cluster_destroy(b);
}

Test(cluster_work, a_restarted_peer_replaces_its_work, .init = start_server, .fini = stop_server,
     .timeout = 60)
{
    km_cluster *a = instance("a", 50), *b = instance("b", 50);
    km_active_load busy = {1, 1, 32, 4, 4, 100};
    cr_assert_eq(km_cluster_publish_work(a, 3, &busy, &PREFIX, 1, PROMPT + 1, 2), KM_OK);
    WAIT_UNTIL(km_cluster_remote_prefix_sharers(b, 3, PREFIX) == 1, 2000);
    cr_assert_eq(km_cluster_remote_prefix_sharers(b, 3, PREFIX), 1);
    km_cluster_destroy(a);
    a = instance("a", 50); /* a new incarnation, with no requests */
    WAIT_UNTIL(stats(b).restarted_instances == 1, 2000);
    cr_assert_eq(stats(b).restarted_instances, 1);
    cr_assert_eq(km_cluster_remote_prefix_sharers(b, 3, PREFIX), 0);
    cr_assert_eq(km_cluster_remote_queued_depth(b, 3, PROMPT, 4, 1), 1);
    cr_assert_eq(stats(b).remote_work, 0);
    km_cluster_destroy(a);
    km_cluster_destroy(b);
}

Test(cluster_work, malformed_work_rows_are_refused_counted_and_change_nothing,
     .init = start_server, .fini = stop_server, .timeout = 60)
{
    km_cluster *b = instance("b", 50);
    natsConnection *nc = NULL;
    cr_assert_eq(natsConnection_ConnectTo(&nc, server.url), NATS_OK);
    const char *good = "{\"v\":1,\"kind\":\"state\",\"instance\":\"x\",\"incarnation\":5,\"seq\":1,"
                       "\"workers\":[[3,1,1,0,0,0,0]],\"work\":[[3,[\"feedfacecafebeef\"],[]]],"
                       "\"peers\":[]}";
    const char *bad = "{\"v\":1,\"kind\":\"change\",\"instance\":\"x\",\"incarnation\":5,\"seq\":2,"
                      "\"workers\":[[3,1,1,0,0,0,0]],\"work\":[[3,[\"not-a-hash\"],[]]]}";
    cr_assert_eq(natsConnection_PublishString(nc, "kvmatch.cluster.state.x", good), NATS_OK);
    cr_assert_eq(natsConnection_FlushTimeout(nc, 2000), NATS_OK);
    WAIT_UNTIL(km_cluster_remote_prefix_sharers(b, 3, PREFIX) == 1, 2000);
    cr_assert_eq(km_cluster_remote_prefix_sharers(b, 3, PREFIX), 1);
    cr_assert_eq(natsConnection_PublishString(nc, "kvmatch.cluster.change.x", bad), NATS_OK);
    cr_assert_eq(natsConnection_FlushTimeout(nc, 2000), NATS_OK);
    WAIT_UNTIL(stats(b).refused[KM_CLUSTER_REFUSED_MALFORMED] == 1, 2000);
    km_cluster_stats st = stats(b);
    cr_assert_eq(st.refused[KM_CLUSTER_REFUSED_MALFORMED], 1);
    cr_assert(strstr(st.last_refusal, "work[0]"), "last refusal: %s", st.last_refusal);
    cr_assert_eq(km_cluster_remote_prefix_sharers(b, 3, PREFIX), 1, "the table is unchanged");
    natsConnection_Destroy(nc);
    km_cluster_destroy(b);
}

Test(cluster_work, a_peer_whose_workers_differ_has_its_work_left_out_until_they_agree,
     .init = start_server, .fini = stop_server, .timeout = 60)
{
    km_cluster *a = instance("a", 50), *b = instance("b", 50);
    static const uint32_t ids[2] = {3, 4};
    km_cluster_pool ours = {"main", 0x1111u, ids, 2}, theirs = {"main", 0x2222u, ids, 2};
    cr_assert_eq(km_cluster_set_pools(b, &ours, 1), KM_OK);
    cr_assert_eq(km_cluster_set_pools(a, &ours, 1), KM_OK);
    km_active_load busy = {1, 1, 32, 4, 4, 100};
    cr_assert_eq(km_cluster_publish_work(a, 3, &busy, &PREFIX, 1, PROMPT + 1, 2), KM_OK);
    WAIT_UNTIL(km_cluster_remote_prefix_sharers(b, 3, PREFIX) == 1, 2000);
    cr_assert_eq(km_cluster_remote_prefix_sharers(b, 3, PREFIX), 1);
    cr_assert_eq(km_cluster_set_pools(a, &theirs, 1), KM_OK); /* its state goes out at once */
    WAIT_UNTIL(stats(b).n_mismatched == 1, 2000);
    cr_assert_eq(stats(b).n_mismatched, 1);
    cr_assert_eq(km_cluster_remote_prefix_sharers(b, 3, PREFIX), 0, "a mismatched pool's work");
    cr_assert_eq(km_cluster_remote_queued_depth(b, 3, PROMPT, 4, 1), 1);
    cr_assert_eq(km_cluster_set_pools(a, &ours, 1), KM_OK);
    WAIT_UNTIL(stats(b).n_mismatched == 0, 2000);
    WAIT_UNTIL(km_cluster_remote_prefix_sharers(b, 3, PREFIX) == 1, 2000);
    cr_assert_eq(km_cluster_remote_prefix_sharers(b, 3, PREFIX), 1, "agreeing again applies it");
    cr_assert_eq(km_cluster_remote_queued_depth(b, 3, PROMPT, 4, 1), 3);
    km_cluster_destroy(a);
    km_cluster_destroy(b);
}
