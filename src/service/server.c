/* The routing service (include/kvmatch/server.h, docs/SERVICE.md).
 *
 * Threads and what they own:
 *  - the loop thread (km_server_run, libuv): listeners, connections, frame reading and decoding,
 *    hashing of token input (so it overlaps the scheduler's current batch: double buffering),
 *    lifecycle reports and active-work expiry, WORKERS / POOLS / STATUS, encoding and writing
 *    replies; and, when the scheduler is idle, small batches itself (on_dispatch, inline_routes);
 *  - the scheduler thread: takes whole ROUTE frames off the queue, flushes each pool's events,
 *    scores every pool's share of the batch with one km_index_match_batch, runs the policies,
 *    begins active work, writes decision records, teaches approximate-mode pools, and hands the
 *    jobs back to the loop thread (uv_async), their replies already encoded when nothing else
 *    was queued;
 *  - subscribers' I/O threads, the records writer and the HTTP server run their own.
 *
 * Locks (never nested in another order than listed):
 *  admin_lock  pools, workers, and every index call (the indexes are not thread-safe: the scheduler
 *              holds it for a whole batch; admin operations take it between batches). Pool
 *              metadata (names, models, block sizes, the pool array) is written only on the loop
 *              thread, by admin handlers holding admin_lock, so the loop thread reads it without
 *              the lock: decoding a ROUTE never waits for a batch;
 *  active_lock km_active and the attempts kept for outcome records; the scheduler takes it per
 *              decision, so a lifecycle report waits one decision at most;
 *  queue_lock  the route queue; done_lock the finished jobs.
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>
#include <uv.h>
#include <xxhash.h>

#include "base/utf8.h"
#include "base/error_detail.h"
#include "service/http.h"
#include "kvmatch/active.h"
#include "kvmatch/approx.h"
#include "kvmatch/hash.h"
#include "kvmatch/kvmatch.h"
#include "kvmatch/metrics.h"
#include "kvmatch/records.h"
#include "kvmatch/server.h"
#include "kvmatch/subscriber.h"
#include "service/server_config.h"
#include "base/u64_map.h"

#define MAX_POOLS 4096u
#define READ_CHUNK (64u * 1024u)
#define SCHEDULER_TICK_MS 20u
/* Active work whose FINISHED never comes is expired only by the holder of the scheduler role, so
 * expiry never contends with a batch's decisions for active_lock:
 *  - the scheduler thread, before each batch (housekeeping): twice the batch's routes (at least
 *    a slice, at most EXPIRY_PER_PASS), which keeps up with any decision rate;
 *  - the loop thread, when the role is free: every EXPIRY_TICK_MS, one slice per pass of the event
 *    loop (on_expiry_tick, then on_expiry_more while a full slice ended), taking the role for the
 *    slice, so sockets are served and inline batches decided between slices.
 * Entries end in slices of EXPIRY_SLICE per hold of active_lock, so a lifecycle report waits for
 * one slice at most. Measured on the 2-core VM (docs/BENCHMARKS.md "IPC"): ending every due entry
 * per tick held the loop 0.5-9 ms; slices on the loop thread without the role made the scheduler
 * wait for active_lock 130-175 ms of every second at 180,000 decisions/s (a holder preempted by
 * the third busy thread, presumably) while the machine sat 16% idle; expiry on the scheduler
 * thread alone kept the role busy at 20,000 single routes/s, so those routes lost the inline path
 * (median p99 4.5 ms against 3.1 ms in six shuffled runs each). */
#define EXPIRY_TICK_MS 20u
#define EXPIRY_SLICE 64u
#define EXPIRY_PER_PASS 1024u

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * UINT64_C(1000000000) + (uint64_t)ts.tv_nsec;
}

/* ---- structures ------------------------------------------------------------------------------ */

typedef struct conn conn;

/* One route of a queued ROUTE frame, deep-copied out of the connection's decoder. */
typedef struct route_job {
    int status; /* KM_OK, or this route is answered with the error below */
    char message[256];
    char *request_id, *attempt_id, *model, *endpoint, *policy_name;
    uint32_t pool;
    km_route_input input;
    uint64_t *hashes;
    uint32_t n_hashes;
    uint32_t *candidates; /* NULL = every worker of the pool */
    uint32_t n_candidates;
    uint64_t prompt_tokens; /* as given, else n_tokens (token input) or n_hashes x block size */
    bool has_prompt_tokens;
    uint64_t expected_output_tokens;
    bool has_expected_output_tokens;
    bool brief; /* no candidate rows in the reply */
} route_job;

/* Bump allocator for one job's copies. */
typedef struct chunk {
    struct chunk *next;
    size_t used, size;
    _Alignas(16) unsigned char data[];
} chunk;

typedef struct job {
    struct job *next;
    conn *conn;
    uint64_t msg_id;
    uint64_t enqueued_ns;
    route_job *routes;
    uint32_t n_routes;
    km_route_decision *decisions; /* filled by the scheduler, encoded by the loop thread */
    km_frame_buffer reply;
    bool encoded; /* reply already encoded (by the scheduler, when it had nothing queued) */
    chunk *chunks;
} job;

/* What an outcome record needs from its decision; kept from the decision to FINISHED / expiry. */
typedef struct attempt {
    uint64_t decision_id;
    const char *request_id, *attempt_id, *model, *pool, *endpoint; /* in strings[] */
    char chosen_name[KM_SERVER_NAME_MAX], owner_name[KM_SERVER_NAME_MAX];
    char dispatched_name[KM_SERVER_NAME_MAX]; /* "" unless the router used another worker */
    bool has_owner;
    uint32_t worker;
    km_record_source source;
    uint32_t block_size, chosen_depth, owner_depth;
    km_record_time decided;
    km_record_time dispatched, first_token; /* monotonic 0 = absent */
    double router_dispatched_ms, router_ttft_ms; /* the router's elapsed_ms; NAN = not reported */
    bool cached_size;  /* allocated with ATTEMPT_CACHED_STRINGS bytes of strings: reusable */
    /* The request's block hashes, kept (approx_dispatch_max_bytes) when its pool has
     * approximate-mode workers: a report that the router used another of them teaches it. */
    uint64_t *hashes;
    uint32_t n_hashes;
    bool has_blocks; /* the request had a block: an override has something to teach */
    struct attempt *next_free; /* in attempt_cache */
    char strings[]; /* the ids and names, one allocation with the struct */
} attempt;

/* Attempts are made by the scheduler thread and released by the loop thread (outcome or expiry),
 * one of each per decision: through malloc that is a cross-thread free per decision, which glibc
 * pays for with its arena lock and fastbin consolidation. Attempts whose strings fit
 * ATTEMPT_CACHED_STRINGS are instead kept on this free list (under active_lock, which both
 * threads hold when they make or release one), at most ATTEMPT_CACHE_MAX of them. */
enum { ATTEMPT_CACHED_STRINGS = 192, ATTEMPT_CACHE_MAX = 65536 };
typedef struct attempt_cache {
    attempt *head;
    uint32_t count;
    uint64_t hash_bytes; /* the live attempts' `hashes` and the queued lessons', all together
                          * (at most approx_dispatch_max_bytes) */
} attempt_cache;

/* A router override to an approximate-mode worker (lifecycle `worker`): the request's blocks
 * are assumed on that worker from the report on. Made by the loop thread under active_lock,
 * applied by the scheduler role (which owns the approximate-mode state) at its next
 * housekeeping; `incarnation` tells a worker removed and added again meanwhile. */
typedef struct dispatch_lesson {
    struct dispatch_lesson *next;
    uint32_t worker;
    uint64_t incarnation;
    uint32_t n_hashes;
    uint64_t hashes[];
} dispatch_lesson;

typedef struct worker_slot {
    bool used;
    uint32_t pool;
    bool events; /* fed by KV events; else approximate mode */
    bool local;  /* events handed over in process (km_server_deliver_events), no sockets */
    bool has_dp_rank; /* WORKERS add `dp_rank`, echoed in WORKER_LIST and /status */
    uint32_t dp_rank;
    uint64_t incarnation; /* distinct for every worker_add */
    char name[KM_SERVER_NAME_MAX];
    char *event_endpoint, *replay_endpoint;
    /* per batch: state name cached */
    uint64_t state_batch;
    const char *state;
    /* Health (SERVICE.md, "Worker health"), under active_lock: the router's verdict and the
     * circuit breaker fed by this instance's outcomes. */
    bool unhealthy;            /* the router said so (WORKERS add / update `healthy` false) */
    uint32_t failures;         /* outcomes error or incomplete in a row */
    bool breaker_tripped;      /* failures reached breaker_failures; a complete outcome clears it */
    uint64_t breaker_until_ns; /* tripped: open until then, half-open after */
    uint64_t probe_decision;   /* half-open: the latest decision made for it (0: none); the probe
                                * is in flight while attempts_by_decision holds it on this worker */
} worker_slot;

typedef struct pool {
    char name[KM_SERVER_NAME_MAX];
    char *model;
    uint32_t block_size;
    km_policy_config policy;
    km_policy_state policy_state;
    km_index *index;
    km_subscriber *sub; /* created with the first event-fed worker */
    /* Workers whose events arrive in process (event endpoint "local": the simulator). */
    pthread_mutex_t local_lock; /* local_feed, local_decoder */
    km_feed *local_feed;
    km_kv_decoder *local_decoder;
    km_approx *approx;
    km_approx_updates approx_updates;
    uint64_t approx_ttl_ms, approx_capacity_blocks;
    uint32_t *members; /* worker ids, ascending */
    uint32_t n_members, members_capacity;
    uint32_t n_approx_members; /* of which in approximate mode */
    bool overrides_seen; /* a lifecycle report named another worker than its decision's: from then
                          * on decisions keep their hashes (attempt_keep_hashes); active_lock */
    char *snapshot_path; /* NULL = none */
    /* per batch */
    km_request *requests;
    size_t n_requests, requests_capacity;
    km_match_results results;
} pool;

/* Scratch for one batch: the scheduler role's (whoever holds scheduler_busy). */
typedef struct batch_scratch {
    km_policy_candidate *cands;
    double *costs;
    km_candidate_score *scores;
    km_record_candidate *rcands;
    size_t cap_cands;
    km_update *pool_updates;
    size_t cap_pool_updates;
    km_approx_updates updates;
    uint32_t *seen;           /* max_workers stamps (next_stamp): a route's candidate seen
                               * already, a worker cleared already (approx_apply) */
    uint32_t candidate_stamp; /* the latest stamp */
} batch_scratch;

struct conn {
    union {
        uv_handle_t handle;
        uv_stream_t stream;
        uv_pipe_t pipe;
        uv_tcp_t tcp;
    } h;
    km_server *server;
    conn *prev, *next;
    km_frame_reader *reader;
    km_protocol_decoder *decoder;
    km_frame_buffer outbox, writing;
    uv_write_t write_req;
    bool write_in_flight, reading, paused, eof, closing, handle_closed, hello_done;
    uint32_t jobs_in_flight;
    char rbuf[READ_CHUNK];
};

struct km_server {
    km_server_config cfg;
    char *socket_path, *tcp, *http_addr, *records_path, *snapshot_dir, *default_pool;
    km_log_fn log;
    void *log_user;

    uv_loop_t loop;
    uv_pipe_t unix_listener;
    uv_tcp_t tcp_listener;
    bool have_unix, have_tcp;
    bool own_socket_file; /* bound by this server: unlinked at destroy */
    uint16_t tcp_port;
    uv_signal_t sigterm, sigint;
    bool signals_installed;
    uv_async_t wake;
    uv_timer_t drain_timer;
    atomic_bool draining; /* written by the loop thread, read by the HTTP thread too (/readyz) */
    bool drain_timer_started;
    uint64_t drain_deadline_ns;
    atomic_bool stop_requested;
    conn *conns;

    pthread_t scheduler;
    bool scheduler_started;
    pthread_mutex_t queue_lock;
    pthread_cond_t queue_cond;
    job *queue_head, *queue_tail;
    uint64_t queued_routes;
    bool scheduler_stop;
    /* The scheduler role: held (under queue_lock) by whoever runs housekeeping or a batch, the
     * scheduler thread or the loop thread running a small batch inline (on_dispatch). */
    bool scheduler_busy;
    bool events_pending; /* a subscriber received messages since the last housekeeping */
    batch_scratch scratch; /* the role's */
    uv_check_t dispatch;   /* after each loop iteration's reads: run or hand off new frames */
    bool dispatch_pending; /* loop thread: frames were queued in this iteration */
    bool dispatch_inited;
    uint32_t inline_routes; /* cfg.inline_routes, at most max_batch_routes */

    pthread_mutex_t done_lock;
    job *done_head, *done_tail;

    pthread_mutex_t admin_lock;
    pool **pools;
    uint32_t n_pools;
    worker_slot *workers;
    uint64_t batch_stamp;
    uint64_t next_incarnation;

    pthread_mutex_t active_lock;
    km_active *active;
    km_u64map attempts_by_decision; /* decision id -> attempt*; by ids: the active entry's user */
    attempt_cache attempt_cache;     /* released attempts for reuse (active_lock) */
    dispatch_lesson *lessons;        /* for the next housekeeping, newest first (active_lock) */
    uint32_t health_restricted;      /* workers unhealthy or with a tripped breaker (active_lock;
                                      * health_changed): 0 lets decide_route skip the checks */
    atomic_bool lessons_queued;      /* lessons is not empty: housekeeping takes the lock only then */
    km_memory attempts_memory;
    uv_timer_t expiry_timer; /* loop thread: active-work expiry while the scheduler role is free */
    uv_idle_t expiry_more;   /* runs while a full slice ended */
    bool expiry_timer_inited;

    km_record_writer *records;
    char instance[33];
    char host[128];
    atomic_uint_fast64_t next_record_id, next_decision_id;

    km_metrics *metrics;
    km_counter *m_decisions, *m_route_errors, *m_frames, *m_bad_frames, *m_lifecycle,
        *m_outcomes, *m_expired, *m_evicted, *m_overloaded;
    km_histogram *m_batch_routes, *m_batch_seconds, *m_queue_seconds;
    km_http *http;
    uint16_t http_port;

    uint64_t start_ns;
    struct {
        atomic_uint_fast64_t accepted, open, refused, slow_closed, frames, bad_frames, routes,
            decisions, route_errors, overloaded, batches, inline_batches, lifecycle,
            lifecycle_errors, outcomes, expired, evicted, dropped_at_shutdown,
            dispatch_learned, dispatch_unlearned, breaker_opened, no_healthy;
    } st;
    int shutdown_status;
};

static void slog(km_server *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void slog(km_server *s, const char *fmt, ...)
{
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    if (s->log)
        s->log(s->log_user, line);
    else
        fprintf(stderr, "kvmatch serve: %s\n", line);
}

/* ---- job memory ------------------------------------------------------------------------------ */

static void *job_alloc(job *j, size_t n)
{
    n = (n + 15) & ~(size_t)15;
    if (!j->chunks || j->chunks->size - j->chunks->used < n) {
        /* Chunks grow from 4 KB to 64 KB: a lone route needs about 1 KB, so a frame of one route
         * no longer takes a 64 KB block (no speed difference measured either way). */
        size_t step = j->chunks ? 2 * (j->chunks->size + sizeof(chunk)) : 4096;
        if (step > 64 * 1024)
            step = 64 * 1024;
        size_t size = n > step - sizeof(chunk) ? n : step - sizeof(chunk);
        chunk *c = malloc(sizeof *c + size);
        if (!c)
            return NULL;
        c->size = size;
        c->used = 0;
        c->next = j->chunks;
        j->chunks = c;
    }
    void *p = j->chunks->data + j->chunks->used;
    j->chunks->used += n;
    return p;
}

static char *job_strdup(job *j, const char *s)
{
    if (!s)
        return NULL;
    size_t n = strlen(s) + 1;
    char *p = job_alloc(j, n);
    if (p)
        memcpy(p, s, n);
    return p;
}

static void job_free(job *j)
{
    if (!j)
        return;
    km_frame_buffer_free(&j->reply);
    for (chunk *c = j->chunks; c;) {
        chunk *next = c->next;
        free(c);
        c = next;
    }
    free(j);
}

/* ---- pools and workers ---------------------------------------------------------------------- */

static int pool_find(const km_server *s, const char *name)
{
    for (uint32_t i = 0; i < s->n_pools; i++)
        if (!strcmp(s->pools[i]->name, name))
            return (int)i;
    return -1;
}

static int pool_for_model(const km_server *s, const char *model)
{
    for (uint32_t i = 0; i < s->n_pools; i++)
        if (s->pools[i]->model && !strcmp(s->pools[i]->model, model))
            return (int)i;
    return -1;
}

static void pool_destroy(pool *p)
{
    if (!p)
        return;
    km_subscriber_destroy(p->sub);
    km_feed_destroy(p->local_feed);
    km_kv_decoder_destroy(p->local_decoder);
    pthread_mutex_destroy(&p->local_lock);
    km_approx_destroy(p->approx);
    km_approx_updates_free(&p->approx_updates);
    km_index_destroy(p->index);
    km_match_results_free(&p->results);
    free(p->requests);
    free(p->members);
    free(p->model);
    free(p->snapshot_path);
    free(p);
}

static int pool_create(km_server *s, const km_server_pool *pc, pool **out, char *why,
                       size_t why_size)
{
    *out = NULL;
    if (!km_server_name_valid(pc->name))
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                     "pool name \"%s\" must be 1..%u of [A-Za-z0-9._-]", pc->name ? pc->name : "",
                     KM_SERVER_NAME_MAX - 1);
    if (pc->block_size == 0)
        return km_why(why, why_size, KM_ERR_BLOCK_SIZE, "pool %s: block_size must be at least 1",
                     pc->name);
    if (pc->approx_ttl_ms > UINT64_MAX / 1000000)
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                      "pool %s: approx_ttl_ms %" PRIu64 " is over %" PRIu64 " (the TTL in ns must "
                      "fit 64 bits)", pc->name, pc->approx_ttl_ms, UINT64_MAX / 1000000);
    if (pc->model && !km_utf8_name(pc->model))
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                     "pool %s: model must be UTF-8 without control characters", pc->name);
    char detail[192];
    if (km_policy_config_validate(&pc->policy, detail, sizeof detail) != KM_OK)
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT, "pool %s: %s", pc->name, detail);
    pool *p = calloc(1, sizeof *p);
    if (!p)
        return km_why(why, why_size, KM_ERR_OUT_OF_MEMORY, "pool %s", pc->name);
    snprintf(p->name, sizeof p->name, "%s", pc->name);
    pthread_mutex_init(&p->local_lock, NULL);
    p->block_size = pc->block_size;
    p->policy = pc->policy;
    km_policy_state_init(&p->policy_state, s->cfg.seed ^ XXH3_64bits(pc->name, strlen(pc->name)));
    p->approx_ttl_ms = pc->approx_ttl_ms ? pc->approx_ttl_ms : 120000;
    p->approx_capacity_blocks = pc->approx_capacity_blocks;
    km_approx_updates_init(&p->approx_updates);
    km_match_results_init(&p->results);
    int rc = KM_OK;
    if (pc->model && !(p->model = strdup(pc->model)))
        rc = KM_ERR_OUT_OF_MEMORY;
    if (!rc && s->snapshot_dir) {
        size_t n = strlen(s->snapshot_dir) + strlen(p->name) + 8;
        p->snapshot_path = malloc(n);
        if (!p->snapshot_path)
            rc = KM_ERR_OUT_OF_MEMORY;
        else
            snprintf(p->snapshot_path, n, "%s/%s.snap", s->snapshot_dir, p->name);
    }
    if (rc) {
        pool_destroy(p);
        return km_why(why, why_size, rc, "pool %s", pc->name);
    }
    km_index_config ic;
    km_index_config_init(&ic);
    ic.max_workers = s->cfg.max_workers;
    ic.backend = s->cfg.backend;
    ic.threads = s->cfg.index_threads;
    ic.memory_cap_bytes = s->cfg.index_memory_cap_bytes;
    if (s->cfg.index_initial_blocks)
        ic.initial_blocks = s->cfg.index_initial_blocks;
    ic.log = s->log;
    ic.log_user = s->log_user;
    if ((rc = km_index_create(&ic, &p->index)) != KM_OK) {
        pool_destroy(p);
        return km_why(why, why_size, rc, "pool %s: creating its index: %s", pc->name,
                     km_strerror(rc));
    }
    km_approx_config ac;
    km_approx_config_init(&ac);
    ac.max_workers = s->cfg.max_workers;
    ac.ttl_ns = p->approx_ttl_ms * UINT64_C(1000000);
    ac.worker_capacity_blocks = p->approx_capacity_blocks;
    if (pc->approx_every_touch)
        ac.refresh_ns = 0;
    if ((rc = km_approx_create(&ac, &p->approx)) != KM_OK) {
        pool_destroy(p);
        return km_why(why, why_size, rc, "pool %s: approximate-mode state: %s", pc->name,
                     km_strerror(rc));
    }
    *out = p;
    return KM_OK;
}

/* Subscriber I/O thread: events arrived; the scheduler flushes them at once instead of at its
 * next tick, so the index is fresh before the next decision. */
static void wake_scheduler(void *user)
{
    km_server *s = user;
    pthread_mutex_lock(&s->queue_lock);
    s->events_pending = true;
    pthread_cond_signal(&s->queue_cond);
    pthread_mutex_unlock(&s->queue_lock);
}

/* The pool's subscriber, created (restoring its snapshot when there is one) on first use. */
static int pool_subscriber(km_server *s, pool *p, char *why, size_t why_size)
{
    if (p->sub)
        return KM_OK;
    km_subscriber_config sc;
    km_subscriber_config_init(&sc);
    sc.feed.block_size = p->block_size;
    sc.feed.log = s->log;
    sc.feed.log_user = s->log_user;
    sc.log = s->log;
    sc.log_user = s->log_user;
    sc.snapshot_path = p->snapshot_path;
    sc.snapshot_interval_ms = p->snapshot_path ? s->cfg.snapshot_interval_ms : 0;
    sc.snapshot_background = true; /* the scheduler must not stop routing while a snapshot is written */
    sc.on_received = wake_scheduler;
    sc.on_received_user = s;
    struct stat stt;
    sc.restore_path = p->snapshot_path && stat(p->snapshot_path, &stt) == 0 ? p->snapshot_path : NULL;
    int rc = km_subscriber_create(p->index, &sc, &p->sub);
    if (rc)
        return km_why(why, why_size, rc, "pool %s: event subscriber: %s", p->name, km_strerror(rc));
    km_subscriber_stats st;
    if (sc.restore_path && km_subscriber_get_stats(p->sub, &st) == KM_OK)
        slog(s, "pool %s: snapshot %s %s%s%s", p->name, sc.restore_path,
             st.restored ? "restored" : "not restored: ", st.restored ? "" : km_error_name(st.restore_status),
             st.restored ? "; workers resume from their saved seq + 1" : "; starting empty");
    return KM_OK;
}

/* The pool's in-process feed, created on first use. */
static int pool_local_feed(km_server *s, pool *p, char *why, size_t why_size)
{
    if (p->local_feed)
        return KM_OK;
    km_feed_config fc;
    km_feed_config_init(&fc);
    fc.block_size = p->block_size;
    fc.bootstrap_replay = false;
    fc.log = s->log;
    fc.log_user = s->log_user;
    int rc = km_feed_create(p->index, &fc, &p->local_feed);
    if (!rc)
        rc = km_kv_decoder_create(NULL, &p->local_decoder);
    if (rc) {
        km_feed_destroy(p->local_feed);
        p->local_feed = NULL;
        return km_why(why, why_size, rc, "pool %s: in-process event feed: %s", p->name,
                      km_strerror(rc));
    }
    return KM_OK;
}

/* A worker's feed view, from its subscriber or the in-process feed (admin_lock held). */
static int feed_info(km_server *s, uint32_t id, km_feed_worker_info *out)
{
    worker_slot *w = &s->workers[id];
    pool *p = s->pools[w->pool];
    if (!w->events)
        return KM_ERR_NOT_FOUND;
    if (!w->local)
        return km_subscriber_get_worker_info(p->sub, id, out);
    pthread_mutex_lock(&p->local_lock);
    int rc = km_feed_get_worker_info(p->local_feed, id, out);
    pthread_mutex_unlock(&p->local_lock);
    return rc;
}

static int feed_windows(km_server *s, uint32_t id, km_feed_window *out, uint32_t cap, uint32_t *n)
{
    worker_slot *w = &s->workers[id];
    pool *p = s->pools[w->pool];
    if (!w->local)
        return km_subscriber_get_worker_windows(p->sub, id, out, cap, n);
    pthread_mutex_lock(&p->local_lock);
    int rc = km_feed_get_worker_windows(p->local_feed, id, out, cap, n);
    pthread_mutex_unlock(&p->local_lock);
    return rc;
}

static int members_insert(pool *p, uint32_t id)
{
    if (p->n_members == p->members_capacity) {
        uint32_t cap = p->members_capacity ? p->members_capacity * 2 : 16;
        uint32_t *g = realloc(p->members, cap * sizeof *g);
        if (!g)
            return KM_ERR_OUT_OF_MEMORY;
        p->members = g;
        p->members_capacity = cap;
    }
    uint32_t i = p->n_members;
    while (i > 0 && p->members[i - 1] > id) {
        p->members[i] = p->members[i - 1];
        i--;
    }
    p->members[i] = id;
    p->n_members++;
    return KM_OK;
}

static void members_erase(pool *p, uint32_t id)
{
    for (uint32_t i = 0; i < p->n_members; i++)
        if (p->members[i] == id) {
            memmove(p->members + i, p->members + i + 1, (p->n_members - i - 1) * sizeof *p->members);
            p->n_members--;
            return;
        }
}

static bool is_member(const pool *p, uint32_t id)
{
    uint32_t lo = 0, hi = p->n_members;
    while (lo < hi) {
        uint32_t mid = (lo + hi) / 2;
        if (p->members[mid] < id)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < p->n_members && p->members[lo] == id;
}

/* Add a worker (admin_lock held). */
/* Whether w may be ineligible now or later without another change of its health: health_changed
 * keeps health_restricted counting such workers (active_lock held), given what this was before. */
static bool health_may_restrict(const worker_slot *w)
{
    return w->unhealthy || w->breaker_tripped;
}

static void health_changed(km_server *s, const worker_slot *w, bool restricted_before)
{
    bool now = health_may_restrict(w);
    if (now && !restricted_before)
        s->health_restricted++;
    else if (!now && restricted_before)
        s->health_restricted--;
}

static int worker_add(km_server *s, uint32_t pool_index, const km_server_worker *w, char *why,
                      size_t why_size)
{
    pool *p = s->pools[pool_index];
    if (w->id >= s->cfg.max_workers)
        return km_why(why, why_size, KM_ERR_WORKER_RANGE, "worker %u: ids are 0..%u (max_workers)",
                     w->id, s->cfg.max_workers - 1);
    worker_slot *slot = &s->workers[w->id];
    if (slot->used)
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT, "worker %u already exists (pool %s)",
                     w->id, s->pools[slot->pool]->name);
    if (w->name && (strlen(w->name) == 0 || strlen(w->name) >= KM_SERVER_NAME_MAX ||
                    !km_utf8_name(w->name)))
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                     "worker %u: name must be 1..%u bytes of UTF-8 without control characters "
                     "(it is a label in /metrics and a string in /status and the records)",
                     w->id, KM_SERVER_NAME_MAX - 1);
    if (w->replay_endpoint && !w->event_endpoint)
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                     "worker %u: a replay endpoint needs an event endpoint", w->id);
    int rc;
    bool local = w->event_endpoint && !strcmp(w->event_endpoint, KM_SERVER_LOCAL_EVENTS);
    if (local) {
        if ((rc = pool_local_feed(s, p, why, why_size)) != KM_OK)
            return rc;
        km_feed_worker_config fw = {w->id, w->name, false};
        pthread_mutex_lock(&p->local_lock);
        rc = km_feed_add_worker(p->local_feed, &fw, now_ns());
        pthread_mutex_unlock(&p->local_lock);
        if (rc)
            return km_why(why, why_size, rc, "worker %u: %s", w->id, km_feed_last_error(p->local_feed));
    } else if (w->event_endpoint) {
        if ((rc = pool_subscriber(s, p, why, why_size)) != KM_OK)
            return rc;
        km_subscriber_worker sw = {w->id, w->name, w->event_endpoint, w->replay_endpoint};
        if ((rc = km_subscriber_add_worker(p->sub, &sw)) != KM_OK)
            return km_why(why, why_size, rc, "worker %u: %s", w->id, km_subscriber_last_error(p->sub));
    }
    if ((rc = members_insert(p, w->id)) != KM_OK) {
        if (local) {
            pthread_mutex_lock(&p->local_lock);
            km_feed_remove_worker(p->local_feed, w->id, now_ns());
            pthread_mutex_unlock(&p->local_lock);
        } else if (w->event_endpoint) {
            km_subscriber_remove_worker(p->sub, w->id);
        }
        return km_why(why, why_size, rc, "worker %u", w->id);
    }
    memset(slot, 0, sizeof *slot);
    slot->used = true;
    slot->pool = pool_index;
    slot->events = w->event_endpoint != NULL;
    slot->local = local;
    slot->incarnation = ++s->next_incarnation;
    p->n_approx_members += !slot->events;
    if (w->name)
        snprintf(slot->name, sizeof slot->name, "%s", w->name);
    else
        snprintf(slot->name, sizeof slot->name, "w%u", w->id);
    slot->event_endpoint = w->event_endpoint ? strdup(w->event_endpoint) : NULL;
    slot->replay_endpoint = w->replay_endpoint ? strdup(w->replay_endpoint) : NULL;
    return KM_OK;
}

static void record_removed(void *user, const km_active_summary *sum);

/* Remove a worker (admin_lock held): it stops being a candidate; its blocks leave the index; its
 * active work ends (outcome records say so). */
static int worker_remove(km_server *s, uint32_t id, char *why, size_t why_size)
{
    if (id >= s->cfg.max_workers || !s->workers[id].used)
        return km_why(why, why_size, KM_ERR_NOT_FOUND, "worker %u does not exist", id);
    worker_slot *slot = &s->workers[id];
    pool *p = s->pools[slot->pool];
    if (slot->local) {
        pthread_mutex_lock(&p->local_lock);
        km_feed_remove_worker(p->local_feed, id, now_ns());
        pthread_mutex_unlock(&p->local_lock);
    } else if (slot->events) {
        km_subscriber_remove_worker(p->sub, id);
    } else {
        km_approx_updates_clear(&p->approx_updates);
        km_approx_clear_worker(p->approx, id, &p->approx_updates);
        km_approx_updates_clear(&p->approx_updates);
        km_index_remove_worker(p->index, id);
        p->n_approx_members--;
    }
    members_erase(p, id);
    free(slot->event_endpoint);
    free(slot->replay_endpoint);
    pthread_mutex_lock(&s->active_lock);
    bool restricted = health_may_restrict(slot);
    memset(slot, 0, sizeof *slot);
    health_changed(s, slot, restricted);
    km_active_remove_worker(s->active, id, now_ns(), record_removed, s, NULL);
    pthread_mutex_unlock(&s->active_lock);
    return KM_OK;
}

/* Index state of a worker, now (admin_lock held). */
static const char *worker_state(km_server *s, uint32_t id)
{
    worker_slot *w = &s->workers[id];
    if (!w->used)
        return "REMOVED";
    if (!w->events)
        return "APPROX";
    km_feed_worker_info info;
    return feed_info(s, id, &info) == KM_OK ? km_feed_state_name(info.state) : "UNKNOWN";
}

/* The same, read once per scoring batch (a batch decides against one view of the feeds). */
static const char *worker_state_in_batch(km_server *s, uint32_t id)
{
    worker_slot *w = &s->workers[id];
    if (w->used && w->events && w->state_batch == s->batch_stamp && w->state)
        return w->state;
    w->state = worker_state(s, id);
    w->state_batch = s->batch_stamp;
    return w->state;
}

/* ---- attempts and outcome records ------------------------------------------------------------ */

/* One allocation: the struct and its strings (NULL strings stay NULL). active_lock held. */
static attempt *attempt_new(attempt_cache *cache, const char *request_id, const char *attempt_id,
                            const char *model, const char *pool_name, const char *endpoint)
{
    const char *in[5] = {request_id, attempt_id, model, pool_name, endpoint};
    size_t len[5], total = 0;
    for (int i = 0; i < 5; i++) {
        len[i] = in[i] ? strlen(in[i]) + 1 : 0;
        total += len[i];
    }
    bool cached_size = total <= ATTEMPT_CACHED_STRINGS;
    attempt *a = NULL;
    if (cached_size && cache->head) {
        a = cache->head;
        cache->head = a->next_free;
        cache->count--;
    } else {
        a = malloc(sizeof *a + (cached_size ? ATTEMPT_CACHED_STRINGS : total));
        if (!a)
            return NULL;
    }
    memset(a, 0, sizeof *a);
    a->cached_size = cached_size;
    a->router_dispatched_ms = a->router_ttft_ms = NAN;
    const char **out[5] = {&a->request_id, &a->attempt_id, &a->model, &a->pool, &a->endpoint};
    char *p = a->strings;
    for (int i = 0; i < 5; i++) {
        if (!in[i])
            continue;
        memcpy(p, in[i], len[i]);
        *out[i] = p;
        p += len[i];
    }
    return a;
}

/* active_lock held (or the server being destroyed). */
static void attempt_drop_hashes(attempt_cache *cache, attempt *a)
{
    if (!a->hashes)
        return;
    cache->hash_bytes -= (uint64_t)a->n_hashes * sizeof *a->hashes;
    free(a->hashes);
    a->hashes = NULL;
    a->n_hashes = 0;
}

static void attempt_free(attempt_cache *cache, attempt *a)
{
    if (a)
        attempt_drop_hashes(cache, a);
    if (a && a->cached_size && cache->count < ATTEMPT_CACHE_MAX) {
        a->next_free = cache->head;
        cache->head = a;
        cache->count++;
        return;
    }
    free(a);
}

static void attempt_cache_free(attempt_cache *cache)
{
    while (cache->head) {
        attempt *a = cache->head;
        cache->head = a->next_free;
        free(a);
    }
    cache->count = 0;
}

/* A decision in a pool with approximate-mode workers keeps its request's hashes, within
 * approx_dispatch_max_bytes, for a router override to one of them (dispatch_lesson), until the
 * attempt's FIRST_TOKEN or its end. Only once the pool has seen an override: a router that follows
 * every decision pays nothing (a copy and an allocation per decision cost the scheduler about a
 * tenth of its time in bench ipc), and one that overrides has its first overrides unlearned.
 * active_lock held. Without them such an override teaches nothing (approx_dispatch_unlearned). */
static void attempt_keep_hashes(km_server *s, attempt *a, const pool *p, const route_job *r)
{
    if (!p->overrides_seen || !p->n_approx_members || !r->n_hashes)
        return;
    uint64_t bytes = (uint64_t)r->n_hashes * sizeof *r->hashes;
    if (s->attempt_cache.hash_bytes + bytes > s->cfg.approx_dispatch_max_bytes)
        return;
    if (!(a->hashes = malloc(bytes)))
        return;
    memcpy(a->hashes, r->hashes, bytes);
    a->n_hashes = (uint32_t)r->n_hashes;
    s->attempt_cache.hash_bytes += bytes;
}

/* active_lock held. */
static attempt *attempt_by_key(km_server *s, const char *request_id, const char *attempt_id)
{
    km_active_key key = km_active_key_of(request_id, attempt_id);
    return km_active_user(s->active, &key);
}

static void attempt_forget(km_server *s, attempt *a)
{
    km_u64map_erase(&s->attempts_by_decision, km_u64map_key(a->decision_id));
    attempt_free(&s->attempt_cache, a);
}

static km_record_time mono_to_record(uint64_t mono)
{
    km_record_time now = km_record_time_now();
    km_record_time t = {now.wall_ns - ((int64_t)now.monotonic_ns - (int64_t)mono), (int64_t)mono};
    return t;
}

static void write_outcome(km_server *s, const attempt *a, km_record_outcome outcome,
                          const km_lifecycle_event *ev, const km_active_summary *sum,
                          const char *error)
{
    atomic_fetch_add(&s->st.outcomes, 1);
    km_counter_add(s->m_outcomes, 1);
    if (!s->records)
        return;
    km_outcome_record r;
    km_outcome_record_init(&r);
    r.common.record_id = (int64_t)atomic_fetch_add(&s->next_record_id, 1);
    r.common.instance = s->instance;
    r.common.host = s->host;
    r.common.kvmatch_version = KVMATCH_VERSION;
    r.common.decision_id = (int64_t)a->decision_id;
    r.common.request_id = a->request_id;
    r.common.attempt_id = a->attempt_id ? a->attempt_id : "";
    r.common.model = a->model ? a->model : a->pool;
    r.common.pool = a->pool;
    r.common.endpoint = a->endpoint;
    r.common.time = km_record_time_now();
    r.outcome = outcome;
    r.decided = a->decided;
    if (sum && sum->dispatched)
        r.dispatched = mono_to_record(sum->dispatched_ns);
    else if (a->dispatched.monotonic_ns)
        r.dispatched = a->dispatched;
    if (sum && sum->first_token)
        r.first_token = mono_to_record(sum->first_token_ns);
    if (ev) /* only a FINISHED report ends an attempt with an event: expiry, eviction and a
             * removed worker received none, and their finished_* stay null */
        r.finished = r.common.time;
    r.router_dispatched_ms = a->router_dispatched_ms;
    r.router_ttft_ms = a->router_ttft_ms;
    if (ev && ev->has_elapsed_ms)
        r.router_e2e_ms = ev->elapsed_ms;
    if (ev) {
        r.finish_reason = ev->finish_reason;
        r.done_seen = ev->done_seen ? KM_RECORD_FLAG_TRUE : KM_RECORD_FLAG_FALSE;
        if (ev->has_http_status)
            r.http_status = ev->http_status;
        r.error = ev->error;
        if (ev->has_cached_tokens)
            r.cached_tokens = (int64_t)ev->cached_tokens;
        if (ev->has_prompt_tokens)
            r.prompt_tokens = (int64_t)ev->prompt_tokens;
        if (ev->has_output_tokens)
            r.output_tokens = (int64_t)ev->output_tokens;
        r.retries = ev->retries;
    }
    if (error)
        r.error = error;
    if (!ev && sum && sum->engine_cached_tokens != KM_ACTIVE_CACHED_UNKNOWN)
        r.cached_tokens = sum->engine_cached_tokens;
    r.worker = a->chosen_name;
    r.dispatched_worker = a->dispatched_name[0] ? a->dispatched_name : NULL;
    r.source = a->source;
    r.block_size = a->block_size;
    r.predicted_depth_blocks = a->chosen_depth;
    r.owner_worker = a->has_owner ? a->owner_name : NULL;
    r.owner_depth_blocks = a->owner_depth;
    /* Formatted on the writer's thread; a full queue drops it and counts it. */
    km_record_writer_submit_outcome(s->records, &r);
}

/* km_active callbacks (active_lock held). */
/* The outcome record of an entry km_active ended without FINISHED, and its attempt released. */
static void end_attempt(km_server *s, const km_active_summary *sum, km_record_outcome outcome,
                        const char *error)
{
    attempt *a = sum->user;
    if (!a)
        return;
    write_outcome(s, a, outcome, NULL, sum, error);
    attempt_forget(s, a);
}

static void record_expired(void *user, const km_active_summary *sum)
{
    km_server *s = user;
    atomic_fetch_add(&s->st.expired, 1);
    km_counter_add(s->m_expired, 1);
    end_attempt(s, sum, KM_RECORD_OUTCOME_EXPIRED, NULL);
}

/* An entry ended early to make room: its outcome is `expired` (FINISHED never came), with the
 * reason in `error`. The first eviction, and every 100,000th, is logged. */
static void record_evicted(void *user, const km_active_summary *sum)
{
    km_server *s = user;
    uint64_t n = atomic_fetch_add(&s->st.evicted, 1) + 1;
    km_counter_add(s->m_evicted, 1);
    if (n == 1 || n % 100000 == 0)
        slog(s, "active work: %" PRIu64 " entries evicted so far to make room (max_active_entries "
             "%u): FINISHED is not reported for them, or the TTL (%" PRIu64 " ms) is long for this "
             "rate", n, s->cfg.max_active_entries, s->cfg.active_ttl_ms);
    end_attempt(s, sum, KM_RECORD_OUTCOME_EXPIRED,
                "evicted before its TTL: the active-work table was full (max_active_entries)");
}

static void record_removed(void *user, const km_active_summary *sum)
{
    end_attempt(user, sum, KM_RECORD_OUTCOME_ERROR, "worker removed from its pool before FINISHED");
}

/* ---- the scheduler --------------------------------------------------------------------------- */


static int grow(void **p, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap)
        return KM_OK;
    size_t n = *cap ? *cap : 16;
    while (n < need)
        n *= 2;
    void *g = realloc(*p, n * elem);
    if (!g)
        return KM_ERR_OUT_OF_MEMORY;
    *p = g;
    *cap = n;
    return KM_OK;
}

static int scratch_reserve(batch_scratch *b, size_t n_cands)
{
    size_t cap = b->cap_cands;
    if (grow((void **)&b->cands, &cap, n_cands, sizeof *b->cands))
        return KM_ERR_OUT_OF_MEMORY;
    cap = b->cap_cands;
    if (grow((void **)&b->costs, &cap, n_cands, sizeof *b->costs))
        return KM_ERR_OUT_OF_MEMORY;
    cap = b->cap_cands;
    if (grow((void **)&b->scores, &cap, n_cands, sizeof *b->scores))
        return KM_ERR_OUT_OF_MEMORY;
    cap = b->cap_cands;
    if (grow((void **)&b->rcands, &cap, n_cands, sizeof *b->rcands))
        return KM_ERR_OUT_OF_MEMORY;
    b->cap_cands = cap;
    return KM_OK;
}

static void route_fail(route_job *r, int status, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void route_fail(route_job *r, int status, const char *fmt, ...)
{
    r->status = status;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->message, sizeof r->message, fmt, ap);
    va_end(ap);
}

static const km_worker_match *find_match(const km_worker_match *m, uint32_t count, uint32_t worker,
                                         uint32_t *index_out)
{
    uint32_t lo = 0, hi = count;
    while (lo < hi) {
        uint32_t mid = (lo + hi) / 2;
        if (m[mid].worker < worker)
            lo = mid + 1;
        else
            hi = mid;
    }
    *index_out = lo;
    return lo < count && m[lo].worker == worker ? &m[lo] : NULL;
}

/* The prediction is an observation (`events`) only when every depth it reports is one: the
 * owner's and the chosen worker's, and when nothing matched, every candidate's zero. A pool may
 * mix workers with and without event endpoints; one approximate-mode worker among those makes the
 * prediction `approx` (RECORDS.md, "source"). Until 2026-11-30 the chosen worker alone decided
 * it, so an assumed match on another owner was labelled `events`. */
static bool prediction_observed(const km_server *s, const km_policy_candidate *cands, uint32_t n,
                                bool has_owner, uint32_t owner, uint32_t chosen)
{
    if (!s->workers[chosen].events || (has_owner && !s->workers[owner].events))
        return false;
    for (uint32_t i = 0; !has_owner && i < n; i++)
        if (!s->workers[cands[i].worker].events)
            return false;
    return true;
}

/* A stamp no worker in b->seen carries yet. */
static uint32_t next_stamp(km_server *s, batch_scratch *b)
{
    if (++b->candidate_stamp == 0) { /* wrapped: no stale stamp may match */
        memset(b->seen, 0, s->cfg.max_workers * sizeof *b->seen);
        b->candidate_stamp = 1;
    }
    return b->candidate_stamp;
}

/* ---- worker health ---------------------------------------------------------------------------- */

typedef enum breaker_state { BREAKER_CLOSED, BREAKER_OPEN, BREAKER_HALF_OPEN } breaker_state;

static breaker_state worker_breaker(const worker_slot *w, uint64_t now)
{
    if (!w->breaker_tripped)
        return BREAKER_CLOSED;
    return now < w->breaker_until_ns ? BREAKER_OPEN : BREAKER_HALF_OPEN;
}

static const char *breaker_state_name(breaker_state b)
{
    return b == BREAKER_OPEN ? "open" : b == BREAKER_HALF_OPEN ? "half_open" : "closed";
}

typedef enum eligibility {
    ELIGIBLE = 0,
    INELIGIBLE_UNHEALTHY,    /* the router said so */
    INELIGIBLE_BREAKER_OPEN, /* failures reached the threshold, cooldown running */
    INELIGIBLE_PROBING,      /* half-open, its probe attempt still in flight */
} eligibility;

/* Is the probe decided for worker id while half-open still in flight there (active_lock held)?
 * Its attempt leaves attempts_by_decision however it ends (FINISHED, expiry, eviction, removal),
 * and an override moves it to another worker. Attempts decided before the breaker opened are not
 * the probe: one whose FINISHED never comes must not hold the worker back until it expires. */
static bool probe_in_flight(km_server *s, uint32_t id)
{
    uint64_t decision = s->workers[id].probe_decision;
    if (!decision)
        return false;
    const uint64_t *v = km_u64map_find(&s->attempts_by_decision, km_u64map_key(decision));
    return v && ((const attempt *)(uintptr_t)*v)->worker == id;
}

/* Can a route choose worker id now (admin_lock or the loop thread, and active_lock held)? A
 * half-open breaker lets one attempt through at a time, the probe (decide_route sets
 * probe_decision), so the first outcome after the cooldown decides before more follow. */
static eligibility worker_eligibility(km_server *s, uint32_t id, uint64_t now)
{
    const worker_slot *w = &s->workers[id];
    if (w->unhealthy)
        return INELIGIBLE_UNHEALTHY;
    breaker_state b = worker_breaker(w, now);
    if (b == BREAKER_OPEN)
        return INELIGIBLE_BREAKER_OPEN;
    if (b == BREAKER_HALF_OPEN && probe_in_flight(s, id))
        return INELIGIBLE_PROBING;
    return ELIGIBLE;
}

/* An attempt on worker `id` ended with a FINISHED report (active_lock held). `complete` closes
 * the breaker; `error` and `incomplete` (a stream that ended without finish_reason and [DONE],
 * whatever its HTTP status: the brief's point) count as failures, and the breaker_failures-th in
 * a row opens it for breaker_cooldown_ms, as does any failure while half-open; `cancelled` says
 * nothing about the worker. */
static void breaker_outcome(km_server *s, uint32_t id, km_outcome outcome, uint64_t now)
{
    worker_slot *w = &s->workers[id];
    if (outcome == KM_OUTCOME_COMPLETE) {
        bool before = health_may_restrict(w);
        w->failures = 0;
        w->breaker_tripped = false;
        health_changed(s, w, before);
        return;
    }
    if (outcome != KM_OUTCOME_ERROR && outcome != KM_OUTCOME_INCOMPLETE)
        return;
    if (w->failures < UINT32_MAX)
        w->failures++;
    uint32_t threshold = s->cfg.breaker_failures;
    if (!threshold || w->failures < threshold || worker_breaker(w, now) == BREAKER_OPEN)
        return;
    bool reopened = w->breaker_tripped, before = health_may_restrict(w);
    w->breaker_tripped = true;
    health_changed(s, w, before);
    w->probe_decision = 0; /* what was decided before this cooldown is not its probe */
    uint64_t cooldown = s->cfg.breaker_cooldown_ms * 1000000u;
    w->breaker_until_ns = now > UINT64_MAX - cooldown ? UINT64_MAX : now + cooldown;
    atomic_fetch_add(&s->st.breaker_opened, 1);
    slog(s, "worker %u (%s): circuit breaker %s after %u failed attempts in a row (last: %s); not "
         "chosen for %" PRIu64 " ms", id, w->name, reopened ? "reopened" : "open", w->failures,
         outcome == KM_OUTCOME_ERROR ? "error" : "incomplete", s->cfg.breaker_cooldown_ms);
}

/* Decide one route whose scoring result is rr (admin_lock and active_lock held). Fills the reply
 * decision *d (candidate arrays in the job's memory) or fails the route. */
static void decide_route(km_server *s, job *j, route_job *r, pool *p, const km_request_result *rr,
                         batch_scratch *b, km_route_decision *d, uint64_t scored_ns)
{
    /* Candidates: the request's (each must be a worker of this pool), else the pool's. */
    const uint32_t *ids = r->candidates ? r->candidates : p->members;
    uint32_t n = r->candidates ? r->n_candidates : p->n_members;
    if (n == 0) {
        route_fail(r, KM_ERR_NOT_FOUND, "pool %s has no workers", p->name);
        return;
    }
    /* The route's own candidates must be members, each once (the pool's members are, by
     * construction). Duplicates are found in O(n) with a stamp per worker id. */
    for (uint32_t i = 0; r->candidates && i < n; i++) {
        if (!is_member(p, ids[i])) {
            route_fail(r, KM_ERR_NOT_FOUND, "candidate worker %u is not in pool %s", ids[i], p->name);
            return;
        }
        if (i == 0)
            next_stamp(s, b);
        if (b->seen[ids[i]] == b->candidate_stamp) {
            route_fail(r, KM_ERR_INVALID_ARGUMENT, "candidate worker %u is listed twice", ids[i]);
            return;
        }
        b->seen[ids[i]] = b->candidate_stamp;
    }
    if (scratch_reserve(b, n)) {
        route_fail(r, KM_ERR_OUT_OF_MEMORY, "candidate scratch");
        return;
    }
    const km_worker_match *m = p->results.matches + rr->first;
    const km_match_tiers *tiers = p->results.tiers + rr->first;
    uint64_t now = now_ns();
    /* Eligible candidates first, in the route's order, then the ineligible ones (unhealthy or
     * held back by their breaker), also in order: the policy weighs the first n_eligible; the
     * others still have rows, so the reply and the record show what they held. */
    /* While no worker of the service is unhealthy or has a tripped breaker (the usual case), every
     * candidate is eligible and goes straight to its place. */
    bool check_health = s->health_restricted > 0;
    uint32_t n_eligible = 0, back = n, unhealthy = 0, breaker_open = 0, probing = 0;
    for (uint32_t i = 0; i < n; i++) {
        km_policy_candidate cand;
        km_policy_candidate *c = check_health ? &cand : &b->cands[i];
        memset(c, 0, sizeof *c);
        c->worker = ids[i];
        uint32_t at;
        const km_worker_match *hit = find_match(m, rr->count, ids[i], &at);
        if (hit) {
            c->depth = hit->depth;
            c->host_blocks = tiers[at].host_blocks;
            c->disk_blocks = tiers[at].disk_blocks;
            c->device_blocks = hit->depth - c->host_blocks - c->disk_blocks;
        }
        km_active_load load;
        if (km_active_worker_load(s->active, ids[i], &load) == KM_OK) {
            c->in_flight = load.in_flight > UINT32_MAX ? UINT32_MAX : (uint32_t)load.in_flight;
            c->prefilling = load.prefilling > UINT32_MAX ? UINT32_MAX : (uint32_t)load.prefilling;
            c->pending_prefill_tokens = load.pending_prefill_tokens;
            c->active_decode_blocks = load.active_decode_blocks;
            c->allocated_blocks = load.allocated_blocks;
        }
        km_worker_stats ws;
        if (km_index_worker_stats(p->index, ids[i], &ws) == KM_OK)
            c->indexed_blocks = ws.blocks;
        if (!check_health) {
            n_eligible++;
            continue;
        }
        eligibility e = worker_eligibility(s, ids[i], now);
        if (e == ELIGIBLE)
            b->cands[n_eligible++] = cand;
        else
            b->cands[--back] = cand;
        unhealthy += e == INELIGIBLE_UNHEALTHY;
        breaker_open += e == INELIGIBLE_BREAKER_OPEN;
        probing += e == INELIGIBLE_PROBING;
    }
    for (uint32_t lo = n_eligible, hi = n; lo + 1 < hi; lo++, hi--) { /* the route's order */
        km_policy_candidate t = b->cands[lo];
        b->cands[lo] = b->cands[hi - 1];
        b->cands[hi - 1] = t;
    }
    if (n_eligible == 0) {
        atomic_fetch_add(&s->st.no_healthy, 1);
        route_fail(r, KM_ERR_NO_HEALTHY_WORKER,
                   "no eligible worker among the %u candidates of pool %s: %u unhealthy (the "
                   "router's word), %u circuit breaker%s open, %u half-open with a probe in "
                   "flight", n, p->name, unhealthy, breaker_open, breaker_open == 1 ? "" : "s",
                   probing);
        return;
    }
    km_policy_config pc = p->policy;
    if (r->policy_name && km_policy_kind_parse(r->policy_name, &pc.kind) != KM_OK) {
        route_fail(r, KM_ERR_INVALID_ARGUMENT, "unknown policy \"%s\"", r->policy_name);
        return;
    }
    km_policy_request req = {r->n_hashes, p->block_size, r->prompt_tokens,
                             r->has_expected_output_tokens ? r->expected_output_tokens : 0};
    km_policy_decision pd;
    int rc = km_policy_decide(&pc, &p->policy_state, &req, b->cands, n_eligible, &pd, b->costs);
    if (rc != KM_OK) {
        route_fail(r, rc, "%s", km_policy_last_error(&p->policy_state));
        return;
    }
    for (uint32_t i = n_eligible; i < n; i++)
        b->costs[i] = NAN; /* not weighed */
    uint32_t chosen = b->cands[pd.chosen].worker;
    /* The prediction owner is the deepest match among every candidate: an ineligible worker that
     * holds more than any eligible one is the owner (the record says where the KV is, and that it
     * could not be used); ties with an eligible one stay with the policy's owner, ties among
     * ineligible ones are broken by the policy's rule too (km_policy_owner). */
    bool has_owner = pd.owner != KM_POLICY_NO_OWNER;
    uint32_t owner_at = pd.owner, owner_depth = has_owner ? pd.owner_depth : 0;
    uint32_t tail = km_policy_owner(b->cands + n_eligible, n - n_eligible);
    if (tail != KM_POLICY_NO_OWNER && b->cands[n_eligible + tail].depth > owner_depth) {
        owner_at = n_eligible + tail;
        owner_depth = b->cands[owner_at].depth;
        has_owner = true;
    }
    uint32_t owner = has_owner ? b->cands[owner_at].worker : 0;
    const char *chosen_state = worker_state_in_batch(s, chosen);
    bool observed = prediction_observed(s, b->cands, n, has_owner, owner, chosen);

    /* Active work first: a duplicate attempt id fails the route before anything is recorded. */
    uint32_t prompt = r->prompt_tokens > UINT32_MAX ? UINT32_MAX : (uint32_t)r->prompt_tokens;
    uint64_t predicted = (uint64_t)pd.chosen_depth * p->block_size;
    uint32_t expected = r->expected_output_tokens > UINT32_MAX ? UINT32_MAX
                                                               : (uint32_t)r->expected_output_tokens;
    km_active_key key = km_active_key_of(r->request_id, r->attempt_id);
    for (int tries = 0; tries < 2; tries++) {
        rc = km_active_begin(s->active, chosen, &key, prompt,
                             predicted > UINT32_MAX ? UINT32_MAX : (uint32_t)predicted, expected,
                             p->block_size, now);
        /* Full: the least recently touched entry makes room (record_evicted), once. */
        if (rc != KM_ERR_OVERLOADED ||
            km_active_evict_oldest(s->active, now, record_evicted, s) != KM_OK)
            break;
    }
    if (rc != KM_OK) {
        route_fail(r, rc == KM_ERR_PROTOCOL ? KM_ERR_INVALID_ARGUMENT : rc,
                   rc == KM_ERR_PROTOCOL ? "request %s attempt %s is already in flight" : "%s%s",
                   rc == KM_ERR_PROTOCOL ? r->request_id : "active work: ",
                   rc == KM_ERR_PROTOCOL ? (r->attempt_id ? r->attempt_id : "(none)")
                                         : km_active_last_error(s->active));
        return;
    }
    /* The cached prefix it will use there, so concurrent requests on one prefix count its KV
     * once (best effort: without memory for it, the request counts whole). */
    uint32_t hit = pd.chosen_depth;
    if (prompt > 0 && hit > (prompt - 1) / p->block_size)
        hit = (prompt - 1) / p->block_size;
    if (hit && hit <= r->n_hashes)
        km_active_share_prefix(s->active, &key, r->hashes[hit - 1], hit * p->block_size);
    uint64_t decision_id = atomic_fetch_add(&s->next_decision_id, 1);

    /* The candidates' rows, for the reply (unless the route asked for a brief one) and for the
     * decision record. A brief route with records off needs none: they would be written and
     * never read. */
    km_candidate_score *scores = NULL;
    if (!r->brief || s->records) {
        scores = job_alloc(j, n * sizeof *scores);
        if (!scores) {
            km_active_finish(s->active, &key, KM_ACTIVE_END_ERROR, now, NULL);
            route_fail(r, KM_ERR_OUT_OF_MEMORY, "reply candidates");
            return;
        }
    }
    const char *load_kind = km_policy_load_kind(pc.kind);
    for (uint32_t i = 0; scores && i < n; i++) {
        const km_policy_candidate *c = &b->cands[i];
        km_candidate_score *sc = &scores[i];
        memset(sc, 0, sizeof *sc);
        sc->worker = c->worker;
        sc->depth = c->depth;
        sc->device_blocks = c->device_blocks;
        sc->host_blocks = c->host_blocks;
        sc->disk_blocks = c->disk_blocks;
        sc->load.in_flight = c->in_flight;
        sc->load.pending_prefill_tokens = c->pending_prefill_tokens;
        sc->load.active_decode_blocks = c->active_decode_blocks;
        sc->cost = b->costs[i];
        sc->state = worker_state_in_batch(s, c->worker);
        sc->eligible = i < n_eligible;
    }
    /* Load values as the record shows them: before this decision's own charge. */
    memset(d, 0, sizeof *d);
    d->status = KM_OK;
    d->request_id = r->request_id;
    d->attempt_id = r->attempt_id;
    d->decision_id = decision_id;
    d->pool = p->name;
    d->chosen_worker = chosen;
    d->chosen_depth = pd.chosen_depth;
    d->chosen_state = chosen_state;
    d->has_owner = has_owner;
    d->owner_worker = owner;
    d->owner_depth = owner_depth;
    d->owner_state = has_owner ? worker_state_in_batch(s, owner) : NULL;
    d->n_blocks = r->n_hashes;
    d->block_size = p->block_size;
    d->source = observed ? KM_PREDICTION_EVENTS : KM_PREDICTION_APPROX;
    d->policy = km_policy_kind_name(pc.kind);
    d->reason = km_policy_reason_name(pd.reason);
    d->load_kind = load_kind;
    d->load_scope = "this_instance";
    d->load_value = km_policy_load_value(pc.kind, &b->cands[pd.chosen]);
    d->candidates = r->brief ? NULL : scores;
    d->n_candidates = r->brief ? 0 : n;

    /* The attempt, for its outcome record. */
    attempt *a = attempt_new(&s->attempt_cache, r->request_id, r->attempt_id,
                             r->model ? r->model : p->model, p->name, r->endpoint);
    if (a) {
        a->decision_id = decision_id;
        /* Both arrays are KM_SERVER_NAME_MAX bytes and the source is NUL-terminated. */
        memcpy(a->chosen_name, s->workers[chosen].name, sizeof a->chosen_name);
        if (has_owner)
            memcpy(a->owner_name, s->workers[owner].name, sizeof a->owner_name);
        a->has_owner = has_owner;
        a->worker = chosen;
        a->source = observed ? KM_RECORD_SOURCE_EVENTS : KM_RECORD_SOURCE_APPROX;
        a->block_size = p->block_size;
        a->chosen_depth = pd.chosen_depth;
        a->owner_depth = owner_depth;
        a->has_blocks = r->n_hashes > 0;
        attempt_keep_hashes(s, a, p, r);
        if (s->records) /* only outcome records read it; records are set at start */
            a->decided = km_record_time_now();
        if (km_u64map_put(&s->attempts_by_decision, km_u64map_key(decision_id), (uintptr_t)a, 1) ||
            km_active_set_user(s->active, &key, a)) {
            km_u64map_erase(&s->attempts_by_decision, km_u64map_key(decision_id));
            attempt_free(&s->attempt_cache, a);
            a = NULL;
        }
    }
    if (!a)
        slog(s, "decision %" PRIu64 ": out of memory keeping its attempt; its outcome record will be "
             "missing", decision_id);
    /* A half-open worker's probe (worker_eligibility); one whose attempt could not be kept is not
     * tracked, and the next route may probe too. */
    if (check_health && worker_breaker(&s->workers[chosen], now) == BREAKER_HALF_OPEN)
        s->workers[chosen].probe_decision = decision_id;

    /* The decision record. */
    if (s->records) {
        km_decision_record rec;
        km_decision_record_init(&rec);
        rec.common.record_id = (int64_t)atomic_fetch_add(&s->next_record_id, 1);
        rec.common.instance = s->instance;
        rec.common.host = s->host;
        rec.common.kvmatch_version = KVMATCH_VERSION;
        rec.common.decision_id = (int64_t)decision_id;
        rec.common.request_id = r->request_id;
        rec.common.attempt_id = r->attempt_id ? r->attempt_id : "";
        rec.common.model = r->model ? r->model : (p->model ? p->model : p->name);
        rec.common.pool = p->name;
        rec.common.endpoint = r->endpoint;
        rec.common.time = a ? a->decided : km_record_time_now();
        rec.source = observed ? KM_RECORD_SOURCE_EVENTS : KM_RECORD_SOURCE_APPROX;
        rec.input = r->input == KM_ROUTE_INPUT_TOKENS ? KM_RECORD_INPUT_TOKENS : KM_RECORD_INPUT_HASHES;
        rec.block_size = p->block_size;
        rec.block_count = r->n_hashes;
        if (r->has_prompt_tokens || r->input == KM_ROUTE_INPUT_TOKENS)
            rec.prompt_tokens = (int64_t)r->prompt_tokens;
        if (r->has_expected_output_tokens)
            rec.expected_output_tokens = (int64_t)r->expected_output_tokens;
        rec.scored_monotonic_ns = (int64_t)scored_ns;
        rec.owner.worker = has_owner ? s->workers[owner].name : NULL;
        rec.owner.state = has_owner ? d->owner_state : NULL;
        rec.owner.depth_blocks = owner_depth;
        rec.chosen.worker = s->workers[chosen].name;
        rec.chosen.state = chosen_state;
        rec.chosen.depth_blocks = pd.chosen_depth;
        rec.policy = d->policy;
        rec.reason = d->reason;
        rec.load_kind = load_kind;
        rec.load_value = d->load_value;
        for (uint32_t i = 0; i < n; i++) {
            km_record_candidate *rc2 = &b->rcands[i];
            km_record_candidate_init(rc2);
            rc2->worker = s->workers[scores[i].worker].name;
            rc2->state = scores[i].state;
            rc2->depth_blocks = scores[i].depth;
            rc2->device_blocks = scores[i].device_blocks;
            rc2->host_blocks = scores[i].host_blocks;
            rc2->disk_blocks = scores[i].disk_blocks;
            rc2->in_flight = scores[i].load.in_flight;
            rc2->pending_prefill_tokens = (int64_t)scores[i].load.pending_prefill_tokens;
            rc2->active_decode_blocks = (int64_t)scores[i].load.active_decode_blocks;
            rc2->cost = scores[i].cost;
            rc2->eligible = scores[i].eligible;
        }
        rec.candidates = b->rcands;
        rec.n_candidates = n;
        km_record_writer_submit_decision(s->records, &rec);
    }

    /* Approximate mode: the chosen worker, when its index is not fed by its own events, is assumed
     * to hold the request's blocks from now on. */
    if (!s->workers[chosen].events && r->n_hashes)
        km_approx_record(p->approx, chosen, r->hashes, r->n_hashes, now, &b->updates);
    atomic_fetch_add(&s->st.decisions, 1);
    km_counter_add(s->m_decisions, 1);
}

/* On the loop thread, in parallel with the scheduler's next batch. */
static void encode_job_reply(km_server *s, job *j)
{
    km_route_decision *ds = j->decisions;
    if (!ds) {
        km_protocol_encode_error(j->msg_id, KM_ERR_OUT_OF_MEMORY, "no memory for the decisions",
                                 &j->reply);
        return;
    }
    for (uint32_t i = 0; i < j->n_routes; i++) {
        route_job *r = &j->routes[i];
        if (r->status == KM_OK)
            continue;
        memset(&ds[i], 0, sizeof ds[i]);
        ds[i].status = r->status;
        ds[i].message = r->message;
        ds[i].request_id = r->request_id ? r->request_id : "";
        ds[i].attempt_id = r->attempt_id;
        atomic_fetch_add(&s->st.route_errors, 1);
        km_counter_add(s->m_route_errors, 1);
    }
    km_message msg;
    memset(&msg, 0, sizeof msg);
    msg.type = KM_MESSAGE_DECISION;
    msg.has_id = true;
    msg.id = j->msg_id;
    msg.decision.kvmatch_version = KVMATCH_VERSION;
    msg.decision.decisions = ds;
    msg.decision.n_decisions = j->n_routes;
    char why[256];
    int rc = km_protocol_encode(&msg, s->cfg.limits.max_frame_bytes, &j->reply, why, sizeof why);
    if (rc != KM_OK)
        km_protocol_encode_error(j->msg_id, rc, why, &j->reply);
}

/* Apply approximate-mode updates to pool p's index. The index refuses a batch as a whole (its
 * memory cap): km_approx then assumes pairs the index lacks, or the index keeps pairs km_approx
 * evicted, and a later decision touching such a pair only refreshes it, which stores nothing. So
 * every worker the refused updates name is cleared on both sides (approx.h) and learns again from
 * its next decisions. Returns km_index_apply's status. Scheduler role and admin_lock held. */
static int approx_apply(km_server *s, pool *p, batch_scratch *b, const km_update *updates, size_t n)
{
    int rc = km_index_apply(p->index, updates, n, NULL);
    if (rc == KM_OK)
        return KM_OK;
    slog(s, "pool %s: approximate-mode updates refused: %s; the blocks assumed on their workers are "
         "forgotten", p->name, km_index_last_error(p->index));
    uint32_t stamp = next_stamp(s, b);
    km_approx_updates_clear(&p->approx_updates);
    for (size_t i = 0; i < n; i++) {
        uint32_t w = updates[i].worker;
        if (b->seen[w] != stamp) {
            b->seen[w] = stamp;
            km_approx_clear_worker(p->approx, w, &p->approx_updates);
        }
    }
    if (km_index_apply(p->index, p->approx_updates.updates, p->approx_updates.n_updates, NULL))
        slog(s, "pool %s: clearing approximate-mode workers: %s", p->name,
             km_index_last_error(p->index));
    km_approx_updates_clear(&p->approx_updates);
    return rc;
}

static void run_batch(km_server *s, job *jobs, batch_scratch *b)
{
    uint64_t t0 = now_ns();
    uint32_t n_routes = 0;
    for (job *j = jobs; j; j = j->next) {
        n_routes += j->n_routes;
        km_histogram_observe(s->m_queue_seconds, (double)(t0 - j->enqueued_ns) / 1e9);
    }
    pthread_mutex_lock(&s->admin_lock);
    s->batch_stamp++;
    for (uint32_t i = 0; i < s->n_pools; i++)
        s->pools[i]->n_requests = 0;
    /* Requests per pool, in job order. */
    for (job *j = jobs; j; j = j->next)
        for (uint32_t k = 0; k < j->n_routes; k++) {
            route_job *r = &j->routes[k];
            if (r->status != KM_OK)
                continue;
            if (r->pool >= s->n_pools) {
                route_fail(r, KM_ERR_NOT_FOUND, "the pool was removed");
                continue;
            }
            pool *p = s->pools[r->pool];
            if (grow((void **)&p->requests, &p->requests_capacity, p->n_requests + 1,
                     sizeof *p->requests)) {
                route_fail(r, KM_ERR_OUT_OF_MEMORY, "batch");
                continue;
            }
            p->requests[p->n_requests].hashes = r->hashes;
            p->requests[p->n_requests].n_hashes = r->n_hashes;
            p->n_requests++;
        }
    for (uint32_t i = 0; i < s->n_pools; i++) {
        pool *p = s->pools[i];
        if (!p->n_requests)
            continue;
        int rc = km_index_match_batch(p->index, p->requests, p->n_requests, &p->results);
        if (rc != KM_OK) {
            slog(s, "pool %s: scoring failed: %s", p->name, km_index_last_error(p->index));
            p->n_requests = SIZE_MAX; /* marks the failure below */
        }
    }
    uint64_t scored = now_ns();
    size_t *cursor = calloc(s->n_pools ? s->n_pools : 1, sizeof *cursor);
    km_approx_updates_clear(&b->updates);
    for (job *j = jobs; j; j = j->next) {
        j->decisions = job_alloc(j, (j->n_routes ? j->n_routes : 1) * sizeof *j->decisions);
        if (j->decisions)
            memset(j->decisions, 0, j->n_routes * sizeof *j->decisions);
        for (uint32_t k = 0; k < j->n_routes; k++) {
            route_job *r = &j->routes[k];
            if (r->status != KM_OK || !cursor || !j->decisions) {
                if (r->status == KM_OK)
                    route_fail(r, KM_ERR_OUT_OF_MEMORY, "batch");
                continue;
            }
            pool *p = s->pools[r->pool];
            size_t q = cursor[r->pool]++;
            if (p->n_requests == SIZE_MAX) {
                route_fail(r, KM_ERR_INTERNAL, "scoring failed: %s", km_index_last_error(p->index));
                continue;
            }
            /* active_lock per route, not per batch: the loop thread's lifecycle reports
             * (DISPATCHED, FIRST_TOKEN, FINISHED for every request) wait one decision at most. */
            pthread_mutex_lock(&s->active_lock);
            decide_route(s, j, r, p, &p->results.requests[q], b, &j->decisions[k], scored);
            pthread_mutex_unlock(&s->active_lock);
        }
    }
    free(cursor);
    /* Approximate-mode learning: what this batch's decisions taught, one index batch per pool. */
    if (b->updates.n_updates && grow((void **)&b->pool_updates, &b->cap_pool_updates,
                                     b->updates.n_updates, sizeof *b->pool_updates) == KM_OK) {
        for (uint32_t i = 0; i < s->n_pools; i++) {
            size_t n = 0;
            for (size_t u = 0; u < b->updates.n_updates; u++) {
                const km_update *up = &b->updates.updates[u];
                if (up->worker < s->cfg.max_workers && s->workers[up->worker].used &&
                    s->workers[up->worker].pool == i)
                    b->pool_updates[n++] = *up;
            }
            if (!n)
                continue;
            approx_apply(s, s->pools[i], b, b->pool_updates, n);
        }
    }
    pthread_mutex_unlock(&s->admin_lock);
    uint64_t t1 = now_ns();
    atomic_fetch_add(&s->st.batches, 1);
    km_histogram_observe(s->m_batch_routes, n_routes);
    km_histogram_observe(s->m_batch_seconds, (double)(t1 - t0) / 1e9);
}

/* Between batches: apply queued events, approximate-mode expiry. */
/* Expire due active work, slice by slice, at most `limit` entries (scheduler role held). True
 * when it stopped at the limit (more may be due). */
static bool expire_due(km_server *s, uint32_t limit)
{
    uint32_t ended = 0;
    while (ended < limit) {
        size_t n = 0;
        uint32_t slice = limit - ended < EXPIRY_SLICE ? limit - ended : EXPIRY_SLICE;
        pthread_mutex_lock(&s->active_lock);
        km_active_expire_some(s->active, now_ns(), slice, record_expired, s, &n);
        pthread_mutex_unlock(&s->active_lock);
        ended += (uint32_t)n;
        if (n < slice)
            return false;
    }
    return true;
}

/* Router overrides queued by lifecycle reports (lesson_queue): each teaches its worker, if it is
 * still the same approximate-mode worker, in the order they were reported. Scheduler role and
 * admin_lock held. */
static void apply_lessons(km_server *s, batch_scratch *b, uint64_t now)
{
    if (!atomic_load(&s->lessons_queued))
        return;
    pthread_mutex_lock(&s->active_lock);
    dispatch_lesson *newest = s->lessons;
    s->lessons = NULL;
    atomic_store(&s->lessons_queued, false);
    pthread_mutex_unlock(&s->active_lock);
    /* Queued newest first: taught oldest first, so a worker's latest request is its most recently
     * touched prefix (the last its capacity evicts), as if each had been taught when reported. */
    dispatch_lesson *l = NULL;
    uint64_t released_bytes = 0;
    while (newest) {
        dispatch_lesson *next = newest->next;
        newest->next = l;
        l = newest;
        newest = next;
    }
    while (l) {
        dispatch_lesson *next = l->next;
        worker_slot *w = &s->workers[l->worker];
        if (w->used && !w->events && w->incarnation == l->incarnation) {
            pool *p = s->pools[w->pool];
            km_approx_updates_clear(&b->updates);
            int rc = km_approx_record(p->approx, l->worker, l->hashes, l->n_hashes, now, &b->updates);
            if (rc == KM_OK && b->updates.n_updates)
                rc = approx_apply(s, p, b, b->updates.updates, b->updates.n_updates);
            km_approx_updates_clear(&b->updates);
            if (rc == KM_OK)
                atomic_fetch_add(&s->st.dispatch_learned, 1);
            else
                atomic_fetch_add(&s->st.dispatch_unlearned, 1);
        }
        released_bytes += (uint64_t)l->n_hashes * sizeof *l->hashes;
        free(l);
        l = next;
    }
    pthread_mutex_lock(&s->active_lock);
    s->attempt_cache.hash_bytes -= released_bytes;
    pthread_mutex_unlock(&s->active_lock);
}

/* The scheduler role's chores before scoring: apply received events, expire approximate-mode
 * pairs, and (expire_limit > 0) expire active work (expire_due). */
static void housekeeping(km_server *s, batch_scratch *b, uint32_t expire_limit)
{
    if (expire_limit)
        (void)expire_due(s, expire_limit);
    uint64_t now = now_ns();
    pthread_mutex_lock(&s->admin_lock);
    for (uint32_t i = 0; i < s->n_pools; i++) {
        pool *p = s->pools[i];
        if (p->sub) {
            int rc = km_subscriber_flush(p->sub, NULL);
            if (rc != KM_OK)
                slog(s, "pool %s: applying events: %s", p->name, km_subscriber_last_error(p->sub));
        }
        if (p->local_feed) {
            pthread_mutex_lock(&p->local_lock);
            int rc = km_feed_flush(p->local_feed, now, NULL);
            if (rc != KM_OK)
                slog(s, "pool %s: applying in-process events: %s", p->name,
                     km_feed_last_error(p->local_feed));
            pthread_mutex_unlock(&p->local_lock);
        }
        if (km_approx_next_expiry(p->approx) <= now) {
            km_approx_updates_clear(&b->updates);
            if (km_approx_expire(p->approx, now, &b->updates, NULL) == KM_OK && b->updates.n_updates)
                approx_apply(s, p, b, b->updates.updates, b->updates.n_updates);
            km_approx_updates_clear(&b->updates);
        }
    }
    apply_lessons(s, b, now);
    pthread_mutex_unlock(&s->admin_lock);
}

static void scratch_free(batch_scratch *b)
{
    free(b->cands);
    free(b->costs);
    free(b->scores);
    free(b->rcands);
    free(b->pool_updates);
    free(b->seen);
    km_approx_updates_free(&b->updates);
    memset(b, 0, sizeof *b);
}

/* Take whole frames from the queue, up to max_batch_routes (a bigger frame goes alone). Called
 * with queue_lock held. */
static job *take_jobs(km_server *s)
{
    job *take = NULL, **tail = &take;
    uint32_t routes = 0;
    while (s->queue_head &&
           (routes == 0 || routes + s->queue_head->n_routes <= s->cfg.max_batch_routes)) {
        job *j = s->queue_head;
        s->queue_head = j->next;
        j->next = NULL;
        *tail = j;
        tail = &j->next;
        routes += j->n_routes;
    }
    if (!s->queue_head)
        s->queue_tail = NULL;
    s->queued_routes -= routes;
    return take;
}

static void *scheduler_main(void *arg)
{
    km_server *s = arg;
    uint64_t next_tick = now_ns() + SCHEDULER_TICK_MS * UINT64_C(1000000);
    for (;;) {
        pthread_mutex_lock(&s->queue_lock);
        /* Run when the role is free and there is something to do: frames, received events, or
         * the periodic tick (approximate-mode expiry). A wake-up for nothing (the loop thread
         * finished a batch inline, a spurious one) goes back to sleep without housekeeping. */
        bool tick = false;
        for (;;) {
            if (s->scheduler_stop && !s->queue_head && !s->scheduler_busy)
                break;
            tick = now_ns() >= next_tick;
            if (!s->scheduler_busy && (s->queue_head || s->events_pending || tick))
                break;
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += SCHEDULER_TICK_MS * 1000000L;
            if (ts.tv_nsec >= 1000000000L) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000L;
            }
            pthread_cond_timedwait(&s->queue_cond, &s->queue_lock, &ts);
        }
        if (s->scheduler_stop && !s->queue_head && !s->scheduler_busy) {
            pthread_mutex_unlock(&s->queue_lock);
            break;
        }
        if (tick)
            next_tick = now_ns() + SCHEDULER_TICK_MS * UINT64_C(1000000);
        uint64_t queued = s->queued_routes;
        job *take = take_jobs(s);
        uint32_t taken = (uint32_t)(queued - s->queued_routes); /* at most one frame's over the cap */
        s->scheduler_busy = true; /* housekeeping alone holds the role too: it uses the scratch */
        s->events_pending = false; /* housekeeping below flushes them */
        pthread_mutex_unlock(&s->queue_lock);

        /* Before a batch, active work too: twice the batch's routes (at least a slice, at most
         * EXPIRY_PER_PASS), which keeps up with any decision rate without holding the batch's own
         * routes up for more. A pass for the tick alone leaves it to the loop thread. */
        uint32_t expire = 2 * taken < EXPIRY_SLICE ? EXPIRY_SLICE : 2 * taken;
        housekeeping(s, &s->scratch, take ? (expire < EXPIRY_PER_PASS ? expire : EXPIRY_PER_PASS) : 0);
        if (take) {
            run_batch(s, take, &s->scratch);
            /* Nothing queued: this thread would only wait while the loop thread encodes the
             * batch's replies, so it encodes them itself and the loop thread gets back sooner to
             * the frames that will make the next batch. */
            pthread_mutex_lock(&s->queue_lock);
            bool nothing_queued = s->queue_head == NULL;
            pthread_mutex_unlock(&s->queue_lock);
            for (job *j = take; nothing_queued && j; j = j->next) {
                encode_job_reply(s, j);
                j->encoded = true;
            }
            pthread_mutex_lock(&s->done_lock);
            if (s->done_tail)
                s->done_tail->next = take;
            else
                s->done_head = take;
            job *last = take;
            while (last->next)
                last = last->next;
            s->done_tail = last;
            pthread_mutex_unlock(&s->done_lock);
        }
        pthread_mutex_lock(&s->queue_lock);
        s->scheduler_busy = false;
        pthread_mutex_unlock(&s->queue_lock);
        if (take)
            uv_async_send(&s->wake);
    }
    return NULL;
}

/* ---- connections ----------------------------------------------------------------------------- */

static void conn_close(conn *c);
static void conn_flush(conn *c);
static void on_read(uv_stream_t *stream, ssize_t nread, const uv_buf_t *buf);
static void alloc_cb(uv_handle_t *h, size_t suggested, uv_buf_t *buf);

/* Reading paused while replies piled up (conn_send) starts again once they drained, while the
 * server drains too (what was sent before the stop is answered, a new ROUTE refused). libuv wants
 * the allocation callback again (NULL is refused with UV_EINVAL: until 2026-11-30 a paused
 * connection never read again); a connection that cannot read is closed. */
static void conn_resume_reading(conn *c)
{
    c->paused = false;
    int rc = uv_read_start(&c->h.stream, alloc_cb, on_read);
    if (rc < 0) {
        slog(c->server, "closing a connection whose reading could not resume: %s", uv_strerror(rc));
        conn_close(c);
    }
}

static void conn_maybe_free(conn *c)
{
    if (!c->handle_closed || c->jobs_in_flight)
        return;
    km_frame_reader_destroy(c->reader);
    km_protocol_decoder_destroy(c->decoder);
    km_frame_buffer_free(&c->outbox);
    km_frame_buffer_free(&c->writing);
    free(c);
}

static void on_conn_closed(uv_handle_t *h)
{
    conn *c = h->data;
    c->handle_closed = true;
    conn_maybe_free(c);
}

static void conn_close(conn *c)
{
    if (c->closing)
        return;
    km_server *s = c->server;
    c->closing = true;
    if (c->prev)
        c->prev->next = c->next;
    else
        s->conns = c->next;
    if (c->next)
        c->next->prev = c->prev;
    atomic_fetch_sub(&s->st.open, 1);
    uv_close(&c->h.handle, on_conn_closed);
}

/* A connection whose peer is done (EOF) closes once every reply it is owed is written. */
static void conn_close_if_finished(conn *c)
{
    if (c->eof && !c->closing && !c->jobs_in_flight && !c->write_in_flight && c->outbox.size == 0)
        conn_close(c);
}

static void on_write(uv_write_t *req, int status)
{
    conn *c = req->data;
    c->write_in_flight = false;
    c->writing.size = 0;
    if (status < 0) {
        conn_close(c);
        return;
    }
    if (c->closing)
        return;
    km_server *s = c->server;
    if (c->paused && c->outbox.size < s->cfg.max_outbox_bytes / 8 && !c->eof)
        conn_resume_reading(c);
    conn_flush(c);
    conn_close_if_finished(c);
}

static void alloc_cb(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    (void)suggested;
    conn *c = h->data;
    buf->base = c->rbuf;
    buf->len = sizeof c->rbuf;
}

static void conn_flush(conn *c)
{
    if (c->closing || c->write_in_flight || c->outbox.size == 0)
        return;
    /* Try the write now: a reply the socket takes whole needs no write request, no callback and
     * none of the epoll_ctl calls libuv makes when a request completes. Only what is left (the
     * peer's buffer full) goes through uv_write. */
    uv_buf_t now = uv_buf_init((char *)c->outbox.data, (unsigned)c->outbox.size);
    int n = uv_try_write(&c->h.stream, &now, 1);
    if (n < 0 && n != UV_EAGAIN) {
        conn_close(c);
        return;
    }
    size_t written = n > 0 ? (size_t)n : 0;
    if (written == c->outbox.size) {
        c->outbox.size = 0;
        if (c->paused && !c->eof)
            conn_resume_reading(c);
        return;
    }
    km_frame_buffer t = c->writing;
    c->writing = c->outbox;
    c->outbox = t;
    c->outbox.size = 0;
    uv_buf_t buf = uv_buf_init((char *)c->writing.data + written,
                               (unsigned)(c->writing.size - written));
    c->write_req.data = c;
    c->write_in_flight = true;
    int rc = uv_write(&c->write_req, &c->h.stream, &buf, 1, on_write);
    if (rc < 0) {
        c->write_in_flight = false;
        conn_close(c);
    }
}

/* Queue bytes for the peer; a reader that lets too much pile up is closed. Only replies already
 * waiting make a reader slow: a reply that finds nothing unwritten is taken whatever its size (up
 * to max_frame_bytes), so a small max_outbox_bytes never cuts off a client that reads promptly. */
static void conn_send(conn *c, const km_frame_buffer *frames)
{
    km_server *s = c->server;
    if (c->closing || frames->size == 0)
        return;
    size_t waiting = c->outbox.size + c->writing.size;
    if (waiting > 0 && waiting + frames->size > s->cfg.max_outbox_bytes) {
        atomic_fetch_add(&s->st.slow_closed, 1);
        slog(s, "closing a connection that does not read its replies (%zu bytes waiting)",
             c->outbox.size + c->writing.size);
        conn_close(c);
        return;
    }
    if (c->outbox.capacity < c->outbox.size + frames->size) {
        size_t cap = c->outbox.capacity ? c->outbox.capacity : 4096;
        while (cap < c->outbox.size + frames->size)
            cap *= 2;
        uint8_t *g = realloc(c->outbox.data, cap);
        if (!g) {
            conn_close(c);
            return;
        }
        c->outbox.data = g;
        c->outbox.capacity = cap;
    }
    memcpy(c->outbox.data + c->outbox.size, frames->data, frames->size);
    c->outbox.size += frames->size;
    if (!c->paused && c->reading && c->outbox.size + c->writing.size > s->cfg.max_outbox_bytes / 4) {
        c->paused = true;
        uv_read_stop(&c->h.stream);
    }
    conn_flush(c);
}

static void send_error(conn *c, uint64_t id, int code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void send_error(conn *c, uint64_t id, int code, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    km_frame_buffer fb;
    km_frame_buffer_init(&fb);
    if (km_protocol_encode_error(id, code, msg, &fb) == KM_OK)
        conn_send(c, &fb);
    km_frame_buffer_free(&fb);
}

static void send_message(conn *c, const km_message *m)
{
    km_frame_buffer fb;
    km_frame_buffer_init(&fb);
    char why[256];
    int rc = km_protocol_encode(m, c->server->cfg.limits.max_frame_bytes, &fb, why, sizeof why);
    if (rc == KM_OK)
        conn_send(c, &fb);
    else
        send_error(c, m->id, rc, "encoding the reply failed: %s", why);
    km_frame_buffer_free(&fb);
}

/* ---- messages -------------------------------------------------------------------------------- */

static void handle_route(conn *c, const km_message *m)
{
    km_server *s = c->server;
    const km_route_batch *rb = &m->route;
    if (s->draining) {
        send_error(c, m->id, KM_ERR_SHUTTING_DOWN, "the service is shutting down");
        return;
    }
    pthread_mutex_lock(&s->queue_lock);
    bool full = s->queued_routes + rb->n_routes > s->cfg.max_queued_routes;
    pthread_mutex_unlock(&s->queue_lock);
    if (full) {
        atomic_fetch_add(&s->st.overloaded, 1);
        km_counter_add(s->m_overloaded, 1);
        send_error(c, m->id, KM_ERR_OVERLOADED, "%u routes are queued (max_queued_routes %u)",
                   (unsigned)s->queued_routes, s->cfg.max_queued_routes);
        return;
    }
    job *j = calloc(1, sizeof *j);
    if (!j) {
        send_error(c, m->id, KM_ERR_OUT_OF_MEMORY, "queueing the routes");
        return;
    }
    km_frame_buffer_init(&j->reply);
    j->conn = c;
    j->msg_id = m->id;
    j->n_routes = rb->n_routes;
    j->routes = job_alloc(j, rb->n_routes * sizeof *j->routes);
    if (!j->routes) {
        job_free(j);
        send_error(c, m->id, KM_ERR_OUT_OF_MEMORY, "queueing the routes");
        return;
    }
    memset(j->routes, 0, rb->n_routes * sizeof *j->routes);
    atomic_fetch_add(&s->st.routes, rb->n_routes);
    /* No admin_lock: the pool metadata read here is written only on this thread (see the lock
     * notes at the top), and the scheduler may hold the lock for a whole batch. */
    for (uint32_t i = 0; i < rb->n_routes; i++) {
        const km_route_request *in = &rb->routes[i];
        route_job *r = &j->routes[i];
        r->request_id = job_strdup(j, in->request_id ? in->request_id : "");
        r->attempt_id = job_strdup(j, in->attempt_id);
        if (in->status != KM_OK) {
            route_fail(r, in->status, "%s", in->message ? in->message : km_strerror(in->status));
            continue;
        }
        r->model = job_strdup(j, in->model);
        r->endpoint = job_strdup(j, in->endpoint);
        r->policy_name = job_strdup(j, in->policy);
        int pi = -1;
        if (in->pool)
            pi = pool_find(s, in->pool);
        else if (in->model)
            pi = pool_for_model(s, in->model);
        /* Only a route naming neither falls back: a model no pool serves is refused, never
         * decided on a pool serving another model. */
        if (pi < 0 && !in->pool && !in->model && s->default_pool)
            pi = pool_find(s, s->default_pool);
        if (pi < 0 && !in->pool && !in->model && !s->default_pool && s->n_pools > 0)
            pi = 0;
        if (pi < 0) {
            if (in->pool)
                route_fail(r, KM_ERR_NOT_FOUND, "no pool %s", in->pool);
            else if (in->model)
                route_fail(r, KM_ERR_NOT_FOUND, "no pool serves model %s", in->model);
            else
                route_fail(r, KM_ERR_NOT_FOUND, "no pool: the route names none, and the default "
                           "pool %s does not exist", s->default_pool ? s->default_pool : "(none)");
            continue;
        }
        pool *p = s->pools[pi];
        r->pool = (uint32_t)pi;
        r->input = in->input;
        if (in->input == KM_ROUTE_INPUT_TOKENS) {
            size_t nb = in->n_tokens / p->block_size;
            r->hashes = job_alloc(j, (nb ? nb : 1) * sizeof *r->hashes);
            if (!r->hashes) {
                route_fail(r, KM_ERR_OUT_OF_MEMORY, "hashing");
                continue;
            }
            km_hash_config hc = {p->block_size, in->lora_name, in->cache_salt};
            size_t got = 0;
            int rc = km_hash_sequence(&hc, in->tokens, in->n_tokens, 0, KM_NO_PARENT, NULL,
                                      r->hashes, &got);
            if (rc != KM_OK) {
                route_fail(r, rc, "hashing the tokens: %s", km_strerror(rc));
                continue;
            }
            r->n_hashes = (uint32_t)got;
            r->prompt_tokens = in->has_prompt_tokens ? in->prompt_tokens : in->n_tokens;
            r->has_prompt_tokens = true;
        } else {
            if (in->block_size && in->block_size != p->block_size) {
                route_fail(r, KM_ERR_INVALID_ARGUMENT,
                           "hashes were computed with block size %u; pool %s uses %u",
                           in->block_size, p->name, p->block_size);
                continue;
            }
            r->hashes = job_alloc(j, (in->n_hashes ? in->n_hashes : 1) * sizeof *r->hashes);
            if (!r->hashes) {
                route_fail(r, KM_ERR_OUT_OF_MEMORY, "copying the hashes");
                continue;
            }
            memcpy(r->hashes, in->hashes, in->n_hashes * sizeof *r->hashes);
            r->n_hashes = in->n_hashes;
            r->has_prompt_tokens = in->has_prompt_tokens;
            r->prompt_tokens = in->has_prompt_tokens ? in->prompt_tokens
                                                     : (uint64_t)in->n_hashes * p->block_size;
        }
        r->has_expected_output_tokens = in->has_expected_output_tokens;
        r->brief = in->brief;
        r->expected_output_tokens = in->expected_output_tokens;
        if (in->candidates) {
            r->candidates = job_alloc(j, (in->n_candidates ? in->n_candidates : 1) * sizeof(uint32_t));
            if (!r->candidates) {
                route_fail(r, KM_ERR_OUT_OF_MEMORY, "candidates");
                continue;
            }
            memcpy(r->candidates, in->candidates, in->n_candidates * sizeof(uint32_t));
            r->n_candidates = in->n_candidates;
            if (r->n_candidates == 0) {
                route_fail(r, KM_ERR_INVALID_ARGUMENT, "candidates is empty");
                continue;
            }
        }
    }
    j->enqueued_ns = now_ns();
    c->jobs_in_flight++;
    pthread_mutex_lock(&s->queue_lock);
    if (s->queue_tail)
        s->queue_tail->next = j;
    else
        s->queue_head = j;
    s->queue_tail = j;
    s->queued_routes += j->n_routes;
    pthread_mutex_unlock(&s->queue_lock);
    s->dispatch_pending = true; /* on_dispatch runs it or wakes the scheduler */
}

static km_active_end active_end_of(km_outcome o)
{
    switch (o) {
    case KM_OUTCOME_COMPLETE: return KM_ACTIVE_END_COMPLETE;
    case KM_OUTCOME_INCOMPLETE: return KM_ACTIVE_END_INCOMPLETE;
    case KM_OUTCOME_CANCELLED: return KM_ACTIVE_END_CANCELLED;
    default: return KM_ACTIVE_END_ERROR;
    }
}

static km_record_outcome record_outcome_of(km_outcome o)
{
    switch (o) {
    case KM_OUTCOME_COMPLETE: return KM_RECORD_OUTCOME_COMPLETE;
    case KM_OUTCOME_INCOMPLETE: return KM_RECORD_OUTCOME_INCOMPLETE;
    case KM_OUTCOME_CANCELLED: return KM_RECORD_OUTCOME_CANCELLED;
    default: return KM_RECORD_OUTCOME_ERROR;
    }
}

/* Approximate mode assumes the worker a request went to holds its blocks (approx.h). The
 * decision taught that to its chosen worker; when the router reports another approximate-mode
 * worker, that one is taught too, at the scheduler's next housekeeping (apply_lessons). The chosen
 * worker's assumption is left to its TTL: other decisions may have taught it the same blocks.
 * active_lock held. */
static void lesson_queue(km_server *s, const attempt *a, uint32_t worker)
{
    if (!a->has_blocks)
        return; /* nothing to teach, nothing missed */
    dispatch_lesson *l = NULL;
    uint64_t bytes = (uint64_t)a->n_hashes * sizeof *l->hashes;
    /* The copy counts against approx_dispatch_max_bytes until it is taught: reports that move one
     * attempt back and forth would otherwise queue a copy each. */
    if (a->hashes && s->attempt_cache.hash_bytes + bytes <= s->cfg.approx_dispatch_max_bytes)
        l = malloc(sizeof *l + bytes);
    if (!l) {
        atomic_fetch_add(&s->st.dispatch_unlearned, 1);
        return;
    }
    s->attempt_cache.hash_bytes += bytes;
    l->worker = worker;
    l->incarnation = s->workers[worker].incarnation;
    l->n_hashes = a->n_hashes;
    memcpy(l->hashes, a->hashes, (size_t)a->n_hashes * sizeof *l->hashes);
    l->next = s->lessons; /* newest first: apply_lessons reverses */
    s->lessons = l;
    atomic_store(&s->lessons_queued, true);
}

/* One lifecycle report (active_lock held). Returns KM_OK or an error with *msg. */
static int lifecycle_one(km_server *s, const km_lifecycle_event *ev, char *msg, size_t msg_size)
{
    if (ev->status != KM_OK)
        return km_why(msg, msg_size, ev->status, "%s", ev->message ? ev->message : "malformed");
    attempt *a = NULL;
    if (ev->has_decision_id) {
        uint64_t *v = km_u64map_find(&s->attempts_by_decision, km_u64map_key(ev->decision_id));
        a = v ? (attempt *)(uintptr_t)*v : NULL;
    } else if (ev->request_id) {
        a = attempt_by_key(s, ev->request_id, ev->attempt_id);
    }
    if (!a && ev->request_id) {
        /* No attempt: active work still tells a duplicate (already finished: KM_ERR_PROTOCOL) or
         * a late report (expired, evicted, worker removed) from an unknown id, and counts it. The
         * entry is not live, so nothing changes (one whose attempt could not be kept, out of
         * memory, is live: the event applies to it, without an outcome record). */
        km_active_key key = km_active_key_of(ev->request_id, ev->attempt_id);
        uint64_t now = now_ns();
        int rc = ev->kind == KM_LIFECYCLE_DISPATCHED ? km_active_dispatched(s->active, &key, now)
                 : ev->kind == KM_LIFECYCLE_FIRST_TOKEN
                     ? km_active_first_token(s->active, &key, KM_ACTIVE_CACHED_UNKNOWN, now)
                     : km_active_finish(s->active, &key, active_end_of(ev->outcome), now, NULL);
        if (rc == KM_OK)
            return KM_OK;
        if (rc != KM_ERR_NOT_FOUND)
            return km_why(msg, msg_size, rc, "%s", km_active_last_error(s->active));
    }
    if (!a)
        return km_why(msg, msg_size, KM_ERR_NOT_FOUND,
                     "no active attempt for %s%" PRIu64 "%s%s%s%s",
                     ev->has_decision_id ? "decision " : "", ev->has_decision_id ? ev->decision_id : 0,
                     ev->request_id ? " request " : "", ev->request_id ? ev->request_id : "",
                     ev->attempt_id ? " attempt " : "", ev->attempt_id ? ev->attempt_id : "");
    km_active_key key = km_active_key_of(a->request_id, a->attempt_id);
    uint64_t now = now_ns();
    int rc = KM_OK;
    /* The router sent the attempt to another worker than the decision's (PROTOCOL.md, `worker`):
     * its load moves there, and its outcome record says so. A worker outside the decision's pool
     * fails the event and changes nothing. */
    if (ev->has_worker && ev->worker != a->worker) {
        int pi = pool_find(s, a->pool);
        if (ev->worker >= s->cfg.max_workers || pi < 0 || !is_member(s->pools[pi], ev->worker))
            return km_why(msg, msg_size, KM_ERR_NOT_FOUND, "worker %u is not in pool %s",
                          ev->worker, a->pool);
        rc = km_active_move(s->active, &key, ev->worker, now);
        if (rc != KM_OK)
            return km_why(msg, msg_size, rc, "%s", km_active_last_error(s->active));
        s->pools[pi]->overrides_seen = true;
        a->worker = ev->worker;
        memcpy(a->dispatched_name, s->workers[ev->worker].name, sizeof a->dispatched_name);
        if (!strcmp(a->dispatched_name, a->chosen_name))
            a->dispatched_name[0] = '\0';
        if (!s->workers[ev->worker].events)
            lesson_queue(s, a, ev->worker);
    }
    switch (ev->kind) {
    case KM_LIFECYCLE_DISPATCHED:
        rc = km_active_dispatched(s->active, &key, now);
        if (rc == KM_OK && !a->dispatched.monotonic_ns)
            a->dispatched = km_record_time_now();
        if (rc == KM_OK && ev->has_elapsed_ms && isnan(a->router_dispatched_ms))
            a->router_dispatched_ms = ev->elapsed_ms;
        break;
    case KM_LIFECYCLE_FIRST_TOKEN:
        rc = km_active_first_token(s->active, &key,
                                   ev->has_cached_tokens ? (int64_t)ev->cached_tokens
                                                         : KM_ACTIVE_CACHED_UNKNOWN,
                                   now);
        if (rc == KM_OK && ev->has_elapsed_ms && isnan(a->router_ttft_ms))
            a->router_ttft_ms = ev->elapsed_ms; /* the first FIRST_TOKEN counts, as its time does */
        /* Streaming has begun: the router knows where the attempt went and has said so, if it
         * overrode the choice (lesson_queue). Its hashes make room for newer decisions'. */
        if (rc == KM_OK)
            attempt_drop_hashes(&s->attempt_cache, a);
        break;
    case KM_LIFECYCLE_FINISHED: {
        if (ev->has_cached_tokens)
            km_active_report_cached(s->active, &key, (int64_t)ev->cached_tokens, now);
        km_active_summary sum;
        rc = km_active_finish(s->active, &key, active_end_of(ev->outcome), now, &sum);
        if (rc == KM_OK) {
            breaker_outcome(s, a->worker, ev->outcome, now); /* the worker the attempt ran on */
            write_outcome(s, a, record_outcome_of(ev->outcome), ev, &sum, NULL);
            attempt_forget(s, a);
        }
        break;
    }
    default:
        return km_why(msg, msg_size, KM_ERR_PROTOCOL, "unknown lifecycle kind");
    }
    if (rc != KM_OK)
        return km_why(msg, msg_size, rc, "%s", km_active_last_error(s->active));
    return KM_OK;
}

static void handle_lifecycle(conn *c, const km_message *m)
{
    km_server *s = c->server;
    const km_lifecycle_batch *lb = &m->lifecycle;
    km_item_status *items = calloc(lb->n_events, sizeof *items);
    char(*msgs)[256] = calloc(lb->n_events, sizeof *msgs);
    if (!items || !msgs) {
        free(items);
        free(msgs);
        send_error(c, m->id, KM_ERR_OUT_OF_MEMORY, "lifecycle reply");
        return;
    }
    pthread_mutex_lock(&s->active_lock);
    for (uint32_t i = 0; i < lb->n_events; i++) {
        atomic_fetch_add(&s->st.lifecycle, 1);
        km_counter_add(s->m_lifecycle, 1);
        items[i].status = lifecycle_one(s, &lb->events[i], msgs[i], sizeof msgs[i]);
        if (items[i].status != KM_OK) {
            items[i].message = msgs[i];
            atomic_fetch_add(&s->st.lifecycle_errors, 1);
        }
    }
    bool lessons = s->lessons != NULL;
    pthread_mutex_unlock(&s->active_lock);
    if (lessons)
        wake_scheduler(s); /* the next decision should already know */
    km_message reply;
    memset(&reply, 0, sizeof reply);
    reply.type = KM_MESSAGE_ACK;
    reply.has_id = true;
    reply.id = m->id;
    reply.ack.items = items;
    reply.ack.n_items = lb->n_events;
    send_message(c, &reply);
    free(items);
    free(msgs);
}

/* Runtime view of one worker (admin_lock held). */
static void worker_view(km_server *s, uint32_t id, km_worker_info *out)
{
    worker_slot *w = &s->workers[id];
    pool *p = s->pools[w->pool];
    memset(out, 0, sizeof *out);
    out->pool = p->name;
    out->worker = id;
    out->name = w->name;
    out->event_endpoint = w->event_endpoint;
    out->replay_endpoint = w->replay_endpoint;
    out->has_dp_rank = w->has_dp_rank;
    out->dp_rank = w->dp_rank;
    out->state = worker_state(s, id);
    km_worker_stats ws;
    if (km_index_worker_stats(p->index, id, &ws) == KM_OK) {
        out->has_blocks = true;
        out->blocks = ws.blocks;
    }
    if (w->events) {
        km_feed_worker_info info;
        if (feed_info(s, id, &info) == KM_OK) {
            if (info.has_last_receive) {
                out->has_last_event_age_s = true;
                out->last_event_age_s = (double)(now_ns() - info.last_receive_ns) / 1e9;
            }
            out->has_expected_seq = info.has_expected_seq;
            out->expected_seq = info.expected_seq;
        }
    }
    km_active_load load;
    uint64_t now = now_ns();
    pthread_mutex_lock(&s->active_lock);
    if (km_active_worker_load(s->active, id, &load) == KM_OK) {
        out->has_load = true;
        out->load.in_flight = (uint32_t)load.in_flight;
        out->load.pending_prefill_tokens = load.pending_prefill_tokens;
        out->load.active_decode_blocks = load.active_decode_blocks;
    }
    out->has_healthy = true;
    out->healthy = !w->unhealthy;
    out->breaker = breaker_state_name(worker_breaker(w, now));
    out->has_failures = true;
    out->failures = w->failures;
    out->has_eligible = true;
    out->eligible = worker_eligibility(s, id, now) == ELIGIBLE;
    pthread_mutex_unlock(&s->active_lock);
}

/* KM_OK when the worker a WORKERS remove / update item names exists in the pool it names
 * (admin_lock held); else KM_ERR_NOT_FOUND with the reason in why. */
static int named_worker(km_server *s, const km_worker_info *wi, char *why, size_t why_size)
{
    int pi = pool_find(s, wi->pool);
    if (pi < 0)
        return km_why(why, why_size, KM_ERR_NOT_FOUND, "no pool %s", wi->pool);
    if (wi->worker >= s->cfg.max_workers || !s->workers[wi->worker].used ||
        s->workers[wi->worker].pool != (uint32_t)pi)
        return km_why(why, why_size, KM_ERR_NOT_FOUND, "worker %u is not in pool %s", wi->worker,
                      wi->pool);
    return KM_OK;
}

/* The router's verdict on a worker (admin_lock held); true when it changed. Its breaker is
 * this instance's own evidence and stays as it is. */
static bool worker_set_health(km_server *s, uint32_t id, bool healthy)
{
    pthread_mutex_lock(&s->active_lock);
    worker_slot *w = &s->workers[id];
    bool changed = w->unhealthy == healthy, before = health_may_restrict(w);
    w->unhealthy = !healthy;
    health_changed(s, w, before);
    pthread_mutex_unlock(&s->active_lock);
    return changed;
}

static void handle_workers(conn *c, const km_message *m)
{
    km_server *s = c->server;
    const km_workers_message *wm = &m->workers;
    km_message reply;
    memset(&reply, 0, sizeof reply);
    reply.has_id = true;
    reply.id = m->id;
    pthread_mutex_lock(&s->admin_lock);
    if (wm->action == KM_ADMIN_LIST) {
        int pi = wm->pool ? pool_find(s, wm->pool) : -1;
        if (wm->pool && pi < 0) {
            pthread_mutex_unlock(&s->admin_lock);
            send_error(c, m->id, KM_ERR_NOT_FOUND, "no pool %s", wm->pool);
            return;
        }
        km_worker_info *list = calloc(s->cfg.max_workers, sizeof *list);
        uint32_t n = 0;
        for (uint32_t id = 0; list && id < s->cfg.max_workers; id++)
            if (s->workers[id].used && (pi < 0 || s->workers[id].pool == (uint32_t)pi))
                worker_view(s, id, &list[n++]);
        reply.type = KM_MESSAGE_WORKER_LIST;
        reply.workers.action = KM_ADMIN_LIST;
        reply.workers.workers = list;
        reply.workers.n_workers = n;
        if (list)
            send_message(c, &reply);
        else
            send_error(c, m->id, KM_ERR_OUT_OF_MEMORY, "worker list");
        pthread_mutex_unlock(&s->admin_lock);
        free(list);
        return;
    }
    if (wm->action != KM_ADMIN_ADD && wm->action != KM_ADMIN_REMOVE &&
        wm->action != KM_ADMIN_UPDATE) {
        pthread_mutex_unlock(&s->admin_lock);
        send_error(c, m->id, KM_ERR_PROTOCOL, "WORKERS action must be add, remove, update or list");
        return;
    }
    km_item_status *items = calloc(wm->n_workers ? wm->n_workers : 1, sizeof *items);
    char(*msgs)[256] = calloc(wm->n_workers ? wm->n_workers : 1, sizeof *msgs);
    if (!items || !msgs) {
        pthread_mutex_unlock(&s->admin_lock);
        free(items);
        free(msgs);
        send_error(c, m->id, KM_ERR_OUT_OF_MEMORY, "workers reply");
        return;
    }
    for (uint32_t i = 0; i < wm->n_workers; i++) {
        const km_worker_info *wi = &wm->workers[i];
        int rc = wi->status;
        if (rc != KM_OK) {
            snprintf(msgs[i], sizeof msgs[i], "%s", wi->message ? wi->message : "malformed");
        } else if (wm->action == KM_ADMIN_ADD) {
            int pi = pool_find(s, wi->pool);
            if (pi < 0) {
                rc = km_why(msgs[i], sizeof msgs[i], KM_ERR_NOT_FOUND, "no pool %s", wi->pool);
            } else {
                km_server_worker w = {wi->worker, wi->name, wi->event_endpoint, wi->replay_endpoint};
                rc = worker_add(s, (uint32_t)pi, &w, msgs[i], sizeof msgs[i]);
                if (rc == KM_OK) {
                    s->workers[wi->worker].has_dp_rank = wi->has_dp_rank;
                    s->workers[wi->worker].dp_rank = wi->dp_rank;
                }
                if (rc == KM_OK && wi->has_healthy)
                    worker_set_health(s, wi->worker, wi->healthy);
                if (rc == KM_OK)
                    slog(s, "worker %u (%s) added to pool %s%s%s", wi->worker,
                         s->workers[wi->worker].name, wi->pool,
                         wi->event_endpoint ? "" : " in approximate mode",
                         wi->has_healthy && !wi->healthy ? ", unhealthy" : "");
            }
        } else if (wm->action == KM_ADMIN_UPDATE) {
            rc = named_worker(s, wi, msgs[i], sizeof msgs[i]);
            if (rc == KM_OK && !wi->has_healthy)
                rc = km_why(msgs[i], sizeof msgs[i], KM_ERR_INVALID_ARGUMENT,
                           "worker %u: update needs `healthy` (the only field it changes)",
                           wi->worker);
            if (rc == KM_OK && worker_set_health(s, wi->worker, wi->healthy))
                slog(s, "worker %u (%s) marked %s by the router", wi->worker,
                     s->workers[wi->worker].name, wi->healthy ? "healthy" : "unhealthy");
        } else {
            if ((rc = named_worker(s, wi, msgs[i], sizeof msgs[i])) == KM_OK)
                rc = worker_remove(s, wi->worker, msgs[i], sizeof msgs[i]);
            if (rc == KM_OK)
                slog(s, "worker %u removed from pool %s", wi->worker, wi->pool);
        }
        items[i].status = rc;
        items[i].message = rc == KM_OK ? NULL : msgs[i];
    }
    pthread_mutex_unlock(&s->admin_lock);
    reply.type = KM_MESSAGE_ACK;
    reply.ack.items = items;
    reply.ack.n_items = wm->n_workers;
    send_message(c, &reply);
    free(items);
    free(msgs);
}

/* One of a POOLS add / update's params: a policy parameter, or (add only: a pool's approximate
 * mode keeps its TTL and capacity for its life) approx_ttl_s or approx_capacity_blocks. */
static int pool_param(km_admin_action action, km_server_pool *pc, const km_param *param, char *why,
                      size_t why_size)
{
    bool ttl = !strcmp(param->name, "approx_ttl_s");
    if (!ttl && strcmp(param->name, "approx_capacity_blocks") != 0)
        return km_server_policy_param(&pc->policy, param->name, param->value, why, why_size);
    if (action != KM_ADMIN_ADD)
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                      "%s is set when a pool is added; it cannot change", param->name);
    double v = param->value;
    if (ttl) {
        if (!(v >= 0.001 && v <= 1e9))
            return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                          "approx_ttl_s %g is outside [0.001, 1e9]", v);
        pc->approx_ttl_ms = (uint64_t)llround(v * 1000);
    } else {
        if (!(v >= 0 && v <= 1e15) || v != floor(v))
            return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                          "approx_capacity_blocks %g is not a whole number in [0, 1e15]", v);
        pc->approx_capacity_blocks = (uint64_t)v;
    }
    return KM_OK;
}

static void handle_pools(conn *c, const km_message *m)
{
    km_server *s = c->server;
    const km_pools_message *pm = &m->pools;
    km_message reply;
    memset(&reply, 0, sizeof reply);
    reply.has_id = true;
    reply.id = m->id;
    pthread_mutex_lock(&s->admin_lock);
    if (pm->action == KM_ADMIN_LIST) {
        km_pool_info *list = calloc(s->n_pools ? s->n_pools : 1, sizeof *list);
        km_param(*params)[10] = calloc(s->n_pools ? s->n_pools : 1, sizeof *params);
        for (uint32_t i = 0; list && params && i < s->n_pools; i++) {
            pool *p = s->pools[i];
            list[i].name = p->name;
            list[i].model = p->model;
            list[i].block_size = p->block_size;
            list[i].policy = km_policy_kind_name(p->policy.kind);
            km_param *pp = params[i];
            pp[0] = (km_param){"temperature", p->policy.kv.temperature};
            pp[1] = (km_param){"prefill_load_scale", p->policy.kv.prefill_load_scale};
            pp[2] = (km_param){"device_weight", p->policy.kv.device_weight};
            pp[3] = (km_param){"host_weight", p->policy.kv.host_weight};
            pp[4] = (km_param){"disk_weight", p->policy.kv.disk_weight};
            pp[5] = (km_param){"cache_threshold", p->policy.cache_aware.cache_threshold};
            pp[6] = (km_param){"balance_abs_threshold", p->policy.cache_aware.balance_abs_threshold};
            pp[7] = (km_param){"balance_rel_threshold", p->policy.cache_aware.balance_rel_threshold};
            pp[8] = (km_param){"approx_ttl_s", (double)p->approx_ttl_ms / 1000.0};
            pp[9] = (km_param){"approx_capacity_blocks", (double)p->approx_capacity_blocks};
            list[i].params = pp;
            list[i].n_params = 10;
        }
        reply.type = KM_MESSAGE_POOL_LIST;
        reply.pools.action = KM_ADMIN_LIST;
        reply.pools.pools = list;
        reply.pools.n_pools = s->n_pools;
        if (list && params)
            send_message(c, &reply);
        else
            send_error(c, m->id, KM_ERR_OUT_OF_MEMORY, "pool list");
        pthread_mutex_unlock(&s->admin_lock);
        free(list);
        free(params);
        return;
    }
    if (pm->action != KM_ADMIN_ADD && pm->action != KM_ADMIN_UPDATE) {
        pthread_mutex_unlock(&s->admin_lock);
        send_error(c, m->id, KM_ERR_PROTOCOL, "POOLS action must be add, update or list");
        return;
    }
    km_item_status *items = calloc(pm->n_pools ? pm->n_pools : 1, sizeof *items);
    char(*msgs)[256] = calloc(pm->n_pools ? pm->n_pools : 1, sizeof *msgs);
    for (uint32_t i = 0; items && msgs && i < pm->n_pools; i++) {
        const km_pool_info *pi = &pm->pools[i];
        int rc = pi->status;
        if (rc != KM_OK) {
            snprintf(msgs[i], sizeof msgs[i], "%s", pi->message ? pi->message : "malformed");
            items[i].status = rc;
            items[i].message = msgs[i];
            continue;
        }
        int at = pool_find(s, pi->name);
        km_server_pool pc;
        memset(&pc, 0, sizeof pc);
        km_policy_config_init(&pc.policy);
        if (pm->action == KM_ADMIN_UPDATE) {
            if (at < 0) {
                rc = km_why(msgs[i], sizeof msgs[i], KM_ERR_NOT_FOUND, "no pool %s", pi->name);
            } else if (pi->block_size && pi->block_size != s->pools[at]->block_size) {
                rc = km_why(msgs[i], sizeof msgs[i], KM_ERR_INVALID_ARGUMENT,
                           "pool %s: block_size cannot change (the index is hashed with %u)",
                           pi->name, s->pools[at]->block_size);
            } else if (pi->model && !km_utf8_name(pi->model)) {
                /* As pool_create checks it: the model is a string in /status and the records. */
                rc = km_why(msgs[i], sizeof msgs[i], KM_ERR_INVALID_ARGUMENT,
                           "pool %s: model must be UTF-8 without control characters", pi->name);
            }
            if (rc == KM_OK)
                pc.policy = s->pools[at]->policy;
        } else if (at >= 0) {
            rc = km_why(msgs[i], sizeof msgs[i], KM_ERR_INVALID_ARGUMENT, "pool %s already exists",
                       pi->name);
        } else if (s->n_pools >= MAX_POOLS) {
            rc = km_why(msgs[i], sizeof msgs[i], KM_ERR_TOO_LARGE, "at most %u pools", MAX_POOLS);
        }
        if (rc == KM_OK && pi->policy && km_policy_kind_parse(pi->policy, &pc.policy.kind) != KM_OK)
            rc = km_why(msgs[i], sizeof msgs[i], KM_ERR_INVALID_ARGUMENT, "unknown policy \"%s\"",
                       pi->policy);
        for (uint32_t k = 0; rc == KM_OK && k < pi->n_params; k++)
            rc = pool_param(pm->action, &pc, &pi->params[k], msgs[i], sizeof msgs[i]);
        char detail[192];
        if (rc == KM_OK && km_policy_config_validate(&pc.policy, detail, sizeof detail) != KM_OK)
            rc = km_why(msgs[i], sizeof msgs[i], KM_ERR_INVALID_ARGUMENT, "%s", detail);
        if (rc == KM_OK && pm->action == KM_ADMIN_UPDATE) {
            s->pools[at]->policy = pc.policy;
            if (pi->model) {
                char *model = strdup(pi->model);
                if (model) {
                    free(s->pools[at]->model);
                    s->pools[at]->model = model;
                }
            }
        } else if (rc == KM_OK) {
            pc.name = pi->name;
            pc.model = pi->model;
            pc.block_size = pi->block_size;
            pool *np = NULL;
            rc = pool_create(s, &pc, &np, msgs[i], sizeof msgs[i]);
            if (rc == KM_OK)
                s->pools[s->n_pools++] = np;
        }
        if (rc == KM_OK)
            slog(s, "pool %s %s (policy %s)", pi->name,
                 pm->action == KM_ADMIN_ADD ? "added" : "updated",
                 km_policy_kind_name(pc.policy.kind));
        items[i].status = rc;
        items[i].message = rc == KM_OK ? NULL : msgs[i];
    }
    pthread_mutex_unlock(&s->admin_lock);
    if (!items || !msgs) {
        send_error(c, m->id, KM_ERR_OUT_OF_MEMORY, "pools reply");
    } else {
        reply.type = KM_MESSAGE_ACK;
        reply.ack.items = items;
        reply.ack.n_items = pm->n_pools;
        send_message(c, &reply);
    }
    free(items);
    free(msgs);
}

static bool readiness(km_server *s, char *reason, size_t reason_size);

static void handle_status(conn *c, const km_message *m)
{
    km_server *s = c->server;
    km_message reply;
    memset(&reply, 0, sizeof reply);
    reply.type = KM_MESSAGE_STATUS_REPLY;
    reply.has_id = true;
    reply.id = m->id;
    char reason[160];
    km_status_reply *st = &reply.status_reply;
    st->kvmatch_version = KVMATCH_VERSION;
    st->uptime_s = (double)(now_ns() - s->start_ns) / 1e9;
    st->ready = readiness(s, reason, sizeof reason);
    st->connections = (uint32_t)atomic_load(&s->st.open);
    st->decisions = atomic_load(&s->st.decisions);
    km_record_writer_counters rc;
    memset(&rc, 0, sizeof rc);
    if (s->records)
        km_record_writer_stats(s->records, &rc);
    st->records_dropped = rc.dropped;
    pthread_mutex_lock(&s->admin_lock);
    st->backend = s->n_pools ? km_index_backend_name(s->pools[0]->index) : NULL;
    km_worker_info *list = calloc(s->cfg.max_workers, sizeof *list);
    uint32_t n = 0;
    for (uint32_t id = 0; list && id < s->cfg.max_workers; id++)
        if (s->workers[id].used)
            worker_view(s, id, &list[n++]);
    st->workers = list;
    st->n_workers = n;
    if (list)
        send_message(c, &reply);
    else
        send_error(c, m->id, KM_ERR_OUT_OF_MEMORY, "status");
    pthread_mutex_unlock(&s->admin_lock);
    free(list);
}

/* One frame. Returns false when the connection must close (after what was queued is written). */
static bool handle_frame(conn *c, const uint8_t *payload, size_t size)
{
    km_server *s = c->server;
    atomic_fetch_add(&s->st.frames, 1);
    km_counter_add(s->m_frames, 1);
    km_message m;
    int rc = km_protocol_decode(c->decoder, payload, size, &m);
    if (rc != KM_OK) {
        atomic_fetch_add(&s->st.bad_frames, 1);
        km_counter_add(s->m_bad_frames, 1);
        if (!c->hello_done) { /* before HELLO, a frame that is not a readable HELLO ends it */
            if (m.type == KM_MESSAGE_HELLO)
                send_error(c, m.has_id ? m.id : 0, rc, "HELLO: %s",
                           km_protocol_decoder_last_error(c->decoder));
            else
                send_error(c, m.has_id ? m.id : 0, KM_ERR_PROTOCOL,
                           "the first message must be HELLO (this one is unreadable: %s)",
                           km_protocol_decoder_last_error(c->decoder));
            return false;
        }
        send_error(c, m.has_id ? m.id : 0, rc, "%s", km_protocol_decoder_last_error(c->decoder));
        return m.has_id; /* without an id the peer cannot match replies: close */
    }
    if (!c->hello_done && m.type != KM_MESSAGE_HELLO) {
        send_error(c, m.id, KM_ERR_PROTOCOL, "the first message must be HELLO, got %s",
                   km_message_type_name(m.type));
        return false;
    }
    switch (m.type) {
    case KM_MESSAGE_HELLO: {
        if (m.hello.protocol_version != KM_PROTOCOL_VERSION) {
            send_error(c, m.id, KM_ERR_INCOMPATIBLE,
                       "protocol version %u is not spoken here; this server speaks %u",
                       m.hello.protocol_version, KM_PROTOCOL_VERSION);
            return false;
        }
        c->hello_done = true;
        km_message w;
        memset(&w, 0, sizeof w);
        w.type = KM_MESSAGE_WELCOME;
        w.has_id = true;
        w.id = m.id;
        w.welcome.protocol_version = KM_PROTOCOL_VERSION;
        w.welcome.kvmatch_version = KVMATCH_VERSION;
        w.welcome.server_name = "kvmatch serve";
        w.welcome.limits = s->cfg.limits;
        send_message(c, &w);
        return true;
    }
    case KM_MESSAGE_ROUTE: handle_route(c, &m); return true;
    case KM_MESSAGE_LIFECYCLE: handle_lifecycle(c, &m); return true;
    case KM_MESSAGE_WORKERS: handle_workers(c, &m); return true;
    case KM_MESSAGE_POOLS: handle_pools(c, &m); return true;
    case KM_MESSAGE_STATUS: handle_status(c, &m); return true;
    default:
        send_error(c, m.id, KM_ERR_PROTOCOL, "%s is not a request a server answers",
                   km_message_type_name(m.type));
        return true;
    }
}

static void on_read(uv_stream_t *stream, ssize_t nread, const uv_buf_t *buf)
{
    conn *c = stream->data;
    if (c->closing)
        return;
    if (nread < 0) {
        /* EOF or a reset: answer what is in flight, then close. A partial frame is dropped. */
        uv_read_stop(stream);
        c->reading = false;
        c->eof = true;
        if (nread != UV_EOF)
            conn_close(c);
        else
            conn_close_if_finished(c);
        return;
    }
    const uint8_t *data = (const uint8_t *)buf->base;
    size_t left = (size_t)nread;
    while (left > 0 && !c->closing) {
        size_t consumed = 0;
        const uint8_t *payload = NULL;
        size_t psize = 0;
        int rc = km_frame_reader_next(c->reader, data, left, &consumed, &payload, &psize);
        if (rc != KM_OK) {
            atomic_fetch_add(&c->server->st.bad_frames, 1);
            send_error(c, 0, rc, "%s", km_frame_reader_last_error(c->reader));
            uv_read_stop(stream);
            c->reading = false;
            c->eof = true; /* no more input: the stream cannot be re-synced */
            conn_close_if_finished(c);
            return;
        }
        data += consumed;
        left -= consumed;
        if (!payload)
            continue;
        bool keep = handle_frame(c, payload, psize);
        /* Everything a request needs was copied out of the frame: an idle connection keeps
         * neither a large frame's buffer nor its decoded tree. */
        km_protocol_decoder_release(c->decoder);
        km_frame_reader_release(c->reader);
        if (!keep) {
            uv_read_stop(stream);
            c->reading = false;
            c->eof = true;
            conn_close_if_finished(c);
            return;
        }
    }
}

static void on_connection(uv_stream_t *listener, int status)
{
    km_server *s = listener->data;
    if (status < 0)
        return;
    conn *c = calloc(1, sizeof *c);
    if (!c)
        return;
    c->server = s;
    bool tcp = listener == (uv_stream_t *)&s->tcp_listener;
    int rc = tcp ? uv_tcp_init(&s->loop, &c->h.tcp) : uv_pipe_init(&s->loop, &c->h.pipe, 0);
    if (rc < 0) {
        free(c);
        return;
    }
    c->h.handle.data = c;
    if (uv_accept(listener, &c->h.stream) < 0) {
        c->closing = true;
        uv_close(&c->h.handle, on_conn_closed);
        return;
    }
    atomic_fetch_add(&s->st.accepted, 1);
    if (s->draining || atomic_load(&s->st.open) >= s->cfg.max_connections ||
        km_frame_reader_create(s->cfg.limits.max_frame_bytes, &c->reader) != KM_OK ||
        km_protocol_decoder_create(&s->cfg.limits, &c->decoder) != KM_OK) {
        atomic_fetch_add(&s->st.refused, 1);
        c->closing = true;
        uv_close(&c->h.handle, on_conn_closed);
        return;
    }
    if (tcp)
        uv_tcp_nodelay(&c->h.tcp, 1);
    km_frame_buffer_init(&c->outbox);
    km_frame_buffer_init(&c->writing);
    c->next = s->conns;
    if (s->conns)
        s->conns->prev = c;
    s->conns = c;
    atomic_fetch_add(&s->st.open, 1);
    c->reading = true;
    uv_read_start(&c->h.stream, alloc_cb, on_read);
}

/* ---- replies, stop and drain (loop thread) ---------------------------------------------------- */

static void begin_drain(km_server *s);

/* Active work whose FINISHED never came: ended (an `expired` outcome record each) on the loop
 * thread, which handles every other lifecycle report too. */
/* One slice of due active work on the loop thread, holding the scheduler role for it. True when
 * a full slice ended (more may be due); false too when the role is busy: the scheduler thread
 * expires before each of its batches. */
static bool loop_expire_slice(km_server *s)
{
    pthread_mutex_lock(&s->queue_lock);
    if (s->scheduler_busy) {
        pthread_mutex_unlock(&s->queue_lock);
        return false;
    }
    s->scheduler_busy = true;
    pthread_mutex_unlock(&s->queue_lock);
    bool more = expire_due(s, EXPIRY_SLICE);
    pthread_mutex_lock(&s->queue_lock);
    s->scheduler_busy = false;
    if (s->queue_head || s->events_pending) /* work that arrived meanwhile is the scheduler's */
        pthread_cond_signal(&s->queue_cond);
    pthread_mutex_unlock(&s->queue_lock);
    return more;
}

static void on_expiry_more(uv_idle_t *h)
{
    if (!loop_expire_slice(h->data))
        uv_idle_stop(h);
}

static void on_expiry_tick(uv_timer_t *t)
{
    km_server *s = t->data;
    if (!uv_is_active((uv_handle_t *)&s->expiry_more) && loop_expire_slice(s))
        uv_idle_start(&s->expiry_more, on_expiry_more); /* the rest, a slice per loop pass */
}

/* Encode and send the replies of a list of finished jobs, then free them (loop thread). */
static void deliver_jobs(km_server *s, job *list)
{
    while (list) {
        job *j = list;
        list = j->next;
        conn *c = j->conn;
        c->jobs_in_flight--;
        if (!c->closing) {
            if (!j->encoded)
                encode_job_reply(s, j);
            conn_send(c, &j->reply);
        }
        job_free(j);
        if (c->closing)
            conn_maybe_free(c);
        else
            conn_close_if_finished(c);
    }
}

static void deliver_done(km_server *s)
{
    pthread_mutex_lock(&s->done_lock);
    job *list = s->done_head;
    s->done_head = s->done_tail = NULL;
    pthread_mutex_unlock(&s->done_lock);
    deliver_jobs(s, list);
}

/* After the loop iteration's reads (a uv_check callback): frames queued in this iteration either
 * run here at once, when the scheduler role is free and they hold at most inline_routes routes,
 * or go to the scheduler thread with one wake-up. Inline, a lone route costs no thread hand-off
 * either way (two wake-ups fewer); bigger batches go to the scheduler, so decoding and encoding
 * on this thread overlap their scoring. */
static void on_dispatch(uv_check_t *h)
{
    km_server *s = h->data;
    if (!s->dispatch_pending)
        return;
    s->dispatch_pending = false;
    pthread_mutex_lock(&s->queue_lock);
    if (s->scheduler_busy || !s->queue_head || s->queued_routes > s->inline_routes) {
        pthread_cond_signal(&s->queue_cond);
        pthread_mutex_unlock(&s->queue_lock);
        return;
    }
    job *take = take_jobs(s);
    s->scheduler_busy = true;
    s->events_pending = false; /* housekeeping below flushes them */
    pthread_mutex_unlock(&s->queue_lock);
    housekeeping(s, &s->scratch, 0); /* active work: the expiry timer's, between passes */
    run_batch(s, take, &s->scratch);
    pthread_mutex_lock(&s->queue_lock);
    s->scheduler_busy = false;
    if (s->queue_head || s->events_pending) /* work that arrived meanwhile is the scheduler's */
        pthread_cond_signal(&s->queue_cond);
    pthread_mutex_unlock(&s->queue_lock);
    atomic_fetch_add(&s->st.inline_batches, 1);
    deliver_jobs(s, take);
}

static void on_wake(uv_async_t *h)
{
    km_server *s = h->data;
    deliver_done(s);
    if (atomic_load(&s->stop_requested) && !s->draining)
        begin_drain(s);
}

static bool drained(km_server *s)
{
    pthread_mutex_lock(&s->queue_lock);
    bool idle = !s->queue_head && !s->scheduler_busy;
    pthread_mutex_unlock(&s->queue_lock);
    if (!idle)
        return false;
    pthread_mutex_lock(&s->done_lock);
    bool none = s->done_head == NULL;
    pthread_mutex_unlock(&s->done_lock);
    if (!none)
        return false;
    for (conn *c = s->conns; c; c = c->next) {
        if (c->jobs_in_flight || c->write_in_flight || c->outbox.size)
            return false;
        /* Requests a client sent before the stop may still be in its socket or half read: they
         * are read and answered (decided, or refused as shutting down) before the connection
         * closes. Until 2026-11-30 a drain could end between two reads and close a connection
         * whose last requests were never answered. */
        if (c->closing || c->eof)
            continue;
        if (km_frame_reader_pending(c->reader) > 0)
            return false;
        uv_os_fd_t fd;
        int unread = 0;
        if (c->reading && uv_fileno(&c->h.handle, &fd) == 0 && ioctl(fd, FIONREAD, &unread) == 0 &&
            unread > 0)
            return false;
    }
    return true;
}

static void close_everything(km_server *s)
{
    while (s->conns)
        conn_close(s->conns);
    if (!uv_is_closing((uv_handle_t *)&s->wake))
        uv_close((uv_handle_t *)&s->wake, NULL);
    if (s->dispatch_inited && !uv_is_closing((uv_handle_t *)&s->dispatch))
        uv_close((uv_handle_t *)&s->dispatch, NULL);
    if (s->expiry_timer_inited && !uv_is_closing((uv_handle_t *)&s->expiry_timer)) {
        uv_close((uv_handle_t *)&s->expiry_timer, NULL);
        uv_close((uv_handle_t *)&s->expiry_more, NULL);
    }
    if (s->drain_timer_started && !uv_is_closing((uv_handle_t *)&s->drain_timer))
        uv_close((uv_handle_t *)&s->drain_timer, NULL);
    if (s->signals_installed) {
        uv_close((uv_handle_t *)&s->sigterm, NULL);
        uv_close((uv_handle_t *)&s->sigint, NULL);
        s->signals_installed = false;
    }
}

/* The drain timed out: routes still queued are dropped unanswered (their connections close now;
 * deciding them would only begin active work and write decision records for replies nobody can
 * read). Returns how many. A batch being scored ends normally, and km_server_run delivers it
 * (freeing its closed connection) after joining the scheduler. */
static uint64_t drop_queued(km_server *s)
{
    pthread_mutex_lock(&s->queue_lock);
    job *list = s->queue_head;
    s->queue_head = s->queue_tail = NULL;
    uint64_t routes = s->queued_routes;
    s->queued_routes = 0;
    pthread_mutex_unlock(&s->queue_lock);
    while (list) {
        job *j = list;
        list = j->next;
        j->conn->jobs_in_flight--;
        job_free(j);
    }
    return routes;
}

static void on_drain_tick(uv_timer_t *t)
{
    km_server *s = t->data;
    deliver_done(s);
    if (drained(s) || now_ns() >= s->drain_deadline_ns) {
        if (!drained(s)) {
            uint64_t dropped = drop_queued(s);
            atomic_fetch_add(&s->st.dropped_at_shutdown, dropped);
            slog(s, "drain timeout: closing with work unfinished (%" PRIu64 " queued routes dropped "
                 "unanswered; a batch being scored ends first)", dropped);
        }
        uv_timer_stop(t);
        close_everything(s);
    }
}

static void begin_drain(km_server *s)
{
    if (s->draining)
        return;
    s->draining = true;
    slog(s, "stopping: no new connections or routes; finishing queued decisions");
    if (s->have_unix && !uv_is_closing((uv_handle_t *)&s->unix_listener))
        uv_close((uv_handle_t *)&s->unix_listener, NULL);
    if (s->have_tcp && !uv_is_closing((uv_handle_t *)&s->tcp_listener))
        uv_close((uv_handle_t *)&s->tcp_listener, NULL);
    s->drain_deadline_ns = now_ns() + (uint64_t)s->cfg.drain_timeout_ms * 1000000u;
    uv_timer_init(&s->loop, &s->drain_timer);
    s->drain_timer.data = s;
    s->drain_timer_started = true;
    uv_timer_start(&s->drain_timer, on_drain_tick, 0, 5);
}

static void on_signal(uv_signal_t *h, int signum)
{
    km_server *s = h->data;
    slog(s, "%s received", signum == SIGTERM ? "SIGTERM" : "SIGINT");
    atomic_store(&s->stop_requested, true);
    begin_drain(s);
}

void km_server_stop(km_server *server)
{
    if (!server)
        return;
    atomic_store(&server->stop_requested, true);
    uv_async_send(&server->wake);
}

/* ---- HTTP: readiness, status, metrics --------------------------------------------------------- */

static bool readiness(km_server *s, char *reason, size_t reason_size)
{
    uint32_t events = 0, live = 0, approx = 0;
    pthread_mutex_lock(&s->admin_lock);
    for (uint32_t id = 0; id < s->cfg.max_workers; id++) {
        worker_slot *w = &s->workers[id];
        if (!w->used)
            continue;
        if (!w->events) {
            approx++;
            continue;
        }
        events++;
        km_feed_worker_info info;
        if (feed_info(s, id, &info) == KM_OK && info.state == KM_FEED_STATE_LIVE)
            live++;
    }
    pthread_mutex_unlock(&s->admin_lock);
    bool ready = !s->draining && (events == 0 || (double)live >= s->cfg.ready_share * events - 1e-9);
    snprintf(reason, reason_size, "%s%u/%u event-fed workers LIVE (need %.0f%%), %u approximate",
             s->draining ? "shutting down; " : "", live, events, s->cfg.ready_share * 100.0, approx);
    return ready;
}

static bool http_readiness(void *user, km_text *reason)
{
    char buf[200];
    bool ready = readiness(user, buf, sizeof buf);
    km_text_append_cstr(reason, buf);
    return ready;
}

static int http_status(void *user, km_text *out)
{
    km_server *s = user;
    json_t *root = json_object();
    char reason[200];
    bool ready = readiness(s, reason, sizeof reason);
    json_object_set_new(root, "kvmatch_version", json_string(KVMATCH_VERSION));
    json_object_set_new(root, "uptime_s", json_real((double)(now_ns() - s->start_ns) / 1e9));
    json_object_set_new(root, "ready", json_boolean(ready));
    json_object_set_new(root, "ready_reason", json_string(reason));
    json_object_set_new(root, "connections", json_integer((json_int_t)atomic_load(&s->st.open)));
    json_object_set_new(root, "decisions", json_integer((json_int_t)atomic_load(&s->st.decisions)));
    json_t *workers = json_array();
    pthread_mutex_lock(&s->admin_lock);
    json_t *pools = json_array();
    for (uint32_t i = 0; i < s->n_pools; i++) {
        pool *p = s->pools[i];
        json_t *jp = json_object();
        json_object_set_new(jp, "name", json_string(p->name));
        json_object_set_new(jp, "model", p->model ? json_string(p->model) : json_null());
        json_object_set_new(jp, "block_size", json_integer(p->block_size));
        json_object_set_new(jp, "policy", json_string(km_policy_kind_name(p->policy.kind)));
        json_object_set_new(jp, "backend", json_string(km_index_backend_name(p->index)));
        km_index_stats is;
        if (km_index_get_stats(p->index, &is) == KM_OK) {
            json_object_set_new(jp, "blocks", json_integer((json_int_t)is.blocks));
            json_object_set_new(jp, "pairs", json_integer((json_int_t)is.pairs));
            json_object_set_new(jp, "memory_bytes", json_integer((json_int_t)is.memory_bytes));
            json_object_set_new(jp, "block_capacity", json_integer((json_int_t)is.block_capacity));
            json_object_set_new(jp, "table_growths", json_integer((json_int_t)is.table_growths));
            json_object_set_new(jp, "table_growth_ms_max", json_real(is.table_growth_ms_max));
            json_object_set_new(jp, "host_scored_batches",
                                json_integer((json_int_t)is.host_scored_batches));
        }
        json_array_append_new(pools, jp);
    }
    uint64_t now = now_ns();
    for (uint32_t id = 0; id < s->cfg.max_workers; id++) {
        worker_slot *w = &s->workers[id];
        if (!w->used)
            continue;
        pool *p = s->pools[w->pool];
        json_t *jw = json_object();
        json_object_set_new(jw, "id", json_integer(id));
        json_object_set_new(jw, "name", json_string(w->name));
        json_object_set_new(jw, "pool", json_string(p->name));
        json_object_set_new(jw, "mode", json_string(w->events ? "events" : "approx"));
        json_object_set_new(jw, "dp_rank", w->has_dp_rank ? json_integer(w->dp_rank) : json_null());
        pthread_mutex_lock(&s->active_lock);
        json_object_set_new(jw, "healthy", json_boolean(!w->unhealthy));
        json_object_set_new(jw, "breaker", json_string(breaker_state_name(worker_breaker(w, now))));
        json_object_set_new(jw, "failures", json_integer(w->failures));
        json_object_set_new(jw, "eligible", json_boolean(worker_eligibility(s, id, now) == ELIGIBLE));
        pthread_mutex_unlock(&s->active_lock);
        km_worker_stats ws;
        if (km_index_worker_stats(p->index, id, &ws) == KM_OK)
            json_object_set_new(jw, "blocks", json_integer((json_int_t)ws.blocks));
        km_feed_worker_info info;
        if (w->events && feed_info(s, id, &info) == KM_OK) {
            json_object_set_new(jw, "state", json_string(km_feed_state_name(info.state)));
            json_object_set_new(jw, "expected_seq", info.has_expected_seq
                                                        ? json_integer((json_int_t)info.expected_seq)
                                                        : json_null());
            json_object_set_new(jw, "last_event_age_s",
                                info.has_last_receive
                                    ? json_real((double)(now - info.last_receive_ns) / 1e9)
                                    : json_null());
            json_object_set_new(jw, "gaps", json_integer((json_int_t)info.counters.gaps));
            json_object_set_new(jw, "replayed", json_integer((json_int_t)info.counters.replayed));
            json_object_set_new(jw, "lost", json_integer((json_int_t)info.counters.lost));
            json_object_set_new(jw, "restarts", json_integer((json_int_t)info.counters.restarts));
            km_feed_window win[16];
            uint32_t nw = 0;
            json_t *jwin = json_array();
            if (feed_windows(s, id, win, 16, &nw) == KM_OK)
                for (uint32_t k = 0; k < nw && k < 16; k++) {
                    json_t *o = json_object();
                    json_object_set_new(o, "cause", json_string(km_feed_window_cause_name(win[k].cause)));
                    json_object_set_new(o, "end", json_string(km_feed_window_end_name(win[k].end)));
                    json_object_set_new(o, "start_age_s", json_real((double)(now - win[k].start_ns) / 1e9));
                    json_object_set_new(o, "duration_s",
                                        win[k].end_ns ? json_real((double)win[k].duration_ns / 1e9)
                                                      : json_null());
                    json_object_set_new(o, "lost", json_integer((json_int_t)win[k].lost));
                    json_array_append_new(jwin, o);
                }
            json_object_set_new(jw, "recovery_windows", jwin);
        } else {
            json_object_set_new(jw, "state", json_string(w->events ? "UNKNOWN" : "APPROX"));
        }
        json_array_append_new(workers, jw);
    }
    pthread_mutex_unlock(&s->admin_lock);
    json_object_set_new(root, "pools", pools);
    json_object_set_new(root, "workers", workers);
    char *text = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    if (!text) {
        km_text_append_cstr(out, "out of memory building the status");
        return KM_ERR_OUT_OF_MEMORY;
    }
    km_text_append_cstr(out, text);
    free(text);
    return KM_OK;
}

static int http_metrics(void *user, km_text *out)
{
    km_server *s = user;
    km_prom_write_family(out, "kvmatch_worker_blocks", "Blocks the index holds per worker.",
                         KM_METRIC_GAUGE);
    pthread_mutex_lock(&s->admin_lock);
    uint32_t degraded = 0, ineligible = 0;
    uint64_t gaps = 0, replayed = 0, restarts = 0, lost = 0, events = 0, now = now_ns();
    for (uint32_t id = 0; id < s->cfg.max_workers; id++) {
        worker_slot *w = &s->workers[id];
        if (!w->used)
            continue;
        pool *p = s->pools[w->pool];
        km_worker_stats ws;
        char ids[16];
        snprintf(ids, sizeof ids, "%u", id);
        const char *state = worker_state(s, id);
        km_metric_label labels[4] = {{"worker", ids}, {"name", w->name}, {"pool", p->name},
                                     {"state", state}};
        if (km_index_worker_stats(p->index, id, &ws) == KM_OK)
            km_prom_write_sample_u64(out, "kvmatch_worker_blocks", labels, 4, ws.blocks);
        pthread_mutex_lock(&s->active_lock);
        ineligible += worker_eligibility(s, id, now) != ELIGIBLE;
        pthread_mutex_unlock(&s->active_lock);
        km_feed_worker_info info;
        if (w->events && feed_info(s, id, &info) == KM_OK) {
            degraded += info.state == KM_FEED_STATE_DEGRADED;
            gaps += info.counters.gaps;
            replayed += info.counters.replayed;
            restarts += info.counters.restarts;
            lost += info.counters.lost;
            events += info.counters.events;
        }
    }
    pthread_mutex_unlock(&s->admin_lock);
    struct {
        const char *name, *help;
        km_metric_type type;
        uint64_t v;
    } rows[] = {
        {"kvmatch_degraded_workers", "Event-fed workers whose history was lost.", KM_METRIC_GAUGE,
         degraded},
        {"kvmatch_ineligible_workers",
         "Workers a route cannot choose now: unhealthy by the router's word or held back by their "
         "circuit breaker.",
         KM_METRIC_GAUGE, ineligible},
        {"kvmatch_kv_events_total", "KV events applied, all workers.", KM_METRIC_COUNTER, events},
        {"kvmatch_event_gaps_total", "Sequence gaps detected.", KM_METRIC_COUNTER, gaps},
        {"kvmatch_event_replayed_total", "Messages applied from replays.", KM_METRIC_COUNTER,
         replayed},
        {"kvmatch_event_lost_total", "Sequence numbers lost for good.", KM_METRIC_COUNTER, lost},
        {"kvmatch_engine_restarts_total", "Engine restarts detected.", KM_METRIC_COUNTER, restarts},
        {"kvmatch_connections", "Router connections open.", KM_METRIC_GAUGE,
         atomic_load(&s->st.open)},
        {"kvmatch_lifecycle_errors_total", "Lifecycle reports answered with an error.",
         KM_METRIC_COUNTER, atomic_load(&s->st.lifecycle_errors)},
        {"kvmatch_approx_dispatch_learned_total",
         "Router overrides to an approximate-mode worker that taught it the request's blocks.",
         KM_METRIC_COUNTER, atomic_load(&s->st.dispatch_learned)},
        {"kvmatch_approx_dispatch_unlearned_total",
         "Router overrides to an approximate-mode worker that could not teach it "
         "(approx_dispatch_max_bytes).",
         KM_METRIC_COUNTER, atomic_load(&s->st.dispatch_unlearned)},
        {"kvmatch_breaker_opened_total",
         "Circuit breakers opened or reopened by failed attempts (breaker_failures).",
         KM_METRIC_COUNTER, atomic_load(&s->st.breaker_opened)},
        {"kvmatch_no_healthy_worker_total",
         "Routes refused because no candidate was eligible (unhealthy or breaker open).",
         KM_METRIC_COUNTER, atomic_load(&s->st.no_healthy)},
    };
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        km_prom_write_family(out, rows[i].name, rows[i].help, rows[i].type);
        km_prom_write_sample_u64(out, rows[i].name, NULL, 0, rows[i].v);
    }
    km_record_writer_counters rc;
    memset(&rc, 0, sizeof rc);
    if (s->records)
        km_record_writer_stats(s->records, &rc);
    /* Every writer counter (docs/RECORDS.md): dropped, failed and invalid records are the ones
     * an analyzer will not find. */
    struct {
        const char *name, *help;
        km_metric_type type;
        uint64_t v;
    } records[] = {
        {"kvmatch_records_submitted_total", "Records the writer took into its queue.",
         KM_METRIC_COUNTER, rc.submitted},
        {"kvmatch_records_dropped_total", "Records the writer could not take (queue full).",
         KM_METRIC_COUNTER, rc.dropped},
        {"kvmatch_records_written_total", "Records written to the records file.",
         KM_METRIC_COUNTER, rc.written},
        {"kvmatch_records_failed_total",
         "Records lost to an I/O error (full disk, unwritable or missing directory).",
         KM_METRIC_COUNTER, rc.failed},
        {"kvmatch_records_invalid_total", "Records that did not format (a bad field).",
         KM_METRIC_COUNTER, rc.invalid},
        {"kvmatch_records_pending", "Records taken, not yet written, failed or invalid.",
         KM_METRIC_GAUGE, rc.pending},
        {"kvmatch_records_bytes_total", "Bytes written to the records files.", KM_METRIC_COUNTER,
         rc.bytes},
        {"kvmatch_records_rotations_total", "Records files rotated.", KM_METRIC_COUNTER,
         rc.rotations},
        {"kvmatch_records_write_errors_total",
         "Failed system calls of the records writer (open, write, fdatasync, rename).",
         KM_METRIC_COUNTER, rc.write_errors},
    };
    for (size_t i = 0; i < sizeof records / sizeof records[0]; i++) {
        km_prom_write_family(out, records[i].name, records[i].help, records[i].type);
        km_prom_write_sample_u64(out, records[i].name, NULL, 0, records[i].v);
    }
    return out->status;
}

/* ---- create / run / destroy ------------------------------------------------------------------- */

static int parse_host_port(const char *text, char *host, size_t host_size, int *port)
{
    const char *colon = strrchr(text, ':');
    if (!colon || colon == text)
        return KM_ERR_INVALID_ARGUMENT;
    size_t hl = (size_t)(colon - text);
    const char *h = text;
    if (h[0] == '[' && hl >= 2 && h[hl - 1] == ']') {
        h++;
        hl -= 2;
    }
    if (hl == 0 || hl >= host_size)
        return KM_ERR_INVALID_ARGUMENT;
    memcpy(host, h, hl);
    host[hl] = '\0';
    char *end;
    long p = strtol(colon + 1, &end, 10);
    if (*end || p < 0 || p > 65535 || end == colon + 1)
        return KM_ERR_INVALID_ARGUMENT;
    *port = (int)p;
    return KM_OK;
}

/* Does something accept connections on this Unix socket path? */
static bool unix_socket_answers(const char *path)
{
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return false;
    struct sockaddr_un sa;
    memset(&sa, 0, sizeof sa);
    sa.sun_family = AF_UNIX;
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", path);
    bool answers = connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0;
    close(fd);
    return answers;
}

static bool loopback_host(const char *h)
{
    return !strcmp(h, "127.0.0.1") || !strcmp(h, "::1") || !strcmp(h, "localhost") ||
           !strncmp(h, "127.", 4);
}

void km_server_destroy(km_server *s)
{
    if (!s)
        return;
    if (s->scheduler_started) {
        pthread_mutex_lock(&s->queue_lock);
        s->scheduler_stop = true;
        pthread_cond_signal(&s->queue_cond);
        pthread_mutex_unlock(&s->queue_lock);
        pthread_join(s->scheduler, NULL);
    }
    km_http_stop(s->http);
    if (s->dispatch_inited && !uv_is_closing((uv_handle_t *)&s->dispatch))
        uv_close((uv_handle_t *)&s->dispatch, NULL); /* unreferenced: close it explicitly */
    if (s->expiry_timer_inited && !uv_is_closing((uv_handle_t *)&s->expiry_timer)) {
        uv_close((uv_handle_t *)&s->expiry_timer, NULL);
        uv_close((uv_handle_t *)&s->expiry_more, NULL);
    }
    /* Handles still open (destroy without run): close them and let the loop finish. */
    if (uv_loop_alive(&s->loop)) {
        while (s->conns)
            conn_close(s->conns);
        if (s->have_unix && !uv_is_closing((uv_handle_t *)&s->unix_listener))
            uv_close((uv_handle_t *)&s->unix_listener, NULL);
        if (s->have_tcp && !uv_is_closing((uv_handle_t *)&s->tcp_listener))
            uv_close((uv_handle_t *)&s->tcp_listener, NULL);
        if (!uv_is_closing((uv_handle_t *)&s->wake))
            uv_close((uv_handle_t *)&s->wake, NULL);
        if (s->signals_installed) {
            uv_close((uv_handle_t *)&s->sigterm, NULL);
            uv_close((uv_handle_t *)&s->sigint, NULL);
        }
        uv_run(&s->loop, UV_RUN_DEFAULT);
    }
    uv_loop_close(&s->loop);
    for (job *j = s->queue_head; j;) {
        job *n = j->next;
        job_free(j);
        j = n;
    }
    for (job *j = s->done_head; j;) {
        job *n = j->next;
        job_free(j);
        j = n;
    }
    for (uint32_t i = 0; i < s->n_pools; i++)
        pool_destroy(s->pools[i]);
    free(s->pools);
    if (s->workers)
        for (uint32_t i = 0; i < s->cfg.max_workers; i++) {
            free(s->workers[i].event_endpoint);
            free(s->workers[i].replay_endpoint);
        }
    free(s->workers);
    uint64_t cursor = 0;
    for (km_u64map_entry *e; (e = km_u64map_next(&s->attempts_by_decision, &cursor));)
        attempt_free(&s->attempt_cache, (attempt *)(uintptr_t)e->value);
    attempt_cache_free(&s->attempt_cache);
    while (s->lessons) {
        dispatch_lesson *l = s->lessons;
        s->lessons = l->next;
        free(l);
    }
    km_u64map_free(&s->attempts_by_decision);
    km_active_destroy(s->active);
    scratch_free(&s->scratch);
    if (s->records) {
        km_record_writer_flush(s->records, 5000);
        km_record_writer_destroy(s->records);
    }
    km_metrics_destroy(s->metrics);
    if (s->own_socket_file)
        unlink(s->socket_path);
    pthread_mutex_destroy(&s->queue_lock);
    pthread_cond_destroy(&s->queue_cond);
    pthread_mutex_destroy(&s->done_lock);
    pthread_mutex_destroy(&s->admin_lock);
    pthread_mutex_destroy(&s->active_lock);
    free(s->socket_path);
    free(s->tcp);
    free(s->http_addr);
    free(s->records_path);
    free(s->snapshot_dir);
    free(s->default_pool);
    free(s);
}

static int dup_opt(const char *in, char **out)
{
    *out = NULL;
    if (!in)
        return KM_OK;
    *out = strdup(in);
    return *out ? KM_OK : KM_ERR_OUT_OF_MEMORY;
}

static int setup_metrics(km_server *s)
{
    int rc = km_metrics_create(&s->metrics);
    size_t nb, nl;
    const double *bb = km_metrics_batch_size_buckets(&nb);
    const double *lb = km_metrics_latency_buckets_seconds(&nl);
    if (!rc)
        rc = km_metrics_add_counter(s->metrics, "kvmatch_decisions_total", "Routes decided.", NULL, 0,
                                    &s->m_decisions);
    if (!rc)
        rc = km_metrics_add_counter(s->metrics, "kvmatch_route_errors_total",
                                    "Routes answered with an error.", NULL, 0, &s->m_route_errors);
    if (!rc)
        rc = km_metrics_add_counter(s->metrics, "kvmatch_frames_total", "Frames received.", NULL, 0,
                                    &s->m_frames);
    if (!rc)
        rc = km_metrics_add_counter(s->metrics, "kvmatch_bad_frames_total",
                                    "Frames that failed to decode.", NULL, 0, &s->m_bad_frames);
    if (!rc)
        rc = km_metrics_add_counter(s->metrics, "kvmatch_lifecycle_events_total",
                                    "DISPATCHED / FIRST_TOKEN / FINISHED reports.", NULL, 0,
                                    &s->m_lifecycle);
    if (!rc)
        rc = km_metrics_add_counter(s->metrics, "kvmatch_outcomes_total",
                                    "Outcome records (FINISHED and expiries).", NULL, 0, &s->m_outcomes);
    if (!rc)
        rc = km_metrics_add_counter(s->metrics, "kvmatch_active_expired_total",
                                    "Active work that expired without FINISHED.", NULL, 0,
                                    &s->m_expired);
    if (!rc)
        rc = km_metrics_add_counter(s->metrics, "kvmatch_active_evicted_total",
                                    "Active work ended early to make room (max_active_entries).",
                                    NULL, 0, &s->m_evicted);
    if (!rc)
        rc = km_metrics_add_counter(s->metrics, "kvmatch_overloaded_total",
                                    "ROUTE frames refused: queue full.", NULL, 0, &s->m_overloaded);
    if (!rc)
        rc = km_metrics_add_histogram(s->metrics, "kvmatch_batch_routes", "Routes per scoring batch.",
                                      NULL, 0, bb, nb, &s->m_batch_routes);
    if (!rc)
        rc = km_metrics_add_histogram(s->metrics, "kvmatch_batch_seconds",
                                      "Time to score and decide one batch.", NULL, 0, lb, nl,
                                      &s->m_batch_seconds);
    if (!rc)
        rc = km_metrics_add_histogram(s->metrics, "kvmatch_queue_wait_seconds",
                                      "Time a ROUTE frame waited for its batch.", NULL, 0, lb, nl,
                                      &s->m_queue_seconds);
    return rc;
}

int km_server_create(const km_server_config *cfg_in, km_server **out, char *why, size_t why_size)
{
    if (!cfg_in || !out)
        return km_why(why, why_size, KM_ERR_NULL_POINTER, "config or out is NULL");
    *out = NULL;
    km_server_config cfg = *cfg_in;
    if (!cfg.socket_path && !cfg.tcp)
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT, "neither a socket path nor tcp");
    if (cfg.max_workers == 0 || cfg.max_workers > KM_MAX_WORKERS_LIMIT || cfg.max_batch_routes == 0 ||
        cfg.max_queued_routes == 0 || cfg.max_connections == 0 || cfg.max_outbox_bytes < 4096 ||
        cfg.active_ttl_ms == 0 || cfg.active_ttl_ms > UINT64_MAX / 1000000 || /* in ns */
        !(cfg.ready_share >= 0 && cfg.ready_share <= 1))
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                     "max_workers, max_batch_routes, max_queued_routes, max_connections, "
                     "max_outbox_bytes (>= 4096), active_ttl_ms or ready_share out of range");
    /* The cooldown is added to a time in ns (breaker_outcome): bounded as the JSON config and the
     * CLI bound it, so the product cannot wrap to a short cooldown. */
    if (cfg.breaker_failures &&
        (cfg.breaker_cooldown_ms == 0 || cfg.breaker_cooldown_ms > UINT64_MAX / 1000000))
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                     "breaker_cooldown_ms %" PRIu64 " is out of 1..%" PRIu64 " (in ns it must fit "
                     "64 bits)", cfg.breaker_cooldown_ms, UINT64_MAX / 1000000);
    if (cfg.n_pools > MAX_POOLS)
        return km_why(why, why_size, KM_ERR_TOO_LARGE, "%u pools; at most %u", cfg.n_pools, MAX_POOLS);
    km_server *s = calloc(1, sizeof *s);
    if (!s)
        return km_why(why, why_size, KM_ERR_OUT_OF_MEMORY, "server");
    s->cfg = cfg;
    s->log = cfg.log;
    s->log_user = cfg.log_user;
    s->start_ns = now_ns();
    atomic_init(&s->next_decision_id, 1);
    atomic_init(&s->next_record_id, 1);
    pthread_mutex_init(&s->queue_lock, NULL);
    pthread_cond_init(&s->queue_cond, NULL);
    pthread_mutex_init(&s->done_lock, NULL);
    pthread_mutex_init(&s->admin_lock, NULL);
    pthread_mutex_init(&s->active_lock, NULL);
    km_u64map_init(&s->attempts_by_decision, &s->attempts_memory);
    uv_loop_init(&s->loop);
    int rc = KM_OK;
    if (dup_opt(cfg.socket_path, &s->socket_path) || dup_opt(cfg.tcp, &s->tcp) ||
        dup_opt(cfg.http, &s->http_addr) || dup_opt(cfg.records_path, &s->records_path) ||
        dup_opt(cfg.snapshot_dir, &s->snapshot_dir) || dup_opt(cfg.default_pool, &s->default_pool))
        rc = km_why(why, why_size, KM_ERR_OUT_OF_MEMORY, "config strings");
    s->cfg.pools = NULL;
    s->cfg.n_pools = 0;
    if (!rc && !(s->pools = calloc(MAX_POOLS, sizeof *s->pools)))
        rc = km_why(why, why_size, KM_ERR_OUT_OF_MEMORY, "pools");
    if (!rc && !(s->workers = calloc(cfg.max_workers, sizeof *s->workers)))
        rc = km_why(why, why_size, KM_ERR_OUT_OF_MEMORY, "workers");
    if (!rc) {
        gethostname(s->host, sizeof s->host - 1);
        km_record_instance_id(s->instance);
        km_active_config ac;
        km_active_config_init(&ac);
        ac.max_workers = cfg.max_workers;
        ac.ttl_ns = cfg.active_ttl_ms * UINT64_C(1000000);
        ac.max_entries = cfg.max_active_entries;
        if ((rc = km_active_create(&ac, &s->active)) != KM_OK)
            km_why(why, why_size, rc, "active work: %s", km_strerror(rc));
    }
    if (!rc && (rc = setup_metrics(s)) != KM_OK)
        km_why(why, why_size, rc, "metrics: %s", km_strerror(rc));
    if (!rc && s->snapshot_dir) {
        struct stat st;
        if (stat(s->snapshot_dir, &st) != 0 && mkdir(s->snapshot_dir, 0755) != 0)
            rc = km_why(why, why_size, KM_ERR_IO, "snapshot dir %s: %s", s->snapshot_dir,
                       strerror(errno));
    }
    for (uint32_t i = 0; !rc && i < cfg.n_pools; i++) {
        const km_server_pool *pc = &cfg.pools[i];
        if (pool_find(s, pc->name ? pc->name : "") >= 0) {
            rc = km_why(why, why_size, KM_ERR_INVALID_ARGUMENT, "pool %s is listed twice", pc->name);
            break;
        }
        pool *p = NULL;
        if ((rc = pool_create(s, pc, &p, why, why_size)) != KM_OK)
            break;
        s->pools[s->n_pools++] = p;
        for (uint32_t k = 0; !rc && k < pc->n_workers; k++)
            rc = worker_add(s, s->n_pools - 1, &pc->workers[k], why, why_size);
    }
    if (!rc && s->default_pool && pool_find(s, s->default_pool) < 0)
        rc = km_why(why, why_size, KM_ERR_INVALID_ARGUMENT, "default_pool %s is not a pool",
                   s->default_pool);
    if (!rc && s->records_path) {
        km_record_writer_config wc;
        km_record_writer_config_init(&wc);
        wc.path = s->records_path;
        if (cfg.records_max_file_bytes)
            wc.max_file_bytes = cfg.records_max_file_bytes;
        wc.log = s->log;
        wc.log_user = s->log_user;
        if ((rc = km_record_writer_create(&wc, &s->records)) != KM_OK)
            km_why(why, why_size, rc, "records %s: %s", s->records_path, km_strerror(rc));
    }
    /* Listeners. */
    if (!rc && s->socket_path) {
        uv_pipe_init(&s->loop, &s->unix_listener, 0);
        s->unix_listener.data = s;
        s->have_unix = true;
        /* A socket file left by a crashed run is replaced; one a live server answers on is not. */
        struct stat st;
        if (stat(s->socket_path, &st) == 0 && S_ISSOCK(st.st_mode)) {
            if (unix_socket_answers(s->socket_path))
                rc = km_why(why, why_size, KM_ERR_IO, "socket %s: another server is listening on it",
                           s->socket_path);
            else
                unlink(s->socket_path);
        }
        int e = rc ? 0 : uv_pipe_bind(&s->unix_listener, s->socket_path);
        if (!e && !rc)
            e = uv_listen((uv_stream_t *)&s->unix_listener, 511, on_connection);
        if (rc) {
            /* reported above */
        } else if (e) {
            rc = km_why(why, why_size, KM_ERR_IO, "socket %s: %s", s->socket_path, uv_strerror(e));
        } else {
            s->own_socket_file = true;
            chmod(s->socket_path, 0660);
        }
    }
    if (!rc && s->tcp) {
        char host[128];
        int port;
        struct sockaddr_storage sa;
        if (parse_host_port(s->tcp, host, sizeof host, &port) != KM_OK) {
            rc = km_why(why, why_size, KM_ERR_INVALID_ARGUMENT, "tcp \"%s\" is not HOST:PORT", s->tcp);
        } else if (!cfg.allow_non_loopback && !loopback_host(host)) {
            rc = km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                       "tcp %s is not a loopback address (allow_non_loopback to permit it)", s->tcp);
        } else {
            if (!strcmp(host, "localhost"))
                snprintf(host, sizeof host, "127.0.0.1");
            int e = strchr(host, ':') ? uv_ip6_addr(host, port, (struct sockaddr_in6 *)&sa)
                                      : uv_ip4_addr(host, port, (struct sockaddr_in *)&sa);
            uv_tcp_init(&s->loop, &s->tcp_listener);
            s->tcp_listener.data = s;
            s->have_tcp = true;
            if (!e)
                e = uv_tcp_bind(&s->tcp_listener, (struct sockaddr *)&sa, 0);
            if (!e)
                e = uv_listen((uv_stream_t *)&s->tcp_listener, 511, on_connection);
            if (e)
                rc = km_why(why, why_size, KM_ERR_IO, "tcp %s: %s", s->tcp, uv_strerror(e));
            else {
                struct sockaddr_storage bound;
                int len = sizeof bound;
                uv_tcp_getsockname(&s->tcp_listener, (struct sockaddr *)&bound, &len);
                s->tcp_port = ntohs(bound.ss_family == AF_INET6
                                        ? ((struct sockaddr_in6 *)&bound)->sin6_port
                                        : ((struct sockaddr_in *)&bound)->sin_port);
            }
        }
    }
    if (!rc) {
        uv_async_init(&s->loop, &s->wake, on_wake);
        s->wake.data = s;
        uv_check_init(&s->loop, &s->dispatch);
        s->dispatch.data = s;
        uv_check_start(&s->dispatch, on_dispatch);
        uv_unref((uv_handle_t *)&s->dispatch); /* it alone does not keep the loop running */
        s->dispatch_inited = true;
        uv_timer_init(&s->loop, &s->expiry_timer);
        s->expiry_timer.data = s;
        uv_timer_start(&s->expiry_timer, on_expiry_tick, EXPIRY_TICK_MS, EXPIRY_TICK_MS);
        uv_unref((uv_handle_t *)&s->expiry_timer);
        uv_idle_init(&s->loop, &s->expiry_more);
        s->expiry_more.data = s;
        uv_unref((uv_handle_t *)&s->expiry_more); /* neither keeps the loop running */
        s->expiry_timer_inited = true;
    }
    if (!rc && s->http_addr) {
        char host[128];
        int port;
        if (parse_host_port(s->http_addr, host, sizeof host, &port) != KM_OK) {
            rc = km_why(why, why_size, KM_ERR_INVALID_ARGUMENT, "http \"%s\" is not HOST:PORT",
                       s->http_addr);
        } else {
            km_http_config hc;
            km_http_config_init(&hc);
            hc.bind_address = host;
            hc.port = (uint16_t)port;
            hc.allow_non_loopback = cfg.allow_non_loopback;
            hc.metrics = s->metrics;
            hc.callbacks.user = s;
            hc.callbacks.readiness = http_readiness;
            hc.callbacks.status_json = http_status;
            hc.callbacks.append_metrics = http_metrics;
            hc.log = s->log;
            hc.log_user = s->log_user;
            char herr[200];
            if ((rc = km_http_start(&hc, &s->http, herr, sizeof herr)) != KM_OK)
                km_why(why, why_size, rc, "http %s: %s", s->http_addr, herr);
            else
                s->http_port = km_http_port(s->http);
        }
    }
    if (!rc) {
        km_approx_updates_init(&s->scratch.updates);
        s->scratch.seen = calloc(cfg.max_workers, sizeof *s->scratch.seen);
        if (!s->scratch.seen)
            rc = km_why(why, why_size, KM_ERR_OUT_OF_MEMORY, "scheduler scratch");
    }
    if (!rc) {
        s->inline_routes = cfg.inline_routes < cfg.max_batch_routes ? cfg.inline_routes
                                                                   : cfg.max_batch_routes;
        if (pthread_create(&s->scheduler, NULL, scheduler_main, s) != 0)
            rc = km_why(why, why_size, KM_ERR_INTERNAL, "starting the scheduler thread");
        else {
            pthread_setname_np(s->scheduler, "km-scheduler"); /* for top -H, perf, bench ipc */
            s->scheduler_started = true;
        }
    }
    if (rc) {
        km_server_destroy(s);
        return rc;
    }
    *out = s;
    return KM_OK;
}

int km_server_run(km_server *s, bool install_signals)
{
    if (!s)
        return KM_ERR_NULL_POINTER;
    if (install_signals) {
        uv_signal_init(&s->loop, &s->sigterm);
        uv_signal_init(&s->loop, &s->sigint);
        s->sigterm.data = s->sigint.data = s;
        uv_signal_start(&s->sigterm, on_signal, SIGTERM);
        uv_signal_start(&s->sigint, on_signal, SIGINT);
        s->signals_installed = true;
        signal(SIGPIPE, SIG_IGN);
    }
    slog(s, "serving on %s%s%s%s%s (%u pools)", s->socket_path ? s->socket_path : "",
         s->socket_path && s->tcp ? " and " : "", s->tcp ? "tcp " : "", s->tcp ? s->tcp : "",
         s->http_addr ? ", http on" : "", s->n_pools);
    /* A peer that closes while its replies are written makes write() raise SIGPIPE, which ends
     * the process unless it is ignored: a program embedding the server (install_signals false)
     * need not ignore it. The signal is directed at the writing thread, this one, so blocking it
     * here turns it into EPIPE (the connection closes); the ones raised meanwhile are discarded
     * before the caller's mask is restored. */
    sigset_t pipe_only, caller_mask;
    sigemptyset(&pipe_only);
    sigaddset(&pipe_only, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_only, &caller_mask);
    if (atomic_load(&s->stop_requested))
        begin_drain(s);
    uv_run(&s->loop, UV_RUN_DEFAULT);
    struct timespec no_wait = {0, 0};
    while (sigtimedwait(&pipe_only, NULL, &no_wait) == SIGPIPE) {
    }
    pthread_sigmask(SIG_SETMASK, &caller_mask, NULL);
    /* Drained: stop the scheduler, then persist. */
    pthread_mutex_lock(&s->queue_lock);
    s->scheduler_stop = true;
    pthread_cond_signal(&s->queue_cond);
    pthread_mutex_unlock(&s->queue_lock);
    pthread_join(s->scheduler, NULL);
    s->scheduler_started = false;
    /* A batch that ended after a drain timeout closed its connections: nothing is sent, but the
     * jobs and the closed connections they kept are freed. */
    deliver_done(s);
    int status = KM_OK;
    for (uint32_t i = 0; i < s->n_pools; i++) {
        pool *p = s->pools[i];
        if (p->sub && p->snapshot_path) {
            int rc = km_subscriber_save(p->sub, NULL);
            if (rc != KM_OK) {
                slog(s, "pool %s: snapshot not written: %s", p->name, km_subscriber_last_error(p->sub));
                if (status == KM_OK)
                    status = rc;
            } else {
                slog(s, "pool %s: snapshot written to %s", p->name, p->snapshot_path);
            }
        }
    }
    if (s->records) {
        if (km_record_writer_flush(s->records, 10000) != KM_OK)
            slog(s, "records: not every record reached the disk before the timeout");
    }
    km_http_stop(s->http);
    s->http = NULL;
    slog(s, "stopped");
    return status;
}

uint16_t km_server_tcp_port(const km_server *s)
{
    return s ? s->tcp_port : 0;
}

uint16_t km_server_http_port(const km_server *s)
{
    return s ? s->http_port : 0;
}

void km_server_get_stats(km_server *s, km_server_stats *o)
{
    memset(o, 0, sizeof *o);
    if (!s)
        return;
    o->connections_accepted = atomic_load(&s->st.accepted);
    o->connections_open = atomic_load(&s->st.open);
    o->connections_refused = atomic_load(&s->st.refused);
    o->slow_clients_closed = atomic_load(&s->st.slow_closed);
    o->frames = atomic_load(&s->st.frames);
    o->bad_frames = atomic_load(&s->st.bad_frames);
    o->routes = atomic_load(&s->st.routes);
    o->decisions = atomic_load(&s->st.decisions);
    o->route_errors = atomic_load(&s->st.route_errors);
    o->overloaded = atomic_load(&s->st.overloaded);
    o->batches = atomic_load(&s->st.batches);
    o->inline_batches = atomic_load(&s->st.inline_batches);
    o->lifecycle_events = atomic_load(&s->st.lifecycle);
    o->lifecycle_errors = atomic_load(&s->st.lifecycle_errors);
    o->outcomes = atomic_load(&s->st.outcomes);
    o->expired = atomic_load(&s->st.expired);
    o->evicted = atomic_load(&s->st.evicted);
    o->routes_dropped_at_shutdown = atomic_load(&s->st.dropped_at_shutdown);
    o->approx_dispatch_learned = atomic_load(&s->st.dispatch_learned);
    o->approx_dispatch_unlearned = atomic_load(&s->st.dispatch_unlearned);
    o->breaker_opened = atomic_load(&s->st.breaker_opened);
    o->no_healthy_worker = atomic_load(&s->st.no_healthy);
    if (s->records) {
        km_record_writer_counters rc;
        km_record_writer_stats(s->records, &rc);
        o->records_dropped = rc.dropped;
    }
}

int km_server_deliver_events(km_server *s, uint32_t worker, uint64_t seq, const void *payload,
                             size_t size)
{
    if (!s || (!payload && size))
        return KM_ERR_NULL_POINTER;
    pthread_mutex_lock(&s->admin_lock);
    if (worker >= s->cfg.max_workers || !s->workers[worker].used || !s->workers[worker].local) {
        pthread_mutex_unlock(&s->admin_lock);
        return KM_ERR_NOT_FOUND;
    }
    pool *p = s->pools[s->workers[worker].pool];
    uint64_t now = now_ns();
    pthread_mutex_lock(&p->local_lock);
    km_kv_batch batch;
    int rc = km_kv_decode_payload(p->local_decoder, payload, size, &batch);
    /* A payload that does not decode still consumes its seq, as on the wire. */
    int rc2 = km_feed_live(p->local_feed, worker, seq, rc == KM_OK ? &batch : NULL, now);
    pthread_mutex_unlock(&p->local_lock);
    pthread_mutex_unlock(&s->admin_lock);
    wake_scheduler(s);
    return rc != KM_OK ? rc : rc2;
}
