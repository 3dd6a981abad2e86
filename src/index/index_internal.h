/* SPDX-License-Identifier: Apache-2.0 */
/* Internal: the km_index handle and the backend interface. Never included by public headers.
 *
 * The host tables are the index's authoritative state: the update planner (src/index/index.c) applies
 * every update to them, keeping segment keys sound and per-worker counters exact, so a CPU fallback
 * always has the whole index. A backend only scores: the CPU backend reads the host tables in place;
 * the CUDA backend keeps a device replica that sync() patches from the tables' dirty-slot lists. */
#ifndef KM_INDEX_IMPL_H
#define KM_INDEX_IMPL_H

#include <stdarg.h>

#include "kvmatch/index.h"
#include "index/host_table.h"
#include "base/u64_map.h"

typedef struct km_backend_ops {
    const char *name;
    /* Set up backend state for an index whose host tables exist. Errors mean "not usable"
     * (KM_ERR_BACKEND_UNAVAILABLE, KM_ERR_CUDA with detail in `why`, why_size bytes). */
    int (*create)(km_index *index, void **state, char *why, size_t why_size);
    /* Release everything create() made; state may be NULL. */
    void (*destroy)(void *state);
    /* Make the backend's view equal to the host tables after an update batch: upload dirty slots
     * and bitmaps, or everything when a table's layout changed. Clears nothing; the index clears
     * the dirty lists after a successful sync. KM_ERR_OUT_OF_MEMORY (device or staging memory)
     * is temporary: the host scores until a later sync succeeds; any other status moves the index
     * to the CPU backend for good. */
    int (*sync)(void *state, km_index *index);
    /* Score n requests into results (already sized: results->requests has n entries). Must give
     * exactly what km_walk_request gives for each request, entries ascending by worker. On
     * KM_ERR_OUT_OF_MEMORY the host scores this batch; any other status moves the index to the
     * CPU backend for good, which scores it. */
    int (*match)(void *state, km_index *index, const km_request *requests, size_t n,
                 km_match_results *results);
    /* Does this backend need dirty-slot tracking on the host tables? */
    int needs_dirty_tracking;
} km_backend_ops;

/* While a device replica waits for a table's move, each update batch moves this many old slots,
 * within this budget: a step's cost is its keys' random writes into the new arrays, so the step
 * bounds every batch's pause while a move of a table of millions of slots still ends within about
 * a thousand batches, and the budget cuts the first steps into fresh pages short
 * (docs/BENCHMARKS.md, "Growth"). */
#define KM_REPLICA_GROWTH_STEP_SLOTS (UINT64_C(1) << 13)
#define KM_REPLICA_GROWTH_BUDGET_MS 0.5

extern const km_backend_ops km_backend_cpu;
#if KM_HAVE_CUDA
extern const km_backend_ops km_backend_cuda;
#endif

/* Open segments a worker keeps (src/index/index.c, "open segments"). */
#define KM_OPEN_SEGMENTS 16

/* Per-worker counters (the public km_worker_stats). */
typedef km_worker_stats km_worker_counters;

struct km_index {
    km_index_config config;
    km_memory memory;
    /* Table growths so far, and the pauses they caused (km_index_stats). */
    uint64_t table_growths;
    double table_growth_ms_max, table_growth_ms_total;
    km_table blocks;    /* chain hash -> workers holding the block; with km_block_meta */
    km_table segments;  /* chain hash of a segment's last block -> workers holding all of it */
    /* Lower storage tiers: lower[t - 1] maps a block to the workers whose best tier for it is t
     * (KM_TIER_HOST, KM_TIER_DISK). A pair is in at most one, and only while it is in `blocks`;
     * a pair in neither is device-resident. Host-only: scoring's tier split runs on the host. */
    km_table lower[KM_TIER_COUNT - 1];
    /* anchor tag (km_anchor_tag of a segment's first block) -> list of segment-last-block hashes
     * with a non-empty set, so a remove can find the segment keys it invalidates (segments whose
     * tags collide share a list). Nodes in anchor_nodes. */
    km_u64map anchors;
    struct km_anchor_node { uint64_t end; uint32_t next; uint32_t reserved; } *anchor_nodes;
    uint32_t anchor_nodes_capacity, anchor_nodes_high, anchor_free_head; /* from km_pages_grow */

    km_worker_counters *workers;

    /* Update batches' scratch, kept between batches (single writer) so a batch allocates nothing
     * in the common case: the undo log (src/index/index.c), the counters of each worker a batch touched
     * as they were before it, and a touched flag per worker (all 0 between batches). */
    struct km_undo_entry *undo_log;
    size_t undo_capacity;
    struct km_saved_counters { uint32_t worker; km_worker_counters counters; } *undo_saved;
    size_t undo_saved_capacity;
    uint8_t *undo_touched;

    /* Open segments (src/index/index.c, "open segments"): per worker KM_OPEN_SEGMENTS entries,
     * their fields in arrays so that one worker's anchor tags are compared at once, and
     * segment_blocks fingerprint bytes per entry; allocated by the first store that starts one
     * (NULL before, and when that allocation failed: every completion then walks). Scratch of
     * the update path like the undo log, outside the memory cap. */
    struct km_open_segments {
        uint32_t anchor_tag[KM_OPEN_SEGMENTS];
        uint64_t last[KM_OPEN_SEGMENTS];
        uint8_t offset[KM_OPEN_SEGMENTS];
        uint16_t used; /* bit k: entry k is in use; the others name nothing */
        /* bit k: entry k was started or extended since every entry in use last was (set when
         * the last one's bit was, then cleared): an entry without it is the one a new segment
         * replaces when all are in use. */
        uint16_t recent;
    } *open_segments;
    uint8_t *open_fingerprints;

    const km_backend_ops *backend;
    void *backend_state;
    /* A device replica mirrors one array per table, so while the block or segment table grows it
     * is not synced (replica_stale) and batches are scored on the host by a CPU backend,
     * host_scorer, created the first time it is needed; host_scored_batches counts them
     * (km_index_stats). A sync that ran out of memory marks the replica stale too, until a later
     * sync succeeds; any other failure falls back to the CPU for good. */
    int replica_stale;
    void *host_scorer;
    uint64_t host_scored_batches;
    /* A sync's failure (its status and message) while no CPU backend could be made to take over:
     * the replica is not trusted, and the next match retries the fallback instead of scoring on
     * it. 0 once a sync succeeds or the fallback is made. */
    int backend_failed;
    char backend_failed_detail[256];
    /* While a replica waits, each update batch moves up to replica_growth_step old-array slots of
     * a growing table (on top of the 16 per key its inserts and erases move), and stops early
     * after replica_growth_budget_ms (0: no limit), but never before 512 slots: a move ends even
     * when nothing is inserted. KM_REPLICA_GROWTH_STEP_SLOTS and KM_REPLICA_GROWTH_BUDGET_MS; tests
     * lower the step to watch a move of a small table. */
    uint64_t replica_growth_step;
    double replica_growth_budget_ms;
    /* Makes the CPU backend states for a fallback and for host_scorer: km_backend_cpu's create,
     * destroy and match. Tests put in one whose create can fail, as it does out of host memory. */
    const km_backend_ops *host_ops;

    /* Window rules (src/index/window_rule.c, km_index_set_worker_windows): max_workers entries,
     * NULL until the first rule is set; window_rule_workers counts the workers with one, and
     * while it is 0 scoring skips the step. */
    struct km_window_rule *window_rules;
    uint32_t window_rule_workers;

    char last_error[256];
};

/* Drop every open segment (the blocks table was replaced, or a batch rolled back): completions
 * walk until stores open new ones. */
void km_index_forget_open_segments(km_index *index);
/* Record detail for km_index_last_error and return `status`. */
int km_index_fail(km_index *index, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
void km_index_log(const km_index *index, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Rebuild the anchor lists (segment start -> segment ends with holders) from the segment table
 * and the block metadata; the index's anchor structures must be empty. KM_ERR_CORRUPT when a
 * segment key's last block is missing from the block table. */
int km_index_rebuild_anchors(km_index *index);
/* After the host tables were replaced wholesale (snapshot load): re-arm dirty tracking and give
 * the backend a full upload; a CUDA failure falls back to the CPU backend. */
void km_index_tables_replaced(km_index *index);

/* Replace the index's backend with `ops`: any growth in progress is finished, the new backend is
 * created (a replica uploads the tables whole), and then the old one is destroyed. On failure the
 * old backend stays as it was, with whatever its next sync still has to send (dirty lists, a
 * finished move's whole upload), and `why` says what failed. For tests: a host replica that keeps
 * the device replica's contract exercises the sync protocol without a GPU (tests/test_replica.c). */
int km_index_use_backend(km_index *index, const km_backend_ops *ops, char *why, size_t why_size);

/* Bound the depth of every worker with a window rule in a scored batch (entries dropped at depth
 * 0, owners chosen again, probes counted): km_index_set_worker_windows in kvmatch/index.h. */
void km_window_rules_apply(const km_index *index, const km_request *requests, size_t n,
                           km_match_results *results);

/* Grow results to hold n requests and `matches` entries; afterwards results->matches is never
 * NULL (even for 0 entries), so `matches + first` is always defined. */
int km_match_results_reserve(km_match_results *r, size_t n_requests, size_t n_matches);

#endif
