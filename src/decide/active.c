/* SPDX-License-Identifier: Apache-2.0 */
/* Active work (include/kvmatch/active.h): per-worker load as this instance saw it, from the
 * decision to FINISHED or expiry.
 *
 * Layout: entries live in a slab addressed by u32 index (a free list threads the unused ones). A
 * u64map sends the XXH3 hash of the key to the first entry with that hash; entries with equal
 * hashes chain through hash_next and are told apart by comparing the ids they keep. Each live
 * entry is on two doubly-linked lists: the touch list (all entries, ascending last-touch time; a
 * lifecycle event moves its entry to the tail, so expiry reads from the head) and its worker's list
 * (for km_active_remove_worker).
 *
 * Invariants: for every worker, each load value equals the sum of its live entries' charges
 * (in_flight: 1 each; pending prefill: prefill_pending; decode: decode_blocks), so subtracting an
 * entry's charge never underflows (saturations counts the case anyway); last_touch along the touch
 * list is non-decreasing because every touch uses the handle's clock, which never goes back. */
#include "kvmatch/active.h"
#include "kvmatch/engine_model.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <xxhash.h>

#include "base/u64_map.h"
#include "base/error_detail.h"

#define NIL UINT32_MAX

typedef struct entry {
    uint64_t hash;      /* XXH3 of the key (key_hash) */
    char *ids;          /* "request\0attempt\0", malloc'd; NULL when the slot is free */
    uint32_t request_len, attempt_len;
    uint32_t worker;
    uint32_t hash_next; /* next entry with the same hash; free-list link when free */
    uint32_t touch_prev, touch_next;
    uint32_t worker_prev, worker_next;
    bool dispatched, first_token;
    uint32_t prompt_tokens, predicted_cached_tokens, expected_output_tokens, block_size;
    uint64_t prefill_charged; /* what the entry added to pending prefill (after corrections) */
    uint64_t prefill_pending; /* what it still holds there (0 after FIRST_TOKEN) */
    uint64_t pairs_pending;   /* the attention pairs of that prefill after its cached prefix */
    uint64_t decode_blocks;
    uint64_t new_blocks;   /* what it charged to allocated_blocks */
    uint64_t prefix_key;   /* the prefix it declared (km_active_share_prefix); 0 = none */
    uint64_t prefix_blocks; /* that prefix's full blocks */
    uint64_t *queued;       /* the blocks its prefill will store (km_active_queue_blocks), malloc'd */
    uint32_t n_queued;
    uint32_t n_computed;    /* queued[0..n_computed) are computed (km_active_blocks_stored) */
    int64_t engine_cached_tokens;
    uint64_t begin_ns, dispatched_ns, first_token_ns, last_touch_ns;
    void *user; /* the caller's pointer (km_active_set_user) */
    uint32_t user_bytes; /* what the caller keeps beside it, counted in the bytes bound */
} entry;

enum { IDS_INLINE_BYTES = 64 };

/* A recently ended id, to tell "already finished" / "expired" from "never seen". */
typedef struct ended_slot {
    uint64_t hash;
    char *ids; /* owned (or inline_ids); NULL when unused */
    /* Ids that fit are copied here and their buffer released at once: a ring of small buffers
     * from all over the heap would keep its pages from going back after a drain. */
    char inline_ids[IDS_INLINE_BYTES];
    uint32_t request_len, attempt_len;
    km_active_end end;
} ended_slot;

typedef struct worker_state {
    km_active_load load; /* pending_prefill_pairs: the low 64 bits of their sum (pairs_add) */
    uint64_t pairs_high; /* the bits of that sum past 64 */
    uint32_t head; /* first entry of the worker's list */
    uint64_t last_arrival; /* km_active_last_arrival */
} worker_state;

struct km_active {
    km_active_config cfg;
    km_memory memory; /* for the u64maps; no cap */
    entry *slab;
    uint32_t slab_capacity, free_head, live;
    km_u64map by_hash; /* km_u64map_key(hash) -> first entry index */
    uint32_t touch_head, touch_tail;
    worker_state *workers;
    ended_slot *ended;  /* ring of cfg.remember_ended slots */
    uint32_t ended_next;
    km_u64map ended_by_hash; /* km_u64map_key(hash) -> ring slot of the latest end with that hash */
    km_u64map prefixes;      /* km_u64map_key(prefix_slot(worker, key)) -> live entries holding it
                              * and the blocks charged for it (prefix_take) */
    km_u64map queued;        /* prefix_slot(worker, block hash) -> (the latest entry to promise it
                              * << 32) | the live entries promising it (QUEUED_COUNT) */
    char *unremembered_ids;  /* ids of the last ended entry when the ring is off (summary storage) */
    size_t unremembered_size;
    void *ids_cache;         /* released id buffers of IDS_CACHED_BYTES, linked through their start */
    uint32_t ids_cached;
    uint64_t clock;          /* latest now_ns seen */
    uint64_t arrivals;       /* begins, and moves to another worker, since creation */
    km_active_stats stats;
    char last_error[256];
};

/* Id buffers are made by km_active_begin and released when their entry's end leaves the ended
 * ring: in the service, by the scheduler and the loop thread in turn, one of each per decision,
 * which through malloc is a cross-thread free per decision (glibc's arena lock and fastbin
 * consolidation). Buffers of up to IDS_CACHED_BYTES (a UUID request id and a short attempt id)
 * are all that size and kept on a free list, at most IDS_CACHE_MAX of them. */
enum { IDS_CACHED_BYTES = 64, IDS_CACHE_MAX = 65536 };

static size_t ids_size(uint32_t request_len, uint32_t attempt_len)
{
    return (size_t)request_len + attempt_len + 2;
}

static char *ids_alloc(km_active *a, size_t size)
{
    if (size > IDS_CACHED_BYTES)
        return malloc(size);
    if (!a->ids_cache)
        return malloc(IDS_CACHED_BYTES);
    char *ids = a->ids_cache;
    memcpy(&a->ids_cache, ids, sizeof(void *));
    a->ids_cached--;
    return ids;
}

static void ids_release(km_active *a, char *ids, size_t size)
{
    if (!ids)
        return;
    if (size > IDS_CACHED_BYTES || a->ids_cached >= IDS_CACHE_MAX) {
        free(ids);
        return;
    }
    memcpy(ids, &a->ids_cache, sizeof(void *));
    a->ids_cache = ids;
    a->ids_cached++;
}

void km_active_config_init(km_active_config *cfg)
{
    if (!cfg)
        return;
    memset(cfg, 0, sizeof *cfg);
    cfg->max_workers = 1024;
    cfg->ttl_ns = UINT64_C(600) * 1000000000u;
    cfg->max_entries = 1u << 20;
    cfg->remember_ended = 4096;
    cfg->max_queued_blocks = 1u << 20;
    cfg->max_bytes = UINT64_C(1) << 30;
}

static const char *const active_end_names[] = {
#define KM_ACTIVE_END_NAME(value, name) [value] = name,
    KM_ACTIVE_END_LIST(KM_ACTIVE_END_NAME)
#undef KM_ACTIVE_END_NAME
};
_Static_assert(sizeof active_end_names / sizeof active_end_names[0] == KM_ACTIVE_END_COUNT,
               "KM_ACTIVE_END_COUNT is the length of KM_ACTIVE_END_LIST");

const char *km_active_end_name(km_active_end end)
{
    return (unsigned)end < KM_ACTIVE_END_COUNT ? active_end_names[end] : "unknown";
}

/* ---- errors ------------------------------------------------------------------------------- */

__attribute__((format(printf, 3, 4))) static int active_fail(km_active *a, int status,
                                                               const char *fmt, ...)
{
    if (!a)
        return status;
    va_list ap;
    va_start(ap, fmt);
    km_vstatus_message(a->last_error, sizeof a->last_error, status, fmt, ap);
    va_end(ap);
    return status;
}

const char *km_active_last_error(const km_active *active)
{
    return active ? active->last_error : "";
}

/* Ids in messages are cut to keep the sentence readable. */
#define ID_FMT "request '%.*s' attempt '%.*s'"
#define ID_ARGS(k)                                                                             \
    (int)((k)->request_id_len > 64 ? 64 : (k)->request_id_len), (k)->request_id,              \
        (int)((k)->attempt_id_len > 64 ? 64 : (k)->attempt_id_len), (k)->attempt_id

/* ---- create / destroy --------------------------------------------------------------------- */

int km_active_create(const km_active_config *cfg, km_active **out)
{
    if (!out)
        return KM_ERR_NULL_POINTER;
    *out = NULL;
    km_active_config c;
    if (cfg)
        c = *cfg;
    else
        km_active_config_init(&c);
    if (c.max_workers < 1 || c.max_workers > 65534u || c.ttl_ns == 0 || c.max_entries == 0 ||
        c.max_entries >= NIL)
        return KM_ERR_INVALID_ARGUMENT;
    km_active *a = calloc(1, sizeof *a);
    if (!a)
        return KM_ERR_OUT_OF_MEMORY;
    a->cfg = c;
    a->free_head = NIL;
    a->touch_head = a->touch_tail = NIL;
    km_u64map_init(&a->by_hash, &a->memory);
    km_u64map_init(&a->ended_by_hash, &a->memory);
    km_u64map_init(&a->prefixes, &a->memory);
    km_u64map_init(&a->queued, &a->memory);
    a->workers = calloc(c.max_workers, sizeof *a->workers);
    a->ended = c.remember_ended ? calloc(c.remember_ended, sizeof *a->ended) : NULL;
    if (!a->workers || (c.remember_ended && !a->ended)) {
        km_active_destroy(a);
        return KM_ERR_OUT_OF_MEMORY;
    }
    for (uint32_t w = 0; w < c.max_workers; w++)
        a->workers[w].head = NIL;
    *out = a;
    return KM_OK;
}

void km_active_destroy(km_active *a)
{
    if (!a)
        return;
    for (uint32_t i = 0; i < a->slab_capacity; i++) {
        free(a->slab[i].ids);
        free(a->slab[i].queued);
    }
    free(a->slab);
    if (a->ended)
        for (uint32_t i = 0; i < a->cfg.remember_ended; i++)
            if (a->ended[i].ids != a->ended[i].inline_ids)
                free(a->ended[i].ids);
    free(a->ended);
    free(a->unremembered_ids);
    while (a->ids_cache) {
        void *next;
        memcpy(&next, a->ids_cache, sizeof next);
        free(a->ids_cache);
        a->ids_cache = next;
    }
    free(a->workers);
    km_u64map_free(&a->by_hash);
    km_u64map_free(&a->ended_by_hash);
    km_u64map_free(&a->prefixes);
    km_u64map_free(&a->queued);
    free(a);
}

uint64_t km_active_release_idle(km_active *a)
{
    if (!a)
        return 0;
    uint64_t freed = 0;
    while (a->ids_cache) {
        void *next;
        memcpy(&next, a->ids_cache, sizeof next);
        free(a->ids_cache);
        a->ids_cache = next;
        freed += IDS_CACHED_BYTES;
    }
    a->ids_cached = 0;
    if (a->live == 0 && a->slab_capacity) {
        /* Free slots hold no ids (released when their entry ended). */
        freed += (uint64_t)a->slab_capacity * sizeof *a->slab + km_u64map_bytes(&a->by_hash) +
                 km_u64map_bytes(&a->prefixes) + km_u64map_bytes(&a->queued);
        free(a->slab);
        a->slab = NULL;
        a->slab_capacity = 0;
        a->free_head = NIL;
        a->touch_head = a->touch_tail = NIL;
        for (uint32_t w = 0; w < a->cfg.max_workers; w++)
            a->workers[w].head = NIL;
        km_u64map_free(&a->by_hash);
        km_u64map_init(&a->by_hash, &a->memory);
        km_u64map_free(&a->prefixes);
        km_u64map_init(&a->prefixes, &a->memory);
        /* Nothing in flight promises anything (promises end with their entries). */
        km_u64map_free(&a->queued);
        km_u64map_init(&a->queued, &a->memory);
    }
    return freed;
}

/* ---- keys --------------------------------------------------------------------------------- */

static int check_key(km_active *a, const km_active_key *key)
{
    if (!key)
        return active_fail(a, KM_ERR_NULL_POINTER, "key is NULL");
    if (!key->request_id || (key->attempt_id_len && !key->attempt_id))
        return active_fail(a, KM_ERR_NULL_POINTER, "request id or attempt id is NULL");
    if (key->request_id_len == 0)
        return active_fail(a, KM_ERR_INVALID_ARGUMENT, "request id is empty");
    if (key->request_id_len > KM_ACTIVE_ID_MAX || key->attempt_id_len > KM_ACTIVE_ID_MAX)
        return active_fail(a, KM_ERR_TOO_LARGE,
                           "request id (%zu bytes) or attempt id (%zu bytes) longer than %u bytes",
                           key->request_id_len, key->attempt_id_len, KM_ACTIVE_ID_MAX);
    if (memchr(key->request_id, 0, key->request_id_len) ||
        (key->attempt_id_len && memchr(key->attempt_id, 0, key->attempt_id_len)))
        return active_fail(a, KM_ERR_INVALID_ARGUMENT, "request id or attempt id contains a NUL byte");
    return KM_OK;
}

/* The request id's length seeds the attempt's hash, so ("ab","c") and ("a","bc") differ even
 * before the ids are compared. */
static uint64_t key_hash(const km_active_key *key)
{
    uint64_t h = XXH3_64bits(key->request_id, key->request_id_len);
    return XXH3_64bits_withSeed(key->attempt_id_len ? key->attempt_id : "", key->attempt_id_len,
                                h ^ (uint64_t)key->request_id_len);
}

static bool ids_equal(const char *ids, uint32_t request_len, uint32_t attempt_len,
                      const km_active_key *key)
{
    return request_len == key->request_id_len && attempt_len == key->attempt_id_len &&
           memcmp(ids, key->request_id, request_len) == 0 &&
           (attempt_len == 0 || memcmp(ids + request_len + 1, key->attempt_id, attempt_len) == 0);
}

static uint32_t find_entry(const km_active *a, const km_active_key *key, uint64_t hash)
{
    const uint64_t *head = km_u64map_find(&a->by_hash, km_u64map_key(hash));
    for (uint32_t i = head ? (uint32_t)*head : NIL; i != NIL; i = a->slab[i].hash_next) {
        const entry *e = &a->slab[i];
        if (e->hash == hash && ids_equal(e->ids, e->request_len, e->attempt_len, key))
            return i;
    }
    return NIL;
}

static const ended_slot *find_ended(const km_active *a, const km_active_key *key, uint64_t hash)
{
    const uint64_t *slot = km_u64map_find(&a->ended_by_hash, km_u64map_key(hash));
    if (!slot)
        return NULL;
    const ended_slot *s = &a->ended[*slot];
    if (s->ids && s->hash == hash && ids_equal(s->ids, s->request_len, s->attempt_len, key))
        return s;
    return NULL; /* another id with the same hash ended later: this one reads as unknown */
}

static uint64_t advance_clock(km_active *a, uint64_t now_ns)
{
    if (now_ns > a->clock)
        a->clock = now_ns;
    return a->clock;
}

static uint64_t saturating_sub(km_active *a, uint64_t value, uint64_t amount)
{
    if (amount > value) {
        a->stats.saturations++;
        return 0;
    }
    return value - amount;
}

/* A worker's pending prefill pairs are summed exactly, in 128 bits (load.pending_prefill_pairs
 * and pairs_high): an entry of a huge prompt holds up to about 2^63 pairs, so a few of them sum
 * past 2^64, and each must take off exactly what it added. The load reads UINT64_MAX while the
 * sum is past it (load_of). */
static void pairs_add(worker_state *w, uint64_t v)
{
    w->load.pending_prefill_pairs += v;
    w->pairs_high += w->load.pending_prefill_pairs < v;
}

static void pairs_sub(km_active *a, worker_state *w, uint64_t v)
{
    if (w->load.pending_prefill_pairs < v) {
        if (!w->pairs_high) {
            a->stats.saturations++;
            w->load.pending_prefill_pairs = 0;
            return;
        }
        w->pairs_high--;
    }
    w->load.pending_prefill_pairs -= v;
}

static km_active_load load_of(const worker_state *w)
{
    km_active_load l = w->load;
    if (w->pairs_high)
        l.pending_prefill_pairs = UINT64_MAX;
    return l;
}

/* ---- lists -------------------------------------------------------------------------------- */

static void touch_unlink(km_active *a, uint32_t i)
{
    entry *e = &a->slab[i];
    if (e->touch_prev != NIL)
        a->slab[e->touch_prev].touch_next = e->touch_next;
    else
        a->touch_head = e->touch_next;
    if (e->touch_next != NIL)
        a->slab[e->touch_next].touch_prev = e->touch_prev;
    else
        a->touch_tail = e->touch_prev;
    e->touch_prev = e->touch_next = NIL;
}

static void touch_append(km_active *a, uint32_t i)
{
    entry *e = &a->slab[i];
    e->touch_prev = a->touch_tail;
    e->touch_next = NIL;
    if (a->touch_tail != NIL)
        a->slab[a->touch_tail].touch_next = i;
    else
        a->touch_head = i;
    a->touch_tail = i;
}

static void touch(km_active *a, uint32_t i, uint64_t now)
{
    a->slab[i].last_touch_ns = now;
    if (a->touch_tail != i) {
        touch_unlink(a, i);
        touch_append(a, i);
    }
}

static void worker_link(km_active *a, uint32_t i)
{
    entry *e = &a->slab[i];
    worker_state *w = &a->workers[e->worker];
    e->worker_prev = NIL;
    e->worker_next = w->head;
    if (w->head != NIL)
        a->slab[w->head].worker_prev = i;
    w->head = i;
}

static void worker_unlink(km_active *a, uint32_t i)
{
    entry *e = &a->slab[i];
    if (e->worker_prev != NIL)
        a->slab[e->worker_prev].worker_next = e->worker_next;
    else
        a->workers[e->worker].head = e->worker_next;
    if (e->worker_next != NIL)
        a->slab[e->worker_next].worker_prev = e->worker_prev;
}

/* Remove entry i from the hash chain (the map entry is updated or erased). */
static void hash_unlink(km_active *a, uint32_t i)
{
    uint64_t mkey = km_u64map_key(a->slab[i].hash);
    uint64_t *head = km_u64map_find(&a->by_hash, mkey);
    if (!head)
        return; /* cannot happen: every live entry is reachable */
    if ((uint32_t)*head == i) {
        if (a->slab[i].hash_next == NIL)
            km_u64map_erase(&a->by_hash, mkey);
        else
            *head = a->slab[i].hash_next;
        return;
    }
    for (uint32_t p = (uint32_t)*head; p != NIL; p = a->slab[p].hash_next) {
        if (a->slab[p].hash_next == i) {
            a->slab[p].hash_next = a->slab[i].hash_next;
            return;
        }
    }
}

/* ---- shared prefixes ------------------------------------------------------------------------ */

/* The map slot of prefix `key` on `worker`. */
static uint64_t prefix_slot(uint32_t worker, uint64_t key)
{
    return km_u64map_key(key ^ ((uint64_t)(worker + 1) * UINT64_C(0x9E3779B97F4A7C15)));
}

/* A prefix's map value: its live holders on the worker (high half) and the blocks charged for it
 * to the worker's allocated_blocks (low half), once for all of them. */
#define PREFIX_HOLDERS_ONE (UINT64_C(1) << 32)
#define PREFIX_CHARGED(v) ((v) & UINT64_C(0xFFFFFFFF))

/* Entry e stops holding its prefix: the holders' count drops; the last one takes the prefix's
 * charge off its worker's allocated_blocks and the slot goes. */
static void prefix_release(km_active *a, entry *e)
{
    if (!e->prefix_key)
        return;
    uint64_t slot = prefix_slot(e->worker, e->prefix_key);
    uint64_t *v = km_u64map_find(&a->prefixes, slot);
    if (!v)
        return;
    if (*v >= 2 * PREFIX_HOLDERS_ONE) {
        *v -= PREFIX_HOLDERS_ONE;
        return;
    }
    km_active_load *load = &a->workers[e->worker].load;
    load->allocated_blocks = saturating_sub(a, load->allocated_blocks, PREFIX_CHARGED(*v));
    km_u64map_erase(&a->prefixes, slot);
}

/* Entry e (on e->worker, its load not yet charged with new_blocks) holds its prefix: the prefix's
 * blocks are charged to the worker once, by its first live holder, for as long as any holder is
 * live, and each holder's own charge (new_blocks) leaves them out. Returns KM_OK or
 * KM_ERR_OUT_OF_MEMORY (nothing changed). */
static int prefix_take(km_active *a, entry *e)
{
    e->new_blocks = e->decode_blocks;
    if (!e->prefix_key)
        return KM_OK;
    uint64_t slot = prefix_slot(e->worker, e->prefix_key);
    uint64_t *v = km_u64map_find(&a->prefixes, slot);
    uint64_t charged;
    if (v) {
        *v += PREFIX_HOLDERS_ONE;
        charged = PREFIX_CHARGED(*v);
    } else {
        charged = e->prefix_blocks < e->decode_blocks ? e->prefix_blocks : e->decode_blocks;
        charged = charged < UINT32_MAX ? charged : UINT32_MAX;
        if (km_u64map_put(&a->prefixes, slot, PREFIX_HOLDERS_ONE | charged, 1))
            return KM_ERR_OUT_OF_MEMORY;
        a->workers[e->worker].load.allocated_blocks += charged;
    }
    e->new_blocks = e->decode_blocks > charged ? e->decode_blocks - charged : 0;
    return KM_OK;
}

/* ---- queued prefixes ------------------------------------------------------------------------ */

/* A queued slot's value: the count of live promisers in the low half, and in the high half the
 * latest entry to promise the block while that entry's promise lasts, else NIL (QUEUED_NOBODY). */
#define QUEUED_COUNT(v) ((uint32_t)(v))
#define QUEUED_ENTRY(v) ((uint32_t)((v) >> 32))
#define QUEUED_COUNT_MASK UINT64_C(0xffffffff)
#define QUEUED_NOBODY ((uint64_t)NIL << 32)

/* Entry e's promise ends (its prefill ran, it ended or moved): each promised block's count drops
 * (and its slot goes at 0). */
static void queued_release(km_active *a, entry *e)
{
    uint32_t idx = (uint32_t)(e - a->slab);
    for (uint32_t k = 0; k < e->n_queued; k++) {
        uint64_t slot = prefix_slot(e->worker, e->queued[k]);
        uint64_t *v = km_u64map_find(&a->queued, slot);
        if (v && QUEUED_COUNT(*v) > 1)
            *v = (QUEUED_ENTRY(*v) == idx ? QUEUED_NOBODY : *v & ~QUEUED_COUNT_MASK) |
                 (QUEUED_COUNT(*v) - 1);
        else if (v)
            km_u64map_erase(&a->queued, slot);
    }
    a->stats.queued_blocks = saturating_sub(a, a->stats.queued_blocks, e->n_queued);
    free(e->queued);
    e->queued = NULL;
    e->n_queued = 0;
    e->n_computed = 0;
}

/* ---- ending an entry ---------------------------------------------------------------------- */

/* Release entry i's load, fill *s, unlink it everywhere, keep its ids in the ended ring (or the
 * single summary buffer), and free the slab slot. s's id pointers stay valid until the next end. */
static void end_entry(km_active *a, uint32_t i, km_active_end end, uint64_t now,
                      km_active_summary *s)
{
    entry *e = &a->slab[i];
    km_active_load *load = &a->workers[e->worker].load;
    load->in_flight = saturating_sub(a, load->in_flight, 1);
    if (!e->first_token)
        load->prefilling = saturating_sub(a, load->prefilling, 1);
    load->pending_prefill_tokens = saturating_sub(a, load->pending_prefill_tokens, e->prefill_pending);
    pairs_sub(a, &a->workers[e->worker], e->pairs_pending);
    load->active_decode_blocks = saturating_sub(a, load->active_decode_blocks, e->decode_blocks);
    load->allocated_blocks = saturating_sub(a, load->allocated_blocks, e->new_blocks);
    prefix_release(a, e);
    queued_release(a, e);

    memset(s, 0, sizeof *s);
    s->request_id = e->ids;
    s->request_id_len = e->request_len;
    s->attempt_id = e->ids + e->request_len + 1;
    s->attempt_id_len = e->attempt_len;
    s->worker = e->worker;
    s->end = end;
    s->prompt_tokens = e->prompt_tokens;
    s->predicted_cached_tokens = e->predicted_cached_tokens;
    s->expected_output_tokens = e->expected_output_tokens;
    s->block_size = e->block_size;
    s->prefill_tokens_charged = e->prefill_charged;
    s->decode_blocks_charged = e->decode_blocks;
    s->engine_cached_tokens = e->engine_cached_tokens;
    s->dispatched = e->dispatched;
    s->first_token = e->first_token;
    s->begin_ns = e->begin_ns;
    s->dispatched_ns = e->dispatched_ns;
    s->first_token_ns = e->first_token_ns;
    s->last_event_ns = e->last_touch_ns;
    s->end_ns = now;
    s->user = e->user;

    hash_unlink(a, i);
    touch_unlink(a, i);
    worker_unlink(a, i);

    if (a->cfg.remember_ended) {
        uint32_t k = a->ended_next;
        a->ended_next = (k + 1) % a->cfg.remember_ended;
        ended_slot *slot = &a->ended[k];
        if (slot->ids) {
            uint64_t mkey = km_u64map_key(slot->hash);
            uint64_t *v = km_u64map_find(&a->ended_by_hash, mkey);
            if (v && *v == k)
                km_u64map_erase(&a->ended_by_hash, mkey);
            if (slot->ids != slot->inline_ids)
                ids_release(a, slot->ids, ids_size(slot->request_len, slot->attempt_len));
        }
        slot->hash = e->hash;
        size_t n = ids_size(e->request_len, e->attempt_len);
        if (n <= IDS_INLINE_BYTES) {
            memcpy(slot->inline_ids, e->ids, n);
            ids_release(a, e->ids, n);
            slot->ids = slot->inline_ids;
            s->request_id = slot->ids;
            s->attempt_id = slot->ids + e->request_len + 1;
        } else {
            slot->ids = e->ids;
        }
        slot->request_len = e->request_len;
        slot->attempt_len = e->attempt_len;
        slot->end = end;
        /* A failed map insert (out of memory) only means this id will later read as unknown. */
        (void)km_u64map_put(&a->ended_by_hash, km_u64map_key(e->hash), k, 1);
    } else {
        ids_release(a, a->unremembered_ids, a->unremembered_size);
        a->unremembered_ids = e->ids;
        a->unremembered_size = ids_size(e->request_len, e->attempt_len);
    }
    a->stats.bytes = saturating_sub(a, a->stats.bytes,
                                    km_active_entry_bytes(e->request_len, e->attempt_len) + e->user_bytes);
    e->ids = NULL;
    e->hash_next = a->free_head;
    a->free_head = i;
    a->live--;
    a->stats.ended[end]++;
}

/* Find the live entry for an event, or classify the miss (unknown / late / duplicate) with an
 * error naming the event. */
static int lookup_for_event(km_active *a, const km_active_key *key, const char *event,
                            uint32_t *out)
{
    int rc = check_key(a, key);
    if (rc)
        return rc;
    uint64_t hash = key_hash(key);
    uint32_t i = find_entry(a, key, hash);
    if (i != NIL) {
        *out = i;
        return KM_OK;
    }
    const ended_slot *s = a->ended ? find_ended(a, key, hash) : NULL;
    if (s && (s->end == KM_ACTIVE_END_EXPIRED || s->end == KM_ACTIVE_END_WORKER_REMOVED ||
              s->end == KM_ACTIVE_END_EVICTED)) {
        a->stats.late++;
        return active_fail(a, KM_ERR_NOT_FOUND, "%s for " ID_FMT ": the entry ended earlier (%s)",
                           event, ID_ARGS(key), km_active_end_name(s->end));
    }
    if (s) {
        a->stats.duplicates++;
        return active_fail(a, KM_ERR_PROTOCOL, "%s for " ID_FMT " after FINISHED (outcome %s)",
                           event, ID_ARGS(key), km_active_end_name(s->end));
    }
    a->stats.unknown++;
    return active_fail(a, KM_ERR_NOT_FOUND, "%s for " ID_FMT ": no such active request", event,
                       ID_ARGS(key));
}

/* ---- the bytes bound ------------------------------------------------------------------------ */

/* An id map slot is a 16-byte km_u64map_entry and the map is at most 70% full with a power-of-two
 * capacity, so one entry's share is at most about three slots: four are counted. */
enum { ENTRY_MAP_SHARE_BYTES = 4 * 16 };

uint64_t km_active_entry_bytes(size_t request_id_len, size_t attempt_id_len)
{
    size_t ids = request_id_len + attempt_id_len + 2;
    return sizeof(entry) + (ids > IDS_CACHED_BYTES ? ids : IDS_CACHED_BYTES) + ENTRY_MAP_SHARE_BYTES;
}

/* KM_ERR_MEMORY_CAP (counted) when the key's entry, with the caller's user_bytes beside it, would
 * take the live entries past max_bytes. */
static int check_bytes_bound(km_active *a, const km_active_key *key, uint32_t user_bytes)
{
    uint64_t need = km_active_entry_bytes(key->request_id_len, key->attempt_id_len) + user_bytes;
    if (!a->cfg.max_bytes || a->stats.bytes + need <= a->cfg.max_bytes)
        return KM_OK;
    a->stats.refused_bytes++;
    return active_fail(a, KM_ERR_MEMORY_CAP,
                       "%" PRIu64 " bytes held by %" PRIu32 " entries; this request's entry (%" PRIu64
                       " bytes) would pass the bound of %" PRIu64 " bytes",
                       a->stats.bytes, a->live, need, a->cfg.max_bytes);
}

/* ---- lifecycle ---------------------------------------------------------------------------- */

static int grow_slab(km_active *a)
{
    uint64_t wanted = a->slab_capacity ? (uint64_t)a->slab_capacity * 2 : 64;
    uint32_t capacity = wanted > a->cfg.max_entries ? a->cfg.max_entries : (uint32_t)wanted;
    entry *slab = realloc(a->slab, (size_t)capacity * sizeof *slab);
    if (!slab)
        return KM_ERR_OUT_OF_MEMORY;
    a->slab = slab;
    for (uint32_t i = capacity; i-- > a->slab_capacity;) {
        memset(&slab[i], 0, sizeof slab[i]);
        slab[i].hash_next = a->free_head;
        a->free_head = i;
    }
    a->slab_capacity = capacity;
    return KM_OK;
}

int km_active_begin(km_active *a, uint32_t worker, const km_active_key *key,
                    uint32_t prompt_tokens, uint32_t cached_tokens_predicted,
                    uint32_t expected_output_tokens, uint32_t block_size, uint64_t now_ns)
{
    return km_active_begin_with_user_bytes(a, worker, key, prompt_tokens, cached_tokens_predicted,
                                           expected_output_tokens, block_size, 0, now_ns);
}

int km_active_begin_with_user_bytes(km_active *a, uint32_t worker, const km_active_key *key,
                                    uint32_t prompt_tokens, uint32_t cached_tokens_predicted,
                                    uint32_t expected_output_tokens, uint32_t block_size,
                                    uint32_t user_bytes, uint64_t now_ns)
{
    if (!a)
        return KM_ERR_NULL_POINTER;
    a->last_error[0] = '\0';
    int rc = check_key(a, key);
    if (rc)
        return rc;
    if (worker >= a->cfg.max_workers)
        return active_fail(a, KM_ERR_WORKER_RANGE, "worker %" PRIu32 " out of range (max_workers %" PRIu32 ")",
                           worker, a->cfg.max_workers);
    if (block_size == 0)
        return active_fail(a, KM_ERR_BLOCK_SIZE, "block size 0 for " ID_FMT, ID_ARGS(key));
    uint64_t hash = key_hash(key);
    /* One lookup of the hash's chain serves the duplicate check and the insertion below (nothing
     * between them changes the map, so the pointer stays valid). */
    uint64_t mkey = km_u64map_key(hash);
    uint64_t *head = km_u64map_find(&a->by_hash, mkey);
    for (uint32_t j = head ? (uint32_t)*head : NIL; j != NIL; j = a->slab[j].hash_next) {
        const entry *e = &a->slab[j];
        if (e->hash == hash && ids_equal(e->ids, e->request_len, e->attempt_len, key)) {
            a->stats.duplicates++;
            return active_fail(a, KM_ERR_PROTOCOL, ID_FMT " is already active (routed twice?)",
                               ID_ARGS(key));
        }
    }
    if (a->live >= a->cfg.max_entries)
        return active_fail(a, KM_ERR_OVERLOADED, "%" PRIu32 " active requests, the configured maximum",
                           a->cfg.max_entries);
    if ((rc = check_bytes_bound(a, key, user_bytes)) != KM_OK)
        return rc;

    /* Allocate everything before touching any state. */
    if (a->free_head == NIL && (rc = grow_slab(a)) != KM_OK)
        return active_fail(a, rc, "cannot grow the active-work table");
    size_t size = key->request_id_len + key->attempt_id_len + 2;
    char *ids = ids_alloc(a, size);
    if (!ids)
        return active_fail(a, KM_ERR_OUT_OF_MEMORY, "cannot copy the ids");
    uint32_t chain_next = head ? (uint32_t)*head : NIL;
    uint32_t i = a->free_head;
    if (head) {
        *head = i; /* the new entry heads the chain */
    } else if ((rc = km_u64map_put(&a->by_hash, mkey, i, 1)) != KM_OK) {
        ids_release(a, ids, size);
        return active_fail(a, rc, "cannot grow the active-work map");
    }
    a->free_head = a->slab[i].hash_next;

    memcpy(ids, key->request_id, key->request_id_len);
    ids[key->request_id_len] = '\0';
    if (key->attempt_id_len)
        memcpy(ids + key->request_id_len + 1, key->attempt_id, key->attempt_id_len);
    ids[key->request_id_len + 1 + key->attempt_id_len] = '\0';

    uint64_t now = advance_clock(a, now_ns);
    entry *e = &a->slab[i];
    memset(e, 0, sizeof *e);
    e->hash = hash;
    e->ids = ids;
    e->request_len = (uint32_t)key->request_id_len;
    e->attempt_len = (uint32_t)key->attempt_id_len;
    e->worker = worker;
    e->hash_next = chain_next;
    e->prompt_tokens = prompt_tokens;
    e->predicted_cached_tokens = cached_tokens_predicted;
    e->expected_output_tokens = expected_output_tokens;
    e->block_size = block_size;
    uint32_t cached = cached_tokens_predicted < prompt_tokens ? cached_tokens_predicted : prompt_tokens;
    e->prefill_charged = e->prefill_pending = (uint64_t)prompt_tokens - cached;
    e->pairs_pending = km_engine_model_chunk_pairs(cached, e->prefill_pending);
    uint64_t tokens = (uint64_t)prompt_tokens + expected_output_tokens;
    e->decode_blocks = (tokens + block_size - 1) / block_size;
    e->new_blocks = e->decode_blocks;
    e->engine_cached_tokens = KM_ACTIVE_CACHED_UNKNOWN;
    e->user_bytes = user_bytes;
    e->begin_ns = e->last_touch_ns = now;
    e->touch_prev = e->touch_next = NIL;
    touch_append(a, i);
    worker_link(a, i);

    km_active_load *load = &a->workers[worker].load;
    load->in_flight += 1;
    load->prefilling += 1;
    load->pending_prefill_tokens += e->prefill_pending;
    pairs_add(&a->workers[worker], e->pairs_pending);
    load->active_decode_blocks += e->decode_blocks;
    load->allocated_blocks += e->new_blocks;
    a->workers[worker].last_arrival = ++a->arrivals;
    a->live++;
    a->stats.begun++;
    a->stats.bytes += km_active_entry_bytes(key->request_id_len, key->attempt_id_len) + user_bytes;
    return KM_OK;
}

int km_active_share_prefix(km_active *a, const km_active_key *key, uint64_t prefix_key,
                           uint32_t prefix_tokens)
{
    if (!a)
        return KM_ERR_NULL_POINTER;
    a->last_error[0] = '\0';
    uint32_t i;
    int rc = lookup_for_event(a, key, "a shared prefix", &i);
    if (rc)
        return rc;
    entry *e = &a->slab[i];
    if (e->prefix_key)
        return active_fail(a, KM_ERR_PROTOCOL, "a prefix was already declared for " ID_FMT,
                           ID_ARGS(key));
    if (!prefix_key || !prefix_tokens)
        return KM_OK;
    km_active_load *load = &a->workers[e->worker].load;
    uint64_t before = e->new_blocks;
    e->prefix_key = prefix_key;
    e->prefix_blocks = prefix_tokens / e->block_size;
    if ((rc = prefix_take(a, e))) {
        e->prefix_key = e->prefix_blocks = 0;
        e->new_blocks = before;
        return active_fail(a, rc, "no memory to record a shared prefix");
    }
    load->allocated_blocks = saturating_sub(a, load->allocated_blocks, before) + e->new_blocks;
    return KM_OK;
}

int km_active_queue_blocks(km_active *a, const km_active_key *key, const uint64_t *hashes,
                           uint32_t n)
{
    if (!a)
        return KM_ERR_NULL_POINTER;
    a->last_error[0] = '\0';
    if (n && !hashes)
        return active_fail(a, KM_ERR_NULL_POINTER, "promised block hashes are NULL");
    uint32_t i;
    int rc = lookup_for_event(a, key, "a queued prefix", &i);
    if (rc)
        return rc;
    entry *e = &a->slab[i];
    if (e->queued || e->first_token)
        return active_fail(a, KM_ERR_PROTOCOL, "%s for " ID_FMT,
                           e->first_token ? "a queued prefix after FIRST_TOKEN"
                                          : "a second queued prefix",
                           ID_ARGS(key));
    uint64_t room = a->cfg.max_queued_blocks > a->stats.queued_blocks
                        ? a->cfg.max_queued_blocks - a->stats.queued_blocks
                        : 0;
    uint32_t keep = n < room ? n : (uint32_t)room;
    a->stats.queued_truncated += n - keep;
    if (keep == 0)
        return KM_OK;
    uint64_t *copy = malloc((size_t)keep * sizeof *copy);
    if (!copy || km_u64map_reserve(&a->queued, keep) != KM_OK) {
        free(copy);
        return active_fail(a, KM_ERR_OUT_OF_MEMORY, "no memory to record a queued prefix");
    }
    memcpy(copy, hashes, (size_t)keep * sizeof *copy);
    for (uint32_t k = 0; k < keep; k++) {
        uint64_t slot = prefix_slot(e->worker, copy[k]);
        uint64_t *v = km_u64map_find(&a->queued, slot);
        uint32_t count = v ? QUEUED_COUNT(*v) + 1 : 1;
        uint64_t value = (uint64_t)i << 32 | count;
        if (v)
            *v = value;
        else
            (void)km_u64map_put(&a->queued, slot, value, 0); /* room reserved above */
    }
    e->queued = copy;
    e->n_queued = keep;
    a->stats.queued_blocks += keep;
    return KM_OK;
}

/* ---- work shared with other instances -------------------------------------------------------- */

int km_active_worker_work(const km_active *a, uint32_t worker, uint64_t *prefixes,
                          uint32_t max_prefixes, uint32_t *n_prefixes, uint64_t *queued,
                          uint32_t max_queued, uint32_t *n_queued)
{
    if (!a || !n_prefixes || !n_queued || (max_prefixes && !prefixes) || (max_queued && !queued))
        return KM_ERR_NULL_POINTER;
    if (worker >= a->cfg.max_workers)
        return KM_ERR_WORKER_RANGE;
    uint32_t np = 0, nq = 0;
    for (uint32_t i = a->workers[worker].head; i != NIL; i = a->slab[i].worker_next) {
        const entry *e = &a->slab[i];
        if (e->prefix_key) {
            if (np < max_prefixes)
                prefixes[np] = e->prefix_key;
            np++;
        }
        for (uint32_t k = 0; k < e->n_queued; k++, nq++)
            if (nq < max_queued)
                queued[nq] = e->queued[k];
    }
    *n_prefixes = np;
    *n_queued = nq;
    return KM_OK;
}

uint32_t km_active_prefix_sharers(const km_active *a, uint32_t worker, uint64_t prefix_key)
{
    if (!a || worker >= a->cfg.max_workers || !prefix_key)
        return 0;
    const uint64_t *n = km_u64map_find(&a->prefixes, prefix_slot(worker, prefix_key));
    return n ? (uint32_t)(*n / PREFIX_HOLDERS_ONE) : 0;
}

uint32_t km_active_queued_depth(const km_active *a, uint32_t worker, const uint64_t *hashes,
                                uint32_t n, uint32_t from)
{
    if (!a || (n && !hashes) || worker >= a->cfg.max_workers || from > n)
        return 0;
    uint32_t depth = from;
    if (a->stats.queued_blocks == 0)
        return depth;
    while (depth < n && km_u64map_find(&a->queued, prefix_slot(worker, hashes[depth])))
        depth++;
    return depth;
}

/* Entry e (before its FIRST_TOKEN) has `pending` of its prompt's tokens left to compute: the
 * worker's pending prefill and pairs move by the difference. */
static void set_prefill_pending(km_active *a, entry *e, uint64_t pending)
{
    worker_state *w = &a->workers[e->worker];
    uint64_t pairs = km_engine_model_chunk_pairs(e->prompt_tokens - pending, pending);
    w->load.pending_prefill_tokens =
        saturating_sub(a, w->load.pending_prefill_tokens, e->prefill_pending) + pending;
    pairs_sub(a, w, e->pairs_pending);
    pairs_add(w, pairs);
    e->prefill_pending = pending;
    e->pairs_pending = pairs;
}

/* What the stores leave of entry e's prefill: its charge at the decision (the prompt past the
 * predicted cached tokens, where its promise begins) less its computed promised blocks, at
 * least 0. */
static uint64_t stores_leave(const entry *e)
{
    uint64_t cached = e->predicted_cached_tokens < e->prompt_tokens ? e->predicted_cached_tokens
                                                                    : e->prompt_tokens;
    uint64_t charged = e->prompt_tokens - cached;
    uint64_t computed = (uint64_t)e->n_computed * e->block_size;
    return computed < charged ? charged - computed : 0;
}

/* Entry e's promise names `hash` past its computed part: the blocks up to it are computed (the
 * prefill runs in prompt order, and a block another request cached meanwhile is a hit, with no
 * event of its own). Its pending prefill becomes what the stores leave, where that is less (a
 * cached-tokens report may have left less already). Returns the promised blocks that became
 * computed. */
static uint64_t progress_to(km_active *a, entry *e, uint64_t hash)
{
    if (e->first_token)
        return 0;
    uint32_t k = e->n_computed;
    while (k < e->n_queued && e->queued[k] != hash)
        k++;
    if (k == e->n_queued)
        return 0;
    uint64_t blocks = (uint64_t)k + 1 - e->n_computed;
    e->n_computed = k + 1;
    uint64_t left = stores_leave(e);
    if (left < e->prefill_pending)
        set_prefill_pending(a, e, left);
    return blocks;
}

int km_active_blocks_stored(km_active *a, uint32_t worker, const uint64_t *hashes, size_t n,
                            uint64_t *n_progressed)
{
    if (n_progressed)
        *n_progressed = 0;
    if (!a || (n && !hashes))
        return KM_ERR_NULL_POINTER;
    if (worker >= a->cfg.max_workers)
        return KM_ERR_WORKER_RANGE;
    uint64_t progressed = 0;
    for (size_t j = 0; j < n && a->stats.queued_blocks; j++) {
        const uint64_t *v = km_u64map_find(&a->queued, prefix_slot(worker, hashes[j]));
        if (!v)
            continue;
        if (QUEUED_COUNT(*v) == 1 && QUEUED_ENTRY(*v) != NIL) { /* its only promiser */
            entry *e = &a->slab[QUEUED_ENTRY(*v)];
            /* Another worker's when two (worker, hash) pairs share the slot: none here. */
            if (e->worker == worker)
                progressed += progress_to(a, e, hashes[j]);
            continue;
        }
        /* Promised by more than one entry, or the latest to promise it is done: every entry of
         * the worker is asked. */
        for (uint32_t i = a->workers[worker].head; i != NIL; i = a->slab[i].worker_next)
            progressed += progress_to(a, &a->slab[i], hashes[j]);
    }
    a->stats.progressed_blocks += progressed;
    if (n_progressed)
        *n_progressed = progressed;
    return KM_OK;
}

uint64_t km_active_queued_blocks(const km_active *a)
{
    return a ? a->stats.queued_blocks : 0;
}

int km_active_dispatched(km_active *a, const km_active_key *key, uint64_t now_ns)
{
    if (!a)
        return KM_ERR_NULL_POINTER;
    a->last_error[0] = '\0';
    uint32_t i;
    int rc = lookup_for_event(a, key, "DISPATCHED", &i);
    if (rc)
        return rc;
    entry *e = &a->slab[i];
    if (e->first_token) {
        a->stats.out_of_order++;
        return active_fail(a, KM_ERR_PROTOCOL, "DISPATCHED for " ID_FMT " after FIRST_TOKEN",
                           ID_ARGS(key));
    }
    uint64_t now = advance_clock(a, now_ns);
    if (!e->dispatched) {
        e->dispatched = true;
        e->dispatched_ns = now;
    }
    touch(a, i, now);
    return KM_OK;
}

int km_active_move(km_active *a, const km_active_key *key, uint32_t worker, uint64_t now_ns)
{
    if (!a)
        return KM_ERR_NULL_POINTER;
    a->last_error[0] = '\0';
    if (worker >= a->cfg.max_workers)
        return active_fail(a, KM_ERR_WORKER_RANGE, "worker %u (max_workers %u)", worker,
                           a->cfg.max_workers);
    uint32_t i;
    int rc = lookup_for_event(a, key, "a move", &i);
    if (rc)
        return rc;
    entry *e = &a->slab[i];
    uint64_t now = advance_clock(a, now_ns);
    touch(a, i, now);
    if (e->worker == worker)
        return KM_OK;
    km_active_load *from = &a->workers[e->worker].load, *to = &a->workers[worker].load;
    from->in_flight = saturating_sub(a, from->in_flight, 1);
    if (!e->first_token)
        from->prefilling = saturating_sub(a, from->prefilling, 1);
    from->pending_prefill_tokens = saturating_sub(a, from->pending_prefill_tokens, e->prefill_pending);
    pairs_sub(a, &a->workers[e->worker], e->pairs_pending);
    from->active_decode_blocks = saturating_sub(a, from->active_decode_blocks, e->decode_blocks);
    from->allocated_blocks = saturating_sub(a, from->allocated_blocks, e->new_blocks);
    /* The declared prefix was the decision's worker's: on another one nothing is known shared. */
    prefix_release(a, e);
    e->prefix_key = e->prefix_blocks = 0;
    e->new_blocks = e->decode_blocks;
    queued_release(a, e); /* the blocks were promised on the decision's worker */
    worker_unlink(a, i);
    e->worker = worker;
    worker_link(a, i);
    to->in_flight++;
    to->prefilling += !e->first_token;
    to->pending_prefill_tokens += e->prefill_pending;
    pairs_add(&a->workers[worker], e->pairs_pending);
    to->active_decode_blocks += e->decode_blocks;
    to->allocated_blocks += e->new_blocks;
    a->workers[worker].last_arrival = ++a->arrivals;
    a->stats.moved++;
    return KM_OK;
}

int km_active_first_token(km_active *a, const km_active_key *key, int64_t engine_cached_tokens,
                          uint64_t now_ns)
{
    if (!a)
        return KM_ERR_NULL_POINTER;
    a->last_error[0] = '\0';
    if (engine_cached_tokens < KM_ACTIVE_CACHED_UNKNOWN)
        return active_fail(a, KM_ERR_INVALID_ARGUMENT, "engine cached tokens %" PRId64 " is negative",
                           engine_cached_tokens);
    uint32_t i;
    int rc = lookup_for_event(a, key, "FIRST_TOKEN", &i);
    if (rc)
        return rc;
    entry *e = &a->slab[i];
    if (e->first_token) {
        a->stats.duplicates++;
        return active_fail(a, KM_ERR_PROTOCOL, "FIRST_TOKEN twice for " ID_FMT, ID_ARGS(key));
    }
    uint64_t now = advance_clock(a, now_ns);
    km_active_load *load = &a->workers[e->worker].load;
    load->pending_prefill_tokens = saturating_sub(a, load->pending_prefill_tokens, e->prefill_pending);
    pairs_sub(a, &a->workers[e->worker], e->pairs_pending);
    load->prefilling = saturating_sub(a, load->prefilling, 1);
    e->prefill_pending = e->pairs_pending = 0;
    queued_release(a, e); /* the prefill ran: the worker's cache (and the index) has the blocks */
    e->first_token = true;
    e->first_token_ns = now;
    if (engine_cached_tokens != KM_ACTIVE_CACHED_UNKNOWN)
        e->engine_cached_tokens = engine_cached_tokens;
    touch(a, i, now);
    return KM_OK;
}

int km_active_report_cached(km_active *a, const km_active_key *key, int64_t engine_cached_tokens,
                            uint64_t now_ns)
{
    if (!a)
        return KM_ERR_NULL_POINTER;
    a->last_error[0] = '\0';
    if (engine_cached_tokens < 0)
        return active_fail(a, KM_ERR_INVALID_ARGUMENT, "engine cached tokens %" PRId64 " is negative",
                           engine_cached_tokens);
    uint32_t i;
    int rc = lookup_for_event(a, key, "cached-tokens report", &i);
    if (rc)
        return rc;
    entry *e = &a->slab[i];
    uint64_t now = advance_clock(a, now_ns);
    e->engine_cached_tokens = engine_cached_tokens;
    if (!e->first_token) {
        uint64_t cached = (uint64_t)engine_cached_tokens < e->prompt_tokens
                              ? (uint64_t)engine_cached_tokens
                              : e->prompt_tokens;
        uint64_t corrected = e->prompt_tokens - cached;
        e->prefill_charged = corrected;
        /* Blocks computed since the decision (km_active_blocks_stored) lie past the predicted
         * cached prefix: a smaller cache than predicted was computed before them, and a larger
         * one leaves at most what the report says. */
        if (e->n_computed && stores_leave(e) < corrected)
            corrected = stores_leave(e);
        if (corrected != e->prefill_pending) {
            set_prefill_pending(a, e, corrected);
            a->stats.corrections++;
        }
    }
    touch(a, i, now);
    return KM_OK;
}

int km_active_finish(km_active *a, const km_active_key *key, km_active_end outcome,
                     uint64_t now_ns, km_active_summary *summary)
{
    if (!a)
        return KM_ERR_NULL_POINTER;
    a->last_error[0] = '\0';
    if (outcome != KM_ACTIVE_END_COMPLETE && outcome != KM_ACTIVE_END_INCOMPLETE &&
        outcome != KM_ACTIVE_END_ERROR && outcome != KM_ACTIVE_END_CANCELLED)
        return active_fail(a, KM_ERR_INVALID_ARGUMENT,
                           "FINISHED outcome %d is not complete, incomplete, error or cancelled",
                           (int)outcome);
    uint32_t i;
    int rc = lookup_for_event(a, key, "FINISHED", &i);
    if (rc)
        return rc;
    km_active_summary local;
    end_entry(a, i, outcome, advance_clock(a, now_ns), summary ? summary : &local);
    return KM_OK;
}

int km_active_expire(km_active *a, uint64_t now_ns, km_active_summary_fn on_expired, void *user,
                     size_t *n_expired)
{
    return km_active_expire_some(a, now_ns, SIZE_MAX, on_expired, user, n_expired);
}

int km_active_expire_some(km_active *a, uint64_t now_ns, size_t max,
                          km_active_summary_fn on_expired, void *user, size_t *n_expired)
{
    if (n_expired)
        *n_expired = 0;
    if (!a)
        return KM_ERR_NULL_POINTER;
    a->last_error[0] = '\0';
    uint64_t now = advance_clock(a, now_ns);
    size_t n = 0;
    while (a->touch_head != NIL && n < max) {
        uint32_t i = a->touch_head;
        if (now - a->slab[i].last_touch_ns < a->cfg.ttl_ns)
            break; /* the list is ordered: every later entry is younger */
        km_active_summary s;
        end_entry(a, i, KM_ACTIVE_END_EXPIRED, now, &s);
        n++;
        if (on_expired)
            on_expired(user, &s);
    }
    if (n_expired)
        *n_expired = n;
    return KM_OK;
}

int km_active_evict_oldest(km_active *a, uint64_t now_ns, km_active_summary_fn on_evicted,
                           void *user)
{
    if (!a)
        return KM_ERR_NULL_POINTER;
    a->last_error[0] = '\0';
    if (a->touch_head == NIL)
        return active_fail(a, KM_ERR_NOT_FOUND, "no active entry to evict");
    km_active_summary s;
    end_entry(a, a->touch_head, KM_ACTIVE_END_EVICTED, advance_clock(a, now_ns), &s);
    if (on_evicted)
        on_evicted(user, &s);
    return KM_OK;
}

int km_active_remove_worker(km_active *a, uint32_t worker, uint64_t now_ns,
                            km_active_summary_fn on_removed, void *user, size_t *n_removed)
{
    if (n_removed)
        *n_removed = 0;
    if (!a)
        return KM_ERR_NULL_POINTER;
    a->last_error[0] = '\0';
    if (worker >= a->cfg.max_workers)
        return active_fail(a, KM_ERR_WORKER_RANGE, "worker %" PRIu32 " out of range (max_workers %" PRIu32 ")",
                           worker, a->cfg.max_workers);
    uint64_t now = advance_clock(a, now_ns);
    size_t n = 0;
    while (a->workers[worker].head != NIL) {
        km_active_summary s;
        end_entry(a, a->workers[worker].head, KM_ACTIVE_END_WORKER_REMOVED, now, &s);
        n++;
        if (on_removed)
            on_removed(user, &s);
    }
    km_active_load *load = &a->workers[worker].load;
    if (load->in_flight || load->prefilling || load->pending_prefill_tokens ||
        load->pending_prefill_pairs || a->workers[worker].pairs_high ||
        load->active_decode_blocks || load->allocated_blocks) {
        a->stats.saturations++; /* a broken sum invariant; reset rather than keep phantom load */
        memset(load, 0, sizeof *load);
        a->workers[worker].pairs_high = 0;
    }
    a->workers[worker].last_arrival = 0;
    if (n_removed)
        *n_removed = n;
    return KM_OK;
}

/* ---- inspection --------------------------------------------------------------------------- */

int km_active_worker_load(const km_active *a, uint32_t worker, km_active_load *out)
{
    if (!a || !out)
        return KM_ERR_NULL_POINTER;
    if (worker >= a->cfg.max_workers)
        return KM_ERR_WORKER_RANGE;
    *out = load_of(&a->workers[worker]);
    return KM_OK;
}

uint64_t km_active_last_arrival(const km_active *a, uint32_t worker)
{
    return a && worker < a->cfg.max_workers ? a->workers[worker].last_arrival : 0;
}

int km_active_get_stats(const km_active *a, km_active_stats *out)
{
    if (!a || !out)
        return KM_ERR_NULL_POINTER;
    *out = a->stats;
    memset(&out->total, 0, sizeof out->total);
    for (uint32_t w = 0; w < a->cfg.max_workers; w++) {
        km_active_load l = load_of(&a->workers[w]);
        out->total.in_flight += l.in_flight;
        out->total.prefilling += l.prefilling;
        out->total.pending_prefill_tokens += l.pending_prefill_tokens;
        out->total.pending_prefill_pairs =
            out->total.pending_prefill_pairs > UINT64_MAX - l.pending_prefill_pairs
                ? UINT64_MAX
                : out->total.pending_prefill_pairs + l.pending_prefill_pairs;
        out->total.active_decode_blocks += l.active_decode_blocks;
        out->total.allocated_blocks += l.allocated_blocks;
    }
    out->entries = a->live;
    return KM_OK;
}

int km_active_contains(const km_active *a, const km_active_key *key)
{
    if (!a || !key || !key->request_id || !key->request_id_len ||
        key->request_id_len > KM_ACTIVE_ID_MAX || key->attempt_id_len > KM_ACTIVE_ID_MAX ||
        (key->attempt_id_len && !key->attempt_id))
        return 0;
    return find_entry(a, key, key_hash(key)) != NIL;
}

int km_active_set_user(km_active *a, const km_active_key *key, void *user)
{
    if (!a)
        return KM_ERR_NULL_POINTER;
    int rc = check_key(a, key);
    if (rc)
        return rc;
    uint32_t i = find_entry(a, key, key_hash(key));
    if (i == NIL)
        return active_fail(a, KM_ERR_NOT_FOUND, ID_FMT " is not active", ID_ARGS(key));
    a->slab[i].user = user;
    return KM_OK;
}

void *km_active_user(const km_active *a, const km_active_key *key)
{
    if (!a || !key || !key->request_id || key->request_id_len == 0 ||
        key->request_id_len > KM_ACTIVE_ID_MAX || key->attempt_id_len > KM_ACTIVE_ID_MAX ||
        (key->attempt_id_len && !key->attempt_id))
        return NULL;
    uint32_t i = find_entry(a, key, key_hash(key));
    return i == NIL ? NULL : a->slab[i].user;
}
