/* SPDX-License-Identifier: Apache-2.0 */
/* Approximate mode (include/kvmatch/approx.h): (worker, block) pairs assumed from this instance's
 * own decisions, with TTL expiry and per-worker capacity, turned into index updates.
 *
 * Layout: pairs live in a slab addressed by u32 index (released pairs on a free list through
 * global_next, then a never-used tail, so growing the slab writes nothing). Each worker
 * has a u64map chain hash -> pair index and a coarse copy of the pair's touch time (map_value;
 * chain hashes are never 0 or 1, the map's reserved keys, so the key is the hash itself and
 * lookups are exact). Every pair is on two doubly-linked lists
 * ordered by last touch: the global list (TTL expiry reads its head) and its worker's list
 * (capacity eviction reads its head). A touch moves the pair to the tail of both, unless its
 * recorded touch is less than refresh_ns old and the record evicts nothing: then nothing changes
 * at all.
 *
 * Invariants: last_touch is non-decreasing along both lists (every touch uses the handle's clock,
 * which never goes back); a worker's count equals its list length and its map's size; every
 * mutating call reserves all it may need (slab, map, update buffer) before changing anything, so a
 * failure leaves the handle and the buffer's content as they were. */
#include "kvmatch/approx.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/u64_map.h"
#include "base/array.h"
#include "base/error_detail.h"
#include "base/zeroed_pages.h"

#define NIL UINT32_MAX
#define MAX_PAIRS (NIL - 1u)
/* A map value: the pair's slab index in the low 32 bits, its recorded touch time in units of
 * 2^TOUCH_SHIFT ns (16.8 ms; 32 bits of them wrap after 2.3 years) in the high 32, so most
 * recency checks need no access to the slab. */
#define TOUCH_SHIFT 24u

typedef struct pair {
    uint64_t hash;
    uint64_t last_touch_ns;
    uint32_t worker;
    uint32_t global_prev, global_next;
    uint32_t worker_prev, worker_next;
} pair;

typedef struct worker_state {
    km_u64map map; /* chain hash -> pair index */
    uint32_t head, tail;
    uint64_t count;
    uint64_t capacity; /* 0 = unlimited */
} worker_state;

/* An expired pair waiting to be grouped into per-worker REMOVE updates. */
typedef struct expired_pair {
    uint32_t worker;
    uint64_t hash;
} expired_pair;

struct km_approx {
    km_approx_config cfg;
    km_memory memory; /* for the per-worker maps; no cap */
    pair *slab;
    /* Free slots: the list through global_next (released pairs), then [slab_used, slab_capacity),
     * never used yet, so growing the slab writes nothing into its new part. */
    uint32_t slab_capacity, slab_used, free_head, free_count;
    uint32_t global_head, global_tail;
    worker_state *workers;
    expired_pair *scratch;
    size_t scratch_capacity;
    uint64_t clock;
    bool coarse_touch; /* map values' coarse touch times are usable: see coarse_recency */
    km_approx_stats stats;
    char last_error[256];
};

void km_approx_config_init(km_approx_config *cfg)
{
    if (!cfg)
        return;
    memset(cfg, 0, sizeof *cfg);
    cfg->max_workers = 1024;
    cfg->ttl_ns = UINT64_C(120) * 1000000000u;
    cfg->worker_capacity_blocks = UINT64_C(1) << 20;
    cfg->refresh_ns = KM_APPROX_REFRESH_AUTO;
}

__attribute__((format(printf, 3, 4))) static int approx_fail(km_approx *a, int status,
                                                               const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    km_vstatus_message(a->last_error, sizeof a->last_error, status, fmt, ap);
    va_end(ap);
    return status;
}

const char *km_approx_last_error(const km_approx *a)
{
    return a ? a->last_error : "";
}

int km_approx_create(const km_approx_config *cfg, km_approx **out)
{
    if (!out)
        return KM_ERR_NULL_POINTER;
    *out = NULL;
    km_approx_config c;
    if (cfg)
        c = *cfg;
    else
        km_approx_config_init(&c);
    if (c.refresh_ns == KM_APPROX_REFRESH_AUTO)
        c.refresh_ns = c.ttl_ns / 256;
    if (c.max_workers < 1 || c.max_workers > KM_MAX_WORKERS_LIMIT || c.ttl_ns == 0 ||
        c.refresh_ns >= c.ttl_ns)
        return KM_ERR_INVALID_ARGUMENT;
    km_approx *a = calloc(1, sizeof *a);
    if (!a)
        return KM_ERR_OUT_OF_MEMORY;
    a->cfg = c;
    /* Coarse times help only when refresh_ns spans several units, and are exact only while no
     * pair can be older than their 2^32-unit wrap (TTL expiry bounds the age, for callers that
     * expire). */
    a->coarse_touch = c.refresh_ns >= (UINT64_C(4) << TOUCH_SHIFT) &&
                      c.ttl_ns < (UINT64_C(1) << (31 + TOUCH_SHIFT));
    a->free_head = NIL;
    a->global_head = a->global_tail = NIL;
    a->workers = calloc(c.max_workers, sizeof *a->workers);
    if (!a->workers) {
        free(a);
        return KM_ERR_OUT_OF_MEMORY;
    }
    for (uint32_t w = 0; w < c.max_workers; w++) {
        km_u64map_init(&a->workers[w].map, &a->memory);
        a->workers[w].head = a->workers[w].tail = NIL;
        a->workers[w].capacity = c.worker_capacity_blocks;
    }
    *out = a;
    return KM_OK;
}

void km_approx_destroy(km_approx *a)
{
    if (!a)
        return;
    for (uint32_t w = 0; w < a->cfg.max_workers; w++)
        km_u64map_free(&a->workers[w].map);
    free(a->workers);
    km_pages_free(a->slab, (uint64_t)a->slab_capacity * sizeof *a->slab);
    free(a->scratch);
    free(a);
}

/* ---- the update buffer ---------------------------------------------------------------------- */

void km_approx_updates_init(km_approx_updates *buf)
{
    if (buf)
        memset(buf, 0, sizeof *buf);
}

void km_approx_updates_clear(km_approx_updates *buf)
{
    if (buf) {
        buf->n_updates = 0;
        buf->n_hashes = 0;
    }
}

void km_approx_updates_free(km_approx_updates *buf)
{
    if (!buf)
        return;
    free(buf->updates);
    free(buf->hashes);
    free(buf->offsets);
    memset(buf, 0, sizeof *buf);
}

/* Room for `updates` more updates and `hashes` more hashes, without changing the content. */
static int buf_reserve(km_approx_updates *buf, size_t updates, size_t hashes)
{
    /* updates and offsets share updates_capacity, which moves once both have grown (an updates
     * array larger than its capacity is harmless). */
    size_t updates_capacity = buf->updates_capacity, offsets_capacity = updates_capacity;
    if (KM_ARRAY_GROW(buf->updates, updates_capacity, buf->n_updates + updates, 16) ||
        KM_ARRAY_GROW(buf->offsets, offsets_capacity, buf->n_updates + updates, 16))
        return KM_ERR_OUT_OF_MEMORY;
    buf->updates_capacity = updates_capacity;
    if (KM_ARRAY_GROW(buf->hashes, buf->hashes_capacity, buf->n_hashes + hashes, 256))
        return KM_ERR_OUT_OF_MEMORY;
    /* The hash storage may have moved: re-point every update. */
    for (size_t i = 0; i < buf->n_updates; i++)
        buf->updates[i].hashes = buf->updates[i].n_hashes ? buf->hashes + buf->offsets[i] : NULL;
    return KM_OK;
}

/* Open an update whose hashes will be appended with buf_push_hash (room already reserved). */
static km_update *buf_begin_update(km_approx_updates *buf, km_update_kind kind, uint32_t worker)
{
    km_update *u = &buf->updates[buf->n_updates];
    buf->offsets[buf->n_updates] = buf->n_hashes;
    buf->n_updates++;
    memset(u, 0, sizeof *u);
    u->kind = kind;
    u->worker = worker;
    u->parent = KM_NO_PARENT;
    u->hashes = NULL;
    return u;
}

static void buf_push_hash(km_approx_updates *buf, km_update *u, uint64_t hash)
{
    if (!u->hashes)
        u->hashes = buf->hashes + buf->n_hashes;
    buf->hashes[buf->n_hashes++] = hash;
    u->n_hashes++;
}

/* ---- pairs and lists ------------------------------------------------------------------------ */

static uint64_t advance_clock(km_approx *a, uint64_t now_ns)
{
    if (now_ns > a->clock)
        a->clock = now_ns;
    return a->clock;
}

static int reserve_pairs(km_approx *a, size_t n)
{
    if (a->free_count >= n)
        return KM_OK;
    uint64_t need = (uint64_t)a->slab_capacity + (n - a->free_count);
    if (need > MAX_PAIRS)
        return KM_ERR_TOO_LARGE;
    uint64_t capacity = a->slab_capacity ? a->slab_capacity : 256;
    while (capacity < need)
        capacity *= 2;
    if (capacity > MAX_PAIRS)
        capacity = MAX_PAIRS;
    /* Pages, not copies: the grown slab keeps the old one's pages, so a growth costs the same at
     * any size. */
    pair *slab = km_pages_grow(a->slab, (uint64_t)a->slab_capacity * sizeof *slab,
                               capacity * sizeof *slab);
    if (!slab)
        return KM_ERR_OUT_OF_MEMORY;
    a->slab = slab;
    /* The new slots stay untouched until used: linking them all into the free list here would write
     * every page of the grown part at once, a pause as long as the growth is large
     * (docs/BENCHMARKS.md, "Growth"). */
    a->free_count += (uint32_t)capacity - a->slab_capacity;
    a->slab_capacity = (uint32_t)capacity;
    return KM_OK;
}

static void global_unlink(km_approx *a, uint32_t i)
{
    pair *p = &a->slab[i];
    if (p->global_prev != NIL)
        a->slab[p->global_prev].global_next = p->global_next;
    else
        a->global_head = p->global_next;
    if (p->global_next != NIL)
        a->slab[p->global_next].global_prev = p->global_prev;
    else
        a->global_tail = p->global_prev;
}

static void global_append(km_approx *a, uint32_t i)
{
    pair *p = &a->slab[i];
    p->global_prev = a->global_tail;
    p->global_next = NIL;
    if (a->global_tail != NIL)
        a->slab[a->global_tail].global_next = i;
    else
        a->global_head = i;
    a->global_tail = i;
}

static void worker_unlink(km_approx *a, uint32_t i)
{
    pair *p = &a->slab[i];
    worker_state *w = &a->workers[p->worker];
    if (p->worker_prev != NIL)
        a->slab[p->worker_prev].worker_next = p->worker_next;
    else
        w->head = p->worker_next;
    if (p->worker_next != NIL)
        a->slab[p->worker_next].worker_prev = p->worker_prev;
    else
        w->tail = p->worker_prev;
}

static void worker_append(km_approx *a, uint32_t i)
{
    pair *p = &a->slab[i];
    worker_state *w = &a->workers[p->worker];
    p->worker_prev = w->tail;
    p->worker_next = NIL;
    if (w->tail != NIL)
        a->slab[w->tail].worker_next = i;
    else
        w->head = i;
    w->tail = i;
}

/* Forget pair i (the caller emits its REMOVE or CLEAR). */
static void drop_pair(km_approx *a, uint32_t i, bool erase_from_map)
{
    pair *p = &a->slab[i];
    worker_state *w = &a->workers[p->worker];
    if (erase_from_map)
        km_u64map_erase(&w->map, p->hash);
    global_unlink(a, i);
    worker_unlink(a, i);
    w->count--;
    a->stats.pairs--;
    p->global_next = a->free_head;
    a->free_head = i;
    a->free_count++;
}

/* Evict the worker's least recently touched pairs until it fits its capacity, appending one
 * REMOVE (room for w->count - capacity hashes and one update must be reserved). */
static void evict_over_capacity(km_approx *a, uint32_t worker, km_approx_updates *buf)
{
    worker_state *w = &a->workers[worker];
    if (!w->capacity || w->count <= w->capacity)
        return;
    km_update *u = buf_begin_update(buf, KM_UPDATE_REMOVE, worker);
    while (w->count > w->capacity) {
        uint32_t i = w->head;
        buf_push_hash(buf, u, a->slab[i].hash);
        drop_pair(a, i, true);
        a->stats.evicted_pairs++;
    }
}

/* ---- learning and forgetting ---------------------------------------------------------------- */


static inline uint64_t map_value(uint32_t i, uint64_t touch_ns)
{
    return (uint64_t)i | ((touch_ns >> TOUCH_SHIFT) << 32);
}

/* -1: touched less than refresh_ns ago for certain; 1: for certain not; 0: cannot tell from the
 * coarse time (the exact one is in the slab). With du = the coarse age in units U, the exact age
 * lies in ((du - 1) U, (du + 1) U). */
static inline int coarse_recency(const km_approx *a, uint64_t value, uint64_t now)
{
    if (!a->coarse_touch)
        return 0;
    uint32_t du = (uint32_t)(now >> TOUCH_SHIFT) - (uint32_t)(value >> 32);
    if (((uint64_t)du + 1) << TOUCH_SHIFT <= a->cfg.refresh_ns)
        return -1;
    if (du >= 1 && ((uint64_t)du - 1) << TOUCH_SHIFT >= a->cfg.refresh_ns)
        return 1;
    return 0;
}

/* The exact rule: a touch less than refresh_ns after the recorded one is not recorded. */
static inline bool touch_is_recent(const km_approx *a, uint64_t value, uint32_t i, uint64_t now)
{
    int c = coarse_recency(a, value, now);
    return c ? c < 0 : now - a->slab[i].last_touch_ns < a->cfg.refresh_ns;
}

/* Look a hash up ahead of its turn and start loading its pair, unless the touch will be skipped. */
static inline uint64_t *find_ahead(const km_approx *a, worker_state *w, uint64_t hash, uint64_t now)
{
    uint64_t *v = km_u64map_find(&w->map, hash);
    if (v && coarse_recency(a, *v, now) >= 0)
        __builtin_prefetch(&a->slab[(uint32_t)*v]);
    return v;
}

int km_approx_record(km_approx *a, uint32_t worker, const uint64_t *hashes, size_t n,
                     uint64_t now_ns, km_approx_updates *buf)
{
    if (!a)
        return KM_ERR_NULL_POINTER;
    a->last_error[0] = '\0';
    if (!buf || (n && !hashes))
        return approx_fail(a, KM_ERR_NULL_POINTER, "update buffer or hashes is NULL");
    if (worker >= a->cfg.max_workers)
        return approx_fail(a, KM_ERR_WORKER_RANGE, "worker %" PRIu32 " out of range (max_workers %" PRIu32 ")",
                           worker, a->cfg.max_workers);
    for (size_t i = 0; i < n; i++)
        if (hashes[i] < 2)
            return approx_fail(a, KM_ERR_INVALID_ARGUMENT,
                               "hash %zu is %" PRIu64 ", a reserved value no chain hash takes", i,
                               hashes[i]);
    if (n == 0)
        return KM_OK;
    worker_state *w = &a->workers[worker];
    size_t keep = n;
    if (w->capacity && keep > w->capacity)
        keep = (size_t)w->capacity;

    /* Reserve the worst case: every kept hash new, one STORE plus one REMOVE of as many. */
    int rc = reserve_pairs(a, keep);
    if (rc == KM_OK)
        rc = km_u64map_reserve(&w->map, keep);
    if (rc == KM_OK)
        rc = buf_reserve(buf, 2, 2 * keep);
    if (rc)
        return approx_fail(a, rc, "cannot reserve room for %zu blocks of worker %" PRIu32, keep, worker);

    uint64_t now = advance_clock(a, now_ns);
    uint64_t added = 0;
    /* A record that may evict applies every touch: a pair it left in place could sit at the head
     * of the eviction order and go in this very record's eviction, block 0 before the deeper
     * blocks it touched after it. Without eviction (the worker's pairs and this record's fit)
     * a touch within refresh_ns changes nothing. */
    bool may_evict = w->capacity && w->count + keep > w->capacity;
    /* The maps and the slab are larger than the caches and every hash lands somewhere random:
     * load the map entry RECORD_AHEAD hashes ahead, and the pair (and so its list neighbours'
     * indices) half as far ahead, so the misses of several blocks overlap. */
    enum { RECORD_AHEAD = 8, FIND_AHEAD = RECORD_AHEAD / 2 };
    /* Each map entry is looked up once, FIND_AHEAD blocks ahead of its use (the ring); the pair is
     * prefetched then too, unless the entry's coarse touch time already says the touch will be
     * skipped. Inserts in between move no entry (room is reserved: no rehash), so a pointer found
     * ahead stays valid; an entry not found ahead is looked up again (a duplicate hash in the same
     * record may have inserted it since). */
    uint64_t *ring[FIND_AHEAD] = {NULL};
    for (size_t k = keep; k-- > 0 && keep - k <= RECORD_AHEAD;)
        km_u64map_prefetch(&w->map, hashes[k]);
    for (size_t k = keep; k-- > 0 && keep - k <= FIND_AHEAD;)
        ring[k % FIND_AHEAD] = find_ahead(a, w, hashes[k], now);
    for (size_t k = keep; k-- > 0;) { /* deepest first, so block 0 ends up the newest */
        if (k >= RECORD_AHEAD)
            km_u64map_prefetch(&w->map, hashes[k - RECORD_AHEAD]);
        uint64_t *found = ring[k % FIND_AHEAD];
        if (k >= FIND_AHEAD)
            ring[k % FIND_AHEAD] = find_ahead(a, w, hashes[k - FIND_AHEAD], now);
        if (!found)
            found = km_u64map_find(&w->map, hashes[k]);
        uint32_t i;
        if (found) {
            i = (uint32_t)*found;
            if (!may_evict && touch_is_recent(a, *found, i, now)) {
                a->stats.recent_pairs++; /* recorded recently enough: left in place */
                continue;
            }
            *found = map_value(i, now);
            global_unlink(a, i);
            worker_unlink(a, i);
            a->stats.refreshed_pairs++;
        } else {
            if (a->free_head != NIL) {
                i = a->free_head;
                a->free_head = a->slab[i].global_next;
            } else {
                i = a->slab_used++;
            }
            a->free_count--;
            a->slab[i].hash = hashes[k];
            a->slab[i].worker = worker;
            km_u64map_put(&w->map, hashes[k], map_value(i, now), 0); /* room reserved: cannot fail */
            w->count++;
            a->stats.pairs++;
            a->stats.stored_pairs++;
            added++;
        }
        a->slab[i].last_touch_ns = now;
        global_append(a, i);
        worker_append(a, i);
    }
    a->stats.records++;
    if (keep < n)
        a->stats.truncated_records++;
    if (added) {
        km_update *u = buf_begin_update(buf, KM_UPDATE_STORE, worker);
        for (size_t k = 0; k < keep; k++)
            buf_push_hash(buf, u, hashes[k]);
    }
    evict_over_capacity(a, worker, buf);
    return KM_OK;
}

static int compare_expired(const void *x, const void *y)
{
    const expired_pair *a = x, *b = y;
    if (a->worker != b->worker)
        return a->worker < b->worker ? -1 : 1;
    return (a->hash > b->hash) - (a->hash < b->hash);
}

static bool is_expired(const km_approx *a, uint32_t i, uint64_t now)
{
    return now - a->slab[i].last_touch_ns >= a->cfg.ttl_ns;
}

int km_approx_expire(km_approx *a, uint64_t now_ns, km_approx_updates *buf, size_t *n_expired)
{
    if (n_expired)
        *n_expired = 0;
    if (!a)
        return KM_ERR_NULL_POINTER;
    a->last_error[0] = '\0';
    if (!buf)
        return approx_fail(a, KM_ERR_NULL_POINTER, "update buffer is NULL");
    uint64_t now = advance_clock(a, now_ns);
    size_t k = 0;
    uint32_t distinct_workers = 0, last_worker = NIL;
    for (uint32_t i = a->global_head; i != NIL && is_expired(a, i, now); i = a->slab[i].global_next)
        k++;
    if (k == 0)
        return KM_OK;
    if (KM_ARRAY_GROW(a->scratch, a->scratch_capacity, k, 0))
        return approx_fail(a, KM_ERR_OUT_OF_MEMORY, "cannot list %zu expired blocks", k);
    size_t j = 0;
    for (uint32_t i = a->global_head; j < k; i = a->slab[i].global_next, j++) {
        a->scratch[j].worker = a->slab[i].worker;
        a->scratch[j].hash = a->slab[i].hash;
    }
    qsort(a->scratch, k, sizeof *a->scratch, compare_expired);
    for (j = 0; j < k; j++)
        if (a->scratch[j].worker != last_worker) {
            distinct_workers++;
            last_worker = a->scratch[j].worker;
        }
    int rc = buf_reserve(buf, distinct_workers, k);
    if (rc)
        return approx_fail(a, rc, "cannot append %zu expired blocks to the update buffer", k);

    for (j = 0; j < k; j++)
        drop_pair(a, a->global_head, true);
    km_update *u = NULL;
    for (j = 0; j < k; j++) {
        if (!u || u->worker != a->scratch[j].worker)
            u = buf_begin_update(buf, KM_UPDATE_REMOVE, a->scratch[j].worker);
        buf_push_hash(buf, u, a->scratch[j].hash);
    }
    a->stats.expired_pairs += k;
    if (n_expired)
        *n_expired = k;
    return KM_OK;
}

uint64_t km_approx_next_expiry(const km_approx *a)
{
    if (!a || a->global_head == NIL)
        return UINT64_MAX;
    uint64_t t = a->slab[a->global_head].last_touch_ns;
    return t > UINT64_MAX - a->cfg.ttl_ns ? UINT64_MAX : t + a->cfg.ttl_ns;
}

int km_approx_clear_worker(km_approx *a, uint32_t worker, km_approx_updates *buf)
{
    if (!a)
        return KM_ERR_NULL_POINTER;
    a->last_error[0] = '\0';
    if (!buf)
        return approx_fail(a, KM_ERR_NULL_POINTER, "update buffer is NULL");
    if (worker >= a->cfg.max_workers)
        return approx_fail(a, KM_ERR_WORKER_RANGE, "worker %" PRIu32 " out of range (max_workers %" PRIu32 ")",
                           worker, a->cfg.max_workers);
    worker_state *w = &a->workers[worker];
    int rc = buf_reserve(buf, 1, w->count);
    if (rc)
        return approx_fail(a, rc, "cannot append to the update buffer");
    a->stats.cleared_pairs += w->count;
    /* The clear names every pair assumed, so the index takes out exactly those. */
    km_update *u = buf_begin_update(buf, KM_UPDATE_CLEAR_WORKER, worker);
    while (w->head != NIL) {
        buf_push_hash(buf, u, a->slab[w->head].hash);
        drop_pair(a, w->head, false);
    }
    km_u64map_free(&w->map); /* release the memory of a worker that may never come back */
    return KM_OK;
}

int km_approx_set_worker_capacity(km_approx *a, uint32_t worker, uint64_t capacity_blocks,
                                  km_approx_updates *buf)
{
    if (!a)
        return KM_ERR_NULL_POINTER;
    a->last_error[0] = '\0';
    if (!buf)
        return approx_fail(a, KM_ERR_NULL_POINTER, "update buffer is NULL");
    if (worker >= a->cfg.max_workers)
        return approx_fail(a, KM_ERR_WORKER_RANGE, "worker %" PRIu32 " out of range (max_workers %" PRIu32 ")",
                           worker, a->cfg.max_workers);
    worker_state *w = &a->workers[worker];
    if (capacity_blocks && w->count > capacity_blocks) {
        int rc = buf_reserve(buf, 1, (size_t)(w->count - capacity_blocks));
        if (rc)
            return approx_fail(a, rc, "cannot append evictions to the update buffer");
    }
    w->capacity = capacity_blocks;
    evict_over_capacity(a, worker, buf);
    return KM_OK;
}

/* ---- inspection ----------------------------------------------------------------------------- */

uint64_t km_approx_worker_blocks(const km_approx *a, uint32_t worker)
{
    if (!a || worker >= a->cfg.max_workers)
        return 0;
    return a->workers[worker].count;
}

bool km_approx_holds(const km_approx *a, uint32_t worker, uint64_t hash)
{
    if (!a || worker >= a->cfg.max_workers || hash < 2)
        return false;
    return km_u64map_find(&a->workers[worker].map, hash) != NULL;
}

int km_approx_get_stats(const km_approx *a, km_approx_stats *out)
{
    if (!a || !out)
        return KM_ERR_NULL_POINTER;
    *out = a->stats;
    return KM_OK;
}
