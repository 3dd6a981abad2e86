/* SPDX-License-Identifier: Apache-2.0 */
/* Linked decision and outcome records (docs/RECORDS.md, schema docs/records.schema.json).
 *
 * Every routing decision leaves one JSON line (a decision record) and every attempt's end one more
 * (an outcome record); an analyzer joins them by decision_id, or by request_id + attempt_id. Each
 * number in a record says where it came from: the prediction's source ("events": the workers' own
 * KV events; "approx": this instance's past decisions), its input representation and units, the
 * worker that owns the best match apart from the worker chosen, the load signal's kind and scope
 * (what this kvmatch instance saw, never cluster-wide), and, in the outcome, what the engine itself
 * reported (cached tokens) next to the depth that was predicted.
 *
 * Two parts:
 *  - formatting: plain structs the service fills, and pure functions that turn one into a single
 *    line of JSON (written field by field; no newline inside, none at the end). Missing values are JSON null,
 *    never 0: km_decision_record_init / km_outcome_record_init set every optional field to its
 *    "absent" value (KM_RECORD_ABSENT for integers, NAN for reals, NULL for strings,
 *    KM_RECORD_FLAG_UNKNOWN for booleans). Thread-safe (no shared state).
 *  - km_record_writer: a background writer that appends lines to a JSONL file with size-based
 *    rotation. Submitting never does I/O and never waits for it: km_record_writer_submit copies a
 *    formatted line, km_record_writer_submit_decision / _outcome deep-copy a record struct and
 *    leave the formatting to the writer thread, so the routing thread pays for neither; a full
 *    bounded queue refuses the record (KM_ERR_OVERLOADED, counted as dropped). One writer thread
 *    per handle formats and does buffered appends.
 *
 * Clocks: every `monotonic_ns` is CLOCK_MONOTONIC of the host kvmatch runs on (the record's
 * "host"), comparable only with other monotonic times from the same host and boot; every `wall_ns`
 * is CLOCK_REALTIME in nanoseconds since the Unix epoch, written as RFC 3339 UTC with
 * microseconds. Durations in records are differences of monotonic times taken on this host. */
#ifndef KVMATCH_RECORDS_H
#define KVMATCH_RECORDS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvmatch/error.h"
#include "kvmatch/log.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The "schema_version" every record carries; bumped on any incompatible change of the format. */
#define KM_RECORD_SCHEMA_VERSION 1

/* An absent integer field: written as JSON null. Every other integer field must be >= 0. */
#define KM_RECORD_ABSENT INT64_MIN

/* Most candidates one decision record lists (a longer list is KM_ERR_TOO_LARGE). */
#define KM_RECORD_MAX_CANDIDATES 65534u

/* A tri-state boolean: zero-initialised means unknown (JSON null). */
typedef enum km_record_flag {
    KM_RECORD_FLAG_UNKNOWN = 0,
    KM_RECORD_FLAG_FALSE = 1,
    KM_RECORD_FLAG_TRUE = 2,
} km_record_flag;

/* The enums below are X-macro lists, X(NAME, value, "name"): the list generates the enum, and
 * km_record_*_name the names records use. */

/* Where the overlap prediction came from. The values equal protocol.h's km_prediction_source.
 *   events  fed by the workers' KV events (observations)
 *   approx  learned from this instance's own decisions */
#define KM_RECORD_SOURCE_LIST(X)            \
    X(KM_RECORD_SOURCE_EVENTS, 1, "events") \
    X(KM_RECORD_SOURCE_APPROX, 2, "approx")

/* What the router sent to be scored.
 *   tokens  token ids, hashed by kvmatch
 *   hashes  chain hashes computed by the router */
#define KM_RECORD_INPUT_LIST(X)            \
    X(KM_RECORD_INPUT_TOKENS, 1, "tokens") \
    X(KM_RECORD_INPUT_HASHES, 2, "hashes")

/* How an attempt ended. Values 1..4 equal protocol.h's km_outcome; EXPIRED is the record's own.
 *   complete    the final finish_reason and the [DONE] sentinel were both seen (only then)
 *   incomplete  the stream ended without them, whatever the HTTP status
 *   error       the upstream or the router reported an error
 *   cancelled   the client or the router cancelled it, or the router never received the
 *               decision (its connection closed before the reply was written; `error` says so)
 *   expired     FINISHED never came; the active-work entry hit its TTL */
#define KM_RECORD_OUTCOME_LIST(X)                    \
    X(KM_RECORD_OUTCOME_COMPLETE, 1, "complete")     \
    X(KM_RECORD_OUTCOME_INCOMPLETE, 2, "incomplete") \
    X(KM_RECORD_OUTCOME_ERROR, 3, "error")           \
    X(KM_RECORD_OUTCOME_CANCELLED, 4, "cancelled")   \
    X(KM_RECORD_OUTCOME_EXPIRED, 5, "expired")

#define KM_RECORD_ENUM_ENTRY(name, value, text) name = value,
typedef enum km_record_source { KM_RECORD_SOURCE_LIST(KM_RECORD_ENUM_ENTRY) } km_record_source;
typedef enum km_record_input { KM_RECORD_INPUT_LIST(KM_RECORD_ENUM_ENTRY) } km_record_input;
typedef enum km_record_outcome { KM_RECORD_OUTCOME_LIST(KM_RECORD_ENUM_ENTRY) } km_record_outcome;
#undef KM_RECORD_ENUM_ENTRY

/* A moment, on both clocks (either may be KM_RECORD_ABSENT). */
typedef struct km_record_time {
    int64_t wall_ns;      /* CLOCK_REALTIME, ns since the Unix epoch */
    int64_t monotonic_ns; /* CLOCK_MONOTONIC of this host */
} km_record_time;

/* Both clocks, now. */
km_record_time km_record_time_now(void);

/* Fields every record carries. Strings are borrowed: they must stay valid until the format call
 * returns; they must be valid UTF-8 (any byte sequence that is not is KM_ERR_INVALID_ARGUMENT
 * for the format functions; the writer's submit_decision / _outcome copies replace it, see there).
 * "required" strings must be non-NULL (they may be empty); the others may be NULL (JSON null). */
typedef struct km_record_common {
    int64_t record_id;            /* required, >= 0: unique per record within an instance */
    const char *instance;         /* required: this kvmatch process (km_record_instance_id) */
    const char *host;             /* the host whose monotonic clock the record uses; NULL = null */
    const char *kvmatch_version;  /* required, e.g. KVMATCH_VERSION */
    int64_t decision_id;          /* required, >= 0: unique within an instance */
    const char *request_id;       /* required: router-supplied */
    const char *attempt_id;       /* required: router-supplied */
    const char *model;            /* required */
    const char *pool;             /* required */
    const char *endpoint;         /* e.g. "/v1/chat/completions"; NULL = null */
    km_record_time time;          /* when the record's event happened (decision made, outcome
                                   * known); both clocks required */
} km_record_common;

/* One worker's state at the decision: in the owner / chosen summaries and per candidate. */
typedef struct km_record_worker {
    const char *worker;   /* the worker's name; for the owner NULL = no worker holds any block */
    const char *state;    /* its index state: "LIVE", "GAP", "SYNCING", "DEGRADED", "APPROX", ...
                           * (upper case letters and '_'); NULL = null (only when worker is NULL) */
    int64_t depth_blocks; /* leading blocks of the request it holds (any tier); required >= 0 */
} km_record_worker;

/* A candidate the policy weighed. Every integer may be KM_RECORD_ABSENT, cost may be NAN. */
typedef struct km_record_candidate {
    const char *worker;                /* required */
    const char *state;                 /* required: index state, as in km_record_worker */
    int64_t depth_blocks;              /* required: leading blocks held, any tier */
    int64_t device_blocks;             /* of those leading blocks: held in device memory */
    int64_t host_blocks;               /* ... in host memory */
    int64_t disk_blocks;               /* ... on disk or other external tiers */
    int64_t in_flight;                 /* load this instance saw: requests in flight */
    int64_t pending_prefill_tokens;    /* prefill tokens not yet processed */
    int64_t active_decode_blocks;      /* KV blocks of decodes in progress */
    /* depth_blocks extended by the blocks prefills queued on it will store (km_active_queued_depth);
     * absent (null) where the pool keeps no queued prefixes */
    int64_t queued_depth_blocks;
    /* this instance's arrival count at the worker's latest arrival (km_active_last_arrival): a
     * larger value is a later arrival; 0 = none seen */
    int64_t last_arrival;
    double cost;                       /* what the policy compared (RECORDS.md); NAN = null */
    bool eligible;                     /* could be chosen: healthy, breaker not open (init: true) */
} km_record_candidate;

typedef struct km_decision_record {
    km_record_common common;

    /* prediction */
    km_record_source source;           /* required */
    km_record_input input;             /* required */
    int64_t block_size;                /* required >= 1: tokens per block */
    int64_t block_count;               /* required: full blocks in the request's input */
    int64_t prompt_tokens;             /* prompt tokens as the router counted them; absent = null */
    int64_t expected_output_tokens;    /* router's estimate; absent = null */
    int64_t scored_monotonic_ns;       /* when the index was probed for it; absent = null */
    km_record_worker owner;            /* deepest match (worker NULL: none); ties broken as the
                                        * policy broke them */
    km_record_worker chosen;           /* required: the worker chosen (may differ from owner) */

    /* decision */
    const char *policy;                /* required: "kv", "cache_aware", "prefix", "least_load",
                                        * "round_robin" (lower case, digits, '_') */
    const char *reason;                /* why this worker, e.g. "min_cost"; NULL = null */
    const char *load_kind;             /* required: the load signal, e.g. "in_flight_requests" */
    double load_value;                 /* the chosen worker's value of that signal; NAN = null */
    /* Whose load view the decision used (docs/CLUSTER.md): "this_instance" (NULL means it),
     * "cluster", "this_instance+engine_reported" or "cluster+engine_reported" (some candidate's
     * fresh engine scrape used); any other is refused. With every scope but "this_instance" the
     * record adds load_instances (remote contributions applied), load_oldest_age_ms (since the
     * oldest contribution, an instance's last message or an engine scrape; NAN = null) and
     * load_stale_instances (the stale ones' ids, comma-separated; NULL = none). */
    const char *load_scope;
    int64_t load_instances;
    double load_oldest_age_ms;
    const char *load_stale_instances;
    /* The engine model's predicted time to first token on the chosen worker, from the decision,
     * in ms (km_policy_decision.chosen_predicted_ttft_ms); NAN = null (a warm-up's). */
    double predicted_ttft_ms;

    const km_record_candidate *candidates; /* may be NULL when n_candidates == 0 */
    size_t n_candidates;

    /* The warm-up this decision asked for (docs/RECORDS.md, decision.warm_up): the worker to warm
     * (NULL = none, the field is null), the leading blocks of the request to prefill there and
     * the warm-up's own decision id, both required >= 0 with a worker. */
    struct {
        const char *worker;
        int64_t blocks;
        int64_t decision_id;
    } warm_up;
    /* This decision is the warm-up that decision warm_up_for asked for; KM_RECORD_ABSENT = not a
     * warm-up (null). */
    int64_t warm_up_for;
} km_decision_record;

typedef struct km_outcome_record {
    km_record_common common;

    km_record_outcome outcome;         /* required */
    const char *finish_reason;         /* final finish_reason from the stream; NULL = null */
    km_record_flag done_seen;          /* the [DONE] sentinel was seen */
    int64_t http_status;               /* upstream HTTP status; absent = null */
    const char *error;                 /* error text; NULL = null */
    int64_t cached_tokens;             /* engine-reported cached prompt tokens; absent (not
                                        * reported) = null, which is not 0 */
    int64_t prompt_tokens;
    int64_t output_tokens;
    int64_t retries;                   /* retries before this attempt, as the router counted */
    km_record_time decided;            /* when the decision was made (copied from the decision) */
    km_record_time dispatched;         /* DISPATCHED received; absent = null */
    km_record_time first_token;        /* FIRST_TOKEN received */
    km_record_time finished;           /* FINISHED received (or the TTL expiry) */
    /* wait_ns = dispatched - decided and ttft_ns = first_token - decided are derived from the
     * monotonic times when both ends are present, else null. */
    /* The router's own clock, as it reported (`elapsed_ms` of each lifecycle event): ms from the
     * request's arrival at the router to DISPATCHED, FIRST_TOKEN and FINISHED; NAN = null. */
    double router_dispatched_ms;
    double router_ttft_ms;
    double router_e2e_ms;

    /* the prediction, copied from the decision so a reader can compare without a join */
    const char *worker;                /* required: the worker the decision chose */
    const char *dispatched_worker;     /* the worker the router reported it used instead (a
                                        * lifecycle event's `worker`); NULL = null: none reported,
                                        * or the chosen one */
    km_record_source source;           /* required */
    int64_t block_size;                /* required >= 1 */
    int64_t predicted_depth_blocks;    /* required: the chosen worker's predicted depth */
    const char *owner_worker;          /* NULL = no worker held any block */
    int64_t owner_depth_blocks;        /* required */
} km_outcome_record;

/* Set every optional field to absent and every other field to 0 / NULL. */
void km_decision_record_init(km_decision_record *record);
void km_outcome_record_init(km_outcome_record *record);
void km_record_candidate_init(km_record_candidate *candidate);

/* Copy what an outcome record repeats from its decision: common fields (record_id, time and
 * host-specific fields too, which the caller then overwrites), decided time, worker, source,
 * block size, predicted depth and owner. Pointers are copied, not the strings. */
void km_outcome_record_from_decision(km_outcome_record *outcome,
                                     const km_decision_record *decision);

/* Format one record as one line of compact JSON, without a trailing newline. On success *line is a
 * NUL-terminated malloc'd string (free() it) and *len its length. On failure *line is NULL and
 * error (if non-NULL, error_size bytes) holds a sentence naming the field.
 * Errors: KM_ERR_NULL_POINTER (record, line, len, a required string), KM_ERR_INVALID_ARGUMENT
 * (an enum out of range, a negative number, block_size < 1, a string that is not valid UTF-8, a
 * state name not of upper case letters and '_', an infinite real), KM_ERR_TOO_LARGE (more than
 * KM_RECORD_MAX_CANDIDATES candidates), KM_ERR_OUT_OF_MEMORY. */
int km_decision_record_format(const km_decision_record *record, char **line, size_t *len,
                              char *error, size_t error_size);
int km_outcome_record_format(const km_outcome_record *record, char **line, size_t *len,
                             char *error, size_t error_size);

/* Names used in records ("events", "tokens", "complete", ...); "unknown" when out of range. */
const char *km_record_source_name(km_record_source source);
const char *km_record_input_name(km_record_input input);
const char *km_record_outcome_name(km_record_outcome outcome);

/* A fresh random instance id: 32 lower-case hex digits and a NUL (33 bytes). KM_OK, or KM_ERR_IO
 * when the system's random source failed. */
int km_record_instance_id(char out[33]);

/* ---- the background writer ------------------------------------------------------------------- */

typedef struct km_record_writer km_record_writer;

typedef struct km_record_writer_config {
    const char *path;          /* required: the JSONL file; appended to when it exists */
    uint64_t max_file_bytes;   /* rotate when the next line would make the file larger; 0 = never;
                                * default 256 MiB. A line is never split: one longer than this
                                * goes alone into a file. */
    uint32_t keep_files;       /* rotated files kept: path.1 (newest) .. path.N (oldest); older ones
                                * are deleted; 0 = rotation just starts path again, keeping nothing;
                                * default 8 */
    uint64_t max_kept_bytes;   /* the rotated files together, at most (the oldest go first); checked
                                * at each rotation; 0 = no byte limit (the default) */
    uint64_t max_age_s;        /* a rotated file last written longer ago is deleted at the next
                                * rotation; 0 = no age limit (the default) */
    uint32_t queue_capacity;   /* records waiting or being written, at most; >= 1; default 65,536 */
    uint64_t max_queue_bytes;  /* bytes of those records, at most; >= 1; default 64 MiB */
    uint64_t max_line_bytes;   /* longest line accepted; default 1 MiB */
    uint32_t flush_interval_ms; /* a line reaches the kernel at most this long after the writer
                                 * takes it (it is buffered meanwhile); >= 1; default 200 */
    km_log_fn log;             /* one line per I/O failure and per recovery; NULL = stderr */
    void *log_user;
} km_record_writer_config;

typedef struct km_record_writer_counters {
    uint64_t submitted;    /* lines accepted by submit */
    uint64_t dropped;      /* lines refused because the queue was full (KM_ERR_OVERLOADED) */
    uint64_t written;      /* lines written to a file (passed to the kernel) */
    uint64_t failed;       /* lines lost to an I/O error (open, write) */
    uint64_t invalid;      /* records queued by submit_decision / submit_outcome that did not
                            * format (a bad field; the sentence is in last_error) */
    uint64_t pending;      /* accepted, not yet written, failed or invalid:
                            * submitted - written - failed - invalid */
    uint64_t bytes;        /* bytes written, newlines included */
    uint64_t rotations;    /* files rotated */
    uint64_t deleted_files;   /* files deleted by retention (keep_files, max_kept_bytes, max_age_s) */
    uint64_t deleted_records; /* records (lines) in them: every record rotation deleted, whoever
                               * wrote it; each rotation that deletes logs one line */
    uint64_t deleted_bytes;
    uint64_t write_errors; /* failed system calls (open, write, fdatasync, rename) */
    int last_error_status; /* status of the last failure (KM_ERR_IO, or a format error of an
                            * invalid record; KM_OK when none) */
    bool failing;          /* the last I/O operation failed: lines are being lost now; cleared
                            * by the next successful write */
} km_record_writer_counters;

void km_record_writer_config_init(km_record_writer_config *cfg);

/* Start the writer thread. The file is opened (created, mode 0644) lazily by the thread; a file
 * that cannot be opened is an I/O failure counted in the stats, not a create error, so the service
 * keeps routing and the writer retries the open for later lines. A file that does not end with a
 * newline (a crash mid-line) gets one first, so the next record starts on its own line.
 * Errors: KM_ERR_NULL_POINTER (cfg, cfg->path, out), KM_ERR_INVALID_ARGUMENT (an empty path, a
 * limit of 0), KM_ERR_OUT_OF_MEMORY, KM_ERR_INTERNAL (thread creation failed). */
int km_record_writer_create(const km_record_writer_config *cfg, km_record_writer **out);

/* Write everything queued, fdatasync, stop the thread, close the file. NULL is a no-op. Must not
 * race with any other call on the handle. A writer stuck in write() (a FIFO nobody reads) blocks
 * this call until the write returns. */
void km_record_writer_destroy(km_record_writer *writer);

/* Queue a copy of line[0..len) (one record, without its newline; the writer appends it). Never does
 * I/O and never waits for it: it takes a mutex held only for pointer updates.
 * Errors: KM_ERR_NULL_POINTER, KM_ERR_INVALID_ARGUMENT (len 0, or a '\n' in the line),
 * KM_ERR_TOO_LARGE (len > max_line_bytes), KM_ERR_OVERLOADED (queue full; counted in dropped),
 * KM_ERR_OUT_OF_MEMORY (counted in dropped), KM_ERR_SHUTTING_DOWN (destroy has begun).
 * Thread-safe. */
int km_record_writer_submit(km_record_writer *writer, const char *line, size_t len);

/* Queue a deep copy of a record (every string and the candidate array are copied; the caller's
 * memory may change as soon as this returns). In the copy every ill-formed UTF-8 sequence of a
 * string (its maximal subpart) is replaced by U+FFFD: strings a router sent are not checked on
 * the wire, and one bad byte must not lose the whole record. The writer thread formats it, so
 * formatting never runs on the caller's thread. A record that fails to format there is counted as `invalid` with the sentence
 * in last_error (what km_decision_record_format would have returned); check records in tests
 * with the format functions. Same queue, limits and errors as km_record_writer_submit (the copy's
 * size counts against max_queue_bytes), plus KM_ERR_TOO_LARGE (more than
 * KM_RECORD_MAX_CANDIDATES candidates) and KM_ERR_NULL_POINTER (candidates NULL with
 * n_candidates > 0). Thread-safe. */
int km_record_writer_submit_decision(km_record_writer *writer, const km_decision_record *record);
int km_record_writer_submit_outcome(km_record_writer *writer, const km_outcome_record *record);

/* Wait until every line submitted before this call is written (or failed) and the file is
 * fdatasync'ed, or timeout_ms passes (0 = wait forever). KM_OK when all of them reached the disk;
 * KM_ERR_IO when a line failed since the previous flush returned, or fdatasync failed;
 * KM_ERR_INVALID_ARGUMENT when a queued record did not format since then; KM_ERR_TIMEOUT.
 * Thread-safe. */
int km_record_writer_flush(km_record_writer *writer, uint32_t timeout_ms);

/* Close the file once the lines submitted before this call are written to it; the next line
 * opens the path again (creating it). For an outside rotation that copies and truncates or moves
 * the file (logrotate's postrotate, SIGHUP): lines never go to a file no one reads. Never waits.
 * Errors: KM_ERR_NULL_POINTER. Thread-safe. */
int km_record_writer_reopen(km_record_writer *writer);

/* Counters now. Thread-safe. */
void km_record_writer_stats(km_record_writer *writer, km_record_writer_counters *out);

/* The last failure's sentence is kept within this many bytes, its NUL included. */
#define KM_RECORD_WRITER_ERROR_BYTES 512u

/* Copy the last failure's sentence (I/O, or an invalid record; "" when none) into buf; returns
 * its full length. A buf of KM_RECORD_WRITER_ERROR_BYTES always holds it whole. Thread-safe. */
size_t km_record_writer_last_error(km_record_writer *writer, char *buf, size_t size);

#ifdef __cplusplus
}
#endif
#endif
