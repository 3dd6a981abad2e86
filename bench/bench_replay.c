/* SPDX-License-Identifier: Apache-2.0 */
/* `kvmatch bench replay`: Dynamo's indexer-benchmark methodology (../shared/reference/peers.md), so
 * figures stand beside its published ones. The Mooncake trace is replayed through a simulated
 * cluster (16 workers, round robin, each an LRU prefix cache of 65,536 16-token blocks, as in
 * `bench events`) into one stream of operations in arrival order: per request a query (its chain
 * hashes), then the store of the blocks its worker did not hold, and the removes of what that
 * evicted. Each index (cpu = km_index, cuda when usable, radix, radix_compressed, flatmap) replays
 * the stream on one thread: the first WARM requests untimed, then consecutive slices of the stream
 * offered at increasing query rates, open loop (query k of a slice is due at k / rate; updates are
 * applied as they come, between queries, in order). A query's latency is from when it was due to
 * when its answer exists, so falling behind shows. Per index and limit (1 ms, 10 ms): the highest
 * offered rate whose query p99 stayed under the limit, and the block operations per second (stored
 * + removed blocks) applied during that slice. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <jansson.h>

#include "baselines.h"
#include "bench_common.h"
#include "bench_lru.h"
#include "cli/commands.h"
#include "cli/options.h"
#include "kvmatch/kvmatch.h"
#include "sim/trace.h"

#define RP_WORKERS 16u
#define RP_BLOCK 16u
#define RP_TOKENS_PER_ID 512u
#define RP_CAPACITY 65536u
#define RP_MAX_BLOCKS 2048u /* a request's blocks, at most (32 k tokens) */

typedef enum op_kind { OP_QUERY, OP_STORE, OP_REMOVE } op_kind;

typedef struct op {
    op_kind kind;
    uint32_t worker;
    uint32_t n;
    uint64_t parent;      /* OP_STORE */
    const uint64_t *chain; /* into the pools */
    const uint64_t *local; /* NULL for removes */
} op;

typedef struct stream {
    op *ops;
    size_t n_ops, cap_ops;
    uint64_t *chains, *locals; /* one run per request (queries and stores point into it) */
    size_t n_pool, cap_pool;
    uint64_t *removed; /* removes' chain hashes */
    size_t n_removed, cap_removed;
    size_t queries;
} stream;

static int push_op(stream *s, op o)
{
    if (s->n_ops == s->cap_ops) {
        size_t cap = s->cap_ops ? s->cap_ops * 2 : 4096;
        op *g = realloc(s->ops, cap * sizeof *g);
        if (!g)
            return -1;
        s->ops = g;
        s->cap_ops = cap;
    }
    s->ops[s->n_ops++] = o;
    s->queries += o.kind == OP_QUERY;
    return 0;
}

/* Build the stream; pointers into the pools are fixed up at the end (the pools grow). */
static int build_stream(const km_trace *t, size_t max_requests, stream *s, char *err, size_t err_size)
{
    memset(s, 0, sizeof *s);
    size_t total = 0;
    size_t n_req = t->n_requests < max_requests ? t->n_requests : max_requests;
    for (size_t r = 0; r < n_req; r++) {
        uint32_t nb = t->requests[r].input_length / RP_BLOCK;
        total += nb < RP_MAX_BLOCKS ? nb : RP_MAX_BLOCKS;
    }
    s->chains = malloc((total ? total : 1) * sizeof *s->chains);
    s->locals = malloc((total ? total : 1) * sizeof *s->locals);
    s->cap_removed = total ? total : 1;
    s->removed = malloc(s->cap_removed * sizeof *s->removed);
    uint32_t *tokens = malloc((size_t)RP_MAX_BLOCKS * RP_BLOCK * sizeof *tokens + RP_TOKENS_PER_ID * 4);
    km_bench_lru lrus[RP_WORKERS];
    memset(lrus, 0, sizeof lrus);
    int rc = s->chains && s->locals && s->removed && tokens ? 0 : -1;
    for (uint32_t w = 0; !rc && w < RP_WORKERS; w++)
        rc = km_bench_lru_init(&lrus[w], RP_CAPACITY);
    /* Offsets while building: op.chain holds an offset cast to a pointer, fixed below. */
    size_t *offsets = NULL;
    size_t cap_offsets = 0;
    for (size_t r = 0; !rc && r < n_req; r++) {
        const km_trace_request *q = &t->requests[r];
        uint32_t nb = q->input_length / RP_BLOCK;
        if (nb > RP_MAX_BLOCKS)
            nb = RP_MAX_BLOCKS;
        if (nb > q->n_ids * (RP_TOKENS_PER_ID / RP_BLOCK))
            nb = q->n_ids * (RP_TOKENS_PER_ID / RP_BLOCK);
        if (!nb)
            continue;
        uint32_t n_ids = (nb * RP_BLOCK + RP_TOKENS_PER_ID - 1) / RP_TOKENS_PER_ID;
        for (uint32_t i = 0; i < n_ids; i++)
            km_trace_id_tokens(q->ids[i], RP_TOKENS_PER_ID, tokens + (size_t)i * RP_TOKENS_PER_ID);
        km_hash_config hc = {RP_BLOCK, NULL, NULL};
        size_t got = 0;
        size_t base = s->n_pool;
        km_hash_sequence(&hc, tokens, (size_t)nb * RP_BLOCK, 0, KM_NO_PARENT, s->locals + base,
                         s->chains + base, &got);
        s->n_pool += got;
        uint32_t w = (uint32_t)(r % RP_WORKERS);
        km_bench_lru *l = &lrus[w];
        uint32_t cached = 0;
        while (cached < got && km_bench_lru_touch(l, s->chains[base + cached]))
            cached++;
        uint32_t fresh = (uint32_t)got - cached;
        size_t rbase = s->n_removed;
        while (l->count + fresh > RP_CAPACITY)
            s->removed[s->n_removed++] = km_bench_lru_evict(l);
        for (uint32_t b = cached; b < got; b++)
            km_bench_lru_insert(l, s->chains[base + b]);
        if (cap_offsets < s->n_ops + 3) {
            cap_offsets = (s->n_ops + 3) * 2;
            size_t *g = realloc(offsets, cap_offsets * sizeof *g);
            if (!g) {
                rc = -1;
                break;
            }
            offsets = g;
        }
        offsets[s->n_ops] = base;
        rc |= push_op(s, (op){OP_QUERY, w, (uint32_t)got, KM_NO_PARENT, NULL, NULL});
        if (fresh) {
            offsets[s->n_ops] = base + cached;
            rc |= push_op(s, (op){OP_STORE, w, fresh,
                                  cached ? s->chains[base + cached - 1] : KM_NO_PARENT, NULL, NULL});
        }
        if (s->n_removed > rbase) {
            offsets[s->n_ops] = rbase;
            rc |= push_op(s, (op){OP_REMOVE, w, (uint32_t)(s->n_removed - rbase), 0, NULL, NULL});
        }
    }
    for (size_t i = 0; !rc && i < s->n_ops; i++) {
        op *o = &s->ops[i];
        if (o->kind == OP_REMOVE) {
            o->chain = s->removed + offsets[i];
        } else {
            o->chain = s->chains + offsets[i];
            o->local = s->locals + offsets[i];
        }
    }
    for (uint32_t w = 0; w < RP_WORKERS; w++)
        km_bench_lru_free(&lrus[w]);
    free(offsets);
    free(tokens);
    if (rc)
        snprintf(err, err_size, "out of memory building the stream");
    return rc;
}

static void stream_free(stream *s)
{
    free(s->ops);
    free(s->chains);
    free(s->locals);
    free(s->removed);
}

/* One index under test. */
typedef struct target {
    const char *name;
    km_index *index;
    km_baseline *baseline;
    km_baseline_result bres;
    km_match_results ires;
} target;

static int apply(target *t, const op *o)
{
    if (o->kind == OP_QUERY) {
        if (t->index) {
            km_request rq = {o->chain, o->n};
            return km_index_match_batch(t->index, &rq, 1, &t->ires);
        }
        return km_baseline_match(t->baseline, o->chain, o->local, o->n, &t->bres);
    }
    if (o->kind == OP_STORE) {
        if (t->index)
            return km_index_store(t->index, o->worker, o->parent, o->chain, o->n);
        int rc = km_baseline_store(t->baseline, o->worker, o->parent, o->chain, o->local, o->n);
        return rc == KM_ERR_INVALID_ARGUMENT ? KM_OK : rc; /* a tree refusing an unknown parent */
    }
    if (t->index)
        return km_index_remove(t->index, o->worker, o->chain, o->n);
    return km_baseline_remove(t->baseline, o->worker, o->chain, o->n);
}

static void wait_until(double t)
{
    for (;;) {
        double left = t - km_bench_now_s();
        if (left <= 0)
            return;
        if (left > 200e-6) {
            struct timespec ts = {0, (long)((left - 100e-6) * 1e9)};
            nanosleep(&ts, NULL);
        }
    }
}

typedef struct slice_result {
    double rate, p99_ms, block_ops_per_s;
    size_t queries;
} slice_result;

/* Replay ops [*pos, ...) until `queries` queries were answered, the i-th due at start + i / rate. */
static int run_slice(target *t, const stream *s, size_t *pos, size_t queries, double rate,
                     double *lat, slice_result *out)
{
    size_t q = 0;
    uint64_t blocks = 0;
    double start = km_bench_now_s() + 1e-3;
    wait_until(start);
    while (*pos < s->n_ops && q < queries) {
        const op *o = &s->ops[(*pos)++];
        if (o->kind == OP_QUERY) {
            double due = start + (double)q / rate;
            wait_until(due);
            int rc = apply(t, o);
            if (rc)
                return rc;
            lat[q++] = (km_bench_now_s() - due) * 1e3;
        } else {
            int rc = apply(t, o);
            if (rc)
                return rc;
            blocks += o->n;
        }
    }
    double elapsed = km_bench_now_s() - start;
    km_bench_sort(lat, q);
    out->rate = rate;
    out->queries = q;
    out->p99_ms = q ? lat[(size_t)(0.99 * (double)(q - 1) + 0.5)] : 0;
    out->block_ops_per_s = elapsed > 0 ? (double)blocks / elapsed : 0;
    return KM_OK;
}

/* Unpaced: the rest of the stream as fast as it goes, time in stores, removes and queries apart. */
typedef struct ceiling_rates {
    double store_ops_per_s, remove_ops_per_s, update_ops_per_s, queries_per_s;
} ceiling_rates;

static int run_ceiling(target *t, const stream *s, size_t pos, ceiling_rates *c)
{
    double t_store = 0, t_remove = 0, t_q = 0;
    uint64_t stored = 0, removed = 0, queries = 0;
    for (; pos < s->n_ops; pos++) {
        const op *o = &s->ops[pos];
        double a = km_bench_now_s();
        int rc = apply(t, o);
        double b = km_bench_now_s();
        if (rc)
            return rc;
        if (o->kind == OP_QUERY) {
            t_q += b - a;
            queries++;
        } else if (o->kind == OP_STORE) {
            t_store += b - a;
            stored += o->n;
        } else {
            t_remove += b - a;
            removed += o->n;
        }
    }
    c->store_ops_per_s = t_store > 0 ? (double)stored / t_store : 0;
    c->remove_ops_per_s = t_remove > 0 ? (double)removed / t_remove : 0;
    c->update_ops_per_s = t_store + t_remove > 0 ? (double)(stored + removed) / (t_store + t_remove) : 0;
    c->queries_per_s = t_q > 0 ? (double)queries / t_q : 0;
    return KM_OK;
}

static void usage(FILE *f)
{
    fprintf(f, "usage: kvmatch bench replay [--json] [--quick] [--trace PATH] [--index NAME] [--ceiling]\n");
}

int km_bench_replay_main(int argc, char **argv)
{
    bool json = false, quick = false, ceiling = false;
    const char *trace_path = NULL, *only = NULL;
    enum { OPT_JSON = 256, OPT_QUICK, OPT_TRACE, OPT_INDEX, OPT_CEILING };
    static const struct option options[] = {
        {"help", no_argument, NULL, 'h'},
        {"json", no_argument, NULL, OPT_JSON},
        {"quick", no_argument, NULL, OPT_QUICK},
        {"trace", required_argument, NULL, OPT_TRACE},
        {"index", required_argument, NULL, OPT_INDEX},
        {"ceiling", no_argument, NULL, OPT_CEILING},
        {NULL, 0, NULL, 0},
    };
    km_cli_getopt_begin(argv, "bench replay");
    int opt;
    while ((opt = getopt_long(argc, argv, "h", options, NULL)) != -1) {
        switch (opt) {
        case 'h':
            usage(stdout);
            return KM_EXIT_OK;
        case OPT_JSON:
            json = true;
            break;
        case OPT_QUICK:
            quick = true;
            break;
        case OPT_TRACE:
            trace_path = optarg;
            break;
        case OPT_INDEX:
            only = optarg;
            break;
        case OPT_CEILING:
            ceiling = true;
            break;
        default:
            return km_cli_usage_error("bench replay");
        }
    }
    if (optind < argc) {
        fprintf(stderr, "kvmatch bench replay: unexpected argument \"%s\"\n", argv[optind]);
        return km_cli_usage_error("bench replay");
    }
    if (!trace_path)
        trace_path = km_trace_default_path();
    char err[512];
    km_trace trace;
    if (km_trace_load_mooncake(trace_path, &trace, err, sizeof err) != KM_OK) {
        fprintf(stderr, "bench replay: %s\n", err);
        return 1;
    }
    const double rates[] = {1e3, 2e3, 5e3, 1e4, 2e4, 5e4, 1e5, 2e5, 5e5};
    const size_t n_rates = sizeof rates / sizeof rates[0];
    size_t warm = quick ? 1000 : 2000, per_rate = quick ? 300 : 1000;
    stream s;
    if (build_stream(&trace, warm + per_rate * n_rates, &s, err, sizeof err)) {
        fprintf(stderr, "bench replay: %s\n", err);
        km_trace_free(&trace);
        return 1;
    }
    double *lat = malloc(per_rate * sizeof *lat);
    json_t *root = json_object();
    /* --ceiling is its own benchmark: unpaced rates instead of sustained ones. */
    json_object_set_new(root, "benchmark", json_string(ceiling ? "replay-ceiling" : "replay"));
    json_object_set_new(root, "machine", km_bench_machine_json());
    json_t *results = json_array(), *slices = json_array(), *ceilings = json_array();
    const char *names[] = {"cpu", "cuda", "radix", "radix_compressed", "flatmap"};
    if (!json)
        printf("%-17s %10s %12s %14s   (per offered rate: query p99 ms)\n", "index", "p99 limit",
               "queries/s", "block ops/s");
    int status = 0;
    for (size_t k = 0; k < sizeof names / sizeof names[0] && lat; k++) {
        if (only && strcmp(only, names[k]))
            continue;
        target t;
        memset(&t, 0, sizeof t);
        t.name = names[k];
        int rc = KM_OK;
        if (k <= 1) {
            km_index_config ic;
            km_index_config_init(&ic);
            ic.max_workers = RP_WORKERS;
            ic.backend = k == 0 ? KM_BACKEND_CPU : KM_BACKEND_CUDA;
            ic.threads = 1;
            /* Sized for the cluster it indexes (16 engines x 65,536 blocks), as an operator would
             * configure it: the replay measures serving, not the table's first growth. */
            ic.initial_blocks = (uint64_t)RP_WORKERS * RP_CAPACITY;
            ic.log = km_bench_quiet_log;
            rc = km_index_create(&ic, &t.index);
            km_match_results_init(&t.ires);
            if (rc && k == 1) {
                /* No usable GPU: say so, do not estimate. */
                for (int lim = 0; lim < 2; lim++) {
                    json_t *o = json_object();
                    json_object_set_new(o, "index", json_string("cuda"));
                    json_object_set_new(o, "p99_limit_ms", json_integer(lim ? 10 : 1));
                    json_object_set_new(o, "sustained_queries_per_s", json_null());
                    json_object_set_new(o, "block_ops_per_s", json_null());
                    json_object_set_new(o, "note", json_string("not measured: no usable CUDA device"));
                    json_array_append_new(results, o);
                }
                if (ceiling) {
                    json_t *o = json_object();
                    json_object_set_new(o, "index", json_string("cuda"));
                    json_object_set_new(o, "note", json_string("not measured: no usable CUDA device"));
                    json_array_append_new(ceilings, o);
                }
                if (!json)
                    printf("%-17s not measured (%s)\n", "cuda", km_error_name(rc));
                km_match_results_free(&t.ires);
                continue;
            }
        } else {
            rc = km_baseline_create((km_baseline_kind)(k - 2), RP_WORKERS, &t.baseline);
            if (!rc)
                rc = km_baseline_result_init(t.baseline, &t.bres);
        }
        size_t pos = 0, seen = 0;
        /* Warm-up: the first `warm` queries and their updates, untimed. */
        while (!rc && pos < s.n_ops && seen < warm) {
            seen += s.ops[pos].kind == OP_QUERY;
            rc = apply(&t, &s.ops[pos++]);
        }
        if (ceiling && !rc) {
            /* Instead of the paced slices: what the index does flat out on the same stream. */
            ceiling_rates c = {0};
            rc = run_ceiling(&t, &s, pos, &c);
            if (rc) {
                fprintf(stderr, "bench replay: %s: %s\n", t.name, km_error_name(rc));
                status = 1;
            }
            json_t *o = json_object();
            json_object_set_new(o, "index", json_string(t.name));
            json_object_set_new(o, "update_ops_per_s", json_real(km_bench_round_to(c.update_ops_per_s, 1)));
            json_object_set_new(o, "store_ops_per_s", json_real(km_bench_round_to(c.store_ops_per_s, 1)));
            json_object_set_new(o, "remove_ops_per_s", json_real(km_bench_round_to(c.remove_ops_per_s, 1)));
            json_object_set_new(o, "queries_per_s", json_real(km_bench_round_to(c.queries_per_s, 1)));
            json_array_append_new(ceilings, o);
            if (!json)
                printf("%-17s ceiling: updates %.0f block ops/s (stores %.0f, removes %.0f), "
                       "queries %.0f /s (alone)\n",
                       t.name, c.update_ops_per_s, c.store_ops_per_s, c.remove_ops_per_s,
                       c.queries_per_s);
            km_index_destroy(t.index);
            km_match_results_free(&t.ires);
            km_baseline_result_free(&t.bres);
            km_baseline_destroy(t.baseline);
            continue;
        }
        slice_result best[2];
        memset(best, 0, sizeof best);
        json_t *per = json_array();
        for (size_t i = 0; !rc && i < n_rates && pos < s.n_ops; i++) {
            slice_result sr;
            rc = run_slice(&t, &s, &pos, per_rate, rates[i], lat, &sr);
            if (rc)
                break;
            json_t *o = json_object();
            json_object_set_new(o, "offered_queries_per_s", json_real(sr.rate));
            json_object_set_new(o, "query_p99_ms", json_real(km_bench_round_to(sr.p99_ms, 0.001)));
            json_object_set_new(o, "block_ops_per_s", json_real(km_bench_round_to(sr.block_ops_per_s, 1)));
            json_object_set_new(o, "queries", json_integer((json_int_t)sr.queries));
            json_array_append_new(per, o);
            if (sr.p99_ms < 1.0)
                best[0] = sr;
            if (sr.p99_ms < 10.0)
                best[1] = sr;
            if (sr.p99_ms >= 10.0)
                break; /* beyond both limits: higher rates only queue more */
        }
        if (rc) {
            fprintf(stderr, "bench replay: %s: %s\n", t.name, km_error_name(rc));
            status = 1;
        }
        json_t *so = json_object();
        json_object_set_new(so, "index", json_string(t.name));
        json_object_set_new(so, "slices", per);
        json_array_append_new(slices, so);
        for (int lim = 0; lim < 2; lim++) {
            json_t *o = json_object();
            json_object_set_new(o, "index", json_string(t.name));
            json_object_set_new(o, "p99_limit_ms", json_integer(lim ? 10 : 1));
            json_object_set_new(o, "sustained_queries_per_s",
                                best[lim].rate > 0 ? json_real(best[lim].rate) : json_null());
            json_object_set_new(o, "block_ops_per_s",
                                best[lim].rate > 0 ? json_real(km_bench_round_to(best[lim].block_ops_per_s, 1))
                                                   : json_null());
            json_array_append_new(results, o);
            if (!json)
                printf("%-17s %8d ms %12.0f %14.0f\n", t.name, lim ? 10 : 1, best[lim].rate,
                       best[lim].block_ops_per_s);
        }
        km_index_destroy(t.index);
        km_match_results_free(&t.ires);
        km_baseline_result_free(&t.bres);
        km_baseline_destroy(t.baseline);
    }
    json_object_set_new(root, "results", results);
    json_object_set_new(root, "slices", slices);
    if (ceiling)
        json_object_set_new(root, "ceilings", ceilings);
    else
        json_decref(ceilings);
    json_t *wl = json_object();
    json_object_set_new(wl, "trace", json_string(trace_path));
    json_object_set_new(wl, "workers", json_integer(RP_WORKERS));
    json_object_set_new(wl, "capacity_blocks", json_integer(RP_CAPACITY));
    json_object_set_new(wl, "block_size", json_integer(RP_BLOCK));
    json_object_set_new(wl, "warm_queries", json_integer((json_int_t)warm));
    json_object_set_new(wl, "queries_per_rate", json_integer((json_int_t)per_rate));
    json_object_set_new(wl, "ops", json_integer((json_int_t)s.n_ops));
    json_object_set_new(root, "workload", wl);
    if (json) {
        char *text = json_dumps(root, JSON_INDENT(2));
        puts(text);
        free(text);
    }
    json_decref(root);
    free(lat);
    stream_free(&s);
    km_trace_free(&trace);
    return status;
}
