/* Open-addressing u64 -> u64 map (linear probing, backward-shift deletion, incremental growth) for
 * host bookkeeping. The growth protocol is in u64map.h. */
#include "u64map.h"

#include <stddef.h>
#include <string.h>

#include "kvmatch/error.h"
#include "pages.h"

#define MAP_EMPTY UINT64_C(0)
#define MAP_ERASED UINT64_C(1) /* only ever in the old array of a growing map */

void km_u64map_init(km_u64map *m, km_memory *memory)
{
    memset(m, 0, sizeof *m);
    m->memory = memory;
}

/* Arrays come from src/pages.c: large ones are mapped directly (nothing cleared up front) and the
 * moved part of an old one is given back a piece at a time as a growth passes it. Not advised as
 * huge pages: random inserts into a fresh array fault in every 2 MiB page within the first few
 * hundred moves, a burst of clearing the whole array at once (measured: a 125-210 ms pause at 16 M
 * entries on the development VM, against at most 1-2 ms with small pages). */
static uint64_t array_bytes(uint64_t capacity)
{
    return capacity * sizeof(km_u64map_entry);
}

static km_u64map_entry *array_alloc(uint64_t capacity)
{
    return km_pages_alloc(array_bytes(capacity));
}

static void array_free(km_u64map_entry *a, uint64_t capacity)
{
    km_pages_free(a, array_bytes(capacity));
}

/* Bytes of the old array given back so far: whole pieces below `migrated`. */
static uint64_t old_released_bytes(const km_u64map *m)
{
    return km_pages_releasable(array_bytes(m->old_capacity), array_bytes(m->migrated));
}

static void release_old(km_u64map *m)
{
    if (!m->old)
        return;
    km_memory_release(m->memory, array_bytes(m->old_capacity));
    uint64_t done = old_released_bytes(m);
    if (done == 0)
        array_free(m->old, m->old_capacity);
    else
        km_pages_release(m->old, array_bytes(m->old_capacity), done, array_bytes(m->old_capacity));
    m->old = NULL;
    m->old_capacity = 0;
    m->migrated = 0;
}

void km_u64map_free(km_u64map *m)
{
    release_old(m);
    if (m->entries)
        km_memory_release(m->memory, array_bytes(m->capacity));
    array_free(m->entries, m->capacity);
    km_memory *memory = m->memory;
    memset(m, 0, sizeof *m);
    m->memory = memory;
}

static inline uint64_t home_in(uint64_t key, uint64_t capacity)
{
    return (key * UINT64_C(0x9E3779B97F4A7C15)) & (capacity - 1);
}

/* The entry of key in the new array, or NULL. */
static km_u64map_entry *find_new(const km_u64map *m, uint64_t key)
{
    if (m->capacity == 0)
        return NULL;
    for (uint64_t i = home_in(key, m->capacity);; i = (i + 1) & (m->capacity - 1)) {
        if (m->entries[i].key == key)
            return &m->entries[i];
        if (m->entries[i].key == MAP_EMPTY)
            return NULL;
    }
}

/* The entry of key in the old array if it has not moved yet, or NULL. The old array's probe runs
 * are never changed while it lives (an erase leaves MAP_ERASED), and slots below `migrated` have all
 * moved (and may have been unmapped), so the search never reads them: a run that starts below
 * `migrated` is entered at `migrated` (its slots up to a key beyond are all occupied, so the key is
 * still reached), and a run that wraps past the last slot continues at `migrated` (the moved slots
 * it crossed hold keys that are in the new array now). It stops at an empty slot, or back where it
 * started. (Until 2026-11-30 a wrapping run ended at the moved prefix, which lost a key whose run
 * wrapped past the first `migrated` slots: tests/test_table.c crowds runs at the end to catch it.) */
static km_u64map_entry *find_old(const km_u64map *m, uint64_t key)
{
    if (!m->old)
        return NULL;
    uint64_t i = home_in(key, m->old_capacity);
    if (i < m->migrated)
        i = m->migrated;
    uint64_t start = i;
    for (;;) {
        if (m->old[i].key == key)
            return &m->old[i];
        if (m->old[i].key == MAP_EMPTY)
            return NULL;
        if (++i == m->old_capacity)
            i = m->migrated;
        if (i == start)
            return NULL;
    }
}

uint64_t *km_u64map_find(const km_u64map *m, uint64_t key)
{
    km_u64map_entry *e = find_new(m, key);
    if (!e)
        e = find_old(m, key);
    return e ? &e->value : NULL;
}

/* Put a key known to be absent into the new array, which has room. */
static void insert_new(km_u64map *m, uint64_t key, uint64_t value)
{
    uint64_t i = home_in(key, m->capacity);
    while (m->entries[i].key != MAP_EMPTY)
        i = (i + 1) & (m->capacity - 1);
    m->entries[i].key = key;
    m->entries[i].value = value;
    m->in_new++;
}

/* Move up to `slots` slots of the old array, giving back each whole piece passed. */
static void migrate(km_u64map *m, uint64_t slots)
{
    if (!m->old)
        return;
    uint64_t end = m->old_capacity - m->migrated > slots ? m->migrated + slots : m->old_capacity;
    for (uint64_t j = m->migrated; j < end; j++)
        if (m->old[j].key > MAP_ERASED)
            insert_new(m, m->old[j].key, m->old[j].value);
    if (end == m->old_capacity) {
        release_old(m);
        return;
    }
    uint64_t released = old_released_bytes(m);
    m->migrated = end;
    km_pages_release(m->old, array_bytes(m->old_capacity), released, old_released_bytes(m));
}

void km_u64map_finish_growth(km_u64map *m)
{
    migrate(m, UINT64_MAX);
}

/* Replace the array with one of new_capacity slots. Small maps move every entry now; large ones
 * keep the old array and move its entries over the next reserves. */
static int map_grow(km_u64map *m, uint64_t new_capacity)
{
    km_u64map_finish_growth(m); /* at most one growth in progress */
    uint64_t old_bytes = m->capacity * sizeof(km_u64map_entry);
    uint64_t new_bytes = new_capacity * sizeof(km_u64map_entry);
    /* Both arrays live until the move ends. */
    int rc = km_memory_reserve(m->memory, old_bytes, old_bytes + new_bytes);
    if (rc)
        return rc;
    km_u64map_entry *fresh = array_alloc(new_capacity);
    if (!fresh) {
        km_memory_reserve(m->memory, old_bytes + new_bytes, old_bytes);
        return KM_ERR_OUT_OF_MEMORY;
    }
    m->old = m->entries;
    m->old_capacity = m->capacity;
    m->migrated = 0;
    m->entries = fresh;
    m->capacity = new_capacity;
    m->in_new = 0;
    if (!m->old)
        return KM_OK;
    if (m->old_capacity < KM_U64MAP_INCREMENTAL_SLOTS)
        km_u64map_finish_growth(m);
    return KM_OK;
}

/* At most 70% of the slots hold entries once every old entry has moved. */
static int has_room(const km_u64map *m, uint64_t need)
{
    return m->capacity && need * 10 <= m->capacity * 7;
}

int km_u64map_reserve(km_u64map *m, uint64_t extra)
{
    if (m->old) { /* 16 slots per key reserved, at least 1024: tens of microseconds a call */
        uint64_t step = extra > UINT64_MAX / 16 ? UINT64_MAX : 16 * extra;
        migrate(m, step > 1024 ? step : 1024);
    }
    uint64_t need = m->live + extra;
    if (has_room(m, need))
        return KM_OK;
    uint64_t capacity = m->capacity ? m->capacity : 64;
    while (need * 10 > capacity * 7 || need * 2 > capacity)
        capacity *= 2;
    return map_grow(m, capacity);
}

int km_u64map_put(km_u64map *m, uint64_t key, uint64_t value, int allow_grow)
{
    uint64_t *existing = km_u64map_find(m, key);
    if (existing) {
        *existing = value;
        return KM_OK;
    }
    if (allow_grow) {
        int rc = km_u64map_reserve(m, 1);
        if (rc)
            return rc;
    } else if (m->capacity == 0 || m->in_new + 1 >= m->capacity) {
        return KM_ERR_INTERNAL;
    }
    insert_new(m, key, value);
    m->live++;
    return KM_OK;
}

/* A map that shrinks or churns without inserting would otherwise keep its old array (and probe
 * it on every miss) indefinitely: each erase moves a small share too. */
#define ERASE_MIGRATE_SLOTS 64

int km_u64map_erase(km_u64map *m, uint64_t key)
{
    km_u64map_entry *e = find_new(m, key);
    if (!e) {
        e = find_old(m, key);
        if (!e)
            return 0;
        e->key = MAP_ERASED; /* keeps the old array's probe runs whole */
        e->value = 0;
        m->live--;
        migrate(m, ERASE_MIGRATE_SLOTS);
        return 1;
    }
    /* Backward shift, as in km_table_erase: no tombstones, so churn never forces a rehash. */
    uint64_t mask = m->capacity - 1;
    uint64_t hole = (uint64_t)(e - m->entries);
    for (uint64_t j = (hole + 1) & mask; m->entries[j].key != MAP_EMPTY; j = (j + 1) & mask) {
        if (!km_probe_may_fill(home_in(m->entries[j].key, m->capacity), hole, j, mask))
            continue;
        m->entries[hole] = m->entries[j];
        hole = j;
    }
    m->entries[hole].key = MAP_EMPTY;
    m->entries[hole].value = 0;
    m->in_new--;
    m->live--;
    migrate(m, ERASE_MIGRATE_SLOTS);
    return 1;
}

uint64_t km_u64map_bytes(const km_u64map *m)
{
    return (m->capacity + m->old_capacity) * sizeof(km_u64map_entry);
}

km_u64map_entry *km_u64map_next(const km_u64map *m, uint64_t *cursor)
{
    /* Cursor values [0, capacity) walk the new array, then [capacity, capacity + old_capacity)
     * the old one from `migrated` on. */
    for (uint64_t c = *cursor; c < m->capacity; c++)
        if (m->entries[c].key > MAP_ERASED) {
            *cursor = c + 1;
            return &m->entries[c];
        }
    uint64_t c = *cursor > m->capacity ? *cursor - m->capacity : 0;
    if (c < m->migrated)
        c = m->migrated;
    for (; m->old && c < m->old_capacity; c++)
        if (m->old[c].key > MAP_ERASED) {
            *cursor = m->capacity + c + 1;
            return &m->old[c];
        }
    *cursor = m->capacity + m->old_capacity;
    return NULL;
}
