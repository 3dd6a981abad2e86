/* SPDX-License-Identifier: Apache-2.0 */
/* The event feed's per-worker engine-hash map: an engine's block hash -> the kvmatch chain hash
 * computed for it, the media (device, host, disk, ...) holding it, the KV-cache groups holding it
 * on the device and the device copies beyond the first of the lowest groups, in 24-byte entries.
 * Two side maps keyed by an entry's key hold what few deployments need, so that the others pay
 * nothing for it:
 *  - parents: the engine hash of the block before it, kept only when the map was created to keep
 *    them (a pool whose engines announce offloaded chunks of several blocks by placeholders);
 *  - announcements: per medium other than the device, how many announcements hold the block, only
 *    for blocks held by two or more in one medium (one is said by the media bit); the side map
 *    exists only while it holds such a block.
 * Erasing or clearing an entry erases its side entries: the side maps never hold a key the map
 * does not (km_emap_check). The shared open-addressing core (src/base/open_map.h: linear probing,
 * backward-shift deletion, incremental growth: a map of 16 K slots or more moves its entries to the
 * doubled array over the following reserves and erases, so no message pays for rehashing a
 * worker's million blocks) under all three; not accounted against the index's memory cap.
 * Single-threaded (the feed's caller). */
#ifndef KM_EMAP_H
#define KM_EMAP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvmatch/error.h"
#include "base/open_map.h"
#include "base/u64_map.h"

/* KV-cache groups 0 .. KM_EMAP_COPY_GROUPS - 1 count a block's device copies (in the entry's
 * padding, so an entry stays 24 bytes). */
#define KM_EMAP_COPY_GROUPS 3u
/* The most extra copies an entry counts per group; copies beyond it are not counted. */
#define KM_EMAP_MAX_EXTRA_COPIES 255u
/* Media other than the device (km_kv_medium 1 .. KM_EMAP_HOLD_MEDIA) count the announcements
 * holding a block. */
#define KM_EMAP_HOLD_MEDIA 4u
/* The most announcements the map counts per block and medium; more are not counted. */
#define KM_EMAP_MAX_HOLDS 65535u

typedef struct km_emap_entry {
    uint64_t key;   /* km_u64map_key(engine hash); 0 = empty, 1 = erased (old array only) */
    uint64_t chain; /* kvmatch chain hash, or the feed's mark for an unhashable block */
    uint8_t media;  /* bit per medium holding the block */
    /* Per group g < KM_EMAP_COPY_GROUPS: the device copies of the block in group g beyond the
     * first (an engine caches a block again when it recomputes it, and removes each copy on its
     * own); 0 when gpu_groups lacks g's bit. */
    uint8_t extra_copies[KM_EMAP_COPY_GROUPS];
    uint32_t gpu_groups; /* bit per KV-cache group holding the block on the GPU (group 0 for an
                          * event without group_idx); 0 exactly when media lacks the GPU bit */
} km_emap_entry;

typedef struct km_emap {
    km_oamap core; /* km_emap_entry */
    /* entry key -> km_u64map_key(parent's engine hash), for entries that have a parent; empty
     * unless keep_parents. */
    km_u64map parents;
    /* entry key -> announcements per medium m = 1 .. KM_EMAP_HOLD_MEDIA, 16 bits each at bit
     * 16 * (m - 1): a count of 2 or more, or 0 where the media bit says it (0 or 1). Only entries
     * with some count of 2 or more; freed when none has. */
    km_u64map holds;
    bool keep_parents;
} km_emap;

/* keep_parents: keep each entry's parent (km_emap_set_parent); without it parents are dropped. */
void km_emap_init(km_emap *m, bool keep_parents);
/* Start loading the slot where a lookup of engine_hash begins and the line after it (a hint; no
 * effect on the map): a 24-byte entry may straddle two lines, and a probe run or an erase's
 * backward shift goes on into the next. always_inline for the reason given at
 * km_u64map_prefetch. */
__attribute__((always_inline)) static inline void km_emap_prefetch(const km_emap *m,
                                                                   uint64_t engine_hash)
{
    uint64_t key = km_u64map_key(engine_hash);
    const km_oamap *c = &m->core;
    if (c->capacity) {
        const uint8_t *home = c->entries + km_oamap_home(key, c->capacity) * sizeof(km_emap_entry);
        __builtin_prefetch(home);
        __builtin_prefetch(home + 64);
    }
    if (c->old)
        __builtin_prefetch(c->old + km_oamap_home(key, c->old_capacity) * sizeof(km_emap_entry));
}
void km_emap_free(km_emap *m);
/* Entries in the map. */
static inline uint64_t km_emap_live(const km_emap *m)
{
    return m->core.live;
}
/* The entry of an engine hash, or NULL. Valid until the next reserve, erase or clear. */
static inline km_emap_entry *km_emap_find(const km_emap *m, uint64_t engine_hash)
{
    return (km_emap_entry *)(void *)km_oamap_find(&m->core, km_u64map_key(engine_hash),
                                                  sizeof(km_emap_entry));
}
/* Room for `extra` more entries through km_emap_upsert, and for their parents when the map keeps
 * them (load <= 70% once every old entry has moved); moves max(16 * extra, 1024) old slots of a
 * growing map. Entry pointers are stale afterwards. KM_OK or KM_ERR_OUT_OF_MEMORY (the map holds
 * the same entries). */
int km_emap_reserve(km_emap *m, uint64_t extra);
/* The entry of an engine hash, inserted (chain 0, media 0, no copies, gpu_groups 0, no parent)
 * when absent: room must have been reserved. Never moves another entry, so pointers from find and
 * upsert stay valid. */
static inline km_emap_entry *km_emap_upsert(km_emap *m, uint64_t engine_hash)
{
    uint64_t key = km_u64map_key(engine_hash);
    uint8_t *vacant;
    uint8_t *e = km_oamap_find_new_vacant(&m->core, key, sizeof(km_emap_entry), &vacant);
    if (!e)
        e = km_oamap_find_old(&m->core, key, sizeof(km_emap_entry));
    if (e)
        return (km_emap_entry *)(void *)e;
    /* Where km_oamap_place would put it: the new array's empty slot ending the key's run. */
    km_emap_entry fresh = {.key = key};
    memcpy(vacant, &fresh, sizeof fresh);
    m->core.in_new++;
    m->core.live++;
    return (km_emap_entry *)(void *)vacant;
}
/* km_emap_erase's part for a map holding parents or announcements: key's are dropped. */
void km_emap_erase_extras(km_emap *m, uint64_t key);
/* Erase an entry find or upsert returned, with its parent and announcements. Later entries may
 * move (backward shift), and a growing map moves a few more: entry pointers are stale afterwards.
 * Inline: an erase per removed block. */
__attribute__((always_inline)) static inline void km_emap_erase(km_emap *m, km_emap_entry *e)
{
    uint64_t key = e->key;
    km_oamap_erase_sized(&m->core, (uint8_t *)e, sizeof *e);
    if (m->parents.live || m->holds.live)
        km_emap_erase_extras(m, key);
}
/* Drop every entry (keeps the current array; a growth in progress ends). */
void km_emap_clear(km_emap *m);
/* Size an empty map for `entries` at the densest load a reserve accepts (restoring saved state):
 * half the memory of a fresh reserve. KM_OK, KM_ERR_OUT_OF_MEMORY, or KM_ERR_INVALID_ARGUMENT
 * for a map that is not empty (nothing changed). */
int km_emap_size_for(km_emap *m, uint64_t entries);
/* Iteration: start *cursor at 0; each call returns the next entry, or NULL at the end. The map must
 * not change during an iteration. */
const km_emap_entry *km_emap_next(const km_emap *m, uint64_t *cursor);

/* ---- parents --------------------------------------------------------------------------------- */

/* The out-of-line parts of km_emap_parent and km_emap_set_parent, for a map that holds (keeps)
 * parents; the common map keeps none, and their tests of that are inline. */
uint64_t km_emap_parent_held(const km_emap *m, const km_emap_entry *e);
int km_emap_set_kept_parent(km_emap *m, const km_emap_entry *e, uint64_t parent_key);

/* km_u64map_key of the engine hash of the block before e's, as set; 0 when none was set or the
 * map keeps no parents. */
static inline uint64_t km_emap_parent(const km_emap *m, const km_emap_entry *e)
{
    return m->parents.live ? km_emap_parent_held(m, e) : 0;
}

/* Set e's parent (a km_u64map_key; 0: none). No effect when the map keeps no parents. Room comes
 * from km_emap_reserve; KM_ERR_OUT_OF_MEMORY only beyond it (e keeps no parent then). Never moves
 * an entry of the map. */
static inline int km_emap_set_parent(km_emap *m, const km_emap_entry *e, uint64_t parent_key)
{
    return m->keep_parents ? km_emap_set_kept_parent(m, e, parent_key) : KM_OK;
}

/* ---- announcements per medium other than the device ------------------------------------------ */

/* The announcements holding e's block in medium (1 .. KM_EMAP_HOLD_MEDIA): 0 without the medium's
 * media bit, else 1 or the count kept for it. */
uint32_t km_emap_holds(const km_emap *m, const km_emap_entry *e, unsigned medium);
/* One more announcement in medium: sets its media bit, or counts one more (up to
 * KM_EMAP_MAX_HOLDS; a count the side map has no memory for is not counted either: the block then
 * leaves the medium early, never late). Never moves an entry of the map. */
void km_emap_gain_hold(km_emap *m, km_emap_entry *e, unsigned medium);
/* One announcement fewer in medium: true when another still holds the block there (media
 * unchanged); false when the caller must take the block out of the medium (km_emap_leave). */
bool km_emap_drop_hold(km_emap *m, const km_emap_entry *e, unsigned medium);
/* Take the block out of medium at once (whatever its count): clears the media bit and count. */
void km_emap_leave(km_emap *m, km_emap_entry *e, unsigned medium);
/* Restoring saved state: set the count of e in medium (>= 2, e's media bit set, none set before);
 * KM_OK or KM_ERR_OUT_OF_MEMORY. */
int km_emap_restore_holds(km_emap *m, const km_emap_entry *e, unsigned medium, uint32_t count);

/* The side maps hold only keys the map holds, counts of 2 or more in media the entry holds, no
 * parent unless kept, and the announcement map is freed while empty. KM_OK, or KM_ERR_INTERNAL
 * with the first violation in why. */
int km_emap_check(const km_emap *m, char *why, size_t why_size);

#endif
