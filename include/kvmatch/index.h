/* SPDX-License-Identifier: Apache-2.0 */
/* The placement index: which workers hold which blocks, and batched prefix-overlap scoring.
 *
 * Keys are chain hashes (include/kvmatch/hash.h): a chain hash names a block together with its
 * whole prefix, so a flat hash table answers "how many leading blocks of this request does worker
 * w hold?" (the semantics of a radix-tree walk, NVIDIA Dynamo's find_matches).
 *
 * Lifecycle: km_index_config_init -> adjust the config -> km_index_create -> any number of
 * km_index_apply (update batches) and km_index_match_batch (scoring batches) -> km_index_destroy.
 * A handle is not thread-safe: the caller serialises updates and scoring batches (the service's
 * scheduler does); each call uses the backend's own threads or stream internally.
 * Every function returns KM_OK (0) or a negative km_status; km_index_last_error() then holds a
 * sentence with the detail, but for the read-only calls on a const index (km_index_worker_stats,
 * km_index_get_stats, km_index_holders, km_index_pair_tier), which leave it as it was: their
 * errors (a NULL argument, a worker out of range, a pair not held) are named by the status alone.
 * A failed km_index_apply leaves the index's content exactly as it was. */
#ifndef KVMATCH_INDEX_H
#define KVMATCH_INDEX_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvmatch/error.h"
#include "kvmatch/log.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct km_index km_index;

/* "No parent": the first hash of a store run is the first block of its sequence (position 0). */
#define KM_NO_PARENT UINT64_C(0)
/* "No worker": the owner of a request that no worker has any block of. */
#define KM_NO_WORKER UINT32_MAX
/* Hard upper bound for km_index_config.max_workers (worker ids are u16 in table slots). */
#define KM_MAX_WORKERS_LIMIT 65534u
/* Hard upper bound for km_index_config.segment_blocks. */
#define KM_MAX_SEGMENT_BLOCKS 255u
/* Hard upper bound for km_index_config.max_request_blocks: the walk's block positions, a few
 * segments past a request's end included, stay within 32 bits. */
#define KM_MAX_REQUEST_BLOCKS_LIMIT (UINT32_C(1) << 31)

typedef enum km_backend_kind {
    KM_BACKEND_AUTO = 0, /* the default: the CPU backend, which scores faster than the CUDA backend
                          * on every host measured (docs/BENCHMARKS.md, "GPU"); one log line says
                          * which and why. The CUDA backend is used only when named. */
    KM_BACKEND_CPU = 1,
    KM_BACKEND_CUDA = 2,
} km_backend_kind;

typedef struct km_index_config {
    uint32_t max_workers;       /* worker ids are 0 .. max_workers-1; 1 .. KM_MAX_WORKERS_LIMIT; default 1024 */
    uint32_t segment_blocks;    /* S: blocks per segment key; 0 disables segment keys; default 32 */
    uint64_t initial_blocks;    /* capacity hint for distinct blocks; default 1 << 16 */
    uint64_t memory_cap_bytes;  /* 0 = no cap; otherwise table memory never exceeds it
                                 * (KM_ERR_MEMORY_CAP), except while a snapshot loads into an
                                 * index that holds something: the staged copy (itself within
                                 * the cap) and the live tables coexist until the swap */
    uint32_t max_request_blocks; /* longest request accepted by match_batch; 1 ..
                                  * KM_MAX_REQUEST_BLOCKS_LIMIT; default 1 << 20 */
    uint32_t threads;           /* host threads of a batch, the caller's included: the CPU
                                 * backend's walks, the CUDA backend's staging and result copies;
                                 * 0 = online CPUs */
    km_backend_kind backend;    /* default KM_BACKEND_AUTO */
    int cuda_device;            /* device ordinal for the CUDA backend; default 0. The CUDA
                                 * backend makes it the current device of every thread that calls
                                 * into the index and does not restore the previous one (restoring
                                 * could create a context on a device this process never asked
                                 * for): an embedding application that uses CUDA on those threads
                                 * selects its own device again after each call. */
    km_log_fn log;              /* receives one line per notable event (backend choice); NULL = stderr */
    void *log_user;
} km_index_config;

void km_index_config_init(km_index_config *cfg);
/* cfg NULL = the defaults of km_index_config_init. On failure *out is NULL. Errors:
 * KM_ERR_NULL_POINTER, KM_ERR_INVALID_ARGUMENT (a field out of range), KM_ERR_OUT_OF_MEMORY,
 * KM_ERR_MEMORY_CAP, KM_ERR_BACKEND_UNAVAILABLE (KM_BACKEND_CUDA forced without a usable device). */
int km_index_create(const km_index_config *cfg, km_index **out);
void km_index_destroy(km_index *index); /* NULL is a no-op */

/* Detail for the last failed call on this handle ("" when none). Valid until the next call. */
const char *km_index_last_error(const km_index *index);
/* "cpu" or "cuda": the backend actually in use. */
const char *km_index_backend_name(const km_index *index);

/* ---- updates ------------------------------------------------------------------------------ */

typedef enum km_update_kind {
    KM_UPDATE_STORE = 1,         /* worker now holds hashes[0..n): a run of consecutive blocks */
    KM_UPDATE_REMOVE = 2,        /* worker no longer holds these blocks (any order, any subset) */
    /* Worker holds nothing any more (AllBlocksCleared, engine restart). hashes may name blocks it
     * is believed to hold (any order, any subset; others are ignored): those are taken out one
     * lookup each, and the tables are scanned whole (a cost of the table's size, not the
     * worker's) only while the worker still holds some block after them. The event feed names
     * every block it knows the worker to hold. */
    KM_UPDATE_CLEAR_WORKER = 3,
    KM_UPDATE_REMOVE_WORKER = 4, /* clear (hashes as for a clear), and reset the worker's
                                  * counters */
    KM_UPDATE_SET_TIER = 5,      /* blocks the worker holds now have `tier` (any order, any subset;
                                  * pairs not held are counted in absent_tier_changes) */
} km_update_kind;

/* Storage tier of a (block, worker) pair: the best (fastest) tier the worker holds the block in.
 * Scoring splits each worker's matched prefix by tier so a policy can credit tiers differently
 * (Dynamo: device 1.0, host 0.75, disk 0.25). The index stores only what it is told: the event
 * feed derives each pair's best tier from the engine's per-medium events (docs/EVENTS.md). */
typedef enum km_tier {
    KM_TIER_DEVICE = 0, /* accelerator memory (vLLM medium "GPU"); the default */
    KM_TIER_HOST = 1,   /* host memory ("CPU") */
    KM_TIER_DISK = 2,   /* disk or any other lower tier */
} km_tier;
#define KM_TIER_COUNT 3u

typedef struct km_update {
    km_update_kind kind;
    uint32_t worker;
    /* STORE only: chain hash of the block just before hashes[0], or KM_NO_PARENT when hashes[0] is
     * the first block of its sequence. A parent the index does not know, or knows without a
     * position (itself from an orphan run), makes an "orphan" run: its blocks are stored and found
     * by scoring, and earn segment keys only where another worker's stores already placed them
     * (counted in orphan_runs). */
    uint64_t parent;
    const uint64_t *hashes;
    size_t n_hashes;
    /* STORE and SET_TIER: the tier the pairs are in after this update (a STORE of a pair already
     * held sets it too: the latest statement wins). Zero-initialised = KM_TIER_DEVICE. */
    km_tier tier;
} km_update;

/* What one km_index_apply did; every field counts (block, worker) pairs unless named otherwise. */
typedef struct km_update_stats {
    uint64_t stored;           /* pairs added */
    uint64_t duplicate_stores; /* store of a pair already held: harmless, counted */
    uint64_t removed;          /* pairs removed */
    uint64_t absent_removes;   /* remove of a pair not held: harmless, counted */
    uint64_t cleared;          /* pairs removed by CLEAR_WORKER / REMOVE_WORKER */
    uint64_t orphan_runs;      /* store runs whose parent was unknown (runs, not pairs) */
    uint64_t tier_changes;     /* pairs whose tier changed (STORE or SET_TIER) */
    uint64_t absent_tier_changes; /* SET_TIER of a pair not held: harmless, counted */
    uint64_t clear_scans; /* clears (updates, not pairs) whose named blocks left the worker holding
                           * some: the tables were scanned whole for the rest */
} km_update_stats;

/* Apply a batch of updates in order. All or nothing: on any error the index's content is unchanged
 * (capacity may have grown). Errors: KM_ERR_WORKER_RANGE, KM_ERR_NULL_POINTER,
 * KM_ERR_INVALID_ARGUMENT (unknown kind or tier; a hash equal to a reserved value 0 or 1, which no
 * chain hash takes), KM_ERR_MEMORY_CAP, KM_ERR_OUT_OF_MEMORY. stats may be NULL. */
int km_index_apply(km_index *index, const km_update *updates, size_t n_updates,
                   km_update_stats *stats);

/* One-update conveniences over km_index_apply. */
int km_index_store(km_index *index, uint32_t worker, uint64_t parent, const uint64_t *hashes,
                   size_t n_hashes);
int km_index_remove(km_index *index, uint32_t worker, const uint64_t *hashes, size_t n_hashes);
int km_index_clear_worker(km_index *index, uint32_t worker);
int km_index_remove_worker(km_index *index, uint32_t worker);

/* ---- scoring ------------------------------------------------------------------------------ */

/* A request is a real chain: hashes[i] is the chain hash of block i of one token sequence
 * (docs/HASHING.md). Scoring relies on a chain hash naming its whole prefix; an arbitrary list of
 * hashes gets no defined answer. */
typedef struct km_request {
    const uint64_t *hashes; /* the request's chain hashes, block 0 first */
    uint32_t n_hashes;      /* 0 is allowed (no match); at most max_request_blocks */
} km_request;

typedef struct km_worker_match {
    uint32_t worker;
    uint32_t depth; /* leading blocks of the request this worker holds, >= 1 */
} km_worker_match;

/* How much of one worker's matched prefix lies in lower tiers; the rest (depth - host_blocks -
 * disk_blocks) is device-resident. Parallel to km_match_results.matches. */
typedef struct km_match_tiers {
    uint32_t host_blocks;
    uint32_t disk_blocks;
} km_match_tiers;

typedef struct km_request_result {
    uint64_t first;       /* index of this request's first entry in km_match_results.matches */
    uint32_t count;       /* entries, ascending by worker id: every worker with depth >= 1 */
    uint32_t owner;       /* prediction owner: deepest match, ties to the lowest worker id; KM_NO_WORKER if none */
    uint32_t owner_depth; /* its depth (0 when none) */
    uint32_t probes;      /* hash-table lookups this request cost (block and segment keys) */
} km_request_result;

/* Results of one scoring batch. Initialise with km_match_results_init, reuse across batches
 * (buffers only grow), release with km_match_results_free. The arrays are written only by the
 * library: a caller reads them and never writes them, since a reused results keeps state across
 * batches (tiers entries that are already zero are not written again). */
typedef struct km_match_results {
    km_request_result *requests;
    size_t n_requests;
    km_worker_match *matches;
    size_t n_matches;
    km_match_tiers *tiers; /* n_matches entries: tiers[j] splits matches[j].depth by tier */
    uint64_t probes; /* sum of requests[i].probes (tier lookups not included) */
    size_t requests_capacity; /* private */
    size_t matches_capacity;  /* private */
    size_t tiers_capacity;    /* private */
    size_t tiers_zeroed;      /* private: leading tiers entries known to be all zero */
} km_match_results;

void km_match_results_init(km_match_results *results);
void km_match_results_free(km_match_results *results);

/* Score every request against every worker. Results are identical, bit for bit, on every backend.
 * The tier split is computed on the host after the backend's walk, from the pairs' recorded
 * tiers; it costs nothing while no pair is in a lower tier, else up to 2 lookups per matched block.
 * Errors: KM_ERR_NULL_POINTER, KM_ERR_TOO_LARGE (a request over max_request_blocks),
 * KM_ERR_OUT_OF_MEMORY, KM_ERR_CUDA (the index stays usable; see km_index_backend_name); a
 * refused batch leaves `results` (when not NULL) holding no request. */
int km_index_match_batch(km_index *index, const km_request *requests, size_t n_requests,
                         km_match_results *results);

/* ---- window rules (hybrid models) ---------------------------------------------------------- */

/* A hybrid model's engine (vLLM's HybridKVCacheCoordinator) hits a prefix only as far as each of
 * its sliding-window KV-cache groups holds the blocks just before the hit's end. For a worker with
 * window groups the index holds, besides the chain hashes its full-attention groups hold, one
 * window key per (block, window group) the group holds (km_hash_window_key(chain, group), stored
 * with ordinary updates), and scoring bounds the worker's depth as the engine does: from its
 * plain prefix depth d, the largest e <= d such that, for every window group g, the worker holds
 * the window keys of blocks [max(0, e - g.blocks), e) (vLLM's right-to-left scan, repeated over
 * the groups until no group lowers it). A worker whose depth drops to 0 loses its entry; the owner
 * is chosen again; the lookups are counted in probes. The step runs on the host after either
 * backend's walk, so both give the same results, and costs nothing while no worker has a rule.
 * Rules are not saved in snapshots: the event feed sets them again (docs/EVENTS.md). */
#define KM_MAX_WINDOW_GROUPS 8u

typedef struct km_window_group {
    uint32_t group;  /* the tag in its window keys (vLLM's group_idx) */
    uint32_t blocks; /* contiguous blocks before a hit's end the group must hold, >= 1 (vLLM:
                      * max(1, ceil((sliding_window - 1) / block_size))) */
} km_window_group;

/* Give `worker` the rule of n_groups window groups (0 = none: its plain prefix depth, the
 * default). Takes effect from the next scoring batch. Errors: KM_ERR_NULL_POINTER,
 * KM_ERR_WORKER_RANGE, KM_ERR_INVALID_ARGUMENT (more than KM_MAX_WINDOW_GROUPS, blocks 0),
 * KM_ERR_OUT_OF_MEMORY (the first rule's table). */
int km_index_set_worker_windows(km_index *index, uint32_t worker, const km_window_group *groups,
                                uint32_t n_groups);

/* ---- snapshots ------------------------------------------------------------------------------ */

/* Write the index's whole content, and an opaque caller section (the event feed's stream
 * positions), to `path` atomically: a temporary file in the same directory, fsync, rename, fsync of
 * the directory. A reader never sees half a snapshot. Format: docs/ARCHITECTURE.md "Snapshots".
 * Errors: KM_ERR_NULL_POINTER, KM_ERR_IO (with errno's text in km_index_last_error; a path too
 * long to name its temporary file is one), KM_ERR_OUT_OF_MEMORY. */
int km_index_save(km_index *index, const char *path, const void *user, size_t user_size);

/* The temporary file km_index_save writes first and renames over `path`: "<path>.tmp.<pid>", pid
 * being the writing process's. False when it does not fit in out[0..size). A writer killed before
 * the rename leaves it behind; whoever reaps such a writer (a process forked to save in the
 * background) removes it. */
bool km_index_save_temp_path(const char *path, long pid, char *out, size_t size);

/* Replace the index's content with the snapshot at `path`. The file is read, checksummed and
 * checked in full before anything changes: on any error the index is exactly as it was.
 * *user_out (may be NULL) receives a malloc'd copy of the caller section (release with free()),
 * *user_size_out its size. Errors: KM_ERR_IO (missing, unreadable, not a regular file: a
 * directory or a FIFO, which is not waited on), KM_ERR_CORRUPT (truncated, checksum mismatch,
 * inconsistent structure), KM_ERR_INCOMPATIBLE (other format version, or max_workers /
 * segment_blocks / layout differing from this index's), KM_ERR_MEMORY_CAP, KM_ERR_OUT_OF_MEMORY. */
int km_index_load(km_index *index, const char *path, void **user_out, size_t *user_size_out);

/* Judges a snapshot's caller section before km_index_load_checked changes anything: KM_OK lets the
 * load go on; any other status refuses the whole snapshot. Called once, after every check of the
 * index part passed; the section is only lent for the call. */
typedef int (*km_snapshot_check_fn)(void *user, const void *section, size_t section_size);

/* km_index_load, with the caller section judged by `check` (NULL: none) before the index's
 * content is replaced: a section `check` refuses leaves the index exactly as it was and returns
 * `check`'s status (km_index_last_error says the caller section was refused), so a caller whose own
 * state must come from the same file installs both or neither. */
int km_index_load_checked(km_index *index, const char *path, km_snapshot_check_fn check,
                          void *check_user, void **user_out, size_t *user_size_out);

/* ---- inspection --------------------------------------------------------------------------- */

typedef struct km_worker_stats {
    uint64_t blocks;           /* blocks held now */
    uint64_t stores;           /* pairs added over the worker's life */
    uint64_t duplicate_stores;
    uint64_t removes;
    uint64_t absent_removes;
    uint64_t clears;           /* CLEAR_WORKER / REMOVE_WORKER updates */
} km_worker_stats;

typedef struct km_index_stats {
    uint64_t blocks;            /* distinct blocks held by at least one worker */
    uint64_t pairs;             /* (block, worker) pairs */
    uint64_t segment_keys;      /* segment keys with at least one worker */
    uint64_t segment_pairs;     /* (segment, worker) pairs */
    uint64_t shared_sets;       /* blocks whose worker set lives in a bitmap (widely held) */
    uint64_t host_pairs;        /* pairs whose best tier is KM_TIER_HOST */
    uint64_t disk_pairs;        /* pairs whose best tier is KM_TIER_DISK */
    uint64_t block_capacity;    /* slots in the block table */
    uint64_t table_growths;     /* times a table grew (initial_blocks avoids them); each one is
                                 * logged. A table of 16 K slots or more moves its keys over the
                                 * following inserts; a smaller one rehashes at once */
    double table_growth_ms_max; /* the longest pause for growth (the insert that grew a table, or
                                 * with the CUDA backend a sync's step of the move), and the sum
                                 * of them */
    double table_growth_ms_total;
    uint64_t host_scored_batches; /* with the CUDA backend: batches scored on the host because a
                                   * table was growing (the device replica catches up when the
                                   * move ends) or device memory ran out, in a sync (until one
                                   * succeeds) or in the replica's scoring (that batch); always 0
                                   * on the CPU backend */
    uint64_t memory_bytes;      /* host table memory counted against the cap */
    uint64_t memory_cap_bytes;
} km_index_stats;

int km_index_worker_stats(const km_index *index, uint32_t worker, km_worker_stats *out);
/* Worker ids are 0 .. km_index_max_workers(index) - 1 (its config's max_workers; fixed at create,
 * so any thread may read it while another applies updates); 0 for NULL. */
uint32_t km_index_max_workers(const km_index *index);
int km_index_get_stats(const km_index *index, km_index_stats *out);
/* The workers holding one block, ascending; *n_out gets the full count even when capacity is short. */
int km_index_holders(const km_index *index, uint64_t hash, uint32_t *workers, uint32_t capacity,
                     uint32_t *n_out);
/* The tier of one (block, worker) pair into *tier; KM_ERR_NOT_FOUND when the worker does not hold
 * the block. */
int km_index_pair_tier(const km_index *index, uint64_t hash, uint32_t worker, km_tier *tier);

#ifdef __cplusplus
}
#endif
#endif
