/* SPDX-License-Identifier: Apache-2.0 */
/* kvmatch bench growth: how long the longest single call takes while a structure grows from empty.
 * A routing service cannot stop for a rehash: every call below is one the scheduler thread makes
 * between two decisions, so its worst case is added to some request's latency.
 *
 * Rows (each from empty, fresh random 64-bit keys, the same keys for every row of a structure):
 *   u64map  incremental     the bookkeeping map as built (src/base/u64_map.c): one reserve of 24 keys,
 *                           then 24 find-or-insert, per call (approximate mode's pattern)
 *   u64map  stop-the-world  the same calls, but every growth is finished in the call that starts
 *                           it (km_u64map_finish_growth): the same-run baseline
 *   approx  as built        km_approx_record of 24 new blocks, 16 workers in turn
 *   index   default size    km_index_store of a 24-block run, 16 workers in turn, from the default
 *                           initial_blocks (the slot tables grow incrementally: src/index/host_table.h)
 *   index   sized at start  the same, with initial_blocks covering every block stored
 *   index   shared sets     1,024 workers, each 32-block run stored by 6 of them in turn (sets held
 *                           by more than 4 workers live in the table's bitmap pool, segment keys in
 *                           its anchor lists: both grow by doubling), sized at start
 *   replica stop-the-world  "default size" under a backend with a device replica's host side
 *                           (dirty-slot tracking, a sync after every batch) but no device: every
 *                           growth finished in the sync after the batch that started it, as the
 *                           same-run baseline. The upload itself is not in it
 *   replica bounded steps   the same as built: a sync moves at most KM_REPLICA_GROWTH_STEP_SLOTS old
 *                           slots of a growing table, for at most KM_REPLICA_GROWTH_BUDGET_MS
 *                           (src/index/index.c, advance_growths)
 *   feed    index sized     KV events for 4 workers, each message storing the next 16 blocks of
 *                           the worker's chain, a flush every 8 messages (as the service batches);
 *                           the index is sized at start, so what grows is the feed's own engine-hash
 *                           maps (src/events/engine_hash_map.c, incremental)
 *   clear   scan            one KM_UPDATE_CLEAR_WORKER naming no block, on an index of
 *                           CLEAR_WORKERS workers holding fresh chains: the index scans its tables
 *                           whole
 *   clear   named           the same naming every block the worker holds, as the event feed's and
 *                           approximate mode's clears do: a lookup per block, no scan (the two rows
 *                           take turns, worker by worker, on the same index)
 * Reported: total time, mean, 99.9th percentile and worst call (for the feed: a message, or a
 * message and the flush after it); entries are the structure's at the end (the clears: pairs in the
 * index before the first clear). */
#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_common.h"
#include "cli/options.h"
#include "kvmatch/approx.h"
#include "kvmatch/feed.h"
#include "kvmatch/index.h"
#include "kvmatch/kv_events.h"
#include "index/index_internal.h"
#include "base/u64_map.h"

#define KEYS_PER_CALL 24
#define WORKERS 16

typedef struct growth_row {
    const char *structure, *mode;
    uint64_t entries;
    size_t calls;
    double total_s, mean_us, p999_us, worst_ms;
} growth_row;

static uint64_t next_key(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s | 2; /* never 0 or 1, the reserved keys and chain-hash values */
}

static double now_us(void)
{
    return km_bench_now_s() * 1e6;
}

/* Fill row's statistics from the per-call latencies lat[0..n) (sorted in place). */
static void summarise(growth_row *row, double *lat, size_t n)
{
    double total = 0;
    for (size_t i = 0; i < n; i++)
        total += lat[i];
    km_bench_sort(lat, n);
    row->calls = n;
    row->total_s = total / 1e6;
    row->mean_us = n ? total / (double)n : 0;
    row->p999_us = n ? lat[(size_t)((double)(n - 1) * 0.999)] : 0;
    row->worst_ms = n ? lat[n - 1] / 1000.0 : 0;
}

static int run_u64map(int stop_the_world, size_t calls, double *lat, growth_row *row)
{
    km_memory memory = {0, 0};
    km_u64map m;
    km_u64map_init(&m, &memory);
    uint64_t seed = UINT64_C(88172645463325252);
    for (size_t c = 0; c < calls; c++) {
        uint64_t keys[KEYS_PER_CALL];
        for (int k = 0; k < KEYS_PER_CALL; k++)
            keys[k] = next_key(&seed);
        double t0 = now_us();
        int rc = km_u64map_reserve(&m, KEYS_PER_CALL);
        if (rc == KM_OK && stop_the_world)
            km_u64map_finish_growth(&m);
        for (int k = 0; rc == KM_OK && k < KEYS_PER_CALL; k++)
            if (!km_u64map_find(&m, keys[k]))
                rc = km_u64map_put(&m, keys[k], c, 0);
        lat[c] = now_us() - t0;
        if (rc != KM_OK) {
            km_u64map_free(&m);
            return rc;
        }
    }
    row->structure = "u64map";
    row->mode = stop_the_world ? "stop-the-world" : "incremental";
    row->entries = m.live;
    summarise(row, lat, calls);
    km_u64map_free(&m);
    return KM_OK;
}

static int run_approx(size_t calls, double *lat, growth_row *row)
{
    km_approx_config cfg;
    km_approx_config_init(&cfg);
    cfg.max_workers = WORKERS;
    cfg.worker_capacity_blocks = 0; /* unlimited: growth, not eviction */
    km_approx *a = NULL;
    int rc = km_approx_create(&cfg, &a);
    if (rc)
        return rc;
    km_approx_updates buf;
    memset(&buf, 0, sizeof buf);
    uint64_t seed = UINT64_C(88172645463325252);
    for (size_t c = 0; c < calls && rc == KM_OK; c++) {
        uint64_t hashes[KEYS_PER_CALL];
        for (int k = 0; k < KEYS_PER_CALL; k++)
            hashes[k] = next_key(&seed);
        km_approx_updates_clear(&buf);
        double t0 = now_us();
        rc = km_approx_record(a, (uint32_t)(c % WORKERS), hashes, KEYS_PER_CALL,
                              (uint64_t)c * 1000u, &buf);
        lat[c] = now_us() - t0;
    }
    km_approx_stats stats;
    if (rc == KM_OK)
        rc = km_approx_get_stats(a, &stats);
    if (rc == KM_OK) {
        row->structure = "approx";
        row->mode = "as built";
        row->entries = stats.pairs;
        summarise(row, lat, calls);
    }
    km_approx_updates_free(&buf);
    km_approx_destroy(a);
    return rc;
}

/* A quiet CPU index; initial_blocks 0 = the default size. */
static int create_index(uint32_t max_workers, uint64_t initial_blocks, km_index **out)
{
    km_index_config cfg;
    km_index_config_init(&cfg);
    cfg.max_workers = max_workers;
    cfg.backend = KM_BACKEND_CPU;
    cfg.log = km_bench_quiet_log;
    if (initial_blocks)
        cfg.initial_blocks = initial_blocks;
    return km_index_create(&cfg, out);
}

/* Fill row from the latencies, with the index's pair count as its entries (when rc is KM_OK). */
static int index_row(int rc, const km_index *index, const char *structure, const char *mode,
                     double *lat, size_t calls, growth_row *row)
{
    km_index_stats stats;
    if (rc == KM_OK)
        rc = km_index_get_stats(index, &stats);
    if (rc == KM_OK) {
        row->structure = structure;
        row->mode = mode;
        row->entries = stats.pairs;
        summarise(row, lat, calls);
    }
    return rc;
}

/* The index rows' calls: a 24-block run of fresh keys on one of WORKERS workers in turn. */
static int store_runs(km_index *index, size_t calls, double *lat)
{
    int rc = KM_OK;
    uint64_t seed = UINT64_C(88172645463325252);
    for (size_t c = 0; c < calls && rc == KM_OK; c++) {
        uint64_t hashes[KEYS_PER_CALL];
        for (int k = 0; k < KEYS_PER_CALL; k++)
            hashes[k] = next_key(&seed);
        double t0 = now_us();
        rc = km_index_store(index, (uint32_t)(c % WORKERS), KM_NO_PARENT, hashes, KEYS_PER_CALL);
        lat[c] = now_us() - t0;
    }
    return rc;
}

static int run_index(uint64_t initial_blocks, size_t calls, double *lat, growth_row *row)
{
    km_index *index = NULL;
    int rc = create_index(WORKERS, initial_blocks, &index);
    if (rc)
        return rc;
    rc = store_runs(index, calls, lat);
    rc = index_row(rc, index, "index", initial_blocks ? "sized at start" : "default size", lat,
                   calls, row);
    km_index_destroy(index);
    return rc;
}

#define SHARED_WORKERS 1024
#define SHARED_RUN 32
#define SHARED_HOLDERS 6

/* Runs of SHARED_RUN fresh blocks, each stored by SHARED_HOLDERS workers of SHARED_WORKERS in turn
 * (one call each), continuing one chain so that whole segments earn keys. */
static int run_index_shared(size_t calls, double *lat, growth_row *row)
{
    km_index *index = NULL;
    uint64_t blocks = (uint64_t)(calls / SHARED_HOLDERS) * SHARED_RUN;
    int rc = create_index(SHARED_WORKERS, blocks, &index);
    if (rc)
        return rc;
    uint64_t seed = UINT64_C(88172645463325252), parent = KM_NO_PARENT;
    size_t c = 0;
    while (c + SHARED_HOLDERS <= calls && rc == KM_OK) {
        uint64_t hashes[SHARED_RUN];
        for (int k = 0; k < SHARED_RUN; k++)
            hashes[k] = next_key(&seed);
        for (uint32_t h = 0; h < SHARED_HOLDERS && rc == KM_OK; h++, c++) {
            uint32_t w = (uint32_t)((c / SHARED_HOLDERS * 7 + h * 131) % SHARED_WORKERS);
            double t0 = now_us();
            rc = km_index_store(index, w, parent, hashes, SHARED_RUN);
            lat[c] = now_us() - t0;
        }
        parent = hashes[SHARED_RUN - 1];
    }
    rc = index_row(rc, index, "index", "shared sets", lat, c, row);
    km_index_destroy(index);
    return rc;
}

/* A device replica's host side without a device: the tables track dirty slots and every batch is
 * followed by a sync, which uploads nothing. */
static int no_device_create(km_index *index, void **state, char *why, size_t why_size)
{
    (void)index, (void)why, (void)why_size;
    static int token;
    *state = &token;
    return KM_OK;
}

static void no_device_destroy(void *state)
{
    (void)state;
}

static int no_device_sync(void *state, km_index *index)
{
    (void)state, (void)index;
    return KM_OK;
}

static const km_backend_ops no_device_backend = {
    .name = "replica without a device",
    .create = no_device_create,
    .destroy = no_device_destroy,
    .sync = no_device_sync,
    .match = NULL, /* the row only stores */
    .needs_dirty_tracking = 1,
};

static int run_replica(int stop_the_world, size_t calls, double *lat, growth_row *row)
{
    km_index *index = NULL;
    int rc = create_index(WORKERS, 0, &index);
    char why[128];
    if (rc == KM_OK)
        rc = km_index_use_backend(index, &no_device_backend, why, sizeof why);
    if (rc == KM_OK && stop_the_world) {
        index->replica_growth_step = UINT64_MAX;
        index->replica_growth_budget_ms = 0;
    }
    if (rc == KM_OK)
        rc = store_runs(index, calls, lat);
    rc = index_row(rc, index, "replica", stop_the_world ? "stop-the-world" : "bounded steps", lat,
                   calls, row);
    km_index_destroy(index);
    return rc;
}

#define FEED_WORKERS 4
#define FEED_BLOCKS 16 /* per message */
#define FEED_BLOCK_SIZE 16
#define FEED_FLUSH_EVERY 8

static int run_feed(size_t calls, double *lat, growth_row *row)
{
    km_index *index = NULL;
    int rc = create_index(FEED_WORKERS, (uint64_t)calls * FEED_BLOCKS, &index);
    if (rc)
        return rc;
    km_feed_config fcfg;
    km_feed_config_init(&fcfg);
    fcfg.block_size = FEED_BLOCK_SIZE;
    fcfg.bootstrap_replay = false;
    fcfg.log = km_bench_quiet_log;
    km_feed *feed = NULL;
    rc = km_feed_create(index, &fcfg, &feed);
    for (uint32_t w = 0; rc == KM_OK && w < FEED_WORKERS; w++) {
        km_feed_worker_config wc = {w, "bench", false};
        rc = km_feed_add_worker(feed, &wc, 1);
    }
    if (rc == KM_OK)
        rc = km_feed_flush(feed, 1, NULL);
    uint64_t seed = UINT64_C(88172645463325252);
    uint64_t last_hash[FEED_WORKERS] = {0}, seq[FEED_WORKERS] = {0};
    uint32_t tokens[FEED_BLOCKS * FEED_BLOCK_SIZE];
    for (size_t c = 0; c < calls && rc == KM_OK; c++) {
        uint32_t w = (uint32_t)(c % FEED_WORKERS);
        uint64_t hashes[FEED_BLOCKS];
        for (int k = 0; k < FEED_BLOCKS; k++)
            hashes[k] = next_key(&seed);
        for (int k = 0; k < FEED_BLOCKS * FEED_BLOCK_SIZE; k++)
            tokens[k] = (uint32_t)next_key(&seed);
        km_kv_event ev;
        memset(&ev, 0, sizeof ev);
        ev.kind = KM_KV_EVENT_BLOCK_STORED;
        ev.block_hashes = hashes;
        ev.n_block_hashes = FEED_BLOCKS;
        ev.medium = KM_KV_MEDIUM_GPU;
        ev.has_parent_block_hash = last_hash[w] != 0;
        ev.parent_block_hash = last_hash[w];
        ev.token_ids = tokens;
        ev.n_token_ids = FEED_BLOCKS * FEED_BLOCK_SIZE;
        ev.block_size = FEED_BLOCK_SIZE;
        km_kv_batch batch;
        memset(&batch, 0, sizeof batch);
        batch.events = &ev;
        batch.n_events = 1;
        batch.n_payload_events = 1;
        last_hash[w] = hashes[FEED_BLOCKS - 1];
        double t0 = now_us();
        rc = km_feed_live(feed, w, seq[w]++, &batch, 2);
        if (rc == KM_OK && c % FEED_FLUSH_EVERY == FEED_FLUSH_EVERY - 1)
            rc = km_feed_flush(feed, 3, NULL);
        lat[c] = now_us() - t0;
    }
    rc = index_row(rc, index, "feed", "index sized", lat, calls, row);
    km_feed_destroy(feed);
    km_index_destroy(index);
    return rc;
}

#define CLEAR_WORKERS 256
#define CLEAR_RUN 512 /* blocks per stored run of a worker's chain */

/* The clear rows: CLEAR_WORKERS workers each holding a chain of `blocks` fresh blocks, then every
 * worker cleared in turn, the even ones naming nothing and the odd ones naming their chain. */
static int run_clears(uint64_t blocks, double *lat, growth_row *rows)
{
    km_index *index = NULL;
    int rc = create_index(CLEAR_WORKERS, (uint64_t)CLEAR_WORKERS * blocks, &index);
    if (rc)
        return rc;
    uint64_t *chain = malloc(blocks * sizeof *chain);
    if (!chain) {
        km_index_destroy(index);
        return KM_ERR_OUT_OF_MEMORY;
    }
    uint64_t seed = UINT64_C(88172645463325252);
    for (uint32_t w = 0; w < CLEAR_WORKERS && rc == KM_OK; w++) {
        for (uint64_t k = 0; k < blocks; k++)
            chain[k] = next_key(&seed);
        for (uint64_t k = 0; k < blocks && rc == KM_OK; k += CLEAR_RUN) {
            uint64_t n = blocks - k < CLEAR_RUN ? blocks - k : CLEAR_RUN;
            rc = km_index_store(index, w, k ? chain[k - 1] : KM_NO_PARENT, chain + k, n);
        }
    }
    km_index_stats stats;
    if (rc == KM_OK)
        rc = km_index_get_stats(index, &stats);
    /* The same keys again, worker by worker, for the named clears. */
    seed = UINT64_C(88172645463325252);
    double *named = lat + CLEAR_WORKERS / 2;
    for (uint32_t w = 0; w < CLEAR_WORKERS && rc == KM_OK; w++) {
        for (uint64_t k = 0; k < blocks; k++)
            chain[k] = next_key(&seed);
        int by_name = w & 1;
        km_update u = {KM_UPDATE_CLEAR_WORKER, w, KM_NO_PARENT, by_name ? chain : NULL,
                       by_name ? blocks : 0, KM_TIER_DEVICE};
        km_update_stats applied;
        double t0 = now_us();
        rc = km_index_apply(index, &u, 1, &applied);
        (by_name ? named : lat)[w / 2] = now_us() - t0;
        if (rc == KM_OK && (applied.cleared != blocks || applied.clear_scans != (uint64_t)!by_name))
            rc = KM_ERR_INTERNAL;
    }
    if (rc == KM_OK) {
        rows[0] = (growth_row){.structure = "clear", .mode = "scan", .entries = stats.pairs};
        rows[1] = (growth_row){.structure = "clear", .mode = "named", .entries = stats.pairs};
        summarise(&rows[0], lat, CLEAR_WORKERS / 2);
        summarise(&rows[1], named, CLEAR_WORKERS / 2);
    }
    free(chain);
    km_index_destroy(index);
    return rc;
}

int km_bench_growth_main(int argc, char **argv)
{
    int json = 0, quick = 0;
    enum { OPT_JSON = 256, OPT_QUICK };
    static const struct option options[] = {
        {"help", no_argument, NULL, 'h'},
        {"json", no_argument, NULL, OPT_JSON},
        {"quick", no_argument, NULL, OPT_QUICK},
        {NULL, 0, NULL, 0},
    };
    km_cli_getopt_begin(argv, "bench growth");
    int opt;
    while ((opt = getopt_long(argc, argv, "h", options, NULL)) != -1) {
        switch (opt) {
        case 'h':
            printf("usage: kvmatch bench growth [--json] [--quick]\n");
            return KM_EXIT_OK;
        case OPT_JSON:
            json = 1;
            break;
        case OPT_QUICK:
            quick = 1;
            break;
        default:
            return km_cli_usage_error("bench growth");
        }
    }
    if (optind < argc) {
        fprintf(stderr, "kvmatch bench growth: unexpected argument \"%s\"\n", argv[optind]);
        return km_cli_usage_error("bench growth");
    }
    /* 600,000 calls of 24 keys: 14.4 M map entries (a 512 MiB array at the last doubling), 9.6 M
     * approximate-mode pairs over 16 workers; the index stores 4.8 M blocks; the feed 4 M blocks,
     * 1 M per worker's engine-hash map. */
    size_t map_calls = quick ? 150000 : 600000, approx_calls = quick ? 100000 : 400000;
    size_t index_calls = quick ? 50000 : 200000, feed_calls = quick ? 50000 : 250000;
    uint64_t clear_blocks = quick ? 4096 : 16384; /* per worker: 1 M or 4 M pairs in all */
    size_t shared_calls = quick ? 98304 : 393216;  /* 3 or 12.6 M pairs, 0.5 or 2 M blocks */
    size_t most = map_calls;
    double *lat = malloc(most * sizeof *lat);
    if (!lat)
        return 1;
    json_t *root = json_object();
    json_object_set_new(root, "benchmark", json_string("growth"));
    json_object_set_new(root, "command", json_string(quick ? "kvmatch bench growth --json --quick"
                                                           : "kvmatch bench growth --json"));
    json_object_set_new(root, "machine", km_bench_machine_json());
    json_object_set_new(root, "keys_per_call", json_integer(KEYS_PER_CALL));
    json_object_set_new(root, "feed_blocks_per_message", json_integer(FEED_BLOCKS));
    json_object_set_new(root, "shared_run_blocks", json_integer(SHARED_RUN));
    json_t *results = json_array();
    growth_row rows[11];
    int rc = KM_OK, n_rows = 0;
    if (rc == KM_OK && (rc = run_u64map(1, map_calls, lat, &rows[n_rows])) == KM_OK)
        n_rows++;
    if (rc == KM_OK && (rc = run_u64map(0, map_calls, lat, &rows[n_rows])) == KM_OK)
        n_rows++;
    if (rc == KM_OK && (rc = run_approx(approx_calls, lat, &rows[n_rows])) == KM_OK)
        n_rows++;
    if (rc == KM_OK && (rc = run_index(0, index_calls, lat, &rows[n_rows])) == KM_OK)
        n_rows++;
    if (rc == KM_OK && (rc = run_index((uint64_t)index_calls * KEYS_PER_CALL, index_calls, lat,
                                       &rows[n_rows])) == KM_OK)
        n_rows++;
    if (rc == KM_OK && (rc = run_index_shared(shared_calls, lat, &rows[n_rows])) == KM_OK)
        n_rows++;
    if (rc == KM_OK && (rc = run_replica(1, index_calls, lat, &rows[n_rows])) == KM_OK)
        n_rows++;
    if (rc == KM_OK && (rc = run_replica(0, index_calls, lat, &rows[n_rows])) == KM_OK)
        n_rows++;
    if (rc == KM_OK && (rc = run_feed(feed_calls, lat, &rows[n_rows])) == KM_OK)
        n_rows++;
    if (rc == KM_OK && (rc = run_clears(clear_blocks, lat, &rows[n_rows])) == KM_OK)
        n_rows += 2;
    free(lat);
    if (rc != KM_OK) {
        fprintf(stderr, "kvmatch bench growth: %s\n", km_strerror(rc));
        json_decref(root);
        json_decref(results);
        return 1;
    }
    if (!json)
        printf("%-8s %-16s %12s %9s %9s %9s %10s %10s\n", "struct", "mode", "entries", "calls",
               "total s", "mean us", "p99.9 us", "worst ms");
    for (int i = 0; i < n_rows; i++) {
        growth_row *r = &rows[i];
        json_t *o = json_object();
        json_object_set_new(o, "structure", json_string(r->structure));
        json_object_set_new(o, "mode", json_string(r->mode));
        json_object_set_new(o, "entries", json_integer((json_int_t)r->entries));
        json_object_set_new(o, "calls", json_integer((json_int_t)r->calls));
        json_object_set_new(o, "total_s", json_real(km_bench_round_to(r->total_s, 0.001)));
        json_object_set_new(o, "mean_us", json_real(km_bench_round_to(r->mean_us, 0.01)));
        json_object_set_new(o, "p999_us", json_real(km_bench_round_to(r->p999_us, 0.1)));
        json_object_set_new(o, "worst_ms", json_real(km_bench_round_to(r->worst_ms, 0.01)));
        json_array_append_new(results, o);
        if (!json)
            printf("%-8s %-16s %12" PRIu64 " %9zu %9.3f %9.2f %10.1f %10.2f\n", r->structure, r->mode,
                   r->entries, r->calls, r->total_s, r->mean_us, r->p999_us, r->worst_ms);
    }
    json_object_set_new(root, "results", results);
    if (json) {
        char *s = json_dumps(root, JSON_INDENT(2));
        if (s)
            puts(s);
        free(s);
    }
    json_decref(root);
    return 0;
}
