/* The host hash table: open addressing with linear probing over 16-byte km_slot (src/shared.h),
 * backward-shift deletion (no tombstones, so removes never force a purging rehash and probe runs
 * stay as short as the live load makes them), a pool of bitmaps for widely-held blocks, optional
 * per-slot block metadata, dirty-slot tracking for device replicas (every slot a shift moves is
 * listed), and memory accounting against a shared cap. Single writer; readers use km_table_view. */
#ifndef KM_TABLE_H
#define KM_TABLE_H

#include <stddef.h>
#include <stdint.h>

#include "shared.h"

/* Memory accounting shared by every table of one index. cap 0 = unlimited. */
typedef struct km_memory {
    uint64_t used;
    uint64_t cap;
} km_memory;

/* Per-block facts the update planner needs and scoring never reads (parallel to the slots). */
#define KM_POSITION_UNKNOWN UINT32_MAX
typedef struct km_block_meta {
    uint64_t parent;   /* chain hash of the previous block, KM_NO_PARENT at position 0 */
    uint64_t anchor;   /* chain hash of the first block of this block's segment */
    uint32_t position; /* block index in its sequence, or KM_POSITION_UNKNOWN (orphan) */
    uint32_t reserved;
} km_block_meta;

/* Demote a shared (bitmap) set back to inline form when it shrinks to this many holders. Below
 * KM_SLOT_INLINE so that re-adding one worker (undo) never needs a bitmap. */
#define KM_SLOT_DEMOTE_AT 3u

typedef struct km_table {
    km_slot *slots;
    km_block_meta *meta; /* NULL unless created with_meta */
    uint8_t *aux;        /* aux_bytes per slot for the table's owner, moved with the key and zeroed
                          * on insert and erase; NULL when aux_bytes is 0 */
    uint32_t aux_bytes;
    uint64_t capacity;   /* power of two */
    uint32_t shift;
    uint64_t live;       /* slots holding a key */
    uint64_t tombstones; /* always 0 outside snapshot loading, which purges any it reads */
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

/* Backward-shift deletion, shared by every linear-probing map in kvmatch (this table, src/u64map.c,
 * the feed's engine-hash maps): after a hole opens at `hole`, the key at slot j further along the
 * same probe run, whose home slot is `home`, may move back into the hole iff its home does not lie
 * in (hole, j], so it stays reachable from its home. mask = capacity - 1. */
static inline int km_probe_may_fill(uint64_t home, uint64_t hole, uint64_t j, uint64_t mask)
{
    return ((j - home) & mask) >= ((j - hole) & mask);
}

/* Create with room for at least `initial_keys` keys at the maximum load. with_meta: a
 * km_block_meta per slot; aux_bytes: that many owner-defined bytes per slot (0 for none). */
int km_table_init(km_table *t, uint64_t initial_keys, uint32_t max_workers, int with_meta,
                  uint32_t aux_bytes, km_memory *memory);

/* The aux bytes of a slot. */
static inline uint8_t *km_table_aux(const km_table *t, uint64_t slot)
{
    return t->aux + slot * t->aux_bytes;
}
void km_table_free(km_table *t);

static inline km_table_view km_table_get_view(const km_table *t)
{
    km_table_view v = {t->slots, t->pool, t->capacity - 1, t->shift, t->words_per_set};
    return v;
}

/* Slot index of key, or KM_SLOT_NONE. */
uint64_t km_table_find(const km_table *t, uint64_t key);
/* 1 when km_table_insert(t, ..., allow_grow = 1, ...) of one more key would grow the table first. */
int km_table_insert_grows(const km_table *t);
/* Make room for `extra` more keys (grow). KM_ERR_MEMORY_CAP / OUT_OF_MEMORY. */
int km_table_reserve(km_table *t, uint64_t extra);
/* Insert a key with an empty set; the caller checked it is absent. allow_grow = 0 is for undo
 * (must not allocate; relies on the load factor leaving empty slots). Returns KM_OK and *slot. */
int km_table_insert(km_table *t, uint64_t key, int allow_grow, uint64_t *slot);
/* Erase a key whose set is empty. Backward shift may move later keys of its probe run into
 * earlier slots: every slot index the caller holds for this table is stale afterwards (a caller
 * scanning slots in ascending order re-examines `slot`; keys only move towards it). Never
 * allocates. */
void km_table_erase(km_table *t, uint64_t slot);
/* Rehash at the same capacity when the table holds tombstones (only a loaded file can bring them;
 * kvmatch has not written any since backward-shift deletion); erase requires none. */
int km_table_purge_tombstones(km_table *t);

/* Set operations. add: 1 added, 0 already present, <0 error (bitmap allocation); remove: 1 removed,
 * 0 absent. Neither erases the key; callers erase when the count reaches 0. */
int km_table_set_add(km_table *t, uint64_t slot, uint32_t worker);
int km_table_set_remove(km_table *t, uint64_t slot, uint32_t worker);
int km_table_set_contains(const km_table *t, uint64_t slot, uint32_t worker);
uint32_t km_table_set_count(const km_table *t, uint64_t slot);
/* Workers of a slot ascending into out (capacity entries); returns the full count. */
uint32_t km_table_set_list(const km_table *t, uint64_t slot, uint32_t *out, uint32_t capacity);

/* Bytes of slot + meta + pool memory. */
uint64_t km_table_bytes(const km_table *t);
void km_table_clear_dirty(km_table *t);

/* Accounted allocation helpers shared by the index's other structures. */
int km_memory_reserve(km_memory *m, uint64_t old_bytes, uint64_t new_bytes);
void km_memory_release(km_memory *m, uint64_t bytes);

#endif
