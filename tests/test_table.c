/* SPDX-License-Identifier: Apache-2.0 */
/* The host hash table (src/index/host_table.c), the bookkeeping map (src/base/u64_map.c) and the feed's engine-hash
 * map (src/events/engine_hash_map.c) under churn and growth, against a brute-force oracle: backward-shift deletion
 * keeps every key reachable from its home slot, leaves no tombstone, never rehashes a table whose
 * live count stays put, and lists every slot it moves so that a replica patched from the dirty list
 * (what the CUDA backend does) equals the table; incremental growth keeps every key findable while
 * it sits in either array. */
#include <errno.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "events/engine_hash_map.h"
#include "kvmatch/error.h"
#include "kvmatch/index.h"
#include "index/host_table.h"
#include "test_util.h"
#include "base/u64_map.h"
#include "base/zeroed_pages.h"

/* The inverse of km_slot_home's multiplier modulo 2^64 (Newton's iteration), so a test can pick a
 * key's home slot. */
static uint64_t home_multiplier_inverse(void)
{
    const uint64_t g = UINT64_C(0x9E3779B97F4A7C15);
    uint64_t inv = g;
    for (int i = 0; i < 6; i++)
        inv *= 2 - g * inv;
    return inv;
}

/* A key whose home is `home` in a u64map of 2^bits slots (low bits of the product). */
static uint64_t key_with_home(km_rng *r, uint64_t home, uint32_t bits)
{
    for (;;) {
        uint64_t x = (km_rng_next(r) << bits) | home;
        uint64_t key = x * home_multiplier_inverse();
        if (key > KM_KEY_TOMBSTONE)
            return key;
    }
}

/* A key whose home is `home` in a table of `capacity` slots, hashed as km_slot_home (the product
 * scaled onto the capacity): the products mapping to home start at ceil(home * 2^64 / capacity)
 * and span at least floor(2^64 / capacity) values. */
static uint64_t key_with_table_home(km_rng *r, uint64_t home, uint64_t capacity)
{
    unsigned __int128 first = (((unsigned __int128)home << 64) + capacity - 1) / capacity;
    uint64_t span = (uint64_t)(((unsigned __int128)1 << 64) / capacity);
    for (;;) {
        uint64_t x = (uint64_t)first + km_rng_next(r) % span;
        uint64_t key = x * home_multiplier_inverse();
        if (key > KM_KEY_TOMBSTONE) {
            cr_assert_eq(km_slot_home(key, capacity), home);
            return key;
        }
    }
}

/* Half the keys have random homes; half crowd into a few homes, some of them at the table's end,
 * so probe runs are long and wrap around past the last slot. */
static uint64_t clustered_key(km_rng *r, uint64_t capacity)
{
    for (;;) {
        uint64_t key = km_rng_hash(r);
        if (km_rng_percent(r, 50)) {
            uint64_t home = km_rng_percent(r, 30) ? capacity - 1 - km_rng_below(r, 3)
                                                  : km_rng_below(r, 8) * 7u;
            key = key_with_table_home(r, home, capacity);
        }
        if (key > KM_KEY_TOMBSTONE)
            return key;
    }
}

/* Every live key is found at its slot and reachable from home without crossing an empty slot. */
static void check_table(const km_table *t, const uint64_t *keys, const uint8_t *present, size_t n)
{
    uint64_t live = 0;
    for (uint64_t i = 0; i < t->capacity; i++) {
        uint64_t key = t->slots[i].key;
        KM_CHECK(key != KM_KEY_TOMBSTONE, "slot %llu holds a tombstone", (unsigned long long)i);
        if (key == KM_KEY_EMPTY)
            continue;
        live++;
        for (uint64_t j = km_slot_home(key, t->capacity); j != i; j = km_slot_next(j, t->capacity))
            KM_CHECK(t->slots[j].key != KM_KEY_EMPTY, "key at slot %llu unreachable from its home",
                     (unsigned long long)i);
    }
    KM_CHECK(live == t->live, "table counts %llu live keys, holds %llu", (unsigned long long)t->live,
             (unsigned long long)live);
    uint64_t expected = 0;
    for (size_t k = 0; k < n; k++) {
        uint64_t slot = km_table_find(t, keys[k]);
        expected += present[k];
        KM_CHECK((slot != KM_SLOT_NONE) == present[k], "key %zu: found %d, oracle %d", k,
                 slot != KM_SLOT_NONE, present[k]);
        if (present[k]) {
            /* The set travelled with the key: worker k % 50 was added at insert. */
            KM_CHECK(km_table_set_contains(t, slot, (uint32_t)(k % 50)), "key %zu lost its set", k);
            KM_CHECK(km_table_meta(t, slot)->placement == (uint32_t)(keys[k] ^ 0x5555u),
                     "key %zu lost its metadata", k);
        }
    }
    KM_CHECK(expected == t->live, "oracle holds %llu keys, table %llu", (unsigned long long)expected,
             (unsigned long long)t->live);
}

Test(table, backward_shift_churn_matches_oracle, .timeout = 60)
{
    km_rng r;
    km_rng_init(&r, km_test_seed());
    for (int round = 0; round < 4; round++) {
        km_memory memory = {0, 0};
        km_table t;
        cr_assert_eq(km_table_init(&t, 600, 64, 1, 0, &memory), KM_OK);
        size_t n = 1500;
        uint64_t *keys = malloc(n * sizeof *keys);
        uint8_t *present = calloc(n, 1);
        for (size_t k = 0; k < n; k++) {
            /* distinct keys */
            for (;;) {
                keys[k] = clustered_key(&r, t.capacity);
                size_t j = 0;
                while (j < k && keys[j] != keys[k])
                    j++;
                if (j == k)
                    break;
            }
        }
        uint64_t capacity = t.capacity;
        size_t live = 0;
        for (int step = 0; step < 20000; step++) {
            size_t k = km_rng_below(&r, (uint32_t)n);
            if (!present[k] && live < 600) {
                uint64_t slot;
                cr_assert_eq(km_table_insert(&t, keys[k], 1, &slot), KM_OK);
                cr_assert_geq(km_table_set_add(&t, slot, (uint32_t)(k % 50)), 0);
                km_table_meta(&t, slot)->placement = (uint32_t)(keys[k] ^ 0x5555u);
                present[k] = 1;
                live++;
            } else if (present[k]) {
                uint64_t slot = km_table_find(&t, keys[k]);
                cr_assert_neq(slot, KM_SLOT_NONE);
                km_table_set_remove(&t, slot, (uint32_t)(k % 50));
                km_table_erase(&t, slot);
                present[k] = 0;
                live--;
            }
            if (step % 997 == 0)
                check_table(&t, keys, present, n);
        }
        check_table(&t, keys, present, n);
        KM_CHECK(t.tombstones == 0, "tombstones counted: %llu", (unsigned long long)t.tombstones);
        /* At most 600 live keys in a table sized for 600: 20,000 inserts and erases never rehash. */
        KM_CHECK(t.capacity == capacity, "capacity went from %llu to %llu under churn",
                 (unsigned long long)capacity, (unsigned long long)t.capacity);
        free(keys);
        free(present);
        km_table_free(&t);
    }
}

/* A replica starts as a copy of the table and receives only the slots on the dirty list, as the
 * CUDA backend's patch does; after inserts and shifting erases it must equal the table. Batches
 * alternate between 4 operations and 200, whose list (every shifted slot counted) reaches the
 * table's size and is dropped for layout_changed (host_table.c): then the replica takes the table
 * whole, as the backend's upload does. */
Test(table, dirty_list_patches_a_replica_exactly, .timeout = 60)
{
    km_rng r;
    km_rng_init(&r, km_test_seed() ^ 0xD1);
    km_memory memory = {0, 0};
    km_table t;
    cr_assert_eq(km_table_init(&t, 400, 64, 1, 0, &memory), KM_OK);
    t.track_dirty = 1;
    size_t n = 800;
    uint64_t *keys = malloc(n * sizeof *keys);
    uint8_t *present = calloc(n, 1);
    for (size_t k = 0; k < n; k++) {
        keys[k] = clustered_key(&r, t.capacity);
        for (size_t j = 0; j < k; j++)
            if (keys[j] == keys[k])
                keys[k] = 0; /* drop a duplicate */
    }
    km_slot *replica = malloc(t.capacity * sizeof *replica);
    memcpy(replica, t.slots, t.capacity * sizeof *replica);
    const km_slot *slots = t.slots;
    uint64_t capacity = t.capacity;
    int patched = 0, uploaded = 0;
    for (int batch = 0; batch < 50; batch++) {
        km_table_clear_dirty(&t);
        for (int step = 0; step < (batch % 2 ? 200 : 4); step++) {
            size_t k = km_rng_below(&r, (uint32_t)n);
            if (keys[k] <= KM_KEY_TOMBSTONE)
                continue;
            if (!present[k] && t.live < 400) {
                uint64_t slot;
                cr_assert_eq(km_table_insert(&t, keys[k], 1, &slot), KM_OK);
                cr_assert_geq(km_table_set_add(&t, slot, (uint32_t)(k % 50)), 0);
                present[k] = 1;
            } else if (present[k]) {
                uint64_t slot = km_table_find(&t, keys[k]);
                km_table_set_remove(&t, slot, (uint32_t)(k % 50));
                km_table_erase(&t, slot);
                present[k] = 0;
            }
        }
        cr_assert(t.slots == slots && t.capacity == capacity,
                  "no reallocation expected at this load");
        cr_assert_leq(t.n_dirty_slots, t.capacity, "the dirty list outgrew the table");
        if (t.layout_changed) {
            memcpy(replica, t.slots, t.capacity * sizeof *replica);
            uploaded++;
            continue;
        }
        patched++;
        for (size_t i = 0; i < t.n_dirty_slots; i++)
            replica[t.dirty_slots[i]] = t.slots[t.dirty_slots[i]];
        KM_CHECK(memcmp(replica, t.slots, t.capacity * sizeof *replica) == 0,
                 "batch %d: replica patched from %zu dirty slots differs from the table", batch,
                 t.n_dirty_slots);
    }
    cr_assert(patched > 0 && uploaded > 0, "%d batches patched, %d uploaded whole", patched,
              uploaded);
    free(replica);
    free(keys);
    free(present);
    km_table_free(&t);
}

/* A table loaded with tombstones (an old snapshot) is purged before anything erases in it. */
Test(table, purge_removes_tombstones_and_keeps_keys, .timeout = 30)
{
    km_memory memory = {0, 0};
    km_table t;
    cr_assert_eq(km_table_init(&t, 100, 64, 0, 0, &memory), KM_OK);
    uint64_t keys[60];
    km_rng r;
    km_rng_init(&r, km_test_seed() ^ 0x70);
    for (int k = 0; k < 60; k++) {
        keys[k] = km_rng_hash(&r);
        uint64_t slot;
        cr_assert_eq(km_table_insert(&t, keys[k], 1, &slot), KM_OK);
        km_table_set_add(&t, slot, (uint32_t)k);
    }
    /* What the old erase left: tombstones in place of the first 20 keys. */
    for (int k = 0; k < 20; k++) {
        uint64_t slot = km_table_find(&t, keys[k]);
        km_table_set_remove(&t, slot, (uint32_t)k);
        t.slots[slot].key = KM_KEY_TOMBSTONE;
        t.live--;
        t.tombstones++;
    }
    cr_assert_eq(km_table_purge_tombstones(&t), KM_OK);
    cr_assert_eq(t.tombstones, 0);
    for (uint64_t i = 0; i < t.capacity; i++)
        cr_assert_neq(t.slots[i].key, KM_KEY_TOMBSTONE);
    for (int k = 0; k < 60; k++) {
        uint64_t slot = km_table_find(&t, keys[k]);
        cr_assert_eq(slot != KM_SLOT_NONE, k >= 20, "key %d", k);
        if (k >= 20)
            cr_assert(km_table_set_contains(&t, slot, (uint32_t)k));
    }
    km_table_free(&t);
}

/* The oracle of the u64map tests: n distinct random keys (the low 20 bits are the key's own
 * index, n <= 2^20), each one's value and whether the map should hold it. */
typedef struct map_oracle {
    uint64_t *keys, *values;
    uint8_t *present;
    size_t n;
} map_oracle;

static map_oracle map_oracle_make(km_rng *r, size_t n)
{
    map_oracle o = {malloc(n * sizeof(uint64_t)), calloc(n, sizeof(uint64_t)), calloc(n, 1), n};
    cr_assert(n <= (1u << 20) && o.keys && o.values && o.present);
    for (size_t k = 0; k < n; k++)
        o.keys[k] = km_u64map_key((km_rng_next(r) & ~UINT64_C(0xFFFFF)) | k);
    return o;
}

static void map_oracle_free(map_oracle *o)
{
    free(o->keys);
    free(o->values);
    free(o->present);
}

Test(u64map, backward_shift_churn_matches_oracle, .timeout = 60)
{
    km_rng r;
    km_rng_init(&r, km_test_seed() ^ 0x64);
    km_memory memory = {0, 0};
    km_u64map m;
    km_u64map_init(&m, &memory);
    map_oracle o = map_oracle_make(&r, 2000);
    size_t n = o.n;
    uint64_t *keys = o.keys, *values = o.values;
    uint8_t *present = o.present;
    cr_assert_eq(km_u64map_reserve(&m, 700), KM_OK);
    uint64_t capacity = m.capacity;
    size_t live = 0;
    for (int step = 0; step < 40000; step++) {
        size_t k = km_rng_below(&r, (uint32_t)n);
        if (!present[k] && live < 700) {
            values[k] = km_rng_next(&r);
            cr_assert_eq(km_u64map_put(&m, keys[k], values[k], 0), KM_OK);
            present[k] = 1;
            live++;
        } else if (present[k]) {
            cr_assert_eq(km_u64map_erase(&m, keys[k]), 1);
            cr_assert_eq(km_u64map_erase(&m, keys[k]), 0, "erased twice");
            present[k] = 0;
            live--;
        }
        if (step % 1999 == 0 || step == 39999) {
            KM_CHECK(m.live == live, "map counts %llu, oracle %zu", (unsigned long long)m.live, live);
            for (size_t j = 0; j < n; j++) {
                uint64_t *v = km_u64map_find(&m, keys[j]);
                KM_CHECK((v != NULL) == present[j], "step %d key %zu: found %d, oracle %d", step, j,
                         v != NULL, present[j]);
                if (v)
                    KM_CHECK(*v == values[j], "key %zu has the wrong value", j);
            }
        }
    }
    KM_CHECK(m.capacity == capacity, "capacity went from %llu to %llu under churn",
             (unsigned long long)capacity, (unsigned long long)m.capacity);
    map_oracle_free(&o);
    km_u64map_free(&m);
}

/* Check the map against the oracle: every key's presence and value, the live count, and that an
 * iteration yields each live entry exactly once. */
static void u64map_check(const km_u64map *m, const uint64_t *keys, const uint64_t *values,
                         const uint8_t *present, size_t n, size_t live, const char *when)
{
    KM_CHECK(m->live == live, "%s: map counts %llu, oracle %zu", when,
             (unsigned long long)m->live, live);
    for (size_t j = 0; j < n; j++) {
        uint64_t *v = km_u64map_find(m, keys[j]);
        KM_CHECK((v != NULL) == present[j], "%s: key %zu found %d, oracle %d", when, j, v != NULL,
                 present[j]);
        if (v)
            KM_CHECK(*v == values[j], "%s: key %zu has the wrong value", when, j);
    }
    size_t seen = 0;
    uint64_t cursor = 0;
    for (km_u64map_entry *e; (e = km_u64map_next(m, &cursor));) {
        size_t k = (size_t)(e->value >> 32); /* the tests store the key's index in the high half */
        KM_CHECK(k < n && keys[k] == e->key && present[k], "%s: iteration yields a stray entry",
                 when);
        seen++;
    }
    KM_CHECK(seen == live, "%s: iteration yields %zu entries, oracle %zu", when, seen, live);
}

/* Large maps grow a bounded number of slots per call: puts, erases and overwrites land while
 * entries sit in either array, and everything stays findable, iterable and counted. */
Test(u64map, incremental_growth_matches_oracle, .timeout = 120)
{
    km_rng r;
    km_rng_init(&r, km_test_seed() ^ 0x6477);
    km_memory memory = {0, 0};
    km_u64map m;
    km_u64map_init(&m, &memory);
    map_oracle o = map_oracle_make(&r, 200000);
    size_t n = o.n;
    uint64_t *keys = o.keys, *values = o.values;
    uint8_t *present = o.present;
    size_t live = 0, growing_steps = 0, checks = 0, growth_age = 0;
    for (size_t step = 0; step < 600000; step++) {
        size_t k = km_rng_below(&r, (uint32_t)n);
        uint32_t op = km_rng_below(&r, 10);
        if (op < 7) { /* put: new or overwrite */
            values[k] = (uint64_t)k << 32 | (uint32_t)km_rng_next(&r);
            cr_assert_eq(km_u64map_put(&m, keys[k], values[k], 1), KM_OK);
            live += !present[k];
            present[k] = 1;
        } else if (op < 9) {
            cr_assert_eq(km_u64map_erase(&m, keys[k]), present[k]);
            live -= present[k];
            present[k] = 0;
        } else { /* a reserved batch, as approximate mode records: puts that may not grow */
            uint32_t batch = 1 + km_rng_below(&r, 64);
            cr_assert_eq(km_u64map_reserve(&m, batch), KM_OK);
            for (uint32_t b = 0; b < batch; b++) {
                size_t j = km_rng_below(&r, (uint32_t)n);
                values[j] = (uint64_t)j << 32 | (uint32_t)km_rng_next(&r);
                cr_assert_eq(km_u64map_put(&m, keys[j], values[j], 0), KM_OK);
                live += !present[j];
                present[j] = 1;
            }
        }
        growing_steps += m.old != NULL;
        growth_age = m.old != NULL ? growth_age + 1 : 0;
        if ((growth_age == 1 || growth_age == 37 || growth_age == 120) && checks < 12) {
            checks++;
            u64map_check(&m, keys, values, present, n, live, "while growing");
        }
        /* The largest map this test builds must grow without a stop-the-world move. */
        KM_CHECK(m.old == NULL || m.old_capacity >= KM_U64MAP_INCREMENTAL_SLOTS,
                 "a small map left mid-growth");
    }
    cr_assert_gt(growing_steps, 1000, "the map never grew incrementally (%zu steps)",
                 growing_steps);
    cr_assert_gt(checks, 2, "only %zu checks landed mid-growth", checks);
    u64map_check(&m, keys, values, present, n, live, "at the end");
    KM_CHECK(memory.used == km_u64map_bytes(&m), "memory accounts %llu bytes, map holds %llu",
             (unsigned long long)memory.used, (unsigned long long)km_u64map_bytes(&m));
    km_u64map_finish_growth(&m);
    u64map_check(&m, keys, values, present, n, live, "after finishing");
    km_u64map_free(&m);
    KM_CHECK(memory.used == 0, "%llu bytes still accounted after free",
             (unsigned long long)memory.used);
    map_oracle_free(&o);
}

/* The contract approximate mode relies on: after a reserve, pointers found stay valid across
 * non-growing puts, even mid-growth, and no call moves more than its share of the old array. */
Test(u64map, reserved_pointers_survive_non_growing_puts, .timeout = 60)
{
    km_memory memory = {0, 0};
    km_u64map m;
    km_u64map_init(&m, &memory);
    uint64_t next_key = 2;
    while (m.old == NULL) { /* fill until an incremental growth starts */
        cr_assert_eq(km_u64map_put(&m, next_key, next_key, 1), KM_OK);
        next_key++;
    }
    uint64_t old_left = m.old_capacity - m.migrated;
    cr_assert_gt(old_left, 1024, "the growth moved %llu slots at once",
                 (unsigned long long)(m.old_capacity - old_left));
    cr_assert_eq(km_u64map_reserve(&m, 32), KM_OK);
    cr_assert_leq(old_left - (m.old_capacity - m.migrated), 1024,
                  "one reserve of 32 moved more than max(16 * 32, 1024) slots");
    uint64_t *found[16];
    for (int i = 0; i < 16; i++) { /* the oldest keys: some still in the old array */
        found[i] = km_u64map_find(&m, (uint64_t)(2 + i * 97));
        cr_assert_not_null(found[i]);
    }
    for (int i = 0; i < 32; i++)
        cr_assert_eq(km_u64map_put(&m, next_key + (uint64_t)i, 7, 0), KM_OK);
    for (int i = 0; i < 16; i++) {
        *found[i] = UINT64_C(0xABC) + (uint64_t)i;
        uint64_t *again = km_u64map_find(&m, (uint64_t)(2 + i * 97));
        cr_assert(again == found[i] && *again == UINT64_C(0xABC) + (uint64_t)i,
                  "pointer %d went stale", i);
    }
    km_u64map_free(&m);
}

/* A map whose growth started and that then only loses keys still finishes moving them: every
 * erase moves a share (otherwise it would keep both arrays, and probe both on every miss). */
Test(u64map, erases_alone_finish_a_growth, .timeout = 60)
{
    km_memory memory = {0, 0};
    km_u64map m;
    km_u64map_init(&m, &memory);
    uint64_t next_key = 2;
    while (m.old == NULL) {
        cr_assert_eq(km_u64map_put(&m, next_key, next_key, 1), KM_OK);
        next_key++;
    }
    uint64_t erased = 0;
    for (uint64_t k = 2; k < next_key && m.old != NULL; k++, erased++)
        cr_assert_eq(km_u64map_erase(&m, k), 1);
    cr_assert_null(m.old, "still growing after erasing every key");
    cr_assert_leq(erased, m.capacity / 2 / 64 + 1, "%llu erases to finish a move of %llu slots",
                  (unsigned long long)erased, (unsigned long long)(m.capacity / 2));
    for (uint64_t k = 2; k < next_key; k++)
        cr_assert_eq(km_u64map_find(&m, k) != NULL, k >= 2 + erased, "key %llu",
                     (unsigned long long)k);
    cr_assert_eq(m.live, next_key - 2 - erased);
    km_u64map_free(&m);
}

static uint32_t log2_of(uint64_t x)
{
    return 63u - (uint32_t)__builtin_clzll(x);
}

/* A probe run crowded at the last slot wraps into the first slots. After a growth has moved the
 * first few slots, its keys beyond them are still in the old array, and a lookup that reaches the
 * end of the old array must go on from `migrated`, not give up (here an erase moves 64 slots, and
 * the run's keys past slot 64 must stay findable). */
Test(u64map, a_run_wrapping_past_the_moved_slots_stays_findable, .timeout = 60)
{
    km_rng r;
    km_rng_init(&r, km_test_seed() ^ 0x3A9);
    km_memory memory = {0, 0};
    km_u64map m;
    km_u64map_init(&m, &memory);
    cr_assert_eq(km_u64map_reserve(&m, 20000), KM_OK);
    uint64_t capacity = m.capacity;
    cr_assert_geq(capacity, KM_U64MAP_INCREMENTAL_SLOTS);
    enum { CROWD = 300 };
    uint64_t crowd[CROWD];
    for (int i = 0; i < CROWD; i++) {
        crowd[i] = km_u64map_key(key_with_home(&r, capacity - 1, log2_of(capacity)));
        cr_assert_eq(km_u64map_put(&m, crowd[i], (uint64_t)i, 1), KM_OK);
    }
    uint64_t filler = 0;
    while (m.old == NULL) { /* fill until the growth starts */
        filler = km_u64map_key(km_rng_hash(&r));
        if (!km_u64map_find(&m, filler))
            cr_assert_eq(km_u64map_put(&m, filler, 0, 1), KM_OK);
    }
    cr_assert_eq(m.old_capacity, capacity);
    cr_assert_eq(km_u64map_erase(&m, filler), 1); /* moves the first 64 slots */
    cr_assert(m.migrated > 0 && m.migrated < CROWD, "migrated %llu", (unsigned long long)m.migrated);
    for (int i = 0; i < CROWD; i++) {
        uint64_t *v = km_u64map_find(&m, crowd[i]);
        KM_CHECK(v && *v == (uint64_t)i, "crowded key %d lost mid-growth (migrated %llu)", i,
                 (unsigned long long)m.migrated);
    }
    uint64_t absent = km_u64map_key(key_with_home(&r, capacity - 1, log2_of(capacity)));
    cr_assert_null(km_u64map_find(&m, absent), "an absent key with the crowd's home");
    km_u64map_free(&m);
}

/* The oracle of a table under growth: each key's holders as a bitmap of up to 64 workers (more
 * than KM_SLOT_INLINE, so sets move to the bitmap pool and back) and its metadata. */
typedef struct table_oracle {
    uint64_t *keys;
    uint64_t *holders; /* 0 = absent */
    size_t n;
} table_oracle;

/* Every key agrees with the oracle through km_table_find and through the view the walk reads:
 * presence, holders, metadata; the live and pair counts and the memory accounted agree too. */
/* The metadata the growth test gives key k: chains of 8 keys (k - 1 is k's parent, k % 8 its
 * offset, k / 8 its anchor tag). */
static void chain_meta(const table_oracle *o, size_t k, km_block_meta *m)
{
    km_meta_set(m, k ? o->keys[k - 1] : KM_NO_PARENT, (uint32_t)(k / 8) & 0xFFFFFFu,
                (uint32_t)(k % 8));
}

static void growth_check(const km_table *t, const table_oracle *o, const km_memory *memory,
                         const char *when)
{
    km_table_view v = km_table_get_view(t);
    uint64_t live = 0, pairs = 0;
    uint32_t ids[64];
    for (size_t k = 0; k < o->n; k++) {
        uint64_t slot = km_table_find(t, o->keys[k]);
        uint64_t vslot = km_view_find(&v, o->keys[k]);
        KM_CHECK(slot == vslot, "%s: key %zu: table and view disagree", when, k);
        KM_CHECK((slot != KM_SLOT_NONE) == (o->holders[k] != 0), "%s: key %zu found %d, oracle %d",
                 when, k, slot != KM_SLOT_NONE, o->holders[k] != 0);
        if (slot == KM_SLOT_NONE)
            continue;
        live++;
        KM_CHECK(km_view_slot(&v, vslot) == km_table_slot(t, slot), "%s: key %zu: slot pointers",
                 when, k);
        KM_CHECK(km_table_slot(t, slot)->key == o->keys[k], "%s: key %zu at a wrong slot", when, k);
        uint32_t n = km_table_set_list(t, slot, ids, 64);
        uint64_t got = 0;
        for (uint32_t i = 0; i < n && i < 64; i++)
            got |= UINT64_C(1) << ids[i];
        KM_CHECK(got == o->holders[k], "%s: key %zu holders %llx, oracle %llx", when, k,
                 (unsigned long long)got, (unsigned long long)o->holders[k]);
        pairs += (uint64_t)__builtin_popcountll(o->holders[k]);
        km_block_meta want;
        chain_meta(o, k, &want);
        const km_block_meta *m = km_table_meta(t, slot);
        KM_CHECK(m->placement == want.placement &&
                     km_meta_parent_tag(m) == km_meta_parent_tag(&want) &&
                     km_table_aux(t, slot)[0] == (uint8_t)(o->keys[k] >> 8),
                 "%s: key %zu lost its metadata or aux bytes", when, k);
        /* Its parent, key k - 1, is found by tag wherever either sits, and only while present. */
        uint64_t parent = km_table_find_parent(t, m);
        uint64_t expect = k % 8 == 0 ? KM_SLOT_NONE : km_table_find(t, o->keys[k - 1]);
        KM_CHECK(parent == expect, "%s: key %zu: parent found at %llu, expected %llu", when, k,
                 (unsigned long long)parent, (unsigned long long)expect);
    }
    KM_CHECK(live == t->live && pairs == t->pairs, "%s: table counts %llu keys / %llu pairs, "
             "oracle %llu / %llu", when, (unsigned long long)t->live, (unsigned long long)t->pairs,
             (unsigned long long)live, (unsigned long long)pairs);
    KM_CHECK(memory->used == km_table_bytes(t), "%s: memory accounts %llu bytes, table holds %llu",
             when, (unsigned long long)memory->used, (unsigned long long)km_table_bytes(t));
}

/* Large tables grow a bounded number of slots per insert and erase: holders are added and removed,
 * keys inserted and erased (in either array), while keys sit in both arrays, across several
 * growths, with some probe runs crowded at the end of the table so they wrap. */
Test(table, incremental_growth_matches_oracle, .timeout = 120)
{
    km_rng r;
    km_rng_init(&r, km_test_seed() ^ 0x7AB1E);
    km_memory memory = {0, 0};
    km_table t;
    cr_assert_eq(km_table_init(&t, 14000, 64, 1, 4, &memory), KM_OK);
    cr_assert_geq(t.capacity, KM_TABLE_INCREMENTAL_SLOTS);
    table_oracle o = {malloc(120000 * sizeof(uint64_t)), calloc(120000, sizeof(uint64_t)), 120000};
    cr_assert(o.keys && o.holders);
    /* Random 64-bit keys (a repeat among them is a 1 in 10^9 event); the first 400 crowd into the
     * last three homes, and stay near the end of every grown table (home slots scale with it). */
    for (size_t k = 0; k < o.n; k++)
        o.keys[k] = k < 400 ? key_with_table_home(&r, t.capacity - 1 - k % 3, t.capacity)
                            : km_rng_hash(&r);
    size_t growing_steps = 0, checks = 0, old_erases = 0, growths = 0, growth_age = 0;
    uint64_t capacity = t.capacity;
    for (size_t step = 0; step < 400000; step++) {
        /* Keys arrive faster than they leave, so the table grows about three times. */
        size_t k = km_rng_below(&r, (uint32_t)(step < 300000 ? o.n : o.n / 2));
        uint32_t op = km_rng_below(&r, 10);
        uint64_t slot = km_table_find(&t, o.keys[k]);
        if (op < 7) { /* add a holder, inserting the key if absent */
            uint32_t w = km_rng_below(&r, 8) * (km_rng_percent(&r, 10) ? 8 : 1);
            if (slot == KM_SLOT_NONE) {
                cr_assert_eq(km_table_insert(&t, o.keys[k], 1, &slot), KM_OK);
                cr_assert_lt(slot, t.capacity, "an insert lands in the new array");
                chain_meta(&o, k, km_table_meta(&t, slot));
                km_table_aux(&t, slot)[0] = (uint8_t)(o.keys[k] >> 8);
            }
            cr_assert_geq(km_table_set_add(&t, slot, w), 0);
            o.holders[k] |= UINT64_C(1) << w;
        } else if (slot != KM_SLOT_NONE) { /* remove a holder; erase the key when none is left */
            uint32_t ids[64];
            uint32_t n = km_table_set_list(&t, slot, ids, 64);
            uint32_t w = ids[km_rng_below(&r, n)];
            cr_assert_eq(km_table_set_remove(&t, slot, w), 1);
            o.holders[k] &= ~(UINT64_C(1) << w);
            if (km_table_set_count(&t, slot) == 0) {
                old_erases += slot >= t.capacity;
                km_table_erase(&t, slot);
            }
        }
        if (t.capacity != capacity) {
            growths++;
            capacity = t.capacity;
        }
        growing_steps += t.old_slots != NULL;
        growth_age = t.old_slots ? growth_age + 1 : 0;
        /* Early in each move (the crowd's wrapped run is still partly unmoved), then now and then. */
        if ((growth_age == 2 || growth_age == 9 || (t.old_slots && step % 1500 == 0)) && checks < 60) {
            checks++;
            growth_check(&t, &o, &memory, "while growing");
        }
    }
    cr_assert_geq(growths, 2, "the table grew %zu times", growths);
    cr_assert_gt(checks, 5, "only %zu checks landed mid-growth", checks);
    cr_assert_gt(old_erases, 100, "only %zu keys were erased from an old array", old_erases);
    growth_check(&t, &o, &memory, "at the end");
    km_table_finish_growth(&t);
    cr_assert_null(t.old_slots);
    growth_check(&t, &o, &memory, "after finishing");
    for (uint64_t i = 0; i < t.capacity; i++) /* no tombstone in a table that is not growing */
        KM_CHECK(t.slots[i].key != KM_KEY_TOMBSTONE, "slot %llu holds a tombstone",
                 (unsigned long long)i);
    km_table_free(&t);
    KM_CHECK(memory.used == 0, "%llu bytes still accounted after free",
             (unsigned long long)memory.used);
    free(o.keys);
    free(o.holders);
}

/* A key whose parent tag (km_parent_tag) is `tag`: the product's top bits are the tag. */
static uint64_t key_with_parent_tag(km_rng *r, uint32_t tag)
{
    const uint32_t low_bits = 64u - KM_PARENT_TAG_BITS;
    for (;;) {
        uint64_t x = (uint64_t)tag << low_bits | (km_rng_next(r) & ((UINT64_C(1) << low_bits) - 1));
        uint64_t key = x * home_multiplier_inverse();
        if (key > KM_KEY_TOMBSTONE) {
            cr_assert_eq(km_parent_tag(key), tag);
            return key;
        }
    }
}

static uint64_t insert_placed(km_table *t, uint64_t key, uint64_t parent, uint32_t anchor,
                              uint32_t offset)
{
    uint64_t slot;
    cr_assert_eq(km_table_insert(t, key, 1, &slot), KM_OK);
    cr_assert_geq(km_table_set_add(t, slot, 0), 0);
    km_meta_set(km_table_meta(t, slot), parent, anchor, offset);
    return slot;
}

/* A block's parent is found from the 24-bit tag in its metadata: the one key of that tag placed in
 * the block's segment one offset earlier. A key of the same tag elsewhere (another segment, another
 * offset) is no match; a second one in the same place makes the parent unknown rather than a
 * guess; a parent that is gone is not found. Keys crowd into the tag's home, so the matches sit
 * inside one probe run, some wrapping past the last slot. */
Test(table, a_parent_is_found_by_its_tag_only_when_unique, .timeout = 30)
{
    km_rng r;
    km_rng_init(&r, km_test_seed() ^ 0x9A7E);
    km_memory memory = {0, 0};
    for (int round = 0; round < 200; round++) {
        km_table t;
        cr_assert_eq(km_table_init(&t, 200, 8, 1, 0, &memory), KM_OK);
        /* Half the rounds put the tag's home at the last slot, so its run wraps. */
        const uint32_t tags = 1u << KM_PARENT_TAG_BITS;
        uint32_t tag = round % 2 ? tags - 1 - km_rng_below(&r, 4) : (uint32_t)km_rng_next(&r) % tags;
        const uint32_t anchor = 0xABCDEu, offset = 1 + km_rng_below(&r, 30);
        uint64_t parent = key_with_parent_tag(&r, tag);
        km_block_meta child;
        km_meta_set(&child, parent, anchor, offset);
        cr_assert_eq(km_meta_parent_tag(&child), tag);
        cr_assert_eq(km_table_find_parent(&t, &child), KM_SLOT_NONE, "an empty table");
        /* Strangers first: the same tag at another anchor or offset, and keys of other tags. */
        uint64_t stranger = key_with_parent_tag(&r, tag), elsewhere = key_with_parent_tag(&r, tag);
        insert_placed(&t, stranger, parent, anchor ^ 1u, offset - 1);
        insert_placed(&t, elsewhere, parent, anchor, offset == 1 ? 2 : offset - 2);
        for (int k = 0; k < 20; k++)
            insert_placed(&t, key_with_parent_tag(&r, tag ^ (1u + km_rng_below(&r, 1000))), parent,
                          anchor, offset - 1);
        cr_assert_eq(km_table_find_parent(&t, &child), KM_SLOT_NONE, "only strangers");
        insert_placed(&t, parent, KM_NO_PARENT, anchor, offset - 1);
        uint64_t at = km_table_find_parent(&t, &child);
        cr_assert(at != KM_SLOT_NONE && km_table_slot(&t, at)->key == parent, "round %d", round);
        /* A sibling with the same tag and place: ambiguous, so unknown. */
        uint64_t sibling = key_with_parent_tag(&r, tag);
        insert_placed(&t, sibling, KM_NO_PARENT, anchor, offset - 1);
        cr_assert_eq(km_table_find_parent(&t, &child), KM_SLOT_NONE, "two candidates");
        km_table_set_remove(&t, km_table_find(&t, sibling), 0);
        km_table_erase(&t, km_table_find(&t, sibling));
        at = km_table_find_parent(&t, &child);
        cr_assert(at != KM_SLOT_NONE && km_table_slot(&t, at)->key == parent);
        /* Gone: not found, whatever else holds its tag. */
        km_table_set_remove(&t, at, 0);
        km_table_erase(&t, at);
        cr_assert_eq(km_table_find_parent(&t, &child), KM_SLOT_NONE, "the parent is gone");
        /* A segment start and an orphan have no parent to find. */
        km_block_meta start, orphan;
        km_meta_set(&start, parent, anchor, 0);
        km_meta_set(&orphan, parent, anchor, KM_OFFSET_UNKNOWN);
        cr_assert_eq(km_table_find_parent(&t, &start), KM_SLOT_NONE);
        cr_assert_eq(km_table_find_parent(&t, &orphan), KM_SLOT_NONE);
        km_table_free(&t);
    }
    cr_assert_eq(memory.used, 0);
}

/* ---- the feed's engine-hash map (src/events/engine_hash_map.c) ----------------------------------------------------- */

/* Every key agrees with the oracle (presence, chain, media), and an iteration yields each live
 * entry once. */
static void emap_check(const km_emap *m, const uint64_t *keys, const uint64_t *chains,
                       const uint8_t *media, size_t n, const char *when)
{
    size_t live = 0;
    for (size_t k = 0; k < n; k++) {
        const km_emap_entry *e = km_emap_find(m, keys[k]);
        KM_CHECK((e != NULL) == (media[k] != 0), "%s: key %zu found %d, oracle %d", when, k,
                 e != NULL, media[k] != 0);
        if (!e)
            continue;
        live++;
        KM_CHECK(e->chain == chains[k] && e->media == media[k], "%s: key %zu holds %llx/%u, oracle "
                 "%llx/%u", when, k, (unsigned long long)e->chain, e->media,
                 (unsigned long long)chains[k], media[k]);
    }
    KM_CHECK(m->core.live == live, "%s: map counts %llu, oracle %zu", when, (unsigned long long)m->core.live,
             live);
    size_t seen = 0;
    uint64_t cursor = 0;
    for (const km_emap_entry *e; (e = km_emap_next(m, &cursor));) {
        size_t k = (size_t)(e->chain >> 40); /* the test's chains carry the key's index */
        KM_CHECK(k < n && km_u64map_key(keys[k]) == e->key && media[k], "%s: iteration yields a "
                 "stray entry", when);
        seen++;
    }
    KM_CHECK(seen == live, "%s: iteration yields %zu entries, oracle %zu", when, seen, live);
}

/* As the feed uses it: reserve a message's stores, upsert each (a store of a known hash updates
 * its entry in place, wherever it sits), erase removed ones, across several growths; keys sit in
 * either array and erases hit both. Some keys crowd at the end of the array so runs wrap. */
Test(emap, incremental_growth_matches_oracle, .timeout = 120)
{
    km_rng r;
    km_rng_init(&r, km_test_seed() ^ 0xE3A9);
    km_emap m;
    km_emap_init(&m, false);
    size_t n = 150000;
    uint64_t *keys = malloc(n * sizeof *keys), *chains = calloc(n, sizeof *chains);
    uint8_t *media = calloc(n, 1);
    cr_assert(keys && chains && media);
    for (size_t k = 0; k < n; k++) /* engine hashes: random, 300 crowding into the last home of a
                                    * 32 K-slot array (and of every larger one, by the low bits) */
        keys[k] = k < 300 ? key_with_home(&r, (UINT64_C(1) << 15) - 1, 15) : km_rng_hash(&r);
    size_t growing = 0, checks = 0, old_erases = 0, growth_age = 0;
    for (size_t step = 0; step < 60000; step++) {
        uint32_t batch = 1 + km_rng_below(&r, 24);
        cr_assert_eq(km_emap_reserve(&m, batch), KM_OK);
        /* Keys arrive faster than they leave for most of the run. */
        uint32_t span = step < 45000 ? (uint32_t)n : 20000;
        for (uint32_t b = 0; b < batch; b++) {
            size_t k = km_rng_below(&r, span);
            km_emap_entry *e = km_emap_upsert(&m, keys[k]);
            chains[k] = (uint64_t)k << 40 | km_rng_below(&r, 1u << 30);
            media[k] |= (uint8_t)(1u << km_rng_below(&r, 4));
            e->chain = chains[k];
            e->media = media[k];
        }
        for (uint32_t b = 0; b < batch * (step < 45000 ? 1u : 3u) / 2; b++) {
            size_t k = km_rng_below(&r, span);
            km_emap_entry *e = km_emap_find(&m, keys[k]);
            cr_assert_eq(e != NULL, media[k] != 0, "step %zu key %zu", step, k);
            if (!e)
                continue;
            old_erases += (uintptr_t)e - (uintptr_t)m.core.entries >= m.core.capacity * sizeof *e;
            km_emap_erase(&m, e);
            media[k] = 0;
        }
        growing += m.core.old != NULL;
        growth_age = m.core.old ? growth_age + 1 : 0;
        if ((growth_age == 1 || growth_age == 4 || (m.core.old && step % 700 == 0)) && checks < 40) {
            checks++;
            emap_check(&m, keys, chains, media, n, "while growing");
        }
    }
    cr_assert_gt(growing, 100, "the map never grew incrementally (%zu steps)", growing);
    cr_assert_gt(checks, 5, "only %zu checks landed mid-growth", checks);
    cr_assert_gt(old_erases, 50, "only %zu erases hit the old array", old_erases);
    emap_check(&m, keys, chains, media, n, "at the end");
    km_emap_clear(&m);
    cr_assert(m.core.live == 0 && m.core.old == NULL);
    for (size_t k = 0; k < n; k++)
        media[k] = 0;
    emap_check(&m, keys, chains, media, n, "after clear");
    km_emap_free(&m);
    free(keys);
    free(chains);
    free(media);
}

/* Restoring saved state sizes the map at the densest load a reserve accepts, only when empty. */
Test(emap, size_for_takes_an_empty_map_only, .timeout = 30)
{
    km_emap m;
    km_emap_init(&m, false);
    cr_assert_eq(km_emap_size_for(&m, 1000), KM_OK);
    cr_assert_eq(m.core.capacity, 2048, "1,000 entries at <= 70%% fit 2,048 slots");
    cr_assert_eq(km_emap_reserve(&m, 0), KM_OK);
    km_emap_upsert(&m, 42)->media = 1;
    cr_assert_eq(km_emap_size_for(&m, 10), KM_ERR_INVALID_ARGUMENT);
    cr_assert_not_null(km_emap_find(&m, 42), "a refused size_for keeps the entries");
    km_emap_free(&m);
}

/* km_table_find_vacant finds what km_table_find finds, and the slot it names for an absent key is
 * the one km_table_insert gives it: twin tables, one inserting a key and its holder at the named
 * slot whenever there is one (km_table_insert_vacant), the other always through km_table_insert
 * and km_table_set_add, and removing holders through km_table_set_remove_erase against
 * km_table_set_remove and km_table_erase, stay slot for slot the same, dirty lists included,
 * through churn, crowded and wrapping runs, and incremental growths (when no slot is named). */
Test(table, find_vacant_names_the_slot_an_insert_takes, .timeout = 120)
{
    km_rng r;
    km_rng_init(&r, km_test_seed() ^ 0xFACA7u);
    km_memory memory = {0, 0};
    km_table a, b;
    cr_assert_eq(km_table_init(&a, 14000, 64, 1, 0, &memory), KM_OK);
    cr_assert_eq(km_table_init(&b, 14000, 64, 1, 0, &memory), KM_OK);
    a.track_dirty = b.track_dirty = 1;
    size_t n = 60000;
    uint64_t *keys = malloc(n * sizeof *keys);
    cr_assert(keys);
    for (size_t k = 0; k < n; k++)
        keys[k] = k < 300 ? key_with_table_home(&r, a.capacity - 1 - k % 3, a.capacity)
                          : km_rng_hash(&r);
    size_t named = 0, unnamed = 0, growths = 0;
    uint64_t capacity = a.capacity;
    for (size_t step = 0; step < 200000; step++) {
        size_t k = km_rng_below(&r, (uint32_t)(step < 150000 ? n : n / 3));
        uint64_t vacant;
        uint64_t slot = km_table_find_vacant(&a, keys[k], &vacant);
        cr_assert_eq(slot, km_table_find(&a, keys[k]), "step %zu: find_vacant differs", step);
        cr_assert_eq(slot, km_table_find(&b, keys[k]), "step %zu: the twins differ", step);
        if (slot != KM_SLOT_NONE) {
            cr_assert_eq(vacant, KM_SLOT_NONE);
            /* A second holder now and then; a remove takes one of them, the key with the last. */
            uint32_t w = (uint32_t)(k % 64), other = (w + 1) % 64;
            if (km_rng_percent(&r, 20)) {
                cr_assert_eq(km_table_set_add(&a, slot, other), km_table_set_add(&b, slot, other));
            } else if (km_rng_percent(&r, 50)) {
                uint32_t gone = km_table_set_contains(&a, slot, w) ? w : other;
                int erased = km_table_set_remove_erase(&a, slot, gone);
                cr_assert_eq(km_table_set_remove(&b, slot, gone), 1);
                cr_assert_eq(erased, km_table_set_count(&b, slot) == 0);
                if (erased)
                    km_table_erase(&b, slot);
            }
            continue;
        }
        uint64_t slot_b;
        cr_assert_eq(km_table_insert(&b, keys[k], 1, &slot_b), KM_OK);
        if (vacant != KM_SLOT_NONE) {
            km_table_insert_vacant(&a, keys[k], vacant, (uint32_t)(k % 64));
            cr_assert_eq(vacant, slot_b, "step %zu: the named slot is not the insert's", step);
            cr_assert_eq(km_table_set_add(&b, slot_b, (uint32_t)(k % 64)), 1);
            named++;
        } else {
            uint64_t slot_a;
            cr_assert_eq(km_table_insert(&a, keys[k], 1, &slot_a), KM_OK);
            cr_assert_eq(slot_a, slot_b);
            cr_assert_eq(km_table_set_add(&a, slot_a, (uint32_t)(k % 64)), 1);
            cr_assert_eq(km_table_set_add(&b, slot_b, (uint32_t)(k % 64)), 1);
            unnamed++;
        }
        if (a.capacity != capacity) {
            growths++;
            capacity = a.capacity;
        }
        if (step % 20000 == 0 || step == 199999) {
            cr_assert(a.capacity == b.capacity && a.live == b.live && a.pairs == b.pairs &&
                      (a.old_slots == NULL) == (b.old_slots == NULL) &&
                      a.migrated == b.migrated);
            KM_CHECK(memcmp(a.slots, b.slots, a.capacity * sizeof *a.slots) == 0 &&
                         memcmp(a.meta, b.meta, a.capacity * sizeof *a.meta) == 0,
                     "step %zu: the twins' slots differ", step);
            KM_CHECK(a.layout_changed == b.layout_changed && a.n_dirty_slots == b.n_dirty_slots &&
                         (a.n_dirty_slots == 0 ||
                          memcmp(a.dirty_slots, b.dirty_slots,
                                 a.n_dirty_slots * sizeof *a.dirty_slots) == 0),
                     "step %zu: the twins' dirty lists differ", step);
            km_table_clear_dirty(&a);
            km_table_clear_dirty(&b);
        }
    }
    cr_assert_geq(growths, 2, "the table grew %zu times", growths);
    cr_assert(named > 10000 && unnamed > 1000, "%zu inserts at a named slot, %zu not", named,
              unnamed);
    km_table_free(&a);
    km_table_free(&b);
    free(keys);
}

/* Whether no page of [p, p + bytes) is mapped any more (mincore refuses an unmapped page). */
static bool all_unmapped(const void *p, uint64_t bytes)
{
    long page = sysconf(_SC_PAGESIZE);
    unsigned char vec;
    for (uint64_t off = 0; off < bytes; off += (uint64_t)page) {
        void *at = (void *)((uintptr_t)p + off);
        if (mincore(at, (size_t)page, &vec) == 0 || errno != ENOMEM)
            return false;
    }
    return true;
}

/* A growth gives the whole old array back once its entries have moved: finished at once by
 * km_u64map_finish_growth, or step by step by the puts that follow. */
Test(u64map, a_finished_growth_leaves_no_page_of_the_old_array_mapped, .timeout = 60)
{
    for (int by_puts = 0; by_puts < 2; by_puts++) {
        km_memory memory = {0, 0};
        km_u64map m;
        km_u64map_init(&m, &memory);
        uint64_t key = 2;
        /* a growth from an array of several 2 MiB pieces */
        while (m.old == NULL || m.old_capacity * sizeof(km_u64map_entry) < 3 * KM_PAGES_PIECE) {
            cr_assert_eq(km_u64map_put(&m, key, key, 1), KM_OK);
            key++;
        }
        const void *old = m.old;
        uint64_t bytes = m.old_capacity * sizeof(km_u64map_entry);
        if (by_puts)
            while (m.old != NULL) {
                cr_assert_eq(km_u64map_put(&m, key, key, 1), KM_OK);
                key++;
            }
        else
            km_u64map_finish_growth(&m);
        cr_assert(all_unmapped(old, bytes), "%s: part of the old array of %llu bytes is mapped",
                  by_puts ? "moved by puts" : "finished at once", (unsigned long long)bytes);
        cr_assert_eq(memory.used, km_u64map_bytes(&m), "accounted %llu, held %llu",
                     (unsigned long long)memory.used, (unsigned long long)km_u64map_bytes(&m));
        km_u64map_free(&m);
    }
}

Test(table, a_finished_growth_leaves_no_page_of_the_old_arrays_mapped, .timeout = 60)
{
    for (int by_inserts = 0; by_inserts < 2; by_inserts++) {
        km_memory memory = {0, 0};
        km_table t;
        cr_assert_eq(km_table_init_capacity(&t, UINT64_C(1) << 19, 64, 1, 4, &memory), KM_OK);
        km_rng r;
        km_rng_init(&r, km_test_seed() + (uint64_t)by_inserts);
        uint64_t slot;
        while (t.old_slots == NULL)
            cr_assert_eq(km_table_insert(&t, km_rng_hash(&r) | 2, 1, &slot), KM_OK);
        const void *old[3] = {t.old_slots, t.old_meta, t.old_aux};
        uint64_t bytes[3] = {t.old_capacity * sizeof(km_slot),
                             t.old_capacity * sizeof(km_block_meta), t.old_capacity * t.aux_bytes};
        cr_assert_geq(bytes[0], 3 * KM_PAGES_PIECE, "old slots of %llu bytes",
                      (unsigned long long)bytes[0]);
        if (by_inserts)
            while (t.old_slots != NULL)
                cr_assert_eq(km_table_insert(&t, km_rng_hash(&r) | 2, 1, &slot), KM_OK);
        else
            km_table_finish_growth(&t);
        for (int k = 0; k < 3; k++)
            cr_assert(bytes[k] < KM_PAGES_PIECE || all_unmapped(old[k], bytes[k]),
                      "%s: part of old array %d (%llu bytes) is mapped",
                      by_inserts ? "moved by inserts" : "finished at once", k,
                      (unsigned long long)bytes[k]);
        km_table_free(&t);
    }
}
