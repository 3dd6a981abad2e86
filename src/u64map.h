/* A small open-addressing map from u64 keys to u64 values, for host-side bookkeeping (segment
 * anchors, per-worker engine-hash maps). Keys 0 and 1 are reserved (0 marks an empty entry, 1 was
 * the tombstone before erase became a backward shift): callers map
 * arbitrary keys through km_u64map_key() first. Memory is accounted against a km_memory. */
#ifndef KM_U64MAP_H
#define KM_U64MAP_H

#include <stdint.h>

#include "table.h"

typedef struct km_u64map_entry {
    uint64_t key;
    uint64_t value;
} km_u64map_entry;

typedef struct km_u64map {
    km_u64map_entry *entries;
    uint64_t capacity; /* power of two, or 0 before the first insert */
    uint64_t live;
    km_memory *memory;
} km_u64map;

/* Keys 0 and 1 become two fixed other values (documented in docs/HASHING.md for engine hashes). */
static inline uint64_t km_u64map_key(uint64_t raw)
{
    return raw < 2 ? raw + UINT64_C(0x8a5cd789635d2dff) : raw;
}

void km_u64map_init(km_u64map *m, km_memory *memory);
void km_u64map_free(km_u64map *m);
/* Start loading the entry where a lookup of key begins (a hint; no effect on the map). */
static inline void km_u64map_prefetch(const km_u64map *m, uint64_t key)
{
    if (m->capacity)
        __builtin_prefetch(&m->entries[(key * UINT64_C(0x9E3779B97F4A7C15)) & (m->capacity - 1)]);
}

/* Pointer to the value of key, or NULL. Valid until the next insert or erase (erase shifts). */
uint64_t *km_u64map_find(const km_u64map *m, uint64_t key);
/* Insert or overwrite. allow_grow = 0 never allocates (undo). KM_ERR_MEMORY_CAP / OUT_OF_MEMORY. */
int km_u64map_put(km_u64map *m, uint64_t key, uint64_t value, int allow_grow);
/* 1 if erased, 0 if absent. Later entries of the probe run may move (backward shift). */
int km_u64map_erase(km_u64map *m, uint64_t key);
int km_u64map_reserve(km_u64map *m, uint64_t extra);
uint64_t km_u64map_bytes(const km_u64map *m);

#endif
