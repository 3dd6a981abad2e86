/* SPDX-License-Identifier: Apache-2.0 */
/* The feed's engine-hash map: the shared core (src/base/open_map.h) over 24-byte entries, with its
 * parent and announcement side maps (src/base/u64_map.h) kept in step. */
#include "events/engine_hash_map.h"

#include <stdio.h>

#include "kvmatch/error.h"
#include "base/u64_map.h"

_Static_assert(offsetof(km_emap_entry, key) == 0, "the core reads the key first");
_Static_assert(sizeof(km_emap_entry) == 24, "24-byte entries (engine_hash_map.h)");

void km_emap_init(km_emap *m, bool keep_parents)
{
    km_oamap_init(&m->core, sizeof(km_emap_entry), 16, NULL);
    km_u64map_init(&m->parents, NULL);
    km_u64map_init(&m->holds, NULL);
    m->keep_parents = keep_parents;
}

void km_emap_free(km_emap *m)
{
    km_oamap_free(&m->core);
    km_u64map_free(&m->parents);
    km_u64map_free(&m->holds);
}

int km_emap_reserve(km_emap *m, uint64_t extra)
{
    int rc = km_oamap_reserve(&m->core, extra);
    if (rc == KM_OK && m->keep_parents)
        rc = km_u64map_reserve(&m->parents, extra);
    return rc;
}

/* The announcement map exists only while it holds an entry. */
static void holds_release_if_empty(km_emap *m)
{
    if (m->holds.live == 0 && m->holds.capacity) {
        km_u64map_free(&m->holds);
        km_u64map_init(&m->holds, NULL);
    }
}

void km_emap_erase_extras(km_emap *m, uint64_t key)
{
    if (m->parents.live)
        km_u64map_erase(&m->parents, key);
    if (m->holds.live && km_u64map_erase(&m->holds, key))
        holds_release_if_empty(m);
}

void km_emap_clear(km_emap *m)
{
    km_oamap_clear(&m->core);
    km_oamap_clear(&m->parents);
    km_u64map_free(&m->holds);
    km_u64map_init(&m->holds, NULL);
}

int km_emap_size_for(km_emap *m, uint64_t entries)
{
    int rc = km_oamap_size_for(&m->core, entries);
    if (rc == KM_OK)
        km_oamap_finish_growth(&m->core); /* the previous array was empty: let it go now */
    return rc;
}

const km_emap_entry *km_emap_next(const km_emap *m, uint64_t *cursor)
{
    return (const km_emap_entry *)(void *)km_oamap_next(&m->core, cursor);
}

/* ---- parents --------------------------------------------------------------------------------- */

uint64_t km_emap_parent_held(const km_emap *m, const km_emap_entry *e)
{
    const uint64_t *p = km_u64map_find(&m->parents, e->key);
    return p ? *p : 0;
}

int km_emap_set_kept_parent(km_emap *m, const km_emap_entry *e, uint64_t parent_key)
{
    if (!parent_key) {
        if (m->parents.live)
            km_u64map_erase(&m->parents, e->key);
        return KM_OK;
    }
    return km_u64map_put(&m->parents, e->key, parent_key, 1);
}

/* ---- announcements --------------------------------------------------------------------------- */

static unsigned holds_shift(unsigned medium)
{
    return 16u * (medium - 1u);
}

uint32_t km_emap_holds(const km_emap *m, const km_emap_entry *e, unsigned medium)
{
    if (!(e->media >> medium & 1u))
        return 0;
    const uint64_t *v = m->holds.live ? km_u64map_find(&m->holds, e->key) : NULL;
    uint32_t count = v ? (uint32_t)(*v >> holds_shift(medium) & 0xFFFFu) : 0;
    return count ? count : 1;
}

/* Store count (0: the media bit says it) for e in medium; the entry leaves the side map when its
 * last count goes. */
static int holds_store(km_emap *m, uint64_t key, unsigned medium, uint32_t count)
{
    uint64_t *v = m->holds.live ? km_u64map_find(&m->holds, key) : NULL;
    uint64_t mask = UINT64_C(0xFFFF) << holds_shift(medium);
    uint64_t now = ((v ? *v : 0) & ~mask) | (uint64_t)count << holds_shift(medium);
    if (now == 0) {
        if (v) {
            km_u64map_erase(&m->holds, key);
            holds_release_if_empty(m);
        }
        return KM_OK;
    }
    if (v) {
        *v = now;
        return KM_OK;
    }
    int rc = km_u64map_put(&m->holds, key, now, 1);
    if (rc != KM_OK)
        holds_release_if_empty(m);
    return rc;
}

void km_emap_gain_hold(km_emap *m, km_emap_entry *e, unsigned medium)
{
    uint8_t bit = (uint8_t)(1u << medium);
    if (!(e->media & bit)) {
        e->media |= bit;
        return;
    }
    uint32_t count = km_emap_holds(m, e, medium);
    if (count < KM_EMAP_MAX_HOLDS)
        (void)holds_store(m, e->key, medium, count + 1); /* no memory: not counted */
}

bool km_emap_drop_hold(km_emap *m, const km_emap_entry *e, unsigned medium)
{
    uint32_t count = km_emap_holds(m, e, medium);
    if (count <= 1)
        return false;
    (void)holds_store(m, e->key, medium, count == 2 ? 0 : count - 1); /* never allocates */
    return true;
}

void km_emap_leave(km_emap *m, km_emap_entry *e, unsigned medium)
{
    e->media &= (uint8_t) ~(1u << medium);
    if (m->holds.live)
        (void)holds_store(m, e->key, medium, 0); /* never allocates */
}

int km_emap_restore_holds(km_emap *m, const km_emap_entry *e, unsigned medium, uint32_t count)
{
    return holds_store(m, e->key, medium, count);
}

/* ---- consistency ----------------------------------------------------------------------------- */

int km_emap_check(const km_emap *m, char *why, size_t why_size)
{
    uint64_t cursor = 0;
    if (!m->keep_parents && m->parents.live) {
        snprintf(why, why_size, "%llu parents kept by a map that keeps none",
                 (unsigned long long)m->parents.live);
        return KM_ERR_INTERNAL;
    }
    for (const km_u64map_entry *p; (p = km_u64map_next(&m->parents, &cursor));) {
        if (!km_oamap_find(&m->core, p->key, sizeof(km_emap_entry)) || p->value <= 1) {
            snprintf(why, why_size, "parent entry %016llx -> %016llx of an absent block or none",
                     (unsigned long long)p->key, (unsigned long long)p->value);
            return KM_ERR_INTERNAL;
        }
    }
    if (m->holds.live == 0 && m->holds.capacity) {
        snprintf(why, why_size, "an empty announcement map is still allocated");
        return KM_ERR_INTERNAL;
    }
    cursor = 0;
    for (const km_u64map_entry *h; (h = km_u64map_next(&m->holds, &cursor));) {
        const km_emap_entry *e =
            (const km_emap_entry *)(void *)km_oamap_find(&m->core, h->key, sizeof *e);
        if (!e || !h->value) {
            snprintf(why, why_size, "announcements of %016llx, an absent block or none",
                     (unsigned long long)h->key);
            return KM_ERR_INTERNAL;
        }
        for (unsigned medium = 1; medium <= KM_EMAP_HOLD_MEDIA; medium++) {
            uint32_t count = (uint32_t)(h->value >> holds_shift(medium) & 0xFFFFu);
            if (count && (count < 2 || !(e->media >> medium & 1u))) {
                snprintf(why, why_size, "block %016llx counts %u announcements in medium %u "
                         "(media %#x)", (unsigned long long)h->key, count, medium, e->media);
                return KM_ERR_INTERNAL;
            }
        }
    }
    return KM_OK;
}
