/* SPDX-License-Identifier: Apache-2.0 */
/* The wire protocol between routers and `kvmatch serve` (docs/PROTOCOL.md): framing, and the
 * conversion of every message between C structs and msgpack.
 *
 * A connection carries frames: a 4-byte big-endian payload length, then exactly one msgpack map.
 * Every map has "type" (a string) and "id" (a u64 the client chooses; the reply echoes it, so many
 * requests can be in flight on one connection, answered in any order).
 *
 * Three pieces, none of which does I/O:
 *  - km_frame_reader cuts an arbitrary byte stream into frames, with memory bounded by the maximum
 *    frame size; a length over the maximum is refused from the 4 header bytes alone.
 *  - km_protocol_decoder turns one frame payload into a km_message, validating every field's type
 *    and range within configured limits (km_protocol_limits).
 *  - km_protocol_encode appends one framed message to a km_frame_buffer.
 *
 * Thread-safety: none of the handles is thread-safe; use one per thread. The pure functions
 * (names, km_outcome_from_stream, km_protocol_encode on distinct buffers) are. */
#ifndef KVMATCH_PROTOCOL_H
#define KVMATCH_PROTOCOL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvmatch/error.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The only protocol version this library speaks. */
#define KM_PROTOCOL_VERSION 1u
/* Bytes of the length prefix in front of every frame. */
#define KM_FRAME_HEADER_BYTES 4u
/* Default maximum payload of one frame (the length prefix excluded). */
#define KM_PROTOCOL_DEFAULT_MAX_FRAME_BYTES (16u << 20)
/* Deepest container nesting a payload may have (msgpack-c's unpacker stack). Valid messages nest
 * at most 5 deep (message, decisions, decision, candidates, candidate row). */
#define KM_PROTOCOL_MAX_NESTING_DEPTH 32u
/* The most tokens a route may state as its prompt_tokens or its expected_output_tokens (u32's
 * range, as active work counts a request's tokens): a larger value fails the route with
 * KM_ERR_PARSE naming the field, and the encoder refuses it (KM_ERR_INVALID_ARGUMENT). */
#define KM_PROTOCOL_MAX_ROUTE_TOKENS UINT32_MAX
/* Default Unix socket path of `kvmatch serve`. */
#define KM_PROTOCOL_DEFAULT_SOCKET "/tmp/kvmatch.sock"

/* ---- limits ---------------------------------------------------------------------------------- */

/* Hard limits a decoder enforces. Every one must be >= 1. A frame over max_frame_bytes or
 * max_objects fails as a whole with KM_ERR_TOO_LARGE; an array over its limit fails the whole
 * message (a batch array) or only its item (an array inside a route), also KM_ERR_TOO_LARGE.
 * A decoder's memory is bounded by about 40 bytes per msgpack value of the largest frame
 * (msgpack-c's object tree plus the decoded copy), so by 40 * max_objects. */
typedef struct km_protocol_limits {
    uint32_t max_frame_bytes;      /* payload bytes of one frame; default 16 MiB */
    uint32_t max_objects;          /* msgpack values in one frame, map keys included; default 1 << 22 */
    uint32_t max_batch_items;      /* routes, lifecycle events, workers, pools, decisions, ack items
                                    * of one message; default 4096 */
    uint32_t max_tokens_per_route; /* "tokens" of one route; default 1 << 20 */
    uint32_t max_hashes_per_route; /* "hashes" of one route; default 1 << 16 */
    uint32_t max_candidates;       /* "candidates" of one route or decision; default 4096 */
    uint32_t max_params;           /* entries of a pool's "params"; default 64 */
    uint32_t max_string_bytes;     /* any string field; default 1024 */
} km_protocol_limits;

/* Fill `limits` with the defaults above. */
void km_protocol_limits_init(km_protocol_limits *limits);

/* ---- frame reader ---------------------------------------------------------------------------- */

typedef struct km_frame_reader km_frame_reader;

/* max_frame_bytes: largest payload accepted, >= 1 (0 = KM_PROTOCOL_DEFAULT_MAX_FRAME_BYTES).
 * Errors: KM_ERR_NULL_POINTER, KM_ERR_OUT_OF_MEMORY. */
int km_frame_reader_create(uint32_t max_frame_bytes, km_frame_reader **out);
void km_frame_reader_destroy(km_frame_reader *reader); /* NULL is a no-op */

/* Take bytes from data[0..size) up to the end of the next complete frame, and no further.
 * Returns KM_OK with *consumed = bytes taken. When a frame completed, *payload and *payload_size
 * give its payload (without the length prefix); otherwise *payload is NULL. The payload points into
 * `data` when the whole frame was in this chunk (no copy), else into the reader's buffer; either
 * way it is valid until the next call on the reader (and, for the first case, while `data` is).
 * Call again with the rest of the chunk until *consumed == size (the caller's loop:
 * `while (size) { next(...); data += consumed; size -= consumed; if (payload) handle(); }`).
 * Errors, all sticky (every later call returns the same status: the stream cannot be re-synced,
 * so the connection must be closed after an ERROR reply): KM_ERR_TOO_LARGE (declared length over
 * the maximum, found before any of its payload is buffered), KM_ERR_PROTOCOL (length 0),
 * KM_ERR_OUT_OF_MEMORY, KM_ERR_NULL_POINTER (data NULL with size > 0, or an output pointer NULL).
 * Memory: at most the declared length of the frame being assembled, grown as its bytes arrive;
 * a buffer over 64 KiB is released once its frame has been handed out. */
int km_frame_reader_next(km_frame_reader *reader, const void *data, size_t size, size_t *consumed,
                         const uint8_t **payload, size_t *payload_size);
/* The payload handed out last is no longer needed: free its buffer now when it is over 64 KiB,
 * instead of at the next call (a peer that goes quiet after a large frame holds nothing). */
void km_frame_reader_release(km_frame_reader *reader);
/* Bytes of an incomplete frame held now (0 between frames): a peer that closes with this > 0
 * sent a truncated frame. */
size_t km_frame_reader_pending(const km_frame_reader *reader);
/* True once the reader has failed (see km_frame_reader_next). */
bool km_frame_reader_failed(const km_frame_reader *reader);
/* "KM_ERR_TOO_LARGE: frame declares 4294967295 payload bytes, max_frame_bytes is 16777216";
 * "" while the reader is healthy. */
const char *km_frame_reader_last_error(const km_frame_reader *reader);

/* ---- messages -------------------------------------------------------------------------------- */

/* The enums of this header are generated from X-macro lists of X(enumerator, value, name), so that
 * an enum and its names (the *_name functions, and the decoder's reading of the same strings) can
 * never drift apart. */
#define KM_PROTOCOL_ENUM_ENTRY(enumerator, value, name) enumerator = value,

/* The wire name of each message type is its "type" string. */
#define KM_MESSAGE_TYPE_LIST(X)                                                                \
    X(KM_MESSAGE_UNKNOWN, 0, "UNKNOWN")                                                        \
    /* client -> server */                                                                     \
    X(KM_MESSAGE_HELLO, 1, "HELLO")         /* handshake, first message of a connection */     \
    X(KM_MESSAGE_ROUTE, 2, "ROUTE")         /* one or more route requests */                   \
    X(KM_MESSAGE_LIFECYCLE, 3, "LIFECYCLE") /* DISPATCHED / FIRST_TOKEN / FINISHED reports     \
                                             * (also sent as single-event messages of those    \
                                             * three types) */                                 \
    X(KM_MESSAGE_WORKERS, 4, "WORKERS")     /* add / remove / update (health) / list workers */ \
    X(KM_MESSAGE_POOLS, 5, "POOLS")         /* add / update / remove / list pools */           \
    X(KM_MESSAGE_STATUS, 6, "STATUS")       /* service summary request */                      \
    /* server -> client */                                                                     \
    X(KM_MESSAGE_WELCOME, 7, "WELCOME")   /* handshake reply */                                \
    X(KM_MESSAGE_DECISION, 8, "DECISION") /* reply to ROUTE: one decision or error per route */ \
    X(KM_MESSAGE_ACK, 9, "ACK") /* reply to LIFECYCLE and to WORKERS / POOLS add, remove,      \
                                 * update */                                                   \
    X(KM_MESSAGE_WORKER_LIST, 10, "WORKER_LIST") /* reply to WORKERS list */                   \
    X(KM_MESSAGE_POOL_LIST, 11, "POOL_LIST")     /* reply to POOLS list */                     \
    X(KM_MESSAGE_STATUS_REPLY, 12, "STATUS_REPLY")                                             \
    X(KM_MESSAGE_ERROR, 13, "ERROR") /* the whole request failed */

typedef enum km_message_type {
    KM_MESSAGE_TYPE_LIST(KM_PROTOCOL_ENUM_ENTRY)
} km_message_type;

/* Wire name ("ROUTE"); "UNKNOWN" otherwise. */
const char *km_message_type_name(km_message_type type);

typedef struct km_hello {
    uint32_t protocol_version; /* the version the client speaks */
    const char *client_name;   /* free text for logs; NULL when absent */
} km_hello;

typedef struct km_welcome {
    uint32_t protocol_version;
    const char *kvmatch_version; /* required */
    const char *server_name;     /* NULL when absent */
    km_protocol_limits limits;   /* the server's limits: a client must stay within them */
} km_welcome;

/* ---- ROUTE ---- */

typedef enum km_route_input {
    KM_ROUTE_INPUT_NONE = 0, /* only in an item that failed to decode */
    KM_ROUTE_INPUT_TOKENS = 1,
    KM_ROUTE_INPUT_HASHES = 2,
} km_route_input;

/* One route request. Strings are NUL-terminated with no NUL inside; NULL when absent. */
typedef struct km_route_request {
    /* Decode result of this item: KM_OK, or an error (message says which field) while its siblings
     * decode normally; the fields after it are then partial and must not be used, except
     * request_id / attempt_id when set. Ignored by the encoder. */
    int status;
    const char *message;

    const char *request_id; /* required, non-empty */
    const char *attempt_id; /* optional; an int on the wire is decoded as its decimal string */
    const char *model;      /* optional */
    const char *pool;       /* optional: the server's default pool, or the pool serving `model` */
    const char *endpoint;   /* optional ("/v1/chat/completions") */
    km_route_input input;   /* exactly one of tokens / hashes is on the wire */
    const uint32_t *tokens; /* token ids; the server hashes them (docs/HASHING.md) */
    uint32_t n_tokens;
    const uint64_t *hashes; /* chain hashes per full block, as docs/HASHING.md computes them */
    uint32_t n_hashes;
    uint32_t block_size;    /* 0 = absent; with hashes: the block size they were computed with */
    const char *lora_name;  /* optional */
    const char *cache_salt; /* optional */
    const uint32_t *candidates; /* optional worker ids (NULL = every worker of the pool) */
    uint32_t n_candidates;
    const char *policy;        /* optional override: "kv", "cache_aware", "prefix", ... */
    bool has_prompt_tokens;    /* absent (or 0): n_tokens for token input, unknown for hashes; the
                                * service counts at least what the input covers (PROTOCOL.md) */
    uint64_t prompt_tokens;    /* at most KM_PROTOCOL_MAX_ROUTE_TOKENS */
    bool has_expected_output_tokens;
    uint64_t expected_output_tokens; /* at most KM_PROTOCOL_MAX_ROUTE_TOKENS */
    /* true: the DECISION leaves out the candidate rows (the decision record keeps them); for
     * routers that only need the choice, at a fraction of the reply's size. */
    bool brief;
    /* true: this router carries out the warm-ups a decision asks for (km_route_decision's
     * warm_up fields, docs/PROTOCOL.md "Warm-ups"); false: no decision asks for one. */
    bool warm_ups;
} km_route_request;

typedef struct km_route_batch {
    const km_route_request *routes;
    uint32_t n_routes; /* >= 1 */
} km_route_batch;

/* ---- DECISION ---- */

#define KM_PREDICTION_SOURCE_LIST(X)                                                           \
    X(KM_PREDICTION_NONE, 0, "none")     /* only in a failed decision */                       \
    X(KM_PREDICTION_EVENTS, 1, "events") /* the index is fed by the workers' KV events         \
                                          * (observations) */                                  \
    X(KM_PREDICTION_APPROX, 2, "approx") /* the index holds decisions (predictions): this      \
                                          * instance's, and its cluster peers' */

typedef enum km_prediction_source {
    KM_PREDICTION_SOURCE_LIST(KM_PROTOCOL_ENUM_ENTRY)
} km_prediction_source;

/* "events", "approx"; "none" otherwise. */
const char *km_prediction_source_name(km_prediction_source source);

/* Active work on one worker as this kvmatch instance sees it. */
typedef struct km_worker_load {
    uint32_t in_flight;
    uint64_t pending_prefill_tokens;
    uint64_t active_decode_blocks;
} km_worker_load;

/* Candidates travel as positional rows of this many fields (docs/PROTOCOL.md, "ROUTE ->
 * DECISION", `candidates`): worker, depth, device_blocks, host_blocks, disk_blocks, in_flight,
 * pending_prefill_tokens, active_decode_blocks, cost, state, eligible. */
#define KM_CANDIDATE_ROW_FIELDS 11u

typedef struct km_candidate_score {
    uint32_t worker;
    uint32_t depth;         /* leading blocks of the request this worker holds (any tier) */
    uint32_t device_blocks; /* of those, on the GPU */
    uint32_t host_blocks;   /* in CPU memory */
    uint32_t disk_blocks;   /* on disk */
    km_worker_load load;
    double cost;       /* the policy's score (lower is better for "kv"); 0 when it has none */
    const char *state; /* index state: "LIVE", "GAP", "DEGRADED", "SYNCING", "APPROX", ... */
    bool eligible;     /* healthy and allowed by the request's candidates */
} km_candidate_score;

typedef struct km_route_decision {
    int status;          /* KM_OK, or this route failed: code and message, nothing else but ids */
    const char *message; /* NULL when status is KM_OK */
    const char *request_id;
    const char *attempt_id; /* NULL when the request had none */
    uint64_t decision_id;   /* unique within the server's life; lifecycle reports name it */
    const char *pool;
    uint32_t chosen_worker;
    uint32_t chosen_depth;
    const char *chosen_state;
    bool has_owner;        /* false when no worker holds block 0 */
    uint32_t owner_worker; /* the worker with the deepest match (the prediction's owner) */
    uint32_t owner_depth;
    const char *owner_state; /* NULL when !has_owner */
    uint32_t n_blocks;       /* full blocks in the request */
    uint32_t block_size;
    km_prediction_source source;
    const char *policy;     /* the policy that decided */
    const char *reason;     /* km_policy_reason_name: "min_cost", "below_threshold", ... */
    const char *load_kind;  /* km_policy_load_kind: "active_decode_blocks", "in_flight_requests",
                             * "none" */
    const char *load_scope; /* "this_instance" or "cluster", either possibly joined with
                             * "+engine_reported" (docs/CLUSTER.md) */
    double load_value;      /* the chosen worker's value of load_kind; NAN = none (round_robin):
                             * encoded as nil, and nil or absent decodes as NAN */
    /* With every load_scope but "this_instance" (absent with it): remote contributions applied,
     * the age of the oldest contribution (an instance's or an engine scrape) in ms (NAN = nil),
     * the stale instances' ids comma-separated ("" = none). */
    uint32_t load_instances;
    double load_oldest_age_ms;
    const char *load_stale_instances;
    const km_candidate_score *candidates;
    uint32_t n_candidates;
    /* A warm-up (only for a route with warm_ups): send a prefill of the prompt's first
     * warm_up_tokens tokens (warm_up_blocks blocks), for one output token that nobody waits for,
     * to warm_up_worker, and report its lifecycle under warm_up_decision_id like any decision's
     * (with request_id and warm_up_attempt_id when ids are given). All 0 / NULL when has_warm_up
     * is false. */
    bool has_warm_up;
    const char *warm_up_attempt_id; /* its attempt id: the decision's attempt_id + ":warm_up" */
    uint32_t warm_up_worker;
    uint32_t warm_up_blocks;
    uint64_t warm_up_tokens;
    uint64_t warm_up_decision_id;
} km_route_decision;

typedef struct km_decision_batch {
    const char *kvmatch_version;
    const km_route_decision *decisions; /* one per route, in the request's order */
    uint32_t n_decisions;
} km_decision_batch;

/* ---- LIFECYCLE ---- */

#define KM_LIFECYCLE_KIND_LIST(X)                                                              \
    X(KM_LIFECYCLE_NONE, 0, "NONE") /* only in an item that failed to decode */                \
    X(KM_LIFECYCLE_DISPATCHED, 1, "DISPATCHED")                                                \
    X(KM_LIFECYCLE_FIRST_TOKEN, 2, "FIRST_TOKEN")                                              \
    X(KM_LIFECYCLE_FINISHED, 3, "FINISHED")

typedef enum km_lifecycle_kind {
    KM_LIFECYCLE_KIND_LIST(KM_PROTOCOL_ENUM_ENTRY)
} km_lifecycle_kind;

#define KM_OUTCOME_LIST(X)                                                                     \
    X(KM_OUTCOME_NONE, 0, "none")                                                              \
    X(KM_OUTCOME_COMPLETE, 1, "complete")     /* the final finish_reason and the [DONE]        \
                                               * sentinel were seen */                         \
    X(KM_OUTCOME_INCOMPLETE, 2, "incomplete") /* the stream ended without them, whatever the   \
                                               * HTTP status */                                \
    X(KM_OUTCOME_ERROR, 3, "error")           /* an error was reported or the HTTP status was  \
                                               * not 2xx */                                    \
    X(KM_OUTCOME_CANCELLED, 4, "cancelled")   /* the client went away */

typedef enum km_outcome {
    KM_OUTCOME_LIST(KM_PROTOCOL_ENUM_ENTRY)
} km_outcome;

/* "DISPATCHED", "FIRST_TOKEN", "FINISHED"; "NONE" otherwise. */
const char *km_lifecycle_kind_name(km_lifecycle_kind kind);
/* "complete", "incomplete", "error", "cancelled"; "none" otherwise. */
const char *km_outcome_name(km_outcome outcome);

/* The outcome rule (docs/PROTOCOL.md): error when `error` is non-empty or an HTTP status is known
 * and not 2xx; else complete when finish_reason is non-empty and done_seen; else incomplete. */
km_outcome km_outcome_from_stream(const char *finish_reason, bool done_seen, bool has_http_status,
                                  uint32_t http_status, const char *error);

typedef struct km_lifecycle_event {
    int status; /* decode result of this item, as in km_route_request */
    const char *message;
    km_lifecycle_kind kind;
    /* Which attempt: decision_id, or request_id (+ attempt_id), or both; at least one. */
    bool has_decision_id;
    uint64_t decision_id;
    const char *request_id;
    const char *attempt_id;
    bool has_worker; /* the worker actually dispatched to, when the router knows it */
    uint32_t worker;
    bool has_elapsed_ms; /* router clock: ms from the request's arrival at the router */
    double elapsed_ms;
    /* FINISHED only (ignored otherwise) */
    km_outcome outcome; /* decoded: as sent (complete only if the rule allows), else derived */
    const char *finish_reason;
    bool done_seen;
    bool has_http_status;
    uint32_t http_status;
    const char *error;
    bool has_cached_tokens; /* engine-reported cached prompt tokens; absent = unknown */
    uint64_t cached_tokens;
    bool has_prompt_tokens;
    uint64_t prompt_tokens;
    bool has_output_tokens;
    uint64_t output_tokens;
    uint32_t retries;
} km_lifecycle_event;

typedef struct km_lifecycle_batch {
    const km_lifecycle_event *events;
    uint32_t n_events; /* >= 1 */
} km_lifecycle_batch;

/* ---- ACK ---- */

typedef struct km_item_status {
    int status;          /* KM_OK or a km_status */
    const char *message; /* NULL when status is KM_OK */
} km_item_status;

typedef struct km_ack {
    const km_item_status *items; /* one per item of the request, in order */
    uint32_t n_items;
} km_ack;

/* ---- WORKERS / POOLS / STATUS ---- */

#define KM_ADMIN_ACTION_LIST(X)                                                                \
    X(KM_ADMIN_NONE, 0, "none")                                                                \
    X(KM_ADMIN_ADD, 1, "add")                                                                  \
    X(KM_ADMIN_REMOVE, 2, "remove")                                                            \
    X(KM_ADMIN_UPDATE, 3, "update") /* POOLS: policy and parameters; WORKERS: the router's     \
                                     * health verdict */                                       \
    X(KM_ADMIN_LIST, 4, "list")

typedef enum km_admin_action {
    KM_ADMIN_ACTION_LIST(KM_PROTOCOL_ENUM_ENTRY)
} km_admin_action;

/* "add", "remove", "update", "list"; "none" otherwise. */
const char *km_admin_action_name(km_admin_action action);

/* A worker: configuration (add; remove needs pool and worker only) and, in WORKER_LIST and
 * STATUS_REPLY, its runtime view. */
typedef struct km_worker_info {
    int status; /* decode result of this item */
    const char *message;
    const char *pool; /* required */
    uint32_t worker;  /* required; unique within the service */
    const char *name;
    const char *event_endpoint;  /* ZMQ PUB endpoint; NULL: approximate mode for this worker */
    const char *replay_endpoint; /* ZMQ ROUTER endpoint for replays; NULL when none */
    bool has_dp_rank;
    uint32_t dp_rank;
    /* The router's own verdict on the worker (its health checks): add (default true) and update
     * (required) set it; replies echo it. An unhealthy worker is never chosen. */
    bool has_healthy;
    bool healthy;
    /* runtime (replies only) */
    const char *state; /* "LIVE", "GAP", ...; NULL when absent */
    bool has_blocks;
    uint64_t blocks;
    bool has_last_event_age_s;
    double last_event_age_s;
    bool has_expected_seq; /* event-fed workers: the next seq the index will apply; every message
                            * before it is in the index (or was found lost) */
    uint64_t expected_seq;
    bool has_load;
    km_worker_load load;
    /* The circuit breaker this instance keeps from the attempts' outcomes (SERVICE.md, "Worker
     * health"): "closed", "open" (failures reached the threshold: not chosen until the cooldown
     * ends), "half_open" (cooldown over: chosen only while no probe, an attempt decided for it
     * since, is in flight, and the next outcome closes or reopens it); NULL when absent. */
    const char *breaker;
    bool has_failures;
    uint32_t failures; /* attempts in a row whose outcome was error or incomplete */
    bool has_eligible;
    bool eligible; /* a route naming it could choose it now: healthy and the breaker allows it */
} km_worker_info;

typedef struct km_workers_message {
    km_admin_action action;    /* ADD, REMOVE, UPDATE, LIST (request); LIST (WORKER_LIST reply) */
    const char *pool;          /* LIST request: only this pool; NULL = all */
    const km_worker_info *workers; /* ADD / REMOVE / UPDATE requests and WORKER_LIST replies */
    uint32_t n_workers;
} km_workers_message;

/* A named numeric policy parameter ("temperature", "cache_threshold", "approx_ttl_s", ...). */
typedef struct km_param {
    const char *name;
    double value;
} km_param;

typedef struct km_pool_info {
    int status; /* decode result of this item */
    const char *message;
    const char *name;    /* required */
    const char *model;   /* NULL when absent */
    uint32_t block_size; /* 0 = absent (UPDATE: unchanged) */
    /* Tokens after each block its hash covers (the engines' lookahead hashing, docs/HASHING.md);
     * 0 = none or absent. Set at ADD only: UPDATE refuses a value other than the pool's. */
    uint32_t hash_lookahead_tokens;
    const char *policy;  /* NULL when absent */
    /* The engine model the pool's workers run (a km_engine_model_preset name: what `ttft` and
     * `preble` time work with, `llmd`'s KV capacity); NULL when absent: the default preset at ADD.
     * Set at ADD only: UPDATE refuses another preset than the pool's. POOL_LIST: the pool's
     * preset, NULL when its model is none of them. */
    const char *engine;
    const km_param *params;
    uint32_t n_params;
    /* Blocks per offloaded chunk of the engines' KV connector, by which placeholder stores are
     * placed (km_feed_config.offload_chunk_blocks); 0 = absent: 1 at ADD. Set at ADD only:
     * UPDATE refuses a value other than the pool's. 1 to KM_FEED_MAX_OFFLOAD_CHUNK_BLOCKS when
     * present. */
    uint32_t offload_chunk_blocks;
} km_pool_info;

typedef struct km_pools_message {
    km_admin_action action; /* ADD, UPDATE, REMOVE (by name), LIST (request); LIST (POOL_LIST) */
    const km_pool_info *pools;
    uint32_t n_pools;
} km_pools_message;

typedef struct km_status_reply {
    const char *kvmatch_version; /* required */
    double uptime_s;
    bool ready;           /* the /readyz answer */
    uint32_t connections; /* router connections open now */
    uint64_t decisions;   /* since start */
    uint64_t records_dropped;
    const char *backend; /* "cpu", "cuda"; NULL when absent */
    const km_worker_info *workers;
    uint32_t n_workers;
} km_status_reply;

typedef struct km_error_reply {
    int code;            /* a negative km_status */
    const char *name;    /* km_error_name(code) */
    const char *message; /* the detail */
} km_error_reply;

/* One message. `type` says which member of the union is meaningful. STATUS has no body. */
typedef struct km_message {
    km_message_type type;
    bool has_id; /* false only for a message that failed to decode before its id was read */
    uint64_t id;
    union {
        km_hello hello;
        km_welcome welcome;
        km_route_batch route;
        km_decision_batch decision;
        km_lifecycle_batch lifecycle;
        km_ack ack;
        km_workers_message workers; /* WORKERS and WORKER_LIST */
        km_pools_message pools;     /* POOLS and POOL_LIST */
        km_status_reply status_reply;
        km_error_reply error;
    };
} km_message;

/* ---- decoder --------------------------------------------------------------------------------- */

typedef struct km_protocol_decoder km_protocol_decoder;

/* limits NULL = defaults. Errors: KM_ERR_NULL_POINTER, KM_ERR_INVALID_ARGUMENT (a limit of 0),
 * KM_ERR_OUT_OF_MEMORY. */
int km_protocol_decoder_create(const km_protocol_limits *limits, km_protocol_decoder **out);
void km_protocol_decoder_destroy(km_protocol_decoder *decoder); /* NULL is a no-op */

/* Decode one frame payload (without its length prefix).
 *
 * Memory: everything *out points to lives in the decoder and stays valid until the next decode
 * call on it, km_protocol_decoder_release or its destruction; the payload may be released as soon
 * as the call returns. Without a release the decoder keeps its largest chunk for reuse.
 *
 * Errors. The message as a whole fails (return value) when the payload is not exactly one
 * well-formed msgpack map (KM_ERR_PARSE), is over max_objects or nests too deep
 * (KM_ERR_TOO_LARGE), lacks a valid "type" or "id" (KM_ERR_PARSE), names a type this library does
 * not know (KM_ERR_PROTOCOL), has a batch array over max_batch_items (KM_ERR_TOO_LARGE) or a
 * message-level field of the wrong type or range (KM_ERR_PARSE). out->type and out->id / has_id
 * are still set as far as they were read, so the server can answer with an ERROR carrying the id
 * (and keep the connection) when out->has_id, and must close it otherwise. A field inside one item
 * of a batch (a route, a lifecycle event, a worker, a pool) that is missing, mistyped, out of range
 * or over a limit fails only that item: the call succeeds and the item's status / message say
 * what (KM_ERR_PARSE, KM_ERR_TOO_LARGE, or KM_ERR_INVALID_ARGUMENT for a value the rules forbid,
 * such as outcome "complete" without finish_reason and done_seen). Unknown fields are ignored; a
 * string key present twice in one map, a field's name or not, is KM_ERR_PARSE. Every message
 * names the field: "KM_ERR_PARSE: routes[3].tokens[7]: expected an int in 0..4294967295, got str".
 * Also KM_ERR_NULL_POINTER and KM_ERR_OUT_OF_MEMORY. */
int km_protocol_decode(km_protocol_decoder *decoder, const void *payload, size_t payload_size,
                       km_message *out);
/* Detail of the last failed decode; "" after a success. Valid until the next call. */
const char *km_protocol_decoder_last_error(const km_protocol_decoder *decoder);
/* The message decoded last is no longer needed: give back everything its decoding grew beyond the
 * decoder's first 64 KiB chunk (a frame of 4 M values builds ~96 MB). Its contents are invalid
 * afterwards. The server calls it after every frame, so its memory does not grow with the number
 * of idle connections that once sent a large one. A no-op after a small message. */
void km_protocol_decoder_release(km_protocol_decoder *decoder);

/* ---- encoder --------------------------------------------------------------------------------- */

/* A growable byte buffer of whole frames, ready to write to a socket. */
typedef struct km_frame_buffer {
    uint8_t *data;
    size_t size;     /* bytes of complete frames */
    size_t capacity; /* bytes allocated */
} km_frame_buffer;

void km_frame_buffer_init(km_frame_buffer *buffer);
void km_frame_buffer_free(km_frame_buffer *buffer); /* frees and re-initializes; NULL is a no-op */
/* Drop the first n bytes (already written to the socket). */
void km_frame_buffer_consume(km_frame_buffer *buffer, size_t n);

/* Append `msg` as one frame (length prefix + msgpack map) to `buffer`. Only the fields that belong
 * to msg->type are written; optional fields whose has_ flag is false or whose pointer is NULL are
 * left out. Item status / message fields of requests are not written. The encoder checks what a
 * decoder would otherwise reject in the peer: required strings present, a route with exactly one
 * of tokens / hashes, a non-OK item status with a message, codes negative in ERROR replies
 * (KM_ERR_INVALID_ARGUMENT with a message naming the field), arrays whose count > 0 have a pointer
 * (KM_ERR_NULL_POINTER), and the frame within max_frame_bytes (KM_ERR_TOO_LARGE; 0 = default).
 * On error the buffer is unchanged and, when `why` is not NULL, why[0..why_size) holds the
 * detail. Thread-safe for distinct buffers. */
int km_protocol_encode(const km_message *msg, uint32_t max_frame_bytes, km_frame_buffer *buffer,
                       char *why, size_t why_size);

/* Convenience: an ERROR reply for request `id` (0 when unknown) with km_error_name(code). */
int km_protocol_encode_error(uint64_t id, int code, const char *message, km_frame_buffer *buffer);

#ifdef __cplusplus
}
#endif
#endif
