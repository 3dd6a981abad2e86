/* SPDX-License-Identifier: Apache-2.0 */
/* The host hash table: open addressing with linear probing over 16-byte km_slot (src/index/slot_walk.h),
 * any capacity (multiply-shift home slots), run at 53-80% load (grows by half at 80%),
 * backward-shift deletion (no tombstones, so removes never force a purging rehash and probe runs
 * stay as short as the live load makes them), a pool of bitmaps for widely-held blocks, optional
 * per-slot block metadata, dirty-slot tracking for device replicas (every slot a shift moves is
 * listed), and memory accounting against a shared cap (src/base/memory_budget.h). Single writer;
 * readers use km_table_view.
 *
 * Growth is incremental once the table is large (KM_TABLE_INCREMENTAL_SLOTS): the keys move to the
 * larger arrays a bounded number of slots per reserve, insert and erase, so no single call pays
 * for rehashing millions of keys. While a table grows both arrays are live:
 *  - a key is in exactly one of them; lookups try the new array, then the old one from
 *    max(home, migrated) (old slots below `migrated` have moved, and may have been unmapped);
 *  - a slot index names either array: [0, capacity) the new one, [capacity, capacity +
 *    old_capacity) the old one. Every accessor below takes either; inserts go to the new array;
 *  - erasing a key still in the old array leaves KM_KEY_TOMBSTONE there, so the old array's probe
 *    runs stay whole (it never holds any otherwise);
 *  - a device replica mirrors one array, so it is not synced while a move lasts (scoring runs on
 *    the host meanwhile, and each update batch moves a bounded step more: km_table_advance_growth;
 *    src/index/index.c, sync_backend).
 * An empty slot is all zero bytes (fresh arrays are zeroed pages, erase writes zeros). */
#ifndef KM_TABLE_H
#define KM_TABLE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "base/memory_budget.h"
#include "index/slot_walk.h"

/* Tables below this many slots rehash at once when they grow (a few hundred microseconds at most);
 * larger ones grow incrementally. */
#define KM_TABLE_INCREMENTAL_SLOTS (UINT64_C(1) << 14)
/* Most slots a table may have: no host holds more, and past it the arrays' byte sizes would
 * overflow. */
#define KM_TABLE_MAX_SLOTS (UINT64_C(1) << 40)

/* Per-block facts the update planner needs and scoring never reads (parallel to the slots), 7
 * bytes. What segment keys need of a block's place in its sequence is its offset inside its
 * segment (position modulo segment_blocks, at most 254) and its segment's first block; that block
 * is kept as a 24-bit tag (km_anchor_tag), the key of its anchor list (src/index/index.c): two
 * segments whose tags collide share a list, which costs a remove a few more candidates to check
 * and stays sound.
 *
 * The block before it in its segment (its parent) is kept as a 24-bit tag, not a chain hash: the
 * top 24 bits of the parent's Fibonacci hash (km_parent_tag), which fix the parent's home slot in
 * a table of up to 2^24 slots (a range of capacity / 2^24 homes beyond). km_table_find_parent
 * finds it again: the one key of those homes whose own tag is the one kept and whose metadata is
 * this block's anchor at the offset before. A parent is needed only inside a segment (segment keys
 * check a worker's hold of a segment, and recompute its fingerprints on undo, by walking back from
 * its last block), so a block at offset 0 and an orphan keep no parent (tag 0). */
#define KM_OFFSET_UNKNOWN 0xFFu /* an orphan: no known position */
#define KM_ANCHOR_TAG_BITS 24u
#define KM_PARENT_TAG_BITS 24u
typedef struct __attribute__((packed)) km_block_meta {
    uint32_t placement;    /* bits 0-23: anchor tag; bits 24-31: offset in the segment (position
                            * mod segment_blocks, 0 without segments) or KM_OFFSET_UNKNOWN */
    uint8_t parent_tag[3]; /* km_parent_tag of the previous block, little-endian; 0 at offset 0
                            * and for an orphan */
} km_block_meta;
_Static_assert(sizeof(km_block_meta) == 7, "block metadata is 7 bytes per slot");

/* The tag a segment's first block is known by in block metadata and the anchor lists: the low 24
 * bits of its chain hash (independent of the high bits that segment fingerprints use). */
static inline uint32_t km_anchor_tag(uint64_t first_block)
{
    return (uint32_t)first_block & ((1u << KM_ANCHOR_TAG_BITS) - 1u);
}
/* The tag a block's parent is kept by: the top 24 bits of the product km_slot_home maps onto a
 * table's capacity (src/index/slot_walk.h), so the tag alone gives the parent's home slot. */
static inline uint32_t km_parent_tag(uint64_t parent)
{
    return (uint32_t)((parent * UINT64_C(0x9E3779B97F4A7C15)) >> (64u - KM_PARENT_TAG_BITS));
}
static inline uint32_t km_meta_parent_tag(const km_block_meta *m)
{
    return (uint32_t)m->parent_tag[0] | (uint32_t)m->parent_tag[1] << 8 |
           (uint32_t)m->parent_tag[2] << 16;
}
static inline uint32_t km_meta_anchor_tag(const km_block_meta *m)
{
    return m->placement & ((1u << KM_ANCHOR_TAG_BITS) - 1u);
}
static inline uint32_t km_meta_offset(const km_block_meta *m)
{
    return m->placement >> KM_ANCHOR_TAG_BITS;
}
/* anchor_tag from km_anchor_tag; offset < KM_MAX_SEGMENT_BLOCKS or KM_OFFSET_UNKNOWN; parent the
 * chain hash of the block before (kept as its tag only where a walk may need it: offset >= 1). */
static inline void km_meta_set(km_block_meta *m, uint64_t parent, uint32_t anchor_tag,
                               uint32_t offset)
{
    uint32_t tag = offset != 0 && offset != KM_OFFSET_UNKNOWN ? km_parent_tag(parent) : 0;
    m->placement = anchor_tag | offset << KM_ANCHOR_TAG_BITS;
    m->parent_tag[0] = (uint8_t)tag;
    m->parent_tag[1] = (uint8_t)(tag >> 8);
    m->parent_tag[2] = (uint8_t)(tag >> 16);
}

/* Demote a shared (bitmap) set back to inline form when it shrinks to this many holders. Below
 * KM_SLOT_INLINE (hysteresis), so a set whose holders hover around five does not change form on
 * every change; a set of 4 holders may thus have either form, and a batch's undo logs which it
 * had (src/index/index.c). */
#define KM_SLOT_DEMOTE_AT 3u

typedef struct km_table {
    km_slot *slots;
    km_block_meta *meta; /* NULL unless created with_meta */
    uint8_t *aux;        /* aux_bytes per slot for the table's owner, moved with the key and zeroed
                          * on insert and erase; NULL when aux_bytes is 0 */
    uint32_t aux_bytes;
    uint64_t capacity;   /* slots, any size >= 64 */
    uint64_t live;       /* keys, in both arrays while growing */
    uint64_t tombstones; /* in the new array: always 0 outside snapshot loading, which purges any */

    /* While growing: the previous arrays; their slots [migrated, old_capacity) are still to move.
     * old_slots is NULL otherwise. */
    km_slot *old_slots;
    km_block_meta *old_meta;
    uint8_t *old_aux;
    uint64_t old_capacity;
    uint64_t migrated;
    uint64_t pairs;      /* sum of set sizes */
    uint64_t shared_sets;

    uint64_t *pool; /* pool_capacity bitmaps of words_per_set words */
    uint32_t words_per_set;
    uint32_t pool_capacity;
    uint32_t pool_high;   /* bitmaps ever handed out (next fresh index) */
    uint32_t *pool_free;  /* stack of released bitmap indices */
    uint32_t pool_free_count;

    /* Device replicas: when track_dirty, every slot written is appended to dirty_slots and every
     * bitmap written to dirty_sets; a reallocation sets layout_changed (replica re-uploads all). */
    int track_dirty;
    int layout_changed;
    uint64_t *dirty_slots;
    size_t n_dirty_slots, dirty_slots_capacity;
    uint32_t *dirty_sets;
    size_t n_dirty_sets, dirty_sets_capacity;

    km_memory *memory;
} km_table;

/* Create with room for at least `initial_keys` keys at the maximum load. with_meta: a
 * km_block_meta per slot; aux_bytes: that many owner-defined bytes per slot (0 for none).
 * KM_ERR_OUT_OF_MEMORY when that takes more than KM_TABLE_MAX_SLOTS slots. */
int km_table_init(km_table *t, uint64_t initial_keys, uint32_t max_workers, int with_meta,
                  uint32_t aux_bytes, km_memory *memory);
/* The same with exactly `capacity` slots (at least 64; KM_ERR_OUT_OF_MEMORY past
 * KM_TABLE_MAX_SLOTS), for a loaded snapshot. */
int km_table_init_capacity(km_table *t, uint64_t capacity, uint32_t max_workers, int with_meta,
                           uint32_t aux_bytes, km_memory *memory);

/* The slot, metadata and aux bytes at a slot index of either array (see the file comment). */
static inline km_slot *km_table_slot(const km_table *t, uint64_t slot)
{
    return slot < t->capacity ? &t->slots[slot] : &t->old_slots[slot - t->capacity];
}
static inline km_block_meta *km_table_meta(const km_table *t, uint64_t slot)
{
    return slot < t->capacity ? &t->meta[slot] : &t->old_meta[slot - t->capacity];
}
static inline uint8_t *km_table_aux(const km_table *t, uint64_t slot)
{
    return slot < t->capacity ? t->aux + slot * t->aux_bytes
                              : t->old_aux + (slot - t->capacity) * t->aux_bytes;
}
void km_table_free(km_table *t);

static inline km_table_view km_table_get_view(const km_table *t)
{
    km_table_view v = {t->slots,     t->pool,         t->capacity, t->words_per_set,
                       t->old_slots, t->old_capacity, t->migrated};
    return v;
}

/* Slot index of key (in either array), or KM_SLOT_NONE. */
static inline uint64_t km_table_find(const km_table *t, uint64_t key)
{
    km_table_view v = km_table_get_view(t);
    return km_view_find(&v, key);
}
/* The slot (in either array) of the parent of a block whose metadata is m, in a table with
 * metadata: the one key whose km_parent_tag is m's parent tag and whose metadata places it in m's
 * segment (same anchor tag) at the offset before m's. KM_SLOT_NONE when m's offset is 0 or
 * unknown, when no key matches (the parent is gone, or was placed otherwise), and when two or more
 * do (siblings or strangers sharing the tag: the parent is then unknown, never guessed). A parent
 * that is gone while a key of the same 24-bit tag and placement is present is taken for it; the
 * callers' contracts state what that can cost (src/index/index.c). */
uint64_t km_table_find_parent(const km_table *t, const km_block_meta *m);
/* Move every key still in the old array now (a no-op when not growing). Slot indices held by the
 * caller are stale afterwards. Never allocates. */
void km_table_finish_growth(km_table *t);
/* Move up to max_slots more slots of the old array. Returns 1 while the table is still growing,
 * 0 once the move is over (or when it was not growing). Slot indices held by the caller are stale
 * afterwards. Never allocates. */
int km_table_advance_growth(km_table *t, uint64_t max_slots);
/* 1 when km_table_insert(t, ..., allow_grow = 1, ...) of one more key would grow the table first. */
int km_table_insert_grows(const km_table *t);
/* Make room for `extra` more keys (grow), and move 16 * extra slots of a growing table's old
 * array (so the move ends long before the new array fills). Slot indices held by the caller are
 * stale afterwards. KM_ERR_MEMORY_CAP / OUT_OF_MEMORY. */
int km_table_reserve(km_table *t, uint64_t extra);
/* The load limit: a table holding `used` keys (and tombstones) in `capacity` slots is over it
 * (src/index/host_table.c says why 80%). */
#define KM_TABLE_MAX_LOAD_NUM 4
#define KM_TABLE_MAX_LOAD_DEN 5
static inline int km_table_over_load(uint64_t used, uint64_t capacity)
{
    return used * KM_TABLE_MAX_LOAD_DEN > capacity * KM_TABLE_MAX_LOAD_NUM;
}

/* Append slot to a tracking table's dirty list (t->track_dirty). */
void km_table_record_dirty_slot(km_table *t, uint64_t slot);

/* km_table_find, and for an absent key the slot a km_table_insert(t, key, 1, ...) would fill
 * without reserving first: *vacant is that slot when no move is under way, one more key stays
 * within the load limit and the table holds no tombstones, else KM_SLOT_NONE (also when the key
 * is present). */
static inline uint64_t km_table_find_vacant(const km_table *t, uint64_t key, uint64_t *vacant)
{
    const km_slot *slots = t->slots;
    uint64_t capacity = t->capacity;
    const km_slot *s = slots + km_slot_home(key, capacity), *end = slots + capacity;
    for (;;) { /* by pointer: the walk's one test per slot besides the keys is the wrap */
        uint64_t k = s->key;
        if (k == KM_KEY_EMPTY)
            break;
        if (k == key) {
            *vacant = KM_SLOT_NONE;
            return (uint64_t)(s - slots);
        }
        if (++s == end)
            s = slots;
    }
    uint64_t i = (uint64_t)(s - slots);
    /* Absent from the new array, whose first empty slot along the run is where an insert that
     * needs no reserve (no move under way, room for one more key) puts the key when there are no
     * tombstones (the insert would take the first of them). */
    if (t->old_slots) {
        *vacant = KM_SLOT_NONE;
        km_table_view v = km_table_get_view(t);
        return km_view_find_old(&v, key);
    }
    *vacant = t->tombstones || km_table_over_load(t->live + 1, capacity) ? KM_SLOT_NONE : i;
    return KM_SLOT_NONE;
}

/* Key a free slot of the new array with an empty set, zeroed metadata and aux bytes: an insert's
 * write, without the dirty mark (the caller's). */
static inline void km_table_fill_slot(km_table *t, uint64_t slot, uint64_t key)
{
    km_slot *s = &t->slots[slot];
    s->key = key;
    for (uint32_t j = 0; j < KM_SLOT_INLINE; j++)
        s->ids[j] = KM_SLOT_ID_EMPTY;
    if (t->meta)
        memset(&t->meta[slot], 0, sizeof t->meta[slot]);
    if (t->aux)
        memset(km_table_aux(t, slot), 0, t->aux_bytes);
    t->live++;
}

/* Insert an absent key held by worker alone at the slot km_table_find_vacant gave for it, the
 * table unchanged since: what km_table_insert(t, key, 1, ...) and km_table_set_add of the worker
 * would do. Never allocates. */
static inline void km_table_insert_vacant(km_table *t, uint64_t key, uint64_t slot,
                                          uint32_t worker)
{
    km_table_fill_slot(t, slot, key);
    t->slots[slot].ids[0] = (uint16_t)worker;
    t->pairs++;
    /* Listed as the insert and the add list it: a list's length (repeats counted) decides when
     * it gives way to a whole upload. */
    if (t->track_dirty) {
        km_table_record_dirty_slot(t, slot);
        km_table_record_dirty_slot(t, slot);
    }
}

/* Insert a key with an empty set into the new array; the caller checked it is absent. allow_grow
 * = 1 reserves first (see km_table_reserve); allow_grow = 0 is for undo (never allocates, never
 * moves a key; relies on the load factor leaving empty slots). Returns KM_OK and *slot. */
int km_table_insert(km_table *t, uint64_t key, int allow_grow, uint64_t *slot);
/* Erase a key whose set is empty. Backward shift may move later keys of its probe run into
 * earlier slots, and a growing table moves a few old slots: every slot index the caller holds for
 * this table is stale afterwards (a caller scanning the slots of a table that is not growing, in
 * ascending order, re-examines `slot`; keys only move towards it). Never allocates. */
void km_table_erase(km_table *t, uint64_t slot);
/* Rehash at the same capacity when the table holds tombstones (only a loaded file can bring them;
 * kvmatch has not written any since backward-shift deletion); erase requires none. */
int km_table_purge_tombstones(km_table *t);

/* Set operations. add: 1 added, 0 already present, <0 error (bitmap allocation); remove: 1 removed,
 * 0 absent. Neither erases the key; callers erase when the count reaches 0. */
int km_table_set_add(km_table *t, uint64_t slot, uint32_t worker);
int km_table_set_remove(km_table *t, uint64_t slot, uint32_t worker);
static inline int km_table_set_contains(const km_table *t, uint64_t slot, uint32_t worker)
{
    return km_slot_contains(km_table_slot(t, slot), t->pool, t->words_per_set, worker);
}
static inline uint32_t km_table_set_count(const km_table *t, uint64_t slot)
{
    return km_slot_count(km_table_slot(t, slot));
}
/* Remove a holder of the set at slot and erase the key when none is left: what
 * km_table_set_remove and then, at a count of 0, km_table_erase do. Returns 1 when the key was
 * erased (slot indices held by the caller are stale then), 0 when not. */
int km_table_set_remove_erase(km_table *t, uint64_t slot, uint32_t worker);
/* Move a set between its forms without changing it: promote an inline set of KM_SLOT_INLINE
 * holders to a bitmap (<0 when no bitmap can be had), demote a bitmap of at most KM_SLOT_INLINE
 * holders to inline ids. set_add and set_remove do this at the thresholds; a batch's undo does it
 * to restore the form a set had, which the hysteresis does not (src/index/index.c). */
int km_table_set_promote(km_table *t, uint64_t slot);
void km_table_set_demote(km_table *t, uint64_t slot);
/* Workers of a slot ascending into out (capacity entries); returns the full count. */
uint32_t km_table_set_list(const km_table *t, uint64_t slot, uint32_t *out, uint32_t capacity);

/* Bytes of slot + meta + aux + pool memory, both arrays while growing. */
uint64_t km_table_bytes(const km_table *t);
void km_table_clear_dirty(km_table *t);

#endif
