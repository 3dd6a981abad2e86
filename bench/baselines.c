/* SPDX-License-Identifier: Apache-2.0 */
/* The baselines' public entry points (argument checks, dispatch through km_baseline_ops) and the
 * shared building blocks declared in bench/baseline_impl.h: worker sets, the u64 map and children
 * tables. */
#include "baseline_impl.h"

#include <stdlib.h>
#include <string.h>

/* ---- worker sets ---------------------------------------------------------------------------- */

int km_bl_set_add(km_bl_set *s, uint32_t w, uint32_t words, km_bl_memory *m)
{
    if (s->in.form == KM_BL_FORM_BITMAP) {
        uint64_t bit = UINT64_C(1) << (w & 63);
        if (s->bm.bits[w >> 6] & bit)
            return 0;
        s->bm.bits[w >> 6] |= bit;
        s->bm.count++;
        return 1;
    }
    uint32_t n = s->in.count, at = 0;
    while (at < n && s->in.ids[at] < w)
        at++;
    if (at < n && s->in.ids[at] == w)
        return 0;
    if (n < KM_BL_SET_INLINE) {
        memmove(&s->in.ids[at + 1], &s->in.ids[at], (n - at) * sizeof(uint16_t));
        s->in.ids[at] = (uint16_t)w;
        s->in.count++;
        return 1;
    }
    uint64_t *bits = km_bl_calloc(m, words, sizeof(uint64_t));
    if (!bits)
        return KM_ERR_OUT_OF_MEMORY;
    for (uint32_t i = 0; i < n; i++)
        bits[s->in.ids[i] >> 6] |= UINT64_C(1) << (s->in.ids[i] & 63);
    bits[w >> 6] |= UINT64_C(1) << (w & 63);
    s->bm.form = KM_BL_FORM_BITMAP;
    s->bm.reserved = 0;
    s->bm.bits = bits;
    s->bm.count = (uint16_t)(n + 1);
    return 1;
}

int km_bl_set_remove(km_bl_set *s, uint32_t w, uint32_t words, km_bl_memory *m)
{
    if (s->in.form == KM_BL_FORM_BITMAP) {
        uint64_t bit = UINT64_C(1) << (w & 63);
        if (!(s->bm.bits[w >> 6] & bit))
            return 0;
        s->bm.bits[w >> 6] &= ~bit;
        s->bm.count--;
        if (s->bm.count <= KM_BL_SET_DEMOTE_AT) {
            uint32_t ids[KM_BL_SET_DEMOTE_AT];
            uint32_t n = km_bl_set_list(s, words, ids);
            km_bl_free(m, s->bm.bits, words * sizeof(uint64_t));
            memset(s, 0, sizeof(*s));
            s->in.form = KM_BL_FORM_INLINE;
            s->in.count = (uint16_t)n;
            for (uint32_t i = 0; i < n; i++)
                s->in.ids[i] = (uint16_t)ids[i];
        }
        return 1;
    }
    uint32_t n = s->in.count;
    for (uint32_t i = 0; i < n; i++) {
        if (s->in.ids[i] == w) {
            memmove(&s->in.ids[i], &s->in.ids[i + 1], (n - i - 1) * sizeof(uint16_t));
            s->in.count--;
            return 1;
        }
    }
    return 0;
}

int km_bl_set_copy(km_bl_set *dst, const km_bl_set *src, uint32_t words, km_bl_memory *m)
{
    *dst = *src;
    if (src->in.form == KM_BL_FORM_BITMAP) {
        dst->bm.bits = km_bl_alloc(m, words * sizeof(uint64_t));
        if (!dst->bm.bits) {
            memset(dst, 0, sizeof(*dst));
            return KM_ERR_OUT_OF_MEMORY;
        }
        memcpy(dst->bm.bits, src->bm.bits, words * sizeof(uint64_t));
    }
    return KM_OK;
}

void km_bl_set_release(km_bl_set *s, uint32_t words, km_bl_memory *m)
{
    if (s->in.form == KM_BL_FORM_BITMAP)
        km_bl_free(m, s->bm.bits, words * sizeof(uint64_t));
    memset(s, 0, sizeof(*s));
}

uint32_t km_bl_set_list(const km_bl_set *s, uint32_t words, uint32_t *out)
{
    uint32_t n = 0;
    if (s->in.form == KM_BL_FORM_BITMAP) {
        for (uint32_t wi = 0; wi < words; wi++) {
            uint64_t word = s->bm.bits[wi];
            while (word) {
                out[n++] = wi * 64u + (uint32_t)__builtin_ctzll(word);
                word &= word - 1;
            }
        }
        return n;
    }
    for (uint32_t i = 0; i < s->in.count; i++)
        out[n++] = s->in.ids[i];
    return n;
}

/* ---- u64 -> u64 map ------------------------------------------------------------------------- */

static inline uint64_t map_home(uint64_t key, uint64_t mask)
{
    return (km_bl_mix(key) >> 20) & mask;
}

static int map_grow(km_bl_map *map, km_bl_memory *m)
{
    uint64_t cap = map->capacity ? map->capacity * 2 : 16;
    km_bl_map_entry *e = km_bl_calloc(m, cap, sizeof(*e));
    if (!e)
        return KM_ERR_OUT_OF_MEMORY;
    uint64_t mask = cap - 1;
    for (uint64_t i = 0; i < map->capacity; i++) {
        km_bl_map_entry *o = &map->entries[i];
        if (o->key == KM_BL_MAP_EMPTY)
            continue;
        uint64_t j = map_home(o->key, mask);
        while (e[j].key != KM_BL_MAP_EMPTY)
            j = (j + 1) & mask;
        e[j] = *o;
    }
    km_bl_free(m, map->entries, map->capacity * sizeof(*e));
    map->entries = e;
    map->capacity = cap;
    return KM_OK;
}

int km_bl_map_put(km_bl_map *map, uint64_t raw, uint64_t value, km_bl_memory *m)
{
    km_bl_map_entry *e = km_bl_map_find(map, raw);
    if (e) {
        e->value = value;
        return KM_OK;
    }
    /* Load factor at most 3/4. */
    if ((map->live + 1) * 4 > map->capacity * 3) {
        int rc = map_grow(map, m);
        if (rc != KM_OK)
            return rc;
    }
    uint64_t key = km_bl_map_key(raw);
    uint64_t mask = map->capacity - 1;
    uint64_t i = map_home(key, mask);
    while (map->entries[i].key != KM_BL_MAP_EMPTY)
        i = (i + 1) & mask;
    map->entries[i].key = key;
    map->entries[i].value = value;
    map->live++;
    return KM_OK;
}

int km_bl_map_take(km_bl_map *map, uint64_t raw, uint64_t *value)
{
    km_bl_map_entry *e = km_bl_map_find(map, raw);
    if (!e)
        return 0;
    if (value)
        *value = e->value;
    /* Backward-shift deletion keeps probe chains short without tombstones. */
    uint64_t mask = map->capacity - 1;
    uint64_t i = (uint64_t)(e - map->entries);
    uint64_t j = i;
    for (;;) {
        j = (j + 1) & mask;
        km_bl_map_entry *n = &map->entries[j];
        if (n->key == KM_BL_MAP_EMPTY)
            break;
        uint64_t k = map_home(n->key, mask);
        /* n may move to the hole at i when its home is not in (i, j] (cyclically). */
        int home_between = (i <= j) ? (k > i && k <= j) : (k > i || k <= j);
        if (!home_between) {
            map->entries[i] = *n;
            i = j;
        }
    }
    map->entries[i].key = KM_BL_MAP_EMPTY;
    map->entries[i].value = 0;
    map->live--;
    return 1;
}

void km_bl_map_release(km_bl_map *map, km_bl_memory *m)
{
    km_bl_free(m, map->entries, map->capacity * sizeof(km_bl_map_entry));
    memset(map, 0, sizeof(*map));
}

/* ---- children tables ------------------------------------------------------------------------ */

static inline uint32_t ctab_home(uint64_t key, uint32_t mask)
{
    return (uint32_t)(km_bl_mix(key) >> 40) & mask;
}

static size_t ctab_bytes(uint32_t capacity)
{
    return sizeof(km_bl_ctab) + capacity * (sizeof(uint64_t) + sizeof(uint32_t));
}

static km_bl_ctab *ctab_new(uint32_t capacity, km_bl_memory *m)
{
    km_bl_ctab *t = km_bl_alloc(m, ctab_bytes(capacity));
    if (!t)
        return NULL;
    t->capacity = capacity;
    t->count = 0;
    t->keys = (uint64_t *)(t + 1);
    t->nodes = (uint32_t *)(t->keys + capacity);
    memset(t->nodes, 0xff, capacity * sizeof(uint32_t));
    return t;
}

static void ctab_insert(km_bl_ctab *t, uint64_t key, uint32_t node)
{
    uint32_t mask = t->capacity - 1;
    uint32_t i = ctab_home(key, mask);
    while (t->nodes[i] != KM_BL_NO_NODE)
        i = (i + 1) & mask;
    t->keys[i] = key;
    t->nodes[i] = node;
    t->count++;
}

static uint32_t ctab_slot(const km_bl_ctab *t, uint64_t key)
{
    uint32_t mask = t->capacity - 1;
    uint32_t i = ctab_home(key, mask);
    while (t->nodes[i] != KM_BL_NO_NODE) {
        if (t->keys[i] == key)
            return i;
        i = (i + 1) & mask;
    }
    return UINT32_MAX;
}

int km_bl_children_add(km_bl_children *c, uint64_t key, uint32_t node, km_bl_memory *m)
{
    if (c->count == 0) {
        c->one_key = key;
        c->u.one = node;
        c->count = 1;
        return KM_OK;
    }
    if (c->count == 1) {
        km_bl_ctab *t = ctab_new(4, m);
        if (!t)
            return KM_ERR_OUT_OF_MEMORY;
        ctab_insert(t, c->one_key, c->u.one);
        ctab_insert(t, key, node);
        c->u.tab = t;
        c->count = 2;
        return KM_OK;
    }
    km_bl_ctab *t = c->u.tab;
    /* Load factor at most 1/2: small tables, short probes. */
    if ((t->count + 1) * 2 > t->capacity) {
        km_bl_ctab *g = ctab_new(t->capacity * 2, m);
        if (!g)
            return KM_ERR_OUT_OF_MEMORY;
        for (uint32_t i = 0; i < t->capacity; i++)
            if (t->nodes[i] != KM_BL_NO_NODE)
                ctab_insert(g, t->keys[i], t->nodes[i]);
        km_bl_free(m, t, ctab_bytes(t->capacity));
        c->u.tab = t = g;
    }
    ctab_insert(t, key, node);
    c->count = t->count;
    return KM_OK;
}

void km_bl_children_set(km_bl_children *c, uint64_t key, uint32_t node)
{
    if (c->count == 1) {
        if (c->one_key == key)
            c->u.one = node;
        return;
    }
    if (c->count == 0)
        return;
    uint32_t i = ctab_slot(c->u.tab, key);
    if (i != UINT32_MAX)
        c->u.tab->nodes[i] = node;
}

void km_bl_children_del(km_bl_children *c, uint64_t key, km_bl_memory *m)
{
    if (c->count == 0)
        return;
    if (c->count == 1) {
        if (c->one_key == key) {
            c->count = 0;
            c->one_key = 0;
            c->u.one = KM_BL_NO_NODE;
        }
        return;
    }
    km_bl_ctab *t = c->u.tab;
    uint32_t i = ctab_slot(t, key);
    if (i == UINT32_MAX)
        return;
    uint32_t mask = t->capacity - 1, j = i;
    for (;;) {
        j = (j + 1) & mask;
        if (t->nodes[j] == KM_BL_NO_NODE)
            break;
        uint32_t k = ctab_home(t->keys[j], mask);
        int home_between = (i <= j) ? (k > i && k <= j) : (k > i || k <= j);
        if (!home_between) {
            t->keys[i] = t->keys[j];
            t->nodes[i] = t->nodes[j];
            i = j;
        }
    }
    t->nodes[i] = KM_BL_NO_NODE;
    t->count--;
    c->count = t->count;
    if (t->count == 1) {
        for (uint32_t s = 0; s < t->capacity; s++) {
            if (t->nodes[s] != KM_BL_NO_NODE) {
                c->one_key = t->keys[s];
                c->u.one = t->nodes[s];
                break;
            }
        }
        km_bl_free(m, t, ctab_bytes(t->capacity));
    }
}

void km_bl_children_release(km_bl_children *c, km_bl_memory *m)
{
    if (c->count >= 2)
        km_bl_free(m, c->u.tab, ctab_bytes(c->u.tab->capacity));
    memset(c, 0, sizeof(*c));
}

typedef struct children_holder {
    const km_bl_set *(*set_of)(const void *tree, uint32_t node);
    const void *tree;
    uint32_t worker;
    bool found;
} children_holder;

static void check_child(uint32_t node, void *user)
{
    children_holder *h = user;
    h->found = h->found || km_bl_set_contains(h->set_of(h->tree, node), h->worker);
}

bool km_bl_children_held_by(const km_bl_children *c, const km_bl_set *(*set_of)(const void *tree,
                                                                               uint32_t node),
                            const void *tree, uint32_t worker)
{
    children_holder h = {set_of, tree, worker, false};
    km_bl_children_each(c, check_child, &h);
    return h.found;
}

void km_bl_children_each(const km_bl_children *c, void (*fn)(uint32_t node, void *user), void *user)
{
    if (c->count == 1) {
        fn(c->u.one, user);
        return;
    }
    if (c->count == 0)
        return;
    const km_bl_ctab *t = c->u.tab;
    for (uint32_t i = 0; i < t->capacity; i++)
        if (t->nodes[i] != KM_BL_NO_NODE)
            fn(t->nodes[i], user);
}

/* ---- public entry points -------------------------------------------------------------------- */

struct km_baseline {
    km_baseline_kind kind;
    uint32_t max_workers;
    const km_baseline_ops *ops;
    void *state;
};

static const km_baseline_ops *ops_of(km_baseline_kind kind)
{
    switch (kind) {
    case KM_BASELINE_RADIX:
        return &km_baseline_radix_ops;
    case KM_BASELINE_RADIX_COMPRESSED:
        return &km_baseline_radix_compressed_ops;
    case KM_BASELINE_FLATMAP:
        return &km_baseline_flatmap_ops;
    }
    return NULL;
}

const char *km_baseline_name(km_baseline_kind kind)
{
    const km_baseline_ops *ops = ops_of(kind);
    return ops ? ops->name : NULL;
}

int km_baseline_create(km_baseline_kind kind, uint32_t max_workers, km_baseline **out)
{
    if (!out)
        return KM_ERR_NULL_POINTER;
    *out = NULL;
    const km_baseline_ops *ops = ops_of(kind);
    if (!ops || max_workers == 0 || max_workers > KM_MAX_WORKERS_LIMIT)
        return KM_ERR_INVALID_ARGUMENT;
    km_baseline *b = calloc(1, sizeof(*b));
    if (!b)
        return KM_ERR_OUT_OF_MEMORY;
    b->kind = kind;
    b->max_workers = max_workers;
    b->ops = ops;
    int rc = ops->create(max_workers, &b->state);
    if (rc != KM_OK) {
        free(b);
        return rc;
    }
    *out = b;
    return KM_OK;
}

void km_baseline_destroy(km_baseline *baseline)
{
    if (!baseline)
        return;
    baseline->ops->destroy(baseline->state);
    free(baseline);
}

km_baseline_kind km_baseline_get_kind(const km_baseline *baseline)
{
    return baseline->kind;
}

int km_baseline_store(km_baseline *baseline, uint32_t worker, uint64_t parent,
                      const uint64_t *chain, const uint64_t *local, size_t n)
{
    if (!baseline || (n > 0 && (!chain || (baseline->ops->needs_local && !local))))
        return KM_ERR_NULL_POINTER;
    if (worker >= baseline->max_workers)
        return KM_ERR_WORKER_RANGE;
    if (n == 0)
        return KM_OK;
    return baseline->ops->store(baseline->state, worker, parent, chain, local, n);
}

int km_baseline_remove(km_baseline *baseline, uint32_t worker, const uint64_t *chain, size_t n)
{
    if (!baseline || (n > 0 && !chain))
        return KM_ERR_NULL_POINTER;
    if (worker >= baseline->max_workers)
        return KM_ERR_WORKER_RANGE;
    if (n == 0)
        return KM_OK;
    return baseline->ops->remove(baseline->state, worker, chain, n);
}

int km_baseline_result_init(const km_baseline *baseline, km_baseline_result *result)
{
    if (!baseline || !result)
        return KM_ERR_NULL_POINTER;
    memset(result, 0, sizeof(*result));
    result->matches = malloc(baseline->max_workers * sizeof(km_worker_match));
    result->scratch = malloc(baseline->max_workers * sizeof(uint32_t));
    if (!result->matches || !result->scratch) {
        km_baseline_result_free(result);
        return KM_ERR_OUT_OF_MEMORY;
    }
    result->capacity = baseline->max_workers;
    result->owner = KM_NO_WORKER;
    return KM_OK;
}

void km_baseline_result_free(km_baseline_result *result)
{
    if (!result)
        return;
    free(result->matches);
    free(result->scratch);
    memset(result, 0, sizeof(*result));
}

int km_baseline_match(const km_baseline *baseline, const uint64_t *chain, const uint64_t *local,
                      uint32_t n, km_baseline_result *result)
{
    if (!baseline || !result || !result->matches)
        return KM_ERR_NULL_POINTER;
    if (n > 0 && ((baseline->ops->needs_local && !local) ||
                  (baseline->ops->needs_chain_for_match && !chain)))
        return KM_ERR_NULL_POINTER;
    if (result->capacity < baseline->max_workers)
        return KM_ERR_INVALID_ARGUMENT;
    result->count = 0;
    result->owner = KM_NO_WORKER;
    result->owner_depth = 0;
    result->visits = 0;
    if (n == 0)
        return KM_OK;
    baseline->ops->match(baseline->state, chain, local, n, result);
    return KM_OK;
}

int km_baseline_get_stats(const km_baseline *baseline, km_baseline_stats *out)
{
    if (!baseline || !out)
        return KM_ERR_NULL_POINTER;
    memset(out, 0, sizeof(*out));
    baseline->ops->stats(baseline->state, out);
    return KM_OK;
}
