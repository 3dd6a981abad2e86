/* SPDX-License-Identifier: Apache-2.0 */
/* A fixed-capacity LRU set of 64-bit block keys for the benchmarks' simulated engine caches
 * (bench events, bench replay): touch moves a key to the front, evict takes the least recent.
 * Keys must be non-zero. Single-threaded. */
#ifndef KM_BENCH_LRU_H
#define KM_BENCH_LRU_H

#include <stdbool.h>
#include <stdint.h>

typedef struct km_bench_lru {
    uint64_t *keys; /* node -> key */
    uint32_t *prev, *next;
    uint32_t head, tail; /* head = most recent; UINT32_MAX = none */
    uint32_t count, free_head;
    uint64_t *slot_key; /* open addressing: key (0 = empty) */
    uint32_t *slot_node;
    uint32_t slots; /* power of two */
} km_bench_lru;

/* Returns 0, or -1 when out of memory (free it anyway). */
int km_bench_lru_init(km_bench_lru *l, uint32_t capacity);
void km_bench_lru_free(km_bench_lru *l);
/* Present: move to the front and return true. */
bool km_bench_lru_touch(km_bench_lru *l, uint64_t key);
/* Remove and return the least recent key; the set must not be empty. */
uint64_t km_bench_lru_evict(km_bench_lru *l);
/* Add an absent key at the front; the set must not be full. */
void km_bench_lru_insert(km_bench_lru *l, uint64_t key);

#endif
