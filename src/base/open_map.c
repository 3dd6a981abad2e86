/* SPDX-License-Identifier: Apache-2.0 */
/* The open-addressing core of the host's keyed maps (contract and growth protocol in open_map.h). */
#include "base/open_map.h"

#include "kvmatch/error.h"
#include "base/zeroed_pages.h"

void km_oamap_init(km_oamap *m, uint32_t entry_size, uint32_t min_capacity, km_memory *memory)
{
    memset(m, 0, sizeof *m);
    m->entry_size = entry_size;
    m->min_capacity = min_capacity;
    m->memory = memory;
}

static uint64_t array_bytes(const km_oamap *m, uint64_t capacity)
{
    return capacity * m->entry_size;
}

static void account_release(km_oamap *m, uint64_t bytes)
{
    if (m->memory)
        km_memory_release(m->memory, bytes);
}

/* Give back what the move has not given back of the old array (all of it once the move is over). */
static void release_old(km_oamap *m)
{
    if (!m->old)
        return;
    uint64_t bytes = array_bytes(m, m->old_capacity);
    account_release(m, bytes);
    km_pages_release(m->old, bytes, km_pages_releasable(bytes, array_bytes(m, m->migrated)), bytes);
    m->old = NULL;
    m->old_capacity = 0;
    m->migrated = 0;
}

void km_oamap_free(km_oamap *m)
{
    release_old(m);
    if (m->entries)
        account_release(m, array_bytes(m, m->capacity));
    km_pages_free(m->entries, array_bytes(m, m->capacity));
    km_oamap_init(m, m->entry_size, m->min_capacity, m->memory);
}

uint8_t *km_oamap_place(km_oamap *m, const void *entry)
{
    uint64_t i = km_oamap_home(km_oamap_entry_key(entry), m->capacity);
    while (km_oamap_entry_key(m->entries + i * m->entry_size) != KM_OAMAP_EMPTY)
        i = (i + 1) & (m->capacity - 1);
    uint8_t *e = m->entries + i * m->entry_size;
    memcpy(e, entry, m->entry_size);
    m->in_new++;
    return e;
}

/* Move up to `slots` slots of the old array, giving back each whole piece passed. */
static void migrate(km_oamap *m, uint64_t slots)
{
    if (!m->old)
        return;
    uint64_t from = m->migrated;
    uint64_t end = m->old_capacity - from > slots ? from + slots : m->old_capacity;
    for (uint64_t j = from; j < end; j++) {
        const uint8_t *e = m->old + j * m->entry_size;
        if (km_oamap_entry_key(e) > KM_OAMAP_ERASED)
            km_oamap_place(m, e);
    }
    if (end == m->old_capacity) {
        release_old(m); /* from `migrated` (still `from`) to the end */
        return;
    }
    m->migrated = end;
    uint64_t bytes = array_bytes(m, m->old_capacity);
    km_pages_release(m->old, bytes, km_pages_releasable(bytes, array_bytes(m, from)),
                     km_pages_releasable(bytes, array_bytes(m, end)));
}

void km_oamap_finish_growth(km_oamap *m)
{
    migrate(m, UINT64_MAX);
}

/* Replace the array with one of new_capacity slots; small maps move every entry now. */
static int grow(km_oamap *m, uint64_t new_capacity)
{
    km_oamap_finish_growth(m); /* at most one growth in progress */
    uint64_t old_bytes = array_bytes(m, m->capacity);
    uint64_t new_bytes = array_bytes(m, new_capacity);
    /* Both arrays live until the move ends. */
    int rc = m->memory ? km_memory_reserve(m->memory, old_bytes, old_bytes + new_bytes) : KM_OK;
    if (rc)
        return rc;
    uint8_t *fresh = km_pages_alloc(new_bytes);
    if (!fresh) {
        if (m->memory)
            km_memory_reserve(m->memory, old_bytes + new_bytes, old_bytes);
        return KM_ERR_OUT_OF_MEMORY;
    }
    m->old = m->entries;
    m->old_capacity = m->capacity;
    m->migrated = 0;
    m->entries = fresh;
    m->capacity = new_capacity;
    m->in_new = 0;
    if (m->old_capacity < KM_OAMAP_INCREMENTAL_SLOTS)
        km_oamap_finish_growth(m); /* also drops a NULL old array (the first reserve) */
    return KM_OK;
}

int km_oamap_reserve(km_oamap *m, uint64_t extra)
{
    if (m->old) { /* 16 slots per entry reserved, at least 1024: tens of microseconds a call */
        uint64_t step = extra > UINT64_MAX / 16 ? UINT64_MAX : 16 * extra;
        migrate(m, step > 1024 ? step : 1024);
    }
    uint64_t need = m->live + extra;
    if (m->capacity && need * 10 <= m->capacity * 7)
        return KM_OK;
    uint64_t capacity = m->capacity > m->min_capacity ? m->capacity : m->min_capacity;
    while (need * 10 > capacity * 7 || need * 2 > capacity)
        capacity *= 2;
    return grow(m, capacity);
}

int km_oamap_size_for(km_oamap *m, uint64_t entries)
{
    if (m->live || m->old)
        return KM_ERR_INVALID_ARGUMENT;
    uint64_t capacity = m->min_capacity;
    while (entries * 10 > capacity * 7)
        capacity *= 2;
    if (capacity == m->capacity)
        return KM_OK;
    return grow(m, capacity); /* the old array is empty: dropped at once */
}

/* A map that only shrinks would otherwise keep its old array (and probe it on every miss)
 * indefinitely: each erase moves a small share too. */
#define ERASE_MIGRATE_SLOTS 64

void km_oamap_erase_moves(km_oamap *m)
{
    migrate(m, ERASE_MIGRATE_SLOTS);
}

void km_oamap_erase(km_oamap *m, uint8_t *entry)
{
    km_oamap_erase_sized(m, entry, m->entry_size);
}

void km_oamap_clear(km_oamap *m)
{
    release_old(m);
    if (m->capacity)
        memset(m->entries, 0, array_bytes(m, m->capacity));
    m->live = 0;
    m->in_new = 0;
}

uint8_t *km_oamap_next(const km_oamap *m, uint64_t *cursor)
{
    /* [0, capacity) walks the new array, then [capacity, capacity + old_capacity) the old one
     * from `migrated` on. */
    for (uint64_t c = *cursor; c < m->capacity; c++) {
        uint8_t *e = m->entries + c * m->entry_size;
        if (km_oamap_entry_key(e) > KM_OAMAP_ERASED) {
            *cursor = c + 1;
            return e;
        }
    }
    uint64_t c = *cursor > m->capacity ? *cursor - m->capacity : 0;
    if (c < m->migrated)
        c = m->migrated;
    for (; m->old && c < m->old_capacity; c++) {
        uint8_t *e = m->old + c * m->entry_size;
        if (km_oamap_entry_key(e) > KM_OAMAP_ERASED) {
            *cursor = m->capacity + c + 1;
            return e;
        }
    }
    *cursor = m->capacity + m->old_capacity;
    return NULL;
}

uint64_t km_oamap_bytes(const km_oamap *m)
{
    return array_bytes(m, m->capacity + m->old_capacity);
}
