/* SPDX-License-Identifier: Apache-2.0 */
/* The service's configuration: defaults, policy parameters by name (shared by the JSON file and the
 * POOLS protocol message), and the JSON file reader (jansson). Format: docs/SERVICE.md. */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "base/error_detail.h"
#include "kvmatch/hash.h"
#include "kvmatch/server.h"
#include "kvmatch/subscriber.h"
#include "service/server_config.h"

void km_server_config_init(km_server_config *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    cfg->socket_path = KM_PROTOCOL_DEFAULT_SOCKET;
    cfg->snapshot_interval_ms = 60000;
    cfg->max_workers = 1024;
    cfg->backend = KM_BACKEND_AUTO;
    cfg->max_batch_routes = 512;
    cfg->inline_routes = 16;
    cfg->max_queued_routes = 65536;
    cfg->max_queue_wait_ms = 50;
    cfg->max_connection_routes = 4096;
    cfg->max_connections = 1024;
    cfg->max_outbox_bytes = (uint64_t)64 << 20;
    km_protocol_limits_init(&cfg->limits);
    km_kv_decoder_config_init(&cfg->kv_events);
    cfg->active_ttl_ms = 600000;
    cfg->max_active_entries = 1u << 20;
    cfg->max_active_bytes = UINT64_C(1) << 30;
    cfg->approx_dispatch_max_bytes = (uint64_t)64 << 20;
    cfg->breaker_failures = 5;
    cfg->breaker_cooldown_ms = 10000;
    cfg->ready_share = 1.0;
    cfg->drain_timeout_ms = 10000;
    cfg->frame_timeout_ms = 30000;
    cfg->stalled_reader_timeout_ms = 60000;
    cfg->seed = 0x6b766d;
    cfg->records_max_file_bytes = UINT64_C(256) << 20;
    cfg->records_keep_files = 8;
}

int km_server_policy_param(km_policy_config *p, const char *name, double value, char *why,
                           size_t why_size)
{
    if (!isfinite(value))
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT, "parameter %s is not a finite number",
                    name);
    if (!strcmp(name, "temperature"))
        p->kv.temperature = value;
    else if (!strcmp(name, "prefill_load_scale") || !strcmp(name, "overlap_score_weight"))
        p->kv.prefill_load_scale = value;
    else if (!strcmp(name, "device_weight"))
        p->kv.device_weight = value;
    else if (!strcmp(name, "host_weight"))
        p->kv.host_weight = value;
    else if (!strcmp(name, "disk_weight"))
        p->kv.disk_weight = value;
    else if (!strcmp(name, "cache_threshold"))
        p->cache_aware.cache_threshold = value;
    else if (!strcmp(name, "balance_abs_threshold")) {
        if (!(value >= 0 && value <= UINT32_MAX) || value != (double)(uint32_t)value)
            return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                        "balance_abs_threshold %g is not a whole number in [0, %u]", value,
                        UINT32_MAX);
        p->cache_aware.balance_abs_threshold = (uint32_t)value;
    } else if (!strcmp(name, "balance_rel_threshold"))
        p->cache_aware.balance_rel_threshold = value;
    else if (!strcmp(name, "prefix_weight"))
        p->llmd.prefix_weight = value;
    else if (!strcmp(name, "queue_weight"))
        p->llmd.queue_weight = value;
    else if (!strcmp(name, "kv_usage_weight"))
        p->llmd.kv_usage_weight = value;
    else if (!strcmp(name, "host_tier_weight"))
        p->llmd.host_tier_weight = value;
    else if (!strcmp(name, "exploit_ratio"))
        p->preble.exploit_ratio = value;
    else if (!strcmp(name, "load_bound"))
        p->ttft.load_bound = value;
    else if (!strcmp(name, "hot_prefix_sharers")) {
        if (!(value >= 0 && value <= UINT32_MAX) || value != (double)(uint32_t)value)
            return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                        "hot_prefix_sharers %g is not a whole number in [0, %u]", value,
                        UINT32_MAX);
        p->ttft.hot_prefix_sharers = (uint32_t)value;
    } else if (!strcmp(name, "hot_prefix_share"))
        p->ttft.hot_prefix_share = value;
    else if (!strcmp(name, "spread_ms"))
        p->ttft.spread_ms = value;
    else
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                    "unknown policy parameter \"%s\" (temperature, prefill_load_scale, "
                    "device_weight, host_weight, disk_weight, cache_threshold, "
                    "balance_abs_threshold, balance_rel_threshold, prefix_weight, queue_weight, "
                    "kv_usage_weight, host_tier_weight, exploit_ratio, load_bound, "
                    "hot_prefix_sharers, hot_prefix_share, spread_ms)",
                    name);
    return KM_OK;
}

const char *km_server_policy_param_owner(const char *name)
{
    static const struct {
        const char *name, *policy;
    } owners[] = {
        {"temperature", "kv"},           {"prefill_load_scale", "kv"},
        {"overlap_score_weight", "kv"},  {"device_weight", "kv"},
        {"host_weight", "kv"},           {"disk_weight", "kv"},
        {"cache_threshold", "cache_aware"}, {"balance_abs_threshold", "cache_aware"},
        {"balance_rel_threshold", "cache_aware"}, {"prefix_weight", "llmd"},
        {"queue_weight", "llmd"},        {"kv_usage_weight", "llmd"},
        {"host_tier_weight", "llmd"},    {"exploit_ratio", "preble"},
        {"load_bound", "ttft"},          {"hot_prefix_sharers", "ttft"},
        {"hot_prefix_share", "ttft"},    {"spread_ms", "ttft"},
    };
    for (size_t i = 0; name && i < sizeof owners / sizeof owners[0]; i++)
        if (!strcmp(owners[i].name, name))
            return owners[i].policy;
    return NULL;
}

bool km_server_name_valid(const char *name)
{
    size_t n = name ? strlen(name) : 0;
    if (n == 0 || n >= KM_SERVER_NAME_MAX)
        return false;
    for (size_t i = 0; i < n; i++) {
        char c = name[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '.' || c == '_' || c == '-'))
            return false;
    }
    return name[0] != '.';
}

/* ---- JSON ------------------------------------------------------------------------------------ */

struct km_server_config_json {
    json_t *root;
    km_server_pool *pools;
    uint32_t n_pools;
    km_server_worker **workers; /* per pool */
    char **strings;             /* endpoints made for data-parallel ranks */
    size_t n_strings, strings_capacity;
    /* Per worker id, where the file lists it: (pool + 1) << 32 | its entry in workers[]; 0 where
     * it lists none. Read only while the file is read. */
    uint64_t *listed_at;
};

/* Worker ids a file can name: an id up to KM_MAX_WORKERS_LIMIT - 1, then its dp_size ranks. */
#define LISTED_IDS (KM_MAX_WORKERS_LIMIT + 1024u)

void km_server_config_json_free(km_server_config_json *o)
{
    if (!o)
        return;
    if (o->workers)
        for (uint32_t i = 0; i < o->n_pools; i++)
            free(o->workers[i]);
    free(o->workers);
    free(o->pools);
    for (size_t i = 0; i < o->n_strings; i++)
        free(o->strings[i]);
    free(o->strings);
    free(o->listed_at);
    json_decref(o->root);
    free(o);
}

static const char *keep_string(km_server_config_json *o, const char *s)
{
    if (o->n_strings == o->strings_capacity) {
        size_t cap = o->strings_capacity ? o->strings_capacity * 2 : 16;
        char **grown = realloc(o->strings, cap * sizeof *grown);
        if (!grown)
            return NULL;
        o->strings = grown;
        o->strings_capacity = cap;
    }
    char *copy = strdup(s);
    if (copy)
        o->strings[o->n_strings++] = copy;
    return copy;
}

typedef struct reader {
    char *why;
    size_t why_size;
    int rc;
} reader;

/* Field readers: absent keeps *out; a wrong type sets r->rc (first error wins). */
static void get_string(reader *r, json_t *obj, const char *key, const char *where, const char **out)
{
    json_t *v = json_object_get(obj, key);
    if (!v || r->rc)
        return;
    if (json_is_null(v)) {
        *out = NULL;
        return;
    }
    if (!json_is_string(v)) {
        r->rc = km_why(r->why, r->why_size, KM_ERR_PARSE, "%s%s: expected a string", where, key);
        return;
    }
    *out = json_string_value(v);
}

/* A setting whose flag takes `none` for "off" (--socket, --records, --cluster): the config key
 * takes it too, as null does, so flag and key keep one meaning. */
static void get_string_or_none(reader *r, json_t *obj, const char *key, const char *where,
                               const char **out)
{
    get_string(r, obj, key, where, out);
    if (!r->rc && *out && json_object_get(obj, key) && !strcmp(*out, "none"))
        *out = NULL;
}

static void get_number(reader *r, json_t *obj, const char *key, const char *where, double lo,
                       double hi, double *out)
{
    json_t *v = json_object_get(obj, key);
    if (!v || r->rc)
        return;
    if (!json_is_number(v)) {
        r->rc = km_why(r->why, r->why_size, KM_ERR_PARSE, "%s%s: expected a number", where, key);
        return;
    }
    double d = json_number_value(v);
    if (!(d >= lo && d <= hi)) {
        r->rc = km_why(r->why, r->why_size, KM_ERR_INVALID_ARGUMENT, "%s%s: %g is outside %g..%g",
                     where, key, d, lo, hi);
        return;
    }
    *out = d;
}

static void get_u64(reader *r, json_t *obj, const char *key, const char *where, uint64_t lo,
                    uint64_t hi, uint64_t *out)
{
    json_t *v = json_object_get(obj, key);
    if (!v || r->rc)
        return;
    if (!json_is_integer(v) || json_integer_value(v) < 0) {
        r->rc = km_why(r->why, r->why_size, KM_ERR_PARSE, "%s%s: expected a non-negative integer",
                     where, key);
        return;
    }
    uint64_t x = (uint64_t)json_integer_value(v);
    if (x < lo || x > hi) {
        r->rc = km_why(r->why, r->why_size, KM_ERR_INVALID_ARGUMENT,
                     "%s%s: %llu is outside %llu..%llu", where, key, (unsigned long long)x,
                     (unsigned long long)lo, (unsigned long long)hi);
        return;
    }
    *out = x;
}

static void get_u32(reader *r, json_t *obj, const char *key, const char *where, uint32_t lo,
                    uint32_t hi, uint32_t *out)
{
    uint64_t x = *out;
    get_u64(r, obj, key, where, lo, hi, &x);
    *out = (uint32_t)x;
}

static void get_bool(reader *r, json_t *obj, const char *key, const char *where, bool *out)
{
    json_t *v = json_object_get(obj, key);
    if (!v || r->rc)
        return;
    if (!json_is_boolean(v)) {
        r->rc = km_why(r->why, r->why_size, KM_ERR_PARSE, "%s%s: expected true or false", where, key);
        return;
    }
    *out = json_is_true(v);
}

/* Every key of obj must be one of `known` (NULL-terminated): a misspelt key would otherwise be
 * ignored and its setting silently left at the default. */
static void check_keys(reader *r, json_t *obj, const char *where, const char *const *known)
{
    if (r->rc || !json_is_object(obj))
        return;
    const char *key;
    json_t *v;
    json_object_foreach(obj, key, v)
    {
        bool ok = false;
        for (const char *const *k = known; *k && !ok; k++)
            ok = !strcmp(*k, key);
        if (ok)
            continue;
        char list[600];
        size_t n = 0;
        list[0] = '\0';
        for (const char *const *k = known; *k && n < sizeof list; k++)
            n += (size_t)snprintf(list + n, sizeof list - n, "%s%s", k == known ? "" : ", ", *k);
        r->rc = km_why(r->why, r->why_size, KM_ERR_PARSE, "%s: unknown key \"%s\" (known: %s)",
                       where[0] ? where : "the top level", key, list);
        return;
    }
}

static void read_pool(reader *r, km_server_config_json *o, json_t *jp, uint32_t i)
{
    char where[96];
    snprintf(where, sizeof where, "pools[%u].", i);
    km_server_pool *p = &o->pools[i];
    km_policy_config_init(&p->policy);
    p->approx_ttl_ms = 120000;
    if (!json_is_object(jp)) {
        r->rc = km_why(r->why, r->why_size, KM_ERR_PARSE, "pools[%u]: expected an object", i);
        return;
    }
    static const char *const pool_keys[] = {"name",          "model",
                                            "block_size",    "hash_lookahead_tokens",
                                            "offload_chunk_blocks",
                                            "approx_ttl_ms", "approx_capacity_blocks",
                                            "policy",        "engine",
                                            "params",        "workers",
                                            NULL};
    char pool_where[96];
    snprintf(pool_where, sizeof pool_where, "pools[%u]", i);
    check_keys(r, jp, pool_where, pool_keys);
    get_string(r, jp, "name", where, &p->name);
    /* Applied entry by entry, a second entry of one pool would undo the first's workers. */
    for (uint32_t k = 0; !r->rc && p->name && k < i; k++)
        if (o->pools[k].name && !strcmp(o->pools[k].name, p->name))
            r->rc = km_why(r->why, r->why_size, KM_ERR_INVALID_ARGUMENT,
                           "%sname: pool %s is listed twice (pools[%u])", where, p->name, k);
    get_string(r, jp, "model", where, &p->model);
    get_u32(r, jp, "block_size", where, 1, 1u << 20, &p->block_size);
    /* Every pool names its engines' block size: nothing could stand in for it, at the start or
     * at a reload (where the pool's own would otherwise read as a change). */
    if (!r->rc && !json_object_get(jp, "block_size"))
        r->rc = km_why(r->why, r->why_size, KM_ERR_INVALID_ARGUMENT,
                       "%sblock_size is required (the engines' KV block size in tokens)", where);
    get_u32(r, jp, "hash_lookahead_tokens", where, 0, KM_HASH_MAX_LOOKAHEAD,
            &p->hash_lookahead_tokens);
    get_u32(r, jp, "offload_chunk_blocks", where, 1, KM_FEED_MAX_OFFLOAD_CHUNK_BLOCKS,
            &p->offload_chunk_blocks);
    get_u64(r, jp, "approx_ttl_ms", where, 1, UINT64_MAX / 1000000, &p->approx_ttl_ms);
    get_u64(r, jp, "approx_capacity_blocks", where, 0, UINT64_MAX, &p->approx_capacity_blocks);
    const char *policy = NULL;
    get_string(r, jp, "policy", where, &policy);
    if (!r->rc && policy && km_policy_kind_parse(policy, &p->policy.kind) != KM_OK)
        r->rc = km_why(r->why, r->why_size, KM_ERR_PARSE,
                     "%spolicy: unknown policy \"%s\" (kv, cache_aware, prefix, least_load, "
                     "round_robin, llmd, preble, ttft)",
                     where, policy);
    const char *engine = NULL;
    get_string(r, jp, "engine", where, &engine);
    if (!r->rc && engine && km_engine_model_preset(engine, &p->policy.engine) != KM_OK)
        r->rc = km_why(r->why, r->why_size, KM_ERR_PARSE,
                       "%sengine: unknown engine preset \"%s\" (kvmatch sim --help lists them)",
                       where, engine);
    json_t *params = json_object_get(jp, "params");
    if (!r->rc && params) {
        if (!json_is_object(params)) {
            r->rc = km_why(r->why, r->why_size, KM_ERR_PARSE, "%sparams: expected an object", where);
            return;
        }
        const char *key;
        json_t *v;
        json_object_foreach(params, key, v)
        {
            if (!json_is_number(v)) {
                r->rc = km_why(r->why, r->why_size, KM_ERR_PARSE, "%sparams.%s: expected a number",
                             where, key);
                return;
            }
            const char *owner = km_server_policy_param_owner(key);
            const char *kind = km_policy_kind_name(p->policy.kind);
            if (owner && strcmp(owner, kind) != 0) {
                r->rc = km_why(r->why, r->why_size, KM_ERR_INVALID_ARGUMENT,
                               "%sparams.%s: a parameter of policy %s; this pool's policy is %s",
                               where, key, owner, kind);
                return;
            }
            char detail[256];
            if (km_server_policy_param(&p->policy, key, json_number_value(v), detail,
                                       sizeof detail) != KM_OK) {
                r->rc = km_why(r->why, r->why_size, KM_ERR_INVALID_ARGUMENT, "%sparams: %s", where,
                             detail);
                return;
            }
        }
    }
    if (!r->rc && params) { /* each value may be valid alone and not together (ranges, sums) */
        char detail[256];
        if (km_policy_config_validate(&p->policy, detail, sizeof detail) != KM_OK)
            r->rc = km_why(r->why, r->why_size, KM_ERR_INVALID_ARGUMENT, "%sparams: %s", where,
                           detail);
    }
    json_t *workers = json_object_get(jp, "workers");
    if (r->rc || !workers)
        return;
    if (!json_is_array(workers)) {
        r->rc = km_why(r->why, r->why_size, KM_ERR_PARSE, "%sworkers: expected an array", where);
        return;
    }
    /* Count data-parallel ranks first: each becomes a worker. */
    size_t total = 0;
    for (size_t k = 0; k < json_array_size(workers); k++) {
        uint32_t dp = 1;
        char wwhere[128];
        snprintf(wwhere, sizeof wwhere, "%sworkers[%zu].", where, k);
        if (!json_is_object(json_array_get(workers, k))) {
            r->rc = km_why(r->why, r->why_size, KM_ERR_PARSE, "%sworkers[%zu]: expected an object",
                         where, k);
            return;
        }
        get_u32(r, json_array_get(workers, k), "dp_size", wwhere, 1, 1024, &dp);
        total += dp;
    }
    if (r->rc)
        return;
    km_server_worker *ws = calloc(total ? total : 1, sizeof *ws);
    if (!ws) {
        r->rc = km_why(r->why, r->why_size, KM_ERR_OUT_OF_MEMORY, "workers of pool %u", i);
        return;
    }
    o->workers[i] = ws;
    size_t n = 0;
    for (size_t k = 0; k < json_array_size(workers) && !r->rc; k++) {
        json_t *jw = json_array_get(workers, k);
        char wwhere[128];
        snprintf(wwhere, sizeof wwhere, "%sworkers[%zu].", where, k);
        km_server_worker base = {.id = UINT32_MAX};
        uint32_t dp = 1;
        uint64_t id = UINT64_MAX;
        static const char *const worker_keys[] = {"id",      "name",    "events", "replay",
                                                  "dp_size", "metrics", NULL};
        char worker_where[128];
        snprintf(worker_where, sizeof worker_where, "%sworkers[%zu]", where, k);
        check_keys(r, jw, worker_where, worker_keys);
        get_u64(r, jw, "id", wwhere, 0, KM_MAX_WORKERS_LIMIT - 1, &id);
        get_string(r, jw, "name", wwhere, &base.name);
        get_string(r, jw, "events", wwhere, &base.event_endpoint);
        get_string(r, jw, "replay", wwhere, &base.replay_endpoint);
        get_string(r, jw, "metrics", wwhere, &base.metrics_url);
        get_u32(r, jw, "dp_size", wwhere, 1, 1024, &dp);
        if (!r->rc && id == UINT64_MAX)
            r->rc = km_why(r->why, r->why_size, KM_ERR_PARSE, "%sid: required", wwhere);
        for (uint32_t rank = 0; rank < dp && !r->rc; rank++) {
            km_server_worker w = base;
            w.id = (uint32_t)id + rank;
            if (!o->listed_at && !(o->listed_at = calloc(LISTED_IDS, sizeof *o->listed_at))) {
                r->rc = km_why(r->why, r->why_size, KM_ERR_OUT_OF_MEMORY, "worker ids");
                break;
            }
            uint64_t at = ((uint64_t)i + 1) << 32 | k;
            uint64_t before = o->listed_at[w.id];
            if (before) {
                r->rc = km_why(r->why, r->why_size, KM_ERR_INVALID_ARGUMENT,
                               "%sworkers[%zu]: worker %u is listed twice (pools[%u].workers[%u])",
                               where, k, w.id, (uint32_t)(before >> 32) - 1, (uint32_t)before);
                break;
            }
            o->listed_at[w.id] = at;
            if (dp > 1) {
                w.has_dp_rank = true;
                w.dp_rank = rank;
                char buf[KM_SUBSCRIBER_ENDPOINT_MAX], name[KM_SERVER_NAME_MAX];
                int len = snprintf(name, sizeof name, "%s/dp%u", base.name ? base.name : "engine",
                                   rank);
                if (len < 0 || (size_t)len >= sizeof name) {
                    /* Cut short, the ranks' names would lose their /dp<r> and be one name. */
                    r->rc = km_why(r->why, r->why_size, KM_ERR_INVALID_ARGUMENT,
                                   "%sname: \"%s/dp%u\" is over %u bytes", wwhere,
                                   base.name ? base.name : "engine", rank, KM_SERVER_NAME_MAX - 1);
                    break;
                }
                w.name = keep_string(o, name);
                if (base.event_endpoint) {
                    if (km_endpoint_for_rank(base.event_endpoint, rank, buf, sizeof buf) != KM_OK)
                        r->rc = km_why(r->why, r->why_size, KM_ERR_INVALID_ARGUMENT,
                                     "%sevents: \"%s\" has no port for rank %u", wwhere,
                                     base.event_endpoint, rank);
                    else
                        w.event_endpoint = keep_string(o, buf);
                }
                if (!r->rc && base.replay_endpoint) {
                    if (km_endpoint_for_rank(base.replay_endpoint, rank, buf, sizeof buf) != KM_OK)
                        r->rc = km_why(r->why, r->why_size, KM_ERR_INVALID_ARGUMENT,
                                     "%sreplay: \"%s\" has no port for rank %u", wwhere,
                                     base.replay_endpoint, rank);
                    else
                        w.replay_endpoint = keep_string(o, buf);
                }
                if (!r->rc && (!w.name || (base.event_endpoint && !w.event_endpoint) ||
                               (base.replay_endpoint && !w.replay_endpoint)))
                    r->rc = km_why(r->why, r->why_size, KM_ERR_OUT_OF_MEMORY, "worker strings");
            }
            ws[n++] = w;
        }
    }
    p->workers = ws;
    p->n_workers = (uint32_t)n;
}

int km_server_config_load_json(const char *path, km_server_config *target, km_server_config_json **out,
                               char *why, size_t why_size)
{
    if (!path || !target || !out)
        return km_why(why, why_size, KM_ERR_NULL_POINTER, "path, cfg or owner is NULL");
    *out = NULL;
    /* Read into a copy: on an error the caller's config is left as it was (the strings a half
     * read would leave in it belong to the JSON freed below). */
    km_server_config loaded = *target;
    km_server_config *cfg = &loaded;
    json_error_t jerr;
    json_t *root = json_load_file(path, JSON_REJECT_DUPLICATES, &jerr);
    if (!root) {
        FILE *f = fopen(path, "r");
        if (!f)
            return km_why(why, why_size, KM_ERR_IO, "%s: %s", path, strerror(errno));
        fclose(f);
        return km_why(why, why_size, KM_ERR_PARSE, "%s:%d:%d: %s", path, jerr.line, jerr.column,
                    jerr.text);
    }
    if (!json_is_object(root)) {
        json_decref(root);
        return km_why(why, why_size, KM_ERR_PARSE, "%s: the top level must be an object", path);
    }
    km_server_config_json *o = calloc(1, sizeof *o);
    if (!o) {
        json_decref(root);
        return km_why(why, why_size, KM_ERR_OUT_OF_MEMORY, "config");
    }
    o->root = root;
    reader r = {why, why_size, KM_OK};
    static const char *const top_keys[] = {
        "socket", "tcp", "http", "allow_non_loopback", "default_pool", "max_connections",
        "max_outbox_bytes", "active_ttl_ms", "max_active_entries", "max_active_bytes", "approx_dispatch_max_bytes",
        "breaker_failures", "breaker_cooldown_ms", "ready_share", "drain_timeout_ms", "seed",
        "frame_timeout_ms", "stalled_reader_timeout_ms",
        "records", "snapshot", "index", "scheduler", "limits", "kv_events", "cluster",
        "engine_metrics", "pools", NULL};
    static const char *const records_keys[] = {"path",           "max_file_bytes", "keep_files",
                                               "max_kept_bytes", "max_age_s",      NULL};
    static const char *const snapshot_keys[] = {"dir", "interval_ms", NULL};
    static const char *const cluster_keys[] = {"url", "instance", "subject", "heartbeat_ms",
                                               "expire_ms", "sync_timeout_ms", "sync_quiet_ms",
                                               NULL};
    static const char *const engine_metrics_keys[] = {"interval_ms", "timeout_ms", "max_age_ms",
                                                      NULL};
    static const char *const index_keys[] = {"max_workers", "threads", "memory_cap_bytes",
                                             "initial_blocks", "backend", NULL};
    static const char *const scheduler_keys[] = {"max_batch_routes",  "max_queued_routes",
                                                 "max_queue_wait_ms", "max_connection_routes",
                                                 "inline_routes",     NULL};
    static const char *const limits_keys[] = {"max_frame_bytes", "max_objects", "max_batch_items",
                                              "max_tokens_per_route", "max_hashes_per_route",
                                              "max_candidates", "max_string_bytes", NULL};
    check_keys(&r, root, "", top_keys);
    if (json_is_object(json_object_get(root, "records")))
        check_keys(&r, json_object_get(root, "records"), "records", records_keys);
    check_keys(&r, json_object_get(root, "snapshot"), "snapshot", snapshot_keys);
    check_keys(&r, json_object_get(root, "cluster"), "cluster", cluster_keys);
    check_keys(&r, json_object_get(root, "engine_metrics"), "engine_metrics", engine_metrics_keys);
    check_keys(&r, json_object_get(root, "index"), "index", index_keys);
    check_keys(&r, json_object_get(root, "scheduler"), "scheduler", scheduler_keys);
    check_keys(&r, json_object_get(root, "limits"), "limits", limits_keys);
    static const char *const kv_events_keys[] = {
        "max_payload_bytes",    "max_payload_objects",  "max_events_per_batch",
        "max_hashes_per_event", "max_tokens_per_event", "max_string_bytes", NULL};
    check_keys(&r, json_object_get(root, "kv_events"), "kv_events", kv_events_keys);
    get_string_or_none(&r, root, "socket", "", &cfg->socket_path);
    get_string(&r, root, "tcp", "", &cfg->tcp);
    get_string(&r, root, "http", "", &cfg->http);
    get_bool(&r, root, "allow_non_loopback", "", &cfg->allow_non_loopback);
    get_string(&r, root, "default_pool", "", &cfg->default_pool);
    get_u32(&r, root, "max_connections", "", 1, 1u << 20, &cfg->max_connections);
    get_u64(&r, root, "max_outbox_bytes", "", 4096, KM_SERVER_MAX_OUTBOX_BYTES_LIMIT,
            &cfg->max_outbox_bytes);
    get_u64(&r, root, "active_ttl_ms", "", 1, UINT64_MAX / 1000000, &cfg->active_ttl_ms);
    get_u32(&r, root, "max_active_entries", "", 1, (1u << 31) - 1, &cfg->max_active_entries);
    get_u64(&r, root, "max_active_bytes", "", 0, UINT64_MAX, &cfg->max_active_bytes);
    get_u64(&r, root, "approx_dispatch_max_bytes", "", 0, UINT64_MAX, &cfg->approx_dispatch_max_bytes);
    get_u32(&r, root, "breaker_failures", "", 0, 1u << 20, &cfg->breaker_failures);
    get_u64(&r, root, "breaker_cooldown_ms", "", 1, UINT64_MAX / 1000000, &cfg->breaker_cooldown_ms);
    get_number(&r, root, "ready_share", "", 0.0, 1.0, &cfg->ready_share);
    get_u32(&r, root, "drain_timeout_ms", "", 0, 3600000, &cfg->drain_timeout_ms);
    get_u32(&r, root, "frame_timeout_ms", "", 1, 3600000, &cfg->frame_timeout_ms);
    get_u32(&r, root, "stalled_reader_timeout_ms", "", 1, 3600000,
            &cfg->stalled_reader_timeout_ms);
    get_u64(&r, root, "seed", "", 0, UINT64_MAX, &cfg->seed);
    json_t *rec = json_object_get(root, "records");
    if (rec && !r.rc) {
        if (json_is_string(rec) || json_is_null(rec))
            get_string_or_none(&r, root, "records", "", &cfg->records_path);
        else if (json_is_object(rec)) {
            get_string_or_none(&r, rec, "path", "records.", &cfg->records_path);
            get_u64(&r, rec, "max_file_bytes", "records.", 0, UINT64_MAX,
                    &cfg->records_max_file_bytes);
            get_u32(&r, rec, "keep_files", "records.", 0, 1u << 20, &cfg->records_keep_files);
            get_u64(&r, rec, "max_kept_bytes", "records.", 0, UINT64_MAX,
                    &cfg->records_max_kept_bytes);
            get_u64(&r, rec, "max_age_s", "records.", 0, UINT64_MAX, &cfg->records_max_age_s);
        } else
            r.rc = km_why(why, why_size, KM_ERR_PARSE, "records: expected a path or an object");
    }
    json_t *snap = json_object_get(root, "snapshot");
    if (snap && !r.rc) {
        if (!json_is_object(snap))
            r.rc = km_why(why, why_size, KM_ERR_PARSE, "snapshot: expected an object");
        get_string(&r, snap, "dir", "snapshot.", &cfg->snapshot_dir);
        get_u32(&r, snap, "interval_ms", "snapshot.", 0, UINT32_MAX, &cfg->snapshot_interval_ms);
    }
    json_t *clu = json_object_get(root, "cluster");
    if (clu && !r.rc) {
        if (!json_is_object(clu))
            r.rc = km_why(why, why_size, KM_ERR_PARSE, "cluster: expected an object");
        get_string_or_none(&r, clu, "url", "cluster.", &cfg->cluster_url);
        get_string(&r, clu, "instance", "cluster.", &cfg->cluster_instance);
        get_string(&r, clu, "subject", "cluster.", &cfg->cluster_subject);
        get_u32(&r, clu, "heartbeat_ms", "cluster.", 10, 600000, &cfg->cluster_heartbeat_ms);
        get_u32(&r, clu, "expire_ms", "cluster.", 20, 3600000, &cfg->cluster_expire_ms);
        get_u32(&r, clu, "sync_timeout_ms", "cluster.", 1, 600000, &cfg->cluster_sync_timeout_ms);
        /* At least twice the peers' sync_answer_ms (20): an answer due then still arrives. */
        get_u32(&r, clu, "sync_quiet_ms", "cluster.", 40, 600000, &cfg->cluster_sync_quiet_ms);
    }
    json_t *em = json_object_get(root, "engine_metrics");
    if (em && !r.rc) {
        if (!json_is_object(em))
            r.rc = km_why(why, why_size, KM_ERR_PARSE, "engine_metrics: expected an object");
        get_u32(&r, em, "interval_ms", "engine_metrics.", 10, 3600000,
                &cfg->engine_metrics_interval_ms);
        get_u32(&r, em, "timeout_ms", "engine_metrics.", 1, 600000, &cfg->engine_metrics_timeout_ms);
        get_u32(&r, em, "max_age_ms", "engine_metrics.", 1, 3600000,
                &cfg->engine_metrics_max_age_ms);
    }
    json_t *idx = json_object_get(root, "index");
    if (idx && !r.rc) {
        if (!json_is_object(idx))
            r.rc = km_why(why, why_size, KM_ERR_PARSE, "index: expected an object");
        get_u32(&r, idx, "max_workers", "index.", 1, KM_MAX_WORKERS_LIMIT, &cfg->max_workers);
        get_u32(&r, idx, "threads", "index.", 0, 1024, &cfg->index_threads);
        get_u64(&r, idx, "memory_cap_bytes", "index.", 0, UINT64_MAX, &cfg->index_memory_cap_bytes);
        get_u64(&r, idx, "initial_blocks", "index.", 0, UINT64_C(1) << 36,
                &cfg->index_initial_blocks);
        const char *backend = NULL;
        get_string(&r, idx, "backend", "index.", &backend);
        if (!r.rc && backend) {
            if (!strcmp(backend, "auto"))
                cfg->backend = KM_BACKEND_AUTO;
            else if (!strcmp(backend, "cpu"))
                cfg->backend = KM_BACKEND_CPU;
            else if (!strcmp(backend, "cuda"))
                cfg->backend = KM_BACKEND_CUDA;
            else
                r.rc = km_why(why, why_size, KM_ERR_PARSE,
                            "index.backend: \"%s\" is not auto, cpu or cuda", backend);
        }
    }
    json_t *sched = json_object_get(root, "scheduler");
    if (sched && !r.rc) {
        if (!json_is_object(sched))
            r.rc = km_why(why, why_size, KM_ERR_PARSE, "scheduler: expected an object");
        get_u32(&r, sched, "max_batch_routes", "scheduler.", 1, 1u << 20, &cfg->max_batch_routes);
        get_u32(&r, sched, "max_queued_routes", "scheduler.", 1, 1u << 24, &cfg->max_queued_routes);
        get_u32(&r, sched, "max_queue_wait_ms", "scheduler.", 0, 3600000, &cfg->max_queue_wait_ms);
        get_u32(&r, sched, "max_connection_routes", "scheduler.", 0, 1u << 24,
                &cfg->max_connection_routes);
        get_u32(&r, sched, "inline_routes", "scheduler.", 0, 1u << 20, &cfg->inline_routes);
    }
    json_t *lim = json_object_get(root, "limits");
    if (lim && !r.rc) {
        if (!json_is_object(lim))
            r.rc = km_why(why, why_size, KM_ERR_PARSE, "limits: expected an object");
        km_protocol_limits *l = &cfg->limits;
        get_u32(&r, lim, "max_frame_bytes", "limits.", KM_SERVER_MIN_FRAME_BYTES, UINT32_MAX,
                &l->max_frame_bytes);
        get_u32(&r, lim, "max_objects", "limits.", 16, UINT32_MAX, &l->max_objects);
        get_u32(&r, lim, "max_batch_items", "limits.", 1, UINT32_MAX, &l->max_batch_items);
        get_u32(&r, lim, "max_tokens_per_route", "limits.", 1, UINT32_MAX, &l->max_tokens_per_route);
        get_u32(&r, lim, "max_hashes_per_route", "limits.", 1, UINT32_MAX, &l->max_hashes_per_route);
        get_u32(&r, lim, "max_candidates", "limits.", 1, UINT32_MAX, &l->max_candidates);
        get_u32(&r, lim, "max_string_bytes", "limits.", 16, UINT32_MAX, &l->max_string_bytes);
    }
    json_t *kve = json_object_get(root, "kv_events");
    if (kve && !r.rc) {
        if (!json_is_object(kve))
            r.rc = km_why(why, why_size, KM_ERR_PARSE, "kv_events: expected an object");
        km_kv_decoder_config *d = &cfg->kv_events;
        get_u64(&r, kve, "max_payload_bytes", "kv_events.", 1, UINT32_MAX, &d->max_payload_bytes);
        get_u32(&r, kve, "max_payload_objects", "kv_events.", 1, UINT32_MAX,
                &d->max_payload_objects);
        get_u32(&r, kve, "max_events_per_batch", "kv_events.", 1, UINT32_MAX,
                &d->max_events_per_batch);
        get_u32(&r, kve, "max_hashes_per_event", "kv_events.", 1, UINT32_MAX,
                &d->max_hashes_per_event);
        get_u32(&r, kve, "max_tokens_per_event", "kv_events.", 1, UINT32_MAX,
                &d->max_tokens_per_event);
        get_u32(&r, kve, "max_string_bytes", "kv_events.", 1, UINT32_MAX, &d->max_string_bytes);
    }
    json_t *pools = json_object_get(root, "pools");
    if (pools && !r.rc) {
        if (!json_is_array(pools) || json_array_size(pools) > 4096) {
            r.rc = km_why(why, why_size, KM_ERR_PARSE, "pools: expected an array (at most 4096)");
        } else {
            o->n_pools = (uint32_t)json_array_size(pools);
            o->pools = calloc(o->n_pools ? o->n_pools : 1, sizeof *o->pools);
            o->workers = calloc(o->n_pools ? o->n_pools : 1, sizeof *o->workers);
            if (!o->pools || !o->workers)
                r.rc = km_why(why, why_size, KM_ERR_OUT_OF_MEMORY, "pools");
            for (uint32_t i = 0; i < o->n_pools && !r.rc; i++)
                read_pool(&r, o, json_array_get(pools, i), i);
            cfg->pools = o->pools;
            cfg->n_pools = o->n_pools;
        }
    }
    if (r.rc) {
        km_server_config_json_free(o);
        return r.rc;
    }
    free(o->listed_at);
    o->listed_at = NULL;
    *target = loaded;
    *out = o;
    return KM_OK;
}
