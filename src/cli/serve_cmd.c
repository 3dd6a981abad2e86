/* `kvmatch serve`: the routing service (docs/SERVICE.md). A JSON config file (--config) and flags;
 * flags override the file. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/commands.h"
#include "kvmatch/kvmatch.h"
#include "service/server_config.h"

#define MAX_FLAG_POOLS 64
#define MAX_FLAG_WORKERS 4096

static void serve_usage(FILE *f)
{
    fprintf(f,
            "usage: kvmatch serve [--config FILE] [options]\n"
            "  --socket PATH           Unix socket (default %s; 'none' for TCP only)\n"
            "  --tcp HOST:PORT         also listen on loopback TCP\n"
            "  --http HOST:PORT        /healthz /readyz /status /metrics on loopback\n"
            "  --records PATH|none     decision and outcome JSONL (default kvmatch-records.jsonl)\n"
            "  --snapshot-dir DIR      event pools' snapshots (restored at start, written on SIGTERM)\n"
            "  --snapshot-interval-s N periodic snapshots (default 60; 0 = only on shutdown)\n"
            "  --pool NAME:BLOCK_SIZE[:POLICY[:MODEL]]  add a pool (policy ttft, kv, cache_aware,\n"
            "                          prefix, least_load, round_robin, llmd, preble; default ttft)\n"
            "  --worker POOL:ID[=PUB[,REPLAY]]  add a worker; without PUB it is in approximate mode\n"
            "  --param POOL:NAME=VALUE policy parameter (temperature, cache_threshold, ...)\n"
            "  --max-workers N  --backend auto|cpu|cuda  --threads N  --max-batch N\n"
            "  --initial-blocks N (each pool's index sized for N distinct blocks at start)\n"
            "  --inline-routes N (frames up to N routes are decided on the loop thread when the\n"
            "                    scheduler is idle; 0 = never; default 16)\n"
            "  --active-ttl-s N  --max-active N  --approx-dispatch-mb N\n"
            "  --breaker-failures N  --breaker-cooldown-ms N\n"
            "  --ready-share X  --seed N  --allow-non-loopback\n"
            "Without --config and --pool, one pool \"default\" (block size 16, policy ttft) is made.\n"
            "SIGTERM / SIGINT: stop accepting, finish queued decisions, flush records, snapshot, exit 0.\n",
            KM_PROTOCOL_DEFAULT_SOCKET);
}

static int parse_u64(const char *s, uint64_t *out)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || *end || end == s || s[0] == '-')
        return -1;
    *out = v;
    return 0;
}

static void log_line(void *user, const char *line)
{
    (void)user;
    fprintf(stderr, "kvmatch serve: %s\n", line);
}

static int find_pool(km_server_pool *pools, uint32_t n, const char *name, size_t len)
{
    for (uint32_t i = 0; i < n; i++)
        if (strlen(pools[i].name) == len && !strncmp(pools[i].name, name, len))
            return (int)i;
    return -1;
}

int km_cmd_serve(int argc, char **argv)
{
    km_server_config cfg;
    km_server_config_init(&cfg);
    cfg.records_path = "kvmatch-records.jsonl";
    cfg.log = log_line;
    const char *config_path = NULL;
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--config") && i + 1 < argc)
            config_path = argv[i + 1];
    km_server_config_json *owner = NULL;
    char why[512];
    if (config_path && km_server_config_load_json(config_path, &cfg, &owner, why, sizeof why) != KM_OK) {
        fprintf(stderr, "kvmatch serve: %s\n", why);
        return 2;
    }
    /* Pools from the file are copied so flags can add to them. */
    static km_server_pool pools[MAX_FLAG_POOLS];
    static km_server_worker workers[MAX_FLAG_POOLS][MAX_FLAG_WORKERS / MAX_FLAG_POOLS];
    uint32_t n_pools = 0;
    uint32_t n_workers[MAX_FLAG_POOLS] = {0};
    for (uint32_t i = 0; i < cfg.n_pools && n_pools < MAX_FLAG_POOLS; i++)
        pools[n_pools++] = cfg.pools[i];
    int status = 0;
    for (int i = 1; i < argc && !status; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        uint64_t x;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            serve_usage(stdout);
            km_server_config_json_free(owner);
            return 0;
        } else if (!strcmp(a, "--allow-non-loopback")) {
            cfg.allow_non_loopback = true;
            continue;
        }
        if (!v) {
            fprintf(stderr, "kvmatch serve: %s needs a value\n", a);
            status = 2;
            break;
        }
        i++;
        if (!strcmp(a, "--config")) {
            /* read above */
        } else if (!strcmp(a, "--socket")) {
            cfg.socket_path = strcmp(v, "none") ? v : NULL;
        } else if (!strcmp(a, "--tcp")) {
            cfg.tcp = v;
        } else if (!strcmp(a, "--http")) {
            cfg.http = v;
        } else if (!strcmp(a, "--records")) {
            cfg.records_path = strcmp(v, "none") ? v : NULL;
        } else if (!strcmp(a, "--snapshot-dir")) {
            cfg.snapshot_dir = v;
        } else if (!strcmp(a, "--snapshot-interval-s") && !parse_u64(v, &x) && x <= 86400) {
            cfg.snapshot_interval_ms = (uint32_t)(x * 1000);
        } else if (!strcmp(a, "--max-workers") && !parse_u64(v, &x) && x >= 1 && x <= KM_MAX_WORKERS_LIMIT) {
            cfg.max_workers = (uint32_t)x;
        } else if (!strcmp(a, "--threads") && !parse_u64(v, &x) && x <= 1024) {
            cfg.index_threads = (uint32_t)x;
        } else if (!strcmp(a, "--max-batch") && !parse_u64(v, &x) && x >= 1 && x <= (1u << 20)) {
            cfg.max_batch_routes = (uint32_t)x;
        } else if (!strcmp(a, "--initial-blocks") && !parse_u64(v, &x) && x <= (UINT64_C(1) << 36)) {
            cfg.index_initial_blocks = x;
        } else if (!strcmp(a, "--inline-routes") && !parse_u64(v, &x) && x <= (1u << 20)) {
            cfg.inline_routes = (uint32_t)x;
        } else if (!strcmp(a, "--active-ttl-s") && !parse_u64(v, &x) && x >= 1 && x <= 86400 * 7) {
            cfg.active_ttl_ms = x * 1000;
        } else if (!strcmp(a, "--max-active") && !parse_u64(v, &x) && x >= 1 && x < (1u << 31)) {
            cfg.max_active_entries = (uint32_t)x;
        } else if (!strcmp(a, "--approx-dispatch-mb") && !parse_u64(v, &x) && x <= (UINT64_C(1) << 40)) {
            cfg.approx_dispatch_max_bytes = x << 20;
        } else if (!strcmp(a, "--breaker-failures") && !parse_u64(v, &x) && x <= (1u << 20)) {
            cfg.breaker_failures = (uint32_t)x;
        } else if (!strcmp(a, "--breaker-cooldown-ms") && !parse_u64(v, &x) && x >= 1 &&
                   x <= UINT64_MAX / 1000000) {
            cfg.breaker_cooldown_ms = x;
        } else if (!strcmp(a, "--seed") && !parse_u64(v, &x)) {
            cfg.seed = x;
        } else if (!strcmp(a, "--ready-share")) {
            char *end;
            double d = strtod(v, &end);
            if (*end || !(d >= 0 && d <= 1)) {
                fprintf(stderr, "kvmatch serve: --ready-share wants 0..1, got %s\n", v);
                status = 2;
            }
            cfg.ready_share = d;
        } else if (!strcmp(a, "--backend")) {
            if (!strcmp(v, "auto"))
                cfg.backend = KM_BACKEND_AUTO;
            else if (!strcmp(v, "cpu"))
                cfg.backend = KM_BACKEND_CPU;
            else if (!strcmp(v, "cuda"))
                cfg.backend = KM_BACKEND_CUDA;
            else {
                fprintf(stderr, "kvmatch serve: --backend is auto, cpu or cuda\n");
                status = 2;
            }
        } else if (!strcmp(a, "--pool")) {
            /* NAME:BLOCK_SIZE[:POLICY[:MODEL]] */
            char buf[256];
            snprintf(buf, sizeof buf, "%s", v);
            char *save = NULL;
            char *name = strtok_r(buf, ":", &save), *bs = strtok_r(NULL, ":", &save),
                 *pol = strtok_r(NULL, ":", &save), *model = strtok_r(NULL, "", &save);
            if (!name || !bs || parse_u64(bs, &x) || x == 0 || x > (1u << 20) || n_pools >= MAX_FLAG_POOLS) {
                fprintf(stderr, "kvmatch serve: --pool wants NAME:BLOCK_SIZE[:POLICY[:MODEL]], got %s\n", v);
                status = 2;
                break;
            }
            km_server_pool *p = &pools[n_pools];
            memset(p, 0, sizeof *p);
            km_policy_config_init(&p->policy);
            p->name = strndup(name, strlen(name));
            p->block_size = (uint32_t)x;
            p->model = model ? strdup(model) : NULL;
            if (pol && km_policy_kind_parse(pol, &p->policy.kind) != KM_OK) {
                fprintf(stderr, "kvmatch serve: unknown policy %s\n", pol);
                status = 2;
                break;
            }
            n_pools++;
        } else if (!strcmp(a, "--worker") || !strcmp(a, "--param")) {
            const char *colon = strchr(v, ':');
            int pi = colon ? find_pool(pools, n_pools, v, (size_t)(colon - v)) : -1;
            if (pi < 0) {
                fprintf(stderr, "kvmatch serve: %s %s: no such pool (define it first)\n", a, v);
                status = 2;
                break;
            }
            if (!strcmp(a, "--param")) {
                const char *eq = strchr(colon + 1, '=');
                char pname[64];
                if (!eq || (size_t)(eq - colon - 1) >= sizeof pname) {
                    fprintf(stderr, "kvmatch serve: --param wants POOL:NAME=VALUE\n");
                    status = 2;
                    break;
                }
                snprintf(pname, sizeof pname, "%.*s", (int)(eq - colon - 1), colon + 1);
                char *end;
                double d = strtod(eq + 1, &end);
                km_server_pool *p = &pools[pi];
                km_policy_config pc = p->policy;
                char detail[256];
                if (*end || km_server_policy_param(&pc, pname, d, detail, sizeof detail) != KM_OK) {
                    fprintf(stderr, "kvmatch serve: --param %s: %s\n", v, *end ? "not a number" : detail);
                    status = 2;
                    break;
                }
                p->policy = pc;
                continue;
            }
            /* POOL:ID[=PUB[,REPLAY]] */
            const char *idp = colon + 1;
            char *end;
            unsigned long id = strtoul(idp, &end, 10);
            if (end == idp || (*end && *end != '=') || id >= KM_MAX_WORKERS_LIMIT) {
                fprintf(stderr, "kvmatch serve: --worker wants POOL:ID[=PUB[,REPLAY]], got %s\n", v);
                status = 2;
                break;
            }
            if (n_workers[pi] >= MAX_FLAG_WORKERS / MAX_FLAG_POOLS) {
                fprintf(stderr, "kvmatch serve: too many --worker flags for pool %s (use --config)\n",
                        pools[pi].name);
                status = 2;
                break;
            }
            km_server_worker w = {(uint32_t)id, NULL, NULL, NULL};
            if (*end == '=') {
                char *pub = strdup(end + 1);
                char *comma = pub ? strchr(pub, ',') : NULL;
                if (comma) {
                    *comma = '\0';
                    w.replay_endpoint = comma + 1;
                }
                w.event_endpoint = pub;
            }
            /* Keep the pool's configured workers, then the flag's. */
            km_server_pool *p = &pools[pi];
            if (n_workers[pi] == 0 && p->n_workers) {
                uint32_t k = 0;
                for (; k < p->n_workers && k < MAX_FLAG_WORKERS / MAX_FLAG_POOLS - 1; k++)
                    workers[pi][k] = p->workers[k];
                n_workers[pi] = k;
            }
            workers[pi][n_workers[pi]++] = w;
            p->workers = workers[pi];
            p->n_workers = n_workers[pi];
        } else {
            fprintf(stderr, "kvmatch serve: unknown option or bad value: %s %s\n", a, v);
            status = 2;
        }
    }
    if (status) {
        serve_usage(stderr);
        km_server_config_json_free(owner);
        return status;
    }
    if (n_pools == 0) {
        km_server_pool *p = &pools[n_pools++];
        memset(p, 0, sizeof *p);
        p->name = "default";
        p->block_size = 16;
        km_policy_config_init(&p->policy);
    }
    cfg.pools = pools;
    cfg.n_pools = n_pools;
    km_server *server = NULL;
    int rc = km_server_create(&cfg, &server, why, sizeof why);
    if (rc != KM_OK) {
        fprintf(stderr, "kvmatch serve: %s: %s\n", km_error_name(rc), why);
        km_server_config_json_free(owner);
        /* a setting the server refused is a configuration error; anything else failed to start */
        return rc == KM_ERR_INVALID_ARGUMENT || rc == KM_ERR_TOO_LARGE ? 2 : 1;
    }
    if (km_server_tcp_port(server))
        fprintf(stderr, "kvmatch serve: tcp port %u\n", km_server_tcp_port(server));
    if (km_server_http_port(server))
        fprintf(stderr, "kvmatch serve: http port %u\n", km_server_http_port(server));
    rc = km_server_run(server, true);
    km_server_destroy(server);
    km_server_config_json_free(owner);
    return rc == KM_OK ? 0 : 1;
}
