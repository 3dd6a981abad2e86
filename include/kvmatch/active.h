/* SPDX-License-Identifier: Apache-2.0 */
/* Active work: the load each worker carries, as THIS kvmatch instance saw it.
 *
 * Every routing decision begins an entry keyed by (request id, attempt id); the router's lifecycle
 * messages (DISPATCHED, FIRST_TOKEN, FINISHED) move it along, and entries whose FINISHED never
 * comes expire after a TTL. Per worker the handle keeps these load values, each the sum over the
 * worker's live entries of what that entry was charged:
 *
 *   in_flight               1 per entry, from the decision until FINISHED / expiry;
 *   prefilling              1 per entry, from the decision until FIRST_TOKEN (or its end);
 *   pending_prefill_tokens  prompt_tokens - min(cached_tokens_predicted, prompt_tokens), charged
 *                           at the decision and released at FIRST_TOKEN (the prefill is done),
 *                           lowered before that as the blocks its prefill promised are stored
 *                           (km_active_blocks_stored) and corrected by km_active_report_cached;
 *   pending_prefill_pairs   the attention pairs of that prefill after its cached prefix
 *                           (km_engine_model_chunk_pairs), charged, corrected and released with it;
 *   active_decode_blocks    ceil((prompt_tokens + expected_output_tokens) / block_size): the KV
 *                           blocks the request will occupy when its generation ends (Dynamo's
 *                           "potential decode blocks"), charged at the decision, released at
 *                           FINISHED / expiry.
 *
 * Scope: requests routed elsewhere (another router, traffic that bypasses kvmatch) are not here;
 * a fresh process starts empty. A decision that uses these values must say so (load scope
 * "this_instance", KM_ACTIVE_LOAD_SCOPE).
 *
 * Two attempts of one request are separate entries. Ids are byte strings (not NUL-terminated on
 * input, since msgpack strings are not); an entry keeps a copy, so lookups compare the full ids and
 * a hash collision can never merge two entries.
 *
 * Events that do not fit the lifecycle change no load and return an error, each counted:
 *  - an id never begun (or long forgotten)                 KM_ERR_NOT_FOUND  (unknown)
 *  - an id that expired, was evicted or whose worker was
 *    removed                                              KM_ERR_NOT_FOUND  (late)
 *  - an id already finished (FINISHED twice, FIRST_TOKEN
 *    after FINISHED), begun twice, FIRST_TOKEN twice        KM_ERR_PROTOCOL   (duplicates)
 *  - DISPATCHED after FIRST_TOKEN                           KM_ERR_PROTOCOL   (out_of_order)
 * "Finished", "expired" and "worker removed" are told apart from "unknown" through a bounded ring of
 * recently ended ids (remember_ended, default 4096); an id pushed out of it reads as unknown.
 * A load value never goes negative: a subtraction that would is clamped to 0 and counted
 * (saturations; it stays 0 unless a bug breaks the sum invariant).
 *
 * Cost: every event is O(1) expected (one hash lookup, list splices); km_active_expire is
 * O(expired entries): entries sit on one list ordered by last touch (every lifecycle event moves
 * its entry to the tail), so expiry reads the head only.
 *
 * Times: every now_ns is the caller's monotonic clock in ns (tests pass a synthetic one). A time
 * earlier than the latest one a successful call was given counts as no time passing (the list
 * stays ordered); a failed call changes nothing, its clock included.
 *
 * Lifecycle: km_active_config_init -> adjust -> km_active_create -> any number of begin /
 * dispatched / first_token / report_cached / finish / expire / remove_worker / getters ->
 * km_active_destroy. Not thread-safe: the service's event loop owns it. Every int-returning
 * function returns KM_OK or a negative km_status, with detail in km_active_last_error. */
#ifndef KVMATCH_ACTIVE_H
#define KVMATCH_ACTIVE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kvmatch/error.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct km_active km_active;

/* The scope a decision using these load values must state: what this kvmatch instance saw. */
#define KM_ACTIVE_LOAD_SCOPE "this_instance"
/* Longest request id and attempt id accepted, in bytes (KM_ERR_TOO_LARGE beyond). */
#define KM_ACTIVE_ID_MAX 256u
/* "Not reported": engine-reported cached tokens that never arrived. */
#define KM_ACTIVE_CACHED_UNKNOWN INT64_C(-1)

typedef struct km_active_config {
    uint32_t max_workers;    /* worker ids 0 .. max_workers-1; 1 .. 65534; default 1024 */
    uint64_t ttl_ns;         /* an entry with no lifecycle event for this long expires; >= 1;
                              * default 600 s */
    uint32_t max_entries;    /* live entries, all workers; one more begin is KM_ERR_OVERLOADED;
                              * default 1 << 20 */
    uint32_t remember_ended; /* recently ended ids kept to classify late events; 0 = none;
                              * default 4096 */
    uint32_t max_queued_blocks; /* blocks promised by queued prefills (km_active_queue_blocks), all
                                 * workers; a promise past it is cut short and counted; 0 = none
                                 * kept; default 1 << 20 */
    uint64_t max_bytes;      /* bytes live entries are counted as holding (km_active_entry_bytes
                              * and their callers' user bytes), all workers; a begin that would pass it is KM_ERR_MEMORY_CAP
                              * (counted in refused_bytes); 0 = no bound; default 1 GiB */
} km_active_config;

void km_active_config_init(km_active_config *cfg);

/* cfg NULL = defaults. On failure *out is NULL. Errors: KM_ERR_NULL_POINTER (out),
 * KM_ERR_INVALID_ARGUMENT (a field out of range), KM_ERR_OUT_OF_MEMORY. */
int km_active_create(const km_active_config *cfg, km_active **out);
void km_active_destroy(km_active *active); /* NULL is a no-op */

/* Detail of the last failed call ("" when none). Valid until the next call on the handle. */
const char *km_active_last_error(const km_active *active);

/* An entry's key: the request id and the attempt id, as byte strings with lengths. The request
 * id must be non-empty; the attempt id may be empty; neither may contain a NUL byte or exceed
 * KM_ACTIVE_ID_MAX bytes (KM_ERR_INVALID_ARGUMENT / KM_ERR_TOO_LARGE). */
typedef struct km_active_key {
    const char *request_id;
    size_t request_id_len;
    const char *attempt_id;
    size_t attempt_id_len;
} km_active_key;

/* A key over two NUL-terminated strings (attempt_id NULL = ""). */
static inline km_active_key km_active_key_of(const char *request_id, const char *attempt_id)
{
    km_active_key key;
    key.request_id = request_id;
    key.request_id_len = request_id ? strlen(request_id) : 0;
    key.attempt_id = attempt_id ? attempt_id : "";
    key.attempt_id_len = attempt_id ? strlen(attempt_id) : 0;
    return key;
}

/* How an entry ended, and the name records and logs give it; the values follow the list's order
 * from 0. The first four are the router's FINISHED outcomes (`complete` only when the final
 * finish_reason and [DONE] were seen; `incomplete` for a stream that ended without them, even
 * with HTTP 200); EXPIRED: no event for ttl_ns (km_active_expire); WORKER_REMOVED:
 * km_active_remove_worker; EVICTED: the least recently touched, to make room
 * (km_active_evict_oldest). */
#define KM_ACTIVE_END_LIST(X)                         \
    X(KM_ACTIVE_END_COMPLETE, "complete")             \
    X(KM_ACTIVE_END_INCOMPLETE, "incomplete")         \
    X(KM_ACTIVE_END_ERROR, "error")                   \
    X(KM_ACTIVE_END_CANCELLED, "cancelled")           \
    X(KM_ACTIVE_END_EXPIRED, "expired")               \
    X(KM_ACTIVE_END_WORKER_REMOVED, "worker_removed") \
    X(KM_ACTIVE_END_EVICTED, "evicted")

typedef enum km_active_end {
#define KM_ACTIVE_END_ENUM(value, name) value,
    KM_ACTIVE_END_LIST(KM_ACTIVE_END_ENUM)
#undef KM_ACTIVE_END_ENUM
} km_active_end;
#define KM_ACTIVE_END_COUNT 7u

/* The name in KM_ACTIVE_END_LIST; "unknown" for any other value. */
const char *km_active_end_name(km_active_end end);

/* Everything the handle knew about an entry when it ended: what the service writes into the
 * attempt's outcome record. The id pointers are NUL-terminated copies owned by the handle, valid
 * until the next call on it (inside a callback: until the callback returns). */
typedef struct km_active_summary {
    const char *request_id;
    size_t request_id_len;
    const char *attempt_id;
    size_t attempt_id_len;
    uint32_t worker;
    km_active_end end;
    uint32_t prompt_tokens;           /* as given at the decision */
    uint32_t predicted_cached_tokens; /* the decision's prediction (overlap x block size) */
    uint32_t expected_output_tokens;
    uint32_t block_size;
    uint64_t prefill_tokens_charged;  /* pending prefill this entry added (after any correction) */
    uint64_t decode_blocks_charged;
    int64_t engine_cached_tokens;     /* last engine report, or KM_ACTIVE_CACHED_UNKNOWN */
    bool dispatched;
    bool first_token;
    uint64_t begin_ns;       /* the decision */
    uint64_t dispatched_ns;  /* first DISPATCHED (0 when none) */
    uint64_t first_token_ns; /* FIRST_TOKEN (0 when none) */
    uint64_t last_event_ns;  /* last lifecycle event before the end */
    uint64_t end_ns;         /* FINISHED, expiry check or removal time */
    void *user;              /* what km_active_set_user attached; NULL when nothing */
} km_active_summary;

/* Receives each entry that expire / remove_worker ends; the entry is already gone. */
typedef void (*km_active_summary_fn)(void *user, const km_active_summary *summary);

/* What an entry with ids of these lengths is counted as holding against max_bytes: its slot in
 * the entry table, its id buffer as allocated, and its share of the id map. The table and the
 * map grow by doubling, so what they have allocated can reach twice the count; the queued-prefix
 * promises (max_queued_blocks, 8 bytes a block) and the ring of ended ids (remember_ended) are
 * bounded apart. */
uint64_t km_active_entry_bytes(size_t request_id_len, size_t attempt_id_len);

/* ---- lifecycle ------------------------------------------------------------------------------ */

/* At the decision (optimistic): a new entry on `worker`; in_flight += 1, pending prefill +=
 * prompt_tokens - min(cached_tokens_predicted, prompt_tokens), decode blocks +=
 * ceil((prompt_tokens + expected_output_tokens) / block_size). Errors: KM_ERR_NULL_POINTER,
 * KM_ERR_WORKER_RANGE, KM_ERR_BLOCK_SIZE (0), KM_ERR_INVALID_ARGUMENT / KM_ERR_TOO_LARGE (ids),
 * KM_ERR_PROTOCOL (this key is already active: counted as a duplicate), KM_ERR_OVERLOADED
 * (max_entries live), KM_ERR_MEMORY_CAP (the entry would take the live entries past max_bytes:
 * counted in refused_bytes; no entry is evicted to make room), KM_ERR_OUT_OF_MEMORY. On error
 * nothing changes. */
int km_active_begin(km_active *active, uint32_t worker, const km_active_key *key,
                    uint32_t prompt_tokens, uint32_t cached_tokens_predicted,
                    uint32_t expected_output_tokens, uint32_t block_size, uint64_t now_ns);

/* km_active_begin for a caller that keeps user_bytes of its own beside the entry (the object it
 * attaches with km_active_set_user): they count toward max_bytes and stats.bytes with the entry,
 * from this begin until the entry ends, so the bound covers what one in-flight request costs
 * the caller too. km_active_begin is this with user_bytes 0. */
int km_active_begin_with_user_bytes(km_active *active, uint32_t worker, const km_active_key *key,
                                    uint32_t prompt_tokens, uint32_t cached_tokens_predicted,
                                    uint32_t expected_output_tokens, uint32_t block_size,
                                    uint32_t user_bytes, uint64_t now_ns);

/* The entry holds the cached prefix named prefix_key (any 64-bit name of it, e.g. the chain hash
 * of its last block; 0 = none) of prefix_tokens tokens on its worker. While another live entry of
 * the same worker holds the same prefix, they share its KV: the prefix's full blocks are charged
 * to the worker's allocated_blocks once, from its first holder's declaration until its last
 * holder ends or moves, and each holder's own charge leaves them out. At most once per entry
 * (KM_ERR_PROTOCOL); a move to another worker forgets it. Errors: KM_ERR_NULL_POINTER, KM_ERR_NOT_FOUND, KM_ERR_PROTOCOL, KM_ERR_OUT_OF_MEMORY
 * (nothing changes). */
int km_active_share_prefix(km_active *active, const km_active_key *key, uint64_t prefix_key,
                           uint32_t prefix_tokens);

/* Queued prefixes. Between a decision and its FIRST_TOKEN the engine is computing the entry's
 * prompt, and once that prefill has run it holds the prompt's blocks; a request routed there
 * meanwhile will find them cached. The entry's worker is promised `hashes[0..n)` (the request's
 * chain hashes beyond what the worker holds or is promised, in prompt order) until the entry's
 * FIRST_TOKEN, its end, or a move to another worker (a move forgets the promise). A second
 * promise while one is held, or one after FIRST_TOKEN, is KM_ERR_PROTOCOL (n = 0 included);
 * otherwise n = 0 is a no-op. A promise that would take the table past
 * max_queued_blocks keeps only its leading part (counted in queued_truncated), which only makes
 * km_active_queued_depth shorter, never wrong. Blocks are told apart by (worker, hash), mixed
 * into one 64-bit key: two promises collide with the probability of a 64-bit hash collision.
 * Errors: KM_ERR_NULL_POINTER, KM_ERR_NOT_FOUND, KM_ERR_PROTOCOL, KM_ERR_OUT_OF_MEMORY (nothing
 * changes). */
int km_active_queue_blocks(km_active *active, const km_active_key *key, const uint64_t *hashes,
                           uint32_t n);

/* The leading blocks of a request (chain hashes hashes[0..n)) that `worker` holds or will hold
 * once its queued prefills have run: `from` (the blocks it holds now, e.g. the index's depth;
 * <= n) extended by every following block some live entry there has promised. O(1 + the
 * extension) map lookups. 0 for invalid arguments; `from` when nothing extends it. */
uint32_t km_active_queued_depth(const km_active *active, uint32_t worker, const uint64_t *hashes,
                                uint32_t n, uint32_t from);

/* Progress of queued prefills: `worker` now holds hashes[0..n) (the event feed saw them stored).
 * A live entry there, before its FIRST_TOKEN, whose promise (km_active_queue_blocks) names one of
 * them has computed its prompt up to that block, since a prefill runs in prompt order (a block
 * another request cached meanwhile needs no computing either). The stores' view of its pending
 * prefill is its charge at the decision (prompt_tokens less the predicted cached tokens, where
 * the promise begins) less block_size tokens for each promised block up to the furthest one
 * stored, never below 0; a km_active_report_cached before FIRST_TOKEN gives the report's view
 * (prompt_tokens less the reported cached tokens; a later report replaces an earlier one). Its
 * pending prefill is the smaller of the views it has, and its pending pairs those of what is left
 * after what is computed; stores never raise it. What remains is released at FIRST_TOKEN as
 * before. Hashes nobody there promised are ignored. *n_progressed (may be NULL) gets the promised
 * blocks newly seen computed (also summed in stats.progressed_blocks). Cost: per hash one map
 * lookup and a search of its promiser's promise from its computed part on (one step when blocks
 * come in prompt order); a block more than one live entry promised, or whose latest promiser's
 * promise ended, searches the promise of every entry of the worker. Errors: KM_ERR_NULL_POINTER,
 * KM_ERR_WORKER_RANGE (nothing changes). */
int km_active_blocks_stored(km_active *active, uint32_t worker, const uint64_t *hashes, size_t n,
                            uint64_t *n_progressed);

/* Blocks promised by live queued prefills now (stats.queued_blocks), in O(1). NULL: 0. */
uint64_t km_active_queued_blocks(const km_active *active);

/* Live entries of `worker` that declared the prefix named prefix_key (km_active_share_prefix): how
 * many concurrent requests there use it. 0 for invalid arguments. O(1). */
uint32_t km_active_prefix_sharers(const km_active *active, uint32_t worker, uint64_t prefix_key);

/* What other instances sharing this one's active work need to weigh `worker` as it does: the
 * prefix key of each live entry there that declared one (km_active_share_prefix; a key k entries
 * declared appears k times) into prefixes[0..max_prefixes), and every block hash its queued
 * prefills promise (km_active_queue_blocks) into queued[0..max_queued), in the worker's entry
 * order. *n_prefixes and *n_queued get the full counts: past a max only the leading part is
 * written. O(the worker's entries and promises). Errors: KM_ERR_NULL_POINTER,
 * KM_ERR_WORKER_RANGE. */
int km_active_worker_work(const km_active *active, uint32_t worker, uint64_t *prefixes,
                          uint32_t max_prefixes, uint32_t *n_prefixes, uint64_t *queued,
                          uint32_t max_queued, uint32_t *n_queued);

/* The request was sent to the engine: no load change; the first call records the time, a repeat
 * is accepted and changes nothing but the last-touch time (idempotent). Errors: KM_ERR_NOT_FOUND,
 * KM_ERR_PROTOCOL (after FIRST_TOKEN: out_of_order; or already finished: duplicate). */
int km_active_dispatched(km_active *active, const km_active_key *key, uint64_t now_ns);

/* The router sent the attempt to `worker`, not to the one it was begun on (it overrode the
 * decision): the entry and everything it still charges (in_flight 1, its pending prefill, its
 * decode blocks) move to `worker`; the same worker is a no-op but for the touch. Errors:
 * KM_ERR_NULL_POINTER, KM_ERR_WORKER_RANGE, KM_ERR_NOT_FOUND (unknown or ended: late),
 * KM_ERR_PROTOCOL (already finished). */
int km_active_move(km_active *active, const km_active_key *key, uint32_t worker, uint64_t now_ns);

/* The first output token arrived, so the prefill is done: the entry's pending prefill is released.
 * engine_cached_tokens (or KM_ACTIVE_CACHED_UNKNOWN) is kept for the summary. Errors:
 * KM_ERR_NULL_POINTER, KM_ERR_INVALID_ARGUMENT (engine_cached_tokens below
 * KM_ACTIVE_CACHED_UNKNOWN), KM_ERR_NOT_FOUND, KM_ERR_PROTOCOL (FIRST_TOKEN twice, or after
 * FINISHED: duplicates). */
int km_active_first_token(km_active *active, const km_active_key *key,
                          int64_t engine_cached_tokens, uint64_t now_ns);

/* The engine reported how many prompt tokens it found cached (>= 0) before the first token: the
 * entry's pending prefill becomes prompt_tokens - min(cached, prompt_tokens), or what its stored
 * promised blocks leave where that is less (km_active_blocks_stored), and the worker's total
 * moves by the difference. After FIRST_TOKEN only the reported value is kept (the prefill is
 * already released). Errors: KM_ERR_NOT_FOUND, KM_ERR_INVALID_ARGUMENT (negative),
 * KM_ERR_PROTOCOL (already finished). */
int km_active_report_cached(km_active *active, const km_active_key *key,
                            int64_t engine_cached_tokens, uint64_t now_ns);

/* The attempt ended with `outcome` (COMPLETE, INCOMPLETE, ERROR or CANCELLED): in_flight -= 1,
 * decode blocks -= the entry's, pending prefill -= whatever it still had; the entry is removed and
 * described in *summary (may be NULL). Errors: KM_ERR_NULL_POINTER, KM_ERR_INVALID_ARGUMENT (an
 * outcome that is not a FINISHED outcome), KM_ERR_NOT_FOUND, KM_ERR_PROTOCOL (finished twice). */
int km_active_finish(km_active *active, const km_active_key *key, km_active_end outcome,
                     uint64_t now_ns, km_active_summary *summary);

/* End every entry whose last lifecycle event is at or before now_ns - ttl_ns, oldest first: its
 * load is released and on_expired (may be NULL) receives its summary (end EXPIRED). *n_expired
 * (may be NULL) gets the count. O(expired). Errors: KM_ERR_NULL_POINTER (active). */
int km_active_expire(km_active *active, uint64_t now_ns, km_active_summary_fn on_expired,
                     void *user, size_t *n_expired);
/* The same for at most `max` entries (the oldest), so a caller sharing a lock with others can
 * expire a large backlog in slices; *n_expired < max means nothing due is left. */
int km_active_expire_some(km_active *active, uint64_t now_ns, size_t max,
                          km_active_summary_fn on_expired, void *user, size_t *n_expired);

/* End the least recently touched entry before its TTL (end EVICTED, passed to on_evicted, may be
 * NULL), to make room when max_entries are live: a router that never reports FINISHED fills the
 * table at its routing rate times the TTL, and new work matters more than the stalest. Later
 * events for its id are "late" (KM_ERR_NOT_FOUND), as for an expired one. O(1). Errors:
 * KM_ERR_NULL_POINTER, KM_ERR_NOT_FOUND (no entry). */
int km_active_evict_oldest(km_active *active, uint64_t now_ns, km_active_summary_fn on_evicted,
                           void *user);

/* Drop every entry of `worker` (end WORKER_REMOVED, each passed to on_removed, may be NULL); its
 * load becomes 0. Later events for those ids are "late" (KM_ERR_NOT_FOUND). O(the worker's
 * entries). Errors: KM_ERR_NULL_POINTER, KM_ERR_WORKER_RANGE. */
int km_active_remove_worker(km_active *active, uint32_t worker, uint64_t now_ns,
                            km_active_summary_fn on_removed, void *user, size_t *n_removed);

/* Attach a caller pointer to an active entry: handed back in its summary (FINISHED, expiry,
 * removal) and by km_active_user, so a caller keeps per-attempt data without a map of its own.
 * Errors: KM_ERR_NULL_POINTER, KM_ERR_INVALID_ARGUMENT / KM_ERR_TOO_LARGE (ids), KM_ERR_NOT_FOUND. */
int km_active_set_user(km_active *active, const km_active_key *key, void *user);
/* The pointer attached to an active entry; NULL when none or the key is not active. */
void *km_active_user(const km_active *active, const km_active_key *key);

/* ---- inspection ----------------------------------------------------------------------------- */

typedef struct km_active_load {
    uint64_t in_flight;
    uint64_t prefilling; /* of in_flight, the entries whose FIRST_TOKEN has not come */
    uint64_t pending_prefill_tokens;
    uint64_t active_decode_blocks;
    /* The KV blocks those requests take, counting a prefix that several of them share once:
     * each request's footprint less the blocks of its declared prefix, plus each declared prefix
     * once while any live request on the worker holds it (km_active_share_prefix). */
    uint64_t allocated_blocks;
    /* The attention pairs of the pending prefills: each entry's km_engine_model_chunk_pairs(its
     * cached tokens, its pending prefill tokens), charged and released with its pending prefill.
     * Summed exactly; UINT64_MAX while the sum does not fit in 64 bits. */
    uint64_t pending_prefill_pairs;
} km_active_load;

/* One worker's load. Errors: KM_ERR_NULL_POINTER, KM_ERR_WORKER_RANGE. */
int km_active_worker_load(const km_active *active, uint32_t worker, km_active_load *out);

/* When `worker` last received a request: the number of arrivals (begins, and moves to another
 * worker) this table had counted once that one was counted, so a larger value is a later arrival.
 * 0 when none has come since the table was created or the worker removed, and for invalid
 * arguments. O(1). */
uint64_t km_active_last_arrival(const km_active *active, uint32_t worker);

typedef struct km_active_stats {
    km_active_load total;  /* sum over all workers */
    uint64_t entries;      /* live entries (== total.in_flight) */
    uint64_t begun;
    uint64_t ended[KM_ACTIVE_END_COUNT]; /* by km_active_end: finished by outcome, expired, removed */
    uint64_t unknown;      /* events for ids never begun or forgotten */
    uint64_t late;         /* events for ids that expired or whose worker was removed */
    uint64_t duplicates;   /* begin of an active id; FIRST_TOKEN twice; any event after FINISHED */
    uint64_t out_of_order; /* DISPATCHED after FIRST_TOKEN */
    uint64_t saturations;  /* subtractions clamped at 0 (a broken invariant; expected 0) */
    uint64_t corrections;  /* km_active_report_cached calls that changed a pending prefill */
    uint64_t moved;        /* entries km_active_move gave to another worker */
    uint64_t queued_blocks;    /* blocks promised by queued prefills now (km_active_queue_blocks) */
    uint64_t queued_truncated; /* promised blocks left out at max_queued_blocks */
    uint64_t progressed_blocks; /* promised blocks seen computed (km_active_blocks_stored) */
    uint64_t bytes;            /* bytes the live entries are counted as holding (max_bytes) */
    uint64_t refused_bytes;    /* begins refused with KM_ERR_MEMORY_CAP at max_bytes */
} km_active_stats;

/* Errors: KM_ERR_NULL_POINTER. */
int km_active_get_stats(const km_active *active, km_active_stats *out);

/* Give memory back after a drain: the cache of released id buffers is freed, and when no entry
 * is live the entry slab and the maps grow from nothing again (what a burst of in-flight work
 * made them hold is returned). Nothing observable changes: loads, counters and the ended ring are
 * kept. Returns the bytes freed (an estimate of the allocations, not of RSS). NULL: 0. */
uint64_t km_active_release_idle(km_active *active);

/* Is this key an active entry? (1 yes, 0 no; 0 for invalid arguments.) */
int km_active_contains(const km_active *active, const km_active_key *key);

#ifdef __cplusplus
}
#endif
#endif
