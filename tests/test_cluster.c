/* The cluster view (include/kvmatch/cluster.h) through a real nats-server on a loopback port:
 * instances converge, a lost message is detected and counted, a crashed instance's contribution
 * expires, NATS down and back, a restarted instance sees running work before create returns, and
 * bad or foreign messages are refused and counted without harm. A test that cannot start
 * nats-server fails with the reason. */
#include <criterion/criterion.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <nats/nats.h>

#include "base/utf8.h"
#include "cluster/cluster_internal.h"
#include "kvmatch/cluster.h"
#include "kv_test_publisher.h"
#include "nats_test_server.h"
#include "test_util.h"

#define WORKERS 16u

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

/* sync_quiet_ms of the instances created; 0: the default (100 ms). A running peer's first answer
 * can take longer than 100 ms on a loaded test machine. */
static uint32_t g_sync_quiet_ms = 1000;

static km_cluster *instance(const char *id, const char *url, uint32_t expire_ms,
                            uint32_t drop_one_in)
{
    km_cluster_config cfg;
    km_cluster_config_init(&cfg);
    cfg.url = url;
    cfg.instance = id;
    cfg.max_workers = WORKERS;
    cfg.heartbeat_ms = 50;
    if (g_sync_quiet_ms)
        cfg.sync_quiet_ms = g_sync_quiet_ms;
    cfg.expire_ms = expire_ms;
    cfg.reconnect_wait_ms = 50;
    cfg.drop_one_in = drop_one_in;
    km_cluster *c = NULL;
    char why[256] = "";
    int rc = km_cluster_create(&cfg, &c, why, sizeof why);
    cr_assert_eq(rc, KM_OK, "km_cluster_create(%s): %s", id, why);
    return c;
}

static km_active_load remote(km_cluster *c, uint32_t worker)
{
    km_active_load l = {0};
    cr_assert_eq(km_cluster_add_remote_load(c, worker, &l), KM_OK);
    return l;
}

static bool load_eq(km_active_load a, km_active_load b)
{
    return !memcmp(&a, &b, sizeof a);
}

static uint64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Poll `cond` every 5 ms for at most ms milliseconds. */
#define WAIT_UNTIL(cond, ms)                                              \
    do {                                                                  \
        for (int waited_ = 0; !(cond) && waited_ < (ms); waited_ += 5)    \
            km_test_sleep_ms(5);                                          \
    } while (0)

static km_cluster_stats stats(km_cluster *c)
{
    km_cluster_stats st;
    cr_assert_eq(km_cluster_get_stats(c, &st), KM_OK);
    return st;
}

/* ---- the codec, without NATS ---------------------------------------------------------------- */

Test(cluster, messages_round_trip_and_bad_ones_are_refused_by_reason, .timeout = 30)
{
    km_text t;
    km_text_init(&t, 0);
    cluster_worker_load rows[2] = {{3, {2, 1, 100, 10, 9, 123456}, CLUSTER_NO_WORK_ROW},
                                   {15, {1, 0, 0, 4, 4, 0}, CLUSTER_NO_WORK_ROW}};
    char peers[1][KM_CLUSTER_INSTANCE_MAX + 1] = {"b-2"};
    cluster_message m = {.kind = CLUSTER_STATE, .instance = "a_1", .incarnation = 77, .seq = 5,
                         .workers = rows, .n_workers = 2, .peers = peers, .n_peers = 1};
    cr_assert_eq(km_cluster_encode(&t, &m, KM_CLUSTER_MESSAGE_MAX), KM_OK);
    cluster_message d;
    km_cluster_refusal r;
    char why[160];
    cr_assert(km_cluster_decode("state.a_1", t.data, t.length, WORKERS, &d, &r, why, sizeof why),
              "%s", why);
    cr_assert_eq(d.kind, CLUSTER_STATE);
    cr_assert_str_eq(d.instance, "a_1");
    cr_assert_eq(d.incarnation, 77);
    cr_assert_eq(d.seq, 5);
    cr_assert_eq(d.n_workers, 2);
    cr_assert_eq(d.workers[1].worker, 15);
    cr_assert(load_eq(d.workers[0].load, rows[0].load));
    cr_assert_eq(d.n_peers, 1);
    cr_assert_str_eq(d.peers[0], "b-2");
    cr_assert_eq(d.n_pools, 0);
    km_cluster_message_free(&d);
    /* A state's pool list: names and fingerprints, every bit of them. */
    cluster_pool_fingerprint pools[2] = {{"main", UINT64_MAX}, {"b.v2", 0x0123456789abcdefu}};
    m.pools = pools;
    m.n_pools = 2;
    cr_assert_eq(km_cluster_encode(&t, &m, KM_CLUSTER_MESSAGE_MAX), KM_OK);
    cr_assert(km_cluster_decode("state.a_1", t.data, t.length, WORKERS, &d, &r, why, sizeof why),
              "%s", why);
    cr_assert_eq(d.n_pools, 2);
    cr_assert_str_eq(d.pools[1].name, "b.v2");
    cr_assert_eq(d.pools[0].fingerprint, UINT64_MAX);
    cr_assert_eq(d.pools[1].fingerprint, 0x0123456789abcdefu);
    km_cluster_message_free(&d);

    struct {
        const char *subject, *body;
        km_cluster_refusal want;
    } bad[] = {
        {"state.a", "not json", KM_CLUSTER_REFUSED_MALFORMED},
        {"state.a", "[1,2]", KM_CLUSTER_REFUSED_MALFORMED},
        {"state.a", "{\"v\":2,\"kind\":\"state\",\"instance\":\"a\",\"incarnation\":1,\"seq\":1,"
                    "\"workers\":[],\"peers\":[]}", KM_CLUSTER_REFUSED_VERSION},
        {"state.b", "{\"v\":1,\"kind\":\"state\",\"instance\":\"a\",\"incarnation\":1,\"seq\":1,"
                    "\"workers\":[],\"peers\":[]}", KM_CLUSTER_REFUSED_SUBJECT},
        {"change.a", "{\"v\":1,\"kind\":\"change\",\"instance\":\"a\",\"incarnation\":1,\"seq\":1,"
                     "\"workers\":[[16,1,0,0,0,0,0]]}", KM_CLUSTER_REFUSED_WORKER},
        {"change.a", "{\"v\":1,\"kind\":\"change\",\"instance\":\"a\",\"incarnation\":1,\"seq\":1,"
                     "\"workers\":[[1,-1,0,0,0,0,0]]}", KM_CLUSTER_REFUSED_MALFORMED},
        {"change.a", "{\"v\":1,\"kind\":\"change\",\"instance\":\"a\",\"incarnation\":1,\"seq\":1,"
                     "\"workers\":[[1,1,2,0,0,0,0]]}", KM_CLUSTER_REFUSED_MALFORMED},
        {"change.a", "{\"v\":1,\"kind\":\"change\",\"instance\":\"a\",\"incarnation\":1,\"seq\":0,"
                     "\"workers\":[]}", KM_CLUSTER_REFUSED_MALFORMED},
        {"change.a b", "{\"v\":1,\"kind\":\"change\",\"instance\":\"a b\",\"incarnation\":1,"
                       "\"seq\":1,\"workers\":[]}", KM_CLUSTER_REFUSED_MALFORMED},
        {"state.a", "{\"v\":1,\"kind\":\"state\",\"instance\":\"a\",\"incarnation\":1,\"seq\":1,"
                    "\"workers\":[],\"peers\":[],\"pools\":[[\"main\",1]]}",
         KM_CLUSTER_REFUSED_MALFORMED},
        {"state.a", "{\"v\":1,\"kind\":\"state\",\"instance\":\"a\",\"incarnation\":1,\"seq\":1,"
                    "\"workers\":[],\"peers\":[],\"pools\":[[\"a b\",\"0000000000000001\"]]}",
         KM_CLUSTER_REFUSED_MALFORMED},
        {"state.a", "{\"v\":1,\"kind\":\"state\",\"instance\":\"a\",\"incarnation\":1,\"seq\":1,"
                    "\"workers\":[],\"peers\":[],\"pools\":{}}", KM_CLUSTER_REFUSED_MALFORMED},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        bool ok = km_cluster_decode(bad[i].subject, bad[i].body, strlen(bad[i].body), WORKERS, &d,
                                    &r, why, sizeof why);
        cr_assert(!ok, "case %zu accepted", i);
        cr_assert_eq(r, bad[i].want, "case %zu: refused as %s (%s), expected %s", i,
                     km_cluster_refusal_name(r), why, km_cluster_refusal_name(bad[i].want));
    }
    km_text_free(&t);
}

Test(cluster, predictions_round_trip_every_hash_and_bad_ones_are_refused_by_reason, .timeout = 30)
{
    km_text t;
    km_text_init(&t, 0);
    km_rng rng;
    km_rng_init(&rng, km_test_seed());
    uint64_t hashes[300];
    for (size_t i = 0; i < 300; i++)
        hashes[i] = km_rng_next(&rng);
    hashes[0] = UINT64_MAX; /* past INT64_MAX: not a JSON integer every parser keeps */
    hashes[1] = 0;
    cluster_message m = {.kind = CLUSTER_PREDICT, .instance = "a", .incarnation = 7, .seq = 3,
                         .pool = "main.v2", .worker = 15, .lesson = true, .hashes = hashes,
                         .n_hashes = 300};
    cr_assert_eq(km_cluster_encode(&t, &m, KM_CLUSTER_MESSAGE_MAX), KM_OK);
    cluster_message d;
    km_cluster_refusal r;
    char why[160];
    cr_assert(km_cluster_decode("predict.a", t.data, t.length, WORKERS, &d, &r, why, sizeof why),
              "%s", why);
    cr_assert_eq(d.kind, CLUSTER_PREDICT);
    cr_assert_eq(d.seq, 3);
    cr_assert_str_eq(d.pool, "main.v2");
    cr_assert_eq(d.worker, 15);
    cr_assert(d.lesson);
    cr_assert_eq(d.n_hashes, 300);
    cr_assert_arr_eq(d.hashes, hashes, sizeof hashes);
    km_cluster_message_free(&d);

#define P(rest)                                                                            \
    "{\"v\":1,\"kind\":\"predict\",\"instance\":\"a\",\"incarnation\":1,\"seq\":1," rest "}"
#define H1 "\"hashes\":[\"0000000000000001\"]"
    struct {
        const char *subject, *body;
        km_cluster_refusal want;
    } bad[] = {
        {"predict.a", P("\"pool\":\"p\",\"worker\":16,\"lesson\":false," H1),
         KM_CLUSTER_REFUSED_WORKER},
        {"predict.a", P("\"pool\":\"p q\",\"worker\":1,\"lesson\":false," H1),
         KM_CLUSTER_REFUSED_MALFORMED},
        {"predict.a", P("\"worker\":1,\"lesson\":false,\"hashes\":[\"0000000000000001\"]"),
         KM_CLUSTER_REFUSED_MALFORMED},
        {"predict.a", P("\"pool\":\"p\",\"worker\":1,\"hashes\":[\"0000000000000001\"]"),
         KM_CLUSTER_REFUSED_MALFORMED},
        {"predict.a", P("\"pool\":\"p\",\"worker\":1,\"lesson\":false,\"hashes\":[]"),
         KM_CLUSTER_REFUSED_MALFORMED},
        {"predict.a", P("\"pool\":\"p\",\"worker\":1,\"lesson\":false,\"hashes\":[1]"),
         KM_CLUSTER_REFUSED_MALFORMED},
        {"predict.a", P("\"pool\":\"p\",\"worker\":1,\"lesson\":false,"
                        "\"hashes\":[\"000000000000000g\"]"),
         KM_CLUSTER_REFUSED_MALFORMED},
        {"predict.a", P("\"pool\":\"p\",\"worker\":1,\"lesson\":false,"
                        "\"hashes\":[\"00000000000000001\"]"),
         KM_CLUSTER_REFUSED_MALFORMED},
        {"predict.b", P("\"pool\":\"p\",\"worker\":1,\"lesson\":false," H1),
         KM_CLUSTER_REFUSED_SUBJECT},
    };
#undef P
#undef H1
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        bool ok = km_cluster_decode(bad[i].subject, bad[i].body, strlen(bad[i].body), WORKERS, &d,
                                    &r, why, sizeof why);
        cr_assert(!ok, "case %zu accepted", i);
        cr_assert_eq(r, bad[i].want, "case %zu: refused as %s (%s), expected %s", i,
                     km_cluster_refusal_name(r), why, km_cluster_refusal_name(bad[i].want));
    }
    /* More hashes than a prediction may carry: refused as too large. */
    km_text big;
    km_text_init(&big, 0);
    km_text_append_cstr(&big, "{\"v\":1,\"kind\":\"predict\",\"instance\":\"a\",\"incarnation\":1,"
                              "\"seq\":1,\"pool\":\"p\",\"worker\":1,\"lesson\":false,\"hashes\":[");
    for (uint32_t i = 0; i <= KM_CLUSTER_PREDICTION_MAX_HASHES; i++)
        km_text_printf(&big, "%s\"%016x\"", i ? "," : "", i);
    km_text_append_cstr(&big, "]}");
    cr_assert(!km_cluster_decode("predict.a", big.data, big.length, WORKERS, &d, &r, why,
                                 sizeof why));
    cr_assert_eq(r, KM_CLUSTER_REFUSED_TOO_LARGE, "%s", why);
    km_text_free(&big);
    km_text_free(&t);
}

/* ---- through a real nats-server -------------------------------------------------------------- */

Test(cluster, two_instances_converge_on_each_others_load, .init = start_server,
     .fini = stop_server, .timeout = 60)
{
    km_cluster *a = instance("a", server.url, 2000, 0);
    km_cluster *b = instance("b", server.url, 2000, 0);
    /* Random changes on both; each side's remote view must end equal to the other's last values
     * (the oracle: what each published last). */
    km_rng rng;
    km_rng_init(&rng, km_test_seed());
    km_active_load last_a[WORKERS] = {{0}}, last_b[WORKERS] = {{0}};
    for (int i = 0; i < 400; i++) {
        uint32_t w = km_rng_below(&rng, WORKERS);
        km_active_load l = {km_rng_below(&rng, 50), 0, km_rng_below(&rng, 5000),
                            km_rng_below(&rng, 300), 0, km_rng_below(&rng, 1000000)};
        l.prefilling = l.in_flight ? km_rng_below(&rng, (uint32_t)l.in_flight + 1) : 0;
        l.allocated_blocks = l.active_decode_blocks;
        if (km_rng_below(&rng, 2)) {
            cr_assert_eq(km_cluster_publish_load(a, w, &l), KM_OK);
            last_a[w] = l;
        } else {
            cr_assert_eq(km_cluster_publish_load(b, w, &l), KM_OK);
            last_b[w] = l;
        }
    }
    bool equal = false;
    for (int t = 0; t < 400 && !equal; t++) {
        equal = true;
        for (uint32_t w = 0; w < WORKERS; w++)
            equal = equal && load_eq(remote(b, w), last_a[w]) && load_eq(remote(a, w), last_b[w]);
        if (!equal)
            km_test_sleep_ms(5);
    }
    cr_assert(equal, "the two views did not converge within 2 s");
    km_cluster_view v;
    cr_assert_eq(km_cluster_get_view(b, mono_ns(), &v), KM_OK);
    cr_assert_str_eq(v.scope, "cluster");
    cr_assert_eq(v.instances, 1);
    cr_assert_eq(v.n_stale, 0);
    cr_assert(v.oldest_age_ms >= 0 && v.oldest_age_ms < 2000, "age %f", v.oldest_age_ms);
    cr_assert_eq(stats(b).lost_messages, 0);
    cr_assert_eq(stats(a).lost_messages, 0);
    km_cluster_destroy(a);
    km_cluster_destroy(b);
}

/* A raw NATS client that speaks for a made-up instance. */
static natsConnection *raw_connect(void)
{
    natsConnection *nc = NULL;
    natsStatus s = natsConnection_ConnectTo(&nc, server.url);
    cr_assert_eq(s, NATS_OK, "raw connect: %s", natsStatus_GetText(s));
    return nc;
}

static void raw_publish(natsConnection *nc, const char *subject, const char *body)
{
    char full[256];
    snprintf(full, sizeof full, "kvmatch.cluster.%s", subject);
    cr_assert_eq(natsConnection_PublishString(nc, full, body), NATS_OK);
    cr_assert_eq(natsConnection_FlushTimeout(nc, 2000), NATS_OK);
}

static void raw_load(natsConnection *nc, const char *kind, uint64_t incarnation, uint64_t seq,
                     uint32_t worker, uint64_t in_flight)
{
    char subject[64], body[512];
    snprintf(subject, sizeof subject, "%s.x", kind);
    snprintf(body, sizeof body,
             "{\"v\":1,\"kind\":\"%s\",\"instance\":\"x\",\"incarnation\":%llu,\"seq\":%llu,"
             "\"workers\":[[%u,%llu,0,0,0,0,0]]%s}",
             kind, (unsigned long long)incarnation, (unsigned long long)seq, worker,
             (unsigned long long)in_flight, strcmp(kind, "state") ? "" : ",\"peers\":[]");
    raw_publish(nc, subject, body);
}

Test(cluster, a_lost_message_is_counted_and_marks_its_instance_stale_until_a_full_state,
     .init = start_server, .fini = stop_server, .timeout = 60)
{
    km_cluster *b = instance("b", server.url, 10000, 0);
    natsConnection *nc = raw_connect();
    raw_load(nc, "state", 5, 1, 2, 7);
    raw_load(nc, "change", 5, 2, 2, 8);
    WAIT_UNTIL(remote(b, 2).in_flight == 8, 2000);
    cr_assert_eq(remote(b, 2).in_flight, 8);
    km_cluster_view v;
    km_cluster_get_view(b, mono_ns(), &v);
    cr_assert_eq(v.n_stale, 0);
    raw_load(nc, "change", 5, 5, 3, 4); /* seq 3 and 4 never arrive */
    WAIT_UNTIL(stats(b).lost_messages == 2, 2000);
    cr_assert_eq(stats(b).lost_messages, 2);
    km_cluster_get_view(b, mono_ns(), &v);
    cr_assert_eq(v.n_stale, 1, "the instance with a gap is stale");
    cr_assert_str_eq(v.stale[0], "x");
    cr_assert_eq(remote(b, 3).in_flight, 4, "the change after the gap still applies");
    raw_load(nc, "state", 5, 6, 3, 1); /* a full state replaces everything */
    WAIT_UNTIL(remote(b, 2).in_flight == 0, 2000);
    cr_assert_eq(remote(b, 2).in_flight, 0, "worker 2 is absent from the full state: 0");
    cr_assert_eq(remote(b, 3).in_flight, 1);
    km_cluster_get_view(b, mono_ns(), &v);
    cr_assert_eq(v.n_stale, 0);
    cr_assert_eq(stats(b).lost_messages, 2);
    natsConnection_Destroy(nc);
    km_cluster_destroy(b);
}

Test(cluster, every_injected_loss_between_two_instances_is_detected,
     .init = start_server, .fini = stop_server, .timeout = 60)
{
    km_cluster *a = instance("a", server.url, 2000, 4);
    km_cluster *b = instance("b", server.url, 2000, 0);
    for (uint32_t i = 1; i <= 40; i++) {
        km_active_load l = {i, 0, 0, 0, 0, 0};
        km_cluster_publish_load(a, i % WORKERS, &l);
    }
    /* 10 of the 40 changes were never sent; the next heartbeat state shows every gap. */
    WAIT_UNTIL(stats(b).lost_messages == 10 && remote(b, 40 % WORKERS).in_flight == 40, 3000);
    cr_assert_eq(stats(a).publish_failures, 10);
    cr_assert_eq(stats(b).lost_messages, 10, "lost %llu of 10",
                 (unsigned long long)stats(b).lost_messages);
    for (uint32_t w = 0; w < WORKERS; w++) {
        uint64_t want = 0;
        for (uint32_t i = 1; i <= 40; i++)
            if (i % WORKERS == w)
                want = i;
        cr_assert_eq(remote(b, w).in_flight, want, "worker %u after the full state", w);
    }
    km_cluster_destroy(a);
    km_cluster_destroy(b);
}

/* The propagation accessors: a peer has applied everything sent once its applied sequence number
 * (of the sender's incarnation) reaches the sender's sent one; an injected drop is not "sent", and
 * the drop rate can be changed on a running handle. */
Test(cluster, applied_sequence_numbers_reach_the_senders_and_drops_are_not_sent,
     .init = start_server, .fini = stop_server, .timeout = 60)
{
    km_cluster *a = instance("a", server.url, 5000, 0);
    km_cluster *b = instance("b", server.url, 5000, 0);
    uint64_t inc = 0, seq = 0, ainc = 0, aseq = 0;
    cr_assert_eq(km_cluster_get_applied(b, "nobody", &ainc, &aseq), KM_ERR_NOT_FOUND);
    cr_assert_eq(km_cluster_get_sent(NULL, &inc, &seq), KM_ERR_NULL_POINTER);
    cr_assert_eq(km_cluster_set_drop_one_in(NULL, 1), KM_ERR_NULL_POINTER);
    for (uint32_t i = 1; i <= 10; i++) {
        km_active_load l = {i, 0, 0, 0, 0, 0};
        km_cluster_publish_load(a, 1, &l);
        cr_assert_eq(km_cluster_get_sent(a, &inc, &seq), KM_OK);
        WAIT_UNTIL(km_cluster_get_applied(b, "a", &ainc, &aseq) == KM_OK && ainc == inc &&
                       aseq >= seq, 2000);
        cr_assert_eq(ainc, inc, "b holds a's incarnation");
        cr_assert_geq(aseq, seq, "b applied a's seq %llu (sent %llu)", (unsigned long long)aseq,
                      (unsigned long long)seq);
        /* Everything up to the sent seq is applied: the last change is in b's view. */
        cr_assert_eq(remote(b, 1).in_flight, i);
    }
    /* Every change dropped from now on: the sent seq stays (a heartbeat may still send a state,
     * which carries the value: then it is sent). */
    cr_assert_eq(km_cluster_set_drop_one_in(a, 1), KM_OK);
    uint64_t failures = stats(a).publish_failures;
    km_active_load l = {99, 0, 0, 0, 0, 0};
    km_cluster_publish_load(a, 2, &l);
    cr_assert_eq(stats(a).publish_failures, failures + 1, "the change was dropped");
    cr_assert_eq(km_cluster_set_drop_one_in(a, 0), KM_OK);
    l.in_flight = 100;
    km_cluster_publish_load(a, 2, &l);
    cr_assert_eq(km_cluster_get_sent(a, &inc, &seq), KM_OK);
    WAIT_UNTIL(km_cluster_get_applied(b, "a", &ainc, &aseq) == KM_OK && aseq >= seq, 2000);
    cr_assert_geq(aseq, seq);
    cr_assert_eq(remote(b, 2).in_flight, 100);
    cr_assert_geq(stats(b).lost_messages, 1, "the dropped change shows as a gap");
    km_cluster_destroy(a);
    km_cluster_destroy(b);
}

Test(cluster, a_crashed_instance_contribution_expires, .init = start_server, .fini = stop_server,
     .timeout = 60)
{
    /* The crashing instance is a child process killed with SIGKILL: no goodbye, no flush. It is
     * forked before this process starts the NATS client's threads. */
    int parent = getpid();
    pid_t child = fork();
    cr_assert(child >= 0);
    if (child == 0) {
        km_test_die_with_parent(parent);
        km_cluster *a = instance("a", server.url, 500, 0);
        km_active_load l = {5, 1, 100, 9, 9, 4000};
        km_cluster_publish_load(a, 1, &l);
        for (;;)
            pause();
    }
    km_cluster *b = instance("b", server.url, 500, 0);
    WAIT_UNTIL(remote(b, 1).in_flight == 5, 5000);
    cr_assert_eq(remote(b, 1).in_flight, 5, "the child's load never arrived");
    kill(child, SIGKILL);
    waitpid(child, NULL, 0);
    uint64_t killed = mono_ns();
    WAIT_UNTIL(remote(b, 1).in_flight == 0, 3000);
    double after_ms = (double)(mono_ns() - killed) / 1e6;
    cr_assert_eq(remote(b, 1).in_flight, 0, "the crashed instance's load is still counted");
    cr_assert_eq(stats(b).expired_instances, 1);
    cr_assert(after_ms < 2000, "expired after %.0f ms (expire_ms 500)", after_ms);
    km_cluster_view v;
    km_cluster_get_view(b, mono_ns(), &v);
    cr_assert_eq(v.instances, 0);
    km_cluster_destroy(b);
}

Test(cluster, nats_down_at_start_and_mid_run_keeps_the_local_view_and_catches_up,
     .init = start_server, .fini = stop_server, .timeout = 60)
{
    km_cluster *a = instance("a", server.url, 400, 0);
    km_cluster *b = instance("b", server.url, 400, 0);
    km_active_load one = {1, 0, 0, 0, 0, 0}, three = {3, 0, 0, 0, 0, 0};
    km_cluster_publish_load(a, 0, &one);
    WAIT_UNTIL(remote(b, 0).in_flight == 1, 2000);
    cr_assert_eq(remote(b, 0).in_flight, 1);

    km_nats_test_server_stop(&server); /* mid-run */
    WAIT_UNTIL(!stats(b).connected && stats(b).instances == 0, 3000);
    cr_assert(!stats(b).connected);
    km_cluster_view v;
    km_cluster_get_view(b, mono_ns(), &v);
    cr_assert_str_eq(v.scope, "this_instance", "NATS gone, contributions expired: local view");
    cr_assert_eq(remote(b, 0).in_flight, 0);
    cr_assert_eq(km_cluster_publish_load(a, 0, &three), KM_OK, "publishing never fails");
    cr_assert_geq(stats(a).skipped_disconnected, 1);

    /* Down at start: create succeeds at once and routes on its own view. */
    char url[64];
    snprintf(url, sizeof url, "%s", server.url);
    uint64_t t0 = mono_ns();
    km_cluster *c = instance("c", url, 400, 0);
    cr_assert((mono_ns() - t0) / 1000000 < 1500, "create waited for an absent NATS");
    km_cluster_get_view(c, mono_ns(), &v);
    cr_assert_str_eq(v.scope, "this_instance");

    char why[256];
    cr_assert(km_nats_test_server_restart(&server, why, sizeof why), "%s", why);
    WAIT_UNTIL(remote(b, 0).in_flight == 3 && remote(c, 0).in_flight == 3, 5000);
    cr_assert_eq(remote(b, 0).in_flight, 3, "b did not catch up with a's change made while down");
    cr_assert_eq(remote(c, 0).in_flight, 3, "c (down at its start) did not catch up");
    km_cluster_get_view(b, mono_ns(), &v);
    cr_assert_str_eq(v.scope, "cluster");
    cr_assert_geq(stats(b).reconnects, 1);
    km_cluster_destroy(c);
    km_cluster_destroy(a);
    km_cluster_destroy(b);
}

Test(cluster, a_new_or_restarted_instance_has_the_running_work_when_create_returns,
     .init = start_server, .fini = stop_server, .timeout = 60)
{
    km_cluster *a = instance("a", server.url, 2000, 0);
    km_cluster *b = instance("b", server.url, 2000, 0);
    km_active_load la = {4, 2, 300, 20, 18, 52000}, lb = {2, 0, 0, 7, 7, 0};
    km_cluster_publish_load(a, 5, &la);
    km_cluster_publish_load(b, 6, &lb);
    WAIT_UNTIL(remote(a, 6).in_flight == 2 && remote(b, 5).in_flight == 4, 2000);
    cr_assert_eq(remote(a, 6).in_flight, 2);

    km_cluster *c = instance("c", server.url, 2000, 0);
    /* No waiting: create returned after the sync. */
    cr_assert(load_eq(remote(c, 5), la), "c misses a's running work");
    cr_assert(load_eq(remote(c, 6), lb), "c misses b's running work");
    km_cluster_stats st = stats(c);
    cr_assert(st.synced);
    cr_assert_eq(st.sync_peers, 2);
    cr_assert(st.sync_seconds >= 0 && st.sync_seconds < 2.0, "sync took %f s", st.sync_seconds);

    /* b restarts under the same id: the new b sees a's work at once, and a replaces b's old
     * contribution with the new incarnation's (which holds nothing yet). */
    km_cluster_destroy(b);
    b = instance("b", server.url, 2000, 0);
    cr_assert(load_eq(remote(b, 5), la), "restarted b misses a's running work");
    WAIT_UNTIL(remote(a, 6).in_flight == 0, 2000);
    cr_assert_eq(remote(a, 6).in_flight, 0);
    cr_assert_geq(stats(a).restarted_instances, 1);
    km_cluster_destroy(c);
    km_cluster_destroy(a);
    km_cluster_destroy(b);
}

Test(cluster, bad_and_foreign_messages_are_refused_counted_and_harmless, .init = start_server,
     .fini = stop_server, .timeout = 60)
{
    km_cluster *a = instance("a", server.url, 10000, 0);
    natsConnection *nc = raw_connect();
    raw_load(nc, "state", 9, 1, 4, 6);
    WAIT_UNTIL(remote(a, 4).in_flight == 6, 2000);
    cr_assert_eq(remote(a, 4).in_flight, 6);
    raw_publish(nc, "state.x", "garbage");
    raw_publish(nc, "state.x", "{\"v\":3,\"kind\":\"state\",\"instance\":\"x\",\"incarnation\":9,"
                               "\"seq\":2,\"workers\":[[4,99,0,0,0,0,0]],\"peers\":[]}");
    raw_publish(nc, "change.y", "{\"v\":1,\"kind\":\"change\",\"instance\":\"x\",\"incarnation\":9,"
                                "\"seq\":2,\"workers\":[[4,99,0,0,0,0,0]]}");
    raw_publish(nc, "change.x", "{\"v\":1,\"kind\":\"change\",\"instance\":\"x\",\"incarnation\":9,"
                                "\"seq\":2,\"workers\":[[9999,99,0,0,0,0,0]]}");
    raw_publish(nc, "change.a", "{\"v\":1,\"kind\":\"change\",\"instance\":\"a\",\"incarnation\":9,"
                                "\"seq\":1,\"workers\":[[4,99,0,0,0,0,0]]}");
    raw_load(nc, "change", 9, 1, 4, 99); /* a duplicate sequence number */
    raw_load(nc, "change", 8, 2, 4, 99); /* an older incarnation */
    /* A well-formed change of x's on a subject no kind has. */
    raw_publish(nc, "elsewhere", "{\"v\":1,\"kind\":\"change\",\"instance\":\"x\","
                                 "\"incarnation\":9,\"seq\":2,\"workers\":[[4,99,0,0,0,0,0]]}");
    km_cluster_stats st;
    /* Messages of one publisher arrive in order: the last one counted means all were seen. */
    WAIT_UNTIL((st = stats(a)).refused[KM_CLUSTER_REFUSED_SUBJECT] == 2, 2000);
    cr_assert_eq(st.refused[KM_CLUSTER_REFUSED_MALFORMED], 1, "the garbage");
    cr_assert_eq(st.refused[KM_CLUSTER_REFUSED_VERSION], 1);
    cr_assert_eq(st.refused[KM_CLUSTER_REFUSED_SUBJECT], 2, "change.y and the unknown subject");
    cr_assert_eq(st.refused[KM_CLUSTER_REFUSED_WORKER], 1);
    cr_assert_eq(st.refused[KM_CLUSTER_REFUSED_OWN_ID], 1);
    cr_assert_eq(st.refused[KM_CLUSTER_REFUSED_DUPLICATE], 1);
    cr_assert_eq(st.refused[KM_CLUSTER_REFUSED_OLD_INCARNATION], 1);
    cr_assert_neq(st.last_refusal[0], '\0');
    cr_assert_eq(remote(a, 4).in_flight, 6, "a refused message changed the view");
    cr_assert_eq(st.lost_messages, 0);
    /* and the handle keeps applying good messages */
    raw_load(nc, "change", 9, 2, 4, 7);
    WAIT_UNTIL(remote(a, 4).in_flight == 7, 2000);
    cr_assert_eq(remote(a, 4).in_flight, 7);
    natsConnection_Destroy(nc);
    km_cluster_destroy(a);
}

/* What an on_prediction observer was handed, copied (the test's oracle). */
typedef struct predictions_seen {
    pthread_mutex_t lock;
    uint32_t n;
    char instance[4][KM_CLUSTER_INSTANCE_MAX + 1];
    char pool[4][KM_CLUSTER_POOL_MAX + 1];
    uint32_t worker[4];
    bool lesson[4];
    uint32_t n_hashes[4];
    uint64_t first[4], last[4];
} predictions_seen;

static void prediction_seen(void *user, const km_cluster_prediction *p)
{
    predictions_seen *seen = user;
    pthread_mutex_lock(&seen->lock);
    if (seen->n < 4) {
        uint32_t i = seen->n;
        snprintf(seen->instance[i], sizeof seen->instance[i], "%s", p->instance);
        snprintf(seen->pool[i], sizeof seen->pool[i], "%s", p->pool);
        seen->worker[i] = p->worker;
        seen->lesson[i] = p->lesson;
        seen->n_hashes[i] = p->n_hashes;
        seen->first[i] = p->hashes[0];
        seen->last[i] = p->hashes[p->n_hashes - 1];
    }
    seen->n++;
    pthread_mutex_unlock(&seen->lock);
}

static uint32_t predictions_count(predictions_seen *seen)
{
    pthread_mutex_lock(&seen->lock);
    uint32_t n = seen->n;
    pthread_mutex_unlock(&seen->lock);
    return n;
}

/* The config of an instance whose on_prediction records into *seen (50 ms heartbeat). */
static km_cluster_config seeing_config(const char *id, predictions_seen *seen)
{
    km_cluster_config cfg;
    km_cluster_config_init(&cfg);
    cfg.url = server.url;
    cfg.instance = id;
    cfg.max_workers = WORKERS;
    cfg.heartbeat_ms = 50;
    cfg.expire_ms = 10000;
    cfg.on_prediction = prediction_seen;
    cfg.on_prediction_user = seen;
    return cfg;
}

static km_cluster *instance_seeing(const char *id, predictions_seen *seen)
{
    km_cluster_config cfg = seeing_config(id, seen);
    km_cluster *c = NULL;
    char why[256] = "";
    cr_assert_eq(km_cluster_create(&cfg, &c, why, sizeof why), KM_OK, "%s", why);
    return c;
}

Test(cluster, predictions_reach_the_peers_in_order_and_bad_ones_are_refused,
     .init = start_server, .fini = stop_server, .timeout = 60)
{
    static predictions_seen seen = {.lock = PTHREAD_MUTEX_INITIALIZER};
    km_cluster *a = instance("a", server.url, 10000, 0);
    km_cluster *b = instance_seeing("b", &seen);

    static uint64_t hashes[KM_CLUSTER_PREDICTION_MAX_HASHES + 10];
    for (uint32_t i = 0; i < KM_CLUSTER_PREDICTION_MAX_HASHES + 10; i++)
        hashes[i] = UINT64_C(0xfedcba9876543210) + i;
    km_active_load l = {1, 0, 0, 0, 0, 0};
    cr_assert_eq(km_cluster_publish_prediction(a, "main", 3, false, hashes, 5), KM_OK);
    cr_assert_eq(km_cluster_publish_load(a, 3, &l), KM_OK); /* one sequence over both kinds */
    cr_assert_eq(km_cluster_publish_prediction(a, "main", 7, true, hashes + 1, 2), KM_OK);
    /* A longer prompt's prediction carries its leading blocks only. */
    cr_assert_eq(km_cluster_publish_prediction(a, "other", 0, false, hashes,
                                               KM_CLUSTER_PREDICTION_MAX_HASHES + 10), KM_OK);
    cr_assert_eq(km_cluster_publish_prediction(a, "main", WORKERS, false, hashes, 1),
                 KM_ERR_WORKER_RANGE);
    cr_assert_eq(km_cluster_publish_prediction(a, "no pool", 0, false, hashes, 1),
                 KM_ERR_INVALID_ARGUMENT);
    WAIT_UNTIL(predictions_count(&seen) == 3, 3000);
    cr_assert_eq(predictions_count(&seen), 3);
    cr_assert_str_eq(seen.instance[0], "a");
    cr_assert_str_eq(seen.pool[0], "main");
    cr_assert_eq(seen.worker[0], 3);
    cr_assert(!seen.lesson[0]);
    cr_assert_eq(seen.n_hashes[0], 5);
    cr_assert_eq(seen.first[0], hashes[0]);
    cr_assert_eq(seen.last[0], hashes[4]);
    cr_assert_eq(seen.worker[1], 7);
    cr_assert(seen.lesson[1]);
    cr_assert_eq(seen.n_hashes[1], 2);
    cr_assert_eq(seen.first[1], hashes[1]);
    cr_assert_str_eq(seen.pool[2], "other");
    cr_assert_eq(seen.n_hashes[2], KM_CLUSTER_PREDICTION_MAX_HASHES);
    cr_assert_eq(seen.last[2], hashes[KM_CLUSTER_PREDICTION_MAX_HASHES - 1]);
    WAIT_UNTIL(remote(b, 3).in_flight == 1, 2000);
    cr_assert_eq(remote(b, 3).in_flight, 1);
    cr_assert_eq(stats(b).lost_messages, 0, "predictions and loads share one sequence");
    cr_assert_eq(stats(a).predictions_sent, 3);
    cr_assert_eq(stats(b).predictions_received, 3);

    /* Malformed and foreign predictions: refused, counted, never handed over. */
    natsConnection *nc = raw_connect();
    raw_publish(nc, "predict.x", "{\"v\":1,\"kind\":\"predict\",\"instance\":\"x\","
                                 "\"incarnation\":1,\"seq\":1,\"pool\":\"main\",\"worker\":1,"
                                 "\"lesson\":false,\"hashes\":[\"not a hash\"]}");
    raw_publish(nc, "predict.y", "{\"v\":1,\"kind\":\"predict\",\"instance\":\"x\","
                                 "\"incarnation\":1,\"seq\":1,\"pool\":\"main\",\"worker\":1,"
                                 "\"lesson\":false,\"hashes\":[\"0000000000000001\"]}");
    raw_publish(nc, "predict.b", "{\"v\":1,\"kind\":\"predict\",\"instance\":\"b\","
                                 "\"incarnation\":1,\"seq\":1,\"pool\":\"main\",\"worker\":1,"
                                 "\"lesson\":false,\"hashes\":[\"0000000000000001\"]}");
    raw_publish(nc, "predict.x", "{\"v\":1,\"kind\":\"predict\",\"instance\":\"x\","
                                 "\"incarnation\":1,\"seq\":1,\"pool\":\"main\",\"worker\":99,"
                                 "\"lesson\":false,\"hashes\":[\"0000000000000001\"]}");
    km_cluster_stats st;
    WAIT_UNTIL((st = stats(b)).refused[KM_CLUSTER_REFUSED_WORKER] == 1, 2000);
    cr_assert_eq(st.refused[KM_CLUSTER_REFUSED_MALFORMED], 1);
    cr_assert_eq(st.refused[KM_CLUSTER_REFUSED_SUBJECT], 1);
    cr_assert_eq(st.refused[KM_CLUSTER_REFUSED_OWN_ID], 1);
    cr_assert_eq(st.refused[KM_CLUSTER_REFUSED_WORKER], 1);
    cr_assert_eq(predictions_count(&seen), 3, "a refused prediction was handed over");
    natsConnection_Destroy(nc);
    km_cluster_destroy(b);
    km_cluster_destroy(a);
}

/* A load value over KM_CLUSTER_LOAD_VALUE_MAX is refused (so the sum over the most instances
 * cannot wrap and make a loaded worker look idle); the largest accepted one is applied whole. */
Test(cluster, a_load_value_past_the_bound_is_refused_and_the_bound_itself_applied,
     .init = start_server, .fini = stop_server, .timeout = 60)
{
    km_cluster *b = instance("b", server.url, 10000, 0);
    natsConnection *nc = raw_connect();
    raw_load(nc, "state", 5, 1, 2, 7);
    WAIT_UNTIL(remote(b, 2).in_flight == 7, 2000);
    char body[256];
    snprintf(body, sizeof body, "{\"v\":1,\"kind\":\"change\",\"instance\":\"x\","
             "\"incarnation\":5,\"seq\":2,\"workers\":[[2,7,0,%llu,0,0,0]]}",
             (unsigned long long)KM_CLUSTER_LOAD_VALUE_MAX + 1);
    raw_publish(nc, "change.x", body);
    WAIT_UNTIL(stats(b).refused[KM_CLUSTER_REFUSED_MALFORMED] == 1, 2000);
    cr_assert_eq(stats(b).refused[KM_CLUSTER_REFUSED_MALFORMED], 1);
    cr_assert(strstr(stats(b).last_refusal, "over 2^48"), "%s", stats(b).last_refusal);
    cr_assert_eq(remote(b, 2).pending_prefill_tokens, 0, "the refused value was applied");
    snprintf(body, sizeof body, "{\"v\":1,\"kind\":\"change\",\"instance\":\"x\","
             "\"incarnation\":5,\"seq\":2,\"workers\":[[2,7,0,%llu,0,0,0]]}",
             (unsigned long long)KM_CLUSTER_LOAD_VALUE_MAX);
    raw_publish(nc, "change.x", body);
    WAIT_UNTIL(remote(b, 2).pending_prefill_tokens == KM_CLUSTER_LOAD_VALUE_MAX, 2000);
    cr_assert_eq(remote(b, 2).pending_prefill_tokens, KM_CLUSTER_LOAD_VALUE_MAX);
    natsConnection_Destroy(nc);
    km_cluster_destroy(b);
}

/* Log lines that contain one of `needles` (up to 2), counted; `secret`, when set, is a text that no
 * line may hold (secret_seen says whether one did). */
typedef struct counted_lines {
    pthread_mutex_t lock;
    const char *needles[2];
    const char *secret;
    uint32_t n;
    bool secret_seen;
} counted_lines;

static void count_lines(void *user, const char *line)
{
    counted_lines *r = user;
    pthread_mutex_lock(&r->lock);
    if (r->secret && strstr(line, r->secret))
        r->secret_seen = true;
    for (int i = 0; i < 2; i++)
        if (r->needles[i] && strstr(line, r->needles[i])) {
            r->n++;
            break;
        }
    pthread_mutex_unlock(&r->lock);
}

static uint32_t counted_lines_count(counted_lines *r)
{
    pthread_mutex_lock(&r->lock);
    uint32_t n = r->n;
    pthread_mutex_unlock(&r->lock);
    return n;
}

/* A process that keeps sending what is refused (here: under this instance's own id) has every
 * message counted but costs one log line per reason and interval, not one per message. */
Test(cluster, refusals_are_all_counted_and_logged_once_per_reason_and_interval,
     .init = start_server, .fini = stop_server, .timeout = 60)
{
    static counted_lines lines = {.lock = PTHREAD_MUTEX_INITIALIZER,
                                  .needles = {"refused a message"}};
    km_cluster_config cfg;
    km_cluster_config_init(&cfg);
    cfg.url = server.url;
    cfg.instance = "a";
    cfg.max_workers = WORKERS;
    cfg.heartbeat_ms = 50;
    cfg.log = count_lines;
    cfg.log_user = &lines;
    km_cluster *a = NULL;
    char why[256] = "";
    cr_assert_eq(km_cluster_create(&cfg, &a, why, sizeof why), KM_OK, "%s", why);
    natsConnection *nc = raw_connect();
    char body[256];
    for (int i = 1; i <= 40; i++) {
        snprintf(body, sizeof body, "{\"v\":1,\"kind\":\"change\",\"instance\":\"a\","
                 "\"incarnation\":7,\"seq\":%d,\"workers\":[[1,1,0,0,0,0,0]]}", i);
        raw_publish(nc, "change.a", body);
    }
    raw_publish(nc, "state.x", "garbage");
    km_cluster_stats st;
    WAIT_UNTIL((st = stats(a)).refused[KM_CLUSTER_REFUSED_MALFORMED] == 1, 2000);
    cr_assert_eq(st.refused[KM_CLUSTER_REFUSED_OWN_ID], 40, "every refusal is counted");
    cr_assert_eq(st.refused[KM_CLUSTER_REFUSED_MALFORMED], 1);
    cr_assert_eq(counted_lines_count(&lines), 2, "one line per reason: %u",
                 counted_lines_count(&lines));
    cr_assert_eq(remote(a, 1).in_flight, 0, "a refused message changed the view");
    natsConnection_Destroy(nc);
    km_cluster_destroy(a);
}

/* Log lines that contain "refused a message", kept whole (the first 4). */
typedef struct refusal_texts {
    pthread_mutex_t lock;
    uint32_t n;
    char line[4][512];
} refusal_texts;

static void keep_refusal_lines(void *user, const char *line)
{
    refusal_texts *r = user;
    if (!strstr(line, "refused a message"))
        return;
    pthread_mutex_lock(&r->lock);
    if (r->n < 4)
        snprintf(r->line[r->n], sizeof r->line[r->n], "%s", line);
    r->n++;
    pthread_mutex_unlock(&r->lock);
}

/* Whatever bytes a message carries, the reason it was refused is printable UTF-8 in the log and
 * in the stats (/status puts it in a JSON string, which must be UTF-8): a control character
 * (a newline would forge a log line of its own) or a character cut in two at a length bound
 * does not reach them. */
Test(cluster, a_refusal_reason_is_printable_utf8_whatever_the_message_carries,
     .init = start_server, .fini = stop_server, .timeout = 60)
{
    static refusal_texts lines = {.lock = PTHREAD_MUTEX_INITIALIZER};
    km_cluster_config cfg;
    km_cluster_config_init(&cfg);
    cfg.url = server.url;
    cfg.instance = "a";
    cfg.max_workers = WORKERS;
    cfg.heartbeat_ms = 50;
    cfg.log = keep_refusal_lines;
    cfg.log_user = &lines;
    km_cluster *a = NULL;
    char why[256] = "";
    cr_assert_eq(km_cluster_create(&cfg, &a, why, sizeof why), KM_OK, "%s", why);
    natsConnection *nc = raw_connect();
    /* A kind holding a newline and a forged log line (logged: the first malformed one). */
    raw_publish(nc, "change.x", "{\"v\":1,\"kind\":\"x\\n2030-01-01 error serve: forged\","
                                "\"instance\":\"x\",\"incarnation\":1,\"seq\":1,\"workers\":[]}");
    km_cluster_stats st;
    WAIT_UNTIL((st = stats(a)).refused[KM_CLUSTER_REFUSED_MALFORMED] == 1, 2000);
    cr_assert_eq(st.refused[KM_CLUSTER_REFUSED_MALFORMED], 1);
    cr_assert(km_utf8_name(st.last_refusal), "last_refusal: \"%s\"", st.last_refusal);
    pthread_mutex_lock(&lines.lock);
    cr_assert_eq(lines.n, 1);
    cr_assert(km_utf8_name(lines.line[0]), "logged: \"%s\"", lines.line[0]);
    pthread_mutex_unlock(&lines.lock);
    /* A kind whose 40th and 41st bytes are one character: the reason quotes 40 bytes of it. */
    raw_publish(nc, "change.x", "{\"v\":1,\"kind\":\"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\xc3\xa9\","
                                "\"instance\":\"x\",\"incarnation\":1,\"seq\":1,\"workers\":[]}");
    WAIT_UNTIL((st = stats(a)).refused[KM_CLUSTER_REFUSED_MALFORMED] == 2, 2000);
    cr_assert_eq(st.refused[KM_CLUSTER_REFUSED_MALFORMED], 2);
    cr_assert(km_utf8_name(st.last_refusal), "last_refusal: \"%s\"", st.last_refusal);
    /* A subject of bytes no text has: the reason quotes the subject. */
    raw_publish(nc, "change.\x1b[2J\xff", "{\"v\":1,\"kind\":\"change\",\"instance\":\"x\","
                                        "\"incarnation\":1,\"seq\":1,\"workers\":[]}");
    WAIT_UNTIL((st = stats(a)).refused[KM_CLUSTER_REFUSED_SUBJECT] == 1, 2000);
    cr_assert_eq(st.refused[KM_CLUSTER_REFUSED_SUBJECT], 1);
    cr_assert(km_utf8_name(st.last_refusal), "last_refusal: \"%s\"", st.last_refusal);
    natsConnection_Destroy(nc);
    km_cluster_destroy(a);
}

/* A state too large for one message (more non-zero workers than fit in KM_CLUSTER_MESSAGE_MAX)
 * is not sent, says so once, and gives its sequence number back: the peers count no message lost
 * while each worker's change still reaches them. */
Test(cluster, a_state_too_large_to_send_is_logged_once_and_costs_no_sequence_number,
     .init = start_server, .fini = stop_server, .timeout = 60)
{
    static counted_lines lines = {.lock = PTHREAD_MUTEX_INITIALIZER,
                                  .needles = {"bytes without its work: not sent"}};
    const uint32_t W = 12000; /* rows of about 100 bytes: over 1 MiB together */
    km_cluster_config cfg;
    km_cluster_config_init(&cfg);
    cfg.url = server.url;
    cfg.max_workers = W;
    cfg.heartbeat_ms = 50;
    cfg.expire_ms = 10000;
    cfg.instance = "b";
    km_cluster *b = NULL;
    char why[256] = "";
    cr_assert_eq(km_cluster_create(&cfg, &b, why, sizeof why), KM_OK, "%s", why);
    cfg.instance = "a";
    cfg.log = count_lines;
    cfg.log_user = &lines;
    km_cluster *a = NULL;
    cr_assert_eq(km_cluster_create(&cfg, &a, why, sizeof why), KM_OK, "%s", why);
    const uint64_t big = KM_CLUSTER_LOAD_VALUE_MAX - 1;
    km_active_load l = {big, big, big, big, big, big};
    for (uint32_t w = 0; w < W; w++)
        cr_assert_eq(km_cluster_publish_load(a, w, &l), KM_OK);
    WAIT_UNTIL(remote(b, W - 1).in_flight == big, 30000);
    cr_assert_eq(remote(b, W - 1).in_flight, big, "the last worker's change arrived");
    km_test_sleep_ms(300); /* several heartbeats, each a state that does not fit */
    cr_assert_eq(counted_lines_count(&lines), 1, "the oversized state said so once: %u",
                 counted_lines_count(&lines));
    km_cluster_stats sa = stats(a);
    cr_assert_geq(sa.publish_too_large, 2, "states over the limit counted as too large");
    cr_assert_geq(sa.publish_failures, sa.publish_too_large);
    cr_assert_eq(sa.publish_outbox_full, 0);
    /* A change after them: a sequence number spent on a state not sent would show as a gap. */
    km_active_load one = {1, 0, 0, 0, 0, 0};
    cr_assert_eq(km_cluster_publish_load(a, 0, &one), KM_OK);
    WAIT_UNTIL(remote(b, 0).in_flight == 1, 5000);
    cr_assert_eq(remote(b, 0).in_flight, 1);
    cr_assert_eq(stats(b).lost_messages, 0, "a state not sent was counted lost");
    km_cluster_destroy(a);
    km_cluster_destroy(b);
}

/* A prediction from an instance whose full state has not arrived cannot be checked against its
 * pools: refused (no_state), counted, never handed over, and the instance is stale. Once its
 * state is in, its predictions pass; one that follows a gap still passes but marks it stale, as a
 * change after a gap does. */
Test(cluster, a_prediction_before_a_full_state_is_refused_and_one_after_a_gap_marks_stale,
     .init = start_server, .fini = stop_server, .timeout = 60)
{
    static predictions_seen seen = {.lock = PTHREAD_MUTEX_INITIALIZER};
    km_cluster *b = instance_seeing("b", &seen);
    natsConnection *nc = raw_connect();
    const char *predict = "{\"v\":1,\"kind\":\"predict\",\"instance\":\"x\","
                          "\"incarnation\":5,\"seq\":%d,\"pool\":\"main\",\"worker\":1,"
                          "\"lesson\":false,\"hashes\":[\"0000000000000001\"]}";
    char body[256];
    snprintf(body, sizeof body, predict, 1);
    raw_publish(nc, "predict.x", body);
    km_cluster_stats st;
    WAIT_UNTIL((st = stats(b)).refused[KM_CLUSTER_REFUSED_NO_STATE] == 1, 2000);
    cr_assert_eq(st.refused[KM_CLUSTER_REFUSED_NO_STATE], 1);
    cr_assert(strstr(st.last_refusal, "no_state"), "%s", st.last_refusal);
    cr_assert_eq(st.predictions_received, 0);
    cr_assert_eq(st.applied, 0, "a refused prediction counts as applied");
    cr_assert_eq(predictions_count(&seen), 0, "a prediction without its state was handed over");
    km_cluster_view v;
    km_cluster_get_view(b, mono_ns(), &v);
    cr_assert_eq(v.n_stale, 1, "an instance heard from without a full state is stale");

    raw_load(nc, "state", 5, 2, 2, 7);
    WAIT_UNTIL(remote(b, 2).in_flight == 7, 2000);
    km_cluster_get_view(b, mono_ns(), &v);
    cr_assert_eq(v.n_stale, 0, "its full state makes it fresh");
    snprintf(body, sizeof body, predict, 3);
    raw_publish(nc, "predict.x", body);
    WAIT_UNTIL(predictions_count(&seen) == 1, 2000);
    cr_assert_eq(predictions_count(&seen), 1, "a prediction after its state is handed over");
    cr_assert_eq(stats(b).applied, 2, "the state and the prediction");
    km_cluster_get_view(b, mono_ns(), &v);
    cr_assert_eq(v.n_stale, 0);
    snprintf(body, sizeof body, predict, 6); /* seq 4 and 5 never arrive */
    raw_publish(nc, "predict.x", body);
    WAIT_UNTIL(stats(b).lost_messages == 2, 2000);
    cr_assert_eq(stats(b).lost_messages, 2);
    cr_assert_eq(predictions_count(&seen), 2);
    km_cluster_get_view(b, mono_ns(), &v);
    cr_assert_eq(v.n_stale, 1, "a gap before a prediction leaves the instance stale");
    cr_assert_str_eq(v.stale[0], "x");
    cr_assert_eq(stats(b).refused[KM_CLUSTER_REFUSED_NO_STATE], 1);
    natsConnection_Destroy(nc);
    km_cluster_destroy(b);
}

/* Pools given at create are this instance's from its first message: a peer that disagrees on
 * one is left out of it and its predictions for it are refused without a km_cluster_set_pools
 * call, as soon as the create's sync has taken the peer's state; bad pools fail the create. */
Test(cluster, pools_given_at_create_are_compared_from_the_first_state,
     .init = start_server, .fini = stop_server, .timeout = 60)
{
    static predictions_seen seen = {.lock = PTHREAD_MUTEX_INITIALIZER};
    uint32_t main_workers[] = {0, 1};
    km_cluster_pool on_a[] = {{"main", 0x9999, main_workers, 2}};
    km_cluster_pool on_b[] = {{"main", 0x1111, main_workers, 2}};
    km_cluster *a = instance("a", server.url, 10000, 0);
    cr_assert_eq(km_cluster_set_pools(a, on_a, 1), KM_OK);
    km_active_load l = {3, 0, 0, 0, 0, 0};
    cr_assert_eq(km_cluster_publish_load(a, 0, &l), KM_OK);
    km_cluster_config cfg = seeing_config("b", &seen);
    cfg.pools = on_b;
    cfg.n_pools = 1;
    /* a is known only once a message of its arrives: on a loaded machine its answer or heartbeat
     * may take longer than the default quiet wait of 100 ms, after which b would start alone. */
    cfg.sync_quiet_ms = 1500;
    km_cluster *b = NULL;
    char why[256] = "";
    cr_assert_eq(km_cluster_create(&cfg, &b, why, sizeof why), KM_OK, "%s", why);
    km_cluster_stats st = stats(b);
    cr_assert_eq(st.sync_peers, 1, "the create's sync took a's state");
    cr_assert_eq(st.n_mismatched, 1, "a's pool was compared with b's at once");
    cr_assert_eq(remote(b, 0).in_flight, 0, "a's load on the disagreed pool is left out");
    uint64_t h[2] = {1, 2};
    cr_assert_eq(km_cluster_publish_prediction(a, "main", 1, false, h, 2), KM_OK);
    WAIT_UNTIL(stats(b).refused[KM_CLUSTER_REFUSED_WORKER_MISMATCH] == 2, 2000);
    cr_assert_eq(stats(b).refused[KM_CLUSTER_REFUSED_WORKER_MISMATCH], 2,
                 "the disagreement and the prediction");
    cr_assert_eq(predictions_count(&seen), 0,
                 "a prediction for the disagreed pool was handed over");
    km_cluster_destroy(b);

    uint32_t twice[] = {0, 0};
    km_cluster_pool bad[] = {{"main", 0x1111, twice, 2}};
    cfg.instance = "c";
    cfg.pools = bad;
    km_cluster *c = NULL;
    cr_assert_eq(km_cluster_create(&cfg, &c, why, sizeof why), KM_ERR_INVALID_ARGUMENT);
    cr_assert_null(c);
    cr_assert(strstr(why, "pools given at create"), "%s", why);
    km_cluster_destroy(a);
}

Test(cluster, a_peer_whose_workers_differ_has_its_pool_left_out_counted_once,
     .init = start_server, .fini = stop_server, .timeout = 60)
{
    static predictions_seen seen = {.lock = PTHREAD_MUTEX_INITIALIZER};
    km_cluster *a = instance("a", server.url, 10000, 0);
    km_cluster *b = instance_seeing("b", &seen);
    /* Pool "main" is workers 0-1 on both, "side" is 2; a's "main" means other engines. */
    uint32_t main_workers[] = {0, 1}, side_workers[] = {2};
    km_cluster_pool on_b[] = {{"main", 0x1111, main_workers, 2}, {"side", 0x2222, side_workers, 1}};
    km_cluster_pool on_a[] = {{"main", 0x9999, main_workers, 2}, {"side", 0x2222, side_workers, 1}};
    cr_assert_eq(km_cluster_set_pools(b, on_b, 2), KM_OK);
    cr_assert_eq(km_cluster_set_pools(a, on_a, 2), KM_OK);
    km_active_load l = {3, 0, 0, 0, 0, 0};
    cr_assert_eq(km_cluster_publish_load(a, 0, &l), KM_OK);
    cr_assert_eq(km_cluster_publish_load(a, 2, &l), KM_OK);
    cr_assert_eq(km_cluster_publish_load(a, 5, &l), KM_OK); /* in no pool: compared nowhere */
    /* Each side learns of the other's pools from its heartbeats: wait for both. */
    WAIT_UNTIL(remote(b, 2).in_flight == 3 && remote(b, 5).in_flight == 3 &&
                   stats(b).n_mismatched == 1 && stats(a).n_mismatched == 1, 2000);
    cr_assert_eq(remote(b, 2).in_flight, 3, "the pool both agree on is applied");
    cr_assert_eq(remote(b, 5).in_flight, 3);
    cr_assert_eq(remote(b, 0).in_flight, 0, "a's load on main's workers is left out");
    km_cluster_stats st = stats(b);
    cr_assert_eq(st.n_mismatched, 1);
    cr_assert_str_eq(st.mismatched[0].instance, "a");
    cr_assert_str_eq(st.mismatched[0].pool, "main");
    cr_assert_eq(st.mismatched[0].theirs, 0x9999);
    cr_assert_eq(st.mismatched[0].ours, 0x1111);
    cr_assert_eq(stats(a).n_mismatched, 1, "each side sees the disagreement");
    /* Predictions for the pool are refused; for the other pool they go through. */
    uint64_t h[2] = {1, 2};
    cr_assert_eq(km_cluster_publish_prediction(a, "main", 1, false, h, 2), KM_OK);
    cr_assert_eq(km_cluster_publish_prediction(a, "side", 2, false, h, 2), KM_OK);
    WAIT_UNTIL(predictions_count(&seen) == 1, 2000);
    km_test_sleep_ms(200); /* several heartbeats: the disagreement is counted once */
    st = stats(b);
    cr_assert_eq(predictions_count(&seen), 1);
    cr_assert_str_eq(seen.pool[0], "side");
    cr_assert_eq(st.refused[KM_CLUSTER_REFUSED_WORKER_MISMATCH], 2,
                 "the disagreement once and the prediction once: %llu",
                 (unsigned long long)st.refused[KM_CLUSTER_REFUSED_WORKER_MISMATCH]);
    cr_assert_eq(remote(b, 0).in_flight, 0);
    /* a's configuration agrees again: its load on main's workers is applied. */
    on_a[0].fingerprint = 0x1111;
    cr_assert_eq(km_cluster_set_pools(a, on_a, 2), KM_OK);
    WAIT_UNTIL(remote(b, 0).in_flight == 3, 2000);
    cr_assert_eq(remote(b, 0).in_flight, 3);
    cr_assert_eq(stats(b).n_mismatched, 0);
    cr_assert_eq(stats(b).refused[KM_CLUSTER_REFUSED_WORKER_MISMATCH], 2);
    /* and b's own pools changing moves the pool's workers: worker 5 joins main, a disagrees. */
    uint32_t main_more[] = {0, 1, 5};
    km_cluster_pool on_b2[] = {{"main", 0x3333, main_more, 3}, {"side", 0x2222, side_workers, 1}};
    cr_assert_eq(km_cluster_set_pools(b, on_b2, 2), KM_OK);
    cr_assert_eq(remote(b, 5).in_flight, 0, "worker 5 now in the pool a disagrees on");
    cr_assert_eq(remote(b, 0).in_flight, 0);
    cr_assert_eq(remote(b, 2).in_flight, 3);
    cr_assert_eq(stats(b).n_mismatched, 1);
    cr_assert_eq(stats(b).refused[KM_CLUSTER_REFUSED_WORKER_MISMATCH], 3, "a new disagreement");
    /* Bad pool lists are refused whole. */
    uint32_t twice[] = {2};
    km_cluster_pool bad[] = {{"main", 1, main_workers, 2}, {"side", 2, twice, 1},
                             {"x", 3, twice, 1}};
    cr_assert_eq(km_cluster_set_pools(b, bad, 3), KM_ERR_INVALID_ARGUMENT, "worker 2 twice");
    uint32_t far[] = {WORKERS};
    km_cluster_pool out_of_range[] = {{"main", 1, far, 1}};
    cr_assert_eq(km_cluster_set_pools(b, out_of_range, 1), KM_ERR_INVALID_ARGUMENT);
    km_cluster_pool bad_name[] = {{"a pool", 1, main_workers, 2}};
    cr_assert_eq(km_cluster_set_pools(b, bad_name, 1), KM_ERR_INVALID_ARGUMENT);
    cr_assert_eq(remote(b, 2).in_flight, 3, "a refused list changed nothing");
    km_cluster_destroy(b);
    km_cluster_destroy(a);
}

/* A restarted instance (a higher incarnation) is compared afresh: until its new process's full
 * state says otherwise, the pool disagreement of the old process no longer leaves its load out,
 * as for an instance never heard from. */
Test(cluster, a_restarted_instance_is_compared_afresh, .init = start_server, .fini = stop_server,
     .timeout = 30)
{
    uint32_t main_workers[] = {0, 1};
    km_cluster_pool on_b[] = {{"main", 0x1111, main_workers, 2}};
    km_cluster *b = instance("b", server.url, 10000, 0);
    cr_assert_eq(km_cluster_set_pools(b, on_b, 1), KM_OK);
    natsConnection *nc = raw_connect();
    raw_publish(nc, "state.x",
                "{\"v\":1,\"kind\":\"state\",\"instance\":\"x\",\"incarnation\":1,\"seq\":1,"
                "\"workers\":[[0,4,0,0,0,0,0]],\"peers\":[],"
                "\"pools\":[[\"main\",\"0000000000009999\"]]}");
    WAIT_UNTIL(stats(b).n_mismatched == 1, 2000);
    cr_assert_eq(stats(b).n_mismatched, 1, "x's old process disagrees on main");
    cr_assert_eq(remote(b, 0).in_flight, 0);
    raw_load(nc, "change", 2, 1, 0, 5); /* the new process, before its full state */
    WAIT_UNTIL(stats(b).restarted_instances == 1 && remote(b, 0).in_flight == 5, 2000);
    cr_assert_eq(stats(b).restarted_instances, 1);
    cr_assert_eq(remote(b, 0).in_flight, 5, "the old process's disagreement left it out");
    cr_assert_eq(stats(b).n_mismatched, 0);
    natsConnection_Destroy(nc);
    km_cluster_destroy(b);
}

Test(cluster, heartbeats_keep_their_interval_however_many_messages_arrive, .init = start_server,
     .fini = stop_server, .timeout = 60)
{
    /* a only listens; b publishes a change every ms for 0.5 s. a's own messages are its
     * heartbeats (50 ms) and the one state its start sends: a busy peer never makes more. */
    km_cluster *a = instance("a", server.url, 2000, 0);
    km_cluster *b = instance("b", server.url, 2000, 0);
    uint64_t before = stats(a).sent, t0 = mono_ns();
    for (uint32_t i = 1; i <= 500; i++) {
        km_active_load l = {i, 0, 0, 0, 0, 0};
        km_cluster_publish_load(b, 0, &l);
        km_test_sleep_ms(1);
    }
    WAIT_UNTIL(remote(a, 0).in_flight == 500, 2000);
    uint64_t sent = stats(a).sent - before;
    double heartbeats = (double)(mono_ns() - t0) / 1e6 / 50.0;
    cr_assert_leq((double)sent, heartbeats + 3, "a sent %llu messages in %.0f heartbeat intervals",
                  (unsigned long long)sent, heartbeats);
    km_cluster_destroy(a);
    km_cluster_destroy(b);
}

/* Messages waiting on a synchronous subscription (none taken off it in these tests). */
static int pending(natsSubscription *sub)
{
    int msgs = 0, bytes = 0;
    cr_assert_eq(natsSubscription_GetPending(sub, &msgs, &bytes), NATS_OK);
    return msgs;
}

/* Many sync requests at once (every instance reconnecting after a NATS restart) cost a peer far
 * fewer states than requests, while each requester still gets a state published after its
 * request: requester i is a subscription to the peer's states made just before its request (a
 * requester counts a peer as answered by any state of it that arrives after the request is
 * made), so a request left unanswered leaves its subscription empty. A handle starting with the
 * default configuration still takes the peer's state within its quiet wait. */
Test(cluster, a_burst_of_sync_requests_costs_a_peer_few_states_and_each_request_is_answered,
     .init = start_server, .fini = stop_server, .timeout = 60)
{
    enum { REQUESTS = 100 };
    km_cluster_config cfg;
    km_cluster_config_init(&cfg);
    cfg.url = server.url;
    cfg.instance = "p";
    cfg.max_workers = WORKERS;
    cfg.sync_answer_ms = cfg.sync_quiet_ms / 2 + 1;
    km_cluster *p = NULL;
    char why[256] = "";
    cr_assert_eq(km_cluster_create(&cfg, &p, why, sizeof why), KM_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(why, "sync_answer_ms"), "%s", why);
    km_cluster_config_init(&cfg);
    cfg.url = server.url;
    cfg.instance = "p";
    cfg.max_workers = WORKERS;
    cfg.heartbeat_ms = 60000; /* no heartbeat within the test: every state is an answer */
    cfg.expire_ms = 120000;
    cr_assert_eq(km_cluster_create(&cfg, &p, why, sizeof why), KM_OK, "%s", why);
    km_active_load l = {2, 0, 0, 0, 0, 0};
    cr_assert_eq(km_cluster_publish_load(p, 3, &l), KM_OK);

    natsConnection *nc = raw_connect();
    natsSubscription *all = NULL, *requester[REQUESTS];
    cr_assert_eq(natsConnection_SubscribeSync(&all, nc, "kvmatch.cluster.state.p"), NATS_OK);
    cr_assert_eq(natsConnection_FlushTimeout(nc, 2000), NATS_OK);
    /* One connection, in order: the server holds each subscription before it routes the request
     * that follows it. Flushed once: the requests reach the peer together. */
    for (int i = 0; i < REQUESTS; i++) {
        char body[160];
        snprintf(body, sizeof body, "{\"v\":1,\"kind\":\"sync\",\"instance\":\"r%d\","
                 "\"incarnation\":%d}", i, i + 1);
        cr_assert_eq(natsConnection_SubscribeSync(&requester[i], nc, "kvmatch.cluster.state.p"),
                     NATS_OK);
        cr_assert_eq(natsConnection_PublishString(nc, "kvmatch.cluster.sync", body), NATS_OK);
    }
    cr_assert_eq(natsConnection_FlushTimeout(nc, 2000), NATS_OK);
    for (int i = 0; i < REQUESTS; i++) {
        natsMsg *msg = NULL;
        cr_assert_eq(natsSubscription_NextMsg(&msg, requester[i], 5000), NATS_OK,
                     "requester %d got no state of the peer's after its request", i);
        natsMsg_Destroy(msg);
    }
    km_cluster_stats st;
    WAIT_UNTIL((st = stats(p)).sync_requests == REQUESTS &&
                   (uint64_t)pending(all) == st.sync_answers, 5000);
    int states = pending(all);
    cr_assert_eq(st.sync_requests, REQUESTS);
    cr_assert_eq((uint64_t)states, st.sync_answers, "every state published was an answer");
    cr_assert(states >= 1 && states <= REQUESTS / 8,
              "%d sync requests at once cost the peer %d states", REQUESTS, states);

    /* A handle of the default configuration: the peer's answer reaches it within its quiet
     * wait, whether it shares an answer still due or has one of its own. */
    g_sync_quiet_ms = 0;
    km_cluster *r = instance("r", server.url, 10000, 0);
    st = stats(r);
    cr_assert_eq(st.sync_peers, 1, "the new handle took the peer's state");
    cr_assert_eq(remote(r, 3).in_flight, 2);
    cr_assert_eq(stats(p).sync_requests, REQUESTS + 1);
    for (int i = 0; i < REQUESTS; i++)
        natsSubscription_Destroy(requester[i]);
    natsSubscription_Destroy(all);
    natsConnection_Destroy(nc);
    km_cluster_destroy(r);
    km_cluster_destroy(p);
}

/* ---- a NATS server that stops reading ------------------------------------------------------- */

typedef struct stalled_run {
    km_cluster *c;
    atomic_bool stop;
    atomic_bool done;
} stalled_run;

/* Changes as fast as they go, so the connection's socket fills while the server reads nothing. */
static void *publish_until_stopped(void *arg)
{
    stalled_run *r = arg;
    for (uint64_t i = 0; !atomic_load(&r->stop); i++) {
        km_active_load l = {i % 100 + 1, 1, 1000 + i, 0, 0, 0};
        km_cluster_publish_load(r->c, (uint32_t)(i % WORKERS), &l);
    }
    return NULL;
}

/* What a decision and a readiness probe call on the handle. */
static void *one_decision(void *arg)
{
    stalled_run *r = arg;
    km_active_load l = {0};
    km_cluster_add_remote_load(r->c, 1, &l);
    km_active_load mine = {1, 1, 16, 0, 0, 0};
    km_cluster_publish_load(r->c, 2, &mine);
    km_cluster_stats st;
    km_cluster_get_stats(r->c, &st);
    km_cluster_view v;
    km_cluster_get_view(r->c, mono_ns(), &v);
    atomic_store(&r->done, true);
    return NULL;
}

/* A server that takes nothing (SIGSTOP) makes the NATS client block its writer once the socket
 * is full: the outbox (here 4 messages) fills behind it and each further message is dropped and
 * counted as outbox-full. outbox_max_messages outside 1..65536 is refused, naming it. */
Test(cluster, a_full_outbox_drops_and_counts_what_nats_cannot_take, .init = start_server,
     .fini = stop_server, .timeout = 90)
{
    km_cluster_config cfg;
    km_cluster_config_init(&cfg);
    cfg.url = server.url;
    cfg.instance = "a";
    cfg.max_workers = WORKERS;
    km_cluster *a = NULL;
    char why[256] = "";
    uint32_t bad[] = {0, 65537};
    for (int i = 0; i < 2; i++) {
        cfg.outbox_max_messages = bad[i];
        cr_assert_eq(km_cluster_create(&cfg, &a, why, sizeof why), KM_ERR_INVALID_ARGUMENT);
        cr_assert(strstr(why, "outbox_max_messages"), "%s", why);
    }
    cfg.outbox_max_messages = 4;
    cr_assert_eq(km_cluster_create(&cfg, &a, why, sizeof why), KM_OK, "%s", why);
    cr_assert_eq(kill(server.pid, SIGSTOP), 0);
    uint64_t deadline = mono_ns() + UINT64_C(20000000000);
    km_cluster_stats st = stats(a);
    for (uint64_t i = 0; st.publish_outbox_full == 0 && mono_ns() < deadline; i++) {
        km_active_load l = {i % 100 + 1, 1, 1000 + i, 0, 0, 0};
        km_cluster_publish_load(a, (uint32_t)(i % WORKERS), &l);
        if (i % 1024 == 0)
            st = stats(a);
    }
    st = stats(a);
    cr_assert_eq(kill(server.pid, SIGCONT), 0);
    cr_assert_gt(st.publish_outbox_full, 0, "publish_failures %" PRIu64 ", outbox full %" PRIu64,
                 st.publish_failures, st.publish_outbox_full);
    cr_assert_geq(st.publish_failures, st.publish_outbox_full);
    cr_assert_eq(st.publish_too_large, 0);
    km_cluster_destroy(a);
}

/* The server stopped (SIGSTOP: a hung server, or a link that drops everything while TCP stays
 * up): every call a decision makes still returns while the publishing goes on, and the handle
 * comes back once the server runs again. */
Test(cluster, a_stalled_nats_server_never_blocks_a_decision, .init = start_server,
     .fini = stop_server, .timeout = 90)
{
    km_cluster *a = instance("a", server.url, 1000, 0);
    km_cluster *b = instance("b", server.url, 1000, 0);
    cr_assert_eq(kill(server.pid, SIGSTOP), 0);
    stalled_run run = {.c = a};
    pthread_t flood;
    cr_assert_eq(pthread_create(&flood, NULL, publish_until_stopped, &run), 0);
    for (int i = 0; i < 8; i++) {
        km_test_sleep_ms(250);
        stalled_run decision = {.c = a};
        pthread_t t;
        cr_assert_eq(pthread_create(&t, NULL, one_decision, &decision), 0);
        WAIT_UNTIL(atomic_load(&decision.done), 5000);
        if (!atomic_load(&decision.done)) {
            kill(server.pid, SIGCONT);
            cr_assert_fail("decision %d did not complete within 5 s while NATS is stopped", i);
        }
        pthread_join(t, NULL);
    }
    /* A flood that outruns a server taking nothing has messages dropped: from the full outbox
     * while the client blocks on its socket, or by the client once its write deadline gave the
     * connection up and its reconnect buffer (8 MB) is full. Both count in publish_failures, the
     * first also in publish_outbox_full. Whether and which comes first within the wait is the
     * flood's speed: on a quiet machine the outbox fills within a second; under a sanitizer
     * beside other work the flood may not fill the buffers at all, and then nothing is
     * dropped (nothing need be). */
    WAIT_UNTIL(stats(a).publish_failures > 0, 20000);
    atomic_store(&run.stop, true);
    pthread_join(flood, NULL);
    km_cluster_stats sa = stats(a);
    cr_assert_geq(sa.publish_failures, sa.publish_outbox_full);
    cr_assert_eq(sa.publish_too_large, 0);
    cr_assert_eq(kill(server.pid, SIGCONT), 0);
    km_active_load l = {7, 0, 0, 0, 0, 0};
    km_cluster_publish_load(a, 3, &l);
    WAIT_UNTIL(remote(b, 3).in_flight == 7, 15000);
    cr_assert_eq(remote(b, 3).in_flight, 7, "b has a's load again once the server runs");
    km_cluster_destroy(a);
    km_cluster_destroy(b);
}

/* ---- a server whose max_payload is below KM_CLUSTER_MESSAGE_MAX ------------------------------ */

static void start_small_payload_server(void)
{
    char why[256];
    if (!km_nats_test_server_start_with(&server, "max_payload: 4096", why, sizeof why))
        cr_assert_fail("cannot start nats-server: %s", why);
}

/* The server's max_payload bounds what is sent, as KM_CLUSTER_MESSAGE_MAX does: a change whose
 * work passes it goes out without the work, and the peers hold the load; a prediction carries
 * the leading hashes that fit. */
Test(cluster, a_server_max_payload_below_the_message_bound_is_the_bound,
     .init = start_small_payload_server, .fini = stop_server, .timeout = 60)
{
    static counted_lines lines = {.lock = PTHREAD_MUTEX_INITIALIZER,
                                  .needles = {"not published", "without it"}};
    static predictions_seen seen = {.lock = PTHREAD_MUTEX_INITIALIZER};
    km_cluster *b = instance_seeing("b", &seen);
    km_cluster_config cfg;
    km_cluster_config_init(&cfg);
    cfg.url = server.url;
    cfg.instance = "a";
    cfg.max_workers = WORKERS;
    cfg.heartbeat_ms = 50;
    cfg.expire_ms = 5000;
    cfg.log = count_lines;
    cfg.log_user = &lines;
    km_cluster *a = NULL;
    char why[256] = "";
    cr_assert_eq(km_cluster_create(&cfg, &a, why, sizeof why), KM_OK, "%s", why);
    static uint64_t queued[300]; /* about 6 KB as hex strings */
    for (uint32_t i = 0; i < 300; i++)
        queued[i] = i + 1;
    km_active_load l = {5, 1, 0, 0, 0, 0};
    cr_assert_eq(km_cluster_publish_work(a, 3, &l, NULL, 0, queued, 300), KM_OK);
    WAIT_UNTIL(remote(b, 3).in_flight == 5, 5000);
    cr_assert_eq(remote(b, 3).in_flight, 5, "b has a's load of the change over max_payload");
    km_cluster_stats st = stats(a);
    cr_assert_geq(st.work_omitted, 1, "sent without its work");
    cr_assert_eq(st.publish_failures, 0);
    cr_assert_eq(stats(b).lost_messages, 0);
    cr_assert_geq(counted_lines_count(&lines), 1, "the omission was logged");
    cr_assert_eq(km_cluster_publish_prediction(a, "main", 1, false, queued, 300), KM_OK);
    WAIT_UNTIL(predictions_count(&seen) == 1, 5000);
    cr_assert_eq(predictions_count(&seen), 1, "the prediction over max_payload arrived");
    cr_assert(seen.n_hashes[0] >= 150 && seen.n_hashes[0] < 300, "%u hashes", seen.n_hashes[0]);
    cr_assert_eq(seen.first[0], queued[0]);
    cr_assert_eq(seen.last[0], queued[seen.n_hashes[0] - 1]);
    cr_assert_eq(stats(a).publish_failures, 0);
    km_cluster_destroy(a);
    km_cluster_destroy(b);
}

/* ---- a server that refuses an instance's publishes ------------------------------------------ */

static void start_permissions_server(void)
{
    char why[256];
    if (!km_nats_test_server_start_with(&server,
                                        "authorization { users = [ {user: a, password: a}, "
                                        "{user: b, password: s3cret, permissions: "
                                        "{publish: {deny: \">\"}}} ] }",
                                        why, sizeof why))
        cr_assert_fail("cannot start nats-server: %s", why);
}

/* The server refusing an instance's publishes (its user may not publish) is an error outside any
 * call: counted, its words kept, and logged once per interval however many publishes it refuses,
 * while the instance allowed to publish is not touched. No line logs the URL's password. */
Test(cluster, a_publish_the_server_refuses_is_counted_kept_and_logged,
     .init = start_permissions_server, .fini = stop_server, .timeout = 60)
{
    static counted_lines lines = {.lock = PTHREAD_MUTEX_INITIALIZER,
                                  .needles = {"NATS reported an error"}, .secret = "s3cret"};
    char url_a[96], url_b[96];
    snprintf(url_a, sizeof url_a, "nats://a:a@127.0.0.1:%u", server.port);
    snprintf(url_b, sizeof url_b, "nats://b:s3cret@127.0.0.1:%u", server.port);
    km_cluster *a = instance("a", url_a, 5000, 0);
    km_cluster_config cfg;
    km_cluster_config_init(&cfg);
    cfg.url = url_b;
    cfg.instance = "b";
    cfg.max_workers = WORKERS;
    cfg.heartbeat_ms = 50;
    cfg.sync_quiet_ms = 200;
    cfg.expire_ms = 5000;
    cfg.log = count_lines;
    cfg.log_user = &lines;
    km_cluster *b = NULL;
    char why[256] = "";
    cr_assert_eq(km_cluster_create(&cfg, &b, why, sizeof why), KM_OK, "%s", why);
    km_active_load l = {4, 1, 0, 0, 0, 0};
    km_cluster_publish_load(b, 2, &l);
    WAIT_UNTIL(stats(b).nats_errors >= 3, 10000);
    km_cluster_stats sb = stats(b);
    cr_assert_geq(sb.nats_errors, 3, "every refused publish is counted");
    cr_assert_eq(sb.nats_slow_consumer, 0);
    cr_assert_not_null(strstr(sb.last_nats_error, "Permissions Violation"), "%s",
                       sb.last_nats_error);
    cr_assert_eq(counted_lines_count(&lines), 1, "logged once in the interval");
    cr_assert_eq(stats(a).nats_errors, 0);
    cr_assert_str_eq(stats(a).last_nats_error, "");
    cr_assert_eq(remote(a, 2).in_flight, 0, "the refused load never reached a");
    km_cluster_destroy(b);
    km_cluster_destroy(a);
    cr_assert(!lines.secret_seen, "a log line holds the password");
}

/* Log lines, kept for reading. */
typedef struct log_lines {
    pthread_mutex_t lock;
    char text[4096];
} log_lines;

static void keep_lines(void *user, const char *line)
{
    log_lines *l = user;
    pthread_mutex_lock(&l->lock);
    size_t at = strlen(l->text);
    snprintf(l->text + at, sizeof l->text - at, "%s\n", line);
    pthread_mutex_unlock(&l->lock);
}

/* An instance whose NATS server is not there says so with the URL, but not with its password. */
Test(cluster, an_unreachable_urls_password_is_not_logged, .timeout = 30)
{
    static log_lines lines = {.lock = PTHREAD_MUTEX_INITIALIZER};
    char url[96];
    snprintf(url, sizeof url, "nats://b:s3cret@127.0.0.1:%u", km_test_free_port());
    km_cluster_config cfg;
    km_cluster_config_init(&cfg);
    cfg.url = url;
    cfg.instance = "b";
    cfg.max_workers = WORKERS;
    cfg.log = keep_lines;
    cfg.log_user = &lines;
    km_cluster *b = NULL;
    char why[256] = "";
    cr_assert_eq(km_cluster_create(&cfg, &b, why, sizeof why), KM_OK, "%s", why);
    km_cluster_destroy(b);
    pthread_mutex_lock(&lines.lock);
    cr_assert_not_null(strstr(lines.text, "unreachable"), "%s", lines.text);
    cr_assert_not_null(strstr(lines.text, "nats://b:***@127.0.0.1:"), "%s", lines.text);
    cr_assert_null(strstr(lines.text, "s3cret"), "%s", lines.text);
    pthread_mutex_unlock(&lines.lock);
}

/* A URL's password or token never reaches a log line or message: each URL of a list shown with
 * three asterisks in their place, the user name and everything else as given; on fresh random
 * credentials. */
Test(cluster, a_urls_credentials_are_not_shown, .timeout = 10)
{
    static const struct {
        const char *url, *shown;
    } cases[] = {
        {"nats://127.0.0.1:4222", "nats://127.0.0.1:4222"},
        {"nats://b:s3cret@127.0.0.1:4222", "nats://b:***@127.0.0.1:4222"},
        {"nats://t0ken@nats.internal:4222", "nats://***@nats.internal:4222"},
        {"nats://u:p@ss@h:1", "nats://u:***@h:1"},
        {"nats://u:p@h1:1,nats://t@h2:2,nats://h3:3",
         "nats://u:***@h1:1,nats://***@h2:2,nats://h3:3"},
        {"nats://h:1/x@y", "nats://h:1/x@y"},
        {"", ""},
    };
    char out[128];
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        km_cluster_url_shown(cases[i].url, out, sizeof out);
        cr_assert_str_eq(out, cases[i].shown, "%s", cases[i].url);
    }
    km_cluster_url_shown("nats://user:password@host:1", out, 12);
    cr_assert_str_eq(out, "nats://user", "cut to the size");
    static const char chars[] = "abcXYZ019-_.~!$&'()*+;=:@%";
    unsigned seed0 = (unsigned)time(NULL), seed = seed0;
    for (int k = 0; k < 1000; k++) {
        char user[12], secret[24], url[96], expect[96];
        int nu = 1 + rand_r(&seed) % 10, ns = 1 + rand_r(&seed) % 22;
        for (int j = 0; j < nu; j++)
            user[j] = chars[rand_r(&seed) % 15]; /* no ':' or '@' */
        user[nu] = '\0';
        for (int j = 0; j < ns; j++)
            secret[j] = chars[rand_r(&seed) % (sizeof chars - 1)];
        secret[ns] = '\0';
        snprintf(url, sizeof url, "nats://%s:%s@10.0.0.%d:4222", user, secret, k % 250);
        snprintf(expect, sizeof expect, "nats://%s:***@10.0.0.%d:4222", user, k % 250);
        km_cluster_url_shown(url, out, sizeof out);
        cr_assert_str_eq(out, expect, "%s (seed %u)", url, seed0);
    }
}

/* A list past the bounds is cut, and what was cut counted once per list kept: the same cut list
 * published again beside another load sends no new work, so it counts nothing more. */
Test(cluster, a_cut_work_list_is_counted_once_per_list_it_replaces, .init = start_server,
     .fini = stop_server, .timeout = 30)
{
    km_cluster *a = instance("a", server.url, 5000, 0);
    static uint64_t prefixes[KM_CLUSTER_WORK_MAX_PREFIXES + 10];
    for (uint32_t i = 0; i < KM_CLUSTER_WORK_MAX_PREFIXES + 10; i++)
        prefixes[i] = i + 2;
    km_active_load l = {5, 1, 0, 0, 0, 0};
    cr_assert_eq(km_cluster_publish_work(a, 3, &l, prefixes, KM_CLUSTER_WORK_MAX_PREFIXES + 10,
                                         NULL, 0), KM_OK);
    cr_assert_eq(stats(a).work_truncated, 10);
    l.in_flight = 6;
    cr_assert_eq(km_cluster_publish_work(a, 3, &l, prefixes, KM_CLUSTER_WORK_MAX_PREFIXES + 10,
                                         NULL, 0), KM_OK);
    cr_assert_eq(stats(a).work_truncated, 10, "the same list again: no new cut");
    prefixes[0] = 1u << 30;
    cr_assert_eq(km_cluster_publish_work(a, 3, &l, prefixes, KM_CLUSTER_WORK_MAX_PREFIXES + 4,
                                         NULL, 0), KM_OK);
    cr_assert_eq(stats(a).work_truncated, 14, "another list, cut by 4");
    km_cluster_destroy(a);
}

/* A log line that contains a text, kept. */
typedef struct kept_line {
    pthread_mutex_t lock;
    const char *contains;
    char line[512];
} kept_line;

static void keep_line(void *user, const char *line)
{
    kept_line *k = user;
    if (strstr(line, k->contains)) {
        pthread_mutex_lock(&k->lock);
        snprintf(k->line, sizeof k->line, "%s", line);
        pthread_mutex_unlock(&k->lock);
    }
}

/* A starting instance whose sync waits for a peer that is gone (one that another instance still
 * lists) keeps sending its heartbeat meanwhile: the running instance never expires it. The sync's
 * warning counts the peers that did not answer. */
Test(cluster, a_starting_instance_waiting_for_a_gone_peer_is_not_expired, .init = start_server,
     .fini = stop_server, .timeout = 60)
{
    km_cluster *a = instance("a", server.url, 300, 0);
    natsConnection *nc = raw_connect();
    /* A peer that speaks once and is gone: a holds it (and lists it) for 300 ms. */
    raw_publish(nc, "state.ghost", "{\"v\":1,\"kind\":\"state\",\"instance\":\"ghost\","
                                   "\"incarnation\":9,\"seq\":1,\"workers\":[],\"peers\":[]}");
    WAIT_UNTIL(stats(a).instances == 1, 2000);
    cr_assert_eq(stats(a).instances, 1);
    km_cluster_config cfg;
    km_cluster_config_init(&cfg);
    cfg.url = server.url;
    cfg.instance = "b";
    cfg.max_workers = WORKERS;
    cfg.heartbeat_ms = 50;
    cfg.expire_ms = 300;
    cfg.sync_timeout_ms = 1000; /* waited out: the ghost never answers */
    static kept_line warning = {.lock = PTHREAD_MUTEX_INITIALIZER, .contains = "did not answer"};
    cfg.log = keep_line;
    cfg.log_user = &warning;
    km_cluster *b = NULL;
    char why[256] = "";
    cr_assert_eq(km_cluster_create(&cfg, &b, why, sizeof why), KM_OK, "%s", why);
    cr_assert_eq(stats(b).sync_peers, 1, "b heard a, not the ghost");
    cr_assert(strstr(warning.line, ": 1 of the 2 peers learnt of did not answer"), "%s",
              warning.line);
    uint64_t inc, seq;
    cr_assert_eq(km_cluster_get_applied(a, "b", &inc, &seq), KM_OK, "a holds b");
    cr_assert_eq(stats(a).expired_instances, 1, "a expired the ghost only");
    natsConnection_Destroy(nc);
    km_cluster_destroy(b);
    km_cluster_destroy(a);
}

/* A message whose sequence number jumps past KM_CLUSTER_SEQ_JUMP_MAX (a stray tool, a replay) is
 * refused as malformed: no loss is counted for it and the sender's next messages apply. */
Test(cluster, an_implausible_sequence_jump_is_refused_and_the_sender_goes_on,
     .init = start_server, .fini = stop_server, .timeout = 60)
{
    km_cluster *a = instance("a", server.url, 10000, 0);
    natsConnection *nc = raw_connect();
    raw_load(nc, "state", 9, 1, 4, 6);
    WAIT_UNTIL(remote(a, 4).in_flight == 6, 2000);
    cr_assert_eq(remote(a, 4).in_flight, 6);
    raw_load(nc, "change", 9, 1 + KM_CLUSTER_SEQ_JUMP_MAX + 1, 4, 99);
    raw_load(nc, "change", 9, INT64_MAX, 4, 99);
    WAIT_UNTIL(stats(a).refused[KM_CLUSTER_REFUSED_MALFORMED] == 2, 2000);
    km_cluster_stats st = stats(a);
    cr_assert_eq(st.refused[KM_CLUSTER_REFUSED_MALFORMED], 2, "%s", st.last_refusal);
    cr_assert_eq(st.lost_messages, 0);
    cr_assert_eq(remote(a, 4).in_flight, 6, "a refused message changed nothing");
    for (uint64_t seq = 2; seq <= 6; seq++)
        raw_load(nc, "change", 9, seq, 4, 10 + seq);
    WAIT_UNTIL(remote(a, 4).in_flight == 16, 2000);
    cr_assert_eq(remote(a, 4).in_flight, 16, "the sender's next messages apply");
    st = stats(a);
    cr_assert_eq(st.refused[KM_CLUSTER_REFUSED_DUPLICATE], 0);
    cr_assert_eq(st.lost_messages, 0);
    /* The largest plausible jump is a gap. */
    raw_load(nc, "change", 9, 6 + KM_CLUSTER_SEQ_JUMP_MAX, 4, 20);
    WAIT_UNTIL(remote(a, 4).in_flight == 20, 2000);
    cr_assert_eq(remote(a, 4).in_flight, 20);
    cr_assert_eq(stats(a).lost_messages, KM_CLUSTER_SEQ_JUMP_MAX - 1);
    natsConnection_Destroy(nc);
    km_cluster_destroy(a);
}

/* A lossy link (every other change lost): every loss is counted, and reported in one line per
 * interval, not one per gap. */
Test(cluster, sequence_gaps_are_all_counted_and_logged_once_per_interval, .init = start_server,
     .fini = stop_server, .timeout = 60)
{
    static counted_lines lines = {.lock = PTHREAD_MUTEX_INITIALIZER,
                                  .needles = {" lost (seq"}};
    km_cluster_config cfg;
    km_cluster_config_init(&cfg);
    cfg.url = server.url;
    cfg.instance = "b";
    cfg.max_workers = WORKERS;
    cfg.heartbeat_ms = 200;
    cfg.log = count_lines;
    cfg.log_user = &lines;
    km_cluster *b = NULL;
    char why[256] = "";
    cr_assert_eq(km_cluster_create(&cfg, &b, why, sizeof why), KM_OK, "%s", why);
    km_cluster *a = instance("a", server.url, 1000, 2);
    for (uint32_t i = 1; i <= 2000; i++) {
        km_active_load l = {i, 0, 0, 0, 0, 0};
        km_cluster_publish_load(a, 1, &l);
    }
    WAIT_UNTIL(stats(b).lost_messages >= 1000, 5000);
    cr_assert_geq(stats(b).lost_messages, 1000);
    uint32_t n = counted_lines_count(&lines);
    cr_assert(n >= 1 && n <= 2, "%u lines for 1000 gaps", n);
    km_cluster_destroy(a);
    km_cluster_destroy(b);
}

/* The test server's log lives while it runs: stopping it removes the log. */
Test(cluster, a_stopped_test_server_leaves_no_log_behind, .timeout = 30)
{
    km_nats_test_server s;
    char why[256];
    cr_assert(km_nats_test_server_start(&s, why, sizeof why), "%s", why);
    cr_assert_eq(access(s.log_path, F_OK), 0, "%s while it runs", s.log_path);
    km_nats_test_server_stop(&s);
    cr_assert_neq(access(s.log_path, F_OK), 0, "%s left behind", s.log_path);
}
