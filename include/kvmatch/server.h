/* SPDX-License-Identifier: Apache-2.0 */
/* The routing service (`kvmatch serve`; docs/SERVICE.md, docs/PROTOCOL.md): routers connect over a
 * Unix socket (and optionally loopback TCP), send ROUTE frames and lifecycle reports, and get
 * DECISION frames back. Requests from every connection join one queue; a scheduler thread scores
 * them in batches against the pools' indexes, lets each pool's policy weigh overlap against the
 * load this instance saw, and writes a linked JSONL record per decision and per outcome.
 *
 * Threads: the caller of km_server_run runs the event loop (libuv: sockets, signals, replies); the
 * scheduler role owns every index (event flushes, scoring, approximate-mode updates, snapshots,
 * active-work expiry): the scheduler thread holds it for batches, the loop thread for a small
 * batch that arrives while the scheduler is idle (inline_routes; docs/ARCHITECTURE.md, "The
 * service's threads"); each pool with event sources has its subscriber's I/O thread; the records
 * writer and the HTTP server (libmicrohttpd) have their own.
 *
 * Lifecycle: km_server_config_init -> fill (or km_server_config_load_json) -> km_server_create
 * (binds the sockets, restores snapshots, starts the threads) -> km_server_run (blocks until
 * SIGTERM / SIGINT or km_server_stop, then drains: stops accepting, finishes queued decisions,
 * writes their replies, flushes records, writes each event pool's snapshot) -> km_server_destroy. */
#ifndef KVMATCH_SERVER_H
#define KVMATCH_SERVER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvmatch/cluster.h"
#include "kvmatch/error.h"
#include "kvmatch/log.h"
#include "kvmatch/index.h"
#include "kvmatch/kv_events.h"
#include "kvmatch/policy.h"
#include "kvmatch/protocol.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct km_server km_server;

/* Longest pool or worker name. */
#define KM_SERVER_NAME_MAX 64u
/* Largest max_outbox_bytes (1 GiB): a connection's waiting replies are written in one libuv
 * buffer, whose length is 32 bits. */
#define KM_SERVER_MAX_OUTBOX_BYTES_LIMIT (UINT64_C(1) << 30)
/* Smallest limits.max_frame_bytes a server takes: every reply of a bounded size fits in it (a
 * WELCOME whatever its limits, an ERROR with the longest message the server writes, 511 bytes),
 * so a client that reads frames up to max_frame_bytes reads them. */
#define KM_SERVER_MIN_FRAME_BYTES 1024u

/* One worker: an engine replica (or one data-parallel rank of one). Ids are unique across the
 * service (0 .. max_workers - 1); with an event endpoint the worker's index is fed by its KV
 * events, without one by this instance's own decisions (approximate mode). */
typedef struct km_server_worker {
    uint32_t id;
    const char *name;            /* NULL = "w<id>" */
    const char *event_endpoint;  /* ZMQ PUB endpoint; NULL = approximate mode */
    const char *replay_endpoint; /* ZMQ ROUTER replay endpoint; NULL = none */
    bool has_dp_rank;            /* a data-parallel rank (a config's dp_size names each one) */
    uint32_t dp_rank;
    const char *metrics_url;     /* the engine's Prometheus endpoint (http:// or https://), scraped
                                  * for engine-reported load (kvmatch/engine_metrics.h); NULL =
                                  * not scraped */
} km_server_worker;

typedef struct km_server_pool {
    const char *name;   /* required, unique; [A-Za-z0-9._-]{1,63} (it names the snapshot file) */
    const char *model;  /* routes naming this model (and no pool) go here; NULL = none */
    uint32_t block_size; /* tokens per block, as the engines' --block-size; required */
    /* The engines' lookahead hashing (vLLM's num_hash_lookahead_tokens under EAGLE / MTP
     * speculative decoding; docs/HASHING.md): routes' token ids are hashed with it and event
     * workers' stores must carry as many lookahead tokens; 0 = none (default), at most 1024. */
    uint32_t hash_lookahead_tokens;
    /* Blocks per chunk of the engines' KV offloading connector (vLLM's OffloadingConnector: its
     * offloaded block size over block_size), by which an engine's placeholder stores are placed
     * (km_feed_config.offload_chunk_blocks); 0 = 1 (default), at most
     * KM_FEED_MAX_OFFLOAD_CHUNK_BLOCKS. */
    uint32_t offload_chunk_blocks;
    km_policy_config policy;
    uint64_t approx_ttl_ms;          /* approximate mode: a routed block is assumed held this
                                      * long; at most UINT64_MAX / 1,000,000; 0 = default
                                      * 120,000 (Dynamo's) */
    uint64_t approx_capacity_blocks; /* approximate mode: blocks assumed per worker, least
                                      * recently routed dropped first; 0 = the engine model's
                                      * capacity (policy.engine) in this pool's blocks */
    bool approx_every_touch;         /* approximate mode: every decision's touch reorders the
                                      * eviction order (km_approx_config.refresh_ns 0), instead of
                                      * touches within 1/256 of the TTL being one. For the
                                      * simulator, whose runs last less wall time than that */
    const km_server_worker *workers;
    uint32_t n_workers;
} km_server_pool;

typedef struct km_server_config {
    const char *socket_path; /* Unix socket; default KM_PROTOCOL_DEFAULT_SOCKET; NULL = none
                              * (then tcp is required) */
    const char *tcp;         /* "127.0.0.1:PORT" / "[::1]:PORT"; NULL = no TCP; a non-loopback
                              * address needs allow_non_loopback */
    const char *http;        /* health / readiness / status / metrics "127.0.0.1:PORT"; NULL = none */
    bool allow_non_loopback;
    const char *records_path; /* decision and outcome JSONL (docs/RECORDS.md); NULL = none */
    /* Rotation and retention of the records (km_record_writer_config, docs/RECORDS.md): the same
     * meanings, 0 included. records_max_file_bytes: rotation size, 0 = never rotate (default
     * 256 MiB); records_keep_files: rotated files kept, 0 = none (default 8);
     * records_max_kept_bytes, records_max_age_s: 0 = no limit (the defaults). */
    uint64_t records_max_file_bytes;
    uint32_t records_keep_files;
    uint64_t records_max_kept_bytes;
    uint64_t records_max_age_s;
    const char *snapshot_dir; /* event pools' snapshots <dir>/<pool>.snap; NULL = none */
    uint32_t snapshot_interval_ms; /* periodic snapshots; 0 = only at shutdown; default 60,000 */
    /* The cluster view (docs/CLUSTER.md): with cluster_url the instance shares its active work
     * with the others over NATS under cluster_instance (required then) and adds theirs to its
     * decisions' load; the server is created (so ready) only after the peers' state was taken.
     * cluster_subject: subject prefix, NULL = "kvmatch.cluster"; the intervals: 0 = the
     * km_cluster defaults (heartbeat 200 ms, expiry 1000 ms, sync timeout 2000 ms, sync quiet
     * 100 ms: how long the start waits for a first answer when no peer is known). */
    const char *cluster_url;
    const char *cluster_instance;
    const char *cluster_subject;
    uint32_t cluster_heartbeat_ms;
    uint32_t cluster_expire_ms;
    uint32_t cluster_sync_timeout_ms;
    uint32_t cluster_sync_quiet_ms;
    /* Engine-reported load: how often each worker's metrics_url is scraped and how long one scrape
     * may take; 0 = the defaults (1000 ms, 500 ms). A decision uses a worker's reported values
     * while their age is below max_age_ms; 0 = three intervals. */
    uint32_t engine_metrics_interval_ms;
    uint32_t engine_metrics_timeout_ms;
    uint32_t engine_metrics_max_age_ms;

    uint32_t max_workers;     /* worker ids 0 .. max_workers - 1; default 1024 */
    km_backend_kind backend;  /* scoring backend of every pool's index; default AUTO */
    uint32_t index_threads;   /* CPU scoring threads per index; 0 = online CPUs */
    uint64_t index_memory_cap_bytes; /* per pool; 0 = none */
    uint64_t index_initial_blocks;   /* per pool: distinct blocks the index is sized for at start
                                      * (beyond it the tables grow incrementally, keys moving a
                                      * few slots per insert); 0 = the index's default (65,536) */

    uint32_t max_batch_routes;  /* routes scored in one batch at most (a bigger frame goes alone);
                                 * default 512. Smaller than what a busy server has queued on
                                 * purpose: the loop thread encodes one batch's replies and decodes
                                 * the next frames while the scheduler scores the next batch. One
                                 * batch of everything queued leaves them taking turns. */
    uint32_t inline_routes;     /* frames holding at most this many routes, arriving while the
                                 * scheduler is idle, are decided on the loop thread at once (no
                                 * thread hand-off), as many as max_batch_routes allows when no
                                 * bigger frame is queued with them; 0 = always the scheduler
                                 * thread; default 16 */
    uint32_t max_queued_routes; /* more waiting than this: ROUTE gets KM_ERR_OVERLOADED; 65,536 */
    /* Load shedding (docs/RELIABILITY.md): a route that waited in the queue longer than
     * max_queue_wait_ms is answered KM_ERR_OVERLOADED when the scheduler reaches it, without
     * being scored (default 50; 0 = no deadline); a ROUTE frame that would take one connection's
     * queued routes past max_connection_routes is refused at once with KM_ERR_OVERLOADED
     * (default 4,096; 0 = no per-connection budget). Both counted (routes_shed). */
    uint32_t max_queue_wait_ms;
    uint32_t max_connection_routes;
    uint32_t max_connections;   /* more are accepted and closed at once; default 1024 */
    uint64_t max_outbox_bytes;  /* replies waiting for a slow reader beyond this close it;
                                 * default 64 MiB (reading pauses at a quarter of it); 4096 ..
                                 * KM_SERVER_MAX_OUTBOX_BYTES_LIMIT */
    km_protocol_limits limits;  /* frame and message limits (docs/PROTOCOL.md) */
    /* Limits of the KV-event decoder of every event-fed pool (docs/EVENTS.md, "Limits and
     * memory"); a field 0 = its default (km_kv_decoder_config_init). An engine whose scheduler
     * steps publish more (a batch of more than 65,536 events at a small block size) has every
     * such message refused as undecodable until they are raised. */
    km_kv_decoder_config kv_events;

    uint64_t active_ttl_ms;     /* active work whose FINISHED never comes expires; default 600,000 */
    uint32_t max_active_entries; /* active work kept at most; one more evicts the least recently
                                  * touched entry (an `expired` outcome record, counted in
                                  * `evicted`), so a router that never reports FINISHED degrades
                                  * load accounting, not routing; default 1,048,576 */
    uint64_t max_active_bytes;  /* bytes active work's entries are counted as holding
                                 * (km_active_entry_bytes), at most; a route whose entry would pass
                                 * it fails with KM_ERR_MEMORY_CAP, nothing evicted (counted in
                                 * `active_refused_bytes`); 0 = no bound; default 1 GiB */
    uint64_t approx_dispatch_max_bytes; /* block hashes kept, all live attempts together, for
                                  * decisions in pools with approximate-mode workers: a lifecycle
                                  * report naming another such worker (the router overrode the
                                  * choice) teaches that worker the request's blocks. Kept once the
                                  * pool has seen an override, until the attempt's FIRST_TOKEN or
                                  * end; each such report copies them until the next batch
                                  * teaches it, and the copies count too. Beyond it a
                                  * decision keeps none, and a report copies none (counted in
                                  * approx_dispatch_unlearned); 0 = keep none; default 64 MiB */
    uint32_t breaker_failures;  /* a worker whose last this-many attempts in a row ended `error` or
                                 * `incomplete` (FINISHED) is not chosen for breaker_cooldown_ms;
                                 * after it, one probe attempt at a time goes to it until an
                                 * outcome closes (complete) or reopens (a failure) the
                                 * breaker. 0 = no breaker; default 5 (SERVICE.md, "Worker
                                 * health") */
    uint64_t breaker_cooldown_ms; /* 1..UINT64_MAX / 1,000,000 (in ns it fits 64 bits; else
                                   * km_server_create refuses it unless breaker_failures is 0);
                                   * default 10,000 */
    double ready_share;         /* /readyz: ready when at least this share of event-fed workers is
                                 * LIVE; default 1.0 */
    uint32_t drain_timeout_ms;  /* shutdown waits this long for queued work; default 10,000 */
    uint32_t frame_timeout_ms;  /* a frame begun and not complete this long: ERROR (KM_ERR_TIMEOUT)
                                 * and the connection reads no more; default 30,000; >= 1 */
    uint32_t stalled_reader_timeout_ms; /* reading paused this long for replies the client does
                                         * not read: closed; default 60,000; >= 1 */
    uint64_t seed;              /* policies' random state (temperature > 0); default 0x6b766d */
    const char *default_pool;   /* routes naming neither pool nor model; NULL = the first (a
                                 * route naming a model no pool serves is refused) */

    const km_server_pool *pools;
    uint32_t n_pools;

    km_log_fn log; /* one line per notable event; NULL = stderr */
    void *log_user;
    /* SIGHUP (with install_signals), after the server reopened its records file: the embedding
     * program's part (reopen its log file, reload its configuration: km_server_reload). Runs on
     * the loop thread; NULL = none. SIGHUP never stops the server; one that comes while the
     * server drains is ignored (neither reopens nor runs this). */
    void (*on_hangup)(km_server *server, void *user);
    void *hangup_user;
} km_server_config;

void km_server_config_init(km_server_config *cfg);

/* A configuration read from a JSON file (format: docs/SERVICE.md). The strings and arrays it
 * points to belong to *owner (release with km_server_config_json_free after the server is gone).
 * Fields the file leaves out keep km_server_config_init's defaults. Errors: KM_ERR_IO (unreadable),
 * KM_ERR_PARSE (not JSON, a field of the wrong type, an unknown policy), KM_ERR_INVALID_ARGUMENT
 * (a value out of range), each with the detail in why; *cfg is then unchanged. */
typedef struct km_server_config_json km_server_config_json;
int km_server_config_load_json(const char *path, km_server_config *cfg, km_server_config_json **owner,
                               char *why, size_t why_size);
void km_server_config_json_free(km_server_config_json *owner);

/* Validate, bind the listeners, create the pools (indexes, subscribers restoring their snapshots,
 * approximate-mode state), the records writer and the HTTP server, and start the scheduler.
 * A failure at any step releases what the earlier steps made and returns the error; it never
 * aborts the process.
 * Errors: KM_ERR_INVALID_ARGUMENT (why says which field: a TCP address that is not HOST:PORT or
 * not loopback, a socket path that is empty or longer than a Unix socket path takes),
 * KM_ERR_IO (a socket could not be bound: in use, permission, a missing directory; the records
 * file cannot be opened for appending), KM_ERR_OUT_OF_MEMORY, and those of the parts. */
int km_server_create(const km_server_config *cfg, km_server **out, char *why, size_t why_size);

/* Serve until SIGTERM / SIGINT (when install_signals) or km_server_stop, then drain and return
 * KM_OK, or the first shutdown error: a snapshot that could not be written, KM_ERR_IO when records
 * were lost (an I/O error during the run, or lines still unwritten after the final flush's 10 s;
 * each logged with the count). install_signals also takes SIGHUP: the records file is reopened
 * (after a rotation from outside) and on_hangup runs; the server keeps serving (while it drains, a
 * SIGHUP is ignored). It also
 * ignores SIGPIPE process-wide; without it, SIGPIPE is blocked in the calling thread while it
 * serves (a peer closing mid-reply is an EPIPE, not the end of the process), and the caller's
 * signal mask is restored on return. */
int km_server_run(km_server *server, bool install_signals);

/* Apply a configuration read again (SIGHUP) to a running server, on the loop thread (from
 * on_hangup): pools it lists that the server lacks are added; a listed pool's policy, parameters
 * and model take the new values (its block_size, hash_lookahead_tokens, offload_chunk_blocks and
 * engine cannot change, and a model must be UTF-8 without control characters: else that pool is
 * refused whole, as it is when its model cannot be copied, KM_ERR_OUT_OF_MEMORY); its workers
 * become the listed ones (a worker not listed is removed, one whose endpoints or name changed is
 * removed and added again, one whose metrics URL or dp_rank changed takes the new value in place,
 * a new one is added; all pools' removals come before any addition, so a worker can move between
 * pools listed in either order). Pools it does not list are kept. Settings only a restart
 * applies (every field but pools, log and the hangup callback; a listed pool's approx_ttl_ms and
 * approx_capacity_blocks, defaults applied) are not changed; each that differs is logged by its
 * name in the configuration file. Every change and refusal is logged, then a summary line.
 * KM_OK, or the first refusal's error (the rest is still applied). A configuration that lists a
 * pool name or a worker id twice is refused whole (KM_ERR_INVALID_ARGUMENT, logged): nothing
 * changes. */
int km_server_reload(km_server *server, const km_server_config *config);

/* Ask a running server to stop (drain and return from km_server_run). Any thread. */
void km_server_stop(km_server *server);

/* After km_server_run returned (or instead of it). NULL is a no-op. */
void km_server_destroy(km_server *server);

/* A worker whose event endpoint is this string gets its KV events from km_server_deliver_events
 * (same process, no sockets): the simulator's engines. */
#define KM_SERVER_LOCAL_EVENTS "local"

/* Hand one KV-event message of a "local" worker to its pool's feed, exactly as if it had arrived
 * on the wire with this seq (gaps, restarts and duplicates are judged the same way); it reaches the
 * index before the next scoring batch. Any thread. Errors: KM_ERR_NULL_POINTER, KM_ERR_NOT_FOUND
 * (no such local worker), the decoder's (the seq is still consumed, as for a malformed message). */
int km_server_deliver_events(km_server *server, uint32_t worker, uint64_t seq, const void *payload,
                             size_t size);

/* The server's cluster handle (docs/CLUSTER.md), NULL without cluster_url: for observers that
 * read its propagation state (the simulator). Valid from km_server_create until
 * km_server_destroy; its functions are thread-safe. */
km_cluster *km_server_cluster(km_server *server);

/* The bound TCP / HTTP ports (useful with port 0); 0 when not listening. */
uint16_t km_server_tcp_port(const km_server *server);
uint16_t km_server_http_port(const km_server *server);

/* Counters, any thread. */
typedef struct km_server_stats {
    uint64_t connections_accepted;
    uint64_t connections_open;
    uint64_t connections_refused;   /* over max_connections */
    uint64_t slow_clients_closed;   /* outbox over max_outbox_bytes, or reading paused with none
                                     * of the replies taken for stalled_reader_timeout_ms */
    uint64_t reading_pauses;        /* times a connection's reading paused for its waiting
                                     * replies (over max_outbox_bytes / 4) */
    uint64_t frames;                /* frames received */
    uint64_t bad_frames;            /* frames that failed as a whole: a framing error, not
                                     * complete within frame_timeout_ms, or not decoded (as
                                     * kvmatch_bad_frames_total) */
    uint64_t routes;                /* route requests received */
    uint64_t decisions;             /* routes decided */
    uint64_t warm_ups;              /* warm-ups those decisions asked for (each a decision of its
                                     * own, not counted in decisions) */
    uint64_t route_errors;          /* routes answered with an error */
    uint64_t overloaded;            /* ROUTE frames refused with KM_ERR_OVERLOADED */
    uint64_t routes_shed_wait;      /* routes answered KM_ERR_OVERLOADED: queued past
                                     * max_queue_wait_ms */
    uint64_t routes_shed_connection; /* routes of frames refused: over max_connection_routes */
    uint64_t batches;               /* scoring batches */
    uint64_t inline_batches;        /* of which decided on the loop thread (inline_routes) */
    uint64_t lifecycle_events;
    uint64_t lifecycle_errors;      /* unknown ids, out of order, ... (answered per item) */
    uint64_t outcomes;              /* outcome records (FINISHED and expiries) */
    uint64_t expired;               /* active work expired by TTL */
    uint64_t evicted;               /* active work ended early to make room (max_active_entries) */
    uint64_t active_refused_bytes;  /* routes refused: their active work would pass
                                     * max_active_bytes */
    uint64_t records_dropped;       /* records the writer could not take (queue full) */
    uint64_t routes_dropped_at_shutdown; /* still queued when the drain timed out: unanswered */
    uint64_t routes_dropped_closed; /* still queued when their connection closed: not decided */
    uint64_t decisions_undelivered; /* decided, their reply not written whole before their
                                     * connection closed (or not encodable): active work ended
                                     * with a `cancelled` outcome */
    uint64_t approx_dispatch_learned;   /* overrides to an approximate-mode worker that taught it */
    uint64_t approx_dispatch_unlearned; /* ... that could not: the decision kept no hashes
                                         * (approx_dispatch_max_bytes, out of memory). A request
                                         * shorter than one block counts in neither */
    uint64_t breaker_opened;            /* circuit breakers opened (or reopened after a probe) */
    uint64_t no_healthy_worker;         /* routes refused: no candidate was eligible */
    uint64_t scheduler_replies;         /* ROUTE replies the scheduler thread wrote into their
                                         * sockets itself (no earlier reply of the connection
                                         * was waiting), without the loop thread */
    uint64_t send_buffer_bytes; /* allocated to the open connections' send buffers now: each
                                 * connection keeps at most 64 KiB of each of its two once its
                                 * replies are written, whatever its largest reply */
    uint64_t replies_cut;       /* ACKs over max_frame_bytes with their failed items' messages
                                 * whole, sent with those messages cut short (every status
                                 * kept) */
} km_server_stats;

void km_server_get_stats(km_server *server, km_server_stats *out);

#ifdef __cplusplus
}
#endif
#endif
