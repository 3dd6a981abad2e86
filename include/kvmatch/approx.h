/* SPDX-License-Identifier: Apache-2.0 */
/* Approximate mode: the placement index of a pool without KV event sources, learned from this
 * instance's own decisions.
 *
 * After a decision the service records the request's chain hashes against the chosen worker: the
 * worker is ASSUMED to hold those blocks from then on (a prediction, not an observation: decisions
 * scored on this state must say prediction source "approx", never "events"). Blocks are forgotten
 * when ttl_ns passes without a new decision touching them (Dynamo's approximate mode, default
 * 120 s), or when a worker's assumed blocks pass its capacity (the least recently touched are
 * evicted first). Touch times have the resolution refresh_ns (default ttl_ns / 256): a touch
 * within refresh_ns of the pair's recorded one is not recorded, unless its record evicts.
 *
 * km_approx never writes to the index itself. Every call that changes what it believes appends the
 * matching km_update records to a caller-owned km_approx_updates buffer; the caller applies them
 * with km_index_apply (typically several calls' worth in one batch, between scoring batches).
 * Invariant: once every appended update has been applied in order, the (worker, block) pairs the
 * index holds for this handle's workers are exactly the pairs km_approx believes stored. This needs
 *  - the workers used here to be fed by nothing else (no event feed, no other km_approx);
 *  - a batch refused by km_index_apply (memory cap) to be followed by km_approx_clear_worker for
 *    each worker the batch touched (their CLEAR_WORKER updates resynchronise both sides).
 *
 * What a record produces:
 *  - one KM_UPDATE_STORE of hashes[0 .. n) with parent KM_NO_PARENT (the run starts at block 0, so
 *    the index knows the blocks' positions), emitted only when at least one pair is new (a pure
 *    refresh changes nothing in the index);
 *  - then, when the worker is over its capacity, one KM_UPDATE_REMOVE of the evicted blocks.
 * A record touches hashes[n-1] first and hashes[0] last, so within one request the deepest block
 * is the oldest: capacity eviction trims long prefixes from the end, and block 0 (the part that
 * other requests share) survives longest. A request longer than the capacity is recorded up to the
 * capacity (its first `capacity` blocks). Evicting a block in the middle of a prefix is allowed:
 * the index's scoring stops at the first missing block.
 *
 * Lifecycle: km_approx_config_init -> adjust -> km_approx_create -> any number of record / expire /
 * clear_worker / set_worker_capacity / getters -> km_approx_destroy. Not thread-safe (the service's
 * scheduler owns it). Every int function returns KM_OK or a negative km_status with detail in
 * km_approx_last_error; a failed call changes neither the handle nor the update buffer's content.
 * Times: now_ns is the caller's monotonic clock in ns; a time earlier than the latest one a
 * successful call was given counts as no time passing. Cost: record O(n), expire O(expired + expired log expired), clear O(blocks
 * of the worker). */
#ifndef KVMATCH_APPROX_H
#define KVMATCH_APPROX_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvmatch/error.h"
#include "kvmatch/index.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct km_approx km_approx;

typedef struct km_approx_config {
    uint32_t max_workers;             /* worker ids 0 .. max_workers-1 (the index's ids);
                                       * 1 .. KM_MAX_WORKERS_LIMIT; default 1024 */
    uint64_t ttl_ns;                  /* a block untouched this long is forgotten; >= 1;
                                       * default 120 s */
    uint64_t worker_capacity_blocks;  /* blocks assumed per worker before the oldest are evicted;
                                       * 0 = unlimited; default 1 << 20; km_approx_set_worker_capacity
                                       * overrides it per worker */
    uint64_t refresh_ns;              /* a record finding a pair touched less than refresh_ns ago
                                       * leaves it as it is (its touch time and its place in the
                                       * expiry and eviction orders): one map lookup instead of
                                       * relinking it in two lists, for the blocks every request
                                       * shares. Such a pair expires up to refresh_ns before
                                       * ttl_ns after its last decision, and a later record's
                                       * capacity eviction may take it as if touched up to
                                       * refresh_ns earlier. A record that may evict (the worker's
                                       * pairs and its blocks pass the capacity) applies every
                                       * touch, so its own eviction never takes a block it names.
                                       * 0 = every touch counts; < ttl_ns; default
                                       * KM_APPROX_REFRESH_AUTO */
} km_approx_config;

/* refresh_ns = ttl_ns / 256 (0.47 s of the default 120 s TTL). */
#define KM_APPROX_REFRESH_AUTO UINT64_MAX

void km_approx_config_init(km_approx_config *cfg);

/* cfg NULL = defaults. On failure *out is NULL. Errors: KM_ERR_NULL_POINTER, KM_ERR_INVALID_ARGUMENT
 * (a field out of range), KM_ERR_OUT_OF_MEMORY. */
int km_approx_create(const km_approx_config *cfg, km_approx **out);
void km_approx_destroy(km_approx *approx); /* NULL is a no-op */

/* Detail of the last failed call ("" when none). Valid until the next call on the handle. */
const char *km_approx_last_error(const km_approx *approx);

/* ---- the update buffer ----------------------------------------------------------------------- */

/* Updates for km_index_apply(index, buf.updates, buf.n_updates, ...). Calls append; the caller
 * clears after applying. The hashes the updates point to live in the buffer: every pointer in
 * updates[0 .. n_updates) stays valid until the next call that appends to, clears or frees this
 * buffer (an append may move the storage and re-points all updates). */
typedef struct km_approx_updates {
    km_update *updates;
    size_t n_updates;
    uint64_t *hashes;          /* private: storage the updates point into */
    size_t n_hashes;           /* private */
    size_t hashes_capacity;    /* private */
    size_t *offsets;           /* private: updates[i].hashes == hashes + offsets[i] */
    size_t updates_capacity;   /* private */
} km_approx_updates;

void km_approx_updates_init(km_approx_updates *buf);
void km_approx_updates_clear(km_approx_updates *buf); /* n_updates = 0; keeps the storage */
void km_approx_updates_free(km_approx_updates *buf);

/* ---- learning and forgetting ------------------------------------------------------------------ */

/* `worker` was chosen for a request whose chain hashes are hashes[0 .. n) (block 0 first): assume
 * it holds them from now on. New pairs are stored, pairs already assumed get their TTL refreshed;
 * updates are appended to *buf as described above. n = 0 is allowed (nothing happens).
 * Errors: KM_ERR_NULL_POINTER, KM_ERR_WORKER_RANGE, KM_ERR_INVALID_ARGUMENT (a hash equal to the
 * reserved values 0 or 1, which no chain hash takes), KM_ERR_OUT_OF_MEMORY. */
int km_approx_record(km_approx *approx, uint32_t worker, const uint64_t *hashes, size_t n,
                     uint64_t now_ns, km_approx_updates *buf);

/* Forget every pair untouched since now_ns - ttl_ns: appends one KM_UPDATE_REMOVE per worker
 * concerned (workers ascending). *n_expired (may be NULL) gets the pairs forgotten.
 * Errors: KM_ERR_NULL_POINTER, KM_ERR_OUT_OF_MEMORY. */
int km_approx_expire(km_approx *approx, uint64_t now_ns, km_approx_updates *buf,
                     size_t *n_expired);

/* When the next pair expires (its last touch + ttl_ns), for the caller's timer; UINT64_MAX when
 * nothing is assumed. */
uint64_t km_approx_next_expiry(const km_approx *approx);

/* Forget everything about `worker` (removed from its pool, or its engine restarted): appends one
 * KM_UPDATE_CLEAR_WORKER naming the pairs assumed, always (even when nothing was assumed, so the
 * index side is certainly empty too). Errors: KM_ERR_NULL_POINTER, KM_ERR_WORKER_RANGE,
 * KM_ERR_OUT_OF_MEMORY. */
int km_approx_clear_worker(km_approx *approx, uint32_t worker, km_approx_updates *buf);

/* Set one worker's capacity in blocks (0 = unlimited); a worker over the new capacity has its
 * least recently touched pairs evicted at once (one KM_UPDATE_REMOVE appended).
 * Errors: KM_ERR_NULL_POINTER, KM_ERR_WORKER_RANGE, KM_ERR_OUT_OF_MEMORY. */
int km_approx_set_worker_capacity(km_approx *approx, uint32_t worker, uint64_t capacity_blocks,
                                  km_approx_updates *buf);

/* ---- inspection ------------------------------------------------------------------------------ */

/* Blocks assumed on `worker` (0 for an id out of range or a NULL handle). */
uint64_t km_approx_worker_blocks(const km_approx *approx, uint32_t worker);
/* Does km_approx assume `worker` holds `hash`? */
bool km_approx_holds(const km_approx *approx, uint32_t worker, uint64_t hash);

typedef struct km_approx_stats {
    uint64_t pairs;           /* (worker, block) pairs assumed now */
    uint64_t records;         /* km_approx_record calls with n >= 1 */
    uint64_t stored_pairs;    /* pairs newly assumed */
    uint64_t refreshed_pairs; /* pairs already assumed whose TTL a record renewed */
    uint64_t recent_pairs;    /* pairs already assumed and touched within refresh_ns: unchanged */
    uint64_t truncated_records; /* records longer than the worker's capacity (cut to it) */
    uint64_t expired_pairs;   /* forgotten by TTL */
    uint64_t evicted_pairs;   /* forgotten by capacity */
    uint64_t cleared_pairs;   /* forgotten by km_approx_clear_worker */
} km_approx_stats;

/* Errors: KM_ERR_NULL_POINTER. */
int km_approx_get_stats(const km_approx *approx, km_approx_stats *out);

#ifdef __cplusplus
}
#endif
#endif
