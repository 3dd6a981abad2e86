/* SPDX-License-Identifier: Apache-2.0 */
/* Internal to the analyzer (src/analyze/): the analysis handle, the compact point kept per
 * decision or outcome, the observations of index state, and the helpers that reading and joining
 * (join.c), the metrics (metrics.c) and the renderers (render_*.c) share. Never included outside
 * src/analyze. */
#ifndef KM_ANALYZE_INTERNAL_H
#define KM_ANALYZE_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "analyze/analyze.h"
#include "base/u64_map.h"

/* An id that names nothing: no string, no worker. */
#define NONE UINT32_MAX

/* ---- interned byte strings ------------------------------------------------------------------- */

/* Each distinct byte string gets a dense id; items are NUL-terminated copies. */
typedef struct intern_table {
    char **items;
    size_t *lengths;
    size_t n, capacity;
    km_u64map map; /* hash (re-seeded on a collision) -> id */
} intern_table;

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
    POINT_OWNER_NOT_WEIGHED = 1u << 14, /* the owner's row eligible with a null cost, the chosen
                                         * worker's with a cost */
    POINT_WARM_UP = 1u << 15,        /* a warm-up: its decision names warm_up_for, or its
                                      * outcome's attempt_id ends ":warm_up"; in no figure but
                                      * input.warm_ups */
    POINT_CHOSEN_QUEUED = 1u << 16,  /* the chosen worker's pending_prefill_tokens was above 0 */
};

/* A point the figures count: neither merged into another nor a warm-up. */
#define POINT_COUNTED(p) (!((p)->flags & (POINT_MERGED_AWAY | POINT_WARM_UP)))

typedef struct point {
    int64_t time_ns;          /* decision monotonic_ns (outcome only: decided or own time) */
    int64_t predicted;        /* chosen depth_tokens (outcome only: its predicted copy) */
    int64_t owner_tokens;     /* owner depth_tokens */
    int64_t decision_prompt;  /* prediction.prompt_tokens, -1 = null */
    int64_t outcome_prompt;   /* outcome prompt_tokens, -1 = null */
    int64_t actual;           /* cached_tokens, -1 = null or no outcome */
    int64_t ttft_ns;          /* -1 = null */
    double router_ttft_ms;    /* -1 = null or absent (records before the field existed) */
    double predicted_ttft_ms; /* decision.predicted_ttft_ms; -1 = null, absent or no decision */
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
    uint32_t reason;          /* decision.reason (string id); NONE = null */
    uint32_t worker;          /* chosen worker (worker table id) */
    uint32_t copy_worker;     /* the outcome's worker */
    uint32_t dispatched;      /* the outcome's dispatched_worker (worker table id, the outcome's
                               * host and pool) when POINT_OVERRIDDEN, else NONE */
    uint32_t owner_name;      /* prediction.owner.worker (string id); NONE = no owner */
    uint32_t flags;
    uint8_t outcome_kind;     /* a km_record_outcome (kvmatch/records.h) */
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
    uint64_t named_in;         /* plain worker: the decision (its input.decisions count) whose
                                * candidates last named it, so that a worker named twice is
                                * judged by its first row; 0 = none */
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
    km_analysis_reason *reasons;
    uint32_t *time_order; /* decision points by time, for the charts */
    size_t n_time_order;
    int64_t min_time_ns;
    double reuse_max_tokens; /* chart scale */
};

static inline const char *str(const km_analysis *a, uint32_t id)
{
    return id == NONE ? "" : a->strings.items[id];
}

/* The prediction an outcome's cached_tokens are compared with: the depth at the decision of the
 * worker whose engine reported them: the chosen worker's (the outcome's copy when it has no
 * decision), or for a router override the dispatched worker's candidate row. Returns 0 when there
 * is none (an override without such a row, or without a decision): not compared. */
static inline int compared_prediction(const point *p, int64_t *predicted)
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

/* *sum += tokens (a count of tokens, at most INT64_MAX), saturating at KM_ANALYSIS_TOKENS_MAX. */
static inline void add_tokens(uint64_t *sum, uint64_t tokens)
{
    *sum = tokens > KM_ANALYSIS_TOKENS_MAX - *sum ? KM_ANALYSIS_TOKENS_MAX : *sum + tokens;
}

/* qsort that accepts an empty (possibly NULL) array. */
static inline void sort_items(void *base, size_t n, size_t size,
                              int (*compare)(const void *, const void *))
{
    if (n > 1)
        qsort(base, n, size, compare);
}

/* Interned strings (analyze.c): the id of bytes[0..len), added when new; NONE on out of memory. */
uint32_t km_analysis_intern(intern_table *t, const void *bytes, size_t len);
uint32_t km_analysis_intern_cstr(intern_table *t, const char *s);

/* Strings from the records as the reports show them (analyze.c). A character no report may carry
 * as is (a terminal would act on it; XML cannot hold it) has a visible substitute: a control
 * character (U+0000..U+001F, U+007F) is written \xNN (two lowercase hex digits), the noncharacters
 * U+FFFE and U+FFFF are written \uFFFE and \uFFFF. km_analysis_substitute writes the substitute of
 * the character at s (NUL-terminated) and returns the bytes of s it stands for; 0 when that
 * character is shown as is. */
size_t km_analysis_substitute(const char *s, char substitute[8]);
/* Append s to out with every character km_analysis_substitute replaces by its substitute. */
void km_analysis_append_shown(km_text *out, const char *s);

/* The analysis's last error (analyze.c). */
void km_analysis_set_error(km_analysis *a, const char *format, ...)
    __attribute__((format(printf, 2, 3)));
/* Out of memory: the analysis is broken, every later call fails. Returns KM_ERR_OUT_OF_MEMORY. */
int km_analysis_fail_memory(km_analysis *a, const char *where);
/* Keep a problem when fewer than max_listed are kept (analyze.c). */
int km_analysis_add_problem(km_analysis *a, problem_list *list, uint32_t file, uint64_t line,
                            const char *format, ...) __attribute__((format(printf, 5, 6)));
/* Free every decision's kept candidates (analyze.c). */
void km_analysis_pending_free(km_analysis *a);
/* Pair the points left unjoined by (request_id, attempt_id), in reading order (join.c). */
int km_analysis_join_by_request(km_analysis *a);

#endif
