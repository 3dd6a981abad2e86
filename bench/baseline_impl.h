/* SPDX-License-Identifier: Apache-2.0 */
/* Internal to bench/: the baseline vtable and the building blocks the three baselines share --
 * accounted allocation, compact worker sets, a u64 -> u64 open-addressing map (per-worker engine-hash
 * lookups), small children tables for tree nodes, and the active-set walk that settles each worker's
 * depth when it drops out. Kept here so every baseline pays the same for the same job. */
#ifndef KM_BENCH_BASELINE_IMPL_H
#define KM_BENCH_BASELINE_IMPL_H

#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "baselines.h"

/* ---- accounted memory ---------------------------------------------------------------------- */

typedef struct km_bl_memory {
    uint64_t bytes;
} km_bl_memory;

static inline void *km_bl_alloc(km_bl_memory *m, size_t size)
{
    void *p = malloc(size);
    if (p)
        m->bytes += size;
    return p;
}

static inline void *km_bl_calloc(km_bl_memory *m, size_t n, size_t size)
{
    void *p = calloc(n, size);
    if (p)
        m->bytes += n * size;
    return p;
}

static inline void *km_bl_realloc(km_bl_memory *m, void *p, size_t old_size, size_t new_size)
{
    void *q = realloc(p, new_size);
    if (q) {
        m->bytes -= old_size;
        m->bytes += new_size;
    }
    return q;
}

static inline void km_bl_free(km_bl_memory *m, void *p, size_t size)
{
    if (p) {
        free(p);
        m->bytes -= size;
    }
}

/* ---- worker sets ---------------------------------------------------------------------------- */

/* 16 bytes: up to KM_BL_SET_INLINE ids inline (ascending), else a bitmap of words_per_set words.
 * A bitmap goes back to inline form when the set shrinks to KM_BL_SET_DEMOTE_AT. */
#define KM_BL_SET_INLINE 6u
#define KM_BL_SET_DEMOTE_AT 3u
#define KM_BL_FORM_INLINE 0u
#define KM_BL_FORM_BITMAP 1u

typedef union km_bl_set {
    struct {
        uint16_t count;
        uint16_t form;
        uint16_t ids[KM_BL_SET_INLINE];
    } in;
    struct {
        uint16_t count;
        uint16_t form;
        uint32_t reserved;
        uint64_t *bits;
    } bm;
} km_bl_set;

static inline uint32_t km_bl_words(uint32_t max_workers)
{
    return (max_workers + 63u) / 64u;
}

static inline uint32_t km_bl_set_count(const km_bl_set *s)
{
    return s->in.count;
}

static inline int km_bl_set_contains(const km_bl_set *s, uint32_t w)
{
    if (s->in.form == KM_BL_FORM_BITMAP)
        return (int)((s->bm.bits[w >> 6] >> (w & 63)) & 1u);
    for (uint32_t i = 0; i < s->in.count; i++)
        if (s->in.ids[i] == w)
            return 1;
    return 0;
}

/* Is the set exactly {w}? */
static inline int km_bl_set_is_only(const km_bl_set *s, uint32_t w)
{
    return s->in.form == KM_BL_FORM_INLINE && s->in.count == 1 && s->in.ids[0] == w;
}

int km_bl_set_add(km_bl_set *s, uint32_t w, uint32_t words, km_bl_memory *m);  /* 1, 0, <0 */
int km_bl_set_remove(km_bl_set *s, uint32_t w, uint32_t words, km_bl_memory *m); /* 1 or 0 */
int km_bl_set_copy(km_bl_set *dst, const km_bl_set *src, uint32_t words, km_bl_memory *m);
void km_bl_set_release(km_bl_set *s, uint32_t words, km_bl_memory *m);
/* Ascending ids into out (room for the whole set); returns the count. */
uint32_t km_bl_set_list(const km_bl_set *s, uint32_t words, uint32_t *out);

/* ---- u64 -> u64 map (linear probing, backward-shift deletion, any key) ---------------------- */

typedef struct km_bl_map_entry {
    uint64_t key;
    uint64_t value;
} km_bl_map_entry;

typedef struct km_bl_map {
    km_bl_map_entry *entries; /* key KM_BL_MAP_EMPTY = free */
    uint64_t capacity;        /* 0 or a power of two */
    uint64_t live;
} km_bl_map;

/* Keys are remapped so that the empty marker never occurs (km_bl_map_key). */
#define KM_BL_MAP_EMPTY UINT64_C(0)

static inline uint64_t km_bl_map_key(uint64_t raw)
{
    return raw == KM_BL_MAP_EMPTY ? UINT64_C(0x8a5cd789635d2dff) : raw;
}

static inline uint64_t km_bl_mix(uint64_t key)
{
    key ^= key >> 32;
    return key * UINT64_C(0x9E3779B97F4A7C15);
}

static inline km_bl_map_entry *km_bl_map_find(const km_bl_map *map, uint64_t raw)
{
    if (map->capacity == 0)
        return NULL;
    uint64_t key = km_bl_map_key(raw);
    uint64_t mask = map->capacity - 1;
    uint64_t i = (km_bl_mix(key) >> 20) & mask;
    for (;;) {
        km_bl_map_entry *e = &map->entries[i];
        if (e->key == key)
            return e;
        if (e->key == KM_BL_MAP_EMPTY)
            return NULL;
        i = (i + 1) & mask;
    }
}

/* Insert or overwrite. KM_OK or KM_ERR_OUT_OF_MEMORY. */
int km_bl_map_put(km_bl_map *map, uint64_t raw, uint64_t value, km_bl_memory *m);
/* 1 and *value if it was there, else 0. */
int km_bl_map_take(km_bl_map *map, uint64_t raw, uint64_t *value);
void km_bl_map_release(km_bl_map *map, km_bl_memory *m);

/* ---- children of a tree node, keyed by a local hash ----------------------------------------- */

#define KM_BL_NO_NODE UINT32_MAX

typedef struct km_bl_ctab {
    uint32_t capacity; /* power of two */
    uint32_t count;
    uint64_t *keys;
    uint32_t *nodes; /* KM_BL_NO_NODE = free */
} km_bl_ctab;

/* One child inline (the common case: a chain), a small hash table beyond that. */
typedef struct km_bl_children {
    uint64_t one_key;
    union {
        uint32_t one;
        km_bl_ctab *tab;
    } u;
    uint32_t count;
} km_bl_children;

static inline uint32_t km_bl_children_find(const km_bl_children *c, uint64_t key)
{
    if (c->count == 1)
        return c->one_key == key ? c->u.one : KM_BL_NO_NODE;
    if (c->count == 0)
        return KM_BL_NO_NODE;
    const km_bl_ctab *t = c->u.tab;
    uint32_t mask = t->capacity - 1;
    uint32_t i = (uint32_t)(km_bl_mix(key) >> 40) & mask;
    for (;;) {
        uint32_t n = t->nodes[i];
        if (n == KM_BL_NO_NODE)
            return KM_BL_NO_NODE;
        if (t->keys[i] == key)
            return n;
        i = (i + 1) & mask;
    }
}

/* Add key -> node (key absent). KM_OK or KM_ERR_OUT_OF_MEMORY. */
int km_bl_children_add(km_bl_children *c, uint64_t key, uint32_t node, km_bl_memory *m);
/* Change the node of a present key. */
void km_bl_children_set(km_bl_children *c, uint64_t key, uint32_t node);
void km_bl_children_del(km_bl_children *c, uint64_t key, km_bl_memory *m);
void km_bl_children_release(km_bl_children *c, km_bl_memory *m);
/* Call fn(node, user) for every child. */
void km_bl_children_each(const km_bl_children *c, void (*fn)(uint32_t node, void *user), void *user);
/* Whether `worker` is in the set of some child: set_of(tree, node) is a node's worker set. A remove
 * of the parent from that worker then leaves a hole (a block held without its parent). */
bool km_bl_children_held_by(const km_bl_children *c, const km_bl_set *(*set_of)(const void *tree,
                                                                               uint32_t node),
                            const void *tree, uint32_t worker);

/* ---- the active-set walk (find_matches) ----------------------------------------------------- */

/* Start a walk from the holders of block 0: every holder open. Returns the holder count. */
static inline uint32_t km_bl_walk_start(const km_bl_set *s, uint32_t words,
                                        km_baseline_result *r, uint32_t *open)
{
    uint32_t m = km_bl_set_list(s, words, open);
    for (uint32_t j = 0; j < m; j++) {
        r->matches[j].worker = open[j];
        r->matches[j].depth = UINT32_MAX;
        open[j] = j;
    }
    return m;
}

/* Intersect the open workers with the set of the block at `position`; drop-outs settle there.
 * prefix_closed: every worker that holds a block of the tree holds all of its ancestors, so the
 * open workers are exactly the holders of the previous block and a set of as many holders as are
 * open is the same set: nothing to intersect (Dynamo's RadixTree::find_matches makes the same
 * O(1) length check before its O(workers) one). */
static inline void km_bl_walk_filter(const km_bl_set *s, uint32_t position, km_baseline_result *r,
                                     uint32_t *open, uint32_t *n_open, bool prefix_closed)
{
    if (prefix_closed && km_bl_set_count(s) == *n_open)
        return;
    uint32_t kept = 0;
    for (uint32_t j = 0; j < *n_open; j++) {
        uint32_t e = open[j];
        if (km_bl_set_contains(s, r->matches[e].worker))
            open[kept++] = e;
        else
            r->matches[e].depth = position;
    }
    *n_open = kept;
}

/* Settle the still-open workers at `depth`, then pick the owner (deepest, lowest id on ties). */
static inline void km_bl_walk_finish(km_baseline_result *r, uint32_t m, const uint32_t *open,
                                     uint32_t n_open, uint32_t depth)
{
    for (uint32_t j = 0; j < n_open; j++)
        r->matches[open[j]].depth = depth;
    r->count = m;
    r->owner = KM_NO_WORKER;
    r->owner_depth = 0;
    for (uint32_t j = 0; j < m; j++) {
        if (r->matches[j].depth > r->owner_depth) {
            r->owner_depth = r->matches[j].depth;
            r->owner = r->matches[j].worker;
        }
    }
}

/* ---- vtable --------------------------------------------------------------------------------- */

typedef struct km_baseline_ops {
    const char *name;
    /* Allocate the structure for max_workers workers into *state. */
    int (*create)(uint32_t max_workers, void **state);
    void (*destroy)(void *state);
    /* As km_baseline_store / _remove / _match, arguments already checked (worker in range,
     * pointers non-NULL, result made for this baseline). */
    int (*store)(void *state, uint32_t worker, uint64_t parent, const uint64_t *chain,
                 const uint64_t *local, size_t n);
    int (*remove)(void *state, uint32_t worker, const uint64_t *chain, size_t n);
    void (*match)(const void *state, const uint64_t *chain, const uint64_t *local, uint32_t n,
                  km_baseline_result *result);
    void (*stats)(const void *state, km_baseline_stats *out);
    int needs_local; /* store / match read local hashes */
    int needs_chain_for_match;
} km_baseline_ops;

extern const km_baseline_ops km_baseline_radix_ops;
extern const km_baseline_ops km_baseline_radix_compressed_ops;
extern const km_baseline_ops km_baseline_flatmap_ops;

#endif
