/* SPDX-License-Identifier: Apache-2.0 */
/* Attempts and outcome records: what an outcome record needs from its decision, kept from the
 * decision to its end; lifecycle reports (DISPATCHED, FIRST_TOKEN, FINISHED, a router override)
 * applied to active work and the attempt; the outcome record of each end. */
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/error_detail.h"
#include "kvmatch/log.h"
#include "kvmatch/server.h"
#include "kvmatch/version.h"
#include "service/server_internal.h"

/* The strings of an attempt as one block: each NUL-terminated, NULL ones absent. */
static size_t attempt_strings_bytes(const char *const in[5], size_t len[5])
{
    size_t total = 0;
    for (int i = 0; i < 5; i++) {
        len[i] = in[i] ? strlen(in[i]) + 1 : 0;
        total += len[i];
    }
    return total;
}

/* An attempt's id-map slots in attempts_by_decision (16-byte entries at most 70% full in a
 * power-of-two table: about three; four are counted), as active work counts its own. */
enum { ATTEMPT_MAP_SHARE_BYTES = 4 * 16 };

uint32_t km_srv_attempt_bytes(const char *request_id, const char *attempt_id, const char *model,
                              const char *pool_name, const char *endpoint)
{
    const char *const in[5] = {request_id, attempt_id, model, pool_name, endpoint};
    size_t len[5], total = attempt_strings_bytes(in, len);
    size_t strings = total <= ATTEMPT_CACHED_STRINGS ? ATTEMPT_CACHED_STRINGS : total;
    return (uint32_t)(sizeof(attempt) + strings + ATTEMPT_MAP_SHARE_BYTES);
}

/* One allocation: the struct and its strings (NULL strings stay NULL). active_lock held. */
attempt *km_srv_attempt_new(attempt_cache *cache, const char *request_id, const char *attempt_id,
                            const char *model, const char *pool_name, const char *endpoint)
{
    const char *const in[5] = {request_id, attempt_id, model, pool_name, endpoint};
    size_t len[5], total = attempt_strings_bytes(in, len);
    bool cached_size = total <= ATTEMPT_CACHED_STRINGS;
    attempt *a = NULL;
    if (cached_size && cache->head) {
        a = cache->head;
        cache->head = a->next_free;
        cache->count--;
    } else {
        a = malloc(sizeof *a + (cached_size ? ATTEMPT_CACHED_STRINGS : total));
        if (!a)
            return NULL;
    }
    memset(a, 0, sizeof *a);
    a->cached_size = cached_size;
    a->router_dispatched_ms = a->router_ttft_ms = a->predicted_ttft_ms = NAN;
    const char **out[5] = {&a->request_id, &a->attempt_id, &a->model, &a->pool, &a->endpoint};
    char *p = a->strings;
    for (int i = 0; i < 5; i++) {
        if (!in[i])
            continue;
        memcpy(p, in[i], len[i]);
        *out[i] = p;
        p += len[i];
    }
    return a;
}

/* active_lock held (or the server being destroyed). */
static void attempt_drop_hashes(attempt_cache *cache, attempt *a)
{
    if (!a->hashes)
        return;
    cache->hash_bytes -= (uint64_t)a->n_hashes * sizeof *a->hashes;
    free(a->hashes);
    a->hashes = NULL;
    a->n_hashes = 0;
}

/* Release an attempt (its kept hashes included) to the cache, or free it; NULL is a no-op.
 * active_lock held (or the server being destroyed). */
void km_srv_attempt_free(attempt_cache *cache, attempt *a)
{
    if (a)
        attempt_drop_hashes(cache, a);
    if (a && a->cached_size && cache->count < ATTEMPT_CACHE_MAX) {
        a->next_free = cache->head;
        cache->head = a;
        cache->count++;
        return;
    }
    free(a);
}

/* Free every cached attempt (the server being destroyed). */
void km_srv_attempt_cache_free(attempt_cache *cache)
{
    while (cache->head) {
        attempt *a = cache->head;
        cache->head = a->next_free;
        free(a);
    }
    cache->count = 0;
}

/* A decision in a pool with approximate-mode workers keeps its request's hashes, within
 * approx_dispatch_max_bytes, for a router override to one of them (dispatch_lesson), until the
 * attempt's FIRST_TOKEN or its end. Only once the pool has seen an override (or `always`: a
 * warm-up, taught at its first token): a router that follows every decision pays no copy and no
 * allocation per decision (docs/BENCHMARKS.md, "IPC"), and one that overrides has its first
 * overrides unlearned. active_lock held. Without them such an override teaches nothing
 * (approx_dispatch_unlearned). */
void km_srv_attempt_keep_hashes(km_server *s, attempt *a, const pool *p, const route_job *r,
                                bool always)
{
    if ((!p->overrides_seen && !always) || !p->n_approx_members || !r->n_hashes)
        return;
    uint64_t bytes = (uint64_t)r->n_hashes * sizeof *r->hashes;
    if (s->attempt_cache.hash_bytes + bytes > s->cfg.approx_dispatch_max_bytes)
        return;
    if (!(a->hashes = malloc(bytes)))
        return;
    memcpy(a->hashes, r->hashes, bytes);
    a->n_hashes = (uint32_t)r->n_hashes;
    s->attempt_cache.hash_bytes += bytes;
}

/* active_lock held. */
static attempt *attempt_by_key(km_server *s, const char *request_id, const char *attempt_id)
{
    km_active_key key = km_active_key_of(request_id, attempt_id);
    return km_active_user(s->active, &key);
}

static void attempt_forget(km_server *s, attempt *a)
{
    km_u64map_erase(&s->attempts_by_decision, km_u64map_key(a->decision_id));
    km_srv_attempt_free(&s->attempt_cache, a);
}

static km_record_time mono_to_record(uint64_t mono)
{
    km_record_time now = km_record_time_now();
    km_record_time t = {now.wall_ns - ((int64_t)now.monotonic_ns - (int64_t)mono), (int64_t)mono};
    return t;
}

/* The fields a decision record and its outcome records share, with this server's next record id;
 * the caller sets the time. A NULL attempt_id is written as "". */
km_record_common km_srv_record_common(km_server *s, uint64_t decision_id, const char *request_id,
                                      const char *attempt_id, const char *model,
                                      const char *pool_name, const char *endpoint)
{
    km_record_common c;
    memset(&c, 0, sizeof c);
    c.record_id = (int64_t)atomic_fetch_add(&s->next_record_id, 1);
    c.instance = s->instance;
    c.host = s->host;
    c.kvmatch_version = KVMATCH_VERSION;
    c.decision_id = (int64_t)decision_id;
    c.request_id = request_id;
    c.attempt_id = attempt_id ? attempt_id : "";
    c.model = model;
    c.pool = pool_name;
    c.endpoint = endpoint;
    return c;
}

static void write_outcome(km_server *s, const attempt *a, km_record_outcome outcome,
                          const km_lifecycle_event *ev, const km_active_summary *sum,
                          const char *error)
{
    atomic_fetch_add(&s->st.outcomes, 1);
    km_counter_add(s->m_outcomes, 1);
    if (!s->records)
        return;
    km_outcome_record r;
    km_outcome_record_init(&r);
    r.common = km_srv_record_common(s, a->decision_id, a->request_id, a->attempt_id,
                                    a->model ? a->model : a->pool, a->pool, a->endpoint);
    r.common.time = km_record_time_now();
    r.outcome = outcome;
    r.decided = a->decided;
    if (sum && sum->dispatched)
        r.dispatched = mono_to_record(sum->dispatched_ns);
    else if (a->dispatched.monotonic_ns)
        r.dispatched = a->dispatched;
    if (sum && sum->first_token)
        r.first_token = mono_to_record(sum->first_token_ns);
    if (ev) /* only a FINISHED report ends an attempt with an event: expiry, eviction, a
             * removed worker and an undelivered decision received none, and their finished_*
             * stay null */
        r.finished = r.common.time;
    r.router_dispatched_ms = a->router_dispatched_ms;
    r.router_ttft_ms = a->router_ttft_ms;
    if (ev && ev->has_elapsed_ms)
        r.router_e2e_ms = ev->elapsed_ms;
    if (ev) {
        r.finish_reason = ev->finish_reason;
        r.done_seen = ev->done_seen ? KM_RECORD_FLAG_TRUE : KM_RECORD_FLAG_FALSE;
        if (ev->has_http_status)
            r.http_status = ev->http_status;
        r.error = ev->error;
        if (ev->has_cached_tokens)
            r.cached_tokens = (int64_t)ev->cached_tokens;
        if (ev->has_prompt_tokens)
            r.prompt_tokens = (int64_t)ev->prompt_tokens;
        if (ev->has_output_tokens)
            r.output_tokens = (int64_t)ev->output_tokens;
        r.retries = ev->retries;
    }
    if (error)
        r.error = error;
    if (!ev && sum && sum->engine_cached_tokens != KM_ACTIVE_CACHED_UNKNOWN)
        r.cached_tokens = sum->engine_cached_tokens;
    r.worker = a->chosen_name;
    r.dispatched_worker = a->dispatched_name[0] ? a->dispatched_name : NULL;
    r.source = a->source;
    r.block_size = a->block_size;
    r.predicted_depth_blocks = a->chosen_depth;
    r.owner_worker = a->has_owner ? a->owner_name : NULL;
    r.owner_depth_blocks = a->owner_depth;
    /* Formatted on the writer's thread; a full queue drops it and counts it. */
    km_record_writer_submit_outcome(s->records, &r);
}

/* The outcome record of an entry km_active ended without FINISHED, and its attempt released. The
 * km_srv_record_* functions below are km_active's callbacks (active_lock held). */
static void end_attempt(km_server *s, const km_active_summary *sum, km_record_outcome outcome,
                        const char *error)
{
    attempt *a = sum->user;
    if (!a)
        return;
    write_outcome(s, a, outcome, NULL, sum, error);
    attempt_forget(s, a);
}

/* An entry km_active expired (its TTL passed without FINISHED): an `expired` outcome record. */
void km_srv_record_expired(void *user, const km_active_summary *sum)
{
    km_server *s = user;
    atomic_fetch_add(&s->st.expired, 1);
    km_counter_add(s->m_expired, 1);
    end_attempt(s, sum, KM_RECORD_OUTCOME_EXPIRED, NULL);
    km_srv_cluster_publish(s, sum->worker);
}

/* An entry ended early to make room: its outcome is `expired` (FINISHED never came), with the
 * reason in `error`. The first eviction, and every 100,000th, is logged. */
void km_srv_record_evicted(void *user, const km_active_summary *sum)
{
    km_server *s = user;
    uint64_t n = atomic_fetch_add(&s->st.evicted, 1) + 1;
    km_counter_add(s->m_evicted, 1);
    if (n == 1 || n % 100000 == 0)
        km_srv_log(s, KM_LOG_WARNING "active work: %" PRIu64 " entries evicted so far to make room "
                   "(max_active_entries %u): FINISHED is not reported for them, or the TTL "
                   "(%" PRIu64 " ms) is long for this rate", n, s->cfg.max_active_entries,
                   s->cfg.active_ttl_ms);
    end_attempt(s, sum, KM_RECORD_OUTCOME_EXPIRED,
                "evicted before its TTL: the active-work table was full (max_active_entries)");
    km_srv_cluster_publish(s, sum->worker);
}

/* An entry ended because its worker left the pool: an `error` outcome record saying so. */
void km_srv_record_removed(void *user, const km_active_summary *sum)
{
    end_attempt(user, sum, KM_RECORD_OUTCOME_ERROR, "worker removed from its pool before FINISHED");
    km_srv_cluster_publish(user, sum->worker);
}

/* A decision the router never received: its reply was not written whole into the socket before
 * its connection closed, or it did not encode (an ERROR went in its place). Nobody will report its
 * lifecycle, so its active work ends now, with a `cancelled` outcome record saying why, and its
 * worker's load is published. Left alone: a decision already ended, one a lifecycle report reached
 * (DISPATCHED or FIRST_TOKEN by request id: the router holds the attempt), and one whose attempt
 * could not be kept (its entry ends at its TTL). Its worker's breaker learns nothing: the worker
 * never saw it. Loop thread, holding no lock (active_lock is taken here). */
void km_srv_end_undelivered(km_server *s, uint64_t decision_id)
{
    pthread_mutex_lock(&s->active_lock);
    uint64_t *v = km_u64map_find(&s->attempts_by_decision, km_u64map_key(decision_id));
    attempt *a = v ? (attempt *)(uintptr_t)*v : NULL;
    if (a && !a->dispatched.monotonic_ns && !a->first_token.monotonic_ns) {
        km_active_key key = km_active_key_of(a->request_id, a->attempt_id);
        km_active_summary sum;
        if (km_active_finish(s->active, &key, KM_ACTIVE_END_CANCELLED, now_ns(), &sum) == KM_OK) {
            atomic_fetch_add(&s->st.undelivered, 1);
            km_counter_add(s->m_undelivered, 1);
            write_outcome(s, a, KM_RECORD_OUTCOME_CANCELLED, NULL, &sum,
                          "the decision was never delivered: its connection closed before the "
                          "reply was written whole, or the reply could not be encoded");
            km_srv_cluster_publish(s, sum.worker);
            attempt_forget(s, a);
        }
    }
    pthread_mutex_unlock(&s->active_lock);
}

static km_active_end active_end_of(km_outcome o)
{
    switch (o) {
    case KM_OUTCOME_COMPLETE: return KM_ACTIVE_END_COMPLETE;
    case KM_OUTCOME_INCOMPLETE: return KM_ACTIVE_END_INCOMPLETE;
    case KM_OUTCOME_CANCELLED: return KM_ACTIVE_END_CANCELLED;
    default: return KM_ACTIVE_END_ERROR;
    }
}

static km_record_outcome record_outcome_of(km_outcome o)
{
    switch (o) {
    case KM_OUTCOME_COMPLETE: return KM_RECORD_OUTCOME_COMPLETE;
    case KM_OUTCOME_INCOMPLETE: return KM_RECORD_OUTCOME_INCOMPLETE;
    case KM_OUTCOME_CANCELLED: return KM_RECORD_OUTCOME_CANCELLED;
    default: return KM_RECORD_OUTCOME_ERROR;
    }
}

/* Approximate mode assumes the worker a request went to holds its blocks (approx.h). The
 * decision taught that to its chosen worker; when the router reports another approximate-mode
 * worker, that one is taught too, at the scheduler's next housekeeping (apply_lessons). The chosen
 * worker's assumption is left to its TTL: other decisions may have taught it the same blocks.
 * active_lock held. */
static void lesson_queue(km_server *s, const attempt *a, uint32_t worker)
{
    if (!a->has_blocks)
        return; /* nothing to teach, nothing missed */
    dispatch_lesson *l = NULL;
    uint64_t bytes = (uint64_t)a->n_hashes * sizeof *l->hashes;
    /* The copy counts against approx_dispatch_max_bytes until it is taught: reports that move one
     * attempt back and forth would otherwise queue a copy each. */
    if (a->hashes && s->attempt_cache.hash_bytes + bytes <= s->cfg.approx_dispatch_max_bytes)
        l = malloc(sizeof *l + bytes);
    if (!l) {
        atomic_fetch_add(&s->st.dispatch_unlearned, 1);
        return;
    }
    s->attempt_cache.hash_bytes += bytes;
    l->worker = worker;
    l->incarnation = s->workers[worker].incarnation;
    l->n_hashes = a->n_hashes;
    memcpy(l->hashes, a->hashes, (size_t)a->n_hashes * sizeof *l->hashes);
    l->next = s->lessons; /* newest first: apply_lessons reverses */
    s->lessons = l;
    atomic_store(&s->lessons_queued, true);
}

/* The first token of an attempt the router ran where kvmatch chose: its time over the engine
 * model's prediction into its pool's kvmatch_ttft_observed_over_predicted. The time is the router's
 * (elapsed_ms, from the request's arrival) when the report gives one, else kvmatch's, from the
 * decision. A warm-up (no prediction), an overridden attempt (the prediction was for another
 * worker) and a ratio that is not a finite number are left out. */
static void observe_ttft_prediction(const attempt *a, const km_lifecycle_event *ev, uint64_t now)
{
    if (!(a->predicted_ttft_ms > 0) || a->dispatched_name[0])
        return;
    double observed = ev->has_elapsed_ms ? ev->elapsed_ms
                      : now >= a->decided_ns ? (double)(now - a->decided_ns) / 1e6
                                             : 0.0;
    double ratio = observed / a->predicted_ttft_ms;
    if (isfinite(ratio))
        km_histogram_observe(a->ttft_ratio, ratio);
}

/* A warm-up of an approximate-mode worker whose prefill has run (FIRST_TOKEN, or a complete
 * FINISHED before one) teaches its blocks to the worker it ran on, once. active_lock held. */
static void warm_up_lesson(km_server *s, attempt *a)
{
    if (!a->lesson_at_first_token)
        return;
    a->lesson_at_first_token = false;
    if (!s->workers[a->worker].events)
        lesson_queue(s, a, a->worker);
}

/* One lifecycle report (active_lock held). Returns KM_OK or an error with *msg. */
static int lifecycle_one(km_server *s, const km_lifecycle_event *ev, char *msg, size_t msg_size)
{
    if (ev->status != KM_OK)
        return km_why(msg, msg_size, ev->status, "%s", ev->message ? ev->message : "malformed");
    attempt *a = NULL;
    if (ev->has_decision_id) {
        uint64_t *v = km_u64map_find(&s->attempts_by_decision, km_u64map_key(ev->decision_id));
        a = v ? (attempt *)(uintptr_t)*v : NULL;
        /* Given both, they must name one attempt: a decision id alone is this process's (a report
         * from before a restart may reuse one), the request id is the router's. */
        if (ev->request_id) {
            const char *given = ev->attempt_id ? ev->attempt_id : "";
            if (a && (strcmp(a->request_id, ev->request_id) != 0 ||
                      (ev->attempt_id && strcmp(a->attempt_id ? a->attempt_id : "", given) != 0)))
                return km_why(msg, msg_size, KM_ERR_NOT_FOUND,
                              "decision %" PRIu64 " is not request %s%s%s's; nothing changed",
                              ev->decision_id, ev->request_id, ev->attempt_id ? " attempt " : "",
                              given);
            attempt *named = a ? NULL : attempt_by_key(s, ev->request_id, ev->attempt_id);
            if (named)
                return km_why(msg, msg_size, KM_ERR_NOT_FOUND,
                              "request %s%s%s follows decision %" PRIu64 ", not %" PRIu64
                              "; nothing changed", ev->request_id,
                              ev->attempt_id ? " attempt " : "", given, named->decision_id,
                              ev->decision_id);
        }
    } else if (ev->request_id) {
        a = attempt_by_key(s, ev->request_id, ev->attempt_id);
    }
    if (!a && ev->request_id) {
        /* No attempt: active work still tells a duplicate (already finished: KM_ERR_PROTOCOL) or
         * a late report (expired, evicted, worker removed) from an unknown id, and counts it. The
         * entry is not live, so nothing changes (one whose attempt could not be kept, out of
         * memory, is live: the event applies to it, without an outcome record). */
        km_active_key key = km_active_key_of(ev->request_id, ev->attempt_id);
        uint64_t now = now_ns();
        int rc = ev->kind == KM_LIFECYCLE_DISPATCHED ? km_active_dispatched(s->active, &key, now)
                 : ev->kind == KM_LIFECYCLE_FIRST_TOKEN
                     ? km_active_first_token(s->active, &key, KM_ACTIVE_CACHED_UNKNOWN, now)
                     : km_active_finish(s->active, &key, active_end_of(ev->outcome), now, NULL);
        if (rc == KM_OK) {
            km_srv_cluster_publish_all(s); /* its worker is not known here; rare (no memory) */
            return KM_OK;
        }
        /* Active work's sentence names the request and why: unknown, late (and how it ended) */
        if (rc != KM_ERR_NOT_FOUND || !ev->has_decision_id)
            return km_why(msg, msg_size, rc, "%s", km_active_last_error(s->active));
        return km_why(msg, msg_size, rc, "no active attempt for decision %" PRIu64 "; %s",
                      ev->decision_id, km_active_last_error(s->active));
    }
    if (!a) /* named by its decision alone */
        return km_why(msg, msg_size, KM_ERR_NOT_FOUND, "no active attempt for decision %" PRIu64,
                      ev->decision_id);
    km_active_key key = km_active_key_of(a->request_id, a->attempt_id);
    uint64_t now = now_ns();
    int rc = KM_OK;
    if (ev->kind != KM_LIFECYCLE_DISPATCHED && ev->kind != KM_LIFECYCLE_FIRST_TOKEN &&
        ev->kind != KM_LIFECYCLE_FINISHED)
        return km_why(msg, msg_size, KM_ERR_PROTOCOL, "unknown lifecycle kind");
    /* DISPATCHED or FIRST_TOKEN after FIRST_TOKEN is refused (km_active, KM_ERR_PROTOCOL, counted
     * there): a refused report changes nothing, so the worker it names is not taken either. */
    bool refused = ev->kind != KM_LIFECYCLE_FINISHED && a->first_token.monotonic_ns != 0;
    /* The router sent the attempt to another worker than the decision's (PROTOCOL.md, `worker`):
     * its load moves there, and its outcome record says so. A worker outside the decision's pool
     * fails the event and changes nothing. */
    if (ev->has_worker && ev->worker != a->worker && !refused) {
        int pi = km_srv_pool_find(s, a->pool);
        if (ev->worker >= s->cfg.max_workers || pi < 0 ||
            !km_srv_pool_is_member(s->pools[pi], ev->worker))
            return km_why(msg, msg_size, KM_ERR_NOT_FOUND, "worker %u is not in pool %s",
                          ev->worker, a->pool);
        rc = km_active_move(s->active, &key, ev->worker, now);
        if (rc != KM_OK)
            return km_why(msg, msg_size, rc, "%s", km_active_last_error(s->active));
        km_srv_cluster_publish(s, a->worker);
        km_srv_cluster_publish(s, ev->worker);
        s->pools[pi]->overrides_seen = true;
        a->worker = ev->worker;
        memcpy(a->dispatched_name, s->workers[ev->worker].name, sizeof a->dispatched_name);
        if (!strcmp(a->dispatched_name, a->chosen_name))
            a->dispatched_name[0] = '\0';
        if (!s->workers[ev->worker].events && !a->lesson_at_first_token)
            lesson_queue(s, a, ev->worker);
    }
    switch (ev->kind) {
    case KM_LIFECYCLE_DISPATCHED:
        rc = km_active_dispatched(s->active, &key, now);
        if (rc == KM_OK && !a->dispatched.monotonic_ns)
            a->dispatched = km_record_time_now();
        if (rc == KM_OK && ev->has_elapsed_ms && isnan(a->router_dispatched_ms))
            a->router_dispatched_ms = ev->elapsed_ms;
        break;
    case KM_LIFECYCLE_FIRST_TOKEN:
        rc = km_active_first_token(s->active, &key,
                                   ev->has_cached_tokens ? (int64_t)ev->cached_tokens
                                                         : KM_ACTIVE_CACHED_UNKNOWN,
                                   now);
        if (rc == KM_OK && ev->has_elapsed_ms && isnan(a->router_ttft_ms))
            a->router_ttft_ms = ev->elapsed_ms; /* the first FIRST_TOKEN counts, as its time does */
        /* Streaming has begun: the router knows where the attempt went and has said so, if it
         * overrode the choice (lesson_queue); a warm-up's prefill has run there. Its hashes make
         * room for newer decisions'. */
        if (rc == KM_OK) {
            a->first_token = km_record_time_now();
            observe_ttft_prediction(a, ev, now);
            warm_up_lesson(s, a);
            attempt_drop_hashes(&s->attempt_cache, a);
            km_srv_cluster_publish(s, a->worker);
        }
        break;
    case KM_LIFECYCLE_FINISHED: {
        if (ev->has_cached_tokens)
            km_active_report_cached(s->active, &key, (int64_t)ev->cached_tokens, now);
        km_active_summary sum;
        rc = km_active_finish(s->active, &key, active_end_of(ev->outcome), now, &sum);
        if (rc == KM_OK) {
            if (ev->outcome == KM_OUTCOME_COMPLETE) /* no FIRST_TOKEN reported: its prefill ran */
                warm_up_lesson(s, a);
            km_srv_cluster_publish(s, a->worker);
            /* the worker the attempt ran on */
            km_srv_breaker_outcome(s, a->worker, ev->outcome, now);
            write_outcome(s, a, record_outcome_of(ev->outcome), ev, &sum, NULL);
            attempt_forget(s, a);
        }
        break;
    }
    default:
        return km_why(msg, msg_size, KM_ERR_PROTOCOL, "unknown lifecycle kind");
    }
    if (rc != KM_OK)
        return km_why(msg, msg_size, rc, "%s", km_active_last_error(s->active));
    return KM_OK;
}

/* A LIFECYCLE frame (loop thread): each report applied under one hold of active_lock, answered
 * with an ACK of per-report statuses; queued dispatch lessons wake the scheduler. */
void km_srv_handle_lifecycle(conn *c, const km_message *m)
{
    km_server *s = c->server;
    const km_lifecycle_batch *lb = &m->lifecycle;
    km_item_status *items = calloc(lb->n_events, sizeof *items);
    char(*msgs)[256] = calloc(lb->n_events, sizeof *msgs);
    if (!items || !msgs) {
        free(items);
        free(msgs);
        km_srv_send_error(c, m->id, KM_ERR_OUT_OF_MEMORY, "lifecycle reply");
        return;
    }
    pthread_mutex_lock(&s->active_lock);
    for (uint32_t i = 0; i < lb->n_events; i++) {
        atomic_fetch_add(&s->st.lifecycle, 1);
        km_counter_add(s->m_lifecycle, 1);
        items[i].status = lifecycle_one(s, &lb->events[i], msgs[i], sizeof msgs[i]);
        if (items[i].status != KM_OK) {
            items[i].message = msgs[i];
            atomic_fetch_add(&s->st.lifecycle_errors, 1);
        }
    }
    bool lessons = s->lessons != NULL;
    pthread_mutex_unlock(&s->active_lock);
    if (lessons)
        km_srv_wake_scheduler(s); /* the next decision should already know */
    km_message reply;
    memset(&reply, 0, sizeof reply);
    reply.type = KM_MESSAGE_ACK;
    reply.has_id = true;
    reply.id = m->id;
    reply.ack.items = items;
    reply.ack.n_items = lb->n_events;
    km_srv_send_message(c, &reply);
    free(items);
    free(msgs);
}

/* ---- queued prefills' progress --------------------------------------------------------------- */

void km_srv_note_stored(void *user, uint32_t worker, const uint64_t *hashes, size_t n)
{
    km_server *s = user;
    if (!n || !atomic_load_explicit(&s->stored_wanted, memory_order_relaxed))
        return;
    pthread_mutex_lock(&s->stored_lock);
    size_t need = s->n_stored + 1 + n;
    bool kept = false;
    if (n < UINT32_MAX && need <= KM_SRV_STORED_MAX) {
        if (need > s->stored_capacity) {
            size_t cap = s->stored_capacity ? s->stored_capacity : 1024;
            while (cap < need)
                cap *= 2;
            uint64_t *grown = realloc(s->stored, cap * sizeof *grown);
            if (grown) {
                s->stored = grown;
                s->stored_capacity = cap;
            }
        }
        if (need <= s->stored_capacity) {
            s->stored[s->n_stored] = (uint64_t)worker << 32 | n;
            memcpy(s->stored + s->n_stored + 1, hashes, n * sizeof *hashes);
            s->n_stored = need;
            kept = true;
        }
    }
    pthread_mutex_unlock(&s->stored_lock);
    if (!kept) /* its blocks count as not computed until a later run or the first token */
        km_counter_add(s->m_progress_dropped, 1);
}

void km_srv_apply_stored(km_server *s)
{
    /* The runs are taken out, so the hook can go on keeping runs meanwhile, and nothing is
     * called with stored_lock held. */
    pthread_mutex_lock(&s->stored_lock);
    uint64_t *runs = s->stored;
    size_t n_words = s->n_stored, capacity = s->stored_capacity;
    s->stored = NULL;
    s->n_stored = s->stored_capacity = 0;
    pthread_mutex_unlock(&s->stored_lock);
    uint32_t published = UINT32_MAX;
    for (size_t i = 0; i < n_words;) {
        uint32_t worker = (uint32_t)(runs[i] >> 32), n = (uint32_t)runs[i];
        uint64_t progressed = 0;
        if (km_active_blocks_stored(s->active, worker, runs + i + 1, n, &progressed) == KM_OK &&
            progressed) {
            km_counter_add(s->m_progress_blocks, progressed);
            if (worker != published)
                km_srv_cluster_publish(s, worker);
            published = worker;
        }
        i += 1 + (size_t)n;
    }
    if (km_active_queued_blocks(s->active) == 0)
        atomic_store(&s->stored_wanted, false);
    pthread_mutex_lock(&s->stored_lock);
    if (!s->stored) { /* the buffer goes back for the next runs, emptied */
        s->stored = runs;
        s->stored_capacity = capacity;
        runs = NULL;
    }
    pthread_mutex_unlock(&s->stored_lock);
    free(runs);
}
