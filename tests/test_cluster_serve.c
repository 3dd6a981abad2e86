/* Two and three `kvmatch serve` instances (in process) sharing their active work through a real
 * nats-server: a decision on one weighs the requests another routed, says so in its reply, its
 * record, /status and /metrics, and a new instance has the running work when it is created. */
#include <criterion/criterion.h>
#include <arpa/inet.h>
#include <jansson.h>
#include <math.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <unistd.h>

#include <nats/nats.h>
#include <xxhash.h>

#include "kv_test_publisher.h"
#include "kvmatch/kvmatch.h"
#include "nats_test_server.h"
#include "test_util.h"

#define BS 4u

typedef struct node {
    km_server *server;
    pthread_t thread;
    char dir[64], sock[128], addr[160], records[128];
    int run_status;
} node;

static km_nats_test_server nats;
static km_server_worker g_workers[2] = {{.id = 0}, {.id = 1}};
static km_server_pool g_pool;
static uint32_t g_tokens[64];
static km_policy_kind g_policy = KM_POLICY_LEAST_LOAD;

static void start_nats(void)
{
    char why[256];
    if (!km_nats_test_server_start(&nats, why, sizeof why))
        cr_assert_fail("cannot start nats-server: %s", why);
}

static void stop_nats(void)
{
    km_nats_test_server_stop(&nats);
}

static void *run_thread(void *arg)
{
    node *n = arg;
    n->run_status = km_server_run(n->server, false);
    return NULL;
}

static void quiet_log(void *user, const char *line)
{
    (void)user;
    if (getenv("KM_TEST_SERVER_LOG"))
        fprintf(stderr, "serve: %s\n", line);
}

static void node_start_with(node *n, const char *instance, km_server_worker *workers);

/* When set, the next node started gets an index capped at its size when created (256 blocks):
 * it refuses any growth. */
static bool g_cap_index;

/* cluster.sync_quiet_ms of the nodes started. */
static uint32_t g_sync_quiet_ms = 1000;

static void node_start(node *n, const char *instance)
{
    node_start_with(n, instance, g_workers);
}

/* Start n with the pool's workers given (two of them: approximate mode, or fed by KV events). */
static void node_start_with(node *n, const char *instance, km_server_worker *workers)
{
    strcpy(n->dir, "/tmp/kvmatch-cluster-XXXXXX");
    cr_assert_not_null(mkdtemp(n->dir));
    snprintf(n->sock, sizeof n->sock, "%s/s.sock", n->dir);
    snprintf(n->addr, sizeof n->addr, "unix:%s", n->sock);
    snprintf(n->records, sizeof n->records, "%s/records.jsonl", n->dir);
    km_server_config cfg;
    km_server_config_init(&cfg);
    cfg.socket_path = n->sock;
    cfg.records_path = n->records;
    cfg.http = "127.0.0.1:0";
    cfg.max_workers = 8;
    cfg.backend = KM_BACKEND_CPU;
    cfg.index_threads = 1;
    cfg.log = quiet_log;
    cfg.max_queue_wait_ms = 0;
    cfg.cluster_url = nats.url;
    cfg.cluster_instance = instance;
    cfg.cluster_heartbeat_ms = 50;
    cfg.cluster_expire_ms = 2000;
    /* A running peer's first answer can take longer than the default 100 ms on a loaded test
     * machine; a lone instance then waits this long at its start. */
    cfg.cluster_sync_quiet_ms = g_sync_quiet_ms;
    if (g_cap_index)
        km_test_cap_server_index_at_creation(&cfg);
    memset(&g_pool, 0, sizeof g_pool);
    g_pool.name = "main";
    g_pool.model = "m1";
    g_pool.block_size = BS;
    km_policy_config_init(&g_pool.policy);
    g_pool.policy.kind = g_policy;
    g_pool.workers = workers;
    g_pool.n_workers = 2;
    cfg.pools = &g_pool;
    cfg.n_pools = 1;
    char why[256];
    int rc = km_server_create(&cfg, &n->server, why, sizeof why);
    cr_assert_eq(rc, KM_OK, "km_server_create(%s): %s: %s", instance, km_error_name(rc), why);
    cr_assert_eq(pthread_create(&n->thread, NULL, run_thread, n), 0);
}

static void node_stop(node *n)
{
    km_server_stop(n->server);
    pthread_join(n->thread, NULL);
    cr_assert_eq(n->run_status, KM_OK);
    km_server_destroy(n->server);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", n->dir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", n->dir);
}

static km_client *connect_to(node *n)
{
    km_client *c = NULL;
    char why[256];
    cr_assert_eq(km_client_connect(n->addr, 3000, &c, why, sizeof why), KM_OK, "%s", why);
    return c;
}

static const km_route_decision *route_prompt(km_client *c, const char *id, uint32_t first_token,
                                             km_message *reply);

static const km_route_decision *route(km_client *c, const char *id, km_message *reply)
{
    return route_prompt(c, id, 500, reply);
}

/* Route a prompt of 3 blocks: tokens first_token, first_token + 1, ... */
static const km_route_decision *route_prompt(km_client *c, const char *id, uint32_t first_token,
                                             km_message *reply)
{
    for (uint32_t i = 0; i < 3 * BS; i++)
        g_tokens[i] = first_token + i;
    km_route_request r;
    memset(&r, 0, sizeof r);
    r.request_id = id;
    r.pool = "main";
    r.input = KM_ROUTE_INPUT_TOKENS;
    r.tokens = g_tokens;
    r.n_tokens = 3 * BS;
    cr_assert_eq(km_client_route(c, &r, 1, 5000, reply), KM_OK, "%s", km_client_last_error(c));
    cr_assert_eq(reply->decision.n_decisions, 1);
    const km_route_decision *d = &reply->decision.decisions[0];
    cr_assert_eq(d->status, KM_OK, "%s", d->message ? d->message : "");
    return d;
}

static uint32_t in_flight(const km_route_decision *d, uint32_t worker)
{
    for (uint32_t i = 0; i < d->n_candidates; i++)
        if (d->candidates[i].worker == worker)
            return d->candidates[i].load.in_flight;
    cr_assert_fail("worker %u not among the candidates", worker);
    return 0;
}

static int http_get(uint16_t port, const char *path, char *body, size_t body_size)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    cr_assert_eq(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0);
    struct timeval tv = {3, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    char req[256];
    int n = snprintf(req, sizeof req, "GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                     path);
    cr_assert_eq(write(fd, req, (size_t)n), n);
    static char resp[1 << 17];
    size_t got = 0;
    ssize_t k;
    while (got < sizeof resp - 1 && (k = read(fd, resp + got, sizeof resp - 1 - got)) > 0)
        got += (size_t)k;
    resp[got] = '\0';
    close(fd);
    int status = 0;
    sscanf(resp, "HTTP/1.%*d %d", &status);
    const char *b = strstr(resp, "\r\n\r\n");
    snprintf(body, body_size, "%s", b ? b + 4 : "");
    return status;
}

static json_t *status_of(node *n)
{
    static char body[1 << 17];
    cr_assert_eq(http_get(km_server_http_port(n->server), "/status", body, sizeof body), 200);
    json_error_t e;
    json_t *o = json_loads(body, 0, &e);
    cr_assert_not_null(o, "/status is not JSON: %s", e.text);
    return o;
}

static json_int_t cluster_int(node *n, const char *key)
{
    json_t *st = status_of(n);
    json_int_t v = json_integer_value(json_object_get(json_object_get(st, "cluster"), key));
    json_decref(st);
    return v;
}

static json_t *last_decision_record(node *n)
{
    json_t *last = NULL;
    for (int tries = 0; tries < 200 && !last; tries++) {
        FILE *f = fopen(n->records, "r");
        char *line = NULL;
        size_t cap = 0;
        while (f && getline(&line, &cap, f) > 0) {
            json_t *o = json_loads(line, 0, NULL);
            if (o && !strcmp(json_string_value(json_object_get(o, "type")), "decision")) {
                json_decref(last);
                last = o;
            } else {
                json_decref(o);
            }
        }
        free(line);
        if (f)
            fclose(f);
        if (!last)
            km_test_sleep_ms(20);
    }
    cr_assert_not_null(last, "no decision record in %s", n->records);
    return last;
}

Test(cluster_serve, decisions_weigh_the_other_instances_work_and_say_so, .init = start_nats,
     .fini = stop_nats, .timeout = 60)
{
    node a, b;
    node_start(&a, "a");
    node_start(&b, "b");
    cr_assert_eq(cluster_int(&b, "sync_peers"), 1, "b took a's state at start");
    /* b's sync may end on a heartbeat of a's before a's answer (sync_answer_ms) goes out. */
    for (int t = 0; t < 200 && cluster_int(&a, "sync_answers") != 1; t++)
        km_test_sleep_ms(10);
    cr_assert_eq(cluster_int(&a, "sync_requests"), 1, "a received b's sync request");
    cr_assert_eq(cluster_int(&a, "sync_answers"), 1, "one state of a's answered it");
    /* The handle an observer reads is the one the status reports on. */
    cr_assert_null(km_server_cluster(NULL));
    km_cluster_stats cst;
    cr_assert_eq(km_cluster_get_stats(km_server_cluster(b.server), &cst), KM_OK);
    cr_assert_eq(cst.sync_peers, 1);
    km_client *ca = connect_to(&a), *cb = connect_to(&b);
    km_message reply;
    char id[32];
    for (int i = 0; i < 3; i++) {
        snprintf(id, sizeof id, "a-%d", i);
        route(ca, id, &reply);
    }
    /* a holds 3 in flight over workers 0 and 1 (least_load: 2 and 1); b must see them. */
    for (int t = 0; t < 200 && cluster_int(&b, "instances") != 1; t++)
        km_test_sleep_ms(10);
    const km_route_decision *d = NULL;
    for (int t = 0; t < 200; t++) {
        snprintf(id, sizeof id, "b-probe-%d", t);
        d = route(cb, id, &reply);
        bool seen = in_flight(d, 0) + in_flight(d, 1) >= 3;
        if (seen)
            break; /* b-probe-t stays in flight on b; finished below */
        km_lifecycle_event ev = {.kind = KM_LIFECYCLE_FINISHED, .request_id = id,
                                 .outcome = KM_OUTCOME_CANCELLED};
        km_message ack;
        km_client_lifecycle(cb, &ev, 1, 5000, &ack);
        km_test_sleep_ms(10);
    }
    uint32_t w0 = in_flight(d, 0), w1 = in_flight(d, 1);
    cr_assert_eq(w0 + w1, 3, "b's candidates carry a's 3 requests (%u + %u)", w0, w1);
    cr_assert(w0 == 2 || w1 == 2);
    cr_assert_neq(d->chosen_worker, w0 == 2 ? 0u : 1u, "least_load avoids a's busier worker");
    cr_assert_str_eq(d->load_scope, "cluster");
    cr_assert_eq(d->load_instances, 1);
    cr_assert(d->load_oldest_age_ms >= 0 && d->load_oldest_age_ms < 2000, "age %f",
              d->load_oldest_age_ms);
    cr_assert_str_eq(d->load_stale_instances ? d->load_stale_instances : "", "");

    json_t *rec = last_decision_record(&b);
    json_t *load = json_object_get(json_object_get(rec, "decision"), "load");
    cr_assert_str_eq(json_string_value(json_object_get(load, "scope")), "cluster");
    cr_assert_eq(json_integer_value(json_object_get(load, "instances")), 1);
    cr_assert(json_is_array(json_object_get(load, "stale_instances")));
    json_decref(rec);

    json_t *st = status_of(&b);
    json_t *cl = json_object_get(st, "cluster");
    cr_assert(json_is_true(json_object_get(cl, "connected")));
    cr_assert_str_eq(json_string_value(json_object_get(cl, "load_scope")), "cluster");
    cr_assert_eq(json_integer_value(json_object_get(cl, "lost_messages")), 0);
    cr_assert(json_is_integer(json_object_get(cl, "publish_outbox_full")));
    cr_assert(json_is_integer(json_object_get(cl, "publish_too_large")));
    cr_assert_eq(json_integer_value(json_object_get(cl, "nats_errors")), 0);
    cr_assert(json_is_integer(json_object_get(cl, "nats_slow_consumer")));
    cr_assert_str_eq(json_string_value(json_object_get(cl, "last_nats_error")), "");
    json_decref(st);
    static char body[1 << 17];
    cr_assert_eq(http_get(km_server_http_port(b.server), "/metrics", body, sizeof body), 200);
    cr_assert(strstr(body, "\nkvmatch_cluster_instances 1"), "%s", body);
    cr_assert(strstr(body, "\nkvmatch_cluster_publish_outbox_full_total 0"), "%s", body);
    cr_assert(strstr(body, "\nkvmatch_cluster_publish_too_large_total 0"), "%s", body);
    cr_assert(strstr(body, "\nkvmatch_cluster_nats_errors_total 0"), "%s", body);
    cr_assert(strstr(body, "kvmatch_cluster_refused_messages_total{reason=\"malformed\"} 0"));
    cr_assert(strstr(body, "\nkvmatch_cluster_sync_requests_total 0"), "%s", body);
    cr_assert_eq(http_get(km_server_http_port(a.server), "/metrics", body, sizeof body), 200);
    cr_assert(strstr(body, "\nkvmatch_cluster_sync_requests_total 1"), "%s", body);
    cr_assert(strstr(body, "\nkvmatch_cluster_sync_answers_total 1"), "%s", body);

    /* a's requests finish (and b's probe): b's view of them goes back to 0. */
    km_lifecycle_event probe_end = {.kind = KM_LIFECYCLE_FINISHED, .request_id = id,
                                    .outcome = KM_OUTCOME_CANCELLED};
    km_message probe_ack;
    cr_assert_eq(km_client_lifecycle(cb, &probe_end, 1, 5000, &probe_ack), KM_OK);
    cr_assert_eq(probe_ack.ack.items[0].status, KM_OK);
    for (int i = 0; i < 3; i++) {
        snprintf(id, sizeof id, "a-%d", i);
        km_lifecycle_event ev = {.kind = KM_LIFECYCLE_FINISHED, .request_id = id,
                                 .outcome = KM_OUTCOME_CANCELLED};
        km_message ack;
        cr_assert_eq(km_client_lifecycle(ca, &ev, 1, 5000, &ack), KM_OK);
        cr_assert_eq(ack.ack.items[0].status, KM_OK, "%s", ack.ack.items[0].message ? ack.ack.items[0].message : "");
    }
    uint32_t left = 3;
    for (int t = 0; t < 200 && left; t++) {
        snprintf(id, sizeof id, "b-after-%d", t);
        d = route(cb, id, &reply);
        /* b's own routes count too: each is finished at once */
        left = in_flight(d, 0) + in_flight(d, 1);
        km_lifecycle_event ev = {.kind = KM_LIFECYCLE_FINISHED, .request_id = id,
                                 .outcome = KM_OUTCOME_CANCELLED};
        km_message ack;
        km_client_lifecycle(cb, &ev, 1, 5000, &ack);
        if (left)
            km_test_sleep_ms(10);
    }
    cr_assert_eq(left, 0, "a's finished requests still weigh on b's decisions");
    km_client_close(ca);
    km_client_close(cb);
    node_stop(&b);
    node_stop(&a);
}

/* cluster.sync_quiet_ms reaches the cluster: an instance that knows of no peer waits that long
 * for a first answer before it is ready. */
Test(cluster_serve, a_lone_instance_waits_its_sync_quiet_ms, .init = start_nats,
     .fini = stop_nats, .timeout = 60)
{
    g_sync_quiet_ms = 1500;
    node a;
    node_start(&a, "a");
    json_t *st = status_of(&a);
    json_t *cl = json_object_get(st, "cluster");
    cr_assert_eq(json_integer_value(json_object_get(cl, "sync_peers")), 0);
    double took = json_real_value(json_object_get(cl, "sync_seconds"));
    cr_assert(took >= 1.5, "a lone instance's sync ended after %f s, before its quiet wait", took);
    json_decref(st);
    node_stop(&a);
}

Test(cluster_serve, a_new_instance_has_the_running_work_when_it_is_ready, .init = start_nats,
     .fini = stop_nats, .timeout = 60)
{
    node a;
    node_start(&a, "a");
    km_client *ca = connect_to(&a);
    km_message reply;
    route(ca, "running-1", &reply);
    route(ca, "running-2", &reply);
    node c;
    node_start(&c, "c"); /* returns once ready: its first decision must see a's two requests */
    km_client *cc = connect_to(&c);
    const km_route_decision *d = route(cc, "first", &reply);
    cr_assert_eq(in_flight(d, 0) + in_flight(d, 1), 2, "c's first decision misses a's work");
    cr_assert_str_eq(d->load_scope, "cluster");
    json_t *st = status_of(&c);
    json_t *cl = json_object_get(st, "cluster");
    cr_assert_eq(json_integer_value(json_object_get(cl, "sync_peers")), 1);
    double took = json_real_value(json_object_get(cl, "sync_seconds"));
    cr_assert(took > 0 && took < 2.0, "sync took %f s", took);
    json_decref(st);
    km_client_close(cc);
    km_client_close(ca);
    node_stop(&c);
    node_stop(&a);
}

/* ---- approximate-mode predictions shared ------------------------------------------------------ */

static uint32_t depth_of(const km_route_decision *d, uint32_t worker)
{
    for (uint32_t i = 0; i < d->n_candidates; i++)
        if (d->candidates[i].worker == worker)
            return d->candidates[i].depth;
    cr_assert_fail("worker %u not among the candidates", worker);
    return 0;
}

static json_int_t predictions_int(node *n, const char *key)
{
    json_t *st = status_of(n);
    json_t *p = json_object_get(json_object_get(json_object_get(st, "cluster"), "predictions"), key);
    cr_assert(json_is_integer(p), "/status cluster.predictions.%s", key);
    json_int_t v = json_integer_value(p);
    json_decref(st);
    return v;
}

static void wait_predictions(node *n, const char *key, json_int_t want)
{
    for (int t = 0; t < 300 && predictions_int(n, key) < want; t++)
        km_test_sleep_ms(10);
    json_int_t got = predictions_int(n, key);
    cr_assert_eq(got, want, "cluster.predictions.%s: %lld, expected %lld", key, (long long)got,
                 (long long)want);
}

/* A prediction from another instance that the pool's index refuses to take (its memory cap) is
 * counted dropped, not applied. */
Test(cluster_serve, a_prediction_the_index_refuses_is_dropped_not_applied,
     .init = start_nats, .fini = stop_nats, .timeout = 60)
{
    node a, b;
    node_start(&a, "a");
    g_cap_index = true;
    node_start(&b, "b");
    g_cap_index = false;
    km_client *ca = connect_to(&a);
    km_message reply;
    enum { PROMPTS = 200 }; /* 600 blocks: past the 256 b's index holds */
    char id[32];
    for (uint32_t i = 0; i < PROMPTS; i++) {
        snprintf(id, sizeof id, "a-%u", i);
        route_prompt(ca, id, 10000 + 100 * i, &reply);
    }
    for (int t = 0; t < 500 && predictions_int(&b, "received") < PROMPTS; t++)
        km_test_sleep_ms(10);
    cr_assert_eq(predictions_int(&b, "received"), PROMPTS);
    json_int_t applied = 0, dropped = 0;
    for (int t = 0; t < 500 && applied + dropped < PROMPTS; t++) {
        km_test_sleep_ms(10);
        applied = predictions_int(&b, "applied");
        dropped = predictions_int(&b, "dropped");
    }
    cr_assert_eq(applied + dropped, PROMPTS, "applied %lld, dropped %lld", (long long)applied,
                 (long long)dropped);
    cr_assert_gt(dropped, 0, "the capped index refused some: applied %lld", (long long)applied);
    cr_assert_gt(applied, 0, "the first ones fit");
    km_client_close(ca);
    node_stop(&b);
    node_stop(&a);
}

Test(cluster_serve, approximate_mode_predictions_and_lessons_reach_the_other_instance,
     .init = start_nats, .fini = stop_nats, .timeout = 60)
{
    node a, b;
    node_start(&a, "a");
    node_start(&b, "b");
    km_client *ca = connect_to(&a), *cb = connect_to(&b);
    km_message reply, reply_b;

    /* a routes a prompt: b's first decision on it sees the prefix predicted on a's choice. */
    uint32_t w = route_prompt(ca, "a-p", 1000, &reply)->chosen_worker;
    wait_predictions(&b, "applied", 1);
    const km_route_decision *d = route_prompt(cb, "b-p", 1000, &reply_b);
    cr_assert_eq(d->source, KM_PREDICTION_APPROX, "a shared prediction is labelled approx");
    cr_assert(d->has_owner);
    cr_assert_eq(d->owner_worker, w);
    cr_assert_eq(d->owner_depth, 3);
    cr_assert_eq(depth_of(d, w), 3);
    cr_assert_eq(depth_of(d, 1 - w), 0, "only a's chosen worker holds the prefix");

    /* a routes another prompt and its router overrides the choice: the lesson moves it on b. A
     * pool keeps its decisions' hashes for lessons once it has seen an override: one first. */
    for (int i = 0; i < 2; i++) {
        const km_route_decision *dq = route_prompt(ca, i ? "a-q" : "a-warm", i ? 2000 : 5000,
                                                   &reply);
        uint32_t wq = dq->chosen_worker;
        km_lifecycle_event ev = {.kind = KM_LIFECYCLE_DISPATCHED, .has_decision_id = true,
                                 .decision_id = dq->decision_id, .has_worker = true,
                                 .worker = 1 - wq};
        km_message ack;
        cr_assert_eq(km_client_lifecycle(ca, &ev, 1, 5000, &ack), KM_OK);
        cr_assert_eq(ack.ack.items[0].status, KM_OK);
        if (i)
            w = wq;
    }
    uint32_t moved = 1 - w;
    /* a's three decisions and its one lesson (b's decision was applied on a): four on b. */
    wait_predictions(&b, "applied", 4);
    d = route_prompt(cb, "b-q", 2000, &reply_b);
    cr_assert_eq(depth_of(d, moved), 3, "the lesson taught b the worker the router used");
    cr_assert_eq(depth_of(d, w), 3, "the decision's prediction stays until its TTL, as on a");
    cr_assert_eq(predictions_int(&b, "received"), 4);
    cr_assert_eq(predictions_int(&b, "refused"), 0);
    cr_assert_eq(predictions_int(&a, "sent"), 4);
    wait_predictions(&a, "applied", 2); /* b's two decisions reached a */
    cr_assert_eq(cluster_int(&b, "lost_messages"), 0);
    static char body[1 << 17];
    cr_assert_eq(http_get(km_server_http_port(b.server), "/metrics", body, sizeof body), 200);
    cr_assert(strstr(body, "kvmatch_cluster_predictions_total{outcome=\"applied\"} 4"), "%s", body);
    km_client_close(ca);
    km_client_close(cb);
    node_stop(&b);
    node_stop(&a);
}

static natsConnection *raw_connect(void)
{
    natsConnection *nc = NULL;
    natsStatus st = natsConnection_ConnectTo(&nc, nats.url);
    cr_assert_eq(st, NATS_OK, "raw connect: %s", natsStatus_GetText(st));
    return nc;
}

static void raw_publish(natsConnection *nc, const char *subject, const char *body)
{
    cr_assert_eq(natsConnection_PublishString(nc, subject, body), NATS_OK);
    cr_assert_eq(natsConnection_FlushTimeout(nc, 2000), NATS_OK);
}

Test(cluster_serve, predictions_for_event_fed_or_unknown_workers_and_bad_ones_change_nothing,
     .init = start_nats, .fini = stop_nats, .timeout = 60)
{
    /* c's workers are fed by KV events (endpoints nobody publishes on): observations win. */
    char ep0[64], ep1[64];
    snprintf(ep0, sizeof ep0, "tcp://127.0.0.1:%u", km_test_free_port());
    snprintf(ep1, sizeof ep1, "tcp://127.0.0.1:%u", km_test_free_port());
    static km_server_worker observed[2];
    observed[0] = (km_server_worker){.id = 0, .event_endpoint = ep0};
    observed[1] = (km_server_worker){.id = 1, .event_endpoint = ep1};
    node a, c;
    node_start(&a, "a");
    node_start_with(&c, "c", observed);
    km_client *ca = connect_to(&a), *cc = connect_to(&c);
    km_message reply;
    route_prompt(ca, "a-p", 3000, &reply);
    wait_predictions(&c, "ignored_observed", 1);
    const km_route_decision *d = route_prompt(cc, "c-p", 3000, &reply);
    cr_assert_eq(d->source, KM_PREDICTION_EVENTS);
    cr_assert(!d->has_owner, "a's prediction reached an event-fed worker");
    cr_assert_eq(predictions_int(&c, "applied"), 0);

    /* A prediction for a pool or a worker this instance does not have: refused, counted, said.
     * The made-up instance sends its full state first: a prediction before it is refused by the
     * cluster handle itself (no_state), before the service sees it. */
    natsConnection *nc = raw_connect();
    raw_publish(nc, "kvmatch.cluster.state.x",
                "{\"v\":1,\"kind\":\"state\",\"instance\":\"x\",\"incarnation\":1,\"seq\":1,"
                "\"workers\":[[0,0,0,0,0,0,0]],\"peers\":[]}");
    raw_publish(nc, "kvmatch.cluster.predict.x",
                "{\"v\":1,\"kind\":\"predict\",\"instance\":\"x\",\"incarnation\":1,\"seq\":2,"
                "\"pool\":\"elsewhere\",\"worker\":1,\"lesson\":false,"
                "\"hashes\":[\"0000000000000001\"]}");
    raw_publish(nc, "kvmatch.cluster.predict.x",
                "{\"v\":1,\"kind\":\"predict\",\"instance\":\"x\",\"incarnation\":1,\"seq\":3,"
                "\"pool\":\"main\",\"worker\":5,\"lesson\":false,"
                "\"hashes\":[\"0000000000000001\"]}");
    raw_publish(nc, "kvmatch.cluster.predict.x", "{\"v\":1,\"kind\":\"predict\"");
    wait_predictions(&a, "refused", 2);
    json_t *st = status_of(&a);
    json_t *cl = json_object_get(st, "cluster");
    cr_assert(strstr(json_string_value(json_object_get(json_object_get(cl, "predictions"),
                                                       "last_refusal")), "worker 5"));
    for (int t = 0; t < 200 && json_integer_value(json_object_get(json_object_get(cl, "refused"),
                                                                  "malformed")) < 1; t++) {
        json_decref(st);
        km_test_sleep_ms(10);
        st = status_of(&a);
        cl = json_object_get(st, "cluster");
    }
    cr_assert_eq(json_integer_value(json_object_get(json_object_get(cl, "refused"), "malformed")), 1);
    json_decref(st);
    d = route_prompt(ca, "a-after", 4000, &reply); /* a keeps serving */
    cr_assert_eq(d->status, KM_OK);
    natsConnection_Destroy(nc);
    km_client_close(ca);
    km_client_close(cc);
    node_stop(&c);
    node_stop(&a);
}

/* ---- worker-id mismatch between instances ------------------------------------------------------ */

Test(cluster_serve, instances_whose_workers_differ_leave_each_others_pool_out_and_say_so,
     .init = start_nats, .fini = stop_nats, .timeout = 60)
{
    /* d's worker 0 is another engine than a's (another name): the pool means other workers. */
    static km_server_worker renamed[2] = {{.id = 0, .name = "other-engine"}, {.id = 1}};
    node a, d;
    node_start(&a, "a");
    node_start_with(&d, "d", renamed);
    km_client *ca = connect_to(&a), *cd = connect_to(&d);
    km_message reply;
    route(ca, "a-1", &reply);
    route(ca, "a-2", &reply);
    route_prompt(ca, "a-3", 6000, &reply);
    json_t *st = NULL, *cl = NULL;
    for (int t = 0; t < 300; t++) {
        json_decref(st);
        st = status_of(&d);
        cl = json_object_get(st, "cluster");
        if (json_array_size(json_object_get(cl, "mismatched_pools")) == 1 &&
            json_integer_value(json_object_get(json_object_get(cl, "refused"),
                                               "worker_mismatch")) >= 4)
            break;
        km_test_sleep_ms(10);
    }
    json_t *mm = json_array_get(json_object_get(cl, "mismatched_pools"), 0);
    cr_assert_not_null(mm, "d lists no mismatched pool");
    cr_assert_str_eq(json_string_value(json_object_get(mm, "instance")), "a");
    cr_assert_str_eq(json_string_value(json_object_get(mm, "pool")), "main");
    /* The fingerprints are the documented ones (CLUSTER.md): XXH3 of the block size and the
     * workers' ids and names. */
    static const char ours[] = "block_size 4\n0 other-engine\n1 w1\n",
                      theirs[] = "block_size 4\n0 w0\n1 w1\n";
    char hex[2][17];
    snprintf(hex[0], sizeof hex[0], "%016llx",
             (unsigned long long)XXH3_64bits(ours, sizeof ours - 1));
    snprintf(hex[1], sizeof hex[1], "%016llx",
             (unsigned long long)XXH3_64bits(theirs, sizeof theirs - 1));
    cr_assert_str_eq(json_string_value(json_object_get(mm, "fingerprint")), hex[0]);
    cr_assert_str_eq(json_string_value(json_object_get(mm, "their_fingerprint")), hex[1]);
    /* the disagreement once (however many states came since), and a's three predictions */
    cr_assert_eq(json_integer_value(json_object_get(json_object_get(cl, "refused"),
                                                    "worker_mismatch")), 4);
    cr_assert_eq(predictions_int(&a, "sent"), 3);
    json_decref(st);
    /* a's requests and its predictions for the pool are left out of d's decisions. */
    const km_route_decision *dd = route(cd, "d-1", &reply);
    cr_assert_eq(in_flight(dd, 0) + in_flight(dd, 1), 0, "a's load on the pool reached d");
    cr_assert(!dd->has_owner, "a's prediction reached d");
    cr_assert_eq(predictions_int(&d, "applied"), 0);
    static char body[1 << 17];
    cr_assert_eq(http_get(km_server_http_port(d.server), "/metrics", body, sizeof body), 200);
    cr_assert(strstr(body, "\nkvmatch_cluster_mismatched_pools 1"), "%s", body);
    cr_assert(strstr(body, "kvmatch_cluster_refused_messages_total{reason=\"worker_mismatch\"}"),
              "%s", body);
    /* a sees the same disagreement from its side. */
    for (int t = 0; t < 300; t++) {
        st = status_of(&a);
        size_t n = json_array_size(json_object_get(json_object_get(st, "cluster"),
                                                   "mismatched_pools"));
        json_decref(st);
        if (n == 1)
            break;
        cr_assert(t < 299, "a lists no mismatched pool");
        km_test_sleep_ms(10);
    }
    km_client_close(ca);
    km_client_close(cd);
    node_stop(&d);
    node_stop(&a);
}

/* The decision record of request `id` on n (records are written asynchronously: polled). */
static json_t *decision_record_of(node *n, const char *id)
{
    char needle[96];
    snprintf(needle, sizeof needle, "\"request_id\":\"%s\"", id);
    for (int tries = 0; tries < 200; tries++) {
        FILE *f = fopen(n->records, "r");
        char *line = NULL;
        size_t cap = 0;
        json_t *found = NULL;
        while (f && !found && getline(&line, &cap, f) > 0)
            if (strstr(line, needle) && strstr(line, "\"type\":\"decision\""))
                found = json_loads(line, 0, NULL);
        free(line);
        if (f)
            fclose(f);
        if (found)
            return found;
        km_test_sleep_ms(20);
    }
    cr_assert_fail("no decision record of %s in %s", id, n->records);
    return NULL;
}

/* The queued_depth_blocks of worker `name` among a decision record's candidates. */
static json_int_t queued_depth_of(json_t *rec, const char *name)
{
    json_t *cands = json_object_get(rec, "candidates"), *c;
    size_t i;
    json_array_foreach(cands, i, c)
        if (!strcmp(json_string_value(json_object_get(c, "worker")), name))
            return json_integer_value(json_object_get(c, "queued_depth_blocks"));
    cr_assert_fail("worker %s not among the candidates", name);
    return -1;
}

static void finish(km_client *c, const char *id, km_lifecycle_kind kind)
{
    km_lifecycle_event ev = {.kind = kind, .request_id = id, .outcome = KM_OUTCOME_CANCELLED};
    km_message ack;
    cr_assert_eq(km_client_lifecycle(c, &ev, 1, 5000, &ack), KM_OK);
    cr_assert_eq(ack.ack.items[0].status, KM_OK, "%s",
                 ack.ack.items[0].message ? ack.ack.items[0].message : "");
}

/* Route the prompt from b until its decision's candidate `worker` shows queued depth `want`
 * (a's changes reach b within a publish and a delivery); each probe is finished at once. */
static json_int_t probe_queued_depth(node *b, km_client *cb, uint32_t worker, json_int_t want)
{
    char id[32], name[8];
    snprintf(name, sizeof name, "w%u", worker);
    json_int_t got = -1;
    km_message reply;
    for (int t = 0; t < 100 && got != want; t++) {
        snprintf(id, sizeof id, "b-q%lld-%d", (long long)want, t);
        route_prompt(cb, id, 7000, &reply);
        json_t *rec = decision_record_of(b, id);
        got = queued_depth_of(rec, name);
        json_decref(rec);
        finish(cb, id, KM_LIFECYCLE_FINISHED);
        if (got != want)
            km_test_sleep_ms(20);
    }
    return got;
}

Test(cluster_serve, ttft_candidates_count_the_other_instances_queued_prefills,
     .init = start_nats, .fini = stop_nats, .timeout = 90)
{
    /* Workers fed by KV events nobody publishes: no worker holds the prompt, so a candidate's
     * queued depth is what the queued prefills promise. */
    char ep0[64], ep1[64];
    snprintf(ep0, sizeof ep0, "tcp://127.0.0.1:%u", km_test_free_port());
    snprintf(ep1, sizeof ep1, "tcp://127.0.0.1:%u", km_test_free_port());
    static km_server_worker observed[2];
    observed[0] = (km_server_worker){.id = 0, .event_endpoint = ep0};
    observed[1] = (km_server_worker){.id = 1, .event_endpoint = ep1};
    g_policy = KM_POLICY_TTFT;
    node a, b;
    node_start_with(&a, "a", observed);
    node_start_with(&b, "b", observed);
    g_policy = KM_POLICY_LEAST_LOAD;
    km_client *ca = connect_to(&a), *cb = connect_to(&b);
    km_message reply;
    const km_route_decision *d = route_prompt(ca, "a-1", 7000, &reply);
    uint32_t wa = d->chosen_worker;
    cr_assert_eq(d->chosen_depth, 0);
    /* a's request promises the prompt's 3 blocks on wa until its FIRST_TOKEN. */
    cr_assert_eq(probe_queued_depth(&b, cb, wa, 3), 3,
                 "b's candidate w%u does not count a's queued prefill", wa);
    cr_assert_eq(probe_queued_depth(&b, cb, 1 - wa, 0), 0, "the other worker has no promise");
    finish(ca, "a-1", KM_LIFECYCLE_FIRST_TOKEN);
    cr_assert_eq(probe_queued_depth(&b, cb, wa, 0), 0,
                 "a's prefill ran (FIRST_TOKEN): its promise still counts on b");
    finish(ca, "a-1", KM_LIFECYCLE_FINISHED);
    km_client_close(ca);
    km_client_close(cb);
    node_stop(&b);
    node_stop(&a);
}

/* A request whose queued prefill promises more blocks than a work row carries: the instance
 * sends the leading KM_CLUSTER_WORK_MAX_QUEUED and counts the rest in work.truncated. */
Test(cluster_serve, a_promise_longer_than_a_work_row_is_cut_and_counted, .init = start_nats,
     .fini = stop_nats, .timeout = 90)
{
    enum { BLOCKS = KM_CLUSTER_WORK_MAX_QUEUED + 3616 };
    g_policy = KM_POLICY_TTFT;
    node a;
    node_start(&a, "a");
    g_policy = KM_POLICY_LEAST_LOAD;
    km_client *ca = connect_to(&a);
    static uint64_t hashes[BLOCKS];
    for (uint32_t i = 0; i < BLOCKS; i++)
        hashes[i] = 0x100000 + i;
    km_route_request r;
    memset(&r, 0, sizeof r);
    r.request_id = "long-1";
    r.pool = "main";
    r.input = KM_ROUTE_INPUT_HASHES;
    r.hashes = hashes;
    r.n_hashes = BLOCKS;
    km_message reply;
    cr_assert_eq(km_client_route(ca, &r, 1, 5000, &reply), KM_OK, "%s",
                 km_client_last_error(ca));
    cr_assert_eq(reply.decision.decisions[0].status, KM_OK);
    json_int_t truncated = 0;
    for (int t = 0; t < 200 && truncated == 0; t++) {
        json_t *st = status_of(&a);
        json_t *work = json_object_get(json_object_get(st, "cluster"), "work");
        truncated = json_integer_value(json_object_get(work, "truncated"));
        json_decref(st);
        if (truncated == 0)
            km_test_sleep_ms(10);
    }
    cr_assert_geq(truncated, BLOCKS - KM_CLUSTER_WORK_MAX_QUEUED, "work.truncated %lld",
                  (long long)truncated);
    km_client_close(ca);
    node_stop(&a);
}
