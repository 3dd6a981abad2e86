/* SPDX-License-Identifier: Apache-2.0 */
/* Open-addressing u64 -> u64 map for host bookkeeping: the shared core (src/base/open_map.h: linear
 * probing, backward-shift deletion, incremental growth) over 16-byte entries. */
#include "base/u64_map.h"

#include "kvmatch/error.h"

_Static_assert(offsetof(km_u64map_entry, key) == 0, "the core reads the key first");

void km_u64map_init(km_u64map *m, km_memory *memory)
{
    km_oamap_init(m, sizeof(km_u64map_entry), 64, memory);
}

void km_u64map_free(km_u64map *m)
{
    km_oamap_free(m);
}

void km_u64map_finish_growth(km_u64map *m)
{
    km_oamap_finish_growth(m);
}

int km_u64map_reserve(km_u64map *m, uint64_t extra)
{
    return km_oamap_reserve(m, extra);
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
    km_u64map_entry e = {key, value};
    km_oamap_place(m, &e);
    m->live++;
    return KM_OK;
}

int km_u64map_erase(km_u64map *m, uint64_t key)
{
    uint8_t *e = km_oamap_find(m, key, sizeof(km_u64map_entry));
    if (!e)
        return 0;
    km_oamap_erase(m, e);
    return 1;
}

uint64_t km_u64map_bytes(const km_u64map *m)
{
    return km_oamap_bytes(m);
}

km_u64map_entry *km_u64map_next(const km_u64map *m, uint64_t *cursor)
{
    return (km_u64map_entry *)(void *)km_oamap_next(m, cursor);
}
