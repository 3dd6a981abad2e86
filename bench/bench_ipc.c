/* SPDX-License-Identifier: Apache-2.0 */
/* `kvmatch bench ipc`: decisions per second and round-trip latency of a real `kvmatch serve`,
 * started by this command as a child process on a temporary Unix socket (CPU backend, records off
 * unless --records), driven over 1, 16 and 128 connections with single-route and batched frames.
 *
 * Workload: a pool of 16 approximate-mode workers (block size 16, policy kv). Each route carries
 * the chain hashes of a prompt drawn from 256 shared prefixes (system prompts / documents) of 8..40
 * blocks plus 2..24 unique blocks, so overlap, policy and approximate-mode learning all do real
 * work. Hashes rather than token ids: the router sends what it already has (docs/PROTOCOL.md).
 *
 * Closed loop: each connection keeps `window` frames outstanding; decisions/s counts routes
 * answered per second; the round trip is send-to-reply per frame. Open loop (--rate): frames are
 * sent on a fixed schedule across the connections regardless of replies (the p99 target is
 * measured this way, so a slow reply delays nothing but itself). One driver thread polls every
 * connection. Two baselines, measured in the same run on the same schedule: `ping` (kvmatch's
 * transport alone: a report the loop thread answers itself) and `echo` (no kvmatch at all: a
 * child that echoes raw frames; run_echo_phase).
 *
 * Client languages (--clients DIR): each executable in DIR is another language's client driver
 * (scripts/bench-clients.sh builds them from clients/), run as `DIR/NAME ADDRESS SCHEDULE PER_FRAME
 * WINDOW SECONDS` against the same server on the schedule of the C client's one-connection closed
 * loop phases (window 4, single and batched frames, prompts of the repeat workload from the same
 * generator, written to SCHEDULE one per line); it prints one JSON line (decisions_per_s,
 * rtt_p50_us, rtt_p99_us, frames, errors), shown beside the C client's row of the same run
 * (run_client_phases). Output: docs/BENCHMARKS.md "IPC". */

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <sys/epoll.h>
#include <sys/prctl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>

#include "base/array.h"
#include "bench_common.h"
#include "cli/options.h"
#include "kvmatch/kvmatch.h"

#define WORKERS 16
#define BLOCK 16
#define PREFIXES 256
#define BATCH_ROUTES 64

typedef struct workload {
    uint64_t prefix[PREFIXES][40];
    uint32_t prefix_len[PREFIXES];
    uint64_t rng;
    uint64_t unique;
    bool fresh; /* each request adds 2..24 blocks never seen before (the index learns them) */
} workload;

static uint64_t next_rand(uint64_t *s)
{
    uint64_t z = (*s += UINT64_C(0x9e3779b97f4a7c15));
    z = (z ^ (z >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
    z = (z ^ (z >> 27)) * UINT64_C(0x94d049bb133111eb);
    return z ^ (z >> 31);
}

static void workload_init(workload *w)
{
    w->rng = 42;
    for (int p = 0; p < PREFIXES; p++) {
        w->prefix_len[p] = 8 + (uint32_t)(next_rand(&w->rng) % 33);
        uint64_t parent = 0;
        for (uint32_t i = 0; i < w->prefix_len[p]; i++) {
            uint64_t local = km_hash_remap(next_rand(&w->rng));
            w->prefix[p][i] = parent ? km_hash_chain_step(parent, local) : km_hash_chain_root(local);
            parent = w->prefix[p][i];
        }
    }
}

/* One request's hashes into out (capacity 64); returns the count. Popular prefixes are hot
 * (p = r^2 skew). */
static uint32_t workload_request(workload *w, uint64_t *out)
{
    uint64_t r = next_rand(&w->rng) % 1000;
    int p = (int)(r * r * PREFIXES / 1000000);
    uint32_t n = w->prefix_len[p];
    memcpy(out, w->prefix[p], n * sizeof *out);
    if (!w->fresh) {
        /* Repeat: a prefix of a known prompt, cut at a random block (a request population whose
         * blocks the index already knows after the warm-up). */
        return 1 + (uint32_t)(next_rand(&w->rng) % n);
    }
    uint32_t extra = 2 + (uint32_t)(next_rand(&w->rng) % 23);
    uint64_t parent = out[n - 1];
    for (uint32_t i = 0; i < extra; i++) {
        uint64_t local = km_hash_remap(next_rand(&w->rng) ^ ++w->unique);
        out[n] = km_hash_chain_step(parent, local);
        parent = out[n++];
    }
    return n;
}

typedef struct conn_state {
    km_client *c;
    uint32_t outstanding;
    double *sent_at; /* by id % ring */
    uint32_t ring;
    uint64_t routes_per_frame;
} conn_state;

/* Server CPU per thread name (read_thread_times). */
#define MAX_THREAD_NAMES 8
typedef struct thread_times {
    double total;
    unsigned n;
    char name[MAX_THREAD_NAMES][16];
    double ns[MAX_THREAD_NAMES];
} thread_times;

typedef struct phase_result {
    double decisions_per_s;
    double rtt_p50_us, rtt_p99_us;
    uint64_t frames, routes, errors;
    /* Where the two cores went during the measured interval: CPU time per answered route of the
     * server (all its threads; < 0 when unknown: --connect) and of this driver, and the machine's
     * idle and stolen shares (/proc/stat). Throughput on this shared VM moves with the steal and
     * the wake-ups; CPU per decision is what a change to the code moves. */
    double server_cpu_us, driver_cpu_us, idle_pct, steal_pct;
    thread_times server_threads; /* per thread name: us per answered route */
    double records_dropped_per_s; /* records the server's writer refused (queue full); < 0: off */
    double elapsed_s;             /* the measured interval */
} phase_result;

/* Round trips, in microseconds, kept across the rounds of a phase (--rounds). */
typedef struct rtt_samples {
    double *v;
    size_t n, cap;
} rtt_samples;

#define RTT_SAMPLES_MAX ((size_t)1 << 24)

/* Appends n round trips to keep (NULL: nothing); past RTT_SAMPLES_MAX the rest are not kept.
 * Returns KM_ERR_OUT_OF_MEMORY when the samples cannot grow. */
static int rtt_keep(rtt_samples *keep, const double *rtt, size_t n)
{
    if (!keep)
        return KM_OK;
    if (n > RTT_SAMPLES_MAX - keep->n)
        n = RTT_SAMPLES_MAX - keep->n;
    if (KM_ARRAY_GROW(keep->v, keep->cap, keep->n + n, 4096) != KM_OK)
        return KM_ERR_OUT_OF_MEMORY;
    memcpy(keep->v + keep->n, rtt, n * sizeof *rtt);
    keep->n += n;
    return KM_OK;
}

static bool g_records; /* the server writes records: count what its writer drops */

/* The server's count of dropped records (STATUS), or -1. */
static double records_dropped(const char *addr)
{
    if (!g_records)
        return -1;
    km_client *c = NULL;
    if (km_client_connect(addr, 2000, &c, NULL, 0) != KM_OK)
        return -1;
    km_message m;
    double dropped = -1;
    if (km_client_status(c, 2000, &m) == KM_OK && m.type == KM_MESSAGE_STATUS_REPLY)
        dropped = (double)m.status_reply.records_dropped;
    km_client_close(c);
    return dropped;
}

/* The process being measured (the child server), or 0. */
static pid_t g_server_pid;

/* Run time of every thread of `pid`, in ns (/proc/PID/task/TID/schedstat: the first field is
 * the time spent on a CPU), in total and per thread name (/proc/PID/task/TID/comm: the server
 * names its threads km-scheduler, km-records, ...; the main thread, which runs the event loop,
 * is "loop").
 * -1 when it cannot be read. */

static void read_thread_times(pid_t pid, thread_times *t)
{
    memset(t, 0, sizeof *t);
    t->total = -1;
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/task", (int)pid);
    DIR *d = opendir(path);
    if (!d)
        return;
    t->total = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.')
            continue;
        char file[128], name[16] = "?";
        snprintf(file, sizeof file, "/proc/%d/task/%.20s/comm", (int)pid, e->d_name);
        FILE *f = fopen(file, "r");
        if (atoi(e->d_name) == (int)pid) {
            snprintf(name, sizeof name, "loop"); /* the main thread runs the event loop */
        } else if (f) {
            if (fgets(name, sizeof name, f))
                name[strcspn(name, "\n")] = '\0';
        }
        if (f)
            fclose(f);
        snprintf(file, sizeof file, "/proc/%d/task/%.20s/schedstat", (int)pid, e->d_name);
        f = fopen(file, "r");
        unsigned long long ns;
        if (f && fscanf(f, "%llu", &ns) == 1) {
            t->total += (double)ns;
            unsigned k = 0;
            while (k < t->n && strcmp(t->name[k], name) != 0)
                k++;
            if (k == t->n && t->n < MAX_THREAD_NAMES)
                snprintf(t->name[t->n++], sizeof t->name[0], "%s", name);
            if (k < t->n)
                t->ns[k] += (double)ns;
        }
        if (f)
            fclose(f);
    }
    closedir(d);
}

/* The machine's CPU counters (/proc/stat "cpu" line): all ticks, idle (+ iowait), steal. */
typedef struct machine_ticks {
    unsigned long long total, idle, steal;
} machine_ticks;

static machine_ticks read_machine_ticks(void)
{
    machine_ticks t = {0, 0, 0};
    FILE *f = fopen("/proc/stat", "r");
    unsigned long long v[8] = {0};
    if (f && fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu", &v[0], &v[1], &v[2], &v[3],
                    &v[4], &v[5], &v[6], &v[7]) == 8) {
        for (int i = 0; i < 8; i++)
            t.total += v[i];
        t.idle = v[3] + v[4];
        t.steal = v[7];
    }
    if (f)
        fclose(f);
    return t;
}

static double driver_cpu_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double percentile(double *v, size_t n, double q)
{
    if (!n)
        return 0;
    size_t i = (size_t)(q * (double)(n - 1) + 0.5);
    return v[i < n ? i : n - 1];
}

/* Before/after readings of where the CPU went during a measured interval (phase_result). */
typedef struct cpu_marks {
    thread_times server;
    double driver_ns;
    machine_ticks ticks;
} cpu_marks;

static void cpu_mark(cpu_marks *m)
{
    read_thread_times(g_server_pid > 0 ? g_server_pid : -1, &m->server);
    m->driver_ns = driver_cpu_ns();
    m->ticks = read_machine_ticks();
}

/* Fills out's CPU and machine shares from two marks, per answered request. */
static void cpu_account(const cpu_marks *m0, const cpu_marks *m1, phase_result *out)
{
    double answered = out->routes ? (double)out->routes : 1;
    out->server_cpu_us = m0->server.total >= 0 && m1->server.total >= 0
                             ? (m1->server.total - m0->server.total) / 1e3 / answered : -1;
    out->server_threads = m1->server;
    for (unsigned k = 0; k < m1->server.n; k++) {
        double before = 0;
        for (unsigned j = 0; j < m0->server.n; j++)
            if (!strcmp(m0->server.name[j], m1->server.name[k]))
                before = m0->server.ns[j];
        out->server_threads.ns[k] = (m1->server.ns[k] - before) / 1e3 / answered;
    }
    out->driver_cpu_us = (m1->driver_ns - m0->driver_ns) / 1e3 / answered;
    unsigned long long dt = m1->ticks.total - m0->ticks.total;
    out->idle_pct = dt ? 100.0 * (double)(m1->ticks.idle - m0->ticks.idle) / (double)dt : -1;
    out->steal_pct = dt ? 100.0 * (double)(m1->ticks.steal - m0->ticks.steal) / (double)dt : -1;
}

/* A phase's rounds added up (--rounds): counts and time, CPU as totals (us) rather than per
 * route, the machine's idle and stolen shares as seconds, and every round's round trips. */
typedef struct phase_rounds {
    phase_result sum;
    double server_us, driver_us, idle_s, steal_s, dropped;
    bool server_unknown, dropped_unknown;
    rtt_samples rtt;
} phase_rounds;

static void phase_rounds_add(phase_rounds *acc, const phase_result *r)
{
    double routes = r->routes ? (double)r->routes : 1;
    phase_result *s = &acc->sum;
    s->frames += r->frames;
    s->routes += r->routes;
    s->errors += r->errors;
    s->elapsed_s += r->elapsed_s;
    acc->server_unknown |= r->server_cpu_us < 0;
    acc->server_us += r->server_cpu_us * routes;
    acc->driver_us += r->driver_cpu_us * routes;
    acc->idle_s += r->idle_pct > 0 ? r->idle_pct / 100.0 * r->elapsed_s : 0;
    acc->steal_s += r->steal_pct > 0 ? r->steal_pct / 100.0 * r->elapsed_s : 0;
    acc->dropped_unknown |= r->records_dropped_per_s < 0;
    acc->dropped += r->records_dropped_per_s * r->elapsed_s;
    for (unsigned k = 0; k < r->server_threads.n; k++) {
        unsigned j = 0;
        while (j < s->server_threads.n && strcmp(s->server_threads.name[j], r->server_threads.name[k]))
            j++;
        if (j == s->server_threads.n && j < MAX_THREAD_NAMES)
            snprintf(s->server_threads.name[s->server_threads.n++], sizeof s->server_threads.name[0],
                     "%s", r->server_threads.name[k]);
        if (j < s->server_threads.n)
            s->server_threads.ns[j] += r->server_threads.ns[k] * routes;
    }
}

/* The rounds as one phase: per-route CPU, rates over the summed time, percentiles over every
 * round's round trips. */
static phase_result phase_rounds_result(phase_rounds *acc)
{
    phase_result out = acc->sum;
    double routes = out.routes ? (double)out.routes : 1, t = out.elapsed_s > 0 ? out.elapsed_s : 1;
    out.decisions_per_s = (double)out.routes / t;
    out.server_cpu_us = acc->server_unknown ? -1 : acc->server_us / routes;
    out.driver_cpu_us = acc->driver_us / routes;
    out.idle_pct = acc->sum.elapsed_s > 0 ? 100.0 * acc->idle_s / t : -1;
    out.steal_pct = acc->sum.elapsed_s > 0 ? 100.0 * acc->steal_s / t : -1;
    out.records_dropped_per_s = acc->dropped_unknown ? -1 : acc->dropped / t;
    for (unsigned k = 0; k < out.server_threads.n; k++)
        out.server_threads.ns[k] /= routes;
    qsort(acc->rtt.v, acc->rtt.n, sizeof *acc->rtt.v, cmp_double);
    out.rtt_p50_us = percentile(acc->rtt.v, acc->rtt.n, 0.50);
    out.rtt_p99_us = percentile(acc->rtt.v, acc->rtt.n, 0.99);
    return out;
}

/* Send one frame of `per_frame` routes on connection k. */
static bool g_brief;
static bool g_ping; /* the IPC floor: a LIFECYCLE report the loop thread answers by itself */

static int send_frame(conn_state *cs, workload *w, uint32_t per_frame, uint64_t *seq)
{
    if (g_ping) {
        char rid[32];
        snprintf(rid, sizeof rid, "ping-%" PRIu64, (*seq)++);
        km_lifecycle_event ev;
        memset(&ev, 0, sizeof ev);
        ev.kind = KM_LIFECYCLE_DISPATCHED;
        ev.request_id = rid;
        uint64_t id;
        int rc = km_client_send_lifecycle(cs->c, &ev, 1, 5000, &id);
        if (rc != KM_OK)
            return rc;
        cs->sent_at[id % cs->ring] = km_bench_now_s();
        cs->outstanding++;
        return KM_OK;
    }
    static uint64_t hashes[BATCH_ROUTES][64];
    static km_route_request routes[BATCH_ROUTES];
    static char ids[BATCH_ROUTES][32];
    for (uint32_t i = 0; i < per_frame; i++) {
        km_route_request *r = &routes[i];
        memset(r, 0, sizeof *r);
        /* "b<seq>", formatted by hand: snprintf here was a tenth of this driver's time, and the
         * driver shares the cores with the server it measures. */
        char digits[24];
        int nd = 0;
        for (uint64_t v = (*seq)++; nd == 0 || v; v /= 10)
            digits[nd++] = (char)('0' + v % 10);
        ids[i][0] = 'b';
        for (int k = 0; k < nd; k++)
            ids[i][1 + k] = digits[nd - 1 - k];
        ids[i][1 + nd] = '\0';
        r->request_id = ids[i];
        r->pool = "main";
        r->input = KM_ROUTE_INPUT_HASHES;
        r->hashes = hashes[i];
        r->n_hashes = workload_request(w, hashes[i]);
        r->has_expected_output_tokens = true;
        r->expected_output_tokens = 128;
        r->brief = g_brief;
    }
    uint64_t id;
    int rc = km_client_send_route(cs->c, routes, per_frame, 5000, &id);
    if (rc != KM_OK)
        return rc;
    cs->sent_at[id % cs->ring] = km_bench_now_s();
    cs->outstanding++;
    return KM_OK;
}

/* Lifecycle reports would keep the active-work table small; this benchmark measures decisions,
 * so the server runs with a short active TTL instead (entries expire every second). */
static int run_phase(const char *addr, uint32_t n_conns, uint32_t per_frame, uint32_t window,
                     double rate, double seconds, workload *w, phase_result *out, rtt_samples *keep)
{
    memset(out, 0, sizeof *out);
    conn_state *cs = calloc(n_conns, sizeof *cs);
    /* epoll, not poll: the driver shares the two cores with the server, and poll over 128
     * sockets sets up and tears down 128 waits per call (at 20,000 frames/s the driver took
     * about as much CPU as the server). */
    int epfd = epoll_create1(EPOLL_CLOEXEC);
    struct epoll_event *events = calloc(n_conns, sizeof *events);
    size_t rtt_cap = 1 << 22, n_rtt = 0;
    double *rtt = malloc(rtt_cap * sizeof *rtt);
    /* KM_BENCH_IPC_RTT_LOG=FILE: every round trip as "<sent, s after the phase start> <rtt us>",
     * to see when the tail happens, not only how long it is. */
    const char *log_path = getenv("KM_BENCH_IPC_RTT_LOG");
    double *sent = log_path ? malloc(rtt_cap * sizeof *sent) : NULL;
    if (!cs || epfd < 0 || !events || !rtt || (log_path && !sent))
        return KM_ERR_OUT_OF_MEMORY;
    int rc = KM_OK;
    for (uint32_t k = 0; k < n_conns && !rc; k++) {
        char why[200];
        rc = km_client_connect(addr, 5000, &cs[k].c, why, sizeof why);
        if (rc) {
            fprintf(stderr, "bench ipc: connect: %s\n", why);
            break;
        }
        cs[k].ring = 4096;
        cs[k].sent_at = calloc(cs[k].ring, sizeof(double));
        struct epoll_event ev = {.events = EPOLLIN, .data.u32 = k};
        if (epoll_ctl(epfd, EPOLL_CTL_ADD, km_client_fd(cs[k].c), &ev) != 0) {
            fprintf(stderr, "bench ipc: epoll_ctl: %s\n", strerror(errno));
            rc = KM_ERR_IO;
        }
    }
    static uint64_t seq = 0; /* request ids stay unique across phases */
    double dropped0 = records_dropped(addr);
    cpu_marks m0, m1;
    cpu_mark(&m0);
    double start = km_bench_now_s(), end = start + seconds, next_send = start;
    double interval = rate > 0 ? (double)per_frame / rate : 0;
    uint32_t rr = 0;
    /* Closed loop: fill every window. */
    if (!rc && rate <= 0)
        for (uint32_t k = 0; k < n_conns && !rc; k++)
            for (uint32_t i = 0; i < window && !rc; i++)
                rc = send_frame(&cs[k], w, per_frame, &seq);
    while (!rc) {
        double now = km_bench_now_s();
        if (now >= end)
            break;
        if (rate > 0) {
            while (next_send <= now && !rc) {
                rc = send_frame(&cs[rr], w, per_frame, &seq);
                rr = (rr + 1) % n_conns;
                next_send += interval;
            }
        }
        /* Open loop: sleep exactly until the next frame is due, so frames leave on their
         * schedule instead of in bursts at a coarse poll timeout (a burst queues at the server and
         * would inflate the tail it is meant to measure). Closed loop: until a reply. */
        double wait_s = rate > 0 ? next_send - km_bench_now_s() : 0.001;
        if (wait_s < 0)
            wait_s = 0;
        struct timespec ts = {(time_t)wait_s, (long)((wait_s - (double)(time_t)wait_s) * 1e9)};
        int ready = epoll_pwait2(epfd, events, (int)n_conns, &ts, NULL);
        if (ready < 0 && errno != EINTR)
            break;
        for (int e = 0; e < ready && !rc; e++) {
            uint32_t k = events[e].data.u32;
            while (cs[k].outstanding) {
                km_message m;
                int r2 = km_client_receive(cs[k].c, 0, &m);
                if (r2 == KM_ERR_TIMEOUT)
                    break;
                if (r2 != KM_OK) {
                    rc = r2;
                    break;
                }
                double t = km_bench_now_s();
                cs[k].outstanding--;
                out->frames++;
                if (g_ping && m.type == KM_MESSAGE_ACK) {
                    out->routes++; /* answered (unknown id: NOT_FOUND, as intended) */
                } else if (m.type == KM_MESSAGE_DECISION) {
                    for (uint32_t i = 0; i < m.decision.n_decisions; i++)
                        if (m.decision.decisions[i].status == KM_OK)
                            out->routes++;
                        else
                            out->errors++;
                } else {
                    out->errors++;
                }
                if (n_rtt < rtt_cap) {
                    double at = cs[k].sent_at[m.id % cs[k].ring];
                    if (sent)
                        sent[n_rtt] = at - start;
                    rtt[n_rtt++] = (t - at) * 1e6;
                }
                if (rate <= 0 && t < end)
                    rc = send_frame(&cs[k], w, per_frame, &seq);
            }
        }
    }
    double elapsed = km_bench_now_s() - start;
    cpu_mark(&m1);
    double dropped1 = records_dropped(addr);
    out->records_dropped_per_s = dropped0 >= 0 && dropped1 >= 0 ? (dropped1 - dropped0) / elapsed : -1;
    cpu_account(&m0, &m1, out);
    if (sent) {
        FILE *f = fopen(log_path, "w");
        for (size_t i = 0; f && i < n_rtt; i++)
            fprintf(f, "%.6f %.1f\n", sent[i], rtt[i]);
        if (f)
            fclose(f);
        free(sent);
    }
    out->decisions_per_s = (double)out->routes / elapsed;
    out->elapsed_s = elapsed;
    if (!rc)
        rc = rtt_keep(keep, rtt, n_rtt);
    qsort(rtt, n_rtt, sizeof *rtt, cmp_double);
    out->rtt_p50_us = percentile(rtt, n_rtt, 0.50);
    out->rtt_p99_us = percentile(rtt, n_rtt, 0.99);
    /* Drain what is still in flight so the next phase starts clean. */
    for (uint32_t k = 0; k < n_conns; k++) {
        while (cs[k].c && cs[k].outstanding) {
            km_message m;
            if (km_client_receive(cs[k].c, 5000, &m) != KM_OK)
                break;
            cs[k].outstanding--;
        }
        km_client_close(cs[k].c);
        free(cs[k].sent_at);
    }
    free(cs);
    free(events);
    close(epfd);
    free(rtt);
    return rc;
}

/* The machine's own floor, measured in the same run: a child process that does nothing but echo
 * what it reads (one epoll thread, no libuv, no msgpack, no kvmatch), driven on the same open-loop
 * schedule, over the same number of Unix-socket connections, with a frame the size of a ping's.
 * The `ping` row adds kvmatch's transport (the loop thread decodes a LIFECYCLE report and encodes
 * an ACK); this row has none of it, so what it shows is the VM, the kernel and the driver. */
#define ECHO_FRAME 64

/* A Unix socket address for path; false when the path does not fit. */
static bool unix_address(const char *path, struct sockaddr_un *a)
{
    memset(a, 0, sizeof *a);
    a->sun_family = AF_UNIX;
    size_t n = strlen(path);
    if (n >= sizeof a->sun_path)
        return false;
    memcpy(a->sun_path, path, n + 1);
    return true;
}

static pid_t start_echo_server(const char *path)
{
    struct sockaddr_un a;
    if (!unix_address(path, &a))
        return -1;
    int lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (lfd < 0 || bind(lfd, (struct sockaddr *)&a, sizeof a) != 0 || listen(lfd, 256) != 0) {
        if (lfd >= 0)
            close(lfd);
        return -1;
    }
    pid_t pid = fork();
    if (pid != 0) {
        close(lfd);
        return pid;
    }
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    int ep = epoll_create1(0);
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = lfd};
    epoll_ctl(ep, EPOLL_CTL_ADD, lfd, &ev);
    struct epoll_event ready[64];
    char buf[16384];
    for (;;) {
        int n = epoll_wait(ep, ready, 64, -1);
        for (int i = 0; i < n; i++) {
            int fd = ready[i].data.fd;
            if (fd == lfd) {
                int c = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
                struct epoll_event ce = {.events = EPOLLIN, .data.fd = c};
                if (c >= 0)
                    epoll_ctl(ep, EPOLL_CTL_ADD, c, &ce);
                continue;
            }
            ssize_t r = read(fd, buf, sizeof buf);
            /* The driver's frames are small and few in flight: a blocking write of what was read
             * never waits on a full buffer here. */
            if (r <= 0 || write(fd, buf, (size_t)r) != r)
                close(fd);
        }
    }
}

/* The echo baseline: `rate` frames/s, round robin over n_conns connections to a fresh echo child
 * at `path`, for `seconds`. Fills out like run_phase (a frame counts as one answered request). */
static int run_echo_phase(const char *path, uint32_t n_conns, double rate, double seconds,
                          phase_result *out, rtt_samples *keep)
{
    memset(out, 0, sizeof *out);
    unlink(path);
    pid_t pid = start_echo_server(path);
    if (pid < 0)
        return KM_ERR_IO;
    pid_t saved_server = g_server_pid;
    g_server_pid = pid;
    int *fds = calloc(n_conns, sizeof *fds);
    int epfd = epoll_create1(EPOLL_CLOEXEC);
    struct epoll_event *events = calloc(n_conns, sizeof *events);
    size_t cap = (size_t)(rate * seconds) + 1024, n_rtt = 0;
    double *sent_at = malloc(cap * sizeof *sent_at), *rtt = malloc(cap * sizeof *rtt);
    int rc = fds && epfd >= 0 && events && sent_at && rtt ? KM_OK : KM_ERR_OUT_OF_MEMORY;
    for (uint32_t k = 0; k < n_conns && !rc; k++) {
        struct sockaddr_un a;
        fds[k] = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        struct epoll_event ev = {.events = EPOLLIN, .data.u32 = k};
        if (fds[k] < 0 || !unix_address(path, &a) || connect(fds[k], (struct sockaddr *)&a, sizeof a) != 0 ||
            epoll_ctl(epfd, EPOLL_CTL_ADD, fds[k], &ev) != 0) {
            fprintf(stderr, "bench ipc: echo connection: %s\n", strerror(errno));
            rc = KM_ERR_IO;
        }
    }
    cpu_marks m0, m1;
    cpu_mark(&m0);
    double start = km_bench_now_s(), end = start + seconds, next_send = start;
    uint64_t sent = 0, received = 0;
    uint32_t rr = 0;
    while (!rc) {
        double now = km_bench_now_s();
        if (now >= end)
            break;
        while (next_send <= now && sent < cap && !rc) {
            uint64_t frame[ECHO_FRAME / sizeof(uint64_t)] = {sent};
            sent_at[sent] = km_bench_now_s();
            if (write(fds[rr], frame, sizeof frame) != (ssize_t)sizeof frame)
                rc = KM_ERR_IO;
            sent++;
            rr = (rr + 1) % n_conns;
            next_send += 1.0 / rate;
        }
        double wait_s = next_send - km_bench_now_s();
        if (wait_s < 0)
            wait_s = 0;
        struct timespec ts = {(time_t)wait_s, (long)((wait_s - (double)(time_t)wait_s) * 1e9)};
        int ready = epoll_pwait2(epfd, events, (int)n_conns, &ts, NULL);
        for (int e = 0; e < ready && !rc; e++) {
            /* Whole frames only: a stream read may end mid-frame, so read exactly what the
             * connection owes (frames in flight there are few and small). */
            uint64_t frame[ECHO_FRAME / sizeof(uint64_t)];
            ssize_t r = recv(fds[events[e].data.u32], frame, sizeof frame, MSG_WAITALL);
            if (r != (ssize_t)sizeof frame) {
                rc = KM_ERR_IO;
                break;
            }
            double t = km_bench_now_s();
            received++;
            if (frame[0] < sent && n_rtt < cap)
                rtt[n_rtt++] = (t - sent_at[frame[0]]) * 1e6;
        }
    }
    double elapsed = km_bench_now_s() - start;
    out->frames = out->routes = received;
    cpu_mark(&m1);
    cpu_account(&m0, &m1, out);
    out->records_dropped_per_s = -1;
    out->decisions_per_s = (double)received / elapsed;
    out->elapsed_s = elapsed;
    if (!rc)
        rc = rtt_keep(keep, rtt, n_rtt);
    qsort(rtt, n_rtt, sizeof *rtt, cmp_double);
    out->rtt_p50_us = percentile(rtt, n_rtt, 0.50);
    out->rtt_p99_us = percentile(rtt, n_rtt, 0.99);
    for (uint32_t k = 0; fds && k < n_conns; k++)
        if (fds[k] > 0)
            close(fds[k]);
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    unlink(path);
    g_server_pid = saved_server;
    free(fds);
    free(events);
    free(sent_at);
    free(rtt);
    if (epfd >= 0)
        close(epfd);
    return rc;
}

/* The child `kvmatch serve`. shedding false: load shedding off (max_queue_wait_ms and
 * max_connection_routes 0, through a config file in dir), so the throughput rows measure the
 * decision path at saturation, whatever the queue wait; true: the service's defaults. */
static pid_t start_server(const char *self, const char *sock, bool records, const char *dir,
                          bool shedding)
{
    static char config[320];
    snprintf(config, sizeof config, "%s/no-shedding.json", dir);
    if (!shedding) {
        FILE *f = fopen(config, "w");
        if (f) {
            fputs("{\"scheduler\": {\"max_queue_wait_ms\": 0, \"max_connection_routes\": 0}}\n", f);
            fclose(f);
        }
    }
    pid_t pid = fork();
    if (pid != 0)
        return pid;
    char rec[300];
    snprintf(rec, sizeof rec, "%s/records.jsonl", dir);
    char *argv[64];
    int n = 0;
    argv[n++] = (char *)self;
    argv[n++] = "serve";
    if (!shedding) {
        argv[n++] = "--config";
        argv[n++] = config;
    }
    argv[n++] = "--socket";
    argv[n++] = (char *)sock;
    argv[n++] = "--records";
    argv[n++] = records ? rec : "none";
    argv[n++] = "--backend";
    argv[n++] = "cpu";
    argv[n++] = "--threads";
    argv[n++] = getenv("KM_BENCH_IPC_THREADS") ? getenv("KM_BENCH_IPC_THREADS") : "1";
    argv[n++] = "--active-ttl-ms";
    argv[n++] = "1000";
    /* KM_BENCH_IPC_POLICY: the pool's policy (default kv, whose cost the tables have always used). */
    static char pool_spec[64];
    snprintf(pool_spec, sizeof pool_spec, "main:16:%s",
             getenv("KM_BENCH_IPC_POLICY") ? getenv("KM_BENCH_IPC_POLICY") : "kv");
    argv[n++] = "--pool";
    argv[n++] = pool_spec;
    static char wspec[WORKERS][32];
    for (int i = 0; i < WORKERS; i++) {
        snprintf(wspec[i], sizeof wspec[i], "main:%d", i);
        argv[n++] = "--worker";
        argv[n++] = wspec[i];
    }
    argv[n] = NULL;
    int devnull = open("/dev/null", O_WRONLY);
    if (devnull >= 0 && !getenv("KM_BENCH_SERVER_LOG"))
        dup2(devnull, 2);
    /* KM_BENCH_IPC_SERVER=PATH: another build's kvmatch as the server, driven by this one, for an
     * A/B of the server alone (same driver, same CPU accounting). */
    const char *server = getenv("KM_BENCH_IPC_SERVER");
    execv(server && *server ? server : self, argv);
    _exit(127);
}

/* The one-connection closed-loop phases every client language drives (their index in the phase
 * table below, for the C client's row). */
static const struct {
    const char *frame;
    uint32_t per_frame, window;
    size_t c_phase;
} client_phases[] = {{"single", 1, 4, 1}, {"batched", BATCH_ROUTES, 4, 4}};

#define SCHEDULE_PROMPTS 4096

/* SCHEDULE_PROMPTS prompts of the repeat workload, one per line of decimal hashes. */
static int write_schedule(const char *path, const workload *from)
{
    workload w = *from;
    w.fresh = false;
    FILE *f = fopen(path, "w");
    if (!f)
        return KM_ERR_IO;
    uint64_t hashes[64];
    for (int i = 0; i < SCHEDULE_PROMPTS; i++) {
        uint32_t n = workload_request(&w, hashes);
        for (uint32_t k = 0; k < n; k++)
            fprintf(f, k ? " %" PRIu64 : "%" PRIu64, hashes[k]);
        fputc('\n', f);
    }
    return fclose(f) == 0 ? KM_OK : KM_ERR_IO;
}

static int cmp_names(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Run each driver of clients_dir on each client phase and add its rows (with the C client's of
 * the same run, c_results[phase]) to results and to the text table. A driver that fails is
 * reported and gives no row; the others still run. */
static void run_client_phases(const char *clients_dir, const char *addr, const char *dir,
                              const workload *w, double seconds, const phase_result *c_results,
                              const bool *c_ran, json_t *results, bool json)
{
    char schedule[400];
    snprintf(schedule, sizeof schedule, "%s/schedule.txt", dir);
    if (write_schedule(schedule, w) != KM_OK) {
        fprintf(stderr, "bench ipc: cannot write %s\n", schedule);
        return;
    }
    DIR *d = opendir(clients_dir);
    if (!d) {
        fprintf(stderr, "bench ipc: --clients %s: %s\n", clients_dir, strerror(errno));
        return;
    }
    char *names[32];
    size_t n_names = 0;
    struct dirent *e;
    while ((e = readdir(d)) && n_names < 32) {
        char path[4400];
        snprintf(path, sizeof path, "%s/%s", clients_dir, e->d_name);
        struct stat st;
        if (e->d_name[0] != '.' && stat(path, &st) == 0 && S_ISREG(st.st_mode) && access(path, X_OK) == 0)
            names[n_names++] = strdup(e->d_name);
    }
    closedir(d);
    qsort(names, n_names, sizeof *names, cmp_names);
    if (!json)
        printf("\n%-8s %-8s %-6s %14s %11s %11s %7s\n", "client", "frame", "window", "decisions/s",
               "rtt p50 us", "rtt p99 us", "errors");
    for (size_t p = 0; p < sizeof client_phases / sizeof client_phases[0]; p++) {
        if (c_ran[client_phases[p].c_phase] && !json) {
            const phase_result *c = &c_results[client_phases[p].c_phase];
            printf("%-8s %-8s %-6u %14.0f %11.1f %11.1f %7" PRIu64 "\n", "c", client_phases[p].frame,
                   client_phases[p].window, c->decisions_per_s, c->rtt_p50_us, c->rtt_p99_us, c->errors);
        }
        for (size_t i = 0; i < n_names; i++) {
            char cmd[5000], out[4096];
            snprintf(cmd, sizeof cmd, "'%s/%s' '%s' '%s' %u %u %g", clients_dir, names[i], addr,
                     schedule, client_phases[p].per_frame, client_phases[p].window, seconds);
            FILE *pipe = popen(cmd, "r");
            size_t got = pipe ? fread(out, 1, sizeof out - 1, pipe) : 0;
            out[got] = '\0';
            int rc = pipe ? pclose(pipe) : -1;
            /* The last line is the result. */
            char *line = out;
            for (char *nl = strchr(out, '\n'); nl && nl[1]; nl = strchr(nl + 1, '\n'))
                line = nl + 1;
            json_error_t err;
            json_t *r = rc == 0 ? json_loads(line, JSON_DECODE_ANY, &err) : NULL;
            double dps = json_number_value(json_object_get(r, "decisions_per_s"));
            if (!json_is_object(r) || !json_is_number(json_object_get(r, "decisions_per_s"))) {
                fprintf(stderr, "bench ipc: client %s (%s frames) gave no result (exit %d): %s\n",
                        names[i], client_phases[p].frame, rc, out);
                json_decref(r);
                continue;
            }
            json_t *o = json_object();
            json_object_set_new(o, "client", json_string(names[i]));
            json_object_set_new(o, "workload", json_string("repeat"));
            json_object_set_new(o, "reply", json_string("full"));
            json_object_set_new(o, "connections", json_integer(1));
            json_object_set_new(o, "frame", json_string(client_phases[p].frame));
            json_object_set_new(o, "routes_per_frame", json_integer(client_phases[p].per_frame));
            json_object_set_new(o, "window", json_integer(client_phases[p].window));
            json_object_set_new(o, "offered_per_s", json_null());
            json_object_set_new(o, "decisions_per_s", json_real(km_bench_round_to(dps, 1)));
            double p50 = json_number_value(json_object_get(r, "rtt_p50_us"));
            double p99 = json_number_value(json_object_get(r, "rtt_p99_us"));
            json_int_t errors = json_integer_value(json_object_get(r, "errors"));
            json_object_set_new(o, "rtt_p50_us", json_real(km_bench_round_to(p50, 0.1)));
            json_object_set_new(o, "rtt_p99_us", json_real(km_bench_round_to(p99, 0.1)));
            json_object_set_new(o, "errors", json_integer(errors));
            json_array_append_new(results, o);
            json_decref(r);
            if (!json) {
                printf("%-8s %-8s %-6u %14.0f %11.1f %11.1f %7" PRId64 "\n", names[i],
                       client_phases[p].frame, client_phases[p].window, dps, p50, p99, (int64_t)errors);
                fflush(stdout);
            }
        }
    }
    for (size_t i = 0; i < n_names; i++)
        free(names[i]);
}

/* The flood rows: FLOOD_CONNS connections each keep FLOOD_WINDOW batched frames outstanding
 * (16,384 routes in flight, far more than the scheduler decides in the deadline) while one light
 * client on its own connection sends one route at a time; its round trips and answers are what a
 * router beside someone else's flood sees. */
#define FLOOD_CONNS 8
#define FLOOD_WINDOW 32

typedef struct flood_arg {
    const char *addr;
    double seconds;
    workload w;
    phase_result pr;
    int rc;
} flood_arg;

static void *flood_thread(void *p)
{
    flood_arg *a = p;
    a->rc = run_phase(a->addr, FLOOD_CONNS, BATCH_ROUTES, FLOOD_WINDOW, 0, a->seconds, &a->w,
                      &a->pr, NULL);
    return NULL;
}

typedef struct flood_result {
    phase_result flood;
    double light_p50_us, light_p99_us;
    uint64_t light_routes, light_overloaded, light_other_errors;
} flood_result;

static int run_flood(const char *addr, double seconds, flood_result *out)
{
    memset(out, 0, sizeof *out);
    g_brief = true;
    g_ping = false;
    flood_arg fa;
    memset(&fa, 0, sizeof fa);
    fa.addr = addr;
    fa.seconds = seconds;
    workload_init(&fa.w);
    km_client *c = NULL;
    char why[200];
    int rc = km_client_connect(addr, 5000, &c, why, sizeof why);
    if (rc)
        return rc;
    pthread_t t;
    if (pthread_create(&t, NULL, flood_thread, &fa) != 0) {
        km_client_close(c);
        return KM_ERR_INTERNAL;
    }
    /* the flood fills the queue first */
    struct timespec settle = {0, 200000000};
    nanosleep(&settle, NULL);
    workload lw;
    workload_init(&lw);
    size_t cap = 1 << 20, n = 0;
    double *rtt = malloc(cap * sizeof *rtt);
    double end = km_bench_now_s() + seconds - 0.4;
    uint64_t hashes[64];
    for (uint64_t k = 0; rtt && km_bench_now_s() < end; k++) {
        char rid[32];
        snprintf(rid, sizeof rid, "light-%" PRIu64, k);
        km_route_request r;
        memset(&r, 0, sizeof r);
        r.request_id = rid;
        r.pool = "main";
        r.input = KM_ROUTE_INPUT_HASHES;
        r.hashes = hashes;
        r.n_hashes = workload_request(&lw, hashes);
        r.brief = true;
        km_message m;
        double t0 = km_bench_now_s();
        /* A frame refused as a whole (shed) comes back as its ERROR's code. */
        int st = km_client_route(c, &r, 1, 10000, &m);
        if (st != KM_OK && st != KM_ERR_OVERLOADED) {
            rc = st;
            break;
        }
        if (n < cap)
            rtt[n++] = (km_bench_now_s() - t0) * 1e6;
        if (st == KM_OK)
            st = m.decision.n_decisions ? m.decision.decisions[0].status : KM_ERR_INTERNAL;
        out->light_routes++;
        out->light_overloaded += st == KM_ERR_OVERLOADED;
        out->light_other_errors += st != KM_OK && st != KM_ERR_OVERLOADED;
    }
    pthread_join(t, NULL);
    km_client_close(c);
    if (!rc)
        rc = fa.rc;
    out->flood = fa.pr;
    if (rtt) {
        qsort(rtt, n, sizeof *rtt, cmp_double);
        out->light_p50_us = percentile(rtt, n, 0.50);
        out->light_p99_us = percentile(rtt, n, 0.99);
    }
    free(rtt);
    return rc;
}

/* Both flood rows: shedding off (the server at addr), then on (a second server with the
 * service's defaults). */
static int flood_rows(const char *self, const char *addr, const char *dir, double seconds,
                      bool json, json_t *results)
{
    for (int shedding = 0; shedding < 2; shedding++) {
        char sock2[320], addr2[340];
        pid_t pid2 = 0;
        const char *at = addr;
        if (shedding) {
            snprintf(sock2, sizeof sock2, "%s/shed.sock", dir);
            snprintf(addr2, sizeof addr2, "unix:%s", sock2);
            pid2 = start_server(self, sock2, false, dir, true);
            km_client *probe = NULL;
            for (int i = 0; i < 200 && !probe; i++)
                if (km_client_connect(addr2, 1000, &probe, NULL, 0) != KM_OK) {
                    probe = NULL;
                    struct timespec ts = {0, 20000000};
                    nanosleep(&ts, NULL);
                }
            if (!probe) {
                kill(pid2, SIGKILL);
                waitpid(pid2, NULL, 0);
                return KM_ERR_IO;
            }
            km_client_close(probe);
            at = addr2;
        }
        flood_result fr;
        int rc = run_flood(at, seconds, &fr);
        if (pid2 > 0) {
            kill(pid2, SIGTERM);
            waitpid(pid2, NULL, 0);
        }
        if (rc)
            return rc;
        const char *name = shedding ? "on" : "off";
        json_t *o = json_object();
        json_object_set_new(o, "workload", json_string("flood"));
        json_object_set_new(o, "shedding", json_string(name));
        json_object_set_new(o, "flood_connections", json_integer(FLOOD_CONNS));
        json_object_set_new(o, "flood_routes_in_flight",
                            json_integer(FLOOD_CONNS * FLOOD_WINDOW * BATCH_ROUTES));
        json_object_set_new(o, "flood_decisions_per_s",
                            json_real(km_bench_round_to(fr.flood.decisions_per_s, 1)));
        json_object_set_new(o, "flood_overloaded", json_integer((json_int_t)fr.flood.errors));
        json_object_set_new(o, "light_routes", json_integer((json_int_t)fr.light_routes));
        json_object_set_new(o, "light_rtt_p50_us", json_real(km_bench_round_to(fr.light_p50_us, 0.1)));
        json_object_set_new(o, "light_rtt_p99_us", json_real(km_bench_round_to(fr.light_p99_us, 0.1)));
        json_object_set_new(o, "light_overloaded", json_integer((json_int_t)fr.light_overloaded));
        json_object_set_new(o, "light_other_errors", json_integer((json_int_t)fr.light_other_errors));
        json_array_append_new(results, o);
        if (!json) {
            if (!shedding)
                printf("\nflood (%d conns x %d frames x %d routes in flight) + one light client "
                       "(1 route at a time):\n%-9s %14s %11s %13s %13s %14s %12s\n",
                       FLOOD_CONNS, FLOOD_WINDOW, BATCH_ROUTES, "shedding", "flood dec/s",
                       "flood shed", "light routes", "light p50 us", "light p99 us",
                       "light shed");
            printf("%-9s %14.0f %11" PRIu64 " %13" PRIu64 " %13.1f %14.1f %12" PRIu64 "\n", name,
                   fr.flood.decisions_per_s, fr.flood.errors, fr.light_routes, fr.light_p50_us,
                   fr.light_p99_us, fr.light_overloaded);
            fflush(stdout);
        }
    }
    return KM_OK;
}

/* The phases of the default run (the table in km_bench_ipc_main; --only numbers them from 0). */
#define IPC_PHASES 15

int km_bench_ipc_main(int argc, char **argv)
{
    bool json = false, quick = false, records = false, flood = false;
    const char *connect_to = NULL; /* a running server (pool "main") instead of a child */
    const char *clients_dir = NULL; /* other languages' client drivers (run_client_phases) */
    bool only[IPC_PHASES] = {false}; /* --only: these phases (0-based, the table's row order) */
    bool only_some = false;
    double seconds = 2.0;
    uint32_t rounds = 1; /* --rounds: the selected phases run this many times in turn */
    enum { OPT_JSON = 256, OPT_QUICK, OPT_RECORDS, OPT_FLOOD, OPT_CONNECT, OPT_ONLY, OPT_SECONDS,
           OPT_CLIENTS, OPT_ROUNDS };
    static const struct option options[] = {
        {"help", no_argument, NULL, 'h'},
        {"json", no_argument, NULL, OPT_JSON},
        {"quick", no_argument, NULL, OPT_QUICK},
        {"records", no_argument, NULL, OPT_RECORDS},
        {"flood", no_argument, NULL, OPT_FLOOD},
        {"connect", required_argument, NULL, OPT_CONNECT},
        {"only", required_argument, NULL, OPT_ONLY},
        {"seconds", required_argument, NULL, OPT_SECONDS},
        {"clients", required_argument, NULL, OPT_CLIENTS},
        {"rounds", required_argument, NULL, OPT_ROUNDS},
        {NULL, 0, NULL, 0},
    };
    static const char usage_line[] = "usage: kvmatch bench ipc [--json] [--quick] [--seconds S] "
                                     "[--records] [--clients DIR] [--flood] [--connect ADDR] "
                                     "[--only PHASE[,PHASE...]] [--rounds N]   "
                                     "(--opt VALUE or --opt=VALUE)\n";
    km_cli_getopt_begin(argv, "bench ipc");
    int opt;
    while ((opt = getopt_long(argc, argv, "h", options, NULL)) != -1) {
        uint32_t phase;
        switch (opt) {
        case 'h':
            fputs(usage_line, stdout);
            return KM_EXIT_OK;
        case OPT_JSON:
            json = true;
            break;
        case OPT_QUICK:
            quick = true;
            break;
        case OPT_RECORDS:
            records = true;
            break;
        case OPT_FLOOD:
            flood = true;
            break;
        case OPT_CONNECT:
            connect_to = optarg;
            break;
        case OPT_ONLY: { /* one phase, or a comma-separated list of them */
            char list[256];
            if (strlen(optarg) >= sizeof list) {
                fprintf(stderr, "kvmatch bench ipc: --only: too long a list\n");
                return KM_EXIT_USAGE;
            }
            strcpy(list, optarg);
            char *save = NULL;
            for (char *tok = strtok_r(list, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
                if (!km_cli_u32("bench ipc", "only", tok, 0, IPC_PHASES - 1, &phase))
                    return KM_EXIT_USAGE;
                only[phase] = true;
            }
            only_some = true;
            break;
        }
        case OPT_SECONDS:
            if (!km_cli_double("bench ipc", "seconds", optarg, 0.01, 3600, &seconds))
                return KM_EXIT_USAGE;
            break;
        case OPT_CLIENTS:
            clients_dir = optarg;
            break;
        case OPT_ROUNDS:
            if (!km_cli_u32("bench ipc", "rounds", optarg, 1, 1000, &rounds))
                return KM_EXIT_USAGE;
            break;
        default:
            return km_cli_usage_error("bench ipc");
        }
    }
    if (optind < argc) {
        fprintf(stderr, "kvmatch bench ipc: unexpected argument \"%s\"\n", argv[optind]);
        return km_cli_usage_error("bench ipc");
    }
    if (quick)
        seconds = 0.5;
    signal(SIGPIPE, SIG_IGN);
    /* The open-loop schedule wakes every 50 us at 20,000 frames/s: the default 50 us timer
     * slack would bunch those wake-ups. */
    prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
    char self[4096];
    ssize_t sl = readlink("/proc/self/exe", self, sizeof self - 1);
    if (sl <= 0) {
        fprintf(stderr, "bench ipc: cannot find this executable\n");
        return 1;
    }
    self[sl] = '\0';
    char dir[] = "/tmp/kvmatch-bench-ipc-XXXXXX";
    if (!mkdtemp(dir)) {
        perror("bench ipc: mkdtemp");
        return 1;
    }
    char sock[300], addr[320];
    snprintf(sock, sizeof sock, "%s/s.sock", dir);
    snprintf(addr, sizeof addr, "unix:%s", sock);
    json_t *root = json_object();
    json_object_set_new(root, "benchmark", json_string("ipc"));
    json_object_set_new(root, "machine", km_bench_machine_json());
    pid_t pid = connect_to ? 0 : start_server(self, sock, records, dir, false);
    g_server_pid = pid;
    g_records = records;
    if (connect_to)
        snprintf(addr, sizeof addr, "%s", connect_to);
    /* Wait for the socket. */
    km_client *probe = NULL;
    for (int i = 0; i < 200 && !probe; i++) {
        if (km_client_connect(addr, 1000, &probe, NULL, 0) != KM_OK) {
            probe = NULL;
            struct timespec ts = {0, 20000000};
            nanosleep(&ts, NULL);
        }
    }
    if (!probe) {
        fprintf(stderr, "bench ipc: the server did not start\n");
        if (pid > 0) {
            kill(pid, SIGKILL);
            waitpid(pid, NULL, 0);
        }
        return 1;
    }
    km_client_close(probe);
    workload w;
    workload_init(&w);
    /* Warm-up: the approximate-mode index learns the prefixes. */
    phase_result pr;
    run_phase(addr, 4, BATCH_ROUTES, 2, 0, quick ? 0.3 : 1.0, &w, &pr, NULL);

    json_t *results = json_array();
    double rate = getenv("KM_BENCH_IPC_RATE") ? atof(getenv("KM_BENCH_IPC_RATE")) : 20000;
    struct {
        const char *workload, *reply;
        uint32_t conns;
        const char *frame;
        uint32_t per_frame, window;
        double rate;
    } phases[] = {
        {"-", "ping", 16, "single", 1, 0, rate},
        {"repeat", "full", 1, "single", 1, 4, 0},
        {"repeat", "full", 16, "single", 1, 4, 0},
        {"repeat", "full", 128, "single", 1, 2, 0},
        {"repeat", "full", 1, "batched", BATCH_ROUTES, 4, 0},
        {"repeat", "full", 16, "batched", BATCH_ROUTES, 2, 0},
        {"repeat", "full", 128, "batched", BATCH_ROUTES, 1, 0},
        {"repeat", "full", 16, "single", 1, 0, rate},
        {"repeat", "brief", 1, "batched", BATCH_ROUTES, 4, 0},
        {"repeat", "brief", 16, "batched", BATCH_ROUTES, 2, 0},
        {"repeat", "brief", 128, "batched", BATCH_ROUTES, 1, 0},
        {"repeat", "brief", 16, "single", 1, 0, rate},
        {"fresh", "full", 16, "single", 1, 4, 0},
        {"fresh", "full", 16, "batched", BATCH_ROUTES, 2, 0},
        /* Last so that the phase numbers --only takes stay what they were; the floor of the
         * machine itself, no kvmatch in it (run_echo_phase). */
        {"-", "echo", 16, "single", 1, 0, rate},
    };
    int status = 0;
    if (!json)
        printf("%-7s %-6s %-5s %-8s %-9s %14s %11s %11s %7s %8s %8s %5s %5s\n", "prompts", "reply",
               "conns", "frame", "offered", "decisions/s", "rtt p50 us", "rtt p99 us", "errors",
               "srv us/d", "drv us/d", "idle%", "steal%");
    size_t n_phases = sizeof phases / sizeof phases[0];
    _Static_assert(sizeof phases / sizeof phases[0] == IPC_PHASES, "IPC_PHASES counts the phases");
    phase_result c_results[sizeof phases / sizeof phases[0]];
    bool c_ran[sizeof phases / sizeof phases[0]] = {false};
    /* --flood: only the flood rows (load shedding off and on). */
    if (flood && !connect_to) {
        int rc = flood_rows(self, addr, dir, quick ? 2.0 : seconds < 3 ? 3 : seconds, json, results);
        if (rc != KM_OK) {
            fprintf(stderr, "bench ipc: flood failed: %s\n", km_error_name(rc));
            status = 1;
        }
        n_phases = 0;
    }
    /* --rounds N: the selected phases run N times in turn, `seconds` each time, so that each sees
     * the same spells of the machine's load; a row reports all its rounds together. */
    phase_rounds acc[sizeof phases / sizeof phases[0]];
    memset(acc, 0, sizeof acc);
    for (size_t step = 0; step < n_phases * rounds && !status; step++) {
        size_t i = step % n_phases;
        bool last_round = step / n_phases == rounds - 1;
        w.fresh = !strcmp(phases[i].workload, "fresh");
        g_brief = !strcmp(phases[i].reply, "brief");
        g_ping = !strcmp(phases[i].reply, "ping");
        const char *wname = phases[i].workload;
        if (only_some && !only[i])
            continue;
        int rc;
        if (!strcmp(phases[i].reply, "echo")) {
            char echo_path[320];
            snprintf(echo_path, sizeof echo_path, "%s/echo.sock", dir);
            rc = run_echo_phase(echo_path, phases[i].conns, phases[i].rate, seconds, &pr,
                                rounds > 1 ? &acc[i].rtt : NULL);
        } else {
            rc = run_phase(addr, phases[i].conns, phases[i].per_frame, phases[i].window,
                           phases[i].rate, seconds, &w, &pr, rounds > 1 ? &acc[i].rtt : NULL);
        }
        if (rc != KM_OK) {
            fprintf(stderr, "bench ipc: phase %zu failed: %s\n", i, km_error_name(rc));
            status = 1;
            break;
        }
        if (rounds > 1) {
            phase_rounds_add(&acc[i], &pr);
            if (!last_round)
                continue;
            pr = phase_rounds_result(&acc[i]);
        }
        c_results[i] = pr;
        c_ran[i] = true;
        json_t *o = json_object();
        json_object_set_new(o, "client", json_string("c"));
        json_object_set_new(o, "workload", json_string(wname));
        json_object_set_new(o, "reply", json_string(phases[i].reply));
        json_object_set_new(o, "connections", json_integer(phases[i].conns));
        json_object_set_new(o, "frame", json_string(phases[i].frame));
        json_object_set_new(o, "routes_per_frame", json_integer(phases[i].per_frame));
        json_object_set_new(o, "window", phases[i].rate > 0 ? json_null() : json_integer(phases[i].window));
        json_object_set_new(o, "offered_per_s", phases[i].rate > 0 ? json_real(phases[i].rate) : json_null());
        json_object_set_new(o, "decisions_per_s", json_real(km_bench_round_to(pr.decisions_per_s, 1)));
        json_object_set_new(o, "rtt_p50_us", json_real(km_bench_round_to(pr.rtt_p50_us, 0.1)));
        json_object_set_new(o, "rtt_p99_us", json_real(km_bench_round_to(pr.rtt_p99_us, 0.1)));
        json_object_set_new(o, "errors", json_integer((json_int_t)pr.errors));
        json_object_set_new(o, "server_cpu_us_per_decision",
                            pr.server_cpu_us >= 0 ? json_real(km_bench_round_to(pr.server_cpu_us, 0.01)) : json_null());
        json_object_set_new(o, "driver_cpu_us_per_decision", json_real(km_bench_round_to(pr.driver_cpu_us, 0.01)));
        json_object_set_new(o, "records_dropped_per_s",
                            pr.records_dropped_per_s >= 0 ? json_real(km_bench_round_to(pr.records_dropped_per_s, 1))
                                                          : json_null());
        if (pr.server_cpu_us >= 0) {
            json_t *by = json_object();
            for (unsigned k = 0; k < pr.server_threads.n; k++)
                json_object_set_new(by, pr.server_threads.name[k],
                                    json_real(km_bench_round_to(pr.server_threads.ns[k], 0.01)));
            json_object_set_new(o, "server_cpu_us_per_decision_by_thread", by);
        }
        json_object_set_new(o, "idle_pct", pr.idle_pct >= 0 ? json_real(km_bench_round_to(pr.idle_pct, 0.1)) : json_null());
        json_object_set_new(o, "steal_pct", pr.steal_pct >= 0 ? json_real(km_bench_round_to(pr.steal_pct, 0.1)) : json_null());
        json_array_append_new(results, o);
        if (!json) {
            char offered[32] = "open";
            if (phases[i].rate > 0)
                snprintf(offered, sizeof offered, "%.0f/s", phases[i].rate);
            printf("%-7s %-6s %-5u %-8s %-9s %14.0f %11.1f %11.1f %7" PRIu64 " %8.2f %8.2f %5.1f %5.1f\n",
                   wname, phases[i].reply, phases[i].conns, phases[i].frame, offered,
                   pr.decisions_per_s, pr.rtt_p50_us, pr.rtt_p99_us, pr.errors, pr.server_cpu_us,
                   pr.driver_cpu_us, pr.idle_pct, pr.steal_pct);
            fflush(stdout);
        }
    }
    /* The open-loop rows against the echo floor of this same run (their tail moves with the VM). */
    const size_t echo = IPC_PHASES - 1;
    for (size_t i = 0; !json && c_ran[echo] && i < echo; i++)
        if (c_ran[i] && phases[i].rate > 0 && c_results[echo].rtt_p50_us > 0 &&
            c_results[echo].rtt_p99_us > 0)
            printf("%s %s %s against echo: p50 %.2f, p99 %.2f times\n", phases[i].workload,
                   phases[i].reply, phases[i].frame, c_results[i].rtt_p50_us / c_results[echo].rtt_p50_us,
                   c_results[i].rtt_p99_us / c_results[echo].rtt_p99_us);
    if (clients_dir && !status)
        run_client_phases(clients_dir, addr, dir, &w, seconds, c_results, c_ran, results, json);
    json_object_set_new(root, "results", results);
    json_t *wl = json_object();
    json_object_set_new(wl, "workers", json_integer(WORKERS));
    json_object_set_new(wl, "block_size", json_integer(BLOCK));
    json_object_set_new(wl, "input", json_string("hashes"));
    json_object_set_new(wl, "repeat", json_string("a prefix (1..40 blocks) of one of 256 known prompts: the decision path with an index that already knows every block"));
    json_object_set_new(wl, "fresh", json_string("one of 256 prompts (8..40 blocks) + 2..24 blocks never seen: approximate mode stores every new block, the index grows"));
    json_object_set_new(wl, "seconds_per_phase", json_real(seconds));
    json_object_set_new(wl, "rounds", json_integer(rounds));
    json_object_set_new(wl, "records", json_boolean(records));
    json_object_set_new(root, "workload", wl);
    int wst = 0;
    if (pid > 0) {
        kill(pid, SIGTERM);
        waitpid(pid, &wst, 0);
    }
    json_object_set_new(root, "server_exit_status",
                        json_integer(WIFEXITED(wst) ? WEXITSTATUS(wst) : -1));
    if (json) {
        char *text = json_dumps(root, JSON_INDENT(2));
        puts(text);
        free(text);
    }
    json_decref(root);
    char cmd[400];
    for (size_t i = 0; i < sizeof acc / sizeof acc[0]; i++)
        free(acc[i].rtt.v);
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "bench ipc: could not remove %s\n", dir);
    return status;
}
