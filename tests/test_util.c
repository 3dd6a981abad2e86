/* SPDX-License-Identifier: Apache-2.0 */
/* Helpers for the test suites (see tests/test_util.h): seeds, the brute-force oracle, random
 * workloads and result comparison. Deliberately simple and independent of the library's tables:
 * the oracle is a map from chain hash to a sorted list of holders, and a request's depth for a
 * worker is found by walking the request block by block. */
#include "test_util.h"
#include "sim/trace.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* ---- seeds and random numbers ------------------------------------------------------------- */

static uint64_t test_seed;
static pthread_once_t test_seed_once = PTHREAD_ONCE_INIT;

static void test_seed_choose(void)
{
    const char *env = getenv("KM_TEST_SEED");
    if (env && *env) {
        test_seed = strtoull(env, NULL, 0);
    } else {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        test_seed = ((uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec) ^
                    ((uint64_t)getpid() << 40);
        test_seed %= UINT64_C(10000000000000); /* short enough to copy from a log line */
    }
}

/* Chosen once per process, whichever thread asks first: threads of one test that ask at the same
 * time get the same seed, the one the test logs. */
uint64_t km_test_seed(void)
{
    pthread_once(&test_seed_once, test_seed_choose);
    return test_seed;
}

static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += UINT64_C(0x9E3779B97F4A7C15));
    z = (z ^ (z >> 30)) * UINT64_C(0xBF58476D1CE4E5B9);
    z = (z ^ (z >> 27)) * UINT64_C(0x94D049BB133111EB);
    return z ^ (z >> 31);
}

void km_rng_init(km_rng *r, uint64_t seed)
{
    r->state = seed ^ UINT64_C(0x5851F42D4C957F2D);
}

uint64_t km_rng_next(km_rng *r)
{
    return splitmix64(&r->state);
}

uint32_t km_rng_below(km_rng *r, uint32_t n)
{
    return (uint32_t)(((km_rng_next(r) >> 32) * (uint64_t)n) >> 32);
}

int km_rng_percent(km_rng *r, uint32_t percent)
{
    return km_rng_below(r, 100) < percent;
}

uint64_t km_rng_hash(km_rng *r)
{
    uint64_t h;
    do
        h = km_rng_next(r);
    while (h < 2);
    return h;
}

static void *xrealloc(void *p, size_t bytes)
{
    void *q = realloc(p, bytes ? bytes : 1);
    cr_assert(q != NULL, "test helper out of memory (%zu bytes)", bytes);
    return q;
}

static void *xcalloc(size_t n, size_t size)
{
    void *q = calloc(n ? n : 1, size ? size : 1);
    cr_assert(q != NULL, "test helper out of memory");
    return q;
}

static void set_why(char *why, size_t size, const char *fmt, ...)
{
    if (!why || size == 0)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, size, fmt, ap);
    va_end(ap);
}

/* ---- oracle -------------------------------------------------------------------------------- */

static uint64_t oracle_home(const km_oracle *o, uint64_t key)
{
    uint64_t x = key;
    return splitmix64(&x) & (o->capacity - 1);
}

void km_oracle_init(km_oracle *o, uint32_t max_workers)
{
    memset(o, 0, sizeof *o);
    o->capacity = 1024;
    o->entries = xcalloc(o->capacity, sizeof *o->entries);
    o->max_workers = max_workers;
    o->workers = xcalloc(max_workers, sizeof *o->workers);
}

void km_oracle_free(km_oracle *o)
{
    for (uint64_t i = 0; i < o->capacity; i++)
        free(o->entries[i].workers);
    free(o->entries);
    free(o->workers);
    memset(o, 0, sizeof *o);
}

static km_oracle_entry *oracle_find(const km_oracle *o, uint64_t key)
{
    for (uint64_t i = oracle_home(o, key);; i = (i + 1) & (o->capacity - 1)) {
        km_oracle_entry *e = &o->entries[i];
        if (e->key == key)
            return e;
        if (e->key == 0)
            return NULL;
    }
}

static km_oracle_entry *oracle_get(km_oracle *o, uint64_t key)
{
    km_oracle_entry *e = oracle_find(o, key);
    if (e)
        return e;
    if ((o->used + 1) * 2 > o->capacity) {
        km_oracle_entry *old = o->entries;
        uint64_t old_cap = o->capacity;
        o->capacity *= 2;
        o->entries = xcalloc(o->capacity, sizeof *o->entries);
        for (uint64_t i = 0; i < old_cap; i++) {
            if (old[i].key == 0)
                continue;
            uint64_t j = oracle_home(o, old[i].key);
            while (o->entries[j].key != 0)
                j = (j + 1) & (o->capacity - 1);
            o->entries[j] = old[i];
        }
        free(old);
    }
    uint64_t j = oracle_home(o, key);
    while (o->entries[j].key != 0)
        j = (j + 1) & (o->capacity - 1);
    o->entries[j].key = key;
    o->used++;
    return &o->entries[j];
}

const uint32_t *km_oracle_holders(const km_oracle *o, uint64_t hash, uint32_t *n)
{
    km_oracle_entry *e = hash == 0 ? NULL : oracle_find(o, hash);
    *n = e ? e->n : 0;
    return e && e->n ? e->workers : NULL;
}

static long entry_position(const km_oracle_entry *e, uint32_t worker)
{
    uint32_t lo = 0, hi = e->n;
    while (lo < hi) {
        uint32_t mid = (lo + hi) / 2;
        if (e->workers[mid] < worker)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < e->n && e->workers[lo] == worker ? (long)lo : -1 - (long)lo;
}

int km_oracle_holds(const km_oracle *o, uint32_t worker, uint64_t hash)
{
    km_oracle_entry *e = hash == 0 ? NULL : oracle_find(o, hash);
    return e && entry_position(e, worker) >= 0;
}

static int oracle_add(km_oracle *o, uint32_t worker, uint64_t hash, int position_known,
                      int *known_out)
{
    km_oracle_entry *e = oracle_get(o, hash);
    if (e->n == 0)
        e->position_known = position_known; /* a new key: its metadata comes from this run */
    else if (position_known)
        e->position_known = 1; /* an unknown position gets filled in */
    *known_out = e->position_known;
    long p = entry_position(e, worker);
    if (p >= 0)
        return 0;
    uint32_t at = (uint32_t)(-1 - p);
    if (e->n == e->cap) {
        e->cap = e->cap ? e->cap * 2 : 4;
        e->workers = xrealloc(e->workers, e->cap * sizeof *e->workers);
    }
    memmove(e->workers + at + 1, e->workers + at, (e->n - at) * sizeof *e->workers);
    e->workers[at] = worker;
    if (e->n++ == 0)
        o->blocks++;
    o->pairs++;
    return 1;
}

static int oracle_del(km_oracle *o, uint32_t worker, uint64_t hash)
{
    km_oracle_entry *e = oracle_find(o, hash);
    if (!e)
        return 0;
    long p = entry_position(e, worker);
    if (p < 0)
        return 0;
    memmove(e->workers + p, e->workers + p + 1, (e->n - (uint32_t)p - 1) * sizeof *e->workers);
    if (--e->n == 0) {
        o->blocks--;
        e->position_known = 0;
    }
    o->pairs--;
    return 1;
}

/* The keys worker holds, up to capacity of them written at out; returns how many it holds. */
static size_t oracle_worker_keys(const km_oracle *o, uint32_t worker, uint64_t *out,
                                 size_t capacity)
{
    size_t n = 0;
    for (uint64_t i = 0; i < o->capacity; i++) {
        const km_oracle_entry *e = &o->entries[i];
        if (e->key != 0 && e->n > 0 && entry_position(e, worker) >= 0) {
            if (n < capacity)
                out[n] = e->key;
            n++;
        }
    }
    return n;
}

static uint64_t oracle_clear(km_oracle *o, uint32_t worker)
{
    uint64_t n = 0;
    for (uint64_t i = 0; i < o->capacity; i++) {
        km_oracle_entry *e = &o->entries[i];
        if (e->key != 0 && e->n > 0 && entry_position(e, worker) >= 0)
            n += (uint64_t)oracle_del(o, worker, e->key);
    }
    return n;
}

uint32_t km_oracle_depth(const km_oracle *o, uint32_t worker, const uint64_t *hashes, uint32_t n)
{
    uint32_t d = 0;
    while (d < n && km_oracle_holds(o, worker, hashes[d]))
        d++;
    return d;
}

void km_oracle_apply(km_oracle *o, const km_update *updates, size_t n, km_update_stats *expect)
{
    memset(expect, 0, sizeof *expect);
    for (size_t u = 0; u < n; u++) {
        const km_update *up = &updates[u];
        km_worker_stats *ws = &o->workers[up->worker];
        switch (up->kind) {
        case KM_UPDATE_STORE: {
            int known = 1; /* is the position of the block before hashes[i] known? */
            if (up->parent != KM_NO_PARENT) {
                km_oracle_entry *pe = oracle_find(o, up->parent);
                known = pe && pe->n > 0 && pe->position_known;
                if (!known)
                    expect->orphan_runs++;
            }
            for (size_t i = 0; i < up->n_hashes; i++) {
                if (oracle_add(o, up->worker, up->hashes[i], known, &known)) {
                    expect->stored++;
                    ws->stores++;
                    ws->blocks++;
                } else {
                    expect->duplicate_stores++;
                    ws->duplicate_stores++;
                }
            }
            break;
        }
        case KM_UPDATE_REMOVE:
            for (size_t i = 0; i < up->n_hashes; i++) {
                if (oracle_del(o, up->worker, up->hashes[i])) {
                    expect->removed++;
                    ws->removes++;
                    ws->blocks--;
                } else {
                    expect->absent_removes++;
                    ws->absent_removes++;
                }
            }
            break;
        case KM_UPDATE_CLEAR_WORKER:
        case KM_UPDATE_REMOVE_WORKER: {
            /* The named blocks first; the tables are scanned only for what they leave. */
            uint64_t named = 0;
            for (size_t i = 0; i < up->n_hashes; i++)
                named += (uint64_t)oracle_del(o, up->worker, up->hashes[i]);
            uint64_t rest = oracle_clear(o, up->worker);
            expect->cleared += named + rest;
            expect->clear_scans += rest > 0;
            ws->blocks = 0;
            if (up->kind == KM_UPDATE_CLEAR_WORKER)
                ws->clears++;
            else
                memset(ws, 0, sizeof *ws);
            break;
        }
        case KM_UPDATE_SET_TIER:
            break; /* holdings do not change; tiers are modelled by tests/test_tiers.c */
        }
    }
}

size_t km_oracle_keys(const km_oracle *o, uint64_t *out, size_t capacity)
{
    size_t n = 0;
    for (uint64_t i = 0; i < o->capacity; i++)
        if (o->entries[i].key != 0) {
            if (n < capacity)
                out[n] = o->entries[i].key;
            n++;
        }
    return n;
}

uint32_t km_oracle_match(const km_oracle *o, const uint64_t *hashes, uint32_t n,
                         km_worker_match *out, uint32_t *owner, uint32_t *owner_depth)
{
    *owner = KM_NO_WORKER;
    *owner_depth = 0;
    if (n == 0)
        return 0;
    uint32_t m = 0;
    const uint32_t *w0 = km_oracle_holders(o, hashes[0], &m);
    for (uint32_t j = 0; j < m; j++) {
        out[j].worker = w0[j];
        out[j].depth = km_oracle_depth(o, w0[j], hashes, n);
        if (out[j].depth > *owner_depth) {
            *owner_depth = out[j].depth;
            *owner = w0[j];
        }
    }
    return m;
}

int km_check_results(const km_oracle *o, const km_request *requests, size_t n,
                     const km_match_results *res, uint32_t segment_blocks, char *why,
                     size_t why_size)
{
    if (res->n_requests != n) {
        set_why(why, why_size, "n_requests %zu, expected %zu", res->n_requests, n);
        return 0;
    }
    km_worker_match *expect = xcalloc(o->max_workers, sizeof *expect);
    uint64_t probes = 0;
    int ok = 1;
    for (size_t i = 0; i < n && ok; i++) {
        const km_request_result *rr = &res->requests[i];
        const km_request *q = &requests[i];
        uint32_t owner, owner_depth;
        uint32_t m = km_oracle_match(o, q->hashes, q->n_hashes, expect, &owner, &owner_depth);
        probes += rr->probes;
        uint64_t bound =
            (uint64_t)q->n_hashes + (segment_blocks ? q->n_hashes / segment_blocks : 0);
        if (rr->count != m) {
            set_why(why, why_size, "request %zu (%u blocks): %u workers matched, expected %u", i,
                    q->n_hashes, rr->count, m);
            ok = 0;
        } else if (rr->owner != owner || rr->owner_depth != owner_depth) {
            set_why(why, why_size,
                    "request %zu (%u blocks): owner %u depth %u, expected %u depth %u", i,
                    q->n_hashes, rr->owner, rr->owner_depth, owner, owner_depth);
            ok = 0;
        } else if (rr->first + rr->count > res->n_matches) {
            set_why(why, why_size, "request %zu: entries [%" PRIu64 ", +%u) past n_matches %zu", i,
                    rr->first, rr->count, res->n_matches);
            ok = 0;
        } else if (rr->probes > bound || (q->n_hashes > 0 && rr->probes == 0)) {
            set_why(why, why_size,
                    "request %zu (%u blocks, S=%u): %u probes, outside [1, %" PRIu64 "]", i,
                    q->n_hashes, segment_blocks, rr->probes, bound);
            ok = 0;
        } else {
            const km_worker_match *got = res->matches + rr->first;
            for (uint32_t j = 0; j < m; j++) {
                if (got[j].worker != expect[j].worker || got[j].depth != expect[j].depth) {
                    set_why(why, why_size,
                            "request %zu (%u blocks), entry %u: worker %u depth %u, expected "
                            "worker %u depth %u",
                            i, q->n_hashes, j, got[j].worker, got[j].depth, expect[j].worker,
                            expect[j].depth);
                    ok = 0;
                    break;
                }
            }
        }
    }
    if (ok && probes != res->probes) {
        set_why(why, why_size, "results.probes %" PRIu64 " != sum of request probes %" PRIu64,
                res->probes, probes);
        ok = 0;
    }
    free(expect);
    return ok;
}

int km_check_counters(const km_oracle *o, const km_index *index, char *why, size_t why_size)
{
    km_index_stats st;
    int rc = km_index_get_stats(index, &st);
    if (rc != KM_OK) {
        set_why(why, why_size, "km_index_get_stats: %s", km_error_name(rc));
        return 0;
    }
    if (st.pairs != o->pairs || st.blocks != o->blocks) {
        set_why(why, why_size, "index stats pairs %" PRIu64 " blocks %" PRIu64
                ", expected pairs %" PRIu64 " blocks %" PRIu64, st.pairs, st.blocks, o->pairs,
                o->blocks);
        return 0;
    }
    if (st.memory_cap_bytes != 0 && st.memory_bytes > st.memory_cap_bytes) {
        set_why(why, why_size, "memory %" PRIu64 " over the cap %" PRIu64, st.memory_bytes,
                st.memory_cap_bytes);
        return 0;
    }
    for (uint32_t w = 0; w < o->max_workers; w++) {
        km_worker_stats ws;
        rc = km_index_worker_stats(index, w, &ws);
        if (rc != KM_OK) {
            set_why(why, why_size, "km_index_worker_stats(%u): %s", w, km_error_name(rc));
            return 0;
        }
        const km_worker_stats *e = &o->workers[w];
        if (memcmp(&ws, e, sizeof ws) != 0) {
            set_why(why, why_size,
                    "worker %u stats {blocks %" PRIu64 " stores %" PRIu64 " dup %" PRIu64
                    " removes %" PRIu64 " absent %" PRIu64 " clears %" PRIu64 "}, expected {%"
                    PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64 "}",
                    w, ws.blocks, ws.stores, ws.duplicate_stores, ws.removes, ws.absent_removes,
                    ws.clears, e->blocks, e->stores, e->duplicate_stores, e->removes,
                    e->absent_removes, e->clears);
            return 0;
        }
    }
    return 1;
}

int km_check_index(const km_oracle *o, km_index *index, uint32_t segment_blocks,
                   const km_request *requests, size_t n, km_match_results *res, char *why,
                   size_t why_size)
{
    if (!km_check_counters(o, index, why, why_size))
        return 0;
    uint32_t *buf = xcalloc(o->max_workers, sizeof *buf);
    int ok = 1;
    for (uint64_t i = 0; i < o->capacity && ok; i++) {
        const km_oracle_entry *e = &o->entries[i];
        if (e->key == 0)
            continue;
        uint32_t got = UINT32_MAX;
        int rc = km_index_holders(index, e->key, buf, o->max_workers, &got);
        if (rc != KM_OK) {
            set_why(why, why_size, "km_index_holders: %s", km_error_name(rc));
            ok = 0;
        } else if (got != e->n || (e->n && memcmp(buf, e->workers, e->n * sizeof *buf) != 0)) {
            set_why(why, why_size, "holders of %016" PRIx64 ": %u workers (first %u), expected %u "
                    "(first %u)", e->key, got, got ? buf[0] : 0, e->n, e->n ? e->workers[0] : 0);
            ok = 0;
        }
    }
    free(buf);
    if (!ok)
        return 0;
    int rc = km_index_match_batch(index, requests, n, res);
    if (rc != KM_OK) {
        set_why(why, why_size, "km_index_match_batch: %s (%s)", km_error_name(rc),
                km_index_last_error(index));
        return 0;
    }
    return km_check_results(o, requests, n, res, segment_blocks, why, why_size);
}

int km_update_stats_equal(const km_update_stats *a, const km_update_stats *b, char *why,
                          size_t why_size)
{
    if (memcmp(a, b, sizeof *a) == 0)
        return 1;
    set_why(why, why_size,
            "update stats {stored %" PRIu64 " dup %" PRIu64 " removed %" PRIu64 " absent %" PRIu64
            " cleared %" PRIu64 " orphan_runs %" PRIu64 " clear_scans %" PRIu64
            "}, expected {%" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64
            " %" PRIu64 "}",
            a->stored, a->duplicate_stores, a->removed, a->absent_removes, a->cleared,
            a->orphan_runs, a->clear_scans, b->stored, b->duplicate_stores, b->removed,
            b->absent_removes, b->cleared, b->orphan_runs, b->clear_scans);
    return 0;
}

int km_results_identical(const km_match_results *a, const km_match_results *b, char *why,
                         size_t why_size)
{
    if (a->n_requests != b->n_requests || a->probes != b->probes) {
        set_why(why, why_size, "n_requests %zu/%zu probes %" PRIu64 "/%" PRIu64, a->n_requests,
                b->n_requests, a->probes, b->probes);
        return 0;
    }
    for (size_t i = 0; i < a->n_requests; i++) {
        const km_request_result *x = &a->requests[i], *y = &b->requests[i];
        if (x->first != y->first || x->count != y->count || x->owner != y->owner ||
            x->owner_depth != y->owner_depth || x->probes != y->probes) {
            set_why(why, why_size,
                    "request %zu: {first %" PRIu64 " count %u owner %u depth %u probes %u} vs "
                    "{first %" PRIu64 " count %u owner %u depth %u probes %u}",
                    i, x->first, x->count, x->owner, x->owner_depth, x->probes, y->first, y->count,
                    y->owner, y->owner_depth, y->probes);
            return 0;
        }
        for (uint32_t j = 0; j < x->count; j++) {
            const km_worker_match *p = &a->matches[x->first + j], *q = &b->matches[y->first + j];
            if (p->worker != q->worker || p->depth != q->depth) {
                set_why(why, why_size,
                        "request %zu entry %u: worker %u depth %u vs worker %u depth %u", i, j,
                        p->worker, p->depth, q->worker, q->depth);
                return 0;
            }
        }
    }
    if (a->n_matches != b->n_matches) {
        set_why(why, why_size, "n_matches %zu vs %zu", a->n_matches, b->n_matches);
        return 0;
    }
    return 1;
}

/* ---- corpus -------------------------------------------------------------------------------- */

#define VOCAB 32000u

static void seq_append_random(uint32_t **tokens, size_t *n, size_t *cap, km_rng *r, size_t count)
{
    if (*n + count > *cap) {
        *cap = (*n + count) * 2;
        *tokens = xrealloc(*tokens, *cap * sizeof **tokens);
    }
    for (size_t i = 0; i < count; i++)
        (*tokens)[(*n)++] = km_rng_below(r, VOCAB);
}

static void seq_finish(km_seq *s, uint32_t block_size)
{
    km_hash_config hc = {block_size, NULL, NULL};
    size_t nb = s->n_tokens / block_size;
    s->chain = xcalloc(nb, sizeof *s->chain);
    size_t got = 0;
    int rc = km_hash_sequence(&hc, s->tokens, s->n_tokens, 0, KM_NO_PARENT, NULL, s->chain, &got);
    cr_assert(rc == KM_OK && got == nb, "km_hash_sequence failed while generating a corpus: %s",
              km_error_name(rc));
    s->n_blocks = (uint32_t)nb;
}

void km_corpus_generate(km_corpus *c, km_rng *r, size_t n_seqs, uint32_t block_size,
                        uint32_t max_blocks)
{
    memset(c, 0, sizeof *c);
    c->block_size = block_size;
    c->seqs = xcalloc(n_seqs, sizeof *c->seqs);
    size_t max_tokens = (size_t)max_blocks * block_size;

    /* A few system prompts of 0..3 segments' worth of blocks (S = 32), ending anywhere. */
    size_t n_system = 2 + km_rng_below(r, 4);
    uint32_t **system = xcalloc(n_system, sizeof *system);
    size_t *system_len = xcalloc(n_system, sizeof *system_len);
    for (size_t i = 0; i < n_system; i++) {
        size_t cap = 0;
        seq_append_random(&system[i], &system_len[i], &cap, r,
                          km_rng_below(r, (uint32_t)(block_size * 100)) + 1);
    }

    for (size_t i = 0; i < n_seqs; i++) {
        km_seq *s = &c->seqs[i];
        size_t cap = 0;
        uint32_t kind = i < 4 ? 0 : km_rng_below(r, 100);
        if (kind < 35) {
            /* a new conversation: system prompt + user message */
            size_t p = km_rng_below(r, (uint32_t)n_system);
            s->tokens = xrealloc(s->tokens, (system_len[p] + 1) * sizeof *s->tokens);
            cap = system_len[p] + 1;
            memcpy(s->tokens, system[p], system_len[p] * sizeof *s->tokens);
            s->n_tokens = system_len[p];
            seq_append_random(&s->tokens, &s->n_tokens, &cap, r,
                              km_rng_below(r, block_size * 40) + 1);
        } else if (kind < 90) {
            /* a continuation (next turn: response + user message) or a branch cut anywhere */
            const km_seq *base = &c->seqs[km_rng_below(r, (uint32_t)i)];
            size_t keep = kind < 65 ? base->n_tokens
                                    : km_rng_below(r, (uint32_t)base->n_tokens + 1);
            cap = keep + 1;
            s->tokens = xrealloc(NULL, cap * sizeof *s->tokens);
            memcpy(s->tokens, base->tokens, keep * sizeof *s->tokens);
            s->n_tokens = keep;
            seq_append_random(&s->tokens, &s->n_tokens, &cap, r,
                              km_rng_below(r, block_size * 24) + 1);
        } else {
            seq_append_random(&s->tokens, &s->n_tokens, &cap, r,
                              km_rng_below(r, block_size * 80) + 1);
        }
        if (s->n_tokens > max_tokens)
            s->n_tokens = max_tokens;
        seq_finish(s, block_size);
    }
    for (size_t i = 0; i < n_system; i++)
        free(system[i]);
    free(system);
    free(system_len);
    c->n_seqs = n_seqs;
}

void km_corpus_free(km_corpus *c)
{
    for (size_t i = 0; i < c->n_seqs; i++) {
        free(c->seqs[i].tokens);
        free(c->seqs[i].chain);
    }
    free(c->seqs);
    memset(c, 0, sizeof *c);
}

/* ---- workload ------------------------------------------------------------------------------ */

void km_workload_init(km_workload *w, const km_corpus *c, uint32_t max_workers)
{
    memset(w, 0, sizeof *w);
    w->corpus = c;
    w->max_workers = max_workers;
    w->n_workers_used = max_workers < 24 ? max_workers : 24;
}

static void workload_reset(km_workload *w)
{
    for (size_t i = 0; i < w->n_arrays; i++)
        free(w->arrays[i]);
    w->n_arrays = 0;
    w->n_updates = 0;
}

void km_workload_free(km_workload *w)
{
    workload_reset(w);
    free(w->arrays);
    free(w->updates);
    memset(w, 0, sizeof *w);
}

static uint64_t *workload_array(km_workload *w, size_t n)
{
    if (w->n_arrays == w->arrays_capacity) {
        w->arrays_capacity = w->arrays_capacity ? w->arrays_capacity * 2 : 16;
        w->arrays = xrealloc(w->arrays, w->arrays_capacity * sizeof *w->arrays);
    }
    uint64_t *a = xcalloc(n, sizeof *a);
    w->arrays[w->n_arrays++] = a;
    return a;
}

static km_update *workload_push(km_workload *w, km_update_kind kind, uint32_t worker,
                                uint64_t parent, const uint64_t *hashes, size_t n)
{
    if (w->n_updates == w->updates_capacity) {
        w->updates_capacity = w->updates_capacity ? w->updates_capacity * 2 : 16;
        w->updates = xrealloc(w->updates, w->updates_capacity * sizeof *w->updates);
    }
    km_update *u = &w->updates[w->n_updates++];
    u->kind = kind;
    u->worker = worker;
    u->parent = parent;
    u->hashes = hashes;
    u->n_hashes = n;
    u->tier = KM_TIER_DEVICE;
    return u;
}

static uint32_t workload_worker(km_workload *w, km_rng *r)
{
    /* Mostly a small set of ids (so blocks get shared), sometimes the top ids of the range. */
    if (w->max_workers > w->n_workers_used && km_rng_percent(r, 15))
        return w->max_workers - 1 - km_rng_below(r, 4 < w->max_workers ? 4 : w->max_workers);
    return km_rng_below(r, w->n_workers_used);
}

static void shuffle_hashes(km_rng *r, uint64_t *h, size_t m)
{
    for (size_t i = m; i > 1; i--) {
        size_t j = km_rng_below(r, (uint32_t)i);
        uint64_t t = h[i - 1];
        h[i - 1] = h[j];
        h[j] = t;
    }
}

static void store_range(km_workload *w, uint32_t worker, const km_seq *s, uint32_t a, uint32_t b,
                        uint64_t parent)
{
    uint64_t *h = workload_array(w, b - a);
    memcpy(h, s->chain + a, (b - a) * sizeof *h);
    workload_push(w, KM_UPDATE_STORE, worker, parent, h, b - a);
}

void km_workload_step(km_workload *w, km_rng *r, const km_oracle *o, size_t max_batch)
{
    workload_reset(w);
    const km_corpus *c = w->corpus;
    size_t n = 1 + km_rng_below(r, (uint32_t)max_batch);
    /* Updates inside one batch see the oracle as it was before the batch: the generated batch is
     * still valid, just with more duplicates / absent removes than a real stream. */
    for (size_t k = 0; k < n; k++) {
        const km_seq *s = &c->seqs[km_rng_below(r, (uint32_t)c->n_seqs)];
        if (s->n_blocks == 0)
            continue;
        uint32_t worker = workload_worker(w, r);
        uint32_t held = km_oracle_depth(o, worker, s->chain, s->n_blocks);
        uint32_t kind = km_rng_below(r, 100);
        if (kind < 40) {
            /* continuation: store what follows the worker's held prefix, in 1..3 runs */
            uint32_t a = held == s->n_blocks ? km_rng_below(r, s->n_blocks) : held;
            uint32_t b = a + 1 + km_rng_below(r, s->n_blocks - a);
            uint32_t runs = 1 + km_rng_below(r, 3);
            uint32_t at = a;
            for (uint32_t i = 0; i < runs && at < b; i++) {
                uint32_t end = i + 1 == runs ? b : at + 1 + km_rng_below(r, b - at);
                store_range(w, worker, s, at, end, at ? s->chain[at - 1] : KM_NO_PARENT);
                at = end;
            }
        } else if (kind < 50) {
            /* orphan: a run whose parent is unknown (random) or the real one, maybe unheld */
            uint32_t a = km_rng_below(r, s->n_blocks);
            uint32_t b = a + 1 + km_rng_below(r, s->n_blocks - a);
            uint64_t parent = a == 0 || km_rng_percent(r, 50) ? km_rng_hash(r) : s->chain[a - 1];
            store_range(w, worker, s, a, b, parent);
        } else if (kind < 58) {
            /* out of order: the later half of a continuation arrives first */
            uint32_t a = held == s->n_blocks ? 0 : held;
            uint32_t b = a + 1 + km_rng_below(r, s->n_blocks - a);
            uint32_t m = a + km_rng_below(r, b - a);
            if (m > a && m < b) {
                store_range(w, worker, s, m, b, s->chain[m - 1]);
                store_range(w, worker, s, a, m, a ? s->chain[a - 1] : KM_NO_PARENT);
            } else {
                store_range(w, worker, s, a, b, a ? s->chain[a - 1] : KM_NO_PARENT);
            }
        } else if (kind < 61) {
            /* broadcast: many workers store the same prefix (widely held blocks, bitmap sets) */
            uint32_t b = 1 + km_rng_below(r, s->n_blocks);
            uint32_t count = 5 + km_rng_below(r, w->max_workers < 64 ? w->max_workers : 64);
            uint32_t first = km_rng_below(r, w->max_workers);
            for (uint32_t i = 0; i < count && i < w->max_workers; i++)
                store_range(w, (first + i * 7) % w->max_workers, s, 0, b, KM_NO_PARENT);
        } else if (kind < 66) {
            /* duplicate: restore part of what the worker already holds */
            uint32_t a = held ? km_rng_below(r, held) : 0;
            uint32_t b = a + 1 + km_rng_below(r, s->n_blocks - a);
            store_range(w, worker, s, a, b, a ? s->chain[a - 1] : KM_NO_PARENT);
        } else if (kind < 96) {
            /* remove: head, tail, middle, random subset, or blocks not held; mostly from a
             * worker that holds the sequence's first block, so the removes cut held chains */
            uint32_t nh = 0;
            const uint32_t *hw = km_oracle_holders(o, s->chain[0], &nh);
            if (nh > 0 && km_rng_percent(r, 75))
                worker = hw[km_rng_below(r, nh)];
            uint32_t nb = s->n_blocks;
            uint64_t *h = workload_array(w, nb + 2);
            size_t m = 0;
            uint32_t how = km_rng_below(r, 5);
            uint32_t a = km_rng_below(r, nb), b = a + 1 + km_rng_below(r, nb - a);
            for (uint32_t i = 0; i < nb; i++) {
                int take;
                switch (how) {
                case 0: take = i < b; break;                        /* head */
                case 1: take = i >= a; break;                       /* tail */
                case 2: take = i >= a && i < b; break;              /* middle */
                case 3: take = km_rng_percent(r, 30); break;        /* random subset */
                default: take = i >= a && i < b && km_rng_percent(r, 50); break;
                }
                if (take)
                    h[m++] = s->chain[i];
            }
            if (km_rng_percent(r, 30))
                h[m++] = km_rng_hash(r); /* never stored */
            shuffle_hashes(r, h, m); /* removes come in any order */
            workload_push(w, KM_UPDATE_REMOVE, worker, 0, h, m);
        } else {
            /* clear or remove the worker, mostly naming blocks it holds (as the oracle had it
             * before the batch): all of them, a part, or all with hashes it does not hold */
            km_update_kind clear = kind < 98 ? KM_UPDATE_CLEAR_WORKER : KM_UPDATE_REMOVE_WORKER;
            uint32_t how = km_rng_below(r, 4);
            uint64_t *h = NULL;
            size_t m = 0;
            if (how > 0) {
                size_t nh = oracle_worker_keys(o, worker, NULL, 0);
                h = workload_array(w, nh + 3);
                m = oracle_worker_keys(o, worker, h, nh);
                if (how == 2) {
                    size_t kept = 0;
                    for (size_t i = 0; i < m; i++)
                        if (km_rng_percent(r, 50))
                            h[kept++] = h[i];
                    m = kept;
                } else if (how == 3) {
                    h[m++] = km_rng_hash(r); /* never stored */
                    h[m++] = s->chain[km_rng_below(r, s->n_blocks)]; /* maybe another's */
                    if (m > 2)
                        h[m++] = h[0]; /* named twice */
                }
                shuffle_hashes(r, h, m);
            }
            workload_push(w, clear, worker, 0, h, m);
        }
    }
}

/* ---- requests ------------------------------------------------------------------------------ */

static uint64_t *request_storage(km_request_set *s, size_t n)
{
    if (s->storage == NULL || s->storage_used + n > s->storage_capacity) {
        s->storage_capacity = (s->storage_used + n) * 2 + 64;
        s->storage = xrealloc(s->storage, s->storage_capacity * sizeof *s->storage);
    }
    uint64_t *p = s->storage + s->storage_used;
    s->storage_used += n;
    return p;
}

void km_request_set_generate(km_request_set *s, km_rng *r, const km_corpus *c, size_t n)
{
    s->requests = xrealloc(s->requests, (n ? n : 1) * sizeof *s->requests);
    s->storage_used = 0;
    size_t *offsets = xcalloc(n, sizeof *offsets);
    for (size_t i = 0; i < n; i++) {
        const km_seq *q = &c->seqs[km_rng_below(r, (uint32_t)c->n_seqs)];
        uint32_t kind = km_rng_below(r, 100);
        uint32_t len;
        uint64_t *h;
        if (kind < 3 || (q->n_blocks == 0 && kind < 80)) {
            len = 0;
            h = request_storage(s, 0);
        } else if (kind < 45) { /* prefix */
            len = 1 + km_rng_below(r, q->n_blocks);
            h = request_storage(s, len);
            memcpy(h, q->chain, len * sizeof *h);
        } else if (kind < 60) { /* whole chain */
            len = q->n_blocks;
            h = request_storage(s, len);
            memcpy(h, q->chain, len * sizeof *h);
        } else if (kind < 80) { /* extension: the chain continued with unseen blocks */
            uint32_t extra = 1 + km_rng_below(r, 40);
            len = q->n_blocks + extra;
            h = request_storage(s, len);
            memcpy(h, q->chain, q->n_blocks * sizeof *h);
            for (uint32_t j = q->n_blocks; j < len; j++)
                h[j] = j ? km_hash_chain_step(h[j - 1], km_rng_next(r))
                         : km_hash_chain_root(km_rng_next(r));
        } else if (kind < 90 && q->n_blocks > 1) {
            /* a sibling branch: the same tokens with one token changed anywhere (mid-block and
             * mid-segment included), hashed again, so the chain diverges at that block. (Replacing
             * one chain hash in place would not be a chain: scoring may rely on a chain hash
             * naming its whole prefix.) */
            len = q->n_blocks;
            size_t nt = (size_t)len * c->block_size;
            uint32_t *t = xcalloc(nt, sizeof *t);
            memcpy(t, q->tokens, nt * sizeof *t);
            t[km_rng_below(r, (uint32_t)nt)] += 1 + km_rng_below(r, 1000);
            km_hash_config hc = {c->block_size, NULL, NULL};
            h = request_storage(s, len);
            size_t got = 0;
            int rc = km_hash_sequence(&hc, t, nt, 0, KM_NO_PARENT, NULL, h, &got);
            cr_assert(rc == KM_OK && got == len, "km_hash_sequence failed in a request generator");
            free(t);
        } else { /* unrelated */
            len = 1 + km_rng_below(r, 64);
            h = request_storage(s, len);
            for (uint32_t j = 0; j < len; j++)
                h[j] = km_rng_hash(r);
        }
        offsets[i] = (size_t)(h - s->storage);
        s->requests[i].n_hashes = len;
    }
    for (size_t i = 0; i < n; i++)
        s->requests[i].hashes = s->storage + offsets[i];
    free(offsets);
    s->n = n;
}

void km_request_set_free(km_request_set *s)
{
    free(s->requests);
    free(s->storage);
    memset(s, 0, sizeof *s);
}

/* ---- the Mooncake trace -------------------------------------------------------------------- */

int km_trace_case_load(km_trace_case *tc, uint32_t block_size, size_t max_requests, char *why,
                       size_t why_size)
{
    memset(tc, 0, sizeof *tc);
    km_trace trace = {0};
    const char *path = km_trace_default_path();
    char err[512] = "";
    int rc = km_trace_load_mooncake(path, &trace, err, sizeof err);
    if (rc != KM_OK) {
        set_why(why, why_size, "%s: %s (%s)", path, km_error_name(rc), err);
        return rc;
    }
    size_t n = trace.n_requests < max_requests ? trace.n_requests : max_requests;
    size_t total = 0;
    for (size_t i = 0; i < n; i++)
        total += km_trace_max_blocks(&trace.requests[i], block_size, 512);
    tc->hashes = xcalloc(total, sizeof *tc->hashes);
    tc->offset = xcalloc(n, sizeof *tc->offset);
    tc->n_blocks = xcalloc(n, sizeof *tc->n_blocks);
    tc->session = xcalloc(n, sizeof *tc->session);
    size_t at = 0;
    for (size_t i = 0; i < n; i++) {
        const km_trace_request *r = &trace.requests[i];
        uint32_t got = 0;
        rc = km_trace_chain_hashes(r, block_size, 512, tc->hashes + at, &got);
        if (rc != KM_OK) {
            set_why(why, why_size, "km_trace_chain_hashes(request %zu): %s", i, km_error_name(rc));
            km_trace_free(&trace);
            return rc;
        }
        tc->offset[i] = at;
        tc->n_blocks[i] = got;
        tc->session[i] = r->n_ids > 1 ? r->ids[1] : (r->n_ids ? r->ids[0] : 0);
        at += got;
    }
    tc->n = n;
    km_trace_free(&trace);
    return KM_OK;
}

void km_trace_case_free(km_trace_case *tc)
{
    free(tc->hashes);
    free(tc->offset);
    free(tc->n_blocks);
    free(tc->session);
    memset(tc, 0, sizeof *tc);
}

typedef struct scenario_batch {
    km_update u[8];
    size_t n;
    km_oracle *o;
    km_apply_fn apply;
    void *ctx;
} scenario_batch;

static void scenario_flush(scenario_batch *b)
{
    if (b->n == 0)
        return;
    km_update_stats expect;
    km_oracle_apply(b->o, b->u, b->n, &expect);
    b->apply(b->ctx, b->u, b->n, &expect);
    b->n = 0;
}

static void scenario_push(scenario_batch *b, km_update u)
{
    b->u[b->n++] = u;
    if (b->n == 8)
        scenario_flush(b);
}

void km_trace_scenario(const km_trace_case *tc, size_t n_state, uint32_t max_workers,
                       int affinity, km_rng *r, km_oracle *o, km_apply_fn apply, void *ctx)
{
    scenario_batch b = {.o = o, .apply = apply, .ctx = ctx};
    if (n_state > tc->n)
        n_state = tc->n;
    uint32_t *worker_of = xcalloc(n_state, sizeof *worker_of);
    uint64_t *subset = NULL;
    size_t subset_cap = 0;
    for (size_t i = 0; i < n_state; i++) {
        uint32_t w = affinity ? tc->session[i] % max_workers : (uint32_t)(i % max_workers);
        worker_of[i] = w;
        const uint64_t *h = tc->hashes + tc->offset[i];
        uint32_t n = tc->n_blocks[i];
        scenario_flush(&b); /* so the depth below sees every earlier update */
        uint32_t d = km_oracle_depth(o, w, h, n);
        if (d < n)
            scenario_push(&b, (km_update){KM_UPDATE_STORE, w, d ? h[d - 1] : KM_NO_PARENT, h + d,
                                          n - d, KM_TIER_DEVICE});
        if (i % 500 == 499) {
            for (int k = 0; k < 3; k++) {
                size_t j = km_rng_below(r, (uint32_t)i + 1);
                uint32_t nj = tc->n_blocks[j];
                if (nj == 0)
                    continue;
                uint32_t from = km_rng_below(r, nj);
                scenario_push(&b, (km_update){KM_UPDATE_REMOVE, worker_of[j], 0,
                                              tc->hashes + tc->offset[j] + from, nj - from,
                                              KM_TIER_DEVICE});
            }
        }
    }
    scenario_flush(&b);
    /* Random subsets of a few workers' requests. */
    for (int k = 0; k < 6 && n_state > 0; k++) {
        size_t j = km_rng_below(r, (uint32_t)n_state);
        uint32_t nj = tc->n_blocks[j];
        if (nj > subset_cap) {
            subset_cap = nj;
            subset = xrealloc(subset, subset_cap * sizeof *subset);
        }
        size_t m = 0;
        for (uint32_t i = 0; i < nj; i++)
            if (km_rng_percent(r, 25))
                subset[m++] = tc->hashes[tc->offset[j] + i];
        km_update u = {KM_UPDATE_REMOVE, worker_of[j], 0, subset, m, KM_TIER_DEVICE};
        km_update_stats expect;
        km_oracle_apply(o, &u, 1, &expect);
        apply(ctx, &u, 1, &expect);
    }
    scenario_push(&b,
                  (km_update){KM_UPDATE_CLEAR_WORKER, km_rng_below(r, max_workers), 0, NULL, 0, KM_TIER_DEVICE});
    scenario_push(&b,
                  (km_update){KM_UPDATE_CLEAR_WORKER, km_rng_below(r, max_workers), 0, NULL, 0, KM_TIER_DEVICE});
    scenario_push(&b,
                  (km_update){KM_UPDATE_REMOVE_WORKER, km_rng_below(r, max_workers), 0, NULL, 0, KM_TIER_DEVICE});
    scenario_flush(&b);
    free(subset);
    free(worker_of);
}

/* ---- misc ---------------------------------------------------------------------------------- */

static void count_log(void *user, const char *line)
{
    (void)line;
    if (user)
        (*(int *)user)++;
}

void km_test_config(km_index_config *cfg, int *log_counter)
{
    km_index_config_init(cfg);
    cfg->log = count_log;
    cfg->log_user = log_counter;
}

void km_test_cap_server_index_at_creation(km_server_config *cfg)
{
    km_index_config ic;
    km_test_config(&ic, NULL);
    ic.max_workers = cfg->max_workers;
    ic.backend = cfg->backend;
    ic.threads = cfg->index_threads;
    ic.initial_blocks = 256;
    km_index *probe = NULL;
    cr_assert_eq(km_index_create(&ic, &probe), KM_OK);
    km_index_stats ist;
    cr_assert_eq(km_index_get_stats(probe, &ist), KM_OK);
    km_index_destroy(probe);
    cfg->index_initial_blocks = ic.initial_blocks;
    cfg->index_memory_cap_bytes = ist.memory_bytes;
}

km_index *km_test_growing_index(uint32_t max_workers, uint32_t segment_blocks, uint32_t threads)
{
    km_index_config cfg;
    km_test_config(&cfg, NULL);
    cfg.backend = KM_BACKEND_CPU;
    cfg.max_workers = max_workers;
    cfg.segment_blocks = segment_blocks;
    cfg.threads = threads;
    cfg.initial_blocks = 256;
    km_index *index = NULL;
    int rc = km_index_create(&cfg, &index);
    cr_assert_eq(rc, KM_OK, "km_index_create: %s", km_error_name(rc));
    return index;
}

int km_growth_update(km_rng *r, const km_corpus *corpus, uint32_t W, km_update *u, uint64_t tail[8])
{
    const km_seq *q = &corpus->seqs[km_rng_below(r, (uint32_t)corpus->n_seqs)];
    if (q->n_blocks == 0)
        return 0;
    uint32_t w = km_rng_below(r, W);
    *u = (km_update){KM_UPDATE_STORE, w, KM_NO_PARENT, q->chain, q->n_blocks, KM_TIER_DEVICE};
    if (km_rng_percent(r, 15)) {
        uint32_t n = q->n_blocks < 8 ? q->n_blocks : 8;
        memcpy(tail, q->chain + q->n_blocks - n, n * sizeof *tail);
        *u = (km_update){KM_UPDATE_REMOVE, w, KM_NO_PARENT, tail, n, KM_TIER_DEVICE};
    }
    return 1;
}

double km_test_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int km_test_run_capture(const char *command, char *out, size_t out_size)
{
    char cmd[8300];
    snprintf(cmd, sizeof cmd, "%s 2>&1", command);
    out[0] = '\0';
    FILE *p = popen(cmd, "r");
    if (!p)
        return -1;
    size_t n = fread(out, 1, out_size - 1, p);
    out[n] = '\0';
    char sink[4096];
    while (fread(sink, 1, sizeof sink, p) > 0) {
    }
    int status = pclose(p);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

long km_test_resident_mib(int pid)
{
    char path[64], line[256];
    if (pid)
        snprintf(path, sizeof path, "/proc/%d/status", pid);
    else
        snprintf(path, sizeof path, "/proc/self/status");
    FILE *f = fopen(path, "r");
    long kb = -1;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "VmRSS: %ld kB", &kb) == 1)
            break;
    if (f)
        fclose(f);
    return kb < 0 ? -1 : kb / 1024;
}

void km_test_die_with_parent(int parent)
{
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != (pid_t)parent)
        _exit(126);
}
