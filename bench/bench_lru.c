/* SPDX-License-Identifier: Apache-2.0 */
/* A fixed-capacity LRU set of 64-bit block keys (bench_lru.h). */
#include "bench_lru.h"

#include <stdlib.h>
#include <string.h>

#define NIL UINT32_MAX

static uint64_t splitmix64(uint64_t x)
{
    x += UINT64_C(0x9E3779B97F4A7C15);
    x = (x ^ (x >> 30)) * UINT64_C(0xBF58476D1CE4E5B9);
    x = (x ^ (x >> 27)) * UINT64_C(0x94D049BB133111EB);
    return x ^ (x >> 31);
}


int km_bench_lru_init(km_bench_lru *l, uint32_t capacity)
{
    memset(l, 0, sizeof *l);
    l->slots = 1;
    while (l->slots < capacity * 2)
        l->slots *= 2;
    l->keys = malloc(capacity * sizeof *l->keys);
    l->prev = malloc(capacity * sizeof *l->prev);
    l->next = malloc(capacity * sizeof *l->next);
    l->slot_key = calloc(l->slots, sizeof *l->slot_key);
    l->slot_node = malloc(l->slots * sizeof *l->slot_node);
    if (!l->keys || !l->prev || !l->next || !l->slot_key || !l->slot_node)
        return -1;
    for (uint32_t i = 0; i < capacity; i++)
        l->next[i] = i + 1 < capacity ? i + 1 : NIL;
    l->free_head = 0;
    l->head = l->tail = NIL;
    return 0;
}

void km_bench_lru_free(km_bench_lru *l)
{
    free(l->keys);
    free(l->prev);
    free(l->next);
    free(l->slot_key);
    free(l->slot_node);
}

static uint32_t lru_slot(const km_bench_lru *l, uint64_t key)
{
    uint32_t i = (uint32_t)(splitmix64(key) & (l->slots - 1));
    while (l->slot_key[i] && l->slot_key[i] != key)
        i = (i + 1) & (l->slots - 1);
    return i;
}

static void unlink_node(km_bench_lru *l, uint32_t n)
{
    if (l->prev[n] != NIL)
        l->next[l->prev[n]] = l->next[n];
    else
        l->head = l->next[n];
    if (l->next[n] != NIL)
        l->prev[l->next[n]] = l->prev[n];
    else
        l->tail = l->prev[n];
}

static void push_front(km_bench_lru *l, uint32_t n)
{
    l->prev[n] = NIL;
    l->next[n] = l->head;
    if (l->head != NIL)
        l->prev[l->head] = n;
    l->head = n;
    if (l->tail == NIL)
        l->tail = n;
}

bool km_bench_lru_touch(km_bench_lru *l, uint64_t key)
{
    uint32_t s = lru_slot(l, key);
    if (!l->slot_key[s])
        return false;
    uint32_t n = l->slot_node[s];
    unlink_node(l, n);
    push_front(l, n);
    return true;
}

/* Remove the least recent key; returns it. */
uint64_t km_bench_lru_evict(km_bench_lru *l)
{
    uint32_t n = l->tail;
    uint64_t key = l->keys[n];
    unlink_node(l, n);
    l->next[n] = l->free_head;
    l->free_head = n;
    l->count--;
    /* backward-shift deletion */
    uint32_t i = lru_slot(l, key);
    l->slot_key[i] = 0;
    uint32_t j = i;
    for (;;) {
        j = (j + 1) & (l->slots - 1);
        if (!l->slot_key[j])
            break;
        uint32_t home = (uint32_t)(splitmix64(l->slot_key[j]) & (l->slots - 1));
        if (((j - home) & (l->slots - 1)) >= ((j - i) & (l->slots - 1))) {
            l->slot_key[i] = l->slot_key[j];
            l->slot_node[i] = l->slot_node[j];
            l->slot_key[j] = 0;
            i = j;
        }
    }
    return key;
}

void km_bench_lru_insert(km_bench_lru *l, uint64_t key)
{
    uint32_t n = l->free_head;
    l->free_head = l->next[n];
    l->keys[n] = key;
    push_front(l, n);
    l->count++;
    uint32_t s = lru_slot(l, key);
    l->slot_key[s] = key;
    l->slot_node[s] = n;
}

