/* The CPU backend: scores requests straight from the host tables with km_walk_request (the code
 * the CUDA kernel runs), across a persistent pool of threads. Requests are split into contiguous
 * slices of roughly equal block counts; inside a slice, the next request's first lookups are
 * prefetched while the current one walks, and the walk itself prefetches KM_PREFETCH_AHEAD keys
 * ahead, so several DRAM misses are always in flight per thread. A batch runs in two phases: each
 * request's entry count (its block 0's holder count) first, so every walk then writes its entries
 * straight into their final place in the results. */
#include <pthread.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "index_impl.h"

/* ---- a minimal persistent thread pool ------------------------------------------------------ */

typedef void (*pool_job)(void *arg, uint32_t thread_index);

typedef struct km_thread_pool {
    pthread_t *threads;
    uint32_t n_threads; /* helper threads; the caller is thread n_threads */
    pthread_mutex_t mutex;
    pthread_cond_t start;
    pthread_cond_t done;
    uint64_t generation;
    uint32_t pending;
    int stop;
    pool_job job;
    void *arg;
} km_thread_pool;

typedef struct pool_thread_arg {
    km_thread_pool *pool;
    uint32_t index;
} pool_thread_arg;

static void *pool_main(void *p)
{
    pool_thread_arg self = *(pool_thread_arg *)p;
    free(p);
    km_thread_pool *pool = self.pool;
    uint64_t seen = 0;
    pthread_mutex_lock(&pool->mutex);
    for (;;) {
        while (!pool->stop && pool->generation == seen)
            pthread_cond_wait(&pool->start, &pool->mutex);
        if (pool->stop)
            break;
        seen = pool->generation;
        pool_job job = pool->job;
        void *arg = pool->arg;
        pthread_mutex_unlock(&pool->mutex);
        job(arg, self.index);
        pthread_mutex_lock(&pool->mutex);
        if (--pool->pending == 0)
            pthread_cond_signal(&pool->done);
    }
    pthread_mutex_unlock(&pool->mutex);
    return NULL;
}

static void pool_destroy(km_thread_pool *pool)
{
    if (!pool)
        return;
    pthread_mutex_lock(&pool->mutex);
    pool->stop = 1;
    pthread_cond_broadcast(&pool->start);
    pthread_mutex_unlock(&pool->mutex);
    for (uint32_t i = 0; i < pool->n_threads; i++)
        pthread_join(pool->threads[i], NULL);
    pthread_mutex_destroy(&pool->mutex);
    pthread_cond_destroy(&pool->start);
    pthread_cond_destroy(&pool->done);
    free(pool->threads);
    free(pool);
}

static km_thread_pool *pool_create(uint32_t helpers)
{
    km_thread_pool *pool = calloc(1, sizeof *pool);
    if (!pool)
        return NULL;
    pthread_mutex_init(&pool->mutex, NULL);
    pthread_cond_init(&pool->start, NULL);
    pthread_cond_init(&pool->done, NULL);
    pool->threads = calloc(helpers ? helpers : 1, sizeof *pool->threads);
    if (!pool->threads) {
        pool_destroy(pool);
        return NULL;
    }
    for (uint32_t i = 0; i < helpers; i++) {
        pool_thread_arg *arg = malloc(sizeof *arg);
        if (arg) { /* filled before the thread starts: it reads them at once */
            arg->pool = pool;
            arg->index = i;
        }
        if (!arg || pthread_create(&pool->threads[i], NULL, pool_main, arg) != 0) {
            free(arg);
            pool_destroy(pool);
            return NULL;
        }
        pool->n_threads++;
    }
    return pool;
}

/* Run job(arg, t) for t = 0 .. n_threads (the caller runs the last one) and wait for all. */
static void pool_run(km_thread_pool *pool, pool_job job, void *arg)
{
    pthread_mutex_lock(&pool->mutex);
    pool->job = job;
    pool->arg = arg;
    pool->pending = pool->n_threads;
    pool->generation++;
    pthread_cond_broadcast(&pool->start);
    pthread_mutex_unlock(&pool->mutex);
    job(arg, pool->n_threads);
    pthread_mutex_lock(&pool->mutex);
    while (pool->pending > 0)
        pthread_cond_wait(&pool->done, &pool->mutex);
    pthread_mutex_unlock(&pool->mutex);
}

/* ---- scoring --------------------------------------------------------------------------- */

/* The walk's entries are written straight into km_worker_match arrays. */
_Static_assert(sizeof(km_walk_entry) == sizeof(km_worker_match) &&
                   offsetof(km_walk_entry, worker) == offsetof(km_worker_match, worker) &&
                   offsetof(km_walk_entry, depth) == offsetof(km_worker_match, depth),
               "km_walk_entry and km_worker_match must share a layout");

typedef struct cpu_lane {
    uint64_t *scratch; /* KM_WALK_SCRATCH_WORDS(max_workers) */
    size_t first_request, end_request;
    int status;
} cpu_lane;

typedef struct cpu_state {
    km_thread_pool *pool; /* NULL when single-threaded */
    uint32_t n_lanes;
    cpu_lane *lanes;
} cpu_state;

typedef struct match_job {
    const km_index *index;
    const km_request *requests;
    km_match_results *results;
    cpu_state *state;
} match_job;

/* Prefetch every lookup of a request that does not depend on the walk: block 0 and each segment
 * key. Issued one request ahead, so the next request's misses overlap this one's walk. */
static void prefetch_request(const km_table_view *blocks, const km_table_view *segments,
                             uint32_t S, const km_request *r)
{
    if (r->n_hashes == 0)
        return;
    km_view_prefetch(blocks, r->hashes[0]);
    if (S == 0)
        return;
    /* Only the first segment keys: most queries stop after a few segments, and the walk itself
     * prefetches KM_PREFETCH_AHEAD keys ahead as it goes. */
    for (uint32_t k = 1; k <= KM_PREFETCH_AHEAD && k * S <= r->n_hashes; k++)
        km_view_prefetch(segments, r->hashes[k * S - 1]);
}

/* Phase 1: each request's entry count is the holder count of its block 0, known from one lookup,
 * so every request's output can be placed exactly and the walks write in place (no copy of the
 * batch's results, which at 1024 workers are ~8 KB per request). The lookup also brings block 0's
 * slot into cache for phase 2. */
#define CPU_COUNT_PREFETCH 8u
static void count_lane(void *p, uint32_t lane_index)
{
    match_job *job = p;
    cpu_lane *lane = &job->state->lanes[lane_index];
    km_table_view blocks = km_table_get_view(&job->index->blocks);
    for (size_t r = lane->first_request; r < lane->end_request; r++) {
        size_t ahead = r + CPU_COUNT_PREFETCH;
        if (ahead < lane->end_request && job->requests[ahead].n_hashes)
            km_view_prefetch(&blocks, job->requests[ahead].hashes[0]);
        const km_request *req = &job->requests[r];
        uint64_t slot = req->n_hashes ? km_view_find(&blocks, req->hashes[0]) : KM_SLOT_NONE;
        job->results->requests[r].count = slot == KM_SLOT_NONE ? 0 : km_slot_count(&blocks.slots[slot]);
    }
}

/* Phase 2: walk every request straight into its place in the results. */
static void walk_lane(void *p, uint32_t lane_index)
{
    match_job *job = p;
    cpu_lane *lane = &job->state->lanes[lane_index];
    const km_index *index = job->index;
    km_table_view blocks = km_table_get_view(&index->blocks);
    km_table_view segments = km_table_get_view(&index->segments);
    uint32_t S = index->config.segment_blocks;
    uint32_t max_workers = index->config.max_workers;
    for (size_t r = lane->first_request; r < lane->end_request; r++) {
        if (r + 1 < lane->end_request)
            prefetch_request(&blocks, &segments, S, &job->requests[r + 1]);
        const km_request *req = &job->requests[r];
        km_request_result *res = &job->results->requests[r];
        uint32_t owner, owner_depth, probes;
        uint32_t m = km_walk_request(&blocks, &segments, S, req->hashes, req->n_hashes,
                                     (km_walk_entry *)(job->results->matches + res->first),
                                     lane->scratch, max_workers, &owner, &owner_depth, &probes);
        if (m != res->count) { /* the tables cannot change between the phases */
            lane->status = KM_ERR_INTERNAL;
            return;
        }
        res->owner = owner;
        res->owner_depth = owner_depth;
        res->probes = probes;
    }
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
        state->lanes[i].scratch = malloc(KM_WALK_SCRATCH_WORDS((size_t)max_workers) * sizeof(uint64_t));
        if (!state->lanes[i].scratch)
            goto oom;
    }
    if (threads > 1) {
        state->pool = pool_create(threads - 1);
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
    pool_destroy(state->pool);
    for (uint32_t i = 0; state->lanes && i < state->n_lanes; i++) {
        free(state->lanes[i].scratch);
    }
    free(state->lanes);
    free(state);
}

/* Below this many requests a batch is scored on the calling thread alone. */
#define CPU_MIN_REQUESTS_PER_LANE 16

static int cpu_match(void *p, km_index *index, const km_request *requests, size_t n,
                     km_match_results *results)
{
    cpu_state *state = p;
    uint32_t lanes = state->pool ? state->n_lanes : 1;
    if (n < (size_t)lanes * CPU_MIN_REQUESTS_PER_LANE)
        lanes = 1;
    /* Slices of about equal block counts: the walk's cost follows the blocks, not the requests. */
    uint64_t total = 0;
    for (size_t i = 0; i < n; i++)
        total += requests[i].n_hashes + 1;
    size_t r = 0;
    uint64_t seen = 0;
    for (uint32_t l = 0; l < state->n_lanes; l++) {
        cpu_lane *lane = &state->lanes[l];
        lane->first_request = r;
        if (l < lanes) {
            uint64_t target = total * (l + 1) / lanes;
            while (r < n && (seen < target || l + 1 == lanes)) {
                seen += requests[r].n_hashes + 1;
                r++;
            }
        }
        lane->end_request = r;
    }
    match_job job = {index, requests, results, state};
    if (lanes > 1)
        pool_run(state->pool, count_lane, &job);
    else
        count_lane(&job, 0);
    size_t total_matches = 0;
    for (size_t i = 0; i < n; i++) {
        results->requests[i].first = total_matches;
        total_matches += results->requests[i].count;
    }
    if (km_match_results_reserve(results, n, total_matches))
        return km_index_fail(index, KM_ERR_OUT_OF_MEMORY, "results for %zu matches", total_matches);
    for (uint32_t l = 0; l < state->n_lanes; l++)
        state->lanes[l].status = KM_OK;
    if (lanes > 1)
        pool_run(state->pool, walk_lane, &job);
    else
        walk_lane(&job, 0);
    uint64_t probes = 0;
    for (uint32_t l = 0; l < state->n_lanes; l++)
        if (state->lanes[l].status)
            return km_index_fail(index, state->lanes[l].status, "cpu scoring: tables changed during a batch");
    for (size_t i = 0; i < n; i++)
        probes += results->requests[i].probes;
    results->n_matches = total_matches;
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
