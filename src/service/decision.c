/* One route's decision, on the scheduler role with admin_lock and active_lock held: candidates
 * and their eligibility, the policy, active work begun, the reply's rows, the attempt kept for
 * its outcome record, the decision record, and approximate-mode learning. */
#include <inttypes.h>
#include <math.h>
#include <string.h>

#include "kvmatch/kvmatch.h"
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
 * prediction `approx` (RECORDS.md, "source"). Until 2026-11-30 the chosen worker alone decided
 * it, so an assumed match on another owner was labelled `events`. */
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

/* Decide one route whose scoring result is rr (admin_lock and active_lock held). Fills the reply
 * decision *d (candidate arrays in the job's memory) or fails the route. */
void km_srv_decide_route(km_server *s, job *j, route_job *r, pool *p, const km_request_result *rr,
                         batch_scratch *b, km_route_decision *d, uint64_t scored_ns)
{
    /* Candidates: the request's (each must be a worker of this pool), else the pool's. */
    const uint32_t *ids = r->candidates ? r->candidates : p->members;
    uint32_t n = r->candidates ? r->n_candidates : p->n_members;
    if (n == 0) {
        km_srv_route_fail(r, KM_ERR_NOT_FOUND, "pool %s has no workers", p->name);
        return;
    }
    /* The route's own candidates must be members, each once (the pool's members are, by
     * construction). Duplicates are found in O(n) with a stamp per worker id. */
    for (uint32_t i = 0; r->candidates && i < n; i++) {
        if (!km_srv_pool_is_member(p, ids[i])) {
            km_srv_route_fail(r, KM_ERR_NOT_FOUND, "candidate worker %u is not in pool %s", ids[i],
                              p->name);
            return;
        }
        if (i == 0)
            km_srv_scratch_next_stamp(s, b);
        if (b->seen[ids[i]] == b->candidate_stamp) {
            km_srv_route_fail(r, KM_ERR_INVALID_ARGUMENT, "candidate worker %u is listed twice",
                              ids[i]);
            return;
        }
        b->seen[ids[i]] = b->candidate_stamp;
    }
    if (km_srv_scratch_reserve(b, n)) {
        km_srv_route_fail(r, KM_ERR_OUT_OF_MEMORY, "candidate scratch");
        return;
    }
    const km_worker_match *m = p->results.matches + rr->first;
    const km_match_tiers *tiers = p->results.tiers + rr->first;
    uint64_t now = now_ns();
    /* Eligible candidates first, in the route's order, then the ineligible ones (unhealthy or
     * held back by their breaker), also in order: the policy weighs the first n_eligible; the
     * others still have rows, so the reply and the record show what they held. */
    /* While no worker of the service is unhealthy or has a tripped breaker (the usual case), every
     * candidate is eligible and goes straight to its place. */
    bool check_health = s->health_restricted > 0;
    uint32_t n_eligible = 0, back = n, unhealthy = 0, breaker_open = 0, probing = 0;
    for (uint32_t i = 0; i < n; i++) {
        km_policy_candidate cand;
        km_policy_candidate *c = check_health ? &cand : &b->cands[i];
        memset(c, 0, sizeof *c);
        c->worker = ids[i];
        uint32_t at;
        const km_worker_match *hit = find_match(m, rr->count, ids[i], &at);
        if (hit) {
            c->depth = hit->depth;
            c->host_blocks = tiers[at].host_blocks;
            c->disk_blocks = tiers[at].disk_blocks;
            c->device_blocks = hit->depth - c->host_blocks - c->disk_blocks;
        }
        km_active_load load;
        if (km_active_worker_load(s->active, ids[i], &load) == KM_OK) {
            c->in_flight = load.in_flight > UINT32_MAX ? UINT32_MAX : (uint32_t)load.in_flight;
            c->pending_prefill_tokens = load.pending_prefill_tokens;
            c->active_decode_blocks = load.active_decode_blocks;
        }
        km_worker_stats ws;
        if (km_index_worker_stats(p->index, ids[i], &ws) == KM_OK)
            c->indexed_blocks = ws.blocks;
        if (!check_health) {
            n_eligible++;
            continue;
        }
        eligibility e = km_srv_worker_eligibility(s, ids[i], now);
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
        return;
    }
    km_policy_config pc = p->policy;
    if (r->policy_name && km_policy_kind_parse(r->policy_name, &pc.kind) != KM_OK) {
        km_srv_route_fail(r, KM_ERR_INVALID_ARGUMENT, "unknown policy \"%s\"", r->policy_name);
        return;
    }
    km_policy_request req = {r->n_hashes, p->block_size, r->prompt_tokens,
                             r->has_expected_output_tokens ? r->expected_output_tokens : 0};
    km_policy_decision pd;
    int rc = km_policy_decide(&pc, &p->policy_state, &req, b->cands, n_eligible, &pd, b->costs);
    if (rc != KM_OK) {
        km_srv_route_fail(r, rc, "%s", km_policy_last_error(&p->policy_state));
        return;
    }
    for (uint32_t i = n_eligible; i < n; i++)
        b->costs[i] = NAN; /* not weighed */
    uint32_t chosen = b->cands[pd.chosen].worker;
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
    uint32_t owner = has_owner ? b->cands[owner_at].worker : 0;
    const char *chosen_state = km_srv_worker_state_in_batch(s, chosen);
    bool observed = prediction_observed(s, b->cands, n, has_owner, owner, chosen);

    /* Active work first: a duplicate attempt id fails the route before anything is recorded. */
    uint32_t prompt = r->prompt_tokens > UINT32_MAX ? UINT32_MAX : (uint32_t)r->prompt_tokens;
    uint64_t predicted = (uint64_t)pd.chosen_depth * p->block_size;
    uint32_t expected = r->expected_output_tokens > UINT32_MAX ? UINT32_MAX
                                                               : (uint32_t)r->expected_output_tokens;
    km_active_key key = km_active_key_of(r->request_id, r->attempt_id);
    for (int tries = 0; tries < 2; tries++) {
        rc = km_active_begin(s->active, chosen, &key, prompt,
                             predicted > UINT32_MAX ? UINT32_MAX : (uint32_t)predicted, expected,
                             p->block_size, now);
        /* Full: the least recently touched entry makes room (km_srv_record_evicted), once. */
        if (rc != KM_ERR_OVERLOADED ||
            km_active_evict_oldest(s->active, now, km_srv_record_evicted, s) != KM_OK)
            break;
    }
    if (rc != KM_OK) {
        km_srv_route_fail(r, rc == KM_ERR_PROTOCOL ? KM_ERR_INVALID_ARGUMENT : rc,
                          rc == KM_ERR_PROTOCOL ? "request %s attempt %s is already in flight"
                                                : "%s%s",
                          rc == KM_ERR_PROTOCOL ? r->request_id : "active work: ",
                          rc == KM_ERR_PROTOCOL ? (r->attempt_id ? r->attempt_id : "(none)")
                                                : km_active_last_error(s->active));
        return;
    }
    uint64_t decision_id = atomic_fetch_add(&s->next_decision_id, 1);

    /* The candidates' rows, for the reply (unless the route asked for a brief one) and for the
     * decision record. A brief route with records off needs none: they would be written and
     * never read. */
    km_candidate_score *scores = NULL;
    if (!r->brief || s->records) {
        scores = km_srv_job_alloc(j, n * sizeof *scores);
        if (!scores) {
            km_active_finish(s->active, &key, KM_ACTIVE_END_ERROR, now, NULL);
            km_srv_route_fail(r, KM_ERR_OUT_OF_MEMORY, "reply candidates");
            return;
        }
    }
    const char *load_kind = km_policy_load_kind(pc.kind);
    for (uint32_t i = 0; scores && i < n; i++) {
        const km_policy_candidate *c = &b->cands[i];
        km_candidate_score *sc = &scores[i];
        memset(sc, 0, sizeof *sc);
        sc->worker = c->worker;
        sc->depth = c->depth;
        sc->device_blocks = c->device_blocks;
        sc->host_blocks = c->host_blocks;
        sc->disk_blocks = c->disk_blocks;
        sc->load.in_flight = c->in_flight;
        sc->load.pending_prefill_tokens = c->pending_prefill_tokens;
        sc->load.active_decode_blocks = c->active_decode_blocks;
        sc->cost = b->costs[i];
        sc->state = km_srv_worker_state_in_batch(s, c->worker);
        sc->eligible = i < n_eligible;
    }
    /* Load values as the record shows them: before this decision's own charge. */
    memset(d, 0, sizeof *d);
    d->status = KM_OK;
    d->request_id = r->request_id;
    d->attempt_id = r->attempt_id;
    d->decision_id = decision_id;
    d->pool = p->name;
    d->chosen_worker = chosen;
    d->chosen_depth = pd.chosen_depth;
    d->chosen_state = chosen_state;
    d->has_owner = has_owner;
    d->owner_worker = owner;
    d->owner_depth = owner_depth;
    d->owner_state = has_owner ? km_srv_worker_state_in_batch(s, owner) : NULL;
    d->n_blocks = r->n_hashes;
    d->block_size = p->block_size;
    d->source = observed ? KM_PREDICTION_EVENTS : KM_PREDICTION_APPROX;
    d->policy = km_policy_kind_name(pc.kind);
    d->reason = km_policy_reason_name(pd.reason);
    d->load_kind = load_kind;
    d->load_scope = "this_instance";
    d->load_value = km_policy_load_value(pc.kind, &b->cands[pd.chosen]);
    d->candidates = r->brief ? NULL : scores;
    d->n_candidates = r->brief ? 0 : n;

    /* The attempt, for its outcome record. */
    attempt *a = km_srv_attempt_new(&s->attempt_cache, r->request_id, r->attempt_id,
                                    r->model ? r->model : p->model, p->name, r->endpoint);
    if (a) {
        a->decision_id = decision_id;
        /* Both arrays are KM_SERVER_NAME_MAX bytes and the source is NUL-terminated. */
        memcpy(a->chosen_name, s->workers[chosen].name, sizeof a->chosen_name);
        if (has_owner)
            memcpy(a->owner_name, s->workers[owner].name, sizeof a->owner_name);
        a->has_owner = has_owner;
        a->worker = chosen;
        a->source = observed ? KM_RECORD_SOURCE_EVENTS : KM_RECORD_SOURCE_APPROX;
        a->block_size = p->block_size;
        a->chosen_depth = pd.chosen_depth;
        a->owner_depth = owner_depth;
        a->has_blocks = r->n_hashes > 0;
        km_srv_attempt_keep_hashes(s, a, p, r);
        if (s->records) /* only outcome records read it; records are set at start */
            a->decided = km_record_time_now();
        if (km_u64map_put(&s->attempts_by_decision, km_u64map_key(decision_id), (uintptr_t)a, 1) ||
            km_active_set_user(s->active, &key, a)) {
            km_u64map_erase(&s->attempts_by_decision, km_u64map_key(decision_id));
            km_srv_attempt_free(&s->attempt_cache, a);
            a = NULL;
        }
    }
    if (!a)
        km_srv_log(s, "decision %" PRIu64 ": out of memory keeping its attempt; its outcome record "
                   "will be missing", decision_id);
    /* A half-open worker's probe (km_srv_worker_eligibility); one whose attempt could not be kept
     * is not tracked, and the next route may probe too. */
    if (check_health && km_srv_worker_breaker(&s->workers[chosen], now) == BREAKER_HALF_OPEN)
        s->workers[chosen].probe_decision = decision_id;

    /* The decision record. */
    if (s->records) {
        km_decision_record rec;
        km_decision_record_init(&rec);
        rec.common.record_id = (int64_t)atomic_fetch_add(&s->next_record_id, 1);
        rec.common.instance = s->instance;
        rec.common.host = s->host;
        rec.common.kvmatch_version = KVMATCH_VERSION;
        rec.common.decision_id = (int64_t)decision_id;
        rec.common.request_id = r->request_id;
        rec.common.attempt_id = r->attempt_id ? r->attempt_id : "";
        rec.common.model = r->model ? r->model : (p->model ? p->model : p->name);
        rec.common.pool = p->name;
        rec.common.endpoint = r->endpoint;
        rec.common.time = a ? a->decided : km_record_time_now();
        rec.source = observed ? KM_RECORD_SOURCE_EVENTS : KM_RECORD_SOURCE_APPROX;
        rec.input = r->input == KM_ROUTE_INPUT_TOKENS ? KM_RECORD_INPUT_TOKENS : KM_RECORD_INPUT_HASHES;
        rec.block_size = p->block_size;
        rec.block_count = r->n_hashes;
        if (r->has_prompt_tokens || r->input == KM_ROUTE_INPUT_TOKENS)
            rec.prompt_tokens = (int64_t)r->prompt_tokens;
        if (r->has_expected_output_tokens)
            rec.expected_output_tokens = (int64_t)r->expected_output_tokens;
        rec.scored_monotonic_ns = (int64_t)scored_ns;
        rec.owner.worker = has_owner ? s->workers[owner].name : NULL;
        rec.owner.state = has_owner ? d->owner_state : NULL;
        rec.owner.depth_blocks = owner_depth;
        rec.chosen.worker = s->workers[chosen].name;
        rec.chosen.state = chosen_state;
        rec.chosen.depth_blocks = pd.chosen_depth;
        rec.policy = d->policy;
        rec.reason = d->reason;
        rec.load_kind = load_kind;
        rec.load_value = d->load_value;
        for (uint32_t i = 0; i < n; i++) {
            km_record_candidate *rc2 = &b->rcands[i];
            km_record_candidate_init(rc2);
            rc2->worker = s->workers[scores[i].worker].name;
            rc2->state = scores[i].state;
            rc2->depth_blocks = scores[i].depth;
            rc2->device_blocks = scores[i].device_blocks;
            rc2->host_blocks = scores[i].host_blocks;
            rc2->disk_blocks = scores[i].disk_blocks;
            rc2->in_flight = scores[i].load.in_flight;
            rc2->pending_prefill_tokens = (int64_t)scores[i].load.pending_prefill_tokens;
            rc2->active_decode_blocks = (int64_t)scores[i].load.active_decode_blocks;
            rc2->cost = scores[i].cost;
            rc2->eligible = scores[i].eligible;
        }
        rec.candidates = b->rcands;
        rec.n_candidates = n;
        km_record_writer_submit_decision(s->records, &rec);
    }

    /* Approximate mode: the chosen worker, when its index is not fed by its own events, is assumed
     * to hold the request's blocks from now on. */
    if (!s->workers[chosen].events && r->n_hashes)
        km_approx_record(p->approx, chosen, r->hashes, r->n_hashes, now, &b->updates);
    atomic_fetch_add(&s->st.decisions, 1);
    km_counter_add(s->m_decisions, 1);
}
