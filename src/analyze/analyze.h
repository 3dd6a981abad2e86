/* SPDX-License-Identifier: Apache-2.0 */
/* Routing analysis over linked decision and outcome records (docs/ANALYZE.md, docs/RECORDS.md).
 *
 * `kvmatch analyze` and the simulator's reports use this: it streams one or more JSONL record files,
 * joins every decision with the outcome of its attempt, and measures how good the routing was:
 * predicted against engine-reported KV reuse, how often (and at what cost) the worker that owned the
 * best match was not the one chosen, how many predictions rested on a stale or degraded index or on
 * approximate (assumed) placement, how attempts ended, and the recovery windows (periods in which
 * the index state of some worker was not LIVE) with the routing quality inside and outside them.
 *
 * Lifecycle: km_analysis_create -> km_analysis_add_file (any number, in the order
 * PATH.N ... PATH.1 PATH for rotated files; any order joins correctly) -> km_analysis_finish ->
 * km_analysis_summary / km_analysis_render_text / _json / _html / km_analysis_write_html ->
 * km_analysis_destroy. A handle is not thread-safe; separate handles are independent.
 *
 * Streaming and memory: files are read line by line (a line is at most max_line_bytes). What is
 * kept is what the join and the time-based metrics need: one compact point (about 180 bytes, plus
 * about 24 bytes of join map) per decision or unjoined outcome, holding hashes of its keys and the
 * numbers the metrics use, never the line; interned names (hosts, pools, workers, states,
 * policies, instances, files); per file only the changes of each worker's index state (plus its
 * first and last observation); and at most max_listed example lines of each problem kind. A
 * million decisions take about 200 MB. A decision read before its outcome also keeps its
 * candidates' depths (16 bytes per candidate) until that outcome is read or joined, since a router
 * override is compared with the depth of the worker the router used: decisions whose outcome is
 * in a later file, or that have none, hold them until finish.
 *
 * Router overrides: an outcome's dispatched_worker names the worker the router really sent the
 * attempt to when that is not the chosen one (docs/RECORDS.md). Its cached_tokens were then
 * reported by that worker's engine, so the reuse comparisons use that worker's depth at the
 * decision (its candidate row), never the chosen worker's; an override with no such row (or no
 * decision) is counted and not compared.
 *
 * Worker health: a candidate row with eligible false is a worker the policy could not choose
 * (unhealthy by the router's word, or behind an open circuit breaker); the prediction owner may be
 * one. Records written before the field have none: every row counts as eligible. The owner !=
 * chosen decisions are split by the owner's eligibility; the per-worker and per-decision health
 * counts are taken as each decision is read, so a point keeps only one more flag bit (no byte).
 *
 * Bad input is never fatal: a line that is too long, not JSON, not an object, of an unknown type or
 * schema_version, or missing a field the analysis uses (or holding one of the wrong type) is counted
 * as invalid and listed as FILE:LINE: reason (the first max_listed of them). */
#ifndef KM_ANALYZE_H
#define KM_ANALYZE_H

#include <stddef.h>
#include <stdint.h>

#include "kvmatch/error.h"
#include "kvmatch/text.h"

typedef struct km_analysis km_analysis;

typedef struct km_analysis_config {
    size_t max_line_bytes; /* longest record line accepted; 0 = KM_ANALYSIS_DEFAULT_MAX_LINE */
    size_t max_listed;     /* example lines kept per problem kind (invalid, unjoined decisions,
                            * unjoined outcomes); 0 = KM_ANALYSIS_DEFAULT_MAX_LISTED */
    uint32_t chart_buckets; /* time buckets of the charts; 0 = KM_ANALYSIS_DEFAULT_BUCKETS */
} km_analysis_config;

#define KM_ANALYSIS_DEFAULT_MAX_LINE ((size_t)16 << 20)
#define KM_ANALYSIS_DEFAULT_MAX_LISTED 20
#define KM_ANALYSIS_DEFAULT_BUCKETS 100

/* Buckets of (actual - predicted) reuse in tokens, symmetric around 0:
 *  0: d <= -4096, 1: [-4095, -1024], 2: [-1023, -256], 3: [-255, -64], 4: [-63, -16], 5: [-15, -1],
 *  6: d == 0,
 *  7: [1, 15], 8: [16, 63], 9: [64, 255], 10: [256, 1023], 11: [1024, 4095], 12: d >= 4096. */
#define KM_ANALYSIS_DIFF_BUCKETS 13
/* The bucket of a difference (exposed for tests and the report's labels). */
uint32_t km_analysis_diff_bucket(int64_t difference);
/* Label of a bucket, e.g. "[16, 63]"; "?" out of range. */
const char *km_analysis_diff_bucket_label(uint32_t bucket);

/* Every sum of tokens below (the *_tokens fields and actual_with_prompt) saturates at
 * KM_ANALYSIS_TOKENS_MAX, the largest integer the JSON report can write: a sum that would pass
 * it is reported as KM_ANALYSIS_TOKENS_MAX, never wrapped around. Means and rates are computed
 * from the sums as reported. */
#define KM_ANALYSIS_TOKENS_MAX ((uint64_t)INT64_MAX)

/* Reading. */
typedef struct km_analysis_input {
    uint64_t files;          /* files read (opened) */
    uint64_t files_failed;   /* files that could not be opened or read */
    uint64_t lines;          /* lines read, blank ones included */
    uint64_t blank_lines;    /* empty or all-whitespace lines: skipped, not invalid */
    uint64_t invalid;        /* lines that are not a usable record (listed with FILE:LINE) */
    uint64_t decisions;      /* valid decision records */
    uint64_t outcomes;       /* valid outcome records */
    uint64_t warm_ups;       /* of the decisions, warm-ups (decision.warm_up_for set): prefills
                              * no user waited for, left out of every figure with their outcomes */
    uint64_t hosts;          /* distinct `host` values (monotonic clocks); > 1 means the time
                              * charts put different clocks on one axis */
    uint64_t interleaved_streams; /* (instance, pool, worker) index-state streams whose records
                              * came in files overlapping in time: their recovery windows may be
                              * inexact (one instance's files must follow each other, as
                              * rotation writes them) */
} km_analysis_input;

/* The join of decisions and outcomes. A decision and an outcome are joined by (instance,
 * decision_id); what is left is then paired by (request_id, attempt_id), in reading order. */
typedef struct km_analysis_join {
    uint64_t by_decision_id;            /* pairs joined by (instance, decision_id) */
    uint64_t by_request;                /* pairs joined by (request_id, attempt_id) */
    uint64_t decisions_without_outcome; /* kvmatch stopped first, a record dropped, a file missing */
    uint64_t outcomes_without_decision; /* the decision is in a file not given, or was dropped */
    uint64_t duplicate_decisions;       /* a second decision with the same (instance,
                                         * decision_id): counted, not used */
    uint64_t duplicate_outcomes;        /* a second outcome for an already joined or pending key:
                                         * counted, not used */
    uint64_t copy_mismatches;           /* joined pairs whose outcome's copy of the prediction
                                         * (worker, predicted depth) differs from the decision; the
                                         * copy is the chosen worker's even when the router
                                         * overrode it, so an override is never a mismatch */
} km_analysis_join;

/* Predicted against actual reuse, one comparison per outcome (joined or not): actual = the
 * outcome's cached_tokens as the engine reported it; predicted = the depth, at the decision, of
 * the worker whose engine reported it: the decision's chosen.depth_tokens (the outcome's
 * predicted.depth_tokens copy when the outcome has no decision), or for a router override
 * (dispatched_worker set and not the chosen worker) the depth_tokens of the decision's candidate
 * row for the dispatched worker. outcomes = unknown + overridden_unpredicted + known. */
typedef struct km_analysis_reuse {
    uint64_t outcomes;                 /* every valid outcome kept */
    uint64_t unknown;                  /* cached_tokens null: not compared, never taken as 0 */
    uint64_t overridden_unpredicted;   /* cached_tokens reported, but overridden to a worker with no
                                        * prediction (no candidate row for it in the decision, or
                                        * no decision): not compared, in no sum below */
    uint64_t known;                    /* cached_tokens reported and compared: the rest is over
                                        * these */
    uint64_t overridden;               /* known ones overridden: compared with the dispatched
                                        * worker's depth */
    uint64_t from_outcome_copy;        /* known ones whose prediction came from the outcome's copy */
    uint64_t predicted_tokens;         /* sum of predicted tokens */
    uint64_t actual_tokens;            /* sum of cached tokens */
    uint64_t exact;                    /* actual == predicted */
    uint64_t over_predicted;           /* actual < predicted */
    uint64_t under_predicted;          /* actual > predicted */
    uint64_t over_predicted_tokens;    /* sum of predicted - actual over the over-predicted */
    uint64_t under_predicted_tokens;   /* sum of actual - predicted over the under-predicted */
    double mean_predicted_tokens;      /* per known outcome; 0 when none */
    double mean_actual_tokens;
    uint64_t difference_buckets[KM_ANALYSIS_DIFF_BUCKETS];
} km_analysis_reuse;

/* One part of owner_not_chosen, measured as the whole is (km_analysis_owner's fields of the same
 * names). */
typedef struct km_analysis_owner_part {
    uint64_t decisions;
    uint64_t owner_tokens;             /* sum of the owners' depth_tokens */
    uint64_t chosen_tokens;            /* sum of the chosen workers' depth_tokens */
    uint64_t cost_tokens;              /* sum of owner - chosen depth_tokens: reuse given up
                                        * (predicted); owner_tokens - chosen_tokens unless a sum
                                        * saturated */
    uint64_t joined_known;             /* joined, known cached_tokens, not overridden */
    uint64_t joined_actual_tokens;     /* their cached tokens */
    uint64_t joined_owner_tokens;      /* their owners' predicted depth_tokens */
    uint64_t joined_overridden;        /* joined, known cached_tokens, overridden: not above */
} km_analysis_owner_part;

/* The prediction owner against the chosen worker, over every decision. */
typedef struct km_analysis_owner {
    uint64_t decisions;
    uint64_t no_owner;                 /* no worker held even the first block */
    uint64_t owner_is_chosen;
    uint64_t owner_not_chosen;         /* an owner exists and is not the chosen worker */
    double owner_not_chosen_rate;      /* owner_not_chosen / (decisions - no_owner); 0 when none */
    uint64_t owner_tokens;             /* over owner_not_chosen: sum of the owner's depth_tokens */
    uint64_t chosen_tokens;            /* over owner_not_chosen: sum of the chosen's depth_tokens */
    uint64_t cost_tokens;              /* sum of owner - chosen depth_tokens: reuse given up
                                        * (predicted); owner_tokens - chosen_tokens unless a sum
                                        * saturated */
    uint64_t joined_known;             /* of owner_not_chosen: joined with a known cached_tokens and
                                        * not overridden (the chosen worker served it) */
    uint64_t joined_actual_tokens;     /* their cached tokens (what the chosen really reused) */
    uint64_t joined_owner_tokens;      /* their owners' predicted depth_tokens */
    uint64_t joined_overridden;        /* of owner_not_chosen: joined with a known cached_tokens but
                                        * overridden, so left out of the three above (another
                                        * worker's engine reported that reuse) */
    uint64_t overridden;               /* decisions whose joined outcome reports an override */
    uint64_t overridden_to_owner;      /* of those, sent to the prediction owner although kvmatch
                                        * chose another worker */
    /* owner_not_chosen split by the owner's eligibility (its candidates[] row; a worker is
     * ineligible while unhealthy or behind an open circuit breaker): the two parts add up to the
     * fields above. */
    km_analysis_owner_part owner_ineligible; /* the owner's row says eligible false: the KV was on
                                        * a worker the policy could not choose */
    km_analysis_owner_part owner_eligible; /* the owner could be chosen (eligible true, the field
                                        * absent, or no row for it) and the policy chose another
                                        * eligible worker */
} km_analysis_owner;

/* Worker health at the decisions: candidates[].eligible false (unhealthy by the router's word or
 * behind an open circuit breaker). Records written before the field existed have none: every row
 * counts as eligible. A worker named in more than one row counts by its first. */
typedef struct km_analysis_health {
    uint64_t decisions_with_ineligible; /* decisions with at least one ineligible candidate */
    uint64_t ineligible_candidates;    /* (decision, worker) pairs with the worker ineligible: the
                                        * sum of the workers' `ineligible` */
} km_analysis_health;

/* Index state behind each decision. Events-sourced decisions only in the first four counters. */
typedef struct km_analysis_staleness {
    uint64_t events_decisions;         /* prediction.source == "events" */
    uint64_t chosen_not_live;          /* chosen.state != LIVE */
    uint64_t owner_not_live;           /* an owner exists and owner.state != LIVE */
    uint64_t stale_decisions;          /* either of the two (each decision once) */
    uint64_t approx_decisions;         /* prediction.source == "approx": built on assumptions */
} km_analysis_staleness;

/* Whose load view the decisions used (decision.load.scope, docs/CLUSTER.md). */
typedef struct km_analysis_load_view {
    uint64_t this_instance;            /* scope "this_instance", alone or +engine_reported (or no
                                        * scope: older records) */
    uint64_t cluster;                  /* scope "cluster", alone or +engine_reported: other
                                        * instances' work added */
    uint64_t cluster_with_stale;       /* of those, with at least one stale instance */
    uint64_t engine_reported;          /* of all, "+engine_reported": engines' scrapes used */
    double oldest_age_ms_max;          /* the largest load.oldest_age_ms of all; 0 when none */
} km_analysis_load_view;

/* How attempts ended. */
typedef struct km_analysis_outcomes {
    uint64_t complete, incomplete, error, cancelled, expired;
    uint64_t incomplete_http_200;      /* incomplete although HTTP 200: not a success */
    uint64_t ttft_known;               /* complete outcomes with ttft_ns */
    double ttft_p50_ms, ttft_p99_ms;   /* over those (nearest rank); 0 when none */
    uint64_t router_ttft_known;        /* complete outcomes with router_ttft_ms */
    double router_ttft_p50_ms, router_ttft_p99_ms; /* the router's clock, from arrival */
} km_analysis_outcomes;

/* Observed over predicted time to first token for a set of compared outcomes (nearest rank);
 * every figure 0 when n is 0. */
typedef struct km_analysis_ttft_ratio {
    uint64_t n;
    double ratio_p10, ratio_p50, ratio_p90;   /* observed / predicted */
    double observed_p50_ms, predicted_p50_ms; /* each over the same outcomes, apart */
} km_analysis_ttft_ratio;

/* How the engine model's predictions (decision.predicted_ttft_ms) held against the times to first
 * token the outcomes report. Compared: a complete, joined, not overridden outcome (the prediction
 * was for the chosen worker) whose decision predicted a time above 0 and which reports one:
 * router_ttft_ms when present (the router's clock; kvmatch sim's virtual time), else ttft_ns
 * (kvmatch's clock, from the decision), and whose observed / predicted is finite. */
typedef struct km_analysis_ttft_prediction {
    uint64_t decisions_predicted;      /* decisions (warm-ups aside) with predicted_ttft_ms, not
                                        * null nor absent */
    uint64_t router_clock, kvmatch_clock; /* the compared outcomes, by the time they used */
    km_analysis_ttft_ratio all;
    km_analysis_ttft_ratio idle;       /* the chosen worker's pending_prefill_tokens was 0,
                                        * null or absent (or it had no candidate row): the
                                        * request's own prefill alone (and the step running) */
    km_analysis_ttft_ratio queued;     /* prefill was waiting there: the model replayed a queue */
} km_analysis_ttft_prediction;

/* Routing quality over a set of decisions (inside or outside recovery windows, per policy).
 * Predicted is as in km_analysis_reuse: a router override is compared with the dispatched
 * worker's depth, or not at all when the decision has no candidate row for it. */
typedef struct km_analysis_quality {
    uint64_t decisions;
    uint64_t owner_not_chosen;
    uint64_t stale;                    /* events-sourced with chosen or owner not LIVE */
    uint64_t known;                    /* joined, cached_tokens reported and compared */
    uint64_t overridden;               /* of known, overridden (dispatched worker's depth) */
    uint64_t overridden_unpredicted;   /* joined, cached_tokens reported, overridden to a worker
                                        * without a candidate row: not in known nor below */
    uint64_t predicted_tokens;         /* over known */
    uint64_t actual_tokens;            /* over known */
    uint64_t exact;                    /* over known */
    uint64_t prompt_tokens;            /* over known with prompt tokens reported */
    uint64_t actual_with_prompt;       /* cached tokens of those */
    double hit_rate;                   /* actual_with_prompt / prompt_tokens; 0 when none */
} km_analysis_quality;

/* A recovery window: a run of one kvmatch instance's decisions in which a worker's index state
 * (as that instance held it: index state is per instance) was not LIVE. It starts at the first
 * decision showing a non-LIVE state for the worker (as chosen, owner or candidate) and ends at the
 * first later decision showing it LIVE again; when none does, it is open and ends at the last
 * non-LIVE observation. APPROX states (no events at all) never make a window. Times are the
 * decisions' monotonic_ns (the host's clock). A file's records must be in decision order (the
 * writer's order); files may be given in any order. */
typedef struct km_analysis_window {
    const char *host;                  /* the instance's host; "" when null */
    const char *instance;
    const char *pool;
    const char *worker;
    const char *state;                 /* the first non-LIVE state seen in it */
    int64_t start_ns, end_ns;
    int open;                          /* no LIVE observation closed it */
    km_analysis_quality inside;        /* decisions of the same instance and pool within it
                                        * ([start, end) when closed, [start, end] when open) */
} km_analysis_window;

typedef struct km_analysis_policy {
    const char *policy;
    km_analysis_quality quality;
} km_analysis_policy;

/* Decisions by the reason their policy gave (decision.reason), and what the prediction owner
 * lost in them. */
typedef struct km_analysis_reason {
    const char *policy;
    const char *reason;                /* "" when null */
    uint64_t decisions;
    uint64_t owner_not_chosen;         /* some worker held the first block and was not chosen */
    uint64_t owner_not_weighed;        /* of those, the owner's candidate row is eligible with a
                                        * null cost while the chosen worker's has one: the policy
                                        * left the owner out (ttft's load bound) */
    uint64_t given_up_tokens;          /* over owner_not_chosen: the owner's depth_tokens minus
                                        * the chosen worker's (saturating) */
} km_analysis_reason;

typedef struct km_analysis_worker {
    const char *host, *pool, *worker;
    uint64_t chosen;                   /* decisions that chose it */
    uint64_t in_flight_known;          /* of those, with its in_flight among the candidates */
    double mean_in_flight;             /* at the decisions that chose it */
    uint64_t max_in_flight;
    uint64_t dispatched_by_override;   /* outcomes (joined or not) whose dispatched_worker is it:
                                        * attempts the router sent here instead of the chosen one;
                                        * a worker only ever dispatched to has chosen 0 */
    uint64_t ineligible;               /* decisions it was an ineligible candidate in (a worker only
                                        * ever ineligible is listed with chosen 0) */
    uint64_t owned_ineligible;         /* of those, decisions whose prediction owner it was */
} km_analysis_worker;

/* One listed problem: FILE:LINE and a sentence. */
typedef struct km_analysis_problem {
    const char *file;
    uint64_t line;
    const char *what;
} km_analysis_problem;

typedef struct km_analysis_summary {
    km_analysis_input input;
    km_analysis_join join;
    km_analysis_reuse reuse;
    km_analysis_owner owner;
    km_analysis_health health;
    km_analysis_staleness staleness;
    km_analysis_load_view load_view;
    km_analysis_outcomes outcomes;
    km_analysis_ttft_prediction ttft_prediction;
    km_analysis_quality in_windows;    /* decisions inside any window of their instance and pool */
    km_analysis_quality outside_windows;
    const km_analysis_window *windows; /* ordered by instance, pool, worker, start */
    size_t n_windows;
    const km_analysis_policy *policies; /* by name */
    size_t n_policies;
    const km_analysis_reason *reasons; /* by policy, then reason */
    size_t n_reasons;
    const km_analysis_worker *workers; /* by host, pool, worker */
    size_t n_workers;
    const km_analysis_problem *invalid_lines;      /* the first max_listed */
    size_t n_invalid_lines;
    const km_analysis_problem *unjoined_decisions; /* the first max_listed, in reading order */
    size_t n_unjoined_decisions;
    const km_analysis_problem *unjoined_outcomes;
    size_t n_unjoined_outcomes;
} km_analysis_summary;

/* Create an empty analysis. cfg may be NULL (defaults). KM_ERR_NULL_POINTER (out),
 * KM_ERR_OUT_OF_MEMORY. */
int km_analysis_create(const km_analysis_config *cfg, km_analysis **out);
/* NULL is a no-op. */
void km_analysis_destroy(km_analysis *analysis);

/* Read one JSONL file into the analysis. Bad lines are counted, never an error. Returns KM_OK;
 * KM_ERR_IO when the file cannot be opened or a read fails (counted in files_failed; the lines
 * read before a failed read stay); KM_ERR_INVALID_ARGUMENT after finish; KM_ERR_NULL_POINTER;
 * KM_ERR_OUT_OF_MEMORY (the analysis is then unusable: every later call returns it). The detail is
 * in km_analysis_last_error. */
int km_analysis_add_file(km_analysis *analysis, const char *path);

/* Complete the join (the (request_id, attempt_id) fallback), derive the recovery windows and every
 * metric. Call once, after the last file; later add_file calls fail. KM_ERR_OUT_OF_MEMORY. */
int km_analysis_finish(km_analysis *analysis);

/* The results; NULL before finish. Valid until destroy. */
const km_analysis_summary *km_analysis_summary_get(const km_analysis *analysis);

/* Append the report to out: readable text, one JSON object (docs/ANALYZE.md lists its keys), or
 * one self-contained HTML page (no scripts, fonts or other external resources; inline SVG charts:
 * predicted against actual reuse, hit rate over time with recovery windows shaded, load per worker
 * over time; every string escaped). KM_ERR_INVALID_ARGUMENT before finish, else out's status. */
int km_analysis_render_text(const km_analysis *analysis, km_text *out);
int km_analysis_render_json(const km_analysis *analysis, km_text *out);
int km_analysis_render_html(const km_analysis *analysis, km_text *out);
/* Render the HTML page into path (written to path.tmp, then renamed). KM_ERR_IO with detail. */
int km_analysis_write_html(km_analysis *analysis, const char *path);

/* The sentence describing the last failure; "" when none. */
const char *km_analysis_last_error(const km_analysis *analysis);

#endif
