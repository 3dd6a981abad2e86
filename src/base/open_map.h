/* SPDX-License-Identifier: Apache-2.0 */
/* The open-addressing core shared by the host's keyed maps (src/base/u64_map.c: u64 -> u64 bookkeeping;
 * src/events/engine_hash_map.c: the feed's engine-hash maps): entries of `entry_size` bytes that begin with a u64 key,
 * linear probing from a Fibonacci-hashed home, backward-shift deletion, and incremental growth.
 * Keys 0 (empty) and 1 (erased, only ever in the old array of a growing map) are reserved: callers
 * map their keys through km_u64map_key() first.
 *
 * Growth: past 70% a map allocates the doubled array (zeroed, from src/base/zeroed_pages.c) and keeps the old
 * one; maps of KM_OAMAP_INCREMENTAL_SLOTS or more then move the old slots over the following
 * reserves (16 slots per entry reserved, at least 1,024) and erases (64), so no single call pays
 * for rehashing millions of entries. While it grows, both arrays are live: an entry is in exactly
 * one of them; lookups try the new array, then the old one from max(home, migrated), going on at
 * `migrated` when a probe run wraps past the old array's end and stopping at an empty slot or
 * back where they started; an erase of an entry still in the old array leaves key 1 there, so its
 * probe runs stay whole. The moved part of the old array is given back a 2 MiB piece at a time.
 *
 * The lookups are inline so that each map's constant entry size specialises them. */
#ifndef KM_OAMAP_H
#define KM_OAMAP_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "base/memory_budget.h"

#define KM_OAMAP_EMPTY UINT64_C(0)
#define KM_OAMAP_ERASED UINT64_C(1)

/* Maps below this many slots rehash at once when they grow (a few hundred microseconds at most). */
#define KM_OAMAP_INCREMENTAL_SLOTS (UINT64_C(1) << 14)

typedef struct km_oamap {
    uint8_t *entries;
    uint64_t capacity; /* power of two, or 0 before the first reserve */
    uint64_t live;     /* entries in both arrays */
    uint64_t in_new;   /* of them, in `entries` */
    /* While growing: the previous array; its slots [migrated, old_capacity) are still to move. */
    uint8_t *old;
    uint64_t old_capacity;
    uint64_t migrated;
    km_memory *memory; /* both arrays are accounted here while they live; NULL: not accounted */
    uint32_t entry_size;
    uint32_t min_capacity; /* the first array's size */
} km_oamap;

/* Backward-shift deletion, shared by every linear-probing map in kvmatch (these maps and the
 * index's host tables, src/index/host_table.c): after a hole opens at `hole`, the key at slot j further along the
 * same probe run, whose home slot is `home`, may move back into the hole iff its home does not lie
 * in (hole, j], so it stays reachable from its home. mask = capacity - 1. */
static inline int km_probe_may_fill(uint64_t home, uint64_t hole, uint64_t j, uint64_t mask)
{
    return ((j - home) & mask) >= ((j - hole) & mask);
}

/* An empty map of entries of entry_size bytes (at least 8, the key first). */
void km_oamap_init(km_oamap *m, uint32_t entry_size, uint32_t min_capacity, km_memory *memory);
void km_oamap_free(km_oamap *m);

static inline uint64_t km_oamap_entry_key(const uint8_t *e)
{
    uint64_t key;
    memcpy(&key, e, sizeof key);
    return key;
}

static inline uint64_t km_oamap_home(uint64_t key, uint64_t capacity)
{
    return (key * UINT64_C(0x9E3779B97F4A7C15)) & (capacity - 1);
}

/* km_oamap_find_new, and for an absent key *vacant = the empty slot that ends its probe run,
 * where km_oamap_place puts it (the new array holds no erased keys); NULL when the map has no
 * array yet. */
static inline uint8_t *km_oamap_find_new_vacant(const km_oamap *m, uint64_t key, size_t entry_size,
                                                uint8_t **vacant)
{
    *vacant = NULL;
    if (m->capacity == 0)
        return NULL;
    for (uint64_t i = km_oamap_home(key, m->capacity);; i = (i + 1) & (m->capacity - 1)) {
        uint8_t *e = m->entries + i * entry_size;
        uint64_t k = km_oamap_entry_key(e);
        if (k == key)
            return e;
        if (k == KM_OAMAP_EMPTY) {
            *vacant = e;
            return NULL;
        }
    }
}

/* The entry of key in the new array, or NULL. */
static inline uint8_t *km_oamap_find_new(const km_oamap *m, uint64_t key, size_t entry_size)
{
    uint8_t *vacant;
    return km_oamap_find_new_vacant(m, key, entry_size, &vacant);
}

/* The entry of key in the old array if it has not moved yet, or NULL (see the file comment). */
static inline uint8_t *km_oamap_find_old(const km_oamap *m, uint64_t key, size_t entry_size)
{
    if (!m->old)
        return NULL;
    uint64_t i = km_oamap_home(key, m->old_capacity);
    if (i < m->migrated)
        i = m->migrated;
    uint64_t start = i;
    for (;;) {
        uint8_t *e = m->old + i * entry_size;
        uint64_t k = km_oamap_entry_key(e);
        if (k == key)
            return e;
        if (k == KM_OAMAP_EMPTY)
            return NULL;
        if (++i == m->old_capacity)
            i = m->migrated;
        if (i == start)
            return NULL;
    }
}

/* The entry of key (> 1) in either array, or NULL. Valid until the next reserve or erase. */
static inline uint8_t *km_oamap_find(const km_oamap *m, uint64_t key, size_t entry_size)
{
    uint8_t *e = km_oamap_find_new(m, key, entry_size);
    return e ? e : km_oamap_find_old(m, key, entry_size);
}

/* Copy an entry whose key is in neither array into the new one, which has room; returns it. Never
 * moves another entry. */
uint8_t *km_oamap_place(km_oamap *m, const void *entry);
/* Room for `extra` more entries through km_oamap_place (70% load once every old entry has moved),
 * after moving a growing map's share. KM_ERR_MEMORY_CAP / KM_ERR_OUT_OF_MEMORY (nothing changed). */
int km_oamap_reserve(km_oamap *m, uint64_t extra);
/* Erase an entry a find returned: later entries may move (backward shift), and a growing map moves
 * a few more; pointers into the map are stale afterwards. */
void km_oamap_erase(km_oamap *m, uint8_t *entry);
/* The share of a growing map's move that each erase makes (km_oamap_erase_sized). */
void km_oamap_erase_moves(km_oamap *m);
/* km_oamap_erase for a map whose entries are entry_size bytes: inline, so that a map's constant
 * entry size turns the moves into plain loads and stores. */
static inline void km_oamap_erase_sized(km_oamap *m, uint8_t *entry, size_t entry_size)
{
    if ((uintptr_t)entry - (uintptr_t)m->entries >= m->capacity * entry_size) {
        /* Still in the old array: a tombstone keeps its probe runs whole. */
        memset(entry, 0, entry_size);
        uint64_t erased = KM_OAMAP_ERASED;
        memcpy(entry, &erased, sizeof erased);
    } else {
        /* Backward shift, as in km_table_erase: no tombstones in the new array. */
        uint8_t *entries = m->entries; /* the moves below never change the map's fields */
        uint64_t capacity = m->capacity, mask = capacity - 1;
        uint64_t hole = (uint64_t)(entry - entries) / entry_size;
        for (uint64_t j = (hole + 1) & mask;; j = (j + 1) & mask) {
            uint64_t key = km_oamap_entry_key(entries + j * entry_size);
            if (key == KM_OAMAP_EMPTY)
                break;
            if (!km_probe_may_fill(km_oamap_home(key, capacity), hole, j, mask))
                continue;
            memcpy(entries + hole * entry_size, entries + j * entry_size, entry_size);
            hole = j;
        }
        memset(entries + hole * entry_size, 0, entry_size);
        m->in_new--;
    }
    m->live--;
    if (m->old)
        km_oamap_erase_moves(m);
}
/* Move every remaining old entry now. */
void km_oamap_finish_growth(km_oamap *m);
/* Size an empty map for `entries` at the densest load a reserve accepts (70%: restoring saved
 * state, half the memory of a reserve). KM_ERR_INVALID_ARGUMENT when not empty. */
int km_oamap_size_for(km_oamap *m, uint64_t entries);
/* Drop every entry (the current array is kept; a growth in progress ends). */
void km_oamap_clear(km_oamap *m);
/* Iteration: start *cursor at 0; each call returns the next entry, or NULL at the end. The map must
 * not change during an iteration. */
uint8_t *km_oamap_next(const km_oamap *m, uint64_t *cursor);
/* Bytes of both arrays. */
uint64_t km_oamap_bytes(const km_oamap *m);

#endif
