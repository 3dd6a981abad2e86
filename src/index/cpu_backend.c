/* SPDX-License-Identifier: Apache-2.0 */
/* The CPU backend: scores requests straight from the host tables with the per-element walk steps
 * of src/index/slot_walk.h (those km_walk_request is made of), across a persistent pool of threads
 * (src/index/thread_pool.h). A batch runs in two phases: each request's entry count (its block 0's
 * holder count) first, so every walk then writes its entries straight into their final place in
 * the results. Lanes claim requests in small chunks, so a slow or late lane never holds the batch
 * up, and each lane walks several requests interleaved, one lookup per request per turn with the
 * next one prefetched, so several DRAM misses are always in flight per thread. */
#include <stdatomic.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "base/array.h"
#include "index/thread_pool.h"
#include "index/index_internal.h"

/* ---- scoring --------------------------------------------------------------------------- */

/* The walk's entries are written straight into km_worker_match arrays. */
_Static_assert(sizeof(km_walk_entry) == sizeof(km_worker_match) &&
                   offsetof(km_walk_entry, worker) == offsetof(km_worker_match, worker) &&
                   offsetof(km_walk_entry, depth) == offsetof(km_worker_match, depth),
               "km_walk_entry and km_worker_match must share a layout");

typedef struct cpu_lane {
    uint64_t *scratch; /* KM_WALK_SCRATCH_WORDS(max_workers) per request in flight */
    int status;
} cpu_lane;

typedef struct cpu_state {
    km_thread_pool *pool; /* NULL when single-threaded */
    uint32_t n_lanes;
    cpu_lane *lanes;
    uint64_t *slot0; /* per request of the batch: its block 0's slot, found by the count phase */
    size_t slot0_capacity;
} cpu_state;

/* One batch, run by every lane that joins it, in two phases:
 *   1. count: each request's entry count is the holder count of its block 0, known from one
 *      lookup, so every request's output can be placed exactly and the walks write in place (no
 *      copy of the batch's results, which at 1024 workers are ~8 KB per request);
 *   2. walk: every request is walked straight into its place, from the block 0 slot the count
 *      found.
 * Both phases hand out requests in chunks. The lane that completes the last count chunk lays the
 * results out (prefix sums, one reserve) and opens phase 2; a lane with no count chunk left waits
 * for that, which is only ever a lane in the middle of a chunk. */
enum { PHASE_COUNT = 0, PHASE_WALK = 1, PHASE_FAILED = 2 };

typedef struct match_job {
    const km_index *index;
    const km_request *requests;
    size_t n_requests;
    km_match_results *results;
    uint64_t *slot0; /* n_requests: written by phase 1, read by phase 2 */
    cpu_state *state;
    atomic_size_t next_count; /* phase 1: the next unclaimed request */
    atomic_size_t counted;    /* phase 1: requests whose count is written */
    atomic_int phase;
    atomic_size_t next_walk;  /* phase 2: the next unclaimed request */
    size_t total_matches;     /* written before phase becomes PHASE_WALK */
} match_job;

#define CPU_COUNT_CHUNK 64u
#define CPU_WALK_CHUNK 8u

/* Phase 1 for requests [r, end): block 0's slot is prefetched 8 requests ahead and the line of
 * the request's hash array holding block 0 16 ahead (the slot's address needs the hash). */
static void count_chunk(match_job *job, const km_table_view *blocks, size_t r, size_t end)
{
    const km_request *requests = job->requests;
    for (size_t k = r; k < end && k < r + 16; k++)
        if (requests[k].n_hashes)
            __builtin_prefetch(requests[k].hashes, 0, 1);
    for (size_t k = r; k < end && k < r + 8; k++)
        if (requests[k].n_hashes)
            km_view_prefetch(blocks, requests[k].hashes[0]);
    for (; r < end; r++) {
        if (r + 16 < end && requests[r + 16].n_hashes)
            __builtin_prefetch(requests[r + 16].hashes, 0, 1);
        if (r + 8 < end && requests[r + 8].n_hashes)
            km_view_prefetch(blocks, requests[r + 8].hashes[0]);
        const km_request *req = &requests[r];
        uint64_t slot = req->n_hashes ? km_view_find(blocks, req->hashes[0]) : KM_SLOT_NONE;
        job->slot0[r] = slot;
        job->results->requests[r].count = slot == KM_SLOT_NONE ? 0 : km_slot_count(km_view_slot(blocks, slot));
    }
}

/* Between the phases, on the lane that completed the last count chunk. */
static void lay_out_results(match_job *job)
{
    km_match_results *results = job->results;
    size_t total = 0;
    for (size_t i = 0; i < job->n_requests; i++) {
        results->requests[i].first = total;
        total += results->requests[i].count;
    }
    job->total_matches = total;
    int ok = km_match_results_reserve(results, job->n_requests, total) == KM_OK;
    atomic_store_explicit(&job->phase, ok ? PHASE_WALK : PHASE_FAILED, memory_order_release);
}

/* Phase 2: the lane's claimed requests, walked CPU_WALK_INFLIGHT at a time, interleaved. A walk is
 * a chain of lookups (block 0, then segment keys, then the blocks of a segment where workers drop
 * out), each known only once the one before it has been answered; one request alone leaves the
 * core waiting on memory at every step. So each request in flight makes one lookup per turn and
 * prefetches the slot (and the hash-array line) of its next lookup before the lane turns to the
 * next request: by the time its turn comes back, the line has arrived. The steps are those of
 * km_walk_request (the same per-element functions of src/index/slot_walk.h, in the same order for
 * each request), so the results and the probe counts are identical. */
#define CPU_WALK_INFLIGHT 12u
/* Scratch for the requests in flight is capped; at large max_workers fewer are in flight. */
#define CPU_WALK_SCRATCH_CAP_BYTES (256u << 10)

enum {
    WALK_IDLE = 0,  /* no request */
    WALK_START,     /* its block 0 slot and first hash-array lines are being fetched */
    WALK_BLOCK0,    /* block 0's holders (its slot found by the count phase) are opened next */
    WALK_SEGMENT,   /* the lookup of segment key k is next */
    WALK_BLOCKS,    /* the lookup of block i of the range [i, last] is next */
};

typedef struct walk_flight {
    int step;
    int in_segment;     /* WALK_BLOCKS: the range is segment k (else the blocks after the last one) */
    size_t r;           /* the request */
    const uint64_t *hashes;
    uint32_t n, k, i, last, next, probes;
    uint32_t owner, owner_depth; /* the deepest worker settled so far (km_walk_block_step) */
    uint64_t slot0;
    uint64_t *open, *kept, *tmp;
    uint32_t *depth_of;
} walk_flight;

static uint32_t walk_inflight_for(uint32_t max_workers)
{
    size_t bytes = KM_WALK_SCRATCH_WORDS((size_t)max_workers) * sizeof(uint64_t);
    size_t fit = CPU_WALK_SCRATCH_CAP_BYTES / bytes;
    return fit < 1 ? 1 : fit > CPU_WALK_INFLIGHT ? CPU_WALK_INFLIGHT : (uint32_t)fit;
}

/* The walk's steps are inlined into each specialisation of walk_lane_requests. */
#define WALK_INLINE __attribute__((always_inline))

typedef struct walk_ctx {
    match_job *job;
    const km_table_view *blocks, *segments;
    uint32_t S, W;
    size_t r, end; /* the lane's claimed chunk: requests [r, end) not yet started */
} walk_ctx;

/* The next request this lane may walk, or SIZE_MAX when the batch has none left. */
static size_t walk_claim(walk_ctx *c)
{
    if (c->r == c->end) {
        size_t n = c->job->n_requests;
        size_t r = atomic_fetch_add_explicit(&c->job->next_walk, CPU_WALK_CHUNK, memory_order_relaxed);
        if (r >= n)
            return SIZE_MAX;
        c->r = r;
        c->end = r + CPU_WALK_CHUNK < n ? r + CPU_WALK_CHUNK : n;
    }
    return c->r++;
}

/* Make block i (of a range ending at last) the flight's next lookup: its slot and the hash-array
 * line a few blocks on are prefetched. */
KM_PREFETCHER static inline void walk_enter_block(walk_ctx *c, walk_flight *f, uint32_t i)
{
    f->step = WALK_BLOCKS;
    f->i = i;
    km_view_prefetch(c->blocks, f->hashes[i]);
    if (i + 1 <= f->last)
        km_view_prefetch(c->blocks, f->hashes[i + 1]);
    if (i + 8 <= f->last)
        __builtin_prefetch(&f->hashes[i + 8], 0, 1);
}

/* The flight's next lookup after every open worker was found to hold [0, next): segment key k,
 * the blocks after the last whole segment, or none (0: the walk is over). */
WALK_INLINE static inline int walk_continue(walk_ctx *c, walk_flight *f, uint64_t any)
{
    uint32_t S = c->S, n = f->n;
    if (!any)
        return 0;
    if (S > 0 && (f->k + 1) * S <= n) {
        f->step = WALK_SEGMENT;
        km_view_prefetch(c->segments, f->hashes[(f->k + 1) * S - 1]);
        /* The lines the step after may read: the next segment's first block and its key (this
         * segment's were fetched the step before). */
        if ((f->k + 1) * S < n)
            km_prefetch_segment_input(f->hashes, S, f->k + 1, n);
        return 1;
    }
    if (f->next < n) {
        f->in_segment = 0;
        f->last = n - 1;
        walk_enter_block(c, f, f->next);
        return 1;
    }
    return 0;
}

/* One turn of a flight: its one lookup, then the next one set up. Returns 0 when the walk is over
 * (its entries are then written by walk_finish). */
WALK_INLINE static inline int walk_turn(walk_ctx *c, walk_flight *f)
{
    uint32_t S = c->S;
    switch (f->step) {
    case WALK_START:
        f->step = WALK_BLOCK0;
        KM_PREFETCH(km_view_slot(c->blocks, f->slot0));
        if (S > 0 && S <= f->n)
            km_view_prefetch(c->segments, f->hashes[S - 1]);
        return 1;
    case WALK_BLOCK0: /* block 0's lookup was made by the count phase */
        km_walk_open_holders(c->blocks, f->slot0, f->open, f->tmp);
        f->next = 1;
        f->k = 0;
        return walk_continue(c, f, 1);
    case WALK_SEGMENT: {
        uint32_t last = (f->k + 1) * S - 1;
        f->probes++;
        if (km_walk_segment_split(c->segments, f->hashes[last], f->open, f->kept) &&
            f->next <= last) {
            f->in_segment = 1;
            f->last = last;
            walk_enter_block(c, f, f->next);
            return 1;
        }
        f->next = last + 1;
        f->k++;
        return walk_continue(c, f, km_walk_segment_rejoin(c->W, f->open, f->kept));
    }
    case WALK_BLOCKS: {
        f->probes++;
        uint64_t any = km_walk_block_step(c->blocks, f->hashes[f->i], f->i, f->open, f->tmp,
                                          f->depth_of, &f->owner, &f->owner_depth);
        if (any && f->i < f->last) {
            walk_enter_block(c, f, f->i + 1);
            return 1;
        }
        if (!f->in_segment)
            return 0;
        f->next = f->last + 1;
        f->k++;
        return walk_continue(c, f, km_walk_segment_rejoin(c->W, f->open, f->kept));
    }
    }
    return 0;
}

/* A flight whose walk is over: its entries written in place. */
WALK_INLINE static inline int walk_finish(walk_ctx *c, walk_flight *f)
{
    km_match_results *results = c->job->results;
    km_request_result *res = &results->requests[f->r];
    uint32_t owner = f->owner, owner_depth = f->owner_depth, m = 0;
    if (f->n > 0 && f->slot0 != KM_SLOT_NONE)
        m = km_walk_emit_all(c->blocks, f->slot0, f->n, f->open, f->depth_of,
                             (km_walk_entry *)(results->matches + res->first), &owner,
                             &owner_depth);
    if (m != res->count) /* the tables cannot change between the phases */
        return KM_ERR_INTERNAL;
    res->owner = owner;
    res->owner_depth = owner_depth;
    res->probes = f->probes;
    f->step = WALK_IDLE;
    return KM_OK;
}

/* Put the lane's next request into an idle flight; 0 when none is left. */
WALK_INLINE static inline int walk_load(walk_ctx *c, walk_flight *f)
{
    size_t r = walk_claim(c);
    if (r == SIZE_MAX)
        return 0;
    const km_request *req = &c->job->requests[r];
    f->r = r;
    f->hashes = req->hashes;
    f->n = req->n_hashes;
    f->probes = f->n > 0; /* block 0's lookup */
    f->owner = 0xFFFFFFFFu;
    f->owner_depth = 0;
    f->slot0 = c->job->slot0[r];
    if (f->slot0 == KM_SLOT_NONE) {
        f->step = WALK_IDLE; /* no blocks, or no holder of block 0: finished at once */
        return 1;
    }
    f->step = WALK_START;
    __builtin_prefetch(f->hashes, 0, 1);
    if (c->S > 0 && c->S <= f->n)
        __builtin_prefetch(&f->hashes[c->S - 1], 0, 1);
    return 1;
}

/* The lane's walks. Inlined twice (walk_interleaved); with one_word (both tables' sets are one
 * word: up to 64 workers) the views' words_per_set is the constant 1, so every per-word loop of
 * the steps folds away. */
WALK_INLINE static inline int walk_lane_requests(match_job *job, cpu_lane *lane,
                                                 const km_table_view *blocks_in,
                                                 const km_table_view *segments_in, int one_word)
{
    km_table_view blocks_view = *blocks_in, segments_view = *segments_in;
    if (one_word) {
        blocks_view.words_per_set = 1;
        segments_view.words_per_set = 1;
    }
    const km_table_view *blocks = &blocks_view, *segments = &segments_view;
    walk_ctx c = {.job = job, .blocks = blocks, .segments = segments,
                  .S = job->index->config.segment_blocks, .W = blocks->words_per_set};
    uint32_t max_workers = job->index->config.max_workers;
    size_t words = KM_WALK_SCRATCH_WORDS((size_t)max_workers);
    uint32_t n_flights = walk_inflight_for(max_workers);
    walk_flight flights[CPU_WALK_INFLIGHT];
    uint32_t active = 0;
    for (uint32_t s = 0; s < n_flights; s++) {
        walk_flight *f = &flights[s];
        uint64_t *scratch = lane->scratch + s * words;
        f->open = scratch;
        f->kept = scratch + c.W;
        f->tmp = scratch + 2u * c.W;
        f->depth_of = (uint32_t *)(scratch + 3u * c.W);
        f->step = WALK_IDLE;
    }
    /* Fill every flight; a request with no blocks finishes on the spot. */
    int more = 1;
    for (uint32_t s = 0; s < n_flights && more; s++) {
        walk_flight *f = &flights[s];
        while ((more = walk_load(&c, f)) && f->step == WALK_IDLE) {
            int rc = walk_finish(&c, f);
            if (rc)
                return rc;
        }
        active += more;
    }
    while (active) {
        for (uint32_t s = 0; s < n_flights; s++) {
            walk_flight *f = &flights[s];
            if (f->step == WALK_IDLE || walk_turn(&c, f))
                continue;
            int rc = walk_finish(&c, f);
            if (rc)
                return rc;
            while ((more = walk_load(&c, f)) && f->step == WALK_IDLE) {
                rc = walk_finish(&c, f);
                if (rc)
                    return rc;
            }
            active -= !more;
        }
    }
    return KM_OK;
}

static int walk_interleaved(match_job *job, cpu_lane *lane, const km_table_view *blocks,
                            const km_table_view *segments)
{
    if (blocks->words_per_set == 1 && segments->words_per_set == 1)
        return walk_lane_requests(job, lane, blocks, segments, 1);
    return walk_lane_requests(job, lane, blocks, segments, 0);
}

static void match_lane(void *p, uint32_t lane_index)
{
    match_job *job = p;
    cpu_lane *lane = &job->state->lanes[lane_index];
    km_table_view blocks = km_table_get_view(&job->index->blocks);
    km_table_view segments = km_table_get_view(&job->index->segments);
    size_t n = job->n_requests;
    for (;;) {
        size_t r = atomic_fetch_add_explicit(&job->next_count, CPU_COUNT_CHUNK, memory_order_relaxed);
        if (r >= n)
            break;
        size_t end = r + CPU_COUNT_CHUNK < n ? r + CPU_COUNT_CHUNK : n;
        count_chunk(job, &blocks, r, end);
        /* acq_rel: the last lane to finish sees every other lane's counts. */
        if (atomic_fetch_add_explicit(&job->counted, end - r, memory_order_acq_rel) + (end - r) == n)
            lay_out_results(job);
    }
    uint32_t spins = 0;
    int phase;
    while ((phase = atomic_load_explicit(&job->phase, memory_order_acquire)) == PHASE_COUNT)
        km_spin_relax(&spins);
    if (phase == PHASE_FAILED)
        return;
    int rc = walk_interleaved(job, lane, &blocks, &segments);
    km_walk_entries_fence(); /* before the pool or the caller learns that this lane is done */
    if (rc)
        lane->status = rc;
}

static int cpu_create(km_index *index, void **state_out, char *why, size_t why_size)
{
    (void)why;
    (void)why_size;
    cpu_state *state = calloc(1, sizeof *state);
    if (!state)
        return KM_ERR_OUT_OF_MEMORY;
    uint32_t threads = index->config.threads ? index->config.threads : 1;
    state->n_lanes = threads;
    state->lanes = calloc(threads, sizeof *state->lanes);
    if (!state->lanes)
        goto oom;
    uint32_t max_workers = index->config.max_workers;
    for (uint32_t i = 0; i < threads; i++) {
        state->lanes[i].scratch = malloc(walk_inflight_for(max_workers) *
                                         KM_WALK_SCRATCH_WORDS((size_t)max_workers) * sizeof(uint64_t));
        if (!state->lanes[i].scratch)
            goto oom;
    }
    if (threads > 1) {
        state->pool = km_thread_pool_create(threads - 1, "km-index");
        if (!state->pool)
            goto oom;
    }
    *state_out = state;
    return KM_OK;
oom:
    km_backend_cpu.destroy(state);
    return KM_ERR_OUT_OF_MEMORY;
}

static void cpu_destroy(void *p)
{
    cpu_state *state = p;
    if (!state)
        return;
    km_thread_pool_destroy(state->pool);
    for (uint32_t i = 0; state->lanes && i < state->n_lanes; i++) {
        free(state->lanes[i].scratch);
    }
    free(state->lanes);
    free(state->slot0);
    free(state);
}

/* Below this many requests a batch is scored on the calling thread alone. */
#define CPU_MIN_REQUESTS_PER_LANE 16

static int cpu_match(void *p, km_index *index, const km_request *requests, size_t n,
                     km_match_results *results)
{
    cpu_state *state = p;
    if (n == 0) { /* no count chunk would ever open phase 2 */
        results->n_matches = 0;
        results->probes = 0;
        return KM_OK;
    }
    if (KM_ARRAY_GROW(state->slot0, state->slot0_capacity, n, 1024))
        return km_index_fail(index, KM_ERR_OUT_OF_MEMORY, "cpu scoring scratch for %zu requests", n);
    match_job job = {.index = index, .requests = requests, .n_requests = n, .results = results,
                     .slot0 = state->slot0, .state = state};
    atomic_init(&job.next_count, 0);
    atomic_init(&job.counted, 0);
    atomic_init(&job.phase, PHASE_COUNT);
    atomic_init(&job.next_walk, 0);
    for (uint32_t l = 0; l < state->n_lanes; l++)
        state->lanes[l].status = KM_OK;
    if (state->pool && n >= (size_t)state->n_lanes * CPU_MIN_REQUESTS_PER_LANE)
        km_thread_pool_run(state->pool, match_lane, &job);
    else
        match_lane(&job, 0);
    if (atomic_load(&job.phase) == PHASE_FAILED)
        return km_index_fail(index, KM_ERR_OUT_OF_MEMORY, "results for %zu matches",
                             job.total_matches);
    for (uint32_t l = 0; l < state->n_lanes; l++)
        if (state->lanes[l].status)
            return km_index_fail(index, state->lanes[l].status,
                                 "cpu scoring: tables changed during a batch");
    uint64_t probes = 0;
    for (size_t i = 0; i < n; i++)
        probes += results->requests[i].probes;
    results->n_matches = job.total_matches;
    results->probes = probes;
    return KM_OK;
}

const km_backend_ops km_backend_cpu = {
    .name = "cpu",
    .create = cpu_create,
    .destroy = cpu_destroy,
    .sync = NULL,
    .match = cpu_match,
    .needs_dirty_tracking = 0,
};
