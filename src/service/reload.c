/* SPDX-License-Identifier: Apache-2.0 */
/* km_server_reload (include/kvmatch/server.h): apply what a configuration may change at run time
 * (pools, their policies and parameters, their workers) on the loop thread under admin_lock, and
 * log every change and every setting that only a restart applies. */
#include <inttypes.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/error_detail.h"
#include "base/utf8.h"
#include "service/server_internal.h"

static bool same_string(const char *a, const char *b)
{
    return (!a && !b) || (a && b && !strcmp(a, b));
}

/* What of the live worker differs from worker w of the file for pool pool_index. */
typedef enum worker_change {
    WORKER_SAME = 0,
    WORKER_ENDPOINTS = 1 << 0, /* another pool or other event endpoints: removed and added again */
    WORKER_NAME = 1 << 1,      /* its name (subscriber, records, /metrics labels): the same */
    WORKER_METRICS = 1 << 2,   /* its engine's metrics URL: changed in place */
    WORKER_DP_RANK = 1 << 3,   /* its data-parallel rank: changed in place */
} worker_change;

static unsigned worker_changes(const km_server *s, uint32_t pool_index, const km_server_worker *w)
{
    const worker_slot *slot = &s->workers[w->id];
    unsigned c = WORKER_SAME;
    if (!slot->used || slot->pool != pool_index ||
        !same_string(slot->event_endpoint, w->event_endpoint) ||
        !same_string(slot->replay_endpoint, w->replay_endpoint))
        return WORKER_ENDPOINTS;
    char name[KM_SERVER_NAME_MAX];
    if (w->name)
        snprintf(name, sizeof name, "%s", w->name);
    else
        snprintf(name, sizeof name, "w%u", w->id);
    if (strcmp(slot->name, name) != 0 || (w->name && strlen(w->name) >= sizeof name))
        c |= WORKER_NAME;
    if (!same_string(slot->metrics_url, w->metrics_url))
        c |= WORKER_METRICS;
    if (slot->has_dp_rank != w->has_dp_rank || (w->has_dp_rank && slot->dp_rank != w->dp_rank))
        c |= WORKER_DP_RANK;
    return c;
}

/* The file's entry for worker id in pool pc; NULL when not listed. */
static const km_server_worker *listed_worker(const km_server_pool *pc, uint32_t id)
{
    for (uint32_t k = 0; k < pc->n_workers; k++)
        if (pc->workers[k].id == id)
            return &pc->workers[k];
    return NULL;
}

/* A setting of km_server_config only a restart applies, by its name in the configuration file. */
typedef struct restart_only {
    const char *name;
    size_t offset, size;
    bool string; /* a const char * (NULL = absent), compared by content */
} restart_only;

#define KM_RELOAD_FIELD(member, name)                                                           \
    {name, offsetof(km_server_config, member), sizeof(((km_server_config *)0)->member), false}
#define KM_RELOAD_STRING(member, name)                                                          \
    {name, offsetof(km_server_config, member), sizeof(const char *), true}

/* Every field of km_server_config but the pools (applied), the log and the hangup callback (the
 * program's own). */
static const restart_only RESTART_ONLY[] = {
    KM_RELOAD_STRING(socket_path, "socket"),
    KM_RELOAD_STRING(tcp, "tcp"),
    KM_RELOAD_STRING(http, "http"),
    KM_RELOAD_FIELD(allow_non_loopback, "allow_non_loopback"),
    KM_RELOAD_STRING(records_path, "records"),
    KM_RELOAD_FIELD(records_max_file_bytes, "records.max_file_bytes"),
    KM_RELOAD_FIELD(records_keep_files, "records.keep_files"),
    KM_RELOAD_FIELD(records_max_kept_bytes, "records.max_kept_bytes"),
    KM_RELOAD_FIELD(records_max_age_s, "records.max_age_s"),
    KM_RELOAD_STRING(snapshot_dir, "snapshot.dir"),
    KM_RELOAD_FIELD(snapshot_interval_ms, "snapshot.interval_ms"),
    KM_RELOAD_STRING(cluster_url, "cluster.url"),
    KM_RELOAD_STRING(cluster_instance, "cluster.instance"),
    KM_RELOAD_STRING(cluster_subject, "cluster.subject"),
    KM_RELOAD_FIELD(cluster_heartbeat_ms, "cluster.heartbeat_ms"),
    KM_RELOAD_FIELD(cluster_expire_ms, "cluster.expire_ms"),
    KM_RELOAD_FIELD(cluster_sync_timeout_ms, "cluster.sync_timeout_ms"),
    KM_RELOAD_FIELD(cluster_sync_quiet_ms, "cluster.sync_quiet_ms"),
    KM_RELOAD_FIELD(engine_metrics_interval_ms, "engine_metrics.interval_ms"),
    KM_RELOAD_FIELD(engine_metrics_timeout_ms, "engine_metrics.timeout_ms"),
    KM_RELOAD_FIELD(engine_metrics_max_age_ms, "engine_metrics.max_age_ms"),
    KM_RELOAD_FIELD(max_workers, "index.max_workers"),
    KM_RELOAD_FIELD(backend, "index.backend"),
    KM_RELOAD_FIELD(index_threads, "index.threads"),
    KM_RELOAD_FIELD(index_memory_cap_bytes, "index.memory_cap_bytes"),
    KM_RELOAD_FIELD(index_initial_blocks, "index.initial_blocks"),
    KM_RELOAD_FIELD(max_batch_routes, "scheduler.max_batch_routes"),
    KM_RELOAD_FIELD(inline_routes, "scheduler.inline_routes"),
    KM_RELOAD_FIELD(max_queued_routes, "scheduler.max_queued_routes"),
    KM_RELOAD_FIELD(max_queue_wait_ms, "scheduler.max_queue_wait_ms"),
    KM_RELOAD_FIELD(max_connection_routes, "scheduler.max_connection_routes"),
    KM_RELOAD_FIELD(max_connections, "max_connections"),
    KM_RELOAD_FIELD(max_outbox_bytes, "max_outbox_bytes"),
    KM_RELOAD_FIELD(limits.max_frame_bytes, "limits.max_frame_bytes"),
    KM_RELOAD_FIELD(limits.max_objects, "limits.max_objects"),
    KM_RELOAD_FIELD(limits.max_batch_items, "limits.max_batch_items"),
    KM_RELOAD_FIELD(limits.max_tokens_per_route, "limits.max_tokens_per_route"),
    KM_RELOAD_FIELD(limits.max_hashes_per_route, "limits.max_hashes_per_route"),
    KM_RELOAD_FIELD(limits.max_candidates, "limits.max_candidates"),
    KM_RELOAD_FIELD(limits.max_params, "limits.max_params"),
    KM_RELOAD_FIELD(limits.max_string_bytes, "limits.max_string_bytes"),
    KM_RELOAD_FIELD(kv_events.max_payload_bytes, "kv_events.max_payload_bytes"),
    KM_RELOAD_FIELD(kv_events.max_payload_objects, "kv_events.max_payload_objects"),
    KM_RELOAD_FIELD(kv_events.max_events_per_batch, "kv_events.max_events_per_batch"),
    KM_RELOAD_FIELD(kv_events.max_hashes_per_event, "kv_events.max_hashes_per_event"),
    KM_RELOAD_FIELD(kv_events.max_tokens_per_event, "kv_events.max_tokens_per_event"),
    KM_RELOAD_FIELD(kv_events.max_string_bytes, "kv_events.max_string_bytes"),
    KM_RELOAD_FIELD(active_ttl_ms, "active_ttl_ms"),
    KM_RELOAD_FIELD(max_active_entries, "max_active_entries"),
    KM_RELOAD_FIELD(max_active_bytes, "max_active_bytes"),
    KM_RELOAD_FIELD(approx_dispatch_max_bytes, "approx_dispatch_max_bytes"),
    KM_RELOAD_FIELD(breaker_failures, "breaker_failures"),
    KM_RELOAD_FIELD(breaker_cooldown_ms, "breaker_cooldown_ms"),
    KM_RELOAD_FIELD(ready_share, "ready_share"),
    KM_RELOAD_FIELD(drain_timeout_ms, "drain_timeout_ms"),
    KM_RELOAD_FIELD(frame_timeout_ms, "frame_timeout_ms"),
    KM_RELOAD_FIELD(stalled_reader_timeout_ms, "stalled_reader_timeout_ms"),
    KM_RELOAD_FIELD(seed, "seed"),
    KM_RELOAD_STRING(default_pool, "default_pool"),
};
#undef KM_RELOAD_FIELD
#undef KM_RELOAD_STRING

/* The settings only a restart applies: each that differs is logged, none is changed. */
static void note_restart_only(km_server *s, const km_server_config *n)
{
    const char *live = (const char *)&s->cfg, *file = (const char *)n;
    for (size_t i = 0; i < sizeof RESTART_ONLY / sizeof RESTART_ONLY[0]; i++) {
        const restart_only *f = &RESTART_ONLY[i];
        bool same;
        if (f->string) {
            const char *a, *b;
            memcpy(&a, live + f->offset, sizeof a);
            memcpy(&b, file + f->offset, sizeof b);
            same = same_string(a, b);
        } else {
            same = memcmp(live + f->offset, file + f->offset, f->size) == 0;
        }
        if (!same)
            km_srv_log(s, KM_LOG_WARNING
                       "reload: %s changed in the file; it takes effect at restart", f->name);
    }
}

/* A listed pool's settings fixed for its life (its approximate mode's TTL and capacity, defaults
 * applied): each that differs is logged, none is changed. */
static void note_pool_restart_only(km_server *s, const pool *p, const km_server_pool *pc)
{
    uint64_t ttl_ms, capacity;
    km_srv_pool_approx_params(pc, &ttl_ms, &capacity);
    if (ttl_ms != p->approx_ttl_ms)
        km_srv_log(s, KM_LOG_WARNING "reload: pool %s: approx_ttl_ms changed in the file (%" PRIu64
                   " -> %" PRIu64 "); it takes effect at restart", p->name, p->approx_ttl_ms,
                   ttl_ms);
    if (capacity != p->approx_capacity_blocks)
        km_srv_log(s, KM_LOG_WARNING "reload: pool %s: approx_capacity_blocks changed in the file "
                   "(%" PRIu64 " -> %" PRIu64 "); it takes effect at restart", p->name,
                   p->approx_capacity_blocks, capacity);
}

/* The first pool of the file that lists worker id among those this reload accepted (accepted:
 * pool_at >= 0) or refused (pool_at -1); NULL if none. *entry gets its entry for the worker. */
static const km_server_pool *pool_listing(const km_server_config *n, const int *pool_at,
                                          uint32_t id, bool accepted,
                                          const km_server_worker **entry)
{
    for (uint32_t i = 0; i < n->n_pools; i++) {
        const km_server_worker *w = (pool_at[i] >= 0) == accepted
                                        ? listed_worker(&n->pools[i], id) : NULL;
        if (w) {
            *entry = w;
            return &n->pools[i];
        }
    }
    *entry = NULL;
    return NULL;
}

typedef struct listed_id {
    uint32_t id, pool; /* a worker id and the index of the pool whose entry lists it */
} listed_id;

static int listed_id_cmp(const void *a, const void *b)
{
    const listed_id *x = a, *y = b;
    if (x->id != y->id)
        return x->id < y->id ? -1 : 1;
    return x->pool < y->pool ? -1 : x->pool > y->pool;
}

/* KM_OK when n lists each pool name, each model and each worker id once, as km_server_create
 * requires; else KM_ERR_INVALID_ARGUMENT (KM_ERR_OUT_OF_MEMORY) with why naming the first listed
 * twice. Applied
 * entry by entry, a second entry of a pool would remove the workers the first lists, and the
 * first would add them again without their index state and active work. */
static int check_listed_once(const km_server_config *n, char *why, size_t why_size)
{
    size_t total = 0;
    for (uint32_t i = 0; i < n->n_pools; i++) {
        const char *name = n->pools[i].name ? n->pools[i].name : "";
        for (uint32_t k = 0; k < i; k++)
            if (!strcmp(n->pools[k].name ? n->pools[k].name : "", name))
                return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                              "pool %s is listed twice", name);
        const char *model = n->pools[i].model;
        for (uint32_t k = 0; model && k < i; k++)
            if (n->pools[k].model && !strcmp(n->pools[k].model, model))
                return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                              "model %s is listed for pools %s and %s (a route naming a model "
                              "reaches one pool)", model, n->pools[k].name ? n->pools[k].name : "",
                              name);
        total += n->pools[i].n_workers;
    }
    if (!total)
        return KM_OK;
    listed_id *ids = malloc(total * sizeof *ids);
    if (!ids)
        return km_why(why, why_size, KM_ERR_OUT_OF_MEMORY, "out of memory");
    size_t m = 0;
    for (uint32_t i = 0; i < n->n_pools; i++)
        for (uint32_t k = 0; k < n->pools[i].n_workers; k++)
            ids[m++] = (listed_id){n->pools[i].workers[k].id, i};
    qsort(ids, m, sizeof *ids, listed_id_cmp);
    int rc = KM_OK;
    for (size_t j = 1; j < m && rc == KM_OK; j++)
        if (ids[j].id == ids[j - 1].id) {
            const char *a = n->pools[ids[j - 1].pool].name, *b = n->pools[ids[j].pool].name;
            rc = ids[j].pool == ids[j - 1].pool
                     ? km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                              "worker %u is listed twice (pool %s)", ids[j].id, a ? a : "")
                     : km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                              "worker %u is listed twice (pools %s and %s)", ids[j].id,
                              a ? a : "", b ? b : "");
        }
    free(ids);
    return rc;
}

/* The pool other than `except` that serves `model` and keeps serving it through this reload (one
 * the file does not list keeps its model; a listed one takes the file's, which check_listed_once
 * found to be no other listed pool's): its index in s->pools, or -1. */
static int model_kept_by_another(const km_server *s, const km_server_config *n, const char *model,
                                 int except)
{
    int at = km_srv_pool_serving_model(s, model, except);
    for (uint32_t i = 0; at >= 0 && i < n->n_pools; i++)
        if (n->pools[i].name && !strcmp(n->pools[i].name, s->pools[at]->name))
            return -1;
    return at;
}

int km_server_reload(km_server *s, const km_server_config *n)
{
    if (!s || !n)
        return KM_ERR_NULL_POINTER;
    int first_error = KM_OK;
    char why[256];
    int listed = check_listed_once(n, why, sizeof why);
    if (listed != KM_OK) {
        km_srv_log(s, KM_LOG_WARNING "reload refused, nothing changed: %s", why);
        return listed;
    }
    /* Each listed pool's index in s->pools, -1 where the pool was refused. */
    int *pool_at = n->n_pools ? calloc(n->n_pools, sizeof *pool_at) : NULL;
    if (n->n_pools && !pool_at) {
        km_srv_log(s, KM_LOG_ERROR "reload refused, nothing changed: out of memory");
        return KM_ERR_OUT_OF_MEMORY;
    }
    note_restart_only(s, n);
    pthread_mutex_lock(&s->admin_lock);
    uint32_t changes = 0;
    for (uint32_t i = 0; i < n->n_pools; i++) {
        const km_server_pool *pc = &n->pools[i];
        int at = km_srv_pool_find(s, pc->name ? pc->name : "");
        pool_at[i] = -1;
        char detail[192];
        if (at < 0) {
            pool *np = NULL;
            int kept = model_kept_by_another(s, n, pc->model, -1);
            int rc = s->n_pools >= MAX_POOLS
                         ? km_why(why, sizeof why, KM_ERR_TOO_LARGE, "at most %u pools", MAX_POOLS)
                     : kept >= 0
                         ? km_why(why, sizeof why, KM_ERR_INVALID_ARGUMENT,
                                  "model %s is served by pool %s already (a route naming a model "
                                  "reaches one pool)", pc->model, s->pools[kept]->name)
                         : km_srv_pool_create(s, pc, &np, why, sizeof why);
            if (rc != KM_OK) {
                km_srv_log(s, KM_LOG_WARNING
                           "reload: pool %s refused: %s", pc->name ? pc->name : "", why);
                first_error = first_error ? first_error : rc;
                continue;
            }
            s->pools[s->n_pools++] = np;
            at = (int)s->n_pools - 1;
            km_srv_log(s, KM_LOG_INFO "reload: pool %s added (policy %s)", pc->name,
                       km_policy_kind_name(pc->policy.kind));
            changes++;
        } else {
            pool *p = s->pools[at];
            if (pc->block_size != p->block_size) {
                km_srv_log(s, KM_LOG_WARNING
                           "reload: pool %s refused: block_size cannot change (the index is "
                           "hashed with %u)", pc->name, p->block_size);
                first_error = first_error ? first_error : KM_ERR_INVALID_ARGUMENT;
                continue;
            }
            if (pc->hash_lookahead_tokens != p->hash_lookahead_tokens) {
                /* The pool's chains are hashed with its lookahead tokens. */
                km_srv_log(s, KM_LOG_WARNING
                           "reload: pool %s refused: hash_lookahead_tokens cannot change (the "
                           "index is hashed with %u)", pc->name, p->hash_lookahead_tokens);
                first_error = first_error ? first_error : KM_ERR_INVALID_ARGUMENT;
                continue;
            }
            uint32_t chunk_blocks = pc->offload_chunk_blocks ? pc->offload_chunk_blocks : 1;
            if (chunk_blocks != p->offload_chunk_blocks) {
                /* Placeholder chunks held now were placed with the old size: their removals must
                 * walk the same blocks. */
                km_srv_log(s, KM_LOG_WARNING
                           "reload: pool %s refused: offload_chunk_blocks cannot change (chunks "
                           "are held with %u)", pc->name, p->offload_chunk_blocks);
                first_error = first_error ? first_error : KM_ERR_INVALID_ARGUMENT;
                continue;
            }
            if (km_srv_pool_engine_check(p, &pc->policy.engine, why, sizeof why) != KM_OK) {
                km_srv_log(s, KM_LOG_WARNING "reload: pool %s refused: %s", pc->name, why);
                first_error = first_error ? first_error : KM_ERR_INVALID_ARGUMENT;
                continue;
            }
            if (km_policy_config_validate(&pc->policy, detail, sizeof detail) != KM_OK) {
                km_srv_log(s, KM_LOG_WARNING "reload: pool %s refused: %s", pc->name, detail);
                first_error = first_error ? first_error : KM_ERR_INVALID_ARGUMENT;
                continue;
            }
            /* The model is checked as km_srv_pool_create and POOLS update check it, and copied
             * before anything of the pool changes: the pool takes the file's entry whole or is
             * refused whole. */
            bool model_changes = !same_string(p->model, pc->model);
            if (model_changes && pc->model && !km_utf8_name(pc->model)) {
                km_srv_log(s, KM_LOG_WARNING "reload: pool %s refused: model must be UTF-8 "
                           "without control characters", pc->name);
                first_error = first_error ? first_error : KM_ERR_INVALID_ARGUMENT;
                continue;
            }
            int kept = model_changes ? model_kept_by_another(s, n, pc->model, at) : -1;
            if (kept >= 0) {
                km_srv_log(s, KM_LOG_WARNING "reload: pool %s refused: model %s is served by pool "
                           "%s already (a route naming a model reaches one pool)", pc->name,
                           pc->model, s->pools[kept]->name);
                first_error = first_error ? first_error : KM_ERR_INVALID_ARGUMENT;
                continue;
            }
            char *model = model_changes && pc->model ? strdup(pc->model) : NULL;
            if (model_changes && pc->model && !model) {
                km_srv_log(s, KM_LOG_ERROR "reload: pool %s refused: out of memory copying its "
                           "model; nothing of it changed", pc->name);
                first_error = first_error ? first_error : KM_ERR_OUT_OF_MEMORY;
                continue;
            }
            note_pool_restart_only(s, p, pc);
            if (memcmp(&p->policy, &pc->policy, sizeof p->policy) != 0) {
                km_srv_log(s, KM_LOG_INFO
                           "reload: pool %s: policy %s -> %s, parameters as in the file",
                           pc->name, km_policy_kind_name(p->policy.kind),
                           km_policy_kind_name(pc->policy.kind));
                p->policy = pc->policy;
                changes++;
            }
            if (model_changes) {
                km_srv_log(s, KM_LOG_INFO "reload: pool %s: model %s -> %s", pc->name,
                           p->model ? p->model : "(none)", pc->model ? pc->model : "(none)");
                free(p->model);
                p->model = model;
                changes++;
            }
        }
        pool_at[i] = at;
    }
    /* Workers: the file is each pool's list. Every pool's removals come before any addition, so a
     * worker that moves to another pool has left its old one when the new one adds it, whichever
     * the file lists first. One no longer listed is removed; one whose endpoints or name changed
     * is removed and added again (its feed, index entries and labels carry them); a new one is
     * added; a changed metrics URL or dp_rank is applied in place. */
    for (uint32_t i = 0; i < n->n_pools; i++) {
        const km_server_pool *pc = &n->pools[i];
        if (pool_at[i] < 0)
            continue;
        uint32_t at = (uint32_t)pool_at[i];
        for (uint32_t id = 0; id < s->cfg.max_workers; id++) {
            worker_slot *slot = &s->workers[id];
            if (!slot->used || slot->pool != at)
                continue;
            const km_server_worker *w = listed_worker(pc, id);
            unsigned c = w ? worker_changes(s, at, w) : WORKER_SAME;
            if (w && !(c & (WORKER_ENDPOINTS | WORKER_NAME)))
                continue;
            const km_server_worker *elsewhere = NULL;
            const km_server_pool *to =
                w ? NULL : pool_listing(n, pool_at, id, false, &elsewhere);
            if (to) {
                /* It moves to a pool this reload refused: it stays where it is, with its index,
                 * rather than end in no pool. */
                km_srv_log(s, KM_LOG_WARNING
                           "reload: pool %s: worker %u kept: pool %s, which lists it, was refused",
                           pc->name, id, to->name ? to->name : "");
                continue;
            }
            /* Removed to be added again (here or in another pool): an entry the addition would
             * refuse keeps the worker as it is instead. */
            const km_server_worker *again = w;
            uint32_t again_at = at;
            if (!again) {
                const km_server_pool *into = pool_listing(n, pool_at, id, true, &again);
                if (into)
                    again_at = (uint32_t)pool_at[into - n->pools];
            }
            if (again && km_srv_worker_check_add(s, again_at, again, why, sizeof why) != KM_OK) {
                km_srv_log(s, KM_LOG_WARNING "reload: pool %s: worker %u kept as it is: %s",
                           pc->name, id, why);
                first_error = first_error ? first_error : KM_ERR_INVALID_ARGUMENT;
                continue;
            }
            if (km_srv_worker_remove(s, id, why, sizeof why) == KM_OK) {
                km_srv_log(s, KM_LOG_INFO "reload: pool %s: worker %u removed%s", pc->name, id,
                           !w ? "" : c & WORKER_ENDPOINTS ? " (its endpoints changed)"
                                                          : " (its name changed)");
                changes++;
            }
        }
    }
    for (uint32_t i = 0; i < n->n_pools; i++) {
        const km_server_pool *pc = &n->pools[i];
        if (pool_at[i] < 0)
            continue;
        uint32_t at = (uint32_t)pool_at[i];
        for (uint32_t k = 0; k < pc->n_workers; k++) {
            const km_server_worker *w = &pc->workers[k];
            worker_slot *slot = w->id < s->cfg.max_workers ? &s->workers[w->id] : NULL;
            if (slot && slot->used && slot->pool != at) {
                km_srv_log(s, KM_LOG_WARNING
                           "reload: pool %s: worker %u refused: it belongs to pool %s", pc->name,
                           w->id, s->pools[slot->pool]->name);
                first_error = first_error ? first_error : KM_ERR_INVALID_ARGUMENT;
            } else if (slot && slot->used) {
                unsigned c = worker_changes(s, at, w);
                if ((c & WORKER_METRICS) && km_srv_worker_check(w, why, sizeof why) != KM_OK) {
                    km_srv_log(s, KM_LOG_WARNING
                               "reload: pool %s: worker %u: metrics not changed: %s", pc->name,
                               w->id, why);
                    first_error = first_error ? first_error : KM_ERR_INVALID_ARGUMENT;
                } else if (c & WORKER_METRICS) {
                    char *url = w->metrics_url ? strdup(w->metrics_url) : NULL;
                    if (w->metrics_url && !url) {
                        km_srv_log(s, KM_LOG_ERROR "reload: pool %s: worker %u: metrics URL "
                                   "not changed: out of memory", pc->name, w->id);
                        first_error = first_error ? first_error : KM_ERR_OUT_OF_MEMORY;
                    } else {
                        km_srv_log(s, KM_LOG_INFO "reload: pool %s: worker %u: metrics %s -> %s",
                                   pc->name, w->id,
                                   slot->metrics_url ? slot->metrics_url : "(none)",
                                   url ? url : "(none)");
                        km_srv_engine_metrics_target(s, w->id, url);
                        free(slot->metrics_url);
                        slot->metrics_url = url;
                        changes++;
                    }
                }
                if (c & WORKER_DP_RANK) {
                    char from[16] = "(none)", to[16] = "(none)";
                    if (slot->has_dp_rank)
                        snprintf(from, sizeof from, "%u", slot->dp_rank);
                    if (w->has_dp_rank)
                        snprintf(to, sizeof to, "%u", w->dp_rank);
                    km_srv_log(s, KM_LOG_INFO "reload: pool %s: worker %u: dp_rank %s -> %s",
                               pc->name, w->id, from, to);
                    slot->has_dp_rank = w->has_dp_rank;
                    slot->dp_rank = w->dp_rank;
                    changes++;
                }
            } else {
                int rc = km_srv_worker_add(s, at, w, why, sizeof why);
                if (rc != KM_OK) {
                    km_srv_log(s, KM_LOG_WARNING
                               "reload: pool %s: worker %u refused: %s", pc->name, w->id, why);
                    first_error = first_error ? first_error : rc;
                } else {
                    km_srv_log(s, KM_LOG_INFO "reload: pool %s: worker %u added", pc->name, w->id);
                    changes++;
                }
            }
        }
    }
    for (uint32_t i = 0; i < s->n_pools; i++) {
        bool in_file = false;
        for (uint32_t k = 0; k < n->n_pools && !in_file; k++)
            in_file = n->pools[k].name && !strcmp(n->pools[k].name, s->pools[i]->name);
        if (!in_file)
            km_srv_log(s, KM_LOG_WARNING
                       "reload: pool %s is not in the file; it is kept (a reload adds and "
                       "changes pools, never removes one)", s->pools[i]->name);
    }
    pthread_mutex_unlock(&s->admin_lock);
    free(pool_at);
    km_srv_log(s, KM_LOG_INFO "reload: %u change%s applied%s", changes, changes == 1 ? "" : "s",
               first_error ? "; some refused (above)" : "");
    if (changes)
        km_srv_wake_scheduler(s);
    return first_error;
}
