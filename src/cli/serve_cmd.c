/* SPDX-License-Identifier: Apache-2.0 */
/* `kvmatch serve`: the routing service (docs/SERVICE.md). A JSON config file (--config) and flags;
 * flags override the file. A flag is the config key's last part with '-' for '_' (active_ttl_ms:
 * --active-ttl-ms; scheduler.max_batch_routes: --max-batch-routes) except --records,
 * --snapshot-dir, --snapshot-interval-ms and --cluster; some keys are file-only; the older flags
 * still work and say which name replaced them. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/commands.h"
#include "cli/options.h"
#include "kvmatch/kvmatch.h"
#include "service/server_config.h"


static void serve_usage(FILE *f)
{
    fprintf(f,
            "usage: kvmatch serve [--config FILE] [options]   (--opt VALUE or --opt=VALUE)\n"
            "  --config FILE            JSON configuration (docs/SERVICE.md); flags override it\n"
            "  --socket PATH            Unix socket (default %s; 'none' for TCP only)\n"
            "  --tcp HOST:PORT          also listen on loopback TCP\n"
            "  --http HOST:PORT         /healthz /readyz /status /metrics on loopback\n"
            "  --allow-non-loopback     permit --tcp and --http on other addresses\n"
            "  --records PATH|none      decision and outcome JSONL (default kvmatch-records.jsonl)\n"
            "  --snapshot-dir DIR       event pools' snapshots (restored at start, written on SIGTERM)\n"
            "  --snapshot-interval-ms N periodic snapshots, 0..86400000 (default 60000; 0 = only\n"
            "                           on shutdown)\n"
            "  --pool NAME:BLOCK_SIZE[:POLICY[:MODEL]]  add a pool (policy ttft, kv, cache_aware,\n"
            "                           prefix, least_load, round_robin, llmd, preble; default ttft)\n"
            "  --worker POOL:ID[=PUB[,REPLAY]]  add a worker; without PUB it is in approximate mode\n"
            "  --param POOL:NAME=VALUE  policy parameter (temperature, cache_threshold, ...)\n"
            "  --engine POOL:PRESET     the engine model the pool's workers run (default\n"
            "                           llama3-8b-h100; kvmatch sim --help lists the presets)\n"
            "  --max-workers N (1..%u)  --backend auto|cpu|cuda  --threads N (0..1024)\n"
            "  --initial-blocks N       each pool's index sized for N distinct blocks at start\n"
            "  --max-batch-routes N (1..1048576)  --max-queued-routes N (1..16777216)\n"
            "  --inline-routes N        frames up to N routes are decided on the loop thread when\n"
            "                           the scheduler is idle; 0 = never; default 16\n"
            "  --max-connections N (1..1048576)  --drain-timeout-ms N (0..3600000)\n"
            "  --active-ttl-ms N (1..604800000)  --max-active-entries N (1..2147483647)\n"
            "  --max-active-bytes N     active work's entries, counted bytes; 0 = no bound\n"
            "  --approx-dispatch-max-bytes N  --breaker-failures N (0..1048576)\n"
            "  --breaker-cooldown-ms N  --ready-share X (0..1)  --seed N\n"
            "  --log-format text|json   log lines: timestamp, level, component (default text)\n"
            "  --log-file PATH          log to PATH instead of stderr (reopened on SIGHUP)\n"
            "  --cluster nats://HOST:PORT|none  share active work with the other instances over\n"
            "                           NATS (docs/CLUSTER.md); needs --instance\n"
            "  --instance ID            this instance's id in the cluster (A-Z a-z 0-9 _ -)\n"
            "Without --config and --pool, one pool \"default\" (block size 16, policy ttft) is made.\n"
            "SIGTERM / SIGINT: stop accepting, finish queued decisions, flush records, snapshot, exit.\n"
            "SIGHUP: reopen the records and log files, reload the config file's pools, workers and\n"
            "policy parameters; the service keeps serving.\n"
            "Exit status: 0 stopped cleanly; 1 could not start or lost records or a snapshot;\n"
            "2 usage or configuration error.\n",
            KM_PROTOCOL_DEFAULT_SOCKET, KM_MAX_WORKERS_LIMIT);
}

static int find_pool(km_server_pool *pools, uint32_t n, const char *name, size_t len)
{
    for (uint32_t i = 0; i < n; i++)
        if (strlen(pools[i].name) == len && !strncmp(pools[i].name, name, len))
            return (int)i;
    return -1;
}

enum {
    OPT_CONFIG = 256, OPT_SOCKET, OPT_TCP, OPT_HTTP, OPT_ALLOW_NON_LOOPBACK, OPT_RECORDS,
    OPT_SNAPSHOT_DIR, OPT_SNAPSHOT_INTERVAL_MS, OPT_POOL, OPT_WORKER, OPT_PARAM, OPT_ENGINE,
    OPT_MAX_WORKERS,
    OPT_BACKEND, OPT_THREADS, OPT_INITIAL_BLOCKS, OPT_MAX_BATCH_ROUTES, OPT_MAX_QUEUED_ROUTES,
    OPT_INLINE_ROUTES, OPT_MAX_CONNECTIONS, OPT_DRAIN_TIMEOUT_MS, OPT_ACTIVE_TTL_MS,
    OPT_MAX_ACTIVE_ENTRIES, OPT_MAX_ACTIVE_BYTES, OPT_APPROX_DISPATCH_MAX_BYTES, OPT_BREAKER_FAILURES,
    OPT_BREAKER_COOLDOWN_MS, OPT_READY_SHARE, OPT_SEED, OPT_LOG_FORMAT, OPT_LOG_FILE,
    OPT_CLUSTER, OPT_INSTANCE,
    /* older names of the same settings */
    OPT_OLD_SNAPSHOT_INTERVAL_S, OPT_OLD_MAX_BATCH, OPT_OLD_ACTIVE_TTL_S, OPT_OLD_MAX_ACTIVE,
    OPT_OLD_APPROX_DISPATCH_MB,
};

static const struct option serve_options[] = {
    {"help", no_argument, NULL, 'h'},
    {"config", required_argument, NULL, OPT_CONFIG},
    {"socket", required_argument, NULL, OPT_SOCKET},
    {"tcp", required_argument, NULL, OPT_TCP},
    {"http", required_argument, NULL, OPT_HTTP},
    {"allow-non-loopback", no_argument, NULL, OPT_ALLOW_NON_LOOPBACK},
    {"records", required_argument, NULL, OPT_RECORDS},
    {"snapshot-dir", required_argument, NULL, OPT_SNAPSHOT_DIR},
    {"snapshot-interval-ms", required_argument, NULL, OPT_SNAPSHOT_INTERVAL_MS},
    {"pool", required_argument, NULL, OPT_POOL},
    {"worker", required_argument, NULL, OPT_WORKER},
    {"param", required_argument, NULL, OPT_PARAM},
    {"engine", required_argument, NULL, OPT_ENGINE},
    {"max-workers", required_argument, NULL, OPT_MAX_WORKERS},
    {"backend", required_argument, NULL, OPT_BACKEND},
    {"threads", required_argument, NULL, OPT_THREADS},
    {"initial-blocks", required_argument, NULL, OPT_INITIAL_BLOCKS},
    {"max-batch-routes", required_argument, NULL, OPT_MAX_BATCH_ROUTES},
    {"max-queued-routes", required_argument, NULL, OPT_MAX_QUEUED_ROUTES},
    {"inline-routes", required_argument, NULL, OPT_INLINE_ROUTES},
    {"max-connections", required_argument, NULL, OPT_MAX_CONNECTIONS},
    {"drain-timeout-ms", required_argument, NULL, OPT_DRAIN_TIMEOUT_MS},
    {"active-ttl-ms", required_argument, NULL, OPT_ACTIVE_TTL_MS},
    {"max-active-entries", required_argument, NULL, OPT_MAX_ACTIVE_ENTRIES},
    {"max-active-bytes", required_argument, NULL, OPT_MAX_ACTIVE_BYTES},
    {"approx-dispatch-max-bytes", required_argument, NULL, OPT_APPROX_DISPATCH_MAX_BYTES},
    {"breaker-failures", required_argument, NULL, OPT_BREAKER_FAILURES},
    {"breaker-cooldown-ms", required_argument, NULL, OPT_BREAKER_COOLDOWN_MS},
    {"ready-share", required_argument, NULL, OPT_READY_SHARE},
    {"seed", required_argument, NULL, OPT_SEED},
    {"log-format", required_argument, NULL, OPT_LOG_FORMAT},
    {"log-file", required_argument, NULL, OPT_LOG_FILE},
    {"cluster", required_argument, NULL, OPT_CLUSTER},
    {"instance", required_argument, NULL, OPT_INSTANCE},
    {"snapshot-interval-s", required_argument, NULL, OPT_OLD_SNAPSHOT_INTERVAL_S},
    {"max-batch", required_argument, NULL, OPT_OLD_MAX_BATCH},
    {"active-ttl-s", required_argument, NULL, OPT_OLD_ACTIVE_TTL_S},
    {"max-active", required_argument, NULL, OPT_OLD_MAX_ACTIVE},
    {"approx-dispatch-mb", required_argument, NULL, OPT_OLD_APPROX_DISPATCH_MB},
    {NULL, 0, NULL, 0},
};

static bool g_quiet; /* a reload applies the flags again: no second round of warnings */

/* Where a flag's refusal goes: stderr at the start; during a reload (g_quiet) the first one is
 * kept in g_flag_refusal, for the reload's log line. */
static char g_flag_refusal[512];

static void flag_error(const char *fmt, ...)
{
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    size_t n = strlen(line);
    while (n && line[n - 1] == '\n')
        line[--n] = '\0';
    if (!g_quiet)
        fprintf(stderr, "kvmatch serve: %s\n", line);
    else if (!g_flag_refusal[0])
        snprintf(g_flag_refusal, sizeof g_flag_refusal, "%s", line);
}

static void deprecated(const char *old, const char *now)
{
    if (!g_quiet)
        fprintf(stderr, "kvmatch serve: warning: --%s is deprecated; use --%s (the config file's "
                    "key of the same name)\n", old, now);
}

static int apply_flags(int argc, char **argv, km_server_config *cfg);

/* What SIGHUP needs: the logger to reopen, the config file to read again. */
typedef struct serve_state {
    km_logger *logger;
    const char *log_file; /* NULL: the log goes to stderr, which SIGHUP does not reopen */
    const char *config_path;
    int argc;
    char **argv;
} serve_state;

static void on_hangup(km_server *server, void *user)
{
    serve_state *st = user;
    char why[512];
    if (st->logger && st->log_file) {
        if (km_logger_reopen(st->logger, why, sizeof why) != KM_OK)
            km_logger_write(st->logger, why);
        else
            km_logger_write(st->logger, "serve: log file reopened");
    }
    if (!st->config_path)
        return;
    km_server_config fresh;
    km_server_config_init(&fresh);
    fresh.records_path = "kvmatch-records.jsonl";
    km_server_config_json *owner = NULL;
    if (km_server_config_load_json(st->config_path, &fresh, &owner, why, sizeof why) != KM_OK) {
        char line[700];
        snprintf(line, sizeof line, "serve: reload of %s refused, nothing changed: %s",
                 st->config_path, why);
        km_logger_write(st->logger, line);
        return;
    }
    /* the flags override the file, at a reload as at the start */
    g_quiet = true;
    g_flag_refusal[0] = '\0';
    int flags = apply_flags(st->argc, st->argv, &fresh);
    g_quiet = false;
    if (flags == KM_EXIT_OK) {
        km_server_reload(server, &fresh);
    } else {
        /* A flag that named what the file no longer has (a pool, its policy). */
        char line[800];
        snprintf(line, sizeof line, "serve: reload of %s refused, nothing changed: the flags do "
                 "not apply over it: %s", st->config_path,
                 g_flag_refusal[0] ? g_flag_refusal : "(stderr says why)");
        km_logger_write(st->logger, line);
    }
    km_server_config_json_free(owner);
}

/* The pools apply_flags hands out: the config file's, then those the flags add, each with its
 * workers copied once a --worker flag adds to it. Sized from the file and grown as the flags need,
 * so nothing the file or the flags list is ever left out. */
typedef struct flag_pools {
    km_server_pool *pools;
    uint32_t n, cap;
    km_server_worker **workers; /* per pool; NULL while the pool keeps the file's array */
    uint32_t *n_workers, *cap_workers;
    char **owned; /* the strings the flags' pools and workers point at */
    uint32_t n_owned, cap_owned;
} flag_pools;

static void flag_pools_free(flag_pools *fp)
{
    for (uint32_t i = 0; i < fp->cap; i++)
        free(fp->workers[i]);
    for (uint32_t i = 0; i < fp->n_owned; i++)
        free(fp->owned[i]);
    free(fp->owned);
    free(fp->workers);
    free(fp->n_workers);
    free(fp->cap_workers);
    free(fp->pools);
    memset(fp, 0, sizeof *fp);
}

/* A copy of text that lives as long as the pools handed out; NULL when out of memory. */
static char *flag_pools_strdup(flag_pools *fp, const char *text)
{
    if (fp->n_owned == fp->cap_owned) {
        uint32_t cap = fp->cap_owned ? fp->cap_owned * 2 : 16;
        char **owned = realloc(fp->owned, cap * sizeof *owned);
        if (!owned)
            return NULL;
        fp->owned = owned;
        fp->cap_owned = cap;
    }
    char *copy = strdup(text);
    if (copy)
        fp->owned[fp->n_owned++] = copy;
    return copy;
}

/* Room for one more pool; false when out of memory. */
static bool flag_pools_reserve(flag_pools *fp)
{
    if (fp->n < fp->cap)
        return true;
    uint32_t cap = fp->cap ? fp->cap * 2 : 16;
    km_server_pool *pools = realloc(fp->pools, cap * sizeof *pools);
    if (pools)
        fp->pools = pools;
    km_server_worker **workers = realloc(fp->workers, cap * sizeof *workers);
    if (workers)
        fp->workers = workers;
    uint32_t *n_workers = realloc(fp->n_workers, cap * sizeof *n_workers);
    if (n_workers)
        fp->n_workers = n_workers;
    uint32_t *cap_workers = realloc(fp->cap_workers, cap * sizeof *cap_workers);
    if (cap_workers)
        fp->cap_workers = cap_workers;
    if (!pools || !workers || !n_workers || !cap_workers)
        return false;
    for (uint32_t i = fp->cap; i < cap; i++) {
        fp->workers[i] = NULL;
        fp->n_workers[i] = fp->cap_workers[i] = 0;
    }
    fp->cap = cap;
    return true;
}

/* Append w to pool pi's workers, after the ones it had (from the file); false when out of
 * memory. */
static bool flag_pools_add_worker(flag_pools *fp, uint32_t pi, km_server_worker w)
{
    km_server_pool *p = &fp->pools[pi];
    if (!fp->workers[pi]) {
        /* the first flag for this pool: copy the file's workers into an array of our own */
        uint32_t cap = p->n_workers + 16;
        if (!(fp->workers[pi] = malloc(cap * sizeof *fp->workers[pi])))
            return false;
        if (p->n_workers)
            memcpy(fp->workers[pi], p->workers, p->n_workers * sizeof *p->workers);
        fp->n_workers[pi] = p->n_workers;
        fp->cap_workers[pi] = cap;
    }
    if (fp->n_workers[pi] == fp->cap_workers[pi]) {
        uint32_t cap = fp->cap_workers[pi] * 2;
        km_server_worker *grown = realloc(fp->workers[pi], cap * sizeof *grown);
        if (!grown)
            return false;
        fp->workers[pi] = grown;
        fp->cap_workers[pi] = cap;
    }
    fp->workers[pi][fp->n_workers[pi]++] = w;
    p->workers = fp->workers[pi];
    p->n_workers = fp->n_workers[pi];
    return true;
}

static flag_pools g_flag_pools; /* what the last apply_flags handed out */

/* Apply the flags (the second pass) over *cfg, which holds the defaults and the config file's
 * settings; pools from the file are copied so flags can add to them and their workers, however
 * many there are. The pools are valid until the next call. KM_EXIT_OK, KM_EXIT_FAILURE (out of
 * memory) or KM_EXIT_USAGE (said on stderr). */
static int apply_flags(int argc, char **argv, km_server_config *cfg)
{
    flag_pools *fp = &g_flag_pools;
    flag_pools_free(fp);
    for (uint32_t i = 0; i < cfg->n_pools; i++) {
        if (!flag_pools_reserve(fp)) {
            flag_error("out of memory copying %u pools\n", cfg->n_pools);
            return KM_EXIT_FAILURE;
        }
        fp->pools[fp->n++] = cfg->pools[i];
    }
    int status = 0, opt;
    /* Without pools from the file or a --pool flag the service has the pool "default", made
     * before the flags are applied so --worker and --param can name it. */
    bool pool_flag = false;
    km_cli_getopt_begin(argv, "serve");
    opterr = 0;
    while ((opt = getopt_long(argc, argv, "h", serve_options, NULL)) != -1)
        pool_flag |= opt == OPT_POOL;
    if (fp->n == 0 && !pool_flag) {
        if (!flag_pools_reserve(fp)) {
            flag_error("out of memory\n");
            return KM_EXIT_FAILURE;
        }
        km_server_pool *p = &fp->pools[fp->n++];
        memset(p, 0, sizeof *p);
        p->name = "default";
        p->block_size = 16;
        km_policy_config_init(&p->policy);
    }
    km_cli_getopt_begin(argv, "serve");
    opterr = !g_quiet;
    while (!status && (opt = getopt_long(argc, argv, "h", serve_options, NULL)) != -1) {
        const char *v = optarg;
        uint64_t x;
        uint32_t u;
        switch (opt) {
        case OPT_CONFIG:
        case OPT_LOG_FILE:
        case OPT_LOG_FORMAT:
            break; /* read in the first pass */
        case OPT_ALLOW_NON_LOOPBACK: cfg->allow_non_loopback = true; break;
        case OPT_SOCKET: cfg->socket_path = strcmp(v, "none") ? v : NULL; break;
        case OPT_TCP: cfg->tcp = v; break;
        case OPT_HTTP: cfg->http = v; break;
        case OPT_RECORDS: cfg->records_path = strcmp(v, "none") ? v : NULL; break;
        case OPT_SNAPSHOT_DIR: cfg->snapshot_dir = v; break;
        case OPT_CLUSTER: cfg->cluster_url = strcmp(v, "none") ? v : NULL; break;
        case OPT_INSTANCE: cfg->cluster_instance = v; break;
        case OPT_OLD_SNAPSHOT_INTERVAL_S:
            deprecated("snapshot-interval-s", "snapshot-interval-ms");
            if (!km_cli_u32("serve", "snapshot-interval-s", v, 0, 86400, &u))
                status = KM_EXIT_USAGE;
            else
                cfg->snapshot_interval_ms = u * 1000;
            break;
        case OPT_SNAPSHOT_INTERVAL_MS:
            if (!km_cli_u32("serve", "snapshot-interval-ms", v, 0, 86400000, &cfg->snapshot_interval_ms))
                status = KM_EXIT_USAGE;
            break;
        case OPT_MAX_WORKERS:
            if (!km_cli_u32("serve", "max-workers", v, 1, KM_MAX_WORKERS_LIMIT, &cfg->max_workers))
                status = KM_EXIT_USAGE;
            break;
        case OPT_THREADS:
            if (!km_cli_u32("serve", "threads", v, 0, 1024, &cfg->index_threads))
                status = KM_EXIT_USAGE;
            break;
        case OPT_OLD_MAX_BATCH:
            deprecated("max-batch", "max-batch-routes");
            /* fall through */
        case OPT_MAX_BATCH_ROUTES:
            if (!km_cli_u32("serve", opt == OPT_OLD_MAX_BATCH ? "max-batch" : "max-batch-routes", v,
                            1, 1u << 20, &cfg->max_batch_routes))
                status = KM_EXIT_USAGE;
            break;
        case OPT_MAX_QUEUED_ROUTES:
            if (!km_cli_u32("serve", "max-queued-routes", v, 1, 1u << 24, &cfg->max_queued_routes))
                status = KM_EXIT_USAGE;
            break;
        case OPT_INITIAL_BLOCKS:
            if (!km_cli_u64("serve", "initial-blocks", v, 0, UINT64_C(1) << 36,
                            &cfg->index_initial_blocks))
                status = KM_EXIT_USAGE;
            break;
        case OPT_INLINE_ROUTES:
            if (!km_cli_u32("serve", "inline-routes", v, 0, 1u << 20, &cfg->inline_routes))
                status = KM_EXIT_USAGE;
            break;
        case OPT_MAX_CONNECTIONS:
            if (!km_cli_u32("serve", "max-connections", v, 1, 1u << 20, &cfg->max_connections))
                status = KM_EXIT_USAGE;
            break;
        case OPT_DRAIN_TIMEOUT_MS:
            if (!km_cli_u32("serve", "drain-timeout-ms", v, 0, 3600000, &cfg->drain_timeout_ms))
                status = KM_EXIT_USAGE;
            break;
        case OPT_OLD_ACTIVE_TTL_S:
            deprecated("active-ttl-s", "active-ttl-ms");
            if (!km_cli_u64("serve", "active-ttl-s", v, 1, 86400 * 7, &x))
                status = KM_EXIT_USAGE;
            else
                cfg->active_ttl_ms = x * 1000;
            break;
        case OPT_ACTIVE_TTL_MS:
            if (!km_cli_u64("serve", "active-ttl-ms", v, 1, UINT64_C(86400000) * 7, &cfg->active_ttl_ms))
                status = KM_EXIT_USAGE;
            break;
        case OPT_OLD_MAX_ACTIVE:
            deprecated("max-active", "max-active-entries");
            /* fall through */
        case OPT_MAX_ACTIVE_ENTRIES:
            if (!km_cli_u32("serve", opt == OPT_OLD_MAX_ACTIVE ? "max-active" : "max-active-entries",
                            v, 1, (1u << 31) - 1, &cfg->max_active_entries))
                status = KM_EXIT_USAGE;
            break;
        case OPT_MAX_ACTIVE_BYTES:
            if (!km_cli_u64("serve", "max-active-bytes", v, 0, UINT64_MAX, &cfg->max_active_bytes))
                status = KM_EXIT_USAGE;
            break;
        case OPT_OLD_APPROX_DISPATCH_MB:
            deprecated("approx-dispatch-mb", "approx-dispatch-max-bytes");
            if (!km_cli_u64("serve", "approx-dispatch-mb", v, 0, UINT64_C(1) << 40, &x))
                status = KM_EXIT_USAGE;
            else
                cfg->approx_dispatch_max_bytes = x << 20;
            break;
        case OPT_APPROX_DISPATCH_MAX_BYTES:
            if (!km_cli_u64("serve", "approx-dispatch-max-bytes", v, 0, UINT64_C(1) << 60,
                            &cfg->approx_dispatch_max_bytes))
                status = KM_EXIT_USAGE;
            break;
        case OPT_BREAKER_FAILURES:
            if (!km_cli_u32("serve", "breaker-failures", v, 0, 1u << 20, &cfg->breaker_failures))
                status = KM_EXIT_USAGE;
            break;
        case OPT_BREAKER_COOLDOWN_MS:
            if (!km_cli_u64("serve", "breaker-cooldown-ms", v, 1, UINT64_MAX / 1000000,
                            &cfg->breaker_cooldown_ms))
                status = KM_EXIT_USAGE;
            break;
        case OPT_SEED:
            if (!km_cli_u64("serve", "seed", v, 0, UINT64_MAX, &cfg->seed))
                status = KM_EXIT_USAGE;
            break;
        case OPT_READY_SHARE:
            if (!km_cli_double("serve", "ready-share", v, 0, 1, &cfg->ready_share))
                status = KM_EXIT_USAGE;
            break;
        case OPT_BACKEND:
            if (!strcmp(v, "auto"))
                cfg->backend = KM_BACKEND_AUTO;
            else if (!strcmp(v, "cpu"))
                cfg->backend = KM_BACKEND_CPU;
            else if (!strcmp(v, "cuda"))
                cfg->backend = KM_BACKEND_CUDA;
            else {
                flag_error("--backend is auto, cpu or cuda, got \"%s\"\n", v);
                status = KM_EXIT_USAGE;
            }
            break;
        case OPT_POOL: {
            /* NAME:BLOCK_SIZE[:POLICY[:MODEL]]; an empty POLICY or MODEL is the default (MODEL is
             * the rest, colons included). */
            char buf[256];
            if (strlen(v) >= sizeof buf) {
                flag_error("--pool takes at most %zu bytes, got %zu\n",
                           sizeof buf - 1, strlen(v));
                status = KM_EXIT_USAGE;
                break;
            }
            snprintf(buf, sizeof buf, "%s", v);
            char *rest = buf;
            char *name = strsep(&rest, ":"), *bs = rest ? strsep(&rest, ":") : NULL;
            char *pol = rest ? strsep(&rest, ":") : NULL, *model = rest;
            if (pol && !*pol)
                pol = NULL;
            if (model && !*model)
                model = NULL;
            if (!name || !*name || !bs || !*bs) {
                flag_error("--pool wants NAME:BLOCK_SIZE[:POLICY[:MODEL]], "
                           "got \"%s\"\n", v);
                status = KM_EXIT_USAGE;
                break;
            }
            if (!flag_pools_reserve(fp)) {
                flag_error("--pool %s: out of memory\n", v);
                status = KM_EXIT_FAILURE;
                break;
            }
            km_server_pool *p = &fp->pools[fp->n];
            memset(p, 0, sizeof *p);
            km_policy_config_init(&p->policy);
            uint64_t block_size;
            if (!km_cli_u64("serve", "pool", bs, 1, 1u << 20, &block_size)) {
                flag_error("(the BLOCK_SIZE of --pool %s)\n", v);
                status = KM_EXIT_USAGE;
                break;
            }
            p->block_size = (uint32_t)block_size;
            if (pol && km_policy_kind_parse(pol, &p->policy.kind) != KM_OK) {
                flag_error("--pool %s: unknown policy \"%s\" (ttft, kv, "
                           "cache_aware, prefix, least_load, round_robin, llmd, preble)\n",
                           v, pol);
                status = KM_EXIT_USAGE;
                break;
            }
            p->name = flag_pools_strdup(fp, name);
            p->model = model ? flag_pools_strdup(fp, model) : NULL;
            if (!p->name || (model && !p->model)) {
                flag_error("--pool %s: out of memory\n", v);
                status = KM_EXIT_FAILURE;
                break;
            }
            fp->n++;
            break;
        }
        case OPT_PARAM:
        case OPT_ENGINE:
        case OPT_WORKER: {
            const char *colon = strchr(v, ':');
            int pi = colon ? find_pool(fp->pools, fp->n, v, (size_t)(colon - v)) : -1;
            const char *flag = opt == OPT_PARAM    ? "--param"
                               : opt == OPT_ENGINE ? "--engine"
                                                   : "--worker";
            if (pi < 0) {
                flag_error("%s %s: no such pool (define it first)\n", flag, v);
                status = KM_EXIT_USAGE;
                break;
            }
            if (opt == OPT_ENGINE) {
                if (km_engine_model_preset(colon + 1, &fp->pools[pi].policy.engine) != KM_OK) {
                    flag_error("--engine %s: unknown engine preset \"%s\" "
                               "(kvmatch sim --help lists them)\n", v, colon + 1);
                    status = KM_EXIT_USAGE;
                }
                break;
            }
            if (opt == OPT_PARAM) {
                const char *eq = strchr(colon + 1, '=');
                char pname[64];
                if (!eq || (size_t)(eq - colon - 1) >= sizeof pname) {
                    flag_error("--param wants POOL:NAME=VALUE, got \"%s\"\n", v);
                    status = KM_EXIT_USAGE;
                    break;
                }
                snprintf(pname, sizeof pname, "%.*s", (int)(eq - colon - 1), colon + 1);
                char *end;
                double d = strtod(eq + 1, &end);
                km_server_pool *p = &fp->pools[pi];
                const char *owner = km_server_policy_param_owner(pname);
                if (owner && strcmp(owner, km_policy_kind_name(p->policy.kind)) != 0) {
                    flag_error("--param %s: a parameter of policy %s; pool %s "
                               "has policy %s\n", v, owner, p->name,
                               km_policy_kind_name(p->policy.kind));
                    status = KM_EXIT_USAGE;
                    break;
                }
                km_policy_config pc = p->policy;
                char detail[256];
                if (*end || end == eq + 1 ||
                    km_server_policy_param(&pc, pname, d, detail, sizeof detail) != KM_OK) {
                    flag_error("--param %s: %s\n", v,
                               *end || end == eq + 1 ? "not a number" : detail);
                    status = KM_EXIT_USAGE;
                    break;
                }
                p->policy = pc;
                break;
            }
            /* POOL:ID[=PUB[,REPLAY]] */
            const char *idp = colon + 1;
            char *end = strchr(idp, '=');
            if (!end)
                end = (char *)idp + strlen(idp);
            uint64_t id;
            /* Digits only, as follow and route read ids (no sign, no space, no hex). */
            if (!km_cli_parse_u64(idp, (size_t)(end - idp), KM_MAX_WORKERS_LIMIT - 1, &id)) {
                flag_error("--worker wants POOL:ID[=PUB[,REPLAY]] with ID in "
                           "0..%u, got \"%s\"\n", KM_MAX_WORKERS_LIMIT - 1, v);
                status = KM_EXIT_USAGE;
                break;
            }
            km_server_worker w = {(uint32_t)id, NULL, NULL, NULL, false, 0, NULL};
            if (*end == '=') {
                char *pub = flag_pools_strdup(fp, end + 1);
                char *comma = pub ? strchr(pub, ',') : NULL;
                if (comma) {
                    *comma = '\0';
                    w.replay_endpoint = comma + 1;
                }
                w.event_endpoint = pub;
            }
            /* Keep the pool's configured workers, then the flag's. */
            if (!flag_pools_add_worker(fp, (uint32_t)pi, w)) {
                flag_error("--worker %s: out of memory\n", v);
                status = KM_EXIT_FAILURE;
            }
            break;
        }
        default:
            status = km_cli_usage_error("serve");
            break;
        }
    }
    if (!status && optind < argc) {
        flag_error("unexpected argument \"%s\"\n", argv[optind]);
        status = km_cli_usage_error("serve");
    }
    if (status)
        return status;
    cfg->pools = fp->pools;
    cfg->n_pools = fp->n;
    return KM_EXIT_OK;
}

int km_cmd_serve(int argc, char **argv)
{
    km_server_config cfg;
    km_server_config_init(&cfg);
    cfg.records_path = "kvmatch-records.jsonl";
    const char *config_path = NULL, *log_file = NULL;
    km_log_format log_format = KM_LOG_FORMAT_TEXT;
    /* First pass: --help, --config and the log settings, which the rest depends on. */
    km_cli_getopt_begin(argv, "serve");
    opterr = 0;
    int opt;
    while ((opt = getopt_long(argc, argv, "h", serve_options, NULL)) != -1) {
        if (opt == 'h') {
            serve_usage(stdout);
            return KM_EXIT_OK;
        }
        if (opt == OPT_CONFIG)
            config_path = optarg;
        else if (opt == OPT_LOG_FILE)
            log_file = optarg;
        else if (opt == OPT_LOG_FORMAT && km_log_format_parse(optarg, &log_format) != KM_OK) {
            fprintf(stderr, "kvmatch serve: --log-format is text or json, got \"%s\"\n", optarg);
            return KM_EXIT_USAGE;
        }
    }
    km_server_config_json *owner = NULL;
    char why[512];
    if (config_path && km_server_config_load_json(config_path, &cfg, &owner, why, sizeof why) != KM_OK) {
        fprintf(stderr, "kvmatch serve: %s\n", why);
        return KM_EXIT_USAGE;
    }
    int status = apply_flags(argc, argv, &cfg);
    if (status) {
        km_server_config_json_free(owner);
        return status;
    }
    km_logger_config lc;
    km_logger_config_init(&lc);
    lc.path = log_file;
    lc.format = log_format;
    lc.component = "serve";
    serve_state state = {NULL, log_file, config_path, argc, argv};
    if (km_logger_create(&lc, &state.logger, why, sizeof why) != KM_OK) {
        fprintf(stderr, "kvmatch serve: %s\n", why);
        km_server_config_json_free(owner);
        return KM_EXIT_FAILURE;
    }
    cfg.log = km_logger_write;
    cfg.log_user = state.logger;
    cfg.on_hangup = on_hangup;
    cfg.hangup_user = &state;
    km_server *server = NULL;
    int rc = km_server_create(&cfg, &server, why, sizeof why);
    if (rc != KM_OK) {
        char line[700];
        snprintf(line, sizeof line, "serve: %s: %s", km_error_name(rc), why);
        km_logger_write(state.logger, line);
        km_logger_destroy(state.logger);
        km_server_config_json_free(owner);
        /* a setting the server refused is a configuration error; anything else failed to start */
        return rc == KM_ERR_INVALID_ARGUMENT || rc == KM_ERR_TOO_LARGE ? KM_EXIT_USAGE
                                                                        : KM_EXIT_FAILURE;
    }
    char line[128];
    if (km_server_tcp_port(server)) {
        snprintf(line, sizeof line, "serve: tcp port %u", km_server_tcp_port(server));
        km_logger_write(state.logger, line);
    }
    if (km_server_http_port(server)) {
        snprintf(line, sizeof line, "serve: http port %u", km_server_http_port(server));
        km_logger_write(state.logger, line);
    }
    rc = km_server_run(server, true);
    km_server_destroy(server);
    flag_pools_free(&g_flag_pools);
    km_logger_destroy(state.logger);
    km_server_config_json_free(owner);
    return rc == KM_OK ? KM_EXIT_OK : KM_EXIT_FAILURE;
}
