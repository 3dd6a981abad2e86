/* SPDX-License-Identifier: Apache-2.0 */
/* Worker health (docs/SERVICE.md, "Worker health"), under active_lock: the router's verdict and a
 * circuit breaker fed by this instance's outcomes decide whether a route may choose a worker. */
#include <inttypes.h>

#include "service/server_internal.h"

/* Whether w may be ineligible now or later without another change of its health: health_changed
 * keeps health_restricted counting such workers (active_lock held), given what this was before. */
static bool health_may_restrict(const worker_slot *w)
{
    return w->unhealthy || w->breaker_tripped;
}

static void health_changed(km_server *s, const worker_slot *w, bool restricted_before)
{
    bool now = health_may_restrict(w);
    if (now && !restricted_before)
        s->health_restricted++;
    else if (!now && restricted_before)
        s->health_restricted--;
}

/* Worker w leaves its pool (active_lock held, before its slot is cleared): it no longer counts in
 * health_restricted. */
void km_srv_health_forget(km_server *s, const worker_slot *w)
{
    if (health_may_restrict(w))
        s->health_restricted--;
}

/* A worker's breaker at time now: closed unless tripped, open during the cooldown, half-open
 * after it. */
breaker_state km_srv_worker_breaker(const worker_slot *w, uint64_t now)
{
    if (!w->breaker_tripped)
        return BREAKER_CLOSED;
    return now < w->breaker_until_ns ? BREAKER_OPEN : BREAKER_HALF_OPEN;
}

static const char *const breaker_state_names[] = {
#define KM_BREAKER_STATE_NAME(value, name) [value] = name,
    KM_BREAKER_STATE_LIST(KM_BREAKER_STATE_NAME)
#undef KM_BREAKER_STATE_NAME
};

/* "closed", "open", "half_open"; "unknown" for a value outside the list. */
const char *km_srv_breaker_state_name(breaker_state b)
{
    return (unsigned)b < sizeof breaker_state_names / sizeof breaker_state_names[0]
               ? breaker_state_names[b]
               : "unknown";
}

/* Is the probe decided for worker id while half-open still in flight there (active_lock held)?
 * Its attempt leaves attempts_by_decision however it ends (FINISHED, expiry, eviction, removal),
 * and an override moves it to another worker. Attempts decided before the breaker opened are not
 * the probe: one whose FINISHED never comes must not hold the worker back until it expires. */
static bool probe_in_flight(km_server *s, uint32_t id)
{
    uint64_t decision = s->workers[id].probe_decision;
    if (!decision)
        return false;
    const uint64_t *v = km_u64map_find(&s->attempts_by_decision, km_u64map_key(decision));
    return v && ((const attempt *)(uintptr_t)*v)->worker == id;
}

/* Can a route choose worker id now (admin_lock or the loop thread, and active_lock held)? A
 * half-open breaker lets one attempt through at a time, the probe (km_srv_decide_route sets
 * probe_decision), so the first outcome after the cooldown decides before more follow. */
eligibility km_srv_worker_eligibility(km_server *s, uint32_t id, uint64_t now)
{
    const worker_slot *w = &s->workers[id];
    if (w->unhealthy)
        return INELIGIBLE_UNHEALTHY;
    breaker_state b = km_srv_worker_breaker(w, now);
    if (b == BREAKER_OPEN)
        return INELIGIBLE_BREAKER_OPEN;
    if (b == BREAKER_HALF_OPEN && probe_in_flight(s, id))
        return INELIGIBLE_PROBING;
    return ELIGIBLE;
}

/* An attempt on worker `id` ended with a FINISHED report (active_lock held). `complete` closes
 * the breaker; `error` and `incomplete` (a stream that ended without finish_reason and [DONE],
 * whatever its HTTP status) count as failures, and the breaker_failures-th in
 * a row opens it for breaker_cooldown_ms, as does any failure while half-open; `cancelled` says
 * nothing about the worker. */
void km_srv_breaker_outcome(km_server *s, uint32_t id, km_outcome outcome, uint64_t now)
{
    worker_slot *w = &s->workers[id];
    if (outcome == KM_OUTCOME_COMPLETE) {
        bool before = health_may_restrict(w);
        w->failures = 0;
        w->breaker_tripped = false;
        health_changed(s, w, before);
        return;
    }
    if (outcome != KM_OUTCOME_ERROR && outcome != KM_OUTCOME_INCOMPLETE)
        return;
    if (w->failures < UINT32_MAX)
        w->failures++;
    uint32_t threshold = s->cfg.breaker_failures;
    if (!threshold || w->failures < threshold || km_srv_worker_breaker(w, now) == BREAKER_OPEN)
        return;
    bool reopened = w->breaker_tripped, before = health_may_restrict(w);
    w->breaker_tripped = true;
    health_changed(s, w, before);
    w->probe_decision = 0; /* what was decided before this cooldown is not its probe */
    uint64_t cooldown = s->cfg.breaker_cooldown_ms * 1000000u;
    w->breaker_until_ns = now > UINT64_MAX - cooldown ? UINT64_MAX : now + cooldown;
    atomic_fetch_add(&s->st.breaker_opened, 1);
    km_srv_log(s, KM_LOG_WARNING
               "worker %u (%s): circuit breaker %s after %u failed attempts in a row (last: "
               "%s); not chosen for %" PRIu64 " ms", id, w->name, reopened ? "reopened" : "open",
               w->failures, outcome == KM_OUTCOME_ERROR ? "error" : "incomplete",
               s->cfg.breaker_cooldown_ms);
}

/* The router's verdict on a worker (admin_lock held); true when it changed. Its breaker is
 * this instance's own evidence and stays as it is. */
bool km_srv_worker_set_health(km_server *s, uint32_t id, bool healthy)
{
    pthread_mutex_lock(&s->active_lock);
    worker_slot *w = &s->workers[id];
    bool changed = w->unhealthy == healthy, before = health_may_restrict(w);
    w->unhealthy = !healthy;
    health_changed(s, w, before);
    pthread_mutex_unlock(&s->active_lock);
    return changed;
}
