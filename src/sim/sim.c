/* SPDX-License-Identifier: Apache-2.0 */
/* `kvmatch sim` (src/sim/sim.h, docs/SIM.md): the virtual-time loop. */
#include "sim/sim.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "kvmatch/client.h"
#include "kvmatch/hash.h"
#include "kvmatch/publisher.h"
#include "kvmatch/server.h"
#include "sim/broker.h"
#include "sim/report.h"
#include "sim/trace.h"
#include "base/array.h"
#include "base/error_detail.h"

const char *km_sim_mode_name(km_sim_mode mode)
{
    switch (mode) {
    case KM_SIM_MODE_SINGLE:
        return "single";
    case KM_SIM_MODE_ISOLATED:
        return "isolated";
    case KM_SIM_MODE_SHARED:
        return "shared";
    }
    return "unknown";
}

bool km_sim_cluster_loss_valid(double p)
{
    if (!(p > 0 && p <= 1))
        return false;
    double period = round(1.0 / p);
    return period >= 2 && period <= (double)UINT32_MAX;
}

bool km_sim_shared_available(char *why, size_t why_size)
{
    if (km_sim_broker_binary())
        return true;
    km_why(why, why_size, KM_ERR_NOT_FOUND,
           "the shared mode (--instances > 1) needs nats-server, which is not in PATH, /usr/sbin or "
           "/usr/local/sbin (Debian package nats-server)");
    return false;
}

void km_sim_config_init(km_sim_config *cfg)
{
    if (!cfg)
        return;
    memset(cfg, 0, sizeof *cfg);
    km_sim_generator_config_init(&cfg->generator);
    cfg->time_scale = 1.0;
    cfg->workers = 8;
    km_sim_engine_config_init(&cfg->engine);
    cfg->policies[0] = "kv";
    cfg->policies[1] = "cache_aware";
    cfg->policies[2] = "least_load";
    cfg->policies[3] = "round_robin";
    cfg->n_policies = 4;
    cfg->cut_worker = -1;
    cfg->restart_worker = -1;
    cfg->replay_buffer = 10000;
    cfg->restart_kvmatch_at_s = -1;
    cfg->approx_dispatch_max_bytes = -1;
    cfg->kill_instance_at_s = -1;
    cfg->nats_stop_at_s = -1;
    cfg->nats_stop_for_s = 2;
    cfg->instances = 1;
}

static double wall_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void sim_log(const km_sim_config *cfg, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sim_log(const km_sim_config *cfg, const char *fmt, ...)
{
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    if (cfg->log)
        cfg->log(cfg->log_user, line);
    else
        fprintf(stderr, "kvmatch sim: %s\n", line);
}

static void quiet(void *user, const char *line)
{
    (void)user;
    (void)line;
}

/* Per request, what the run learns about it. */
typedef struct req_state {
    uint64_t arrival_us;
    uint64_t decision_id;
    uint32_t worker;          /* the worker the router sent it to (the chosen one, or an override) */
    uint32_t predicted_depth; /* that worker's depth in the decision */
    uint32_t truth_depth;     /* that engine's cached depth at the decision instant */
    bool chosen_degraded;     /* the decision said the chosen worker's history was lost */
    uint8_t inst;             /* the instance that decided it */
    bool routed, admitted, first_token, finished;
    uint32_t cached_tokens;   /* engine-reported, at admission */
    uint32_t warm_up_tokens;  /* a warm-up's prompt (its index follows the workload's requests) */
} req_state;

/* One kvmatch instance of the run: a server in this process (or a running one with `connect`)
 * and the router's connection to it. */
typedef struct sim_instance {
    char sock[160], addr[180], records[512];
    char id[16];        /* its cluster instance id (shared mode) */
    km_server *server;
    pthread_t thread;
    bool running;
    bool dead;          /* killed by the fault: routes and reports no longer reach it */
    int status;
    km_client *client;
} sim_instance;

typedef struct run {
    const km_sim_config *cfg;
    const km_trace *trace;
    km_sim_result *res;
    char dir[64];
    uint32_t n_inst;
    sim_instance inst[KM_SIM_MAX_INSTANCES];
    uint32_t ingress_rr;      /* the next routed request's instance, round robin */
    const char *cluster_url;  /* shared mode: the broker all instances share; NULL otherwise */
    km_sim_broker *broker;    /* shared mode: that broker (the NATS outage fault stops it) */
    uint32_t n_alive;         /* instances not killed */
    bool killed, kill_expired; /* the kill fault: done; the survivors dropped its contribution */
    bool nats_down, nats_back; /* the NATS outage fault: begun; over, every view whole again */
    char cluster_subject[64]; /* shared mode: this run's subject prefix */
    uint32_t *own_in_flight;  /* [inst * workers + w]: requests the instance sent to w and has not
                               * yet been told finished */
    uint8_t *pending_inst;    /* per pending report: the instance it goes to */
    km_lifecycle_event *batch; /* one instance's reports, gathered for sending */
    size_t cap_batch;
    km_sim_engine **engines;
    km_publisher **pubs;
    uint64_t *published; /* per worker: messages published (next seq) */
    uint32_t worker_base; /* worker ids used: base .. base + workers - 1 */
    char pool[64];
    req_state *reqs;
    km_lifecycle_event *pending; /* lifecycle reports to send */
    size_t n_pending, cap_pending;
    double *ttft_ms; /* the requests' from cfg->ttft_from on */
    size_t n_ttft;
    double *every_ttft_ms; /* every request's */
    size_t n_every_ttft;
    double *finish_s; /* virtual finish time of each finished request, in finishing order */
    size_t n_finish;
    double *last_admit_s; /* per worker: the latest admission, virtual seconds */
    double *first_token_s; /* virtual time of each first token */
    size_t n_first_token;
    double *decision_us;
    size_t n_decision;
    double decision_wall;
    uint64_t *per_worker;
    uint32_t rr;        /* round-robin fallback when a route fails */
    uint32_t bypass_rr; /* the second ingress path's own round robin */
    size_t n_warm_ups;  /* warm-ups sent: reqs[requests + k] is the k-th */
    /* Output tokens of the requests the router has seen finish: a router knows an answer's
     * length only once it ends, so its expectation for the next request is their mean. */
    uint64_t finished_output_tokens, finished_outputs;
    /* Faults' random draws, in two streams: rng per request (second ingress, override), so every
     * policy gets the same draws for the same request; drop_rng per engine message, whose number
     * depends on the policy. */
    uint64_t rng, drop_rng;
    uint64_t *live_next; /* per worker: seq after the last message sent live (the barrier's goal) */
    uint64_t t0_us;      /* first arrival: fault times count from it */
    bool restarted, kvmatch_restarted;
    int *open_window; /* per worker: index into res->windows of its open window, -1 none,
                       * -2 open but not listed (over KM_SIM_MAX_WINDOWS) */
    uint32_t open_count;
    const char *policy;
    bool direct; /* no kvmatch: every request goes round robin straight to an engine, and the
                  * engines' messages reach nobody (the capacity probes) */
    km_server_worker *ws; /* the pool's workers, for (re)starting the server */
    char (*names)[32];
    char snap_dir[96];
    uint32_t subscriptions; /* per publisher, in total (a restarted server subscribes again) */
    uint32_t *tokens;
    uint64_t *chains;
    size_t cap_tokens;
} run;

static void *server_main(void *arg)
{
    sim_instance *in = arg;
    in->status = km_server_run(in->server, false);
    return NULL;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* The q-quantile of v's n values (index round(q * (n - 1)) after sorting); NAN with none. */
static double pct(double *v, size_t n, double q)
{
    if (!n)
        return NAN;
    qsort(v, n, sizeof *v, cmp_double);
    size_t i = (size_t)(q * (double)(n - 1) + 0.5);
    return v[i < n ? i : n - 1];
}

/* The mean, median and 99th percentile of n TTFTs (sorts v); NAN each without a sample. */
static void ttft_figures(double *v, size_t n, double *mean, double *p50, double *p99)
{
    double sum = 0;
    for (size_t i = 0; i < n; i++)
        sum += v[i];
    *mean = n ? sum / (double)n : NAN;
    *p50 = pct(v, n, 0.50);
    *p99 = pct(v, n, 0.99);
}

/* The request's tokens (expanded from its ids, cut to input_length) and their chain hashes, then
 * the *n_answer tokens of its answer the ids cover (answer_tokens, none when the prompt is cut
 * for the server's limit) after them in r->tokens. Only the ids the cut keeps are expanded: a
 * long id list costs nothing past the answer. */
static int request_tokens(run *r, const km_trace_request *q, uint32_t *n_tokens, uint32_t *n_blocks,
                          uint32_t *n_answer)
{
    if (q->n_ids == 0 || q->input_length == 0)
        return KM_ERR_INVALID_ARGUMENT; /* the loader and the generator never give one */
    /* A prompt longer than the server takes is expanded only one token past its limit, enough
     * for the server to refuse the route (a route error), not the whole input_length. */
    uint64_t input = q->input_length;
    const km_welcome *wel = r->inst[0].client ? km_client_welcome(r->inst[0].client) : NULL;
    uint64_t answer = q->answer_tokens;
    if (wel && input > (uint64_t)wel->limits.max_tokens_per_route) {
        input = (uint64_t)wel->limits.max_tokens_per_route + 1;
        answer = 0;
    }
    uint64_t used = (input + answer + KM_SIM_TOKENS_PER_ID - 1) / KM_SIM_TOKENS_PER_ID;
    uint32_t n_ids = used < q->n_ids ? (uint32_t)used : q->n_ids;
    size_t need = (size_t)n_ids * KM_SIM_TOKENS_PER_ID;
    if (need > r->cap_tokens) {
        uint32_t *t = realloc(r->tokens, need * sizeof *t);
        uint64_t *c = realloc(r->chains, need * sizeof *c);
        if (t)
            r->tokens = t;
        if (c)
            r->chains = c;
        if (!t || !c)
            return KM_ERR_OUT_OF_MEMORY;
        r->cap_tokens = need;
    }
    for (uint32_t i = 0; i < n_ids; i++)
        km_trace_id_tokens(q->ids[i], KM_SIM_TOKENS_PER_ID, r->tokens + (size_t)i * KM_SIM_TOKENS_PER_ID);
    uint32_t n = input < need ? (uint32_t)input : (uint32_t)need;
    km_hash_config hc = {r->cfg->engine.model.block_size, NULL, NULL};
    size_t nb = 0;
    int rc = km_hash_sequence(&hc, r->tokens, n, 0, KM_NO_PARENT, NULL, r->chains, &nb);
    *n_tokens = n;
    *n_blocks = (uint32_t)nb;
    *n_answer = need - n < answer ? (uint32_t)(need - n) : (uint32_t)answer;
    return rc;
}

/* Queue a lifecycle report for request `index`, stamped with the router's elapsed time: virtual
 * microseconds `time_us` since its arrival, as a router would measure on its own clock. */
static int queue_report(run *r, km_lifecycle_kind kind, size_t index, uint64_t time_us)
{
    size_t cap = r->cap_pending;
    if (KM_ARRAY_GROW(r->pending, r->cap_pending, r->n_pending + 1, 64))
        return KM_ERR_OUT_OF_MEMORY;
    if (r->cap_pending != cap) {
        uint8_t *pi = realloc(r->pending_inst, r->cap_pending);
        if (!pi)
            return KM_ERR_OUT_OF_MEMORY;
        r->pending_inst = pi;
    }
    const req_state *s = &r->reqs[index];
    bool warm_up = index >= r->trace->n_requests;
    r->pending_inst[r->n_pending] = s->inst;
    if (kind == KM_LIFECYCLE_FINISHED) {
        uint32_t w = s->worker - r->worker_base;
        uint32_t *own = w < r->cfg->workers
                            ? &r->own_in_flight[(size_t)s->inst * r->cfg->workers + w]
                            : NULL;
        if (own && *own)
            (*own)--;
    }
    km_lifecycle_event *e = &r->pending[r->n_pending];
    memset(e, 0, sizeof *e);
    e->kind = kind;
    e->has_decision_id = true;
    e->decision_id = s->decision_id;
    e->has_worker = true;
    e->worker = s->worker;
    e->has_elapsed_ms = true;
    e->elapsed_ms = time_us > s->arrival_us ? (double)(time_us - s->arrival_us) / 1000.0 : 0.0;
    if (kind == KM_LIFECYCLE_FINISHED) {
        km_trace_request prefill = {0};
        prefill.input_length = s->warm_up_tokens;
        prefill.output_length = 1;
        const km_trace_request *q = warm_up ? &prefill : &r->trace->requests[index];
        e->outcome = KM_OUTCOME_COMPLETE;
        e->finish_reason = "length";
        e->done_seen = true;
        e->has_http_status = true;
        e->http_status = 200;
        e->has_cached_tokens = s->admitted;
        e->cached_tokens = s->cached_tokens;
        e->has_prompt_tokens = true;
        e->prompt_tokens = q->input_length;
        e->has_output_tokens = true;
        e->output_tokens = q->output_length ? q->output_length : 1;
    }
    r->n_pending++;
    return KM_OK;
}

/* Send the queued lifecycle reports, each to the instance that decided its request (in the
 * order they were queued), in frames of at most the server's max_batch_items. */
static int flush_reports(run *r, char *why, size_t why_size)
{
    if (!r->n_pending)
        return KM_OK;
    for (uint32_t i = 0; i < r->n_inst; i++) {
        const km_lifecycle_event *events = r->pending;
        size_t total = r->n_pending;
        if (r->n_inst > 1) {
            if (KM_ARRAY_GROW(r->batch, r->cap_batch, r->n_pending, 64))
                return km_why(why, why_size, KM_ERR_OUT_OF_MEMORY, "out of memory");
            total = 0;
            for (size_t k = 0; k < r->n_pending; k++)
                if (r->pending_inst[k] == i)
                    r->batch[total++] = r->pending[k];
            events = r->batch;
        }
        if (r->inst[i].dead) {
            /* Nobody receives them: the router's reports of a killed instance's requests. */
            for (size_t k = 0; k < r->n_pending; k++)
                r->res->reports_lost_to_kill += r->pending_inst[k] == i;
            continue;
        }
        km_client *c = r->inst[i].client;
        const km_welcome *wel = km_client_welcome(c);
        size_t per = wel && wel->limits.max_batch_items ? wel->limits.max_batch_items : 1024;
        for (size_t at = 0; at < total; at += per) {
            size_t n = total - at < per ? total - at : per;
            km_message reply;
            int rc = km_client_lifecycle(c, events + at, (uint32_t)n, 10000, &reply);
            if (rc != KM_OK)
                return km_why(why, why_size, rc, "instance %u: lifecycle reports: %s", i,
                              km_client_last_error(c));
        }
    }
    r->n_pending = 0;
    return KM_OK;
}

/* The next draw of a splitmix64 stream. */
static uint64_t stream_rand(uint64_t *state)
{
    uint64_t z = (*state += UINT64_C(0x9e3779b97f4a7c15));
    z = (z ^ (z >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
    z = (z ^ (z >> 27)) * UINT64_C(0x94d049bb133111eb);
    return z ^ (z >> 31);
}

/* The per-request stream's next draw. */
static uint64_t fault_rand(run *r)
{
    return stream_rand(&r->rng);
}

/* One draw of a stream: true with probability p (53 random bits against p). */
static bool stream_chance(uint64_t *state, double p)
{
    return (double)(stream_rand(state) >> 11) * (1.0 / 9007199254740992.0) < p;
}

static bool fault_chance(run *r, double p)
{
    return stream_chance(&r->rng, p);
}

/* Is worker w's message at virtual time now lost on the wire? */
static bool message_dropped(run *r, uint32_t w, uint64_t now_us)
{
    const km_sim_config *cfg = r->cfg;
    double t = (double)(now_us - r->t0_us) / 1e6;
    if (cfg->cut_worker == (int)w && t >= cfg->cut_at_s && t < cfg->cut_at_s + cfg->cut_for_s)
        return true;
    if (cfg->drop_events > 0 && t >= cfg->drop_from_s)
        return stream_chance(&r->drop_rng, cfg->drop_events);
    return false;
}

/* A FINISHED report queued for a request (or a warm-up) the engine rejected: an error, nothing
 * generated, so kvmatch neither counts an answer nor learns its blocks as held. */
static void report_rejected(km_lifecycle_event *e)
{
    e->outcome = KM_OUTCOME_ERROR;
    e->error = "the engine cannot hold this request";
    e->finish_reason = NULL;
    e->done_seen = false;
    e->has_output_tokens = false; /* none was generated */
}

/* A user request's first token: its TTFT counts from cfg->ttft_from on, its time always. */
static void note_first_token(run *r, const km_sim_completion *c, const req_state *s)
{
    double ttft_ms = (double)(c->time_us - s->arrival_us) / 1000.0;
    if (c->request_id >= r->cfg->ttft_from)
        r->ttft_ms[r->n_ttft++] = ttft_ms;
    r->every_ttft_ms[r->n_every_ttft++] = ttft_ms;
    r->first_token_s[r->n_first_token++] = (double)c->time_us / 1e6;
}

/* Drain an engine's completions and messages at virtual time `now`. */
static int drain_engine(run *r, uint32_t w, uint64_t now_us, char *why, size_t why_size)
{
    km_sim_completion c;
    while (km_sim_engine_next_completion(r->engines[w], &c)) {
        if (c.request_id >= r->trace->n_requests) {
            /* A warm-up: its lifecycle goes to kvmatch; no user waits for it, so nothing of it
             * counts in the requests' figures. */
            req_state *s = &r->reqs[c.request_id];
            int rc = KM_OK;
            if (c.kind == KM_SIM_ADMITTED) {
                s->admitted = true;
                s->cached_tokens = c.cached_tokens;
                r->res->warm_up_prefill_tokens +=
                    s->warm_up_tokens > c.cached_tokens ? s->warm_up_tokens - c.cached_tokens : 0;
            } else if (c.kind == KM_SIM_FIRST_TOKEN) {
                rc = queue_report(r, KM_LIFECYCLE_FIRST_TOKEN, c.request_id, c.time_us);
            } else {
                s->finished = true;
                rc = queue_report(r, KM_LIFECYCLE_FINISHED, c.request_id, c.time_us);
                r->res->warm_ups_rejected += c.kind == KM_SIM_REJECTED;
                if (!rc && c.kind == KM_SIM_REJECTED)
                    report_rejected(&r->pending[r->n_pending - 1]);
            }
            if (rc)
                return km_why(why, why_size, rc, "out of memory");
            continue;
        }
        req_state *s = &r->reqs[c.request_id];
        if (!s->routed) {
            /* Not decided by kvmatch (second ingress, route error): the engine's facts count,
             * nothing is reported to kvmatch. */
            if (c.kind == KM_SIM_ADMITTED) {
                r->res->actual_reused_tokens += c.cached_tokens;
                r->last_admit_s[w] = (double)c.time_us / 1e6;
            }
            else if (c.kind == KM_SIM_FIRST_TOKEN) {
                note_first_token(r, &c, s);
            }
            else if (c.kind == KM_SIM_FINISHED) {
                r->res->output_tokens += c.output_tokens;
                r->finish_s[r->n_finish++] = (double)c.time_us / 1e6;
            }
            if (c.kind == KM_SIM_FINISHED || c.kind == KM_SIM_REJECTED)
                s->finished = true;
            r->res->rejected += c.kind == KM_SIM_REJECTED;
            if (c.kind == KM_SIM_FINISHED && c.time_us / 1e6 > r->res->makespan_s)
                r->res->makespan_s = (double)c.time_us / 1e6;
            continue;
        }
        int rc = KM_OK;
        switch (c.kind) {
        case KM_SIM_ADMITTED:
            r->last_admit_s[w] = (double)c.time_us / 1e6;
            s->admitted = true;
            s->cached_tokens = c.cached_tokens;
            r->res->actual_reused_tokens += c.cached_tokens;
            if (s->predicted_depth == c.held_blocks)
                r->res->realized_as_predicted++;
            else if (s->truth_depth != s->predicted_depth) {
                r->res->diff_index_wrong++;
                if (r->cfg->approx)
                    r->res->diff_assumed++;
                else if (s->chosen_degraded)
                    r->res->diff_lost++;
                else
                    r->res->diff_not_delivered++;
            }
            else
                r->res->diff_cache_changed++;
            break;
        case KM_SIM_FIRST_TOKEN:
            s->first_token = true;
            note_first_token(r, &c, s);
            rc = queue_report(r, KM_LIFECYCLE_FIRST_TOKEN, c.request_id, c.time_us);
            break;
        case KM_SIM_FINISHED:
            s->finished = true;
            r->res->output_tokens += c.output_tokens;
            r->finished_output_tokens += c.output_tokens;
            r->finished_outputs++;
            r->finish_s[r->n_finish++] = (double)c.time_us / 1e6;
            if (c.time_us / 1e6 > r->res->makespan_s)
                r->res->makespan_s = (double)c.time_us / 1e6;
            rc = queue_report(r, KM_LIFECYCLE_FINISHED, c.request_id, c.time_us);
            break;
        case KM_SIM_REJECTED:
            r->res->rejected++;
            s->finished = true;
            rc = queue_report(r, KM_LIFECYCLE_FINISHED, c.request_id, c.time_us);
            if (!rc)
                report_rejected(&r->pending[r->n_pending - 1]);
            break;
        }
        if (rc)
            return km_why(why, why_size, rc, "out of memory");
    }
    km_sim_message m;
    while (km_sim_engine_take_message(r->engines[w], &m)) {
        int rc = KM_OK;
        if (r->cfg->approx || r->direct) { /* no event stream: the messages reach nobody */
            r->published[w] = m.seq + 1;
            continue;
        }
        bool drop = message_dropped(r, w, now_us);
        r->res->dropped_messages += drop;
        if (r->cfg->zmq) {
            /* Dropped live, still buffered: the replay endpoint can give it back. */
            uint64_t seq;
            if (drop)
                km_publisher_drop_live(r->pubs[w], true);
            rc = km_publisher_publish(r->pubs[w], m.payload, m.payload_size, &seq);
            if (drop)
                km_publisher_drop_live(r->pubs[w], false);
        } else if (!drop) {
            /* Every instance indexes every engine. */
            for (uint32_t i = 0; i < r->n_inst && rc == KM_OK; i++)
                if (!r->inst[i].dead)
                    rc = km_server_deliver_events(r->inst[i].server, r->worker_base + w, m.seq,
                                                  m.payload, m.payload_size);
        }
        if (!drop)
            r->live_next[w] = m.seq + 1;
        if (rc != KM_OK)
            return km_why(why, why_size, rc, "worker %u: delivering events: %s", w, km_strerror(rc));
        r->published[w] = m.seq + 1;
    }
    return KM_OK;
}

/* Over ZMQ, wait until the server has taken every published message of every worker (its next
 * seq caught up); in process, delivery is synchronous. Bounded: a worker that never catches up
 * (a fault) stops being waited for. */
static int wait_delivered(run *r, char *why, size_t why_size)
{
    if (!r->cfg->zmq)
        return KM_OK;
    for (int tries = 0; tries < 400; tries++) {
        km_message m, reply;
        memset(&m, 0, sizeof m);
        m.type = KM_MESSAGE_WORKERS;
        m.workers.action = KM_ADMIN_LIST;
        m.workers.pool = r->pool;
        int rc = km_client_call(r->inst[0].client, &m, 10000, &reply);
        if (rc != KM_OK)
            return km_why(why, why_size, rc, "worker list: %s",
                          km_client_last_error(r->inst[0].client));
        bool all = true;
        for (uint32_t i = 0; i < reply.workers.n_workers; i++) {
            const km_worker_info *wi = &reply.workers.workers[i];
            uint32_t w = wi->worker - r->worker_base;
            /* Only what was sent live can be waited for: a dropped message shows up as a gap,
             * which replay may or may not fill. */
            if (w < r->cfg->workers && (!wi->has_expected_seq || wi->expected_seq < r->live_next[w]))
                all = false;
        }
        if (all)
            return KM_OK;
        struct timespec ts = {0, 500000};
        nanosleep(&ts, NULL);
    }
    return KM_OK;
}

/* A decision showed worker w's index state: open or close its recovery window. */
static void observe_state(run *r, uint32_t w, const char *state, uint64_t now_us)
{
    if (!state || w >= r->cfg->workers)
        return;
    double t = (double)(now_us - r->t0_us) / 1e6;
    bool live = !strcmp(state, "LIVE") || !strcmp(state, "APPROX");
    int *ow = &r->open_window[w];
    if (live && *ow != -1) {
        if (*ow >= 0)
            r->res->windows[*ow].end_s = t;
        *ow = -1;
        r->open_count--;
    } else if (!live && *ow == -1) {
        r->res->windows_total++;
        r->open_count++;
        if (r->res->n_windows < KM_SIM_MAX_WINDOWS) {
            km_sim_window *win = &r->res->windows[r->res->n_windows];
            memset(win, 0, sizeof *win);
            win->worker = w;
            snprintf(win->state, sizeof win->state, "%s", state);
            win->start_s = t;
            win->end_s = -1;
            *ow = (int)r->res->n_windows++;
        } else {
            *ow = -2;
        }
    }
}

static km_cluster *inst_cluster(run *r, uint32_t i)
{
    return r->inst[i].dead || !r->inst[i].server ? NULL : km_server_cluster(r->inst[i].server);
}

/* Has every fault of the run recovered (none configured: false)? */
static bool faults_recovered(const run *r)
{
    const km_sim_config *cfg = r->cfg;
    bool kill = cfg->kill_instance_at_s >= 0, nats = cfg->nats_stop_at_s >= 0;
    return (kill || nats) && (!kill || r->kill_expired) && (!nats || r->nats_back);
}

/* Shared mode: what a decision's view was (load_scope, stale contributions, the killed
 * instance's contribution still counted). */
static void observe_cluster_view(run *r, const km_route_decision *d, bool cluster_scope)
{
    km_sim_result *res = r->res;
    bool this_instance = d->load_scope && !strncmp(d->load_scope, "this_instance", 13);
    res->this_instance_decisions += this_instance;
    res->stale_view_decisions += d->load_stale_instances && d->load_stale_instances[0];
    /* The decider's remote contributions are the other survivors' plus, until it expires, the
     * killed instance's. */
    bool counting_killed = r->killed && !this_instance && d->load_instances >= r->n_alive;
    res->counting_killed_decisions += counting_killed;
    if (faults_recovered(r)) {
        res->decisions_after_faults++;
        res->cluster_scope_after_faults += cluster_scope;
        res->counting_killed_after_faults += counting_killed;
    }
}

static void sleep_us(long us)
{
    struct timespec ts = {0, us * 1000};
    nanosleep(&ts, NULL);
}

/* Does every live instance j hold a contribution of every other live instance i, with every
 * message i had sent when `sent` was taken (sent[i] = {incarnation, seq}; NULL: any)? Instances
 * not connected to NATS neither send nor receive: they are left out. */
static bool propagated(run *r, const uint64_t (*sent)[2], const bool *connected)
{
    for (uint32_t i = 0; i < r->n_inst; i++) {
        if (r->inst[i].dead || !connected[i] || (sent && sent[i][1] == 0))
            continue;
        for (uint32_t j = 0; j < r->n_inst; j++) {
            km_cluster *cj = inst_cluster(r, j);
            uint64_t inc, seq;
            if (j == i || !cj || !connected[j])
                continue;
            if (km_cluster_get_applied(cj, r->inst[i].id, &inc, &seq) != KM_OK)
                return false;
            if (sent && (inc != sent[i][0] || seq < sent[i][1]))
                return false;
        }
    }
    return true;
}

static void connected_now(run *r, bool *connected)
{
    for (uint32_t i = 0; i < r->n_inst; i++) {
        km_cluster_stats st;
        km_cluster *c = inst_cluster(r, i);
        connected[i] = c && km_cluster_get_stats(c, &st) == KM_OK && st.connected;
    }
}

/* Shared mode, before a decision: propagation made explicit in virtual time. Every change an
 * instance has sent so far (its sent sequence number now) is applied by every other connected
 * instance before the decision is taken, however long NATS takes in wall time (at most
 * KM_SIM_PROPAGATION_WAIT_MS, then counted in propagation_timeouts): no decision sees a view
 * older than the virtual instant it is taken at. A change not sent (an injected drop) is not
 * waited for: it is a gap, which the next message shows. */
static void wait_propagated(run *r)
{
    if (!r->cluster_url || r->nats_down)
        return;
    uint64_t sent[KM_SIM_MAX_INSTANCES][2] = {{0}};
    bool connected[KM_SIM_MAX_INSTANCES];
    connected_now(r, connected);
    for (uint32_t i = 0; i < r->n_inst; i++) {
        km_cluster *c = inst_cluster(r, i);
        if (c)
            km_cluster_get_sent(c, &sent[i][0], &sent[i][1]);
    }
    double deadline = wall_s() + KM_SIM_PROPAGATION_WAIT_MS / 1000.0;
    while (!propagated(r, (const uint64_t(*)[2])sent, connected)) {
        if (wall_s() > deadline) {
            r->res->propagation_timeouts++;
            return;
        }
        sleep_us(50);
    }
}

/* Wait (wall time, at most ms) until `done`; false when it never was. */
static bool wait_until(run *r, bool (*done)(run *r), uint32_t ms)
{
    double deadline = wall_s() + ms / 1000.0;
    while (!done(r)) {
        if (wall_s() > deadline)
            return false;
        sleep_us(1000);
    }
    return true;
}

/* The killed instance's contribution has left every survivor's view. */
static bool killed_expired(run *r)
{
    const char *id = r->inst[r->n_inst - 1].id;
    for (uint32_t i = 0; i < r->n_inst; i++) {
        km_cluster *c = inst_cluster(r, i);
        uint64_t inc, seq;
        if (c && km_cluster_get_applied(c, id, &inc, &seq) != KM_ERR_NOT_FOUND)
            return false;
    }
    return true;
}

/* NATS is gone for every live instance: disconnected, every remote contribution expired. */
static bool cut_off(run *r)
{
    for (uint32_t i = 0; i < r->n_inst; i++) {
        km_cluster *c = inst_cluster(r, i);
        km_cluster_stats st;
        if (c && (km_cluster_get_stats(c, &st) != KM_OK || st.connected || st.instances))
            return false;
    }
    return true;
}

/* NATS is back: every live instance connected and holding every other's contribution. */
static bool rejoined(run *r)
{
    bool connected[KM_SIM_MAX_INSTANCES];
    connected_now(r, connected);
    for (uint32_t i = 0; i < r->n_inst; i++)
        if (!r->inst[i].dead && !connected[i])
            return false;
    return propagated(r, NULL, connected);
}

/* Add an instance's cluster counters to the run's. */
static void add_cluster_stats(run *r, uint32_t i)
{
    km_cluster *c = inst_cluster(r, i);
    km_cluster_stats st;
    if (!c || km_cluster_get_stats(c, &st) != KM_OK)
        return;
    r->res->cluster_lost_messages += st.lost_messages;
    r->res->cluster_expired += st.expired_instances;
    r->res->cluster_reconnects += st.reconnects;
    r->res->cluster_publish_failures += st.publish_failures;
}

/* The kill fault: the last instance stops for good (its server, and with it its cluster handle:
 * it falls silent). What the router had queued for it is sent first; nothing after. */
static int kill_instance(run *r, char *why, size_t why_size)
{
    int rc = flush_reports(r, why, why_size);
    if (rc)
        return rc;
    sim_instance *in = &r->inst[r->n_inst - 1];
    add_cluster_stats(r, r->n_inst - 1);
    km_client_close(in->client);
    in->client = NULL;
    km_server_stop(in->server);
    pthread_join(in->thread, NULL);
    in->running = false;
    km_server_destroy(in->server);
    in->server = NULL;
    in->dead = true;
    r->n_alive--;
    r->killed = true;
    sim_log(r->cfg, "fault: instance %s killed", in->id);
    return KM_OK;
}

/* The faults of the shared mode whose time has come (virtual now_us). */
static int cluster_faults(run *r, uint64_t now_us, char *why, size_t why_size)
{
    const km_sim_config *cfg = r->cfg;
    if (!r->cluster_url)
        return KM_OK;
    double t = (double)(now_us - r->t0_us) / 1e6;
    int rc = KM_OK;
    if (cfg->kill_instance_at_s >= 0 && !r->killed && t >= cfg->kill_instance_at_s &&
        r->n_alive > 1)
        rc = kill_instance(r, why, why_size);
    /* The survivors drop the killed instance's contribution after the cluster's expiry: counted
     * in virtual time from the kill, waited for in wall time. */
    if (!rc && r->killed && !r->kill_expired &&
        t >= cfg->kill_instance_at_s + KM_SIM_CLUSTER_EXPIRE_MS / 1000.0) {
        if (!wait_until(r, killed_expired, KM_SIM_CLUSTER_EXPIRE_MS + 5000))
            r->res->propagation_timeouts++;
        r->kill_expired = true;
    }
    if (!rc && cfg->nats_stop_at_s >= 0 && !r->nats_down && !r->nats_back &&
        t >= cfg->nats_stop_at_s) {
        /* An outage longer than the expiry: the views are this instance's own until NATS is
         * back (waited for in wall time, so the virtual timeline does not depend on it). */
        km_sim_broker_kill(r->broker);
        r->nats_down = true;
        sim_log(cfg, "fault: nats-server stopped");
        if (!wait_until(r, cut_off, KM_SIM_CLUSTER_EXPIRE_MS + 5000))
            r->res->propagation_timeouts++;
    }
    if (!rc && r->nats_down && t >= cfg->nats_stop_at_s + cfg->nats_stop_for_s) {
        if ((rc = km_sim_broker_restart(r->broker, why, why_size)) != KM_OK)
            return rc;
        r->nats_down = false;
        r->nats_back = true;
        sim_log(cfg, "fault: nats-server started again");
        if (!wait_until(r, rejoined, 10000))
            r->res->propagation_timeouts++;
    }
    return rc;
}

/* The warm-up a decision asked for: the first `tokens` of the request's `n_tokens` tokens (still
 * in r->tokens) to the engine of worker id `worker`, one output token, dispatched at once and
 * reported to the instance that decided it under its own decision id. */
static int send_warm_up(run *r, uint8_t inst, uint32_t worker, uint64_t tokens, uint32_t n_tokens,
                        uint64_t decision_id, uint64_t now_us, char *why, size_t why_size)
{
    uint32_t w = worker - r->worker_base;
    if (worker < r->worker_base || w >= r->cfg->workers || tokens == 0 || tokens > n_tokens ||
        r->n_warm_ups >= r->trace->n_requests)
        return km_why(why, why_size, KM_ERR_PROTOCOL,
                      "a warm-up of %llu of the request's %u tokens for worker %u",
                      (unsigned long long)tokens, n_tokens, worker);
    size_t index = r->trace->n_requests + r->n_warm_ups++;
    req_state *s = &r->reqs[index];
    s->arrival_us = now_us;
    s->decision_id = decision_id;
    s->worker = worker;
    s->inst = inst;
    s->routed = true;
    s->warm_up_tokens = (uint32_t)tokens;
    r->own_in_flight[(size_t)inst * r->cfg->workers + w]++;
    r->res->warm_ups++;
    int rc = km_sim_engine_submit(r->engines[w], index, r->tokens, (uint32_t)tokens, 1, now_us);
    if (rc)
        return km_why(why, why_size, rc, "engine %u: %s", w,
                      km_sim_engine_last_error(r->engines[w]));
    if ((rc = queue_report(r, KM_LIFECYCLE_DISPATCHED, index, now_us)) != KM_OK)
        return km_why(why, why_size, rc, "out of memory");
    return KM_OK;
}

static int route_one(run *r, size_t index, uint64_t now_us, char *why, size_t why_size)
{
    const km_trace_request *q = &r->trace->requests[index];
    req_state *s = &r->reqs[index];
    uint32_t n_tokens, n_blocks, n_answer;
    int rc = request_tokens(r, q, &n_tokens, &n_blocks, &n_answer);
    if (rc)
        return km_why(why, why_size, rc, "request %zu: tokens", index);
    r->res->prompt_tokens += n_tokens;
    if (r->direct || (r->cfg->second_ingress > 0 && fault_chance(r, r->cfg->second_ingress))) {
        /* Another router sends it on, round robin, and never tells kvmatch. */
        uint32_t bw = r->bypass_rr++ % r->cfg->workers;
        r->res->bypassed++;
        s->worker = r->worker_base + bw;
        r->per_worker[bw]++;
        rc = km_sim_engine_submit_answered(r->engines[bw], index, r->tokens, n_tokens, n_answer,
                                           q->output_length ? q->output_length : 1, now_us);
        return rc ? km_why(why, why_size, rc, "engine %u: %s", bw,
                           km_sim_engine_last_error(r->engines[bw]))
                  : KM_OK;
    }
    char rid[32];
    snprintf(rid, sizeof rid, "r%zu", index);
    km_route_request route;
    memset(&route, 0, sizeof route);
    route.request_id = rid;
    route.attempt_id = "0";
    route.pool = r->pool;
    route.input = KM_ROUTE_INPUT_TOKENS;
    route.tokens = r->tokens;
    route.n_tokens = n_tokens;
    route.warm_ups = true; /* this router carries out the warm-ups decisions ask for */
    route.has_expected_output_tokens = r->finished_outputs > 0;
    if (route.has_expected_output_tokens)
        route.expected_output_tokens =
            (r->finished_output_tokens + r->finished_outputs / 2) / r->finished_outputs;
    /* The override fault, drawn before the decision: such a route asks for the candidates' depths
     * (the prediction for the worker it will really go to). */
    bool override = r->cfg->override > 0 && fault_chance(r, r->cfg->override);
    /* Several instances: the candidates' in-flight counts show whether others' load was seen. */
    route.brief = !override && r->n_inst == 1;
    uint32_t in = r->ingress_rr++ % r->n_inst;
    while (r->inst[in].dead)
        in = r->ingress_rr++ % r->n_inst;
    s->inst = (uint8_t)in;
    km_client *client = r->inst[in].client;
    km_message reply;
    double t0 = wall_s();
    rc = km_client_route(client, &route, 1, 10000, &reply);
    double dt = wall_s() - t0;
    r->decision_wall += dt;
    r->decision_us[r->n_decision++] = dt * 1e6;
    if (rc != KM_OK)
        return km_why(why, why_size, rc, "route %zu: %s", index, km_client_last_error(client));
    const km_route_decision *d = &reply.decision.decisions[0];
    bool warm_up = d->status == KM_OK && d->has_warm_up;
    uint32_t warm_worker = d->warm_up_worker;
    uint64_t warm_tokens = d->warm_up_tokens;
    uint64_t warm_decision = d->warm_up_decision_id;
    uint32_t w;
    if (d->status != KM_OK || d->chosen_worker < r->worker_base ||
        d->chosen_worker >= r->worker_base + r->cfg->workers) {
        r->res->route_errors++;
        if (r->res->route_errors <= 3)
            sim_log(r->cfg, "request %zu: %s", index, d->message ? d->message : "no decision");
        w = r->rr++ % r->cfg->workers;
    } else {
        w = d->chosen_worker - r->worker_base;
        uint32_t predicted = d->chosen_depth;
        const char *state = d->chosen_state;
        if (override) {
            /* The router sends it to another worker, uniformly drawn, and reports that one
             * (queue_report's `worker`): the prediction that counts is that worker's row. */
            uint32_t other = (w + 1 + (uint32_t)(fault_rand(r) % (r->cfg->workers - 1))) % r->cfg->workers;
            const km_candidate_score *row = NULL;
            for (uint32_t k = 0; k < d->n_candidates; k++)
                if (d->candidates[k].worker == r->worker_base + other)
                    row = &d->candidates[k];
            if (!row)
                return km_why(why, why_size, KM_ERR_PROTOCOL,
                              "route %zu: the decision has no candidate row for worker %u", index,
                              r->worker_base + other);
            w = other;
            predicted = row->depth;
            state = row->state;
            r->res->overridden++;
        }
        bool cluster_scope = d->load_scope && !strcmp(d->load_scope, "cluster") &&
                             d->load_instances > 0;
        r->res->cluster_scope_decisions += cluster_scope;
        if (r->cluster_url)
            observe_cluster_view(r, d, cluster_scope);
        const uint32_t *own = &r->own_in_flight[(size_t)in * r->cfg->workers];
        for (uint32_t k = 0; k < d->n_candidates; k++) {
            uint32_t cw = d->candidates[k].worker - r->worker_base;
            if (cw < r->cfg->workers && d->candidates[k].load.in_flight > own[cw]) {
                r->res->remote_load_seen++;
                break;
            }
        }
        s->routed = true;
        r->own_in_flight[(size_t)in * r->cfg->workers + w]++;
        s->decision_id = d->decision_id;
        s->predicted_depth = predicted;
        r->res->routed++;
        r->res->predicted_reused_tokens += (uint64_t)predicted * r->cfg->engine.model.block_size;
        /* The truth at the decision instant: what the engine it goes to caches now. */
        s->truth_depth = km_sim_engine_cached_depth(r->engines[w], r->chains, n_blocks);
        s->chosen_degraded = state && !strcmp(state, "DEGRADED");
        if (s->truth_depth == predicted) {
            r->res->exact_predictions++;
        } else {
            if (s->truth_depth < predicted)
                r->res->over_predictions++;
            else
                r->res->under_predictions++;
            if (km_sim_engine_pending_events(r->engines[w]))
                r->res->pending_at_decision++;
        }
        observe_state(r, d->chosen_worker - r->worker_base, d->chosen_state, now_us);
        if (d->has_owner)
            observe_state(r, d->owner_worker - r->worker_base, d->owner_state, now_us);
        if (r->open_count) {
            bool exact = s->truth_depth == predicted;
            r->res->decisions_in_windows++;
            r->res->exact_in_windows += exact;
            for (uint32_t k = 0; k < r->cfg->workers; k++)
                if (r->open_window[k] >= 0) {
                    r->res->windows[r->open_window[k]].decisions++;
                    r->res->windows[r->open_window[k]].exact += exact;
                }
        }
        if (d->has_owner && d->owner_worker != d->chosen_worker) {
            r->res->owner_not_chosen++;
            if (d->owner_depth > d->chosen_depth)
                r->res->owner_forgone_tokens +=
                    (uint64_t)(d->owner_depth - d->chosen_depth) * r->cfg->engine.model.block_size;
        }
    }
    s->worker = r->worker_base + w;
    r->per_worker[w]++;
    rc = km_sim_engine_submit_answered(r->engines[w], index, r->tokens, n_tokens, n_answer,
                                       q->output_length ? q->output_length : 1, now_us);
    if (rc)
        return km_why(why, why_size, rc, "engine %u: %s", w, km_sim_engine_last_error(r->engines[w]));
    /* The router sent it on at once. */
    if (s->routed && (rc = queue_report(r, KM_LIFECYCLE_DISPATCHED, index, now_us)) != KM_OK)
        return km_why(why, why_size, rc, "out of memory");
    if (warm_up)
        rc = send_warm_up(r, s->inst, warm_worker, warm_tokens, n_tokens, warm_decision, now_us,
                          why, why_size);
    return rc;
}

static void run_teardown(run *r)
{
    for (uint32_t i = 0; i < r->n_inst; i++) {
        sim_instance *in = &r->inst[i];
        km_client_close(in->client);
        in->client = NULL;
        if (in->running) {
            km_server_stop(in->server);
            pthread_join(in->thread, NULL);
            in->running = false;
        }
        km_server_destroy(in->server);
        in->server = NULL;
    }
    for (uint32_t w = 0; r->engines && w < r->cfg->workers; w++)
        km_sim_engine_destroy(r->engines[w]);
    for (uint32_t w = 0; r->pubs && w < r->cfg->workers; w++)
        km_publisher_stop(r->pubs[w]);
    free(r->engines);
    free(r->pubs);
    free(r->published);
    free(r->live_next);
    free(r->open_window);
    free(r->ws);
    free(r->names);
    if (r->snap_dir[0]) {
        char path[256];
        snprintf(path, sizeof path, "%s/%s.snap", r->snap_dir, r->pool);
        unlink(path);
        rmdir(r->snap_dir);
    }
    free(r->reqs);
    free(r->pending);
    free(r->pending_inst);
    free(r->batch);
    free(r->own_in_flight);
    free(r->ttft_ms);
    free(r->every_ttft_ms);
    free(r->finish_s);
    free(r->last_admit_s);
    free(r->first_token_s);
    free(r->decision_us);
    free(r->per_worker);
    free(r->tokens);
    free(r->chains);
    if (r->dir[0]) {
        for (uint32_t i = 0; i < r->n_inst; i++) {
            unlink(r->inst[i].sock);
            if (!r->cfg->records_dir)
                unlink(r->inst[i].records);
        }
        rmdir(r->dir);
    }
}

/* Instance i's kvmatch serve in this process for the run's pool (again after a restart fault);
 * in shared mode it joins the run's cluster (and has synced with the instances started before it
 * when this returns). */
static int start_server(run *r, uint32_t i, char *why, size_t why_size)
{
    sim_instance *in = &r->inst[i];
    const km_sim_config *cfg = r->cfg;
    km_server_pool pool;
    memset(&pool, 0, sizeof pool);
    pool.name = r->pool;
    pool.block_size = cfg->engine.model.block_size;
    km_policy_config_init(&pool.policy);
    if (km_policy_kind_parse(r->policy, &pool.policy.kind) != KM_OK)
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT, "unknown policy \"%s\"", r->policy);
    /* The router knows the engines it routes to: the policies that estimate times use the very
     * model the simulated engines run on, unless the run names another (checked). */
    pool.policy.engine = cfg->engine.model;
    if (cfg->policy_engine)
        km_engine_model_preset(cfg->policy_engine, &pool.policy.engine);
    pool.workers = r->ws;
    pool.n_workers = cfg->workers;
    /* Approximate mode: each worker's assumed blocks bounded as its engine's cache is, least
     * recently routed forgotten first. Its TTL and touch times count wall time, of which a run
     * spends too little for either: the TTL is set beyond any run (so the table does not depend
     * on how long the run took) and every touch counts. */
    pool.approx_capacity_blocks = cfg->approx ? cfg->engine.model.capacity_blocks : 0;
    pool.approx_ttl_ms = UINT64_C(1000000000000); /* 1e9 s */
    pool.approx_every_touch = true;
    km_server_config sc;
    km_server_config_init(&sc);
    sc.socket_path = in->sock;
    sc.records_path = in->records;
    if (r->cluster_url) {
        snprintf(in->id, sizeof in->id, "sim-%u", i);
        sc.cluster_url = r->cluster_url;
        sc.cluster_instance = in->id;
        sc.cluster_subject = r->cluster_subject;
        sc.cluster_expire_ms = KM_SIM_CLUSTER_EXPIRE_MS;
    }
    sc.max_workers = cfg->workers < 64 ? 64 : cfg->workers;
    sc.backend = KM_BACKEND_CPU;
    sc.index_threads = 1;
    if (cfg->approx_dispatch_max_bytes >= 0)
        sc.approx_dispatch_max_bytes = (uint64_t)cfg->approx_dispatch_max_bytes;
    /* The circuit breaker's cooldown counts wall time too: an engine restart failing its running
     * requests would hold the engine back for a wall-clock cooldown, so the table would depend on
     * the machine's speed. Off. */
    sc.breaker_failures = 0;
    /* Load shedding likewise answers by wall time: the simulator decides every route. */
    sc.max_queue_wait_ms = 0;
    sc.max_connection_routes = 0;
    sc.pools = &pool;
    sc.n_pools = 1;
    sc.log = quiet;
    if (r->snap_dir[0]) {
        sc.snapshot_dir = r->snap_dir;
        sc.snapshot_interval_ms = 0; /* only on the way out */
    }
    char addr[sizeof in->addr];
    snprintf(addr, sizeof addr, "unix:%s", in->sock);
    memcpy(in->addr, addr, sizeof addr);
    int rc = km_server_create(&sc, &in->server, why, why_size);
    if (rc)
        return rc;
    if (pthread_create(&in->thread, NULL, server_main, in) != 0)
        return km_why(why, why_size, KM_ERR_INTERNAL, "server thread");
    in->running = true;
    return KM_OK;
}

/* The kvmatch restart fault: the old server drains (writing its snapshot when configured) and a
 * new one starts on the same socket; the engines' publishers see a new subscriber. */
static int restart_kvmatch(run *r, char *why, size_t why_size)
{
    int rc = flush_reports(r, why, why_size);
    if (rc)
        return rc;
    sim_instance *in = &r->inst[0]; /* the fault needs a single instance */
    km_client_close(in->client);
    in->client = NULL;
    km_server_stop(in->server);
    pthread_join(in->thread, NULL);
    in->running = false;
    km_server_destroy(in->server);
    in->server = NULL;
    r->res->kvmatch_restarts++;
    if ((rc = start_server(r, 0, why, why_size)) != KM_OK)
        return rc;
    if ((rc = km_client_connect(in->addr, 10000, &in->client, why, why_size)) != KM_OK)
        return rc;
    r->subscriptions++;
    for (uint32_t w = 0; r->cfg->zmq && w < r->cfg->workers; w++)
        if (!km_publisher_wait_subscribers(r->pubs[w], r->subscriptions, 10000))
            return km_why(why, why_size, KM_ERR_TIMEOUT, "worker %u: the new server never subscribed", w);
    return KM_OK;
}

/* Finished requests per second between the 10th and the 90th percentile of the finish times (in
 * finishing order already, which is time order): the run's steady part, without ramp and drain. */
static double steady_throughput(double *finish_s, size_t n)
{
    if (n < 10)
        return 0;
    qsort(finish_s, n, sizeof *finish_s, cmp_double);
    size_t lo = n / 10, hi = n - 1 - n / 10;
    double span = finish_s[hi] - finish_s[lo];
    return span > 0 ? (double)(hi - lo) / span : 0;
}

/* Finished requests per second from the 10th percentile of finish times until `until` (the first
 * moment some engine had nothing left waiting): the throughput while every engine had a queue.
 * 0 when fewer than a tenth of the requests finished in that window. Call after
 * steady_throughput (which sorts finish_s). */
static double saturated_throughput(const double *finish_s, size_t n, double until)
{
    if (n < 10)
        return 0;
    size_t lo = n / 10, hi = lo;
    while (hi + 1 < n && finish_s[hi + 1] <= until)
        hi++;
    if (hi - lo < n / 10 || !(finish_s[hi] > finish_s[lo]))
        return 0;
    return (double)(hi - lo) / (finish_s[hi] - finish_s[lo]);
}

/* One policy's run on trace, at `load` (0: the trace's own times; it names the records file of
 * a sweep's load). */
static int run_policy(const km_sim_config *cfg, const km_trace *trace, const char *policy,
                      double load, bool direct, km_sim_broker *broker, unsigned run_no,
                      km_sim_result *res, char *why, size_t why_size)
{
    run r;
    memset(&r, 0, sizeof r);
    r.n_inst = cfg->mode == KM_SIM_MODE_SINGLE || direct ? 1 : cfg->instances;
    r.n_alive = r.n_inst;
    r.broker = broker;
    r.cluster_url = cfg->mode == KM_SIM_MODE_SHARED && !direct && broker ? broker->url : NULL;
    snprintf(r.cluster_subject, sizeof r.cluster_subject, "kvmatch.sim.run%u", run_no);
    r.direct = direct;
    r.cfg = cfg;
    r.trace = trace;
    r.res = res;
    r.policy = policy;
    memset(res, 0, sizeof *res);
    snprintf(res->policy, sizeof res->policy, "%s", policy);
    res->mode = cfg->mode;
    res->instances = r.n_inst;
    res->requests = trace->n_requests;
    double started = wall_s();
    uint32_t W = cfg->workers;
    size_t N = trace->n_requests;
    r.engines = calloc(W, sizeof *r.engines);
    r.pubs = calloc(W, sizeof *r.pubs);
    r.published = calloc(W, sizeof *r.published);
    r.live_next = calloc(W, sizeof *r.live_next);
    r.open_window = malloc((W ? W : 1) * sizeof *r.open_window);
    for (uint32_t w = 0; r.open_window && w < W; w++)
        r.open_window[w] = -1;
    r.rng = cfg->generator.seed ^ UINT64_C(0x66617573);
    r.drop_rng = cfg->generator.seed ^ UINT64_C(0x64726f70);
    r.per_worker = calloc(W, sizeof *r.per_worker);
    r.reqs = calloc(N ? 2 * N : 1, sizeof *r.reqs); /* the requests, then a warm-up each at most */
    r.ttft_ms = calloc(N ? N : 1, sizeof *r.ttft_ms);
    r.every_ttft_ms = calloc(N ? N : 1, sizeof *r.every_ttft_ms);
    r.finish_s = calloc(N ? N : 1, sizeof *r.finish_s);
    r.last_admit_s = calloc(W ? W : 1, sizeof *r.last_admit_s);
    r.first_token_s = calloc(N ? N : 1, sizeof *r.first_token_s);
    r.decision_us = calloc(N ? N : 1, sizeof *r.decision_us);
    r.own_in_flight = calloc((size_t)r.n_inst * (W ? W : 1), sizeof *r.own_in_flight);
    int rc = r.own_in_flight && r.open_window && r.live_next && r.engines && r.pubs &&
                     r.published && r.per_worker && r.reqs && r.ttft_ms && r.every_ttft_ms &&
                     r.finish_s && r.last_admit_s && r.first_token_s && r.decision_us
                 ? KM_OK
                 : km_why(why, why_size, KM_ERR_OUT_OF_MEMORY, "simulation state");
    snprintf(r.pool, sizeof r.pool, "sim-%s", policy);
    for (uint32_t w = 0; !rc && w < W; w++) {
        km_sim_engine_config ec = cfg->engine;
        ec.process_seed = cfg->generator.seed * 1000003u + w + 1;
        if ((rc = km_sim_engine_create(&ec, &r.engines[w])) != KM_OK)
            km_why(why, why_size, rc, "engine %u: %s", w, km_strerror(rc));
        if (!rc && cfg->zmq) {
            km_publisher_config pc;
            km_publisher_config_init(&pc);
            pc.buffer_steps = cfg->replay_buffer ? cfg->replay_buffer : 10000;
            rc = km_publisher_start(&pc, &r.pubs[w], why, why_size);
        }
    }
    bool pool_added = false; /* --connect: our pool, removed at the end */
    /* The server: here, or a running one. */
    if (!rc) {
        strcpy(r.dir, "/tmp/kvmatch-sim-XXXXXX");
        if (!mkdtemp(r.dir)) {
            r.dir[0] = '\0';
            rc = km_why(why, why_size, KM_ERR_IO, "temporary directory");
        }
    }
    if (!rc) {
        /* A sweep keeps each load's records apart: records-POLICY[-MODE-I]-loadX.jsonl. */
        char load_part[48] = "";
        if (cfg->n_loads > 1) {
            char label[32];
            km_sim_load_label(load, label, sizeof label);
            snprintf(load_part, sizeof load_part, "-load%s", label);
        }
        for (uint32_t i = 0; i < r.n_inst; i++) {
            sim_instance *in = &r.inst[i];
            snprintf(in->sock, sizeof in->sock, "%s/s%u.sock", r.dir, i);
            if (cfg->records_dir && r.n_inst == 1 && cfg->mode == KM_SIM_MODE_SINGLE)
                snprintf(in->records, sizeof in->records, "%s/records-%s%s.jsonl",
                         cfg->records_dir, policy, load_part);
            else if (cfg->records_dir)
                snprintf(in->records, sizeof in->records, "%s/records-%s-%s-%u%s.jsonl",
                         cfg->records_dir, policy, km_sim_mode_name(cfg->mode), i, load_part);
            else
                snprintf(in->records, sizeof in->records, "%s/records%u.jsonl", r.dir, i);
            snprintf(in->addr, sizeof in->addr, "%s", cfg->connect ? cfg->connect : "");
            /* The file holds this run's records alone: the server appends to an existing file,
             * and an earlier run's there would be joined with this one's. */
            if (!rc && cfg->records_dir && !cfg->connect && unlink(in->records) != 0 &&
                errno != ENOENT)
                rc = km_why(why, why_size, KM_ERR_IO, "records file %s cannot be replaced: %s",
                            in->records, strerror(errno));
        }
    }
    km_server_worker *ws = r.ws = calloc(W ? W : 1, sizeof *ws);
    char (*names)[32] = r.names = calloc(W ? W : 1, sizeof *names);
    if (!rc && cfg->restart_kvmatch_at_s >= 0 && cfg->restart_kvmatch_snapshot) {
        snprintf(r.snap_dir, sizeof r.snap_dir, "%s/snap", r.dir);
    }
    if (!rc && (!ws || !names))
        rc = km_why(why, why_size, KM_ERR_OUT_OF_MEMORY, "workers");
    for (uint32_t w = 0; !rc && w < W; w++) {
        snprintf(names[w], sizeof names[w], "engine-%u", w);
        ws[w].id = r.worker_base + w;
        ws[w].name = names[w];
        ws[w].event_endpoint = cfg->approx ? NULL
                               : cfg->zmq  ? km_publisher_endpoint(r.pubs[w])
                                           : KM_SERVER_LOCAL_EVENTS;
        ws[w].replay_endpoint = cfg->zmq ? km_publisher_replay_endpoint(r.pubs[w]) : NULL;
    }
    for (uint32_t i = 0; !rc && !cfg->connect && !direct && i < r.n_inst; i++)
        rc = start_server(&r, i, why, why_size);
    for (uint32_t i = 0; !rc && !direct && i < r.n_inst; i++)
        rc = km_client_connect(r.inst[i].addr, 10000, &r.inst[i].client, why, why_size);
    if (!rc && cfg->connect) {
        /* A running server: a pool of our own, then the workers. */
        km_message m, reply;
        memset(&m, 0, sizeof m);
        m.type = KM_MESSAGE_POOLS;
        m.pools.action = KM_ADMIN_ADD;
        km_pool_info pi;
        memset(&pi, 0, sizeof pi);
        pi.name = r.pool;
        pi.block_size = cfg->engine.model.block_size;
        pi.policy = policy;
        pi.engine = cfg->policy_engine   ? cfg->policy_engine
                    : cfg->engine_preset ? cfg->engine_preset
                                         : km_engine_model_preset_of(&cfg->engine.model);
        m.pools.pools = &pi;
        m.pools.n_pools = 1;
        rc = km_client_call(r.inst[0].client, &m, 10000, &reply);
        if (!rc && reply.ack.items[0].status != KM_OK)
            rc = km_why(why, why_size, reply.ack.items[0].status, "adding pool %s: %s", r.pool,
                        reply.ack.items[0].message);
        pool_added = rc == KM_OK;
        km_worker_info *wi = calloc(W ? W : 1, sizeof *wi);
        for (uint32_t w = 0; !rc && wi && w < W; w++) {
            wi[w].pool = r.pool;
            wi[w].worker = ws[w].id;
            wi[w].name = ws[w].name;
            wi[w].event_endpoint = ws[w].event_endpoint;
            wi[w].replay_endpoint = ws[w].replay_endpoint;
        }
        memset(&m, 0, sizeof m);
        m.type = KM_MESSAGE_WORKERS;
        m.workers.action = KM_ADMIN_ADD;
        m.workers.workers = wi;
        m.workers.n_workers = W;
        if (!rc && wi && (rc = km_client_call(r.inst[0].client, &m, 10000, &reply)) == KM_OK)
            for (uint32_t w = 0; w < W && !rc; w++)
                if (reply.ack.items[w].status != KM_OK)
                    rc = km_why(why, why_size, reply.ack.items[w].status, "adding worker %u: %s",
                                ws[w].id, reply.ack.items[w].message);
        free(wi);
    }
    /* The lossy link: every instance's cluster handle sends no change in every round(1/P). */
    for (uint32_t i = 0; !rc && r.cluster_url && cfg->cluster_loss > 0 && i < r.n_inst; i++)
        km_cluster_set_drop_one_in(inst_cluster(&r, i),
                                   (uint32_t)round(1.0 / cfg->cluster_loss));
    r.subscriptions = 1;
    for (uint32_t w = 0; !rc && cfg->zmq && w < W; w++)
        if (!km_publisher_wait_subscribers(r.pubs[w], 1, 10000))
            rc = km_why(why, why_size, KM_ERR_TIMEOUT, "worker %u: the server never subscribed", w);

    /* The virtual-time loop. */
    size_t next = 0;
    uint64_t first_arrival = N ? trace->requests[0].timestamp_ms * 1000u : 0;
    r.t0_us = first_arrival;
    while (!rc) {
        uint64_t t_arrival = next < N ? trace->requests[next].timestamp_ms * 1000u : UINT64_MAX;
        uint64_t t_engine = UINT64_MAX;
        for (uint32_t w = 0; w < W; w++) {
            uint64_t t = km_sim_engine_next_event_us(r.engines[w]);
            if (t < t_engine)
                t_engine = t;
        }
        if (t_arrival == UINT64_MAX && t_engine == UINT64_MAX)
            break;
        if (t_engine <= t_arrival) {
            for (uint32_t w = 0; w < W && !rc; w++)
                if (km_sim_engine_next_event_us(r.engines[w]) <= t_engine) {
                    rc = km_sim_engine_advance(r.engines[w], t_engine);
                    if (rc)
                        km_why(why, why_size, rc, "engine %u: %s", w,
                               km_sim_engine_last_error(r.engines[w]));
                }
        } else {
            /* Events as they happen: what a step in progress changed is told now. */
            for (uint32_t w = 0; w < W && !rc && !cfg->step_delivery; w++)
                if (km_sim_engine_pending_events(r.engines[w])) {
                    rc = km_sim_engine_end_step(r.engines[w], t_arrival, NULL);
                    if (!rc)
                        rc = drain_engine(&r, w, t_arrival, why, why_size);
                }
            /* Everything the engines published is with the server before it decides. */
            if (!rc)
                rc = flush_reports(&r, why, why_size);
            if (!rc)
                rc = wait_delivered(&r, why, why_size);
            if (!rc)
                wait_propagated(&r);
            if (!rc) {
                r.reqs[next].arrival_us = t_arrival;
                uint32_t previous = trace->requests[next].previous_turn;
                if (previous) {
                    res->follow_up_turns++;
                    res->turns_before_answer += !r.reqs[previous - 1].finished;
                }
                rc = route_one(&r, next, t_arrival, why, why_size);
                next++;
            }
        }
        uint64_t t_now = t_engine <= t_arrival ? t_engine : t_arrival;
        /* Fault times are compared in double: any finite time is valid, and one past the run
         * never fires (no integer conversion to overflow). */
        double t_now_s = (double)(t_now - r.t0_us) / 1e6;
        for (uint32_t w = 0; w < W && !rc; w++)
            rc = drain_engine(&r, w, t_now, why, why_size);
        /* The engine restart, once its time has come. */
        if (!rc && !r.restarted && cfg->restart_worker >= 0 && (uint32_t)cfg->restart_worker < W &&
            t_now_s >= cfg->restart_at_s) {
            uint32_t rw = (uint32_t)cfg->restart_worker;
            r.restarted = true;
            rc = km_sim_engine_restart(r.engines[rw], cfg->generator.seed * 7919u + 77u, t_now);
            if (cfg->zmq && !rc)
                km_publisher_restart(r.pubs[rw]);
            r.live_next[rw] = 0;
            r.published[rw] = 0;
            /* Its running requests (and warm-ups, which count in no figure) died with it: the
             * router sees them fail. */
            for (size_t k = 0; !rc && k < next + r.n_warm_ups; k++) {
                size_t i = k < next ? k : N + (k - next);
                req_state *s = &r.reqs[i];
                if (s->worker != r.worker_base + rw || s->finished)
                    continue;
                s->finished = true;
                res->lost_to_restart += i < N;
                if (s->routed && (rc = queue_report(&r, KM_LIFECYCLE_FINISHED, i, t_now)) == KM_OK) {
                    km_lifecycle_event *e = &r.pending[r.n_pending - 1];
                    e->outcome = KM_OUTCOME_ERROR;
                    e->error = "the engine restarted";
                    e->finish_reason = NULL;
                    e->done_seen = false;
                    e->has_output_tokens = false; /* how many arrived is not counted */
                    e->has_cached_tokens = s->admitted;
                }
            }
            if (rc)
                km_why(why, why_size, rc, "engine restart");
        }
        if (!rc)
            rc = cluster_faults(&r, t_now, why, why_size);
        if (!rc && !r.kvmatch_restarted && cfg->restart_kvmatch_at_s >= 0 && !cfg->connect &&
            t_now_s >= cfg->restart_kvmatch_at_s) {
            r.kvmatch_restarted = true;
            rc = restart_kvmatch(&r, why, why_size);
        }
    }
    if (!rc)
        rc = flush_reports(&r, why, why_size);
    for (uint32_t i = 0; !rc && r.cluster_url && i < r.n_inst; i++)
        add_cluster_stats(&r, i);
    /* A run that ended inside its NATS outage leaves the broker running for the next one. */
    if (r.nats_down) {
        int restart = km_sim_broker_restart(r.broker, rc ? NULL : why, rc ? 0 : why_size);
        if (!rc)
            rc = restart;
    }
    if (!rc) {
        /* Nothing finished: no makespan (not the first arrival's time negated). */
        res->makespan_s = r.n_finish ? res->makespan_s - (double)first_arrival / 1e6 : 0;
        if (res->makespan_s > 0)
            res->output_tokens_per_s = (double)res->output_tokens / res->makespan_s;
        ttft_figures(r.ttft_ms, r.n_ttft, &res->ttft_mean_ms, &res->ttft_p50_ms,
                     &res->ttft_p99_ms);
        ttft_figures(r.every_ttft_ms, r.n_every_ttft, &res->every_ttft_mean_ms,
                     &res->every_ttft_p50_ms, &res->every_ttft_p99_ms);
        res->reused_share = res->prompt_tokens ? (double)res->actual_reused_tokens /
                                                     (double)res->prompt_tokens
                                               : 0;
        res->throughput_rps = steady_throughput(r.finish_s, r.n_finish);
        res->first_token_rps = steady_throughput(r.first_token_s, r.n_first_token);
        double saturated_until = INFINITY;
        for (uint32_t w = 0; w < W; w++)
            if (r.last_admit_s[w] < saturated_until)
                saturated_until = r.last_admit_s[w];
        res->saturated_throughput_rps = saturated_throughput(r.finish_s, r.n_finish, saturated_until);
        res->offered_rps = km_sim_arrival_rate(trace);
        res->decisions_per_s = r.decision_wall > 0 ? (double)r.n_decision / r.decision_wall : 0;
        res->decision_p50_us = r.n_decision ? pct(r.decision_us, r.n_decision, 0.50) : 0;
        res->decision_p99_us = r.n_decision ? pct(r.decision_us, r.n_decision, 0.99) : 0;
        uint64_t max = 0;
        for (uint32_t w = 0; w < W; w++)
            if (r.per_worker[w] > max)
                max = r.per_worker[w];
        res->load_imbalance = N ? (double)max / ((double)N / W) : 0;
        for (size_t i = 0; i < N; i++)
            res->unadmitted += r.reqs[i].routed && !r.reqs[i].admitted;
    }
    if (cfg->connect && r.inst[0].client && pool_added) {
        /* Leave the running server as it was: our pool, its workers, index and subscriber out. */
        km_message m, reply;
        memset(&m, 0, sizeof m);
        m.type = KM_MESSAGE_POOLS;
        m.pools.action = KM_ADMIN_REMOVE;
        km_pool_info pi;
        memset(&pi, 0, sizeof pi);
        pi.name = r.pool;
        m.pools.pools = &pi;
        m.pools.n_pools = 1;
        km_client_call(r.inst[0].client, &m, 10000, &reply);
    }
    run_teardown(&r);
    res->wall_s = wall_s() - started;
    return rc;
}

/* A copy of trace's request list (sharing its id pool) with arrivals at first + (t - first) * scale,
 * or all at the first arrival when scale is 0. */
static int scaled_copy(const km_trace *trace, double scale, km_trace *out)
{
    *out = *trace;
    out->requests = malloc((trace->n_requests ? trace->n_requests : 1) * sizeof *out->requests);
    if (!out->requests)
        return KM_ERR_OUT_OF_MEMORY;
    uint64_t first = trace->n_requests ? trace->requests[0].timestamp_ms : 0;
    for (size_t i = 0; i < trace->n_requests; i++) {
        out->requests[i] = trace->requests[i];
        double t = (double)(trace->requests[i].timestamp_ms - first) * scale;
        if (!(t <= (double)(KM_TRACE_MAX_TIMESTAMP_MS - first))) {
            free(out->requests);
            out->requests = NULL;
            return KM_ERR_INVALID_ARGUMENT;
        }
        out->requests[i].timestamp_ms = first + (uint64_t)llround(t);
    }
    return KM_OK;
}

/* v[0..n) with its NANs left out, in place (the rest keep their order); returns how many remain. */
static size_t without_nan(double *v, size_t n)
{
    size_t kept = 0;
    for (size_t i = 0; i < n; i++)
        if (!isnan(v[i]))
            v[kept++] = v[i];
    return kept;
}

/* The floor (km_sim_floor_ttft_us) of the requests of `trace` at load l into sum: p50 and p99 in
 * ms over those from cfg->ttft_from on and over every one, as the TTFT figures count them: a
 * request no engine admits (floor NAN) gets no first token and is in neither. */
static int load_floor(const km_sim_config *cfg, const km_trace *trace, km_sim_summary *sum,
                      uint32_t l)
{
    size_t n = trace->n_requests, from = cfg->ttft_from < n ? cfg->ttft_from : 0;
    double *ms = malloc((n ? n : 1) * sizeof *ms);
    double *every = malloc((n ? n : 1) * sizeof *every);
    int rc = ms && every ? km_sim_floor_ttft_us(trace, &cfg->engine.model, ms)
                         : KM_ERR_OUT_OF_MEMORY;
    for (size_t i = 0; !rc && i < n; i++)
        every[i] = ms[i] /= 1000.0;
    if (!rc) {
        size_t counted = without_nan(ms + from, n - from), all = without_nan(every, n);
        sum->floor_ttft_p50_ms[l] = pct(ms + from, counted, 0.50);
        sum->floor_ttft_p99_ms[l] = pct(ms + from, counted, 0.99);
        sum->every_floor_ttft_p50_ms[l] = pct(every, all, 0.50);
        sum->every_floor_ttft_p99_ms[l] = pct(every, all, 0.99);
    }
    free(ms);
    free(every);
    return rc;
}

/* Round robin on `trace` with every request arriving at once, straight to the engines (no
 * kvmatch, no fault, no records: round robin needs no index). */
static int probe_rr(const km_sim_config *cfg, const km_trace *trace, km_sim_result *res,
                    char *why, size_t why_size)
{
    km_sim_config c = *cfg;
    c.records_dir = NULL;
    c.ttft_from = 0;
    c.drop_events = 0;
    c.cut_worker = -1;
    c.restart_worker = -1;
    c.restart_kvmatch_at_s = -1;
    c.second_ingress = 0;
    c.override = 0;
    c.zmq = false;
    c.connect = NULL;
    c.log = quiet;
    km_trace replay;
    int rc = scaled_copy(trace, 0.0, &replay);
    if (rc)
        return km_why(why, why_size, rc, "out of memory");
    c.mode = KM_SIM_MODE_SINGLE;
    c.instances = 1;
    rc = run_policy(&c, &replay, "round_robin", 0, true, NULL, 0, res, why, why_size);
    free(replay.requests);
    return rc;
}

/* Requests an engine can hold at once for this workload: KV blocks over a mean request's own
 * (its share of the prompt no other request shares, and its output), at most max_num_seqs. */
static double engine_concurrency(const km_sim_config *cfg, const km_sim_workload_stats *w)
{
    const km_engine_model *m = &cfg->engine.model;
    double own = w->prompt_mean * (1.0 - w->reusable_share) + w->output_mean;
    double blocks = own / m->block_size + 1.0;
    double n = (double)m->capacity_blocks / blocks;
    return n < m->max_num_seqs ? n : m->max_num_seqs;
}

/* The cluster's capacity on this workload (docs/SIM.md, "Load"): the rate at which round robin
 * finishes requests while every engine has a queue, every request of a sample of the workload
 * arriving at once. The sample holds KM_SIM_CAPACITY_QUEUE times what the engines can hold at
 * once (engine_concurrency), so the queues last for most of the run; a trace gives what it has,
 * the generator draws more requests of the same kind. When the queues emptied before a tenth of
 * the requests finished, the sample doubles, up to KM_SIM_CAPACITY_MAX_SAMPLE requests. */
static int measure_capacity(const km_sim_config *cfg, const km_trace *trace, size_t n,
                            km_sim_summary *sum, char *why, size_t why_size)
{
    double started = wall_s();
    double want = KM_SIM_CAPACITY_QUEUE * cfg->workers * engine_concurrency(cfg, &sum->workload);
    size_t size = want > (double)n ? (size_t)want : n;
    int rc = KM_OK;
    for (;;) {
        if (size > KM_SIM_CAPACITY_MAX_SAMPLE)
            size = KM_SIM_CAPACITY_MAX_SAMPLE;
        km_trace more = {0};
        km_trace sample = *trace;
        if (cfg->trace_path) {
            sample.n_requests = size < trace->n_requests ? size : trace->n_requests;
        } else if (size > trace->n_requests) {
            km_sim_generator_config g = cfg->generator;
            g.requests = (uint32_t)size;
            if ((rc = km_sim_generate_trace(&g, &more, why, why_size)))
                return rc;
            sample = more;
        } else {
            sample.n_requests = size;
        }
        km_sim_result res;
        rc = probe_rr(cfg, &sample, &res, why, why_size);
        km_trace_free(&more);
        if (rc)
            return rc;
        sum->capacity_probes++;
        sum->capacity_requests = sample.n_requests;
        if (res.saturated_throughput_rps > 0) {
            sum->capacity_rps = res.saturated_throughput_rps;
            break;
        }
        if (sample.n_requests >= KM_SIM_CAPACITY_MAX_SAMPLE ||
            (cfg->trace_path && sample.n_requests >= trace->n_requests))
            return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                          "%zu requests at once never kept %u engines queued long enough to "
                          "measure their capacity%s",
                          sample.n_requests, cfg->workers,
                          cfg->trace_path ? " (the trace has no more)" : "");
        size *= 2;
    }
    sum->capacity_wall_s = wall_s() - started;
    return KM_OK;
}

int km_sim_config_check(const km_sim_config *cfg, char *why, size_t why_size)
{
    if (!cfg)
        return km_why(why, why_size, KM_ERR_NULL_POINTER, "config is NULL");
    if (cfg->workers == 0 || cfg->workers > 4096 || cfg->n_policies == 0 ||
        cfg->n_policies > KM_SIM_MAX_POLICIES || !(cfg->time_scale > 0) ||
        cfg->n_loads > KM_SIM_MAX_LOADS)
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                      "workers must be 1..4096, policies 1..%u, loads 0..%u, time_scale > 0",
                      KM_SIM_MAX_POLICIES, KM_SIM_MAX_LOADS);
    for (uint32_t i = 0; i < cfg->n_loads; i++)
        if (!(cfg->loads[i] > 0 && cfg->loads[i] <= 100))
            return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                          "load %g is out of range: a load is a fraction of the capacity, in (0, 100]",
                          cfg->loads[i]);
    for (uint32_t i = 1; i < cfg->n_loads; i++)
        if (!(cfg->loads[i] > cfg->loads[i - 1]))
            return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                          "loads must be increasing, each once: %g follows %g", cfg->loads[i],
                          cfg->loads[i - 1]);
    if (cfg->n_loads && cfg->time_scale != 1.0)
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                      "a load sets the arrival times: it excludes a time scale");
    if (cfg->policy_engine && !km_engine_model_preset_summary(cfg->policy_engine))
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                      "policy_engine \"%s\" is no engine preset", cfg->policy_engine);
    if (cfg->engine_preset && !km_engine_model_preset_summary(cfg->engine_preset))
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                      "engine_preset \"%s\" is no engine preset", cfg->engine_preset);
    if (cfg->restart_kvmatch_at_s >= 0 && cfg->restart_kvmatch_snapshot && !cfg->zmq)
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                      "restarting kvmatch from its snapshot needs --zmq: only subscriber-fed pools "
                      "are saved (in-process feeds start empty)");
    if (cfg->restart_kvmatch_at_s >= 0 && cfg->connect)
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                      "--restart-kvmatch restarts the server in this process, not a --connect one");
    if (cfg->approx && (cfg->zmq || cfg->drop_events > 0 || cfg->cut_worker >= 0 ||
                        (cfg->restart_kvmatch_at_s >= 0 && cfg->restart_kvmatch_snapshot)))
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                      "approximate mode has no event stream: --approx excludes --zmq, --connect, "
                      "--drop-events, --cut and a snapshot restart");
    if (!(cfg->override >= 0 && cfg->override < 1))
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT, "override must be in [0, 1)");
    if (cfg->override > 0 && cfg->workers < 2)
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                      "--override needs at least 2 workers: it sends a request to another worker "
                      "than the decision's, and --workers %u has none", cfg->workers);
    if (cfg->connect && !cfg->zmq)
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                      "--connect needs --zmq: a server in another process hears the engines over ZMQ");
    if (cfg->connect && cfg->records_dir)
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                      "--records keeps the records of a server in this process: with --connect the "
                      "running server writes them where its own --records says");
    if (cfg->mode > KM_SIM_MODE_SHARED || cfg->instances == 0 ||
        cfg->instances > KM_SIM_MAX_INSTANCES ||
        (cfg->mode == KM_SIM_MODE_SINGLE && cfg->instances != 1))
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                      "instances must be 1..%u (1 in the single mode)", KM_SIM_MAX_INSTANCES);
    if (cfg->mode != KM_SIM_MODE_SINGLE &&
        (cfg->connect || cfg->zmq || cfg->restart_kvmatch_at_s >= 0))
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                      "several instances run in this process with in-process events: the %s mode "
                      "excludes --connect, --zmq and --restart-kvmatch",
                      km_sim_mode_name(cfg->mode));
    if (cfg->cluster_loss != 0 && !km_sim_cluster_loss_valid(cfg->cluster_loss))
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                      "a lossy link's loss %g is out of range: it is in (0, 2/3] (one change in "
                      "every round(1/P) unsent; above 2/3 that is every change) and at least "
                      "1/(2^32 - 1)", cfg->cluster_loss);
    if (cfg->nats_stop_at_s >= 0 && !(cfg->nats_stop_for_s > 0))
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                      "a NATS outage lasts more than 0 s");
    if (cfg->mode == KM_SIM_MODE_SHARED && cfg->instances < 2 &&
        (cfg->kill_instance_at_s >= 0 || cfg->nats_stop_at_s >= 0 || cfg->cluster_loss > 0))
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                      "the faults of several instances (kill-instance, nats-restart, lossy) need "
                      "at least 2 instances");
    for (uint32_t i = 0; i < cfg->n_policies; i++) {
        km_policy_kind k;
        if (!cfg->policies[i] || km_policy_kind_parse(cfg->policies[i], &k) != KM_OK)
            return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT, "unknown policy \"%s\"",
                          cfg->policies[i] ? cfg->policies[i] : "(null)");
    }
    /* A policy runs once: its column, JSON entry and records file are named after it. */
    for (uint32_t i = 0; i < cfg->n_policies; i++)
        for (uint32_t j = 0; j < i; j++) {
            km_policy_kind a, b;
            km_policy_kind_parse(cfg->policies[i], &a);
            km_policy_kind_parse(cfg->policies[j], &b);
            if (a == b)
                return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                              "policy \"%s\" is named twice: each policy runs once (its column, "
                              "its results and its records file carry its name)",
                              cfg->policies[i]);
        }
    return KM_OK;
}

int km_sim_run(const km_sim_config *cfg, km_sim_result *results, km_sim_summary *summary,
               char *why, size_t why_size)
{
    if (!cfg || !results)
        return km_why(why, why_size, KM_ERR_NULL_POINTER, "config or results is NULL");
    int rc = km_sim_config_check(cfg, why, why_size);
    if (rc != KM_OK)
        return rc;
    if (cfg->mode == KM_SIM_MODE_SHARED && !km_sim_shared_available(why, why_size))
        return KM_ERR_NOT_FOUND;
    if (cfg->records_dir) {
        struct stat st;
        if (stat(cfg->records_dir, &st) != 0 && mkdir(cfg->records_dir, 0755) != 0)
            return km_why(why, why_size, KM_ERR_IO, "records dir %s cannot be created",
                          cfg->records_dir);
    }
    km_trace trace;
    if (cfg->trace_path)
        rc = km_trace_load_mooncake(cfg->trace_path, &trace, why, why_size);
    else
        rc = km_sim_generate_trace(&cfg->generator, &trace, why, why_size);
    if (rc)
        return rc;
    km_sim_summary local;
    km_sim_summary *sum = summary ? summary : &local;
    memset(sum, 0, sizeof *sum);
    size_t n = cfg->max_requests && cfg->max_requests < trace.n_requests ? cfg->max_requests
                                                                         : trace.n_requests;
    if (cfg->ttft_from >= n) {
        km_trace_free(&trace);
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                      "ttft_from %zu leaves no request for the TTFT figures: the run has %zu",
                      cfg->ttft_from, n);
    }
    km_trace head = trace;
    head.n_requests = n;
    /* At the times the run replays them (km_sim_trace_trim below; a load scales a copy of its
     * own, with time_scale 1). */
    km_trace timed = head;
    if (cfg->time_scale != 1.0) {
        if ((rc = scaled_copy(&head, 1.0, &timed)) ||
            (rc = km_sim_trace_trim(&timed, 0, cfg->time_scale))) {
            free(timed.requests == head.requests ? NULL : timed.requests);
            km_trace_free(&trace);
            return km_why(why, why_size, rc, "time_scale %g puts arrivals past %llu ms",
                          cfg->time_scale, (unsigned long long)KM_TRACE_MAX_TIMESTAMP_MS);
        }
    }
    rc = km_sim_workload_stats_of(&timed, &cfg->engine.model, &sum->workload);
    if (timed.requests != head.requests)
        free(timed.requests);
    if (rc) {
        km_trace_free(&trace);
        return km_why(why, why_size, rc, "workload statistics");
    }
    sim_log(cfg, "%zu requests, %u workers, %u policies%s", n, cfg->workers, cfg->n_policies,
            cfg->zmq ? ", events over ZMQ" : "");
    if (cfg->n_loads) {
        /* The arrival rate is measured between the 10th and the 90th percentile of arrival
         * times (km_sim_arrival_rate): 0 below 10 requests, or when those all come at once. */
        if (n < 10) {
            km_trace_free(&trace);
            return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                          "a load needs at least 10 requests (their arrival rate is measured "
                          "between the 10th and the 90th percentile of arrival times); the run "
                          "has %zu", n);
        }
        if (!(sum->workload.arrival_rate_per_s > 0)) {
            km_trace_free(&trace);
            return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                          "a load needs arrivals spread over time (the trace's all come at once)");
        }
        rc = measure_capacity(cfg, &trace, n, sum, why, why_size);
        if (rc) {
            km_trace_free(&trace);
            return rc;
        }
        sim_log(cfg, "capacity: %.2f requests/s (round robin, %zu requests at once, %u runs, %.1f s)",
                sum->capacity_rps, sum->capacity_requests, sum->capacity_probes,
                sum->capacity_wall_s);
    }
    if ((rc = km_sim_trace_trim(&trace, cfg->max_requests, cfg->time_scale)) != KM_OK) {
        km_trace_free(&trace);
        return km_why(why, why_size, rc, "time_scale %g puts arrivals past %llu ms", cfg->time_scale,
                      (unsigned long long)KM_TRACE_MAX_TIMESTAMP_MS);
    }
    km_sim_broker broker = {0};
    if (cfg->mode == KM_SIM_MODE_SHARED) {
        if ((rc = km_sim_broker_start(&broker, why, why_size)) != KM_OK) {
            km_trace_free(&trace);
            return rc;
        }
        sim_log(cfg, "%u instances sharing their active work over %s", cfg->instances, broker.url);
    }
    unsigned run_no = 0;
    uint32_t n_loads = cfg->n_loads ? cfg->n_loads : 1;
    for (uint32_t l = 0; l < n_loads && !rc; l++) {
        km_trace scaled = trace;
        double load = cfg->n_loads ? cfg->loads[l] : 0;
        if (cfg->n_loads) {
            sum->time_scale[l] = sum->workload.arrival_rate_per_s / (load * sum->capacity_rps);
            if ((rc = scaled_copy(&trace, sum->time_scale[l], &scaled))) {
                km_why(why, why_size, rc, "load %g puts arrivals past %llu ms", load,
                       (unsigned long long)KM_TRACE_MAX_TIMESTAMP_MS);
                break;
            }
            if ((rc = load_floor(cfg, &scaled, sum, l))) {
                free(scaled.requests);
                km_why(why, why_size, rc, "the floor at load %g", load);
                break;
            }
        }
        for (uint32_t i = 0; i < cfg->n_policies && !rc; i++) {
            km_sim_result *res = &results[l * cfg->n_policies + i];
            rc = run_policy(cfg, &scaled, cfg->policies[i], load, false, &broker, run_no++, res,
                            why, why_size);
            res->load = load;
            if (!rc && cfg->n_loads)
                sim_log(cfg, "load %g, %s: done in %.1f s", load, cfg->policies[i], res->wall_s);
            else if (!rc)
                sim_log(cfg, "%s: done in %.1f s", cfg->policies[i], res->wall_s);
        }
        if (cfg->n_loads)
            free(scaled.requests);
    }
    km_sim_broker_stop(&broker);
    km_trace_free(&trace);
    return rc;
}
