/* SPDX-License-Identifier: Apache-2.0 */
/* The feed's engine-hash map: the shared core (src/base/open_map.h) over 40-byte entries. */
#include "events/engine_hash_map.h"

#include <stddef.h>

#include "kvmatch/error.h"
#include "base/u64_map.h"

_Static_assert(offsetof(km_emap_entry, key) == 0, "the core reads the key first");
_Static_assert(sizeof(km_emap_entry) == 40, "40-byte entries (engine_hash_map.h)");

void km_emap_init(km_emap *m)
{
    km_oamap_init(m, sizeof(km_emap_entry), 16, NULL);
}

void km_emap_free(km_emap *m)
{
    km_oamap_free(m);
}

km_emap_entry *km_emap_find(const km_emap *m, uint64_t engine_hash)
{
    return (km_emap_entry *)(void *)km_oamap_find(m, km_u64map_key(engine_hash),
                                                  sizeof(km_emap_entry));
}

int km_emap_reserve(km_emap *m, uint64_t extra)
{
    return km_oamap_reserve(m, extra);
}

km_emap_entry *km_emap_upsert(km_emap *m, uint64_t engine_hash)
{
    km_emap_entry *e = km_emap_find(m, engine_hash);
    if (e)
        return e;
    km_emap_entry fresh = {.key = km_u64map_key(engine_hash)};
    m->live++;
    return (km_emap_entry *)(void *)km_oamap_place(m, &fresh);
}

void km_emap_erase(km_emap *m, km_emap_entry *e)
{
    km_oamap_erase(m, (uint8_t *)e);
}

void km_emap_clear(km_emap *m)
{
    km_oamap_clear(m);
}

int km_emap_size_for(km_emap *m, uint64_t entries)
{
    int rc = km_oamap_size_for(m, entries);
    if (rc == KM_OK)
        km_oamap_finish_growth(m); /* the previous array was empty: let it go now */
    return rc;
}

const km_emap_entry *km_emap_next(const km_emap *m, uint64_t *cursor)
{
    return (const km_emap_entry *)(void *)km_oamap_next(m, cursor);
}
