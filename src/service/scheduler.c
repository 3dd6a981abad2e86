/* SPDX-License-Identifier: Apache-2.0 */
/* The scheduler role: the scheduler thread, and the loop thread when it runs a small batch
 * inline or a slice of active-work expiry; housekeeping between batches (events, approximate-mode
 * expiry and lessons), a batch scored per pool and decided route by route, and the batch
 * scratch. */
#include <inttypes.h>
#include <malloc.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/error_detail.h"
#include "base/array.h"
#include "service/server_internal.h"

#define SCHEDULER_TICK_MS 20u

/* Small frames and batches (at most this many routes; the size of a batch the loop thread runs
 * inline by default): their replies are encoded and written by the scheduler thread
 * (scheduler_main). */
#define SCHEDULER_REPLY_ROUTES 16u

/* Active work whose FINISHED never comes is expired only by the holder of the scheduler role, so
 * expiry never contends with a batch's decisions for active_lock:
 *  - the scheduler thread, before each batch (housekeeping): twice the batch's routes (at least
 *    a slice, at most EXPIRY_PER_PASS), which keeps up with any decision rate;
 *  - the loop thread, when the role is free: every EXPIRY_TICK_MS, one slice per pass of the event
 *    loop (on_expiry_tick, then on_expiry_more while a full slice ended), taking the role for the
 *    slice, so sockets are served and inline batches decided between slices, and single routes
 *    keep the inline path (on_dispatch) while nothing else holds the role.
 * Entries end in slices of EXPIRY_SLICE per hold of active_lock, so neither the loop thread nor a
 * lifecycle report waits for more than one slice (docs/BENCHMARKS.md, "IPC"). */
#define EXPIRY_TICK_MS 20u
#define EXPIRY_SLICE 64u
#define EXPIRY_PER_PASS 1024u

/* Subscriber I/O thread: events arrived; the scheduler flushes them at once instead of at its
 * next tick, so the index is fresh before the next decision. */
void km_srv_wake_scheduler(void *user)
{
    km_server *s = user;
    pthread_mutex_lock(&s->queue_lock);
    s->events_pending = true;
    pthread_cond_signal(&s->queue_cond);
    pthread_mutex_unlock(&s->queue_lock);
}

/* Room for n_cands candidates in the scratch's per-candidate arrays (cands, costs, states,
 * rcands); KM_ERR_OUT_OF_MEMORY leaves what it has. Scheduler role held. */
int km_srv_scratch_reserve(batch_scratch *b, size_t n_cands)
{
    size_t cap = b->cap_cands;
    if (KM_ARRAY_GROW(b->cands, cap, n_cands, 16))
        return KM_ERR_OUT_OF_MEMORY;
    cap = b->cap_cands;
    if (KM_ARRAY_GROW(b->costs, cap, n_cands, 16))
        return KM_ERR_OUT_OF_MEMORY;
    cap = b->cap_cands;
    if (KM_ARRAY_GROW(b->states, cap, n_cands, 16))
        return KM_ERR_OUT_OF_MEMORY;
    cap = b->cap_cands;
    if (KM_ARRAY_GROW(b->rcands, cap, n_cands, 16))
        return KM_ERR_OUT_OF_MEMORY;
    b->cap_cands = cap;
    return KM_OK;
}

/* A stamp no worker in b->seen carries yet. */
uint32_t km_srv_scratch_next_stamp(km_server *s, batch_scratch *b)
{
    if (++b->candidate_stamp == 0) { /* wrapped: no stale stamp may match */
        memset(b->seen, 0, s->cfg.max_workers * sizeof *b->seen);
        b->candidate_stamp = 1;
    }
    return b->candidate_stamp;
}

/* Apply approximate-mode updates to pool p's index. The index refuses a batch as a whole (its
 * memory cap): km_approx then assumes pairs the index lacks, or the index keeps pairs km_approx
 * evicted, and a later decision touching such a pair only refreshes it, which stores nothing. So
 * every worker the refused updates name is cleared on both sides (approx.h) and learns again from
 * its next decisions. Returns km_index_apply's status. Scheduler role and admin_lock held. */
/* Clear, on both sides, every worker of pool p that updates[0..n) name (updates naming workers of
 * other pools are passed over). Scheduler role and admin_lock held. */
static void approx_forget(km_server *s, pool *p, uint32_t pool_index, batch_scratch *b,
                          const km_update *updates, size_t n)
{
    uint32_t stamp = km_srv_scratch_next_stamp(s, b);
    km_approx_updates_clear(&p->approx_updates);
    for (size_t i = 0; i < n; i++) {
        uint32_t w = updates[i].worker;
        if (w >= s->cfg.max_workers || !s->workers[w].used || s->workers[w].pool != pool_index)
            continue;
        if (b->seen[w] != stamp) {
            b->seen[w] = stamp;
            km_approx_clear_worker(p->approx, w, &p->approx_updates);
        }
    }
    if (km_index_apply(p->index, p->approx_updates.updates, p->approx_updates.n_updates, NULL))
        km_srv_log(s, KM_LOG_WARNING "pool %s: clearing approximate-mode workers: %s", p->name,
                   km_index_last_error(p->index));
    km_approx_updates_clear(&p->approx_updates);
}

static int approx_apply(km_server *s, pool *p, uint32_t pool_index, batch_scratch *b,
                        const km_update *updates, size_t n)
{
    int rc = km_index_apply(p->index, updates, n, NULL);
    if (rc == KM_OK)
        return KM_OK;
    km_srv_log(s, KM_LOG_WARNING
               "pool %s: approximate-mode updates refused: %s; the blocks assumed on their "
               "workers are forgotten", p->name, km_index_last_error(p->index));
    approx_forget(s, p, pool_index, b, updates, n);
    return rc;
}

static void run_batch(km_server *s, job *jobs, batch_scratch *b)
{
    uint64_t t0 = now_ns();
    uint32_t n_routes = 0;
    for (job *j = jobs; j; j = j->next) {
        KM_SRV_STAGE(j, batch);
        km_histogram_observe(s->m_queue_seconds, (double)(t0 - j->enqueued_ns) / 1e9);
        if (!j->shed) {
            n_routes += j->n_routes;
            continue;
        }
        /* Answered as a whole (km_srv_job_encode_reply): one ERROR frame, nothing scored. */
        j->shed_wait_ns = t0 - j->enqueued_ns;
        atomic_fetch_add(&s->st.shed_wait, j->n_routes);
        km_counter_add(s->m_shed_wait, j->n_routes);
    }
    pthread_mutex_lock(&s->admin_lock);
    s->batch_stamp++;
    for (uint32_t i = 0; i < s->n_pools; i++)
        s->pools[i]->n_requests = 0;
    /* Requests per pool, in job order. */
    for (job *j = jobs; j; j = j->next)
        for (uint32_t k = 0; !j->shed && k < j->n_routes; k++) {
            route_job *r = &j->routes[k];
            if (r->status != KM_OK)
                continue;
            if (r->pool >= s->n_pools || s->pools[r->pool]->uid != r->pool_uid) {
                /* Pools removed while it was queued moved the others down. */
                uint32_t i = 0;
                while (i < s->n_pools && s->pools[i]->uid != r->pool_uid)
                    i++;
                if (i == s->n_pools) {
                    km_srv_route_fail(r, KM_ERR_NOT_FOUND, "the pool was removed");
                    continue;
                }
                r->pool = i;
            }
            pool *p = s->pools[r->pool];
            if (KM_ARRAY_GROW(p->requests, p->requests_capacity, p->n_requests + 1, 16)) {
                km_srv_route_fail(r, KM_ERR_OUT_OF_MEMORY, "batch");
                continue;
            }
            p->requests[p->n_requests].hashes = r->hashes;
            p->requests[p->n_requests].n_hashes = r->n_hashes;
            p->n_requests++;
        }
    for (uint32_t i = 0; i < s->n_pools; i++) {
        pool *p = s->pools[i];
        if (!p->n_requests)
            continue;
        int rc = km_index_match_batch(p->index, p->requests, p->n_requests, &p->results);
        if (rc != KM_OK) {
            km_srv_log(s, KM_LOG_ERROR
                       "pool %s: scoring failed: %s", p->name, km_index_last_error(p->index));
            p->n_requests = SIZE_MAX; /* marks the failure below */
        }
    }
    uint64_t scored = now_ns();
    for (job *j = jobs; j; j = j->next)
        KM_SRV_STAGE(j, scored);
    size_t *cursor = calloc(s->n_pools ? s->n_pools : 1, sizeof *cursor);
    km_approx_updates_clear(&b->updates);
    for (job *j = jobs; j; j = j->next) {
        if (j->shed)
            continue;
        j->decisions = km_srv_job_alloc(j, (j->n_routes ? j->n_routes : 1) * sizeof *j->decisions);
        if (j->decisions)
            memset(j->decisions, 0, j->n_routes * sizeof *j->decisions);
        for (uint32_t k = 0; k < j->n_routes; k++) {
            route_job *r = &j->routes[k];
            if (r->status != KM_OK || !cursor || !j->decisions) {
                if (r->status == KM_OK)
                    km_srv_route_fail(r, KM_ERR_OUT_OF_MEMORY, "batch");
                continue;
            }
            pool *p = s->pools[r->pool];
            size_t q = cursor[r->pool]++;
            if (p->n_requests == SIZE_MAX) {
                km_srv_route_fail(r, KM_ERR_INTERNAL, "scoring failed: %s",
                                  km_index_last_error(p->index));
                continue;
            }
            /* active_lock per route, not per batch: the loop thread's lifecycle reports
             * (DISPATCHED, FIRST_TOKEN, FINISHED for every request) wait one decision at most. */
            pthread_mutex_lock(&s->active_lock);
            km_srv_decide_route(s, j, r, p, &p->results.requests[q], b, &j->decisions[k], scored);
            pthread_mutex_unlock(&s->active_lock);
        }
    }
    free(cursor);
    /* Approximate-mode learning: what this batch's decisions taught, one index batch per pool.
     * Without room to split them by pool, what they taught is forgotten on both sides, as when the
     * index refuses them, so km_approx and the index never disagree. */
    if (b->updates.n_updates &&
        KM_ARRAY_GROW(b->pool_updates, b->cap_pool_updates, b->updates.n_updates, 16) != KM_OK) {
        km_srv_log(s, KM_LOG_WARNING "out of memory sorting %zu approximate-mode updates by "
                   "pool; the blocks assumed on their workers are forgotten",
                   b->updates.n_updates);
        for (uint32_t i = 0; i < s->n_pools; i++)
            approx_forget(s, s->pools[i], i, b, b->updates.updates, b->updates.n_updates);
    } else if (b->updates.n_updates) {
        for (uint32_t i = 0; i < s->n_pools; i++) {
            size_t n = 0;
            for (size_t u = 0; u < b->updates.n_updates; u++) {
                const km_update *up = &b->updates.updates[u];
                if (up->worker < s->cfg.max_workers && s->workers[up->worker].used &&
                    s->workers[up->worker].pool == i)
                    b->pool_updates[n++] = *up;
            }
            if (!n)
                continue;
            approx_apply(s, s->pools[i], i, b, b->pool_updates, n);
        }
    }
    pthread_mutex_unlock(&s->admin_lock);
    uint64_t t1 = now_ns();
    for (job *j = jobs; j; j = j->next)
        KM_SRV_STAGE(j, decided);
    atomic_fetch_add(&s->st.batches, 1);
    km_histogram_observe(s->m_batch_routes, n_routes);
    km_histogram_observe(s->m_batch_seconds, (double)(t1 - t0) / 1e9);
}

/* Expire due active work, slice by slice, at most `limit` entries (scheduler role held). True
 * when it stopped at the limit (more may be due). */
static bool expire_due(km_server *s, uint32_t limit)
{
    uint32_t ended = 0;
    while (ended < limit) {
        size_t n = 0;
        uint32_t slice = limit - ended < EXPIRY_SLICE ? limit - ended : EXPIRY_SLICE;
        pthread_mutex_lock(&s->active_lock);
        km_active_expire_some(s->active, now_ns(), slice, km_srv_record_expired, s, &n);
        pthread_mutex_unlock(&s->active_lock);
        ended += (uint32_t)n;
        if (n < slice)
            return false;
    }
    return true;
}

/* Router overrides queued by lifecycle reports (lesson_queue): each teaches its worker, if it is
 * still the same approximate-mode worker, in the order they were reported. Scheduler role and
 * admin_lock held. */
static void apply_lessons(km_server *s, batch_scratch *b, uint64_t now)
{
    if (!atomic_load(&s->lessons_queued))
        return;
    pthread_mutex_lock(&s->active_lock);
    dispatch_lesson *newest = s->lessons;
    s->lessons = NULL;
    atomic_store(&s->lessons_queued, false);
    pthread_mutex_unlock(&s->active_lock);
    /* Queued newest first: taught oldest first, so a worker's latest request is its most recently
     * touched prefix (the last its capacity evicts), as if each had been taught when reported. */
    dispatch_lesson *l = NULL;
    uint64_t released_bytes = 0;
    while (newest) {
        dispatch_lesson *next = newest->next;
        newest->next = l;
        l = newest;
        newest = next;
    }
    while (l) {
        dispatch_lesson *next = l->next;
        worker_slot *w = &s->workers[l->worker];
        if (w->used && !w->events && w->incarnation == l->incarnation) {
            pool *p = s->pools[w->pool];
            km_approx_updates_clear(&b->updates);
            int rc = km_approx_record(p->approx, l->worker, l->hashes, l->n_hashes, now, &b->updates);
            if (rc == KM_OK && b->updates.n_updates)
                rc = approx_apply(s, p, w->pool, b, b->updates.updates,
                                  b->updates.n_updates);
            km_approx_updates_clear(&b->updates);
            if (rc == KM_OK)
                km_srv_cluster_publish_prediction(s, p, l->worker, true, l->hashes, l->n_hashes);
            if (rc == KM_OK)
                atomic_fetch_add(&s->st.dispatch_learned, 1);
            else
                atomic_fetch_add(&s->st.dispatch_unlearned, 1);
        }
        released_bytes += (uint64_t)l->n_hashes * sizeof *l->hashes;
        free(l);
        l = next;
    }
    pthread_mutex_lock(&s->active_lock);
    s->attempt_cache.hash_bytes -= released_bytes;
    pthread_mutex_unlock(&s->active_lock);
}

/* Other instances' approximate-mode predictions (cluster_view.c), in the order received: each
 * teaches its worker as this instance's own decision would, when the pool and worker exist here
 * and the worker is in approximate mode (a worker fed by KV events ignores them: observations
 * win). Scheduler role and admin_lock held. */
static void apply_remote_predictions(km_server *s, batch_scratch *b, uint64_t now)
{
    remote_prediction *r = km_srv_cluster_take_predictions(s);
    while (r) {
        remote_prediction *next = r->next;
        int at = km_srv_pool_find(s, r->pool);
        worker_slot *w = r->worker < s->cfg.max_workers ? &s->workers[r->worker] : NULL;
        if (at < 0 || !w || !w->used || w->pool != (uint32_t)at) {
            km_srv_cluster_prediction_outcome(s, r, SRV_PREDICTION_REFUSED);
        } else if (w->events) {
            km_srv_cluster_prediction_outcome(s, r, SRV_PREDICTION_OBSERVED);
        } else {
            pool *p = s->pools[at];
            km_approx_updates_clear(&b->updates);
            int rc = km_approx_record(p->approx, r->worker, r->hashes, r->n_hashes, now,
                                      &b->updates);
            if (rc == KM_OK && b->updates.n_updates)
                rc = approx_apply(s, p, w->pool, b, b->updates.updates,
                                  b->updates.n_updates);
            km_approx_updates_clear(&b->updates);
            /* Not taught (the index's memory cap, no memory): approx_apply has made the worker
             * forget its assumed blocks, as for a local decision. */
            km_srv_cluster_prediction_outcome(s, r, rc == KM_OK ? SRV_PREDICTION_APPLIED
                                                                : SRV_PREDICTION_DROPPED);
        }
        free(r);
        r = next;
    }
}

/* A pool's event flush failed: one log line per FLUSH_LOG_INTERVAL_NS at most, saying how many
 * failures went unlogged since the last (a cause that lasts, the index at its memory cap, fails
 * every flush; the per-worker counts are in /status and /metrics). */
#define FLUSH_LOG_INTERVAL_NS (UINT64_C(10) * 1000000000u)

static void log_flush_failure(km_server *s, pool *p, const char *what, const char *detail,
                              uint64_t now)
{
    if (p->flush_logged_ns && now - p->flush_logged_ns < FLUSH_LOG_INTERVAL_NS) {
        p->flush_failures_unlogged++;
        return;
    }
    if (p->flush_failures_unlogged)
        km_srv_log(s, KM_LOG_WARNING
                   "pool %s: %s: %s (and %" PRIu64 " more failures in the last %.0f s)",
                   p->name, what, detail, p->flush_failures_unlogged,
                   (double)(now - p->flush_logged_ns) / 1e9);
    else
        km_srv_log(s, KM_LOG_WARNING "pool %s: %s: %s", p->name, what, detail);
    p->flush_logged_ns = now;
    p->flush_failures_unlogged = 0;
}

/* The scheduler role's chores before scoring: apply received events (and the progress their
 * stores tell of queued prefills), expire approximate-mode pairs, and (expire_limit > 0) expire
 * active work (expire_due). */
static void housekeeping(km_server *s, batch_scratch *b, uint32_t expire_limit)
{
    if (expire_limit)
        (void)expire_due(s, expire_limit);
    uint64_t now = now_ns();
    pthread_mutex_lock(&s->admin_lock);
    for (uint32_t i = 0; i < s->n_pools; i++) {
        pool *p = s->pools[i];
        if (p->sub) {
            int rc = km_subscriber_flush(p->sub, NULL);
            if (rc != KM_OK)
                log_flush_failure(s, p, "applying events", km_subscriber_last_error(p->sub), now);
        }
        if (p->local_feed) {
            pthread_mutex_lock(&p->local_lock);
            int rc = km_feed_flush(p->local_feed, now, NULL);
            if (rc != KM_OK)
                log_flush_failure(s, p, "applying in-process events",
                                  km_feed_last_error(p->local_feed), now);
            pthread_mutex_unlock(&p->local_lock);
        }
        if (km_approx_next_expiry(p->approx) <= now) {
            km_approx_updates_clear(&b->updates);
            if (km_approx_expire(p->approx, now, &b->updates, NULL) == KM_OK && b->updates.n_updates)
                approx_apply(s, p, i, b, b->updates.updates, b->updates.n_updates);
            km_approx_updates_clear(&b->updates);
        }
    }
    apply_lessons(s, b, now);
    apply_remote_predictions(s, b, now);
    if (atomic_load(&s->stored_wanted)) {
        pthread_mutex_lock(&s->active_lock);
        km_srv_apply_stored(s);
        pthread_mutex_unlock(&s->active_lock);
    }
    pthread_mutex_unlock(&s->admin_lock);
}

/* Free the scratch's arrays and zero it (the server being destroyed). */
void km_srv_scratch_free(batch_scratch *b)
{
    free(b->cands);
    free(b->costs);
    free(b->states);
    free(b->rcands);
    free(b->pool_updates);
    free(b->seen);
    km_approx_updates_free(&b->updates);
    memset(b, 0, sizeof *b);
}

/* Take whole frames from the queue, up to max_batch_routes (a bigger frame goes alone). Frames
 * at the head that waited past max_queue_wait_ms come too, marked shed, outside that cap: they
 * are answered KM_ERR_OVERLOADED without being scored, so an overload drains at the cost of an
 * answer each and a route behind them waits about the deadline at most. Called with queue_lock
 * held. */
static job *take_jobs(km_server *s)
{
    job *take = NULL, **tail = &take;
    uint32_t routes = 0;
    uint64_t taken = 0;
    uint64_t deadline_ns = (uint64_t)s->cfg.max_queue_wait_ms * 1000000u, now = now_ns();
    while (s->queue_head) {
        job *j = s->queue_head;
        j->shed = deadline_ns && now - j->enqueued_ns > deadline_ns;
        if (!j->shed && routes != 0 && routes + j->n_routes > s->cfg.max_batch_routes)
            break;
        s->queue_head = j->next;
        if (j == s->queue_light_tail)
            s->queue_light_tail = NULL;
        if (j->behind)
            j->conn->queued_behind--;
        j->next = NULL;
        *tail = j;
        tail = &j->next;
        if (!j->shed)
            routes += j->n_routes;
        taken += j->n_routes;
        if (j->n_routes > s->inline_routes)
            s->queued_big_frames--;
    }
    if (!s->queue_head)
        s->queue_tail = NULL;
    s->queued_routes -= taken;
    return take;
}

static void *scheduler_main(void *arg)
{
    km_server *s = arg;
    uint64_t next_tick = now_ns() + SCHEDULER_TICK_MS * UINT64_C(1000000);
    for (;;) {
        pthread_mutex_lock(&s->queue_lock);
        /* Run when the role is free and there is something to do: frames, received events, or
         * the periodic tick (approximate-mode expiry). A wake-up for nothing (the loop thread
         * finished a batch inline, a spurious one) goes back to sleep without housekeeping. */
        bool tick = false;
        for (;;) {
            if (s->scheduler_stop && !s->queue_head && !s->scheduler_busy)
                break;
            tick = now_ns() >= next_tick;
            if (!s->scheduler_busy && (s->queue_head || s->events_pending || tick))
                break;
            if (s->trim_pending && !s->queue_head)
                break; /* needs no role: inline batches go on meanwhile */
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += SCHEDULER_TICK_MS * 1000000L;
            if (ts.tv_nsec >= 1000000000L) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000L;
            }
            pthread_cond_timedwait(&s->queue_cond, &s->queue_lock, &ts);
        }
        if (s->scheduler_stop && !s->queue_head && !s->scheduler_busy) {
            pthread_mutex_unlock(&s->queue_lock);
            break;
        }
        if (s->trim_pending && !s->queue_head) {
            s->trim_pending = false;
            pthread_mutex_unlock(&s->queue_lock);
            malloc_trim(0);
            atomic_fetch_add(&s->st.drain_releases, 1); /* counted once the memory is back */
            continue;
        }
        if (tick)
            next_tick = now_ns() + SCHEDULER_TICK_MS * UINT64_C(1000000);
        uint64_t queued = s->queued_routes;
        job *take = take_jobs(s);
        uint32_t taken = (uint32_t)(queued - s->queued_routes); /* shed frames included */
        s->scheduler_busy = true; /* housekeeping alone holds the role too: it uses the scratch */
        s->events_pending = false; /* housekeeping below flushes them */
        pthread_mutex_unlock(&s->queue_lock);

        /* Before a batch, active work too: twice the batch's routes (at least a slice, at most
         * EXPIRY_PER_PASS), which keeps up with any decision rate without holding the batch's own
         * routes up for more. A pass for the tick alone leaves it to the loop thread. */
        uint32_t expire = 2 * taken < EXPIRY_SLICE ? EXPIRY_SLICE : 2 * taken;
        housekeeping(s, &s->scratch, take ? (expire < EXPIRY_PER_PASS ? expire : EXPIRY_PER_PASS) : 0);
        if (take) {
            run_batch(s, take, &s->scratch);
            /* A small frame (at most SCHEDULER_REPLY_ROUTES routes) is answered here when its
             * batch is small too or nothing is queued: its reply encoded and written into its
             * socket now (km_srv_job_hand_back), so it waits for no wake-up of the loop thread,
             * which on a machine short of cores waits for a time slice; a small reply delays the
             * next batch by microseconds. Bigger frames' replies go out together from the loop
             * thread, so their clients' next frames arrive together for the next full batch; and
             * behind a big batch with frames queued (a backlog), every reply is encoded on the
             * loop thread, overlapping the next batch's scoring. With nothing queued this thread
             * encodes them all (it would only wait). */
            pthread_mutex_lock(&s->queue_lock);
            bool nothing_queued = s->queue_head == NULL;
            pthread_mutex_unlock(&s->queue_lock);
            bool small_batch = taken <= SCHEDULER_REPLY_ROUTES;
            for (job *j = take; j; j = j->next) {
                bool write_here =
                    j->n_routes <= SCHEDULER_REPLY_ROUTES && (small_batch || nothing_queued);
                if (write_here || nothing_queued) {
                    km_srv_job_encode_reply(s, j);
                    j->encoded = true;
                }
                KM_SRV_STAGE(j, handed);
                km_srv_job_hand_back(j, write_here);
            }
            pthread_mutex_lock(&s->done_lock);
            if (s->done_tail)
                s->done_tail->next = take;
            else
                s->done_head = take;
            job *last = take;
            while (last->next)
                last = last->next;
            s->done_tail = last;
            pthread_mutex_unlock(&s->done_lock);
        }
        pthread_mutex_lock(&s->queue_lock);
        s->scheduler_busy = false;
        pthread_mutex_unlock(&s->queue_lock);
        if (take)
            uv_async_send(&s->wake);
    }
    return NULL;
}

/* One slice of due active work (an `expired` outcome record each) on the loop thread, holding the
 * scheduler role for it. True when a full slice ended (more may be due); false too when the role
 * is busy: the scheduler thread expires before each of its batches. */
static bool loop_expire_slice(km_server *s)
{
    pthread_mutex_lock(&s->queue_lock);
    if (s->scheduler_busy) {
        pthread_mutex_unlock(&s->queue_lock);
        return false;
    }
    s->scheduler_busy = true;
    pthread_mutex_unlock(&s->queue_lock);
    bool more = expire_due(s, EXPIRY_SLICE);
    pthread_mutex_lock(&s->queue_lock);
    s->scheduler_busy = false;
    if (s->queue_head || s->events_pending) /* work that arrived meanwhile is the scheduler's */
        pthread_cond_signal(&s->queue_cond);
    pthread_mutex_unlock(&s->queue_lock);
    return more;
}

static void on_expiry_more(uv_idle_t *h)
{
    if (!loop_expire_slice(h->data))
        uv_idle_stop(h);
}

/* Memory back after a drain: once active work has fallen to an eighth of a peak of at least
 * DRAIN_RELEASE_MIN entries, the caches that work filled (attempts, id buffers) are freed, the
 * active-work slab and maps too when nothing is in flight (loop thread), and the heap's free
 * memory is handed back to the system by the scheduler thread (malloc_trim walks the whole heap:
 * milliseconds that would hold every route the loop thread serves meanwhile). */
#define DRAIN_RELEASE_MIN 4096u

static void release_after_drain(km_server *s)
{
    pthread_mutex_lock(&s->active_lock);
    km_active_stats st;
    km_active_get_stats(s->active, &st);
    if (st.entries > s->active_peak)
        s->active_peak = st.entries;
    bool drained = s->active_peak >= DRAIN_RELEASE_MIN && st.entries * 8 <= s->active_peak;
    if (drained) {
        km_active_release_idle(s->active);
        km_srv_attempt_cache_free(&s->attempt_cache);
        if (st.entries == 0) {
            km_u64map_free(&s->attempts_by_decision);
            km_u64map_init(&s->attempts_by_decision, &s->attempts_memory);
        }
        s->active_peak = st.entries;
    }
    pthread_mutex_unlock(&s->active_lock);
    if (drained) {
        pthread_mutex_lock(&s->queue_lock);
        s->trim_pending = true;
        pthread_cond_signal(&s->queue_cond);
        pthread_mutex_unlock(&s->queue_lock);
    }
}

static void on_expiry_tick(uv_timer_t *t)
{
    km_server *s = t->data;
    km_srv_conns_sweep(s, now_ns());
    if (!uv_is_active((uv_handle_t *)&s->expiry_more) && loop_expire_slice(s))
        uv_idle_start(&s->expiry_more, on_expiry_more); /* the rest, a slice per loop pass */
    release_after_drain(s);
}

/* After the loop iteration's reads (a uv_check callback): the queued frames either run here at
 * once, when the scheduler role is free and each holds at most inline_routes routes (up to
 * max_batch_routes of them in one batch; the rest go to the scheduler thread), or, when some frame
 * is bigger, go to the scheduler thread with one wake-up. Inline, a lone route costs no thread
 * hand-off either way (two wake-ups fewer), and neither does a burst of small frames that queued
 * while this thread was held up; big frames go to the scheduler, so decoding and encoding on this
 * thread overlap their scoring. */
static void on_dispatch(uv_check_t *h)
{
    km_server *s = h->data;
    if (!s->dispatch_pending)
        return;
    s->dispatch_pending = false;
    pthread_mutex_lock(&s->queue_lock);
    if (s->scheduler_busy || !s->queue_head || s->queued_big_frames) {
        pthread_cond_signal(&s->queue_cond);
        pthread_mutex_unlock(&s->queue_lock);
        return;
    }
    job *take = take_jobs(s);
    s->scheduler_busy = true;
    s->events_pending = false; /* housekeeping below flushes them */
    pthread_mutex_unlock(&s->queue_lock);
    housekeeping(s, &s->scratch, 0); /* active work: the expiry timer's, between passes */
    run_batch(s, take, &s->scratch);
    pthread_mutex_lock(&s->queue_lock);
    s->scheduler_busy = false;
    if (s->queue_head || s->events_pending) /* work that arrived meanwhile is the scheduler's */
        pthread_cond_signal(&s->queue_cond);
    pthread_mutex_unlock(&s->queue_lock);
    atomic_fetch_add(&s->st.inline_batches, 1);
    /* Jobs the scheduler thread handed back before this batch took the role come first: a
     * connection's replies leave in the order its frames were taken. */
    km_srv_deliver_done(s);
#ifdef KM_SRV_STAGE_TRACE
    for (job *j = take; j; j = j->next) {
        KM_SRV_STAGE(j, handed);
        j->stages.on_loop = true;
    }
#endif
    km_srv_deliver_jobs(s, take);
}

/* Start the scheduler role (km_server_create, once the loop and its listeners exist): the loop
 * thread's dispatch check and expiry timer, the batch scratch, and the scheduler thread. */
int km_srv_scheduler_start(km_server *s, char *why, size_t why_size)
{
    uv_check_init(&s->loop, &s->dispatch);
    s->dispatch.data = s;
    uv_check_start(&s->dispatch, on_dispatch);
    uv_unref((uv_handle_t *)&s->dispatch); /* it alone does not keep the loop running */
    s->dispatch_inited = true;
    uv_timer_init(&s->loop, &s->expiry_timer);
    s->expiry_timer.data = s;
    uv_timer_start(&s->expiry_timer, on_expiry_tick, EXPIRY_TICK_MS, EXPIRY_TICK_MS);
    uv_unref((uv_handle_t *)&s->expiry_timer);
    uv_idle_init(&s->loop, &s->expiry_more);
    s->expiry_more.data = s;
    uv_unref((uv_handle_t *)&s->expiry_more); /* neither keeps the loop running */
    s->expiry_timer_inited = true;
    km_approx_updates_init(&s->scratch.updates);
    s->scratch.seen = calloc(s->cfg.max_workers, sizeof *s->scratch.seen);
    if (!s->scratch.seen)
        return km_why(why, why_size, KM_ERR_OUT_OF_MEMORY, "scheduler scratch");
    s->inline_routes = s->cfg.inline_routes < s->cfg.max_batch_routes ? s->cfg.inline_routes
                                                                       : s->cfg.max_batch_routes;
    if (pthread_create(&s->scheduler, NULL, scheduler_main, s) != 0)
        return km_why(why, why_size, KM_ERR_INTERNAL, "starting the scheduler thread");
    pthread_setname_np(s->scheduler, "km-scheduler"); /* for top -H, perf, bench ipc */
    s->scheduler_started = true;
    return KM_OK;
}

/* Stop the scheduler thread and join it: it first decides what is queued and finishes the batch in
 * progress. Nothing when it is not running. */
void km_srv_scheduler_stop(km_server *s)
{
    if (!s->scheduler_started)
        return;
    pthread_mutex_lock(&s->queue_lock);
    s->scheduler_stop = true;
    pthread_cond_signal(&s->queue_cond);
    pthread_mutex_unlock(&s->queue_lock);
    pthread_join(s->scheduler, NULL);
    s->scheduler_started = false;
}

/* Close the role's handles on the loop (the dispatch check, the expiry timer and idle): they are
 * unreferenced, so a closing loop closes them explicitly. */
void km_srv_scheduler_close_handles(km_server *s)
{
    if (s->dispatch_inited && !uv_is_closing((uv_handle_t *)&s->dispatch))
        uv_close((uv_handle_t *)&s->dispatch, NULL);
    if (s->expiry_timer_inited && !uv_is_closing((uv_handle_t *)&s->expiry_timer)) {
        uv_close((uv_handle_t *)&s->expiry_timer, NULL);
        uv_close((uv_handle_t *)&s->expiry_more, NULL);
    }
}
