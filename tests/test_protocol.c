/* SPDX-License-Identifier: Apache-2.0 */
/* The wire protocol (include/kvmatch/protocol.h, docs/PROTOCOL.md): random round trips of every
 * message type through the encoder, the frame reader and the decoder (compared field by field,
 * and re-encoded byte for byte); the frame reader under random chunkings; and the error cases:
 * truncation at every byte, a length over the maximum, zero length, a wrong type in every field of
 * every message (found by walking the encoded tree, so a field added later is covered too),
 * missing fields, unknown types, duplicate keys, hostile declared lengths, nesting, and limits.
 * Randomized tests print their seed (KM_TEST_SEED). */
#include <inttypes.h>
#include <stdio.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <msgpack.h>

#include "kvmatch/feed.h"
#include "kvmatch/hash.h"
#include "kvmatch/protocol.h"
#include "test_util.h"

/* ---- allocations owned by one test ------------------------------------------------------------- */

static void **owned;
static size_t n_owned, cap_owned;

static void *test_alloc(size_t bytes)
{
    void *p = calloc(1, bytes ? bytes : 1);
    cr_assert(p);
    if (n_owned == cap_owned) {
        cap_owned = cap_owned ? 2 * cap_owned : 256;
        owned = realloc(owned, cap_owned * sizeof *owned);
        cr_assert(owned);
    }
    owned[n_owned++] = p;
    return p;
}

static void free_owned(void)
{
    for (size_t i = 0; i < n_owned; i++)
        free(owned[i]);
    free(owned);
    owned = NULL;
    n_owned = cap_owned = 0;
}

/* ---- random content ---------------------------------------------------------------------------- */

/* A random string (printable, sometimes UTF-8, sometimes empty unless non_empty). */
static const char *rand_str(km_rng *r, bool non_empty)
{
    static const char *const pieces[] = {"a", "Z", "0", "-", "_", "/", " ", "\xc3\xa9", "\xe2\x82\xac", "x9"};
    uint32_t n = km_rng_below(r, 12) + (non_empty ? 1 : 0);
    char *s = test_alloc(4 * n + 1);
    for (uint32_t i = 0; i < n; i++)
        strcat(s, pieces[km_rng_below(r, 10)]);
    return s;
}

static const char *maybe_str(km_rng *r)
{
    return km_rng_percent(r, 50) ? rand_str(r, false) : NULL;
}

static uint64_t rand_u64(km_rng *r)
{
    switch (km_rng_below(r, 4)) {
    case 0: return km_rng_below(r, 128);
    case 1: return km_rng_below(r, 70000);
    case 2: return km_rng_next(r) >> km_rng_below(r, 64);
    default: return km_rng_percent(r, 50) ? UINT64_MAX : km_rng_next(r);
    }
}

/* A token or block count: what the protocol carries, 0..2^63-1, the edge included. */
static uint64_t rand_count(km_rng *r)
{
    return km_rng_percent(r, 10) ? (uint64_t)INT64_MAX : rand_u64(r) >> 1;
}

/* A route's token count: 0..KM_PROTOCOL_MAX_ROUTE_TOKENS, its largest one often. */
static uint64_t rand_route_tokens(km_rng *r)
{
    return km_rng_percent(r, 10) ? KM_PROTOCOL_MAX_ROUTE_TOKENS
                                 : rand_u64(r) % ((uint64_t)KM_PROTOCOL_MAX_ROUTE_TOKENS + 1);
}

static uint32_t rand_u32(km_rng *r)
{
    return km_rng_percent(r, 20) ? UINT32_MAX : (uint32_t)rand_u64(r);
}

static double rand_double(km_rng *r)
{
    switch (km_rng_below(r, 3)) {
    case 0: return 0.0;
    case 1: return (double)(int32_t)km_rng_next(r) / 7.0;
    default: return (double)km_rng_next(r) * 1e-300;
    }
}

static km_worker_load rand_load(km_rng *r)
{
    km_worker_load l = {rand_u32(r), rand_u64(r), rand_u64(r)};
    return l;
}

static void rand_route(km_rng *r, km_route_request *q)
{
    q->request_id = rand_str(r, true);
    q->attempt_id = maybe_str(r);
    q->model = maybe_str(r);
    q->pool = maybe_str(r);
    q->endpoint = maybe_str(r);
    if (km_rng_percent(r, 50)) {
        q->input = KM_ROUTE_INPUT_TOKENS;
        q->n_tokens = km_rng_below(r, 300);
        uint32_t *t = test_alloc(q->n_tokens * sizeof *t);
        for (uint32_t i = 0; i < q->n_tokens; i++)
            t[i] = rand_u32(r);
        q->tokens = t;
    } else {
        q->input = KM_ROUTE_INPUT_HASHES;
        q->n_hashes = km_rng_below(r, 40);
        uint64_t *h = test_alloc(q->n_hashes * sizeof *h);
        for (uint32_t i = 0; i < q->n_hashes; i++)
            h[i] = km_rng_next(r);
        q->hashes = h;
    }
    q->block_size = km_rng_percent(r, 50) ? 1 + km_rng_below(r, 64) : 0;
    q->lora_name = maybe_str(r);
    q->cache_salt = maybe_str(r);
    if (km_rng_percent(r, 50)) {
        q->n_candidates = km_rng_below(r, 9);
        uint32_t *c = test_alloc(q->n_candidates * sizeof *c);
        for (uint32_t i = 0; i < q->n_candidates; i++)
            c[i] = rand_u32(r);
        q->candidates = c;
    }
    q->policy = maybe_str(r);
    q->has_prompt_tokens = km_rng_percent(r, 50);
    q->prompt_tokens = q->has_prompt_tokens ? rand_route_tokens(r) : 0;
    q->has_expected_output_tokens = km_rng_percent(r, 50);
    q->expected_output_tokens = q->has_expected_output_tokens ? rand_route_tokens(r) : 0;
    q->brief = km_rng_percent(r, 50);
    q->warm_ups = km_rng_percent(r, 50);
}

static void rand_decision(km_rng *r, km_route_decision *d)
{
    d->request_id = maybe_str(r);
    d->attempt_id = maybe_str(r);
    if (km_rng_percent(r, 20)) {
        d->status = -(int)(1 + km_rng_below(r, 20));
        d->message = rand_str(r, false);
        return;
    }
    d->decision_id = rand_u64(r);
    d->pool = maybe_str(r);
    d->chosen_worker = rand_u32(r);
    d->chosen_depth = rand_u32(r);
    d->chosen_state = maybe_str(r);
    d->has_owner = km_rng_percent(r, 70);
    if (d->has_owner) {
        d->owner_worker = rand_u32(r);
        d->owner_depth = rand_u32(r);
        d->owner_state = maybe_str(r);
    }
    d->n_blocks = rand_u32(r);
    d->block_size = rand_u32(r);
    d->source = km_rng_percent(r, 50) ? KM_PREDICTION_EVENTS : KM_PREDICTION_APPROX;
    d->policy = maybe_str(r);
    d->reason = maybe_str(r);
    d->load_kind = maybe_str(r);
    d->load_scope = maybe_str(r);
    /* NAN: the policy weighed no load (round_robin); it travels as nil */
    d->load_value = km_rng_percent(r, 25) ? NAN : rand_double(r);
    d->n_candidates = km_rng_below(r, 6);
    km_candidate_score *c = test_alloc(d->n_candidates * sizeof *c);
    for (uint32_t i = 0; i < d->n_candidates; i++) {
        c[i].worker = rand_u32(r);
        c[i].depth = rand_u32(r);
        c[i].device_blocks = rand_u32(r);
        c[i].host_blocks = rand_u32(r);
        c[i].disk_blocks = rand_u32(r);
        c[i].load = rand_load(r);
        c[i].cost = km_rng_percent(r, 20) ? NAN : rand_double(r); /* NAN: round_robin, nil */
        c[i].state = maybe_str(r);
        c[i].eligible = km_rng_percent(r, 50);
    }
    d->candidates = c;
    d->has_warm_up = km_rng_percent(r, 30);
    if (d->has_warm_up) {
        d->warm_up_worker = rand_u32(r);
        d->warm_up_blocks = rand_u32(r);
        d->warm_up_tokens = rand_u64(r);
        d->warm_up_decision_id = rand_u64(r);
        d->warm_up_attempt_id = rand_str(r, false);
    }
}

static void rand_event(km_rng *r, km_lifecycle_event *e)
{
    e->kind = (km_lifecycle_kind)(1 + km_rng_below(r, 3));
    e->has_decision_id = km_rng_percent(r, 60);
    e->decision_id = e->has_decision_id ? rand_u64(r) : 0;
    e->request_id = !e->has_decision_id || km_rng_percent(r, 50) ? rand_str(r, true) : NULL;
    e->attempt_id = maybe_str(r);
    e->has_worker = km_rng_percent(r, 50);
    e->worker = e->has_worker ? rand_u32(r) : 0;
    e->has_elapsed_ms = km_rng_percent(r, 50);
    e->elapsed_ms = e->has_elapsed_ms ? fabs(rand_double(r)) : 0;
    if (e->kind != KM_LIFECYCLE_FINISHED)
        return;
    static const char *const reasons[] = {"stop", "length", ""};
    e->finish_reason = km_rng_percent(r, 70) ? reasons[km_rng_below(r, 3)] : NULL;
    e->done_seen = km_rng_percent(r, 70);
    e->has_http_status = km_rng_percent(r, 70);
    e->http_status = e->has_http_status ? (km_rng_percent(r, 80) ? 200 : 100 + km_rng_below(r, 500)) : 0;
    e->error = km_rng_percent(r, 20) ? rand_str(r, false) : NULL;
    km_outcome derived =
        km_outcome_from_stream(e->finish_reason, e->done_seen, e->has_http_status, e->http_status, e->error);
    /* As sent: the derived outcome, or one the rule allows to override it (never "complete"). */
    e->outcome = km_rng_percent(r, 50) ? derived : (km_outcome)(2 + km_rng_below(r, 3));
    e->has_cached_tokens = km_rng_percent(r, 50);
    e->cached_tokens = e->has_cached_tokens ? rand_count(r) : 0;
    e->has_prompt_tokens = km_rng_percent(r, 50);
    e->prompt_tokens = e->has_prompt_tokens ? rand_count(r) : 0;
    e->has_output_tokens = km_rng_percent(r, 50);
    e->output_tokens = e->has_output_tokens ? rand_count(r) : 0;
    e->retries = rand_u32(r);
}

static void rand_worker(km_rng *r, km_worker_info *w, bool runtime)
{
    w->pool = rand_str(r, true);
    w->worker = rand_u32(r);
    w->name = maybe_str(r);
    w->event_endpoint = maybe_str(r);
    w->replay_endpoint = maybe_str(r);
    w->has_dp_rank = km_rng_percent(r, 50);
    w->dp_rank = w->has_dp_rank ? rand_u32(r) : 0;
    w->has_healthy = km_rng_percent(r, 50);
    w->healthy = w->has_healthy && km_rng_percent(r, 50);
    if (!runtime)
        return;
    static const char *const breakers[] = {NULL, "closed", "open", "half_open"};
    w->breaker = breakers[km_rng_below(r, 4)];
    w->has_failures = km_rng_percent(r, 50);
    w->failures = w->has_failures ? rand_u32(r) : 0;
    w->has_eligible = km_rng_percent(r, 50);
    w->eligible = w->has_eligible && km_rng_percent(r, 50);
    w->state = maybe_str(r);
    w->has_blocks = km_rng_percent(r, 50);
    w->blocks = w->has_blocks ? rand_count(r) : 0;
    w->has_last_event_age_s = km_rng_percent(r, 50);
    w->last_event_age_s = w->has_last_event_age_s ? rand_double(r) : 0;
    w->has_load = km_rng_percent(r, 50);
    if (w->has_load)
        w->load = rand_load(r);
}

static void rand_pool(km_rng *r, km_pool_info *p)
{
    p->name = rand_str(r, true);
    p->model = maybe_str(r);
    p->block_size = km_rng_percent(r, 50) ? 1 + km_rng_below(r, 1000) : 0;
    p->hash_lookahead_tokens = km_rng_percent(r, 30) ? 1 + km_rng_below(r, KM_HASH_MAX_LOOKAHEAD) : 0;
    p->offload_chunk_blocks =
        km_rng_percent(r, 30) ? 1 + km_rng_below(r, KM_FEED_MAX_OFFLOAD_CHUNK_BLOCKS) : 0;
    p->policy = maybe_str(r);
    p->engine = maybe_str(r);
    p->n_params = km_rng_below(r, 5);
    km_param *params = test_alloc(p->n_params * sizeof *params);
    for (uint32_t i = 0; i < p->n_params; i++) {
        char *name = test_alloc(16);
        snprintf(name, 16, "p%u_%u", i, km_rng_below(r, 100));
        params[i].name = name;
        params[i].value = rand_double(r);
    }
    p->params = params;
}

static void rand_message(km_rng *r, km_message_type type, km_message *m)
{
    memset(m, 0, sizeof *m);
    m->type = type;
    m->has_id = true;
    m->id = rand_u64(r);
    uint32_t n = 1 + km_rng_below(r, 6);
    switch (type) {
    case KM_MESSAGE_HELLO:
        m->hello.protocol_version = rand_u32(r);
        m->hello.client_name = maybe_str(r);
        break;
    case KM_MESSAGE_WELCOME:
        m->welcome.protocol_version = rand_u32(r);
        m->welcome.kvmatch_version = rand_str(r, true);
        m->welcome.server_name = maybe_str(r);
        km_protocol_limits_init(&m->welcome.limits);
        m->welcome.limits.max_candidates = 1 + km_rng_below(r, 100000);
        m->welcome.limits.max_string_bytes = 1 + km_rng_below(r, 100000);
        break;
    case KM_MESSAGE_ROUTE: {
        km_route_request *q = test_alloc(n * sizeof *q);
        for (uint32_t i = 0; i < n; i++)
            rand_route(r, &q[i]);
        m->route.routes = q;
        m->route.n_routes = n;
        break;
    }
    case KM_MESSAGE_DECISION: {
        km_route_decision *d = test_alloc(n * sizeof *d);
        for (uint32_t i = 0; i < n; i++)
            rand_decision(r, &d[i]);
        m->decision.kvmatch_version = maybe_str(r);
        m->decision.decisions = d;
        m->decision.n_decisions = n;
        break;
    }
    case KM_MESSAGE_LIFECYCLE: {
        km_lifecycle_event *e = test_alloc(n * sizeof *e);
        for (uint32_t i = 0; i < n; i++)
            rand_event(r, &e[i]);
        m->lifecycle.events = e;
        m->lifecycle.n_events = n;
        break;
    }
    case KM_MESSAGE_ACK: {
        km_item_status *s = test_alloc(n * sizeof *s);
        for (uint32_t i = 0; i < n; i++)
            if (km_rng_percent(r, 40)) {
                s[i].status = -(int)(1 + km_rng_below(r, 20));
                s[i].message = rand_str(r, false);
            }
        m->ack.items = s;
        m->ack.n_items = n;
        break;
    }
    case KM_MESSAGE_WORKERS:
    case KM_MESSAGE_WORKER_LIST: {
        m->workers.action = type == KM_MESSAGE_WORKER_LIST ? KM_ADMIN_LIST
                                                           : (km_admin_action)(1 + km_rng_below(r, 4));
        if (type == KM_MESSAGE_WORKERS && m->workers.action == KM_ADMIN_LIST) {
            m->workers.pool = maybe_str(r);
            break;
        }
        km_worker_info *w = test_alloc(n * sizeof *w);
        for (uint32_t i = 0; i < n; i++)
            rand_worker(r, &w[i], type == KM_MESSAGE_WORKER_LIST);
        m->workers.workers = w;
        m->workers.n_workers = n;
        break;
    }
    case KM_MESSAGE_POOLS:
    case KM_MESSAGE_POOL_LIST: {
        static const km_admin_action actions[] = {KM_ADMIN_ADD, KM_ADMIN_UPDATE, KM_ADMIN_LIST};
        m->pools.action = type == KM_MESSAGE_POOL_LIST ? KM_ADMIN_LIST : actions[km_rng_below(r, 3)];
        if (type == KM_MESSAGE_POOLS && m->pools.action == KM_ADMIN_LIST)
            break;
        km_pool_info *p = test_alloc(n * sizeof *p);
        for (uint32_t i = 0; i < n; i++)
            rand_pool(r, &p[i]);
        m->pools.pools = p;
        m->pools.n_pools = n;
        break;
    }
    case KM_MESSAGE_STATUS:
        break;
    case KM_MESSAGE_STATUS_REPLY: {
        km_status_reply *s = &m->status_reply;
        s->kvmatch_version = rand_str(r, true);
        s->uptime_s = rand_double(r);
        s->ready = km_rng_percent(r, 50);
        s->connections = rand_u32(r);
        s->decisions = rand_u64(r);
        s->records_dropped = rand_u64(r);
        s->backend = maybe_str(r);
        n = km_rng_below(r, 4);
        km_worker_info *w = test_alloc(n * sizeof *w);
        for (uint32_t i = 0; i < n; i++)
            rand_worker(r, &w[i], true);
        s->workers = w;
        s->n_workers = n;
        break;
    }
    case KM_MESSAGE_ERROR:
        m->error.code = -(int)(1 + km_rng_below(r, 30));
        m->error.name = km_error_name(m->error.code);
        m->error.message = rand_str(r, false);
        break;
    case KM_MESSAGE_UNKNOWN: break;
    }
}

/* ---- field-by-field comparison ------------------------------------------------------------------ */

#define EQ_STR(a, b, what)                                                                         \
    KM_CHECK(((a) == NULL && (b) == NULL) || ((a) && (b) && strcmp((a), (b)) == 0),              \
             "%s: \"%s\" != \"%s\"", what, (a) ? (a) : "(null)", (b) ? (b) : "(null)")
#define EQ_NUM(a, b, what) KM_CHECK((a) == (b), "%s differs", what)

static void eq_load(const km_worker_load *a, const km_worker_load *b)
{
    EQ_NUM(a->in_flight, b->in_flight, "load.in_flight");
    EQ_NUM(a->pending_prefill_tokens, b->pending_prefill_tokens, "load.pending_prefill_tokens");
    EQ_NUM(a->active_decode_blocks, b->active_decode_blocks, "load.active_decode_blocks");
}

static void eq_worker(const km_worker_info *a, const km_worker_info *b, bool runtime)
{
    EQ_NUM(b->status, KM_OK, "worker status");
    EQ_STR(a->pool, b->pool, "worker.pool");
    EQ_NUM(a->worker, b->worker, "worker.worker");
    EQ_STR(a->name, b->name, "worker.name");
    EQ_STR(a->event_endpoint, b->event_endpoint, "worker.event_endpoint");
    EQ_STR(a->replay_endpoint, b->replay_endpoint, "worker.replay_endpoint");
    EQ_NUM(a->has_dp_rank, b->has_dp_rank, "worker.has_dp_rank");
    EQ_NUM(a->dp_rank, b->dp_rank, "worker.dp_rank");
    EQ_NUM(a->has_healthy, b->has_healthy, "worker.has_healthy");
    EQ_NUM(a->healthy, b->healthy, "worker.healthy");
    if (!runtime)
        return;
    EQ_STR(a->breaker, b->breaker, "worker.breaker");
    EQ_NUM(a->has_failures, b->has_failures, "worker.has_failures");
    EQ_NUM(a->failures, b->failures, "worker.failures");
    EQ_NUM(a->has_eligible, b->has_eligible, "worker.has_eligible");
    EQ_NUM(a->eligible, b->eligible, "worker.eligible");
    EQ_STR(a->state, b->state, "worker.state");
    EQ_NUM(a->has_blocks, b->has_blocks, "worker.has_blocks");
    EQ_NUM(a->blocks, b->blocks, "worker.blocks");
    EQ_NUM(a->has_last_event_age_s, b->has_last_event_age_s, "worker.has_last_event_age_s");
    EQ_NUM(a->last_event_age_s, b->last_event_age_s, "worker.last_event_age_s");
    EQ_NUM(a->has_load, b->has_load, "worker.has_load");
    if (a->has_load)
        eq_load(&a->load, &b->load);
}

static void eq_message(const km_message *a, const km_message *b)
{
    EQ_NUM(a->type, b->type, "type");
    EQ_NUM(b->has_id, true, "has_id");
    EQ_NUM(a->id, b->id, "id");
    switch (a->type) {
    case KM_MESSAGE_HELLO:
        EQ_NUM(a->hello.protocol_version, b->hello.protocol_version, "protocol");
        EQ_STR(a->hello.client_name, b->hello.client_name, "client");
        break;
    case KM_MESSAGE_WELCOME:
        EQ_NUM(a->welcome.protocol_version, b->welcome.protocol_version, "protocol");
        EQ_STR(a->welcome.kvmatch_version, b->welcome.kvmatch_version, "kvmatch_version");
        EQ_STR(a->welcome.server_name, b->welcome.server_name, "server");
        KM_CHECK(memcmp(&a->welcome.limits, &b->welcome.limits, sizeof a->welcome.limits) == 0,
                 "limits differ");
        break;
    case KM_MESSAGE_ROUTE:
        EQ_NUM(a->route.n_routes, b->route.n_routes, "n_routes");
        for (uint32_t i = 0; i < a->route.n_routes; i++) {
            const km_route_request *x = &a->route.routes[i], *y = &b->route.routes[i];
            EQ_NUM(y->status, KM_OK, "route status");
            EQ_STR(x->request_id, y->request_id, "request_id");
            EQ_STR(x->attempt_id, y->attempt_id, "attempt_id");
            EQ_STR(x->model, y->model, "model");
            EQ_STR(x->pool, y->pool, "pool");
            EQ_STR(x->endpoint, y->endpoint, "endpoint");
            EQ_NUM(x->input, y->input, "input");
            EQ_NUM(x->n_tokens, y->n_tokens, "n_tokens");
            EQ_NUM(x->n_hashes, y->n_hashes, "n_hashes");
            if (x->n_tokens)
                KM_CHECK(memcmp(x->tokens, y->tokens, x->n_tokens * 4) == 0, "tokens differ");
            if (x->n_hashes)
                KM_CHECK(memcmp(x->hashes, y->hashes, x->n_hashes * 8) == 0, "hashes differ");
            EQ_NUM(x->block_size, y->block_size, "block_size");
            EQ_STR(x->lora_name, y->lora_name, "lora_name");
            EQ_STR(x->cache_salt, y->cache_salt, "cache_salt");
            EQ_NUM(x->candidates != NULL, y->candidates != NULL, "candidates present");
            EQ_NUM(x->n_candidates, y->n_candidates, "n_candidates");
            if (x->n_candidates)
                KM_CHECK(memcmp(x->candidates, y->candidates, x->n_candidates * 4) == 0,
                         "candidates differ");
            EQ_STR(x->policy, y->policy, "policy");
            EQ_NUM(x->has_prompt_tokens, y->has_prompt_tokens, "has_prompt_tokens");
            EQ_NUM(x->prompt_tokens, y->prompt_tokens, "prompt_tokens");
            EQ_NUM(x->has_expected_output_tokens, y->has_expected_output_tokens, "has_eot");
            EQ_NUM(x->expected_output_tokens, y->expected_output_tokens, "expected_output_tokens");
            EQ_NUM(x->brief, y->brief, "brief");
            EQ_NUM(x->warm_ups, y->warm_ups, "warm_ups");
        }
        break;
    case KM_MESSAGE_DECISION:
        EQ_STR(a->decision.kvmatch_version, b->decision.kvmatch_version, "kvmatch_version");
        EQ_NUM(a->decision.n_decisions, b->decision.n_decisions, "n_decisions");
        for (uint32_t i = 0; i < a->decision.n_decisions; i++) {
            const km_route_decision *x = &a->decision.decisions[i], *y = &b->decision.decisions[i];
            EQ_NUM(x->status, y->status, "decision status");
            EQ_STR(x->message, y->message, "decision message");
            EQ_STR(x->request_id, y->request_id, "request_id");
            EQ_STR(x->attempt_id, y->attempt_id, "attempt_id");
            if (x->status)
                continue;
            EQ_NUM(x->decision_id, y->decision_id, "decision_id");
            EQ_STR(x->pool, y->pool, "pool");
            EQ_NUM(x->chosen_worker, y->chosen_worker, "chosen_worker");
            EQ_NUM(x->chosen_depth, y->chosen_depth, "chosen_depth");
            EQ_STR(x->chosen_state, y->chosen_state, "chosen_state");
            EQ_NUM(x->has_owner, y->has_owner, "has_owner");
            EQ_NUM(x->owner_worker, y->owner_worker, "owner_worker");
            EQ_NUM(x->owner_depth, y->owner_depth, "owner_depth");
            EQ_STR(x->owner_state, y->owner_state, "owner_state");
            EQ_NUM(x->n_blocks, y->n_blocks, "n_blocks");
            EQ_NUM(x->block_size, y->block_size, "block_size");
            EQ_NUM(x->source, y->source, "source");
            EQ_STR(x->policy, y->policy, "policy");
            EQ_STR(x->reason, y->reason, "reason");
            EQ_STR(x->load_kind, y->load_kind, "load_kind");
            EQ_STR(x->load_scope, y->load_scope, "load_scope");
            KM_CHECK(x->load_value == y->load_value || (isnan(x->load_value) && isnan(y->load_value)),
                     "load_value differs: %g, %g", x->load_value, y->load_value);
            EQ_NUM(x->n_candidates, y->n_candidates, "n_candidates");
            for (uint32_t c = 0; c < x->n_candidates; c++) {
                const km_candidate_score *p = &x->candidates[c], *q = &y->candidates[c];
                EQ_NUM(p->worker, q->worker, "cand.worker");
                EQ_NUM(p->depth, q->depth, "cand.depth");
                EQ_NUM(p->device_blocks, q->device_blocks, "cand.device_blocks");
                EQ_NUM(p->host_blocks, q->host_blocks, "cand.host_blocks");
                EQ_NUM(p->disk_blocks, q->disk_blocks, "cand.disk_blocks");
                eq_load(&p->load, &q->load);
                KM_CHECK(p->cost == q->cost || (isnan(p->cost) && isnan(q->cost)),
                         "cand.cost differs: %g, %g", p->cost, q->cost);
                EQ_STR(p->state, q->state, "cand.state");
                EQ_NUM(p->eligible, q->eligible, "cand.eligible");
            }
            EQ_NUM(x->has_warm_up, y->has_warm_up, "has_warm_up");
            EQ_NUM(x->warm_up_worker, y->warm_up_worker, "warm_up_worker");
            EQ_NUM(x->warm_up_blocks, y->warm_up_blocks, "warm_up_blocks");
            EQ_NUM(x->warm_up_tokens, y->warm_up_tokens, "warm_up_tokens");
            EQ_NUM(x->warm_up_decision_id, y->warm_up_decision_id, "warm_up_decision_id");
            EQ_STR(x->warm_up_attempt_id, y->warm_up_attempt_id, "warm_up_attempt_id");
        }
        break;
    case KM_MESSAGE_LIFECYCLE:
        EQ_NUM(a->lifecycle.n_events, b->lifecycle.n_events, "n_events");
        for (uint32_t i = 0; i < a->lifecycle.n_events; i++) {
            const km_lifecycle_event *x = &a->lifecycle.events[i], *y = &b->lifecycle.events[i];
            EQ_NUM(y->status, KM_OK, "event status");
            EQ_NUM(x->kind, y->kind, "kind");
            EQ_NUM(x->has_decision_id, y->has_decision_id, "has_decision_id");
            EQ_NUM(x->decision_id, y->decision_id, "decision_id");
            EQ_STR(x->request_id, y->request_id, "request_id");
            EQ_STR(x->attempt_id, y->attempt_id, "attempt_id");
            EQ_NUM(x->has_worker, y->has_worker, "has_worker");
            EQ_NUM(x->worker, y->worker, "worker");
            EQ_NUM(x->has_elapsed_ms, y->has_elapsed_ms, "has_elapsed_ms");
            EQ_NUM(x->elapsed_ms, y->elapsed_ms, "elapsed_ms");
            EQ_NUM(x->outcome, y->outcome, "outcome");
            EQ_STR(x->finish_reason, y->finish_reason, "finish_reason");
            EQ_NUM(x->done_seen, y->done_seen, "done_seen");
            EQ_NUM(x->has_http_status, y->has_http_status, "has_http_status");
            EQ_NUM(x->http_status, y->http_status, "http_status");
            EQ_STR(x->error, y->error, "error");
            EQ_NUM(x->has_cached_tokens, y->has_cached_tokens, "has_cached_tokens");
            EQ_NUM(x->cached_tokens, y->cached_tokens, "cached_tokens");
            EQ_NUM(x->has_prompt_tokens, y->has_prompt_tokens, "has_prompt_tokens");
            EQ_NUM(x->prompt_tokens, y->prompt_tokens, "prompt_tokens");
            EQ_NUM(x->has_output_tokens, y->has_output_tokens, "has_output_tokens");
            EQ_NUM(x->output_tokens, y->output_tokens, "output_tokens");
            EQ_NUM(x->retries, y->retries, "retries");
        }
        break;
    case KM_MESSAGE_ACK:
        EQ_NUM(a->ack.n_items, b->ack.n_items, "n_items");
        for (uint32_t i = 0; i < a->ack.n_items; i++) {
            EQ_NUM(a->ack.items[i].status, b->ack.items[i].status, "item status");
            EQ_STR(a->ack.items[i].message, b->ack.items[i].message, "item message");
        }
        break;
    case KM_MESSAGE_WORKERS:
    case KM_MESSAGE_WORKER_LIST:
        EQ_NUM(a->workers.action, b->workers.action, "action");
        EQ_STR(a->workers.pool, b->workers.pool, "pool filter");
        EQ_NUM(a->workers.n_workers, b->workers.n_workers, "n_workers");
        for (uint32_t i = 0; i < a->workers.n_workers; i++)
            eq_worker(&a->workers.workers[i], &b->workers.workers[i],
                      a->type == KM_MESSAGE_WORKER_LIST);
        break;
    case KM_MESSAGE_POOLS:
    case KM_MESSAGE_POOL_LIST:
        EQ_NUM(a->pools.action, b->pools.action, "action");
        EQ_NUM(a->pools.n_pools, b->pools.n_pools, "n_pools");
        for (uint32_t i = 0; i < a->pools.n_pools; i++) {
            const km_pool_info *x = &a->pools.pools[i], *y = &b->pools.pools[i];
            EQ_NUM(y->status, KM_OK, "pool status");
            EQ_STR(x->name, y->name, "name");
            EQ_STR(x->model, y->model, "model");
            EQ_NUM(x->block_size, y->block_size, "block_size");
            EQ_NUM(x->hash_lookahead_tokens, y->hash_lookahead_tokens, "hash_lookahead_tokens");
            EQ_NUM(x->offload_chunk_blocks, y->offload_chunk_blocks, "offload_chunk_blocks");
            EQ_STR(x->policy, y->policy, "policy");
            EQ_STR(x->engine, y->engine, "engine");
            EQ_NUM(x->n_params, y->n_params, "n_params");
            for (uint32_t k = 0; k < x->n_params; k++) {
                EQ_STR(x->params[k].name, y->params[k].name, "param name");
                EQ_NUM(x->params[k].value, y->params[k].value, "param value");
            }
        }
        break;
    case KM_MESSAGE_STATUS: break;
    case KM_MESSAGE_STATUS_REPLY: {
        const km_status_reply *x = &a->status_reply, *y = &b->status_reply;
        EQ_STR(x->kvmatch_version, y->kvmatch_version, "kvmatch_version");
        EQ_NUM(x->uptime_s, y->uptime_s, "uptime_s");
        EQ_NUM(x->ready, y->ready, "ready");
        EQ_NUM(x->connections, y->connections, "connections");
        EQ_NUM(x->decisions, y->decisions, "decisions");
        EQ_NUM(x->records_dropped, y->records_dropped, "records_dropped");
        EQ_STR(x->backend, y->backend, "backend");
        EQ_NUM(x->n_workers, y->n_workers, "n_workers");
        for (uint32_t i = 0; i < x->n_workers; i++)
            eq_worker(&x->workers[i], &y->workers[i], true);
        break;
    }
    case KM_MESSAGE_ERROR:
        EQ_NUM(a->error.code, b->error.code, "code");
        EQ_STR(a->error.name, b->error.name, "name");
        EQ_STR(a->error.message, b->error.message, "message");
        break;
    case KM_MESSAGE_UNKNOWN: break;
    }
}

/* ---- helpers ------------------------------------------------------------------------------------ */

static const km_message_type all_types[] = {
    KM_MESSAGE_HELLO,     KM_MESSAGE_WELCOME,     KM_MESSAGE_ROUTE,       KM_MESSAGE_DECISION,
    KM_MESSAGE_LIFECYCLE, KM_MESSAGE_ACK,         KM_MESSAGE_WORKERS,     KM_MESSAGE_WORKER_LIST,
    KM_MESSAGE_POOLS,     KM_MESSAGE_POOL_LIST,   KM_MESSAGE_STATUS,      KM_MESSAGE_STATUS_REPLY,
    KM_MESSAGE_ERROR};
#define N_TYPES (sizeof all_types / sizeof all_types[0])

static uint32_t frame_length(const uint8_t *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

/* Encode m as a frame, check the prefix, return the payload in *buffer (after the header). */
static void encode_ok(const km_message *m, km_frame_buffer *b)
{
    char why[256];
    b->size = 0;
    int rc = km_protocol_encode(m, 0, b, why, sizeof why);
    KM_CHECK(rc == KM_OK, "encode %s: %s (%s)", km_message_type_name(m->type), km_error_name(rc), why);
    KM_CHECK(frame_length(b->data) == b->size - 4, "length prefix %u for %zu payload bytes",
             frame_length(b->data), b->size - 4);
}

/* First item error of a decoded batch message, or NULL. */
static const char *first_item_error(const km_message *m, int *status)
{
    const void *items = NULL;
    size_t size = 0;
    uint32_t n = 0;
    switch (m->type) {
    case KM_MESSAGE_ROUTE: items = m->route.routes, size = sizeof *m->route.routes, n = m->route.n_routes; break;
    case KM_MESSAGE_DECISION: items = m->decision.decisions, size = sizeof *m->decision.decisions, n = m->decision.n_decisions; break;
    case KM_MESSAGE_LIFECYCLE: items = m->lifecycle.events, size = sizeof *m->lifecycle.events, n = m->lifecycle.n_events; break;
    case KM_MESSAGE_WORKERS:
    case KM_MESSAGE_WORKER_LIST: items = m->workers.workers, size = sizeof *m->workers.workers, n = m->workers.n_workers; break;
    case KM_MESSAGE_POOLS:
    case KM_MESSAGE_POOL_LIST: items = m->pools.pools, size = sizeof *m->pools.pools, n = m->pools.n_pools; break;
    case KM_MESSAGE_STATUS_REPLY: items = m->status_reply.workers, size = sizeof *m->status_reply.workers, n = m->status_reply.n_workers; break;
    default: return NULL;
    }
    for (uint32_t i = 0; i < n; i++) {
        const int *st = (const int *)((const char *)items + i * size);
        const char *const *msg = (const char *const *)((const char *)items + i * size + sizeof(void *));
        /* A decision's status may be the server's own answer; decode errors name the item. */
        if (*st != KM_OK && (m->type != KM_MESSAGE_DECISION || (*msg && strstr(*msg, "decisions[")))) {
            *status = *st;
            return *msg;
        }
    }
    return NULL;
}

/* ---- round trips -------------------------------------------------------------------------------- */

Test(protocol, round_trip_every_type_random, .timeout = 60)
{
    km_rng r;
    km_rng_init(&r, km_test_seed());
    km_protocol_decoder *dec;
    cr_assert_eq(km_protocol_decoder_create(NULL, &dec), KM_OK);
    km_frame_buffer b1, b2;
    km_frame_buffer_init(&b1);
    km_frame_buffer_init(&b2);
    for (int iter = 0; iter < 300; iter++) {
        for (size_t t = 0; t < N_TYPES; t++) {
            km_message m, got;
            rand_message(&r, all_types[t], &m);
            encode_ok(&m, &b1);
            int rc = km_protocol_decode(dec, b1.data + 4, b1.size - 4, &got);
            KM_CHECK(rc == KM_OK, "decode %s: %s", km_message_type_name(m.type),
                     km_protocol_decoder_last_error(dec));
            eq_message(&m, &got);
            /* Re-encoding what was decoded gives the same bytes: nothing is lost or added. */
            encode_ok(&got, &b2);
            KM_CHECK(b1.size == b2.size && memcmp(b1.data, b2.data, b1.size) == 0,
                     "%s re-encodes differently", km_message_type_name(m.type));
        }
        free_owned();
    }
    km_frame_buffer_free(&b1);
    km_frame_buffer_free(&b2);
    km_protocol_decoder_destroy(dec);
}

/* The value of "load_value" in an encoded DECISION's first decision (payload after the length
 * prefix), or NULL when the key is absent. The object lives in *zone. */
static const msgpack_object *decision_load_value(const km_frame_buffer *b, msgpack_zone *zone,
                                                 msgpack_object *root)
{
    size_t off = 0;
    cr_assert_eq(msgpack_unpack((const char *)b->data + 4, b->size - 4, &off, zone, root),
                 MSGPACK_UNPACK_SUCCESS);
    cr_assert_eq(root->type, MSGPACK_OBJECT_MAP);
    const msgpack_object *decisions = NULL;
    for (uint32_t i = 0; i < root->via.map.size; i++) {
        const msgpack_object_kv *kv = &root->via.map.ptr[i];
        if (kv->key.type == MSGPACK_OBJECT_STR && kv->key.via.str.size == 9 &&
            memcmp(kv->key.via.str.ptr, "decisions", 9) == 0)
            decisions = &kv->val;
    }
    cr_assert(decisions && decisions->type == MSGPACK_OBJECT_ARRAY && decisions->via.array.size);
    const msgpack_object *d = &decisions->via.array.ptr[0];
    cr_assert_eq(d->type, MSGPACK_OBJECT_MAP);
    for (uint32_t i = 0; i < d->via.map.size; i++) {
        const msgpack_object_kv *kv = &d->via.map.ptr[i];
        if (kv->key.type == MSGPACK_OBJECT_STR && kv->key.via.str.size == 10 &&
            memcmp(kv->key.via.str.ptr, "load_value", 10) == 0)
            return &kv->val;
    }
    return NULL;
}

/* round_robin weighs no load: load_value NAN goes out as nil (a NaN float breaks clients that
 * turn replies into JSON), and nil, or no key at all, comes back as NAN, never 0. */
Test(protocol, decision_load_value_nan_travels_as_nil, .timeout = 10)
{
    km_route_decision d;
    memset(&d, 0, sizeof d);
    d.status = KM_OK;
    d.request_id = "rr-1";
    d.decision_id = 9;
    d.chosen_worker = 1;
    d.source = KM_PREDICTION_EVENTS;
    d.policy = "round_robin";
    d.reason = "round_robin";
    d.load_kind = "none";
    d.load_scope = "this_instance";
    km_message m;
    memset(&m, 0, sizeof m);
    m.type = KM_MESSAGE_DECISION;
    m.id = 4;
    m.decision.kvmatch_version = "0.1.0";
    m.decision.decisions = &d;
    m.decision.n_decisions = 1;
    km_protocol_decoder *dec;
    cr_assert_eq(km_protocol_decoder_create(NULL, &dec), KM_OK);
    km_frame_buffer b;
    km_frame_buffer_init(&b);
    msgpack_zone zone;
    msgpack_zone_init(&zone, 1024);
    msgpack_object root;
    const double values[] = {NAN, INFINITY, -INFINITY, 0.0, 2.5};
    for (size_t i = 0; i < sizeof values / sizeof values[0]; i++) {
        d.load_value = values[i];
        encode_ok(&m, &b);
        const msgpack_object *v = decision_load_value(&b, &zone, &root);
        cr_assert_not_null(v, "load_value %g: the key is written", values[i]);
        km_message got;
        cr_assert_eq(km_protocol_decode(dec, b.data + 4, b.size - 4, &got), KM_OK, "%s",
                     km_protocol_decoder_last_error(dec));
        cr_assert_eq(got.decision.n_decisions, 1);
        cr_assert_eq(got.decision.decisions[0].status, KM_OK, "%s", got.decision.decisions[0].message);
        double back = got.decision.decisions[0].load_value;
        if (isfinite(values[i])) {
            cr_assert_eq(v->type, MSGPACK_OBJECT_FLOAT64, "%g", values[i]);
            cr_assert_eq(back, values[i]);
        } else {
            cr_assert_eq(v->type, MSGPACK_OBJECT_NIL, "load_value %g is sent as %s", values[i],
                         v->type == MSGPACK_OBJECT_FLOAT64 || v->type == MSGPACK_OBJECT_FLOAT32
                             ? "a float" : "something else");
            cr_assert(isnan(back), "nil decodes as NAN, got %g", back);
        }
    }
    /* a decision written without the key (an older server, another encoder) */
    msgpack_sbuffer sb;
    msgpack_packer pk;
    msgpack_sbuffer_init(&sb);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_map(&pk, 3);
    msgpack_pack_str_with_body(&pk, "type", 4);
    msgpack_pack_str_with_body(&pk, "DECISION", 8);
    msgpack_pack_str_with_body(&pk, "id", 2);
    msgpack_pack_uint64(&pk, 5);
    msgpack_pack_str_with_body(&pk, "decisions", 9);
    msgpack_pack_array(&pk, 1);
    msgpack_pack_map(&pk, 4);
    msgpack_pack_str_with_body(&pk, "status", 6);
    msgpack_pack_uint64(&pk, 0);
    msgpack_pack_str_with_body(&pk, "decision_id", 11);
    msgpack_pack_uint64(&pk, 10);
    msgpack_pack_str_with_body(&pk, "chosen_worker", 13);
    msgpack_pack_uint64(&pk, 0);
    msgpack_pack_str_with_body(&pk, "source", 6);
    msgpack_pack_str_with_body(&pk, "events", 6);
    km_message got;
    cr_assert_eq(km_protocol_decode(dec, sb.data, sb.size, &got), KM_OK, "%s",
                 km_protocol_decoder_last_error(dec));
    cr_assert_eq(got.decision.decisions[0].status, KM_OK, "%s", got.decision.decisions[0].message);
    cr_assert(isnan(got.decision.decisions[0].load_value), "absent decodes as NAN, got %g",
              got.decision.decisions[0].load_value);
    msgpack_sbuffer_destroy(&sb);
    msgpack_zone_destroy(&zone);
    km_frame_buffer_free(&b);
    km_protocol_decoder_destroy(dec);
}

/* The single-event forms decode as a LIFECYCLE of one event; an int attempt_id as its digits. */
Test(protocol, single_event_types_and_int_attempt_id, .timeout = 10)
{
    msgpack_sbuffer sb;
    msgpack_packer pk;
    msgpack_sbuffer_init(&sb);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_map(&pk, 6);
    msgpack_pack_str_with_body(&pk, "type", 4);
    msgpack_pack_str_with_body(&pk, "FINISHED", 8);
    msgpack_pack_str_with_body(&pk, "id", 2);
    msgpack_pack_uint64(&pk, 77);
    msgpack_pack_str_with_body(&pk, "request_id", 10);
    msgpack_pack_str_with_body(&pk, "r1", 2);
    msgpack_pack_str_with_body(&pk, "attempt_id", 10);
    msgpack_pack_uint64(&pk, 3);
    msgpack_pack_str_with_body(&pk, "finish_reason", 13);
    msgpack_pack_str_with_body(&pk, "stop", 4);
    msgpack_pack_str_with_body(&pk, "done_seen", 9);
    msgpack_pack_true(&pk);
    km_protocol_decoder *dec;
    cr_assert_eq(km_protocol_decoder_create(NULL, &dec), KM_OK);
    km_message m;
    cr_assert_eq(km_protocol_decode(dec, sb.data, sb.size, &m), KM_OK, "%s",
                 km_protocol_decoder_last_error(dec));
    cr_assert_eq(m.type, KM_MESSAGE_LIFECYCLE);
    cr_assert_eq(m.id, 77);
    cr_assert_eq(m.lifecycle.n_events, 1);
    const km_lifecycle_event *e = &m.lifecycle.events[0];
    cr_assert_eq(e->status, KM_OK, "%s", e->message);
    cr_assert_eq(e->kind, KM_LIFECYCLE_FINISHED);
    cr_assert_str_eq(e->attempt_id, "3");
    cr_assert_eq(e->outcome, KM_OUTCOME_COMPLETE);
    msgpack_sbuffer_destroy(&sb);
    km_protocol_decoder_destroy(dec);
}

/* A single-event message's fields are its own: a field that fails its item is named as it is,
 * not as a field of an "events" array the message does not have. */
Test(protocol, a_single_event_error_names_the_field_as_sent, .timeout = 10)
{
    msgpack_sbuffer sb;
    msgpack_packer pk;
    msgpack_sbuffer_init(&sb);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_map(&pk, 5);
    msgpack_pack_str_with_body(&pk, "type", 4);
    msgpack_pack_str_with_body(&pk, "FINISHED", 8);
    msgpack_pack_str_with_body(&pk, "id", 2);
    msgpack_pack_uint64(&pk, 78);
    msgpack_pack_str_with_body(&pk, "request_id", 10);
    msgpack_pack_str_with_body(&pk, "r1", 2);
    msgpack_pack_str_with_body(&pk, "finish_reason", 13);
    msgpack_pack_str_with_body(&pk, "stop", 4);
    msgpack_pack_str_with_body(&pk, "cached_tokens", 13);
    msgpack_pack_uint64(&pk, UINT64_MAX); /* past 2^63 - 1: the item fails */
    km_protocol_decoder *dec;
    cr_assert_eq(km_protocol_decoder_create(NULL, &dec), KM_OK);
    km_message m;
    cr_assert_eq(km_protocol_decode(dec, sb.data, sb.size, &m), KM_OK, "%s",
                 km_protocol_decoder_last_error(dec));
    cr_assert_eq(m.lifecycle.n_events, 1);
    const km_lifecycle_event *e = &m.lifecycle.events[0];
    cr_assert_eq(e->status, KM_ERR_PARSE);
    cr_assert(strstr(e->message, "cached_tokens") && !strstr(e->message, "events"), "%s",
              e->message);
    msgpack_sbuffer_destroy(&sb);
    km_protocol_decoder_destroy(dec);
}

Test(protocol, outcome_rule, .timeout = 10)
{
    cr_assert_eq(km_outcome_from_stream("stop", true, true, 200, NULL), KM_OUTCOME_COMPLETE);
    cr_assert_eq(km_outcome_from_stream("stop", true, false, 0, ""), KM_OUTCOME_COMPLETE);
    /* HTTP 200 without [DONE] or without finish_reason is not a completion. */
    cr_assert_eq(km_outcome_from_stream("stop", false, true, 200, NULL), KM_OUTCOME_INCOMPLETE);
    cr_assert_eq(km_outcome_from_stream(NULL, true, true, 200, NULL), KM_OUTCOME_INCOMPLETE);
    cr_assert_eq(km_outcome_from_stream("", true, true, 200, NULL), KM_OUTCOME_INCOMPLETE);
    cr_assert_eq(km_outcome_from_stream("stop", true, true, 500, NULL), KM_OUTCOME_ERROR);
    cr_assert_eq(km_outcome_from_stream("stop", true, true, 200, "reset"), KM_OUTCOME_ERROR);
    cr_assert_eq(km_outcome_from_stream(NULL, false, true, 199, NULL), KM_OUTCOME_ERROR);
}

/* A client that claims "complete" without the evidence gets a per-event error; siblings pass. */
Test(protocol, complete_without_evidence_is_rejected_per_event, .timeout = 10)
{
    km_lifecycle_event ev[3] = {0};
    for (int i = 0; i < 3; i++) {
        ev[i].kind = KM_LIFECYCLE_FINISHED;
        ev[i].request_id = "req";
        ev[i].has_http_status = true;
        ev[i].http_status = 200;
        ev[i].outcome = KM_OUTCOME_COMPLETE;
        ev[i].finish_reason = "stop";
        ev[i].done_seen = true;
    }
    ev[1].done_seen = false; /* HTTP 200 but no [DONE] */
    km_message m = {.type = KM_MESSAGE_LIFECYCLE, .id = 5};
    m.lifecycle.events = ev;
    m.lifecycle.n_events = 3;
    km_frame_buffer b;
    km_frame_buffer_init(&b);
    encode_ok(&m, &b);
    km_protocol_decoder *dec;
    cr_assert_eq(km_protocol_decoder_create(NULL, &dec), KM_OK);
    km_message got;
    cr_assert_eq(km_protocol_decode(dec, b.data + 4, b.size - 4, &got), KM_OK);
    cr_assert_eq(got.lifecycle.events[0].status, KM_OK);
    cr_assert_eq(got.lifecycle.events[2].status, KM_OK);
    cr_assert_eq(got.lifecycle.events[1].status, KM_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(got.lifecycle.events[1].message, "events[1].outcome"), "%s",
              got.lifecycle.events[1].message);
    /* Without an outcome the rule derives it: incomplete. */
    ev[1].outcome = KM_OUTCOME_NONE;
    encode_ok(&m, &b);
    cr_assert_eq(km_protocol_decode(dec, b.data + 4, b.size - 4, &got), KM_OK);
    cr_assert_eq(got.lifecycle.events[1].status, KM_OK);
    cr_assert_eq(got.lifecycle.events[1].outcome, KM_OUTCOME_INCOMPLETE);
    km_frame_buffer_free(&b);
    km_protocol_decoder_destroy(dec);
}

/* elapsed_ms is a duration on the router's clock: a negative or non-finite one is refused for its
 * event by the decoder (and never sent by the encoder); the other events stand. */
Test(protocol, elapsed_ms_must_be_a_duration, .timeout = 10)
{
    km_lifecycle_event ev[2] = {0};
    for (int i = 0; i < 2; i++) {
        ev[i].kind = KM_LIFECYCLE_FIRST_TOKEN;
        ev[i].request_id = "req";
        ev[i].has_elapsed_ms = true;
        ev[i].elapsed_ms = 12.5;
    }
    km_message m = {.type = KM_MESSAGE_LIFECYCLE, .id = 9};
    m.lifecycle.events = ev;
    m.lifecycle.n_events = 2;
    km_frame_buffer b;
    km_frame_buffer_init(&b);
    char why[256];
    ev[1].elapsed_ms = -1;
    cr_assert_eq(km_protocol_encode(&m, 0, &b, why, sizeof why), KM_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(why, "elapsed_ms"), "%s", why);
    ev[1].elapsed_ms = 12.5;
    encode_ok(&m, &b);
    km_protocol_decoder *dec;
    cr_assert_eq(km_protocol_decoder_create(NULL, &dec), KM_OK);
    const double bad[3] = {-0.5, NAN, INFINITY};
    for (int k = 0; k < 3; k++) {
        /* Rewrite events[1].elapsed_ms in the encoded message, as a peer could send it. */
        msgpack_zone zone;
        msgpack_zone_init(&zone, 4096);
        msgpack_object root;
        size_t off = 0;
        cr_assert_eq(msgpack_unpack((const char *)b.data + 4, b.size - 4, &off, &zone, &root),
                     MSGPACK_UNPACK_SUCCESS);
        msgpack_object *events = NULL;
        for (uint32_t i = 0; i < root.via.map.size; i++)
            if (!strncmp(root.via.map.ptr[i].key.via.str.ptr, "events", 6))
                events = &root.via.map.ptr[i].val;
        cr_assert(events && events->type == MSGPACK_OBJECT_ARRAY);
        msgpack_object *e1 = &events->via.array.ptr[1];
        int rewritten = 0;
        for (uint32_t i = 0; i < e1->via.map.size; i++) {
            msgpack_object_kv *kv = &e1->via.map.ptr[i];
            if (kv->key.via.str.size == 10 && !strncmp(kv->key.via.str.ptr, "elapsed_ms", 10)) {
                kv->val.type = MSGPACK_OBJECT_FLOAT64;
                kv->val.via.f64 = bad[k];
                rewritten = 1;
            }
        }
        cr_assert(rewritten);
        msgpack_sbuffer sb;
        msgpack_packer pk;
        msgpack_sbuffer_init(&sb);
        msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
        msgpack_pack_object(&pk, root);
        km_message got;
        cr_assert_eq(km_protocol_decode(dec, sb.data, sb.size, &got), KM_OK);
        cr_assert_eq(got.lifecycle.events[0].status, KM_OK);
        cr_assert_float_eq(got.lifecycle.events[0].elapsed_ms, 12.5, 1e-12);
        cr_assert_eq(got.lifecycle.events[1].status, KM_ERR_INVALID_ARGUMENT, "value %g", bad[k]);
        cr_assert(strstr(got.lifecycle.events[1].message, "elapsed_ms"), "%s",
                  got.lifecycle.events[1].message);
        msgpack_sbuffer_destroy(&sb);
        msgpack_zone_destroy(&zone);
    }
    km_frame_buffer_free(&b);
    km_protocol_decoder_destroy(dec);
}

/* Token counts a router reports are 0..2^63-1 (the records hold signed 64-bit integers): a larger
 * one, such as an all-ones "unknown", fails its item with the field named, and 2^63-1 decodes. A
 * route's own prompt_tokens and expected_output_tokens weigh in its decision and active work,
 * which count a request's tokens in 32 bits: past KM_PROTOCOL_MAX_ROUTE_TOKENS they fail the
 * route with the field named, and the maximum decodes. */
static void pack_str(msgpack_packer *pk, const char *s)
{
    msgpack_pack_str(pk, strlen(s));
    msgpack_pack_str_body(pk, s, strlen(s));
}

static void token_count_limits(bool route)
{
    km_protocol_decoder *dec;
    cr_assert_eq(km_protocol_decoder_create(NULL, &dec), KM_OK);
    static const char *const lifecycle_fields[] = {"cached_tokens", "prompt_tokens",
                                                   "output_tokens"};
    static const char *const route_fields[] = {"prompt_tokens", "expected_output_tokens"};
    const uint64_t lifecycle_values[3] = {UINT64_MAX, (uint64_t)INT64_MAX + 1,
                                          (uint64_t)INT64_MAX};
    const uint64_t route_values[3] = {(uint64_t)INT64_MAX,
                                      (uint64_t)KM_PROTOCOL_MAX_ROUTE_TOKENS + 1,
                                      KM_PROTOCOL_MAX_ROUTE_TOKENS};
    int n_fields = route ? 2 : 3;
    for (int f = 0; f < n_fields; f++) {
        const char *field = route ? route_fields[f] : lifecycle_fields[f];
        for (int k = 0; k < 3; k++) {
            uint64_t value = route ? route_values[k] : lifecycle_values[k];
            msgpack_sbuffer sb;
            msgpack_packer pk;
            msgpack_sbuffer_init(&sb);
            msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
            if (route) {
                msgpack_pack_map(&pk, 3);
                pack_str(&pk, "type");
                pack_str(&pk, "ROUTE");
                pack_str(&pk, "id");
                msgpack_pack_uint64(&pk, 4);
                pack_str(&pk, "routes");
                msgpack_pack_array(&pk, 1);
                msgpack_pack_map(&pk, 3);
                pack_str(&pk, "request_id");
                pack_str(&pk, "r");
                pack_str(&pk, "tokens");
                msgpack_pack_array(&pk, 2);
                msgpack_pack_uint32(&pk, 1);
                msgpack_pack_uint32(&pk, 2);
            } else {
                msgpack_pack_map(&pk, 6);
                pack_str(&pk, "type");
                pack_str(&pk, "FINISHED");
                pack_str(&pk, "id");
                msgpack_pack_uint64(&pk, 3);
                pack_str(&pk, "decision_id");
                msgpack_pack_uint64(&pk, 5);
                pack_str(&pk, "outcome");
                pack_str(&pk, "error");
                pack_str(&pk, "error");
                pack_str(&pk, "x");
            }
            pack_str(&pk, field);
            msgpack_pack_uint64(&pk, value);
            km_message got;
            cr_assert_eq(km_protocol_decode(dec, sb.data, sb.size, &got), KM_OK, "%s",
                         km_protocol_decoder_last_error(dec));
            int status = route ? got.route.routes[0].status : got.lifecycle.events[0].status;
            const char *message =
                route ? got.route.routes[0].message : got.lifecycle.events[0].message;
            if (k < 2) {
                cr_assert_eq(status, KM_ERR_PARSE, "%s = %" PRIu64, field, value);
                cr_assert(message && strstr(message, field), "%s", message ? message : "");
            } else {
                cr_assert_eq(status, KM_OK, "%s = %" PRIu64 ": %s", field, value,
                             message ? message : "");
                cr_assert_eq(route ? (f ? got.route.routes[0].expected_output_tokens
                                        : got.route.routes[0].prompt_tokens)
                                   : value,
                             value);
            }
            msgpack_sbuffer_destroy(&sb);
        }
    }
    km_protocol_decoder_destroy(dec);
}

Test(protocol, token_counts_past_two_to_the_63_fail_their_item, .timeout = 10)
{
    token_count_limits(false);
    /* The encoder refuses what the decoder would. */
    km_worker_info wi = {.pool = "p", .worker = 1, .state = "LIVE", .has_blocks = true,
                         .blocks = (uint64_t)INT64_MAX + 1};
    km_message list = {.type = KM_MESSAGE_WORKER_LIST, .id = 2};
    list.workers.action = KM_ADMIN_LIST;
    list.workers.workers = &wi;
    list.workers.n_workers = 1;
    km_frame_buffer b;
    km_frame_buffer_init(&b);
    char why[256];
    cr_assert_eq(km_protocol_encode(&list, 0, &b, why, sizeof why), KM_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(why, "workers[0].blocks"), "%s", why);
    km_frame_buffer_free(&b);
}

Test(protocol, route_token_counts_past_the_route_maximum_fail_their_route, .timeout = 10)
{
    token_count_limits(true);
    /* The encoder refuses what the decoder would, and takes the maximum. */
    km_route_request q = {.request_id = "r", .input = KM_ROUTE_INPUT_TOKENS,
                          .has_prompt_tokens = true,
                          .prompt_tokens = (uint64_t)KM_PROTOCOL_MAX_ROUTE_TOKENS + 1};
    km_message m = {.type = KM_MESSAGE_ROUTE, .id = 1};
    m.route.routes = &q;
    m.route.n_routes = 1;
    km_frame_buffer b;
    km_frame_buffer_init(&b);
    char why[256];
    cr_assert_eq(km_protocol_encode(&m, 0, &b, why, sizeof why), KM_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(why, "routes[0].prompt_tokens"), "%s", why);
    q.prompt_tokens = KM_PROTOCOL_MAX_ROUTE_TOKENS;
    q.has_expected_output_tokens = true;
    q.expected_output_tokens = (uint64_t)KM_PROTOCOL_MAX_ROUTE_TOKENS + 1;
    cr_assert_eq(km_protocol_encode(&m, 0, &b, why, sizeof why), KM_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(why, "routes[0].expected_output_tokens"), "%s", why);
    q.expected_output_tokens = KM_PROTOCOL_MAX_ROUTE_TOKENS;
    cr_assert_eq(km_protocol_encode(&m, 0, &b, why, sizeof why), KM_OK, "%s", why);
    km_frame_buffer_free(&b);
}

/* ---- frame reader ------------------------------------------------------------------------------- */

Test(protocol, frame_reader_random_chunkings, .timeout = 60)
{
    km_rng r;
    km_rng_init(&r, km_test_seed());
    km_frame_buffer stream;
    km_frame_buffer_init(&stream);
    /* A stream of frames of many sizes (1 byte .. 200 KB, so the reader's buffer grows and is
     * released), from random messages and raw payloads. */
    enum { N_FRAMES = 200 };
    size_t offsets[N_FRAMES], sizes[N_FRAMES];
    for (int i = 0; i < N_FRAMES; i++) {
        size_t start = stream.size;
        if (km_rng_percent(&r, 70)) {
            km_message m;
            rand_message(&r, all_types[km_rng_below(&r, N_TYPES)], &m);
            cr_assert_eq(km_protocol_encode(&m, 0, &stream, NULL, 0), KM_OK);
        } else {
            size_t n = km_rng_percent(&r, 10) ? 1 + km_rng_below(&r, 200000) : 1 + km_rng_below(&r, 50);
            uint8_t header[4] = {(uint8_t)(n >> 24), (uint8_t)(n >> 16), (uint8_t)(n >> 8), (uint8_t)n};
            uint8_t *payload = test_alloc(n);
            for (size_t k = 0; k < n; k++)
                payload[k] = (uint8_t)km_rng_next(&r);
            if (stream.capacity < stream.size + 4 + n) {
                stream.capacity = 2 * (stream.size + 4 + n);
                stream.data = realloc(stream.data, stream.capacity);
            }
            memcpy(stream.data + stream.size, header, 4);
            memcpy(stream.data + stream.size + 4, payload, n);
            stream.size += 4 + n;
        }
        offsets[i] = start + 4;
        sizes[i] = stream.size - start - 4;
    }
    for (int round = 0; round < 30; round++) {
        km_frame_reader *reader;
        cr_assert_eq(km_frame_reader_create(1u << 20, &reader), KM_OK);
        size_t pos = 0;
        int next_frame = 0;
        while (pos < stream.size) {
            size_t chunk;
            switch (km_rng_below(&r, 4)) {
            case 0: chunk = 1; break;
            case 1: chunk = 1 + km_rng_below(&r, 7); break;
            case 2: chunk = 1 + km_rng_below(&r, 5000); break;
            default: chunk = 1 + km_rng_below(&r, 300000); break;
            }
            if (chunk > stream.size - pos)
                chunk = stream.size - pos;
            const uint8_t *p = stream.data + pos;
            size_t left = chunk;
            while (left) {
                size_t used;
                const uint8_t *payload;
                size_t size;
                int rc = km_frame_reader_next(reader, p, left, &used, &payload, &size);
                KM_CHECK(rc == KM_OK, "reader: %s", km_frame_reader_last_error(reader));
                KM_CHECK(used > 0 && used <= left, "consumed %zu of %zu", used, left);
                p += used;
                left -= used;
                if (payload) {
                    KM_CHECK(next_frame < N_FRAMES, "more frames than sent");
                    KM_CHECK(size == sizes[next_frame] &&
                                 memcmp(payload, stream.data + offsets[next_frame], size) == 0,
                             "frame %d differs (size %zu, expected %zu)", next_frame, size,
                             sizes[next_frame]);
                    next_frame++;
                }
            }
            pos += chunk;
        }
        KM_CHECK(next_frame == N_FRAMES, "got %d frames of %d", next_frame, N_FRAMES);
        cr_assert_eq(km_frame_reader_pending(reader), 0);
        km_frame_reader_destroy(reader);
    }
    km_frame_buffer_free(&stream);
    free_owned();
}

Test(protocol, frame_reader_oversize_is_refused_from_the_header, .timeout = 10)
{
    km_frame_reader *reader;
    cr_assert_eq(km_frame_reader_create(1000, &reader), KM_OK);
    const uint8_t ok[] = {0, 0, 3, 0xe8}; /* exactly 1000: accepted, waits for the payload */
    size_t used;
    const uint8_t *payload;
    size_t size;
    cr_assert_eq(km_frame_reader_next(reader, ok, 4, &used, &payload, &size), KM_OK);
    cr_assert_null(payload);
    cr_assert_eq(km_frame_reader_pending(reader), 4);
    km_frame_reader_destroy(reader);

    cr_assert_eq(km_frame_reader_create(1000, &reader), KM_OK);
    const uint8_t big[] = {0xff, 0xff, 0xff, 0xff, 1, 2, 3};
    /* Fed one byte at a time: the fourth byte is the one that fails, no payload is buffered. */
    for (int i = 0; i < 3; i++)
        cr_assert_eq(km_frame_reader_next(reader, big + i, 1, &used, &payload, &size), KM_OK);
    cr_assert_eq(km_frame_reader_next(reader, big + 3, 4, &used, &payload, &size), KM_ERR_TOO_LARGE);
    cr_assert(km_frame_reader_failed(reader));
    cr_assert(strstr(km_frame_reader_last_error(reader), "4294967295"), "%s",
              km_frame_reader_last_error(reader));
    /* Sticky: the stream cannot be re-synchronised. */
    cr_assert_eq(km_frame_reader_next(reader, ok, 4, &used, &payload, &size), KM_ERR_TOO_LARGE);
    km_frame_reader_destroy(reader);

    cr_assert_eq(km_frame_reader_create(1000, &reader), KM_OK);
    const uint8_t zero[] = {0, 0, 0, 0};
    cr_assert_eq(km_frame_reader_next(reader, zero, 4, &used, &payload, &size), KM_ERR_PROTOCOL);
    cr_assert(km_frame_reader_failed(reader));
    km_frame_reader_destroy(reader);

    cr_assert_eq(km_frame_reader_create(0, &reader), KM_OK);
    cr_assert_eq(km_frame_reader_next(reader, NULL, 3, &used, &payload, &size), KM_ERR_NULL_POINTER);
    cr_assert_eq(km_frame_reader_next(reader, NULL, 0, &used, &payload, &size), KM_OK);
    km_frame_reader_destroy(reader);
    km_frame_reader_destroy(NULL);
}

/* ---- decode errors ------------------------------------------------------------------------------ */

static km_protocol_decoder *new_decoder(void)
{
    km_protocol_decoder *dec;
    cr_assert_eq(km_protocol_decoder_create(NULL, &dec), KM_OK);
    return dec;
}

/* Every proper prefix of every valid payload is rejected as KM_ERR_PARSE (the pre-scan sees the
 * truncation; nothing is read past the end). */
Test(protocol, truncated_payloads, .timeout = 60)
{
    km_rng r;
    km_rng_init(&r, km_test_seed());
    km_protocol_decoder *dec = new_decoder();
    km_frame_buffer b;
    km_frame_buffer_init(&b);
    for (size_t t = 0; t < N_TYPES; t++) {
        km_message m, got;
        rand_message(&r, all_types[t], &m);
        encode_ok(&m, &b);
        size_t n = b.size - 4;
        for (size_t cut = 0; cut < n; cut++) {
            uint8_t *copy = malloc(cut ? cut : 1);
            memcpy(copy, b.data + 4, cut);
            int rc = km_protocol_decode(dec, copy, cut, &got);
            free(copy);
            KM_CHECK(rc == KM_ERR_PARSE, "%s cut at %zu of %zu: %s", km_message_type_name(m.type),
                     cut, n, km_error_name(rc));
            KM_CHECK(!got.has_id, "a truncated message has no id");
        }
        free_owned();
    }
    km_frame_buffer_free(&b);
    km_protocol_decoder_destroy(dec);
}

/* Replace values in the decoded msgpack tree with wrong types. For each map entry of each
 * encoded message, the decode must fail (whole message or one item) with a message naming the
 * key. */
typedef struct mutation_site {
    msgpack_object *value;
    char key[64];
} mutation_site;

static void collect_sites(msgpack_object *o, mutation_site *sites, size_t *n, size_t cap)
{
    if (o->type == MSGPACK_OBJECT_MAP) {
        for (uint32_t i = 0; i < o->via.map.size; i++) {
            msgpack_object_kv *kv = &o->via.map.ptr[i];
            if (kv->key.type == MSGPACK_OBJECT_STR && *n < cap) {
                mutation_site *s = &sites[(*n)++];
                s->value = &kv->val;
                snprintf(s->key, sizeof s->key, "%.*s", (int)kv->key.via.str.size, kv->key.via.str.ptr);
            }
            collect_sites(&kv->val, sites, n, cap);
        }
    } else if (o->type == MSGPACK_OBJECT_ARRAY) {
        for (uint32_t i = 0; i < o->via.array.size; i++)
            collect_sites(&o->via.array.ptr[i], sites, n, cap);
    }
}

/* Wrong-typed replacements for a value; 0..2 written to out. */
static int wrong_values(const msgpack_object *orig, const char *key, msgpack_object *out)
{
    msgpack_object str = {.type = MSGPACK_OBJECT_STR};
    str.via.str.ptr = "wrong";
    str.via.str.size = 5;
    msgpack_object map = {.type = MSGPACK_OBJECT_MAP};
    msgpack_object boolean = {.type = MSGPACK_OBJECT_BOOLEAN};
    msgpack_object negative = {.type = MSGPACK_OBJECT_NEGATIVE_INTEGER};
    negative.via.i64 = -1;
    bool is_status = strcmp(key, "status") == 0 || strcmp(key, "code") == 0;
    switch (orig->type) {
    case MSGPACK_OBJECT_POSITIVE_INTEGER:
        out[0] = str;
        if (is_status)
            return 1;
        out[1] = negative;
        return 2;
    case MSGPACK_OBJECT_NEGATIVE_INTEGER: out[0] = str; out[1] = boolean; return 2;
    case MSGPACK_OBJECT_STR: out[0] = map; out[1] = boolean; return 2;
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64: out[0] = str; out[1] = boolean; return 2;
    case MSGPACK_OBJECT_BOOLEAN: out[0] = str; out[1] = negative; return 2;
    case MSGPACK_OBJECT_ARRAY: out[0] = str; out[1] = map; return 2;
    case MSGPACK_OBJECT_MAP: out[0] = str; out[1] = negative; return 2;
    default: return 0;
    }
}

/* A random message of `type`, encoded into b (frame header first) and unpacked again into a
 * msgpack object tree in zone (cleared first), for tests that rewrite the tree and re-encode it. */
static msgpack_object random_tree(km_rng *r, km_message_type type, km_message *m,
                                  km_frame_buffer *b, msgpack_zone *zone)
{
    rand_message(r, type, m);
    encode_ok(m, b);
    msgpack_object root;
    size_t off = 0;
    msgpack_zone_clear(zone);
    cr_assert_eq(msgpack_unpack((const char *)b->data + 4, b->size - 4, &off, zone, &root),
                 MSGPACK_UNPACK_SUCCESS);
    return root;
}

Test(protocol, wrong_type_in_every_field, .timeout = 120)
{
    km_rng r;
    km_rng_init(&r, km_test_seed());
    km_protocol_decoder *dec = new_decoder();
    km_frame_buffer b;
    km_frame_buffer_init(&b);
    msgpack_zone zone;
    msgpack_zone_init(&zone, 4096);
    size_t checked = 0;
    for (int iter = 0; iter < 4; iter++) {
        for (size_t t = 0; t < N_TYPES; t++) {
            km_message m, got;
            msgpack_object root = random_tree(&r, all_types[t], &m, &b, &zone);
            mutation_site sites[4096];
            size_t n_sites = 0;
            collect_sites(&root, sites, &n_sites, 4096);
            for (size_t s = 0; s < n_sites; s++) {
                msgpack_object orig = *sites[s].value, wrong[2];
                int n_wrong = wrong_values(&orig, sites[s].key, wrong);
                for (int w = 0; w < n_wrong; w++) {
                    *sites[s].value = wrong[w];
                    msgpack_sbuffer sb;
                    msgpack_packer pk;
                    msgpack_sbuffer_init(&sb);
                    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
                    msgpack_pack_object(&pk, root);
                    int rc = km_protocol_decode(dec, sb.data, sb.size, &got);
                    const char *why = km_protocol_decoder_last_error(dec);
                    int item_status = KM_OK;
                    if (rc == KM_OK)
                        why = first_item_error(&got, &item_status);
                    KM_CHECK(why && (rc != KM_OK || item_status != KM_OK),
                             "%s: field %s with a wrong type (msgpack type %d) was accepted",
                             km_message_type_name(m.type), sites[s].key, (int)wrong[w].type);
                    KM_CHECK(strstr(why, sites[s].key) || strcmp(sites[s].key, "type") == 0,
                             "%s: the error for field %s does not name it: %s",
                             km_message_type_name(m.type), sites[s].key, why);
                    int status = rc != KM_OK ? rc : item_status;
                    KM_CHECK(status == KM_ERR_PARSE || status == KM_ERR_PROTOCOL,
                             "field %s: %s", sites[s].key, km_error_name(status));
                    /* A well-formed map keeps its id so the server can answer it. */
                    if (strcmp(sites[s].key, "id") != 0 && rc != KM_OK)
                        KM_CHECK(got.has_id && got.id == m.id, "field %s: id lost", sites[s].key);
                    msgpack_sbuffer_destroy(&sb);
                    checked++;
                }
                *sites[s].value = orig;
            }
        }
        free_owned();
    }
    cr_assert_gt(checked, 500);
    msgpack_zone_destroy(&zone);
    km_frame_buffer_free(&b);
    km_protocol_decoder_destroy(dec);
}

/* Pack a message from a list of key/value packing steps. */
typedef struct packer_buf {
    msgpack_sbuffer sb;
    msgpack_packer pk;
} packer_buf;

static msgpack_packer *pb_begin(packer_buf *p)
{
    msgpack_sbuffer_init(&p->sb);
    msgpack_packer_init(&p->pk, &p->sb, msgpack_sbuffer_write);
    return &p->pk;
}

static void pk_str(msgpack_packer *pk, const char *s)
{
    msgpack_pack_str_with_body(pk, s, strlen(s));
}

static int decode_packed(km_protocol_decoder *dec, packer_buf *p, km_message *out)
{
    int rc = km_protocol_decode(dec, p->sb.data, p->sb.size, out);
    msgpack_sbuffer_destroy(&p->sb);
    return rc;
}

Test(protocol, message_level_errors, .timeout = 10)
{
    km_protocol_decoder *dec = new_decoder();
    km_message m;
    packer_buf p;
    msgpack_packer *pk;

    /* Not a map. */
    pk = pb_begin(&p);
    msgpack_pack_array(pk, 0);
    cr_assert_eq(decode_packed(dec, &p, &m), KM_ERR_PARSE);
    cr_assert(!m.has_id);
    cr_assert(strstr(km_protocol_decoder_last_error(dec), "map"));

    /* No id: cannot be answered by id (the server closes). */
    pk = pb_begin(&p);
    msgpack_pack_map(pk, 1);
    pk_str(pk, "type"), pk_str(pk, "STATUS");
    cr_assert_eq(decode_packed(dec, &p, &m), KM_ERR_PARSE);
    cr_assert(!m.has_id);
    cr_assert(strstr(km_protocol_decoder_last_error(dec), "id"));

    /* No type, with an id. */
    pk = pb_begin(&p);
    msgpack_pack_map(pk, 1);
    pk_str(pk, "id"), msgpack_pack_uint64(pk, 9);
    cr_assert_eq(decode_packed(dec, &p, &m), KM_ERR_PARSE);
    cr_assert(m.has_id && m.id == 9);
    cr_assert(strstr(km_protocol_decoder_last_error(dec), "type"));

    /* Unknown type: KM_ERR_PROTOCOL, id kept (the connection stays open). */
    pk = pb_begin(&p);
    msgpack_pack_map(pk, 3);
    pk_str(pk, "type"), pk_str(pk, "TELEPORT");
    pk_str(pk, "id"), msgpack_pack_uint64(pk, 10);
    pk_str(pk, "future_field"), msgpack_pack_array(pk, 0);
    cr_assert_eq(decode_packed(dec, &p, &m), KM_ERR_PROTOCOL);
    cr_assert(m.has_id && m.id == 10);
    cr_assert(strstr(km_protocol_decoder_last_error(dec), "TELEPORT"));

    /* Unknown fields are ignored. */
    pk = pb_begin(&p);
    msgpack_pack_map(pk, 3);
    pk_str(pk, "type"), pk_str(pk, "STATUS");
    pk_str(pk, "id"), msgpack_pack_uint64(pk, 11);
    pk_str(pk, "from_the_future"), msgpack_pack_map(pk, 0);
    cr_assert_eq(decode_packed(dec, &p, &m), KM_OK);
    cr_assert_eq(m.type, KM_MESSAGE_STATUS);

    /* A key twice. */
    pk = pb_begin(&p);
    msgpack_pack_map(pk, 3);
    pk_str(pk, "type"), pk_str(pk, "STATUS");
    pk_str(pk, "id"), msgpack_pack_uint64(pk, 12);
    pk_str(pk, "id"), msgpack_pack_uint64(pk, 13);
    cr_assert_eq(decode_packed(dec, &p, &m), KM_ERR_PARSE);
    cr_assert(strstr(km_protocol_decoder_last_error(dec), "twice"));

    /* Missing required batch: ROUTE without routes, and with an empty array. */
    pk = pb_begin(&p);
    msgpack_pack_map(pk, 2);
    pk_str(pk, "type"), pk_str(pk, "ROUTE");
    pk_str(pk, "id"), msgpack_pack_uint64(pk, 14);
    cr_assert_eq(decode_packed(dec, &p, &m), KM_ERR_PARSE);
    cr_assert(strstr(km_protocol_decoder_last_error(dec), "routes"));
    cr_assert(m.has_id && m.id == 14 && m.type == KM_MESSAGE_ROUTE);
    pk = pb_begin(&p);
    msgpack_pack_map(pk, 3);
    pk_str(pk, "type"), pk_str(pk, "ROUTE");
    pk_str(pk, "id"), msgpack_pack_uint64(pk, 15);
    pk_str(pk, "routes"), msgpack_pack_array(pk, 0);
    cr_assert_eq(decode_packed(dec, &p, &m), KM_ERR_PARSE);

    /* Trailing bytes after the map. */
    pk = pb_begin(&p);
    msgpack_pack_map(pk, 2);
    pk_str(pk, "type"), pk_str(pk, "STATUS");
    pk_str(pk, "id"), msgpack_pack_uint64(pk, 16);
    msgpack_pack_nil(pk);
    cr_assert_eq(decode_packed(dec, &p, &m), KM_ERR_PARSE);
    cr_assert(strstr(km_protocol_decoder_last_error(dec), "follow"));

    /* Empty payload, reserved byte. */
    cr_assert_eq(km_protocol_decode(dec, "", 0, &m), KM_ERR_PARSE);
    cr_assert_eq(km_protocol_decode(dec, "\xc1", 1, &m), KM_ERR_PARSE);
    cr_assert_eq(km_protocol_decode(NULL, "", 0, &m), KM_ERR_NULL_POINTER);
    km_protocol_decoder_destroy(dec);
}

/* Missing required fields inside items fail only their item, with the field named. */
Test(protocol, missing_item_fields_fail_only_their_item, .timeout = 10)
{
    static const char *const required[] = {"request_id", "tokens"};
    km_protocol_decoder *dec = new_decoder();
    for (int drop = 0; drop < 2; drop++) {
        packer_buf p;
        msgpack_packer *pk = pb_begin(&p);
        msgpack_pack_map(pk, 3);
        pk_str(pk, "type"), pk_str(pk, "ROUTE");
        pk_str(pk, "id"), msgpack_pack_uint64(pk, 1);
        pk_str(pk, "routes"), msgpack_pack_array(pk, 3);
        for (int i = 0; i < 3; i++) {
            bool broken = i == 1;
            msgpack_pack_map(pk, broken ? 1 : 2);
            if (!(broken && drop == 0))
                pk_str(pk, "request_id"), pk_str(pk, "r");
            if (!(broken && drop == 1))
                pk_str(pk, "tokens"), msgpack_pack_array(pk, 1), msgpack_pack_uint32(pk, 5);
        }
        km_message m;
        cr_assert_eq(decode_packed(dec, &p, &m), KM_OK, "%s", km_protocol_decoder_last_error(dec));
        cr_assert_eq(m.route.routes[0].status, KM_OK);
        cr_assert_eq(m.route.routes[2].status, KM_OK);
        cr_assert_eq(m.route.routes[1].status, KM_ERR_PARSE);
        cr_assert(strstr(m.route.routes[1].message, required[drop]), "%s", m.route.routes[1].message);
        cr_assert(strstr(m.route.routes[1].message, "routes[1]"), "%s", m.route.routes[1].message);
    }
    /* Both tokens and hashes. */
    packer_buf p;
    msgpack_packer *pk = pb_begin(&p);
    msgpack_pack_map(pk, 3);
    pk_str(pk, "type"), pk_str(pk, "ROUTE");
    pk_str(pk, "id"), msgpack_pack_uint64(pk, 1);
    pk_str(pk, "routes"), msgpack_pack_array(pk, 1);
    msgpack_pack_map(pk, 3);
    pk_str(pk, "request_id"), pk_str(pk, "r");
    pk_str(pk, "tokens"), msgpack_pack_array(pk, 0);
    pk_str(pk, "hashes"), msgpack_pack_array(pk, 0);
    km_message m;
    cr_assert_eq(decode_packed(dec, &p, &m), KM_OK);
    cr_assert_eq(m.route.routes[0].status, KM_ERR_PARSE);
    cr_assert(strstr(m.route.routes[0].message, "not both"));
    cr_assert_str_eq(m.route.routes[0].request_id, "r"); /* answerable by request id */
    km_protocol_decoder_destroy(dec);
}

/* A pool's hash_lookahead_tokens: absent is 0, any value up to KM_HASH_MAX_LOOKAHEAD is read, a
 * larger one fails that pool's item naming the field and the others still decode. */
Test(protocol, pool_hash_lookahead_tokens_is_bounded, .timeout = 10)
{
    static const uint64_t values[] = {0, 1, 3, KM_HASH_MAX_LOOKAHEAD, KM_HASH_MAX_LOOKAHEAD + 1,
                                      UINT64_C(1) << 32};
    km_protocol_decoder *dec = new_decoder();
    for (size_t v = 0; v < sizeof values / sizeof values[0]; v++) {
        packer_buf p;
        msgpack_packer *pk = pb_begin(&p);
        msgpack_pack_map(pk, 4);
        pk_str(pk, "type"), pk_str(pk, "POOLS");
        pk_str(pk, "id"), msgpack_pack_uint64(pk, 1);
        pk_str(pk, "action"), pk_str(pk, "add");
        pk_str(pk, "pools"), msgpack_pack_array(pk, 2);
        msgpack_pack_map(pk, 3);
        pk_str(pk, "name"), pk_str(pk, "a");
        pk_str(pk, "block_size"), msgpack_pack_uint32(pk, 16);
        pk_str(pk, "hash_lookahead_tokens"), msgpack_pack_uint64(pk, values[v]);
        msgpack_pack_map(pk, 2);
        pk_str(pk, "name"), pk_str(pk, "b");
        pk_str(pk, "block_size"), msgpack_pack_uint32(pk, 16);
        km_message m;
        cr_assert_eq(decode_packed(dec, &p, &m), KM_OK, "%s", km_protocol_decoder_last_error(dec));
        cr_assert_eq(m.pools.n_pools, 2);
        cr_assert_eq(m.pools.pools[1].status, KM_OK);
        cr_assert_eq(m.pools.pools[1].hash_lookahead_tokens, 0);
        if (values[v] <= KM_HASH_MAX_LOOKAHEAD) {
            cr_assert_eq(m.pools.pools[0].status, KM_OK, "%s", m.pools.pools[0].message);
            cr_assert_eq(m.pools.pools[0].hash_lookahead_tokens, values[v]);
        } else {
            cr_assert_eq(m.pools.pools[0].status, KM_ERR_PARSE);
            cr_assert(strstr(m.pools.pools[0].message, "hash_lookahead_tokens"), "%s",
                      m.pools.pools[0].message);
        }
    }
    km_protocol_decoder_destroy(dec);
}

/* A pool's offload_chunk_blocks: absent is 0, 1 to KM_FEED_MAX_OFFLOAD_CHUNK_BLOCKS is read, 0
 * or a larger one fails that pool's item naming the field and the others still decode. */
Test(protocol, pool_offload_chunk_blocks_is_bounded, .timeout = 10)
{
    static const uint64_t values[] = {1, 2, KM_FEED_MAX_OFFLOAD_CHUNK_BLOCKS, 0,
                                      KM_FEED_MAX_OFFLOAD_CHUNK_BLOCKS + 1, UINT64_C(1) << 32};
    km_protocol_decoder *dec = new_decoder();
    for (size_t v = 0; v < sizeof values / sizeof values[0]; v++) {
        packer_buf p;
        msgpack_packer *pk = pb_begin(&p);
        msgpack_pack_map(pk, 4);
        pk_str(pk, "type"), pk_str(pk, "POOLS");
        pk_str(pk, "id"), msgpack_pack_uint64(pk, 1);
        pk_str(pk, "action"), pk_str(pk, "add");
        pk_str(pk, "pools"), msgpack_pack_array(pk, 2);
        msgpack_pack_map(pk, 3);
        pk_str(pk, "name"), pk_str(pk, "a");
        pk_str(pk, "block_size"), msgpack_pack_uint32(pk, 16);
        pk_str(pk, "offload_chunk_blocks"), msgpack_pack_uint64(pk, values[v]);
        msgpack_pack_map(pk, 2);
        pk_str(pk, "name"), pk_str(pk, "b");
        pk_str(pk, "block_size"), msgpack_pack_uint32(pk, 16);
        km_message m;
        cr_assert_eq(decode_packed(dec, &p, &m), KM_OK, "%s", km_protocol_decoder_last_error(dec));
        cr_assert_eq(m.pools.n_pools, 2);
        cr_assert_eq(m.pools.pools[1].status, KM_OK);
        cr_assert_eq(m.pools.pools[1].offload_chunk_blocks, 0);
        if (values[v] >= 1 && values[v] <= KM_FEED_MAX_OFFLOAD_CHUNK_BLOCKS) {
            cr_assert_eq(m.pools.pools[0].status, KM_OK, "%s", m.pools.pools[0].message);
            cr_assert_eq(m.pools.pools[0].offload_chunk_blocks, values[v]);
        } else {
            cr_assert_eq(m.pools.pools[0].status, KM_ERR_PARSE, "value %" PRIu64, values[v]);
            cr_assert(strstr(m.pools.pools[0].message, "offload_chunk_blocks"), "%s",
                      m.pools.pools[0].message);
        }
    }
    km_protocol_decoder_destroy(dec);
}

/* A bad value deep in a reply names its whole path: the decision and the candidate row. */
Test(protocol, nested_error_names_decision_and_candidate, .timeout = 10)
{
    km_protocol_decoder *dec = new_decoder();
    packer_buf p;
    msgpack_packer *pk = pb_begin(&p);
    msgpack_pack_map(pk, 4);
    pk_str(pk, "type"), pk_str(pk, "DECISION");
    pk_str(pk, "id"), msgpack_pack_uint64(pk, 9);
    pk_str(pk, "kvmatch_version"), pk_str(pk, "test");
    pk_str(pk, "decisions"), msgpack_pack_array(pk, 2);
    for (int d = 0; d < 2; d++) {
        msgpack_pack_map(pk, 4);
        pk_str(pk, "decision_id"), msgpack_pack_uint64(pk, (uint64_t)d + 1);
        pk_str(pk, "chosen_worker"), msgpack_pack_uint32(pk, 0);
        pk_str(pk, "source"), pk_str(pk, "events");
        pk_str(pk, "candidates"), msgpack_pack_array(pk, 3);
        for (int c = 0; c < 3; c++) {
            msgpack_pack_array(pk, 11);
            msgpack_pack_uint32(pk, (uint32_t)c);
            if (d == 1 && c == 2)
                pk_str(pk, "deep"); /* depth must be an unsigned integer */
            else
                msgpack_pack_uint32(pk, 1);
            for (int k = 2; k < 8; k++)
                msgpack_pack_uint32(pk, 0);
            msgpack_pack_double(pk, 0.5);
            msgpack_pack_nil(pk);
            msgpack_pack_nil(pk);
        }
    }
    km_message m;
    cr_assert_eq(decode_packed(dec, &p, &m), KM_OK, "%s", km_protocol_decoder_last_error(dec));
    cr_assert_eq(m.type, KM_MESSAGE_DECISION);
    cr_assert_eq(m.decision.n_decisions, 2);
    cr_assert_eq(m.decision.decisions[0].status, KM_OK, "%s", m.decision.decisions[0].message);
    cr_assert_eq(m.decision.decisions[0].n_candidates, 3);
    cr_assert_eq(m.decision.decisions[1].status, KM_ERR_PARSE);
    cr_assert(strstr(m.decision.decisions[1].message, "decisions[1].candidates[2].depth"), "%s",
              m.decision.decisions[1].message);
    km_protocol_decoder_destroy(dec);
}

/* Limits: arrays over their limits, strings, objects, nesting, and hostile declared lengths. */
Test(protocol, limits_and_hostile_lengths, .timeout = 20)
{
    km_protocol_limits limits;
    km_protocol_limits_init(&limits);
    limits.max_tokens_per_route = 100;
    limits.max_batch_items = 8;
    limits.max_string_bytes = 16;
    limits.max_objects = 10000;
    km_protocol_decoder *dec;
    cr_assert_eq(km_protocol_decoder_create(&limits, &dec), KM_OK);
    km_message m;
    packer_buf p;
    msgpack_packer *pk;

    /* 101 tokens in route 0: that route only. */
    pk = pb_begin(&p);
    msgpack_pack_map(pk, 3);
    pk_str(pk, "type"), pk_str(pk, "ROUTE");
    pk_str(pk, "id"), msgpack_pack_uint64(pk, 1);
    pk_str(pk, "routes"), msgpack_pack_array(pk, 2);
    for (int i = 0; i < 2; i++) {
        msgpack_pack_map(pk, 2);
        pk_str(pk, "request_id"), pk_str(pk, "r");
        pk_str(pk, "tokens"), msgpack_pack_array(pk, i == 0 ? 101 : 100);
        for (int k = 0; k < (i == 0 ? 101 : 100); k++)
            msgpack_pack_uint32(pk, 7);
    }
    cr_assert_eq(decode_packed(dec, &p, &m), KM_OK);
    cr_assert_eq(m.route.routes[0].status, KM_ERR_TOO_LARGE);
    cr_assert(strstr(m.route.routes[0].message, "max_tokens_per_route"));
    cr_assert_eq(m.route.routes[1].status, KM_OK);
    cr_assert_eq(m.route.routes[1].n_tokens, 100);

    /* 9 routes: the whole message. */
    pk = pb_begin(&p);
    msgpack_pack_map(pk, 3);
    pk_str(pk, "type"), pk_str(pk, "ROUTE");
    pk_str(pk, "id"), msgpack_pack_uint64(pk, 2);
    pk_str(pk, "routes"), msgpack_pack_array(pk, 9);
    for (int i = 0; i < 9; i++) {
        msgpack_pack_map(pk, 2);
        pk_str(pk, "request_id"), pk_str(pk, "r");
        pk_str(pk, "hashes"), msgpack_pack_array(pk, 0);
    }
    cr_assert_eq(decode_packed(dec, &p, &m), KM_ERR_TOO_LARGE);
    cr_assert(m.has_id && m.id == 2);
    cr_assert(strstr(km_protocol_decoder_last_error(dec), "max_batch_items"));

    /* A 17-byte string. */
    pk = pb_begin(&p);
    msgpack_pack_map(pk, 3);
    pk_str(pk, "type"), pk_str(pk, "HELLO");
    pk_str(pk, "id"), msgpack_pack_uint64(pk, 3);
    pk_str(pk, "protocol"), msgpack_pack_uint32(pk, 1);
    cr_assert_eq(decode_packed(dec, &p, &m), KM_OK);
    pk = pb_begin(&p);
    msgpack_pack_map(pk, 4);
    pk_str(pk, "type"), pk_str(pk, "HELLO");
    pk_str(pk, "id"), msgpack_pack_uint64(pk, 3);
    pk_str(pk, "protocol"), msgpack_pack_uint32(pk, 1);
    pk_str(pk, "client"), pk_str(pk, "abcdefghijklmnopq");
    cr_assert_eq(decode_packed(dec, &p, &m), KM_ERR_TOO_LARGE);
    cr_assert(strstr(km_protocol_decoder_last_error(dec), "client"));

    /* A NUL inside a string. */
    pk = pb_begin(&p);
    msgpack_pack_map(pk, 4);
    pk_str(pk, "type"), pk_str(pk, "HELLO");
    pk_str(pk, "id"), msgpack_pack_uint64(pk, 3);
    pk_str(pk, "protocol"), msgpack_pack_uint32(pk, 1);
    msgpack_pack_str_with_body(pk, "client", 6);
    msgpack_pack_str_with_body(pk, "a\0b", 3);
    cr_assert_eq(decode_packed(dec, &p, &m), KM_ERR_PARSE);
    cr_assert(strstr(km_protocol_decoder_last_error(dec), "NUL"));

    /* Over max_objects. */
    pk = pb_begin(&p);
    msgpack_pack_map(pk, 3);
    pk_str(pk, "type"), pk_str(pk, "STATUS");
    pk_str(pk, "id"), msgpack_pack_uint64(pk, 4);
    pk_str(pk, "junk"), msgpack_pack_array(pk, 10000);
    for (int i = 0; i < 10000; i++)
        msgpack_pack_nil(pk);
    cr_assert_eq(decode_packed(dec, &p, &m), KM_ERR_TOO_LARGE);
    cr_assert(strstr(km_protocol_decoder_last_error(dec), "max_objects"));

    /* Hostile declared lengths: a container or string whose 32-bit length claims 4 G entries (or
     * bytes) in a payload of a few bytes, nested or at the top, and a length cut short. The
     * pre-scan refuses each before msgpack-c reads it (an array's or map's elements would be
     * allocated from the declaration), so the error is the pre-scan's sentence for that very
     * header. Nothing was read: no type, no id, although the first case holds both before its
     * array. The decoder is not left failed: the next message decodes. */
    static const struct {
        uint8_t bytes[32];
        size_t size;
        const char *error;
    } hostile[] = {
        /* {type: STATUS, id: 7, junk: array32 of 4 G entries, none there} */
        {{0x83, 0xa4, 't', 'y', 'p', 'e', 0xa6, 'S', 'T', 'A', 'T', 'U', 'S', 0xa2, 'i', 'd', 7,
          0xa4, 'j', 'u', 'n', 'k', 0xdd, 0xff, 0xff, 0xff, 0xff},
         27, "KM_ERR_PARSE: payload truncated or corrupt: array at offset 22 declares 4294967295 "
             "entries but only 0 bytes follow"},
        /* map32 of 4 G entries, then one entry's worth of bytes */
        {{0xdf, 0xff, 0xff, 0xff, 0xff, 0xa2, 'i', 'd', 1},
         9, "KM_ERR_PARSE: payload truncated or corrupt: map at offset 0 declares 4294967295 "
            "entries but only 4 bytes follow"},
        /* {type: str32 of 4 G bytes, none there} */
        {{0x81, 0xa4, 't', 'y', 'p', 'e', 0xdb, 0xff, 0xff, 0xff, 0xff},
         11, "KM_ERR_PARSE: payload truncated: value at offset 6 needs 4294967295 more bytes, 0 "
             "left"},
        /* {type: STATUS, then an array32 header as a key, cut after two of its length bytes} */
        {{0x83, 0xa4, 't', 'y', 'p', 'e', 0xa6, 'S', 'T', 'A', 'T', 'U', 'S', 0xdd, 0xff, 0xff},
         16, "KM_ERR_PARSE: payload truncated: value header at offset 13 needs 5 bytes, 3 left"},
    };
    static const uint8_t status_7[] = {0x82, 0xa4, 't', 'y', 'p', 'e', 0xa6, 'S', 'T', 'A', 'T',
                                       'U', 'S', 0xa2, 'i', 'd', 7};
    for (size_t i = 0; i < sizeof hostile / sizeof hostile[0]; i++) {
        int rc = km_protocol_decode(dec, hostile[i].bytes, hostile[i].size, &m);
        cr_assert_eq(rc, KM_ERR_PARSE, "case %zu: %s", i, km_error_name(rc));
        cr_assert_str_eq(km_protocol_decoder_last_error(dec), hostile[i].error, "case %zu: %s", i,
                         km_protocol_decoder_last_error(dec));
        cr_assert_eq(m.type, KM_MESSAGE_UNKNOWN, "case %zu", i);
        cr_assert(!m.has_id && m.id == 0, "case %zu", i);
        rc = km_protocol_decode(dec, status_7, sizeof status_7, &m);
        cr_assert_eq(rc, KM_OK, "after case %zu: %s", i, km_protocol_decoder_last_error(dec));
        cr_assert_eq(m.type, KM_MESSAGE_STATUS);
        cr_assert(m.has_id && m.id == 7);
        cr_assert_str_empty(km_protocol_decoder_last_error(dec));
    }

    /* Nesting deeper than 32. */
    uint8_t deep[64];
    for (int i = 0; i < 40; i++)
        deep[i] = 0x91; /* fixarray of 1 */
    deep[40] = 0xc0;
    cr_assert_eq(km_protocol_decode(dec, deep, 41, &m), KM_ERR_TOO_LARGE);

    /* Payload over max_frame_bytes given straight to the decoder. */
    km_protocol_decoder_destroy(dec);
    limits.max_frame_bytes = 10;
    cr_assert_eq(km_protocol_decoder_create(&limits, &dec), KM_OK);
    cr_assert_eq(km_protocol_decode(dec, deep, 41, &m), KM_ERR_TOO_LARGE);
    km_protocol_decoder_destroy(dec);

    limits.max_params = 0;
    cr_assert_eq(km_protocol_decoder_create(&limits, &dec), KM_ERR_INVALID_ARGUMENT);
    cr_assert_null(dec);
}

/* Random mutations of valid payloads never crash and always end in a definite answer. */
Test(protocol, random_byte_mutations, .timeout = 60)
{
    km_rng r;
    km_rng_init(&r, km_test_seed());
    km_protocol_decoder *dec = new_decoder();
    km_frame_buffer b;
    km_frame_buffer_init(&b);
    for (int iter = 0; iter < 3000; iter++) {
        km_message m, got;
        rand_message(&r, all_types[km_rng_below(&r, N_TYPES)], &m);
        encode_ok(&m, &b);
        uint8_t *copy = malloc(b.size - 4);
        memcpy(copy, b.data + 4, b.size - 4);
        for (uint32_t k = 0, n = 1 + km_rng_below(&r, 4); k < n; k++)
            copy[km_rng_below(&r, (uint32_t)(b.size - 4))] = (uint8_t)km_rng_next(&r);
        int rc = km_protocol_decode(dec, copy, b.size - 4, &got);
        KM_CHECK(rc == KM_OK || rc == KM_ERR_PARSE || rc == KM_ERR_PROTOCOL || rc == KM_ERR_TOO_LARGE,
                 "mutation gave %s", km_error_name(rc));
        KM_CHECK(rc == KM_OK || km_protocol_decoder_last_error(dec)[0], "no error text");
        free(copy);
        if (iter % 50 == 0)
            free_owned();
    }
    free_owned();
    km_frame_buffer_free(&b);
    km_protocol_decoder_destroy(dec);
}

/* A map key that equals a field name up to an embedded NUL ("status\0..." against "status") is not
 * that field, and matching it must not read past the name (found by random_byte_mutations under
 * ASan: a global-buffer-overflow in bind_fields). Every known name of every message type gets the
 * treatment: the item carrying the key fails or is ignored, never crashes, and the decoder keeps
 * decoding. */
static void collect_keys(msgpack_object *o, msgpack_object **keys, size_t *n, size_t cap)
{
    if (o->type == MSGPACK_OBJECT_MAP) {
        for (uint32_t i = 0; i < o->via.map.size; i++) {
            if (*n < cap)
                keys[(*n)++] = &o->via.map.ptr[i].key;
            collect_keys(&o->via.map.ptr[i].val, keys, n, cap);
        }
    } else if (o->type == MSGPACK_OBJECT_ARRAY) {
        for (uint32_t i = 0; i < o->via.array.size; i++)
            collect_keys(&o->via.array.ptr[i], keys, n, cap);
    }
}

Test(protocol, key_with_embedded_nul_is_not_a_field, .timeout = 30)
{
    km_rng r;
    km_rng_init(&r, km_test_seed() ^ 0x4e55);
    km_protocol_decoder *dec = new_decoder();
    km_frame_buffer b;
    km_frame_buffer_init(&b);
    msgpack_zone zone;
    msgpack_zone_init(&zone, 4096);
    size_t rewritten = 0;
    for (size_t t = 0; t < N_TYPES; t++) {
        km_message m, got;
        msgpack_object root = random_tree(&r, all_types[t], &m, &b, &zone);
        msgpack_object *keys[4096];
        size_t n_keys = 0;
        collect_keys(&root, keys, &n_keys, 4096);
        for (size_t k = 0; k < n_keys; k++) {
            msgpack_object *key = keys[k];
            if (key->type != MSGPACK_OBJECT_STR)
                continue;
            /* key + NUL + 8 more bytes */
            uint32_t kn = key->via.str.size;
            char *longer = msgpack_zone_malloc(&zone, kn + 9);
            memcpy(longer, key->via.str.ptr, kn);
            memcpy(longer + kn, "\0overflow", 9);
            msgpack_object saved = *key;
            key->via.str.ptr = longer;
            key->via.str.size = kn + 9;
            msgpack_sbuffer sb;
            msgpack_packer pk;
            msgpack_sbuffer_init(&sb);
            msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
            msgpack_pack_object(&pk, root);
            int rc = km_protocol_decode(dec, sb.data, sb.size, &got);
            KM_CHECK(rc == KM_OK || rc == KM_ERR_PARSE || rc == KM_ERR_PROTOCOL,
                     "key %.*s with a NUL: %s", (int)kn, saved.via.str.ptr, km_error_name(rc));
            msgpack_sbuffer_destroy(&sb);
            *key = saved;
            rewritten++;
        }
        /* The original still decodes. */
        cr_assert_eq(km_protocol_decode(dec, b.data + 4, b.size - 4, &got), KM_OK);
        free_owned();
    }
    cr_assert_gt(rewritten, 20);
    msgpack_zone_destroy(&zone);
    km_frame_buffer_free(&b);
    km_protocol_decoder_destroy(dec);
}

/* ---- encoder checks ----------------------------------------------------------------------------- */

Test(protocol, encoder_refuses_what_a_peer_would_reject, .timeout = 10)
{
    km_frame_buffer b;
    km_frame_buffer_init(&b);
    char why[256];
    km_route_request q = {.request_id = "r", .input = KM_ROUTE_INPUT_TOKENS};
    km_message m = {.type = KM_MESSAGE_ROUTE, .id = 1};
    m.route.routes = &q;
    m.route.n_routes = 1;
    cr_assert_eq(km_protocol_encode(&m, 0, &b, why, sizeof why), KM_OK, "%s", why);
    size_t good = b.size;

    q.request_id = NULL;
    cr_assert_eq(km_protocol_encode(&m, 0, &b, why, sizeof why), KM_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(why, "routes[0].request_id"), "%s", why);
    /* The item's path with a two-digit index (the prefix is formatted by hand). */
    km_route_request many[12];
    for (int k = 0; k < 12; k++)
        many[k] = (km_route_request){.request_id = "r", .input = KM_ROUTE_INPUT_TOKENS};
    many[11].request_id = NULL;
    km_message mm = {.type = KM_MESSAGE_ROUTE, .id = 2};
    mm.route.routes = many;
    mm.route.n_routes = 12;
    cr_assert_eq(km_protocol_encode(&mm, 0, &b, why, sizeof why), KM_ERR_INVALID_ARGUMENT);
    cr_assert(strstr(why, "routes[11].request_id"), "%s", why);
    cr_assert_eq(b.size, good, "a failed encode leaves the buffer as it was");
    q.request_id = "r";
    q.input = KM_ROUTE_INPUT_NONE;
    cr_assert_eq(km_protocol_encode(&m, 0, &b, why, sizeof why), KM_ERR_INVALID_ARGUMENT);
    q.input = KM_ROUTE_INPUT_HASHES;
    q.n_hashes = 3;
    cr_assert_eq(km_protocol_encode(&m, 0, &b, why, sizeof why), KM_ERR_NULL_POINTER);
    q.n_hashes = 0;
    m.route.n_routes = 0;
    cr_assert_eq(km_protocol_encode(&m, 0, &b, why, sizeof why), KM_ERR_INVALID_ARGUMENT);
    m.route.n_routes = 1;

    /* Over the frame limit. */
    uint32_t tokens[1000] = {0};
    q.input = KM_ROUTE_INPUT_TOKENS;
    q.tokens = tokens;
    q.n_tokens = 1000;
    cr_assert_eq(km_protocol_encode(&m, 500, &b, why, sizeof why), KM_ERR_TOO_LARGE);
    cr_assert(strstr(why, "max_frame_bytes"), "%s", why);
    cr_assert_eq(b.size, good);

    km_message e = {.type = KM_MESSAGE_ERROR, .id = 2};
    e.error.code = 0;
    cr_assert_eq(km_protocol_encode(&e, 0, &b, why, sizeof why), KM_ERR_INVALID_ARGUMENT);
    cr_assert_eq(km_protocol_encode_error(3, KM_ERR_PROTOCOL, "bad", &b), KM_OK);
    km_message unknown = {.type = KM_MESSAGE_UNKNOWN};
    cr_assert_eq(km_protocol_encode(&unknown, 0, &b, why, sizeof why), KM_ERR_INVALID_ARGUMENT);

    /* Several frames append to one buffer and read back in order. */
    km_protocol_decoder *dec = new_decoder();
    km_frame_reader *reader;
    cr_assert_eq(km_frame_reader_create(0, &reader), KM_OK);
    size_t pos = 0, used, size;
    const uint8_t *payload;
    km_message got;
    cr_assert_eq(km_frame_reader_next(reader, b.data, b.size, &used, &payload, &size), KM_OK);
    cr_assert_eq(km_protocol_decode(dec, payload, size, &got), KM_OK);
    cr_assert_eq(got.type, KM_MESSAGE_ROUTE);
    pos += used;
    cr_assert_eq(km_frame_reader_next(reader, b.data + pos, b.size - pos, &used, &payload, &size), KM_OK);
    cr_assert_eq(km_protocol_decode(dec, payload, size, &got), KM_OK);
    cr_assert_eq(got.type, KM_MESSAGE_ERROR);
    cr_assert_eq(got.id, 3);
    cr_assert_eq(got.error.code, KM_ERR_PROTOCOL);
    cr_assert_str_eq(got.error.name, "KM_ERR_PROTOCOL");
    cr_assert_str_eq(got.error.message, "bad");
    cr_assert_eq(pos + used, b.size);
    km_frame_buffer_consume(&b, pos);
    cr_assert_eq(b.size, used);
    km_frame_reader_destroy(reader);
    km_protocol_decoder_destroy(dec);
    km_frame_buffer_free(&b);
}

/* A message that quotes a client's text cut at a byte limit can end inside a UTF-8 character:
 * only its longest well-formed prefix goes out, so the peer's UTF-8 decoding of the reply (the
 * Python client's) never fails. */
Test(protocol, a_message_cut_inside_a_character_goes_out_as_well_formed_utf8, .timeout = 10)
{
    /* "no pool serves model a" + U+4E2D + the first two bytes of U+6587 */
    const char *cut = "no pool serves model a\xe4\xb8\xad\xe6\x96";
    const char *whole = "no pool serves model a\xe4\xb8\xad";
    km_frame_buffer b;
    km_frame_buffer_init(&b);
    km_protocol_decoder *dec;
    cr_assert_eq(km_protocol_decoder_create(NULL, &dec), KM_OK);
    km_message got;
    cr_assert_eq(km_protocol_encode_error(7, KM_ERR_NOT_FOUND, cut, &b), KM_OK);
    cr_assert_eq(km_protocol_decode(dec, b.data + 4, b.size - 4, &got), KM_OK);
    cr_assert_str_eq(got.error.message, whole);
    km_item_status items[2] = {{KM_OK, NULL}, {KM_ERR_NOT_FOUND, cut}};
    km_message m = {.type = KM_MESSAGE_ACK, .has_id = true, .id = 8};
    m.ack.items = items;
    m.ack.n_items = 2;
    encode_ok(&m, &b);
    cr_assert_eq(km_protocol_decode(dec, b.data + 4, b.size - 4, &got), KM_OK);
    cr_assert_eq(got.ack.n_items, 2);
    cr_assert_str_eq(got.ack.items[1].message, whole);
    km_frame_buffer_free(&b);
    km_protocol_decoder_destroy(dec);
}

Test(protocol, names, .timeout = 5)
{
    cr_assert_str_eq(km_message_type_name(KM_MESSAGE_STATUS_REPLY), "STATUS_REPLY");
    cr_assert_str_eq(km_message_type_name((km_message_type)99), "UNKNOWN");
    cr_assert_str_eq(km_prediction_source_name(KM_PREDICTION_APPROX), "approx");
    cr_assert_str_eq(km_outcome_name(KM_OUTCOME_INCOMPLETE), "incomplete");
    cr_assert_str_eq(km_lifecycle_kind_name(KM_LIFECYCLE_FIRST_TOKEN), "FIRST_TOKEN");
    cr_assert_str_eq(km_admin_action_name(KM_ADMIN_UPDATE), "update");
}

/* Every value of each X-macro list has its name; values outside a list get the name of its value 0
 * (or UNKNOWN), negative ones included. */
Test(protocol, names_of_every_listed_value_and_of_none_other, .timeout = 5)
{
#define EXPECT_NAME(function, type, enumerator, value, name)                                   \
    cr_assert_eq((int)enumerator, value);                                                      \
    cr_assert_str_eq(function((type)value), name);
#define MESSAGE_TYPE(...) EXPECT_NAME(km_message_type_name, km_message_type, __VA_ARGS__)
#define SOURCE(...) EXPECT_NAME(km_prediction_source_name, km_prediction_source, __VA_ARGS__)
#define KIND(...) EXPECT_NAME(km_lifecycle_kind_name, km_lifecycle_kind, __VA_ARGS__)
#define OUTCOME(...) EXPECT_NAME(km_outcome_name, km_outcome, __VA_ARGS__)
#define ACTION(...) EXPECT_NAME(km_admin_action_name, km_admin_action, __VA_ARGS__)
    KM_MESSAGE_TYPE_LIST(MESSAGE_TYPE)
    KM_PREDICTION_SOURCE_LIST(SOURCE)
    KM_LIFECYCLE_KIND_LIST(KIND)
    KM_OUTCOME_LIST(OUTCOME)
    KM_ADMIN_ACTION_LIST(ACTION)
#undef MESSAGE_TYPE
#undef SOURCE
#undef KIND
#undef OUTCOME
#undef ACTION
#undef EXPECT_NAME
    static const int outside[] = {-1, -1000, 14, 1 << 20};
    for (size_t i = 0; i < sizeof outside / sizeof outside[0]; i++) {
        cr_assert_str_eq(km_message_type_name((km_message_type)outside[i]), "UNKNOWN");
        cr_assert_str_eq(km_prediction_source_name((km_prediction_source)outside[i]), "none");
        cr_assert_str_eq(km_lifecycle_kind_name((km_lifecycle_kind)outside[i]), "NONE");
        cr_assert_str_eq(km_outcome_name((km_outcome)outside[i]), "none");
        cr_assert_str_eq(km_admin_action_name((km_admin_action)outside[i]), "none");
    }
}

/* Any string key twice in one map is KM_ERR_PARSE, known or not, whether the map has a few unknown
 * keys or many (a hash table past 16); distinct unknown keys are ignored. In a route item the
 * duplicate fails that item alone. A message without an id still says its type. */
/* An empty string key is a key like any other: twice is an error, once among others is not, on
 * both the pairwise path (few unknown keys) and the sorted one (many). */
Test(protocol, an_empty_key_twice_is_refused_with_few_or_many_keys, .timeout = 10)
{
    km_protocol_decoder *dec;
    cr_assert_eq(km_protocol_decoder_create(NULL, &dec), KM_OK);
    km_message m;
    for (uint32_t extra = 0; extra <= 40; extra += 40) {
        for (int empties = 1; empties <= 2; empties++) {
            msgpack_sbuffer sb;
            msgpack_packer pk;
            msgpack_sbuffer_init(&sb);
            msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
            msgpack_pack_map(&pk, 2 + extra + (uint32_t)empties);
            pk_str(&pk, "type");
            pk_str(&pk, "STATUS");
            for (int e = 0; e < empties; e++) {
                msgpack_pack_str(&pk, 0);
                msgpack_pack_uint64(&pk, (uint64_t)e);
            }
            for (uint32_t i = 0; i < extra; i++) {
                char key[16];
                snprintf(key, sizeof key, "y%u", i);
                pk_str(&pk, key);
                msgpack_pack_uint64(&pk, i);
            }
            pk_str(&pk, "id");
            msgpack_pack_uint64(&pk, 3);
            int rc = km_protocol_decode(dec, sb.data, sb.size, &m);
            if (empties == 2)
                cr_assert_eq(rc, KM_ERR_PARSE, "two empty keys among %u others: %s", extra,
                             km_protocol_decoder_last_error(dec));
            else
                cr_assert_eq(rc, KM_OK, "one empty key among %u others: %s", extra,
                             km_protocol_decoder_last_error(dec));
            msgpack_sbuffer_destroy(&sb);
        }
    }
    km_protocol_decoder_destroy(dec);
}

Test(protocol, every_duplicate_key_is_refused_and_a_failed_hello_is_a_hello, .timeout = 10)
{
    km_protocol_decoder *dec;
    cr_assert_eq(km_protocol_decoder_create(NULL, &dec), KM_OK);
    km_message m;
    for (uint32_t extra = 1; extra <= 40; extra += 39) {
        for (int dup = 0; dup < 2; dup++) {
            msgpack_sbuffer sb;
            msgpack_packer pk;
            msgpack_sbuffer_init(&sb);
            msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
            msgpack_pack_map(&pk, 2 + extra + (uint32_t)dup);
            pk_str(&pk, "type");
            pk_str(&pk, "STATUS");
            for (uint32_t i = 0; i < extra; i++) {
                char key[16];
                snprintf(key, sizeof key, "x%u", i);
                pk_str(&pk, key);
                msgpack_pack_uint64(&pk, i);
            }
            if (dup) {
                pk_str(&pk, "x0");
                msgpack_pack_uint64(&pk, 2);
            }
            pk_str(&pk, "id");
            msgpack_pack_uint64(&pk, 9);
            int rc = km_protocol_decode(dec, sb.data, sb.size, &m);
            if (dup) {
                cr_assert_eq(rc, KM_ERR_PARSE, "%u unknown keys, one twice", extra);
                cr_assert_not_null(strstr(km_protocol_decoder_last_error(dec),
                                          "key \"x0\" appears twice"), "%s",
                                   km_protocol_decoder_last_error(dec));
            } else {
                cr_assert_eq(rc, KM_OK, "%u distinct unknown keys: %s", extra,
                             km_protocol_decoder_last_error(dec));
            }
            msgpack_sbuffer_destroy(&sb);
        }
    }
    /* a route item with an unknown key twice fails alone */
    msgpack_sbuffer sb;
    msgpack_packer pk;
    msgpack_sbuffer_init(&sb);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_map(&pk, 3);
    pk_str(&pk, "type");
    pk_str(&pk, "ROUTE");
    pk_str(&pk, "id");
    msgpack_pack_uint64(&pk, 4);
    pk_str(&pk, "routes");
    msgpack_pack_array(&pk, 2);
    for (int i = 0; i < 2; i++) {
        msgpack_pack_map(&pk, i ? 4 : 2);
        pk_str(&pk, "request_id");
        pk_str(&pk, i ? "bad" : "good");
        pk_str(&pk, "hashes");
        msgpack_pack_array(&pk, 1);
        msgpack_pack_uint64(&pk, 1);
        if (i) {
            pk_str(&pk, "note");
            msgpack_pack_uint64(&pk, 1);
            pk_str(&pk, "note");
            msgpack_pack_uint64(&pk, 2);
        }
    }
    cr_assert_eq(km_protocol_decode(dec, sb.data, sb.size, &m), KM_OK, "%s",
                 km_protocol_decoder_last_error(dec));
    cr_assert_eq(m.route.routes[0].status, KM_OK);
    cr_assert_eq(m.route.routes[1].status, KM_ERR_PARSE);
    msgpack_sbuffer_destroy(&sb);
    /* {"type": "HELLO", "protocol": 1}: no id, but a HELLO */
    msgpack_sbuffer_init(&sb);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_map(&pk, 2);
    pk_str(&pk, "type");
    pk_str(&pk, "HELLO");
    pk_str(&pk, "protocol");
    msgpack_pack_uint64(&pk, 1);
    cr_assert_eq(km_protocol_decode(dec, sb.data, sb.size, &m), KM_ERR_PARSE);
    cr_assert_eq(m.type, KM_MESSAGE_HELLO);
    cr_assert(!m.has_id);
    msgpack_sbuffer_destroy(&sb);
    km_protocol_decoder_destroy(dec);
}

/* PROTOCOL.md: a failed route's decision echoes its request_id and attempt_id. A route whose map
 * repeats a key fails alone (KM_ERR_PARSE), and its ids are still read wherever the repeat is, as
 * for any other bad field of the route. */
Test(protocol, a_route_with_a_key_twice_keeps_its_ids, .timeout = 10)
{
    km_protocol_decoder *dec;
    cr_assert_eq(km_protocol_decoder_create(NULL, &dec), KM_OK);
    static const char *const twice[] = {"tokens", "note", "request_id"};
    for (int t = 0; t < 3; t++) {
        msgpack_sbuffer sb;
        msgpack_packer pk;
        msgpack_sbuffer_init(&sb);
        msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
        msgpack_pack_map(&pk, 3);
        pk_str(&pk, "type");
        pk_str(&pk, "ROUTE");
        pk_str(&pk, "id");
        msgpack_pack_uint64(&pk, 4);
        pk_str(&pk, "routes");
        msgpack_pack_array(&pk, 1);
        msgpack_pack_map(&pk, 5);
        pk_str(&pk, twice[t]);
        if (t == 2)
            pk_str(&pk, "r7");
        else
            msgpack_pack_array(&pk, 0);
        pk_str(&pk, twice[t]);
        if (t == 2)
            pk_str(&pk, "r8");
        else
            msgpack_pack_array(&pk, 0);
        pk_str(&pk, t == 2 ? "tokens" : "request_id");
        if (t == 2)
            msgpack_pack_array(&pk, 0);
        else
            pk_str(&pk, "r7");
        pk_str(&pk, "attempt_id");
        msgpack_pack_uint64(&pk, 3);
        pk_str(&pk, "pool");
        pk_str(&pk, "main");
        km_message m;
        cr_assert_eq(km_protocol_decode(dec, sb.data, sb.size, &m), KM_OK, "%s",
                     km_protocol_decoder_last_error(dec));
        const km_route_request *r = &m.route.routes[0];
        cr_assert_eq(r->status, KM_ERR_PARSE, "\"%s\" twice", twice[t]);
        cr_assert_not_null(strstr(r->message, "twice"), "%s", r->message);
        cr_assert(r->request_id && strcmp(r->request_id, "r7") == 0,
                  "\"%s\" twice: request_id %s", twice[t], r->request_id ? r->request_id : "NULL");
        cr_assert(r->attempt_id && strcmp(r->attempt_id, "3") == 0, "\"%s\" twice", twice[t]);
        msgpack_sbuffer_destroy(&sb);
    }
    km_protocol_decoder_destroy(dec);
}
