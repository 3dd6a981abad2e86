/* SPDX-License-Identifier: Apache-2.0 */
/* The event feed's per-worker engine-hash map: an engine's block hash -> the kvmatch chain hash
 * computed for it, its parent's engine hash, the media (device, host, disk, ...) holding it, the
 * announcements holding it on each medium other than the device, the KV-cache groups holding it
 * on the device and the device copies beyond the first of the lowest groups. The shared
 * open-addressing core (src/base/open_map.h: linear probing, backward-shift deletion, incremental
 * growth: a map of 16 K slots or more moves its entries to the doubled array over the following
 * reserves and erases, so no message pays for rehashing a worker's million blocks) over 40-byte
 * entries; not accounted against the index's memory cap. Single-threaded (the feed's caller). */
#ifndef KM_EMAP_H
#define KM_EMAP_H

#include <stdint.h>

#include "base/open_map.h"
#include "base/u64_map.h"

/* KV-cache groups 0 .. KM_EMAP_COPY_GROUPS - 1 count a block's device copies. */
#define KM_EMAP_COPY_GROUPS 3u
/* The most extra copies an entry counts per group; copies beyond it are not counted. */
#define KM_EMAP_MAX_EXTRA_COPIES 255u
/* Media other than the device (km_kv_medium 1 .. KM_EMAP_HOLD_MEDIA) count the announcements
 * holding a block, holds[medium - 1]. */
#define KM_EMAP_HOLD_MEDIA 4u
/* The most announcements an entry counts per medium; more are not counted. */
#define KM_EMAP_MAX_HOLDS 65535u

typedef struct km_emap_entry {
    uint64_t key;   /* km_u64map_key(engine hash); 0 = empty, 1 = erased (old array only) */
    uint64_t chain; /* kvmatch chain hash, or the feed's mark for an unhashable block */
    /* km_u64map_key(engine hash of the block before it), as the store that added the entry named
     * it (the previous block of the event, or the event's parent); 0 for a sequence's first
     * block. */
    uint64_t parent;
    uint8_t media;  /* bit per medium holding the block */
    /* Per group g < KM_EMAP_COPY_GROUPS: the device copies of the block in group g beyond the
     * first (an engine caches a block again when it recomputes it, and removes each copy on its
     * own); 0 when gpu_groups lacks g's bit. */
    uint8_t extra_copies[KM_EMAP_COPY_GROUPS];
    uint32_t gpu_groups; /* bit per KV-cache group holding the block on the GPU (group 0 for an
                          * event without group_idx); 0 exactly when media lacks the GPU bit */
    /* Per medium m other than the device: the announcements (stores not yet removed) holding the
     * block in m, holds[m - 1]; not 0 exactly when media has m's bit. */
    uint16_t holds[KM_EMAP_HOLD_MEDIA];
} km_emap_entry;

/* The core over km_emap_entry: `entries` and `old` are arrays of them. */
typedef km_oamap km_emap;

void km_emap_init(km_emap *m);
/* Start loading the slot where a lookup of engine_hash begins (a hint; no effect on the map).
 * always_inline for the reason given at km_u64map_prefetch. */
__attribute__((always_inline)) static inline void km_emap_prefetch(const km_emap *m,
                                                                   uint64_t engine_hash)
{
    uint64_t key = km_u64map_key(engine_hash);
    if (m->capacity)
        __builtin_prefetch(m->entries + km_oamap_home(key, m->capacity) * sizeof(km_emap_entry));
    if (m->old)
        __builtin_prefetch(m->old + km_oamap_home(key, m->old_capacity) * sizeof(km_emap_entry));
}
void km_emap_free(km_emap *m);
/* The entry of an engine hash, or NULL. Valid until the next reserve, erase or clear. */
km_emap_entry *km_emap_find(const km_emap *m, uint64_t engine_hash);
/* Room for `extra` more entries through km_emap_upsert (load <= 70% once every old entry has
 * moved); moves max(16 * extra, 1024) old slots of a growing map. Entry pointers are stale
 * afterwards. KM_OK or KM_ERR_OUT_OF_MEMORY (nothing changed). */
int km_emap_reserve(km_emap *m, uint64_t extra);
/* The entry of an engine hash, inserted (chain 0, media 0, no copies, gpu_groups 0) when absent:
 * room must have been reserved. Never moves another entry, so pointers from find and upsert stay
 * valid. */
km_emap_entry *km_emap_upsert(km_emap *m, uint64_t engine_hash);
/* Erase an entry find or upsert returned. Later entries may move (backward shift), and a growing
 * map moves a few more: entry pointers are stale afterwards. */
void km_emap_erase(km_emap *m, km_emap_entry *e);
/* Drop every entry (keeps the current array; a growth in progress ends). */
void km_emap_clear(km_emap *m);
/* Size an empty map for `entries` at the densest load a reserve accepts (restoring saved state):
 * half the memory of a fresh reserve. KM_OK, KM_ERR_OUT_OF_MEMORY, or KM_ERR_INVALID_ARGUMENT
 * for a map that is not empty (nothing changed). */
int km_emap_size_for(km_emap *m, uint64_t entries);
/* Iteration: start *cursor at 0; each call returns the next entry, or NULL at the end. The map must
 * not change during an iteration. */
const km_emap_entry *km_emap_next(const km_emap *m, uint64_t *cursor);

#endif
