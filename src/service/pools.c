/* SPDX-License-Identifier: Apache-2.0 */
/* Pools and their workers (admin_lock held unless said otherwise): a pool's index, subscriber,
 * in-process feed and approximate-mode state; membership; a worker added or removed; a worker's
 * index state. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <xxhash.h>

#include "kvmatch/log.h"
#include "kvmatch/hash.h"
#include "base/error_detail.h"
#include "base/utf8.h"
#include "service/server_config.h"
#include "service/server_internal.h"

/* The index of the pool named `name`, or -1. */
int km_srv_pool_find(const km_server *s, const char *name)
{
    for (uint32_t i = 0; i < s->n_pools; i++)
        if (!strcmp(s->pools[i]->name, name))
            return (int)i;
    return -1;
}

/* The pool other than `except` (an index in s->pools, or -1 for none) that serves `model`, or -1;
 * -1 for a NULL model. A model names one pool: a route naming it reaches that pool alone. */
int km_srv_pool_serving_model(const km_server *s, const char *model, int except)
{
    for (uint32_t i = 0; model && i < s->n_pools; i++)
        if ((int)i != except && s->pools[i]->model && !strcmp(s->pools[i]->model, model))
            return (int)i;
    return -1;
}

/* The index of the pool serving `model` (a model names one pool), or -1. */
int km_srv_pool_for_model(const km_server *s, const char *model)
{
    return km_srv_pool_serving_model(s, model, -1);
}

/* A pool and everything it owns (subscriber, feeds, index, approximate-mode state); NULL is a
 * no-op. */
void km_srv_pool_destroy(pool *p)
{
    if (!p)
        return;
    km_subscriber_destroy(p->sub);
    km_feed_destroy(p->local_feed);
    km_kv_decoder_destroy(p->local_decoder);
    pthread_mutex_destroy(&p->local_lock);
    km_approx_destroy(p->approx);
    km_approx_updates_free(&p->approx_updates);
    km_index_destroy(p->index);
    km_match_results_free(&p->results);
    free(p->requests);
    free(p->members);
    free(p->model);
    free(p->snapshot_path);
    free(p);
}

/* The pool's engine model's KV capacity in the pool's blocks (the model counts its own): what an
 * approximate-mode worker is assumed to hold at most unless the pool says otherwise. */
static uint64_t engine_capacity_in_blocks(const km_server_pool *pc)
{
    const km_engine_model *m = &pc->policy.engine;
    uint64_t tokens = (uint64_t)m->capacity_blocks * m->block_size;
    uint64_t blocks = pc->block_size ? tokens / pc->block_size : tokens;
    return blocks ? blocks : 1;
}

void km_srv_pool_approx_params(const km_server_pool *pc, uint64_t *ttl_ms,
                               uint64_t *capacity_blocks)
{
    *ttl_ms = pc->approx_ttl_ms ? pc->approx_ttl_ms : 120000;
    *capacity_blocks = pc->approx_capacity_blocks ? pc->approx_capacity_blocks
                                                  : engine_capacity_in_blocks(pc);
}

int km_srv_pool_engine_check(const pool *p, const km_engine_model *m, char *why,
                             size_t why_size)
{
    if (memcmp(&p->policy.engine, m, sizeof *m) == 0)
        return KM_OK;
    const char *own = km_engine_model_preset_of(&p->policy.engine);
    const char *asked = km_engine_model_preset_of(m);
    return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                  "engine cannot change (%s -> %s: its approximate-mode capacity was set from "
                  "the first); POOLS remove the pool and add it again with the new one, or "
                  "restart",
                  own ? own : "a custom model", asked ? asked : "a custom model");
}

/* A pool from its config, with its index and approximate-mode state; its subscriber and in-process
 * feed come with its first worker that needs them. KM_OK, or an error with why filled. */
int km_srv_pool_create(km_server *s, const km_server_pool *pc, pool **out, char *why,
                       size_t why_size)
{
    *out = NULL;
    if (!km_server_name_valid(pc->name))
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                     "pool name \"%s\" must be 1..%u of [A-Za-z0-9._-]", pc->name ? pc->name : "",
                     KM_SERVER_NAME_MAX - 1);
    if (pc->block_size == 0)
        return km_why(why, why_size, KM_ERR_BLOCK_SIZE, "pool %s: block_size must be at least 1",
                     pc->name);
    if (pc->hash_lookahead_tokens > KM_HASH_MAX_LOOKAHEAD)
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                      "pool %s: hash_lookahead_tokens %u is over %u", pc->name,
                      pc->hash_lookahead_tokens, KM_HASH_MAX_LOOKAHEAD);
    if (pc->offload_chunk_blocks > KM_FEED_MAX_OFFLOAD_CHUNK_BLOCKS)
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                      "pool %s: offload_chunk_blocks %u is over %u", pc->name,
                      pc->offload_chunk_blocks, KM_FEED_MAX_OFFLOAD_CHUNK_BLOCKS);
    if (pc->approx_ttl_ms > UINT64_MAX / 1000000)
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                      "pool %s: approx_ttl_ms %" PRIu64 " is over %" PRIu64 " (the TTL in ns must "
                      "fit 64 bits)", pc->name, pc->approx_ttl_ms, UINT64_MAX / 1000000);
    if (pc->model && !km_utf8_name(pc->model))
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                     "pool %s: model must be UTF-8 without control characters", pc->name);
    char detail[192];
    if (km_policy_config_validate(&pc->policy, detail, sizeof detail) != KM_OK)
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT, "pool %s: %s", pc->name, detail);
    pool *p = calloc(1, sizeof *p);
    if (!p)
        return km_why(why, why_size, KM_ERR_OUT_OF_MEMORY, "pool %s", pc->name);
    snprintf(p->name, sizeof p->name, "%s", pc->name);
    p->uid = ++s->next_pool_uid;
    pthread_mutex_init(&p->local_lock, NULL);
    p->block_size = pc->block_size;
    p->hash_lookahead_tokens = pc->hash_lookahead_tokens;
    p->offload_chunk_blocks = pc->offload_chunk_blocks ? pc->offload_chunk_blocks : 1;
    p->policy = pc->policy;
    km_policy_state_init(&p->policy_state, s->cfg.seed ^ XXH3_64bits(pc->name, strlen(pc->name)));
    km_srv_pool_approx_params(pc, &p->approx_ttl_ms, &p->approx_capacity_blocks);
    km_approx_updates_init(&p->approx_updates);
    km_match_results_init(&p->results);
    int rc = km_srv_metrics_pool_ttft(s, p->name, &p->m_ttft_ratio);
    if (!rc && pc->model && !(p->model = strdup(pc->model)))
        rc = KM_ERR_OUT_OF_MEMORY;
    if (!rc && s->snapshot_dir) {
        size_t n = strlen(s->snapshot_dir) + strlen(p->name) + 8;
        p->snapshot_path = malloc(n);
        if (!p->snapshot_path)
            rc = KM_ERR_OUT_OF_MEMORY;
        else
            snprintf(p->snapshot_path, n, "%s/%s.snap", s->snapshot_dir, p->name);
    }
    if (rc) {
        km_srv_pool_destroy(p);
        return km_why(why, why_size, rc, "pool %s", pc->name);
    }
    km_index_config ic;
    km_index_config_init(&ic);
    ic.max_workers = s->cfg.max_workers;
    ic.backend = s->cfg.backend;
    ic.threads = s->cfg.index_threads;
    ic.memory_cap_bytes = s->cfg.index_memory_cap_bytes;
    if (s->cfg.index_initial_blocks)
        ic.initial_blocks = s->cfg.index_initial_blocks;
    ic.log = s->log;
    ic.log_user = s->log_user;
    if ((rc = km_index_create(&ic, &p->index)) != KM_OK) {
        km_srv_pool_destroy(p);
        return km_why(why, why_size, rc, "pool %s: creating its index: %s", pc->name,
                     km_strerror(rc));
    }
    km_approx_config ac;
    km_approx_config_init(&ac);
    ac.max_workers = s->cfg.max_workers;
    ac.ttl_ns = p->approx_ttl_ms * UINT64_C(1000000);
    ac.worker_capacity_blocks = p->approx_capacity_blocks;
    if (pc->approx_every_touch)
        ac.refresh_ns = 0;
    if ((rc = km_approx_create(&ac, &p->approx)) != KM_OK) {
        km_srv_pool_destroy(p);
        return km_why(why, why_size, rc, "pool %s: approximate-mode state: %s", pc->name,
                     km_strerror(rc));
    }
    *out = p;
    return KM_OK;
}

/* The server's decoder limits, a limit 0 taking its default. */
static void pool_decoder_config(const km_server *s, km_kv_decoder_config *out)
{
    km_kv_decoder_config_init(out);
    const km_kv_decoder_config *c = &s->cfg.kv_events;
    if (c->max_payload_bytes)
        out->max_payload_bytes = c->max_payload_bytes;
    if (c->max_payload_objects)
        out->max_payload_objects = c->max_payload_objects;
    if (c->max_events_per_batch)
        out->max_events_per_batch = c->max_events_per_batch;
    if (c->max_hashes_per_event)
        out->max_hashes_per_event = c->max_hashes_per_event;
    if (c->max_tokens_per_event)
        out->max_tokens_per_event = c->max_tokens_per_event;
    if (c->max_string_bytes)
        out->max_string_bytes = c->max_string_bytes;
}

/* The pool's subscriber, created (restoring its snapshot when there is one) on first use. */
static int pool_subscriber(km_server *s, pool *p, char *why, size_t why_size)
{
    if (p->sub)
        return KM_OK;
    km_subscriber_config sc;
    km_subscriber_config_init(&sc);
    sc.feed.block_size = p->block_size;
    sc.feed.hash_lookahead_tokens = p->hash_lookahead_tokens;
    sc.feed.offload_chunk_blocks = p->offload_chunk_blocks;
    pool_decoder_config(s, &sc.decoder);
    sc.feed.log = s->log;
    sc.feed.log_user = s->log_user;
    sc.feed.on_stored = km_srv_note_stored;
    sc.feed.on_stored_user = s;
    sc.log = s->log;
    sc.log_user = s->log_user;
    sc.snapshot_path = p->snapshot_path;
    sc.snapshot_interval_ms = p->snapshot_path ? s->cfg.snapshot_interval_ms : 0;
    sc.snapshot_background = true; /* the scheduler must not stop routing while a snapshot is written */
    sc.on_received = km_srv_wake_scheduler;
    sc.on_received_user = s;
    struct stat stt;
    sc.restore_path = p->snapshot_path && stat(p->snapshot_path, &stt) == 0 ? p->snapshot_path : NULL;
    int rc = km_subscriber_create(p->index, &sc, &p->sub);
    if (rc)
        return km_why(why, why_size, rc, "pool %s: event subscriber: %s", p->name, km_strerror(rc));
    km_subscriber_stats st;
    if (sc.restore_path && km_subscriber_get_stats(p->sub, &st) == KM_OK) {
        if (st.restored)
            km_srv_log(s, KM_LOG_INFO "pool %s: snapshot %s restored; workers resume from their "
                       "saved seq + 1", p->name, sc.restore_path);
        else
            km_srv_log(s, KM_LOG_ERROR "pool %s: snapshot %s not restored: %s; starting empty, "
                       "the file is kept (moved aside before the first snapshot, /status "
                       "pools[].snapshot)", p->name, sc.restore_path, st.restore_error);
    }
    return KM_OK;
}

/* The pool's in-process feed, created on first use. */
static int pool_local_feed(km_server *s, pool *p, char *why, size_t why_size)
{
    if (p->local_feed)
        return KM_OK;
    km_feed_config fc;
    km_feed_config_init(&fc);
    fc.block_size = p->block_size;
    fc.hash_lookahead_tokens = p->hash_lookahead_tokens;
    fc.offload_chunk_blocks = p->offload_chunk_blocks;
    fc.bootstrap_replay = false;
    fc.log = s->log;
    fc.log_user = s->log_user;
    fc.on_stored = km_srv_note_stored;
    fc.on_stored_user = s;
    km_kv_decoder_config dc;
    pool_decoder_config(s, &dc);
    int rc = km_feed_create(p->index, &fc, &p->local_feed);
    if (!rc)
        rc = km_kv_decoder_create(&dc, &p->local_decoder);
    if (rc) {
        km_feed_destroy(p->local_feed);
        p->local_feed = NULL;
        return km_why(why, why_size, rc, "pool %s: in-process event feed: %s", p->name,
                      km_strerror(rc));
    }
    return KM_OK;
}

/* A worker's feed view, from its subscriber or the in-process feed (admin_lock held). */
int km_srv_feed_info(km_server *s, uint32_t id, km_feed_worker_info *out)
{
    worker_slot *w = &s->workers[id];
    pool *p = s->pools[w->pool];
    if (!w->events)
        return KM_ERR_NOT_FOUND;
    if (!w->local)
        return km_subscriber_get_worker_info(p->sub, id, out);
    pthread_mutex_lock(&p->local_lock);
    int rc = km_feed_get_worker_info(p->local_feed, id, out);
    pthread_mutex_unlock(&p->local_lock);
    return rc;
}

/* A worker's latest recovery windows (up to cap), from its subscriber or the in-process feed
 * (admin_lock held). */
int km_srv_feed_windows(km_server *s, uint32_t id, km_feed_window *out, uint32_t cap, uint32_t *n)
{
    worker_slot *w = &s->workers[id];
    pool *p = s->pools[w->pool];
    if (!w->local)
        return km_subscriber_get_worker_windows(p->sub, id, out, cap, n);
    pthread_mutex_lock(&p->local_lock);
    int rc = km_feed_get_worker_windows(p->local_feed, id, out, cap, n);
    pthread_mutex_unlock(&p->local_lock);
    return rc;
}

static int members_insert(pool *p, uint32_t id)
{
    if (p->n_members == p->members_capacity) {
        uint32_t cap = p->members_capacity ? p->members_capacity * 2 : 16;
        uint32_t *g = realloc(p->members, cap * sizeof *g);
        if (!g)
            return KM_ERR_OUT_OF_MEMORY;
        p->members = g;
        p->members_capacity = cap;
    }
    uint32_t i = p->n_members;
    while (i > 0 && p->members[i - 1] > id) {
        p->members[i] = p->members[i - 1];
        i--;
    }
    p->members[i] = id;
    p->n_members++;
    return KM_OK;
}

static void members_erase(pool *p, uint32_t id)
{
    for (uint32_t i = 0; i < p->n_members; i++)
        if (p->members[i] == id) {
            memmove(p->members + i, p->members + i + 1, (p->n_members - i - 1) * sizeof *p->members);
            p->n_members--;
            return;
        }
}

/* Whether worker id belongs to pool p (binary search of its ascending members). */
bool km_srv_pool_is_member(const pool *p, uint32_t id)
{
    uint32_t lo = 0, hi = p->n_members;
    while (lo < hi) {
        uint32_t mid = (lo + hi) / 2;
        if (p->members[mid] < id)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < p->n_members && p->members[lo] == id;
}

int km_srv_worker_check(const km_server_worker *w, char *why, size_t why_size)
{
    if (w->name && (strlen(w->name) == 0 || strlen(w->name) >= KM_SERVER_NAME_MAX ||
                    !km_utf8_name(w->name)))
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                     "worker %u: name must be 1..%u bytes of UTF-8 without control characters "
                     "(it is a label in /metrics and a string in /status and the records)",
                     w->id, KM_SERVER_NAME_MAX - 1);
    if (w->replay_endpoint && !w->event_endpoint)
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                     "worker %u: a replay endpoint needs an event endpoint", w->id);
    if (w->metrics_url && strncmp(w->metrics_url, "http://", 7) &&
        strncmp(w->metrics_url, "https://", 8))
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT,
                     "worker %u: metrics \"%s\" is not an http:// or https:// URL", w->id,
                     w->metrics_url);
    return KM_OK;
}

int km_srv_worker_check_add(km_server *s, uint32_t pool_index, const km_server_worker *w,
                            char *why, size_t why_size)
{
    int rc = km_srv_worker_check(w, why, why_size);
    if (rc != KM_OK || !w->event_endpoint)
        return rc;
    pool *p = s->pools[pool_index];
    if (!strcmp(w->event_endpoint, KM_SERVER_LOCAL_EVENTS))
        return pool_local_feed(s, p, why, why_size);
    if ((rc = pool_subscriber(s, p, why, why_size)) != KM_OK)
        return rc;
    km_subscriber_worker sw = {w->id, w->name, w->event_endpoint, w->replay_endpoint};
    if ((rc = km_subscriber_check_worker(p->sub, &sw)) != KM_OK)
        return km_why(why, why_size, rc, "worker %u: %s", w->id, km_subscriber_last_error(p->sub));
    return KM_OK;
}

/* Add a worker (admin_lock held). */
int km_srv_worker_add(km_server *s, uint32_t pool_index, const km_server_worker *w, char *why,
                      size_t why_size)
{
    pool *p = s->pools[pool_index];
    if (w->id >= s->cfg.max_workers)
        return km_why(why, why_size, KM_ERR_WORKER_RANGE, "worker %u: ids are 0..%u (max_workers)",
                     w->id, s->cfg.max_workers - 1);
    worker_slot *slot = &s->workers[w->id];
    if (slot->used)
        return km_why(why, why_size, KM_ERR_INVALID_ARGUMENT, "worker %u already exists (pool %s)",
                     w->id, s->pools[slot->pool]->name);
    int rc = km_srv_worker_check(w, why, why_size);
    if (rc != KM_OK)
        return rc;
    bool local = w->event_endpoint && !strcmp(w->event_endpoint, KM_SERVER_LOCAL_EVENTS);
    /* The slot's copies are made before anything changes: a worker is added whole or not at all
     * (one kept without its endpoint would be listed without it, and a reload would take it for
     * one whose endpoints changed). */
    char *event_endpoint = w->event_endpoint ? strdup(w->event_endpoint) : NULL;
    char *replay_endpoint = w->replay_endpoint ? strdup(w->replay_endpoint) : NULL;
    char *metrics_url = w->metrics_url ? strdup(w->metrics_url) : NULL;
    if ((w->event_endpoint && !event_endpoint) || (w->replay_endpoint && !replay_endpoint) ||
        (w->metrics_url && !metrics_url)) {
        rc = km_why(why, why_size, KM_ERR_OUT_OF_MEMORY,
                    "worker %u: out of memory copying its endpoints or metrics URL; not added",
                    w->id);
        goto refused;
    }
    if (local) {
        if ((rc = pool_local_feed(s, p, why, why_size)) != KM_OK)
            goto refused;
        km_feed_worker_config fw = {w->id, w->name, false};
        pthread_mutex_lock(&p->local_lock);
        rc = km_feed_add_worker(p->local_feed, &fw, now_ns());
        pthread_mutex_unlock(&p->local_lock);
        if (rc) {
            km_why(why, why_size, rc, "worker %u: %s", w->id, km_feed_last_error(p->local_feed));
            goto refused;
        }
    } else if (w->event_endpoint) {
        if ((rc = pool_subscriber(s, p, why, why_size)) != KM_OK)
            goto refused;
        km_subscriber_worker sw = {w->id, w->name, w->event_endpoint, w->replay_endpoint};
        if ((rc = km_subscriber_add_worker(p->sub, &sw)) != KM_OK) {
            km_why(why, why_size, rc, "worker %u: %s", w->id, km_subscriber_last_error(p->sub));
            goto refused;
        }
    }
    if ((rc = members_insert(p, w->id)) != KM_OK) {
        if (local) {
            pthread_mutex_lock(&p->local_lock);
            km_feed_remove_worker(p->local_feed, w->id, now_ns());
            pthread_mutex_unlock(&p->local_lock);
        } else if (w->event_endpoint) {
            km_subscriber_remove_worker(p->sub, w->id);
        }
        km_why(why, why_size, rc, "worker %u", w->id);
        goto refused;
    }
    memset(slot, 0, sizeof *slot);
    slot->used = true;
    slot->pool = pool_index;
    slot->events = w->event_endpoint != NULL;
    slot->local = local;
    slot->incarnation = ++s->next_incarnation;
    p->n_approx_members += !slot->events;
    if (w->name)
        snprintf(slot->name, sizeof slot->name, "%s", w->name);
    else
        snprintf(slot->name, sizeof slot->name, "w%u", w->id);
    slot->event_endpoint = event_endpoint;
    slot->replay_endpoint = replay_endpoint;
    slot->metrics_url = metrics_url;
    slot->has_dp_rank = w->has_dp_rank;
    slot->dp_rank = w->dp_rank;
    km_srv_engine_metrics_target(s, w->id, w->metrics_url);
    km_srv_cluster_pools_changed(s);
    return KM_OK;

refused:
    free(event_endpoint);
    free(replay_endpoint);
    free(metrics_url);
    return rc;
}

/* Remove a worker (admin_lock held): it stops being a candidate; its blocks leave the index; its
 * active work ends (outcome records say so). */
int km_srv_worker_remove(km_server *s, uint32_t id, char *why, size_t why_size)
{
    if (id >= s->cfg.max_workers || !s->workers[id].used)
        return km_why(why, why_size, KM_ERR_NOT_FOUND, "worker %u does not exist", id);
    worker_slot *slot = &s->workers[id];
    pool *p = s->pools[slot->pool];
    if (slot->local) {
        pthread_mutex_lock(&p->local_lock);
        km_feed_remove_worker(p->local_feed, id, now_ns());
        pthread_mutex_unlock(&p->local_lock);
    } else if (slot->events) {
        km_subscriber_remove_worker(p->sub, id);
    } else {
        km_approx_updates_clear(&p->approx_updates);
        km_approx_clear_worker(p->approx, id, &p->approx_updates);
        km_approx_updates_clear(&p->approx_updates);
        km_index_remove_worker(p->index, id);
        p->n_approx_members--;
    }
    members_erase(p, id);
    km_srv_engine_metrics_target(s, id, NULL);
    free(slot->event_endpoint);
    free(slot->replay_endpoint);
    free(slot->metrics_url);
    pthread_mutex_lock(&s->active_lock);
    km_srv_health_forget(s, slot);
    memset(slot, 0, sizeof *slot);
    km_active_remove_worker(s->active, id, now_ns(), km_srv_record_removed, s, NULL);
    pthread_mutex_unlock(&s->active_lock);
    km_srv_cluster_pools_changed(s);
    return KM_OK;
}

/* Remove a pool (admin_lock held; loop thread, which alone writes pool metadata): each of its
 * workers is removed as km_srv_worker_remove does it (active work ends, outcome records say so),
 * then everything the pool holds is released: its subscriber (I/O thread, ZMQ context, sockets),
 * in-process feed, approximate-mode state and index. Its snapshot file is deleted, so a pool
 * added later under the same name starts empty. The pools after it move down one place (workers
 * renumbered); a route queued for it fails (route_job.pool_uid). */
int km_srv_pool_remove(km_server *s, uint32_t pool_index, char *why, size_t why_size)
{
    if (pool_index >= s->n_pools)
        return km_why(why, why_size, KM_ERR_NOT_FOUND, "no pool at %u", pool_index);
    pool *p = s->pools[pool_index];
    while (p->n_members) {
        int rc = km_srv_worker_remove(s, p->members[p->n_members - 1], why, why_size);
        if (rc)
            return rc;
    }
    memmove(s->pools + pool_index, s->pools + pool_index + 1,
            (s->n_pools - pool_index - 1) * sizeof *s->pools);
    s->n_pools--;
    for (uint32_t id = 0; id < s->cfg.max_workers; id++)
        if (s->workers[id].used && s->workers[id].pool > pool_index)
            s->workers[id].pool--;
    /* The path is taken from the pool rather than copied, so no allocation can keep the file:
     * it is deleted after the subscriber, which may still write it, is gone. */
    char *snapshot = p->snapshot_path;
    p->snapshot_path = NULL;
    km_srv_pool_destroy(p);
    if (snapshot) {
        unlink(snapshot);
        free(snapshot);
    }
    km_srv_cluster_pools_changed(s);
    return KM_OK;
}

/* Index state of a worker, now (admin_lock held). */
const char *km_srv_worker_state(km_server *s, uint32_t id)
{
    worker_slot *w = &s->workers[id];
    if (!w->used)
        return "REMOVED";
    if (!w->events)
        return "APPROX";
    km_feed_worker_info info;
    return km_srv_feed_info(s, id, &info) == KM_OK ? km_feed_state_name(info.state) : "UNKNOWN";
}

int km_server_deliver_events(km_server *s, uint32_t worker, uint64_t seq, const void *payload,
                             size_t size)
{
    if (!s || (!payload && size))
        return KM_ERR_NULL_POINTER;
    pthread_mutex_lock(&s->admin_lock);
    if (worker >= s->cfg.max_workers || !s->workers[worker].used || !s->workers[worker].local) {
        pthread_mutex_unlock(&s->admin_lock);
        return KM_ERR_NOT_FOUND;
    }
    pool *p = s->pools[s->workers[worker].pool];
    uint64_t now = now_ns();
    pthread_mutex_lock(&p->local_lock);
    km_kv_batch batch;
    int rc = km_kv_decode_payload(p->local_decoder, payload, size, &batch);
    /* A payload that does not decode still consumes its seq, as on the wire. */
    int rc2 = rc == KM_OK ? km_feed_live(p->local_feed, worker, seq, &batch, now)
                          : km_feed_live_undecodable(p->local_feed, worker, seq,
                                                     km_kv_decoder_last_error(p->local_decoder),
                                                     now);
    pthread_mutex_unlock(&p->local_lock);
    pthread_mutex_unlock(&s->admin_lock);
    km_srv_wake_scheduler(s);
    return rc != KM_OK ? rc : rc2;
}
