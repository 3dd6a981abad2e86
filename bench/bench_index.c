/* SPDX-License-Identifier: Apache-2.0 */
/* `kvmatch bench index`: scoring throughput of the placement index against faithful re-implementations
 * of today's peers (bench/baselines.h) on the Mooncake conversation trace.
 *
 * Workload. Every request of the trace is expanded to chain hashes (block size 16; each 512-token id
 * becomes 32 blocks of 16 tokens, src/sim/trace.h), truncated to its input length. The first 80% of the
 * requests build the cluster state, the last 20% are the queries. State requests are assigned to
 * workers by a deterministic rule modelled on vllm-router's cache_aware policy without its load
 * terms (a static replay has no in-flight load): if the deepest existing match covers more than 30%
 * (cache_threshold 0.3) of the request's blocks, the worker owning that match (lowest id on ties);
 * otherwise the next worker round-robin. The assigned worker stores the request's whole chain; nothing
 * is evicted. The same state is built at 64 and at 1024 workers.
 *
 * Measurement. Per worker count every structure is built (one at a time, so build_s is clean),
 * then each backend scores the same batches of 1024 queries (taken cyclically, so every batch is
 * full) with the same number of threads: the index through km_index_match_batch and its own thread
 * pool, the baselines one request at a time on a pool of the same size pulling requests from a
 * shared counter. Every backend's answers are checked against the CPU index's before timing. Five
 * repetitions interleave the backends (a noisy stretch of a shared machine then hits all of them);
 * throughputs are medians over repetitions, batch latency percentiles nearest-rank over all batches
 * of all repetitions. A memory-bound ceiling, limit_slot_reads_per_s, is measured beside:
 * independent random 16-byte reads, prefetched in groups, from a table as large as the CPU index's
 * block table, on the same threads.
 *
 * --quick (under 30 s on two cores) changes only the effort: 3 repetitions, a shorter ceiling run,
 * structures built concurrently on the pool (build_s overlaps), every 16th request's hashes
 * cross-checked against km_trace_chain_hashes instead of all, and no cpu_nosegments row. */
#include <errno.h>
#include <jansson.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "baseline_impl.h"
#include "bench_common.h"
#include "cli/commands.h"
#include "cli/options.h"
#include "kvmatch/kvmatch.h"
#include "sim/trace.h"

#define BENCH_BLOCK_SIZE 16u
#define BENCH_TOKENS_PER_ID 512u
#define BENCH_STATE_PERCENT 80u
#define BENCH_CACHE_THRESHOLD_PERCENT 30u
#define BENCH_BATCH 1024u
#define BENCH_SEGMENT_BLOCKS 32u
#define BENCH_REPS 5
#define BENCH_QUICK_REPS 3
#define BENCH_CLAIM 8u /* requests a baseline thread claims at a time */
#define LIMIT_GROUP 16u
#define LIMIT_READS_PER_THREAD (UINT64_C(16) << 20)
#define LIMIT_QUICK_READS_PER_THREAD (UINT64_C(2) << 20)

static const uint32_t bench_worker_counts[] = {64, 1024};
#define N_WORKER_COUNTS (sizeof(bench_worker_counts) / sizeof(bench_worker_counts[0]))

/* ---- a tiny fork-join pool: the caller is thread 0 ------------------------------------------ */

typedef void (*job_fn)(void *arg, uint32_t tid);

typedef struct bench_pool {
    uint32_t n;
    pthread_t *threads;
    pthread_barrier_t start, done;
    job_fn fn;
    void *arg;
    int stop;
} bench_pool;

typedef struct pool_thread_arg {
    bench_pool *pool;
    uint32_t tid;
} pool_thread_arg;

static void *pool_main(void *p)
{
    pool_thread_arg *a = p;
    bench_pool *pool = a->pool;
    uint32_t tid = a->tid;
    free(a);
    for (;;) {
        pthread_barrier_wait(&pool->start);
        if (pool->stop)
            break;
        pool->fn(pool->arg, tid);
        pthread_barrier_wait(&pool->done);
    }
    return NULL;
}

static int pool_init(bench_pool *pool, uint32_t n)
{
    memset(pool, 0, sizeof(*pool));
    pool->n = n;
    if (n <= 1)
        return 0;
    pool->threads = calloc(n, sizeof(pthread_t));
    if (!pool->threads)
        return -1;
    pthread_barrier_init(&pool->start, NULL, n);
    pthread_barrier_init(&pool->done, NULL, n);
    for (uint32_t t = 1; t < n; t++) {
        pool_thread_arg *a = malloc(sizeof(*a));
        if (!a)
            return -1;
        a->pool = pool;
        a->tid = t;
        if (pthread_create(&pool->threads[t], NULL, pool_main, a) != 0)
            return -1;
    }
    return 0;
}

static void pool_run(bench_pool *pool, job_fn fn, void *arg)
{
    if (pool->n <= 1) {
        fn(arg, 0);
        return;
    }
    pool->fn = fn;
    pool->arg = arg;
    pthread_barrier_wait(&pool->start);
    fn(arg, 0);
    pthread_barrier_wait(&pool->done);
}

static void pool_destroy(bench_pool *pool)
{
    if (pool->n > 1 && pool->threads) {
        pool->stop = 1;
        pthread_barrier_wait(&pool->start);
        for (uint32_t t = 1; t < pool->n; t++)
            pthread_join(pool->threads[t], NULL);
        pthread_barrier_destroy(&pool->start);
        pthread_barrier_destroy(&pool->done);
    }
    free(pool->threads);
    memset(pool, 0, sizeof(*pool));
}

/* ---- the workload ----------------------------------------------------------------------------- */

typedef struct workload {
    km_trace trace;
    size_t n_requests, n_state, n_queries;
    uint64_t *offsets; /* request r's blocks are [offsets[r], offsets[r + 1]) */
    uint64_t *chain;
    uint64_t *local;
    uint64_t total_blocks, query_blocks;
    double expand_s;
} workload;

static uint32_t req_len(const workload *wl, size_t r)
{
    return (uint32_t)(wl->offsets[r + 1] - wl->offsets[r]);
}

typedef struct expand_job {
    workload *wl;
    uint32_t max_tokens;
    uint32_t check_every; /* cross-check every k-th request's chain with km_trace_chain_hashes */
    atomic_size_t next;
    atomic_int status;
    atomic_size_t bad_request; /* first request whose two expansions disagree, or SIZE_MAX */
} expand_job;

#define EXPAND_CLAIM 32u

/* Hash claimed requests into wl->local / wl->chain, and check the chains against km_trace's own
 * expansion (km_trace_chain_hashes) so the two can never drift apart silently. */
static void expand_job_run(void *p, uint32_t tid)
{
    (void)tid;
    expand_job *job = p;
    workload *wl = job->wl;
    uint32_t *tokens = malloc((size_t)job->max_tokens * sizeof(uint32_t) + 4);
    uint64_t *check = malloc((size_t)(job->max_tokens / BENCH_BLOCK_SIZE) * sizeof(uint64_t) + 8);
    if (!tokens || !check) {
        atomic_store(&job->status, KM_ERR_OUT_OF_MEMORY);
        free(tokens);
        free(check);
        return;
    }
    km_hash_config cfg = {.block_size = BENCH_BLOCK_SIZE, .lora_name = NULL, .cache_salt = NULL};
    size_t n = wl->trace.n_requests;
    for (;;) {
        size_t first = atomic_fetch_add(&job->next, EXPAND_CLAIM);
        if (first >= n || atomic_load(&job->status) != KM_OK)
            break;
        size_t end = first + EXPAND_CLAIM < n ? first + EXPAND_CLAIM : n;
        for (size_t r = first; r < end; r++) {
            const km_trace_request *q = &wl->trace.requests[r];
            for (uint32_t i = 0; i < q->n_ids; i++)
                km_trace_id_tokens(q->ids[i], BENCH_TOKENS_PER_ID,
                                   tokens + (size_t)i * BENCH_TOKENS_PER_ID);
            uint32_t blocks = req_len(wl, r);
            size_t got = 0;
            int rc = km_hash_sequence(&cfg, tokens, (size_t)blocks * BENCH_BLOCK_SIZE, 0, 0,
                                      wl->local + wl->offsets[r], wl->chain + wl->offsets[r], &got);
            if (rc == KM_OK && got != blocks)
                rc = KM_ERR_INTERNAL;
            if (rc == KM_OK && r % job->check_every == 0) {
                uint32_t n_check = 0;
                rc = km_trace_chain_hashes(q, BENCH_BLOCK_SIZE, BENCH_TOKENS_PER_ID, check, &n_check);
                if (rc == KM_OK && (n_check != blocks ||
                                    memcmp(check, wl->chain + wl->offsets[r],
                                           blocks * sizeof(uint64_t)))) {
                    size_t none = SIZE_MAX;
                    atomic_compare_exchange_strong(&job->bad_request, &none, r);
                    rc = KM_ERR_INTERNAL;
                }
            }
            if (rc != KM_OK) {
                int ok = KM_OK;
                atomic_compare_exchange_strong(&job->status, &ok, rc);
                break;
            }
        }
    }
    free(tokens);
    free(check);
}

/* Expand every request to local and chain hashes (on the pool). */
static int workload_expand(workload *wl, bench_pool *pool, uint32_t check_every, char *err,
                           size_t err_size)
{
    size_t n = wl->trace.n_requests;
    wl->offsets = malloc((n + 1) * sizeof(uint64_t));
    if (!wl->offsets)
        return KM_ERR_OUT_OF_MEMORY;
    wl->offsets[0] = 0;
    uint32_t max_tokens = 0;
    for (size_t r = 0; r < n; r++) {
        const km_trace_request *q = &wl->trace.requests[r];
        uint32_t blocks = km_trace_max_blocks(q, BENCH_BLOCK_SIZE, BENCH_TOKENS_PER_ID);
        wl->offsets[r + 1] = wl->offsets[r] + blocks;
        uint64_t tokens = (uint64_t)q->n_ids * BENCH_TOKENS_PER_ID;
        if (tokens > max_tokens)
            max_tokens = tokens > UINT32_MAX ? UINT32_MAX : (uint32_t)tokens;
    }
    wl->total_blocks = wl->offsets[n];
    wl->chain = malloc(wl->total_blocks * sizeof(uint64_t) + 1);
    wl->local = malloc(wl->total_blocks * sizeof(uint64_t) + 1);
    if (!wl->chain || !wl->local)
        return KM_ERR_OUT_OF_MEMORY;
    expand_job job = {.wl = wl, .max_tokens = max_tokens, .check_every = check_every};
    atomic_init(&job.next, 0);
    atomic_init(&job.status, KM_OK);
    atomic_init(&job.bad_request, SIZE_MAX);
    pool_run(pool, expand_job_run, &job);
    int rc = atomic_load(&job.status);
    size_t bad = atomic_load(&job.bad_request);
    if (bad != SIZE_MAX)
        snprintf(err, err_size, "request %zu: km_trace_chain_hashes disagrees with "
                 "km_hash_sequence over the expanded tokens", bad);
    else if (rc != KM_OK)
        snprintf(err, err_size, "hashing the trace failed: %s", km_strerror(rc));
    return rc;
}

static void workload_free(workload *wl)
{
    km_trace_free(&wl->trace);
    free(wl->offsets);
    free(wl->chain);
    free(wl->local);
    memset(wl, 0, sizeof(*wl));
}

/* The state at one worker count: which worker each state request went to. */
typedef struct assignment {
    uint32_t workers;
    uint32_t *worker_of; /* per state request */
    uint64_t by_cache, by_round_robin;
    uint64_t distinct_blocks;
} assignment;

/* vllm-router-like assignment, documented at the top of this file. Every worker's holdings are whole
 * chains from block 0, so they are prefix-closed: if anyone holds block i, the lowest-id holder of
 * block i holds blocks 0..i. The deepest match is therefore the longest prefix of blocks held by
 * anyone, and its owner the lowest-id holder of its last block. */
static int assign_state(const workload *wl, uint32_t workers, assignment *a)
{
    memset(a, 0, sizeof(*a));
    a->workers = workers;
    a->worker_of = malloc(wl->n_state * sizeof(uint32_t));
    km_bl_memory mem = {0};
    km_bl_map owner = {0};  /* chain hash -> lowest worker id holding it */
    if (!a->worker_of)
        return KM_ERR_OUT_OF_MEMORY;
    uint32_t rr = 0;
    int rc = KM_OK;
    for (size_t r = 0; r < wl->n_state && rc == KM_OK; r++) {
        const uint64_t *h = wl->chain + wl->offsets[r];
        uint32_t n = req_len(wl, r);
        uint32_t depth = 0;
        while (depth < n && km_bl_map_find(&owner, h[depth]))
            depth++;
        uint32_t w;
        if (depth > 0 && (uint64_t)depth * 100 > (uint64_t)n * BENCH_CACHE_THRESHOLD_PERCENT) {
            w = (uint32_t)km_bl_map_find(&owner, h[depth - 1])->value;
            a->by_cache++;
        } else {
            w = rr;
            rr = (rr + 1) % workers;
            a->by_round_robin++;
        }
        a->worker_of[r] = w;
        for (uint32_t i = 0; i < n && rc == KM_OK; i++) {
            km_bl_map_entry *e = km_bl_map_find(&owner, h[i]);
            if (!e)
                rc = km_bl_map_put(&owner, h[i], w, &mem);
            else if (w < e->value)
                e->value = w;
        }
    }
    a->distinct_blocks = owner.live;
    km_bl_map_release(&owner, &mem);
    return rc;
}

/* ---- query batches and the reference answers ------------------------------------------------- */

typedef struct batches {
    size_t n_batches;
    km_request *requests;   /* n_batches * BENCH_BATCH */
    uint32_t *query_of;     /* which query each request is */
    uint64_t blocks_per_rep;
} batches;

static int make_batches(const workload *wl, batches *b)
{
    b->n_batches = (wl->n_queries + BENCH_BATCH - 1) / BENCH_BATCH;
    size_t total = b->n_batches * BENCH_BATCH;
    b->requests = malloc(total * sizeof(km_request));
    b->query_of = malloc(total * sizeof(uint32_t));
    if (!b->requests || !b->query_of)
        return KM_ERR_OUT_OF_MEMORY;
    b->blocks_per_rep = 0;
    for (size_t k = 0; k < total; k++) {
        uint32_t q = (uint32_t)(k % wl->n_queries);
        size_t r = wl->n_state + q;
        b->query_of[k] = q;
        b->requests[k].hashes = wl->chain + wl->offsets[r];
        b->requests[k].n_hashes = req_len(wl, r);
        b->blocks_per_rep += b->requests[k].n_hashes;
    }
    return KM_OK;
}

/* Reference answers of every query, from the CPU index. */
typedef struct reference {
    uint32_t *count, *owner, *owner_depth;
    uint64_t *first;
    km_worker_match *matches;
    uint64_t n_matches;
} reference;

static void reference_free(reference *ref)
{
    free(ref->count);
    free(ref->owner);
    free(ref->owner_depth);
    free(ref->first);
    free(ref->matches);
    memset(ref, 0, sizeof(*ref));
}

/* ---- scorers: one interface over km_index and the baselines ---------------------------------- */

/* One backend under test at one worker count. */
typedef struct scorer {
    const char *backend;
    int is_index;
    km_backend_kind kind;          /* index rows */
    uint32_t segment_blocks;       /* index rows */
    km_baseline_kind baseline_kind; /* baseline rows */
    km_index *index;
    km_baseline *baseline;
    int build_status;
    char why[256];
    double build_s;
    uint64_t memory_bytes, pairs;
    uint64_t mismatches;
    /* per repetition, and per batch of every repetition */
    double *rps, *bps, *sps, *lat;
} scorer;

typedef struct bench_ctx {
    const workload *wl;
    const batches *b;
    bench_pool *pool;
    uint32_t threads;
    int reps;
    reference ref;
    km_match_results results;
    km_baseline_result *bl_results; /* one per pool thread */
    struct batch_output *bl_out;    /* one per pool thread */
} bench_ctx;

/* What a batch caller gets back: every request's answer, kept for the whole batch. The index's
 * km_index_match_batch returns this; the baselines answer one request at a time, each written in
 * place at the end of its thread's buffer here, so they pay the memory traffic of the results
 * (about 8 MB per batch of 1024 requests at 1024 workers) as the index does, and no more. */
typedef struct batch_output {
    km_worker_match *matches;
    size_t n_matches, matches_capacity;
    km_request_result *requests;
    size_t n_requests, requests_capacity;
} batch_output;

/* Where the next answer goes: room for `most` entries at the end of out's matches, which a match
 * writes in place, as the index writes its answers (no second copy). */
static km_worker_match *batch_output_next(batch_output *out, uint32_t most)
{
    if (out->n_matches + most > out->matches_capacity) {
        size_t cap = out->matches_capacity ? out->matches_capacity * 2 : 65536;
        while (cap < out->n_matches + most)
            cap *= 2;
        km_worker_match *grown = realloc(out->matches, cap * sizeof *grown);
        if (!grown)
            abort(); /* benchmark binary: no memory to measure with */
        out->matches = grown;
        out->matches_capacity = cap;
    }
    return out->matches + out->n_matches;
}

/* The answer just written at batch_output_next's place. */
static void batch_output_commit(batch_output *out, const km_baseline_result *res)
{
    if (out->n_requests == out->requests_capacity) {
        size_t cap = out->requests_capacity ? out->requests_capacity * 2 : 1024;
        km_request_result *grown = realloc(out->requests, cap * sizeof *grown);
        if (!grown)
            abort();
        out->requests = grown;
        out->requests_capacity = cap;
    }
    out->requests[out->n_requests++] = (km_request_result){out->n_matches, res->count, res->owner,
                                                           res->owner_depth, 0};
    out->n_matches += res->count;
}

typedef struct baseline_job {
    const km_baseline *baseline;
    const workload *wl;
    const km_request *requests;
    const uint32_t *query_of;
    uint32_t n;
    const reference *ref; /* verify against it when non-NULL */
    atomic_uint next;
    atomic_uint_fast64_t visits;
    atomic_uint_fast64_t mismatches;
    km_baseline_result *results; /* one per thread */
    batch_output *out;           /* one per thread */
} baseline_job;

/* Compare one answer with the reference of query q; 1 if equal. */
static int same_answer(const reference *ref, uint32_t q, const km_worker_match *m, uint32_t count,
                       uint32_t owner, uint32_t owner_depth)
{
    if (ref->count[q] != count || ref->owner[q] != owner || ref->owner_depth[q] != owner_depth)
        return 0;
    return memcmp(ref->matches + ref->first[q], m, count * sizeof(km_worker_match)) == 0;
}

static void baseline_job_run(void *p, uint32_t tid)
{
    baseline_job *job = p;
    km_baseline_result *res = &job->results[tid];
    batch_output *out = &job->out[tid];
    out->n_matches = 0;
    out->n_requests = 0;
    uint64_t visits = 0, bad = 0;
    for (;;) {
        uint32_t k = atomic_fetch_add_explicit(&job->next, BENCH_CLAIM, memory_order_relaxed);
        if (k >= job->n)
            break;
        uint32_t end = k + BENCH_CLAIM < job->n ? k + BENCH_CLAIM : job->n;
        for (; k < end; k++) {
            uint32_t q = job->query_of[k];
            size_t r = job->wl->n_state + q;
            const uint64_t *local = job->wl->local + job->wl->offsets[r];
            km_worker_match *own = res->matches;
            res->matches = batch_output_next(out, res->capacity);
            km_baseline_match(job->baseline, job->requests[k].hashes, local,
                              job->requests[k].n_hashes, res);
            batch_output_commit(out, res);
            visits += res->visits;
            if (job->ref)
                bad += !same_answer(job->ref, q, res->matches, res->count, res->owner,
                                    res->owner_depth);
            res->matches = own;
        }
    }
    atomic_fetch_add_explicit(&job->visits, visits, memory_order_relaxed);
    atomic_fetch_add_explicit(&job->mismatches, bad, memory_order_relaxed);
}

/* Score requests [0, n) of reqs with a baseline on the pool; returns the node visits. */
static uint64_t baseline_run(bench_ctx *ctx, const km_baseline *bl, const km_request *reqs,
                             const uint32_t *query_of, uint32_t n, const reference *ref,
                             uint64_t *mismatches)
{
    baseline_job job = {.baseline = bl,
                        .wl = ctx->wl,
                        .requests = reqs,
                        .query_of = query_of,
                        .n = n,
                        .ref = ref,
                        .results = ctx->bl_results,
                        .out = ctx->bl_out};
    atomic_init(&job.next, 0);
    atomic_init(&job.visits, 0);
    atomic_init(&job.mismatches, 0);
    pool_run(ctx->pool, baseline_job_run, &job);
    if (mismatches)
        *mismatches = atomic_load(&job.mismatches);
    return atomic_load(&job.visits);
}

/* Check every query's answer against the reference; KM_OK and s->mismatches, or a scoring error. */
static int verify(bench_ctx *ctx, scorer *s)
{
    const workload *wl = ctx->wl;
    s->mismatches = 0;
    if (s->index) {
        for (size_t k = 0; k < wl->n_queries; k += BENCH_BATCH) {
            size_t n = wl->n_queries - k < BENCH_BATCH ? wl->n_queries - k : BENCH_BATCH;
            int rc = km_index_match_batch(s->index, ctx->b->requests + k, n, &ctx->results);
            if (rc != KM_OK)
                return rc;
            for (size_t j = 0; j < n; j++) {
                const km_request_result *rr = &ctx->results.requests[j];
                s->mismatches += !same_answer(&ctx->ref, (uint32_t)(k + j),
                                              ctx->results.matches + rr->first, rr->count,
                                              rr->owner, rr->owner_depth);
            }
        }
        return KM_OK;
    }
    /* The first n_queries batch entries are the queries in order. */
    baseline_run(ctx, s->baseline, ctx->b->requests, ctx->b->query_of, (uint32_t)wl->n_queries,
                 &ctx->ref, &s->mismatches);
    return KM_OK;
}

/* One repetition: every batch once, timed batch by batch. */
static int measure_rep(bench_ctx *ctx, scorer *s, int rep)
{
    const batches *b = ctx->b;
    double total = 0;
    uint64_t reads = 0;
    for (size_t k = 0; k < b->n_batches; k++) {
        const km_request *reqs = b->requests + k * BENCH_BATCH;
        double t0 = km_bench_now_s();
        if (s->index) {
            int rc = km_index_match_batch(s->index, reqs, BENCH_BATCH, &ctx->results);
            if (rc != KM_OK)
                return rc;
            reads += ctx->results.probes;
        } else {
            reads += baseline_run(ctx, s->baseline, reqs, b->query_of + k * BENCH_BATCH,
                                  BENCH_BATCH, NULL, NULL);
        }
        double dt = km_bench_now_s() - t0;
        total += dt;
        s->lat[(size_t)rep * b->n_batches + k] = dt * 1e6;
    }
    s->rps[rep] = (double)(b->n_batches * BENCH_BATCH) / total;
    s->bps[rep] = (double)b->blocks_per_rep / total;
    s->sps[rep] = (double)reads / total;
    return KM_OK;
}

typedef struct row {
    const char *backend;
    uint32_t workers, threads;
    double requests_per_s, requests_per_s_min, requests_per_s_max;
    double block_probes_per_s, slot_reads_per_s;
    double batch_p50_us, batch_p99_us;
    double bytes_per_pair;
    uint64_t pairs, memory_bytes;
    double build_s;
    uint64_t mismatches;
    uint32_t segment_blocks;
    int is_index;
} row;

/* Nearest-rank percentile of sorted v. */
static double percentile(const double *sorted, size_t n, double p)
{
    size_t rank = (size_t)(p / 100.0 * (double)n + 0.999999);
    if (rank < 1)
        rank = 1;
    if (rank > n)
        rank = n;
    return sorted[rank - 1];
}

static row make_row(const bench_ctx *ctx, scorer *s, uint32_t workers)
{
    size_t reps = (size_t)ctx->reps, n_lat = reps * ctx->b->n_batches;
    row r;
    memset(&r, 0, sizeof(r));
    r.backend = s->backend;
    r.workers = workers;
    r.threads = ctx->threads;
    r.requests_per_s = km_bench_median(s->rps, reps); /* sorts rps */
    r.requests_per_s_min = s->rps[0];
    r.requests_per_s_max = s->rps[reps - 1];
    r.block_probes_per_s = km_bench_median(s->bps, reps);
    r.slot_reads_per_s = km_bench_median(s->sps, reps);
    km_bench_sort(s->lat, n_lat);
    r.batch_p50_us = percentile(s->lat, n_lat, 50.0);
    r.batch_p99_us = percentile(s->lat, n_lat, 99.0);
    r.pairs = s->pairs;
    r.memory_bytes = s->memory_bytes;
    r.bytes_per_pair = s->pairs ? (double)s->memory_bytes / (double)s->pairs : 0.0;
    r.build_s = s->build_s;
    r.mismatches = s->mismatches;
    r.segment_blocks = s->segment_blocks;
    r.is_index = s->is_index;
    return r;
}

/* ---- building the structures ------------------------------------------------------------------ */

#define APPLY_BATCH 256u

/* Create an index on s->kind and store the state; an error when the backend cannot be used. */
static int build_index(const workload *wl, const assignment *a, uint32_t threads, scorer *s)
{
    km_index_config cfg;
    km_index_config_init(&cfg);
    cfg.max_workers = a->workers;
    cfg.segment_blocks = s->segment_blocks;
    cfg.threads = threads;
    cfg.backend = s->kind;
    cfg.log = km_bench_quiet_log;
    km_index *index = NULL;
    int rc = km_index_create(&cfg, &index);
    if (rc != KM_OK) {
        snprintf(s->why, sizeof s->why, "%s", km_strerror(rc));
        return rc;
    }
    km_update ups[APPLY_BATCH];
    double t0 = km_bench_now_s();
    size_t n_ups = 0;
    for (size_t r = 0; r < wl->n_state && rc == KM_OK; r++) {
        ups[n_ups++] = (km_update){.kind = KM_UPDATE_STORE,
                                   .worker = a->worker_of[r],
                                   .parent = KM_NO_PARENT,
                                   .hashes = wl->chain + wl->offsets[r],
                                   .n_hashes = req_len(wl, r)};
        if (n_ups == APPLY_BATCH || r + 1 == wl->n_state) {
            rc = km_index_apply(index, ups, n_ups, NULL);
            n_ups = 0;
        }
    }
    if (rc != KM_OK) {
        snprintf(s->why, sizeof s->why, "%s (%s)", km_strerror(rc), km_index_last_error(index));
        km_index_destroy(index);
        return rc;
    }
    s->build_s = km_bench_now_s() - t0;
    km_index_stats st;
    km_index_get_stats(index, &st);
    s->index = index;
    s->memory_bytes = st.memory_bytes;
    s->pairs = st.pairs;
    return KM_OK;
}

static int build_baseline(const workload *wl, const assignment *a, scorer *s)
{
    km_baseline *b = NULL;
    int rc = km_baseline_create(s->baseline_kind, a->workers, &b);
    if (rc != KM_OK)
        return rc;
    double t0 = km_bench_now_s();
    for (size_t r = 0; r < wl->n_state && rc == KM_OK; r++)
        rc = km_baseline_store(b, a->worker_of[r], KM_NO_PARENT, wl->chain + wl->offsets[r],
                               wl->local + wl->offsets[r], req_len(wl, r));
    if (rc != KM_OK) {
        snprintf(s->why, sizeof s->why, "%s", km_strerror(rc));
        km_baseline_destroy(b);
        return rc;
    }
    s->build_s = km_bench_now_s() - t0;
    km_baseline_stats st;
    km_baseline_get_stats(b, &st);
    s->baseline = b;
    s->memory_bytes = st.memory_bytes;
    s->pairs = st.pairs;
    return KM_OK;
}

typedef struct build_job {
    const workload *wl;
    const assignment *a;
    uint32_t threads;
    scorer *scorers;
    size_t n;
    atomic_size_t next;
} build_job;

static void build_job_run(void *p, uint32_t tid)
{
    (void)tid;
    build_job *job = p;
    for (;;) {
        size_t i = atomic_fetch_add(&job->next, 1);
        if (i >= job->n)
            break;
        scorer *s = &job->scorers[i];
        s->build_status = s->is_index ? build_index(job->wl, job->a, job->threads, s)
                                      : build_baseline(job->wl, job->a, s);
    }
}

static void scorer_free(scorer *s)
{
    km_index_destroy(s->index);
    km_baseline_destroy(s->baseline);
    free(s->rps);
    free(s->bps);
    free(s->sps);
    free(s->lat);
    s->index = NULL;
    s->baseline = NULL;
    s->rps = s->bps = s->sps = s->lat = NULL;
}

/* Record the reference answers from the CPU index. */
static int make_reference(bench_ctx *ctx, scorer *s)
{
    const workload *wl = ctx->wl;
    reference *ref = &ctx->ref;
    reference_free(ref);
    size_t nq = wl->n_queries;
    ref->count = malloc(nq * sizeof(uint32_t));
    ref->owner = malloc(nq * sizeof(uint32_t));
    ref->owner_depth = malloc(nq * sizeof(uint32_t));
    ref->first = malloc(nq * sizeof(uint64_t));
    if (!ref->count || !ref->owner || !ref->owner_depth || !ref->first)
        return KM_ERR_OUT_OF_MEMORY;
    uint64_t cap = 0;
    for (size_t k = 0; k < nq; k += BENCH_BATCH) {
        size_t n = nq - k < BENCH_BATCH ? nq - k : BENCH_BATCH;
        int rc = km_index_match_batch(s->index, ctx->b->requests + k, n, &ctx->results);
        if (rc != KM_OK)
            return rc;
        if (ref->n_matches + ctx->results.n_matches > cap) {
            uint64_t want = (ref->n_matches + ctx->results.n_matches) * 2;
            km_worker_match *m = realloc(ref->matches, want * sizeof(km_worker_match));
            if (!m)
                return KM_ERR_OUT_OF_MEMORY;
            ref->matches = m;
            cap = want;
        }
        for (size_t j = 0; j < n; j++) {
            const km_request_result *rr = &ctx->results.requests[j];
            ref->count[k + j] = rr->count;
            ref->owner[k + j] = rr->owner;
            ref->owner_depth[k + j] = rr->owner_depth;
            ref->first[k + j] = ref->n_matches;
            memcpy(ref->matches + ref->n_matches, ctx->results.matches + rr->first,
                   rr->count * sizeof(km_worker_match));
            ref->n_matches += rr->count;
        }
    }
    return KM_OK;
}

/* ---- the memory-bound ceiling ----------------------------------------------------------------- */

typedef struct limit_job {
    const uint8_t *table;
    uint64_t slots; /* power of two */
    uint64_t reads_per_thread;
    atomic_uint_fast64_t sink;
} limit_job;

static void limit_job_run(void *p, uint32_t tid)
{
    limit_job *job = p;
    uint64_t x = UINT64_C(0x9E3779B97F4A7C15) * (tid + 1) + 12345;
    uint64_t mask = job->slots - 1, acc = 0;
    uint64_t idx[LIMIT_GROUP];
    for (uint64_t done = 0; done < job->reads_per_thread; done += LIMIT_GROUP) {
        for (uint32_t g = 0; g < LIMIT_GROUP; g++) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            idx[g] = (x * UINT64_C(0x2545F4914F6CDD1D)) & mask;
            __builtin_prefetch(job->table + idx[g] * 16, 0, 1);
        }
        for (uint32_t g = 0; g < LIMIT_GROUP; g++) {
            const uint64_t *slot = (const uint64_t *)(job->table + idx[g] * 16);
            acc += slot[0] ^ slot[1];
        }
    }
    atomic_fetch_add_explicit(&job->sink, acc, memory_order_relaxed);
}

/* Random 16-byte reads per second from a table of `slots` slots; 0 when it cannot allocate. */
static double measure_limit(bench_ctx *ctx, uint64_t slots, uint64_t reads_per_thread, int *huge)
{
    uint64_t pow2 = 1;
    while (pow2 < slots)
        pow2 <<= 1;
    size_t bytes = (size_t)pow2 * 16;
    size_t align = (size_t)2 << 20;
    uint8_t *raw = mmap(NULL, bytes + align, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                        -1, 0);
    if (raw == MAP_FAILED)
        return 0.0;
    uint8_t *table = (uint8_t *)(((uintptr_t)raw + align - 1) & ~(uintptr_t)(align - 1));
    *huge = madvise(table, bytes, MADV_HUGEPAGE) == 0;
    for (size_t i = 0; i < bytes; i += 8)
        *(uint64_t *)(table + i) = i * UINT64_C(0x9E3779B97F4A7C15);
    /* The ceiling is steady: --reps beyond the default only lengthens the run. */
    int reps = ctx->reps < BENCH_REPS ? ctx->reps : BENCH_REPS;
    double *v = calloc((size_t)reps, sizeof(double));
    for (int rep = 0; v && rep < reps; rep++) {
        limit_job job = {.table = table, .slots = pow2, .reads_per_thread = reads_per_thread};
        atomic_init(&job.sink, 0);
        double t0 = km_bench_now_s();
        pool_run(ctx->pool, limit_job_run, &job);
        double dt = km_bench_now_s() - t0;
        v[rep] = (double)(reads_per_thread * ctx->threads) / dt;
    }
    double m = v ? km_bench_median(v, (size_t)reps) : 0.0;
    free(v);
    munmap(raw, bytes + align);
    return m;
}

/* ---- output ----------------------------------------------------------------------------------- */

static json_t *row_json(const row *r)
{
    json_t *o = json_object();
    json_object_set_new(o, "backend", json_string(r->backend));
    json_object_set_new(o, "workers", json_integer(r->workers));
    json_object_set_new(o, "threads", json_integer(r->threads));
    json_object_set_new(o, "requests_per_s", json_integer((json_int_t)(r->requests_per_s + 0.5)));
    json_object_set_new(o, "requests_per_s_min",
                        json_integer((json_int_t)(r->requests_per_s_min + 0.5)));
    json_object_set_new(o, "requests_per_s_max",
                        json_integer((json_int_t)(r->requests_per_s_max + 0.5)));
    json_object_set_new(o, "block_probes_per_s",
                        json_integer((json_int_t)(r->block_probes_per_s + 0.5)));
    json_object_set_new(o, "slot_reads_per_s", json_integer((json_int_t)(r->slot_reads_per_s + 0.5)));
    json_object_set_new(o, "batch_p50_us", json_real(km_bench_round_to(r->batch_p50_us, 0.1)));
    json_object_set_new(o, "batch_p99_us", json_real(km_bench_round_to(r->batch_p99_us, 0.1)));
    json_object_set_new(o, "bytes_per_pair", json_real(km_bench_round_to(r->bytes_per_pair, 0.01)));
    json_object_set_new(o, "pairs", json_integer((json_int_t)r->pairs));
    json_object_set_new(o, "memory_bytes", json_integer((json_int_t)r->memory_bytes));
    json_object_set_new(o, "build_s", json_real(km_bench_round_to(r->build_s, 0.001)));
    if (r->is_index)
        json_object_set_new(o, "segment_blocks", json_integer(r->segment_blocks));
    json_object_set_new(o, "mismatches", json_integer((json_int_t)r->mismatches));
    return o;
}

static const row *find_row(const row *rows, size_t n, const char *backend, uint32_t workers)
{
    for (size_t i = 0; i < n; i++)
        if (!strcmp(rows[i].backend, backend) && rows[i].workers == workers)
            return &rows[i];
    return NULL;
}

static double ratio(double a, double b)
{
    return b > 0 ? km_bench_round_to(a / b, 0.01) : 0.0;
}

static void print_table(const row *rows, size_t n, double limit, json_t *notes)
{
    printf("%-17s %7s %7s %12s %14s %14s %11s %11s %8s %6s\n", "backend", "workers", "threads",
           "requests/s", "block_probes/s", "slot_reads/s", "p50_us", "p99_us", "B/pair", "bad");
    for (size_t i = 0; i < n; i++) {
        const row *r = &rows[i];
        printf("%-17s %7u %7u %12.0f %14.0f %14.0f %11.1f %11.1f %8.1f %6llu\n", r->backend,
               r->workers, r->threads, r->requests_per_s, r->block_probes_per_s,
               r->slot_reads_per_s, r->batch_p50_us, r->batch_p99_us, r->bytes_per_pair,
               (unsigned long long)r->mismatches);
    }
    printf("limit_slot_reads_per_s: %.0f\n", limit);
    size_t k;
    json_t *v;
    json_array_foreach(notes, k, v) printf("note: %s\n", json_string_value(v));
}

/* 1 when the comma-separated list names `name`. */
static int list_names(const char *list, const char *name)
{
    size_t len = strlen(name);
    for (const char *p = list; *p;) {
        const char *end = strchr(p, ',');
        size_t n = end ? (size_t)(end - p) : strlen(p);
        if (n == len && !strncmp(p, name, len))
            return 1;
        p += n + (end != NULL);
    }
    return 0;
}

/* ---- main ------------------------------------------------------------------------------------- */

static void usage(FILE *f)
{
    fprintf(f, "usage: kvmatch bench index [--json] [--quick] [--threads N] [--reps N]\n"
               "                           [--workers N] [--backends LIST] [--trace PATH]\n"
               "  --json       one JSON object on stdout (default: a readable table)\n"
               "  --quick      3 repetitions, concurrent builds, no cpu_nosegments row (< 30 s)\n"
               "  --threads N  scoring threads for every backend (default: online CPUs)\n"
               "  --workers N  only one of the worker counts (64 or 1024)\n"
               "  --reps N     timed repetitions of every batch (default 5, 3 with --quick)\n"
               "  --backends L comma-separated rows to measure, e.g. cpu,radix_compressed; cpu is\n"
               "               always built, as the reference the others are checked against;\n"
               "               exit status 1 when cuda is named and could not be measured\n"
               "  --trace PATH Mooncake JSONL trace (default: $KM_MOONCAKE_TRACE or %s)\n",
            "../shared/data/mooncake/conversation_trace.jsonl");
}

int km_bench_index_main(int argc, char **argv)
{
    int json = 0, quick = 0, reps_wanted = 0;
    uint32_t threads = 0;
    const char *only = NULL;
    uint32_t only_workers = 0;
    const char *trace_path = NULL;
    enum { OPT_JSON = 256, OPT_QUICK, OPT_THREADS, OPT_REPS, OPT_WORKERS, OPT_BACKENDS, OPT_TRACE };
    static const struct option options[] = {
        {"help", no_argument, NULL, 'h'},
        {"json", no_argument, NULL, OPT_JSON},
        {"quick", no_argument, NULL, OPT_QUICK},
        {"threads", required_argument, NULL, OPT_THREADS},
        {"reps", required_argument, NULL, OPT_REPS},
        {"workers", required_argument, NULL, OPT_WORKERS},
        {"backends", required_argument, NULL, OPT_BACKENDS},
        {"trace", required_argument, NULL, OPT_TRACE},
        {NULL, 0, NULL, 0},
    };
    km_cli_getopt_begin(argv, "bench index");
    int opt;
    while ((opt = getopt_long(argc, argv, "h", options, NULL)) != -1) {
        uint32_t w;
        switch (opt) {
        case 'h':
            usage(stdout);
            return KM_EXIT_OK;
        case OPT_JSON:
            json = 1;
            break;
        case OPT_QUICK:
            quick = 1;
            break;
        case OPT_THREADS:
            if (!km_cli_u32("bench index", "threads", optarg, 1, 4096, &threads))
                return KM_EXIT_USAGE;
            break;
        case OPT_REPS:
            if (!km_cli_u32("bench index", "reps", optarg, 1, 100000, &w))
                return KM_EXIT_USAGE;
            reps_wanted = (int)w;
            break;
        case OPT_WORKERS:
            if (!km_cli_u32("bench index", "workers", optarg, 1, 1 << 20, &w))
                return KM_EXIT_USAGE;
            for (size_t k = 0; k < N_WORKER_COUNTS; k++)
                if (w == bench_worker_counts[k])
                    only_workers = bench_worker_counts[k];
            if (!only_workers) {
                fprintf(stderr, "kvmatch bench index: --workers wants 64 or 1024, got \"%s\"\n", optarg);
                return KM_EXIT_USAGE;
            }
            break;
        case OPT_BACKENDS:
            only = optarg;
            break;
        case OPT_TRACE:
            trace_path = optarg;
            break;
        default:
            return km_cli_usage_error("bench index");
        }
    }
    if (optind < argc) {
        fprintf(stderr, "kvmatch bench index: unexpected argument \"%s\"\n", argv[optind]);
        return km_cli_usage_error("bench index");
    }
    if (threads == 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        threads = n > 0 ? (uint32_t)n : 1;
    }
    if (!trace_path)
        trace_path = km_trace_default_path();

    json_t *machine = km_bench_machine_json(); /* before any work, for its load average */
    char err[512] = "";
    workload wl;
    memset(&wl, 0, sizeof(wl));
    double t0 = km_bench_now_s();
    int rc = km_trace_load_mooncake(trace_path, &wl.trace, err, sizeof err);
    if (rc != KM_OK) {
        fprintf(stderr, "kvmatch bench index: cannot load the Mooncake trace: %s\n"
                        "  (pass --trace PATH or set KM_MOONCAKE_TRACE)\n", err);
        json_decref(machine);
        return 2;
    }
    wl.n_requests = wl.trace.n_requests;
    wl.n_state = wl.n_requests * BENCH_STATE_PERCENT / 100;
    wl.n_queries = wl.n_requests - wl.n_state;
    if (wl.n_state == 0 || wl.n_queries == 0) {
        fprintf(stderr, "kvmatch bench index: trace %s has too few requests (%zu)\n", trace_path,
                wl.n_requests);
        workload_free(&wl);
        json_decref(machine);
        return 2;
    }
    batches b;
    memset(&b, 0, sizeof(b));
    bench_pool pool;
    bench_ctx ctx;
    memset(&ctx, 0, sizeof(ctx));
    if (pool_init(&pool, threads) != 0) {
        fprintf(stderr, "kvmatch bench index: cannot start %u threads\n", threads);
        workload_free(&wl);
        free(b.requests);
        free(b.query_of);
        json_decref(machine);
        return 1;
    }
    rc = workload_expand(&wl, &pool, quick ? 16 : 1, err, sizeof err);
    if (rc != KM_OK) {
        fprintf(stderr, "kvmatch bench index: %s\n", err[0] ? err : km_strerror(rc));
        pool_destroy(&pool);
        workload_free(&wl);
        free(b.requests);
        free(b.query_of);
        json_decref(machine);
        return 1;
    }
    wl.expand_s = km_bench_now_s() - t0;
    for (size_t r = wl.n_state; r < wl.n_requests; r++)
        wl.query_blocks += req_len(&wl, r);
    if (make_batches(&wl, &b) != KM_OK) {
        fprintf(stderr, "kvmatch bench index: out of memory\n");
        pool_destroy(&pool);
        workload_free(&wl);
        free(b.requests);
        free(b.query_of);
        json_decref(machine);
        return 1;
    }
    ctx.wl = &wl;
    ctx.b = &b;
    ctx.pool = &pool;
    ctx.threads = threads;
    ctx.reps = reps_wanted ? reps_wanted : quick ? BENCH_QUICK_REPS : BENCH_REPS;
    km_match_results_init(&ctx.results);
    ctx.bl_results = calloc(threads, sizeof(km_baseline_result));
    ctx.bl_out = calloc(threads, sizeof(batch_output));

    size_t max_rows = N_WORKER_COUNTS * 8;
    row *rows = calloc(max_rows, sizeof(row));
    size_t n_rows = 0;
    json_t *notes = json_array();
    json_t *per_workers = json_object();
    json_t *limit_detail = json_object();
    double limit = 0.0;
    uint64_t limit_slots = 0;
    int cuda_noted = 0, failed = !rows || !ctx.bl_results || !ctx.bl_out;

    for (size_t wi = 0; wi < N_WORKER_COUNTS && !failed; wi++) {
        uint32_t workers = bench_worker_counts[wi];
        if (only_workers && only_workers != workers)
            continue;
        assignment a;
        if (assign_state(&wl, workers, &a) != KM_OK) {
            fprintf(stderr, "kvmatch bench index: out of memory assigning requests\n");
            failed = 1;
            break;
        }
        /* Result buffers for the baselines, sized for this worker count. */
        km_baseline *sizing = NULL;
        km_baseline_create(KM_BASELINE_FLATMAP, workers, &sizing);
        for (uint32_t t = 0; t < threads; t++) {
            km_baseline_result_free(&ctx.bl_results[t]);
            km_baseline_result_init(sizing, &ctx.bl_results[t]);
        }
        km_baseline_destroy(sizing);

        /* The index rows first: "cpu" is the reference every other answer is checked against. */
        scorer sc[] = {
            {.backend = "cpu", .is_index = 1, .kind = KM_BACKEND_CPU,
             .segment_blocks = BENCH_SEGMENT_BLOCKS},
            {.backend = "cpu_nosegments", .is_index = 1, .kind = KM_BACKEND_CPU, .segment_blocks = 0},
            {.backend = "cuda", .is_index = 1, .kind = KM_BACKEND_CUDA,
             .segment_blocks = BENCH_SEGMENT_BLOCKS},
            {.backend = "flatmap", .baseline_kind = KM_BASELINE_FLATMAP},
            {.backend = "radix", .baseline_kind = KM_BASELINE_RADIX},
            {.backend = "radix_compressed", .baseline_kind = KM_BASELINE_RADIX_COMPRESSED},
        };
        size_t n_sc = sizeof(sc) / sizeof(sc[0]);
        if (quick) {
            /* --quick must stay under 30 s on two cores: drop the slowest build. */
            memmove(&sc[1], &sc[2], (n_sc - 2) * sizeof(scorer));
            n_sc--;
            if (wi == 0)
                json_array_append_new(notes, json_string("cpu_nosegments: not measured with --quick"));
        }
        if (only) { /* keep sc[0], the reference, and the rows named */
            size_t kept = 1;
            for (size_t i = 1; i < n_sc; i++)
                if (list_names(only, sc[i].backend))
                    sc[kept++] = sc[i];
            n_sc = kept;
        }
        if (!json)
            fprintf(stderr, "  [%5.1f s] %u workers: state assigned, building %zu structures%s\n",
                    km_bench_now_s() - t0, workers, n_sc, quick ? " concurrently" : "");
        /* --quick builds the structures concurrently on the pool (build_s then overlaps);
         * a full run builds them one at a time so build_s is clean. */
        build_job bj = {.wl = &wl, .a = &a, .threads = threads, .scorers = sc, .n = n_sc};
        atomic_init(&bj.next, 0);
        if (quick)
            pool_run(&pool, build_job_run, &bj);
        else
            build_job_run(&bj, 0);

        char wkey[16];
        snprintf(wkey, sizeof wkey, "%u", workers);
        json_object_set_new(per_workers, wkey,
                            json_pack("{s:I, s:I, s:I, s:I}", "assigned_by_cache",
                                      (json_int_t)a.by_cache, "assigned_round_robin",
                                      (json_int_t)a.by_round_robin, "distinct_blocks",
                                      (json_int_t)a.distinct_blocks, "pairs",
                                      (json_int_t)sc[0].pairs));
        free(a.worker_of);

        size_t reps = (size_t)ctx.reps;
        for (size_t i = 0; i < n_sc && !failed; i++) {
            scorer *s = &sc[i];
            if (s->build_status != KM_OK) {
                if (s->is_index && s->kind == KM_BACKEND_CUDA) {
                    if (!cuda_noted)
                        json_array_append_new(notes, json_sprintf(
                            "cuda: not measured (no device: %s)", s->why));
                    cuda_noted = 1;
                    continue;
                }
                fprintf(stderr, "kvmatch bench index: building %s at %u workers failed: %s\n",
                        s->backend, workers, s->why[0] ? s->why : km_strerror(s->build_status));
                failed = 1;
                break;
            }
            s->rps = calloc(reps, sizeof(double));
            s->bps = calloc(reps, sizeof(double));
            s->sps = calloc(reps, sizeof(double));
            s->lat = calloc(reps * b.n_batches, sizeof(double));
            if (!s->rps || !s->bps || !s->sps || !s->lat) {
                failed = 1;
                break;
            }
        }
        if (!failed && (rc = make_reference(&ctx, &sc[0])) != KM_OK) {
            fprintf(stderr, "kvmatch bench index: cpu scoring failed: %s\n", km_strerror(rc));
            failed = 1;
        }
        if (!failed) {
            km_index_stats st;
            km_index_get_stats(sc[0].index, &st);
            if (st.block_capacity > limit_slots) {
                int huge = 0;
                uint64_t per_thread = quick ? LIMIT_QUICK_READS_PER_THREAD : LIMIT_READS_PER_THREAD;
                limit_slots = st.block_capacity;
                limit = measure_limit(&ctx, st.block_capacity, per_thread, &huge);
                json_object_set_new(limit_detail, "table_slots",
                                    json_integer((json_int_t)limit_slots));
                json_object_set_new(limit_detail, "table_bytes",
                                    json_integer((json_int_t)(limit_slots * 16u)));
                json_object_set_new(limit_detail, "madvise_hugepage", json_boolean(huge));
                json_object_set_new(limit_detail, "prefetch_group", json_integer(LIMIT_GROUP));
                json_object_set_new(limit_detail, "reads_per_thread",
                                    json_integer((json_int_t)per_thread));
            }
        }
        for (size_t i = 1; i < n_sc && !failed; i++) { /* sc[0] is the reference itself */
            if (sc[i].build_status != KM_OK)
                continue;
            if ((rc = verify(&ctx, &sc[i])) != KM_OK) {
                fprintf(stderr, "kvmatch bench index: scoring with %s failed: %s\n", sc[i].backend,
                        km_strerror(rc));
                failed = 1;
            }
        }
        if (!json)
            fprintf(stderr, "  [%5.1f s] %u workers: built, reference and ceiling done, answers "
                    "verified; timing\n", km_bench_now_s() - t0, workers);
        /* Repetitions interleave the backends, so a noisy stretch of machine time hits all. */
        for (int rep = 0; rep < ctx.reps && !failed; rep++) {
            for (size_t i = 0; i < n_sc && !failed; i++) {
                if (sc[i].build_status != KM_OK)
                    continue;
                if ((rc = measure_rep(&ctx, &sc[i], rep)) != KM_OK) {
                    fprintf(stderr, "kvmatch bench index: scoring with %s failed: %s\n",
                            sc[i].backend, km_strerror(rc));
                    failed = 1;
                }
            }
        }
        for (size_t i = 0; i < n_sc; i++) {
            if (!failed && sc[i].build_status == KM_OK) {
                row r = make_row(&ctx, &sc[i], workers);
                if (r.mismatches)
                    json_array_append_new(notes, json_sprintf(
                        "%s at %u workers: %llu of %zu answers differ from the cpu index",
                        r.backend, workers, (unsigned long long)r.mismatches, wl.n_queries));
                if (!json)
                    fprintf(stderr, "  [%5.1f s] %-17s %5u workers: %.0f requests/s "
                            "(built in %.2f s)\n", km_bench_now_s() - t0, r.backend, workers,
                            r.requests_per_s, r.build_s);
                rows[n_rows++] = r;
            }
            scorer_free(&sc[i]);
        }
    }

    int status = failed ? 1 : 0;
    /* A row asked for by name that could not be measured fails the run (a GPU check must not
     * pass without its device); without --backends the cuda row is optional, as noted. */
    if (only && list_names(only, "cuda") && cuda_noted) {
        fprintf(stderr, "kvmatch bench index: --backends names cuda and it was not measured "
                        "(see notes)\n");
        status = 1;
    }
    if (!failed) {
        json_t *ratios = json_object();
        for (size_t wi = 0; wi < N_WORKER_COUNTS; wi++) {
            uint32_t w = bench_worker_counts[wi];
            const row *cpu = find_row(rows, n_rows, "cpu", w);
            if (!cpu)
                continue;
            json_t *o = json_object();
            static const char *const others[] = {"radix", "radix_compressed", "flatmap",
                                                 "cpu_nosegments", "cuda"};
            for (size_t k = 0; k < sizeof(others) / sizeof(others[0]); k++) {
                const row *other = find_row(rows, n_rows, others[k], w);
                if (!other)
                    continue;
                char key[64];
                if (!strcmp(others[k], "cuda")) { /* the device is the one expected to win */
                    json_object_set_new(o, "cuda_over_cpu",
                                        json_real(ratio(other->requests_per_s, cpu->requests_per_s)));
                    continue;
                }
                snprintf(key, sizeof key, "cpu_over_%s", others[k]);
                json_object_set_new(o, key,
                                    json_real(ratio(cpu->requests_per_s, other->requests_per_s)));
            }
            json_object_set_new(o, "cpu_block_probes_over_limit",
                                json_real(ratio(cpu->block_probes_per_s, limit)));
            json_object_set_new(o, "cpu_slot_reads_over_limit",
                                json_real(ratio(cpu->slot_reads_per_s, limit)));
            char wkey[16];
            snprintf(wkey, sizeof wkey, "%u", w);
            json_object_set_new(ratios, wkey, o);
        }
        json_array_append_new(notes, json_sprintf("trace load + hashing took %.2f s (not measured)",
                                                  wl.expand_s));
        json_array_append_new(notes, json_string(
            "baselines answer one request at a time on the same thread count; the trees read local "
            "hashes, the index and the flat map chain hashes; hashing is outside every timing"));

        /* argv[0] is the program name for getopt's messages (km_cli_getopt_begin), not "index". */
        char command[512] = "kvmatch bench index";
        for (int i = 1; i < argc; i++) {
            size_t len = strlen(command);
            snprintf(command + len, sizeof command - len, " %s", argv[i]);
        }
        if (json) {
            json_t *rs = json_array();
            for (size_t i = 0; i < n_rows; i++)
                json_array_append_new(rs, row_json(&rows[i]));
            json_t *workload_json = json_pack(
                "{s:s, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:s, s:f, s:o, s:I, s:I, s:I, s:b}",
                "trace", trace_path,
                "requests", (json_int_t)wl.n_requests,
                "state_requests", (json_int_t)wl.n_state,
                "query_requests", (json_int_t)wl.n_queries,
                "block_size", (json_int_t)BENCH_BLOCK_SIZE,
                "tokens_per_id", (json_int_t)BENCH_TOKENS_PER_ID,
                "total_blocks", (json_int_t)wl.total_blocks,
                "query_blocks", (json_int_t)wl.query_blocks,
                "assignment",
                "vllm-router cache_aware without load terms: a state request goes to the owner of "
                "the deepest existing match (lowest worker id on ties) when that match covers more "
                "than cache_threshold of its blocks, else to the next worker round-robin; the worker "
                "stores the request's whole chain; no eviction",
                "cache_threshold", BENCH_CACHE_THRESHOLD_PERCENT / 100.0,
                "per_workers", per_workers,
                "batch_requests", (json_int_t)BENCH_BATCH,
                "batches_per_rep", (json_int_t)b.n_batches,
                "reps", (json_int_t)ctx.reps,
                "quick", quick);
            json_t *defs = json_pack(
                "{s:s, s:s, s:s, s:s, s:s, s:s, s:s, s:s}",
                "requests_per_s", "queries scored per second of scoring time (km_bench_median over reps)",
                "block_probes_per_s",
                "request blocks resolved per second = sum of the scored requests' chain lengths / "
                "scoring time (km_bench_median over reps)",
                "slot_reads_per_s",
                "table lookups actually made per second: km_match_results.probes (block and segment "
                "keys) for the index; node visits (one per child lookup) for the trees; map lookups "
                "for the flat map",
                "batch_p50_us / batch_p99_us",
                "wall time of one batch of 1024 requests, nearest-rank percentile over all batches of "
                "all reps",
                "bytes_per_pair",
                "memory of the structure / (block, worker) pairs held: km_index_stats.memory_bytes "
                "for the index; for the baselines every allocation (sets, children tables, "
                "per-worker lookups, hash maps at their capacity; node and set arrays at the entries "
                "in use, as a per-object allocator would hold them)",
                "limit_slot_reads_per_s",
                "independent random 16-byte reads per second from a table as large as the cpu index's "
                "block table (madvise MADV_HUGEPAGE), prefetched in groups, same threads",
                "ratios", "per worker count: cpu requests_per_s over each baseline's (cuda_over_cpu "
                "the other way round); cpu block_probes_per_s and slot_reads_per_s over "
                "limit_slot_reads_per_s",
                "mismatches", "queries whose answer differs from the cpu index's (must be 0)");
            json_object_set_new(limit_detail, "slot_reads_per_s",
                                json_integer((json_int_t)(limit + 0.5)));
            json_t *root = json_object();
            json_object_set_new(root, "benchmark", json_string("index"));
            json_object_set_new(root, "machine", machine);
            machine = NULL;
            json_object_set_new(root, "command", json_string(command));
            json_object_set_new(root, "workload", workload_json);
            json_object_set_new(root, "definitions", defs);
            json_object_set_new(root, "results", rs);
            json_object_set_new(root, "limit_slot_reads_per_s",
                                json_integer((json_int_t)(limit + 0.5)));
            json_object_set_new(root, "limit", limit_detail);
            json_object_set_new(root, "ratios", ratios);
            json_object_set_new(root, "notes", notes);
            notes = NULL;
            limit_detail = NULL;
            per_workers = NULL;
            json_dumpf(root, stdout, JSON_INDENT(2) | JSON_REAL_PRECISION(10));
            fputc('\n', stdout);
            json_decref(root);
        } else {
            printf("kvmatch bench index: %zu state requests, %zu queries (%llu blocks), "
                   "%u threads, %d reps\n",
                   wl.n_state, wl.n_queries, (unsigned long long)wl.query_blocks, threads, ctx.reps);
            print_table(rows, n_rows, limit, notes);
            const char *key;
            json_t *v;
            json_object_foreach(ratios, key, v) {
                printf("ratios at %s workers:", key);
                const char *rk;
                json_t *rv;
                json_object_foreach(v, rk, rv) printf(" %s %.2f", rk, json_real_value(rv));
                printf("\n");
            }
            json_decref(ratios);
        }
        for (size_t i = 0; i < n_rows; i++)
            if (rows[i].mismatches)
                status = 1;
    }
    json_decref(machine);
    json_decref(notes);
    json_decref(limit_detail);
    json_decref(per_workers);
    for (uint32_t t = 0; t < threads; t++)
        km_baseline_result_free(&ctx.bl_results[t]);
    free(ctx.bl_results);
    for (uint32_t t = 0; ctx.bl_out && t < threads; t++) {
        free(ctx.bl_out[t].matches);
        free(ctx.bl_out[t].requests);
    }
    free(ctx.bl_out);
    km_match_results_free(&ctx.results);
    reference_free(&ctx.ref);
    free(rows);
    free(b.requests);
    free(b.query_of);
    pool_destroy(&pool);
    workload_free(&wl);
    return status;
}
