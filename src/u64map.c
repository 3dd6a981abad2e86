/* Open-addressing u64 -> u64 map (linear probing, backward-shift deletion) for host bookkeeping. */
#include "u64map.h"

#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "kvmatch/error.h"

#define MAP_EMPTY UINT64_C(0)

void km_u64map_init(km_u64map *m, km_memory *memory)
{
    memset(m, 0, sizeof *m);
    m->memory = memory;
}

void km_u64map_free(km_u64map *m)
{
    if (m->entries)
        km_memory_release(m->memory, m->capacity * sizeof(km_u64map_entry));
    free(m->entries);
    km_memory *memory = m->memory;
    memset(m, 0, sizeof *m);
    m->memory = memory;
}

static uint64_t map_home(const km_u64map *m, uint64_t key)
{
    return (key * UINT64_C(0x9E3779B97F4A7C15)) & (m->capacity - 1);
}

uint64_t *km_u64map_find(const km_u64map *m, uint64_t key)
{
    if (m->capacity == 0)
        return NULL;
    for (uint64_t i = map_home(m, key);; i = (i + 1) & (m->capacity - 1)) {
        if (m->entries[i].key == key)
            return &m->entries[i].value;
        if (m->entries[i].key == MAP_EMPTY)
            return NULL;
    }
}

static int map_rehash(km_u64map *m, uint64_t new_capacity)
{
    uint64_t old_bytes = m->capacity * sizeof(km_u64map_entry);
    uint64_t new_bytes = new_capacity * sizeof(km_u64map_entry);
    int rc = km_memory_reserve(m->memory, old_bytes, new_bytes);
    if (rc)
        return rc;
    km_u64map_entry *fresh = calloc(new_capacity, sizeof *fresh);
    if (!fresh) {
        km_memory_reserve(m->memory, new_bytes, old_bytes);
        return KM_ERR_OUT_OF_MEMORY;
    }
    km_u64map_entry *old = m->entries;
    uint64_t old_capacity = m->capacity;
    m->entries = fresh;
    m->capacity = new_capacity;
    for (uint64_t i = 0; i < old_capacity; i++) {
        if (old[i].key == MAP_EMPTY)
            continue;
        uint64_t j = map_home(m, old[i].key);
        while (m->entries[j].key != MAP_EMPTY)
            j = (j + 1) & (m->capacity - 1);
        m->entries[j] = old[i];
    }
    free(old);
    return KM_OK;
}

int km_u64map_reserve(km_u64map *m, uint64_t extra)
{
    uint64_t need = m->live + extra;
    if (m->capacity && need * 10 <= m->capacity * 7)
        return KM_OK;
    uint64_t capacity = m->capacity ? m->capacity : 64;
    while (need * 10 > capacity * 7 || need * 2 > capacity)
        capacity *= 2;
    if (capacity < 64)
        capacity = 64;
    return map_rehash(m, capacity);
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
    } else if (m->capacity == 0 || m->live + 1 >= m->capacity) {
        return KM_ERR_INTERNAL;
    }
    for (uint64_t i = map_home(m, key);; i = (i + 1) & (m->capacity - 1)) {
        uint64_t k = m->entries[i].key;
        if (k == MAP_EMPTY) {
            m->entries[i].key = key;
            m->entries[i].value = value;
            m->live++;
            return KM_OK;
        }
    }
}

int km_u64map_erase(km_u64map *m, uint64_t key)
{
    uint64_t *value = km_u64map_find(m, key);
    if (!value)
        return 0;
    km_u64map_entry *e = (km_u64map_entry *)((char *)value - offsetof(km_u64map_entry, value));
    /* Backward shift, as in km_table_erase: no tombstones, so churn never forces a rehash. */
    uint64_t mask = m->capacity - 1;
    uint64_t hole = (uint64_t)(e - m->entries);
    for (uint64_t j = (hole + 1) & mask; m->entries[j].key != MAP_EMPTY; j = (j + 1) & mask) {
        if (!km_probe_may_fill(map_home(m, m->entries[j].key), hole, j, mask))
            continue;
        m->entries[hole] = m->entries[j];
        hole = j;
    }
    m->entries[hole].key = MAP_EMPTY;
    m->entries[hole].value = 0;
    m->live--;
    return 1;
}

uint64_t km_u64map_bytes(const km_u64map *m)
{
    return m->capacity * sizeof(km_u64map_entry);
}
