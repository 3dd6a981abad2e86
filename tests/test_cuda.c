/* SPDX-License-Identifier: Apache-2.0 */
/* The CUDA backend against the CPU backend: the same updates go to one index
 * of each kind, and every scoring batch must come back identical bit for bit (the CPU side is also
 * checked against the brute-force oracle) and scored by the device: a batch the CUDA index scored
 * on the host (km_index_stats.host_scored_batches) fails the comparison, and a table's move to
 * larger arrays is driven to its end before it. Random workloads for every segment size at 8 and
 * 1000 workers, the Mooncake trace, a batch over one scoring chunk's hashes, a compare after a
 * move, and two small batches for the sanitizers (walk scratch in shared and in global memory).
 * Without a usable device these tests are reported as skipped (as failed with KM_REQUIRE_CUDA=1,
 * which scripts/gpu-check.sh sets).
 * Also: KM_BACKEND_AUTO gives the CPU backend even where a CUDA index can be created, and a
 * snapshot loaded into a second CUDA index of the same process scores as the CPU index it was
 * saved from. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "index/index_internal.h"
#include "test_util.h"

typedef struct log_capture {
    int lines;
    char last[512];
} log_capture;

/* Keeps the last line without its stated level (kvmatch/log.h): it becomes a skip reason. */
static void capture_log(void *user, const char *line)
{
    log_capture *c = user;
    c->lines++;
    if (line[0] == '<' && line[1] >= '0' && line[1] <= '7' && line[2] == '>')
        line += 3;
    snprintf(c->last, sizeof c->last, "%s", line);
}

static int create_backend_sized(km_backend_kind kind, uint32_t W, uint32_t S,
                                uint32_t initial_blocks, log_capture *log, km_index **out)
{
    km_index_config cfg;
    km_index_config_init(&cfg);
    cfg.backend = kind;
    cfg.max_workers = W;
    cfg.segment_blocks = S;
    cfg.initial_blocks = initial_blocks;
    cfg.threads = 2;
    cfg.log = capture_log;
    cfg.log_user = log;
    *out = NULL;
    return km_index_create(&cfg, out);
}

static int create_backend(km_backend_kind kind, uint32_t W, uint32_t S, log_capture *log,
                          km_index **out)
{
    /* small: the device replica must follow table growth */
    return create_backend_sized(kind, W, S, 256, log, out);
}

/* Set (KM_REQUIRE_CUDA=1, as scripts/gpu-check.sh does) on a machine lent for its GPU: there a
 * missing device is the failure under test, not a reason to skip. */
static int cuda_required(void)
{
    const char *v = getenv("KM_REQUIRE_CUDA");
    return v && strcmp(v, "1") == 0;
}

/* A CUDA index, or skip the test when there is no usable device (fail instead under
 * KM_REQUIRE_CUDA=1). Only KM_ERR_BACKEND_UNAVAILABLE means that (kernels/cuda_seam.h): KM_ERR_CUDA
 * is a failure on a usable device (the probe launch, the stream, the first upload) and fails the
 * test. `log` receives the index's log lines for as long as the index lives, so it must outlive
 * it (it belongs to the caller's pair, never to this frame). */
static km_index *cuda_or_skip(uint32_t W, uint32_t S, uint32_t initial_blocks, log_capture *log)
{
    km_index *index;
    int rc = create_backend_sized(KM_BACKEND_CUDA, W, S, initial_blocks, log, &index);
    if (rc == KM_ERR_BACKEND_UNAVAILABLE) {
        if (cuda_required())
            cr_assert_fail("KM_REQUIRE_CUDA=1 and no usable CUDA device: %s%s%s", km_error_name(rc),
                    log->lines ? ": " : "", log->last);
        cr_skip_test("no usable CUDA device: %s%s%s", km_error_name(rc), log->lines ? ": " : "",
                     log->last);
    }
    cr_assert_eq(rc, KM_OK, "creating a CUDA index: %s (%s)", km_error_name(rc), log->last);
    cr_assert_str_eq(km_index_backend_name(index), "cuda");
    return index;
}

static km_index *cpu_index(uint32_t W, uint32_t S, uint32_t initial_blocks, log_capture *log)
{
    km_index *index;
    int rc = create_backend_sized(KM_BACKEND_CPU, W, S, initial_blocks, log, &index);
    cr_assert_eq(rc, KM_OK, "creating a CPU index: %s", km_error_name(rc));
    cr_assert_str_eq(km_index_backend_name(index), "cpu");
    return index;
}

/* The two indexes and their log captures, which live as long as the indexes that write them. */
typedef struct pair {
    km_index *cpu, *cuda;
    log_capture cpu_log, cuda_log;
    km_oracle oracle;
    km_match_results cpu_res, cuda_res;
    uint32_t S;
    size_t batches;
} pair;

static void pair_init_sized(pair *p, uint32_t W, uint32_t S, uint32_t initial_blocks)
{
    memset(p, 0, sizeof *p);
    p->cuda = cuda_or_skip(W, S, initial_blocks, &p->cuda_log);
    p->cpu = cpu_index(W, S, initial_blocks, &p->cpu_log);
    p->S = S;
    km_oracle_init(&p->oracle, W);
    km_match_results_init(&p->cpu_res);
    km_match_results_init(&p->cuda_res);
}

static void pair_init(pair *p, uint32_t W, uint32_t S)
{
    pair_init_sized(p, W, S, 256);
}

static void pair_free(pair *p)
{
    km_index_destroy(p->cpu);
    km_index_destroy(p->cuda);
    km_oracle_free(&p->oracle);
    km_match_results_free(&p->cpu_res);
    km_match_results_free(&p->cuda_res);
}

/* Apply to both indexes; both report what the oracle expects. The oracle itself is updated by
 * the caller (km_oracle_apply or km_trace_scenario). */
static void pair_apply(void *ctx, const km_update *u, size_t n, const km_update_stats *expect)
{
    pair *p = ctx;
    km_update_stats a, b;
    char why[512];
    int rc = km_index_apply(p->cpu, u, n, &a);
    KM_CHECK(rc == KM_OK, "cpu apply %zu: %s (%s)", p->batches, km_error_name(rc),
             km_index_last_error(p->cpu));
    rc = km_index_apply(p->cuda, u, n, &b);
    KM_CHECK(rc == KM_OK, "cuda apply %zu: %s (%s)", p->batches, km_error_name(rc),
             km_index_last_error(p->cuda));
    KM_CHECK(strcmp(km_index_backend_name(p->cuda), "cuda") == 0,
             "cuda apply %zu: the CUDA index fell back to %s: %s", p->batches,
             km_index_backend_name(p->cuda), p->cuda_log.last);
    KM_CHECK(km_update_stats_equal(&a, expect, why, sizeof why), "cpu batch %zu: %s", p->batches,
             why);
    KM_CHECK(km_update_stats_equal(&b, expect, why, sizeof why), "cuda batch %zu: %s", p->batches,
             why);
    p->batches++;
}

/* While a table of the CUDA index moves to larger arrays its replica is not synced and batches
 * are scored on the host; empty update batches each move a step more (km_index_apply's sync), so
 * this ends the move and leaves a synced replica (the first sync after a move uploads it whole). */
static void pair_finish_moves(pair *p, const char *when)
{
    km_index *x = p->cuda;
    for (int i = 0; i < 100000 && x->replica_stale; i++) {
        if (!x->blocks.old_slots && !x->segments.old_slots)
            break; /* stale for another reason: no empty batch ends that */
        int rc = km_index_apply(x, NULL, 0, NULL);
        KM_CHECK(rc == KM_OK, "%s: an empty batch: %s", when, km_error_name(rc));
    }
    KM_CHECK(!x->replica_stale, "%s: the replica is still not synced (a table moving: %d; log: %s)",
             when, x->blocks.old_slots || x->segments.old_slots, p->cuda_log.last);
}

/* Score the same requests on both; CUDA vs CPU bit for bit, and (when with_oracle) CPU vs the
 * oracle. The CUDA index must score the batch on the device: a move in progress is ended first,
 * and a batch it scored on the host (a failed scoring or sync that the index scored around) fails
 * here. The trace cases skip the oracle: tests/test_match.c checks the CPU side there. */
static void pair_compare(pair *p, const km_request *q, size_t n, int with_oracle, const char *when)
{
    char why[512];
    pair_finish_moves(p, when);
    km_index_stats before, after;
    KM_CHECK(km_index_get_stats(p->cuda, &before) == KM_OK, "%s: stats", when);
    int rc = km_index_match_batch(p->cpu, q, n, &p->cpu_res);
    KM_CHECK(rc == KM_OK, "%s: cpu match: %s", when, km_error_name(rc));
    rc = km_index_match_batch(p->cuda, q, n, &p->cuda_res);
    KM_CHECK(rc == KM_OK, "%s: cuda match: %s (%s; log: %s)", when, km_error_name(rc),
             km_index_last_error(p->cuda), p->cuda_log.last);
    KM_CHECK(km_index_get_stats(p->cuda, &after) == KM_OK, "%s: stats", when);
    KM_CHECK(after.host_scored_batches == before.host_scored_batches,
             "%s: the CUDA index scored the batch on the host, not the device (log: %s)", when,
             p->cuda_log.last);
    /* The fallback's cause is in the index's log line, not in last_error: print it. */
    KM_CHECK(strcmp(km_index_backend_name(p->cuda), "cuda") == 0,
             "%s: the CUDA index fell back to %s: %s", when, km_index_backend_name(p->cuda),
             p->cuda_log.last);
    KM_CHECK(!with_oracle || km_check_results(&p->oracle, q, n, &p->cpu_res, p->S, why, sizeof why),
             "%s: cpu vs oracle: %s", when, why);
    KM_CHECK(km_results_identical(&p->cuda_res, &p->cpu_res, why, sizeof why),
             "%s: cuda vs cpu (S=%u): %s", when, p->S, why);
    KM_CHECK(km_check_counters(&p->oracle, p->cuda, why, sizeof why), "%s: cuda counters: %s",
             when, why);
}

static void cuda_random(uint32_t S)
{
    /* One bitmap word, and 16 words of which the last is partly used (1,000 is no multiple of 64:
     * lanes 0..15 of a warp own a word, the rest none). */
    const uint32_t workers[] = {8, 1000};
    for (int k = 0; k < 2; k++) {
        uint32_t W = workers[k];
        pair p;
        pair_init(&p, W, S);
        km_rng r;
        km_rng_init(&r, km_test_seed() ^ ((uint64_t)S << 40) ^ W);
        km_corpus corpus;
        const uint32_t block_sizes[] = {1, 4, 16};
        km_corpus_generate(&corpus, &r, 150, block_sizes[km_rng_below(&r, 3)], 300);
        km_workload wl;
        km_workload_init(&wl, &corpus, W);
        km_request_set rs = {0};
        char when[96];
        for (int step = 0; step < 25; step++) {
            km_workload_step(&wl, &r, &p.oracle, 6);
            km_update_stats expect;
            km_oracle_apply(&p.oracle, wl.updates, wl.n_updates, &expect);
            pair_apply(&p, wl.updates, wl.n_updates, &expect);
            km_request_set_generate(&rs, &r, &corpus, 1500);
            snprintf(when, sizeof when, "S=%u W=%u step %d", S, W, step);
            pair_compare(&p, rs.requests, rs.n, 1, when);
        }
        /* One large batch, and one of a single request. */
        km_request_set_generate(&rs, &r, &corpus, 20000);
        snprintf(when, sizeof when, "S=%u W=%u 20000 requests", S, W);
        pair_compare(&p, rs.requests, rs.n, 1, when);
        pair_compare(&p, rs.requests, 1, 1, when);
        km_request_set_free(&rs);
        km_workload_free(&wl);
        km_corpus_free(&corpus);
        pair_free(&p);
    }
}

/* A snapshot loaded into a second CUDA index (km_index_load replaces its host tables, and the
 * replica must be uploaded whole) scores as the CPU index it was saved from, while the first CUDA
 * index of the process keeps scoring beside it; then both follow the same updates (patches). */
Test(cuda, a_snapshot_loaded_into_a_second_cuda_index_scores_as_the_cpu, .timeout = 120)
{
    const uint32_t W = 64, S = 4;
    pair p;
    pair_init(&p, W, S);
    log_capture second_log = {0};
    km_index *second = cuda_or_skip(W, S, 256, &second_log);
    km_rng r;
    km_rng_init(&r, km_test_seed() ^ 0x5A7E);
    km_corpus corpus;
    km_corpus_generate(&corpus, &r, 150, 4, 300);
    km_workload wl;
    km_workload_init(&wl, &corpus, W);
    km_request_set rs = {0};
    km_update_stats expect, got;
    char why[512], when[96];
    for (int step = 0; step < 8; step++) {
        km_workload_step(&wl, &r, &p.oracle, 6);
        km_oracle_apply(&p.oracle, wl.updates, wl.n_updates, &expect);
        pair_apply(&p, wl.updates, wl.n_updates, &expect);
    }
    char path[] = "/tmp/kvmatch-cuda-snapshot-XXXXXX";
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    close(fd);
    cr_assert_eq(km_index_save(p.cpu, path, NULL, 0), KM_OK, "%s", km_index_last_error(p.cpu));
    int rc = km_index_load(second, path, NULL, NULL);
    unlink(path);
    cr_assert_eq(rc, KM_OK, "loading into the second CUDA index: %s", km_index_last_error(second));
    km_match_results res;
    km_match_results_init(&res);
    for (int step = 0; step < 6; step++) {
        if (step > 0) { /* the same updates on every index */
            km_workload_step(&wl, &r, &p.oracle, 6);
            km_oracle_apply(&p.oracle, wl.updates, wl.n_updates, &expect);
            pair_apply(&p, wl.updates, wl.n_updates, &expect);
            rc = km_index_apply(second, wl.updates, wl.n_updates, &got);
            cr_assert_eq(rc, KM_OK, "second apply: %s", km_index_last_error(second));
            cr_assert(km_update_stats_equal(&got, &expect, why, sizeof why), "second: %s", why);
        }
        km_request_set_generate(&rs, &r, &corpus, 1500);
        snprintf(when, sizeof when, "step %d", step);
        pair_compare(&p, rs.requests, rs.n, 1, when);
        rc = km_index_match_batch(second, rs.requests, rs.n, &res);
        cr_assert_eq(rc, KM_OK, "%s: second match: %s (log: %s)", when, km_error_name(rc),
                     second_log.last);
        cr_assert_str_eq(km_index_backend_name(second), "cuda",
                         "%s: the second index fell back: %s", when, second_log.last);
        cr_assert(km_results_identical(&res, &p.cpu_res, why, sizeof why),
                  "%s: second cuda vs cpu: %s", when, why);
    }
    km_match_results_free(&res);
    km_request_set_free(&rs);
    km_workload_free(&wl);
    km_corpus_free(&corpus);
    km_index_destroy(second);
    pair_free(&p);
}

Test(cuda, matches_cpu_random_s32, .timeout = 120) { cuda_random(32); }
Test(cuda, matches_cpu_random_s4, .timeout = 120) { cuda_random(4); }
Test(cuda, matches_cpu_random_s1, .timeout = 120) { cuda_random(1); }
Test(cuda, matches_cpu_random_s0, .timeout = 120) { cuda_random(0); }

/* Requests over chains[c * len ..) : prefixes of random chains of random lengths (some whole). */
static km_request *chain_requests(km_rng *r, const uint64_t *chains, uint32_t n_chains,
                                  uint32_t len, size_t n)
{
    km_request *q = malloc(n * sizeof *q);
    cr_assert_not_null(q);
    for (size_t i = 0; i < n; i++) {
        uint32_t c = km_rng_below(r, n_chains);
        uint32_t k = km_rng_percent(r, 20) ? len : 1 + km_rng_below(r, len);
        q[i] = (km_request){chains + (size_t)c * len, k};
    }
    return q;
}

/* Score q[0..n) on both indexes after filling the CUDA results' entries with a pattern no walk
 * writes, so an entry the copy back left out cannot pass for the previous batch's. */
static void pair_compare_scrambled(pair *p, const km_request *q, size_t n, int with_oracle,
                                   const char *when)
{
    if (p->cuda_res.matches && p->cuda_res.n_matches > 0)
        memset(p->cuda_res.matches, 0xA5, p->cuda_res.n_matches * sizeof *p->cuda_res.matches);
    pair_compare(p, q, n, with_oracle, when);
}

/* Batches whose results span several copy-back pieces (kernels/cuda_kernels.cu,
 * KM_CUDA_RESULT_PIECES of about KM_CUDA_RESULT_PIECE_MIN bytes) and whose hashes are packed by
 * two host threads: 512 workers, three in four holding a prefix of random length of chain A and
 * one in four of chain B, so a request names 384 or 128 workers (3 or 1 KB of results) and a
 * batch's total is no round number. 2,000 requests (every tenth empty) make several megabytes;
 * 9,000 take two scoring chunks, the second starting after the first's entries; then three
 * requests take one piece. Before each batch the previous results are overwritten. */
Test(cuda, results_of_several_megabytes_come_back_whole, .timeout = 120)
{
    const uint32_t W = 512, S = 32, N = 300, NQ = 9000;
    pair p;
    pair_init(&p, W, S);
    km_rng r;
    km_rng_init(&r, km_test_seed() ^ 0xC0B7);
    uint64_t *chains = malloc(2 * N * sizeof *chains);
    km_update *u = malloc(W * sizeof *u);
    km_request *q = malloc(NQ * sizeof *q);
    cr_assert(chains && u && q);
    for (uint32_t i = 0; i < 2 * N; i++)
        chains[i] = km_rng_hash(&r);
    for (uint32_t w = 0; w < W; w++)
        u[w] = (km_update){KM_UPDATE_STORE, w, KM_NO_PARENT, chains + (w % 4 == 0 ? N : 0),
                           1 + km_rng_below(&r, N), KM_TIER_DEVICE};
    km_update_stats expect;
    km_oracle_apply(&p.oracle, u, W, &expect);
    pair_apply(&p, u, W, &expect);
    for (uint32_t i = 0; i < NQ; i++)
        q[i] = i % 10 == 3 ? (km_request){NULL, 0}
                           : (km_request){chains + km_rng_below(&r, 2) * N,
                                          1 + km_rng_below(&r, N)};
    pair_compare_scrambled(&p, q, 2000, 1, "2,000 requests");
    size_t entries = p.cuda_res.n_matches;
    KM_CHECK(entries * sizeof(km_worker_match) > ((size_t)2 << 20),
             "the batch was meant to bring back over 2 MB: %zu entries", entries);
    pair_compare_scrambled(&p, q, NQ, 0, "9,000 requests"); /* the CPU side is checked above */
    pair_compare_scrambled(&p, q + 1, 3, 1, "three requests");
    free(q);
    free(u);
    free(chains);
    pair_free(&p);
}

/* The widest bitmaps (KM_MAX_WORKERS_LIMIT workers: 1,024 words per set, 201 requests per scoring
 * chunk, so 700 requests take four) and bitmap patches longer than one staging round: 5,000 blocks
 * whose holders are spread over the words become 5,000 bitmaps (a pool growth: uploaded whole);
 * the 6th and 7th holders and every REMOVE_WORKER then rewrite all of them in one batch, patched in
 * two rounds
 * (KM_CUDA_SYNC_ROUND_BYTES / 8 KiB = 4,094 bitmaps per round), down to the removals that demote
 * the sets back to inline form. */
Test(cuda, widest_bitmaps_and_multi_round_set_patches, .timeout = 120)
{
    const uint32_t W = KM_MAX_WORKERS_LIMIT, S = 32, N = 5000, NQ = 700;
    const uint32_t holders[] = {0, 63, 64, 20000, 40001, W - 1, 1000};
    const size_t n_holders = sizeof holders / sizeof holders[0];
    pair p;
    pair_init(&p, W, S);
    km_rng r;
    km_rng_init(&r, km_test_seed() ^ 0xB175);
    uint64_t *chain = malloc(N * sizeof *chain);
    cr_assert_not_null(chain);
    for (uint32_t i = 0; i < N; i++)
        chain[i] = km_rng_hash(&r);
    km_request *q = chain_requests(&r, chain, 1, N, NQ);
    char when[96];
    km_update_stats expect;
    for (size_t k = 0; k < n_holders; k++) {
        km_update u = {KM_UPDATE_STORE, holders[k], KM_NO_PARENT, chain, N, KM_TIER_DEVICE};
        km_oracle_apply(&p.oracle, &u, 1, &expect);
        pair_apply(&p, &u, 1, &expect);
        if (k + 1 < 5)
            continue; /* inline sets: the other tests cover them */
        snprintf(when, sizeof when, "W=%u after %zu holders", W, k + 1);
        pair_compare(&p, q, NQ, 0, when);
    }
    /* Removals rewrite the bitmaps too (a REMOVE_WORKER every one); at 3 holders the sets are
     * inline again. */
    for (size_t k = 0; k + 1 < n_holders; k++) {
        km_update u = {KM_UPDATE_REMOVE, holders[k], KM_NO_PARENT, chain + N / 2, N - N / 2,
                       KM_TIER_DEVICE};
        if (k % 2)
            u = (km_update){KM_UPDATE_REMOVE_WORKER, holders[k], KM_NO_PARENT, NULL, 0,
                            KM_TIER_DEVICE};
        km_oracle_apply(&p.oracle, &u, 1, &expect);
        pair_apply(&p, &u, 1, &expect);
        snprintf(when, sizeof when, "W=%u after %zu removals", W, k + 1);
        pair_compare(&p, q, NQ, 0, when);
    }
    free(q);
    free(chain);
    pair_free(&p);
}

/* Slot patches longer than one staging round (KM_CUDA_SYNC_ROUND_BYTES / 24 B = 1,398,101 slots):
 * tables sized up front so nothing grows, then one batch stores 1.5 M blocks (about 3 M dirty-slot
 * entries, fewer than the 4 M slots, so the replica is patched, not uploaded) and one erases 1 M of
 * them (backward shifts: more slots rewritten). */
Test(cuda, slot_patches_longer_than_one_round, .timeout = 240)
{
    const uint32_t W = 8, S = 32, CHAINS = 1500, LEN = 1000;
    pair p;
    pair_init_sized(&p, W, S, 2900000);
    km_rng r;
    km_rng_init(&r, km_test_seed() ^ 0x5107);
    uint64_t *chains = malloc((size_t)CHAINS * LEN * sizeof *chains);
    km_update *u = malloc(CHAINS * sizeof *u);
    cr_assert(chains && u);
    for (size_t i = 0; i < (size_t)CHAINS * LEN; i++)
        chains[i] = km_rng_hash(&r);
    for (uint32_t c = 0; c < CHAINS; c++)
        u[c] = (km_update){KM_UPDATE_STORE, c % W, KM_NO_PARENT, chains + (size_t)c * LEN, LEN,
                           KM_TIER_DEVICE};
    km_index_stats st;
    cr_assert_eq(km_index_get_stats(p.cuda, &st), KM_OK);
    uint64_t capacity = st.block_capacity;
    km_update_stats expect;
    km_oracle_apply(&p.oracle, u, CHAINS, &expect);
    pair_apply(&p, u, CHAINS, &expect);
    km_request *q = chain_requests(&r, chains, CHAINS, LEN, 3000);
    pair_compare(&p, q, 3000, 0, "1.5 M blocks stored in one batch");
    for (uint32_t c = 0; c < 1000; c++)
        u[c].kind = KM_UPDATE_REMOVE;
    km_oracle_apply(&p.oracle, u, 1000, &expect);
    pair_apply(&p, u, 1000, &expect);
    pair_compare(&p, q, 3000, 0, "1 M blocks removed in one batch");
    cr_assert_eq(km_index_get_stats(p.cuda, &st), KM_OK);
    cr_assert_eq(st.block_capacity, capacity, "the block table grew: the batches were uploaded "
                 "whole, not patched");
    free(q);
    free(u);
    free(chains);
    pair_free(&p);
}

/* Small batches for compute-sanitizer (scripts/gpu-check.sh runs `cuda/small_batch_*` under
 * racecheck, synccheck and memcheck, where the larger tests would take minutes): a few random
 * update batches and 64 requests at W workers. At 1,000 workers a warp's walk scratch is in shared
 * memory; past 2,808 (KM_CUDA_WALK_SHARED_BYTES over KM_CUDA_WALK_WARPS warps) it is in global
 * scratch, so 3,000 takes the other path. */
static void cuda_small_batch(uint32_t W)
{
    const uint32_t S = 4;
    pair p;
    pair_init(&p, W, S);
    km_rng r;
    km_rng_init(&r, km_test_seed() ^ 0x5A17 ^ W);
    km_corpus corpus;
    km_corpus_generate(&corpus, &r, 40, 4, 100);
    km_workload wl;
    km_workload_init(&wl, &corpus, W);
    km_request_set rs = {0};
    char when[96];
    for (int step = 0; step < 3; step++) {
        km_workload_step(&wl, &r, &p.oracle, 6);
        km_update_stats expect;
        km_oracle_apply(&p.oracle, wl.updates, wl.n_updates, &expect);
        pair_apply(&p, wl.updates, wl.n_updates, &expect);
        km_request_set_generate(&rs, &r, &corpus, 64);
        snprintf(when, sizeof when, "W=%u step %d", W, step);
        pair_compare(&p, rs.requests, rs.n, 1, when);
    }
    km_request_set_free(&rs);
    km_workload_free(&wl);
    km_corpus_free(&corpus);
    pair_free(&p);
}

Test(cuda, small_batch_1000_workers_scratch_in_shared_memory, .timeout = 60)
{
    cuda_small_batch(1000);
}

Test(cuda, small_batch_3000_workers_scratch_in_global_memory, .timeout = 60)
{
    cuda_small_batch(3000);
}

/* One batch of more hashes than a scoring chunk stages (KM_CUDA_HASH_BUDGET in
 * kernels/cuda_kernels.cu, 4 M), so it is cut into chunks by hashes, not by requests: 4,300
 * requests of 1,000 blocks over 64 chains that 8 workers hold prefixes of. The second chunk's
 * entries follow the first's. */
Test(cuda, a_batch_over_one_chunks_hashes_scores_on_the_device, .timeout = 120)
{
    const uint32_t W = 8, S = 32, CHAINS = 64, LEN = 1000, NQ = 4300;
    const uint64_t hash_budget = (uint64_t)1 << 22;
    pair p;
    pair_init_sized(&p, W, S, 200000);
    km_rng r;
    km_rng_init(&r, km_test_seed() ^ 0x4B0D);
    uint64_t *chains = malloc((size_t)CHAINS * LEN * sizeof *chains);
    km_update *u = malloc(CHAINS * sizeof *u);
    km_request *q = malloc(NQ * sizeof *q);
    cr_assert(chains && u && q);
    for (size_t i = 0; i < (size_t)CHAINS * LEN; i++)
        chains[i] = km_rng_hash(&r);
    for (uint32_t c = 0; c < CHAINS; c++)
        u[c] = (km_update){KM_UPDATE_STORE, c % W, KM_NO_PARENT, chains + (size_t)c * LEN,
                           1 + km_rng_below(&r, LEN), KM_TIER_DEVICE};
    km_update_stats expect;
    km_oracle_apply(&p.oracle, u, CHAINS, &expect);
    pair_apply(&p, u, CHAINS, &expect);
    uint64_t hashes = 0;
    for (uint32_t i = 0; i < NQ; i++) {
        q[i] = (km_request){chains + (size_t)km_rng_below(&r, CHAINS) * LEN, LEN};
        hashes += LEN;
    }
    cr_assert_gt(hashes, hash_budget, "the batch was meant to exceed one chunk's hashes");
    pair_compare_scrambled(&p, q, NQ, 0, "4.3 M hashes in one batch");
    pair_compare_scrambled(&p, q, 16, 1, "16 of those requests");
    free(q);
    free(u);
    free(chains);
    pair_free(&p);
}

/* A compare after a table's move to larger arrays has ended: chains stored one batch at a time
 * from 256 slots until the block table grows incrementally (16 K slots or more: the keys move
 * over later batches while the host scores); the move is then driven to its end, the replica
 * uploaded whole, and the batch must be scored by the device, as must the next after a patch. */
Test(cuda, a_table_moved_to_larger_arrays_scores_on_the_device, .timeout = 120)
{
    const uint32_t W = 64, S = 4, LEN = 64, MAX_CHAINS = 4096;
    pair p;
    pair_init(&p, W, S);
    km_rng r;
    km_rng_init(&r, km_test_seed() ^ 0x3E0F);
    uint64_t *chains = malloc((size_t)MAX_CHAINS * LEN * sizeof *chains);
    cr_assert_not_null(chains);
    km_update_stats expect;
    uint32_t n = 0;
    while (!p.cuda->blocks.old_slots || p.cuda->blocks.old_capacity < KM_TABLE_INCREMENTAL_SLOTS) {
        cr_assert_lt(n, MAX_CHAINS, "the block table never grew incrementally");
        uint64_t *c = chains + (size_t)n * LEN;
        for (uint32_t i = 0; i < LEN; i++)
            c[i] = km_rng_hash(&r);
        km_update u = {KM_UPDATE_STORE, km_rng_below(&r, W), KM_NO_PARENT, c, LEN, KM_TIER_DEVICE};
        km_oracle_apply(&p.oracle, &u, 1, &expect);
        pair_apply(&p, &u, 1, &expect);
        n++;
    }
    cr_assert(p.cuda->replica_stale, "a move is under way, so the replica waits");
    uint64_t capacity = p.cuda->blocks.capacity;
    km_request *q = chain_requests(&r, chains, n, LEN, 2000);
    pair_compare(&p, q, 2000, 1, "after the move");
    cr_assert_null(p.cuda->blocks.old_slots, "the move did not end");
    cr_assert_eq(p.cuda->blocks.capacity, capacity);
    km_update u = {KM_UPDATE_STORE, 0, KM_NO_PARENT, chains, LEN, KM_TIER_DEVICE};
    km_oracle_apply(&p.oracle, &u, 1, &expect);
    pair_apply(&p, &u, 1, &expect);
    pair_compare(&p, q, 2000, 1, "a patch after the move");
    free(q);
    free(chains);
    pair_free(&p);
}

static void cuda_trace(uint32_t W, int affinity)
{
    pair p;
    pair_init(&p, W, 32);
    km_trace_case tc;
    char why[512];
    int rc = km_trace_case_load(&tc, 64, 7000, why, sizeof why);
    if (rc == KM_ERR_IO) {
        pair_free(&p);
        cr_skip_test("Mooncake trace not available: %s", why);
    }
    cr_assert_eq(rc, KM_OK, "loading the trace: %s", why);
    km_rng r;
    km_rng_init(&r, km_test_seed() ^ W);
    km_trace_scenario(&tc, 4000, W, affinity, &r, &p.oracle, pair_apply, &p);
    size_t n = tc.n < 7000 ? tc.n : 7000;
    km_request *q = malloc(n * sizeof *q);
    for (size_t i = 0; i < n; i++)
        q[i] = (km_request){tc.hashes + tc.offset[i], tc.n_blocks[i]};
    char when[64];
    snprintf(when, sizeof when, "trace W=%u", W);
    pair_compare(&p, q, n, 0, when);
    free(q);
    km_trace_case_free(&tc);
    pair_free(&p);
}

Test(cuda, matches_cpu_mooncake_64_workers, .timeout = 120) { cuda_trace(64, 1); }
Test(cuda, matches_cpu_mooncake_1024_workers, .timeout = 120) { cuda_trace(1024, 0); }

Test(cuda, auto_backend_is_the_cpu_backend_even_beside_a_usable_device, .timeout = 60)
{
    log_capture cuda_log = {0}, auto_log = {0};
    km_index *cuda = NULL, *automatic = NULL;
    int cuda_rc = create_backend(KM_BACKEND_CUDA, 64, 32, &cuda_log, &cuda);
    cr_assert(cuda_rc == KM_OK || cuda_rc == KM_ERR_BACKEND_UNAVAILABLE,
              "KM_BACKEND_CUDA: unexpected %s (%s)", km_error_name(cuda_rc), cuda_log.last);
    /* A forced CUDA index that cannot be had logs why (the caller gets no index to ask). */
    cr_assert(cuda_rc == KM_OK || strstr(cuda_log.last, "cuda unavailable") != NULL,
              "no log line gives the reason CUDA is unavailable: '%s'", cuda_log.last);
    cr_assert(cuda_rc == KM_OK || !cuda_required(),
              "KM_REQUIRE_CUDA=1 and no usable CUDA device: %s", cuda_log.last);
    int rc = create_backend(KM_BACKEND_AUTO, 64, 32, &auto_log, &automatic);
    cr_assert_eq(rc, KM_OK, "KM_BACKEND_AUTO must always give an index: %s", km_error_name(rc));
    cr_assert_str_eq(km_index_backend_name(automatic), "cpu",
                     "AUTO picked %s while a CUDA index %s be created (%s)",
                     km_index_backend_name(automatic), cuda_rc == KM_OK ? "can" : "cannot",
                     cuda_log.last);
    cr_assert_geq(auto_log.lines, 1, "AUTO must log one line saying which backend and why");
    cr_assert(strstr(auto_log.last, "backend: cpu (auto") != NULL,
              "AUTO's log line does not name the cpu backend: %s", auto_log.last);
    /* Whatever it picked, it works. */
    uint64_t h[3] = {11, 12, 13};
    cr_assert_eq(km_index_store(automatic, 5, KM_NO_PARENT, h, 3), KM_OK);
    km_match_results res;
    km_match_results_init(&res);
    km_request q = {h, 3};
    cr_assert_eq(km_index_match_batch(automatic, &q, 1, &res), KM_OK);
    cr_assert(res.requests[0].owner == 5 && res.requests[0].owner_depth == 3);
    km_match_results_free(&res);
    km_index_destroy(automatic);
    km_index_destroy(cuda);
}
