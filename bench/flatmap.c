/* SPDX-License-Identifier: Apache-2.0 */
/* Baseline "flatmap": the llm-d KV cache indexer's scorer (llm-d/llm-d-kv-cache,
 * ../shared/reference/peers.md) over its in-memory index.
 *
 * Reproduces: a general-purpose hash map from block key to the set of pods (workers) holding it; the
 * scorer looks the request's keys up one block at a time, intersecting the pod set block by block,
 * and stops at the first block no active pod holds ("longest consecutive prefix"). Block keys are
 * our chain hashes (llm-d recomputes its own chained request keys from token ids and maps engine
 * keys onto them; both name a block together with its prefix). Parents are not needed. The LRU
 * bookkeeping and tier weights (GPU 1.0 / CPU 0.8) are left out: every block here is on the device
 * and nothing is evicted, so they would not change a score.
 *
 * Where it differs from llm-d's defaults: its in-memory index keeps at most 10 pods per key
 * (defaultPodsPerKey); here a key keeps every holder, so answers are exact at 1,024 workers, where
 * a default deployment would keep fewer holders and do less work per block. Against the baseline's
 * favour that is more work; in its favour, llm-d's Lookup looks up every key of a request and
 * skips the missing ones where this one stops at the first, and its LongestPrefixScorer builds a
 * new set per block and finds the best score by a linear scan, which this one does not.
 *
 * Optimised as a good C general-purpose map would be: open addressing with linear probing over
 * 16-byte (key, value) entries, the value an index into a pool of 16-byte worker sets (6 ids
 * inline, a bitmap beyond) -- the value lives out of line as in any map of key -> set object, so a
 * lookup costs the entry read plus the set read -- and the home slot of the key 8 blocks ahead is
 * prefetched (the keys of a request are known up front). No segment keys, no batching: one request
 * at a time. */
#include <stdlib.h>
#include <string.h>

#include "baseline_impl.h"

#define FLATMAP_PREFETCH_AHEAD 8u
#define SET_FREE_FORM 0xFFFFu

typedef struct flatmap {
    uint32_t max_workers, words;
    km_bl_memory memory;
    km_bl_map map; /* chain hash -> index into sets */
    km_bl_set *sets;
    uint32_t sets_high, sets_capacity, free_head;
    km_baseline_stats stats;
} flatmap;

static int set_new(flatmap *f, uint32_t *out)
{
    uint32_t idx;
    if (f->free_head != KM_BL_NO_NODE) {
        idx = f->free_head;
        f->free_head = f->sets[idx].bm.reserved;
    } else {
        if (f->sets_high == f->sets_capacity) {
            if (f->sets_capacity >= UINT32_MAX / 2)
                return KM_ERR_OUT_OF_MEMORY;
            uint32_t cap = f->sets_capacity ? f->sets_capacity * 2 : 1024;
            km_bl_set *s = km_bl_realloc(&f->memory, f->sets,
                                         (size_t)f->sets_capacity * sizeof(km_bl_set),
                                         (size_t)cap * sizeof(km_bl_set));
            if (!s)
                return KM_ERR_OUT_OF_MEMORY;
            f->sets = s;
            f->sets_capacity = cap;
        }
        idx = f->sets_high++;
    }
    memset(&f->sets[idx], 0, sizeof(km_bl_set));
    *out = idx;
    return KM_OK;
}

static void set_free(flatmap *f, uint32_t idx)
{
    km_bl_set_release(&f->sets[idx], f->words, &f->memory);
    f->sets[idx].bm.form = SET_FREE_FORM;
    f->sets[idx].bm.reserved = f->free_head;
    f->free_head = idx;
}

static int flatmap_create(uint32_t max_workers, void **state)
{
    flatmap *f = calloc(1, sizeof(*f));
    if (!f)
        return KM_ERR_OUT_OF_MEMORY;
    f->max_workers = max_workers;
    f->words = km_bl_words(max_workers);
    f->free_head = KM_BL_NO_NODE;
    *state = f;
    return KM_OK;
}

static void flatmap_destroy(void *state)
{
    flatmap *f = state;
    if (!f)
        return;
    for (uint32_t i = 0; i < f->sets_high; i++)
        if (f->sets[i].bm.form != SET_FREE_FORM)
            km_bl_set_release(&f->sets[i], f->words, &f->memory);
    km_bl_map_release(&f->map, &f->memory);
    free(f->sets);
    free(f);
}

static int flatmap_store(void *state, uint32_t worker, uint64_t parent, const uint64_t *chain,
                         const uint64_t *local, size_t n)
{
    (void)parent;
    (void)local;
    flatmap *f = state;
    for (size_t i = 0; i < n; i++) {
        km_bl_map_entry *e = km_bl_map_find(&f->map, chain[i]);
        uint32_t idx;
        if (e) {
            idx = (uint32_t)e->value;
        } else {
            int rc = set_new(f, &idx);
            if (rc == KM_OK)
                rc = km_bl_map_put(&f->map, chain[i], idx, &f->memory);
            if (rc != KM_OK)
                return rc;
        }
        int added = km_bl_set_add(&f->sets[idx], worker, f->words, &f->memory);
        if (added < 0)
            return added;
        if (added) {
            f->stats.stored++;
            f->stats.pairs++;
        } else {
            f->stats.duplicate_stores++;
        }
    }
    return KM_OK;
}

static int flatmap_remove(void *state, uint32_t worker, const uint64_t *chain, size_t n)
{
    flatmap *f = state;
    for (size_t i = 0; i < n; i++) {
        km_bl_map_entry *e = km_bl_map_find(&f->map, chain[i]);
        uint32_t idx = e ? (uint32_t)e->value : 0;
        if (!e || !km_bl_set_remove(&f->sets[idx], worker, f->words, &f->memory)) {
            f->stats.absent_removes++;
            continue;
        }
        f->stats.removed++;
        f->stats.pairs--;
        if (km_bl_set_count(&f->sets[idx]) == 0) {
            km_bl_map_take(&f->map, chain[i], NULL);
            set_free(f, idx);
        }
    }
    return KM_OK;
}

static inline void prefetch_key(const km_bl_map *map, uint64_t raw)
{
    if (map->capacity == 0)
        return;
    uint64_t key = km_bl_map_key(raw);
    __builtin_prefetch(&map->entries[(km_bl_mix(key) >> 20) & (map->capacity - 1)], 0, 1);
}

static void flatmap_match(const void *state, const uint64_t *chain, const uint64_t *local,
                          uint32_t n, km_baseline_result *r)
{
    (void)local;
    const flatmap *f = state;
    uint32_t *open = r->scratch;
    for (uint32_t k = 1; k <= FLATMAP_PREFETCH_AHEAD && k < n; k++)
        prefetch_key(&f->map, chain[k]);
    const km_bl_map_entry *e = km_bl_map_find(&f->map, chain[0]);
    r->visits = 1;
    if (!e)
        return;
    uint32_t m = km_bl_walk_start(&f->sets[e->value], f->words, r, open);
    uint32_t n_open = m;
    uint32_t i = 1;
    for (; i < n && n_open > 0; i++) {
        if (i + FLATMAP_PREFETCH_AHEAD < n)
            prefetch_key(&f->map, chain[i + FLATMAP_PREFETCH_AHEAD]);
        e = km_bl_map_find(&f->map, chain[i]);
        r->visits++;
        if (!e)
            break;
        km_bl_walk_filter(&f->sets[e->value], i, r, open, &n_open, false);
    }
    km_bl_walk_finish(r, m, open, n_open, i);
}

static void flatmap_stats(const void *state, km_baseline_stats *out)
{
    const flatmap *f = state;
    *out = f->stats;
    out->nodes = f->map.live;
    /* The sets array grows by doubling; count the entries in use, as a per-object allocator
     * would hold, not the slack. */
    out->memory_bytes = f->memory.bytes -
                        (uint64_t)(f->sets_capacity - f->sets_high) * sizeof(km_bl_set);
}

const km_baseline_ops km_baseline_flatmap_ops = {
    .name = "flatmap",
    .create = flatmap_create,
    .destroy = flatmap_destroy,
    .store = flatmap_store,
    .remove = flatmap_remove,
    .match = flatmap_match,
    .stats = flatmap_stats,
    .needs_local = 0,
    .needs_chain_for_match = 1,
};
