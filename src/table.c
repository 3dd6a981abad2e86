/* Host hash table over km_slot: linear probing with backward-shift deletion, bitmap pool for widely
 * held blocks, optional block metadata, dirty-slot tracking for device replicas, accounted memory. */
#include "table.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "kvmatch/error.h"

/* Grow when keys (+ tombstones, which only a loaded old snapshot can hold, purged on load) pass 70%
 * of the slots; growth at least doubles the capacity. */
#define TABLE_MAX_LOAD_NUM 7
#define TABLE_MAX_LOAD_DEN 10
#define TABLE_MIN_CAPACITY 64u

int km_memory_reserve(km_memory *m, uint64_t old_bytes, uint64_t new_bytes)
{
    if (new_bytes > old_bytes && m->cap && m->used - old_bytes + new_bytes > m->cap)
        return KM_ERR_MEMORY_CAP;
    m->used = m->used - old_bytes + new_bytes;
    return KM_OK;
}

void km_memory_release(km_memory *m, uint64_t bytes)
{
    m->used -= bytes;
}

static uint32_t log2_u64(uint64_t x)
{
    return 63u - (uint32_t)__builtin_clzll(x);
}

static uint64_t table_slot_bytes(const km_table *t, uint64_t capacity, int with_meta)
{
    return capacity * (sizeof(km_slot) + (with_meta ? sizeof(km_block_meta) : 0) + t->aux_bytes);
}

static uint64_t pool_bytes(const km_table *t, uint64_t pool_capacity)
{
    return pool_capacity * ((uint64_t)t->words_per_set * sizeof(uint64_t) + sizeof(uint32_t));
}

/* Slot arrays are probed at random: back large ones with transparent huge pages (one TLB entry
 * per 2 MiB instead of per 4 KiB; a dependent random read on a 128 MiB table measured 240 ns with
 * huge pages against 331 ns without on the development machine). Best effort: without THP this is
 * an ordinary aligned allocation. */
#define TABLE_HUGE_PAGE (UINT64_C(2) << 20)
static km_slot *slots_alloc(uint64_t capacity)
{
    uint64_t bytes = capacity * sizeof(km_slot);
    if (bytes < TABLE_HUGE_PAGE)
        return aligned_alloc(64, bytes);
    void *p = NULL;
    if (posix_memalign(&p, TABLE_HUGE_PAGE, bytes) != 0)
        return NULL;
#ifdef MADV_HUGEPAGE
    madvise(p, bytes, MADV_HUGEPAGE);
#endif
    return p;
}

static void mark_dirty_slot(km_table *t, uint64_t slot)
{
    if (!t->track_dirty || t->layout_changed)
        return;
    if (t->n_dirty_slots == t->dirty_slots_capacity) {
        size_t cap = t->dirty_slots_capacity ? t->dirty_slots_capacity * 2 : 1024;
        uint64_t *grown = realloc(t->dirty_slots, cap * sizeof *grown);
        if (!grown) { /* cannot track: the replica re-uploads everything instead */
            t->layout_changed = 1;
            return;
        }
        t->dirty_slots = grown;
        t->dirty_slots_capacity = cap;
    }
    t->dirty_slots[t->n_dirty_slots++] = slot;
}

static void mark_dirty_set(km_table *t, uint32_t set)
{
    if (!t->track_dirty || t->layout_changed)
        return;
    if (t->n_dirty_sets == t->dirty_sets_capacity) {
        size_t cap = t->dirty_sets_capacity ? t->dirty_sets_capacity * 2 : 256;
        uint32_t *grown = realloc(t->dirty_sets, cap * sizeof *grown);
        if (!grown) {
            t->layout_changed = 1;
            return;
        }
        t->dirty_sets = grown;
        t->dirty_sets_capacity = cap;
    }
    t->dirty_sets[t->n_dirty_sets++] = set;
}

void km_table_clear_dirty(km_table *t)
{
    t->n_dirty_slots = 0;
    t->n_dirty_sets = 0;
    t->layout_changed = 0;
}

static void init_empty_slots(km_slot *slots, uint64_t capacity)
{
    for (uint64_t i = 0; i < capacity; i++) {
        slots[i].key = KM_KEY_EMPTY;
        for (uint32_t j = 0; j < KM_SLOT_INLINE; j++)
            slots[i].ids[j] = KM_SLOT_ID_EMPTY;
    }
}

/* Move every live key into fresh arrays of new_capacity slots. On failure nothing changes. */
static int table_rehash(km_table *t, uint64_t new_capacity)
{
    int with_meta = t->meta != NULL;
    uint64_t old_bytes = table_slot_bytes(t, t->capacity, with_meta);
    uint64_t new_bytes = table_slot_bytes(t, new_capacity, with_meta);
    int rc = km_memory_reserve(t->memory, old_bytes, new_bytes);
    if (rc)
        return rc;
    km_slot *slots = slots_alloc(new_capacity);
    km_block_meta *meta = with_meta ? calloc(new_capacity, sizeof(km_block_meta)) : NULL;
    uint8_t *aux = t->aux_bytes ? calloc(new_capacity, t->aux_bytes) : NULL;
    if (!slots || (with_meta && !meta) || (t->aux_bytes && !aux)) {
        free(slots);
        free(meta);
        free(aux);
        km_memory_reserve(t->memory, new_bytes, old_bytes);
        return KM_ERR_OUT_OF_MEMORY;
    }
    init_empty_slots(slots, new_capacity);
    uint32_t shift = 64u - log2_u64(new_capacity);
    for (uint64_t i = 0; i < t->capacity; i++) {
        uint64_t key = t->slots[i].key;
        if (key == KM_KEY_EMPTY || key == KM_KEY_TOMBSTONE)
            continue;
        uint64_t j = km_slot_home(key, shift);
        while (slots[j].key != KM_KEY_EMPTY)
            j = (j + 1) & (new_capacity - 1);
        slots[j] = t->slots[i];
        if (with_meta)
            meta[j] = t->meta[i];
        if (aux)
            memcpy(aux + j * t->aux_bytes, km_table_aux(t, i), t->aux_bytes);
    }
    free(t->slots);
    free(t->meta);
    free(t->aux);
    t->slots = slots;
    t->meta = meta;
    t->aux = aux;
    t->capacity = new_capacity;
    t->shift = shift;
    t->tombstones = 0;
    t->layout_changed = 1;
    t->n_dirty_slots = 0;
    return KM_OK;
}

static int over_load(uint64_t used, uint64_t capacity)
{
    return used * TABLE_MAX_LOAD_DEN > capacity * TABLE_MAX_LOAD_NUM;
}

/* Smallest power-of-two capacity that holds `keys` under the maximum load. */
static uint64_t capacity_for(uint64_t keys)
{
    uint64_t capacity = TABLE_MIN_CAPACITY;
    while (over_load(keys, capacity))
        capacity *= 2;
    return capacity;
}

int km_table_init(km_table *t, uint64_t initial_keys, uint32_t max_workers, int with_meta,
                  uint32_t aux_bytes, km_memory *memory)
{
    memset(t, 0, sizeof *t);
    t->memory = memory;
    t->words_per_set = (max_workers + 63u) / 64u;
    t->aux_bytes = aux_bytes;
    uint64_t capacity = capacity_for(initial_keys);
    uint64_t bytes = table_slot_bytes(t, capacity, with_meta);
    int rc = km_memory_reserve(memory, 0, bytes);
    if (rc)
        return rc;
    t->slots = slots_alloc(capacity);
    t->meta = with_meta ? calloc(capacity, sizeof(km_block_meta)) : NULL;
    t->aux = aux_bytes ? calloc(capacity, aux_bytes) : NULL;
    if (!t->slots || (with_meta && !t->meta) || (aux_bytes && !t->aux)) {
        free(t->slots);
        free(t->meta);
        free(t->aux);
        km_memory_release(memory, bytes);
        memset(t, 0, sizeof *t);
        return KM_ERR_OUT_OF_MEMORY;
    }
    init_empty_slots(t->slots, capacity);
    t->capacity = capacity;
    t->shift = 64u - log2_u64(capacity);
    return KM_OK;
}

void km_table_free(km_table *t)
{
    if (!t->slots)
        return;
    km_memory_release(t->memory, table_slot_bytes(t, t->capacity, t->meta != NULL));
    km_memory_release(t->memory, pool_bytes(t, t->pool_capacity));
    free(t->slots);
    free(t->meta);
    free(t->aux);
    free(t->pool);
    free(t->pool_free);
    free(t->dirty_slots);
    free(t->dirty_sets);
    memset(t, 0, sizeof *t);
}

uint64_t km_table_find(const km_table *t, uint64_t key)
{
    km_table_view v = km_table_get_view(t);
    return km_view_find(&v, key);
}

int km_table_insert_grows(const km_table *t)
{
    return over_load(t->live + t->tombstones + 1, t->capacity);
}

int km_table_reserve(km_table *t, uint64_t extra)
{
    if (!over_load(t->live + t->tombstones + extra, t->capacity))
        return KM_OK;
    /* Mostly live keys: at least double, so growth is amortised and the load drops to <= 35%.
     * Mostly tombstones: rehash at the same capacity to purge them. Never shrink here. */
    uint64_t capacity = capacity_for(t->live + extra);
    if ((t->live + extra) * 2 > t->capacity && capacity < t->capacity * 2)
        capacity = t->capacity * 2;
    if (capacity < t->capacity)
        capacity = t->capacity;
    return table_rehash(t, capacity);
}

int km_table_insert(km_table *t, uint64_t key, int allow_grow, uint64_t *slot_out)
{
    if (allow_grow) {
        int rc = km_table_reserve(t, 1);
        if (rc)
            return rc;
    }
    uint64_t i = km_slot_home(key, t->shift);
    while (t->slots[i].key != KM_KEY_EMPTY && t->slots[i].key != KM_KEY_TOMBSTONE)
        i = (i + 1) & (t->capacity - 1);
    if (t->slots[i].key == KM_KEY_TOMBSTONE)
        t->tombstones--;
    t->slots[i].key = key;
    for (uint32_t j = 0; j < KM_SLOT_INLINE; j++)
        t->slots[i].ids[j] = KM_SLOT_ID_EMPTY;
    if (t->meta)
        memset(&t->meta[i], 0, sizeof t->meta[i]);
    if (t->aux)
        memset(km_table_aux(t, i), 0, t->aux_bytes);
    t->live++;
    mark_dirty_slot(t, i);
    *slot_out = i;
    return KM_OK;
}

void km_table_erase(km_table *t, uint64_t slot)
{
    /* Backward-shift deletion. Walk the probe run after the hole; a key whose home does not lie
     * in (hole, j] may move back into the hole (it stays reachable from its home), and its old
     * slot becomes the hole. The run ends at the first empty slot. Every slot written is marked
     * dirty, so a device replica patched from the list ends up identical. */
    uint64_t mask = t->capacity - 1;
    uint64_t hole = slot;
    for (uint64_t j = (slot + 1) & mask; t->slots[j].key != KM_KEY_EMPTY; j = (j + 1) & mask) {
        if (!km_probe_may_fill(km_slot_home(t->slots[j].key, t->shift), hole, j, mask))
            continue; /* home lies after the hole: moving the key back would hide it */
        t->slots[hole] = t->slots[j];
        if (t->meta)
            t->meta[hole] = t->meta[j];
        if (t->aux)
            memcpy(km_table_aux(t, hole), km_table_aux(t, j), t->aux_bytes);
        mark_dirty_slot(t, hole);
        hole = j;
    }
    t->slots[hole].key = KM_KEY_EMPTY;
    for (uint32_t j = 0; j < KM_SLOT_INLINE; j++)
        t->slots[hole].ids[j] = KM_SLOT_ID_EMPTY;
    if (t->meta)
        memset(&t->meta[hole], 0, sizeof t->meta[hole]);
    if (t->aux)
        memset(km_table_aux(t, hole), 0, t->aux_bytes);
    t->live--;
    mark_dirty_slot(t, hole);
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
        uint64_t *pool = realloc(t->pool, capacity * t->words_per_set * sizeof(uint64_t));
        if (!pool) {
            km_memory_reserve(t->memory, pool_bytes(t, capacity), pool_bytes(t, t->pool_capacity));
            return KM_ERR_OUT_OF_MEMORY;
        }
        t->pool = pool;
        uint32_t *free_stack = realloc(t->pool_free, capacity * sizeof(uint32_t));
        if (!free_stack) {
            /* pool is already larger, which is harmless; keep accounting at the old size */
            km_memory_reserve(t->memory, pool_bytes(t, capacity), pool_bytes(t, t->pool_capacity));
            return KM_ERR_OUT_OF_MEMORY;
        }
        t->pool_free = free_stack;
        memset(t->pool + (uint64_t)t->pool_capacity * t->words_per_set, 0,
               (capacity - t->pool_capacity) * t->words_per_set * sizeof(uint64_t));
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

int km_table_set_contains(const km_table *t, uint64_t slot, uint32_t worker)
{
    return km_slot_contains(&t->slots[slot], t->pool, t->words_per_set, worker);
}

uint32_t km_table_set_count(const km_table *t, uint64_t slot)
{
    return km_slot_count(&t->slots[slot]);
}

int km_table_set_add(km_table *t, uint64_t slot, uint32_t worker)
{
    km_slot *s = &t->slots[slot];
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
    /* Fifth holder: the set moves to a bitmap. */
    uint32_t set;
    int rc = pool_alloc(t, &set);
    if (rc)
        return rc;
    s = &t->slots[slot];
    uint64_t *bits = pool_bits(t, set);
    for (uint32_t j = 0; j < KM_SLOT_INLINE; j++)
        bits[s->ids[j] >> 6] |= UINT64_C(1) << (s->ids[j] & 63);
    bits[worker >> 6] |= UINT64_C(1) << (worker & 63);
    s->ids[0] = KM_SLOT_ID_SHARED;
    s->ids[1] = (uint16_t)(set & 0xFFFFu);
    s->ids[2] = (uint16_t)(set >> 16);
    s->ids[3] = KM_SLOT_INLINE + 1;
    t->pairs++;
    t->shared_sets++;
    mark_dirty_set(t, set);
    mark_dirty_slot(t, slot);
    return 1;
}

int km_table_set_remove(km_table *t, uint64_t slot, uint32_t worker)
{
    km_slot *s = &t->slots[slot];
    if (km_slot_is_shared(s)) {
        uint32_t set = km_slot_pool_index(s);
        uint64_t *bits = pool_bits(t, set);
        uint64_t bit = UINT64_C(1) << (worker & 63);
        if (!(bits[worker >> 6] & bit))
            return 0;
        bits[worker >> 6] &= ~bit;
        s->ids[3]--;
        t->pairs--;
        if (s->ids[3] <= KM_SLOT_DEMOTE_AT) {
            uint16_t ids[KM_SLOT_INLINE] = {KM_SLOT_ID_EMPTY, KM_SLOT_ID_EMPTY, KM_SLOT_ID_EMPTY,
                                            KM_SLOT_ID_EMPTY};
            uint32_t n = 0;
            for (uint32_t w = 0; w < t->words_per_set; w++)
                for (uint64_t word = bits[w]; word; word &= word - 1)
                    ids[n++] = (uint16_t)(w * 64u + (uint32_t)__builtin_ctzll(word));
            memcpy(s->ids, ids, sizeof ids);
            pool_release(t, set);
            t->shared_sets--;
        }
        mark_dirty_set(t, set);
        mark_dirty_slot(t, slot);
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

uint32_t km_table_set_list(const km_table *t, uint64_t slot, uint32_t *out, uint32_t capacity)
{
    const km_slot *s = &t->slots[slot];
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
    return table_slot_bytes(t, t->capacity, t->meta != NULL) + pool_bytes(t, t->pool_capacity);
}
