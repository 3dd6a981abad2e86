/* SPDX-License-Identifier: Apache-2.0 */
/* Baseline placement indexes: single-threaded re-implementations of what today's cache-aware
 * routers use (../shared/reference/peers.md), built to the same answer contract as km_index so the
 * benchmark compares like with like and tests can use them as independent oracles.
 *
 *   KM_BASELINE_RADIX             NVIDIA Dynamo RadixTree: one node per block, children keyed by the
 *                                 block's local (content) hash, per-worker engine-hash -> node maps.
 *   KM_BASELINE_RADIX_COMPRESSED  the same tree with compressed edges: a node holds a run of
 *                                 consecutive blocks that share one worker set (Dynamo's current
 *                                 ConcurrentRadixTreeCompressed idea, see bench/radix_compressed.c).
 *   KM_BASELINE_FLATMAP           llm-d style: a general-purpose hash map chain hash -> worker set,
 *                                 scored block by block.
 *
 * Answer contract (identical to km_index_match_batch for one request): for every worker holding
 * block 0 of the request, depth = the number of leading blocks it holds; entries ascending by worker;
 * owner = deepest, ties to the lowest worker id (KM_NO_WORKER / 0 when none).
 *
 * Where a baseline and km_index may legitimately differ (both documented behaviour):
 *   - the radix trees reject a store whose parent the storing worker does not hold (Dynamo's
 *     "parent block not found"): nothing is stored, the call returns KM_ERR_INVALID_ARGUMENT and
 *     stats.rejected_stores counts it; km_index stores such a run as an orphan. The flat map, like
 *     llm-d, ignores the parent.
 *   - hashes must be consistent: chain[i] is determined by (chain[i-1], local[i]), as km_hash_*
 *     guarantees. The trees navigate by local hash and use the chain hash as the engine hash.
 * Given consistent hashes and known parents, all three give exactly km_index's answers for any
 * sequence of stores and removes (holes included).
 *
 * Lifecycle: km_baseline_create -> km_baseline_store / km_baseline_remove (single writer) ->
 * km_baseline_match (any number of threads at once, each with its own km_baseline_result, while no
 * update runs) -> km_baseline_destroy. Every function returns KM_OK or a negative km_status. */
#ifndef KM_BENCH_BASELINES_H
#define KM_BENCH_BASELINES_H

#include <stddef.h>
#include <stdint.h>

#include "kvmatch/error.h"
#include "kvmatch/index.h"

typedef enum km_baseline_kind {
    KM_BASELINE_RADIX = 0,
    KM_BASELINE_RADIX_COMPRESSED = 1,
    KM_BASELINE_FLATMAP = 2,
} km_baseline_kind;
#define KM_BASELINE_KIND_COUNT 3

typedef struct km_baseline km_baseline;

typedef struct km_baseline_stats {
    uint64_t pairs;            /* (block, worker) pairs held now */
    uint64_t nodes;            /* tree nodes (runs for the compressed tree); map entries (flat map) */
    uint64_t memory_bytes;     /* every byte the structure holds: nodes, sets, children, lookups */
    uint64_t stored;           /* pairs added */
    uint64_t duplicate_stores; /* stores of a pair already held */
    uint64_t removed;          /* pairs removed */
    uint64_t absent_removes;   /* removes of a pair not held */
    uint64_t rejected_stores;  /* store calls refused because the parent was unknown (trees only) */
    uint64_t splits;           /* runs split in two (compressed tree only) */
} km_baseline_stats;

/* One request's answer plus the scratch a match needs. Reuse it across requests; one per thread. */
typedef struct km_baseline_result {
    km_worker_match *matches; /* count entries, ascending by worker, depth >= 1 */
    uint32_t count;
    uint32_t owner;       /* deepest worker, ties to the lowest id; KM_NO_WORKER when count == 0 */
    uint32_t owner_depth; /* 0 when count == 0 */
    uint64_t visits;      /* node visits (trees) or map lookups (flat map) this request cost */
    uint32_t *scratch;    /* private */
    uint32_t capacity;    /* private: max_workers of the baseline it was made for */
} km_baseline_result;

/* "radix", "radix_compressed", "flatmap"; NULL for an unknown kind. */
const char *km_baseline_name(km_baseline_kind kind);

/* max_workers: worker ids are 0 .. max_workers-1, 1 .. KM_MAX_WORKERS_LIMIT. */
int km_baseline_create(km_baseline_kind kind, uint32_t max_workers, km_baseline **out);
void km_baseline_destroy(km_baseline *baseline); /* NULL is a no-op */
km_baseline_kind km_baseline_get_kind(const km_baseline *baseline);

/* Worker now holds a run of n consecutive blocks: chain[i] / local[i] are block i's chain and local
 * hash; parent is the chain hash of the block before chain[0], or KM_NO_PARENT when chain[0] is the
 * first block of its sequence. local may be NULL for the flat map (it never reads it).
 * Errors: KM_ERR_NULL_POINTER, KM_ERR_WORKER_RANGE, KM_ERR_INVALID_ARGUMENT (unknown parent, trees),
 * KM_ERR_OUT_OF_MEMORY (the structure stays valid; a prefix of the run may be stored). */
int km_baseline_store(km_baseline *baseline, uint32_t worker, uint64_t parent,
                      const uint64_t *chain, const uint64_t *local, size_t n);

/* Worker no longer holds these blocks (chain hashes, any order, any subset). */
int km_baseline_remove(km_baseline *baseline, uint32_t worker, const uint64_t *chain, size_t n);

int km_baseline_result_init(const km_baseline *baseline, km_baseline_result *result);
void km_baseline_result_free(km_baseline_result *result); /* zeroed or initialised */

/* Score one request (n blocks; chain and local as for store; the trees read only local, the flat
 * map only chain, so the other may be NULL). */
int km_baseline_match(const km_baseline *baseline, const uint64_t *chain, const uint64_t *local,
                      uint32_t n, km_baseline_result *result);

int km_baseline_get_stats(const km_baseline *baseline, km_baseline_stats *out);

#endif
