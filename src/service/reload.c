/* SPDX-License-Identifier: Apache-2.0 */
/* km_server_reload (include/kvmatch/server.h): apply what a configuration may change at run time
 * (pools, their policies and parameters, their workers) on the loop thread under admin_lock, and
 * log every change and every setting that only a restart applies. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/error_detail.h"
#include "service/server_internal.h"

static bool same_string(const char *a, const char *b)
{
    return (!a && !b) || (a && b && !strcmp(a, b));
}

/* Is worker w of the file the same as the live one (same pool, same endpoints)? */
static bool worker_unchanged(const km_server *s, uint32_t pool_index, const km_server_worker *w)
{
    const worker_slot *slot = &s->workers[w->id];
    return slot->used && slot->pool == pool_index &&
           same_string(slot->event_endpoint, w->event_endpoint) &&
           same_string(slot->replay_endpoint, w->replay_endpoint);
}

static bool listed(const km_server_pool *pc, uint32_t id)
{
    for (uint32_t k = 0; k < pc->n_workers; k++)
        if (pc->workers[k].id == id)
            return true;
    return false;
}

/* The settings only a restart applies: each that differs is logged, none is changed. */
static void note_restart_only(km_server *s, const km_server_config *n)
{
    const km_server_config *c = &s->cfg;
#define KM_RELOAD_STRING(field, name, live)                                                     \
    if (!same_string(live, n->field))                                                          \
        km_srv_log(s, KM_LOG_WARNING "reload: %s changed in the file; it takes effect at restart", \
                   name);
#define KM_RELOAD_NUMBER(field, name)                                                           \
    if (c->field != n->field)                                                                  \
        km_srv_log(s, KM_LOG_WARNING "reload: %s changed in the file; it takes effect at restart", \
                   name);
    KM_RELOAD_STRING(socket_path, "socket", s->socket_path)
    KM_RELOAD_STRING(tcp, "tcp", s->tcp)
    KM_RELOAD_STRING(http, "http", s->http_addr)
    KM_RELOAD_STRING(records_path, "records", s->records_path)
    KM_RELOAD_STRING(snapshot_dir, "snapshot.dir", s->snapshot_dir)
    KM_RELOAD_NUMBER(max_workers, "index.max_workers")
    KM_RELOAD_NUMBER(backend, "index.backend")
    KM_RELOAD_NUMBER(max_batch_routes, "scheduler.max_batch_routes")
    KM_RELOAD_NUMBER(max_queued_routes, "scheduler.max_queued_routes")
    KM_RELOAD_NUMBER(max_connections, "max_connections")
    KM_RELOAD_NUMBER(active_ttl_ms, "active_ttl_ms")
    KM_RELOAD_NUMBER(breaker_failures, "breaker_failures")
    KM_RELOAD_NUMBER(breaker_cooldown_ms, "breaker_cooldown_ms")
#undef KM_RELOAD_STRING
#undef KM_RELOAD_NUMBER
}

int km_server_reload(km_server *s, const km_server_config *n)
{
    if (!s || !n)
        return KM_ERR_NULL_POINTER;
    int first_error = KM_OK;
    char why[256];
    note_restart_only(s, n);
    pthread_mutex_lock(&s->admin_lock);
    uint32_t changes = 0;
    for (uint32_t i = 0; i < n->n_pools; i++) {
        const km_server_pool *pc = &n->pools[i];
        int at = km_srv_pool_find(s, pc->name ? pc->name : "");
        char detail[192];
        if (at < 0) {
            pool *np = NULL;
            int rc = s->n_pools >= MAX_POOLS
                         ? km_why(why, sizeof why, KM_ERR_TOO_LARGE, "at most %u pools", MAX_POOLS)
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
            if (km_policy_config_validate(&pc->policy, detail, sizeof detail) != KM_OK) {
                km_srv_log(s, KM_LOG_WARNING "reload: pool %s refused: %s", pc->name, detail);
                first_error = first_error ? first_error : KM_ERR_INVALID_ARGUMENT;
                continue;
            }
            if (memcmp(&p->policy, &pc->policy, sizeof p->policy) != 0) {
                km_srv_log(s, KM_LOG_INFO
                           "reload: pool %s: policy %s -> %s, parameters as in the file",
                           pc->name, km_policy_kind_name(p->policy.kind),
                           km_policy_kind_name(pc->policy.kind));
                p->policy = pc->policy;
                changes++;
            }
            if (!same_string(p->model, pc->model)) {
                char *model = pc->model ? strdup(pc->model) : NULL;
                if (!pc->model || model) {
                    km_srv_log(s, KM_LOG_INFO "reload: pool %s: model %s -> %s", pc->name,
                               p->model ? p->model : "(none)", pc->model ? pc->model : "(none)");
                    free(p->model);
                    p->model = model;
                    changes++;
                }
            }
        }
        /* Workers: the file is the pool's list. One no longer listed is removed, one whose
         * endpoints changed is removed and added again, a new one is added. */
        for (uint32_t id = 0; id < s->cfg.max_workers; id++) {
            worker_slot *slot = &s->workers[id];
            if (!slot->used || slot->pool != (uint32_t)at)
                continue;
            bool keep = false;
            for (uint32_t k = 0; k < pc->n_workers && !keep; k++)
                keep = pc->workers[k].id == id && worker_unchanged(s, (uint32_t)at, &pc->workers[k]);
            if (!keep && km_srv_worker_remove(s, id, why, sizeof why) == KM_OK) {
                km_srv_log(s, KM_LOG_INFO "reload: pool %s: worker %u removed%s", pc->name, id,
                           listed(pc, id) ? " (its endpoints changed)" : "");
                changes++;
            }
        }
        for (uint32_t k = 0; k < pc->n_workers; k++) {
            const km_server_worker *w = &pc->workers[k];
            if (w->id < s->cfg.max_workers && s->workers[w->id].used)
                continue; /* kept above, or a worker of another pool: refused below if so */
            int rc = km_srv_worker_add(s, (uint32_t)at, w, why, sizeof why);
            if (rc != KM_OK) {
                km_srv_log(s, KM_LOG_WARNING
                           "reload: pool %s: worker %u refused: %s", pc->name, w->id, why);
                first_error = first_error ? first_error : rc;
            } else {
                km_srv_log(s, KM_LOG_INFO "reload: pool %s: worker %u added", pc->name, w->id);
                changes++;
            }
        }
        for (uint32_t k = 0; k < pc->n_workers; k++) {
            const km_server_worker *w = &pc->workers[k];
            if (w->id < s->cfg.max_workers && s->workers[w->id].used &&
                s->workers[w->id].pool != (uint32_t)at) {
                km_srv_log(s, KM_LOG_WARNING
                           "reload: pool %s: worker %u refused: it belongs to pool %s", pc->name,
                           w->id, s->pools[s->workers[w->id].pool]->name);
                first_error = first_error ? first_error : KM_ERR_INVALID_ARGUMENT;
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
    km_srv_log(s, KM_LOG_INFO "reload: %u change%s applied%s", changes, changes == 1 ? "" : "s",
               first_error ? "; some refused (above)" : "");
    if (changes)
        km_srv_wake_scheduler(s);
    return first_error;
}
