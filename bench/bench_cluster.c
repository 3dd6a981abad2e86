/* `kvmatch bench cluster`: active-work updates through NATS between kvmatch instances (km_cluster
 * handles in this process, one NATS connection each, through a nats-server this benchmark starts
 * on a free loopback port).
 *
 * For 2 and 4 instances: every instance publishes paced changes (lag phase, --rate per instance,
 * default 2,000/s: the visibility lag from one instance's publish to another's applied view, one
 * host's monotonic clock, p50 / p99), then
 * as fast as it can (throughput phase: updates/s published by all instances together and applied
 * by every other one); lost messages detected on loopback; then one instance is destroyed and
 * created again, and the time until its create returned with the others' active work in its view
 * is restart_ready_s. Before each lag phase the same paced publishing runs through plain NATS
 * connections with nothing of kvmatch between (floor_lag_*): what the machine and nats-server cost
 * on their own, in the same run. A last run injects loss (one change in 50 not sent) and reports
 * how many of the injected losses were detected. */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <jansson.h>
#include <nats/nats.h>

#include "bench_common.h"
#include "cli/commands.h"
#include "cli/options.h"
#include "kvmatch/cluster.h"
#include "sim/broker.h"

#define MAX_INSTANCES 4
#define WORKERS 64u

static uint64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * UINT64_C(1000000000) + (uint64_t)ts.tv_nsec;
}

/* ---- instances and what they observe ---------------------------------------------------------- */

/* One receiving instance: the lag samples it took and the newest update index it saw from each
 * sender (a state message repeats rows already seen: only a newer index is a new update). */
typedef struct receiver {
    int self;
    double *lag_ms;
    size_t n_lag, cap_lag;
    bool sampling;
    _Atomic uint64_t newest[MAX_INSTANCES];
} receiver;

static receiver receivers[MAX_INSTANCES];
static km_cluster *inst[MAX_INSTANCES];

static void on_applied(void *user, const char *instance, uint32_t worker,
                       const km_active_load *load)
{
    (void)worker;
    receiver *r = user;
    int from = instance[6] - '0'; /* "bench-N" */
    if (from < 0 || from >= MAX_INSTANCES)
        return;
    uint64_t k = load->active_decode_blocks;
    if (k <= atomic_load(&r->newest[from]))
        return;
    atomic_store(&r->newest[from], k);
    if (r->sampling && r->n_lag < r->cap_lag)
        r->lag_ms[r->n_lag++] = (double)(mono_ns() - load->pending_prefill_tokens) / 1e6;
}

static int make_instance(int i, const char *url, uint32_t drop_one_in, double *took_s)
{
    km_cluster_config cfg;
    km_cluster_config_init(&cfg);
    char id[32];
    snprintf(id, sizeof id, "bench-%d", i);
    cfg.url = url;
    cfg.instance = id;
    cfg.max_workers = WORKERS;
    cfg.heartbeat_ms = 200;
    cfg.expire_ms = 5000;
    cfg.drop_one_in = drop_one_in;
    cfg.on_applied = on_applied;
    cfg.on_applied_user = &receivers[i];
    char why[256];
    double t0 = km_bench_now_s();
    int rc = km_cluster_create(&cfg, &inst[i], why, sizeof why);
    if (took_s)
        *took_s = km_bench_now_s() - t0;
    if (rc != KM_OK)
        fprintf(stderr, "kvmatch bench cluster: instance %d: %s\n", i, why);
    return rc;
}

/* Publisher threads: instance i publishes updates first .. first + count - 1, each a new value
 * of worker k % WORKERS carrying its index and its send time, pacing_ns apart (0: at once). */
typedef struct publisher {
    int i;
    uint64_t first, count, pacing_ns;
} publisher;

/* Sleep until *next (monotonic ns), then move it pacing_ns on; nothing when pacing_ns is 0. */
static void pace(uint64_t *next, uint64_t pacing_ns)
{
    if (!pacing_ns)
        return;
    struct timespec ts = {(time_t)(*next / UINT64_C(1000000000)), (long)(*next % UINT64_C(1000000000))};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
    }
    *next += pacing_ns;
}

static void *publish_main(void *arg)
{
    publisher *p = arg;
    uint64_t next = mono_ns();
    for (uint64_t k = p->first; k < p->first + p->count; k++) {
        pace(&next, p->pacing_ns);
        km_active_load l = {k % 97 + 1, 0, mono_ns(), k, k, 0};
        km_cluster_publish_load(inst[p->i], (uint32_t)(k % WORKERS), &l);
    }
    return NULL;
}

static void run_publishers(int n, uint64_t first, uint64_t count, uint64_t pacing_ns)
{
    pthread_t t[MAX_INSTANCES];
    publisher p[MAX_INSTANCES];
    for (int i = 0; i < n; i++) {
        p[i] = (publisher){i, first, count, pacing_ns};
        pthread_create(&t[i], NULL, publish_main, &p[i]);
    }
    for (int i = 0; i < n; i++)
        pthread_join(t[i], NULL);
}

/* Wait until every instance saw update `last` of every other (or timeout_s). */
static bool wait_all_seen(int n, uint64_t last, double timeout_s)
{
    double end = km_bench_now_s() + timeout_s;
    for (;;) {
        bool all = true;
        for (int r = 0; r < n && all; r++)
            for (int s = 0; s < n && all; s++)
                all = s == r || atomic_load(&receivers[r].newest[s]) >= last;
        if (all)
            return true;
        if (km_bench_now_s() > end)
            return false;
        struct timespec ts = {0, 200000};
        nanosleep(&ts, NULL);
    }
}

static double percentile(double *v, size_t n, double q)
{
    if (!n)
        return NAN;
    km_bench_sort(v, n);
    size_t at = (size_t)ceil(q * (double)n) - 1;
    return v[at < n ? at : n - 1];
}

/* ---- the floor: the same publishing through plain NATS connections ---------------------------- */

/* A change message's size (docs/CLUSTER.md: one worker's row is about 130 bytes of JSON). */
#define FLOOR_MESSAGE_BYTES 128

typedef struct floor_conn {
    int self;
    natsConnection *nc;
    natsSubscription *sub;
    uint64_t count, pacing_ns;
    double *lag_ms; /* written by the subscription's delivery thread only */
    size_t n_lag, cap_lag;
    _Atomic uint64_t received;
} floor_conn;

static void floor_on_message(natsConnection *nc, natsSubscription *sub, natsMsg *msg, void *user)
{
    (void)nc;
    (void)sub;
    floor_conn *f = user;
    const char *data = natsMsg_GetData(msg);
    char *end = NULL;
    uint64_t sent_ns = data ? strtoull(data, &end, 10) : 0;
    if (end && end != data && f->n_lag < f->cap_lag)
        f->lag_ms[f->n_lag++] = (double)(mono_ns() - sent_ns) / 1e6;
    atomic_fetch_add(&f->received, 1);
    natsMsg_Destroy(msg);
}

static void *floor_publish_main(void *arg)
{
    floor_conn *f = arg;
    char subject[32], body[FLOOR_MESSAGE_BYTES];
    snprintf(subject, sizeof subject, "kvmbench.floor.%d", f->self);
    uint64_t next = mono_ns();
    for (uint64_t k = 0; k < f->count; k++) {
        pace(&next, f->pacing_ns);
        memset(body, ' ', sizeof body);
        int len = snprintf(body, sizeof body, "%" PRIu64 " %" PRIu64, mono_ns(), k);
        body[len] = ' ';
        natsConnection_Publish(f->nc, subject, body, (int)sizeof body);
    }
    natsConnection_Flush(f->nc);
    return NULL;
}

/* n plain connections, each publishing `count` messages at `rate`/s and reading the others'
 * (no echo of its own). The p50 / p99 of every delivery's lag go to *p50 / *p99; false when a
 * connection failed or not every message arrived within 10 s. */
static bool floor_lag(const char *url, int n, uint64_t count, uint64_t rate, double *p50, double *p99)
{
    floor_conn f[MAX_INSTANCES];
    memset(f, 0, sizeof f);
    bool ok = true;
    for (int i = 0; i < n && ok; i++) {
        natsOptions *opts = NULL;
        f[i].self = i;
        f[i].count = count;
        f[i].pacing_ns = UINT64_C(1000000000) / rate;
        f[i].cap_lag = (size_t)count * (size_t)n;
        f[i].lag_ms = malloc(f[i].cap_lag * sizeof(double));
        ok = f[i].lag_ms && natsOptions_Create(&opts) == NATS_OK &&
             natsOptions_SetURL(opts, url) == NATS_OK &&
             natsOptions_SetNoEcho(opts, true) == NATS_OK &&
             natsConnection_Connect(&f[i].nc, opts) == NATS_OK &&
             natsConnection_Subscribe(&f[i].sub, f[i].nc, "kvmbench.floor.*", floor_on_message,
                                      &f[i]) == NATS_OK &&
             natsSubscription_SetPendingLimits(f[i].sub, -1, -1) == NATS_OK &&
             natsConnection_Flush(f[i].nc) == NATS_OK;
        natsOptions_Destroy(opts);
        if (!ok)
            fprintf(stderr, "kvmatch bench cluster: floor connection %d to %s failed: %s\n", i, url,
                    nats_GetLastError(NULL));
    }
    if (ok) {
        pthread_t t[MAX_INSTANCES];
        for (int i = 0; i < n; i++)
            pthread_create(&t[i], NULL, floor_publish_main, &f[i]);
        for (int i = 0; i < n; i++)
            pthread_join(t[i], NULL);
        uint64_t want = count * (uint64_t)(n - 1);
        double end = km_bench_now_s() + 10;
        for (int i = 0; i < n && ok; i++)
            while (atomic_load(&f[i].received) < want && (ok = km_bench_now_s() < end)) {
                struct timespec ts = {0, 200000};
                nanosleep(&ts, NULL);
            }
    }
    for (int i = 0; i < n; i++) {
        /* Unsubscribed before the samples are read: no delivery runs after this. */
        if (f[i].sub) {
            natsSubscription_Unsubscribe(f[i].sub);
            natsSubscription_Destroy(f[i].sub);
        }
        if (f[i].nc)
            natsConnection_Destroy(f[i].nc);
    }
    size_t total = 0;
    for (int i = 0; i < n; i++)
        total += f[i].n_lag;
    double *all = malloc((total ? total : 1) * sizeof *all);
    size_t at = 0;
    for (int i = 0; i < n && all; i++) {
        memcpy(all + at, f[i].lag_ms, f[i].n_lag * sizeof *all);
        at += f[i].n_lag;
    }
    ok = ok && all;
    if (ok) {
        *p50 = percentile(all, total, 0.50);
        *p99 = percentile(all, total, 0.99);
    }
    free(all);
    for (int i = 0; i < n; i++)
        free(f[i].lag_ms);
    return ok;
}

static void destroy_all(int n)
{
    for (int i = 0; i < n; i++) {
        km_cluster_destroy(inst[i]);
        inst[i] = NULL;
        free(receivers[i].lag_ms);
    }
    memset(receivers, 0, sizeof receivers);
}

/* One row: n instances. */
static json_t *run_instances(const char *url, int n, uint64_t lag_updates, uint64_t tp_updates,
                             uint64_t rate, int json)
{
    double floor_p50 = NAN, floor_p99 = NAN;
    bool floor_ok = floor_lag(url, n, lag_updates, rate, &floor_p50, &floor_p99);
    memset(receivers, 0, sizeof receivers);
    for (int i = 0; i < n; i++) {
        receivers[i].self = i;
        receivers[i].cap_lag = (size_t)lag_updates * (size_t)n;
        receivers[i].lag_ms = malloc(receivers[i].cap_lag * sizeof(double));
        if (!receivers[i].lag_ms || make_instance(i, url, 0, NULL) != KM_OK) {
            destroy_all(n);
            return NULL;
        }
    }
    /* Lag: `rate` updates/s per instance. */
    for (int i = 0; i < n; i++)
        receivers[i].sampling = true;
    run_publishers(n, 1, lag_updates, UINT64_C(1000000000) / rate);
    bool lag_ok = wait_all_seen(n, lag_updates, 10);
    for (int i = 0; i < n; i++)
        receivers[i].sampling = false;
    size_t total = 0;
    for (int i = 0; i < n; i++)
        total += receivers[i].n_lag;

    double *all = malloc((total ? total : 1) * sizeof *all);
    size_t at = 0;
    for (int i = 0; i < n; i++) {
        memcpy(all + at, receivers[i].lag_ms, receivers[i].n_lag * sizeof *all);
        at += receivers[i].n_lag;
    }
    double p50 = percentile(all, total, 0.50), p99 = percentile(all, total, 0.99);
    free(all);
    /* Throughput: as fast as each instance can publish. */
    uint64_t first = lag_updates + 1;
    double t0 = km_bench_now_s();
    run_publishers(n, first, tp_updates, 0);
    bool tp_ok = wait_all_seen(n, first + tp_updates - 1, 30);
    double elapsed = km_bench_now_s() - t0;
    uint64_t lost = 0, sent = 0, failures = 0;
    for (int i = 0; i < n; i++) {
        km_cluster_stats st;
        km_cluster_get_stats(inst[i], &st);
        lost += st.lost_messages;
        sent += st.sent;
        failures += st.publish_failures;
    }
    /* Restart: instance 0 goes and comes back; the others' last values must be in its view. */
    km_cluster_destroy(inst[0]);
    inst[0] = NULL;
    memset((void *)receivers[0].newest, 0, sizeof receivers[0].newest);
    double ready_s = NAN;
    bool restart_ok = make_instance(0, url, 0, &ready_s) == KM_OK;
    uint64_t last = first + tp_updates - 1;
    for (int s = 1; s < n && restart_ok; s++)
        restart_ok = atomic_load(&receivers[0].newest[s]) >= last;
    km_cluster_stats st0;
    if (restart_ok)
        km_cluster_get_stats(inst[0], &st0);
    json_t *row = json_object();
    json_object_set_new(row, "instances", json_integer(n));
    json_object_set_new(row, "updates_per_s",
                        tp_ok ? json_real(km_bench_round_to((double)(n * tp_updates) / elapsed, 1))
                              : json_null());
    json_object_set_new(row, "applied_per_s",
                        tp_ok ? json_real(km_bench_round_to(
                                    (double)((uint64_t)n * (uint64_t)(n - 1) * tp_updates) / elapsed, 1))
                              : json_null());
    json_object_set_new(row, "lag_p50_ms", lag_ok ? json_real(km_bench_round_to(p50, 0.001)) : json_null());
    json_object_set_new(row, "lag_p99_ms", lag_ok ? json_real(km_bench_round_to(p99, 0.001)) : json_null());
    json_object_set_new(row, "lag_samples", json_integer((json_int_t)total));
    json_object_set_new(row, "floor_lag_p50_ms",
                        floor_ok ? json_real(km_bench_round_to(floor_p50, 0.001)) : json_null());
    json_object_set_new(row, "floor_lag_p99_ms",
                        floor_ok ? json_real(km_bench_round_to(floor_p99, 0.001)) : json_null());
    json_object_set_new(row, "lost_detected", json_integer((json_int_t)lost));
    json_object_set_new(row, "messages_sent", json_integer((json_int_t)sent));
    json_object_set_new(row, "publish_failures", json_integer((json_int_t)failures));
    json_object_set_new(row, "restart_ready_s",
                        restart_ok ? json_real(km_bench_round_to(ready_s, 0.0001)) : json_null());
    json_object_set_new(row, "restart_sync_peers",
                        json_integer(restart_ok ? (json_int_t)st0.sync_peers : 0));
    if (!json)
        printf("%9d %14.0f %11.3f %11.3f %11.3f %11.3f %14" PRIu64 " %16.4f\n", n,
               tp_ok ? (double)(n * tp_updates) / elapsed : NAN, p50, p99, floor_p50, floor_p99,
               lost, ready_s);
    destroy_all(n);
    return row;
}

/* Injected loss between two instances: every one detected? */
static json_t *run_loss(const char *url, uint64_t updates)
{
    memset(receivers, 0, sizeof receivers);
    if (make_instance(0, url, 50, NULL) != KM_OK || make_instance(1, url, 0, NULL) != KM_OK) {
        destroy_all(2);
        return NULL;
    }
    publisher p = {0, 1, updates, 0};
    publish_main(&p);
    km_cluster_stats a, b;
    /* The losses after the last delivered change show at the next full state. */
    for (int t = 0; t < 200; t++) {
        km_cluster_get_stats(inst[0], &a);
        km_cluster_get_stats(inst[1], &b);
        if (b.lost_messages >= a.publish_failures)
            break;
        struct timespec ts = {0, 10000000};
        nanosleep(&ts, NULL);
    }
    json_t *o = json_object();
    json_object_set_new(o, "updates", json_integer((json_int_t)updates));
    json_object_set_new(o, "drop_one_in", json_integer(50));
    json_object_set_new(o, "injected", json_integer((json_int_t)a.publish_failures));
    json_object_set_new(o, "detected", json_integer((json_int_t)b.lost_messages));
    destroy_all(2);
    return o;
}

int km_bench_cluster_main(int argc, char **argv)
{
    int json = 0, quick = 0;
    uint64_t rate = 2000;
    enum { OPT_JSON = 256, OPT_QUICK, OPT_RATE };
    static const struct option options[] = {
        {"help", no_argument, NULL, 'h'},
        {"json", no_argument, NULL, OPT_JSON},
        {"quick", no_argument, NULL, OPT_QUICK},
        {"rate", required_argument, NULL, OPT_RATE},
        {NULL, 0, NULL, 0},
    };
    km_cli_getopt_begin(argv, "bench cluster");
    int opt;
    while ((opt = getopt_long(argc, argv, "h", options, NULL)) != -1) {
        switch (opt) {
        case 'h':
            printf("usage: kvmatch bench cluster [--json] [--quick] [--rate N]\n"
                   "  --rate N  updates/s per instance in the lag phase, 1..100000 (default 2000)\n");
            return KM_EXIT_OK;
        case OPT_JSON:
            json = 1;
            break;
        case OPT_QUICK:
            quick = 1;
            break;
        case OPT_RATE:
            if (!km_cli_u64("bench cluster", "rate", optarg, 1, 100000, &rate))
                return KM_EXIT_USAGE;
            break;
        default:
            return km_cli_usage_error("bench cluster");
        }
    }
    if (optind < argc) {
        fprintf(stderr, "kvmatch bench cluster: unexpected argument \"%s\"\n", argv[optind]);
        return km_cli_usage_error("bench cluster");
    }
    char why[256];
    km_sim_broker broker;
    if (km_sim_broker_start(&broker, why, sizeof why) != KM_OK) {
        fprintf(stderr, "kvmatch bench cluster: cannot start nats-server: %s\n", why);
        return 1;
    }
    const char *url = broker.url;
    uint64_t lag_updates = quick ? 500 : 2000, tp_updates = quick ? 20000 : 100000;
    json_t *root = json_object();
    json_object_set_new(root, "benchmark", json_string("cluster"));
    char command[96];
    snprintf(command, sizeof command, "kvmatch bench cluster --json%s%s", quick ? " --quick" : "",
             rate != 2000 ? " --rate N" : "");
    json_object_set_new(root, "command", json_string(command));
    json_object_set_new(root, "machine", km_bench_machine_json());
    json_object_set_new(root, "lag_updates_per_instance", json_integer((json_int_t)lag_updates));
    json_object_set_new(root, "lag_updates_per_instance_per_s", json_integer((json_int_t)rate));
    json_object_set_new(root, "throughput_updates_per_instance", json_integer((json_int_t)tp_updates));
    json_t *results = json_array();
    if (!json)
        printf("%9s %14s %11s %11s %11s %11s %14s %16s\n", "instances", "updates/s", "lag p50 ms",
               "lag p99 ms", "floor p50", "floor p99", "lost detected", "restart ready s");
    int status = 0;
    double restart4 = NAN;
    const int counts[] = {2, 4};
    for (size_t c = 0; c < 2; c++) {
        json_t *row = run_instances(url, counts[c], lag_updates, tp_updates, rate, json);
        if (!row) {
            status = 1;
            break;
        }
        if (counts[c] == 4)
            restart4 = json_real_value(json_object_get(row, "restart_ready_s"));
        json_array_append_new(results, row);
    }
    json_object_set_new(root, "results", results);
    json_object_set_new(root, "restart_ready_s", isnan(restart4) ? json_null() : json_real(restart4));
    json_t *loss = status ? NULL : run_loss(url, quick ? 5000 : 20000);
    json_object_set_new(root, "injected_loss", loss ? loss : json_null());
    km_sim_broker_stop(&broker);
    if (json) {
        char *text = json_dumps(root, JSON_INDENT(2) | JSON_REAL_PRECISION(10));
        if (text)
            puts(text);
        free(text);
    } else if (loss) {
        printf("injected loss: %" PRIu64 " of %" PRIu64 " detected\n",
               (uint64_t)json_integer_value(json_object_get(loss, "detected")),
               (uint64_t)json_integer_value(json_object_get(loss, "injected")));
    }
    json_decref(root);
    return status;
}
