/* SPDX-License-Identifier: Apache-2.0 */
/* Internal to the routing service (src/service/): its structures, what each thread owns, the lock
 * order, and the functions its files share. Nothing outside src/service/ includes it.
 *
 * Files: server.c (create, run, stop, destroy), connection.c (a connection's lifetime and its
 * write side), loop.c (frames by type, replies delivered, stop and drain), jobs.c (ROUTE frames
 * into jobs, their replies), scheduler.c (the scheduler role: batches, housekeeping, expiry),
 * decision.c (one route's decision), pools.c (pools and workers), health.c (worker health and
 * circuit breakers), attempts.c (attempts, lifecycle reports, outcome records), admin.c (WORKERS,
 * POOLS, STATUS), status.c (readiness, /status, /metrics, counters).
 *
 * Threads and what they own:
 *  - the loop thread (km_server_run, libuv): listeners, connections and their buffers, frame
 *    reading and decoding, hashing of token input (so it overlaps the scheduler's current batch:
 *    double buffering), lifecycle reports, WORKERS / POOLS / STATUS, encoding and writing
 *    replies, the drain; it alone writes pool metadata;
 *  - the scheduler role, held by one thread at a time (scheduler_busy, under queue_lock): the
 *    batch scratch, each pool's per-batch requests and results, the workers' per-batch states,
 *    approximate-mode learning (decisions and dispatch lessons) and expiry. The scheduler thread
 *    holds it for housekeeping and whole batches: it takes whole ROUTE frames off the queue,
 *    flushes each pool's events, scores every pool's share of the batch with one
 *    km_index_match_batch, decides each route (decision.c), and hands the jobs back to the loop
 *    thread (uv_async). A small frame's reply (SCHEDULER_REPLY_ROUTES; not behind a backlog) it
 *    encodes and writes into its socket itself when no earlier reply of that connection is still
 *    to be written (km_srv_job_hand_back), so the reply waits for no wake-up of the loop thread.
 *    The loop
 *    thread holds it for a small batch inline (on_dispatch, inline_routes) and for a slice of
 *    active-work expiry while the role is free;
 *  - subscribers' I/O threads (which wake the scheduler when events arrive), the records writer
 *    and the HTTP server (status.c's callbacks) run their own.
 *
 * Locks, in the order they nest (one is taken only while holding none listed after it):
 *  admin_lock   pools, workers, each pool's approximate-mode state, and every index call (the
 *               indexes are not thread-safe: the scheduler holds it for a whole batch; admin
 *               operations take it between batches). Pool metadata (names, models, block sizes,
 *               the pool array) is written only on the loop thread, by admin handlers holding
 *               admin_lock, so the loop thread reads it without the lock: decoding a ROUTE never
 *               waits for a batch;
 *  active_lock  km_active, the attempts kept for outcome records (and their cache), the queued
 *               dispatch lessons, and each worker's health (the router's verdict, its breaker);
 *               the scheduler takes it per decision, so a lifecycle report waits one decision at
 *               most;
 *  local_lock   a pool's in-process feed and decoder (workers whose events are "local"); a
 *               decision reads a worker's feed state under it;
 *  queue_lock   the route queue and the scheduler role; done_lock the finished jobs; a
 *               connection's write_lock its write side (struct conn); stored_lock the blocks
 *               the feeds stored since the last housekeeping. All four are leaves: nothing else
 *               is taken while one is held.
 */
#ifndef KM_SERVER_IMPL_H
#define KM_SERVER_IMPL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include <uv.h>

#include "base/u64_map.h"
#include "kvmatch/active.h"
#include "kvmatch/approx.h"
#include "kvmatch/cluster.h"
#include "kvmatch/engine_metrics.h"
#include "kvmatch/metrics.h"
#include "kvmatch/policy.h"
#include "kvmatch/records.h"
#include "kvmatch/server.h"
#include "kvmatch/subscriber.h"
#include "service/http.h"

#define MAX_POOLS 4096u
#define LIGHT_CONNECTION_ROUTES 64u
#define READ_CHUNK (64u * 1024u)

static inline uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * UINT64_C(1000000000) + (uint64_t)ts.tv_nsec;
}

typedef struct conn conn;

/* One route of a queued ROUTE frame, deep-copied out of the connection's decoder. */
typedef struct route_job {
    int status; /* KM_OK, or this route is answered with the error below */
    char message[256];
    char *request_id, *attempt_id, *model, *endpoint, *policy_name;
    uint32_t pool;
    uint64_t pool_uid; /* the pool's uid when the route was queued: a pool removed meanwhile fails it */
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
    bool warm_ups; /* the router carries out a warm-up the decision asks for */
} route_job;

/* Bump allocator for one job's copies. */
typedef struct chunk {
    struct chunk *next;
    size_t used, size;
    _Alignas(16) unsigned char data[];
} chunk;

/* Where a route job's round trip goes: CLOCK_MONOTONIC stamps of each stage, compiled in only by
 * a diagnostic build (CPPFLAGS=-DKM_SRV_STAGE_TRACE), which writes one line per delivered job to
 * the file the environment variable KM_SRV_STAGE_LOG names (km_srv_stage_log, loop.c). A normal
 * build has neither the fields nor the clock reads. */
#ifdef KM_SRV_STAGE_TRACE
typedef struct job_stages {
    uint64_t read;    /* the loop thread's read that brought the frame began */
    uint64_t batch;   /* its batch began (run_batch) */
    uint64_t scored;  /* the batch's index scoring ended */
    uint64_t decided; /* the batch's decisions and learning ended */
    uint64_t handed;  /* handed back to the loop thread (km_srv_job_hand_back), or decided inline */
    uint64_t picked;  /* the loop thread took it for delivery */
    uint64_t written; /* its reply went into the socket (0: left queued for a uv_write) */
    bool on_loop;     /* decided inline on the loop thread */
} job_stages;
#define KM_SRV_STAGE(j, stage) ((j)->stages.stage = now_ns())
#else
#define KM_SRV_STAGE(j, stage) ((void)0)
#endif

/* A decided route whose reply is queued on its connection: its decision, and where its reply ends
 * in the connection's queued bytes (conn.queued_total, counted in the order they are written). */
typedef struct pending_decision {
    uint64_t end;
    uint64_t decision_id;
} pending_decision;

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
    bool owed;    /* counted in its connection's replies_owed (km_srv_job_hand_back) */
    size_t reply_written; /* bytes of reply the scheduler thread wrote into the socket itself */
    bool shed;    /* queued past max_queue_wait_ms: answered with one ERROR KM_ERR_OVERLOADED */
    bool decisions_lost; /* its reply is an ERROR in place of its decisions (they did not encode):
                          * the router learns none of them (km_srv_end_job_undelivered) */
    bool behind;  /* queued behind the light connections' frames (jobs.c; queue_lock) */
    uint64_t shed_wait_ns; /* how long it had waited then */
    chunk *chunks;
#ifdef KM_SRV_STAGE_TRACE
    job_stages stages; /* queued: enqueued_ns */
#endif
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
    km_record_time dispatched, first_token; /* the first accepted report of each; monotonic 0 =
                                             * absent (a FIRST_TOKEN seen refuses later DISPATCHED
                                             * and FIRST_TOKEN reports whole) */
    double router_dispatched_ms, router_ttft_ms; /* the router's elapsed_ms; NAN = not reported */
    /* The engine model's predicted time to first token on the chosen worker (NAN for a warm-up)
     * and when the decision was made (now_ns), for kvmatch_ttft_observed_over_predicted. */
    double predicted_ttft_ms;
    uint64_t decided_ns;
    km_histogram *ttft_ratio; /* its pool's; the registry's, valid after the pool goes */
    bool cached_size;  /* allocated with ATTEMPT_CACHED_STRINGS bytes of strings: reusable */
    /* The request's block hashes, kept (approx_dispatch_max_bytes) when its pool has
     * approximate-mode workers: a report that the router used another of them teaches it. */
    uint64_t *hashes;
    uint32_t n_hashes;
    bool has_blocks; /* the request had a block: an override has something to teach */
    /* A warm-up of an approximate-mode worker: its blocks are taught to the worker it ran on at
     * its FIRST_TOKEN (or a complete FINISHED before one), not at its decision, so a warm-up the
     * router could not carry out is never assumed held. */
    bool lesson_at_first_token;
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

/* Another instance's approximate-mode prediction (km_cluster_prediction), copied on the NATS
 * delivery thread and applied by the scheduler role at its next housekeeping
 * (km_srv_cluster_take_predictions); it counts against the queue's byte bound until then. */
typedef struct remote_prediction {
    struct remote_prediction *next;
    char instance[KM_CLUSTER_INSTANCE_MAX + 1];
    char pool[KM_CLUSTER_POOL_MAX + 1];
    uint32_t worker;
    bool lesson;
    uint32_t n_hashes;
    uint64_t hashes[];
} remote_prediction;

typedef struct worker_slot {
    bool used;
    uint32_t pool;
    bool events; /* fed by KV events; else approximate mode */
    bool local;  /* events handed over in process (km_server_deliver_events), no sockets */
    bool has_dp_rank; /* WORKERS add `dp_rank`, echoed in WORKER_LIST and /status */
    uint32_t dp_rank;
    uint64_t incarnation; /* distinct for every km_srv_worker_add */
    char name[KM_SERVER_NAME_MAX];
    char *event_endpoint, *replay_endpoint;
    char *metrics_url; /* its engine's metrics endpoint as added (a reload compares it); NULL:
                        * none */
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
    /* kvmatch_ttft_observed_over_predicted{pool}: the registry's, kept after the pool goes (a pool
     * added again under its name gets the same series) */
    km_histogram *m_ttft_ratio;
    uint64_t uid; /* distinct for every pool this server created, never reused */
    char *model;
    uint32_t block_size;
    uint32_t hash_lookahead_tokens;
    uint32_t offload_chunk_blocks;
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
                          * on decisions keep their hashes (km_srv_attempt_keep_hashes);
                          * active_lock */
    char *snapshot_path; /* NULL = none */
    /* Failed event flushes repeat while their cause lasts (the index at its memory cap): logged at
     * most once per FLUSH_LOG_INTERVAL_NS, with how many were not (scheduler role). */
    uint64_t flush_logged_ns;
    uint64_t flush_failures_unlogged;
    /* per batch */
    km_request *requests;
    size_t n_requests, requests_capacity;
    km_match_results results;
} pool;

/* Scratch for one batch: the scheduler role's (whoever holds scheduler_busy). */
typedef struct batch_scratch {
    km_policy_candidate *cands;
    double *costs;
    const char **states; /* a candidate's index state, for the reply's and the record's rows */
    km_record_candidate *rcands;
    size_t cap_cands;
    km_update *pool_updates;
    size_t cap_pool_updates;
    km_approx_updates updates;
    uint32_t *seen;           /* max_workers stamps (km_srv_scratch_next_stamp): a route's
                               * candidate seen already, a worker cleared already (approx_apply) */
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
    /* The scheduler thread writes a decided job's reply into the socket itself when no reply of
     * this connection is ahead of it (km_srv_job_hand_back). write_lock (recursive: a flush may
     * close) orders that write against the loop thread's: the loop thread holds it while it
     * changes outbox, writing, write_in_flight, closing or replies_owed and while it writes into
     * the socket or closes it; the scheduler thread reads them and writes only under it. */
    pthread_mutex_t write_lock;
    uv_os_fd_t fd;
    uint32_t replies_owed; /* jobs handed back by the scheduler thread whose reply the loop thread
                            * has not yet queued or written (km_srv_deliver_jobs) */
    bool reply_cut;        /* the scheduler thread wrote part of a reply: the socket holds part of
                            * a frame, so nothing else is written until the loop thread queues
                            * its rest first (km_srv_conn_send_reply) */
    uint32_t jobs_in_flight;
    uint64_t routes_in_flight; /* routes of its queued or deciding jobs (max_connection_routes) */
    uint32_t queued_behind;    /* its queued jobs behind the light ones: its next frames go
                                * there too (jobs.c; queue_lock) */
    /* Decided routes whose reply is queued here, by where it ends (pending[pending_head ..
     * n_pending), ascending `end`): a reply the socket has taken whole is the router's, and its
     * entries go; when the connection closes, those past written_at_close never reached the
     * router and end their active work (km_srv_end_undelivered). Loop thread, write_lock held. */
    uint64_t queued_total;     /* bytes ever put in outbox, counted in the order they leave */
    size_t write_left;         /* bytes given to the uv_write in flight */
    uint64_t written_at_close; /* of queued_total, what the socket had taken when it closed */
    pending_decision *pending;
    size_t pending_head, n_pending, pending_cap;
    uint64_t frame_started_ns; /* a frame's first bytes came and not yet its last; 0 = none */
    uint64_t paused_since_ns;  /* reading paused for its waiting replies since, or since the
                                * peer last took bytes of them; 0 = not paused */
    size_t write_queue_seen;   /* the uv_write's bytes left at the last sweep (km_srv_conns_sweep):
                                * fewer now means the peer is taking them */
#ifdef KM_SRV_STAGE_TRACE
    uint64_t read_ns; /* the current read began (job_stages.read) */
#endif
    char rbuf[READ_CHUNK];
};

struct km_server {
    km_server_config cfg;
    char *socket_path, *tcp, *http_addr, *records_path, *snapshot_dir, *default_pool;
    char *cluster_url, *cluster_instance, *cluster_subject;
    km_log_fn log;
    void *log_user;

    uv_loop_t loop;
    uv_pipe_t unix_listener;
    uv_tcp_t tcp_listener;
    bool have_unix, have_tcp;
    bool own_socket_file; /* bound by this server: unlinked at destroy */
    uint16_t tcp_port;
    uv_signal_t sigterm, sigint, sighup;
    bool signals_installed;
    bool cfg_signals_ignore_hangup; /* km_server_run installed the signals: SIGHUP stays harmless
                                     * after the loop ends */
    uv_async_t wake;
    bool wake_inited; /* uv_async_init ran: destroy closes it only then */
    uv_timer_t drain_timer;
    atomic_bool draining; /* written by the loop thread, read by the HTTP thread too (/readyz) */
    bool drain_timer_started;
    uint64_t drain_deadline_ns;
    atomic_bool stop_requested;
    conn *conns;
    uint64_t conns_swept_ns; /* the last km_srv_conns_sweep (loop thread) */

    pthread_t scheduler;
    bool scheduler_started;
    pthread_mutex_t queue_lock;
    pthread_cond_t queue_cond;
    job *queue_head, *queue_tail;
    job *queue_light_tail; /* the last of the light connections' frames, which lead the queue
                            * (jobs.c, LIGHT_CONNECTION_ROUTES); NULL: none queued */
    uint64_t queued_routes;
    uint32_t queued_big_frames; /* of the queued frames, those of more than inline_routes routes */
    bool scheduler_stop;
    /* The scheduler role: held (under queue_lock) by whoever runs housekeeping or a batch, the
     * scheduler thread or the loop thread running a small batch inline (on_dispatch). */
    bool scheduler_busy;
    bool events_pending; /* a subscriber received messages since the last housekeeping */
    bool trim_pending;   /* a drain released its memory: the scheduler thread hands the heap's
                          * free pages back (malloc_trim), off the loop thread */
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
    uint64_t next_pool_uid;

    pthread_mutex_t active_lock;
    km_active *active;
    km_u64map attempts_by_decision; /* decision id -> attempt*; by ids: the active entry's user */
    attempt_cache attempt_cache;     /* released attempts for reuse (active_lock) */
    dispatch_lesson *lessons;        /* for the next housekeeping, newest first (active_lock) */
    uint32_t health_restricted;      /* workers unhealthy or with a tripped breaker (active_lock;
                                      * health.c): 0 lets km_srv_decide_route skip the checks */
    atomic_bool lessons_queued;      /* lessons is not empty: housekeeping takes the lock only then */
    km_memory attempts_memory;
    uint64_t active_peak; /* most active entries since the last release_after_drain (active_lock) */
    /* Runs of blocks the pools' feeds stored, for the queued prefills' progress
     * (km_srv_note_stored, km_srv_apply_stored): each run is a header (worker << 32 | count)
     * and its hashes, at most KM_SRV_STORED_MAX words in all; a run past that is dropped and
     * counted (m_progress_dropped). Under stored_lock. stored_wanted: some queued prefill is
     * waiting for its blocks (set by a decision that promised blocks, cleared by the drain that
     * finds none). */
    pthread_mutex_t stored_lock;
    uint64_t *stored;
    size_t n_stored, stored_capacity;
    atomic_bool stored_wanted;
    uv_timer_t expiry_timer; /* loop thread: active-work expiry while the scheduler role is free */
    uv_idle_t expiry_more;   /* runs while a full slice ended */
    bool expiry_timer_inited;

    km_cluster *cluster; /* NULL without cluster_url (cluster_view.c; thread-safe) */
    /* Remote approximate-mode predictions for the next housekeeping, oldest first, and what they
     * came to (cluster_view.c). predictions_lock is a leaf: held only to queue, take or read. */
    pthread_mutex_t predictions_lock;
    remote_prediction *predictions_head, *predictions_tail;
    uint64_t predictions_bytes;
    atomic_bool predictions_queued; /* predictions_head is not NULL */
    uint64_t predictions_applied, predictions_observed, predictions_refused,
        predictions_dropped;              /* predictions_lock */
    char predictions_last_refusal[192]; /* predictions_lock; "" when none */
    km_engine_metrics *engine_metrics; /* made for the first worker with a metrics URL
                                        * (cluster_view.c; thread-safe) */
    km_record_writer *records;
    char instance[33];
    char host[128];
    atomic_uint_fast64_t next_record_id, next_decision_id;

    km_metrics *metrics;
    km_counter *m_decisions, *m_route_errors, *m_frames, *m_bad_frames, *m_lifecycle,
        *m_outcomes, *m_expired, *m_evicted, *m_overloaded, *m_shed_wait, *m_shed_connection,
        *m_slow_closed, *m_reading_paused, *m_dropped_closed, *m_undelivered, *m_warm_ups,
        *m_progress_blocks, *m_progress_dropped;
    km_histogram *m_batch_routes, *m_batch_seconds, *m_queue_seconds;
    km_http *http;
    uint16_t http_port;

    uint64_t start_ns;
    double start_wall_s; /* CLOCK_REALTIME at create (process_start_time_seconds) */
    struct {
        atomic_uint_fast64_t accepted, open, refused, slow_closed, reading_paused, frames,
            bad_frames, routes,
            decisions, warm_ups, route_errors, overloaded, shed_wait, shed_connection, batches, inline_batches, lifecycle,
            lifecycle_errors, outcomes, expired, evicted, dropped_at_shutdown, dropped_closed,
            undelivered,
            dispatch_learned, dispatch_unlearned, breaker_opened, no_healthy, drain_releases,
            scheduler_replies, replies_cut;
        /* bytes allocated to the connections' send buffers (outbox and writing) now */
        atomic_uint_fast64_t send_buffer_bytes;
        /* connections refused at accept, by reason (their sum is `refused`) */
        atomic_uint_fast64_t refused_limit, refused_draining, refused_memory;
    } st;
    /* Log lines about refused connections: at most one a second, with the count since. Loop
     * thread only. */
    uint64_t refusal_log_ns, refusals_unlogged;
    int shutdown_status;
};

/* A worker's circuit breaker (health.c) and its name in WORKER_LIST and /status: closed; open
 * (failures reached breaker_failures, the cooldown runs); half-open (cooldown over, one probe
 * attempt at a time). */
#define KM_BREAKER_STATE_LIST(X)                                                                  \
    X(BREAKER_CLOSED, "closed")                                                                   \
    X(BREAKER_OPEN, "open")                                                                       \
    X(BREAKER_HALF_OPEN, "half_open")

typedef enum breaker_state {
#define KM_BREAKER_STATE_ENUM(value, name) value,
    KM_BREAKER_STATE_LIST(KM_BREAKER_STATE_ENUM)
#undef KM_BREAKER_STATE_ENUM
} breaker_state;

typedef enum eligibility {
    ELIGIBLE = 0,
    INELIGIBLE_UNHEALTHY,    /* the router said so */
    INELIGIBLE_BREAKER_OPEN, /* failures reached the threshold, cooldown running */
    INELIGIBLE_PROBING,      /* half-open, its probe attempt still in flight */
} eligibility;

/* Functions the files share, grouped by the file that defines them (their contracts are at the
 * definitions). The km_srv_ prefix marks them internal to the service: the library exports them only
 * because C has no linkage between static and global. */

/* server.c */
void km_srv_log(km_server *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* connection.c */
void km_srv_conn_maybe_free(conn *c);
void km_srv_conn_close(conn *c);
void km_srv_conn_close_if_finished(conn *c);
/* A connection whose frame began more than cfg.frame_timeout_ms of reading ago and is not complete
 * gets an ERROR (KM_ERR_TIMEOUT) and reads no more (time paused for its replies does not count);
 * one whose reading stayed paused for its waiting replies with none of them taken (a reader that
 * does not read) for cfg.stalled_reader_timeout_ms is closed. Loop thread; looks at most every
 * 100 ms whatever the caller's rate. */
void km_srv_conns_sweep(km_server *s, uint64_t now);
void km_srv_conn_send(conn *c, const km_frame_buffer *frames);
bool km_srv_conn_send_reply(conn *c, job *j);
void km_srv_job_hand_back(job *j, bool write_now);
void km_srv_send_error(conn *c, uint64_t id, int code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
int km_srv_send_message(conn *c, const km_message *m);
void km_srv_on_connection(uv_stream_t *listener, int status);

/* loop.c */
/* A frame that failed as a whole (framing, timeout, decoding): st.bad_frames and
 * kvmatch_bad_frames_total, counted together. */
void km_srv_count_bad_frame(km_server *s);
bool km_srv_handle_frame(conn *c, const uint8_t *payload, size_t size);
void km_srv_deliver_jobs(km_server *s, job *list);
void km_srv_deliver_done(km_server *s);
void km_srv_on_wake(uv_async_t *h);
void km_srv_begin_drain(km_server *s);
void km_srv_on_signal(uv_signal_t *h, int signum);
/* SIGHUP: reopen the records file, run the config's on_hangup; never stops the server. While the
 * server drains it does neither (a line says it was ignored). */
void km_srv_on_hangup(uv_signal_t *h, int signum);

/* jobs.c */
void *km_srv_job_alloc(job *j, size_t n);
void km_srv_job_free(job *j);
void km_srv_route_fail(route_job *r, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
void km_srv_job_encode_reply(km_server *s, job *j);
void km_srv_handle_route(conn *c, const km_message *m);

/* scheduler.c */
void km_srv_wake_scheduler(void *user);
int km_srv_scratch_reserve(batch_scratch *b, size_t n_cands);
uint32_t km_srv_scratch_next_stamp(km_server *s, batch_scratch *b);
void km_srv_scratch_free(batch_scratch *b);
int km_srv_scheduler_start(km_server *s, char *why, size_t why_size);
void km_srv_scheduler_stop(km_server *s);
void km_srv_scheduler_close_handles(km_server *s);

/* decision.c */
void km_srv_decide_route(km_server *s, job *j, route_job *r, pool *p, const km_request_result *rr,
                         batch_scratch *b, km_route_decision *d, uint64_t scored_ns);

/* pools.c */
int km_srv_pool_find(const km_server *s, const char *name);
/* The approximate-mode TTL and per-worker capacity a pool made from pc has, defaults applied
 * (fixed for the pool's life). */
void km_srv_pool_approx_params(const km_server_pool *pc, uint64_t *ttl_ms,
                               uint64_t *capacity_blocks);
/* Whether engine model m may be pool p's (a reload's file, POOLS update): KM_OK when it is the
 * pool's own; else KM_ERR_INVALID_ARGUMENT with why ("engine cannot change (A -> B) ...")
 * naming both models and what to do. The engine is fixed for the pool's life: its
 * approximate mode's capacity was set from it. */
int km_srv_pool_engine_check(const pool *p, const km_engine_model *m, char *why,
                             size_t why_size);
int km_srv_pool_for_model(const km_server *s, const char *model);
int km_srv_pool_serving_model(const km_server *s, const char *model, int except);
void km_srv_pool_destroy(pool *p);
int km_srv_pool_create(km_server *s, const km_server_pool *pc, pool **out, char *why,
                       size_t why_size);
int km_srv_feed_info(km_server *s, uint32_t id, km_feed_worker_info *out);
int km_srv_feed_windows(km_server *s, uint32_t id, km_feed_window *out, uint32_t cap, uint32_t *n);
bool km_srv_pool_is_member(const pool *p, uint32_t id);
int km_srv_pool_remove(km_server *s, uint32_t pool_index, char *why, size_t why_size);
/* What km_srv_worker_add refuses of w itself, whatever the service holds: its name, its replay
 * endpoint without an event endpoint, a metrics URL that is not http:// or https://. KM_OK or
 * KM_ERR_INVALID_ARGUMENT with why. */
int km_srv_worker_check(const km_server_worker *w, char *why, size_t why_size);
/* What km_srv_worker_add would refuse of w in pool pool_index, whatever worker w->id is now:
 * km_srv_worker_check's refusals, then its event source: the pool's feed or subscriber made as
 * the add makes it, and its endpoints as km_subscriber_check_worker finds them (admin_lock held).
 * KM_OK, or the add's error with why. */
int km_srv_worker_check_add(km_server *s, uint32_t pool_index, const km_server_worker *w,
                            char *why, size_t why_size);
int km_srv_worker_add(km_server *s, uint32_t pool_index, const km_server_worker *w, char *why,
                      size_t why_size);
int km_srv_worker_remove(km_server *s, uint32_t id, char *why, size_t why_size);
const char *km_srv_worker_state(km_server *s, uint32_t id);

/* health.c */
void km_srv_health_forget(km_server *s, const worker_slot *w);
breaker_state km_srv_worker_breaker(const worker_slot *w, uint64_t now);
const char *km_srv_breaker_state_name(breaker_state b);
eligibility km_srv_worker_eligibility(km_server *s, uint32_t id, uint64_t now);
void km_srv_breaker_outcome(km_server *s, uint32_t id, km_outcome outcome, uint64_t now);
bool km_srv_worker_set_health(km_server *s, uint32_t id, bool healthy);

/* attempts.c */
/* What km_srv_attempt_new will allocate for these strings, with the attempt's share of
 * attempts_by_decision: the bytes the route's active-work entry is charged for it. */
uint32_t km_srv_attempt_bytes(const char *request_id, const char *attempt_id, const char *model,
                              const char *pool_name, const char *endpoint);
attempt *km_srv_attempt_new(attempt_cache *cache, const char *request_id, const char *attempt_id,
                            const char *model, const char *pool_name, const char *endpoint);
void km_srv_attempt_free(attempt_cache *cache, attempt *a);
void km_srv_attempt_cache_free(attempt_cache *cache);
void km_srv_attempt_keep_hashes(km_server *s, attempt *a, const pool *p, const route_job *r,
                                bool always);
km_record_common km_srv_record_common(km_server *s, uint64_t decision_id, const char *request_id,
                                      const char *attempt_id, const char *model,
                                      const char *pool_name, const char *endpoint);
void km_srv_record_expired(void *user, const km_active_summary *sum);
void km_srv_record_evicted(void *user, const km_active_summary *sum);
void km_srv_record_removed(void *user, const km_active_summary *sum);
void km_srv_handle_lifecycle(conn *c, const km_message *m);
void km_srv_end_undelivered(km_server *s, uint64_t decision_id);
void km_srv_end_job_undelivered(km_server *s, const job *j);
/* Words of stored runs kept between two housekeepings (headers and hashes). */
#define KM_SRV_STORED_MAX (1u << 16)
/* A feed's on_stored hook (user: the server): keeps the run for km_srv_apply_stored while a
 * queued prefill waits for its blocks. Any thread; takes stored_lock only. */
void km_srv_note_stored(void *user, uint32_t worker, const uint64_t *hashes, size_t n);
/* The runs kept since the last call lower the pending prefill of the entries whose promised
 * blocks they hold (km_active_blocks_stored); each worker that changed has its load published.
 * active_lock held. */
void km_srv_apply_stored(km_server *s);

/* admin.c */
void km_srv_handle_workers(conn *c, const km_message *m);
void km_srv_handle_pools(conn *c, const km_message *m);
void km_srv_handle_status(conn *c, const km_message *m);

/* status.c */
/* A readiness reason of this many bytes is never cut: the records writer's last error
 * (KM_RECORD_WRITER_ERROR_BYTES at most) with the words around it and the workers' counts. */
#define KM_SRV_READINESS_REASON_BYTES (KM_RECORD_WRITER_ERROR_BYTES + 256u)
/* Ready to take traffic, and why (or why not) in reason; see status.c. */
bool km_srv_readiness(km_server *s, char *reason, size_t reason_size);

/* The cluster view (cluster_view.c, docs/CLUSTER.md). km_srv_cluster_start makes s->cluster from
 * the configuration (a no-op without cluster_url) and returns once the peers' state was taken.
 * The publishers read km_active, so active_lock is held; they send a worker's load only when it
 * changed. km_srv_cluster_add_load adds the other instances' load of a worker; the label is what
 * a decision says about its load view, its strings valid while *v is. */
typedef struct srv_load_view {
    const char *scope; /* "this_instance" or "cluster" (static); a decision may join
                        * "+engine_reported" (decision.c) */
    uint32_t instances;
    double oldest_age_ms; /* NAN when no remote contribution */
    char stale[8 * (KM_CLUSTER_INSTANCE_MAX + 1)]; /* comma-separated ids; "" = none */
} srv_load_view;
int km_srv_cluster_start(km_server *s, char *why, size_t why_size);
void km_srv_cluster_publish(km_server *s, uint32_t worker);
/* A ttft candidate's prefix_sharers and queued depth (km_active_prefix_sharers,
 * km_active_queued_depth) over this instance's requests and, with a cluster, the other
 * instances' (km_cluster_remote_prefix_sharers, km_cluster_remote_queued_depth). */
uint32_t km_srv_cluster_prefix_sharers(km_server *s, uint32_t worker, uint64_t prefix_key);
uint32_t km_srv_cluster_queued_depth(km_server *s, uint32_t worker, const uint64_t *hashes,
                                     uint32_t n, uint32_t from);
void km_srv_cluster_publish_all(km_server *s);
void km_srv_cluster_add_load(km_server *s, uint32_t worker, km_active_load *load);
void km_srv_cluster_label(km_server *s, uint64_t now, srv_load_view *v);
/* /status's "cluster" object (a new reference; JSON null without a cluster) and the
 * kvmatch_cluster_* metrics (nothing without one). */
struct json_t;
struct json_t *km_srv_cluster_status(km_server *s);
/* Approximate-mode predictions shared with the other instances (docs/CLUSTER.md): this
 * instance's, published when a decision or a router override teaches an approximate-mode worker
 * of pool p; the others', taken (oldest first, the caller frees each) by the scheduler role, which
 * applies each and says what came of it with km_srv_cluster_prediction_outcome. */
void km_srv_cluster_publish_prediction(km_server *s, const struct pool *p, uint32_t worker,
                                       bool lesson, const uint64_t *hashes, uint32_t n_hashes);
remote_prediction *km_srv_cluster_take_predictions(km_server *s);
typedef enum srv_prediction_outcome {
    SRV_PREDICTION_APPLIED,  /* taught to the worker as a prediction, like a local decision */
    SRV_PREDICTION_OBSERVED, /* the worker is fed by KV events here: observations win, ignored */
    SRV_PREDICTION_REFUSED,  /* no such pool here, or the worker is not one of it */
    SRV_PREDICTION_DROPPED,  /* not taught: the pool's index refused it (memory cap, no memory) */
} srv_prediction_outcome;
void km_srv_cluster_prediction_outcome(km_server *s, const remote_prediction *r,
                                       srv_prediction_outcome outcome);
void km_srv_cluster_predictions_free(km_server *s);
/* The pools or their workers changed (admin_lock held): the cluster handle is told each pool's
 * worker fingerprint, which the other instances compare with theirs (docs/CLUSTER.md). */
void km_srv_cluster_pools_changed(km_server *s);
void km_srv_cluster_metrics(km_server *s, km_text *out);
/* Engine-reported load (cluster_view.c): scrape `url` for worker `id` from now on (NULL: stop),
 * the scraper made on first use (a failure is logged: the worker is served without it). A
 * decision uses a worker's values while fresh: a good scrape younger than
 * km_srv_engine_max_age_ns (engine_metrics.max_age_ms, else three intervals); *out is filled
 * whenever the worker is scraped. The worker's values as /status's "engine_reported" (null when
 * not scraped; a new reference), *fresh set as km_srv_engine_reported_fresh says. */
void km_srv_engine_metrics_target(km_server *s, uint32_t id, const char *url);
uint64_t km_srv_engine_max_age_ns(const km_server *s);
bool km_srv_engine_reported_fresh(km_server *s, uint32_t id, uint64_t now, km_engine_reported *out);
struct json_t *km_srv_engine_reported_status(km_server *s, uint32_t id, uint64_t now, bool *fresh);
km_http_callbacks km_srv_http_callbacks(km_server *s);
int km_srv_metrics_setup(km_server *s);
/* kvmatch_ttft_observed_over_predicted{pool=name} (the one series a name has, however often a
 * pool of that name is added). KM_OK, or the registry's error. */
int km_srv_metrics_pool_ttft(km_server *s, const char *name, km_histogram **out);

#endif
