/* SPDX-License-Identifier: Apache-2.0 */
/* One route's decision, by the scheduler role with admin_lock and active_lock held, in named steps
 * over one candidate type (the policy's km_policy_candidate rows in the batch scratch, with a
 * route_choice for what is chosen from them): gather the candidates, choose, begin active work,
 * fill the reply, keep the attempt for its outcome record, begin the warm-up the policy asked for
 * (a decision of its own), record the decisions, teach approximate mode. */
#include <inttypes.h>
#include <math.h>
#include <string.h>

#include "service/server_internal.h"

static const km_worker_match *find_match(const km_worker_match *m, uint32_t count, uint32_t worker,
                                         uint32_t *index_out)
{
    uint32_t lo = 0, hi = count;
    while (lo < hi) {
        uint32_t mid = (lo + hi) / 2;
        if (m[mid].worker < worker)
            lo = mid + 1;
        else
            hi = mid;
    }
    *index_out = lo;
    return lo < count && m[lo].worker == worker ? &m[lo] : NULL;
}

/* The prediction is an observation (`events`) only when every depth it reports is one: the
 * owner's and the chosen worker's, and when nothing matched, every candidate's zero. A pool may
 * mix workers with and without event endpoints; one approximate-mode worker among those makes the
 * prediction `approx` (RECORDS.md, "source"), whichever worker is chosen. */
static bool prediction_observed(const km_server *s, const km_policy_candidate *cands, uint32_t n,
                                bool has_owner, uint32_t owner, uint32_t chosen)
{
    if (!s->workers[chosen].events || (has_owner && !s->workers[owner].events))
        return false;
    for (uint32_t i = 0; !has_owner && i < n; i++)
        if (!s->workers[cands[i].worker].events)
            return false;
    return true;
}

/* Does the pool keep queued prefixes (km_active_queue_blocks)? Only for the policy that weighs
 * them: the others never read a queued depth, and promising costs a map insert per new block. */
static bool queues_prefixes(const pool *p)
{
    return p->policy.kind == KM_POLICY_TTFT;
}

/* Blocks of a `depth`-block match an engine would count as a hit: vLLM recomputes the prompt's
 * last token, so a hit never covers it (a prompt of unknown length is not capped). */
static uint32_t engine_hit(const route_job *r, const pool *p, uint32_t depth)
{
    if (r->prompt_tokens > 0 && depth > (r->prompt_tokens - 1) / p->block_size)
        return (uint32_t)((r->prompt_tokens - 1) / p->block_size);
    return depth;
}

/* The index state of worker id, read once per scoring batch (a batch decides against one view of
 * the feeds). */
static const char *worker_state_in_batch(km_server *s, uint32_t id)
{
    worker_slot *w = &s->workers[id];
    if (w->used && w->events && w->state_batch == s->batch_stamp && w->state)
        return w->state;
    w->state = km_srv_worker_state(s, id);
    w->state_batch = s->batch_stamp;
    return w->state;
}

/* One route's decision as it passes from step to step. Its candidates are the policy's rows in the
 * batch scratch, b->cands[0..n): the n_eligible the policy weighs first, then the ineligible ones
 * (unhealthy or held back by their breaker), each part in the route's order; beside them
 * b->costs[i] (NAN for the ineligible: not weighed) and, when the reply or the record shows rows,
 * b->states[i]. Their load is what this instance saw before this decision's own charge. The rest
 * is what was chosen from them. The reply, the attempt and the decision record are each filled
 * from this, never from one another. */
typedef struct route_choice {
    uint64_t now;
    bool check_health; /* some worker of the service may be ineligible (health_restricted) */
    uint32_t n, n_eligible;
    km_policy_kind kind; /* the pool's policy, or the one the route names */
    km_policy_reason reason;
    uint32_t chosen_at; /* index into b->cands */
    uint32_t chosen, chosen_depth;
    uint32_t chosen_queued_depth; /* chosen_depth extended by prefills queued there (0: none) */
    double predicted_ttft_ms; /* the engine model's, on the chosen worker; NAN for a warm-up */
    const char *chosen_state;
    bool has_owner; /* the prediction owner: the deepest match among every candidate */
    uint32_t owner, owner_depth; /* worker 0 and depth 0 without an owner */
    const char *owner_state;     /* NULL without an owner */
    bool observed;               /* the prediction is an observation (events), else approx */
    km_active_key key;
    uint64_t decision_id;
    srv_load_view view; /* whose load the candidates carry (cluster_view.c), engine_reported
                         * joined to its scope when an engine's scrape was used */
    double engine_oldest_age_ms; /* the oldest scrape used, in ms; NAN when none */
    /* The candidate the policy asked to warm up (index into b->cands), KM_POLICY_NO_WARM_UP when
     * none, and the request's leading blocks to prefill there. */
    uint32_t warm_up_at, warm_up_blocks;
} route_choice;

/* ---- engine-reported load ----------------------------------------------------------------- */

/* A count computed in double (>= 0), as a uint64_t at most 10^18. */
static uint64_t capped_count(double v)
{
    return v >= 1e18 ? UINT64_C(1000000000000000000) : (uint64_t)v;
}

/* The engine sees every request it serves, routed here or not; kvmatch sees its own the moment it
 * routes them. So a fresh scrape (km_srv_engine_reported_fresh) raises a candidate's load and
 * never lowers it: in_flight to at least running + waiting, prefilling to at least waiting (the
 * queue llmd weighs), allocated_blocks to at least kv_usage x the engine's capacity in the pool's
 * blocks (llmd's KV usage). The requests it adds are taken to be like the ones kvmatch routed
 * there: each in flight holds their mean KV footprint (active_decode_blocks), each waiting their
 * mean pending prefill (with none of kvmatch's own waiting, prompt_tokens, the route's), so a
 * longer queue never makes a worker look cheaper. A value the engine did not report raises
 * nothing. True when the scrape was used; *age_ms is then its age. */
static bool engine_raise_load(km_server *s, const pool *p, uint64_t now, uint64_t prompt_tokens,
                              km_policy_candidate *pc, double *age_ms)
{
    km_engine_reported e;
    if (!km_srv_engine_reported_fresh(s, pc->worker, now, &e))
        return false;
    double running = isnan(e.running) ? 0.0 : e.running;
    double waiting = isnan(e.waiting) ? 0.0 : e.waiting;
    double busy = running + waiting;
    uint32_t own_in_flight = pc->in_flight, own_prefilling = pc->prefilling;
    if (busy > (double)pc->in_flight)
        pc->in_flight = busy >= (double)UINT32_MAX ? UINT32_MAX : (uint32_t)busy;
    if (waiting > (double)pc->prefilling)
        pc->prefilling = waiting >= (double)UINT32_MAX ? UINT32_MAX : (uint32_t)waiting;
    if (pc->in_flight > own_in_flight && own_in_flight) {
        double footprint = (double)pc->active_decode_blocks / own_in_flight * pc->in_flight;
        pc->active_decode_blocks = capped_count(footprint);
    }
    if (pc->prefilling > own_prefilling) {
        double extra = (double)(pc->prefilling - own_prefilling);
        double tokens = own_prefilling ? (double)pc->pending_prefill_tokens / own_prefilling
                                       : (double)prompt_tokens;
        double pairs = own_prefilling ? (double)pc->pending_prefill_pairs / own_prefilling
                                      : (double)km_engine_model_chunk_pairs(0, prompt_tokens);
        double all_tokens = (double)pc->pending_prefill_tokens + extra * tokens;
        double all_pairs = (double)pc->pending_prefill_pairs + extra * pairs;
        pc->pending_prefill_tokens = capped_count(all_tokens);
        pc->pending_prefill_pairs = capped_count(all_pairs);
    }
    if (!isnan(e.kv_usage) && e.kv_usage > 0.0) {
        /* The engine's capacity counts its own blocks; the candidate's, the pool's. */
        const km_engine_model *m = &p->policy.engine;
        double used = ceil(e.kv_usage * (double)m->capacity_blocks * (double)m->block_size /
                           (double)p->block_size);
        if (used > (double)pc->allocated_blocks)
            pc->allocated_blocks = capped_count(used);
    }
    *age_ms = (double)km_engine_reported_age_ns(&e, now) / 1e6;
    return true;
}

/* The age of the oldest contribution to the decision's load view, in ms: another instance's or an
 * engine's scrape; NAN when neither was used. */
static double oldest_contribution_ms(const route_choice *c)
{
    double a = c->view.oldest_age_ms, e = c->engine_oldest_age_ms;
    return isnan(a) || (!isnan(e) && e > a) ? e : a;
}

/* The load scope a decision states when engine scrapes were used: its view's, joined. */
static const char *engine_joined_scope(const char *scope)
{
    return strcmp(scope, "cluster") == 0 ? "cluster+engine_reported"
                                         : "this_instance+engine_reported";
}

/* The route's candidates, each with its match (depth by tier), its load and its indexed blocks,
 * the eligible ones first. False when the route failed: a candidate of its own outside the pool
 * or listed twice, no candidate at all, or none eligible. */
static bool gather_candidates(km_server *s, route_job *r, const pool *p,
                              const km_request_result *rr, batch_scratch *b, route_choice *c)
{
    /* Candidates: the request's (each must be a worker of this pool), else the pool's. */
    const uint32_t *ids = r->candidates ? r->candidates : p->members;
    uint32_t n = r->candidates ? r->n_candidates : p->n_members;
    if (n == 0) {
        km_srv_route_fail(r, KM_ERR_NOT_FOUND, "pool %s has no workers", p->name);
        return false;
    }
    /* The route's own candidates must be members, each once (the pool's members are, by
     * construction). Duplicates are found in O(n) with a stamp per worker id. */
    for (uint32_t i = 0; r->candidates && i < n; i++) {
        if (!km_srv_pool_is_member(p, ids[i])) {
            km_srv_route_fail(r, KM_ERR_NOT_FOUND, "candidate worker %u is not in pool %s", ids[i],
                              p->name);
            return false;
        }
        if (i == 0)
            km_srv_scratch_next_stamp(s, b);
        if (b->seen[ids[i]] == b->candidate_stamp) {
            km_srv_route_fail(r, KM_ERR_INVALID_ARGUMENT, "candidate worker %u is listed twice",
                              ids[i]);
            return false;
        }
        b->seen[ids[i]] = b->candidate_stamp;
    }
    if (km_srv_scratch_reserve(b, n)) {
        km_srv_route_fail(r, KM_ERR_OUT_OF_MEMORY, "candidate scratch");
        return false;
    }
    const km_worker_match *m = p->results.matches + rr->first;
    const km_match_tiers *tiers = p->results.tiers + rr->first;
    c->now = now_ns();
    km_srv_cluster_label(s, c->now, &c->view);
    /* Queued depths are read where a policy may weigh them: pools that promise queued prefixes,
     * and routes that name their own policy. */
    bool queued = queues_prefixes(p) || r->policy_name;
    /* While no worker of the service is unhealthy or has a tripped breaker (the usual case), every
     * candidate is eligible and goes straight to its place. */
    c->check_health = s->health_restricted > 0;
    uint32_t n_eligible = 0, back = n, unhealthy = 0, breaker_open = 0, probing = 0;
    bool engine_used = false;
    c->engine_oldest_age_ms = NAN;
    for (uint32_t i = 0; i < n; i++) {
        km_policy_candidate cand;
        km_policy_candidate *pc = c->check_health ? &cand : &b->cands[i];
        memset(pc, 0, sizeof *pc);
        pc->worker = ids[i];
        uint32_t at;
        const km_worker_match *hit = find_match(m, rr->count, ids[i], &at);
        if (hit) {
            pc->depth = hit->depth;
            pc->host_blocks = tiers[at].host_blocks;
            pc->disk_blocks = tiers[at].disk_blocks;
            pc->device_blocks = hit->depth - pc->host_blocks - pc->disk_blocks;
        }
        km_active_load load;
        if (km_active_worker_load(s->active, ids[i], &load) == KM_OK) {
            km_srv_cluster_add_load(s, ids[i], &load);
            pc->in_flight = load.in_flight > UINT32_MAX ? UINT32_MAX : (uint32_t)load.in_flight;
            pc->prefilling = load.prefilling > UINT32_MAX ? UINT32_MAX : (uint32_t)load.prefilling;
            pc->pending_prefill_tokens = load.pending_prefill_tokens;
            pc->pending_prefill_pairs = load.pending_prefill_pairs;
            pc->active_decode_blocks = load.active_decode_blocks;
            pc->allocated_blocks = load.allocated_blocks;
        }
        pc->last_arrival = km_active_last_arrival(s->active, ids[i]);
        double engine_age_ms;
        if (engine_raise_load(s, p, c->now, r->prompt_tokens, pc, &engine_age_ms)) {
            engine_used = true;
            if (isnan(c->engine_oldest_age_ms) || engine_age_ms > c->engine_oldest_age_ms)
                c->engine_oldest_age_ms = engine_age_ms;
        }
        km_worker_stats ws;
        if (km_index_worker_stats(p->index, ids[i], &ws) == KM_OK)
            pc->indexed_blocks = ws.blocks;
        if (queued) {
            pc->queued_depth =
                km_srv_cluster_queued_depth(s, ids[i], r->hashes, r->n_hashes, pc->depth);
            uint32_t held =
                engine_hit(r, p, pc->queued_depth > pc->depth ? pc->queued_depth : pc->depth);
            if (held)
                pc->prefix_sharers = km_srv_cluster_prefix_sharers(s, ids[i], r->hashes[held - 1]);
        }
        if (!c->check_health) {
            n_eligible++;
            continue;
        }
        eligibility e = km_srv_worker_eligibility(s, ids[i], c->now);
        if (e == ELIGIBLE)
            b->cands[n_eligible++] = cand;
        else
            b->cands[--back] = cand;
        unhealthy += e == INELIGIBLE_UNHEALTHY;
        breaker_open += e == INELIGIBLE_BREAKER_OPEN;
        probing += e == INELIGIBLE_PROBING;
    }
    for (uint32_t lo = n_eligible, hi = n; lo + 1 < hi; lo++, hi--) { /* the route's order */
        km_policy_candidate t = b->cands[lo];
        b->cands[lo] = b->cands[hi - 1];
        b->cands[hi - 1] = t;
    }
    if (n_eligible == 0) {
        atomic_fetch_add(&s->st.no_healthy, 1);
        km_srv_route_fail(r, KM_ERR_NO_HEALTHY_WORKER,
                          "no eligible worker among the %u candidates of pool %s: %u unhealthy "
                          "(the router's word), %u circuit breaker%s open, %u half-open with a "
                          "probe in flight", n, p->name, unhealthy, breaker_open,
                          breaker_open == 1 ? "" : "s", probing);
        return false;
    }
    c->n = n;
    c->n_eligible = n_eligible;
    if (engine_used)
        c->view.scope = engine_joined_scope(c->view.scope);
    return true;
}

/* The policy's choice among the eligible candidates, the prediction owner among all of them, and
 * the source of the prediction. False when the route failed: an unknown policy name, or the
 * policy refused the candidates. */
static bool choose(km_server *s, route_job *r, pool *p, batch_scratch *b, route_choice *c)
{
    km_policy_config pc = p->policy;
    if (r->policy_name && km_policy_kind_parse(r->policy_name, &pc.kind) != KM_OK) {
        km_srv_route_fail(r, KM_ERR_INVALID_ARGUMENT, "unknown policy \"%s\"", r->policy_name);
        return false;
    }
    km_policy_request req = {r->n_hashes, p->block_size, r->prompt_tokens,
                             r->has_expected_output_tokens ? r->expected_output_tokens : 0,
                             r->warm_ups};
    km_policy_decision pd;
    int rc = km_policy_decide(&pc, &p->policy_state, &req, b->cands, c->n_eligible, &pd, b->costs);
    if (rc != KM_OK) {
        km_srv_route_fail(r, rc, "%s", km_policy_last_error(&p->policy_state));
        return false;
    }
    uint32_t n = c->n, n_eligible = c->n_eligible;
    for (uint32_t i = n_eligible; i < n; i++)
        b->costs[i] = NAN; /* not weighed */
    c->kind = pc.kind;
    c->reason = pd.reason;
    c->chosen_at = pd.chosen;
    c->chosen = b->cands[pd.chosen].worker;
    c->chosen_depth = pd.chosen_depth;
    c->chosen_queued_depth = b->cands[pd.chosen].queued_depth;
    c->predicted_ttft_ms = pd.chosen_predicted_ttft_ms;
    c->warm_up_at = pd.warm_up;
    c->warm_up_blocks = pd.warm_up_blocks;
    /* The prediction owner is the deepest match among every candidate: an ineligible worker that
     * holds more than any eligible one is the owner (the record says where the KV is, and that it
     * could not be used); ties with an eligible one stay with the policy's owner, ties among
     * ineligible ones are broken by the policy's rule too (km_policy_owner). */
    bool has_owner = pd.owner != KM_POLICY_NO_OWNER;
    uint32_t owner_at = pd.owner, owner_depth = has_owner ? pd.owner_depth : 0;
    uint32_t tail = km_policy_owner(b->cands + n_eligible, n - n_eligible);
    if (tail != KM_POLICY_NO_OWNER && b->cands[n_eligible + tail].depth > owner_depth) {
        owner_at = n_eligible + tail;
        owner_depth = b->cands[owner_at].depth;
        has_owner = true;
    }
    c->has_owner = has_owner;
    c->owner = has_owner ? b->cands[owner_at].worker : 0;
    c->owner_depth = owner_depth;
    c->chosen_state = worker_state_in_batch(s, c->chosen);
    c->observed = prediction_observed(s, b->cands, n, has_owner, c->owner, c->chosen);
    return true;
}

/* The route's active work on the chosen worker, and its decision id. Active work comes first: a
 * duplicate attempt id fails the route before anything is recorded. False when the route failed:
 * already in flight, or no room in the active-work table (after evicting its oldest entry where
 * may_evict: a warm-up, which no user waits for, never ends a request's active work). */
static bool begin_active_work(km_server *s, route_job *r, const pool *p, route_choice *c,
                              bool may_evict)
{
    uint32_t prompt = r->prompt_tokens > UINT32_MAX ? UINT32_MAX : (uint32_t)r->prompt_tokens;
    /* The prefill it adds: what neither the worker's cache nor the prefills queued there cover,
     * of which the engine counts a hit short of the prompt's last token (engine_hit), as the
     * policies weigh it: a block-aligned full match still prefills its last block. */
    uint32_t covered = c->chosen_queued_depth > c->chosen_depth ? c->chosen_queued_depth
                                                                : c->chosen_depth;
    uint32_t hit = engine_hit(r, p, covered);
    uint64_t predicted = (uint64_t)hit * p->block_size;
    uint32_t expected = r->expected_output_tokens > UINT32_MAX ? UINT32_MAX
                                                               : (uint32_t)r->expected_output_tokens;
    c->key = km_active_key_of(r->request_id, r->attempt_id);
    /* The attempt kept for its outcome record (keep_attempt) counts toward the bytes bound. */
    uint32_t attempt_bytes = km_srv_attempt_bytes(r->request_id, r->attempt_id,
                                                  r->model ? r->model : p->model, p->name,
                                                  r->endpoint);
    int rc = KM_OK;
    for (int tries = 0; tries < 2; tries++) {
        rc = km_active_begin_with_user_bytes(
            s->active, c->chosen, &c->key, prompt,
            predicted > UINT32_MAX ? UINT32_MAX : (uint32_t)predicted, expected, p->block_size,
            attempt_bytes, c->now);
        /* Full: the least recently touched entry makes room (km_srv_record_evicted), once. */
        if (rc != KM_ERR_OVERLOADED || !may_evict ||
            km_active_evict_oldest(s->active, c->now, km_srv_record_evicted, s) != KM_OK)
            break;
    }
    if (rc != KM_OK) {
        km_srv_route_fail(r, rc == KM_ERR_PROTOCOL ? KM_ERR_INVALID_ARGUMENT : rc,
                          rc == KM_ERR_PROTOCOL ? "request %s attempt %s is already in flight"
                                                : "%s%s",
                          rc == KM_ERR_PROTOCOL ? r->request_id : "active work: ",
                          rc == KM_ERR_PROTOCOL ? (r->attempt_id ? r->attempt_id : "(none)")
                                                : km_active_last_error(s->active));
        return false;
    }
    /* The cached prefix it will use there, so concurrent requests on one prefix count its KV
     * once (best effort: without memory for it, the request counts whole). */
    if (hit && hit <= r->n_hashes)
        km_active_share_prefix(s->active, &c->key, r->hashes[hit - 1], hit * p->block_size);
    /* The blocks its prefill will store there, promised until its first token (best effort as
     * above: without memory, later routes see only the index), where a policy weighs them: on a
     * pool that queues prefixes, and for a route `ttft` decided on any pool (its own policy, or
     * its warm-up), so that the next route naming `ttft` sees the prefix coming. */
    if ((queues_prefixes(p) || c->kind == KM_POLICY_TTFT) && covered < r->n_hashes)
        if (km_active_queue_blocks(s->active, &c->key, r->hashes + covered,
                                   r->n_hashes - covered) == KM_OK)
            atomic_store(&s->stored_wanted, true); /* its progress is watched (attempts.c) */
    c->decision_id = atomic_fetch_add(&s->next_decision_id, 1);
    km_srv_cluster_publish(s, c->chosen);
    return true;
}

/* The owner's index state, and (rows) every candidate's, for the reply's and the record's rows. */
static void read_states(km_server *s, batch_scratch *b, bool rows, route_choice *c)
{
    for (uint32_t i = 0; rows && i < c->n; i++)
        b->states[i] = worker_state_in_batch(s, b->cands[i].worker);
    c->owner_state = c->has_owner ? worker_state_in_batch(s, c->owner) : NULL;
}

/* The reply's decision *d, with the pool's name and the candidates' rows (unless the route asked
 * for a brief reply) in the job's memory: the reply is encoded after admin_lock is released, when
 * a POOLS remove may have freed the pool. False when the route failed (no memory for them): its
 * active work ends. */
static bool fill_reply(km_server *s, job *j, route_job *r, const pool *p, const batch_scratch *b,
                       const route_choice *c, km_route_decision *d)
{
    km_candidate_score *rows = NULL;
    size_t name_size = strlen(p->name) + 1;
    char *pool_name = km_srv_job_alloc(j, name_size);
    if (!pool_name) {
        km_active_finish(s->active, &c->key, KM_ACTIVE_END_ERROR, c->now, NULL);
        km_srv_cluster_publish(s, c->chosen);
        km_srv_route_fail(r, KM_ERR_OUT_OF_MEMORY, "reply pool name");
        return false;
    }
    memcpy(pool_name, p->name, name_size);
    if (!r->brief) {
        rows = km_srv_job_alloc(j, c->n * sizeof *rows);
        if (!rows) {
            km_active_finish(s->active, &c->key, KM_ACTIVE_END_ERROR, c->now, NULL);
            km_srv_cluster_publish(s, c->chosen);
            km_srv_route_fail(r, KM_ERR_OUT_OF_MEMORY, "reply candidates");
            return false;
        }
    }
    for (uint32_t i = 0; rows && i < c->n; i++) {
        const km_policy_candidate *pc = &b->cands[i];
        km_candidate_score *row = &rows[i];
        memset(row, 0, sizeof *row);
        row->worker = pc->worker;
        row->depth = pc->depth;
        row->device_blocks = pc->device_blocks;
        row->host_blocks = pc->host_blocks;
        row->disk_blocks = pc->disk_blocks;
        row->load.in_flight = pc->in_flight;
        row->load.pending_prefill_tokens = pc->pending_prefill_tokens;
        row->load.active_decode_blocks = pc->active_decode_blocks;
        row->cost = b->costs[i];
        row->state = b->states[i];
        row->eligible = i < c->n_eligible;
    }
    memset(d, 0, sizeof *d);
    d->status = KM_OK;
    d->request_id = r->request_id;
    d->attempt_id = r->attempt_id;
    d->decision_id = c->decision_id;
    d->pool = pool_name;
    d->chosen_worker = c->chosen;
    d->chosen_depth = c->chosen_depth;
    d->chosen_state = c->chosen_state;
    d->has_owner = c->has_owner;
    d->owner_worker = c->owner;
    d->owner_depth = c->owner_depth;
    d->owner_state = c->owner_state;
    d->n_blocks = r->n_hashes;
    d->block_size = p->block_size;
    d->source = c->observed ? KM_PREDICTION_EVENTS : KM_PREDICTION_APPROX;
    d->policy = km_policy_kind_name(c->kind);
    d->reason = km_policy_reason_name(c->reason);
    d->load_kind = km_policy_load_kind(c->kind);
    d->load_scope = c->view.scope;
    d->load_value = km_policy_load_value(c->kind, &b->cands[c->chosen_at]);
    d->load_instances = c->view.instances;
    d->load_oldest_age_ms = oldest_contribution_ms(c);
    d->load_stale_instances = "";
    if (c->view.stale[0]) {
        char *stale = km_srv_job_alloc(j, strlen(c->view.stale) + 1);
        if (stale)
            d->load_stale_instances = strcpy(stale, c->view.stale);
    }
    d->candidates = rows;
    d->n_candidates = rows ? c->n : 0;
    return true;
}

/* The attempt its outcome record will need, kept until FINISHED or expiry; NULL (logged) when it
 * could not be kept, and the outcome record will be missing. A half-open worker's probe is this
 * decision (km_srv_worker_eligibility); one whose attempt could not be kept is not tracked, and
 * the next route may probe too. */
static attempt *keep_attempt(km_server *s, route_job *r, pool *p, const route_choice *c)
{
    attempt *a = km_srv_attempt_new(&s->attempt_cache, r->request_id, r->attempt_id,
                                    r->model ? r->model : p->model, p->name, r->endpoint);
    if (a) {
        a->decision_id = c->decision_id;
        /* Both arrays are KM_SERVER_NAME_MAX bytes and the source is NUL-terminated. */
        memcpy(a->chosen_name, s->workers[c->chosen].name, sizeof a->chosen_name);
        if (c->has_owner)
            memcpy(a->owner_name, s->workers[c->owner].name, sizeof a->owner_name);
        a->has_owner = c->has_owner;
        a->worker = c->chosen;
        a->source = c->observed ? KM_RECORD_SOURCE_EVENTS : KM_RECORD_SOURCE_APPROX;
        a->block_size = p->block_size;
        a->chosen_depth = c->chosen_depth;
        a->owner_depth = c->owner_depth;
        a->predicted_ttft_ms = c->predicted_ttft_ms;
        a->decided_ns = c->now;
        a->ttft_ratio = p->m_ttft_ratio;
        a->has_blocks = r->n_hashes > 0;
        /* A warm-up of an approximate-mode worker is taught when its prefill has run. */
        a->lesson_at_first_token = c->reason == KM_POLICY_REASON_WARM_UP &&
                                   !s->workers[c->chosen].events;
        km_srv_attempt_keep_hashes(s, a, p, r, a->lesson_at_first_token);
        if (s->records) /* only outcome records read it; records are set at start */
            a->decided = km_record_time_now();
        uint64_t key = km_u64map_key(c->decision_id);
        if (km_u64map_put(&s->attempts_by_decision, key, (uintptr_t)a, 1) ||
            km_active_set_user(s->active, &c->key, a)) {
            km_u64map_erase(&s->attempts_by_decision, key);
            km_srv_attempt_free(&s->attempt_cache, a);
            a = NULL;
        }
    }
    if (!a)
        km_srv_log(s, KM_LOG_ERROR
                   "decision %" PRIu64 ": out of memory keeping its attempt; its outcome record "
                   "will be missing", c->decision_id);
    worker_slot *w = &s->workers[c->chosen];
    if (c->check_health && km_srv_worker_breaker(w, c->now) == BREAKER_HALF_OPEN)
        w->probe_decision = c->decision_id;
    return a;
}

/* The decision record (records on), at the attempt's decision time when it was kept. warm_up: the
 * warm-up this decision asked for, or NULL; warm_up_for: the decision this one is the warm-up
 * of, or NULL. */
static void record_decision(km_server *s, const route_job *r, const pool *p, batch_scratch *b,
                            const route_choice *c, const attempt *a, uint64_t scored_ns,
                            const route_choice *warm_up, const route_choice *warm_up_for)
{
    km_decision_record rec;
    km_decision_record_init(&rec);
    rec.common = km_srv_record_common(s, c->decision_id, r->request_id, r->attempt_id,
                                      r->model ? r->model : (p->model ? p->model : p->name),
                                      p->name, r->endpoint);
    rec.common.time = a ? a->decided : km_record_time_now();
    rec.source = c->observed ? KM_RECORD_SOURCE_EVENTS : KM_RECORD_SOURCE_APPROX;
    rec.input = r->input == KM_ROUTE_INPUT_TOKENS ? KM_RECORD_INPUT_TOKENS : KM_RECORD_INPUT_HASHES;
    rec.block_size = p->block_size;
    rec.block_count = r->n_hashes;
    if (r->has_prompt_tokens || r->input == KM_ROUTE_INPUT_TOKENS)
        rec.prompt_tokens = (int64_t)r->prompt_tokens;
    if (r->has_expected_output_tokens)
        rec.expected_output_tokens = (int64_t)r->expected_output_tokens;
    rec.scored_monotonic_ns = (int64_t)scored_ns;
    rec.owner.worker = c->has_owner ? s->workers[c->owner].name : NULL;
    rec.owner.state = c->owner_state;
    rec.owner.depth_blocks = c->owner_depth;
    rec.chosen.worker = s->workers[c->chosen].name;
    rec.chosen.state = c->chosen_state;
    rec.chosen.depth_blocks = c->chosen_depth;
    rec.predicted_ttft_ms = c->predicted_ttft_ms;
    rec.policy = km_policy_kind_name(c->kind);
    rec.reason = km_policy_reason_name(c->reason);
    rec.load_kind = km_policy_load_kind(c->kind);
    rec.load_value = km_policy_load_value(c->kind, &b->cands[c->chosen_at]);
    rec.load_scope = c->view.scope;
    rec.load_instances = c->view.instances;
    rec.load_oldest_age_ms = oldest_contribution_ms(c);
    rec.load_stale_instances = c->view.stale[0] ? c->view.stale : NULL;
    for (uint32_t i = 0; i < c->n; i++) {
        const km_policy_candidate *pc = &b->cands[i];
        km_record_candidate *row = &b->rcands[i];
        km_record_candidate_init(row);
        row->worker = s->workers[pc->worker].name;
        row->state = b->states[i];
        row->depth_blocks = pc->depth;
        row->device_blocks = pc->device_blocks;
        row->host_blocks = pc->host_blocks;
        row->disk_blocks = pc->disk_blocks;
        row->in_flight = pc->in_flight;
        row->pending_prefill_tokens = (int64_t)pc->pending_prefill_tokens;
        row->active_decode_blocks = (int64_t)pc->active_decode_blocks;
        if (queues_prefixes(p) || r->policy_name) /* where the decision read them */
            row->queued_depth_blocks =
                (int64_t)(pc->queued_depth > pc->depth ? pc->queued_depth : pc->depth);
        row->last_arrival = pc->last_arrival > INT64_MAX ? INT64_MAX : (int64_t)pc->last_arrival;
        row->cost = b->costs[i];
        row->eligible = i < c->n_eligible;
    }
    rec.candidates = b->rcands;
    rec.n_candidates = c->n;
    if (warm_up) {
        rec.warm_up.worker = s->workers[warm_up->chosen].name;
        rec.warm_up.blocks = c->warm_up_blocks;
        rec.warm_up.decision_id = (int64_t)warm_up->decision_id;
    }
    if (warm_up_for)
        rec.warm_up_for = (int64_t)warm_up_for->decision_id;
    km_record_writer_submit_decision(s->records, &rec);
}

/* Approximate mode: the chosen worker, when its index is not fed by its own events, is assumed to
 * hold the request's blocks from now on. The updates collect in b->updates; the batch applies them
 * to the pools' indexes after its last decision (scheduler.c). The other instances of a cluster
 * are told the same prediction. */
static void approx_learn(km_server *s, const route_job *r, pool *p, batch_scratch *b,
                         const route_choice *c)
{
    if (!s->workers[c->chosen].events && r->n_hashes) {
        km_approx_record(p->approx, c->chosen, r->hashes, r->n_hashes, c->now, &b->updates);
        km_srv_cluster_publish_prediction(s, p, c->chosen, false, r->hashes, r->n_hashes);
    }
}

/* The warm-up the policy asked for with the decision c of route r: a decision of its own, *wc for
 * the route *wr (a prefill of r's first warm_up_blocks blocks, one output token, the attempt id
 * r's with ":warm_up" appended, in the job's memory) on the worker to warm. Its active work begins
 * there with those blocks queued, so the next routes see them coming. False when it could not
 * begin (logged): c's decision stands without it. */
static bool begin_warm_up(km_server *s, job *j, const route_job *r, pool *p, const batch_scratch *b,
                          const route_choice *c, route_job *wr, route_choice *wc)
{
    static const char suffix[] = ":warm_up";
    const km_policy_candidate *row = &b->cands[c->warm_up_at];
    const char *base = r->attempt_id ? r->attempt_id : "";
    size_t n = strlen(base);
    char *attempt_id = km_srv_job_alloc(j, n + sizeof suffix);
    if (!attempt_id) {
        km_srv_log(s, KM_LOG_WARNING "request %s: out of memory for its warm-up; decided "
                   "without it", r->request_id);
        return false;
    }
    memcpy(attempt_id, base, n);
    memcpy(attempt_id + n, suffix, sizeof suffix);
    *wr = *r;
    wr->attempt_id = attempt_id;
    wr->n_hashes = c->warm_up_blocks;
    /* An engine hashes a block once the pool's lookahead tokens after it are there too. */
    wr->prompt_tokens = (uint64_t)c->warm_up_blocks * p->block_size + p->hash_lookahead_tokens;
    if (r->has_prompt_tokens && wr->prompt_tokens > r->prompt_tokens)
        wr->prompt_tokens = r->prompt_tokens;
    wr->has_prompt_tokens = true;
    wr->expected_output_tokens = 1;
    wr->has_expected_output_tokens = true;
    wr->candidates = NULL;
    wr->n_candidates = 0;
    wr->brief = true;
    wr->warm_ups = false;
    /* The warmed worker's hit is below warm_up_blocks (km_policy_decide), so its depths fit. */
    memset(wc, 0, sizeof *wc);
    wc->now = c->now;
    wc->check_health = c->check_health;
    wc->n = wc->n_eligible = 1;
    wc->kind = c->kind;
    wc->reason = KM_POLICY_REASON_WARM_UP;
    wc->chosen = row->worker;
    wc->chosen_depth = row->depth;
    wc->chosen_queued_depth = row->queued_depth;
    wc->predicted_ttft_ms = NAN; /* nobody waits for a warm-up's first token */
    wc->chosen_state = worker_state_in_batch(s, row->worker);
    wc->has_owner = row->depth > 0;
    wc->owner = row->worker;
    wc->owner_depth = row->depth;
    wc->owner_state = wc->has_owner ? wc->chosen_state : NULL;
    wc->observed = s->workers[row->worker].events;
    wc->view = c->view;
    wc->engine_oldest_age_ms = c->engine_oldest_age_ms;
    wc->warm_up_at = KM_POLICY_NO_WARM_UP;
    if (!begin_active_work(s, wr, p, wc, false)) {
        km_srv_log(s, KM_LOG_WARNING "request %s: its warm-up of worker %u did not begin (%s); "
                   "decided without it", r->request_id, row->worker, wr->message);
        return false;
    }
    return true;
}

/* The warm-up's decision record: its one candidate, the warmed worker's row (not weighed: no
 * cost), beside the decision it is the warm-up of. */
static void record_warm_up(km_server *s, const route_job *wr, const pool *p, batch_scratch *b,
                           const route_choice *c, const route_choice *wc, const attempt *wa,
                           uint64_t scored_ns)
{
    batch_scratch one = *b;
    km_policy_candidate row = b->cands[c->warm_up_at];
    double cost = NAN;
    const char *state = wc->chosen_state;
    one.cands = &row;
    one.costs = &cost;
    one.states = &state;
    record_decision(s, wr, p, &one, wc, wa, scored_ns, NULL, c);
}

/* Decide one route whose scoring result is rr (admin_lock and active_lock held). Fills the reply
 * decision *d (candidate rows in the job's memory) or fails the route. */
void km_srv_decide_route(km_server *s, job *j, route_job *r, pool *p, const km_request_result *rr,
                         batch_scratch *b, km_route_decision *d, uint64_t scored_ns)
{
    route_choice c;
    if (!gather_candidates(s, r, p, rr, b, &c) || !choose(s, r, p, b, &c) ||
        !begin_active_work(s, r, p, &c, true))
        return;
    read_states(s, b, !r->brief || s->records, &c); /* a brief route without records has no rows */
    if (!fill_reply(s, j, r, p, b, &c, d))
        return;
    attempt *a = keep_attempt(s, r, p, &c);
    route_job wr;
    route_choice wc;
    bool warm = c.warm_up_at != KM_POLICY_NO_WARM_UP &&
                begin_warm_up(s, j, r, p, b, &c, &wr, &wc);
    attempt *wa = warm ? keep_attempt(s, &wr, p, &wc) : NULL;
    if (warm) {
        d->has_warm_up = true;
        d->warm_up_attempt_id = wr.attempt_id;
        d->warm_up_worker = wc.chosen;
        d->warm_up_blocks = c.warm_up_blocks;
        d->warm_up_tokens = wr.prompt_tokens;
        d->warm_up_decision_id = wc.decision_id;
    }
    if (s->records) {
        record_decision(s, r, p, b, &c, a, scored_ns, warm ? &wc : NULL, NULL);
        if (warm)
            record_warm_up(s, &wr, p, b, &c, &wc, wa, scored_ns);
    }
    approx_learn(s, r, p, b, &c);
    atomic_fetch_add(&s->st.decisions, 1);
    km_counter_add(s->m_decisions, 1);
    if (warm) {
        /* Approximate mode learns a warm-up when its prefill has run (attempts.c); until then the
         * next routes see its blocks queued there. */
        atomic_fetch_add(&s->st.warm_ups, 1);
        km_counter_add(s->m_warm_ups, 1);
    }
}
