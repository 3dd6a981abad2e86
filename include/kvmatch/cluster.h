/* The cluster view: several kvmatch instances share their active work over NATS.
 *
 * Each instance owns one km_cluster handle. It publishes this instance's per-worker load (the
 * km_active_load values its own decisions and lifecycle reports produced) whenever a value
 * changes, and a full state of all of them at every heartbeat; it applies the other instances'
 * messages into one remote load per worker (the sum over the live remote contributions), which a
 * decision adds to its own view. With each worker's load goes its in-flight work
 * (km_cluster_publish_work: its requests' shared-prefix keys and queued prefills' promised
 * blocks), held and summed the same way, which a ttft decision counts in its candidates'
 * prefix sharers and queued depth. It also publishes this instance's approximate-mode predictions
 * (blocks assumed on a worker without KV events, at a decision or a router override) and hands
 * the other instances' to the service (on_prediction), which teaches them to its own index. Worker
 * ids are the ones the instances' shared configuration gives; each state carries a fingerprint of
 * every pool's workers (km_cluster_set_pools), and a peer whose fingerprint for a pool differs has
 * its load on that pool's workers and its predictions for it left out, counted and logged.
 *
 * Guarantees (docs/CLUSTER.md says the same with the wire format):
 *  - every message of an instance carries the next sequence number of its incarnation; a gap is
 *    counted (lost_messages) and marks that instance's contribution stale until its next full
 *    state, which replaces the contribution whole and clears it;
 *  - a contribution whose instance is silent for expire_ms (crash, partition, NATS lost) is
 *    dropped and counted (expired_instances);
 *  - km_cluster_create asks the peers for their state and waits (at most sync_timeout_ms) until
 *    every peer it learns of has answered, so a new or restarted instance has the cluster's active
 *    work before it reports ready; how long that took is in the stats;
 *  - a peer answers a sync request within sync_answer_ms with a state, which answers every
 *    request received before it, so many instances asking at once (all reconnecting after a NATS
 *    restart) cost each peer at most one answer every sync_answer_ms, not one per request
 *    (counted: sync_requests, sync_answers);
 *  - NATS down at start or later never fails a call: publishing is skipped (the next full state
 *    carries it), the remote contributions expire, the view says "this_instance", and the handle
 *    reconnects, asks for the peers' state again and says "cluster" again;
 *  - a message that is not a well-formed message of this protocol (bad JSON, wrong version,
 *    values out of range, an unknown worker, this instance's own id from another process) changes
 *    nothing and is counted by reason; the last one's reason is kept for operators.
 * Not guaranteed: the work of a crashed instance is counted only until its contribution expires;
 * output growth beyond the decode blocks charged at the decision is not modelled (as in km_active).
 *
 * Threads: every function may be called from any thread (one mutex inside); the NATS client's
 * own threads deliver messages and a heartbeat thread publishes the full state, answers the peers'
 * sync requests and drops expired contributions.
 *
 * Lifecycle: km_cluster_config_init -> adjust -> km_cluster_create (connects or starts retrying,
 * starts the heartbeat, syncs) -> km_cluster_publish_load / km_cluster_publish_work /
 * km_cluster_publish_prediction /
 * km_cluster_add_remote_load / km_cluster_get_view / km_cluster_get_stats -> km_cluster_destroy.
 * Every int-returning function returns KM_OK or a negative km_status. */
#ifndef KVMATCH_CLUSTER_H
#define KVMATCH_CLUSTER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvmatch/active.h"
#include "kvmatch/error.h"
#include "kvmatch/log.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct km_cluster km_cluster;

/* Longest instance id, in bytes; ids are made of [A-Za-z0-9_-] (one NATS subject token). */
#define KM_CLUSTER_INSTANCE_MAX 64u
/* Most remote instances applied at once; messages from more are refused (too_many_instances). */
#define KM_CLUSTER_MAX_INSTANCES 64u
/* Largest step of a peer's sequence number from its last applied one: a message that jumps
 * further (a stray or replayed message under its id) is refused as malformed, not counted as
 * that many lost. An instance sending 10,000 messages a second for 5 days loses fewer. */
#define KM_CLUSTER_SEQ_JUMP_MAX (UINT64_C(1) << 32)
/* Largest message accepted or sent, in bytes (NATS's default max_payload is 1 MiB); a server
 * whose max_payload is lower bounds what is sent to it. */
#define KM_CLUSTER_MESSAGE_MAX (1024u * 1024u)
/* Most block hashes in one approximate-mode prediction: a longer prompt's prediction carries its
 * leading blocks (a prefix match needs no more), so a message stays within
 * KM_CLUSTER_MESSAGE_MAX. */
#define KM_CLUSTER_PREDICTION_MAX_HASHES 32768u
/* Largest value of one load field a peer may send (2^48): a message with more is refused
 * (malformed), so the sum over the most instances cannot wrap. */
#define KM_CLUSTER_LOAD_VALUE_MAX (UINT64_C(1) << 48)
/* Most shared-prefix keys and promised block hashes one worker's row of in-flight work carries
 * in a message (km_cluster_publish_work); a longer list is cut (counted in work_truncated), which
 * only makes the receivers' prefix_sharers and queued depth smaller, never wrong. */
#define KM_CLUSTER_WORK_MAX_PREFIXES 4096u
#define KM_CLUSTER_WORK_MAX_QUEUED 16384u
/* Most shared-prefix keys plus promised hashes held from all remote instances together; past it
 * a row keeps its leading part (counted in work_truncated). */
#define KM_CLUSTER_REMOTE_WORK_MAX (1u << 20)
/* Longest pool name in a prediction or a state's pool list, in bytes. */
#define KM_CLUSTER_POOL_MAX 64u
/* Most pools an instance announces (km_cluster_set_pools); more are refused. */
#define KM_CLUSTER_MAX_POOLS 64u

/* One of this instance's pools as the instances must agree on it: its name, a fingerprint of what
 * its worker ids mean here (the service's: the pool's block size and its workers' ids and names),
 * and its workers' ids. */
typedef struct km_cluster_pool {
    const char *name;
    uint64_t fingerprint;
    const uint32_t *workers;
    uint32_t n_workers;
} km_cluster_pool;

/* An approximate-mode prediction of another instance: `hashes` (the chain hashes of a prompt's
 * leading blocks, in order) are assumed on `worker` of the pool named `pool` from now on, because
 * that instance routed the prompt there (lesson false) or its router reported it sent the prompt
 * there instead of the chosen worker (lesson true). */
typedef struct km_cluster_prediction {
    const char *instance;
    const char *pool;
    uint32_t worker;
    bool lesson;
    const uint64_t *hashes;
    uint32_t n_hashes;
} km_cluster_prediction;

typedef struct km_cluster_config {
    const char *url;            /* "nats://HOST:PORT" (required) */
    const char *instance;       /* this instance's id (required) */
    const char *subject_prefix; /* subjects are PREFIX.change.ID, PREFIX.state.ID, PREFIX.sync;
                                 * default "kvmatch.cluster" */
    uint32_t max_workers;       /* worker ids 0 .. max_workers-1; default 1024 */
    uint32_t heartbeat_ms;      /* full state every this often; >= 10; default 200 */
    uint32_t expire_ms;         /* a silent instance's contribution is dropped after this;
                                 * > heartbeat_ms; default 1000 */
    uint32_t sync_timeout_ms;   /* longest wait for the peers' state at create; default 2000 */
    uint32_t sync_quiet_ms;     /* with no peer known, how long an answer is awaited; default 100 */
    uint32_t sync_answer_ms;    /* a peer's sync request is answered at once, or this long after
                                 * the previous state when one went out more recently (requests
                                 * arriving meanwhile share the answer); <= sync_quiet_ms / 2, so
                                 * the answer reaches a requester of the same configuration
                                 * within its quiet wait; default 20 */
    uint32_t reconnect_wait_ms; /* between connection attempts; default 200 */
    /* Messages queued for the NATS client at most (the outbox); past it, or past 16 MiB, a new
     * one is dropped (publish_failures, publish_outbox_full). 1..65536; default 65536. */
    uint32_t outbox_max_messages;
    /* Fault injection for simulations and benchmarks: one change message in drop_one_in is not
     * sent although its sequence number is used (a lossy link); 0 = none. */
    uint32_t drop_one_in;
    /* Observer: called for each worker row of every applied remote message (change or state),
     * after it is applied, on the NATS client's delivery thread with the handle's lock held: it
     * must return quickly and never call the handle. NULL = none. */
    void (*on_applied)(void *user, const char *instance, uint32_t worker,
                       const km_active_load *load);
    void *on_applied_user;
    /* Called for each accepted remote approximate-mode prediction (in its sender's order), on the
     * NATS client's delivery thread with the handle's lock held: it must copy what it keeps,
     * return quickly and never call the handle. NULL = predictions are counted and dropped. */
    void (*on_prediction)(void *user, const km_cluster_prediction *prediction);
    void *on_prediction_user;
    km_log_fn log; /* may be NULL */
    void *log_user;
    /* This instance's pools from the start (as km_cluster_set_pools, which may still change
     * them): set before the handle subscribes, so the peers' first states and predictions are
     * compared with them. Read during create only. */
    const km_cluster_pool *pools;
    uint32_t n_pools;
} km_cluster_config;

void km_cluster_config_init(km_cluster_config *cfg);

/* Connect (or start retrying when NATS is unreachable: that is not an error), subscribe, start the
 * heartbeat thread (its heartbeat states, and its answers to peers' sync requests, go out from
 * then on, during the sync too) and the publisher thread (every message goes out through it, so
 * no call of this handle waits for NATS), ask the peers for their state and wait for it within
 * sync_timeout_ms. On failure *out is NULL and why (may be NULL) says what failed. Errors: KM_ERR_NULL_POINTER,
 * KM_ERR_INVALID_ARGUMENT (a field out of range, a bad id, prefix or URL), KM_ERR_OUT_OF_MEMORY,
 * KM_ERR_IO (the NATS client could not be set up). */
int km_cluster_create(const km_cluster_config *cfg, km_cluster **out, char *why, size_t why_size);
void km_cluster_destroy(km_cluster *cluster); /* NULL is a no-op */

/* This instance's load of `worker` is now *load: published as a change when it differs from the
 * last value given (an unchanged value sends nothing). Errors: KM_ERR_NULL_POINTER,
 * KM_ERR_WORKER_RANGE. A NATS failure is not an error (counted in publish_failures). */
int km_cluster_publish_load(km_cluster *cluster, uint32_t worker, const km_active_load *load);

/* km_cluster_publish_load, and also the in-flight work of `worker` that a ttft decision reads
 * beyond its load: prefixes[0..n_prefixes) the shared-prefix key of each request there that
 * declared one (km_active_share_prefix; a key listed k times has k sharers) and queued[0..n_queued)
 * the block hashes its queued prefills promise (km_active_queue_blocks). The work replaces what
 * was said before about the worker and goes out with the load (a change when either differs, and
 * every state); lists longer than KM_CLUSTER_WORK_MAX_PREFIXES / KM_CLUSTER_WORK_MAX_QUEUED are
 * cut (counted in work_truncated): only the leading ones are read, so a caller may pass a
 * longer list's full count with an array of just those. km_cluster_publish_load keeps the last
 * work given. Errors: KM_ERR_NULL_POINTER, KM_ERR_WORKER_RANGE. */
int km_cluster_publish_work(km_cluster *cluster, uint32_t worker, const km_active_load *load,
                            const uint64_t *prefixes, uint32_t n_prefixes, const uint64_t *queued,
                            uint32_t n_queued);

/* This instance assumed `hashes` (n_hashes chain hashes of a prompt's leading blocks) on
 * approximate-mode `worker` of `pool`: at a decision (lesson false) or at a router override
 * (lesson true). Published at once to the peers (only the first KM_CLUSTER_PREDICTION_MAX_HASHES
 * hashes); nothing is sent while disconnected (counted in skipped_disconnected: predictions are
 * not repeated by the heartbeat). Errors: KM_ERR_NULL_POINTER, KM_ERR_WORKER_RANGE,
 * KM_ERR_INVALID_ARGUMENT (a pool name empty or over KM_CLUSTER_POOL_MAX bytes, or not printable
 * ASCII). A NATS failure is not an error (counted in publish_failures). */
int km_cluster_publish_prediction(km_cluster *cluster, const char *pool, uint32_t worker,
                                  bool lesson, const uint64_t *hashes, uint32_t n_hashes);

/* This instance's pools are now pools[0..n_pools) (the set replaces the last one). Each state
 * message lists their names and fingerprints; a peer whose state gives another fingerprint for a
 * pool of the same name disagrees on what that pool's worker ids mean: its load on the pool's
 * workers is left out of the remote sum and its predictions for the pool are refused
 * (worker_mismatch), until its fingerprint agrees again; a prediction from a peer whose first
 * state has not arrived is refused too (no_state). Each disagreement is counted and logged once
 * when it begins. Errors: KM_ERR_NULL_POINTER, KM_ERR_INVALID_ARGUMENT (more than
 * KM_CLUSTER_MAX_POOLS, a pool name not valid in a prediction, a worker id out of range or in two
 * pools). */
int km_cluster_set_pools(km_cluster *cluster, const km_cluster_pool *pools, uint32_t n_pools);

/* Add the remote contributions' load of `worker` to *load (every field). Errors:
 * KM_ERR_NULL_POINTER, KM_ERR_WORKER_RANGE. */
int km_cluster_add_remote_load(km_cluster *cluster, uint32_t worker, km_active_load *load);

/* The remote instances' requests on `worker` that declared prefix_key (a stale contribution's
 * count too; a mismatched pool's not). 0 for invalid arguments. */
uint32_t km_cluster_remote_prefix_sharers(km_cluster *cluster, uint32_t worker,
                                          uint64_t prefix_key);

/* `from` (<= n) extended by every following block of hashes[0..n) that a remote instance's queued
 * prefill on `worker` promises (km_active_queued_depth's rule over the remote work). 0 for
 * invalid arguments. */
uint32_t km_cluster_remote_queued_depth(km_cluster *cluster, uint32_t worker,
                                        const uint64_t *hashes, uint32_t n, uint32_t from);

/* What a decision's load view was. */
typedef struct km_cluster_view {
    /* "cluster" while connected and synced, or while remote contributions are applied;
     * "this_instance" otherwise (static strings). */
    const char *scope;
    uint32_t instances;         /* remote contributions applied */
    double oldest_age_ms;       /* since the oldest applied contribution's last message; NAN
                                 * when none */
    uint32_t n_stale;           /* applied contributions marked stale (a gap, no full state yet,
                                 * or NATS disconnected) */
    char stale[8][KM_CLUSTER_INSTANCE_MAX + 1]; /* the first 8 of them, by id */
} km_cluster_view;

/* The view at now_ns (CLOCK_MONOTONIC). Expired contributions are dropped first. Errors:
 * KM_ERR_NULL_POINTER. */
int km_cluster_get_view(km_cluster *cluster, uint64_t now_ns, km_cluster_view *out);

/* Why a message on the subjects was refused; the values follow the list's order from 0. */
#define KM_CLUSTER_REFUSAL_LIST(X)                           \
    X(KM_CLUSTER_REFUSED_MALFORMED, "malformed")             \
    X(KM_CLUSTER_REFUSED_VERSION, "version")                 \
    X(KM_CLUSTER_REFUSED_SUBJECT, "subject")                 \
    X(KM_CLUSTER_REFUSED_WORKER, "worker_range")             \
    X(KM_CLUSTER_REFUSED_OWN_ID, "own_instance_id")          \
    X(KM_CLUSTER_REFUSED_OLD_INCARNATION, "old_incarnation") \
    X(KM_CLUSTER_REFUSED_DUPLICATE, "duplicate")             \
    X(KM_CLUSTER_REFUSED_TOO_MANY, "too_many_instances")     \
    X(KM_CLUSTER_REFUSED_TOO_LARGE, "too_large")             \
    X(KM_CLUSTER_REFUSED_WORKER_MISMATCH, "worker_mismatch") \
    X(KM_CLUSTER_REFUSED_NO_STATE, "no_state")

typedef enum km_cluster_refusal {
#define KM_CLUSTER_REFUSAL_ENUM(value, name) value,
    KM_CLUSTER_REFUSAL_LIST(KM_CLUSTER_REFUSAL_ENUM)
#undef KM_CLUSTER_REFUSAL_ENUM
} km_cluster_refusal;
#define KM_CLUSTER_REFUSAL_COUNT 11u

/* The name in KM_CLUSTER_REFUSAL_LIST; "unknown" for any other value. */
const char *km_cluster_refusal_name(km_cluster_refusal r);

/* url as logs and error messages show it: the secret of each URL of the list that carries
 * credentials replaced by three asterisks (the password of user:password@host:port, the token of
 * token@host:port; the user name stays), anything else as it is; cut to size - 1 bytes. */
void km_cluster_url_shown(const char *url, char *out, size_t size);

typedef struct km_cluster_stats {
    bool connected;              /* the NATS connection is up now */
    bool synced;                 /* the peers' state was taken at create (or after a reconnect) */
    double sync_seconds;         /* how long create's sync took; NAN when it did not finish */
    uint32_t sync_peers;         /* peers whose state the sync took */
    uint32_t instances;          /* remote contributions held now */
    uint32_t stale_instances;    /* of them, stale */
    uint64_t sent;               /* messages handed to the NATS client: changes, states,
                                  * predictions and sync requests */
    uint64_t applied;            /* remote messages applied */
    uint64_t predictions_sent;   /* of `sent`, approximate-mode predictions (decisions, lessons) */
    uint64_t predictions_received; /* of `applied`, remote predictions handed to on_prediction */
    uint64_t lost_messages;      /* sequence numbers never received (gaps), all instances */
    uint64_t expired_instances;  /* contributions dropped for silence */
    uint64_t restarted_instances; /* contributions replaced by a new incarnation of their id */
    uint64_t publish_failures;   /* publishes the NATS client refused, messages dropped by a
                                  * full outbox, too large to send, and drops injected */
    uint64_t publish_outbox_full; /* of publish_failures: dropped by a full outbox (NATS taking
                                   * nothing, KM_CLUSTER_OUTBOX_MAX_MESSAGES / _BYTES) */
    uint64_t publish_too_large;  /* of publish_failures: over the server's max_payload even cut
                                  * to what fits (a state without its work, a prediction's
                                  * leading hashes) */
    uint64_t skipped_disconnected; /* changes and predictions not sent while disconnected, and
                                    * queued messages the publisher took while disconnected */
    uint64_t reconnects;
    uint64_t sync_requests;      /* the peers' sync requests received */
    uint64_t sync_answers;       /* states published that answered them (each answers every
                                  * request received before it) */
    uint64_t remote_work;        /* remote prefix keys and promised hashes held now */
    uint64_t work_truncated;     /* prefix keys and promised hashes cut at the bounds (sent and
                                  * received) */
    uint64_t work_omitted;       /* messages sent without their in-flight work (over
                                  * KM_CLUSTER_MESSAGE_MAX with it) */
    uint64_t nats_errors;        /* errors the NATS client reported outside any call: the
                                  * server refusing a publish or the subscription (permissions),
                                  * the subscription falling behind, ... */
    uint64_t nats_slow_consumer; /* of nats_errors: the client dropped messages of the
                                  * subscription (they also count in lost_messages) */
    char last_nats_error[160];   /* the last of them ("" when none), printable UTF-8 */
    uint64_t refused[KM_CLUSTER_REFUSAL_COUNT]; /* by km_cluster_refusal */
    char last_refusal[160];      /* the last refused message's reason ("" when none), printable
                                  * UTF-8 whatever the message carried */
    /* (peer, pool) pairs whose fingerprints differ now, and the first 8 of them. */
    uint32_t n_mismatched;
    struct {
        char instance[KM_CLUSTER_INSTANCE_MAX + 1];
        char pool[KM_CLUSTER_POOL_MAX + 1];
        uint64_t theirs, ours;
    } mismatched[8];
} km_cluster_stats;

/* Errors: KM_ERR_NULL_POINTER. */
int km_cluster_get_stats(km_cluster *cluster, km_cluster_stats *out);

/* Propagation, for a caller that waits until one instance's changes have reached the others (the
 * simulator does, to make propagation explicit in virtual time): the incarnation of this handle
 * and the sequence number of the last change or state it queued for the publisher thread, which
 * hands them to the NATS client in order (0 = none yet). A change not sent (disconnected, dropped
 * by drop_one_in or by a full outbox) does not count. Errors:
 * KM_ERR_NULL_POINTER. */
int km_cluster_get_sent(km_cluster *cluster, uint64_t *incarnation, uint64_t *seq);

/* The incarnation and the last sequence number this handle applied from peer `instance` (its
 * contribution's). Errors: KM_ERR_NULL_POINTER, KM_ERR_NOT_FOUND (no contribution of that id is
 * held: never heard from, or expired). */
int km_cluster_get_applied(km_cluster *cluster, const char *instance, uint64_t *incarnation,
                           uint64_t *seq);

/* Set drop_one_in (km_cluster_config) of a running handle, for fault injection; 0 = no loss.
 * The count of changes made so far is kept. Errors: KM_ERR_NULL_POINTER. */
int km_cluster_set_drop_one_in(km_cluster *cluster, uint32_t drop_one_in);

#ifdef __cplusplus
}
#endif
#endif
