/* SPDX-License-Identifier: Apache-2.0 */
/* An open-addressing map from u64 keys to u64 values, for host-side bookkeeping (segment anchors,
 * approximate mode's per-worker block maps, active work by hash, attempts by decision). Keys 0 and 1
 * are reserved (0 marks an empty entry, 1 an entry erased from the previous array while the map
 * grows): callers map arbitrary keys through km_u64map_key() first. Memory is accounted against a
 * km_memory.
 *
 * Growth is incremental once the map is large: the entries move to the doubled array a bounded
 * number of slots per km_u64map_reserve / growing put / erase, so no single call pays for rehashing
 * millions of entries (a routing service cannot stop for that). While it grows, both arrays are
 * live: lookups try the new array, then the old one; old entries at index < migrated have moved
 * (or been erased since), and an entry erased before it moved becomes a tombstone there. */
#ifndef KM_U64MAP_H
#define KM_U64MAP_H

#include <stdint.h>

#include "base/memory_budget.h"
#include "base/open_map.h"

typedef struct km_u64map_entry {
    uint64_t key;
    uint64_t value;
} km_u64map_entry;

/* The shared core (src/base/open_map.h) over km_u64map_entry: `entries` and `old` are arrays of them;
 * capacity, live, in_new, old_capacity and migrated as documented there. */
typedef km_oamap km_u64map;

/* Maps below this many slots rehash at once (a few hundred microseconds at most); larger ones grow
 * incrementally. */
#define KM_U64MAP_INCREMENTAL_SLOTS KM_OAMAP_INCREMENTAL_SLOTS

/* Keys 0 and 1 become two fixed other values (documented in docs/HASHING.md for engine hashes). */
static inline uint64_t km_u64map_key(uint64_t raw)
{
    return raw < 2 ? raw + UINT64_C(0x8a5cd789635d2dff) : raw;
}

void km_u64map_init(km_u64map *m, km_memory *memory);
void km_u64map_free(km_u64map *m);
/* Start loading the entry where a lookup of key begins (a hint; no effect on the map). */
/* always_inline: GCC 12 finds a function whose only effects are prefetches "const", and deletes
 * calls to it that it has not inlined yet (here: every call, once the body held two prefetches). */
__attribute__((always_inline)) static inline void km_u64map_prefetch(const km_u64map *m,
                                                                     uint64_t key)
{
    uint64_t h = key * UINT64_C(0x9E3779B97F4A7C15);
    const km_u64map_entry *now = (const void *)m->entries, *before = (const void *)m->old;
    if (m->capacity)
        __builtin_prefetch(&now[h & (m->capacity - 1)]);
    if (m->old)
        __builtin_prefetch(&before[h & (m->old_capacity - 1)]);
}

/* Pointer to the value of key, or NULL. Valid until the next reserve, growing put or erase (erase
 * shifts entries; growth moves them to the new array). */
static inline uint64_t *km_u64map_find(const km_u64map *m, uint64_t key)
{
    km_u64map_entry *e = (km_u64map_entry *)(void *)km_oamap_find(m, key, sizeof *e);
    return e ? &e->value : NULL;
}
/* Insert or overwrite. allow_grow = 0 never allocates and never moves an entry (room must have
 * been reserved). KM_ERR_MEMORY_CAP / OUT_OF_MEMORY. */
int km_u64map_put(km_u64map *m, uint64_t key, uint64_t value, int allow_grow);
/* 1 if erased, 0 if absent. Later entries of the probe run may move (backward shift), and a
 * growing map moves a few more entries to its new array. */
int km_u64map_erase(km_u64map *m, uint64_t key);
/* Room for `extra` more keys through put(..., allow_grow = 0). Also moves a bounded share of the
 * old array of a growing map (16 * extra slots, at least 1024, so the move ends long before the new
 * array fills). */
int km_u64map_reserve(km_u64map *m, uint64_t extra);
/* Move every remaining entry of a growing map now. */
void km_u64map_finish_growth(km_u64map *m);
uint64_t km_u64map_bytes(const km_u64map *m);
/* Iteration: start *cursor at 0; each call returns the next live entry, or NULL at the end. The map
 * must not change during an iteration. */
km_u64map_entry *km_u64map_next(const km_u64map *m, uint64_t *cursor);

#endif
