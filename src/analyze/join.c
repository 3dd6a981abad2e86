/* SPDX-License-Identifier: Apache-2.0 */
/* Reading decision and outcome records and joining them (src/analyze/analyze.h, docs/ANALYZE.md).
 *
 * Each file is read through a fixed buffer; a line longer than max_line_bytes is skipped to its
 * newline and counted invalid, so no input grows memory past that limit. Each valid record becomes
 * or completes one compact `point`; a map keyed by a 128-bit hash of (instance, decision_id) finds
 * the point a record belongs to, so the join needs no record text. At finish the points left
 * unjoined are paired by a hash of (request_id, attempt_id) (km_analysis_join_by_request). A router
 * override (an outcome's dispatched_worker) is compared with the dispatched worker's depth at the
 * decision: a decision read before its outcome keeps its candidates' depths aside (`pending`)
 * until the outcome joins it, then only that one depth stays in the point. Worker health
 * (candidates[].eligible) is counted per worker as each decision is read; the point keeps one flag
 * bit, whether its owner was ineligible. Index states are kept as per-worker observations: within
 * a file only the first observation of each worker, every change of state and the last
 * observation (a file is written in decision order); metrics.c sorts them by time and sweeps them
 * into recovery windows, so files may be given in any order. */
#include "analyze/analyze_internal.h"
#include "base/utf8.h"

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>
#include <xxhash.h>

#include "base/u64_map.h"
#include "kvmatch/records.h"

/* Bytes read from a file at a time. */
#define ANALYSIS_READ_CHUNK ((size_t)1 << 20)

/* ---- field access with a sentence on failure ------------------------------------------------- */

typedef struct field_error {
    char text[256];
} field_error;

static int field_fail(field_error *e, const char *prefix, const char *key, const char *expected)
{
    snprintf(e->text, sizeof e->text, "field %s%s: %s", prefix, key, expected);
    return -1;
}

/* The same, for the record parsers' convention (0 = invalid record). */
static int invalid_field(field_error *e, const char *prefix, const char *key, const char *expected)
{
    field_fail(e, prefix, key, expected);
    return 0;
}

/* A string field; nullable lets JSON null through as NULL. */
static int get_string(json_t *obj, const char *prefix, const char *key, int nullable,
                      const char **out, field_error *e)
{
    json_t *v = json_object_get(obj, key);
    if (!v)
        return field_fail(e, prefix, key, "missing");
    if (json_is_null(v) && nullable) {
        *out = NULL;
        return 0;
    }
    if (!json_is_string(v))
        return field_fail(e, prefix, key, nullable ? "expected a string or null" : "expected a string");
    *out = json_string_value(v);
    return 0;
}

/* A non-negative integer field; nullable gives -1 for null. */
static int get_count(json_t *obj, const char *prefix, const char *key, int nullable, int64_t *out,
                     field_error *e)
{
    json_t *v = json_object_get(obj, key);
    if (!v)
        return field_fail(e, prefix, key, "missing");
    if (json_is_null(v) && nullable) {
        *out = -1;
        return 0;
    }
    if (!json_is_integer(v) || json_integer_value(v) < 0)
        return field_fail(e, prefix, key,
                          nullable ? "expected a non-negative integer or null"
                                   : "expected a non-negative integer");
    *out = (int64_t)json_integer_value(v);
    return 0;
}

static int get_object(json_t *obj, const char *prefix, const char *key, json_t **out,
                      field_error *e)
{
    json_t *v = json_object_get(obj, key);
    if (!v)
        return field_fail(e, prefix, key, "missing");
    if (!json_is_object(v))
        return field_fail(e, prefix, key, "expected an object");
    *out = v;
    return 0;
}

/* Fields both record types carry (the ones the analysis uses). */
typedef struct common_fields {
    const char *instance, *host, *request_id, *attempt_id, *pool;
    int64_t decision_id, monotonic_ns;
} common_fields;

static int parse_common(json_t *root, common_fields *c, field_error *e)
{
    if (get_string(root, "", "instance", 0, &c->instance, e) ||
        get_string(root, "", "host", 1, &c->host, e) ||
        get_count(root, "", "decision_id", 0, &c->decision_id, e) ||
        get_string(root, "", "request_id", 0, &c->request_id, e) ||
        get_string(root, "", "attempt_id", 0, &c->attempt_id, e) ||
        get_string(root, "", "pool", 0, &c->pool, e) ||
        get_count(root, "", "monotonic_ns", 0, &c->monotonic_ns, e))
        return -1;
    return 0;
}

typedef struct worker_fields {
    const char *worker, *state;
    int64_t depth_tokens;
} worker_fields;

static int parse_worker(json_t *obj, const char *prefix, int worker_nullable, worker_fields *w,
                        field_error *e)
{
    if (get_string(obj, prefix, "worker", worker_nullable, &w->worker, e) ||
        get_string(obj, prefix, "state", 1, &w->state, e) ||
        get_count(obj, prefix, "depth_tokens", 0, &w->depth_tokens, e))
        return -1;
    if (w->worker && !w->state)
        return field_fail(e, prefix, "state", "null although a worker is named");
    return 0;
}

/* ---- keys ------------------------------------------------------------------------------------ */

/* 128-bit hash of first, a NUL, then second[0..second_len). */
static void hash_pair(const char *first, const void *second, size_t second_len, uint64_t key[2])
{
    size_t n = strlen(first);
    char buffer[512];
    char *bytes = n + 1 + second_len <= sizeof buffer ? buffer : malloc(n + 1 + second_len);
    XXH128_hash_t h;
    if (bytes) {
        memcpy(bytes, first, n + 1);
        memcpy(bytes + n + 1, second, second_len);
        h = XXH3_128bits(bytes, n + 1 + second_len);
        if (bytes != buffer)
            free(bytes);
    } else { /* no memory for the copy: hash the parts apart (stable, slightly weaker) */
        XXH128_hash_t h2 = XXH3_128bits(second, second_len);
        h = XXH3_128bits_withSeed(first, n, h2.low64 ^ h2.high64);
    }
    key[0] = h.low64;
    key[1] = h.high64;
}

static void decision_key(const char *instance, int64_t decision_id, uint64_t key[2])
{
    uint64_t id = (uint64_t)decision_id;
    hash_pair(instance, &id, sizeof id, key);
}

static void request_key(const char *request_id, const char *attempt_id, uint64_t key[2])
{
    hash_pair(request_id, attempt_id, strlen(attempt_id), key);
}

/* The id of worker (host, pool, name), or with instance != NONE of that worker's index-state
 * stream in that instance; NONE on out of memory. */
static uint32_t worker_id(km_analysis *a, uint32_t instance, uint32_t host, uint32_t pool,
                          const char *name)
{
    uint32_t name_id = km_analysis_intern_cstr(&a->strings, name);
    if (name_id == NONE)
        return NONE;
    uint32_t parts[4] = {instance, instance == NONE ? host : NONE, pool, name_id};
    uint32_t id = km_analysis_intern(&a->worker_keys, parts, sizeof parts);
    if (id == NONE)
        return NONE;
    if (id >= a->workers_capacity) {
        size_t capacity = a->workers_capacity ? a->workers_capacity * 2 : 64;
        worker_info *workers = realloc(a->workers, capacity * sizeof *workers);
        if (!workers)
            return NONE;
        memset(workers + a->workers_capacity, 0,
               (capacity - a->workers_capacity) * sizeof *workers);
        a->workers = workers;
        a->workers_capacity = capacity;
    }
    worker_info *w = &a->workers[id];
    w->instance = instance;
    w->host = host;
    w->pool = pool;
    w->name = name_id;
    return id;
}

static point *new_point(km_analysis *a, uint32_t *index)
{
    if (a->n_points == a->points_capacity) {
        size_t capacity = a->points_capacity ? a->points_capacity * 2 : 1024;
        point *points = realloc(a->points, capacity * sizeof *points);
        if (!points)
            return NULL;
        a->points = points;
        a->points_capacity = capacity;
    }
    if (a->n_points >= NONE)
        return NULL;
    *index = (uint32_t)a->n_points;
    point *p = &a->points[a->n_points++];
    memset(p, 0, sizeof *p);
    p->worker = p->copy_worker = p->dispatched = p->owner_name = p->policy =
        p->reason = NONE;
    p->decision_prompt = p->outcome_prompt = p->actual = p->ttft_ns = p->in_flight = -1;
    p->dispatched_predicted = -1;
    p->router_ttft_ms = p->predicted_ttft_ms = -1;
    return p;
}

/* The point a valid record of type (POINT_DECISION or POINT_OUTCOME) keyed (instance,
 * decision_id) belongs to, in *index: the one a record of the other type started (joined: counted
 * in by_decision_id), or a new one (*created, when created is not NULL). Returns 0, 1 when that
 * point holds a record of this type already (a duplicate, to be counted and not used), or
 * KM_ERR_OUT_OF_MEMORY. */
static int point_of_record(km_analysis *a, const common_fields *c, uint32_t type, uint32_t *index,
                           bool *created)
{
    uint64_t key[2];
    decision_key(c->instance, c->decision_id, key);
    /* The map holds the low 64 bits, the point the high 64: two keys equal in the low half only
     * (about n^2 / 2^65 for n decisions) would make the newer one take the map entry. */
    uint64_t map_key = km_u64map_key(key[0]);
    uint64_t *found = km_u64map_find(&a->by_decision, map_key);
    if (created)
        *created = false;
    if (found && a->points[*found].key_check == key[1]) {
        *index = (uint32_t)*found;
        if (a->points[*index].flags & type)
            return 1;
        a->summary.join.by_decision_id++;
        return 0;
    }
    bool decision = type == POINT_DECISION;
    point *p = new_point(a, index);
    if (!p)
        return km_analysis_fail_memory(a, decision ? "keeping a decision" : "keeping an outcome");
    p->key_check = key[1];
    if (km_u64map_put(&a->by_decision, map_key, *index, 1) != KM_OK)
        return km_analysis_fail_memory(a, decision ? "indexing a decision" : "indexing an outcome");
    if (created)
        *created = true;
    return 0;
}

/* ---- router overrides ------------------------------------------------------------------------ */

/* The pending map's key of a point (never the reserved keys 0 and 1). */
static uint64_t pending_key(uint32_t index)
{
    return (uint64_t)index + 2;
}

/* When p is overridden and rows name its dispatched worker, that row's depth becomes
 * p->dispatched_predicted; otherwise p is left as it is (-1: not compared). */
static void resolve_override(const km_analysis *a, point *p, const candidate_depth *rows, size_t n)
{
    if (!(p->flags & POINT_OVERRIDDEN))
        return;
    uint32_t name = a->workers[p->dispatched].name;
    for (size_t i = 0; i < n; i++)
        if (rows[i].name == name) {
            p->dispatched_predicted = rows[i].depth_tokens;
            return;
        }
}

/* Point index has its outcome now: resolve its override against the candidates kept for it (if
 * any were) and free them. */
static void settle_pending(km_analysis *a, uint32_t index)
{
    uint64_t *found = km_u64map_find(&a->pending, pending_key(index));
    if (!found)
        return;
    pending_candidates *kept = (pending_candidates *)(uintptr_t)*found;
    resolve_override(a, &a->points[index], kept->rows, kept->n);
    free(kept);
    km_u64map_erase(&a->pending, pending_key(index));
}

/* ---- index-state observations ---------------------------------------------------------------- */

static int push_observation(km_analysis *a, uint32_t worker, uint32_t state, int64_t time_ns)
{
    if (a->n_observations == a->observations_capacity) {
        size_t capacity = a->observations_capacity ? a->observations_capacity * 2 : 256;
        observation *o = realloc(a->observations, capacity * sizeof *o);
        if (!o)
            return km_analysis_fail_memory(a, "keeping index-state observations");
        a->observations = o;
        a->observations_capacity = capacity;
    }
    a->observations[a->n_observations++] = (observation){
        .time_ns = time_ns, .worker = worker, .state = state, .file = a->file_generation,
        .live = state == a->live_state};
    return KM_OK;
}

/* Record that worker had state at time_ns (a decision's time). Keeps the first observation of each
 * worker in a file, every change, and (at the file's end) the last. */
static int observe(km_analysis *a, uint32_t worker, const char *state_name, int64_t time_ns)
{
    uint32_t state = km_analysis_intern_cstr(&a->strings, state_name);
    if (state == NONE)
        return km_analysis_fail_memory(a, "interning a state");
    if (state == a->approx_state)
        return KM_OK; /* approximate pools have no stream to recover */
    worker_info *w = &a->workers[worker];
    if (w->file_generation == a->file_generation && w->last_state == state) {
        w->last_time = time_ns;
        w->last_recorded = 0;
        return KM_OK;
    }
    w->file_generation = a->file_generation;
    w->last_state = state;
    w->last_time = time_ns;
    w->last_recorded = 1;
    return push_observation(a, worker, state, time_ns);
}

static int end_file_observations(km_analysis *a)
{
    for (size_t i = 0; i < a->worker_keys.n; i++) {
        worker_info *w = &a->workers[i];
        if (w->file_generation == a->file_generation && !w->last_recorded) {
            int rc = push_observation(a, (uint32_t)i, w->last_state, w->last_time);
            if (rc != KM_OK)
                return rc;
            w->last_recorded = 1;
        }
    }
    return KM_OK;
}

/* ---- records --------------------------------------------------------------------------------- */

static int is_live(const char *state)
{
    return state && !strcmp(state, "LIVE");
}

/* Count a valid decision's ineligible candidates (its rows validated: eligible absent or a
 * boolean) per worker, a worker named twice by its first row, and the decision in
 * decisions_with_ineligible. owner is the prediction owner's name, NULL when none. Counted as the
 * record is read: these need nothing kept in the decision's point. Linear in the rows: a worker's
 * earlier row is found by stamping the worker with the decision (named_in), never by a scan. */
static int count_ineligible(km_analysis *a, json_t *candidates, uint32_t host, uint32_t pool,
                            const char *owner)
{
    uint64_t stamp = a->summary.input.decisions; /* this decision's; never 0 */
    size_t n = json_array_size(candidates);
    int counted = 0;
    for (size_t i = 0; i < n; i++) {
        json_t *cand = json_array_get(candidates, i);
        const char *name = json_string_value(json_object_get(cand, "worker"));
        uint32_t id = worker_id(a, NONE, host, pool, name);
        if (id == NONE)
            return km_analysis_fail_memory(a, "interning names");
        worker_info *w = &a->workers[id];
        if (w->named_in == stamp)
            continue; /* named by an earlier row */
        w->named_in = stamp;
        if (!json_is_false(json_object_get(cand, "eligible")))
            continue;
        w->ineligible++;
        a->summary.health.ineligible_candidates++;
        counted = 1;
        if (owner && !strcmp(name, owner))
            w->owned_ineligible++;
    }
    a->summary.health.decisions_with_ineligible += (uint64_t)counted;
    return KM_OK;
}

/* Apply a decision record; returns 1 when valid and applied, 0 when invalid (e filled), or a
 * negative status. */
static int take_decision(km_analysis *a, json_t *root, uint32_t file, uint64_t line,
                         field_error *e)
{
    common_fields c;
    json_t *prediction, *owner_obj, *decision, *chosen_obj;
    const char *source, *policy;
    int64_t prompt_tokens;
    worker_fields owner, chosen;
    if (parse_common(root, &c, e) || get_object(root, "", "prediction", &prediction, e) ||
        get_string(prediction, "prediction.", "source", 0, &source, e) ||
        get_count(prediction, "prediction.", "prompt_tokens", 1, &prompt_tokens, e) ||
        get_object(prediction, "prediction.", "owner", &owner_obj, e) ||
        parse_worker(owner_obj, "prediction.owner.", 1, &owner, e) ||
        get_object(root, "", "decision", &decision, e) ||
        get_string(decision, "decision.", "policy", 0, &policy, e) ||
        get_object(decision, "decision.", "chosen", &chosen_obj, e) ||
        parse_worker(chosen_obj, "decision.chosen.", 0, &chosen, e))
        return 0;
    int events = !strcmp(source, "events");
    if (!events && strcmp(source, "approx"))
        return invalid_field(e, "prediction.", "source", "expected \"events\" or \"approx\"");
    /* the owner holds the deepest match: a chosen worker deeper than it would make the reuse
     * given up negative */
    if (owner.worker && chosen.depth_tokens > owner.depth_tokens)
        return invalid_field(e, "decision.chosen.", "depth_tokens",
                             "exceeds prediction.owner.depth_tokens (the owner holds the deepest "
                             "match)");
    /* the policy's reason: null or absent counts as none */
    json_t *reason_value = json_object_get(decision, "reason");
    if (reason_value && !json_is_null(reason_value) && !json_is_string(reason_value))
        return invalid_field(e, "decision.", "reason", "expected a string or null");
    const char *reason = json_string_value(reason_value);
    /* a warm-up names the decision it is for; null or absent (older records): none */
    json_t *warm_up_for = json_object_get(decision, "warm_up_for");
    if (warm_up_for && !json_is_null(warm_up_for) &&
        !(json_is_integer(warm_up_for) && json_integer_value(warm_up_for) >= 0))
        return invalid_field(e, "decision.", "warm_up_for", "expected an integer >= 0 or null");
    bool warm_up = warm_up_for && json_is_integer(warm_up_for);
    /* the engine model's prediction on the chosen worker; null or absent (older records): none */
    json_t *predicted_ttft = json_object_get(decision, "predicted_ttft_ms");
    if (predicted_ttft && !json_is_null(predicted_ttft) &&
        !(json_is_number(predicted_ttft) && json_number_value(predicted_ttft) >= 0))
        return invalid_field(e, "decision.", "predicted_ttft_ms", "expected a number >= 0 or null");
    json_t *candidates = json_object_get(root, "candidates");
    if (!candidates || !json_is_array(candidates))
        return invalid_field(e, "", "candidates", candidates ? "expected an array" : "missing");
    size_t n_candidates = json_array_size(candidates);
    int64_t chosen_in_flight = -1, chosen_pending = -1;
    int owner_row_seen = 0, owner_ineligible = 0, any_ineligible = 0;
    int chosen_row_seen = 0, chosen_weighed = 0, owner_unweighed = 0;
    for (size_t i = 0; i < n_candidates; i++) {
        json_t *cand = json_array_get(candidates, i);
        char prefix[64];
        snprintf(prefix, sizeof prefix, "candidates[%zu].", i);
        const char *name, *state;
        int64_t in_flight, depth_tokens;
        if (!json_is_object(cand))
            return invalid_field(e, "", "candidates", "every entry must be an object");
        if (get_string(cand, prefix, "worker", 0, &name, e) ||
            get_string(cand, prefix, "state", 0, &state, e) ||
            get_count(cand, prefix, "depth_tokens", 0, &depth_tokens, e) ||
            get_count(cand, prefix, "in_flight", 1, &in_flight, e))
            return 0;
        int64_t pending = -1;
        if (json_object_get(cand, "pending_prefill_tokens") &&
            get_count(cand, prefix, "pending_prefill_tokens", 1, &pending, e))
            return 0;
        /* absent in records written before worker health: eligible */
        json_t *eligible = json_object_get(cand, "eligible");
        if (eligible && !json_is_boolean(eligible))
            return invalid_field(e, prefix, "eligible", "expected a boolean");
        int ineligible = eligible && json_is_false(eligible);
        any_ineligible |= ineligible;
        json_t *cost = json_object_get(cand, "cost");
        if (!strcmp(name, chosen.worker) && !chosen_row_seen) {
            chosen_row_seen = 1;
            chosen_in_flight = in_flight;
            chosen_pending = pending;
            chosen_weighed = json_is_number(cost);
        }
        if (owner.worker && !owner_row_seen && !strcmp(name, owner.worker)) {
            owner_row_seen = 1;
            owner_ineligible = ineligible;
            owner_unweighed = !ineligible && json_is_null(cost);
        }
    }

    /* Valid: from here on only out-of-memory can fail. */
    uint32_t index;
    int seen = point_of_record(a, &c, POINT_DECISION, &index, NULL);
    if (seen < 0)
        return seen;
    a->summary.input.decisions++;
    if (seen) {
        a->summary.join.duplicate_decisions++;
        return 1;
    }
    point *p = &a->points[index];
    /* The load view: "cluster" or "this_instance", either with "+engine_reported"; any other
     * scope, or a malformed view, is counted as this_instance. A warm-up is in no figure: not
     * here, not in worker health. */
    json_t *load = warm_up ? NULL : json_object_get(decision, "load");
    const char *scope = json_string_value(json_object_get(load, "scope"));
    km_analysis_load_view *lv = &a->summary.load_view;
    bool engine = scope && (!strcmp(scope, "cluster+engine_reported") ||
                            !strcmp(scope, "this_instance+engine_reported"));
    lv->engine_reported += engine;
    if (scope && (!strcmp(scope, "cluster") || !strcmp(scope, "cluster+engine_reported"))) {
        lv->cluster++;
        json_t *stale = json_object_get(load, "stale_instances");
        lv->cluster_with_stale += json_is_array(stale) && json_array_size(stale) > 0;
    } else if (!warm_up) {
        lv->this_instance++;
    }
    json_t *age = json_object_get(load, "oldest_age_ms");
    if (json_is_number(age) && json_number_value(age) > lv->oldest_age_ms_max)
        lv->oldest_age_ms_max = json_number_value(age);
    uint32_t host = km_analysis_intern_cstr(&a->strings, c.host);
    uint32_t pool = km_analysis_intern_cstr(&a->strings, c.pool);
    uint32_t instance = km_analysis_intern_cstr(&a->strings, c.instance);
    uint32_t policy_id = km_analysis_intern_cstr(&a->strings, policy);
    uint32_t reason_id = reason ? km_analysis_intern_cstr(&a->strings, reason) : NONE;
    uint32_t chosen_id = host == NONE || pool == NONE ? NONE
                                                      : worker_id(a, NONE, host, pool, chosen.worker);
    if (instance == NONE || policy_id == NONE || chosen_id == NONE ||
        (reason && reason_id == NONE))
        return km_analysis_fail_memory(a, "interning names");
    p->flags |= POINT_DECISION | (events ? POINT_EVENTS : POINT_APPROX) |
                (warm_up ? POINT_WARM_UP : 0) | (chosen_pending > 0 ? POINT_CHOSEN_QUEUED : 0);
    p->predicted_ttft_ms = json_is_number(predicted_ttft) ? json_number_value(predicted_ttft) : -1;
    p->time_ns = c.monotonic_ns;
    p->predicted = chosen.depth_tokens;
    p->owner_tokens = owner.worker ? owner.depth_tokens : 0;
    p->decision_prompt = prompt_tokens;
    p->in_flight = chosen_in_flight;
    p->decision_id = c.decision_id;
    request_key(c.request_id, c.attempt_id, p->request_key);
    p->decision_file = file;
    p->decision_line = line;
    p->host = host;
    p->pool = pool;
    p->instance = instance;
    p->policy = policy_id;
    p->reason = reason_id;
    p->worker = chosen_id;
    if (owner.worker) {
        p->flags |= POINT_OWNER;
        if (strcmp(owner.worker, chosen.worker))
            p->flags |= POINT_OWNER_NOT_CHOSEN;
        if (owner_ineligible)
            p->flags |= POINT_OWNER_INELIGIBLE;
        if (owner_unweighed && chosen_weighed && strcmp(owner.worker, chosen.worker))
            p->flags |= POINT_OWNER_NOT_WEIGHED;
        p->owner_name = km_analysis_intern_cstr(&a->strings, owner.worker);
        if (p->owner_name == NONE)
            return km_analysis_fail_memory(a, "interning names");
    }
    if (any_ineligible && !warm_up) {
        int rc = count_ineligible(a, candidates, host, pool, owner.worker);
        if (rc != KM_OK)
            return rc;
    }
    /* The candidates' depths, for a router override: resolved now when the outcome came first,
     * else kept until it joins (settle_pending). */
    if (n_candidates) {
        pending_candidates *kept = malloc(sizeof *kept + n_candidates * sizeof kept->rows[0]);
        if (!kept)
            return km_analysis_fail_memory(a, "keeping a decision's candidates");
        kept->n = n_candidates;
        for (size_t i = 0; i < n_candidates; i++) {
            json_t *cand = json_array_get(candidates, i);
            kept->rows[i].name = km_analysis_intern_cstr(
                &a->strings, json_string_value(json_object_get(cand, "worker")));
            kept->rows[i].depth_tokens =
                (int64_t)json_integer_value(json_object_get(cand, "depth_tokens"));
            if (kept->rows[i].name == NONE) {
                free(kept);
                return km_analysis_fail_memory(a, "interning names");
            }
        }
        if (p->flags & POINT_OUTCOME) {
            resolve_override(a, p, kept->rows, kept->n);
            free(kept);
        } else if (km_u64map_put(&a->pending, pending_key(index), (uint64_t)(uintptr_t)kept, 1) !=
                   KM_OK) {
            free(kept);
            return km_analysis_fail_memory(a, "keeping a decision's candidates");
        }
    }
    if (events) {
        if (!is_live(chosen.state))
            p->flags |= POINT_CHOSEN_NOT_LIVE;
        if (owner.worker && !is_live(owner.state))
            p->flags |= POINT_OWNER_NOT_LIVE;
        /* the chosen and the owner are candidates too, normally; observe them anyway */
        uint32_t stream = worker_id(a, instance, host, pool, chosen.worker);
        int rc = stream == NONE ? km_analysis_fail_memory(a, "interning names")
                                : observe(a, stream, chosen.state, c.monotonic_ns);
        if (rc == KM_OK && owner.worker) {
            uint32_t owner_id = worker_id(a, instance, host, pool, owner.worker);
            rc = owner_id == NONE ? km_analysis_fail_memory(a, "interning names")
                                  : observe(a, owner_id, owner.state, c.monotonic_ns);
        }
        for (size_t i = 0; rc == KM_OK && i < n_candidates; i++) {
            json_t *cand = json_array_get(candidates, i);
            const char *name = json_string_value(json_object_get(cand, "worker"));
            const char *state = json_string_value(json_object_get(cand, "state"));
            uint32_t id = worker_id(a, instance, host, pool, name);
            rc = id == NONE ? km_analysis_fail_memory(a, "interning names")
                            : observe(a, id, state, c.monotonic_ns);
        }
        if (rc != KM_OK)
            return rc;
    }
    return 1;
}

/* The km_record_outcome a record's "outcome" names; 0 for none. */
static int parse_outcome_kind(const char *s)
{
#define KM_OUTCOME_IF_NAMED(name, value, text) \
    if (!strcmp(s, text))                      \
        return name;
    KM_RECORD_OUTCOME_LIST(KM_OUTCOME_IF_NAMED)
#undef KM_OUTCOME_IF_NAMED
    return 0;
}

static int take_outcome(km_analysis *a, json_t *root, uint32_t file, uint64_t line,
                        field_error *e)
{
    common_fields c;
    const char *kind_name, *worker;
    int64_t http_status, cached, prompt, decided, ttft, predicted_depth;
    json_t *predicted;
    if (parse_common(root, &c, e) || get_string(root, "", "outcome", 0, &kind_name, e))
        return 0;
    int kind = parse_outcome_kind(kind_name);
    if (!kind)
        return invalid_field(e, "", "outcome",
                          "expected complete, incomplete, error, cancelled or expired");
    json_t *status = json_object_get(root, "http_status");
    if (!status)
        return invalid_field(e, "", "http_status", "missing");
    if (json_is_null(status))
        http_status = -1;
    else if (json_is_integer(status))
        http_status = (int64_t)json_integer_value(status);
    else
        return invalid_field(e, "", "http_status", "expected an integer or null");
    if (get_count(root, "", "cached_tokens", 1, &cached, e) ||
        get_count(root, "", "prompt_tokens", 1, &prompt, e) ||
        get_string(root, "", "worker", 0, &worker, e) ||
        get_count(root, "", "decided_monotonic_ns", 1, &decided, e) ||
        get_count(root, "", "ttft_ns", 1, &ttft, e) ||
        get_object(root, "", "predicted", &predicted, e) ||
        get_count(predicted, "predicted.", "depth_tokens", 0, &predicted_depth, e))
        return 0;
    double router_ttft = -1;
    json_t *rt = json_object_get(root, "router_ttft_ms");
    if (rt && !json_is_null(rt)) {
        if (!json_is_number(rt) || !(json_number_value(rt) >= 0))
            return invalid_field(e, "", "router_ttft_ms", "expected a number >= 0 or null");
        router_ttft = json_number_value(rt);
    }
    /* absent (records before the field existed) or null: the router reported no other worker */
    const char *dispatched = NULL;
    json_t *dw = json_object_get(root, "dispatched_worker");
    if (dw && !json_is_null(dw)) {
        if (!json_is_string(dw))
            return invalid_field(e, "", "dispatched_worker", "expected a string or null");
        dispatched = json_string_value(dw);
    }

    uint32_t index;
    bool created;
    a->summary.input.outcomes++;
    int seen = point_of_record(a, &c, POINT_OUTCOME, &index, &created);
    if (seen < 0)
        return seen;
    if (seen) {
        a->summary.join.duplicate_outcomes++;
        return 1;
    }
    point *p = &a->points[index];
    if (created) {
        /* outcome only, so far: what the outcome itself knows */
        p->time_ns = decided >= 0 ? decided : c.monotonic_ns;
        p->predicted = predicted_depth;
        p->decision_id = c.decision_id;
        request_key(c.request_id, c.attempt_id, p->request_key);
        p->host = km_analysis_intern_cstr(&a->strings, c.host);
        p->pool = km_analysis_intern_cstr(&a->strings, c.pool);
        p->instance = km_analysis_intern_cstr(&a->strings, c.instance);
        if (p->host == NONE || p->pool == NONE || p->instance == NONE)
            return km_analysis_fail_memory(a, "interning names");
    }
    uint32_t host = km_analysis_intern_cstr(&a->strings, c.host);
    uint32_t pool = km_analysis_intern_cstr(&a->strings, c.pool);
    uint32_t worker_index = host == NONE || pool == NONE ? NONE
                                                         : worker_id(a, NONE, host, pool, worker);
    if (worker_index == NONE)
        return km_analysis_fail_memory(a, "interning names");
    /* an override names another worker than the chosen one (the server writes null for the chosen
     * one; an older writer might not) */
    if (dispatched && strcmp(dispatched, worker)) {
        p->dispatched = worker_id(a, NONE, host, pool, dispatched);
        if (p->dispatched == NONE)
            return km_analysis_fail_memory(a, "interning names");
        p->flags |= POINT_OVERRIDDEN;
    }
    p->flags |= POINT_OUTCOME;
    size_t attempt_len = strlen(c.attempt_id), suffix = sizeof ":warm_up" - 1;
    if (attempt_len >= suffix && !strcmp(c.attempt_id + attempt_len - suffix, ":warm_up"))
        p->flags |= POINT_WARM_UP; /* a warm-up's outcome, its decision read or not */
    if (http_status == 200)
        p->flags |= POINT_HTTP_200;
    p->outcome_kind = (uint8_t)kind;
    p->actual = cached;
    p->outcome_prompt = prompt;
    p->ttft_ns = ttft;
    p->router_ttft_ms = router_ttft;
    p->copy_predicted = predicted_depth;
    p->copy_worker = worker_index;
    p->outcome_file = file;
    p->outcome_line = line;
    if (p->flags & POINT_DECISION)
        settle_pending(a, index);
    return 1;
}

/* ---- reading files --------------------------------------------------------------------------- */

typedef struct line_reader {
    FILE *file;
    char *chunk;
    size_t start, end;
    char *line;
    size_t length, capacity, max;
    int too_long;
} line_reader;

/* Next line (without its newline) into r->line / r->length; r->too_long when it passed max (its
 * content is then dropped). Returns 1 for a line, 0 at the end, -1 on a read error. */
static int read_line(line_reader *r)
{
    r->length = 0;
    r->too_long = 0;
    int any = 0;
    for (;;) {
        if (r->start == r->end) {
            size_t n = fread(r->chunk, 1, ANALYSIS_READ_CHUNK, r->file);
            if (n == 0) {
                if (ferror(r->file))
                    return -1;
                return any ? 1 : 0;
            }
            r->start = 0;
            r->end = n;
        }
        any = 1;
        char *begin = r->chunk + r->start;
        char *newline = memchr(begin, '\n', r->end - r->start);
        size_t take = newline ? (size_t)(newline - begin) : r->end - r->start;
        if (!r->too_long) {
            if (r->length + take > r->max) {
                r->too_long = 1;
                r->length = 0;
            } else {
                if (r->length + take + 1 > r->capacity) {
                    size_t capacity = r->capacity ? r->capacity : 4096;
                    while (capacity < r->length + take + 1)
                        capacity *= 2;
                    char *grown = realloc(r->line, capacity);
                    if (!grown)
                        return -2;
                    r->line = grown;
                    r->capacity = capacity;
                }
                memcpy(r->line + r->length, begin, take);
                r->length += take;
            }
        }
        r->start += take + (newline ? 1 : 0);
        if (newline)
            return 1;
    }
}

static int is_blank(const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (s[i] != ' ' && s[i] != '\t' && s[i] != '\r')
            return 0;
    return 1;
}

static int invalid_line(km_analysis *a, uint32_t file, uint64_t line, const char *format, ...)
{
    a->summary.input.invalid++;
    if (a->invalid.n >= a->cfg.max_listed)
        return KM_OK;
    char buffer[400];
    va_list ap;
    va_start(ap, format);
    vsnprintf(buffer, sizeof buffer, format, ap);
    va_end(ap);
    return km_analysis_add_problem(a, &a->invalid, file, line, "%s", buffer);
}

/* One line: a record applied, or counted invalid. KM_OK or out of memory. */
static int take_line(km_analysis *a, uint32_t file, uint64_t line, char *text, size_t length)
{
    if (length && text[length - 1] == '\r')
        length--;
    json_error_t error;
    json_t *root = json_loadb(text, length, JSON_REJECT_DUPLICATES, &error);
    if (!root)
        return invalid_line(a, file, line, "not JSON: %s", error.text);
    int rc = KM_OK;
    field_error e = {{0}};
    if (!json_is_object(root)) {
        rc = invalid_line(a, file, line, "not a JSON object");
        goto done;
    }
    json_t *type = json_object_get(root, "type");
    json_t *version = json_object_get(root, "schema_version");
    if (!type || !json_is_string(type)) {
        rc = invalid_line(a, file, line, "no \"type\" string: not a kvmatch record");
        goto done;
    }
    int is_decision = !strcmp(json_string_value(type), "decision");
    if (!is_decision && strcmp(json_string_value(type), "outcome")) {
        rc = invalid_line(a, file, line, "unknown record type \"%.64s\"", json_string_value(type));
        goto done;
    }
    if (!version || !json_is_integer(version) || json_integer_value(version) != 1) {
        if (version && json_is_integer(version))
            rc = invalid_line(a, file, line,
                              "schema_version %" JSON_INTEGER_FORMAT
                              " is not supported (this analyzer reads 1)",
                              json_integer_value(version));
        else
            rc = invalid_line(a, file, line, "no integer \"schema_version\"");
        goto done;
    }
    int taken = is_decision ? take_decision(a, root, file, line, &e)
                            : take_outcome(a, root, file, line, &e);
    if (taken == 0)
        rc = invalid_line(a, file, line, "%s record: %s", is_decision ? "decision" : "outcome",
                          e.text);
    else if (taken < 0)
        rc = taken;
done:
    json_decref(root);
    return rc;
}

int km_analysis_add_file(km_analysis *a, const char *path)
{
    if (!a || !path)
        return KM_ERR_NULL_POINTER;
    if (a->broken)
        return KM_ERR_OUT_OF_MEMORY;
    if (a->finished) {
        km_analysis_set_error(a, "add_file after finish: the analysis is complete");
        return KM_ERR_INVALID_ARGUMENT;
    }
    /* The name reports show (UTF-8, as JSON needs; the path itself opens the file). */
    char *shown = km_utf8_clean_dup(path);
    uint32_t file = shown ? km_analysis_intern_cstr(&a->strings, shown) : NONE;
    free(shown);
    if (file == NONE)
        return km_analysis_fail_memory(a, "naming a file");
    FILE *f = fopen(path, "rb");
    if (!f) {
        a->summary.input.files_failed++;
        km_analysis_set_error(a, "%s: cannot open: %s", path, strerror(errno));
        return KM_ERR_IO;
    }
    line_reader r = {.file = f, .max = a->cfg.max_line_bytes};
    r.chunk = malloc(ANALYSIS_READ_CHUNK);
    if (!r.chunk) {
        fclose(f);
        return km_analysis_fail_memory(a, "reading a file");
    }
    a->file_generation++;
    a->summary.input.files++;
    uint64_t line = 0;
    int rc = KM_OK;
    for (;;) {
        int got = read_line(&r);
        if (got == 0)
            break;
        if (got == -2) {
            rc = km_analysis_fail_memory(a, "reading a line");
            break;
        }
        if (got < 0) {
            a->summary.input.files_failed++;
            km_analysis_set_error(a, "%s: read error after line %" PRIu64 ": %s", path, line,
                                  strerror(errno));
            rc = KM_ERR_IO;
            break;
        }
        line++;
        a->summary.input.lines++;
        if (r.too_long)
            rc = invalid_line(a, file, line, "line longer than %zu bytes", r.max);
        else if (is_blank(r.line, r.length))
            a->summary.input.blank_lines++;
        else
            rc = take_line(a, file, line, r.line, r.length);
        if (rc != KM_OK)
            break;
    }
    if (rc == KM_OK || rc == KM_ERR_IO) {
        int end = end_file_observations(a);
        if (end != KM_OK)
            rc = end;
    }
    free(r.chunk);
    free(r.line);
    fclose(f);
    return rc;
}

/* ---- fallback join --------------------------------------------------------------------------- */

/* The analysis whose points the comparators below read (qsort has no context argument);
 * thread-local, so handles finished on different threads stay independent. */
static _Thread_local const km_analysis *sort_context;

/* Order of two points' (request_id, attempt_id) keys. */
static int request_order(const point *p, const point *q)
{
    for (int i = 0; i < 2; i++)
        if (p->request_key[i] != q->request_key[i])
            return p->request_key[i] < q->request_key[i] ? -1 : 1;
    return 0;
}

/* By key, then in reading order (point index). */
static int compare_by_request(const void *x, const void *y)
{
    uint32_t a = *(const uint32_t *)x, b = *(const uint32_t *)y;
    int c = request_order(&sort_context->points[a], &sort_context->points[b]);
    return c ? c : (a < b ? -1 : a > b);
}

/* The worker `id` names, as seen from `host`: an outcome joined by request may come from an
 * instance on another host, and a worker id carries its record's host, so the outcome's copy and
 * dispatched worker are taken as the decision's host names them (same pool, same name). */
static uint32_t on_host(km_analysis *a, uint32_t id, uint32_t host)
{
    if (id == NONE || a->workers[id].host == host)
        return id;
    uint32_t pool = a->workers[id].pool; /* worker_id may move a->workers */
    return worker_id(a, NONE, host, pool, str(a, a->workers[id].name));
}

/* Decision d takes outcome o (joined by request); o is merged away. */
static int merge_by_request(km_analysis *a, uint32_t d_index, point *o)
{
    uint32_t host = a->points[d_index].host;
    uint32_t copy_worker = on_host(a, o->copy_worker, host);
    uint32_t dispatched = on_host(a, o->dispatched, host);
    if ((o->copy_worker != NONE && copy_worker == NONE) ||
        (o->dispatched != NONE && dispatched == NONE))
        return km_analysis_fail_memory(a, "interning names");
    point *d = &a->points[d_index];
    d->flags |= POINT_OUTCOME | POINT_JOINED_BY_REQUEST |
                (o->flags & (POINT_HTTP_200 | POINT_OVERRIDDEN | POINT_WARM_UP));
    d->outcome_kind = o->outcome_kind;
    d->actual = o->actual;
    d->outcome_prompt = o->outcome_prompt;
    d->ttft_ns = o->ttft_ns;
    d->router_ttft_ms = o->router_ttft_ms;
    d->copy_predicted = o->copy_predicted;
    d->copy_worker = copy_worker;
    d->dispatched = dispatched;
    d->outcome_file = o->outcome_file;
    d->outcome_line = o->outcome_line;
    settle_pending(a, d_index);
    o->flags = POINT_MERGED_AWAY;
    a->summary.join.by_request++;
    return 0;
}

/* Pair what is left unjoined by (request_id, attempt_id), in reading order: each decision takes
 * the first outcome of its key from another instance. An outcome of the decision's own instance
 * is never its (an instance writes an outcome with its decision's id, so that pair would have
 * joined by decision id): such leftovers stay unjoined, whatever their request. */
int km_analysis_join_by_request(km_analysis *a)
{
    uint32_t *decisions = malloc((a->n_points + 1) * sizeof *decisions);
    uint32_t *outcomes = malloc((a->n_points + 1) * sizeof *outcomes);
    if (!decisions || !outcomes) {
        free(decisions);
        free(outcomes);
        return km_analysis_fail_memory(a, "joining by request");
    }
    size_t nd = 0, no = 0;
    for (size_t i = 0; i < a->n_points; i++) {
        uint32_t f = a->points[i].flags;
        if ((f & POINT_DECISION) && !(f & POINT_OUTCOME))
            decisions[nd++] = (uint32_t)i;
        else if ((f & POINT_OUTCOME) && !(f & POINT_DECISION))
            outcomes[no++] = (uint32_t)i;
    }
    sort_context = a;
    sort_items(decisions, nd, sizeof *decisions, compare_by_request);
    sort_items(outcomes, no, sizeof *outcomes, compare_by_request);
    size_t i = 0, j = 0;
    while (i < nd && j < no) {
        int c = request_order(&a->points[decisions[i]], &a->points[outcomes[j]]);
        if (c < 0) {
            i++;
        } else if (c > 0) {
            j++;
        } else { /* the key's decisions [i, i_end) and outcomes [j, j_end), in reading order */
            size_t i_end = i + 1, j_end = j + 1;
            while (i_end < nd &&
                   request_order(&a->points[decisions[i_end]], &a->points[decisions[i]]) == 0)
                i_end++;
            while (j_end < no &&
                   request_order(&a->points[outcomes[j_end]], &a->points[outcomes[j]]) == 0)
                j_end++;
            for (; i < i_end; i++)
                for (size_t k = j; k < j_end; k++) {
                    point *o = &a->points[outcomes[k]];
                    if (o->flags != POINT_MERGED_AWAY &&
                        o->instance != a->points[decisions[i]].instance) {
                        int rc = merge_by_request(a, decisions[i], o);
                        if (rc) {
                            free(decisions);
                            free(outcomes);
                            return rc;
                        }
                        break;
                    }
                }
            j = j_end;
        }
    }
    free(decisions);
    free(outcomes);
    return KM_OK;
}
