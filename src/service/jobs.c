/* SPDX-License-Identifier: Apache-2.0 */
/* Route jobs: a ROUTE frame copied out of its decoder into one job (pool chosen, token input
 * hashed on the loop thread), queued for the scheduler role; the job's bump-allocated memory;
 * its reply encoded from the decisions. */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvmatch/hash.h"
#include "kvmatch/server.h"
#include "kvmatch/version.h"
#include "service/server_internal.h"

/* Memory that lives as long as the job (16-byte aligned; freed with it by km_srv_job_free); NULL
 * when out of memory. The loop thread fills a job before queueing it, the scheduler role after. */
void *km_srv_job_alloc(job *j, size_t n)
{
    n = (n + 15) & ~(size_t)15;
    if (!j->chunks || j->chunks->size - j->chunks->used < n) {
        /* Chunks grow from 4 KB to 64 KB: a lone route needs about 1 KB, so a frame of one route
         * does not take a 64 KB block. */
        size_t step = j->chunks ? 2 * (j->chunks->size + sizeof(chunk)) : 4096;
        if (step > 64 * 1024)
            step = 64 * 1024;
        size_t size = n > step - sizeof(chunk) ? n : step - sizeof(chunk);
        chunk *c = malloc(sizeof *c + size);
        if (!c)
            return NULL;
        c->size = size;
        c->used = 0;
        c->next = j->chunks;
        j->chunks = c;
    }
    void *p = j->chunks->data + j->chunks->used;
    j->chunks->used += n;
    return p;
}

static char *job_strdup(job *j, const char *s)
{
    if (!s)
        return NULL;
    size_t n = strlen(s) + 1;
    char *p = km_srv_job_alloc(j, n);
    if (p)
        memcpy(p, s, n);
    return p;
}

/* The job, its reply and every km_srv_job_alloc block; NULL is a no-op. */
void km_srv_job_free(job *j)
{
    if (!j)
        return;
    km_frame_buffer_free(&j->reply);
    for (chunk *c = j->chunks; c;) {
        chunk *next = c->next;
        free(c);
        c = next;
    }
    free(j);
}

/* Every decision of a job whose reply the router never received ends its active work
 * (km_srv_end_undelivered). Loop thread, holding no lock. */
void km_srv_end_job_undelivered(km_server *s, const job *j)
{
    for (uint32_t i = 0; j->decisions && i < j->n_routes; i++) {
        if (j->routes[i].status == KM_OK && j->decisions[i].decision_id)
            km_srv_end_undelivered(s, j->decisions[i].decision_id);
        if (j->routes[i].status == KM_OK && j->decisions[i].has_warm_up)
            km_srv_end_undelivered(s, j->decisions[i].warm_up_decision_id);
    }
}

/* Mark a route failed: its reply is this status and formatted message (cut at 255 bytes). */
void km_srv_route_fail(route_job *r, int status, const char *fmt, ...)
{
    r->status = status;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->message, sizeof r->message, fmt, ap);
    va_end(ap);
}

/* On the loop thread, in parallel with the scheduler's next batch. */
void km_srv_job_encode_reply(km_server *s, job *j)
{
    if (j->shed) {
        char why[160];
        snprintf(why, sizeof why, "queued %.1f ms, past max_queue_wait_ms %u: not scored",
                 (double)j->shed_wait_ns / 1e6, s->cfg.max_queue_wait_ms);
        km_protocol_encode_error(j->msg_id, KM_ERR_OVERLOADED, why, &j->reply);
        return;
    }
    km_route_decision *ds = j->decisions;
    if (!ds) {
        km_protocol_encode_error(j->msg_id, KM_ERR_OUT_OF_MEMORY, "no memory for the decisions",
                                 &j->reply);
        return;
    }
    for (uint32_t i = 0; i < j->n_routes; i++) {
        route_job *r = &j->routes[i];
        if (r->status == KM_OK)
            continue;
        memset(&ds[i], 0, sizeof ds[i]);
        ds[i].status = r->status;
        ds[i].message = r->message;
        ds[i].request_id = r->request_id ? r->request_id : "";
        ds[i].attempt_id = r->attempt_id;
        atomic_fetch_add(&s->st.route_errors, 1);
        km_counter_add(s->m_route_errors, 1);
    }
    km_message msg;
    memset(&msg, 0, sizeof msg);
    msg.type = KM_MESSAGE_DECISION;
    msg.has_id = true;
    msg.id = j->msg_id;
    msg.decision.kvmatch_version = KVMATCH_VERSION;
    msg.decision.decisions = ds;
    msg.decision.n_decisions = j->n_routes;
    char why[256];
    int rc = km_protocol_encode(&msg, s->cfg.limits.max_frame_bytes, &j->reply, why, sizeof why);
    if (rc != KM_OK) {
        km_protocol_encode_error(j->msg_id, rc, why, &j->reply);
        j->decisions_lost = true;
    }
}

/* A ROUTE frame (loop thread): each route copied into one job, the job queued for the scheduler
 * role; refused whole while draining or when max_queued_routes would be exceeded. */
void km_srv_handle_route(conn *c, const km_message *m)
{
    km_server *s = c->server;
    const km_route_batch *rb = &m->route;
    if (s->draining) {
        km_srv_send_error(c, m->id, KM_ERR_SHUTTING_DOWN, "the service is shutting down");
        return;
    }
    /* One connection's flood must not fill the queue for everyone: its budget is checked first. */
    if (s->cfg.max_connection_routes &&
        c->routes_in_flight + rb->n_routes > s->cfg.max_connection_routes) {
        atomic_fetch_add(&s->st.shed_connection, rb->n_routes);
        km_counter_add(s->m_shed_connection, rb->n_routes);
        km_srv_send_error(c, m->id, KM_ERR_OVERLOADED,
                          "this connection has %" PRIu64 " routes queued or deciding "
                          "(max_connection_routes %u)",
                          c->routes_in_flight, s->cfg.max_connection_routes);
        return;
    }
    pthread_mutex_lock(&s->queue_lock);
    uint64_t queued = s->queued_routes;
    pthread_mutex_unlock(&s->queue_lock);
    if (queued + rb->n_routes > s->cfg.max_queued_routes) {
        atomic_fetch_add(&s->st.overloaded, 1);
        km_counter_add(s->m_overloaded, 1);
        km_srv_send_error(c, m->id, KM_ERR_OVERLOADED,
                          "%" PRIu64 " routes are queued (max_queued_routes %u)", queued,
                          s->cfg.max_queued_routes);
        return;
    }
    job *j = calloc(1, sizeof *j);
    if (!j) {
        km_srv_send_error(c, m->id, KM_ERR_OUT_OF_MEMORY, "queueing the routes");
        return;
    }
    km_frame_buffer_init(&j->reply);
    j->conn = c;
    j->msg_id = m->id;
    j->n_routes = rb->n_routes;
    j->routes = km_srv_job_alloc(j, rb->n_routes * sizeof *j->routes);
    if (!j->routes) {
        km_srv_job_free(j);
        km_srv_send_error(c, m->id, KM_ERR_OUT_OF_MEMORY, "queueing the routes");
        return;
    }
    memset(j->routes, 0, rb->n_routes * sizeof *j->routes);
    atomic_fetch_add(&s->st.routes, rb->n_routes);
    /* No admin_lock: the pool metadata read here is written only on this thread (the lock order
     * in server_internal.h), and the scheduler may hold the lock for a whole batch. */
    for (uint32_t i = 0; i < rb->n_routes; i++) {
        const km_route_request *in = &rb->routes[i];
        route_job *r = &j->routes[i];
        r->request_id = job_strdup(j, in->request_id ? in->request_id : "");
        r->attempt_id = job_strdup(j, in->attempt_id);
        if (in->status != KM_OK) {
            km_srv_route_fail(r, in->status, "%s",
                              in->message ? in->message : km_strerror(in->status));
            continue;
        }
        r->model = job_strdup(j, in->model);
        r->endpoint = job_strdup(j, in->endpoint);
        r->policy_name = job_strdup(j, in->policy);
        int pi = -1;
        if (in->pool)
            pi = km_srv_pool_find(s, in->pool);
        else if (in->model)
            pi = km_srv_pool_for_model(s, in->model);
        /* Only a route naming neither falls back: a model no pool serves is refused, never
         * decided on a pool serving another model. */
        if (pi < 0 && !in->pool && !in->model && s->default_pool)
            pi = km_srv_pool_find(s, s->default_pool);
        if (pi < 0 && !in->pool && !in->model && !s->default_pool && s->n_pools > 0)
            pi = 0;
        if (pi < 0) {
            if (in->pool)
                km_srv_route_fail(r, KM_ERR_NOT_FOUND, "no pool %s", in->pool);
            else if (in->model)
                km_srv_route_fail(r, KM_ERR_NOT_FOUND, "no pool serves model %s", in->model);
            else
                km_srv_route_fail(r, KM_ERR_NOT_FOUND, "no pool: the route names none, and the "
                                  "default pool %s does not exist",
                                  s->default_pool ? s->default_pool : "(none)");
            continue;
        }
        pool *p = s->pools[pi];
        r->pool = (uint32_t)pi;
        r->pool_uid = p->uid;
        r->input = in->input;
        if (in->input == KM_ROUTE_INPUT_TOKENS) {
            size_t nb = in->n_tokens / p->block_size;
            r->hashes = km_srv_job_alloc(j, (nb ? nb : 1) * sizeof *r->hashes);
            if (!r->hashes) {
                km_srv_route_fail(r, KM_ERR_OUT_OF_MEMORY, "hashing");
                continue;
            }
            km_hash_config hc = {p->block_size, in->lora_name, in->cache_salt};
            size_t got = 0;
            int rc = km_hash_sequence_lookahead(&hc, p->hash_lookahead_tokens, in->tokens,
                                                in->n_tokens, 0, KM_NO_PARENT, NULL, r->hashes,
                                                &got);
            if (rc != KM_OK) {
                km_srv_route_fail(r, rc, "hashing the tokens: %s", km_strerror(rc));
                continue;
            }
            r->n_hashes = (uint32_t)got;
            /* The prompt is at least the tokens sent; 0 says nothing (as absent). */
            r->prompt_tokens = in->has_prompt_tokens && in->prompt_tokens > in->n_tokens
                                   ? in->prompt_tokens
                                   : in->n_tokens;
            r->has_prompt_tokens = true;
        } else {
            if (in->block_size && in->block_size != p->block_size) {
                km_srv_route_fail(r, KM_ERR_INVALID_ARGUMENT,
                                  "hashes were computed with block size %u; pool %s uses %u",
                                  in->block_size, p->name, p->block_size);
                continue;
            }
            r->hashes = km_srv_job_alloc(j, (in->n_hashes ? in->n_hashes : 1) * sizeof *r->hashes);
            if (!r->hashes) {
                km_srv_route_fail(r, KM_ERR_OUT_OF_MEMORY, "copying the hashes");
                continue;
            }
            memcpy(r->hashes, in->hashes, in->n_hashes * sizeof *r->hashes);
            r->n_hashes = in->n_hashes;
            /* n hashes cover at least n blocks and the lookahead tokens their last hash read; a
             * prompt_tokens of 0 says nothing (as absent). */
            uint64_t covered =
                in->n_hashes ? (uint64_t)in->n_hashes * p->block_size + p->hash_lookahead_tokens
                             : 0;
            r->has_prompt_tokens = in->has_prompt_tokens && in->prompt_tokens > 0;
            r->prompt_tokens = r->has_prompt_tokens && in->prompt_tokens > covered
                                   ? in->prompt_tokens
                                   : covered;
        }
        r->has_expected_output_tokens = in->has_expected_output_tokens;
        r->brief = in->brief;
        r->warm_ups = in->warm_ups;
        r->expected_output_tokens = in->expected_output_tokens;
        if (in->candidates) {
            r->candidates =
                km_srv_job_alloc(j, (in->n_candidates ? in->n_candidates : 1) * sizeof(uint32_t));
            if (!r->candidates) {
                km_srv_route_fail(r, KM_ERR_OUT_OF_MEMORY, "candidates");
                continue;
            }
            memcpy(r->candidates, in->candidates, in->n_candidates * sizeof(uint32_t));
            r->n_candidates = in->n_candidates;
            if (r->n_candidates == 0) {
                km_srv_route_fail(r, KM_ERR_INVALID_ARGUMENT, "candidates is empty");
                continue;
            }
        }
    }
    j->enqueued_ns = now_ns();
#ifdef KM_SRV_STAGE_TRACE
    j->stages.read = c->read_ns;
#endif
    c->jobs_in_flight++;
    c->routes_in_flight += j->n_routes;
    /* A frame of a connection with at most LIGHT_CONNECTION_ROUTES routes in flight (this one's
     * included) goes ahead of the frames of busier connections, after the light ones already
     * queued: a router sending a few routes at a time is not queued behind someone's flood. Never
     * ahead of its own connection's frames, though (queued_behind): a connection's frames are
     * taken, and so answered, in the order they came. */
    pthread_mutex_lock(&s->queue_lock);
    bool light = c->routes_in_flight <= LIGHT_CONNECTION_ROUTES && c->queued_behind == 0;
    if (!light) { /* at the tail, behind the light ones */
        j->behind = true;
        c->queued_behind++;
    }
    if (light && s->queue_head && s->queue_light_tail != s->queue_tail) {
        job **at = s->queue_light_tail ? &s->queue_light_tail->next : &s->queue_head;
        j->next = *at;
        *at = j;
        s->queue_light_tail = j;
    } else {
        if (s->queue_tail)
            s->queue_tail->next = j;
        else
            s->queue_head = j;
        s->queue_tail = j;
        if (light)
            s->queue_light_tail = j;
    }
    s->queued_routes += j->n_routes;
    if (j->n_routes > s->inline_routes)
        s->queued_big_frames++;
    pthread_mutex_unlock(&s->queue_lock);
    s->dispatch_pending = true; /* on_dispatch (scheduler.c) runs it or wakes the scheduler */
}
