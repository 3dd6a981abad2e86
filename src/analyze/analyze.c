/* Routing analysis over linked decision and outcome records (src/analyze/analyze.h, docs/ANALYZE.md).
 *
 * Reading: each file is read through a fixed buffer; a line longer than max_line_bytes is skipped
 * to its newline and counted invalid, so no input grows memory past that limit. Each valid record
 * becomes or completes one compact `point`; a map keyed by a 128-bit hash of (instance,
 * decision_id) finds the point a record belongs to, so the join needs no record text. At finish the
 * points left unjoined are paired by a hash of (request_id, attempt_id), then every metric is one
 * pass over the points. A router override (an outcome's dispatched_worker) is compared with the
 * dispatched worker's depth at the decision: a decision read before its outcome keeps its
 * candidates' depths aside (`pending`) until the outcome joins it, then only that one depth stays
 * in the point. Worker health (candidates[].eligible) is counted per worker as each decision is
 * read; the point keeps one flag bit, whether its owner was ineligible. Recovery windows come from per-worker index-state observations: within a
 * file only the first observation of each worker, every change of state and the last observation
 * are kept (a file is written in decision order), and at finish they are sorted by time per worker
 * and swept into windows, so files may be given in any order. */
#include "analyze/analyze.h"

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>
#include <xxhash.h>

#include "base/u64_map.h"

/* Bytes read from a file at a time. */
#define ANALYSIS_READ_CHUNK ((size_t)1 << 20)
/* Most workers drawn in the load chart (the most chosen ones), most points in the scatter, most
 * windows shaded. */
#define ANALYSIS_CHART_MAX_WORKERS 10
#define ANALYSIS_CHART_MAX_POINTS 2000
#define ANALYSIS_CHART_MAX_WINDOWS 500

#define NONE UINT32_MAX

/* ---- interned byte strings ----------------------------------------------------------------- */

/* Each distinct byte string gets a dense id; items are NUL-terminated copies. */
typedef struct intern_table {
    char **items;
    size_t *lengths;
    size_t n, capacity;
    km_u64map map; /* hash (re-seeded on a collision) -> id */
} intern_table;

static void intern_init(intern_table *t, km_memory *memory)
{
    memset(t, 0, sizeof *t);
    km_u64map_init(&t->map, memory);
}

static void intern_free(intern_table *t)
{
    for (size_t i = 0; i < t->n; i++)
        free(t->items[i]);
    free(t->items);
    free(t->lengths);
    km_u64map_free(&t->map);
}

/* The id of bytes[0..len), adding it when new. NONE on out of memory. */
static uint32_t km_analysis_intern(intern_table *t, const void *bytes, size_t len)
{
    for (uint64_t seed = 0;; seed++) {
        uint64_t key = km_u64map_key(XXH3_64bits_withSeed(bytes, len, seed));
        uint64_t *found = km_u64map_find(&t->map, key);
        if (found) {
            uint32_t id = (uint32_t)*found;
            if (t->lengths[id] == len && !memcmp(t->items[id], bytes, len))
                return id;
            continue; /* another string under this hash: try the next seed */
        }
        if (t->n >= NONE - 1)
            return NONE;
        if (t->n == t->capacity) {
            size_t capacity = t->capacity ? t->capacity * 2 : 64;
            char **items = realloc(t->items, capacity * sizeof *items);
            if (!items)
                return NONE;
            t->items = items;
            size_t *lengths = realloc(t->lengths, capacity * sizeof *lengths);
            if (!lengths)
                return NONE;
            t->lengths = lengths;
            t->capacity = capacity;
        }
        char *copy = malloc(len + 1);
        if (!copy)
            return NONE;
        memcpy(copy, bytes, len);
        copy[len] = '\0';
        if (km_u64map_put(&t->map, key, t->n, 1) != KM_OK) {
            free(copy);
            return NONE;
        }
        t->items[t->n] = copy;
        t->lengths[t->n] = len;
        return (uint32_t)t->n++;
    }
}

static uint32_t km_analysis_intern_cstr(intern_table *t, const char *s)
{
    return km_analysis_intern(t, s ? s : "", s ? strlen(s) : 0);
}

/* ---- points: one per decision or (unjoined) outcome ------------------------------------------ */

enum {
    POINT_DECISION = 1u << 0,        /* the decision record was seen */
    POINT_OUTCOME = 1u << 1,         /* the outcome record was seen */
    POINT_MERGED_AWAY = 1u << 2,     /* an outcome-only point joined into another point */
    POINT_JOINED_BY_REQUEST = 1u << 3,
    POINT_OWNER = 1u << 4,           /* some worker held the first block */
    POINT_OWNER_NOT_CHOSEN = 1u << 5,
    POINT_EVENTS = 1u << 6,          /* prediction.source == events */
    POINT_APPROX = 1u << 7,
    POINT_CHOSEN_NOT_LIVE = 1u << 8,
    POINT_OWNER_NOT_LIVE = 1u << 9,
    POINT_HTTP_200 = 1u << 10,
    POINT_IN_WINDOW = 1u << 11,
    POINT_OVERRIDDEN = 1u << 12,     /* the outcome's dispatched_worker is not its worker */
    POINT_OWNER_INELIGIBLE = 1u << 13, /* the owner's candidate row says eligible false */
};

typedef struct point {
    int64_t time_ns;          /* decision monotonic_ns (outcome only: decided or own time) */
    int64_t predicted;        /* chosen depth_tokens (outcome only: its predicted copy) */
    int64_t owner_tokens;     /* owner depth_tokens */
    int64_t decision_prompt;  /* prediction.prompt_tokens, -1 = null */
    int64_t outcome_prompt;   /* outcome prompt_tokens, -1 = null */
    int64_t actual;           /* cached_tokens, -1 = null or no outcome */
    int64_t ttft_ns;          /* -1 = null */
    double router_ttft_ms;    /* -1 = null or absent (records before the field existed) */
    int64_t in_flight;        /* the chosen worker's, -1 = unknown */
    int64_t decision_id;
    int64_t copy_predicted;   /* the outcome's predicted.depth_tokens */
    int64_t dispatched_predicted; /* the dispatched worker's depth_tokens in the decision's
                               * candidates; -1 = no override, no such row, or no decision yet */
    uint64_t key_check;       /* high half of the (instance, decision_id) hash */
    uint64_t request_key[2];  /* hash of (request_id, attempt_id) */
    uint64_t decision_line, outcome_line;
    uint32_t decision_file, outcome_file;
    uint32_t host, pool, instance, policy;
    uint32_t worker;          /* chosen worker (worker table id) */
    uint32_t copy_worker;     /* the outcome's worker */
    uint32_t dispatched;      /* the outcome's dispatched_worker (worker table id, the outcome's
                               * host and pool) when POINT_OVERRIDDEN, else NONE */
    uint32_t owner_name;      /* prediction.owner.worker (string id); NONE = no owner */
    uint32_t flags;
    uint8_t outcome_kind;     /* 1..5 as km_record_outcome */
} point;

/* A worker's index state seen at a decision. */
typedef struct observation {
    int64_t time_ns;
    uint32_t worker;
    uint32_t state; /* string id */
    uint32_t file;  /* file generation it came from */
    uint32_t live;
} observation;

/* A worker (instance NONE: for the per-worker stats, whatever instance routed to it) or a worker's
 * index-state stream as one kvmatch instance saw it (for recovery windows: index state is per
 * instance). Identity, and the per-file compression of the stream's observations. */
typedef struct worker_info {
    uint32_t instance, host, pool, name; /* string ids; instance NONE for a plain worker */
    uint32_t file_generation;  /* file the last observation came from (0 = none yet) */
    uint32_t last_state;
    int64_t last_time;
    int last_recorded;
    uint64_t ineligible;       /* plain worker: decisions it was an ineligible candidate in */
    uint64_t owned_ineligible; /* of those, decisions it was the prediction owner in */
} worker_info;

/* A decision's candidates' depths, kept from its record until its outcome joins it. */
typedef struct candidate_depth {
    uint32_t name;            /* worker name (string id) */
    int64_t depth_tokens;
} candidate_depth;

typedef struct pending_candidates {
    size_t n;
    candidate_depth rows[];
} pending_candidates;

typedef struct problem_list {
    km_analysis_problem *items;
    size_t n;
} problem_list;

struct km_analysis {
    km_analysis_config cfg;
    km_memory memory;
    int finished;
    int broken; /* out of memory: every later call fails */
    char last_error[512];

    intern_table strings; /* hosts, pools, worker names, states, policies, instances, files */
    intern_table worker_keys; /* (host, pool, name) ids as 12 bytes -> worker id */
    worker_info *workers;
    size_t workers_capacity;

    point *points;
    size_t n_points, points_capacity;
    km_u64map by_decision; /* (instance, decision_id) hash -> point index */
    km_u64map pending;     /* point index + 2 -> its pending_candidates (malloc'ed), for decision
                            * points whose outcome has not been read */

    observation *observations;
    size_t n_observations, observations_capacity;
    uint32_t file_generation;
    uint32_t live_state, approx_state;

    problem_list invalid, unjoined_decisions, unjoined_outcomes;

    km_analysis_summary summary;
    km_analysis_window *windows;
    size_t n_windows;
    km_analysis_policy *policies;
    km_analysis_worker *worker_stats;
    uint32_t *time_order; /* decision points by time, for the charts */
    size_t n_time_order;
    int64_t min_time_ns;
    double reuse_max_tokens; /* chart scale */
};

static void km_analysis_set_error(km_analysis *a, const char *format, ...)
{
    va_list ap;
    va_start(ap, format);
    vsnprintf(a->last_error, sizeof a->last_error, format, ap);
    va_end(ap);
}

static int km_analysis_fail_memory(km_analysis *a, const char *where)
{
    a->broken = 1;
    km_analysis_set_error(a, "out of memory while %s", where);
    return KM_ERR_OUT_OF_MEMORY;
}

const char *km_analysis_last_error(const km_analysis *analysis)
{
    return analysis ? analysis->last_error : "";
}

static const char *str(const km_analysis *a, uint32_t id)
{
    return id == NONE ? "" : a->strings.items[id];
}

/* ---- lifecycle ------------------------------------------------------------------------------ */

int km_analysis_create(const km_analysis_config *cfg, km_analysis **out)
{
    if (!out)
        return KM_ERR_NULL_POINTER;
    *out = NULL;
    km_analysis *a = calloc(1, sizeof *a);
    if (!a)
        return KM_ERR_OUT_OF_MEMORY;
    if (cfg)
        a->cfg = *cfg;
    if (!a->cfg.max_line_bytes)
        a->cfg.max_line_bytes = KM_ANALYSIS_DEFAULT_MAX_LINE;
    if (!a->cfg.max_listed)
        a->cfg.max_listed = KM_ANALYSIS_DEFAULT_MAX_LISTED;
    if (!a->cfg.chart_buckets)
        a->cfg.chart_buckets = KM_ANALYSIS_DEFAULT_BUCKETS;
    intern_init(&a->strings, &a->memory);
    intern_init(&a->worker_keys, &a->memory);
    km_u64map_init(&a->by_decision, &a->memory);
    km_u64map_init(&a->pending, &a->memory);
    a->live_state = km_analysis_intern_cstr(&a->strings, "LIVE");
    a->approx_state = km_analysis_intern_cstr(&a->strings, "APPROX");
    if (a->live_state == NONE || a->approx_state == NONE) {
        km_analysis_destroy(a);
        return KM_ERR_OUT_OF_MEMORY;
    }
    *out = a;
    return KM_OK;
}

/* Free every decision's kept candidates (those never joined with an outcome). */
static void km_analysis_pending_free(km_analysis *a)
{
    uint64_t cursor = 0;
    for (km_u64map_entry *e; (e = km_u64map_next(&a->pending, &cursor));)
        free((void *)(uintptr_t)e->value);
    km_u64map_free(&a->pending); /* leaves it empty and usable */
}

static void problems_free(problem_list *list)
{
    for (size_t i = 0; i < list->n; i++)
        free((char *)list->items[i].what);
    free(list->items);
}

void km_analysis_destroy(km_analysis *a)
{
    if (!a)
        return;
    intern_free(&a->strings);
    intern_free(&a->worker_keys);
    free(a->workers);
    free(a->points);
    km_u64map_free(&a->by_decision);
    km_analysis_pending_free(a);
    free(a->observations);
    problems_free(&a->invalid);
    problems_free(&a->unjoined_decisions);
    problems_free(&a->unjoined_outcomes);
    free(a->windows);
    free(a->policies);
    free(a->worker_stats);
    free(a->time_order);
    free(a);
}

/* Keep a problem when fewer than max_listed are kept. */
static int km_analysis_add_problem(km_analysis *a, problem_list *list, uint32_t file, uint64_t line,
                                   const char *format, ...)
{
    if (list->n >= a->cfg.max_listed)
        return KM_OK;
    if (!list->items) {
        list->items = calloc(a->cfg.max_listed, sizeof *list->items);
        if (!list->items)
            return km_analysis_fail_memory(a, "listing a problem");
    }
    char buffer[512];
    va_list ap;
    va_start(ap, format);
    vsnprintf(buffer, sizeof buffer, format, ap);
    va_end(ap);
    char *what = strdup(buffer);
    if (!what)
        return km_analysis_fail_memory(a, "listing a problem");
    list->items[list->n++] = (km_analysis_problem){.file = str(a, file), .line = line, .what = what};
    return KM_OK;
}

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
    p->worker = p->copy_worker = p->dispatched = p->owner_name = p->policy = NONE;
    p->decision_prompt = p->outcome_prompt = p->actual = p->ttft_ns = p->in_flight = -1;
    p->dispatched_predicted = -1;
    p->router_ttft_ms = -1;
    return p;
}

/* ---- router overrides ---------------------------------------------------------------------- */

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

/* The prediction an outcome's cached_tokens are compared with: the depth at the decision of the
 * worker whose engine reported them: the chosen worker's (the outcome's copy when it has no
 * decision), or for a router override the dispatched worker's candidate row. Returns 0 when there
 * is none (an override without such a row, or without a decision): not compared. */
static int compared_prediction(const point *p, int64_t *predicted)
{
    if (!(p->flags & POINT_OVERRIDDEN)) {
        *predicted = p->predicted;
        return 1;
    }
    if ((p->flags & POINT_DECISION) && p->dispatched_predicted >= 0) {
        *predicted = p->dispatched_predicted;
        return 1;
    }
    return 0;
}

/* ---- index-state observations ------------------------------------------------------------------ */

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

/* ---- records ---------------------------------------------------------------------------------- */

static int is_live(const char *state)
{
    return state && !strcmp(state, "LIVE");
}

/* Count a valid decision's ineligible candidates (its rows validated: eligible absent or a
 * boolean) per worker, a worker named twice by its first row, and the decision in
 * decisions_with_ineligible. owner is the prediction owner's name, NULL when none. Counted as the
 * record is read: these need nothing kept in the decision's point. */
static int count_ineligible(km_analysis *a, json_t *candidates, uint32_t host, uint32_t pool,
                            const char *owner)
{
    size_t n = json_array_size(candidates);
    int counted = 0;
    for (size_t i = 0; i < n; i++) {
        json_t *cand = json_array_get(candidates, i);
        if (!json_is_false(json_object_get(cand, "eligible")))
            continue;
        const char *name = json_string_value(json_object_get(cand, "worker"));
        int repeated = 0;
        for (size_t j = 0; j < i && !repeated; j++)
            repeated = !strcmp(name, json_string_value(
                                         json_object_get(json_array_get(candidates, j), "worker")));
        if (repeated)
            continue;
        uint32_t id = worker_id(a, NONE, host, pool, name);
        if (id == NONE)
            return km_analysis_fail_memory(a, "interning names");
        a->workers[id].ineligible++;
        a->summary.health.ineligible_candidates++;
        counted = 1;
        if (owner && !strcmp(name, owner))
            a->workers[id].owned_ineligible++;
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
    json_t *candidates = json_object_get(root, "candidates");
    if (!candidates || !json_is_array(candidates))
        return invalid_field(e, "", "candidates", candidates ? "expected an array" : "missing");
    size_t n_candidates = json_array_size(candidates);
    int64_t chosen_in_flight = -1;
    int owner_row_seen = 0, owner_ineligible = 0, any_ineligible = 0;
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
        /* absent in records written before worker health: eligible */
        json_t *eligible = json_object_get(cand, "eligible");
        if (eligible && !json_is_boolean(eligible))
            return invalid_field(e, prefix, "eligible", "expected a boolean");
        int ineligible = eligible && json_is_false(eligible);
        any_ineligible |= ineligible;
        if (!strcmp(name, chosen.worker) && chosen_in_flight < 0)
            chosen_in_flight = in_flight;
        if (owner.worker && !owner_row_seen && !strcmp(name, owner.worker)) {
            owner_row_seen = 1;
            owner_ineligible = ineligible;
        }
    }

    /* Valid: from here on only out-of-memory can fail. */
    uint64_t key[2];
    decision_key(c.instance, c.decision_id, key);
    /* The map holds the low 64 bits, the point the high 64: two keys equal in the low half only
     * (about n^2 / 2^65 for n decisions) would make the newer one take the map entry. */
    uint64_t map_key = km_u64map_key(key[0]);
    uint64_t *found = km_u64map_find(&a->by_decision, map_key);
    uint32_t index;
    point *p;
    if (found && a->points[*found].key_check == key[1]) {
        index = (uint32_t)*found;
        p = &a->points[index];
        if (p->flags & POINT_DECISION) {
            a->summary.join.duplicate_decisions++;
            a->summary.input.decisions++;
            return 1;
        }
        a->summary.join.by_decision_id++;
    } else {
        p = new_point(a, &index);
        if (!p)
            return km_analysis_fail_memory(a, "keeping a decision");
        p->key_check = key[1];
        if (km_u64map_put(&a->by_decision, map_key, index, 1) != KM_OK)
            return km_analysis_fail_memory(a, "indexing a decision");
    }
    a->summary.input.decisions++;
    uint32_t host = km_analysis_intern_cstr(&a->strings, c.host);
    uint32_t pool = km_analysis_intern_cstr(&a->strings, c.pool);
    uint32_t instance = km_analysis_intern_cstr(&a->strings, c.instance);
    uint32_t policy_id = km_analysis_intern_cstr(&a->strings, policy);
    uint32_t chosen_id = host == NONE || pool == NONE ? NONE
                                                      : worker_id(a, NONE, host, pool, chosen.worker);
    if (instance == NONE || policy_id == NONE || chosen_id == NONE)
        return km_analysis_fail_memory(a, "interning names");
    p->flags |= POINT_DECISION | (events ? POINT_EVENTS : POINT_APPROX);
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
    p->worker = chosen_id;
    if (owner.worker) {
        p->flags |= POINT_OWNER;
        if (strcmp(owner.worker, chosen.worker))
            p->flags |= POINT_OWNER_NOT_CHOSEN;
        if (owner_ineligible)
            p->flags |= POINT_OWNER_INELIGIBLE;
        p->owner_name = km_analysis_intern_cstr(&a->strings, owner.worker);
        if (p->owner_name == NONE)
            return km_analysis_fail_memory(a, "interning names");
    }
    if (any_ineligible) {
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

static int parse_outcome_kind(const char *s)
{
    static const char *const names[] = {"complete", "incomplete", "error", "cancelled", "expired"};
    for (int i = 0; i < 5; i++)
        if (!strcmp(s, names[i]))
            return i + 1;
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

    uint64_t key[2];
    decision_key(c.instance, c.decision_id, key);
    uint64_t map_key = km_u64map_key(key[0]);
    uint64_t *found = km_u64map_find(&a->by_decision, map_key);
    uint32_t index;
    point *p;
    a->summary.input.outcomes++;
    if (found && a->points[*found].key_check == key[1]) {
        index = (uint32_t)*found;
        p = &a->points[index];
        if (p->flags & POINT_OUTCOME) {
            a->summary.join.duplicate_outcomes++;
            return 1;
        }
        a->summary.join.by_decision_id++;
    } else {
        p = new_point(a, &index);
        if (!p)
            return km_analysis_fail_memory(a, "keeping an outcome");
        p->key_check = key[1];
        if (km_u64map_put(&a->by_decision, map_key, index, 1) != KM_OK)
            return km_analysis_fail_memory(a, "indexing an outcome");
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

/* ---- reading files ---------------------------------------------------------------------------- */

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
    uint32_t file = km_analysis_intern_cstr(&a->strings, path);
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

/* ---- finish: fallback join, windows, metrics -------------------------------------------------- */

/* The analysis whose points the comparators below read (qsort has no context argument);
 * thread-local, so handles finished on different threads stay independent. */
static _Thread_local const km_analysis *sort_context;

/* qsort that accepts an empty (possibly NULL) array. */
static void sort_items(void *base, size_t n, size_t size, int (*compare)(const void *, const void *))
{
    if (n > 1)
        qsort(base, n, size, compare);
}

static int compare_by_request(const void *x, const void *y)
{
    const point *p = &sort_context->points[*(const uint32_t *)x];
    const point *q = &sort_context->points[*(const uint32_t *)y];
    for (int i = 0; i < 2; i++)
        if (p->request_key[i] != q->request_key[i])
            return p->request_key[i] < q->request_key[i] ? -1 : 1;
    uint32_t a = *(const uint32_t *)x, b = *(const uint32_t *)y;
    return a < b ? -1 : a > b;
}

static int compare_by_group_time(const void *x, const void *y)
{
    const point *p = &sort_context->points[*(const uint32_t *)x];
    const point *q = &sort_context->points[*(const uint32_t *)y];
    if (p->instance != q->instance)
        return p->instance < q->instance ? -1 : 1;
    if (p->pool != q->pool)
        return p->pool < q->pool ? -1 : 1;
    if (p->time_ns != q->time_ns)
        return p->time_ns < q->time_ns ? -1 : 1;
    uint32_t a = *(const uint32_t *)x, b = *(const uint32_t *)y;
    return a < b ? -1 : a > b;
}

static int compare_by_time(const void *x, const void *y)
{
    const point *p = &sort_context->points[*(const uint32_t *)x];
    const point *q = &sort_context->points[*(const uint32_t *)y];
    if (p->time_ns != q->time_ns)
        return p->time_ns < q->time_ns ? -1 : 1;
    uint32_t a = *(const uint32_t *)x, b = *(const uint32_t *)y;
    return a < b ? -1 : a > b;
}

static int compare_observations(const void *x, const void *y)
{
    const observation *p = x, *q = y;
    if (p->worker != q->worker)
        return p->worker < q->worker ? -1 : 1;
    if (p->time_ns != q->time_ns)
        return p->time_ns < q->time_ns ? -1 : 1;
    if (p->file != q->file)
        return p->file < q->file ? -1 : 1;
    return p->state < q->state ? -1 : p->state > q->state;
}

static int compare_windows(const void *x, const void *y)
{
    const km_analysis_window *p = x, *q = y;
    int c = strcmp(p->instance, q->instance);
    if (!c)
        c = strcmp(p->pool, q->pool);
    if (!c)
        c = strcmp(p->worker, q->worker);
    if (!c && p->start_ns != q->start_ns)
        c = p->start_ns < q->start_ns ? -1 : 1;
    return c;
}

static int compare_policies(const void *x, const void *y)
{
    return strcmp(((const km_analysis_policy *)x)->policy, ((const km_analysis_policy *)y)->policy);
}

static int compare_workers(const void *x, const void *y)
{
    const km_analysis_worker *p = x, *q = y;
    int c = strcmp(p->host, q->host);
    if (!c)
        c = strcmp(p->pool, q->pool);
    if (!c)
        c = strcmp(p->worker, q->worker);
    return c;
}

static int compare_i64(const void *x, const void *y)
{
    int64_t a = *(const int64_t *)x, b = *(const int64_t *)y;
    return a < b ? -1 : a > b;
}

static int compare_double(const void *x, const void *y)
{
    double a = *(const double *)x, b = *(const double *)y;
    return (a > b) - (a < b);
}

/* Pair what is left unjoined by (request_id, attempt_id), in reading order. */
static int km_analysis_join_by_request(km_analysis *a)
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
        point *d = &a->points[decisions[i]];
        point *o = &a->points[outcomes[j]];
        int c = d->request_key[0] != o->request_key[0]
                    ? (d->request_key[0] < o->request_key[0] ? -1 : 1)
                    : d->request_key[1] != o->request_key[1]
                          ? (d->request_key[1] < o->request_key[1] ? -1 : 1)
                          : 0;
        if (c < 0) {
            i++;
        } else if (c > 0) {
            j++;
        } else {
            d->flags |= POINT_OUTCOME | POINT_JOINED_BY_REQUEST |
                        (o->flags & (POINT_HTTP_200 | POINT_OVERRIDDEN));
            d->outcome_kind = o->outcome_kind;
            d->actual = o->actual;
            d->outcome_prompt = o->outcome_prompt;
            d->ttft_ns = o->ttft_ns;
            d->router_ttft_ms = o->router_ttft_ms;
            d->copy_predicted = o->copy_predicted;
            d->copy_worker = o->copy_worker;
            d->dispatched = o->dispatched;
            d->outcome_file = o->outcome_file;
            d->outcome_line = o->outcome_line;
            settle_pending(a, decisions[i]);
            o->flags = POINT_MERGED_AWAY;
            a->summary.join.by_request++;
            i++;
            j++;
        }
    }
    free(decisions);
    free(outcomes);
    return KM_OK;
}

/* The per-worker stats row of worker (a worker table id), added on first use. worker_index maps
 * ids to row index + 1. */
static km_analysis_worker *worker_row(km_analysis *a, uint64_t *worker_index, size_t *n_workers,
                                      uint32_t worker)
{
    if (!worker_index[worker]) {
        const worker_info *w = &a->workers[worker];
        a->worker_stats[*n_workers] = (km_analysis_worker){
            .host = str(a, w->host), .pool = str(a, w->pool), .worker = str(a, w->name)};
        worker_index[worker] = ++*n_workers;
    }
    return &a->worker_stats[worker_index[worker] - 1];
}

static void quality_add(km_analysis_quality *q, const point *p)
{
    q->decisions++;
    if (p->flags & POINT_OWNER_NOT_CHOSEN)
        q->owner_not_chosen++;
    if ((p->flags & POINT_EVENTS) && (p->flags & (POINT_CHOSEN_NOT_LIVE | POINT_OWNER_NOT_LIVE)))
        q->stale++;
    int64_t predicted;
    if (!(p->flags & POINT_OUTCOME) || p->actual < 0)
        return;
    if (!compared_prediction(p, &predicted)) {
        q->overridden_unpredicted++;
        return;
    }
    q->known++;
    if (p->flags & POINT_OVERRIDDEN)
        q->overridden++;
    q->predicted_tokens += (uint64_t)predicted;
    q->actual_tokens += (uint64_t)p->actual;
    if (p->actual == predicted)
        q->exact++;
    int64_t prompt = p->outcome_prompt >= 0 ? p->outcome_prompt : p->decision_prompt;
    if (prompt >= 0) {
        q->prompt_tokens += (uint64_t)prompt;
        q->actual_with_prompt += (uint64_t)p->actual;
    }
}

static void quality_finish(km_analysis_quality *q)
{
    q->hit_rate = q->prompt_tokens ? (double)q->actual_with_prompt / (double)q->prompt_tokens : 0;
}

static int push_window(km_analysis *a, size_t *capacity, const km_analysis_window *window)
{
    if (a->n_windows == *capacity) {
        size_t grown = *capacity ? *capacity * 2 : 16;
        km_analysis_window *w = realloc(a->windows, grown * sizeof *w);
        if (!w)
            return km_analysis_fail_memory(a, "building recovery windows");
        a->windows = w;
        *capacity = grown;
    }
    a->windows[a->n_windows++] = *window;
    return KM_OK;
}

/* Sweep each stream's observations, in time order, into windows. A stream whose observations
 * from one file are not contiguous in time (files overlapping in time) is counted: the per-file
 * compression may have dropped a change of state between them. */
static int build_windows(km_analysis *a)
{
    sort_items(a->observations, a->n_observations, sizeof *a->observations, compare_observations);
    /* left_by[file] = stream + 1 once that stream's run of observations from file ended */
    uint32_t *left_by = calloc((size_t)a->file_generation + 1, sizeof *left_by);
    if (!left_by)
        return km_analysis_fail_memory(a, "building recovery windows");
    size_t capacity = 0;
    size_t i = 0;
    while (i < a->n_observations) {
        uint32_t worker = a->observations[i].worker;
        const worker_info *w = &a->workers[worker];
        int open = 0, interleaved = 0;
        uint32_t file = a->observations[i].file;
        km_analysis_window current = {0};
        for (; i < a->n_observations && a->observations[i].worker == worker; i++) {
            const observation *o = &a->observations[i];
            if (o->file != file) {
                left_by[file] = worker + 1;
                if (left_by[o->file] == worker + 1)
                    interleaved = 1;
                file = o->file;
            }
            if (!o->live) {
                if (!open) {
                    current = (km_analysis_window){.host = str(a, w->host),
                                                   .instance = str(a, w->instance),
                                                   .pool = str(a, w->pool),
                                                   .worker = str(a, w->name),
                                                   .state = str(a, o->state),
                                                   .start_ns = o->time_ns};
                    open = 1;
                }
                current.end_ns = o->time_ns;
            } else if (open) {
                current.end_ns = o->time_ns; /* the first LIVE decision closes it */
                current.open = 0;
                open = 0;
                if (push_window(a, &capacity, &current) != KM_OK) {
                    free(left_by);
                    return KM_ERR_OUT_OF_MEMORY;
                }
            }
        }
        left_by[file] = worker + 1;
        a->summary.input.interleaved_streams += (uint64_t)interleaved;
        if (open) {
            current.open = 1;
            if (push_window(a, &capacity, &current) != KM_OK) {
                free(left_by);
                return KM_ERR_OUT_OF_MEMORY;
            }
        }
    }
    free(left_by);
    sort_items(a->windows, a->n_windows, sizeof *a->windows, compare_windows);
    return KM_OK;
}

/* Decisions ordered by instance name, pool name, time (the windows' order of comparison). */
static int compare_by_group_time_names(const void *x, const void *y)
{
    const point *p = &sort_context->points[*(const uint32_t *)x];
    const point *q = &sort_context->points[*(const uint32_t *)y];
    int c = strcmp(str(sort_context, p->instance), str(sort_context, q->instance));
    if (!c)
        c = strcmp(str(sort_context, p->pool), str(sort_context, q->pool));
    if (c)
        return c;
    return compare_by_group_time(x, y);
}

/* Mark the decisions inside each window (same instance and pool) and total each window's
 * quality. */
static int assign_windows(km_analysis *a)
{
    size_t n = 0;
    uint32_t *order = malloc((a->n_points + 1) * sizeof *order);
    if (!order)
        return km_analysis_fail_memory(a, "ordering decisions");
    for (size_t i = 0; i < a->n_points; i++)
        if (a->points[i].flags & POINT_DECISION)
            order[n++] = (uint32_t)i;
    sort_context = a;
    sort_items(order, n, sizeof *order, compare_by_group_time_names);
    for (size_t w = 0; w < a->n_windows; w++) {
        km_analysis_window *win = &a->windows[w];
        /* lower bound of (instance, pool, start) */
        size_t lo = 0, hi = n;
        while (lo < hi) {
            size_t mid = lo + (hi - lo) / 2;
            const point *p = &a->points[order[mid]];
            int c = strcmp(str(a, p->instance), win->instance);
            if (!c)
                c = strcmp(str(a, p->pool), win->pool);
            if (!c)
                c = p->time_ns < win->start_ns ? -1 : 0;
            if (c < 0)
                lo = mid + 1;
            else
                hi = mid;
        }
        for (size_t k = lo; k < n; k++) {
            point *p = &a->points[order[k]];
            if (strcmp(str(a, p->instance), win->instance) || strcmp(str(a, p->pool), win->pool))
                break;
            if (win->open ? p->time_ns > win->end_ns : p->time_ns >= win->end_ns)
                break;
            p->flags |= POINT_IN_WINDOW;
            quality_add(&win->inside, p);
        }
        quality_finish(&win->inside);
    }
    free(order);
    return KM_OK;
}

int km_analysis_finish(km_analysis *a)
{
    if (!a)
        return KM_ERR_NULL_POINTER;
    if (a->broken)
        return KM_ERR_OUT_OF_MEMORY;
    if (a->finished) {
        km_analysis_set_error(a, "finish called twice");
        return KM_ERR_INVALID_ARGUMENT;
    }
    a->finished = 1;
    km_analysis_summary *s = &a->summary;
    int rc = km_analysis_join_by_request(a);
    if (rc != KM_OK)
        return rc;
    km_analysis_pending_free(a); /* what is left belongs to decisions without outcome */

    /* hosts: distinct host ids among decisions and outcomes */
    {
        uint8_t *seen = calloc(a->strings.n + 1, 1);
        if (!seen)
            return km_analysis_fail_memory(a, "counting hosts");
        for (size_t i = 0; i < a->n_points; i++) {
            const point *p = &a->points[i];
            if (!(p->flags & POINT_MERGED_AWAY) && !seen[p->host]) {
                seen[p->host] = 1;
                s->input.hosts++;
            }
        }
        free(seen);
    }

    int64_t *ttfts = malloc((a->n_points + 1) * sizeof *ttfts);
    double *router_ttfts = malloc((a->n_points + 1) * sizeof *router_ttfts);
    uint64_t *policy_index = calloc(a->strings.n + 1, sizeof *policy_index); /* id -> index + 1 */
    a->policies = calloc(a->strings.n + 1, sizeof *a->policies);
    uint64_t *worker_index = calloc(a->worker_keys.n + 1, sizeof *worker_index);
    a->worker_stats = calloc(a->worker_keys.n + 1, sizeof *a->worker_stats);
    if (!ttfts || !router_ttfts || !policy_index || !a->policies || !worker_index ||
        !a->worker_stats) {
        free(ttfts);
        free(router_ttfts);
        free(policy_index);
        free(worker_index);
        return km_analysis_fail_memory(a, "computing metrics");
    }
    size_t n_ttft = 0, n_router_ttft = 0, n_policies = 0, n_workers = 0;
    a->min_time_ns = INT64_MAX;
    double max_tokens = 0;
    for (size_t i = 0; i < a->n_points; i++) {
        point *p = &a->points[i];
        uint32_t f = p->flags;
        if (f & POINT_MERGED_AWAY)
            continue;
        if ((f & POINT_DECISION) && p->time_ns < a->min_time_ns)
            a->min_time_ns = p->time_ns;
        if (f & POINT_OUTCOME) {
            km_analysis_reuse *r = &s->reuse;
            r->outcomes++;
            int64_t predicted;
            if (p->actual < 0) {
                r->unknown++;
            } else if (!compared_prediction(p, &predicted)) {
                r->overridden_unpredicted++;
            } else {
                r->known++;
                if (f & POINT_OVERRIDDEN)
                    r->overridden++;
                if (!(f & POINT_DECISION))
                    r->from_outcome_copy++;
                r->predicted_tokens += (uint64_t)predicted;
                r->actual_tokens += (uint64_t)p->actual;
                int64_t d = p->actual - predicted;
                if (d == 0)
                    r->exact++;
                else if (d < 0) {
                    r->over_predicted++;
                    r->over_predicted_tokens += (uint64_t)-d;
                } else {
                    r->under_predicted++;
                    r->under_predicted_tokens += (uint64_t)d;
                }
                r->difference_buckets[km_analysis_diff_bucket(d)]++;
                if ((double)predicted > max_tokens)
                    max_tokens = (double)predicted;
                if ((double)p->actual > max_tokens)
                    max_tokens = (double)p->actual;
            }
            km_analysis_outcomes *o = &s->outcomes;
            switch (p->outcome_kind) {
            case 1: o->complete++; break;
            case 2:
                o->incomplete++;
                if (f & POINT_HTTP_200)
                    o->incomplete_http_200++;
                break;
            case 3: o->error++; break;
            case 4: o->cancelled++; break;
            default: o->expired++; break;
            }
            if (p->outcome_kind == 1 && p->ttft_ns >= 0)
                ttfts[n_ttft++] = p->ttft_ns;
            if (p->outcome_kind == 1 && p->router_ttft_ms >= 0)
                router_ttfts[n_router_ttft++] = p->router_ttft_ms;
            /* the copy is the chosen worker's, override or not */
            if ((f & POINT_DECISION) &&
                (p->copy_worker != p->worker || p->copy_predicted != p->predicted))
                s->join.copy_mismatches++;
            if (f & POINT_OVERRIDDEN)
                worker_row(a, worker_index, &n_workers, p->dispatched)->dispatched_by_override++;
        }
        if (f & POINT_DECISION) {
            if (!(f & POINT_OUTCOME))
                s->join.decisions_without_outcome++;
            km_analysis_owner *ow = &s->owner;
            ow->decisions++;
            if (!(f & POINT_OWNER))
                ow->no_owner++;
            else if (f & POINT_OWNER_NOT_CHOSEN) {
                ow->owner_not_chosen++;
                ow->owner_tokens += (uint64_t)p->owner_tokens;
                ow->chosen_tokens += (uint64_t)p->predicted;
                km_analysis_owner_part *part =
                    f & POINT_OWNER_INELIGIBLE ? &ow->owner_ineligible : &ow->owner_eligible;
                part->decisions++;
                part->owner_tokens += (uint64_t)p->owner_tokens;
                part->chosen_tokens += (uint64_t)p->predicted;
                /* what the chosen worker really reused: an overridden attempt's cached tokens
                 * came from another worker's engine */
                if ((f & POINT_OUTCOME) && p->actual >= 0 && (f & POINT_OVERRIDDEN)) {
                    ow->joined_overridden++;
                    part->joined_overridden++;
                } else if ((f & POINT_OUTCOME) && p->actual >= 0) {
                    ow->joined_known++;
                    ow->joined_actual_tokens += (uint64_t)p->actual;
                    ow->joined_owner_tokens += (uint64_t)p->owner_tokens;
                    part->joined_known++;
                    part->joined_actual_tokens += (uint64_t)p->actual;
                    part->joined_owner_tokens += (uint64_t)p->owner_tokens;
                }
            } else
                ow->owner_is_chosen++;
            if (f & POINT_OVERRIDDEN) { /* implies an outcome */
                ow->overridden++;
                if (p->owner_name != NONE && a->workers[p->dispatched].name == p->owner_name)
                    ow->overridden_to_owner++;
            }
            km_analysis_staleness *st = &s->staleness;
            if (f & POINT_APPROX)
                st->approx_decisions++;
            else {
                st->events_decisions++;
                if (f & POINT_CHOSEN_NOT_LIVE)
                    st->chosen_not_live++;
                if (f & POINT_OWNER_NOT_LIVE)
                    st->owner_not_live++;
                if (f & (POINT_CHOSEN_NOT_LIVE | POINT_OWNER_NOT_LIVE))
                    st->stale_decisions++;
            }
            if (!policy_index[p->policy]) {
                a->policies[n_policies].policy = str(a, p->policy);
                policy_index[p->policy] = ++n_policies;
            }
            quality_add(&a->policies[policy_index[p->policy] - 1].quality, p);
            km_analysis_worker *ws = worker_row(a, worker_index, &n_workers, p->worker);
            ws->chosen++;
            if (p->in_flight >= 0) {
                ws->in_flight_known++;
                ws->mean_in_flight += (double)p->in_flight; /* a sum until the end */
                if ((uint64_t)p->in_flight > ws->max_in_flight)
                    ws->max_in_flight = (uint64_t)p->in_flight;
            }
        } else if (f & POINT_OUTCOME) {
            s->join.outcomes_without_decision++;
        }
    }
    /* health, counted as the decisions were read: a worker only ever ineligible gets a row too */
    for (size_t i = 0; i < a->worker_keys.n; i++) {
        const worker_info *w = &a->workers[i];
        if (w->instance != NONE || !w->ineligible)
            continue;
        km_analysis_worker *ws = worker_row(a, worker_index, &n_workers, (uint32_t)i);
        ws->ineligible = w->ineligible;
        ws->owned_ineligible = w->owned_ineligible;
    }
    free(policy_index);
    free(worker_index);
    if (a->min_time_ns == INT64_MAX)
        a->min_time_ns = 0;
    a->reuse_max_tokens = max_tokens;

    km_analysis_reuse *r = &s->reuse;
    if (r->known) {
        r->mean_predicted_tokens = (double)r->predicted_tokens / (double)r->known;
        r->mean_actual_tokens = (double)r->actual_tokens / (double)r->known;
    }
    km_analysis_owner *ow = &s->owner;
    ow->cost_tokens = ow->owner_tokens - ow->chosen_tokens;
    ow->owner_ineligible.cost_tokens =
        ow->owner_ineligible.owner_tokens - ow->owner_ineligible.chosen_tokens;
    ow->owner_eligible.cost_tokens =
        ow->owner_eligible.owner_tokens - ow->owner_eligible.chosen_tokens;
    if (ow->decisions > ow->no_owner)
        ow->owner_not_chosen_rate = (double)ow->owner_not_chosen / (double)(ow->decisions - ow->no_owner);
    sort_items(ttfts, n_ttft, sizeof *ttfts, compare_i64);
    s->outcomes.ttft_known = n_ttft;
    if (n_ttft) {
        size_t r50 = (n_ttft * 50 + 99) / 100, r99 = (n_ttft * 99 + 99) / 100;
        s->outcomes.ttft_p50_ms = (double)ttfts[r50 - 1] / 1e6;
        s->outcomes.ttft_p99_ms = (double)ttfts[r99 - 1] / 1e6;
    }
    free(ttfts);
    sort_items(router_ttfts, n_router_ttft, sizeof *router_ttfts, compare_double);
    s->outcomes.router_ttft_known = n_router_ttft;
    if (n_router_ttft) {
        size_t r50 = (n_router_ttft * 50 + 99) / 100, r99 = (n_router_ttft * 99 + 99) / 100;
        s->outcomes.router_ttft_p50_ms = router_ttfts[r50 - 1];
        s->outcomes.router_ttft_p99_ms = router_ttfts[r99 - 1];
    }
    free(router_ttfts);
    for (size_t i = 0; i < n_policies; i++)
        quality_finish(&a->policies[i].quality);
    sort_items(a->policies, n_policies, sizeof *a->policies, compare_policies);
    for (size_t i = 0; i < n_workers; i++) {
        km_analysis_worker *ws = &a->worker_stats[i];
        ws->mean_in_flight = ws->in_flight_known ? ws->mean_in_flight / (double)ws->in_flight_known : 0;
    }
    sort_items(a->worker_stats, n_workers, sizeof *a->worker_stats, compare_workers);

    rc = build_windows(a);
    if (rc != KM_OK)
        return rc;
    rc = assign_windows(a);
    if (rc != KM_OK)
        return rc;
    for (size_t i = 0; i < a->n_points; i++) {
        const point *p = &a->points[i];
        if (!(p->flags & POINT_DECISION))
            continue;
        quality_add(p->flags & POINT_IN_WINDOW ? &s->in_windows : &s->outside_windows, p);
    }
    quality_finish(&s->in_windows);
    quality_finish(&s->outside_windows);

    /* unjoined lists, in reading order */
    for (size_t i = 0; i < a->n_points && rc == KM_OK; i++) {
        const point *p = &a->points[i];
        if ((p->flags & POINT_DECISION) && !(p->flags & POINT_OUTCOME))
            rc = km_analysis_add_problem(a, &a->unjoined_decisions, p->decision_file,
                                         p->decision_line,
                                         "decision %" PRId64 " of instance %s has no outcome",
                                         p->decision_id, str(a, p->instance));
        else if ((p->flags & POINT_OUTCOME) && !(p->flags & POINT_DECISION))
            rc = km_analysis_add_problem(a, &a->unjoined_outcomes, p->outcome_file,
                                         p->outcome_line,
                                         "outcome of decision %" PRId64
                                         " of instance %s has no decision",
                                         p->decision_id, str(a, p->instance));
    }
    if (rc != KM_OK)
        return rc;

    /* decision points by time, for the charts */
    a->time_order = malloc((a->n_points + 1) * sizeof *a->time_order);
    if (!a->time_order)
        return km_analysis_fail_memory(a, "ordering decisions");
    for (size_t i = 0; i < a->n_points; i++)
        if (a->points[i].flags & POINT_DECISION)
            a->time_order[a->n_time_order++] = (uint32_t)i;
    sort_context = a;
    sort_items(a->time_order, a->n_time_order, sizeof *a->time_order, compare_by_time);

    s->windows = a->windows;
    s->n_windows = a->n_windows;
    s->policies = a->policies;
    s->n_policies = n_policies;
    s->workers = a->worker_stats;
    s->n_workers = n_workers;
    s->invalid_lines = a->invalid.items;
    s->n_invalid_lines = a->invalid.n;
    s->unjoined_decisions = a->unjoined_decisions.items;
    s->n_unjoined_decisions = a->unjoined_decisions.n;
    s->unjoined_outcomes = a->unjoined_outcomes.items;
    s->n_unjoined_outcomes = a->unjoined_outcomes.n;
    return KM_OK;
}

const km_analysis_summary *km_analysis_summary_get(const km_analysis *a)
{
    return a && a->finished && !a->broken ? &a->summary : NULL;
}

/* ---- difference buckets ----------------------------------------------------------------------- */

static const int64_t diff_edges[] = {16, 64, 256, 1024, 4096}; /* magnitude bucket starts after 1 */

uint32_t km_analysis_diff_bucket(int64_t d)
{
    if (d == 0)
        return 6;
    uint64_t m = d < 0 ? (uint64_t)(-(d + 1)) + 1 : (uint64_t)d;
    uint32_t k = 0; /* 0: [1,15], 1: [16,63], ... 5: >= 4096 */
    while (k < 5 && m >= (uint64_t)diff_edges[k])
        k++;
    return d < 0 ? 5 - k : 7 + k;
}

const char *km_analysis_diff_bucket_label(uint32_t bucket)
{
    static const char *const labels[KM_ANALYSIS_DIFF_BUCKETS] = {
        "<= -4096",    "[-4095, -1024]", "[-1023, -256]", "[-255, -64]", "[-63, -16]",
        "[-15, -1]",   "0",              "[1, 15]",       "[16, 63]",    "[64, 255]",
        "[256, 1023]", "[1024, 4095]",   ">= 4096"};
    return bucket < KM_ANALYSIS_DIFF_BUCKETS ? labels[bucket] : "?";
}

/* ---- text report ------------------------------------------------------------------------------ */

static double percent(uint64_t part, uint64_t whole)
{
    return whole ? 100.0 * (double)part / (double)whole : 0.0;
}

static void text_quality(km_text *out, const char *label, const km_analysis_quality *q)
{
    km_text_printf(out,
                   "  %-16s decisions %" PRIu64 ", owner not chosen %" PRIu64 " (%.1f%%), stale %" PRIu64
                   ", known reuse %" PRIu64 " (router overrides %" PRIu64 "; %" PRIu64
                   " more without a prediction, not compared): predicted %" PRIu64
                   " / actual %" PRIu64 " tokens, exact %" PRIu64 " (%.1f%%), hit rate %.1f%%\n",
                   label, q->decisions, q->owner_not_chosen, percent(q->owner_not_chosen, q->decisions),
                   q->stale, q->known, q->overridden, q->overridden_unpredicted,
                   q->predicted_tokens, q->actual_tokens, q->exact, percent(q->exact, q->known),
                   100.0 * q->hit_rate);
}

/* One part of the owner != chosen decisions, in the words of the lines above it. */
static void text_owner_part(km_text *out, const char *label, const km_analysis_owner_part *part)
{
    km_text_printf(out,
                   "  %s: %" PRIu64 " decisions, owners held %" PRIu64 " tokens, the chosen %" PRIu64
                   ": %" PRIu64 " tokens of predicted reuse given up; %" PRIu64
                   " joined and served by the chosen worker: actual %" PRIu64
                   " vs the owners' predicted %" PRIu64 " (%" PRIu64 " overridden, left out)\n",
                   label, part->decisions, part->owner_tokens, part->chosen_tokens,
                   part->cost_tokens, part->joined_known, part->joined_actual_tokens,
                   part->joined_owner_tokens, part->joined_overridden);
}

static void text_problems(km_text *out, const char *title, uint64_t total,
                          const km_analysis_problem *items, size_t n)
{
    if (!total)
        return;
    km_text_printf(out, "\n%s: %" PRIu64 "%s\n", title, total,
                   (uint64_t)n < total ? " (first ones listed)" : "");
    for (size_t i = 0; i < n; i++)
        km_text_printf(out, "  %s:%" PRIu64 ": %s\n", items[i].file, items[i].line, items[i].what);
}

int km_analysis_render_text(const km_analysis *a, km_text *out)
{
    if (!a || !out)
        return KM_ERR_NULL_POINTER;
    const km_analysis_summary *s = km_analysis_summary_get(a);
    if (!s)
        return KM_ERR_INVALID_ARGUMENT;
    const km_analysis_input *in = &s->input;
    km_text_printf(out,
                   "kvmatch analyze: %" PRIu64 " file(s) read, %" PRIu64 " unreadable; %" PRIu64
                   " lines (%" PRIu64 " blank, %" PRIu64 " invalid); %" PRIu64 " decisions, %" PRIu64
                   " outcomes\n",
                   in->files, in->files_failed, in->lines, in->blank_lines, in->invalid, in->decisions,
                   in->outcomes);
    if (in->interleaved_streams)
        km_text_printf(out, "note: %" PRIu64 " worker state streams came from files overlapping in "
                            "time (one instance's files should follow each other): recovery "
                            "windows may be inexact\n", in->interleaved_streams);
    if (in->hosts > 1)
        km_text_printf(out, "note: records from %" PRIu64 " hosts: their monotonic clocks are not "
                            "comparable; times below mix them\n", in->hosts);
    const km_analysis_join *j = &s->join;
    km_text_printf(out,
                   "\njoin (decision <-> outcome)\n"
                   "  joined by (instance, decision_id) %" PRIu64 ", by (request_id, attempt_id) %" PRIu64 "\n"
                   "  decisions without outcome %" PRIu64 ", outcomes without decision %" PRIu64 "\n"
                   "  duplicate decisions %" PRIu64 ", duplicate outcomes %" PRIu64
                   ", outcome copy differs from its decision %" PRIu64 "\n",
                   j->by_decision_id, j->by_request, j->decisions_without_outcome,
                   j->outcomes_without_decision, j->duplicate_decisions, j->duplicate_outcomes,
                   j->copy_mismatches);

    const km_analysis_reuse *r = &s->reuse;
    km_text_printf(out,
                   "\nreuse: predicted (depth at the decision of the worker that served the "
                   "attempt: the chosen one, or the one a router override sent it to) vs actual "
                   "(engine's cached_tokens)\n"
                   "  outcomes %" PRIu64 ": compared %" PRIu64
                   ", cached_tokens unknown (null, not counted as 0) %" PRIu64 "\n"
                   "  router overrides (dispatched_worker): %" PRIu64 " compared with the "
                   "dispatched worker's depth, %" PRIu64
                   " not compared (no prediction for the dispatched worker)\n"
                   "  predicted %" PRIu64 " tokens (mean %.1f), actual %" PRIu64 " tokens (mean %.1f)\n"
                   "  exact %" PRIu64 " (%.1f%%), over-predicted %" PRIu64 " (by %" PRIu64
                   " tokens), under-predicted %" PRIu64 " (by %" PRIu64 " tokens)\n",
                   r->outcomes, r->known, r->unknown, r->overridden, r->overridden_unpredicted,
                   r->predicted_tokens, r->mean_predicted_tokens, r->actual_tokens,
                   r->mean_actual_tokens, r->exact, percent(r->exact, r->known), r->over_predicted,
                   r->over_predicted_tokens, r->under_predicted, r->under_predicted_tokens);
    if (r->from_outcome_copy)
        km_text_printf(out, "  (%" PRIu64 " of them have no decision: predicted from the outcome's copy)\n",
                       r->from_outcome_copy);
    km_text_printf(out, "  actual - predicted (tokens):");
    for (uint32_t b = 0; b < KM_ANALYSIS_DIFF_BUCKETS; b++)
        if (r->difference_buckets[b])
            km_text_printf(out, " %s: %" PRIu64 ";", km_analysis_diff_bucket_label(b),
                           r->difference_buckets[b]);
    km_text_printf(out, "\n");

    const km_analysis_owner *o = &s->owner;
    km_text_printf(out,
                   "\nprediction owner vs chosen worker\n"
                   "  decisions %" PRIu64 ": no owner %" PRIu64 ", owner chosen %" PRIu64
                   ", owner not chosen %" PRIu64 " (%.1f%% of decisions with an owner)\n"
                   "  cost: owners held %" PRIu64 " tokens, the chosen %" PRIu64 ": %" PRIu64
                   " tokens of predicted reuse given up\n"
                   "  of those, %" PRIu64 " joined with reported cached tokens and served by the "
                   "chosen worker: actual %" PRIu64 " vs the owners' predicted %" PRIu64
                   " (%" PRIu64 " more left out: a router override sent them elsewhere)\n"
                   "  router overrides %" PRIu64 ", of them to the prediction owner %" PRIu64 "\n",
                   o->decisions, o->no_owner, o->owner_is_chosen, o->owner_not_chosen,
                   100.0 * o->owner_not_chosen_rate, o->owner_tokens, o->chosen_tokens, o->cost_tokens,
                   o->joined_known, o->joined_actual_tokens, o->joined_owner_tokens,
                   o->joined_overridden, o->overridden, o->overridden_to_owner);
    text_owner_part(out, "owner ineligible (unhealthy or circuit breaker open: the KV was on a "
                         "worker the policy could not choose)", &o->owner_ineligible);
    text_owner_part(out, "owner eligible (the policy chose another eligible worker)",
                    &o->owner_eligible);

    const km_analysis_health *he = &s->health;
    km_text_printf(out,
                   "\nworker health (candidates[].eligible false: unhealthy or circuit breaker "
                   "open; rows without the field count as eligible)\n"
                   "  decisions with an ineligible candidate %" PRIu64 " (%.1f%%), ineligible "
                   "candidates %" PRIu64 "; owner ineligible %" PRIu64 " (above)\n",
                   he->decisions_with_ineligible, percent(he->decisions_with_ineligible, o->decisions),
                   he->ineligible_candidates, o->owner_ineligible.decisions);

    const km_analysis_staleness *st = &s->staleness;
    km_text_printf(out,
                   "\nindex state behind the predictions\n"
                   "  events-sourced %" PRIu64 ": chosen not LIVE %" PRIu64 ", owner not LIVE %" PRIu64
                   ", stale or degraded (either) %" PRIu64 " (%.1f%%)\n"
                   "  approx-sourced (assumed placement, no events) %" PRIu64 "\n",
                   st->events_decisions, st->chosen_not_live, st->owner_not_live, st->stale_decisions,
                   percent(st->stale_decisions, st->events_decisions), st->approx_decisions);

    const km_analysis_outcomes *oc = &s->outcomes;
    km_text_printf(out,
                   "\noutcomes\n"
                   "  complete %" PRIu64 ", incomplete %" PRIu64 " (%" PRIu64
                   " of them with HTTP 200), error %" PRIu64 ", cancelled %" PRIu64 ", expired %" PRIu64 "\n",
                   oc->complete, oc->incomplete, oc->incomplete_http_200, oc->error, oc->cancelled,
                   oc->expired);
    if (oc->ttft_known)
        km_text_printf(out, "  TTFT from the decision (complete): p50 %.3f ms, p99 %.3f ms (%" PRIu64 ")\n",
                       oc->ttft_p50_ms, oc->ttft_p99_ms, oc->ttft_known);
    if (oc->router_ttft_known)
        km_text_printf(out, "  TTFT on the router's clock, from arrival (complete): p50 %.3f ms, "
                       "p99 %.3f ms (%" PRIu64 ")\n",
                       oc->router_ttft_p50_ms, oc->router_ttft_p99_ms, oc->router_ttft_known);

    km_text_printf(out, "\nrecovery windows (a worker's index state not LIVE): %zu\n", s->n_windows);
    for (size_t i = 0; i < s->n_windows; i++) {
        const km_analysis_window *w = &s->windows[i];
        km_text_printf(out,
                       "  %s%s%s/%s (instance %s): %s from +%.3f s to +%.3f s (%.3f s%s), %" PRIu64
                       " decisions of that instance and pool, hit rate %.1f%%, owner not chosen %" PRIu64 "\n",
                       w->host, *w->host ? " " : "", w->pool, w->worker, w->instance, w->state,
                       (double)(w->start_ns - a->min_time_ns) / 1e9,
                       (double)(w->end_ns - a->min_time_ns) / 1e9,
                       (double)(w->end_ns - w->start_ns) / 1e9, w->open ? ", never closed" : "",
                       w->inside.decisions, 100.0 * w->inside.hit_rate, w->inside.owner_not_chosen);
    }
    text_quality(out, "inside windows", &s->in_windows);
    text_quality(out, "outside windows", &s->outside_windows);

    km_text_printf(out, "\nper policy\n");
    for (size_t i = 0; i < s->n_policies; i++)
        text_quality(out, s->policies[i].policy, &s->policies[i].quality);

    km_text_printf(out, "\nper worker (decisions that chose it, its in_flight at those decisions; "
                        "attempts a router override sent to it; decisions it was an ineligible "
                        "candidate in, and of them those it owned the prediction in)\n");
    for (size_t i = 0; i < s->n_workers; i++) {
        const km_analysis_worker *w = &s->workers[i];
        km_text_printf(out, "  %s%s%s/%s: chosen %" PRIu64 " (%.1f%%), in_flight mean %.2f max %"
                       PRIu64,
                       w->host, *w->host ? " " : "", w->pool, w->worker, w->chosen,
                       percent(w->chosen, s->owner.decisions), w->mean_in_flight, w->max_in_flight);
        if (w->dispatched_by_override)
            km_text_printf(out, ", sent here by router override %" PRIu64,
                           w->dispatched_by_override);
        if (w->ineligible)
            km_text_printf(out, ", ineligible in %" PRIu64 " (owner while ineligible %" PRIu64 ")",
                           w->ineligible, w->owned_ineligible);
        km_text_printf(out, "\n");
    }
    text_problems(out, "invalid lines", in->invalid, s->invalid_lines, s->n_invalid_lines);
    text_problems(out, "decisions without outcome", j->decisions_without_outcome,
                  s->unjoined_decisions, s->n_unjoined_decisions);
    text_problems(out, "outcomes without decision", j->outcomes_without_decision,
                  s->unjoined_outcomes, s->n_unjoined_outcomes);
    return out->status;
}

/* ---- JSON report ------------------------------------------------------------------------------ */

static json_t *json_quality(const km_analysis_quality *q)
{
    return json_pack("{sI sI sI sI sI sI sI sI sI sI sI sf}", "decisions", (json_int_t)q->decisions,
                     "owner_not_chosen", (json_int_t)q->owner_not_chosen, "stale",
                     (json_int_t)q->stale, "known", (json_int_t)q->known, "overridden",
                     (json_int_t)q->overridden, "overridden_unpredicted",
                     (json_int_t)q->overridden_unpredicted, "predicted_tokens",
                     (json_int_t)q->predicted_tokens, "actual_tokens", (json_int_t)q->actual_tokens,
                     "exact", (json_int_t)q->exact, "prompt_tokens", (json_int_t)q->prompt_tokens,
                     "actual_with_prompt", (json_int_t)q->actual_with_prompt, "hit_rate",
                     q->hit_rate);
}

static json_t *json_owner_part(const km_analysis_owner_part *part)
{
    return json_pack("{sI sI sI sI sI sI sI sI}", "decisions", (json_int_t)part->decisions,
                     "owner_tokens", (json_int_t)part->owner_tokens, "chosen_tokens",
                     (json_int_t)part->chosen_tokens, "cost_tokens", (json_int_t)part->cost_tokens,
                     "joined_known", (json_int_t)part->joined_known, "joined_actual_tokens",
                     (json_int_t)part->joined_actual_tokens, "joined_owner_tokens",
                     (json_int_t)part->joined_owner_tokens, "joined_overridden",
                     (json_int_t)part->joined_overridden);
}

static json_t *json_problems(const km_analysis_problem *items, size_t n)
{
    json_t *list = json_array();
    for (size_t i = 0; list && i < n; i++)
        json_array_append_new(list, json_pack("{ss sI ss}", "file", items[i].file, "line",
                                              (json_int_t)items[i].line, "what", items[i].what));
    return list;
}

int km_analysis_render_json(const km_analysis *a, km_text *out)
{
    if (!a || !out)
        return KM_ERR_NULL_POINTER;
    const km_analysis_summary *s = km_analysis_summary_get(a);
    if (!s)
        return KM_ERR_INVALID_ARGUMENT;
    const km_analysis_input *in = &s->input;
    const km_analysis_join *j = &s->join;
    const km_analysis_reuse *r = &s->reuse;
    const km_analysis_owner *o = &s->owner;
    const km_analysis_staleness *st = &s->staleness;
    const km_analysis_outcomes *oc = &s->outcomes;
    json_t *buckets = json_array();
    for (uint32_t b = 0; buckets && b < KM_ANALYSIS_DIFF_BUCKETS; b++)
        json_array_append_new(buckets, json_pack("{ss sI}", "range", km_analysis_diff_bucket_label(b),
                                                 "count", (json_int_t)r->difference_buckets[b]));
    json_t *windows = json_array();
    for (size_t i = 0; windows && i < s->n_windows; i++) {
        const km_analysis_window *w = &s->windows[i];
        json_array_append_new(windows,
                              json_pack("{ss ss ss ss ss sI sI sb so}", "host", w->host, "instance", w->instance, "pool", w->pool,
                                        "worker", w->worker, "state", w->state, "start_monotonic_ns",
                                        (json_int_t)w->start_ns, "end_monotonic_ns",
                                        (json_int_t)w->end_ns, "open", w->open, "inside",
                                        json_quality(&w->inside)));
    }
    json_t *policies = json_array();
    for (size_t i = 0; policies && i < s->n_policies; i++) {
        json_t *q = json_quality(&s->policies[i].quality);
        if (q)
            json_object_set_new(q, "policy", json_string(s->policies[i].policy));
        json_array_append_new(policies, q);
    }
    json_t *workers = json_array();
    for (size_t i = 0; workers && i < s->n_workers; i++) {
        const km_analysis_worker *w = &s->workers[i];
        json_array_append_new(workers,
                              json_pack("{ss ss ss sI sI sf sI sI sI sI}", "host", w->host, "pool",
                                        w->pool, "worker", w->worker, "chosen",
                                        (json_int_t)w->chosen, "in_flight_known",
                                        (json_int_t)w->in_flight_known, "mean_in_flight",
                                        w->mean_in_flight, "max_in_flight",
                                        (json_int_t)w->max_in_flight, "dispatched_by_override",
                                        (json_int_t)w->dispatched_by_override, "ineligible",
                                        (json_int_t)w->ineligible, "owned_ineligible",
                                        (json_int_t)w->owned_ineligible));
    }
    json_t *root = json_pack(
        "{s{sI sI sI sI sI sI sI sI sI}"
        " s{sI sI sI sI sI sI sI}"
        " s{sI sI sI sI sI sI sI sI sI sI sI sI sI sf sf so}"
        " s{sI sI sI sI sf sI sI sI sI sI sI sI sI sI so so}"
        " s{sI sI}"
        " s{sI sI sI sI sI}"
        " s{sI sI sI sI sI sI sI sf sf sI sf sf}"
        " s{so so so}"
        " so so so so so}",
        "input", "interleaved_streams", (json_int_t)in->interleaved_streams, "files", (json_int_t)in->files, "files_failed", (json_int_t)in->files_failed,
        "lines", (json_int_t)in->lines, "blank_lines", (json_int_t)in->blank_lines, "invalid",
        (json_int_t)in->invalid, "decisions", (json_int_t)in->decisions, "outcomes",
        (json_int_t)in->outcomes, "hosts", (json_int_t)in->hosts,
        "join", "by_decision_id", (json_int_t)j->by_decision_id, "by_request",
        (json_int_t)j->by_request, "decisions_without_outcome", (json_int_t)j->decisions_without_outcome,
        "outcomes_without_decision", (json_int_t)j->outcomes_without_decision, "duplicate_decisions",
        (json_int_t)j->duplicate_decisions, "duplicate_outcomes", (json_int_t)j->duplicate_outcomes,
        "copy_mismatches", (json_int_t)j->copy_mismatches,
        "reuse", "outcomes", (json_int_t)r->outcomes, "unknown", (json_int_t)r->unknown,
        "overridden_unpredicted", (json_int_t)r->overridden_unpredicted, "known",
        (json_int_t)r->known, "overridden", (json_int_t)r->overridden, "from_outcome_copy",
        (json_int_t)r->from_outcome_copy,
        "predicted_tokens", (json_int_t)r->predicted_tokens, "actual_tokens",
        (json_int_t)r->actual_tokens, "exact", (json_int_t)r->exact, "over_predicted",
        (json_int_t)r->over_predicted, "under_predicted", (json_int_t)r->under_predicted,
        "over_predicted_tokens", (json_int_t)r->over_predicted_tokens, "under_predicted_tokens",
        (json_int_t)r->under_predicted_tokens, "mean_predicted_tokens", r->mean_predicted_tokens,
        "mean_actual_tokens", r->mean_actual_tokens, "difference_buckets", buckets,
        "owner", "decisions", (json_int_t)o->decisions, "no_owner", (json_int_t)o->no_owner,
        "owner_is_chosen", (json_int_t)o->owner_is_chosen, "owner_not_chosen",
        (json_int_t)o->owner_not_chosen, "owner_not_chosen_rate", o->owner_not_chosen_rate,
        "owner_tokens", (json_int_t)o->owner_tokens, "chosen_tokens", (json_int_t)o->chosen_tokens,
        "cost_tokens", (json_int_t)o->cost_tokens, "joined_known", (json_int_t)o->joined_known,
        "joined_actual_tokens", (json_int_t)o->joined_actual_tokens, "joined_owner_tokens",
        (json_int_t)o->joined_owner_tokens, "joined_overridden", (json_int_t)o->joined_overridden,
        "overridden", (json_int_t)o->overridden, "overridden_to_owner",
        (json_int_t)o->overridden_to_owner, "owner_ineligible",
        json_owner_part(&o->owner_ineligible), "owner_eligible",
        json_owner_part(&o->owner_eligible),
        "health", "decisions_with_ineligible", (json_int_t)s->health.decisions_with_ineligible,
        "ineligible_candidates", (json_int_t)s->health.ineligible_candidates,
        "staleness", "events_decisions", (json_int_t)st->events_decisions, "chosen_not_live",
        (json_int_t)st->chosen_not_live, "owner_not_live", (json_int_t)st->owner_not_live,
        "stale_decisions", (json_int_t)st->stale_decisions, "approx_decisions",
        (json_int_t)st->approx_decisions,
        "outcomes", "complete", (json_int_t)oc->complete, "incomplete", (json_int_t)oc->incomplete,
        "incomplete_http_200", (json_int_t)oc->incomplete_http_200, "error", (json_int_t)oc->error,
        "cancelled", (json_int_t)oc->cancelled, "expired", (json_int_t)oc->expired, "ttft_known",
        (json_int_t)oc->ttft_known, "ttft_p50_ms", oc->ttft_p50_ms, "ttft_p99_ms", oc->ttft_p99_ms,
        "router_ttft_known", (json_int_t)oc->router_ttft_known, "router_ttft_p50_ms",
        oc->router_ttft_p50_ms, "router_ttft_p99_ms", oc->router_ttft_p99_ms,
        "recovery", "windows", windows, "inside", json_quality(&s->in_windows), "outside",
        json_quality(&s->outside_windows),
        "policies", policies, "workers", workers, "invalid_lines",
        json_problems(s->invalid_lines, s->n_invalid_lines), "unjoined_decisions",
        json_problems(s->unjoined_decisions, s->n_unjoined_decisions), "unjoined_outcomes",
        json_problems(s->unjoined_outcomes, s->n_unjoined_outcomes));
    if (!root)
        return KM_ERR_OUT_OF_MEMORY;
    char *textual = json_dumps(root, JSON_INDENT(2) | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(10));
    json_decref(root);
    if (!textual)
        return KM_ERR_OUT_OF_MEMORY;
    km_text_append_cstr(out, textual);
    km_text_append_cstr(out, "\n");
    free(textual);
    return out->status;
}

/* ---- HTML report ------------------------------------------------------------------------------ */

#define SVG_WIDTH 720
#define SVG_HEIGHT 300
#define SVG_LEFT 64
#define SVG_RIGHT 16
#define SVG_TOP 16
#define SVG_BOTTOM 44
#define PLOT_WIDTH (SVG_WIDTH - SVG_LEFT - SVG_RIGHT)
#define PLOT_HEIGHT (SVG_HEIGHT - SVG_TOP - SVG_BOTTOM)

static const char *const palette[ANALYSIS_CHART_MAX_WORKERS] = {
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
    "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};

/* Text with &, <, >, " and ' escaped: safe in element content and in quoted attributes, in HTML
 * and in the SVG's XML alike. */
static void html_escape(km_text *out, const char *s)
{
    const char *run = s;
    for (; *s; s++) {
        const char *entity = NULL;
        switch (*s) {
        case '&': entity = "&amp;"; break;
        case '<': entity = "&lt;"; break;
        case '>': entity = "&gt;"; break;
        case '"': entity = "&quot;"; break;
        case '\'': entity = "&#39;"; break;
        default: break;
        }
        if (entity) {
            km_text_append(out, run, (size_t)(s - run));
            km_text_append_cstr(out, entity);
            run = s + 1;
        }
    }
    km_text_append(out, run, (size_t)(s - run));
}

static double plot_x(double value, double max)
{
    return SVG_LEFT + (max > 0 ? value / max : 0) * PLOT_WIDTH;
}

static double plot_y(double value, double max)
{
    return SVG_TOP + PLOT_HEIGHT - (max > 0 ? value / max : 0) * PLOT_HEIGHT;
}

static void svg_begin(km_text *out, const char *id, const char *title)
{
    km_text_printf(out,
                   "<svg xmlns=\"http://www.w3.org/2000/svg\" id=\"%s\" width=\"%d\" height=\"%d\" "
                   "viewBox=\"0 0 %d %d\" role=\"img\"><title>",
                   id, SVG_WIDTH, SVG_HEIGHT, SVG_WIDTH, SVG_HEIGHT);
    html_escape(out, title);
    km_text_printf(out, "</title><rect x=\"0\" y=\"0\" width=\"%d\" height=\"%d\" fill=\"#fff\"/>\n",
                   SVG_WIDTH, SVG_HEIGHT);
}

/* Axes with 5 ticks each, labels from 0 to the maxima. */
static void svg_axes(km_text *out, double x_max, double y_max, const char *x_label,
                     const char *y_label, int y_percent)
{
    km_text_printf(out,
                   "<g class=\"axes\" stroke=\"#444\" stroke-width=\"1\">"
                   "<line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\"/><line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\"/></g>\n",
                   SVG_LEFT, SVG_TOP + PLOT_HEIGHT, SVG_LEFT + PLOT_WIDTH, SVG_TOP + PLOT_HEIGHT,
                   SVG_LEFT, SVG_TOP, SVG_LEFT, SVG_TOP + PLOT_HEIGHT);
    km_text_printf(out, "<g font-family=\"sans-serif\" font-size=\"11\" fill=\"#222\">");
    for (int i = 0; i <= 4; i++) {
        double xv = x_max * i / 4, yv = y_max * i / 4;
        km_text_printf(out, "<text x=\"%.1f\" y=\"%d\" text-anchor=\"middle\">%.4g</text>",
                       plot_x(xv, x_max), SVG_TOP + PLOT_HEIGHT + 14, xv);
        if (y_percent)
            km_text_printf(out, "<text x=\"%d\" y=\"%.1f\" text-anchor=\"end\">%.0f%%</text>",
                           SVG_LEFT - 4, plot_y(yv, y_max) + 4, 100 * yv);
        else
            km_text_printf(out, "<text x=\"%d\" y=\"%.1f\" text-anchor=\"end\">%.4g</text>",
                           SVG_LEFT - 4, plot_y(yv, y_max) + 4, yv);
    }
    km_text_printf(out, "<text x=\"%d\" y=\"%d\" text-anchor=\"middle\">", SVG_LEFT + PLOT_WIDTH / 2,
                   SVG_HEIGHT - 8);
    html_escape(out, x_label);
    km_text_printf(out, "</text><text x=\"12\" y=\"%d\" transform=\"rotate(-90 12 %d)\" "
                        "text-anchor=\"middle\">", SVG_TOP + PLOT_HEIGHT / 2, SVG_TOP + PLOT_HEIGHT / 2);
    html_escape(out, y_label);
    km_text_printf(out, "</text></g>\n");
}

static void svg_no_data(km_text *out)
{
    km_text_printf(out, "<text x=\"%d\" y=\"%d\" text-anchor=\"middle\" font-family=\"sans-serif\" "
                        "font-size=\"14\" fill=\"#888\">no data</text>\n",
                   SVG_LEFT + PLOT_WIDTH / 2, SVG_TOP + PLOT_HEIGHT / 2);
}

/* Predicted against actual reuse, one dot per compared outcome (evenly thinned past the limit). */
static void chart_reuse(const km_analysis *a, km_text *out)
{
    const km_analysis_reuse *r = &a->summary.reuse;
    svg_begin(out, "chart-reuse", "Reuse per request: predicted (x) vs engine-reported (y), tokens");
    double max = a->reuse_max_tokens > 0 ? a->reuse_max_tokens : 1;
    svg_axes(out, max, max, "predicted reuse (tokens, depth of the worker that served it)",
             "actual reuse (cached_tokens)", 0);
    km_text_printf(out, "<line class=\"diagonal\" x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" "
                        "stroke=\"#aaa\" stroke-dasharray=\"4 3\"/>\n",
                   plot_x(0, max), plot_y(0, max), plot_x(max, max), plot_y(max, max));
    if (!r->known) {
        svg_no_data(out);
        km_text_printf(out, "</svg>\n");
        return;
    }
    uint64_t stride = (r->known + ANALYSIS_CHART_MAX_POINTS - 1) / ANALYSIS_CHART_MAX_POINTS;
    uint64_t seen = 0;
    km_text_printf(out, "<g class=\"points\" fill=\"#1f77b4\" fill-opacity=\"0.5\">");
    for (size_t i = 0; i < a->n_points; i++) {
        const point *p = &a->points[i];
        int64_t predicted;
        if ((p->flags & POINT_MERGED_AWAY) || !(p->flags & POINT_OUTCOME) || p->actual < 0 ||
            !compared_prediction(p, &predicted))
            continue;
        if (seen++ % stride)
            continue;
        km_text_printf(out, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"2.5\"/>",
                       plot_x((double)predicted, max), plot_y((double)p->actual, max));
    }
    km_text_printf(out, "</g>\n</svg>\n");
}

/* Time buckets over the decisions' times. */
typedef struct time_axis {
    int64_t start, span;
    uint32_t buckets;
} time_axis;

static time_axis make_time_axis(const km_analysis *a)
{
    time_axis t = {0, 1, a->cfg.chart_buckets};
    if (a->n_time_order) {
        t.start = a->points[a->time_order[0]].time_ns;
        int64_t end = a->points[a->time_order[a->n_time_order - 1]].time_ns;
        t.span = end > t.start ? end - t.start : 1;
    }
    return t;
}

static uint32_t time_bucket(const time_axis *t, int64_t time_ns)
{
    if (time_ns <= t->start)
        return 0;
    uint64_t b = (uint64_t)((double)(time_ns - t->start) / (double)t->span * t->buckets);
    return b >= t->buckets ? t->buckets - 1 : (uint32_t)b;
}

static double bucket_seconds(const time_axis *t, uint32_t b)
{
    return ((double)b + 0.5) * (double)t->span / t->buckets / 1e9;
}

/* Actual (and predicted) hit rate per time bucket, recovery windows shaded behind. */
static int chart_hit_rate(const km_analysis *a, km_text *out)
{
    time_axis t = make_time_axis(a);
    double x_max = (double)t.span / 1e9;
    uint64_t *prompt = calloc(t.buckets, sizeof *prompt);
    uint64_t *actual = calloc(t.buckets, sizeof *actual);
    uint64_t *predicted = calloc(t.buckets, sizeof *predicted);
    if (!prompt || !actual || !predicted) {
        free(prompt);
        free(actual);
        free(predicted);
        return KM_ERR_OUT_OF_MEMORY;
    }
    double y_max = 1;
    int any = 0;
    for (size_t i = 0; i < a->n_time_order; i++) {
        const point *p = &a->points[a->time_order[i]];
        int64_t prompt_tokens = p->outcome_prompt >= 0 ? p->outcome_prompt : p->decision_prompt;
        int64_t predicted_tokens;
        if (!(p->flags & POINT_OUTCOME) || p->actual < 0 || prompt_tokens <= 0 ||
            !compared_prediction(p, &predicted_tokens))
            continue;
        uint32_t b = time_bucket(&t, p->time_ns);
        prompt[b] += (uint64_t)prompt_tokens;
        actual[b] += (uint64_t)p->actual;
        predicted[b] += (uint64_t)predicted_tokens;
        any = 1;
    }
    for (uint32_t b = 0; b < t.buckets; b++)
        if (prompt[b]) {
            double pa = (double)actual[b] / (double)prompt[b];
            double pp = (double)predicted[b] / (double)prompt[b];
            if (pa > y_max)
                y_max = pa;
            if (pp > y_max)
                y_max = pp;
        }
    svg_begin(out, "chart-hit-rate",
              "Hit rate over time: cached / prompt tokens, actual (solid) and predicted (dashed); "
              "recovery windows shaded");
    size_t shaded = 0;
    km_text_printf(out, "<g class=\"windows\" fill=\"#d62728\" fill-opacity=\"0.15\">");
    for (size_t i = 0; i < a->n_windows && shaded < ANALYSIS_CHART_MAX_WINDOWS; i++, shaded++) {
        const km_analysis_window *w = &a->windows[i];
        double x0 = (double)(w->start_ns - t.start) / 1e9, x1 = (double)(w->end_ns - t.start) / 1e9;
        x0 = x0 < 0 ? 0 : x0 > x_max ? x_max : x0;
        x1 = x1 < 0 ? 0 : x1 > x_max ? x_max : x1;
        double left = plot_x(x0, x_max), width = plot_x(x1, x_max) - left;
        km_text_printf(out, "<rect class=\"window\" x=\"%.1f\" y=\"%d\" width=\"%.1f\" height=\"%d\"><title>",
                       left, SVG_TOP, width < 1 ? 1 : width, PLOT_HEIGHT);
        html_escape(out, w->worker);
        km_text_printf(out, ": ");
        html_escape(out, w->state);
        km_text_printf(out, "</title></rect>");
    }
    km_text_printf(out, "</g>\n");
    svg_axes(out, x_max, y_max, "seconds since the first decision", "hit rate", 1);
    if (!any) {
        svg_no_data(out);
    } else {
        for (int line = 0; line < 2; line++) {
            km_text_printf(out, "<polyline class=\"%s\" fill=\"none\" stroke=\"%s\" stroke-width=\"%s\"%s points=\"",
                           line ? "predicted" : "actual", line ? "#ff7f0e" : "#1f77b4",
                           line ? "1.5" : "2", line ? " stroke-dasharray=\"5 3\"" : "");
            for (uint32_t b = 0; b < t.buckets; b++) {
                if (!prompt[b])
                    continue;
                double v = (double)(line ? predicted[b] : actual[b]) / (double)prompt[b];
                km_text_printf(out, "%.1f,%.1f ", plot_x(bucket_seconds(&t, b), x_max),
                               plot_y(v, y_max));
            }
            km_text_printf(out, "\"/>\n");
        }
    }
    km_text_printf(out, "</svg>\n");
    free(prompt);
    free(actual);
    free(predicted);
    return out->status;
}

/* Mean in_flight per time bucket of each of the most chosen workers, at the decisions that chose
 * it. */
static int chart_load(const km_analysis *a, km_text *out)
{
    const km_analysis_summary *s = &a->summary;
    time_axis t = make_time_axis(a);
    double x_max = (double)t.span / 1e9;
    /* the most chosen workers (ties: first in the report's order), by index in worker_stats */
    size_t top[ANALYSIS_CHART_MAX_WORKERS], n_top = 0;
    for (size_t i = 0; i < s->n_workers; i++) {
        if (!s->workers[i].in_flight_known)
            continue;
        size_t k = n_top;
        if (n_top < ANALYSIS_CHART_MAX_WORKERS)
            n_top++;
        else if (s->workers[i].chosen > s->workers[top[n_top - 1]].chosen)
            k = n_top - 1;
        else
            continue;
        while (k > 0 && s->workers[i].chosen > s->workers[top[k - 1]].chosen) {
            top[k] = top[k - 1];
            k--;
        }
        top[k] = i;
    }
    double *sum = calloc((size_t)t.buckets * (n_top ? n_top : 1), sizeof *sum);
    uint64_t *count = calloc((size_t)t.buckets * (n_top ? n_top : 1), sizeof *count);
    if (!sum || !count) {
        free(sum);
        free(count);
        return KM_ERR_OUT_OF_MEMORY;
    }
    double y_max = 1;
    for (size_t i = 0; i < a->n_time_order; i++) {
        const point *p = &a->points[a->time_order[i]];
        if (p->in_flight < 0)
            continue;
        const worker_info *w = &a->workers[p->worker];
        for (size_t k = 0; k < n_top; k++) {
            const km_analysis_worker *ws = &s->workers[top[k]];
            if (strcmp(ws->worker, str(a, w->name)) || strcmp(ws->pool, str(a, w->pool)) ||
                strcmp(ws->host, str(a, w->host)))
                continue;
            uint32_t b = time_bucket(&t, p->time_ns);
            sum[k * t.buckets + b] += (double)p->in_flight;
            count[k * t.buckets + b]++;
            if ((double)p->in_flight > y_max)
                y_max = (double)p->in_flight;
            break;
        }
    }
    svg_begin(out, "chart-load",
              "Load per worker over time: mean in_flight (as this kvmatch saw it) at the decisions "
              "that chose the worker");
    svg_axes(out, x_max, y_max, "seconds since the first decision", "in_flight", 0);
    if (!n_top)
        svg_no_data(out);
    for (size_t k = 0; k < n_top; k++) {
        km_text_printf(out, "<polyline class=\"worker-load\" fill=\"none\" stroke=\"%s\" "
                            "stroke-width=\"1.5\" points=\"", palette[k]);
        for (uint32_t b = 0; b < t.buckets; b++) {
            uint64_t c = count[k * t.buckets + b];
            if (c)
                km_text_printf(out, "%.1f,%.1f ", plot_x(bucket_seconds(&t, b), x_max),
                               plot_y(sum[k * t.buckets + b] / (double)c, y_max));
        }
        km_text_printf(out, "\"/>\n<g font-family=\"sans-serif\" font-size=\"11\">"
                            "<rect x=\"%d\" y=\"%zu\" width=\"10\" height=\"10\" fill=\"%s\"/>"
                            "<text x=\"%d\" y=\"%zu\">",
                       SVG_LEFT + PLOT_WIDTH - 150, SVG_TOP + 4 + 14 * k, palette[k],
                       SVG_LEFT + PLOT_WIDTH - 136, SVG_TOP + 13 + 14 * k);
        const km_analysis_worker *ws = &s->workers[top[k]];
        if (*ws->host) {
            html_escape(out, ws->host);
            km_text_append_cstr(out, " ");
        }
        html_escape(out, ws->pool);
        km_text_append_cstr(out, "/");
        html_escape(out, ws->worker);
        km_text_printf(out, "</text></g>\n");
    }
    km_text_printf(out, "</svg>\n");
    free(sum);
    free(count);
    return out->status;
}

static void html_quality_row(km_text *out, const char *label, const km_analysis_quality *q)
{
    km_text_append_cstr(out, "<tr><td>");
    html_escape(out, label);
    km_text_printf(out,
                   "</td><td>%" PRIu64 "</td><td>%" PRIu64 "</td><td>%" PRIu64 "</td><td>%" PRIu64
                   "</td><td>%" PRIu64 " / %" PRIu64 "</td><td>%" PRIu64 "</td><td>%" PRIu64
                   "</td><td>%" PRIu64 "</td><td>%.1f%%</td></tr>\n",
                   q->decisions, q->owner_not_chosen, q->stale, q->known, q->overridden,
                   q->overridden_unpredicted, q->predicted_tokens, q->actual_tokens, q->exact,
                   100.0 * q->hit_rate);
}

static const char quality_header[] =
    "<tr><th></th><th>decisions</th><th>owner&#8800;chosen</th><th>stale</th><th>known reuse</th>"
    "<th>router overrides compared / not</th><th>predicted tokens</th><th>actual tokens</th>"
    "<th>exact</th><th>hit rate</th></tr>\n";

int km_analysis_render_html(const km_analysis *a, km_text *out)
{
    if (!a || !out)
        return KM_ERR_NULL_POINTER;
    const km_analysis_summary *s = km_analysis_summary_get(a);
    if (!s)
        return KM_ERR_INVALID_ARGUMENT;
    km_text_append_cstr(out,
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"/>"
        "<title>kvmatch routing analysis</title><style>"
        "body{font-family:sans-serif;margin:24px;color:#222;max-width:1000px}"
        "table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #ccc;padding:3px 8px;"
        "text-align:right}td:first-child{text-align:left}pre{background:#f6f6f6;padding:8px;"
        "overflow-x:auto;font-size:12px}svg{display:block;margin:8px 0;border:1px solid #ddd}"
        "</style></head><body>\n<h1>kvmatch routing analysis</h1>\n");
    const km_analysis_reuse *r = &s->reuse;
    const km_analysis_owner *o = &s->owner;
    km_text_printf(out,
                   "<table id=\"summary\"><tr><th>metric</th><th>value</th></tr>\n"
                   "<tr><td>decisions / outcomes</td><td>%" PRIu64 " / %" PRIu64 "</td></tr>\n"
                   "<tr><td>joined (decision_id / request+attempt)</td><td>%" PRIu64 " / %" PRIu64 "</td></tr>\n"
                   "<tr><td>decisions without outcome / outcomes without decision</td><td>%" PRIu64 " / %" PRIu64 "</td></tr>\n"
                   "<tr><td>invalid lines</td><td>%" PRIu64 "</td></tr>\n"
                   "<tr><td>reuse predicted / actual (tokens, %" PRIu64 " outcomes compared)</td><td>%" PRIu64
                   " / %" PRIu64 "</td></tr>\n"
                   "<tr><td>cached_tokens unknown (null)</td><td>%" PRIu64 "</td></tr>\n"
                   "<tr><td>exact / over / under-predicted</td><td>%" PRIu64 " / %" PRIu64 " / %" PRIu64 "</td></tr>\n"
                   "<tr><td>router overrides: compared with the dispatched worker's depth / not "
                   "compared (no prediction for it)</td><td>%" PRIu64 " / %" PRIu64 "</td></tr>\n"
                   "<tr><td>owner not chosen</td><td>%" PRIu64 " (%.1f%%), %" PRIu64 " tokens given up</td></tr>\n"
                   "<tr><td>of those, owner ineligible (unhealthy or circuit breaker open) / owner "
                   "eligible, another eligible worker chosen</td><td>%" PRIu64 " (%" PRIu64
                   " tokens given up) / %" PRIu64 " (%" PRIu64 " tokens given up)</td></tr>\n"
                   "<tr><td>decisions with an ineligible candidate</td><td>%" PRIu64 "</td></tr>\n"
                   "<tr><td>decisions overridden by the router / sent to the prediction "
                   "owner</td><td>%" PRIu64 " / %" PRIu64 "</td></tr>\n"
                   "<tr><td>stale or degraded (events) / approx-sourced</td><td>%" PRIu64 " / %" PRIu64 "</td></tr>\n"
                   "<tr><td>complete / incomplete / error / cancelled / expired</td><td>%" PRIu64 " / %" PRIu64 " / %" PRIu64 " / %" PRIu64 " / %" PRIu64 "</td></tr>\n"
                   "</table>\n",
                   s->input.decisions, s->input.outcomes, s->join.by_decision_id, s->join.by_request,
                   s->join.decisions_without_outcome, s->join.outcomes_without_decision,
                   s->input.invalid, r->known, r->predicted_tokens, r->actual_tokens, r->unknown,
                   r->exact, r->over_predicted, r->under_predicted, r->overridden,
                   r->overridden_unpredicted, o->owner_not_chosen, 100.0 * o->owner_not_chosen_rate,
                   o->cost_tokens, o->owner_ineligible.decisions, o->owner_ineligible.cost_tokens,
                   o->owner_eligible.decisions, o->owner_eligible.cost_tokens,
                   s->health.decisions_with_ineligible, o->overridden, o->overridden_to_owner,
                   s->staleness.stale_decisions, s->staleness.approx_decisions,
                   s->outcomes.complete, s->outcomes.incomplete, s->outcomes.error,
                   s->outcomes.cancelled, s->outcomes.expired);
    km_text_append_cstr(out, "<h2>Reuse: predicted vs actual</h2>\n");
    chart_reuse(a, out);
    km_text_append_cstr(out, "<h2>Hit rate over time</h2>\n");
    int rc = chart_hit_rate(a, out);
    if (rc != KM_OK)
        return rc;
    km_text_append_cstr(out, "<h2>Load per worker over time</h2>\n");
    rc = chart_load(a, out);
    if (rc != KM_OK)
        return rc;
    km_text_printf(out, "<h2>Routing quality</h2>\n<table id=\"quality\">%s", quality_header);
    html_quality_row(out, "inside recovery windows", &s->in_windows);
    html_quality_row(out, "outside recovery windows", &s->outside_windows);
    for (size_t i = 0; i < s->n_policies; i++) {
        char label[160];
        snprintf(label, sizeof label, "policy %s", s->policies[i].policy);
        html_quality_row(out, label, &s->policies[i].quality);
    }
    km_text_append_cstr(out, "</table>\n<h2>Full report</h2>\n<pre>");
    km_text report;
    km_text_init(&report, 0);
    rc = km_analysis_render_text(a, &report);
    if (rc == KM_OK)
        html_escape(out, km_text_cstr(&report));
    km_text_free(&report);
    if (rc != KM_OK)
        return rc;
    km_text_append_cstr(out, "</pre>\n</body></html>\n");
    return out->status;
}

int km_analysis_write_html(km_analysis *a, const char *path)
{
    if (!a || !path)
        return KM_ERR_NULL_POINTER;
    km_text page;
    km_text_init(&page, 0);
    int rc = km_analysis_render_html(a, &page);
    if (rc != KM_OK) {
        km_analysis_set_error(a, "rendering the HTML report: %s", km_strerror(rc));
        km_text_free(&page);
        return rc;
    }
    size_t n = strlen(path);
    char *temporary = malloc(n + 5);
    if (!temporary) {
        km_text_free(&page);
        return KM_ERR_OUT_OF_MEMORY;
    }
    memcpy(temporary, path, n);
    memcpy(temporary + n, ".tmp", 5);
    FILE *f = fopen(temporary, "wb");
    if (!f) {
        km_analysis_set_error(a, "%s: cannot create: %s", temporary, strerror(errno));
        rc = KM_ERR_IO;
    } else {
        size_t written = fwrite(page.data, 1, page.length, f);
        int close_failed = fclose(f);
        if (written != page.length || close_failed) {
            km_analysis_set_error(a, "%s: write failed: %s", temporary, strerror(errno));
            rc = KM_ERR_IO;
        } else if (rename(temporary, path)) {
            km_analysis_set_error(a, "%s: cannot rename over %s: %s", temporary, path,
                                  strerror(errno));
            rc = KM_ERR_IO;
        }
        if (rc != KM_OK)
            remove(temporary);
    }
    free(temporary);
    km_text_free(&page);
    return rc;
}
