/* SPDX-License-Identifier: Apache-2.0 */
/* Host hash table over km_slot: linear probing with backward-shift deletion, bitmap pool for widely
 * held blocks, optional block metadata, dirty-slot tracking for device replicas, accounted memory. */
#include "index/host_table.h"

#include <stdlib.h>
#include <string.h>

#include "kvmatch/error.h"
#include "base/array.h"
#include "base/zeroed_pages.h"

/* Grow when keys (+ tombstones, which only a loaded old snapshot can hold, purged on load) pass 80%
 * of the slots; growth adds at least half the capacity, so the load stays between 53% and 80%.
 * Linear probing with backward-shift deletion keeps probe runs short there: a successful lookup
 * at load a reads (1 + 1 / (1 - a)) / 2 slots on average, 3 at 80% (16-byte slots, four to a
 * cache line). */
#define TABLE_MAX_LOAD_NUM KM_TABLE_MAX_LOAD_NUM
#define TABLE_MAX_LOAD_DEN KM_TABLE_MAX_LOAD_DEN
#define TABLE_GROWTH_NUM 3
#define TABLE_GROWTH_DEN 2
#define TABLE_MIN_CAPACITY 64u

/* Backward shift: the key at j, whose home is `home`, may move back into the hole only if its
 * home does not lie in (hole, j] along the probe run (wrapping), or it would become unreachable.
 * Is it there? */
static int probe_home_between(uint64_t home, uint64_t hole, uint64_t j)
{
    /* Unwrapped (hole < j), home lies there exactly when home - (hole + 1) < j - hole, as
     * unsigned numbers: one comparison for the common case. */
    return hole < j ? home - hole - 1 < j - hole : home > hole || home <= j;
}

static uint64_t table_slot_bytes(const km_table *t, uint64_t capacity, int with_meta)
{
    return capacity * (sizeof(km_slot) + (with_meta ? sizeof(km_block_meta) : 0) + t->aux_bytes);
}

static uint64_t pool_bytes(const km_table *t, uint64_t pool_capacity)
{
    return pool_capacity * ((uint64_t)t->words_per_set * sizeof(uint64_t) + sizeof(uint32_t));
}

/* Each array is zeroed memory from src/base/zeroed_pages.c (an all-zero slot is empty). The slots
 * of a table made at its full size (km_table_init) are probed at random: they are backed by
 * transparent huge pages and faulted in at once, one TLB entry per 2 MiB instead of per 4 KiB, so
 * a random probe misses the TLB less often (docs/BENCHMARKS.md, "Growth"). The arrays a growth
 * moves keys into are not: random moves into fresh huge pages clear the whole array within the
 * first few hundred moves (see src/base/u64_map.c); they are advised once the move ends, so the
 * kernel may back them with huge pages later. Best effort throughout. */
static uint64_t slots_bytes(uint64_t capacity)
{
    return capacity * sizeof(km_slot);
}

static uint64_t meta_bytes(uint64_t capacity)
{
    return capacity * sizeof(km_block_meta);
}

static uint64_t aux_array_bytes(const km_table *t, uint64_t capacity)
{
    return capacity * t->aux_bytes;
}

typedef struct table_arrays {
    km_slot *slots;
    km_block_meta *meta;
    uint8_t *aux;
} table_arrays;

static void arrays_free(const km_table *t, table_arrays *a, uint64_t capacity)
{
    km_pages_free(a->slots, slots_bytes(capacity));
    km_pages_free(a->meta, meta_bytes(capacity));
    km_pages_free(a->aux, aux_array_bytes(t, capacity));
    memset(a, 0, sizeof *a);
}

/* Zeroed arrays for `capacity` slots (meta and aux as the table has them). KM_OK or
 * KM_ERR_OUT_OF_MEMORY, with nothing allocated. */
static int arrays_alloc(const km_table *t, uint64_t capacity, int with_meta, table_arrays *a)
{
    memset(a, 0, sizeof *a);
    a->slots = km_pages_alloc(slots_bytes(capacity));
    a->meta = with_meta ? km_pages_alloc(meta_bytes(capacity)) : NULL;
    a->aux = t->aux_bytes ? km_pages_alloc(aux_array_bytes(t, capacity)) : NULL;
    if (!a->slots || (with_meta && !a->meta) || (t->aux_bytes && !a->aux)) {
        arrays_free(t, a, capacity);
        return KM_ERR_OUT_OF_MEMORY;
    }
    return KM_OK;
}

/* Old-array slots are never listed: a growth sets layout_changed, and a replica is synced only
 * after the move ends. A list that reaches the table's size (repeats count) is dropped for
 * layout_changed: a replica uploads the table whole for less than such a patch costs, and a replica
 * that is not synced for a while (another table moving, device memory exhausted) never makes the
 * list outgrow the table. */
static void stop_dirty_tracking(km_table *t)
{
    t->layout_changed = 1;
    free(t->dirty_slots);
    free(t->dirty_sets);
    t->dirty_slots = NULL;
    t->dirty_sets = NULL;
    t->n_dirty_slots = t->dirty_slots_capacity = 0;
    t->n_dirty_sets = t->dirty_sets_capacity = 0;
}

void km_table_record_dirty_slot(km_table *t, uint64_t slot)
{
    if (t->layout_changed || slot >= t->capacity)
        return;
    if (t->n_dirty_slots >= t->capacity ||
        KM_ARRAY_GROW(t->dirty_slots, t->dirty_slots_capacity, t->n_dirty_slots + 1, 1024)) {
        stop_dirty_tracking(t); /* the replica re-uploads everything instead */
        return;
    }
    t->dirty_slots[t->n_dirty_slots++] = slot;
}

static void record_dirty_set(km_table *t, uint32_t set)
{
    if (t->layout_changed)
        return;
    if (t->n_dirty_sets >= t->pool_capacity ||
        KM_ARRAY_GROW(t->dirty_sets, t->dirty_sets_capacity, t->n_dirty_sets + 1, 256)) {
        stop_dirty_tracking(t);
        return;
    }
    t->dirty_sets[t->n_dirty_sets++] = set;
}

/* A slot or bitmap written: listed for the device replica, when the table tracks them (the
 * common host-only table does not, and pays one test). */
static inline void mark_dirty_slot(km_table *t, uint64_t slot)
{
    if (t->track_dirty)
        km_table_record_dirty_slot(t, slot);
}

static inline void mark_dirty_set(km_table *t, uint32_t set)
{
    if (t->track_dirty)
        record_dirty_set(t, set);
}

void km_table_clear_dirty(km_table *t)
{
    t->n_dirty_slots = 0;
    t->n_dirty_sets = 0;
    t->layout_changed = 0;
}

/* Put a key's slot, metadata and aux bytes into a fresh slot of the new array, which has room and
 * no tombstones. Returns the slot. */
static uint64_t place_new(km_table *t, const km_slot *slot, const km_block_meta *meta,
                          const uint8_t *aux)
{
    uint64_t j = km_slot_home(slot->key, t->capacity);
    while (t->slots[j].key != KM_KEY_EMPTY)
        j = km_slot_next(j, t->capacity);
    t->slots[j] = *slot;
    if (t->meta)
        t->meta[j] = *meta;
    if (t->aux)
        memcpy(km_table_aux(t, j), aux, t->aux_bytes);
    return j;
}

/* Give back the whole pieces of the old arrays that the move from slot from_slot to to_slot
 * passed; to_slot = old_capacity gives back everything from from_slot's piece on. */
static void release_old_part(km_table *t, uint64_t from_slot, uint64_t to_slot)
{
    void *arrays[3] = {t->old_slots, t->old_meta, t->old_aux};
    uint64_t per_slot[3] = {sizeof(km_slot), sizeof(km_block_meta), t->aux_bytes};
    for (int k = 0; k < 3; k++) {
        uint64_t bytes = t->old_capacity * per_slot[k];
        uint64_t from = km_pages_releasable(bytes, from_slot * per_slot[k]);
        uint64_t to = to_slot == t->old_capacity ? bytes
                                                 : km_pages_releasable(bytes, to_slot * per_slot[k]);
        km_pages_release(arrays[k], bytes, from, to);
    }
}

/* Give back what the move has not given back of the old arrays (all of them once it is over). */
static void release_old(km_table *t)
{
    if (!t->old_slots)
        return;
    release_old_part(t, t->migrated, t->old_capacity);
    km_memory_release(t->memory, table_slot_bytes(t, t->old_capacity, t->meta != NULL));
    t->old_slots = NULL;
    t->old_meta = NULL;
    t->old_aux = NULL;
    t->old_capacity = 0;
    t->migrated = 0;
}

/* Move up to `n` slots of the old array (from `migrated` on) into the new one, giving back each
 * whole piece passed. Never allocates. */
static void migrate(km_table *t, uint64_t n)
{
    if (!t->old_slots)
        return;
    uint64_t from = t->migrated;
    uint64_t end = t->old_capacity - from > n ? from + n : t->old_capacity;
    for (uint64_t j = from; j < end; j++) {
        const km_slot *s = &t->old_slots[j];
        if (s->key <= KM_KEY_TOMBSTONE)
            continue;
        uint64_t to = place_new(t, s, t->old_meta ? &t->old_meta[j] : NULL,
                                t->old_aux ? t->old_aux + j * t->aux_bytes : NULL);
        mark_dirty_slot(t, to);
    }
    if (end == t->old_capacity) { /* over: the new slots may have huge pages from now on */
        release_old(t); /* from `migrated` (still `from`) to the end */
        km_pages_advise_huge(t->slots, slots_bytes(t->capacity), 0);
        return;
    }
    t->migrated = end;
    release_old_part(t, from, end);
}

void km_table_finish_growth(km_table *t)
{
    migrate(t, UINT64_MAX);
}

int km_table_advance_growth(km_table *t, uint64_t max_slots)
{
    migrate(t, max_slots);
    return t->old_slots != NULL;
}

/* Replace the arrays with ones of new_capacity slots and move every key now (small tables, and
 * purging a loaded file's tombstones at the same capacity). On failure nothing changes. */
static int table_rehash(km_table *t, uint64_t new_capacity)
{
    km_table_finish_growth(t);
    int with_meta = t->meta != NULL;
    uint64_t old_bytes = table_slot_bytes(t, t->capacity, with_meta);
    uint64_t new_bytes = table_slot_bytes(t, new_capacity, with_meta);
    int rc = km_memory_reserve(t->memory, old_bytes, new_bytes);
    if (rc)
        return rc;
    table_arrays fresh;
    if (arrays_alloc(t, new_capacity, with_meta, &fresh) != KM_OK) {
        km_memory_reserve(t->memory, new_bytes, old_bytes);
        return KM_ERR_OUT_OF_MEMORY;
    }
    table_arrays old = {t->slots, t->meta, t->aux};
    uint64_t old_capacity = t->capacity;
    t->slots = fresh.slots;
    t->meta = fresh.meta;
    t->aux = fresh.aux;
    t->capacity = new_capacity;
    for (uint64_t i = 0; i < old_capacity; i++)
        if (old.slots[i].key > KM_KEY_TOMBSTONE)
            place_new(t, &old.slots[i], old.meta ? &old.meta[i] : NULL,
                      old.aux ? old.aux + i * t->aux_bytes : NULL);
    arrays_free(t, &old, old_capacity);
    km_pages_advise_huge(t->slots, slots_bytes(t->capacity), 0);
    t->tombstones = 0;
    t->layout_changed = 1;
    t->n_dirty_slots = 0;
    return KM_OK;
}

/* Start moving into arrays of new_capacity slots; the keys move over the next reserves, inserts
 * and erases (migrate). Small tables move everything now. On failure nothing changes. */
static int table_grow(km_table *t, uint64_t new_capacity)
{
    km_table_finish_growth(t); /* at most one growth in progress */
    if (t->capacity < KM_TABLE_INCREMENTAL_SLOTS || t->tombstones)
        return table_rehash(t, new_capacity);
    int with_meta = t->meta != NULL;
    uint64_t old_bytes = table_slot_bytes(t, t->capacity, with_meta);
    uint64_t new_bytes = table_slot_bytes(t, new_capacity, with_meta);
    /* Both arrays live until the move ends. */
    int rc = km_memory_reserve(t->memory, old_bytes, old_bytes + new_bytes);
    if (rc)
        return rc;
    table_arrays fresh;
    if (arrays_alloc(t, new_capacity, with_meta, &fresh) != KM_OK) {
        km_memory_reserve(t->memory, old_bytes + new_bytes, old_bytes);
        return KM_ERR_OUT_OF_MEMORY;
    }
    t->old_slots = t->slots;
    t->old_meta = t->meta;
    t->old_aux = t->aux;
    t->old_capacity = t->capacity;
    t->migrated = 0;
    t->slots = fresh.slots;
    t->meta = fresh.meta;
    t->aux = fresh.aux;
    t->capacity = new_capacity;
    t->layout_changed = 1; /* a replica re-uploads (after the move: km_table_finish_growth) */
    t->n_dirty_slots = 0;
    return KM_OK;
}

static int over_load(uint64_t used, uint64_t capacity)
{
    return km_table_over_load(used, capacity);
}

/* Smallest capacity that holds `keys` under the maximum load. */
static uint64_t capacity_for(uint64_t keys)
{
    if (keys > KM_TABLE_MAX_SLOTS) /* too many for any table (and the product below would wrap) */
        return KM_TABLE_MAX_SLOTS + 1;
    uint64_t capacity = keys / TABLE_MAX_LOAD_NUM * TABLE_MAX_LOAD_DEN +
                        (keys % TABLE_MAX_LOAD_NUM * TABLE_MAX_LOAD_DEN + TABLE_MAX_LOAD_NUM - 1) /
                            TABLE_MAX_LOAD_NUM;
    return capacity < TABLE_MIN_CAPACITY ? TABLE_MIN_CAPACITY : capacity;
}

int km_table_init(km_table *t, uint64_t initial_keys, uint32_t max_workers, int with_meta,
                  uint32_t aux_bytes, km_memory *memory)
{
    return km_table_init_capacity(t, capacity_for(initial_keys), max_workers, with_meta, aux_bytes,
                                  memory);
}

int km_table_init_capacity(km_table *t, uint64_t capacity, uint32_t max_workers, int with_meta,
                           uint32_t aux_bytes, km_memory *memory)
{
    memset(t, 0, sizeof *t);
    t->memory = memory;
    t->words_per_set = (max_workers + 63u) / 64u;
    t->aux_bytes = aux_bytes;
    if (capacity < TABLE_MIN_CAPACITY)
        return KM_ERR_INVALID_ARGUMENT;
    if (capacity > KM_TABLE_MAX_SLOTS)
        return KM_ERR_OUT_OF_MEMORY;
    uint64_t bytes = table_slot_bytes(t, capacity, with_meta);
    int rc = km_memory_reserve(memory, 0, bytes);
    if (rc)
        return rc;
    table_arrays a;
    if (arrays_alloc(t, capacity, with_meta, &a) != KM_OK) {
        km_memory_release(memory, bytes);
        memset(t, 0, sizeof *t);
        return KM_ERR_OUT_OF_MEMORY;
    }
    t->slots = a.slots;
    t->meta = a.meta;
    t->aux = a.aux;
    km_pages_advise_huge(t->slots, slots_bytes(capacity), 1); /* cleared here, not on first use */
    t->capacity = capacity;
    return KM_OK;
}

void km_table_free(km_table *t)
{
    if (!t->slots)
        return;
    release_old(t);
    km_memory_release(t->memory, table_slot_bytes(t, t->capacity, t->meta != NULL));
    km_memory_release(t->memory, pool_bytes(t, t->pool_capacity));
    table_arrays a = {t->slots, t->meta, t->aux};
    arrays_free(t, &a, t->capacity);
    km_pages_free(t->pool, (uint64_t)t->pool_capacity * t->words_per_set * sizeof(uint64_t));
    free(t->pool_free);
    free(t->dirty_slots);
    free(t->dirty_sets);
    memset(t, 0, sizeof *t);
}

/* Keys matching a parent tag and placement in one array: those whose home lies in [lo, hi] sit in
 * the probe runs that start there, so the scan goes from `first` (lo, or where the old array's
 * unmoved part begins) over every slot up to hi and on to the next empty slot; a run that wraps
 * past the last slot goes on at `wrap_to`. Stops at the second match. Returns the matches (0, 1
 * or 2) and the first in *found. */
static int scan_parent(const km_slot *slots, const km_block_meta *meta, uint64_t capacity,
                       uint64_t first, uint64_t wrap_to, uint64_t hi, uint32_t tag,
                       uint32_t placement, uint64_t *found)
{
    int matches = 0;
    int wrapped = 0;
    uint64_t i = first;
    for (;;) {
        uint64_t key = slots[i].key;
        if (key == KM_KEY_EMPTY) {
            if (wrapped || i >= hi)
                return matches;
        } else if (key != KM_KEY_TOMBSTONE && km_parent_tag(key) == tag &&
                   meta[i].placement == placement) {
            *found = i;
            if (++matches == 2)
                return matches;
        }
        if (++i == capacity) {
            i = wrap_to;
            wrapped = 1;
        }
        if (i == first)
            return matches;
    }
}

/* The homes a key of this parent tag may have in a table of `capacity` slots: km_slot_home of the
 * smallest and the largest product with these top bits. */
static void tag_homes(uint32_t tag, uint64_t capacity, uint64_t *lo, uint64_t *hi)
{
    const uint32_t low_bits = 64u - KM_PARENT_TAG_BITS;
    uint64_t h = (uint64_t)tag << low_bits;
    *lo = (uint64_t)(((unsigned __int128)h * capacity) >> 64);
    *hi = (uint64_t)(((unsigned __int128)(h | ((UINT64_C(1) << low_bits) - 1)) * capacity) >> 64);
}

uint64_t km_table_find_parent(const km_table *t, const km_block_meta *m)
{
    uint32_t offset = km_meta_offset(m);
    if (!t->meta || offset == 0 || offset == KM_OFFSET_UNKNOWN)
        return KM_SLOT_NONE;
    uint32_t placement = km_meta_anchor_tag(m) | (offset - 1) << KM_ANCHOR_TAG_BITS;
    uint32_t tag = km_meta_parent_tag(m);
    uint64_t lo, hi, found = KM_SLOT_NONE, found_old = KM_SLOT_NONE;
    tag_homes(tag, t->capacity, &lo, &hi);
    int matches = scan_parent(t->slots, t->meta, t->capacity, lo, 0, hi, tag, placement, &found);
    if (matches < 2 && t->old_slots) {
        tag_homes(tag, t->old_capacity, &lo, &hi);
        int old = scan_parent(t->old_slots, t->old_meta, t->old_capacity,
                              lo < t->migrated ? t->migrated : lo, t->migrated, hi, tag,
                              placement, &found_old);
        if (old)
            found = t->capacity + found_old;
        matches += old;
    }
    return matches == 1 ? found : KM_SLOT_NONE;
}

int km_table_insert_grows(const km_table *t)
{
    return over_load(t->live + t->tombstones + 1, t->capacity);
}

/* Slots of the old array a growing table moves per key reserved (or erased): the old array holds
 * at most 80% of its capacity and the next growth comes 0.4 * old capacity keys later (80% of
 * 1.5 times it), so the move ends after a sixth of that. */
#define MIGRATE_PER_KEY 16u

int km_table_reserve(km_table *t, uint64_t extra)
{
    if (t->old_slots)
        migrate(t, extra > UINT64_MAX / MIGRATE_PER_KEY ? UINT64_MAX : MIGRATE_PER_KEY * extra);
    if (!over_load(t->live + t->tombstones + extra, t->capacity))
        return KM_OK;
    /* Mostly live keys: grow by at least half, so growth is amortised and the load drops to <=
     * 53%. Mostly tombstones: rehash at the same capacity to purge them. Never shrink here. */
    uint64_t capacity = capacity_for(t->live + extra);
    uint64_t grown = t->capacity / TABLE_GROWTH_DEN * TABLE_GROWTH_NUM;
    if ((t->live + extra) * 2 > t->capacity && capacity < grown)
        capacity = grown;
    if (capacity < t->capacity)
        capacity = t->capacity;
    return capacity == t->capacity ? table_rehash(t, capacity) : table_grow(t, capacity);
}

int km_table_insert(km_table *t, uint64_t key, int allow_grow, uint64_t *slot_out)
{
    /* km_table_reserve when it has work: a move under way, or no room for one more key. */
    if (allow_grow && (t->old_slots || over_load(t->live + t->tombstones + 1, t->capacity))) {
        int rc = km_table_reserve(t, 1);
        if (rc)
            return rc;
    }
    uint64_t i = km_slot_home(key, t->capacity);
    while (t->slots[i].key != KM_KEY_EMPTY && t->slots[i].key != KM_KEY_TOMBSTONE)
        i = km_slot_next(i, t->capacity);
    if (t->slots[i].key == KM_KEY_TOMBSTONE)
        t->tombstones--;
    km_table_fill_slot(t, i, key);
    mark_dirty_slot(t, i);
    *slot_out = i;
    return KM_OK;
}

/* km_table_erase, inline in km_table_set_remove_erase. */
__attribute__((always_inline)) static inline void table_erase(km_table *t, uint64_t slot)
{
    if (slot >= t->capacity) { /* still in the old array: a tombstone keeps its probe runs whole */
        uint64_t j = slot - t->capacity;
        memset(&t->old_slots[j], 0, sizeof t->old_slots[j]);
        t->old_slots[j].key = KM_KEY_TOMBSTONE;
        t->live--;
        migrate(t, MIGRATE_PER_KEY); /* a table that only shrinks still finishes its move */
        return;
    }
    /* Backward-shift deletion. Walk the probe run after the hole; a key whose home does not lie
     * in (hole, j] may move back into the hole (it stays reachable from its home), and its old
     * slot becomes the hole. The run ends at the first empty slot. Every slot written is marked
     * dirty, so a device replica patched from the list ends up identical. */
    km_slot *slots = t->slots; /* the writes below never change the table's fields */
    km_block_meta *meta = t->meta;
    uint64_t capacity = t->capacity;
    uint64_t hole = slot;
    uint64_t j = slot + 1;
    if (!t->aux && !t->track_dirty) {
        /* The common host table: until the walk wraps past the last slot, hole < j, so the test
         * of probe_home_between is one comparison: the home lies in (hole, j] exactly when
         * home - (hole + 1) <= d, d = j - (hole + 1) counted along the walk. */
        const km_slot *sp = slots + j, *end = slots + capacity;
        uint64_t base = j, d = 0;
        for (; sp < end; sp++, d++) {
            uint64_t key = sp->key;
            if (key == KM_KEY_EMPTY)
                goto done;
            if (km_slot_home(key, capacity) - base <= d)
                continue; /* home lies after the hole: moving the key back would hide it */
            j = (uint64_t)(sp - slots);
            slots[hole] = *sp;
            if (meta)
                meta[hole] = meta[j];
            hole = j;
            base = j + 1;
            d = UINT64_MAX; /* 0 at the next slot, the first after the new hole */
        }
        j = capacity;
    }
    for (j = j < capacity ? j : 0; slots[j].key != KM_KEY_EMPTY; j = km_slot_next(j, capacity)) {
        if (probe_home_between(km_slot_home(slots[j].key, capacity), hole, j))
            continue; /* home lies after the hole: moving the key back would hide it */
        slots[hole] = slots[j];
        if (meta)
            meta[hole] = meta[j];
        if (t->aux)
            memcpy(km_table_aux(t, hole), km_table_aux(t, j), t->aux_bytes);
        mark_dirty_slot(t, hole);
        hole = j;
    }
done:
    memset(&slots[hole], 0, sizeof slots[hole]); /* empty: all zero */
    if (meta)
        memset(&meta[hole], 0, sizeof meta[hole]);
    if (t->aux)
        memset(km_table_aux(t, hole), 0, t->aux_bytes);
    t->live--;
    mark_dirty_slot(t, hole);
    if (t->old_slots)
        migrate(t, MIGRATE_PER_KEY);
}

void km_table_erase(km_table *t, uint64_t slot)
{
    table_erase(t, slot);
}

int km_table_purge_tombstones(km_table *t)
{
    return t->tombstones ? table_rehash(t, t->capacity) : KM_OK;
}

static uint64_t *pool_bits(const km_table *t, uint32_t set)
{
    return t->pool + (uint64_t)set * t->words_per_set;
}

static int pool_alloc(km_table *t, uint32_t *set_out)
{
    if (t->pool_free_count > 0) {
        *set_out = t->pool_free[--t->pool_free_count];
        return KM_OK;
    }
    if (t->pool_high == t->pool_capacity) {
        uint64_t capacity = t->pool_capacity ? (uint64_t)t->pool_capacity * 2 : 64;
        if (capacity > UINT32_MAX)
            return KM_ERR_MEMORY_CAP;
        int rc = km_memory_reserve(t->memory, pool_bytes(t, t->pool_capacity), pool_bytes(t, capacity));
        if (rc)
            return rc;
        /* The free stack first (a realloc, 4 bytes a set: one a failure of the pool's growth
         * leaves larger than it needs, which is harmless); then the bitmaps, whose pages move
         * rather than being copied and whose new part comes zeroed, so a growth of the pool costs
         * the same at any size. */
        uint32_t *free_stack = realloc(t->pool_free, capacity * sizeof(uint32_t));
        if (free_stack)
            t->pool_free = free_stack;
        uint64_t set_bytes = (uint64_t)t->words_per_set * sizeof(uint64_t);
        uint64_t *pool = free_stack ? km_pages_grow(t->pool, t->pool_capacity * set_bytes,
                                                    capacity * set_bytes)
                                    : NULL;
        if (!pool) {
            km_memory_reserve(t->memory, pool_bytes(t, capacity), pool_bytes(t, t->pool_capacity));
            return KM_ERR_OUT_OF_MEMORY;
        }
        t->pool = pool;
        t->pool_capacity = (uint32_t)capacity;
        t->layout_changed = 1;
    }
    *set_out = t->pool_high++;
    return KM_OK;
}

static void pool_release(km_table *t, uint32_t set)
{
    memset(pool_bits(t, set), 0, t->words_per_set * sizeof(uint64_t));
    t->pool_free[t->pool_free_count++] = set;
}

int km_table_set_add(km_table *t, uint64_t slot, uint32_t worker)
{
    km_slot *s = km_table_slot(t, slot);
    if (km_slot_is_shared(s)) {
        uint32_t set = km_slot_pool_index(s);
        uint64_t *bits = pool_bits(t, set);
        uint64_t bit = UINT64_C(1) << (worker & 63);
        if (bits[worker >> 6] & bit)
            return 0;
        bits[worker >> 6] |= bit;
        s->ids[3]++;
        t->pairs++;
        mark_dirty_set(t, set);
        mark_dirty_slot(t, slot);
        return 1;
    }
    uint32_t n = 0;
    for (; n < KM_SLOT_INLINE && s->ids[n] != KM_SLOT_ID_EMPTY; n++)
        if (s->ids[n] == worker)
            return 0;
    if (n < KM_SLOT_INLINE) { /* insert keeping ids ascending */
        uint32_t j = n;
        while (j > 0 && s->ids[j - 1] > worker) {
            s->ids[j] = s->ids[j - 1];
            j--;
        }
        s->ids[j] = (uint16_t)worker;
        t->pairs++;
        mark_dirty_slot(t, slot);
        return 1;
    }
    /* Fifth holder: the set moves to a bitmap first. */
    int rc = km_table_set_promote(t, slot);
    return rc ? rc : km_table_set_add(t, slot, worker);
}

int km_table_set_promote(km_table *t, uint64_t slot)
{
    uint32_t set;
    int rc = pool_alloc(t, &set);
    if (rc)
        return rc;
    km_slot *s = km_table_slot(t, slot);
    uint64_t *bits = pool_bits(t, set);
    for (uint32_t j = 0; j < KM_SLOT_INLINE; j++)
        bits[s->ids[j] >> 6] |= UINT64_C(1) << (s->ids[j] & 63);
    s->ids[0] = KM_SLOT_ID_SHARED;
    s->ids[1] = (uint16_t)(set & 0xFFFFu);
    s->ids[2] = (uint16_t)(set >> 16);
    s->ids[3] = KM_SLOT_INLINE;
    t->shared_sets++;
    mark_dirty_set(t, set);
    mark_dirty_slot(t, slot);
    return KM_OK;
}

void km_table_set_demote(km_table *t, uint64_t slot)
{
    km_slot *s = km_table_slot(t, slot);
    uint32_t set = km_slot_pool_index(s);
    const uint64_t *bits = pool_bits(t, set);
    uint16_t ids[KM_SLOT_INLINE] = {KM_SLOT_ID_EMPTY, KM_SLOT_ID_EMPTY, KM_SLOT_ID_EMPTY,
                                    KM_SLOT_ID_EMPTY};
    uint32_t n = 0;
    /* Called at KM_SLOT_INLINE holders or fewer; the bound holds should the bitmap say more. */
    for (uint32_t w = 0; w < t->words_per_set; w++)
        for (uint64_t word = bits[w]; word && n < KM_SLOT_INLINE; word &= word - 1)
            ids[n++] = (uint16_t)(w * 64u + (uint32_t)__builtin_ctzll(word));
    memcpy(s->ids, ids, sizeof ids);
    pool_release(t, set);
    t->shared_sets--;
    mark_dirty_set(t, set);
    mark_dirty_slot(t, slot);
}

int km_table_set_remove(km_table *t, uint64_t slot, uint32_t worker)
{
    km_slot *s = km_table_slot(t, slot);
    if (km_slot_is_shared(s)) {
        uint32_t set = km_slot_pool_index(s);
        uint64_t *bits = pool_bits(t, set);
        uint64_t bit = UINT64_C(1) << (worker & 63);
        if (!(bits[worker >> 6] & bit))
            return 0;
        bits[worker >> 6] &= ~bit;
        s->ids[3]--;
        t->pairs--;
        mark_dirty_set(t, set);
        mark_dirty_slot(t, slot);
        if (s->ids[3] <= KM_SLOT_DEMOTE_AT)
            km_table_set_demote(t, slot);
        return 1;
    }
    for (uint32_t i = 0; i < KM_SLOT_INLINE && s->ids[i] != KM_SLOT_ID_EMPTY; i++) {
        if (s->ids[i] != worker)
            continue;
        for (uint32_t j = i; j + 1 < KM_SLOT_INLINE; j++)
            s->ids[j] = s->ids[j + 1];
        s->ids[KM_SLOT_INLINE - 1] = KM_SLOT_ID_EMPTY;
        t->pairs--;
        mark_dirty_slot(t, slot);
        return 1;
    }
    return 0;
}

int km_table_set_remove_erase(km_table *t, uint64_t slot, uint32_t worker)
{
    const km_slot *s = km_table_slot(t, slot);
    if (!km_slot_is_shared(s) && s->ids[0] == worker && s->ids[1] == KM_SLOT_ID_EMPTY) {
        /* The only holder: the set's change is the key's erase (its slot listed first, as the
         * remove lists it). */
        t->pairs--;
        mark_dirty_slot(t, slot);
        table_erase(t, slot);
        return 1;
    }
    km_table_set_remove(t, slot, worker);
    if (km_table_set_count(t, slot) == 0) {
        km_table_erase(t, slot);
        return 1;
    }
    return 0;
}

uint32_t km_table_set_list(const km_table *t, uint64_t slot, uint32_t *out, uint32_t capacity)
{
    const km_slot *s = km_table_slot(t, slot);
    uint32_t n = 0;
    if (km_slot_is_shared(s)) {
        const uint64_t *bits = pool_bits(t, km_slot_pool_index(s));
        for (uint32_t w = 0; w < t->words_per_set; w++)
            for (uint64_t word = bits[w]; word; word &= word - 1) {
                if (n < capacity)
                    out[n] = w * 64u + (uint32_t)__builtin_ctzll(word);
                n++;
            }
        return n;
    }
    for (uint32_t i = 0; i < KM_SLOT_INLINE && s->ids[i] != KM_SLOT_ID_EMPTY; i++) {
        if (n < capacity)
            out[n] = s->ids[i];
        n++;
    }
    return n;
}

uint64_t km_table_bytes(const km_table *t)
{
    return table_slot_bytes(t, t->capacity + t->old_capacity, t->meta != NULL) +
           pool_bytes(t, t->pool_capacity);
}
