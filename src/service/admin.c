/* SPDX-License-Identifier: Apache-2.0 */
/* Admin messages on the loop thread: WORKERS (add, remove, update, list), POOLS (add, update,
 * list) and STATUS. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/error_detail.h"
#include "base/utf8.h"
#include "kvmatch/log.h"
#include "kvmatch/server.h"
#include "kvmatch/version.h"
#include "service/server_config.h"
#include "service/server_internal.h"

/* Runtime view of one worker (admin_lock held). */
static void worker_view(km_server *s, uint32_t id, km_worker_info *out)
{
    worker_slot *w = &s->workers[id];
    pool *p = s->pools[w->pool];
    memset(out, 0, sizeof *out);
    out->pool = p->name;
    out->worker = id;
    out->name = w->name;
    out->event_endpoint = w->event_endpoint;
    out->replay_endpoint = w->replay_endpoint;
    out->has_dp_rank = w->has_dp_rank;
    out->dp_rank = w->dp_rank;
    out->state = km_srv_worker_state(s, id);
    /* The feed's position first, then the index: the index then holds at least every message
     * before the seq reported (a flush in between only adds to it). */
    if (w->events) {
        km_feed_worker_info info;
        if (km_srv_feed_info(s, id, &info) == KM_OK) {
            if (info.has_last_receive) {
                out->has_last_event_age_s = true;
                out->last_event_age_s = (double)(now_ns() - info.last_receive_ns) / 1e9;
            }
            out->has_expected_seq = info.has_indexed_seq;
            out->expected_seq = info.indexed_seq;
        }
    }
    km_worker_stats ws;
    if (km_index_worker_stats(p->index, id, &ws) == KM_OK) {
        out->has_blocks = true;
        out->blocks = ws.blocks;
    }
    km_active_load load;
    uint64_t now = now_ns();
    pthread_mutex_lock(&s->active_lock);
    if (km_active_worker_load(s->active, id, &load) == KM_OK) {
        out->has_load = true;
        out->load.in_flight = (uint32_t)load.in_flight;
        out->load.pending_prefill_tokens = load.pending_prefill_tokens;
        out->load.active_decode_blocks = load.active_decode_blocks;
    }
    out->has_healthy = true;
    out->healthy = !w->unhealthy;
    out->breaker = km_srv_breaker_state_name(km_srv_worker_breaker(w, now));
    out->has_failures = true;
    out->failures = w->failures;
    out->has_eligible = true;
    out->eligible = km_srv_worker_eligibility(s, id, now) == ELIGIBLE;
    pthread_mutex_unlock(&s->active_lock);
}

/* KM_OK when the worker a WORKERS remove / update item names exists in the pool it names
 * (admin_lock held); else KM_ERR_NOT_FOUND with the reason in why. */
static int named_worker(km_server *s, const km_worker_info *wi, char *why, size_t why_size)
{
    int pi = km_srv_pool_find(s, wi->pool);
    if (pi < 0)
        return km_why(why, why_size, KM_ERR_NOT_FOUND, "no pool %s", wi->pool);
    if (wi->worker >= s->cfg.max_workers || !s->workers[wi->worker].used ||
        s->workers[wi->worker].pool != (uint32_t)pi)
        return km_why(why, why_size, KM_ERR_NOT_FOUND, "worker %u is not in pool %s", wi->worker,
                      wi->pool);
    return KM_OK;
}

/* A refused POOLS or WORKERS item, logged as well as answered: the log holds what was refused
 * as it holds what was done (out of memory as an error, the rest as warnings). */
static void log_refused_item(km_server *s, const char *message_type, km_admin_action action,
                             const char *what, int status, const char *why)
{
    if (status == KM_ERR_OUT_OF_MEMORY)
        km_srv_log(s, KM_LOG_ERROR "%s %s of %s refused: %s", message_type,
                   km_admin_action_name(action), what, why);
    else
        km_srv_log(s, KM_LOG_WARNING "%s %s of %s refused: %s", message_type,
                   km_admin_action_name(action), what, why);
}

/* A WORKERS frame: list (WORKER_LIST), or add / remove / update each worker under admin_lock,
 * answered with an ACK of per-worker statuses. */
void km_srv_handle_workers(conn *c, const km_message *m)
{
    km_server *s = c->server;
    const km_workers_message *wm = &m->workers;
    km_message reply;
    memset(&reply, 0, sizeof reply);
    reply.has_id = true;
    reply.id = m->id;
    pthread_mutex_lock(&s->admin_lock);
    if (wm->action == KM_ADMIN_LIST) {
        int pi = wm->pool ? km_srv_pool_find(s, wm->pool) : -1;
        if (wm->pool && pi < 0) {
            pthread_mutex_unlock(&s->admin_lock);
            km_srv_send_error(c, m->id, KM_ERR_NOT_FOUND, "no pool %s", wm->pool);
            return;
        }
        km_worker_info *list = calloc(s->cfg.max_workers, sizeof *list);
        uint32_t n = 0;
        for (uint32_t id = 0; list && id < s->cfg.max_workers; id++)
            if (s->workers[id].used && (pi < 0 || s->workers[id].pool == (uint32_t)pi))
                worker_view(s, id, &list[n++]);
        reply.type = KM_MESSAGE_WORKER_LIST;
        reply.workers.action = KM_ADMIN_LIST;
        reply.workers.workers = list;
        reply.workers.n_workers = n;
        if (list)
            km_srv_send_message(c, &reply);
        else
            km_srv_send_error(c, m->id, KM_ERR_OUT_OF_MEMORY, "worker list");
        pthread_mutex_unlock(&s->admin_lock);
        free(list);
        return;
    }
    if (wm->action != KM_ADMIN_ADD && wm->action != KM_ADMIN_REMOVE &&
        wm->action != KM_ADMIN_UPDATE) {
        pthread_mutex_unlock(&s->admin_lock);
        km_srv_send_error(c, m->id, KM_ERR_PROTOCOL,
                          "WORKERS action must be add, remove, update or list");
        return;
    }
    km_item_status *items = calloc(wm->n_workers ? wm->n_workers : 1, sizeof *items);
    char(*msgs)[256] = calloc(wm->n_workers ? wm->n_workers : 1, sizeof *msgs);
    if (!items || !msgs) {
        pthread_mutex_unlock(&s->admin_lock);
        free(items);
        free(msgs);
        km_srv_send_error(c, m->id, KM_ERR_OUT_OF_MEMORY, "workers reply");
        return;
    }
    for (uint32_t i = 0; i < wm->n_workers; i++) {
        const km_worker_info *wi = &wm->workers[i];
        int rc = wi->status;
        if (rc != KM_OK) {
            snprintf(msgs[i], sizeof msgs[i], "%s", wi->message ? wi->message : "malformed");
        } else if (wm->action == KM_ADMIN_ADD) {
            int pi = km_srv_pool_find(s, wi->pool);
            if (pi < 0) {
                rc = km_why(msgs[i], sizeof msgs[i], KM_ERR_NOT_FOUND, "no pool %s", wi->pool);
            } else {
                km_server_worker w = {wi->worker, wi->name, wi->event_endpoint, wi->replay_endpoint,
                                      wi->has_dp_rank, wi->dp_rank, NULL};
                rc = km_srv_worker_add(s, (uint32_t)pi, &w, msgs[i], sizeof msgs[i]);
                if (rc == KM_OK && wi->has_healthy)
                    km_srv_worker_set_health(s, wi->worker, wi->healthy);
                if (rc == KM_OK)
                    km_srv_log(s, KM_LOG_INFO "worker %u (%s) added to pool %s%s%s", wi->worker,
                               s->workers[wi->worker].name, wi->pool,
                               wi->event_endpoint ? "" : " in approximate mode",
                               wi->has_healthy && !wi->healthy ? ", unhealthy" : "");
            }
        } else if (wm->action == KM_ADMIN_UPDATE) {
            rc = named_worker(s, wi, msgs[i], sizeof msgs[i]);
            if (rc == KM_OK && !wi->has_healthy)
                rc = km_why(msgs[i], sizeof msgs[i], KM_ERR_INVALID_ARGUMENT,
                           "worker %u: update needs `healthy` (the only field it changes)",
                           wi->worker);
            if (rc == KM_OK && km_srv_worker_set_health(s, wi->worker, wi->healthy))
                km_srv_log(s, KM_LOG_INFO "worker %u (%s) marked %s by the router", wi->worker,
                           s->workers[wi->worker].name, wi->healthy ? "healthy" : "unhealthy");
        } else {
            if ((rc = named_worker(s, wi, msgs[i], sizeof msgs[i])) == KM_OK)
                rc = km_srv_worker_remove(s, wi->worker, msgs[i], sizeof msgs[i]);
            if (rc == KM_OK)
                km_srv_log(s, KM_LOG_INFO "worker %u removed from pool %s", wi->worker, wi->pool);
        }
        if (rc != KM_OK) {
            char what[32];
            snprintf(what, sizeof what, "worker %u", wi->worker);
            log_refused_item(s, "WORKERS", wm->action, what, rc, msgs[i]);
        }
        items[i].status = rc;
        items[i].message = rc == KM_OK ? NULL : msgs[i];
    }
    pthread_mutex_unlock(&s->admin_lock);
    reply.type = KM_MESSAGE_ACK;
    reply.ack.items = items;
    reply.ack.n_items = wm->n_workers;
    km_srv_send_message(c, &reply);
    free(items);
    free(msgs);
}

/* POOL_LIST's params of pool p: its own policy's parameters (those POOLS update takes back) and
 * its approximate mode's TTL and capacity. Returns the count, at most LISTED_PARAMS_MAX. */
#define LISTED_PARAMS_MAX 7
static uint32_t listed_params(const pool *p, km_param *pp)
{
    const km_policy_config *c = &p->policy;
    uint32_t n = 0;
    switch (c->kind) {
    case KM_POLICY_KV:
        pp[n++] = (km_param){"temperature", c->kv.temperature};
        pp[n++] = (km_param){"prefill_load_scale", c->kv.prefill_load_scale};
        pp[n++] = (km_param){"device_weight", c->kv.device_weight};
        pp[n++] = (km_param){"host_weight", c->kv.host_weight};
        pp[n++] = (km_param){"disk_weight", c->kv.disk_weight};
        break;
    case KM_POLICY_CACHE_AWARE:
        pp[n++] = (km_param){"cache_threshold", c->cache_aware.cache_threshold};
        pp[n++] = (km_param){"balance_abs_threshold", c->cache_aware.balance_abs_threshold};
        pp[n++] = (km_param){"balance_rel_threshold", c->cache_aware.balance_rel_threshold};
        break;
    case KM_POLICY_LLMD:
        pp[n++] = (km_param){"prefix_weight", c->llmd.prefix_weight};
        pp[n++] = (km_param){"queue_weight", c->llmd.queue_weight};
        pp[n++] = (km_param){"kv_usage_weight", c->llmd.kv_usage_weight};
        pp[n++] = (km_param){"host_tier_weight", c->llmd.host_tier_weight};
        break;
    case KM_POLICY_PREBLE:
        pp[n++] = (km_param){"exploit_ratio", c->preble.exploit_ratio};
        break;
    case KM_POLICY_TTFT:
        pp[n++] = (km_param){"load_bound", c->ttft.load_bound};
        pp[n++] = (km_param){"hot_prefix_sharers", c->ttft.hot_prefix_sharers};
        pp[n++] = (km_param){"hot_prefix_share", c->ttft.hot_prefix_share};
        pp[n++] = (km_param){"spread_ms", c->ttft.spread_ms};
        break;
    default: /* prefix, least_load, round_robin: none */
        break;
    }
    pp[n++] = (km_param){"approx_ttl_s", (double)p->approx_ttl_ms / 1000.0};
    pp[n++] = (km_param){"approx_capacity_blocks", (double)p->approx_capacity_blocks};
    return n;
}

/* A POOLS add / update's engine preset (NULL: none given): into pc at add; at update only the
 * pool's own is accepted (km_srv_pool_engine_check), as a reload accepts only it. */
static int pool_engine(km_admin_action action, const pool *existing, km_server_pool *pc,
                       const char *pool_name, const char *preset, char *why, size_t why_size)
{
    if (!preset)
        return KM_OK;
    km_engine_model m;
    if (km_engine_model_preset(preset, &m) != KM_OK) {
        char names[160] = "";
        size_t len = 0;
        for (size_t i = 0; km_engine_model_preset_name(i) && len < sizeof names; i++)
            len += (size_t)snprintf(names + len, sizeof names - len, "%s%s", i ? ", " : "",
                                    km_engine_model_preset_name(i));
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                      "pool %s: unknown engine preset \"%s\" (the presets: %s)", pool_name, preset,
                      names);
    }
    if (action == KM_ADMIN_UPDATE) {
        char detail[224];
        if (km_srv_pool_engine_check(existing, &m, detail, sizeof detail) != KM_OK)
            return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT, "pool %s: %s", pool_name,
                          detail);
        return KM_OK;
    }
    pc->policy.engine = m;
    return KM_OK;
}

/* One of a POOLS add / update's params: a policy parameter, or (add only: a pool's approximate
 * mode keeps its TTL and capacity for its life) approx_ttl_s or approx_capacity_blocks. */
static int pool_param(km_admin_action action, km_server_pool *pc, const km_param *param, char *why,
                      size_t why_size)
{
    bool ttl = !strcmp(param->name, "approx_ttl_s");
    if (!ttl && strcmp(param->name, "approx_capacity_blocks") != 0) {
        /* As the configuration file and --param: another policy's parameter would change
         * nothing, so it is refused rather than kept unread. */
        const char *owner = km_server_policy_param_owner(param->name);
        const char *kind = km_policy_kind_name(pc->policy.kind);
        if (owner && strcmp(owner, kind) != 0)
            return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                          "%s is a parameter of policy %s; this pool's policy is %s",
                          param->name, owner, kind);
        return km_server_policy_param(&pc->policy, param->name, param->value, why, why_size);
    }
    if (action != KM_ADMIN_ADD)
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                      "%s is set when a pool is added; it cannot change", param->name);
    double v = param->value;
    if (ttl) {
        if (!(v >= 0.001 && v <= 1e9))
            return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                          "approx_ttl_s %g is outside [0.001, 1e9]", v);
        pc->approx_ttl_ms = (uint64_t)llround(v * 1000);
    } else {
        if (!(v >= 0 && v <= 1e15) || v != floor(v))
            return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                          "approx_capacity_blocks %g is not a whole number in [0, 1e15]", v);
        pc->approx_capacity_blocks = (uint64_t)v;
    }
    return KM_OK;
}

/* One POOLS item's status into its ACK item, logged when refused (pools[i] names an item whose
 * name did not decode). */
static void pool_item_status(km_server *s, km_admin_action action, const km_pool_info *pi,
                             uint32_t i, int status, const char *why, km_item_status *item)
{
    if (status != KM_OK) {
        char what[96];
        if (pi->name)
            snprintf(what, sizeof what, "pool %s", pi->name);
        else
            snprintf(what, sizeof what, "pools[%u]", i);
        log_refused_item(s, "POOLS", action, what, status, why);
    }
    item->status = status;
    item->message = status == KM_OK ? NULL : why;
}

/* A POOLS frame: list (POOL_LIST), or add / update / remove each pool under admin_lock, answered
 * with an ACK of per-pool statuses. */
void km_srv_handle_pools(conn *c, const km_message *m)
{
    km_server *s = c->server;
    const km_pools_message *pm = &m->pools;
    km_message reply;
    memset(&reply, 0, sizeof reply);
    reply.has_id = true;
    reply.id = m->id;
    pthread_mutex_lock(&s->admin_lock);
    if (pm->action == KM_ADMIN_LIST) {
        km_pool_info *list = calloc(s->n_pools ? s->n_pools : 1, sizeof *list);
        km_param(*params)[LISTED_PARAMS_MAX] = calloc(s->n_pools ? s->n_pools : 1, sizeof *params);
        for (uint32_t i = 0; list && params && i < s->n_pools; i++) {
            pool *p = s->pools[i];
            list[i].name = p->name;
            list[i].model = p->model;
            list[i].block_size = p->block_size;
            list[i].hash_lookahead_tokens = p->hash_lookahead_tokens;
            list[i].offload_chunk_blocks = p->offload_chunk_blocks > 1 ? p->offload_chunk_blocks : 0;
            list[i].policy = km_policy_kind_name(p->policy.kind);
            list[i].engine = km_engine_model_preset_of(&p->policy.engine);
            list[i].params = params[i];
            list[i].n_params = listed_params(p, params[i]);
        }
        reply.type = KM_MESSAGE_POOL_LIST;
        reply.pools.action = KM_ADMIN_LIST;
        reply.pools.pools = list;
        reply.pools.n_pools = s->n_pools;
        if (list && params)
            km_srv_send_message(c, &reply);
        else
            km_srv_send_error(c, m->id, KM_ERR_OUT_OF_MEMORY, "pool list");
        pthread_mutex_unlock(&s->admin_lock);
        free(list);
        free(params);
        return;
    }
    if (pm->action != KM_ADMIN_ADD && pm->action != KM_ADMIN_UPDATE &&
        pm->action != KM_ADMIN_REMOVE) {
        pthread_mutex_unlock(&s->admin_lock);
        km_srv_send_error(c, m->id, KM_ERR_PROTOCOL,
                          "POOLS action must be add, update, remove or list");
        return;
    }
    km_item_status *items = calloc(pm->n_pools ? pm->n_pools : 1, sizeof *items);
    char(*msgs)[256] = calloc(pm->n_pools ? pm->n_pools : 1, sizeof *msgs);
    for (uint32_t i = 0; items && msgs && i < pm->n_pools; i++) {
        const km_pool_info *pi = &pm->pools[i];
        int rc = pi->status;
        if (rc != KM_OK) {
            snprintf(msgs[i], sizeof msgs[i], "%s", pi->message ? pi->message : "malformed");
            pool_item_status(s, pm->action, pi, i, rc, msgs[i], &items[i]);
            continue;
        }
        int at = km_srv_pool_find(s, pi->name);
        if (pm->action == KM_ADMIN_REMOVE) {
            if (at < 0)
                rc = km_why(msgs[i], sizeof msgs[i], KM_ERR_NOT_FOUND, "no pool %s", pi->name);
            else
                rc = km_srv_pool_remove(s, (uint32_t)at, msgs[i], sizeof msgs[i]);
            if (rc == KM_OK)
                km_srv_log(s, KM_LOG_INFO "pool %s removed", pi->name);
            pool_item_status(s, pm->action, pi, i, rc, msgs[i], &items[i]);
            continue;
        }
        km_server_pool pc;
        memset(&pc, 0, sizeof pc);
        km_policy_config_init(&pc.policy);
        if (pm->action == KM_ADMIN_UPDATE) {
            if (at < 0) {
                rc = km_why(msgs[i], sizeof msgs[i], KM_ERR_NOT_FOUND, "no pool %s", pi->name);
            } else if (pi->block_size && pi->block_size != s->pools[at]->block_size) {
                rc = km_why(msgs[i], sizeof msgs[i], KM_ERR_INVALID_ARGUMENT,
                           "pool %s: block_size cannot change (the index is hashed with %u)",
                           pi->name, s->pools[at]->block_size);
            } else if (pi->hash_lookahead_tokens &&
                       pi->hash_lookahead_tokens != s->pools[at]->hash_lookahead_tokens) {
                rc = km_why(msgs[i], sizeof msgs[i], KM_ERR_INVALID_ARGUMENT,
                           "pool %s: hash_lookahead_tokens cannot change (the index is hashed "
                           "with %u)",
                           pi->name, s->pools[at]->hash_lookahead_tokens);
            } else if (pi->offload_chunk_blocks &&
                       pi->offload_chunk_blocks != s->pools[at]->offload_chunk_blocks) {
                rc = km_why(msgs[i], sizeof msgs[i], KM_ERR_INVALID_ARGUMENT,
                           "pool %s: offload_chunk_blocks cannot change (chunks are held with %u)",
                           pi->name, s->pools[at]->offload_chunk_blocks);
            } else if (pi->model && !km_utf8_name(pi->model)) {
                /* As km_srv_pool_create checks it: the model is a string in /status and the
                 * records. */
                rc = km_why(msgs[i], sizeof msgs[i], KM_ERR_INVALID_ARGUMENT,
                           "pool %s: model must be UTF-8 without control characters", pi->name);
            }
            if (rc == KM_OK)
                pc.policy = s->pools[at]->policy;
        } else if (at >= 0) {
            rc = km_why(msgs[i], sizeof msgs[i], KM_ERR_INVALID_ARGUMENT, "pool %s already exists",
                       pi->name);
        } else if (s->n_pools >= MAX_POOLS) {
            rc = km_why(msgs[i], sizeof msgs[i], KM_ERR_TOO_LARGE, "at most %u pools", MAX_POOLS);
        }
        int serving = rc == KM_OK ? km_srv_pool_serving_model(s, pi->model, at) : -1;
        if (serving >= 0)
            rc = km_why(msgs[i], sizeof msgs[i], KM_ERR_INVALID_ARGUMENT,
                        "pool %s: model %s is served by pool %s already (a route naming a model "
                        "reaches one pool)", pi->name, pi->model, s->pools[serving]->name);
        if (rc == KM_OK && pi->policy && km_policy_kind_parse(pi->policy, &pc.policy.kind) != KM_OK)
            rc = km_why(msgs[i], sizeof msgs[i], KM_ERR_INVALID_ARGUMENT, "unknown policy \"%s\"",
                       pi->policy);
        if (rc == KM_OK)
            rc = pool_engine(pm->action, at >= 0 ? s->pools[at] : NULL, &pc, pi->name, pi->engine,
                             msgs[i], sizeof msgs[i]);
        for (uint32_t k = 0; rc == KM_OK && k < pi->n_params; k++)
            rc = pool_param(pm->action, &pc, &pi->params[k], msgs[i], sizeof msgs[i]);
        char detail[192];
        if (rc == KM_OK && km_policy_config_validate(&pc.policy, detail, sizeof detail) != KM_OK)
            rc = km_why(msgs[i], sizeof msgs[i], KM_ERR_INVALID_ARGUMENT, "%s", detail);
        /* An update applies whole or not at all: the model is copied before anything changes. */
        char *model = NULL;
        if (rc == KM_OK && pm->action == KM_ADMIN_UPDATE && pi->model &&
            !(model = strdup(pi->model)))
            rc = km_why(msgs[i], sizeof msgs[i], KM_ERR_OUT_OF_MEMORY,
                        "pool %s: out of memory copying its model; nothing changed", pi->name);
        if (rc == KM_OK && pm->action == KM_ADMIN_UPDATE) {
            s->pools[at]->policy = pc.policy;
            if (model) {
                free(s->pools[at]->model);
                s->pools[at]->model = model;
            }
        } else if (rc == KM_OK) {
            pc.name = pi->name;
            pc.model = pi->model;
            pc.block_size = pi->block_size;
            pc.hash_lookahead_tokens = pi->hash_lookahead_tokens;
            pc.offload_chunk_blocks = pi->offload_chunk_blocks;
            pool *np = NULL;
            rc = km_srv_pool_create(s, &pc, &np, msgs[i], sizeof msgs[i]);
            if (rc == KM_OK)
                s->pools[s->n_pools++] = np;
        }
        if (rc == KM_OK)
            km_srv_log(s, KM_LOG_INFO "pool %s %s (policy %s)", pi->name,
                       pm->action == KM_ADMIN_ADD ? "added" : "updated",
                       km_policy_kind_name(pc.policy.kind));
        pool_item_status(s, pm->action, pi, i, rc, msgs[i], &items[i]);
    }
    pthread_mutex_unlock(&s->admin_lock);
    if (!items || !msgs) {
        km_srv_send_error(c, m->id, KM_ERR_OUT_OF_MEMORY, "pools reply");
    } else {
        reply.type = KM_MESSAGE_ACK;
        reply.ack.items = items;
        reply.ack.n_items = pm->n_pools;
        km_srv_send_message(c, &reply);
    }
    free(items);
    free(msgs);
}

/* A STATUS frame: uptime, readiness, counters and every worker's view (STATUS_REPLY). */
void km_srv_handle_status(conn *c, const km_message *m)
{
    km_server *s = c->server;
    km_message reply;
    memset(&reply, 0, sizeof reply);
    reply.type = KM_MESSAGE_STATUS_REPLY;
    reply.has_id = true;
    reply.id = m->id;
    char reason[KM_SRV_READINESS_REASON_BYTES];
    km_status_reply *st = &reply.status_reply;
    st->kvmatch_version = KVMATCH_VERSION;
    st->uptime_s = (double)(now_ns() - s->start_ns) / 1e9;
    st->ready = km_srv_readiness(s, reason, sizeof reason);
    st->connections = (uint32_t)atomic_load(&s->st.open);
    st->decisions = atomic_load(&s->st.decisions);
    km_record_writer_counters rc;
    memset(&rc, 0, sizeof rc);
    if (s->records)
        km_record_writer_stats(s->records, &rc);
    st->records_dropped = rc.dropped;
    pthread_mutex_lock(&s->admin_lock);
    st->backend = s->n_pools ? km_index_backend_name(s->pools[0]->index) : NULL;
    km_worker_info *list = calloc(s->cfg.max_workers, sizeof *list);
    uint32_t n = 0;
    for (uint32_t id = 0; list && id < s->cfg.max_workers; id++)
        if (s->workers[id].used)
            worker_view(s, id, &list[n++]);
    st->workers = list;
    st->n_workers = n;
    if (list)
        km_srv_send_message(c, &reply);
    else
        km_srv_send_error(c, m->id, KM_ERR_OUT_OF_MEMORY, "status");
    pthread_mutex_unlock(&s->admin_lock);
    free(list);
}
